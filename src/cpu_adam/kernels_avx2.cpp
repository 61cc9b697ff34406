// kernels_avx2.cpp: the AVX2 path (compiled with -mavx2 -mf16c; see kernel_impl.h).
#include "cpu_adam/kernel_impl.h"

namespace strata::cpu_adam {
namespace {

template <>
struct Io<xsimd::avx2> {
  using B = FloatBatch<xsimd::avx2>;
  using D = DoubleBatch<xsimd::avx2>;
  using U = xsimd::batch<uint32_t, xsimd::avx2>;
  static U widen_u16(const uint16_t* p) {
    return _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void narrow_u32(U x, uint16_t* p) {
    // packus works within 128-bit lanes: gather quadwords 0 and 2 into the low half.
    const __m256i packed = _mm256_packus_epi32(x, x);
    const __m256i ordered = _mm256_permute4x64_epi64(packed, 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(ordered));
  }
  static B load_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void store_f16(B x, uint16_t* p) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static void to_double(B x, D& lo, D& hi) {
    const __m256 r = x;
    lo = _mm256_cvtps_pd(_mm256_castps256_ps128(r));
    hi = _mm256_cvtps_pd(_mm256_extractf128_ps(r, 1));
  }
};

}  // namespace

extern const SimdKernels kAvx2Kernels = make_kernels<xsimd::avx2>("avx2");

}  // namespace strata::cpu_adam
