// bench_adam.cpp: `strata bench adam`, the fused CPU Adam step against the memory bound
// (`--optimizer lion` or `adagrad`: theirs, whose one moment makes 8 of Adam's 24 bytes of state
// traffic a parameter go away).
//
// Before it reports a speed it verifies: the first step's output (master, m, v and the copy) at
// a spread sample of indices must equal, bit for bit, the scalar reference path run on the same
// inputs. The bound is measured in the same run, on the same arena and chunks, by a trivial
// kernel with Adam's exact memory traffic (CpuAdam::memory_bound_pass); timed steps of the two
// alternate so a noisy machine affects both alike, and the medians are reported.
//
// It also times the baseline the fused step replaces: norm, unscale, update and cast as separate
// full sweeps over memory (what DeepSpeed does), plain loops the compiler vectorises, on a oneTBB
// arena of the same size over the same fixed chunks. Its master after step 1 must agree with the
// fused path's within 1e-6 relative, and its copy must equal its master rounded, before the ratio
// (grad_stats + update) / separate passes is reported. That baseline is Adam's; with another
// optimizer it is not run.
#include "bench_check.h"
#include "commands.h"
#include "core/dtype.h"
#include "core/error.h"
#include "cpu_adam/cpu_adam.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <cmath>
#if defined(__x86_64__) || defined(__SSE2__)
#include <immintrin.h>
#endif
#include <nlohmann/json.hpp>
#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/partitioner.h>
#include <oneapi/tbb/task_arena.h>
#include <optional>
#include <string>
#include <vector>

namespace strata::cli {
namespace {

struct BenchAdamArgs {
  size_t params = size_t{64} << 20;
  std::string grad_dtype = "f32";
  std::string out_dtype = "none";
  int threads = 0;
  std::string simd = "best";
  std::string optimizer = "adamw";
  int steps = 7;
  bool json = false;
};

// A value in [-0.5, 0.5) from an index hash: cheap to fill hundreds of MiB with, never
// denormal, and the same on every run.
float hashed(size_t i, uint64_t salt) {
  uint64_t x = (i + salt) * 0x9e3779b97f4a7c15ull;
  x ^= x >> 29;
  return static_cast<float>(x & 0xffffff) / 16777216.0f - 0.5f;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Plain loops for the baseline, written for the compiler's vectoriser (eight partial sums for
// the norm). GCC will not vectorise a sqrt that may set errno, and this file is built with errno
// on, so the Adam loop is written with intrinsics: sixteen lanes (AVX-512F) when the fused step
// runs its avx512f path, else four (SSE2, every x86-64 has it), in the same operation order as
// the scalar tail. The other loops are left to the compiler, cloned for AVX-512F and the
// default target (GCC picks one at load time for this CPU).
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define STRATA_BASELINE_CLONES [[gnu::target_clones("avx512f", "default")]]
#else
#define STRATA_BASELINE_CLONES
#endif

template <class T, class ToF32>
[[gnu::always_inline]] inline double sum_squares_of(const T* g, size_t b, size_t e, ToF32 to_f32) {
  double acc[8] = {};
  size_t i = b;
  for (; i + 8 <= e; i += 8)
    for (size_t k = 0; k < 8; ++k) {
      const double x = to_f32(g[i + k]);
      acc[k] += x * x;
    }
  for (; i < e; ++i) {
    const double x = to_f32(g[i]);
    acc[0] += x * x;
  }
  double s = 0.0;
  for (double a : acc) s += a;
  return s;
}

STRATA_BASELINE_CLONES double sum_squares(const void* g, DType t, size_t b, size_t e) {
  switch (t) {
    case DType::bf16:
      return sum_squares_of(static_cast<const uint16_t*>(g), b, e,
                            [](uint16_t h) { return bf16_to_f32(h); });
    case DType::f16:
      return sum_squares_of(static_cast<const uint16_t*>(g), b, e,
                            [](uint16_t h) { return f16_to_f32(h); });
    default:
      return sum_squares_of(static_cast<const float*>(g), b, e, [](float x) { return x; });
  }
}

STRATA_BASELINE_CLONES void unscale_span(const void* grad, DType t, float* out, size_t b, size_t e,
                                         float scale) {
  switch (t) {
    case DType::bf16: {
      const auto* g = static_cast<const uint16_t*>(grad);
      for (size_t i = b; i < e; ++i) out[i] = bf16_to_f32(g[i]) * scale;
      break;
    }
    case DType::f16: {
      const auto* g = static_cast<const uint16_t*>(grad);
      for (size_t i = b; i < e; ++i) out[i] = f16_to_f32(g[i]) * scale;
      break;
    }
    default: {
      const auto* g = static_cast<const float*>(grad);
      for (size_t i = b; i < e; ++i) out[i] = g[i] * scale;
    }
  }
}

STRATA_BASELINE_CLONES void cast_span(const float* master, uint16_t* out, bool bf16, size_t b,
                                      size_t e) {
  if (bf16)
    for (size_t i = b; i < e; ++i) out[i] = f32_to_bf16(master[i]);
  else
    for (size_t i = b; i < e; ++i) out[i] = f32_to_f16(master[i]);
}

struct PlainAdamConstants {
  float l2, decay, beta1, omb1, beta2, omb2, bc2_sqrt, eps, neg_step;
};

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define STRATA_BASELINE_AVX512 1
// The same loop sixteen lanes at a time, for when the fused step runs its avx512f path: the
// baseline then gets the same vector width.
[[gnu::target("avx512f"), gnu::optimize("fp-contract=off")]] size_t adam_span_avx512(
    float* __restrict master, float* __restrict m, float* __restrict v,
    const float* __restrict grad, size_t n, const PlainAdamConstants k) {
  const __m512 l2 = _mm512_set1_ps(k.l2), decay = _mm512_set1_ps(k.decay);
  const __m512 beta1 = _mm512_set1_ps(k.beta1), omb1 = _mm512_set1_ps(k.omb1);
  const __m512 beta2 = _mm512_set1_ps(k.beta2), omb2 = _mm512_set1_ps(k.omb2);
  const __m512 bc2_sqrt = _mm512_set1_ps(k.bc2_sqrt), eps = _mm512_set1_ps(k.eps);
  const __m512 neg_step = _mm512_set1_ps(k.neg_step);
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 w = _mm512_loadu_ps(master + i);
    const __m512 g = _mm512_add_ps(_mm512_loadu_ps(grad + i), _mm512_mul_ps(l2, w));
    w = _mm512_mul_ps(w, decay);
    const __m512 mi =
        _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(m + i), beta1), _mm512_mul_ps(omb1, g));
    const __m512 vi = _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(v + i), beta2),
                                    _mm512_mul_ps(_mm512_mul_ps(omb2, g), g));
    _mm512_storeu_ps(m + i, mi);
    _mm512_storeu_ps(v + i, vi);
    const __m512 denom =
        _mm512_add_ps(_mm512_div_ps(_mm512_mask_sqrt_ps(vi, __mmask16(0xffff), vi), bc2_sqrt), eps);
    _mm512_storeu_ps(master + i,
                     _mm512_add_ps(w, _mm512_div_ps(_mm512_mul_ps(neg_step, mi), denom)));
  }
  return i;
}
#endif

void adam_span(bool avx512, float* __restrict master, float* __restrict m, float* __restrict v,
               const float* __restrict grad, size_t n, const PlainAdamConstants k) {
  size_t i = 0;
#if defined(STRATA_BASELINE_AVX512)
  if (avx512) i = adam_span_avx512(master, m, v, grad, n, k);
#else
  (void)avx512;
#endif
#if defined(__SSE2__)
  const __m128 l2 = _mm_set1_ps(k.l2), decay = _mm_set1_ps(k.decay);
  const __m128 beta1 = _mm_set1_ps(k.beta1), omb1 = _mm_set1_ps(k.omb1);
  const __m128 beta2 = _mm_set1_ps(k.beta2), omb2 = _mm_set1_ps(k.omb2);
  const __m128 bc2_sqrt = _mm_set1_ps(k.bc2_sqrt), eps = _mm_set1_ps(k.eps);
  const __m128 neg_step = _mm_set1_ps(k.neg_step);
  for (; i + 4 <= n; i += 4) {
    __m128 w = _mm_loadu_ps(master + i);
    const __m128 g = _mm_add_ps(_mm_loadu_ps(grad + i), _mm_mul_ps(l2, w));
    w = _mm_mul_ps(w, decay);
    const __m128 mi = _mm_add_ps(_mm_mul_ps(_mm_loadu_ps(m + i), beta1), _mm_mul_ps(omb1, g));
    const __m128 vi =
        _mm_add_ps(_mm_mul_ps(_mm_loadu_ps(v + i), beta2), _mm_mul_ps(_mm_mul_ps(omb2, g), g));
    _mm_storeu_ps(m + i, mi);
    _mm_storeu_ps(v + i, vi);
    const __m128 denom = _mm_add_ps(_mm_div_ps(_mm_sqrt_ps(vi), bc2_sqrt), eps);
    _mm_storeu_ps(master + i, _mm_add_ps(w, _mm_div_ps(_mm_mul_ps(neg_step, mi), denom)));
  }
#endif
  for (; i < n; ++i) {
    float w = master[i];
    const float g = grad[i] + k.l2 * w;
    w = w * k.decay;
    const float mi = m[i] * k.beta1 + k.omb1 * g;
    const float vi = v[i] * k.beta2 + (k.omb2 * g) * g;
    m[i] = mi;
    v[i] = vi;
    master[i] = w + (k.neg_step * mi) / (std::sqrt(vi) / k.bc2_sqrt + k.eps);
  }
}

// The unfused baseline: norm, unscale, update and cast, each its own sweep over the shard, each
// parallel over fixed chunks on an arena of the same size as CpuAdam's.
class SeparatePasses {
 public:
  SeparatePasses(int threads, bool avx512, size_t n, const GradShard& grad)
      : arena_(threads), avx512_(avx512), n_(n), grad_(grad), grad_f32_(n) {}

  double norm_sum_squares() {
    const size_t chunks = (n_ + CpuAdam::kStatsChunk - 1) / CpuAdam::kStatsChunk;
    std::vector<double> sums(chunks);
    for_chunks(chunks, [&](size_t c) {
      const size_t b = c * CpuAdam::kStatsChunk, e = std::min(n_, b + CpuAdam::kStatsChunk);
      sums[c] = sum_squares(grad_.data, grad_.dtype, b, e);
    });
    double total = 0.0;
    for (double s : sums) total += s;
    return total;
  }

  void unscale(float scale) {
    float* out = grad_f32_.data();
    for_update_chunks(
        [&](size_t b, size_t e) { unscale_span(grad_.data, grad_.dtype, out, b, e, scale); });
  }

  // Plain Adam/AdamW (torch.optim's single-tensor order) over the unscaled f32 gradient.
  void update(const AdamShard& s, int64_t step, const AdamParams& p) {
    const double b1 = p.beta1, b2 = p.beta2, lr = p.lr, wd = p.weight_decay;
    const double bc1 = p.bias_correction ? 1.0 - std::pow(b1, static_cast<double>(step)) : 1.0;
    const double bc2 = p.bias_correction ? 1.0 - std::pow(b2, static_cast<double>(step)) : 1.0;
    const float l2 = p.adamw ? 0.0f : p.weight_decay;
    const float decay = p.adamw ? static_cast<float>(1.0 - lr * wd) : 1.0f;
    const float beta1 = p.beta1, beta2 = p.beta2;
    const auto omb1 = static_cast<float>(1.0 - b1), omb2 = static_cast<float>(1.0 - b2);
    const auto bc2_sqrt = static_cast<float>(std::sqrt(bc2));
    const auto neg_step = static_cast<float>(-(lr / bc1));
    const float eps = p.eps;
    const float* gf = grad_f32_.data();
    for_update_chunks([&](size_t b, size_t e) {
      adam_span(avx512_, s.master + b, s.m + b, s.v + b, gf + b, e - b,
                {l2, decay, beta1, omb1, beta2, omb2, bc2_sqrt, eps, neg_step});
    });
  }

  void cast(const float* master, const ParamCopy& copy) {
    auto* out = static_cast<uint16_t*>(copy.data);
    const bool bf16 = copy.dtype == DType::bf16;
    for_update_chunks([&](size_t b, size_t e) { cast_span(master, out, bf16, b, e); });
  }

 private:
  template <class F>
  void for_chunks(size_t chunks, const F& f) {
    arena_.execute([&] {
      tbb::parallel_for(
          tbb::blocked_range<size_t>(0, chunks),
          [&](const tbb::blocked_range<size_t>& r) {
            for (size_t c = r.begin(); c != r.end(); ++c) f(c);
          },
          tbb::static_partitioner());
    });
  }
  template <class F>
  void for_update_chunks(const F& f) {
    const size_t chunks = (n_ + CpuAdam::kUpdateChunk - 1) / CpuAdam::kUpdateChunk;
    for_chunks(chunks, [&](size_t c) {
      const size_t b = c * CpuAdam::kUpdateChunk;
      f(b, std::min(n_, b + CpuAdam::kUpdateChunk));
    });
  }

  tbb::task_arena arena_;
  bool avx512_;
  size_t n_;
  GradShard grad_;
  std::vector<float> grad_f32_;
};

int run_bench_adam(const BenchAdamArgs& a) {
  const size_t n = a.params;
  const DType gt = parse_dtype(a.grad_dtype);
  const bool has_out = a.out_dtype != "none";
  const DType ot = has_out ? parse_dtype(a.out_dtype) : DType::bf16;
  if (has_out && ot == DType::f32)
    fail("bench adam: --out-dtype f32 is not a copy the trainer makes; use none, bf16 or f16");
  const size_t gsize = dtype_size(gt), osize = has_out ? dtype_size(ot) : 0;
  const OptimizerType type = optimizer_flag(a.optimizer);
  const bool adam_type = type == OptimizerType::adam;
  const bool keeps_m = optimizer_keeps_m(type), keeps_v = optimizer_keeps_v(type);

  std::vector<float> master(n), m(n, 0.0f), v(n, 0.0f);
  std::vector<unsigned char> grad(n * gsize);
  std::vector<unsigned char> out(n * osize);
  for (size_t i = 0; i < n; ++i) master[i] = hashed(i, 1);
  {
    std::vector<float> g(n);
    for (size_t i = 0; i < n; ++i) g[i] = hashed(i, 2) * 1e-2f;
    convert(grad.data(), gt, g.data(), DType::f32, n);
  }
  const AdamShard shard{master.data(), keeps_m ? m.data() : nullptr, keeps_v ? v.data() : nullptr,
                        n};
  const GradShard gshard{grad.data(), gt, n};
  std::optional<ParamCopy> copy;
  if (has_out) copy = ParamCopy{out.data(), ot};
  const AdamParams params{
      .type = type, .lr = 1e-3f, .weight_decay = 0.01f, .adamw = type != OptimizerType::adagrad};

  CpuAdam adam({.threads = a.threads, .simd = a.simd});

  // Verify step 1 at a spread sample against the scalar reference on copies of its inputs.
  const size_t samples = std::min<size_t>(n, 4096);
  std::vector<size_t> at(samples);
  for (size_t j = 0; j < samples; ++j) at[j] = samples == 1 ? 0 : j * (n - 1) / (samples - 1);
  std::vector<float> sp(samples), sm(samples), sv(samples);
  std::vector<unsigned char> sg(samples * gsize), so(samples * std::max<size_t>(osize, 1));
  for (size_t j = 0; j < samples; ++j) {
    sp[j] = master[at[j]];
    sm[j] = m[at[j]];
    sv[j] = v[at[j]];
    std::memcpy(&sg[j * gsize], &grad[at[j] * gsize], gsize);
  }
  const GradStats stats = adam.grad_stats(gshard);
  const float scale = combined_grad_scale(stats, 1.0f, 1.0f);
  adam.update(shard, gshard, 1, params, scale, stats, copy);
  CpuAdam reference({.threads = 1, .simd = "scalar"});
  std::optional<ParamCopy> sample_copy;
  if (has_out) sample_copy = ParamCopy{so.data(), ot};
  reference.update(
      {sp.data(), keeps_m ? sm.data() : nullptr, keeps_v ? sv.data() : nullptr, samples},
      {sg.data(), gt, samples}, 1, params, scale, stats, sample_copy);
  for (size_t j = 0; j < samples; ++j) {
    const size_t i = at[j];
    const bool same = std::memcmp(&sp[j], &master[i], 4) == 0 &&
                      std::memcmp(&sm[j], &m[i], 4) == 0 && std::memcmp(&sv[j], &v[i], 4) == 0 &&
                      (!has_out || std::memcmp(&so[j * osize], &out[i * osize], osize) == 0);
    if (!same)
      fail(
          "bench adam: {} path output at element {} differs from the scalar reference "
          "(master {} vs {}); the kernel is wrong: run test_cpu_adam",
          adam.simd_path(), i, master[i], sp[j]);
  }

  // The separate-passes baseline (Adam's) on its own copy of the step-1 inputs; step 1 must
  // agree with the fused path (master within 1e-6 relative, sum of squares too) and its copy
  // must equal its master rounded.
  const size_t bn = adam_type ? n : 0;
  std::vector<float> bmaster(bn), bm(bn, 0.0f), bv(bn, 0.0f);
  std::vector<unsigned char> bout(bn * osize);
  for (size_t i = 0; i < bn; ++i) bmaster[i] = hashed(i, 1);
  const AdamShard bshard{bmaster.data(), bm.data(), bv.data(), bn};
  std::optional<ParamCopy> bcopy;
  if (has_out) bcopy = ParamCopy{bout.data(), ot};
  SeparatePasses separate(adam.threads(), std::string(adam.simd_path()) == "avx512f", bn,
                          {grad.data(), gt, bn});
  std::vector<double> t_pass[4];  // norm, unscale, update, cast
  const auto separate_step = [&](int64_t step) {
    auto t0 = std::chrono::steady_clock::now();
    const auto lap = [&](int pass) {
      t_pass[pass].push_back(seconds_since(t0));
      t0 = std::chrono::steady_clock::now();
    };
    const double sum_squares = separate.norm_sum_squares();
    lap(0);
    separate.unscale(combined_grad_scale({.sum_squares = sum_squares}, 1.0f, 1.0f));
    lap(1);
    separate.update(bshard, step, params);
    lap(2);
    if (has_out) separate.cast(bmaster.data(), *bcopy);
    lap(3);
    return sum_squares;
  };
  const double bsum = adam_type ? separate_step(1) : stats.sum_squares;
  for (auto& t : t_pass) t.clear();
  const auto close = [](double x, double y) {
    return std::abs(x - y) <= 1e-6 * std::max(std::abs(x), std::abs(y));
  };
  if (!close(bsum, stats.sum_squares))
    fail("bench adam: the separate norm pass's sum of squares {} differs from grad_stats' {}", bsum,
         stats.sum_squares);
  for (size_t i = 0; i < bn; ++i) {
    if (!close(bmaster[i], master[i]))
      fail(
          "bench adam: the separate-passes baseline's master at element {} is {}, the fused "
          "path's {}: more than 1e-6 relative apart",
          i, bmaster[i], master[i]);
    if (has_out) {
      const uint16_t want = ot == DType::bf16 ? f32_to_bf16(bmaster[i]) : f32_to_f16(bmaster[i]);
      uint16_t got;
      std::memcpy(&got, &bout[i * osize], osize);
      if (got != want)
        fail("bench adam: the separate cast pass wrote {:#06x} at element {}, not {:#06x}", got, i,
             want);
    }
  }

  // Timed: update steps and bound passes alternate; one untimed bound pass first.
  adam.memory_bound_pass(shard, gshard, copy, type);
  std::vector<double> t_update, t_bound, t_stats, t_separate;
  for (int s = 0; s < a.steps; ++s) {
    auto t0 = std::chrono::steady_clock::now();
    adam.update(shard, gshard, s + 2, params, scale, stats, copy);
    t_update.push_back(seconds_since(t0));
    t0 = std::chrono::steady_clock::now();
    adam.memory_bound_pass(shard, gshard, copy, type);
    t_bound.push_back(seconds_since(t0));
    t0 = std::chrono::steady_clock::now();
    (void)adam.grad_stats(gshard);
    t_stats.push_back(seconds_since(t0));
    if (!adam_type) continue;
    t0 = std::chrono::steady_clock::now();
    (void)separate_step(s + 2);
    t_separate.push_back(seconds_since(t0));
  }
  const double update_s = median(t_update), bound_s = median(t_bound), stats_s = median(t_stats);
  const double separate_s = adam_type ? median(t_separate) : NAN;
  const double fused_vs_separate = (stats_s + update_s) / separate_s;
  // The gradient and the copy once, the master and each moment read and written.
  const double bytes_per_param =
      static_cast<double>(gsize + 2 * optimizer_state_bytes(type) + osize);
  const double params_per_s = static_cast<double>(n) / update_s;
  const double bound_params_per_s = static_cast<double>(n) / bound_s;

  nlohmann::ordered_json j;
  j["optimizer"] = adam_type ? "adamw" : std::string(optimizer_type_name(type));
  j["params"] = n;
  j["grad_dtype"] = dtype_name(gt);
  j["out_dtype"] = has_out ? std::string(dtype_name(ot)) : "none";
  j["threads"] = adam.threads();
  j["arena_threads"] = adam.arena_threads();  // per NUMA node arena
  j["arena_nodes"] = adam.arena_nodes();      // their nodes (-1: one unpinned arena)
  j["simd"] = adam.simd_path();
  j["steps"] = a.steps;
  j["verified_samples"] = samples;
  j["update_s"] = update_s;
  j["params_per_s"] = params_per_s;
  j["bytes_per_param"] = bytes_per_param;
  j["update_gb_per_s"] = params_per_s * bytes_per_param / 1e9;
  j["bound_s"] = bound_s;
  j["bound_params_per_s"] = bound_params_per_s;
  j["bound_gb_per_s"] = bound_params_per_s * bytes_per_param / 1e9;
  j["bound_fraction"] = bound_s / update_s;
  j["grad_stats_s"] = stats_s;
  j["grad_stats_gb_per_s"] = static_cast<double>(n * gsize) / stats_s / 1e9;
  j["separate_passes_s"] = adam_type ? nlohmann::ordered_json(separate_s) : nullptr;
  j["fused_vs_separate"] = adam_type ? nlohmann::ordered_json(fused_vs_separate) : nullptr;
  if (a.json) {
    fmt::print("{}\n", j.dump());
    return 0;
  }
  fmt::print(
      "{}: {} params, grad {}, copy {}, {} threads, {} path; {} samples of step 1 equal "
      "the scalar reference bit for bit\n",
      j["optimizer"].get<std::string>(), n, j["grad_dtype"].get<std::string>(),
      j["out_dtype"].get<std::string>(), adam.threads(), adam.simd_path(), samples);
  std::string arenas;
  const std::vector<int> nodes = adam.arena_nodes(), threads = adam.arena_threads();
  for (size_t i = 0; i < nodes.size(); ++i) {
    if (!arenas.empty()) arenas += ", ";
    arenas += nodes[i] < 0 ? fmt::format("{} unpinned", threads[i])
                           : fmt::format("node {}: {}", nodes[i], threads[i]);
  }
  fmt::print("  threads per NUMA node arena: {}{}\n", arenas,
             adam.pinning_error().empty() ? "" : " (not pinned: " + adam.pinning_error() + ")");
  fmt::print("  update       {:8.2f} ms/step  {:6.3f} Gparam/s  {:6.2f} GB/s ({} B/param)\n",
             update_s * 1e3, params_per_s / 1e9, params_per_s * bytes_per_param / 1e9,
             bytes_per_param);
  fmt::print("  memory bound {:8.2f} ms/pass  {:6.3f} Gparam/s  {:6.2f} GB/s\n", bound_s * 1e3,
             bound_params_per_s / 1e9, bound_params_per_s * bytes_per_param / 1e9);
  fmt::print("  fraction of the bound: {:.3f}\n", bound_s / update_s);
  fmt::print("  grad stats   {:8.2f} ms/pass  {:6.2f} GB/s\n", stats_s * 1e3,
             j["grad_stats_gb_per_s"].get<double>());
  if (!adam_type) {
    fmt::print("  separate passes: not run (the unfused baseline is Adam's)\n");
    return 0;
  }
  fmt::print(
      "  separate     {:8.2f} ms/step (norm, unscale, update{} as separate passes; step 1 "
      "within 1e-6 of the fused master)\n",
      separate_s * 1e3, has_out ? ", cast" : "");
  fmt::print(
      "               norm {:.2f}, unscale {:.2f}, update {:.2f}, cast {:.2f} ms (medians)\n",
      median(t_pass[0]) * 1e3, median(t_pass[1]) * 1e3, median(t_pass[2]) * 1e3,
      median(t_pass[3]) * 1e3);
  fmt::print("  fused (grad stats + update) / separate: {:.3f}\n", fused_vs_separate);
  return 0;
}

}  // namespace

Command add_bench_adam(CLI::App& bench) {
  auto args = std::make_shared<BenchAdamArgs>();
  CLI::App* app = bench.add_subcommand(
      "adam", "the fused CPU Adam step: params/s and the fraction of the memory bound");
  app->add_option("--params", args->params, "shard size in parameters")->check(CLI::PositiveNumber);
  app->add_option("--grad-dtype", args->grad_dtype, "gradient dtype")
      ->check(CLI::IsMember({"f32", "bf16", "f16"}));
  app->add_option("--out-dtype", args->out_dtype, "parameter copy written by the step")
      ->check(CLI::IsMember({"none", "bf16", "f16"}));
  app->add_option("--threads", args->threads, "threads in the arena (0: every core)")
      ->check(CLI::NonNegativeNumber);
  app->add_option("--simd", args->simd, "SIMD path: best, avx512f, avx2, sse4.2, scalar");
  app->add_option("--optimizer", args->optimizer, "the update: adamw (default), lion or adagrad")
      ->check(CLI::IsMember({"adamw", "adam", "lion", "adagrad"}));
  app->add_option("--steps", args->steps, "timed steps (the median is reported)")
      ->check(CLI::PositiveNumber);
  app->add_flag("--json", args->json, "print one JSON object");
  return {app, [args] { return run_bench_adam(*args); }};
}

}  // namespace strata::cli
