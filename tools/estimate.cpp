// estimate.cpp: `strata estimate`, the memory each offload option needs per tier, from the
// model's shape alone: nothing is allocated and no hardware is consulted.
//
// Each row is a Placement (src/tier/placement.h) for one of DeepSpeed's offload choices, so
// the figures are the ones `strata plan` checks and the executor allocates: besides the model
// states DeepSpeed's estimate_zero3_model_states_mem_needs counts, they include the GPU
// working buffers and activations, the pinned staging buffers and the NVMe swap files.
// Also home of run_shape_for(), the model/GPUs/batch/dtype part of a run that `strata plan`
// reads from the same flags.
#include "commands.h"
#include "device_args.h"
#include "core/bytes.h"
#include "core/error.h"
#include "tier/placement.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>

namespace strata::cli {

RunShape run_shape_for(const std::string& model, int gpus, int64_t micro_batch, int64_t seq_len,
                       const std::string& dtype) {
  RunShape s;
  s.model = resolve_model(model);
  if (gpus < 1) fail("--gpus {}: at least 1", gpus);
  s.ranks = gpus;
  s.micro_batch = micro_batch;
  // Without --seq-len: the model's context, at most 4096 tokens (what fine-tuning runs use).
  s.seq_len = seq_len > 0 ? seq_len : std::min<int64_t>(s.model.max_position_embeddings, 4096);
  if (dtype != "bf16" && dtype != "f16" && dtype != "f32")
    fail("--dtype '{}' is not one of bf16, f16, f32", dtype);
  s.param_dtype = parse_dtype(dtype);
  s.grad_dtype = DType::f32;  // the accumulators, whatever the parameters' dtype
  return s;
}

OptimizerType optimizer_flag(const std::string& flag, OptimizerType config) {
  if (flag.empty()) return config;
  if (flag == "adam" || flag == "adamw") return OptimizerType::adam;
  if (flag == "lion") return OptimizerType::lion;
  if (flag == "adagrad") return OptimizerType::adagrad;
  fail("--optimizer '{}' is not one of adamw, adam, lion, adagrad", flag);
}

namespace {

using nlohmann::json;

struct EstimateArgs {
  std::string model;
  int gpus = 1;
  int64_t micro_batch = 1;
  int64_t seq_len = 0;
  std::string dtype = "bf16";
  std::string optimizer;
  bool recompute = true;  // --activation-checkpointing
  std::string offload_activations;
  int64_t micro_batch_group = kUnsetFlag;
  bool json = false;
};

struct Option {
  const char* name;
  Tier param, optimizer;
  GradHome grads;
};

// DeepSpeed's choices, from everything on the GPU to everything on NVMe, the gradients of an
// offloaded optimizer where DeepSpeed's ZeRO-3 keeps their f32 partitions: in host RAM beside
// an optimizer offloaded to the CPU (strata's --offload-gradients cpu), swapped out to NVMe
// beside one offloaded to NVMe (its optimizer swapper's swap_out_gradients; strata's
// --offload-gradients nvme).
constexpr Option kOptions[] = {
    {"none", Tier::gpu, Tier::gpu, GradHome::cpu},
    {"optimizer->cpu", Tier::gpu, Tier::cpu, GradHome::cpu},
    {"optimizer->nvme", Tier::gpu, Tier::nvme, GradHome::nvme},
    {"params+optimizer->cpu", Tier::cpu, Tier::cpu, GradHome::cpu},
    {"params+optimizer->nvme", Tier::nvme, Tier::nvme, GradHome::nvme},
};

// DeepSpeed's word for a device: "none" for the GPU (not offloaded).
std::string offload_name(Tier t) {
  return t == Tier::gpu ? "none" : std::string(tier_name(t));
}

int run_estimate(const EstimateArgs& a) {
  RunShape shape = run_shape_for(a.model, a.gpus, a.micro_batch, a.seq_len, a.dtype);
  shape.optimizer = optimizer_flag(a.optimizer);
  shape.recompute = a.recompute;
  shape.offload_activations = offload_activations_flag(a.offload_activations, std::nullopt);
  shape.micro_batch_group = static_cast<int>(count_flag(
      "--micro-batch-group", a.micro_batch_group, 1, "micro-batches run unit by unit at once"));
  json rows = json::array();
  std::vector<std::vector<std::string>> table;
  for (const Option& o : kOptions) {
    OffloadRequest r;
    r.param = o.param;
    r.optimizer = o.optimizer;
    r.grads = o.grads;
    // A stand-in drive: the swap files' size depends only on the stripe and the path count.
    r.nvme_paths = {"nvme"};
    const Placement p = Placement::make(shape, r, TierBudgets{});
    const TierBytes t = p.needs();
    rows.push_back({{"option", o.name},
                    {"offload_param", offload_name(o.param)},
                    {"offload_optimizer", offload_name(o.optimizer)},
                    {"offload_gradients", grad_home_name(o.grads)},
                    {"gpu_per_device", t.to_json(Tier::gpu)},
                    {"cpu", t.to_json(Tier::cpu)},
                    {"nvme", t.to_json(Tier::nvme)},
                    {"pinned_buffers", p.pinned_buffers},
                    {"pinned_buffer_bytes", p.pinned_buffer_bytes},
                    {"pinned_bytes", p.pinned_need()}});
    table.push_back({o.name, format_bytes(t.total(Tier::gpu)),
                     format_bytes(t.at(Tier::gpu, StateKind::activations)),
                     format_bytes(t.total(Tier::gpu) * uint64_t(shape.ranks)),
                     format_bytes(t.total(Tier::cpu)), format_bytes(p.pinned_need()),
                     format_bytes(t.total(Tier::nvme))});
  }
  if (a.json) {
    fmt::print("{}\n", rows.dump(2));
    return 0;
  }
  fmt::print(
      "memory per tier: {} ({:.2f}B parameters), {} GPU(s), micro-batch {} x {} tokens{}{}, {} "
      "parameters, f32 gradient accumulators, fp32 {} ({} B per parameter)\n",
      shape.model.name, double(parameter_count(shape.model)) / 1e9, shape.ranks, shape.micro_batch,
      shape.seq_len,
      shape.micro_batch_group > 1
          ? fmt::format(" (activations of {} run unit by unit)", shape.micro_batch_group)
          : std::string(),
      shape.offload_activations ? ", activation checkpoints in host RAM" : "",
      dtype_name(shape.param_dtype),
      shape.optimizer == OptimizerType::adam   ? "Adam"
      : shape.optimizer == OptimizerType::lion ? "Lion"
                                               : "Adagrad",
      optimizer_state_bytes(shape.optimizer));
  const char* header[] = {"offload",    "gpu/device", "activations", "gpu (node)",
                          "cpu (node)", "pinned",     "nvme (node)"};
  fmt::print("  {:<28}", header[0]);
  for (int c = 1; c < 7; ++c) fmt::print(" {:>12}", header[c]);
  fmt::print("\n");
  for (const auto& row : table) {
    fmt::print("  {:<28}", row[0]);
    for (size_t c = 1; c < row.size(); ++c) fmt::print(" {:>12}", row[c]);
    fmt::print("\n");
  }
  fmt::print(
      "gpu/device includes the working buffers (2 gathered units) and activations; cpu includes "
      "the pinned staging buffers; pinned is what must be page-locked (buffers and, with "
      "pin_memory, the host-homed state); nvme is the swap files (1 MiB stripes). The "
      "gradients of an offloaded optimizer are where DeepSpeed keeps them (f32): in host RAM "
      "beside an optimizer on the CPU, in the swap files beside one on NVMe; `strata plan` "
      "keeps them on the GPUs where they fit (--offload-gradients auto), in host RAM while it "
      "has room, and checks a choice against this machine's budgets.\n");
  return 0;
}

}  // namespace

Command add_estimate(CLI::App& app) {
  CLI::App* cmd = app.add_subcommand(
      "estimate",
      "Memory per tier (GPU, CPU, pinned, NVMe) for each offload option, activations and "
      "buffers included");
  auto a = std::make_shared<EstimateArgs>();
  cmd->add_option("--model", a->model, "Hugging Face checkpoint directory or preset name")
      ->required();
  cmd->add_option("--gpus", a->gpus, "GPUs the state is partitioned over (default 1)");
  cmd->add_option("--micro-batch", a->micro_batch, "sequences per GPU per micro-batch (default 1)");
  cmd->add_option("--seq-len", a->seq_len,
                  "tokens per sequence (default: the model's context, at most 4096)");
  cmd->add_option("--dtype", a->dtype, "parameter dtype: bf16 (default), f16 or f32");
  cmd->add_option("--optimizer", a->optimizer,
                  "adamw or adam (default), lion or adagrad: the optimizer state's bytes");
  add_checkpointing_option(cmd, a->recompute);
  add_offload_activations_option(cmd, a->offload_activations);
  add_micro_batch_group_option(cmd, a->micro_batch_group);
  cmd->add_flag("--json", a->json, "print an array of objects, one per offload option");
  return {cmd, [a] { return run_estimate(*a); }};
}

}  // namespace strata::cli
