// dtype.h: element types and exact conversions between f32, bf16 and f16.
//
// Float to 16-bit conversions round to nearest, ties to even, overflow to infinity, and
// keep NaN a (quiet) NaN with its sign. The 16-bit to float conversions are exact. These
// are the host reference that every CUDA conversion kernel is checked against, bit for bit.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace strata {

enum class DType : uint8_t { f32, bf16, f16 };

constexpr size_t dtype_size(DType t) {
  return t == DType::f32 ? 4 : 2;
}
constexpr std::string_view dtype_name(DType t) {
  return t == DType::f32 ? "f32" : t == DType::bf16 ? "bf16" : "f16";
}
// Accepts f32/float32/fp32, bf16/bfloat16, f16/fp16/float16 (as in configs and safetensors,
// case-insensitive); throws Error naming the text otherwise.
DType parse_dtype(std::string_view text);

constexpr float bf16_to_f32(uint16_t h) {
  return std::bit_cast<float>(uint32_t{h} << 16);
}

constexpr uint16_t f32_to_bf16(float f) {
  uint32_t x = std::bit_cast<uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x0040u);
  x += 0x7fffu + ((x >> 16) & 1u);  // ties to even; carries into the exponent (and to inf)
  return static_cast<uint16_t>(x >> 16);
}

constexpr float f16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (man << 13));
  if (exp == 0) {
    if (man == 0) return std::bit_cast<float>(sign);
    exp = 113;  // subnormal: normalise, 2^-14 has biased float exponent 113
    while ((man & 0x400u) == 0) {
      man <<= 1;
      --exp;
    }
    return std::bit_cast<float>(sign | (exp << 23) | ((man & 0x3ffu) << 13));
  }
  return std::bit_cast<float>(sign | ((exp + 112) << 23) | (man << 13));
}

constexpr uint16_t f32_to_f16(float f) {
  uint32_t x = std::bit_cast<uint32_t>(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x > 0x7f800000u) return sign | 0x7e00u | ((x >> 13) & 0x3ffu);  // NaN, made quiet
  if (x >= 0x477ff000u) return sign | 0x7c00u;                        // >= 65520 rounds to infinity
  if (x >= 0x38800000u) {                                             // normal half
    uint32_t h = (x >> 13) - (112u << 10);
    const uint32_t rem = x & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
    return sign | static_cast<uint16_t>(h);
  }
  if (x < 0x33000000u) return sign;  // below half the smallest subnormal (2^-25, a tie) -> 0
  const uint32_t exp = x >> 23;
  const uint32_t man = (x & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126 - exp;  // 14..24
  uint32_t h = man >> shift;
  const uint32_t rem = man & ((1u << shift) - 1);
  const uint32_t half = 1u << (shift - 1);
  if (rem > half || (rem == half && (h & 1u))) ++h;
  return sign | static_cast<uint16_t>(h);
}

// Element i of a buffer of type t, widened to f32 (exact).
inline float load_f32(const void* src, DType t, size_t i) {
  switch (t) {
    case DType::f32:
      return static_cast<const float*>(src)[i];
    case DType::bf16:
      return bf16_to_f32(static_cast<const uint16_t*>(src)[i]);
    case DType::f16:
      return f16_to_f32(static_cast<const uint16_t*>(src)[i]);
  }
  return 0.0f;
}

// Stores v as element i of a buffer of type t, rounding to nearest even.
inline void store_f32(void* dst, DType t, size_t i, float v) {
  switch (t) {
    case DType::f32:
      static_cast<float*>(dst)[i] = v;
      break;
    case DType::bf16:
      static_cast<uint16_t*>(dst)[i] = f32_to_bf16(v);
      break;
    case DType::f16:
      static_cast<uint16_t*>(dst)[i] = f32_to_f16(v);
      break;
  }
}

// Converts n elements between any two dtypes (same dtype: a copy). Host reference.
void convert(void* dst, DType dst_type, const void* src, DType src_type, size_t n);

}  // namespace strata
