// cuda_fp16.h (CUDA emulator): the half storage type and the conversions strata's kernels use,
// strata's own (core/dtype.h), which round as cvt.rn.f16.f32 does (to nearest, ties to even,
// subnormals kept, overflow to infinity).
#pragma once

#include "core/dtype.h"

#include <cstdint>

struct __half {
  uint16_t x;
};

inline float __half2float(__half h) {
  return strata::f16_to_f32(h.x);
}

inline __half __float2half_rn(float f) {
  return __half{strata::f32_to_f16(f)};
}
