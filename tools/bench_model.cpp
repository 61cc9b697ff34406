// bench_model.cpp: `strata bench model`, one training step's forward and backward of a Llama
// (all of it resident on one device, randomly initialised): tokens/s and, given the device's
// peak, model FLOPs utilisation.
//
// Before it reports a speed it verifies the device's numbers against the host backend in f32:
// a copy of the model cut to at most two layers, batch 1 and at most 64 positions, with the
// same weights, must give the same per-token losses (1e-4 relative in f32, 3% in bf16) and
// finite gradients. Model FLOPs count what the model needs (6 per parameter and token, plus
// causal attention), not the recomputation that activation checkpointing adds
// (--activation-checkpointing off keeps every block's activations instead).
#include "commands.h"
#include "core/error.h"
#include "device_args.h"
#include "host/host_device.h"
#include "model/config.h"
#include "model/llama.h"
#include "model/weights.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>

namespace strata::cli {
namespace {

struct BenchModelArgs {
  std::string model = "tiny";
  int64_t seq_len = 128;
  int64_t batch = 4;
  int steps = 5;
  std::string devices, device_memory, dtype;
  double peak_tflops = 0;
  bool recompute = true;  // --activation-checkpointing
  bool json = false;
};

// Per-token losses of one forward (and whether backward's gradients are finite) for `config`
// on `device`, random weights from `seed`.
struct Probe {
  std::vector<float> losses;
  bool finite_grads = true;
};
Probe probe(const LlamaConfig& config, Device& device, DType dtype, bool recompute, int64_t T,
            const std::vector<int32_t>& ids, const std::vector<int32_t>& targets) {
  ModelOptions o;
  o.recompute = recompute;
  o.param_dtype = dtype;
  o.grad_dtype = DType::f32;
  o.max_batch = 1;
  o.seq_len = T;
  LlamaModel model(config, o, device);
  ResidentWeights w(model.layout(), device, dtype, DType::f32, true);
  auto s = device.create_stream("bench verify");
  w.init_random(1, *s);
  w.zero_grads(*s);
  DeviceBuffer di(device, static_cast<uint64_t>(T) * 4, "ids"),
      dt(device, static_cast<uint64_t>(T) * 4, "targets");
  device.copy_to_device(di.data(), ids.data(), di.bytes(), *s);
  device.copy_to_device(dt.data(), targets.data(), dt.bytes(), *s);
  model.forward(w.units(), static_cast<int32_t*>(di.data()), static_cast<int32_t*>(dt.data()), 1,
                true, *s);
  Probe p;
  p.losses.resize(static_cast<size_t>(T));
  device.copy_to_host(p.losses.data(), model.losses(1).data, di.bytes(), *s);
  model.backward(w.units(), static_cast<int32_t*>(di.data()), static_cast<int32_t*>(dt.data()), 1,
                 1.0f / static_cast<float>(T), *s);
  s->synchronize();
  for (int u = 0; u < model.layout().num_units(); ++u)
    for (float g : w.download(u, true, *s)) p.finite_grads = p.finite_grads && std::isfinite(g);
  return p;
}

void verify(const LlamaConfig& full, Device& device, DType dtype, bool recompute, int64_t seq_len) {
  LlamaConfig c = full;
  c.num_hidden_layers = std::min<int64_t>(c.num_hidden_layers, 2);
  const int64_t T = std::min<int64_t>(seq_len, 64);
  std::vector<int32_t> ids(static_cast<size_t>(T)), targets(ids.size());
  for (int64_t i = 0; i < T; ++i) {
    ids[static_cast<size_t>(i)] = static_cast<int32_t>((i * 7919 + 13) % c.vocab_size);
    targets[static_cast<size_t>(i)] = static_cast<int32_t>((i * 104729 + 5) % c.vocab_size);
  }
  const Probe got = probe(c, device, dtype, recompute, T, ids, targets);
  // f32 parameters and gradients plus activations; the arena only reserves address space.
  auto host = open_host_device(99, parameter_count(c) * 8 + (1ull << 30));
  const Probe want = probe(c, *host, DType::f32, true, T, ids, targets);
  const double tol = dtype == DType::f32 ? 1e-4 : 3e-2;
  for (size_t i = 0; i < want.losses.size(); ++i)
    if (!(std::abs(got.losses[i] - want.losses[i]) <= tol * std::abs(want.losses[i])))
      fail(
          "bench model: verification failed: {} layer(s) of {} on {} ({}) give loss {} at "
          "position {}, the host backend in f32 gives {}; not reporting a speed",
          c.num_hidden_layers, full.name, device.name(), dtype_name(dtype), got.losses[i], i,
          want.losses[i]);
  if (!got.finite_grads)
    fail("bench model: verification failed: non-finite gradients on {}; not reporting a speed",
         device.name());
}

int run_bench_model(const BenchModelArgs& a) {
  const LlamaConfig config = resolve_model(a.model);
  auto devices = open_cli_devices(a.devices, a.device_memory, 1);
  Device& device = *devices.at(0);
  const DType dtype = model_dtype(device, a.dtype);
  if (a.steps < 1) fail("--steps {} must be at least 1", a.steps);
  verify(config, device, dtype, a.recompute, a.seq_len);

  ModelOptions o;
  o.recompute = a.recompute;
  o.param_dtype = dtype;
  o.grad_dtype = DType::f32;
  o.max_batch = a.batch;
  o.seq_len = a.seq_len;
  LlamaModel model(config, o, device);
  ResidentWeights w(model.layout(), device, dtype, DType::f32, true);
  auto s = device.create_stream("bench");
  w.init_random(1, *s);
  const int64_t N = a.batch * a.seq_len;
  std::vector<int32_t> ids(static_cast<size_t>(N)), targets(ids.size());
  for (int64_t i = 0; i < N; ++i) {
    ids[static_cast<size_t>(i)] = static_cast<int32_t>((i * 31 + 7) % config.vocab_size);
    targets[static_cast<size_t>(i)] = static_cast<int32_t>((i * 17 + 3) % config.vocab_size);
  }
  DeviceBuffer di(device, static_cast<uint64_t>(N) * 4, "ids"),
      dt(device, static_cast<uint64_t>(N) * 4, "targets");
  device.copy_to_device(di.data(), ids.data(), di.bytes(), *s);
  device.copy_to_device(dt.data(), targets.data(), dt.bytes(), *s);
  auto i32 = [](const DeviceBuffer& b) { return static_cast<int32_t*>(b.data()); };

  std::vector<double> fwd, step;
  for (int k = 0; k <= a.steps; ++k) {  // step 0 warms up
    const auto t0 = std::chrono::steady_clock::now();
    model.forward(w.units(), i32(di), i32(dt), a.batch, true, *s);
    s->synchronize();
    const auto t1 = std::chrono::steady_clock::now();
    model.backward(w.units(), i32(di), i32(dt), a.batch, 1.0f / static_cast<float>(N), *s);
    s->synchronize();
    const auto t2 = std::chrono::steady_clock::now();
    if (k == 0) continue;
    fwd.push_back(std::chrono::duration<double>(t1 - t0).count());
    step.push_back(std::chrono::duration<double>(t2 - t0).count());
  }
  std::sort(fwd.begin(), fwd.end());
  std::sort(step.begin(), step.end());
  const double f = fwd[fwd.size() / 2], t = step[step.size() / 2];

  const double params = static_cast<double>(parameter_count(config));
  const double flops = static_cast<double>(N) * model_flops_per_token(config, a.seq_len);
  const double tflops = flops / t / 1e12;
  const double tokens_per_s = static_cast<double>(N) / t;
  if (a.json) {
    nlohmann::json j = {{"model", config.name},
                        {"device", device.name()},
                        {"dtype", dtype_name(dtype)},
                        {"batch", a.batch},
                        {"seq_len", a.seq_len},
                        {"forward_s", f},
                        {"step_s", t},
                        {"tokens_per_s", tokens_per_s},
                        {"model_tflops", tflops},
                        {"activation_checkpointing", a.recompute},
                        {"verified", true}};
    if (a.peak_tflops > 0) j["mfu"] = tflops / a.peak_tflops;
    fmt::print("{}\n", j.dump());
    return 0;
  }
  fmt::print(
      "bench model: {} ({:.3g}M parameters, {}) on {}, batch {} x {} tokens, {}; verified "
      "against the host backend\n"
      "  forward {:.2f} ms, forward+backward {:.2f} ms (median of {}): {:.0f} tokens/s, {:.3g} "
      "model TFLOP/s{}\n",
      config.name, params / 1e6, dtype_name(dtype), device.name(), a.batch, a.seq_len,
      a.recompute ? "blocks recomputed in backward" : "activations kept", f * 1e3, t * 1e3, a.steps,
      tokens_per_s, tflops,
      a.peak_tflops > 0
          ? fmt::format(" = {:.1f}% of {} TFLOP/s", 100 * tflops / a.peak_tflops, a.peak_tflops)
          : std::string());
  return 0;
}

}  // namespace

Command add_bench_model(CLI::App& bench) {
  auto args = std::make_shared<BenchModelArgs>();
  CLI::App* cmd = bench.add_subcommand(
      "model", "forward+backward of a resident Llama on one device: tokens/s, model FLOP/s");
  cmd->add_option("--model", args->model, "preset or checkpoint directory (its config is used)")
      ->capture_default_str();
  cmd->add_option("--seq-len", args->seq_len, "tokens per sequence")->capture_default_str();
  cmd->add_option("--batch", args->batch, "sequences per step")->capture_default_str();
  cmd->add_option("--steps", args->steps, "timed steps (after one warm-up)")->capture_default_str();
  cmd->add_option("--devices", args->devices, "host or cuda:N (default: cuda:0 if usable)");
  cmd->add_option("--device-memory", args->device_memory, "cap of the device's memory");
  cmd->add_option("--dtype", args->dtype, "f32 or bf16 (default: f32 on host, bf16 on cuda)");
  add_checkpointing_option(cmd, args->recompute);
  cmd->add_option("--peak-tflops", args->peak_tflops,
                  "the device's peak (e.g. measured by a large matmul) to report MFU against");
  cmd->add_flag("--json", args->json, "one JSON object: tokens_per_s, model_tflops, mfu, ...");
  return {cmd, [args] { return run_bench_model(*args); }};
}

}  // namespace strata::cli
