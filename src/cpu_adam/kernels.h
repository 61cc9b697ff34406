// kernels.h: the per-instruction-set kernels behind CpuAdam, and the table that picks one.
//
// Each SIMD path is the same template (kernel_impl.h) compiled in its own translation unit
// with its own -m flags (kernels_avx512.cpp, kernels_avx2.cpp, kernels_sse42.cpp on x86-64;
// kernels_neon.cpp, which needs none, on AArch64); the scalar path (kernels_scalar.cpp) is the
// reference. All of them compute the same IEEE operations in the same order (every cpu_adam file
// is built with -ffp-contract=off), so their output bits are identical; tests/test_cpu_adam.cpp
// checks that on every path the CPU runs.
// Never call a path that available_kernels() does not list: it would fault on this CPU.
#pragma once

#include "core/dtype.h"
#include "core/optimizer.h"

#include <cstddef>
#include <span>
#include <string_view>

namespace strata::cpu_adam {

// The per-step scalars of Adam, rounded to float once (as torch does with Python scalars).
struct StepConstants {
  OptimizerType type;  // which formula of formula.h runs; the fields it does not read are 0
  float grad_scale;    // 1/loss-scale x clip coefficient
  float l2_decay;      // Adam, Adagrad: g += l2_decay * p (0 when decoupled or no decay)
  float param_decay;   // AdamW, Lion: p *= param_decay (1 when L2 or no decay)
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float bias_correction2_sqrt;  // sqrt(1 - beta2^step), or 1 without bias correction
  float eps;
  float neg_step_size;  // Adam: -lr / (1 - beta1^step), or -lr without bias correction; else -lr
};

// One contiguous range of a shard, already offset to its first element. m or v is null where
// the type keeps no such moment.
struct UpdateSpan {
  float* master;
  float* m;
  float* v;
  const void* grad;
  DType grad_dtype;
  void* out;  // the 16-bit parameter copy, or nullptr
  DType out_dtype;
  size_t n;
};

// Sum of squares over one statistics chunk: element i goes to lane i % kStatsLanes (in
// double; the square of a float is exact in double), and the lanes are then added in order
// 0..15. Every path sums in exactly this order.
inline constexpr size_t kStatsLanes = 16;

struct SimdKernels {
  const char* name;
  void (*update)(const UpdateSpan& span, const StepConstants& k);
  double (*sum_squares)(const void* grad, DType dtype, size_t n);
  // The update's exact memory traffic with trivial arithmetic (p and each moment the span
  // has = max(., g); the copy of p): the bound `strata bench adam` compares the update with.
  void (*traffic)(const UpdateSpan& span);
  // The conversions the kernels use, exposed so tests can check them exhaustively.
  void (*load)(const void* src, DType src_dtype, size_t n, float* dst);
  void (*store)(const float* src, size_t n, void* dst, DType dst_dtype);
};

extern const SimdKernels kScalarKernels;
#if defined(__x86_64__)
extern const SimdKernels kSse42Kernels;
extern const SimdKernels kAvx2Kernels;
extern const SimdKernels kAvx512Kernels;
#elif defined(__aarch64__)
extern const SimdKernels kNeon64Kernels;
#endif

// The paths this CPU can run, best first; the scalar path is always last.
std::span<const SimdKernels* const> available_kernels();

}  // namespace strata::cpu_adam
