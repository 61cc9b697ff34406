// cpu_adam.cpp: CpuAdam's checks, its oneTBB arena and the choice of SIMD path.
//
// Work is cut into fixed chunks (kUpdateChunk, kStatsChunk elements from the start of the shard)
// whatever the thread count; the statistics keep one partial sum per chunk and add them in chunk
// order afterwards, which is what makes them independent of the thread count and scheduling.
#include "cpu_adam/cpu_adam.h"

#include "core/error.h"
#include "cpu_adam/kernels.h"

#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/partitioner.h>
#include <oneapi/tbb/task_arena.h>
#include <xsimd/xsimd.hpp>

#include <cmath>
#include <vector>

namespace strata {
namespace cpu_adam {

std::span<const SimdKernels* const> available_kernels() {
  static const std::vector<const SimdKernels*> list = [] {
    std::vector<const SimdKernels*> l;
#if defined(__x86_64__)
    const auto a = xsimd::available_architectures();
    const bool f16c = __builtin_cpu_supports("f16c");
    if (a.avx512f && f16c) l.push_back(&kAvx512Kernels);
    if (a.avx2 && f16c) l.push_back(&kAvx2Kernels);
    if (a.sse4_2) l.push_back(&kSse42Kernels);
#endif
    l.push_back(&kScalarKernels);
    return l;
  }();
  return list;
}

}  // namespace cpu_adam

namespace {

const cpu_adam::SimdKernels& pick_kernels(const std::string& name) {
  const auto list = cpu_adam::available_kernels();
  if (name == "best") return *list.front();
  std::string names;
  for (const cpu_adam::SimdKernels* k : list) {
    if (name == k->name) return *k;
    names += names.empty() ? k->name : std::string(", ") + k->name;
  }
  fail(
      "cpu adam: SIMD path '{}' is not available on this CPU (it has: {}); use one of those or "
      "'best'",
      name, names);
}

cpu_adam::StepConstants step_constants(int64_t step, const AdamParams& p, float grad_scale) {
  // Computed in double and rounded to float once, as torch does with its Python-float scalars.
  const double lr = p.lr, b1 = p.beta1, b2 = p.beta2, wd = p.weight_decay;
  const double s = static_cast<double>(step);
  const double bc1 = p.bias_correction ? 1.0 - std::pow(b1, s) : 1.0;
  const double bc2 = p.bias_correction ? 1.0 - std::pow(b2, s) : 1.0;
  cpu_adam::StepConstants k;
  k.grad_scale = grad_scale;
  k.l2_decay = p.adamw ? 0.0f : p.weight_decay;
  k.param_decay = p.adamw ? static_cast<float>(1.0 - lr * wd) : 1.0f;
  k.beta1 = p.beta1;
  k.one_minus_beta1 = static_cast<float>(1.0 - b1);
  k.beta2 = p.beta2;
  k.one_minus_beta2 = static_cast<float>(1.0 - b2);
  k.bias_correction2_sqrt = static_cast<float>(std::sqrt(bc2));
  k.eps = p.eps;
  k.neg_step_size = static_cast<float>(-(lr / bc1));
  return k;
}

void check_params(int64_t step, const AdamParams& p, float grad_scale) {
  if (step < 1) fail("cpu adam: step {} is not valid; steps count from 1", step);
  if (!std::isfinite(p.lr) || p.lr < 0)
    fail("cpu adam: lr {} is not valid; use a finite lr >= 0", p.lr);
  if (!(p.beta1 >= 0 && p.beta1 < 1) || !(p.beta2 >= 0 && p.beta2 < 1))
    fail("cpu adam: betas ({}, {}) are not valid; each must be in [0, 1)", p.beta1, p.beta2);
  if (!std::isfinite(p.eps) || p.eps <= 0)
    fail("cpu adam: eps {} is not valid; use a finite eps > 0 (e.g. 1e-8)", p.eps);
  if (!std::isfinite(p.weight_decay) || p.weight_decay < 0)
    fail("cpu adam: weight_decay {} is not valid; use a finite value >= 0", p.weight_decay);
  if (!std::isfinite(grad_scale) || grad_scale <= 0)
    fail(
        "cpu adam: gradient scale {} is not valid; pass 1/loss-scale x clip coefficient (finite, "
        "> 0), see combined_grad_scale",
        grad_scale);
}

void check_shard(const AdamShard& shard, const GradShard& grad,
                 const std::optional<ParamCopy>& copy) {
  if (grad.n != shard.n)
    fail(
        "cpu adam: gradient shard has {} elements but the optimizer shard {}; pass the gradient "
        "of this shard",
        grad.n, shard.n);
  if (shard.n > 0 && (!shard.master || !shard.m || !shard.v || !grad.data))
    fail("cpu adam: shard of {} elements is missing its master, m, v or gradient buffer", shard.n);
  if (copy && copy->dtype == DType::f32)
    fail(
        "cpu adam: parameter copy dtype f32 is not supported (the master already is f32); use "
        "bf16 or f16, or no copy");
  if (copy && shard.n > 0 && copy->data == nullptr)
    fail("cpu adam: parameter copy of {} elements has no buffer; pass one or no copy", shard.n);
}

}  // namespace

float combined_grad_scale(const GradStats& global, float loss_scale, float max_norm) {
  if (global.non_finite)
    fail(
        "cpu adam: the gradients hold NaN or Inf; skip this step (and lower the loss scale) "
        "instead of scaling it");
  if (!std::isfinite(loss_scale) || loss_scale <= 0)
    fail("cpu adam: loss scale {} is not valid; use a finite value > 0 (1 without fp16)",
         loss_scale);
  const double norm = std::sqrt(global.sum_squares) / loss_scale;
  double clip = 1.0;  // torch.nn.utils.clip_grad_norm_'s coefficient
  if (max_norm > 0 && norm > max_norm) clip = max_norm / (norm + 1e-6);
  return static_cast<float>(clip / loss_scale);
}

struct CpuAdam::Impl {
  const cpu_adam::SimdKernels* kernels;
  tbb::task_arena arena;

  // Runs f(chunk) for chunk in [0, chunks) on the arena, statically partitioned.
  template <class F>
  void for_chunks(size_t chunks, const F& f) {
    if (chunks <= 1) {
      if (chunks == 1) f(size_t{0});
      return;
    }
    arena.execute([&] {
      tbb::parallel_for(
          tbb::blocked_range<size_t>(0, chunks),
          [&](const tbb::blocked_range<size_t>& r) {
            for (size_t c = r.begin(); c != r.end(); ++c) f(c);
          },
          tbb::static_partitioner());
    });
  }
};

CpuAdam::CpuAdam(const CpuAdamOptions& options) {
  if (options.threads < 0)
    fail("cpu adam: threads {} is not valid; use 0 (every core) or a positive count",
         options.threads);
  const int concurrency = options.threads == 0 ? tbb::task_arena::automatic : options.threads;
  impl_ =
      std::unique_ptr<Impl>(new Impl{&pick_kernels(options.simd), tbb::task_arena(concurrency)});
  impl_->arena.initialize();
}

CpuAdam::~CpuAdam() = default;

const char* CpuAdam::simd_path() const {
  return impl_->kernels->name;
}
int CpuAdam::threads() const {
  return impl_->arena.max_concurrency();
}

std::vector<std::string> CpuAdam::available_paths() {
  std::vector<std::string> names;
  for (const cpu_adam::SimdKernels* k : cpu_adam::available_kernels()) names.emplace_back(k->name);
  return names;
}

GradStats CpuAdam::grad_stats(const GradShard& grad) {
  if (grad.n > 0 && grad.data == nullptr)
    fail("cpu adam: gradient shard of {} elements has no data; pass its buffer", grad.n);
  const size_t chunks = (grad.n + kStatsChunk - 1) / kStatsChunk;
  std::vector<double> partial(chunks);
  const size_t size = dtype_size(grad.dtype);
  const auto* base = static_cast<const unsigned char*>(grad.data);
  impl_->for_chunks(chunks, [&](size_t c) {
    const size_t begin = c * kStatsChunk, n = std::min(kStatsChunk, grad.n - begin);
    partial[c] = impl_->kernels->sum_squares(base + begin * size, grad.dtype, n);
  });
  GradStats stats;
  for (double p : partial) stats.sum_squares += p;  // chunk order: the same bits for any threads
  // Squares of finite f32/bf16/f16 values cannot overflow a double sum: a non-finite sum means a
  // non-finite element.
  stats.non_finite = !std::isfinite(stats.sum_squares);
  return stats;
}

bool CpuAdam::update(const AdamShard& shard, const GradShard& grad, int64_t step,
                     const AdamParams& params, float grad_scale, const GradStats& global,
                     std::optional<ParamCopy> copy) {
  if (global.non_finite) return false;  // an overflowed step: the trainer skips it
  check_shard(shard, grad, copy);
  check_params(step, params, grad_scale);
  const cpu_adam::StepConstants k = step_constants(step, params, grad_scale);
  for_spans(shard, grad, copy,
            [&](const cpu_adam::UpdateSpan& span) { impl_->kernels->update(span, k); });
  return true;
}

void CpuAdam::memory_bound_pass(const AdamShard& shard, const GradShard& grad,
                                std::optional<ParamCopy> copy) {
  check_shard(shard, grad, copy);
  for_spans(shard, grad, copy,
            [&](const cpu_adam::UpdateSpan& span) { impl_->kernels->traffic(span); });
}

void CpuAdam::for_spans(const AdamShard& shard, const GradShard& grad,
                        const std::optional<ParamCopy>& copy,
                        const std::function<void(const cpu_adam::UpdateSpan&)>& f) {
  const size_t chunks = (shard.n + kUpdateChunk - 1) / kUpdateChunk;
  const size_t gsize = dtype_size(grad.dtype);
  const size_t osize = copy ? dtype_size(copy->dtype) : 0;
  impl_->for_chunks(chunks, [&](size_t c) {
    const size_t begin = c * kUpdateChunk, n = std::min(kUpdateChunk, shard.n - begin);
    f(cpu_adam::UpdateSpan{
        shard.master + begin,
        shard.m + begin,
        shard.v + begin,
        static_cast<const unsigned char*>(grad.data) + begin * gsize,
        grad.dtype,
        copy ? static_cast<unsigned char*>(copy->data) + begin * osize : nullptr,
        copy ? copy->dtype : DType::bf16,
        n,
    });
  });
}

}  // namespace strata
