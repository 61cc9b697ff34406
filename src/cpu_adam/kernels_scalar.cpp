// kernels_scalar.cpp: the scalar path, one element at a time: the reference every SIMD path is
// compared with bit for bit, and the path for CPUs without SSE4.2 (or not x86).
#include "cpu_adam/formula.h"
#include "cpu_adam/kernels.h"

#include <algorithm>
#include <cstdint>

namespace strata::cpu_adam {
namespace {

void update(const UpdateSpan& s, const StepConstants& k) {
  const bool has_m = optimizer_keeps_m(k.type), has_v = optimizer_keeps_v(k.type);
  for (size_t i = 0; i < s.n; ++i) {
    float p = s.master[i], m = has_m ? s.m[i] : 0.0f, v = has_v ? s.v[i] : 0.0f;
    optimizer_element(k.type, p, load_f32(s.grad, s.grad_dtype, i), m, v, k);
    s.master[i] = p;
    if (has_m) s.m[i] = m;
    if (has_v) s.v[i] = v;
    if (s.out != nullptr) store_f32(s.out, s.out_dtype, i, p);
  }
}

double sum_squares(const void* grad, DType t, size_t n) {
  double lanes[kStatsLanes] = {};
  for (size_t i = 0; i < n; ++i) {
    const double g = load_f32(grad, t, i);
    lanes[i % kStatsLanes] += g * g;
  }
  double sum = 0.0;
  for (double l : lanes) sum += l;
  return sum;
}

void traffic(const UpdateSpan& s) {
  for (size_t i = 0; i < s.n; ++i) {
    const float g = load_f32(s.grad, s.grad_dtype, i);
    s.master[i] = std::max(s.master[i], g);
    if (s.m != nullptr) s.m[i] = std::max(s.m[i], g);
    if (s.v != nullptr) s.v[i] = std::max(s.v[i], g);
    if (s.out != nullptr) store_f32(s.out, s.out_dtype, i, s.master[i]);
  }
}

void load(const void* src, DType t, size_t n, float* dst) {
  for (size_t i = 0; i < n; ++i) dst[i] = load_f32(src, t, i);
}

void store(const float* src, size_t n, void* dst, DType t) {
  for (size_t i = 0; i < n; ++i) store_f32(dst, t, i, src[i]);
}

}  // namespace

extern const SimdKernels kScalarKernels = {"scalar", &update, &sum_squares,
                                           &traffic, &load,   &store};

}  // namespace strata::cpu_adam
