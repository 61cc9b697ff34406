// kernels_sse42.cpp: the SSE4.2 path (compiled with -msse4.2; see kernel_impl.h). Without F16C
// the f16 conversions go through the out-of-line scalar strata::convert.
#include "cpu_adam/kernel_impl.h"

namespace strata::cpu_adam {
namespace {

template <>
struct Io<xsimd::sse4_2> {
  using B = FloatBatch<xsimd::sse4_2>;
  using D = DoubleBatch<xsimd::sse4_2>;
  using U = xsimd::batch<uint32_t, xsimd::sse4_2>;
  static U widen_u16(const uint16_t* p) {
    return _mm_cvtepu16_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  static void narrow_u32(U x, uint16_t* p) {
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packus_epi32(x, x));
  }
  static B load_f16(const uint16_t* p) {
    alignas(16) float f[4];
    convert(f, DType::f32, p, DType::f16, 4);
    return B::load_aligned(f);
  }
  static void store_f16(B x, uint16_t* p) {
    alignas(16) float f[4];
    x.store_aligned(f);
    convert(p, DType::f16, f, DType::f32, 4);
  }
  static void to_double(B x, D& lo, D& hi) {
    const __m128 r = x;
    lo = _mm_cvtps_pd(r);
    hi = _mm_cvtps_pd(_mm_movehl_ps(r, r));
  }
};

}  // namespace

extern const SimdKernels kSse42Kernels = make_kernels<xsimd::sse4_2>("sse4.2");

}  // namespace strata::cpu_adam
