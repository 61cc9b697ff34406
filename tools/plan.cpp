// plan.cpp: `strata plan`, a training run sized and predicted before it spends a GPU-hour.
//
// From the model, a DeepSpeed config and/or flags (flags win), and the hardware (a profile
// from `strata tune`, or budgets given as flags with assumed rates), it makes the Placement,
// checks it against every tier's budget, builds the step's Schedule and simulates it. Nothing
// is allocated and no GPU is touched, so it answers for llama2-70b on a laptop. A placement
// that does not fit is an Error holding the check's table (exit status 1).
//
// Budgets a flag does not give come from this machine: GPU memory from its first GPU (an
// error without one), host RAM as 80% of what /proc/meminfo says is available (the rest is
// the OS's, the page cache's and the data loader's), the pinned limit from `ulimit -l`, NVMe
// as the free space of the nvme paths. Rates without --hardware are an assumed machine (see
// assumed_profile), and the output says so.
#include "commands.h"
#include "device_args.h"
#include "core/bytes.h"
#include "core/error.h"
#include "core/log.h"
#include "core/system.h"
#include "gpu/runtime.h"
#include "schedule/schedule.h"
#include "schedule/simulator.h"
#include "tier/placement.h"
#include "train/ds_config.h"
#include "train/trainer.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>

namespace strata::cli {
namespace {

using nlohmann::json;

struct PlanArgs {
  std::string model;
  std::string config;
  std::string offload_param, offload_optimizer, offload_gradients;
  std::vector<std::string> nvme_paths;
  int64_t micro_batch = kUnsetFlag, grad_accum = kUnsetFlag, seq_len = kUnsetFlag;
  int64_t prefetch_depth = kUnsetFlag;
  bool recompute = true;  // --activation-checkpointing
  std::string offload_activations;
  int64_t micro_batch_group = kUnsetFlag;
  bool update_during_backward = false;
  bool reduce_per_group = false;
  std::string dtype, grad_dtype, optimizer;
  int64_t persistence_threshold = -1;
  int64_t vocab_pieces = 0;
  std::string hardware;
  int gpus = 0;
  std::string gpu_memory, cpu_memory, nvme, pinned_memory;
  bool print_schedule = false;
  bool json = false;
};

// An H100 SXM on PCIe 4.0 x16 with PCIe 4.0 NVMe drives, as achieved rates rather than data
// sheet peaks: 400 TFLOP/s of bf16 matmuls (40% of the 989 dense peak), 25 GB/s of pinned
// copies each way (of 32), 20 GB/s per rank for collectives through PCIe peer traffic, CPU
// Adam at 3e9 elements/s (a memory-bound update of ~30 bytes an element on a ~100 GB/s
// socket), the statistics pass at 2e10, Adam on the GPU at 5e10 (HBM-bound) and its
// statistics pass at 5e11 (one f32 read an element where Adam moves 20 bytes), and per drive
// 6.5 GB/s reads and 4.5 GB/s writes (striping adds drives' bandwidth), copies within the GPU
// at 1.5 TB/s (each byte read and written in its 3.35 TB/s HBM), 10 us per task.
HardwareProfile assumed_profile(int drives) {
  HardwareProfile h;
  h.name = fmt::format("assumed: H100, PCIe 4.0 x16, {} NVMe drive(s) at 6.5/4.5 GB/s",
                       std::max(drives, 1));
  h.gpu_flops = 400e12;
  h.h2d_bytes_per_s = 25e9;
  h.d2h_bytes_per_s = 25e9;
  h.comm_bytes_per_s = 20e9;
  h.adam_elements_per_s = 3e9;
  h.stats_elements_per_s = 2e10;
  h.gpu_adam_elements_per_s = 5e10;
  h.gpu_stats_elements_per_s = 5e11;
  h.nvme_read_bytes_per_s = 6.5e9 * std::max(drives, 1);
  h.nvme_write_bytes_per_s = 4.5e9 * std::max(drives, 1);
  h.device_copy_bytes_per_s = 1.5e12;
  h.task_latency_s = 10e-6;
  return h;
}

// "2x3.5TB" (drives x size each) or "3.5TB" (one drive).
std::pair<int, uint64_t> parse_nvme(const std::string& text) {
  const size_t x = text.find_first_of("xX");
  if (x == std::string::npos) return {1, parse_bytes(text)};
  int n = 0;
  try {
    size_t used = 0;
    n = std::stoi(text.substr(0, x), &used);
    if (used != x) n = 0;
  } catch (const std::exception&) {
    n = 0;
  }
  if (n < 1)
    fail("--nvme '{}': expected DRIVESxSIZE such as 2x3.5TB, or one SIZE such as 3.5TB", text);
  return {n, parse_bytes(text.substr(x + 1))};
}

// "154.571 s", "3.214 ms", "12.0 us": a duration readable at every scale.
std::string seconds(double s) {
  if (s >= 1.0) return fmt::format("{:.3f} s", s);
  if (s >= 1e-3) return fmt::format("{:.3f} ms", s * 1e3);
  return fmt::format("{:.1f} us", s * 1e6);
}

json lanes_json(const Prediction& p) {
  json lanes = json::array();
  for (const LaneTime& l : p.lanes) lanes.push_back({{"lane", l.lane}, {"busy_s", l.busy_s}});
  return lanes;
}

int run_plan(const PlanArgs& a) {
  // ---- what to run: config first, flags over it ----
  const std::optional<DsConfig> ds = load_cli_config(a.config);
  const HardwareProfile* file_profile = nullptr;
  HardwareProfile loaded;
  if (!a.hardware.empty()) {
    loaded = HardwareProfile::load(a.hardware);
    file_profile = &loaded;
  }
  const CudaRuntime& cuda = cuda_runtime();
  int gpus = a.gpus;
  if (gpus == 0) gpus = cuda.gpus.empty() ? 1 : static_cast<int>(cuda.gpus.size());
  if (gpus < 1) fail("--gpus {}: at least 1", gpus);

  const LlamaConfig model = resolve_model(a.model);
  DsPlanSettings cfg;
  if (ds) cfg = ds_plan_settings(*ds, gpus, model);
  const auto [micro, accum] = resolve_batch(ds, cfg.batch, gpus, a.micro_batch, a.grad_accum);
  std::string dtype = a.dtype;
  if (dtype.empty())
    dtype = cfg.param_dtype ? std::string(dtype_name(*cfg.param_dtype)) : std::string("bf16");
  RunShape shape = run_shape_for(
      a.model, gpus, micro, count_flag("--seq-len", a.seq_len, 0, "tokens per sequence"), dtype);
  // As `strata train` takes it: the flag, else the config's data_types.grad_accum_dtype.
  shape.grad_dtype = grad_dtype_for(a.grad_dtype, cfg.grad_dtype, shape.param_dtype,
                                    a.config.empty() ? "config" : a.config);
  apply_vocab_pieces(a.vocab_pieces, shape.model);
  shape.optimizer = optimizer_flag(a.optimizer, cfg.optimizer);
  if (a.update_during_backward)
    check_update_during_backward(ds ? ds->gradient_clipping.value_or(0.0) : 0.0, shape.param_dtype,
                                 "gradient_clipping in " + a.config);
  if (a.persistence_threshold >= 0)
    shape.persistence_threshold = static_cast<uint64_t>(a.persistence_threshold);
  else if (cfg.persistence_threshold)
    shape.persistence_threshold = *cfg.persistence_threshold;
  const int depth = prefetch_depth_flag(a.prefetch_depth, cfg.prefetch_depth.value_or(1));
  shape.working_buffers = working_buffers_for(depth, shape.model.tie_word_embeddings);
  shape.recompute = a.recompute;
  shape.offload_activations =
      offload_activations_flag(a.offload_activations, cfg.offload_activations);
  shape.micro_batch_group = micro_batch_group_flag(a.micro_batch_group, accum);

  OffloadRequest request = cfg.offload;
  apply_offload_flags(request, a.offload_param, a.offload_optimizer, a.offload_gradients);
  if (!a.nvme_paths.empty()) request.nvme_paths = a.nvme_paths;

  // ---- budgets ----
  TierBudgets budgets;
  if (!a.gpu_memory.empty()) {
    budgets.gpu_memory = parse_bytes(a.gpu_memory);
  } else if (!cuda.gpus.empty()) {
    budgets.gpu_memory = cuda.gpus.front().total_memory;
  } else {
    fail(
        "no GPU here to size the plan for ({}); give --gpu-memory SIZE per GPU, e.g. "
        "--gpus 4 --gpu-memory 24GiB",
        cuda.status);
  }
  budgets.cpu_memory = !a.cpu_memory.empty()
                           ? budget_flag("--cpu-memory", a.cpu_memory, "host RAM", "256GiB")
                           : uint64_t(double(memory_info().available) * kSafeRamFraction);
  if (!a.pinned_memory.empty())
    budgets.pinned_limit =
        budget_flag("--pinned-memory", a.pinned_memory, "page-locked memory", "64GiB");
  else
    budgets.pinned_limit = can_lock_past_limit() ? kUnlimited : memlock_limit();
  int drives = static_cast<int>(request.nvme_paths.size());
  if (!a.nvme.empty()) {
    const auto [n, each] = parse_nvme(a.nvme);
    if (!request.nvme_paths.empty() && static_cast<int>(request.nvme_paths.size()) != n)
      fail("--nvme {} names {} drive(s) but {} nvme path(s) are given; make them agree", a.nvme, n,
           request.nvme_paths.size());
    budgets.nvme_free = each * static_cast<uint64_t>(n);
    drives = n;
    // Drives this machine may not have: stand-in paths, only their number matters here.
    if (request.nvme_paths.empty())
      for (int i = 0; i < n; ++i) request.nvme_paths.push_back(fmt::format("nvme{}", i));
  } else if (!request.nvme_paths.empty()) {
    budgets.nvme_paths = nvme_path_space(request.nvme_paths);
    budgets.nvme_free = nvme_free_space(request.nvme_paths);
  }

  // ---- place, check, schedule, simulate ----
  const Placement placement = Placement::make(shape, request, budgets);
  placement.check(budgets);  // throws the table: nothing below runs for a plan that does not fit
  ScheduleOptions so;
  so.micro_batches = static_cast<int>(accum);
  so.prefetch_depth = depth;
  so.update_during_backward = a.update_during_backward;
  so.reduce_per_group = a.reduce_per_group;
  const Schedule schedule = Schedule::build(placement, so);
  schedule.validate();
  const HardwareProfile profile = file_profile ? *file_profile : assumed_profile(drives);
  const Prediction pred = simulate(schedule, profile);
  const double tokens = double(gpus) * double(micro) * double(accum) * double(shape.seq_len);
  const double tokens_per_s = pred.step_s > 0 ? tokens / pred.step_s : 0;
  const std::string critical =
      pred.critical_lane >= 0 ? pred.lanes[size_t(pred.critical_lane)].lane : std::string("-");

  if (a.json) {
    const TierBytes t = placement.needs();
    json tiers = json::object();
    for (Tier tier : {Tier::gpu, Tier::cpu, Tier::nvme})
      tiers[std::string(tier_name(tier))] = t.to_json(tier);
    json homes = json::array();
    for (size_t u = 0; u < placement.homes.size(); ++u)
      homes.push_back({{"unit", placement.partition.units[u].name},
                       {"param", tier_name(placement.homes[u].param)},
                       {"grad", tier_name(placement.homes[u].grad)},
                       {"optimizer", tier_name(placement.homes[u].optimizer)}});
    const json out = {
        {"model", shape.model.name},
        {"gpus", gpus},
        {"micro_batch", micro},
        {"grad_accum", accum},
        {"seq_len", shape.seq_len},
        {"dtype", dtype},
        {"grad_dtype", dtype_name(shape.grad_dtype)},
        {"vocab_pieces", vocab_pieces_for(shape.model)},
        {"prefetch_depth", schedule.prefetch_depth},
        {"activation_checkpointing", shape.recompute},
        {"offload_activations", shape.offload_activations},
        {"micro_batch_group", shape.micro_batch_group},
        {"update_during_backward", a.update_during_backward},
        {"reduce_per_group", a.reduce_per_group},
        {"budgets",
         {{"gpu_memory", budgets.gpu_memory},
          {"cpu_memory", budgets.cpu_memory},
          {"pinned_limit", budgets.pinned_limit},
          {"nvme_free", budgets.nvme_free}}},
        {"memory", tiers},
        {"homes", homes},
        {"pinned_buffers", placement.pinned_buffers},
        {"pinned_buffer_bytes", placement.pinned_buffer_bytes},
        {"pinned_bytes", placement.pinned_need()},
        {"hardware", profile.name},
        {"assumed", file_profile == nullptr},
        {"schedule", {{"tasks", schedule.tasks.size()}, {"lanes", schedule.lanes.size()}}},
        {"step_s", pred.step_s},
        {"tokens_per_s", tokens_per_s},
        {"critical_lane", critical},
        {"overlap", pred.overlap},
        {"lanes", lanes_json(pred)},
        {"ignored_config_keys", ds ? json(ds->ignored) : json::array()},
    };
    fmt::print("{}\n", out.dump(2));
    return 0;
  }

  fmt::print("{}", placement.str());
  fmt::print("budgets: gpu {} per device, cpu {}, pinned {}, nvme {}\n",
             format_bytes(budgets.gpu_memory), format_bytes(budgets.cpu_memory),
             budgets.pinned_limit == kUnlimited ? std::string("unlimited")
                                                : format_bytes(budgets.pinned_limit),
             format_bytes(budgets.nvme_free));
  fmt::print("{}", schedule.summary());
  if (a.print_schedule) fmt::print("{}", schedule.str());
  fmt::print("hardware: {}{}\n", profile.name,
             file_profile ? ""
                          : " (pass --hardware profile.json from `strata tune` for measured "
                            "rates)");
  fmt::print(
      "predicted step: {} for {:.0f} tokens ({} GPU(s) x {} x {} micro-batch(es) x {}), "
      "{:.0f} tokens/s\n",
      seconds(pred.step_s), tokens, gpus, micro, accum, shape.seq_len, tokens_per_s);
  fmt::print("critical lane: {} (busy {:.0f}% of the step)\n", critical, 100.0 * pred.overlap);
  for (const LaneTime& l : pred.lanes) fmt::print("  {:<18} busy {}\n", l.lane, seconds(l.busy_s));
  return 0;
}

}  // namespace

Command add_plan(CLI::App& app) {
  CLI::App* cmd = app.add_subcommand(
      "plan",
      "Place, check, schedule and simulate a training run without allocating it: memory per "
      "tier, pinned buffers, the step's schedule and its predicted time");
  auto a = std::make_shared<PlanArgs>();
  cmd->add_option("--model", a->model, "Hugging Face checkpoint directory or preset name")
      ->required();
  cmd->add_option("--config", a->config,
                  "DeepSpeed JSON config (zero_optimization offload, batch sizes, precision)");
  cmd->add_option("--offload-param", a->offload_param,
                  "where parameter shards live: none, cpu, nvme or auto (overrides --config)");
  cmd->add_option("--offload-optimizer", a->offload_optimizer,
                  "where optimizer state lives: none, cpu, nvme or auto (overrides --config)");
  add_gradients_option(cmd, a->offload_gradients);
  cmd->add_option("--nvme-path", a->nvme_paths, "NVMe directories, one per drive")->delimiter(',');
  cmd->add_option("--micro-batch", a->micro_batch, "sequences per GPU per micro-batch");
  cmd->add_option("--grad-accum", a->grad_accum, "micro-batches per optimizer step");
  cmd->add_option("--seq-len", a->seq_len, "tokens per sequence");
  cmd->add_option("--prefetch-depth", a->prefetch_depth, "units fetched ahead of use (default 1)");
  add_checkpointing_option(cmd, a->recompute);
  add_offload_activations_option(cmd, a->offload_activations);
  add_micro_batch_group_option(cmd, a->micro_batch_group);
  add_update_during_backward_option(cmd, a->update_during_backward);
  add_reduce_per_group_option(cmd, a->reduce_per_group);
  cmd->add_option("--dtype", a->dtype, "parameter dtype: bf16, f16 or f32");
  cmd->add_option("--optimizer", a->optimizer,
                  "adamw or adam, lion or adagrad: the optimizer state's bytes (default: the "
                  "config's optimizer.type, else adam)");
  cmd->add_option("--grad-dtype", a->grad_dtype,
                  "gradients and their accumulators: f32 (default; the config's "
                  "data_types.grad_accum_dtype where it sets it), or the parameters' bf16/f16 "
                  "(half the memory of both, for runs that accumulate little)");
  add_vocab_pieces_option(cmd, a->vocab_pieces);
  cmd->add_option("--persistence-threshold", a->persistence_threshold,
                  "units of at most this many elements stay whole on every GPU (100000)");
  cmd->add_option("--hardware", a->hardware,
                  "hardware profile JSON (`strata tune`); default: an assumed H100 machine");
  cmd->add_option("--gpus", a->gpus, "GPUs (default: this machine's, or 1)");
  cmd->add_option("--gpu-memory", a->gpu_memory, "memory per GPU, e.g. 24GiB");
  cmd->add_option("--cpu-memory", a->cpu_memory,
                  "host RAM the run may use (default: 80% of what is available)");
  cmd->add_option("--nvme", a->nvme,
                  "NVMe drives and free space each, e.g. 2x3.5TB (default: free space of "
                  "--nvme-path)");
  cmd->add_option("--pinned-memory", a->pinned_memory,
                  "page-locked memory allowed (default: ulimit -l)");
  cmd->add_flag("--print-schedule", a->print_schedule, "print every task of the step");
  cmd->add_flag("--json", a->json, "print the plan as JSON");
  return {cmd, [a] { return run_plan(*a); }};
}

}  // namespace strata::cli
