// kernels_avx512.cpp: the AVX-512F path (compiled with -mavx512f -mf16c; see kernel_impl.h).
#include "cpu_adam/kernel_impl.h"

namespace strata::cpu_adam {
namespace {

template <>
struct Io<xsimd::avx512f> {
  using B = FloatBatch<xsimd::avx512f>;
  using D = DoubleBatch<xsimd::avx512f>;
  using U = xsimd::batch<uint32_t, xsimd::avx512f>;
  static U widen_u16(const uint16_t* p) {
    return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void narrow_u32(U x, uint16_t* p) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(x));
  }
  static B load_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void store_f16(B x, uint16_t* p) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static void to_double(B x, D& lo, D& hi) {
    const __m512 r = x;
    lo = _mm512_cvtps_pd(_mm512_castps512_ps256(r));
    hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(r), 1)));
  }
};

}  // namespace

extern const SimdKernels kAvx512Kernels = make_kernels<xsimd::avx512f>("avx512f");

}  // namespace strata::cpu_adam
