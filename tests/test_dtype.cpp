// Exhaustive tests of the f32 <-> bf16/f16 conversions in core/dtype.h.
//
// 16 -> 32 bit: every one of the 65,536 patterns, against an independent decoding from the
// bit fields with ldexp. 32 -> 16 bit: for every 16-bit pattern, the value itself, both
// neighbours' midpoints and points just inside/outside them, so every rounding decision
// (ties to even included) and every overflow and underflow boundary is exercised.
#include "core/dtype.h"
#include "core/error.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

namespace strata {
namespace {

// Independent decoders: value = (-1)^s * mantissa * 2^exp, computed in double.
double decode(uint16_t h, int exp_bits, int man_bits) {
  const int bias = (1 << (exp_bits - 1)) - 1;
  const int s = h >> 15, e = (h >> man_bits) & ((1 << exp_bits) - 1), m = h & ((1 << man_bits) - 1);
  double v;
  if (e == (1 << exp_bits) - 1)
    v = m ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  else if (e == 0)
    v = std::ldexp(static_cast<double>(m), 1 - bias - man_bits);
  else
    v = std::ldexp(static_cast<double>(m | (1 << man_bits)), e - bias - man_bits);
  return s ? -v : v;
}

// Correctly rounded (ties to even) reference in double: the nearest 16-bit value to x.
uint16_t reference_round(double x, int exp_bits, int man_bits) {
  if (std::isnan(x)) return 0x7fff;  // only NaN-ness is compared
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const double a = std::fabs(x);
  const uint16_t inf = static_cast<uint16_t>(((1 << exp_bits) - 1) << man_bits);
  // Binary search over the ordered positive patterns 0..inf.
  uint16_t lo = 0, hi = inf;
  while (hi - lo > 1) {
    const uint16_t mid = static_cast<uint16_t>((lo + hi) / 2);
    (decode(mid, exp_bits, man_bits) <= a ? lo : hi) = mid;
  }
  const double vlo = decode(lo, exp_bits, man_bits);
  double vhi = decode(hi, exp_bits, man_bits);
  if (hi == inf)
    vhi = 2 * decode(inf - 1, exp_bits, man_bits) - decode(inf - 2, exp_bits, man_bits);
  if (a == vlo) return sign | lo;
  const double dlo = a - vlo, dhi = vhi - a;
  uint16_t r = dlo < dhi ? lo : dhi < dlo ? hi : ((lo & 1) ? hi : lo);
  return sign | r;
}

float f32_of(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
uint32_t bits_of(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

struct Format {
  const char* name;
  int exp_bits, man_bits;
  float (*to_f32)(uint16_t);
  uint16_t (*from_f32)(float);
};
const Format kBf16{"bf16", 8, 7, [](uint16_t h) { return bf16_to_f32(h); },
                   [](float f) { return f32_to_bf16(f); }};
const Format kF16{"f16", 5, 10, [](uint16_t h) { return f16_to_f32(h); },
                  [](float f) { return f32_to_f16(f); }};

void check_widening(const Format& fmt) {
  int mismatches = 0;
  for (uint32_t p = 0; p < 65536; ++p) {
    const auto h = static_cast<uint16_t>(p);
    const double want = decode(h, fmt.exp_bits, fmt.man_bits);
    const float got = fmt.to_f32(h);
    const bool ok = std::isnan(want) ? std::isnan(got)
                                     : (static_cast<double>(got) == want &&
                                        std::signbit(got) == std::signbit(want));
    if (!ok && ++mismatches <= 5)
      ADD_FAILURE() << fmt.name << " pattern 0x" << std::hex << p << " -> " << got << " want "
                    << want;
  }
  EXPECT_EQ(mismatches, 0);
}

void check_narrowing(const Format& fmt) {
  int mismatches = 0, checked = 0;
  auto check = [&](float x) {
    ++checked;
    const uint16_t got = fmt.from_f32(x);
    const uint16_t want = reference_round(static_cast<double>(x), fmt.exp_bits, fmt.man_bits);
    const bool got_nan = std::isnan(fmt.to_f32(got));
    const bool ok = std::isnan(x) ? got_nan && ((got >> 15) == (bits_of(x) >> 31)) : got == want;
    if (!ok && ++mismatches <= 5)
      ADD_FAILURE() << fmt.name << " from f32 0x" << std::hex << bits_of(x) << " (" << x
                    << ") gave 0x" << got << " want 0x" << want;
  };
  for (uint32_t p = 0; p < 65536; ++p) {
    const auto h = static_cast<uint16_t>(p);
    const float v = fmt.to_f32(h);
    check(v);
    if (std::isnan(v) || std::isinf(v)) continue;
    // The midpoint to the next pattern up in magnitude and its float neighbours.
    const uint16_t up = static_cast<uint16_t>(h + 1);
    const float next = (up & 0x7fff) == 0 ? v : fmt.to_f32(up);
    if (std::isnan(next) || (up & 0x7fff) == 0) continue;
    const double mid_d =
        (static_cast<double>(v) +
         static_cast<double>(std::isinf(next) ? 2.0 * v - fmt.to_f32(static_cast<uint16_t>(h - 1))
                                              : next)) /
        2.0;
    const float mid = static_cast<float>(mid_d);
    if (static_cast<double>(mid) != mid_d) continue;  // midpoint not representable in f32
    const uint32_t mb = bits_of(mid);
    for (uint32_t d : {0u, 1u, 2u}) {
      check(f32_of(mb + d));
      check(f32_of(mb - d));
    }
  }
  std::mt19937 rng(1234);
  for (int i = 0; i < 1'000'000; ++i) check(f32_of(static_cast<uint32_t>(rng())));
  for (float x : {0.0f, -0.0f, std::numeric_limits<float>::infinity(),
                  -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN(),
                  -std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::max(),
                  std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::min(),
                  f32_of(0x7f800001u) /* signalling NaN */})
    check(x);
  EXPECT_EQ(mismatches, 0) << "of " << checked << " values";
}

TEST(DType, Bf16ToF32EveryPattern) {
  check_widening(kBf16);
}
TEST(DType, F16ToF32EveryPattern) {
  check_widening(kF16);
}
TEST(DType, F32ToBf16RoundsToNearestEven) {
  check_narrowing(kBf16);
}
TEST(DType, F32ToF16RoundsToNearestEven) {
  check_narrowing(kF16);
}

TEST(DType, RoundTripEveryPattern) {
  for (uint32_t p = 0; p < 65536; ++p) {
    const auto h = static_cast<uint16_t>(p);
    for (const Format* fmt : {&kBf16, &kF16}) {
      const float v = fmt->to_f32(h);
      if (std::isnan(v))
        EXPECT_TRUE(std::isnan(fmt->to_f32(fmt->from_f32(v))))
            << fmt->name << " 0x" << std::hex << p;
      else
        ASSERT_EQ(fmt->from_f32(v), h) << fmt->name << " 0x" << std::hex << p;
    }
  }
}

TEST(DType, KnownValues) {
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7bff);
  EXPECT_EQ(f32_to_f16(65519.99f), 0x7bff);
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7c00);  // tie at the top rounds to even = infinity
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -25)), 0x0000);  // tie rounds to even zero
  EXPECT_EQ(f32_to_f16(std::ldexp(1.5f, -25)), 0x0001);
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(f32_to_bf16(f32_of(0x3f808000u)), 0x3f80);  // tie, even stays
  EXPECT_EQ(f32_to_bf16(f32_of(0x3f818000u)), 0x3f82);  // tie, odd rounds up
  EXPECT_EQ(f32_to_bf16(f32_of(0x7f7fffffu)), 0x7f80);  // FLT_MAX overflows to inf
}

TEST(DType, ConvertBuffersAndParse) {
  std::vector<float> src{1.0f, -2.5f, 3.14159f, 65536.0f};
  std::vector<uint16_t> half(4), bf(4);
  std::vector<float> back(4);
  convert(half.data(), DType::f16, src.data(), DType::f32, 4);
  convert(bf.data(), DType::bf16, half.data(), DType::f16, 4);
  convert(back.data(), DType::f32, bf.data(), DType::bf16, 4);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(half[i], f32_to_f16(src[i]));
    EXPECT_EQ(bf[i], f32_to_bf16(f16_to_f32(half[i])));
    EXPECT_EQ(bits_of(back[i]), bits_of(bf16_to_f32(bf[i])));
  }
  EXPECT_EQ(parse_dtype("BF16"), DType::bf16);
  EXPECT_EQ(parse_dtype("float16"), DType::f16);
  EXPECT_EQ(parse_dtype("fp32"), DType::f32);
  try {
    parse_dtype("int8");
    FAIL() << "int8 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'int8'"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace strata
