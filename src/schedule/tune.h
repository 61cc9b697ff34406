// tune.h: the search behind `strata tune`: candidate configurations of a run (where parameters
// and optimizer state live, micro-batch and accumulation, prefetch depth, pinned buffers), each
// placed and checked against this machine's budgets and, where it fits, simulated on a
// hardware profile; and the best one written as a DeepSpeed config.
//
// Every candidate is what `strata train` would build from the config written for it: the same
// Placement (RunShape, OffloadRequest), checked by the same Placement::check, and the same
// Schedule, simulated to its steady state as `strata plan` simulates it: the executor runs the
// next step's forward of a unit as soon as its update is written (DESIGN §3.4), so a step alone
// would charge a run for an optimizer that overlaps the next step's forwards. Runs of
// many micro-batches are simulated at kMaxSimulatedAccum and the step time extrapolated by the
// cost of one more micro-batch (measured between half that and it), which keeps llama2-70b
// with a large global batch to seconds.
#pragma once

#include "schedule/simulator.h"
#include "tier/placement.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace strata {

// What to search over.
struct TuneSpace {
  LlamaConfig model;
  int ranks = 1;
  DType param_dtype = DType::bf16;
  DType grad_dtype = DType::f32;
  OptimizerType optimizer = OptimizerType::adam;  // RunShape::optimizer: its state's bytes
  int64_t seq_len = 0;
  // Sequences per optimizer step over all ranks (DeepSpeed's train_batch_size): micro-batches
  // are its divisors and accumulation makes up the rest. 0: not fixed; accumulation is 1 and
  // the micro-batch goes up to max_micro_batch.
  int64_t global_batch = 0;
  int64_t max_micro_batch = 16;
  uint64_t persistence_threshold = 100000;
  std::vector<Tier> param_tiers{Tier::gpu, Tier::cpu, Tier::nvme};
  std::vector<Tier> optimizer_tiers{Tier::gpu, Tier::cpu, Tier::nvme};
  std::vector<int> prefetch_depths{1, 2, 3};
  std::vector<int> buffer_counts{4, 8};  // pinned buffers, when something lives off the devices
  // Activation checkpointing choices (RunShape::recompute): on needs less GPU memory, off a
  // third fewer FLOPs per block.
  std::vector<bool> recompute{true, false};
  // Activation checkpoints in host RAM (RunShape::offload_activations), with recompute only:
  // less GPU memory (room for a larger micro-batch, or for the state) for two copies of each
  // block's input over PCIe a micro-batch. Kept on the GPU is tried first; without a profile
  // (whether anything fits) only the last choice, the least GPU memory, is.
  std::vector<bool> offload_activations{false, true};
  // Micro-batch groups (RunShape::micro_batch_group) where a step accumulates: each micro-batch
  // on its own (1) and, with `whole_step_groups`, the whole step as one group, each unit then
  // fetched once for the step's forwards and once for its backwards for that many
  // micro-batches' activations on the GPU, and its gradients reduced once per group
  // (ScheduleOptions::reduce_per_group).
  bool whole_step_groups = true;
  // CPU Adam during the backward (ScheduleOptions::update_during_backward): each unit whose
  // optimizer is on the host updated as soon as its gradients are final. Only without
  // gradient clipping or fp16 loss scaling (the caller checks), and a non-finite gradient then
  // stops the run instead of skipping the step, so it is tried only when asked ({false} by
  // default; {false, true} tries both). Candidates whose optimizer is on the GPU do not
  // change with it and are not tried twice.
  std::vector<bool> update_during_backward{false};
  std::vector<std::string> nvme_paths;  // none: the nvme tier is not tried
  uint64_t nvme_stripe = 1ull << 20;    // the swap store's stripe (aio.block_size)
  // The devices are host devices, whose memory is host RAM: the cpu tier and every device's
  // gpu tier must then fit in budgets.cpu_memory together.
  bool host_devices = false;
};

inline constexpr int64_t kMaxSimulatedAccum = 8;

struct TuneCandidate {
  Tier param = Tier::gpu;
  Tier optimizer = Tier::gpu;
  int64_t micro_batch = 1;
  int64_t grad_accum = 1;
  int prefetch_depth = 1;
  int buffer_count = 5;
  bool pin_memory = true;
  bool recompute = true;             // activation checkpointing
  bool offload_activations = false;  // the checkpoints in host RAM
  int micro_batch_group = 1;
  bool update_during_backward = false;  // CPU Adam under the backward (TuneSpace)

  bool fits = false;
  std::string why_not;  // every tier over its budget: needed and available bytes
  TierBytes needs;
  uint64_t pinned_bytes = 0;  // page-locked bytes (Placement::pinned_need)
  uint64_t host_ram = 0;      // host devices: cpu tier + every device's gpu tier

  // When it fits and a profile was given:
  bool simulated = false;
  double step_s = 0;
  double tokens_per_s = 0;
  std::string critical_lane;
  double overlap = 0;         // the critical lane's busy time / the step
  bool extrapolated = false;  // grad_accum > kMaxSimulatedAccum

  // "P nvme, O cpu, micro 4 x 2, depth 2, 8 buffers[, no recompute][, activations in host
  // RAM][, groups of 2 reduced once][, Adam during the backward]" for tables and messages.
  std::string label() const;
  // DeepSpeed's word for a tier: "none" (not offloaded), "cpu", "nvme".
  static std::string offload_name(Tier t);
};

struct TuneResult {
  std::vector<TuneCandidate> ranked;  // every fitting candidate, best first
  // Per parameter/optimizer choice tried that fits at none of its settings: its smallest
  // setting (micro-batch, depth, buffers), with why_not.
  std::vector<TuneCandidate> refused;
  std::vector<std::string> skipped;  // choices not tried, and why ("nvme: no --nvme-path given")
  // Choices whose every fitting candidate places the state exactly as an earlier (simpler)
  // choice does, e.g. P cpu when every unit is under the persistence threshold and so stays on
  // the devices: "P cpu, O none places everything as P none, O none does". They are not ranked.
  std::vector<std::string> same_as;
  // Why candidates that fit could not be simulated (the profile lacks a rate they need, e.g.
  // NVMe rates measured without --nvme-path); they are not ranked.
  std::vector<std::string> unsimulated;
  int placements = 0;   // candidates placed and checked
  int simulations = 0;  // schedules simulated
};

// Places and checks every candidate (a candidate whose placement, micro-batch, accumulation and
// depth equal an earlier one's is dropped); with a profile, simulates those that fit and ranks
// them by tokens/s (within 1% of each other: fewer tiers off the devices first, then a shallower
// prefetch, fewer buffers). Without one, only whether each choice fits at its smallest setting
// (ranked: those that do, unsorted). Throws Error naming the setting for an empty or bad space (a
// global batch that is not a multiple of the ranks, nothing to try).
TuneResult tune_search(const TuneSpace& space, const TierBudgets& budgets,
                       const HardwareProfile* profile);

// The DeepSpeed config of a candidate, as `strata train --config` and DeepSpeed read it:
// batch sizes, bf16/fp16 (both false: fp32), zero_optimization stage 3 with offload_param and
// offload_optimizer (device, nvme_path, pin_memory, buffer_count),
// stage3_prefetch_bucket_size (prefetch depth × the largest unit's elements, which strata reads
// back as the depth), stage3_param_persistence_threshold, aio (block_size, queue_depth)
// when NVMe is used, and activation_checkpointing.cpu_checkpointing when the checkpoints go to
// host RAM. `queue_depth` 0: DeepSpeed's default (8) is left to the reader.
nlohmann::ordered_json tune_ds_config(const TuneSpace& space, const TuneCandidate& c,
                                      unsigned queue_depth);

}  // namespace strata
