// bench_attention.cpp: `strata bench attention`, the causal grouped-query attention kernels
// forward and backward at one shape on one device: time and model TFLOP/s, and on a GPU in bf16
// the two tensor-core paths (attention_mma.cu's mma.sync, attention_tc.cu's wmma) beside the
// SIMT kernels (attention.cu), the same calls in one run. Scores may be scaled and capped as
// Gemma 2's (`--scale`, `--softcap`). Each run is labelled with the kernels that ran, counted by
// the backend, not the ones asked for: a path that does not take the call passes it on.
//
// Before it reports a speed it verifies each kernel against the host backend in f32 on the same
// heads over at most 192 positions (three of the tensor cores' 64-row tiles, so the diagonal and
// the tiles before it are covered): out, lse, dq, dk and dv within a normalised error of 1e-4 in
// f32 or 2e-2 in bf16. Model FLOPs: forward 4·B·H·T²·hd/2 (QKᵀ and PV over the causal half),
// backward twice that (dP, dV, dQ, dK), not the recomputation the backward does.
#include "bench_check.h"
#include "commands.h"
#include "core/error.h"
#include "core/kernels.h"
#include "core/tensor.h"
#include "device_args.h"
#include "gpu/attention_kernels.h"
#include "host/ops.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <random>
#include <vector>

namespace strata::cli {
namespace {

struct BenchAttentionArgs {
  int64_t batch = 1, seq_len = 2048, heads = 32, kv_heads = 8, head_dim = 128;
  float scale = 0.0f, softcap = 0.0f;
  int steps = 5;
  std::string devices, device_memory, dtype;
  bool json = false;
};

struct Dims {
  int64_t batch, seq, heads, kv_heads, head_dim;
  float scale, softcap;  // AttentionMask's: 0 for 1/sqrt(head_dim), 0 for no cap
  AttentionMask mask() const { return AttentionMask(nullptr, 0, scale, softcap); }
  Shape q() const { return {batch, seq, heads, head_dim}; }
  Shape kv() const { return {batch, seq, kv_heads, head_dim}; }
  Shape lse() const { return {batch, heads, seq}; }
};

// Which kernels run: the device's default, or on CUDA wmma's (then SIMT's), or SIMT's only.
enum class Path { kDefault, kWmma, kSimt };

void select(Path p) {
  attention_kernels(p == Path::kDefault ? AttentionKernels::kMma
                    : p == Path::kWmma  ? AttentionKernels::kWmma
                                        : AttentionKernels::kSimt);
}

// One attention problem's tensors on a device, filled from random values of `dtype`; with
// `keep_inputs` the values stay on the host too, in f32, for the host reference.
class Problem {
 public:
  Problem(Device& device, Stream& s, DType dtype, const Dims& d, uint32_t seed, bool keep_inputs)
      : device_(device), mask_(d.mask()) {
    std::mt19937 gen(seed);
    // q spans a wider range than k so that some rows' softmax is sharp; the last is dout.
    const Shape in_shapes[] = {d.q(), d.kv(), d.kv(), d.q()};
    const float ranges[] = {3.0f, 1.0f, 1.0f, 1.0f};
    for (int i = 0; i < 4; ++i) {
      std::uniform_real_distribution<float> dist(-ranges[i], ranges[i]);
      std::vector<uint8_t> raw(bytes(in_shapes[i], dtype));
      for (size_t e = 0; e < static_cast<size_t>(in_shapes[i].numel()); ++e)
        store_f32(raw.data(), dtype, e, dist(gen));
      inputs_[i] = DeviceBuffer(device, raw.size(), "bench attention");
      device.copy_to_device(inputs_[i].data(), raw.data(), raw.size(), s);
      in_views_[i] = TensorView{inputs_[i].data(), dtype, in_shapes[i], &device};
      if (keep_inputs) {
        host_f32_[i].resize(static_cast<size_t>(in_shapes[i].numel()));
        for (size_t e = 0; e < host_f32_[i].size(); ++e)
          host_f32_[i][e] = load_f32(raw.data(), dtype, e);
      }
      s.synchronize();  // before `raw` goes
    }
    const Shape shapes[] = {d.q(), d.lse(), d.q(), d.kv(), d.kv()};
    const DType types[] = {dtype, DType::f32, dtype, dtype, dtype};
    for (int i = 0; i < 5; ++i) {
      outputs_[i] = DeviceBuffer(device, bytes(shapes[i], types[i]), "bench attention");
      out_views_[i] = TensorView{outputs_[i].data(), types[i], shapes[i], &device};
    }
  }

  void forward(Stream& s) {
    device_.kernels().attention_forward(out(), lse(), in(0), in(1), in(2), mask_, s);
  }
  void backward(Stream& s) {
    device_.kernels().attention_backward(out_views_[2], out_views_[3], out_views_[4], in(3), in(0),
                                         in(1), in(2), out(), lse(), mask_, s);
  }
  // out, lse, dq, dk, dv as f32 on the host.
  std::vector<std::vector<float>> results(Stream& s) {
    std::vector<std::vector<float>> r;
    for (const TensorView& v : out_views_) r.push_back(fetch_f32(device_, v, s));
    return r;
  }
  // Input i (q, k, v, dout) as f32, for the host reference (keep_inputs only).
  const std::vector<float>& input(int i) const { return host_f32_[i]; }

 private:
  static uint64_t bytes(const Shape& s, DType t) {
    return static_cast<uint64_t>(s.numel()) * dtype_size(t);
  }
  const TensorView& in(int i) const { return in_views_[i]; }
  const TensorView& out() const { return out_views_[0]; }
  const TensorView& lse() const { return out_views_[1]; }

  Device& device_;
  AttentionMask mask_;
  std::vector<float> host_f32_[4];
  DeviceBuffer inputs_[4], outputs_[5];
  TensorView in_views_[4], out_views_[5];
};

// The host backend's out, lse, dq, dk, dv in f32 from `p`'s inputs.
std::vector<std::vector<float>> reference(const Problem& p, const Dims& d) {
  const Shape shapes[] = {d.q(), d.lse(), d.q(), d.kv(), d.kv()};
  std::vector<std::vector<float>> r;
  for (const Shape& shape : shapes) r.emplace_back(static_cast<size_t>(shape.numel()));
  std::vector<float> in[4];
  for (int i = 0; i < 4; ++i) in[i] = p.input(i);
  auto view = [&](std::vector<float>& v, const Shape& shape) {
    return TensorView{v.data(), DType::f32, shape, nullptr};
  };
  host::attention_forward(view(r[0], d.q()), view(r[1], d.lse()), view(in[0], d.q()),
                          view(in[1], d.kv()), view(in[2], d.kv()), d.mask());
  host::attention_backward(view(r[2], d.q()), view(r[3], d.kv()), view(r[4], d.kv()),
                           view(in[3], d.q()), view(in[0], d.q()), view(in[1], d.kv()),
                           view(in[2], d.kv()), view(r[0], d.q()), view(r[1], d.lse()), d.mask());
  return r;
}

void verify(Device& device, DType dtype, const Dims& full, Path path, const char* label) {
  Dims d = full;
  d.batch = 1;
  d.seq = std::min<int64_t>(full.seq, 192);
  auto s = device.create_stream("bench attention verify");
  Problem p(device, *s, dtype, d, 5, true);
  select(path);
  p.forward(*s);
  p.backward(*s);
  select(Path::kDefault);
  const auto got = p.results(*s);
  const auto want = reference(p, d);
  const double tol = dtype == DType::f32 ? 1e-4 : 2e-2;
  const char* names[] = {"out", "lse", "dq", "dk", "dv"};
  for (size_t i = 0; i < want.size(); ++i) {
    const double err = normalised_error(got[i], want[i]);
    if (!(err <= tol))
      fail(
          "bench attention: verification failed: {} ({}) on {} gives {} with a normalised error "
          "of {:.3g} against the host backend in f32 (the bound is {:.0e}), at seq {} heads {} "
          "kv_heads {} head_dim {}; not reporting a speed",
          label, dtype_name(dtype), device.name(), names[i], err, tol, d.seq, d.heads, d.kv_heads,
          d.head_dim);
  }
}

struct Timing {
  std::string kernels;
  double forward_s = 0, backward_s = 0;
};

// The CUDA kernels that took the calls since `before` (each path's call counts), or "" for none
// (the host backend).
std::string kernels_since(const uint64_t (&before)[3]) {
  static constexpr const char* kNames[] = {"mma.sync", "wmma", "SIMT"};
  for (int k = 0; k < 3; ++k)
    if (attention_calls(static_cast<AttentionKernels>(k)) > before[k]) return kNames[k];
  return "";
}
void count_calls(uint64_t (&calls)[3]) {
  for (int k = 0; k < 3; ++k) calls[k] = attention_calls(static_cast<AttentionKernels>(k));
}

// Times the calls on `path`, labelled with the kernels the warm-up's forward and backward took:
// "mma.sync", or "mma.sync/SIMT" where the backward took another path (its shared memory).
Timing time_kernels(Problem& p, Stream& s, Path path, int steps, const std::string& label) {
  select(path);
  std::vector<double> fwd, bwd;
  std::string ran[2];
  for (int k = 0; k <= steps; ++k) {  // k = 0 warms up
    uint64_t calls[3];
    count_calls(calls);
    const auto t0 = std::chrono::steady_clock::now();
    p.forward(s);
    s.synchronize();
    const auto t1 = std::chrono::steady_clock::now();
    if (k == 0) {
      ran[0] = kernels_since(calls);
      count_calls(calls);
    }
    p.backward(s);
    s.synchronize();
    const auto t2 = std::chrono::steady_clock::now();
    if (k == 0) {
      ran[1] = kernels_since(calls);
      continue;
    }
    fwd.push_back(std::chrono::duration<double>(t1 - t0).count());
    bwd.push_back(std::chrono::duration<double>(t2 - t1).count());
  }
  select(Path::kDefault);
  const std::string kernels = ran[0].empty()     ? label
                              : ran[0] == ran[1] ? ran[0]
                                                 : ran[0] + "/" + ran[1];
  return {kernels, median(fwd), median(bwd)};
}

int run_bench_attention(const BenchAttentionArgs& a) {
  if (a.batch < 1 || a.seq_len < 1 || a.heads < 1 || a.kv_heads < 1 || a.head_dim < 1)
    fail(
        "bench attention: --batch {}, --seq-len {}, --heads {}, --kv-heads {} and --head-dim {} "
        "must each be at least 1",
        a.batch, a.seq_len, a.heads, a.kv_heads, a.head_dim);
  if (a.heads % a.kv_heads != 0)
    fail(
        "bench attention: --heads {} is not a multiple of --kv-heads {}; pick kv heads that divide "
        "it",
        a.heads, a.kv_heads);
  if (a.steps < 1) fail("bench attention: --steps {} must be at least 1", a.steps);
  if (!(a.scale >= 0.0f) || !std::isfinite(a.scale) || !(a.softcap >= 0.0f) ||
      !std::isfinite(a.softcap))
    fail(
        "bench attention: --scale {} and --softcap {} must be finite and at least 0 (0: "
        "1/sqrt(head_dim), and no cap)",
        a.scale, a.softcap);
  auto devices = open_cli_devices(a.devices, a.device_memory, 1);
  Device& device = *devices.at(0);
  const DType dtype = model_dtype(device, a.dtype);
  const Dims d{a.batch, a.seq_len, a.heads, a.kv_heads, a.head_dim, a.scale, a.softcap};

  // The host backend's one kernel; on a GPU the SIMT kernels, and first the tensor-core paths
  // where they apply (bf16, head_dim a multiple of 16: mma.sync up to 128 and at 256, wmma up to
  // 128 with plain scores).
  std::vector<std::pair<Path, std::string>> paths = {{Path::kDefault, "host"}};
  if (device.backend() == Backend::cuda) {
    paths = {{Path::kSimt, "SIMT"}};
    const bool bf16 = dtype == DType::bf16;
    if (bf16 && wmma_attention_head_dim(a.head_dim) && a.scale == 0.0f && a.softcap == 0.0f)
      paths.insert(paths.begin(), {Path::kWmma, "wmma"});
    if (bf16 && mma_attention_head_dim(a.head_dim))
      paths.insert(paths.begin(), {Path::kDefault, "mma.sync"});
  }
  for (const auto& [path, label] : paths) verify(device, dtype, d, path, label.c_str());

  auto s = device.create_stream("bench attention");
  Problem p(device, *s, dtype, d, 7, false);
  std::vector<Timing> timings;
  for (const auto& [path, label] : paths)
    timings.push_back(time_kernels(p, *s, path, a.steps, label));

  const double fwd_flops = 2.0 * static_cast<double>(a.batch * a.heads * a.head_dim) *
                           static_cast<double>(a.seq_len) * static_cast<double>(a.seq_len);
  const double bwd_flops = 2 * fwd_flops;
  if (a.json) {
    nlohmann::json runs = nlohmann::json::array();
    for (const Timing& t : timings)
      runs.push_back({{"kernels", t.kernels},
                      {"forward_s", t.forward_s},
                      {"backward_s", t.backward_s},
                      {"forward_tflops", fwd_flops / t.forward_s / 1e12},
                      {"backward_tflops", bwd_flops / t.backward_s / 1e12}});
    nlohmann::json j = {{"device", device.name()},
                        {"dtype", dtype_name(dtype)},
                        {"batch", a.batch},
                        {"seq_len", a.seq_len},
                        {"heads", a.heads},
                        {"kv_heads", a.kv_heads},
                        {"head_dim", a.head_dim},
                        {"scale", a.scale},
                        {"softcap", a.softcap},
                        {"forward_flops", fwd_flops},
                        {"backward_flops", bwd_flops},
                        {"runs", runs},
                        {"verified", true}};
    fmt::print("{}\n", j.dump());
    return 0;
  }
  fmt::print(
      "bench attention: batch {} x {} positions, {} heads ({} kv), head_dim {}{}{}, {} on {}; "
      "each kernel verified against the host backend\n",
      a.batch, a.seq_len, a.heads, a.kv_heads, a.head_dim,
      a.scale > 0.0f ? fmt::format(", scale {}", a.scale) : "",
      a.softcap > 0.0f ? fmt::format(", softcap {}", a.softcap) : "", dtype_name(dtype),
      device.name());
  for (const Timing& t : timings)
    fmt::print(
        "  {:<13} forward {:8.3f} ms {:7.2f} TFLOP/s   backward {:8.3f} ms {:7.2f} TFLOP/s\n",
        t.kernels, t.forward_s * 1e3, fwd_flops / t.forward_s / 1e12, t.backward_s * 1e3,
        bwd_flops / t.backward_s / 1e12);
  for (size_t i = 1; i < timings.size(); ++i)
    fmt::print("  {} / {}: forward {:.2f}x, backward {:.2f}x faster\n", timings[0].kernels,
               timings[i].kernels, timings[i].forward_s / timings[0].forward_s,
               timings[i].backward_s / timings[0].backward_s);
  fmt::print("  (median of {}; model FLOPs: forward {:.3g}, backward {:.3g})\n", a.steps, fwd_flops,
             bwd_flops);
  return 0;
}

}  // namespace

Command add_bench_attention(CLI::App& bench) {
  auto args = std::make_shared<BenchAttentionArgs>();
  CLI::App* cmd = bench.add_subcommand(
      "attention", "causal GQA attention forward and backward at one shape: time, model TFLOP/s");
  cmd->add_option("--batch", args->batch, "sequences")->capture_default_str();
  cmd->add_option("--seq-len", args->seq_len, "positions per sequence")->capture_default_str();
  cmd->add_option("--heads", args->heads, "query heads")->capture_default_str();
  cmd->add_option("--kv-heads", args->kv_heads, "key/value heads (divides --heads)")
      ->capture_default_str();
  cmd->add_option("--head-dim", args->head_dim, "elements per head")->capture_default_str();
  cmd->add_option("--scale", args->scale,
                  "the scores' scale (0: 1/sqrt(head_dim); Gemma 2's query_pre_attn_scalar^-1/2)")
      ->capture_default_str();
  cmd->add_option("--softcap", args->softcap,
                  "cap the scores at c tanh(s / c) (0: none; Gemma 2's attn_logit_softcapping)")
      ->capture_default_str();
  cmd->add_option("--steps", args->steps, "timed calls of each (after one warm-up)")
      ->capture_default_str();
  cmd->add_option("--devices", args->devices, "host or cuda:N (default: cuda:0 if usable)");
  cmd->add_option("--device-memory", args->device_memory, "cap of the device's memory");
  cmd->add_option("--dtype", args->dtype, "f32 or bf16 (default: f32 on host, bf16 on cuda)");
  cmd->add_flag("--json", args->json, "one JSON object: runs[] with forward_tflops, ...");
  return {cmd, [args] { return run_bench_attention(*args); }};
}

}  // namespace strata::cli
