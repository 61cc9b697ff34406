// trainer.h: the training loop behind `strata train` (DESIGN §3): batches from the data
// loader, one executor step per optimizer step with the learning rate, loss scale and clipping
// of that step, metrics to RUN/metrics.jsonl, checkpoints (checkpoint.h), and resume.
//
// The one thing to know before editing: everything a resumed run needs to continue bit for bit
// is in the checkpoint: the optimizer state (and through it the parameters), the step, the
// number of updates applied (Adam's step count and the LR schedule's index; an fp16 step
// skipped for overflow advances neither), the data loader's position and the loss scaler's
// state. Anything new that changes a later step must be saved there too.
#pragma once

#include "cpu_adam/cpu_adam.h"
#include "model/config.h"
#include "model/tokens.h"
#include "tier/placement.h"
#include "train/data_loader.h"
#include "train/loss_scaler.h"
#include "train/lr_schedule.h"
#include "train/monitor.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace strata {

class Device;

// Every setting of a run, resolved (config file, flags, defaults) by the command line.
struct TrainSettings {
  std::string model;         // Hugging Face directory or preset name
  bool init_random = false;  // initialise instead of loading weights
  uint64_t seed = 1;         // weights (with init_random) and data order
  std::vector<std::filesystem::path> data;
  std::optional<TokenWidth> data_width;  // raw token files; empty: llm.c shards
  bool loss_masks = true;  // read the loss masks beside the token files (TokenSequences)
  Packing packing = Packing::wrapped;  // how sequences are cut, training and held-out alike
  // Held-out data (same format as `data`): its sequences in order, the loss over them every
  // eval_every steps (0: only after the last step) and after the last step.
  std::vector<std::filesystem::path> eval_data;
  int64_t eval_every = 0;
  int64_t eval_sequences = 0;  // at most this many of them (0: all)
  std::filesystem::path run_dir;
  int64_t steps = 0;  // optimizer steps, in all (a resumed run counts the ones done)
  int64_t micro_batch = 1, grad_accum = 1, seq_len = 0;
  DType dtype = DType::f32;
  // The working gradients and their accumulators (RunShape::grad_dtype): f32, or the
  // parameters' 16-bit dtype (half the memory of both, for runs that accumulate little).
  DType grad_dtype = DType::f32;
  int64_t vocab_pieces = 0;  // LlamaConfig::vocab_pieces (0: chosen)
  AdamParams adam;           // lr is the schedule's base; each step's lr comes from `schedule`
  // Weight decay on the 1-D tensors too (StepParams::decay_every_parameter): where the
  // DeepSpeed config's optimizer section makes the optimizer, as it does under DeepSpeed.
  bool decay_every_parameter = false;
  LrSchedule schedule;
  LossScaleSettings scaling;
  double max_grad_norm = 0;  // 0: no clipping
  OffloadRequest offload;
  int prefetch_depth = 1;
  bool recompute = true;             // activation checkpointing (RunShape::recompute)
  bool offload_activations = false;  // checkpoints in host RAM (RunShape::offload_activations)
  int micro_batch_group = 1;         // RunShape::micro_batch_group
  // CPU Adam updates each unit once its gradients are final (ScheduleOptions::
  // update_during_backward); needs max_grad_norm 0 and no fp16 loss scaling.
  bool update_during_backward = false;
  // Gradients reduced once per micro-batch group (ScheduleOptions::reduce_per_group).
  bool reduce_per_group = false;
  uint64_t persistence_threshold = 100000;
  uint64_t cpu_memory = 0;     // budget of host RAM (0: 80% of what is available)
  uint64_t pinned_memory = 0;  // page-locked bytes allowed (0: `ulimit -l`); never above it
  int cpu_adam_threads = 0;
  int64_t save_every = 0;  // 0: only at the end
  int keep = 3;            // complete checkpoints kept (0: all)
  bool resume = false;
  bool resume_fallback = false;  // resume from the newest intact checkpoint, skipping damaged ones
  // With resume: the checkpoint directory (or run directory, for its newest) to continue from
  // instead of run_dir's newest (resume_checkpoint_at); empty: run_dir's. Checkpoints of
  // run_dir past it are set aside; one of another run needs a run_dir holding no run.
  std::filesystem::path resume_from;
  int64_t steps_per_print = 10;
  std::string trace;        // Chrome trace of the last step run, when set
  MonitorSettings monitor;  // TensorBoard and CSV files of each step's scalars (monitor.h)
  nlohmann::json echo;      // the resolved settings, saved in every checkpoint
};

// Refuses CPU Adam updating during the backward (TrainSettings::update_during_backward) with
// gradient clipping (`max_grad_norm` > 0, set by `clip_from`) or fp16 loss scaling, both of
// which need every gradient before any unit is updated: an Error names the setting and what to
// change. `strata train` and `strata plan` check the same way.
void check_update_during_backward(double max_grad_norm, DType dtype, const std::string& clip_from);

// Trains on `devices` (the ranks). Returns the last step's mean loss. Throws Error naming
// what failed; a placement that does not fit is refused before anything is allocated.
double train(const TrainSettings& settings, const std::vector<Device*>& devices);

}  // namespace strata
