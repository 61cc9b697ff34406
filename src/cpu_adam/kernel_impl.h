// kernel_impl.h: the SIMD kernels, one template for every instruction set (x86-64's, AArch64's
// NEON).
//
// Included only by kernels_<arch>.cpp, each compiled with that arch's -m flags; everything here
// has internal linkage so no code built for AVX-512 can leak into another path. Tails shorter
// than one register are copied into a zero-padded register-sized buffer and run through the very
// same vector code, so a tail computes exactly what a full register would. Do not call the inline
// conversions of core/dtype.h here (they would be compiled for this arch and could be picked by
// the linker for other callers); the one scalar fallback calls the out-of-line strata::convert.
#pragma once

#include "cpu_adam/formula.h"
#include "cpu_adam/kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif
#include <xsimd/xsimd.hpp>

#include <cstdint>
#include <cstring>

namespace strata::cpu_adam {
namespace {

// dtype_size, kept local: an inline function from another header compiled here could be the
// copy the linker keeps for everyone.
constexpr size_t element_bytes(DType t) {
  return t == DType::f32 ? 4 : 2;
}

template <class A>
using FloatBatch = xsimd::batch<float, A>;
template <class A>
using DoubleBatch = xsimd::batch<double, A>;

// Io<A>: what xsimd 8.1 lacks per arch: 16-bit widening/narrowing, f16 conversion and
// float -> double halves. Specialised by each kernels_<arch>.cpp before it instantiates.
template <class A>
struct Io;

// float -> bf16 bits, round to nearest even, NaN kept quiet with its sign: core/dtype.h's
// f32_to_bf16 on a register (tests compare the two on all 2^32 inputs' classes).
template <class A>
inline xsimd::batch<uint32_t, A> bf16_bits(FloatBatch<A> f) {
  using U = xsimd::batch<uint32_t, A>;
  using I = xsimd::batch<int32_t, A>;
  const U x = xsimd::bitwise_cast<U>(f);
  const auto is_nan = xsimd::bitwise_cast<I>(x & U(0x7fffffffu)) > I(0x7f800000);
  const U rounded = (x + U(0x7fffu) + ((x >> 16) & U(1u))) >> 16;
  const U quiet_nan = (x >> 16) | U(0x40u);
  return xsimd::bitwise_cast<U>(
      xsimd::select(is_nan, xsimd::bitwise_cast<I>(quiet_nan), xsimd::bitwise_cast<I>(rounded)));
}

template <class A>
inline FloatBatch<A> load_at(const void* src, DType t, size_t i) {
  switch (t) {
    case DType::f32:
      return FloatBatch<A>::load_unaligned(static_cast<const float*>(src) + i);
    case DType::bf16: {
      const auto wide = Io<A>::widen_u16(static_cast<const uint16_t*>(src) + i);
      return xsimd::bitwise_cast<FloatBatch<A>>(wide << 16);
    }
    case DType::f16: {
      // The hardware makes a signalling NaN quiet; core/dtype.h keeps every bit: patch NaNs.
      const auto* p = static_cast<const uint16_t*>(src) + i;
      using U = xsimd::batch<uint32_t, A>;
      using I = xsimd::batch<int32_t, A>;
      const U h = Io<A>::widen_u16(p);
      const auto is_nan = xsimd::bitwise_cast<I>(h & U(0x7fffu)) > I(0x7c00);
      const U nan = ((h & U(0x8000u)) << 16) | U(0x7f800000u) | ((h & U(0x3ffu)) << 13);
      const FloatBatch<A> converted = Io<A>::load_f16(p);
      return xsimd::bitwise_cast<FloatBatch<A>>(
          xsimd::select(is_nan, xsimd::bitwise_cast<I>(nan), xsimd::bitwise_cast<I>(converted)));
    }
  }
  return FloatBatch<A>(0.0f);
}

template <class A>
inline void store_at(FloatBatch<A> x, void* dst, DType t, size_t i) {
  switch (t) {
    case DType::f32:
      x.store_unaligned(static_cast<float*>(dst) + i);
      break;
    case DType::bf16:
      Io<A>::narrow_u32(bf16_bits<A>(x), static_cast<uint16_t*>(dst) + i);
      break;
    case DType::f16:
      Io<A>::store_f16(x, static_cast<uint16_t*>(dst) + i);
      break;
  }
}

template <class A>
struct Sign<FloatBatch<A>> {
  using B = FloatBatch<A>;
  static B of(B x) {
    return xsimd::select(x > B(0.0f), B(1.0f), xsimd::select(x < B(0.0f), B(-1.0f), B(0.0f)));
  }
};

// One register of the fused update of optimizer T at element i: the moments T keeps are read
// and written, the others never touched.
template <OptimizerType T, class A>
inline void update_at(const UpdateSpan& s, const StepConstants& k, size_t i) {
  using B = FloatBatch<A>;
  constexpr bool has_m = optimizer_keeps_m(T), has_v = optimizer_keeps_v(T);
  B p = B::load_unaligned(s.master + i);
  B m = has_m ? B::load_unaligned(s.m + i) : B(0.0f);
  B v = has_v ? B::load_unaligned(s.v + i) : B(0.0f);
  optimizer_element(T, p, load_at<A>(s.grad, s.grad_dtype, i), m, v, k);
  p.store_unaligned(s.master + i);
  if constexpr (has_m) m.store_unaligned(s.m + i);
  if constexpr (has_v) v.store_unaligned(s.v + i);
  if (s.out != nullptr) store_at<A>(p, s.out, s.out_dtype, i);
}

template <OptimizerType T, class A>
void update_typed(const UpdateSpan& s, const StepConstants& k) {
  constexpr size_t W = FloatBatch<A>::size;
  constexpr bool has_m = optimizer_keeps_m(T), has_v = optimizer_keeps_v(T);
  size_t i = 0;
  for (; i + W <= s.n; i += W) update_at<T, A>(s, k, i);
  const size_t rest = s.n - i;
  if (rest == 0) return;
  // The tail: the same register code on a zero-padded copy.
  float p[W] = {}, m[W] = {}, v[W] = {};
  alignas(64) unsigned char g[W * 4] = {}, out[W * 4] = {};
  const size_t gsize = element_bytes(s.grad_dtype), osize = element_bytes(s.out_dtype);
  std::memcpy(p, s.master + i, rest * 4);
  if (has_m) std::memcpy(m, s.m + i, rest * 4);
  if (has_v) std::memcpy(v, s.v + i, rest * 4);
  std::memcpy(g, static_cast<const unsigned char*>(s.grad) + i * gsize, rest * gsize);
  const UpdateSpan tail{p, m, v, g, s.grad_dtype, s.out ? out : nullptr, s.out_dtype, W};
  update_at<T, A>(tail, k, 0);
  std::memcpy(s.master + i, p, rest * 4);
  if (has_m) std::memcpy(s.m + i, m, rest * 4);
  if (has_v) std::memcpy(s.v + i, v, rest * 4);
  if (s.out) std::memcpy(static_cast<unsigned char*>(s.out) + i * osize, out, rest * osize);
}

template <class A>
void update(const UpdateSpan& s, const StepConstants& k) {
  switch (k.type) {
    case OptimizerType::adam:
      return update_typed<OptimizerType::adam, A>(s, k);
    case OptimizerType::lion:
      return update_typed<OptimizerType::lion, A>(s, k);
    case OptimizerType::adagrad:
      return update_typed<OptimizerType::adagrad, A>(s, k);
  }
}

template <class A>
void traffic(const UpdateSpan& s) {
  using B = FloatBatch<A>;
  constexpr size_t W = B::size;
  size_t i = 0;
  for (; i + W <= s.n; i += W) {
    const B g = load_at<A>(s.grad, s.grad_dtype, i);
    const B p = xsimd::max(B::load_unaligned(s.master + i), g);
    if (s.m != nullptr) xsimd::max(B::load_unaligned(s.m + i), g).store_unaligned(s.m + i);
    if (s.v != nullptr) xsimd::max(B::load_unaligned(s.v + i), g).store_unaligned(s.v + i);
    p.store_unaligned(s.master + i);
    if (s.out != nullptr) store_at<A>(p, s.out, s.out_dtype, i);
  }
  // The tail (< one register) is left alone: it is not worth its code in a bandwidth probe.
}

template <class A>
double sum_squares(const void* grad, DType t, size_t n) {
  using D = DoubleBatch<A>;
  constexpr size_t W = FloatBatch<A>::size, WD = D::size;
  static_assert(kStatsLanes % W == 0 && W == 2 * WD);
  D acc[kStatsLanes / WD];
  for (D& a : acc) a = D(0.0);
  // Lanes k*W .. k*W+W-1 of a group of kStatsLanes elements live in acc[2k] and acc[2k+1].
  const auto group = [&](const void* src, size_t at) {
    for (size_t k = 0; k < kStatsLanes / W; ++k) {
      D lo, hi;
      Io<A>::to_double(load_at<A>(src, t, at + k * W), lo, hi);
      acc[2 * k] = acc[2 * k] + lo * lo;
      acc[2 * k + 1] = acc[2 * k + 1] + hi * hi;
    }
  };
  size_t i = 0;
  for (; i + kStatsLanes <= n; i += kStatsLanes) group(grad, i);
  if (i < n) {  // zero padding adds +0.0 to a lane: no change
    alignas(64) unsigned char pad[kStatsLanes * 4] = {};
    const size_t size = element_bytes(t);
    std::memcpy(pad, static_cast<const unsigned char*>(grad) + i * size, (n - i) * size);
    group(pad, 0);
  }
  alignas(64) double lanes[kStatsLanes];
  for (size_t k = 0; k < kStatsLanes / WD; ++k) acc[k].store_aligned(lanes + k * WD);
  double sum = 0.0;
  for (double l : lanes) sum += l;
  return sum;
}

template <class A>
void load(const void* src, DType t, size_t n, float* dst) {
  constexpr size_t W = FloatBatch<A>::size;
  size_t i = 0;
  for (; i + W <= n; i += W) load_at<A>(src, t, i).store_unaligned(dst + i);
  if (i == n) return;
  alignas(64) unsigned char pad[W * 4] = {};
  const size_t size = element_bytes(t);
  std::memcpy(pad, static_cast<const unsigned char*>(src) + i * size, (n - i) * size);
  alignas(64) float out[W];
  load_at<A>(pad, t, 0).store_aligned(out);
  std::memcpy(dst + i, out, (n - i) * 4);
}

template <class A>
void store(const float* src, size_t n, void* dst, DType t) {
  constexpr size_t W = FloatBatch<A>::size;
  size_t i = 0;
  for (; i + W <= n; i += W) store_at<A>(FloatBatch<A>::load_unaligned(src + i), dst, t, i);
  if (i == n) return;
  alignas(64) float in[W] = {};
  std::memcpy(in, src + i, (n - i) * 4);
  alignas(64) unsigned char out[W * 4];
  store_at<A>(FloatBatch<A>::load_aligned(in), out, t, 0);
  const size_t size = element_bytes(t);
  std::memcpy(static_cast<unsigned char*>(dst) + i * size, out, (n - i) * size);
}

template <class A>
constexpr SimdKernels make_kernels(const char* name) {
  return {name, &update<A>, &sum_squares<A>, &traffic<A>, &load<A>, &store<A>};
}

}  // namespace
}  // namespace strata::cpu_adam
