// bench_adam.cpp: `strata bench adam`, the fused CPU Adam step against the memory bound.
//
// Before it reports a speed it verifies: the first step's output (master, m, v and the copy) at
// a spread sample of indices must equal, bit for bit, the scalar reference path run on the same
// inputs. The bound is measured in the same run, on the same arena and chunks, by a trivial
// kernel with Adam's exact memory traffic (CpuAdam::memory_bound_pass); timed steps of the two
// alternate so a noisy machine affects both alike, and the medians are reported.
#include "commands.h"
#include "core/dtype.h"
#include "core/error.h"
#include "cpu_adam/cpu_adam.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <nlohmann/json.hpp>
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

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int run_bench_adam(const BenchAdamArgs& a) {
  const size_t n = a.params;
  const DType gt = parse_dtype(a.grad_dtype);
  const bool has_out = a.out_dtype != "none";
  const DType ot = has_out ? parse_dtype(a.out_dtype) : DType::bf16;
  if (has_out && ot == DType::f32)
    fail("bench adam: --out-dtype f32 is not a copy the trainer makes; use none, bf16 or f16");
  const size_t gsize = dtype_size(gt), osize = has_out ? dtype_size(ot) : 0;

  std::vector<float> master(n), m(n, 0.0f), v(n, 0.0f);
  std::vector<unsigned char> grad(n * gsize);
  std::vector<unsigned char> out(n * osize);
  for (size_t i = 0; i < n; ++i) master[i] = hashed(i, 1);
  {
    std::vector<float> g(n);
    for (size_t i = 0; i < n; ++i) g[i] = hashed(i, 2) * 1e-2f;
    convert(grad.data(), gt, g.data(), DType::f32, n);
  }
  const AdamShard shard{master.data(), m.data(), v.data(), n};
  const GradShard gshard{grad.data(), gt, n};
  std::optional<ParamCopy> copy;
  if (has_out) copy = ParamCopy{out.data(), ot};
  const AdamParams params{.lr = 1e-3f, .weight_decay = 0.01f};

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
  reference.update({sp.data(), sm.data(), sv.data(), samples}, {sg.data(), gt, samples}, 1, params,
                   scale, stats, sample_copy);
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

  // Timed: update steps and bound passes alternate; one untimed bound pass first.
  adam.memory_bound_pass(shard, gshard, copy);
  std::vector<double> t_update, t_bound, t_stats;
  for (int s = 0; s < a.steps; ++s) {
    auto t0 = std::chrono::steady_clock::now();
    adam.update(shard, gshard, s + 2, params, scale, stats, copy);
    t_update.push_back(seconds_since(t0));
    t0 = std::chrono::steady_clock::now();
    adam.memory_bound_pass(shard, gshard, copy);
    t_bound.push_back(seconds_since(t0));
    t0 = std::chrono::steady_clock::now();
    (void)adam.grad_stats(gshard);
    t_stats.push_back(seconds_since(t0));
  }
  const double update_s = median(t_update), bound_s = median(t_bound), stats_s = median(t_stats);
  const double bytes_per_param = static_cast<double>(gsize + 6 * 4 + osize);
  const double params_per_s = static_cast<double>(n) / update_s;
  const double bound_params_per_s = static_cast<double>(n) / bound_s;

  nlohmann::ordered_json j;
  j["params"] = n;
  j["grad_dtype"] = dtype_name(gt);
  j["out_dtype"] = has_out ? std::string(dtype_name(ot)) : "none";
  j["threads"] = adam.threads();
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
  if (a.json) {
    fmt::print("{}\n", j.dump());
    return 0;
  }
  fmt::print(
      "adam: {} params, grad {}, copy {}, {} threads, {} path; {} samples of step 1 equal "
      "the scalar reference bit for bit\n",
      n, j["grad_dtype"].get<std::string>(), j["out_dtype"].get<std::string>(), adam.threads(),
      adam.simd_path(), samples);
  fmt::print("  update       {:8.2f} ms/step  {:6.3f} Gparam/s  {:6.2f} GB/s ({} B/param)\n",
             update_s * 1e3, params_per_s / 1e9, params_per_s * bytes_per_param / 1e9,
             bytes_per_param);
  fmt::print("  memory bound {:8.2f} ms/pass  {:6.3f} Gparam/s  {:6.2f} GB/s\n", bound_s * 1e3,
             bound_params_per_s / 1e9, bound_params_per_s * bytes_per_param / 1e9);
  fmt::print("  fraction of the bound: {:.3f}\n", bound_s / update_s);
  fmt::print("  grad stats   {:8.2f} ms/pass  {:6.2f} GB/s\n", stats_s * 1e3,
             j["grad_stats_gb_per_s"].get<double>());
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
  app->add_option("--steps", args->steps, "timed steps (the median is reported)")
      ->check(CLI::PositiveNumber);
  app->add_flag("--json", args->json, "print one JSON object");
  return {app, [args] { return run_bench_adam(*args); }};
}

}  // namespace strata::cli
