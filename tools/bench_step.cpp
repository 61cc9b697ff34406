// bench_step.cpp: `strata bench step`, whole training steps through the executor with the
// model state in the tiers asked for, side by side with the simulator's prediction from a
// hardware profile measured on this machine in the same run (issue 7's targets).
//
// Order: place and check (a plan that does not fit stops here), run the all-device placement
// as the reference, then for each round measure the profile (or load --hardware once) and run
// the asked placement with every task's start and end recorded. Only when a round's final
// weights equal the reference's bit for bit and its timeline honours every dependency does it
// count: its measured step time (steps overlap in the executor, the next step's forward under
// this step's optimizer, so a step is the period between consecutive steps), each lane's busy
// time, the busiest lane and the overlap (its busy time ÷ the step time), next to the
// simulator's steady state from that round's profile. With several rounds the report is the
// round whose prediction error is the median, and the JSON lists every round: on a shared
// machine whose speed drifts over seconds, a profile and the steps it predicts are timed
// within a second of each other, and no single slow spell decides the figure.
//
// A model whose state does not fit on the devices all at once (an 8B model with its optimizer
// on the CPU, the reason to offload it) has no all-device run to compare with. Its placement is
// then verified on a copy cut to two layers, against that copy's all-device run bit for bit,
// and the full model's steps must give finite losses, the first within half of ln(vocab) (a
// random model's). With --peak-tflops the report adds model FLOPs utilisation: 6 FLOPs per
// parameter and token plus causal attention, not the recomputation checkpointing adds.
#include "bench_check.h"
#include "commands.h"
#include "core/bytes.h"
#include "core/error.h"
#include "device_args.h"
#include "model/config.h"
#include "model/llama.h"
#include "partition/communicator.h"
#include "schedule/executor.h"
#include "schedule/measure.h"
#include "schedule/schedule.h"
#include "schedule/simulator.h"
#include "schedule/trace.h"
#include "tier/placement.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

namespace strata::cli {
namespace {

struct BenchStepArgs {
  std::string model = "tiny";
  int64_t hidden = 0, intermediate = 0, layers = 0, vocab = 0, vocab_pieces = 0;
  std::string devices = "host:1", device_memory;
  std::string offload_param = "nvme", offload_optimizer = "nvme", offload_gradients;
  std::vector<std::string> nvme_paths;
  int64_t micro_batch = 1, grad_accum = 1, seq_len = 64;
  int prefetch_depth = 1;
  bool recompute = true;  // --activation-checkpointing
  std::string offload_activations;
  int64_t micro_batch_group = kUnsetFlag;
  bool update_during_backward = false;
  bool reduce_per_group = false;
  int buffer_count = 4;
  int64_t persistence_threshold = 100000;
  int steps = 5;
  int rounds = 1;
  int threads = 0;
  double peak_tflops = 0;
  std::string hardware, save_profile, trace, predicted_trace;
  bool json = false;
};

LlamaConfig bench_model(const BenchStepArgs& a) {
  LlamaConfig c = resolve_model(a.model);
  if (a.hidden > 0) {
    if (a.hidden % c.num_attention_heads != 0)
      fail("--hidden {}: must be a multiple of the model's {} attention heads", a.hidden,
           c.num_attention_heads);
    c.hidden_size = a.hidden;
    c.head_dim = a.hidden / c.num_attention_heads;
  }
  if (a.intermediate > 0) c.intermediate_size = a.intermediate;
  if (a.layers > 0) c.num_hidden_layers = a.layers;
  if (a.vocab > 0) c.vocab_size = a.vocab;
  validate_llama_config(c, "strata bench step");
  apply_vocab_pieces(a.vocab_pieces, c);
  return c;
}

std::vector<std::vector<HostBatch>> make_step_batches(int step, int micro, int ranks, int64_t B,
                                                      int64_t T, int64_t vocab) {
  std::vector<std::vector<HostBatch>> out(static_cast<size_t>(micro));
  uint64_t x = 0x9e3779b97f4a7c15ull * static_cast<uint64_t>(step + 1);
  auto next = [&] {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<int32_t>((x >> 33) % static_cast<uint64_t>(vocab));
  };
  for (auto& mb : out)
    for (int r = 0; r < ranks; ++r) {
      HostBatch b;
      b.batch = B;
      for (int64_t i = 0; i < B * T; ++i) {
        b.ids.push_back(next());
        b.targets.push_back(next());
      }
      mb.push_back(std::move(b));
    }
  return out;
}

// Clipping at 1 as Hugging Face's Trainer does, unless CPU Adam updates during the backward,
// which cannot clip (the reference runs then do not clip either).
StepParams step_params(int64_t step, bool clip) {
  StepParams p;
  p.step = step;
  p.adam.lr = 1e-3f;
  p.adam.weight_decay = 0.01f;
  p.max_grad_norm = clip ? 1.0f : 0.0f;
  return p;
}

std::string secs(double s) {
  return s >= 1.0 ? fmt::format("{:.3f} s", s) : fmt::format("{:.2f} ms", s * 1e3);
}

struct Measured {
  std::vector<double> step_s, nvme_busy_s, overlap;
  std::vector<std::vector<double>> lane_busy_s;  // [lane][step]
  std::vector<std::vector<float>> master, params;
  std::vector<double> losses;
  // The most device memory the executor held on any device: its allocations (made when it is
  // built) and whatever its steps allocate beside them.
  uint64_t device_bytes = 0;
};

// Progress on stderr (stdout holds the report or the JSON): a large model's run takes minutes
// before the report, spent in pinning host memory, initialising and the reference runs.
using Clock = std::chrono::steady_clock;
template <typename... Args>
void progress(Clock::time_point since, fmt::format_string<Args...> format, Args&&... args) {
  fmt::print(stderr, "bench step [{:7.1f} s] {}\n",
             std::chrono::duration<double>(Clock::now() - since).count(),
             fmt::format(format, std::forward<Args>(args)...));
  std::fflush(stderr);
}

// `what` names the run in the progress lines; `keep_weights` copies every unit's weights out at
// the end for a comparison (a model that does not fit on the devices has none: its copy would
// take as much RAM again as its optimizer states).
Measured run_steps(const Placement& placement, const Schedule& schedule, Communicator& comm,
                   const ExecutorOptions& eo, const BenchStepArgs& a, const std::string& trace,
                   const std::string& what, bool keep_weights = true) {
  const Clock::time_point t0 = Clock::now();
  // The devices outlive each run; their high-water marks span them all, so the executor's part
  // is measured from what is in use before it is built.
  std::vector<uint64_t> before;
  for (int r = 0; r < comm.size(); ++r) before.push_back(comm.device(r).memory().in_use);
  Executor ex(placement, schedule, comm, eo);
  auto held = [&] {
    uint64_t most = 0;
    for (int r = 0; r < comm.size(); ++r)
      most = std::max(most, comm.device(r).memory().in_use - before[static_cast<size_t>(r)]);
    return most;
  };
  ex.init_random(7);
  progress(t0, "{}: state allocated and initialised", what);
  Measured out;
  out.lane_busy_s.resize(schedule.lanes.size());
  const int R = placement.shape.ranks;
  for (int s = 0; s <= a.steps; ++s) {  // step 0 warms up
    const StepResult r =
        ex.step(make_step_batches(s, static_cast<int>(a.grad_accum), R, a.micro_batch, a.seq_len,
                                  placement.shape.model.vocab_size),
                step_params(s + 1, !a.update_during_backward));
    if (r.skipped || !std::isfinite(r.loss))
      fail("bench step: step {} gave loss {} (skipped: {}); not reporting a speed", s + 1, r.loss,
           r.skipped);
    out.losses.push_back(r.loss);
    out.device_bytes = std::max(out.device_bytes, held());
    progress(t0, "{}: step {} of {}, loss {:.4f}, {}", what, s + 1, a.steps + 1, r.loss,
             secs(r.step_s));
    if (s == 0) continue;
    out.step_s.push_back(r.step_s);
    out.nvme_busy_s.push_back(r.nvme_busy_s);
    out.overlap.push_back(r.overlap);
    for (size_t l = 0; l < r.lane_busy_s.size(); ++l)
      out.lane_busy_s[l].push_back(r.lane_busy_s[l]);
  }
  if (eo.record) {
    check_timeline(schedule, ex.timeline());
    if (!trace.empty()) ex.trace(trace);
  }
  for (int u = 0; keep_weights && u < static_cast<int>(placement.homes.size()); ++u) {
    out.master.push_back(ex.master(u));
    out.params.push_back(ex.parameters(u));
  }
  return out;
}

void expect_same_bits(const Measured& got, const Measured& want, const Placement& pl) {
  for (size_t u = 0; u < want.master.size(); ++u)
    for (const auto& [what, g, w] : {std::tuple{"master weights", &got.master[u], &want.master[u]},
                                     std::tuple{"parameters", &got.params[u], &want.params[u]}}) {
      if (g->size() == w->size() && std::memcmp(g->data(), w->data(), g->size() * 4) == 0) continue;
      size_t i = 0;
      while (i < std::min(g->size(), w->size()) && std::memcmp(&(*g)[i], &(*w)[i], 4) == 0) ++i;
      fail(
          "bench step: verification failed: the {} of unit {} differ from the all-device run's "
          "at element {} ({} vs {}); not reporting a speed",
          what, pl.partition.units[u].name, i, i < g->size() ? (*g)[i] : NAN,
          i < w->size() ? (*w)[i] : NAN);
    }
}

int run_bench_step(const BenchStepArgs& a) {
  if (a.steps < 1) fail("--steps {}: at least 1", a.steps);
  if (a.rounds < 1 || a.rounds > 1000)
    fail("--rounds {}: expected 1..1000 (profile-then-steps rounds; 1 for a single run)", a.rounds);
  const int depth = prefetch_depth_flag(a.prefetch_depth, 1);
  const LlamaConfig model = bench_model(a);
  auto devices = open_cli_devices(a.devices, a.device_memory, 0);
  std::vector<Device*> ptrs;
  for (auto& d : devices) ptrs.push_back(d.get());
  auto comm = make_communicator(ptrs);
  const int R = static_cast<int>(ptrs.size());

  RunShape shape;
  shape.model = model;
  shape.ranks = R;
  shape.param_dtype = model_dtype(*ptrs.front(), "");
  shape.grad_dtype = DType::f32;
  shape.micro_batch = a.micro_batch;
  shape.seq_len = a.seq_len;
  shape.persistence_threshold =
      static_cast<uint64_t>(std::max<int64_t>(a.persistence_threshold, 0));
  shape.working_buffers = working_buffers_for(depth, model.tie_word_embeddings);
  shape.recompute = a.recompute;
  shape.offload_activations = offload_activations_flag(a.offload_activations, std::nullopt);
  shape.micro_batch_group = micro_batch_group_flag(a.micro_batch_group, a.grad_accum);

  // Swap space: the given paths, else a directory made here and removed at the end.
  std::vector<std::string> paths = a.nvme_paths;
  std::string made;
  const bool needs_nvme =
      a.offload_param == "nvme" || a.offload_optimizer == "nvme" || a.offload_gradients == "nvme";
  if (paths.empty() && needs_nvme) {
    std::string tmpl = (std::filesystem::current_path() / "strata-bench-swap-XXXXXX").string();
    if (::mkdtemp(tmpl.data()) == nullptr)
      fail("bench step: cannot make a swap directory in {}: {}; give --nvme-path DIR",
           std::filesystem::current_path().string(), std::strerror(errno));
    made = tmpl;
    paths = {made};
  }
  struct Cleanup {
    std::string dir;
    ~Cleanup() {
      std::error_code ec;
      if (!dir.empty()) std::filesystem::remove_all(dir, ec);
    }
  } cleanup{made};

  OffloadRequest request;
  apply_offload_flags(request, a.offload_param, a.offload_optimizer, a.offload_gradients);
  request.buffer_count = a.buffer_count;
  request.nvme_paths = paths;
  const TierBudgets budgets = local_budgets(ptrs.front()->memory().capacity, paths);
  const Placement placement = Placement::make(shape, request, budgets);
  placement.check(budgets);
  const Placement::OffloadedGradients grads = placement.offloaded_gradients();
  ScheduleOptions so;
  so.micro_batches = static_cast<int>(a.grad_accum);
  so.prefetch_depth = depth;
  so.update_during_backward = a.update_during_backward;
  so.reduce_per_group = a.reduce_per_group;
  const Schedule schedule = Schedule::build(placement, so);
  // The references update after the whole backward.
  ScheduleOptions ref_so = so;
  ref_so.update_during_backward = false;
  schedule.validate();

  ExecutorOptions eo;
  eo.cpu_adam_threads = a.threads;

  // The profile: loaded once, or measured in each round just before that round's steps.
  HardwareProfile loaded;
  if (!a.hardware.empty()) loaded = HardwareProfile::load(a.hardware);
  auto measure = [&] {
    MeasureSetup ms;
    ms.devices = ptrs;
    ms.comm = comm.get();
    ms.model = model;
    ms.micro_batch = a.micro_batch;
    ms.seq_len = a.seq_len;
    ms.recompute = a.recompute;
    ms.param_dtype = shape.param_dtype;
    ms.grad_dtype = shape.grad_dtype;
    ms.nvme_paths = paths;
    ms.nvme_stripe = placement.request.nvme_stripe;
    ms.io.queue_depth = placement.request.nvme_queue_depth;
    ms.cpu_adam_threads = a.threads;
    uint64_t largest = 0;
    for (const UnitPartition& up : placement.partition.units)
      largest = std::max(largest, up.padded);
    ms.transfer_bytes = std::clamp<uint64_t>(largest * 4, 1ull << 20, 256ull << 20);
    ms.adam_elements = std::clamp<uint64_t>(largest, 1ull << 16, 1ull << 26);
    return measure_hardware(ms);
  };

  // The reference: every unit's state on the devices, or, where that does not fit, the same
  // placement of a two-layer copy against that copy's all-device run.
  OffloadRequest all_device = request;
  all_device.param = all_device.optimizer = Tier::gpu;
  auto fits = [&](const Placement& p) {
    try {
      p.check(budgets);
      return true;
    } catch (const Error&) {
      return false;
    }
  };
  // The reference runs every micro-batch through the model before the next (no groups): a
  // grouped run must give its bits too. Reducing once per group sums in another order, so its
  // reference runs the same groups.
  const bool per_group = a.reduce_per_group && shape.micro_batch_group > 1;
  RunShape ref_shape = shape;
  if (!per_group) ref_shape.micro_batch_group = 1;
  ref_shape.offload_activations = false;  // and every activation checkpoint on the devices
  const Placement ref_placement = Placement::make(ref_shape, all_device, budgets);
  const bool cut = !fits(ref_placement);
  Measured want;
  std::string verified;
  if (!cut) {
    want = run_steps(ref_placement, Schedule::build(ref_placement, ref_so), *comm, eo, a, "",
                     "reference (every state on the devices)");
    verified = fmt::format(
        "after {} steps every weight equals the all-device run's{} bit for bit", a.steps + 1,
        per_group ? fmt::format(" (groups of {} too)", shape.micro_batch_group) : "");
  } else {
    RunShape small = ref_shape;
    small.model.num_hidden_layers = std::min<int64_t>(shape.model.num_hidden_layers, 2);
    const Placement small_ref = Placement::make(small, all_device, budgets);
    if (!fits(small_ref))
      fail(
          "bench step: {} does not fit on the devices all at once, nor does a two-layer copy of "
          "it, so nothing verifies the steps; give more --device-memory or a smaller model",
          model.name);
    // The copy's gradients where the full model's are (its own budget could keep more of
    // them on the devices).
    OffloadRequest small_request = request;
    if (grads.on_nvme > 0 && grads.on_gpu == 0)
      small_request.grads = GradHome::nvme;
    else if (grads.units > 0 && (grads.on_gpu == 0 || grads.on_gpu == grads.units))
      small_request.grads = grads.on_gpu == 0 ? GradHome::cpu : GradHome::gpu;
    RunShape small_shape = small;
    small_shape.micro_batch_group = shape.micro_batch_group;
    small_shape.offload_activations = shape.offload_activations;
    const Placement small_run = Placement::make(small_shape, small_request, budgets);
    small_run.check(budgets);
    const Measured w = run_steps(small_ref, Schedule::build(small_ref, ref_so), *comm, eo, a, "",
                                 "two-layer copy, every state on the devices");
    const Measured g = run_steps(small_run, Schedule::build(small_run, so), *comm, eo, a, "",
                                 "two-layer copy, placed as asked");
    expect_same_bits(g, w, small_run);
    verified = fmt::format(
        "{} does not fit on the devices all at once, so a two-layer copy of it, placed the same "
        "way, gave its all-device run's weights bit for bit after {} steps; the full model's "
        "losses are finite, the first near ln(vocab)",
        model.name, a.steps + 1);
  }
  ExecutorOptions timed = eo;
  timed.record = true;

  // One round: a profile, then the steps it predicts, verified.
  struct Round {
    HardwareProfile profile;
    Prediction once, steady;
    double step = 0, nvme_busy = 0, overlap = 0, error = 0;
    std::vector<double> busy;  // per lane, the median over the round's steps
    uint64_t device_bytes = 0;
  };
  std::vector<Round> rounds;
  for (int r = 0; r < a.rounds; ++r) {
    Round rd;
    if (a.hardware.empty()) {
      const Clock::time_point t0 = Clock::now();
      rd.profile = measure();
      progress(t0, "round {} of {}: hardware profile measured", r + 1, a.rounds);
    } else {
      rd.profile = loaded;
    }
    // The trace is the last round's (each round's executor writes over the one before).
    const Measured got = run_steps(placement, schedule, *comm, timed, a, a.trace,
                                   fmt::format("round {} of {}", r + 1, a.rounds), !cut);
    if (!cut) {
      expect_same_bits(got, want, placement);
    } else {
      const double expect = std::log(static_cast<double>(model.vocab_size));
      if (!(std::abs(got.losses.front() - expect) <= 0.5 * expect))
        fail(
            "bench step: the first step's loss is {}, but a randomly initialised {} gives about "
            "ln({}) = {:.3f}; not reporting a speed",
            got.losses.front(), model.name, model.vocab_size, expect);
    }
    rd.once = simulate(schedule, rd.profile, 1);
    rd.steady = simulate(schedule, rd.profile, 4);
    // Beside the timed trace: the same round's prediction, to lay over it in Perfetto.
    if (!a.predicted_trace.empty() && r + 1 == a.rounds)
      write_trace(a.predicted_trace, schedule, rd.steady.timeline);
    rd.step = median(got.step_s);
    for (const auto& l : got.lane_busy_s) rd.busy.push_back(median(l));
    rd.nvme_busy = median(got.nvme_busy_s);
    rd.overlap = median(got.overlap);
    rd.device_bytes = got.device_bytes;
    rd.error = rd.step > 0 ? (rd.steady.step_s - rd.step) / rd.step : 0;
    rounds.push_back(std::move(rd));
  }
  // The round reported: the one whose error is the median (upper middle for an even count).
  std::vector<size_t> order(rounds.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(),
            [&](size_t x, size_t y) { return rounds[x].error < rounds[y].error; });
  const Round& mid = rounds[order[order.size() / 2]];
  const HardwareProfile& profile = mid.profile;
  if (!a.save_profile.empty()) {
    std::ofstream f(a.save_profile);
    f << profile.to_json() << "\n";
    if (!f) fail("--save-profile {}: cannot write it", a.save_profile);
  }
  const Prediction& once = mid.once;
  const Prediction& steady = mid.steady;
  const double step = mid.step, nvme_busy = mid.nvme_busy, overlap = mid.overlap;
  const double error = mid.error;
  const std::vector<double>& busy = mid.busy;
  const auto busiest =
      static_cast<size_t>(std::max_element(busy.begin(), busy.end()) - busy.begin());
  // The busiest resource: a lane, or the drives the NVMe lanes share (trace.h).
  const bool drive = nvme_busy > busy[busiest];
  const std::string busiest_name = drive ? "nvme (read + write)" : schedule.lanes[busiest].name();
  const double tokens =
      double(R) * double(a.micro_batch) * double(a.grad_accum) * double(a.seq_len);
  const double tflops =
      step > 0 ? tokens * model_flops_per_token(model, a.seq_len) / step / 1e12 : 0;
  std::string critical =
      steady.critical_lane >= 0 ? steady.lanes[size_t(steady.critical_lane)].lane : "-";
  if (steady.critical_lane >= 0 &&
      steady.nvme_busy_s > steady.lanes[size_t(steady.critical_lane)].busy_s)
    critical = "nvme (read + write)";
  size_t within = 0;
  for (const Round& rd : rounds) within += std::abs(rd.error) <= 0.15;

  if (a.json) {
    nlohmann::json lanes = nlohmann::json::array();
    for (size_t l = 0; l < busy.size(); ++l)
      lanes.push_back({{"lane", schedule.lanes[l].name()},
                       {"busy_s", busy[l]},
                       {"predicted_busy_s", steady.lanes[l].busy_s}});
    nlohmann::json per_round = nlohmann::json::array();
    for (const Round& rd : rounds)
      per_round.push_back({{"step_s", rd.step},
                           {"predicted_step_s", rd.steady.step_s},
                           {"prediction_error", rd.error}});
    nlohmann::json j = {
        {"model", model.name},
        {"parameters", parameter_count(model)},
        {"devices", R},
        {"offload_param", a.offload_param},
        {"offload_optimizer", a.offload_optimizer},
        {"gradients_on_gpu", grads.on_gpu},
        {"gradients_on_nvme", grads.on_nvme},
        {"verified", true},
        {"verified_on_two_layers", cut},
        {"activation_checkpointing", a.recompute},
        {"offload_activations", shape.offload_activations},
        {"micro_batch_group", shape.micro_batch_group},
        {"update_during_backward", a.update_during_backward},
        {"reduce_per_group", per_group},
        {"steps", a.steps},
        {"step_s", step},
        {"tokens_per_s", step > 0 ? tokens / step : 0},
        {"model_tflops", tflops},
        {"busiest_lane", busiest_name},
        {"nvme_busy_s", nvme_busy},
        {"overlap", overlap},
        {"device_bytes", mid.device_bytes},
        {"vocab_pieces", vocab_pieces_for(placement.shape.model)},
        {"planned_device_bytes", placement.needs().total(Tier::gpu)},
        {"planned_host_bytes", placement.needs().total(Tier::cpu)},
        {"planned_nvme_bytes", placement.needs().total(Tier::nvme)},
        {"predicted_step_s", steady.step_s},
        {"predicted_nvme_busy_s", steady.nvme_busy_s},
        {"predicted_critical_lane", critical},
        {"prediction_error", error},
        {"predicted_single_step_s", once.step_s},
        {"lanes", lanes},
        {"rounds", per_round},
        {"profile", nlohmann::json::parse(profile.to_json())},
    };
    if (a.peak_tflops > 0) j["mfu"] = tflops / a.peak_tflops;
    fmt::print("{}\n", j.dump());
    return 0;
  }
  fmt::print(
      "bench step: {} ({:.3g}M parameters) on {} {} device(s), P {} O {}, G on the GPU for {} "
      "(on NVMe for {}) of {} offloaded-optimizer units, micro-batch {} x {} tokens x {} "
      "accumulation{}{}\n",
      model.name, double(parameter_count(model)) / 1e6, R, dtype_name(shape.param_dtype),
      a.offload_param, a.offload_optimizer, grads.on_gpu, grads.on_nvme, grads.units, a.micro_batch,
      a.seq_len, a.grad_accum,
      shape.micro_batch_group > 1
          ? fmt::format(" (groups of {} run unit by unit{})", shape.micro_batch_group,
                        per_group ? ", gradients reduced once per group" : "")
          : std::string(),
      a.update_during_backward ? ", CPU Adam updating during the backward (no clipping)" : "");
  fmt::print("  verified: {}{}\n", verified,
             rounds.size() > 1 ? fmt::format(", in each of {} rounds", rounds.size()) : "");
  fmt::print("  profile: {}\n", profile.name);
  fmt::print(
      "  measured step {} (median of {}, steps overlapping), {:.0f} tokens/s, {:.3g} model "
      "TFLOP/s{}; predicted {} ({:+.1f}%)\n",
      secs(step), a.steps, step > 0 ? tokens / step : 0, tflops,
      a.peak_tflops > 0
          ? fmt::format(" = {:.1f}% of {} TFLOP/s", 100 * tflops / a.peak_tflops, a.peak_tflops)
          : std::string(),
      secs(steady.step_s), 100 * error);
  fmt::print("  device memory: {} held by the executor on the busiest device; the plan counts {}\n",
             format_bytes(mid.device_bytes), format_bytes(placement.needs().total(Tier::gpu)));
  fmt::print("  busiest {} at {:.0f}% of the step (overlap {:.2f}); predicted critical {}\n",
             busiest_name, 100 * overlap, overlap, critical);
  fmt::print("  {:<20} {:>12} {:>12}\n", "lane", "busy", "predicted");
  for (size_t l = 0; l < busy.size(); ++l)
    fmt::print("  {:<20} {:>12} {:>12}\n", schedule.lanes[l].name(), secs(busy[l]),
               secs(steady.lanes[l].busy_s));
  if (nvme_busy > 0 || steady.nvme_busy_s > 0)
    fmt::print("  {:<20} {:>12} {:>12}\n", "nvme (read + write)", secs(nvme_busy),
               secs(steady.nvme_busy_s));
  fmt::print("  one step alone (nothing overlapping): predicted {}\n", secs(once.step_s));
  if (rounds.size() > 1) {
    std::string errors;
    for (const Round& rd : rounds) errors += fmt::format(" {:+.1f}%", 100 * rd.error);
    fmt::print(
        "  rounds (profile, then steps): {}; errors{}; the median round is reported; within "
        "15%: {} of {}\n",
        rounds.size(), errors, within, rounds.size());
  }
  if (!a.trace.empty()) fmt::print("  trace: {}\n", a.trace);
  if (!a.predicted_trace.empty()) fmt::print("  predicted trace: {}\n", a.predicted_trace);
  return 0;
}

}  // namespace

Command add_bench_step(CLI::App& bench) {
  auto a = std::make_shared<BenchStepArgs>();
  CLI::App* cmd = bench.add_subcommand(
      "step",
      "training steps through the executor with state in the tiers asked for, verified against "
      "the all-device run, beside the simulator's prediction from a profile measured here");
  cmd->add_option("--model", a->model, "preset or checkpoint directory (its config is used)")
      ->capture_default_str();
  cmd->add_option("--hidden", a->hidden, "override the model's hidden size");
  cmd->add_option("--intermediate", a->intermediate, "override the model's MLP size");
  cmd->add_option("--layers", a->layers, "override the model's layer count");
  cmd->add_option("--vocab", a->vocab, "override the model's vocabulary size");
  add_vocab_pieces_option(cmd, a->vocab_pieces);
  cmd->add_option("--devices", a->devices, "host:N, cuda or cuda:0,1")->capture_default_str();
  cmd->add_option("--device-memory", a->device_memory, "cap of each device's memory");
  cmd->add_option("--offload-param", a->offload_param, "none, cpu or nvme")->capture_default_str();
  cmd->add_option("--offload-optimizer", a->offload_optimizer, "none, cpu or nvme")
      ->capture_default_str();
  add_gradients_option(cmd, a->offload_gradients);
  cmd->add_option("--nvme-path", a->nvme_paths,
                  "swap directories (default: a temporary one here, removed at the end)")
      ->delimiter(',');
  cmd->add_option("--micro-batch", a->micro_batch, "sequences per device")->capture_default_str();
  cmd->add_option("--grad-accum", a->grad_accum, "micro-batches per step")->capture_default_str();
  cmd->add_option("--seq-len", a->seq_len, "tokens per sequence")->capture_default_str();
  cmd->add_option("--prefetch-depth", a->prefetch_depth, "units fetched ahead")
      ->capture_default_str();
  cmd->add_option("--peak-tflops", a->peak_tflops,
                  "the device's peak (e.g. a large matmul's rate) to report MFU against");
  add_checkpointing_option(cmd, a->recompute);
  add_offload_activations_option(cmd, a->offload_activations);
  add_micro_batch_group_option(cmd, a->micro_batch_group);
  add_update_during_backward_option(cmd, a->update_during_backward);
  add_reduce_per_group_option(cmd, a->reduce_per_group);
  cmd->add_option("--buffer-count", a->buffer_count,
                  "pinned buffers carrying units between NVMe, host and device")
      ->capture_default_str();
  cmd->add_option("--persistence-threshold", a->persistence_threshold,
                  "units of at most this many elements stay whole on every device")
      ->capture_default_str();
  cmd->add_option("--steps", a->steps, "timed steps (after one warm-up)")->capture_default_str();
  cmd->add_option("--rounds", a->rounds,
                  "measure the profile and time the steps this many times, alternating; the "
                  "round with the median prediction error is reported")
      ->capture_default_str();
  cmd->add_option("--threads", a->threads, "CPU Adam threads (0: every CPU)");
  cmd->add_option("--hardware", a->hardware, "a profile JSON to predict from instead of measuring");
  cmd->add_option("--save-profile", a->save_profile, "write the measured profile JSON here");
  cmd->add_option("--trace", a->trace,
                  "write the timed run's Chrome/Perfetto trace JSON here (with --rounds, the last "
                  "round's)");
  cmd->add_option("--predicted-trace", a->predicted_trace,
                  "write the simulator's timeline of the same round (4 steps from a standing "
                  "start, as predicted from its profile) as trace JSON here");
  cmd->add_flag("--json", a->json, "one JSON object");
  return {cmd, [a] { return run_bench_step(*a); }};
}

}  // namespace strata::cli
