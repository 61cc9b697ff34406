// cuda_fp16.h (CUDA emulator): the half storage type and the conversions strata's kernels use,
// with the GPU's rounding (cvt.rn.f16.f32: to nearest, ties to even, subnormals kept).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

struct __half {
  uint16_t x;
};

inline float __half2float(__half h) {
  const uint32_t sign = uint32_t{h.x & 0x8000u} << 16;
  const uint32_t exp = (h.x >> 10) & 0x1fu, mant = h.x & 0x3ffu;
  float magnitude;
  if (exp == 0x1f) {
    magnitude = mant == 0 ? INFINITY : NAN;
  } else if (exp == 0) {
    magnitude = std::ldexp(static_cast<float>(mant), -24);  // subnormal: exact
  } else {
    magnitude = std::ldexp(static_cast<float>(mant | 0x400u), static_cast<int>(exp) - 25);
  }
  uint32_t bits;
  std::memcpy(&bits, &magnitude, sizeof bits);
  bits |= sign;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline __half __float2half_rn(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  const auto sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return __half{static_cast<uint16_t>(sign | 0x7e00u)};   // NaN
  if (abs >= 0x477ff000u) return __half{static_cast<uint16_t>(sign | 0x7c00u)};  // rounds to Inf
  const int exp = static_cast<int>(abs >> 23) - 127;
  uint32_t mant = (abs & 0x7fffffu) | 0x800000u;  // 24 significant bits
  // The number of low bits to drop: 13 for a normal half, more below 2^-14 (subnormal).
  const int drop = exp >= -14 ? 13 : std::min(24 + 1, 13 + (-14 - exp));
  if (abs < 0x33000000u) return __half{sign};  // below half the smallest subnormal: zero
  const uint32_t half_ulp = uint32_t{1} << (drop - 1), mask = (uint32_t{1} << drop) - 1;
  const uint32_t rest = mant & mask;
  mant >>= drop;
  if (rest > half_ulp || (rest == half_ulp && (mant & 1u))) ++mant;
  // mant now holds the half's significand with its implicit bit (normal) or without (subnormal);
  // a carry out of the significand moves into the exponent field, which is what we want.
  const uint32_t biased = exp >= -14 ? static_cast<uint32_t>(exp + 14) : 0;
  return __half{static_cast<uint16_t>(sign | ((biased << 10) + mant))};
}
