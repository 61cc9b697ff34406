// ds_config.h: a DeepSpeed JSON config (the file users already pass to `deepspeed`), read into
// plain data.
//
// Strict where it matters: a key strata acts on with a wrong type or value is an Error that
// names its JSON path (`zero_optimization.offload_optimizer.device`), the value and what is
// accepted. `"auto"` (what Hugging Face's Trainer integration writes and fills in itself) is
// accepted where that integration writes it and read as "unset" (an empty std::optional), for
// the caller to resolve from its flags and defaults. Keys strata does not act on are not an
// error: their JSON paths are collected in `ignored`, for the caller to print once. Every
// field is optional: absent and "auto" both leave it empty, so the caller's flags, then
// DeepSpeed's defaults, decide.
#pragma once

#include "tier/placement.h"
#include "train/monitor.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace strata {

// offload_param.max_in_cpu's default in DeepSpeed (OffloadParamConfig): 1e9 elements a rank.
inline constexpr uint64_t kDeepSpeedMaxInCpu = 1'000'000'000;

// zero_optimization.offload_param / offload_optimizer.
struct DsOffload {
  std::optional<Tier> device;           // "none" | "cpu" | "nvme"
  bool device_auto = false;             // "auto" (strata's): placed within the budgets
  std::vector<std::string> nvme_path;   // a string, or (strata) a list of drives
  std::optional<bool> pin_memory;       // DeepSpeed's default: false
  std::optional<int> buffer_count;      // DeepSpeed's default: 5 (param), 4 (optimizer)
  std::optional<uint64_t> buffer_size;  // elements (offload_param)
  // elements per rank (offload_param with device nvme or auto; elsewhere listed as ignored)
  std::optional<uint64_t> max_in_cpu;
  bool present = false;  // the section was in the file
};

struct DsConfig {
  std::string source;  // the file, for messages

  std::optional<int64_t> train_batch_size;
  std::optional<int64_t> train_micro_batch_size_per_gpu;
  std::optional<int64_t> gradient_accumulation_steps;
  std::optional<double> gradient_clipping;  // 0: no clipping
  std::optional<int64_t> steps_per_print;

  std::optional<bool> bf16_enabled;  // bf16.enabled (or bfloat16.enabled)
  // data_types.grad_accum_dtype: "fp32", "bf16" or "fp16", the dtype gradients accumulate in.
  std::optional<DType> grad_accum_dtype;
  struct Fp16 {
    std::optional<bool> enabled;
    std::optional<double> loss_scale;  // 0: dynamic
    std::optional<int> initial_scale_power;
    std::optional<int64_t> loss_scale_window;
    std::optional<int> hysteresis;
    std::optional<bool> consecutive_hysteresis;
    std::optional<double> min_loss_scale;
  } fp16;

  struct Optimizer {
    // The config has an optimizer section: DeepSpeed builds the optimizer from it, over every
    // parameter in one group, so its weight decay reaches the norm weights and biases too (as
    // Hugging Face's Trainer hands DeepSpeed every parameter when the section is there).
    bool present = false;
    // "Adam", "AdamW", "Lion" or "Adagrad" (any case, as DeepSpeed), with the params each of
    // DeepSpeed's constructors takes (Lion: no eps, adam_w_mode or bias_correction; Adagrad: no
    // betas, adam_w_mode or bias_correction, lr_decay 0); another is refused, naming it.
    std::optional<std::string> type;
    std::optional<double> lr;
    std::optional<std::array<double, 2>> betas;
    std::optional<double> eps;
    std::optional<double> weight_decay;
    // DeepSpeed's Adam is AdamW unless params.adam_w_mode is false (its default is true).
    std::optional<bool> adam_w_mode;
    // params.bias_correction (DeepSpeed's CPU and fused Adam take it; default true). amsgrad true
    // is refused: neither of DeepSpeed's Adams runs it.
    std::optional<bool> bias_correction;
    // AdamW, Lion, or Adam with adam_w_mode true or unset (Adagrad: false, L2 decay).
    bool decoupled_weight_decay() const;
    OptimizerType optimizer_type() const;  // adam without a type

  } optimizer;

  struct Scheduler {
    // WarmupLR | WarmupDecayLR | WarmupCosineLR | OneCycle | LRRangeTest
    std::optional<std::string> type;
    std::optional<double> warmup_min_lr, warmup_max_lr;
    std::optional<int64_t> warmup_num_steps, total_num_steps;
    std::optional<std::string> warmup_type;                 // "log" | "linear"
    std::optional<double> warmup_min_ratio, cos_min_ratio;  // WarmupCosineLR
    // Given as "auto", which Hugging Face fills from its flags (learning_rate, warmup_steps),
    // where absent means DeepSpeed's default.
    bool warmup_max_lr_auto = false, warmup_num_steps_auto = false;
    // OneCycle (the stair counts are read and checked, and not acted on, as in DeepSpeed, whose
    // OneCycle keeps them without using them).
    std::optional<double> cycle_min_lr, cycle_max_lr, decay_lr_rate;
    std::optional<int64_t> cycle_first_step_size, cycle_second_step_size, decay_step_size;
    std::optional<bool> cycle_momentum;
    std::optional<double> cycle_min_mom, cycle_max_mom, decay_mom_rate;
    // LRRangeTest.
    std::optional<double> lr_range_test_min_lr, lr_range_test_step_rate;
    std::optional<int64_t> lr_range_test_step_size;
    std::optional<bool> lr_range_test_staircase;
  } scheduler;

  struct Zero {
    std::optional<int> stage;  // 0..3; strata always partitions as stage 3
    DsOffload offload_param, offload_optimizer;
    std::optional<uint64_t> stage3_prefetch_bucket_size;         // elements
    std::optional<uint64_t> stage3_max_live_parameters;          // elements
    std::optional<uint64_t> stage3_param_persistence_threshold;  // elements
  } zero;

  struct Aio {
    std::optional<uint64_t> block_size;  // bytes
    std::optional<int> queue_depth;
  } aio;

  // activation_checkpointing.cpu_checkpointing: the activation checkpoints in host RAM
  // (RunShape::offload_activations). The section's other keys (partition_activations,
  // contiguous_memory_optimization, number_checkpoints, ...) are Megatron's model-parallel
  // settings and are listed as ignored.
  std::optional<bool> cpu_checkpointing;

  // The "tensorboard" and "csv_monitor" sections (enabled, output_path, job_name); absent:
  // disabled, as in DeepSpeed.
  MonitorSettings monitor;
  std::vector<std::string> ignored;  // JSON paths of keys strata does not act on
  std::vector<std::string> autos;    // JSON paths of the values given as "auto"
  bool is_auto(std::string_view path) const {
    return std::find(autos.begin(), autos.end(), path) != autos.end();
  }
};

// `source` names the file in errors.
DsConfig parse_ds_config(const nlohmann::json& json, std::string_view source);
DsConfig load_ds_config(const std::filesystem::path& path);

// The batch arithmetic DeepSpeed does: train_batch_size = micro × accumulation × world. With
// all three given they must agree (an Error names the three and the product); with two the
// third is derived (it must divide evenly); with only train_batch_size, accumulation is 1;
// with none, both stay unset.
struct DsBatch {
  std::optional<int64_t> micro_batch, grad_accum;
};
DsBatch resolve_ds_batch(const DsConfig& config, int world);

// What `strata plan` and `strata train` take from a config, unset where the config leaves
// it to them.
struct DsPlanSettings {
  OffloadRequest offload;  // devices, nvme paths (both sections', in order, once each), ...
  DsBatch batch;
  // bf16 / f16 when enabled; f32 when a section says enabled false and neither is on (as
  // DeepSpeed, whose default is fp32); unset when neither section says (or both say "auto").
  std::optional<DType> param_dtype;
  std::optional<DType> grad_dtype;  // data_types.grad_accum_dtype
  std::optional<uint64_t> persistence_threshold;
  // stage3_prefetch_bucket_size is how many elements DeepSpeed fetches ahead; strata fetches
  // whole units, so the depth is bucket ÷ the largest unit's elements, at least 1 and at most
  // 4 (deeper only costs working buffers once transfers keep up), and within
  // stage3_max_live_parameters: (depth + 1) units of the largest size at most.
  std::optional<int> prefetch_depth;
  std::optional<bool> offload_activations;        // activation_checkpointing.cpu_checkpointing
  OptimizerType optimizer = OptimizerType::adam;  // optimizer.type: the state's bytes
};
DsPlanSettings ds_plan_settings(const DsConfig& config, int world, const LlamaConfig& model);

}  // namespace strata
