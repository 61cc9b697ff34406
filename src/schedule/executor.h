// executor.h: runs a Schedule for real (DESIGN §1, §3): the model state where the Placement
// puts it, one host thread per lane, the step's numbers exact whatever the placement.
//
// Construction allocates everything, once: the ZeRO-3 state that lives on the devices (a
// ZeroModel whose units keep P and G resident only where the placement homes them on the
// GPU), the optimizer state (fp32 master, m, v) on the devices or in host RAM, host P and G,
// one PinnedPool holding the host state (with request.pin_memory) and every staging buffer,
// a SwapStore over the nvme paths with every NVMe-homed shard added up front, and the device
// staging buffers that carry off-device shards to the gathers and reduce-scattered gradients
// to the host. Staging buffers are assigned to tasks before the first step and checked
// against the schedule's dependencies: a buffer is reused only by a task that the
// dependencies order after every task reading the buffer's previous contents. The schedule's
// own choice (Task::slot for landing buffers, Task::buffer for pinned ones) is taken when it
// passes that check, else the first free buffer, else a new one; memory() reports the counts.
// Every pinned staging buffer has one size, the largest transfer through one (the placement's
// pinned_buffer_bytes when its buffer_size is unset: the executor does not split transfers).
//
// Replicated units are used in place; their backward takes a working gradient buffer from
// the ZeroModel (the first rank's backward takes it for all) and their all-reduce returns it.
//
// Steps overlap (DESIGN §3.4). One host thread per lane lives as long as the executor and runs
// that lane's tasks step after step, in schedule order, each once its dependencies of this step
// and its `prev` dependencies of the previous step are done: so the next step's forward of unit
// u starts as soon as unit u's update is written, under the rest of this step's optimizer.
// step() releases its step to the lanes and returns as soon as the step's loss and gradient
// norm are known (every task before the optimizer's is done); the optimizer's tasks (optim_read,
// adam, optim_write, param_write, param_upload, param_d2h) may still be running then. At most
// two steps are in flight: step() first waits for the step before the previous one. Everything
// that reads or writes the model state outside a step (parameters(), optimizer_state(),
// evaluate(), load(), timeline(), ...) first waits for every step to end (finish()); memory()
// does not (what it reports is fixed at construction). Besides
// the schedule's own `prev` dependencies, a staging buffer's first writer in a step waits for
// the buffer's last users in the previous step. A GPU-lane task queues its work on its rank's
// stream for that lane and synchronises that stream before it counts as done. A group
// (collective) runs once, from the lane of its last-arriving member, as one ZeroModel call over
// every rank's comm stream. The SwapStore is shared by the nvme.read and nvme.write lanes
// behind one mutex. The first exception stops every lane; the next call rethrows it naming the
// task (for an optimizer task, that may be the next step()), and the executor refuses further
// steps (its state is then undefined). A step's gradients are zeroed by its unit's Adam task,
// once the update has read them.
//
// StepResult's times are those of the step's period: from the previous step() returning (or
// from this step's release when nothing was in flight) to this one returning. Its lane busy
// times are what each lane ran within that period, whichever step the tasks belonged to, so
// in a run of steps they add up to the run's lane busy times, and the overlap is the busiest
// lane's share of the period (what the simulator's steady state predicts).
//
// Exactness (DESIGN §3.3): gradient statistics per (unit, rank) shard (replicated units: rank
// 0's copy only), added in (unit, rank) order into one GradStats; the combined gradient scale
// from it; then Adam on every shard with the same scale, by CpuAdam on the host or the kernel
// table's adam_update on the device, which give the same bits. A non-finite step changes no
// weight or optimizer state and zeroes the gradients.
#pragma once

#include "core/device.h"
#include "cpu_adam/cpu_adam.h"
#include "nvme/io_ring.h"
#include "partition/communicator.h"
#include "schedule/schedule.h"
#include "schedule/trace.h"
#include "tier/placement.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace strata {

class SafetensorsReader;
class PinnedPool;

struct ExecutorOptions {
  int cpu_adam_threads = 0;  // CpuAdam's threads; 0: every CPU of this process
  bool record = false;       // keep every task's start and end (timeline(), trace())
  // The swap store's I/O. Its stripe and queue depth are the placement's (aio.block_size and
  // aio.queue_depth: the placement sizes the swap files by that stripe); the rest is here.
  nvme::IoOptions io;
  // Page-locked bytes allowed (0: no limit): a pinned pool larger than this is refused, naming
  // both, before it is allocated.
  uint64_t pinned_limit = 0;
};

// One rank's sequences of one micro-batch, in host memory: batch × seq_len ids and targets.
struct HostBatch {
  std::vector<int32_t> ids, targets;
  // Empty: one document per sequence. Else, beside ids, where each token's document starts in
  // its sequence, for documents packed together (LlamaModel::forward's doc_start).
  std::vector<int32_t> doc_start;
  int64_t batch = 0;
};

struct StepParams {
  int64_t step = 1;  // Adam's step count, from 1
  AdamParams adam;
  // Weight decay on every parameter, as DeepSpeed's own optimizer (a config's optimizer
  // section) applies it; false: not on the 1-D tensors (norm weights, biases), as Hugging Face's
  // Trainer groups the parameters when it makes the optimizer.
  bool decay_every_parameter = false;
  float loss_scale = 1.0f;
  float max_grad_norm = 0.0f;  // <= 0: no clipping
};

struct StepResult {
  double loss = 0;                  // mean over every non-ignored target of the step
  double grad_norm = 0;             // of the unscaled gradients (before clipping)
  bool skipped = false;             // non-finite gradients: nothing was updated
  double step_s = 0;                // the step's period (see the comment above)
  std::vector<double> lane_busy_s;  // per lane of the schedule, within the period
  double nvme_busy_s = 0;           // the drives': the NVMe lanes' union (see trace.h)
  double overlap = 0;               // max(busiest lane, nvme_busy_s) / step_s
};

// A forward-only pass over held-out batches.
struct EvalResult {
  double loss_sum = 0;  // summed over every non-ignored target
  int64_t targets = 0;  // the targets counted
  double seconds = 0;
  double loss() const { return loss_sum / static_cast<double>(std::max<int64_t>(targets, 1)); }
};

// What the executor allocated, for tests and logs.
struct ExecutorMemory {
  uint64_t pinned_capacity = 0;
  uint64_t pinned_peak = 0;
  uint64_t pinned_allocations = 0;  // blocks the pool has handed out since construction
  int device_param_staging = 0;     // per rank
  int device_grad_staging = 0;      // per rank
  int pinned_staging = 0;
  // Per device, what the executor allocates beyond the ZeroModel, the models and the staging
  // above: the step's token ids and targets, the gradient chunk sums, the updated-parameter
  // buffer of a device optimizer whose parameters live off the device.
  uint64_t device_extra_bytes = 0;
  // The swap store's own bounce buffers (pinned, not in the placement): 0 while every buffer
  // the executor hands the store is page aligned, which it is by construction.
  uint64_t swap_bounce_bytes = 0;
};

// One unit's optimizer state, each the unit's element count (padding dropped), f32.
struct UnitOptimizerState {
  std::vector<float> master, m, v;
};

class Executor {
 public:
  // `comm` spans placement.shape.ranks devices. Throws Error when the schedule does not
  // belong to the placement, or when anything does not fit (naming the device or tier).
  // A placement without training state (RunShape::training off) takes a forward-only
  // schedule and allocates the parameters alone: no gradients, optimizer state or CPU Adam.
  // Such an executor loads, evaluates and reads parameters; step(), master() and the
  // optimizer state are refused with an Error.
  Executor(const Placement& placement, const Schedule& schedule, Communicator& comm,
           const ExecutorOptions& options = {});
  ~Executor();
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  // P from init_unit_random's bits (or a checkpoint) wherever it lives; master = P in f32;
  // m = v = 0; G = 0.
  void init_random(uint64_t seed);
  void load(const SafetensorsReader& reader);

  // batches[m][r]: micro-batch m of rank r. Throws Error (naming the task) when a task fails.
  StepResult step(const std::vector<std::vector<HostBatch>>& batches, const StepParams& params);

  // The loss of the current parameters on batches[m][r] (as step() takes them): the step's
  // schedule built forward-only (ScheduleOptions::forward_only), run on the same lanes through
  // the same staging buffers, so the parameters come from wherever they live and nothing is
  // written. Throws Error (naming the task) when a task fails.
  EvalResult evaluate(const std::vector<std::vector<HostBatch>>& batches);

  // Generation, with a placement of RunShape::kv_cache: runs `ids`, the tokens at positions
  // [pos, pos + ids.size()) of one sequence, through the forward-only schedule against the
  // keys and values cached by earlier calls (positions [0, pos); a smaller pos starts again
  // from there), and returns the logits of the last of them ([vocab], valid until the next
  // call). Rank 0 computes; every rank takes part in the gathers. Throws Error naming a bad
  // position or token id.
  const std::vector<float>& decode(const std::vector<int32_t>& ids, int64_t pos);

  // Unit u's parameters (or fp32 master weights) assembled from every rank's shard, as f32.
  std::vector<float> parameters(int u) const;
  // The same into `out`, reusing its capacity when the parameters live on the host; and, with
  // `next` a unit (not -1), unit next's shards start coming from NVMe (where they live there)
  // into a block of the executor's while the caller works on unit u, so that the call for
  // `next` finds them read: a checkpoint writes a unit to its file while the next is read.
  void parameters(int u, std::vector<float>& out, int next = -1) const;
  std::vector<float> master(int u) const;
  // Unit u's optimizer state assembled from every rank's shard, wherever it lives; and its
  // inverse for resuming: the state goes to its homes, the parameters become the master
  // rounded to their dtype (what every Adam step leaves them as) and the gradients zero.
  UnitOptimizerState optimizer_state(int u) const;
  // The same into `out`, whose vectors keep their capacity.
  void optimizer_state(int u, UnitOptimizerState& out) const;
  // Unit u's optimizer state where it lies, for a writer to copy from without assembling it:
  // master, m and v (parts[0], [1], [2]) each as its pieces in order, one per shard (the
  // padding left out), in host RAM (the shards themselves) or in a block of the executor's
  // (read from NVMe, or copied from the GPUs). Valid until the next call on the executor; the
  // block is freed by the next step(), evaluate() or finish(). `next` reads ahead as
  // parameters()'s does: a checkpoint writes one unit's state while the next is read.
  struct OptimizerStateView {
    std::array<std::vector<std::span<const float>>, 3> parts;
  };
  OptimizerStateView optimizer_state_view(int u, int next = -1) const;
  // What goes to NVMe is written behind: the call returns once the state is staged, and the
  // writes run while the caller reads the next unit; the next call, step() or finish() waits
  // for them (and throws their error).
  void set_optimizer_state(int u, const UnitOptimizerState& state);

  // Waits for every step in flight, and every write set_optimizer_state() left running, to
  // end; throws Error (naming the task or the shard) when one failed.
  void finish();
  // Every recorded task (ExecutorOptions::record) of every step run so far; waits for them.
  const Timeline& timeline() const;
  void trace(const std::string& path) const;
  ExecutorMemory memory() const;
  const Schedule& schedule() const { return schedule_; }
  const Placement& placement() const { return placement_; }

 private:
  struct State;
  // Runs the forward-only schedule (built on first use) that evaluate() and decode() share.
  void run_forward_only();
  Placement placement_;
  Schedule schedule_;
  mutable Timeline timeline_;
  std::unique_ptr<State> s_;
};

}  // namespace strata
