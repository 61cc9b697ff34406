// cuda_bf16.h (CUDA emulator): the bfloat16 storage type and the conversions strata's kernels
// use. They are strata's own (core/dtype.h), which round as the GPU's cvt.rn.bf16.f32 does (to
// nearest, ties to even, subnormals kept, NaN stays NaN) and are what the conversion kernels
// are checked against on a GPU.
#pragma once

#include "core/dtype.h"

#include <cstdint>

struct __nv_bfloat16 {
  uint16_t x;
};

inline float __bfloat162float(__nv_bfloat16 h) {
  return strata::bf16_to_f32(h.x);
}

inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  return __nv_bfloat16{strata::f32_to_bf16(f)};
}
