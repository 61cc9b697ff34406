// cuda_bf16.h (CUDA emulator): the bfloat16 storage type and the conversions strata's kernels
// use, computed on the CPU with the rounding the GPU's cvt.rn.bf16.f32 performs (to nearest,
// ties to even, subnormals kept, NaN stays NaN).
#pragma once

#include <cstdint>
#include <cstring>

struct __nv_bfloat16 {
  uint16_t x;
};

inline float __bfloat162float(__nv_bfloat16 h) {
  const uint32_t bits = uint32_t{h.x} << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u)  // NaN: keep it a (quiet) NaN
    return __nv_bfloat16{static_cast<uint16_t>((bits >> 16) | 0x0040u)};
  const uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return __nv_bfloat16{static_cast<uint16_t>((bits + rounding) >> 16)};
}
