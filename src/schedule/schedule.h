// schedule.h: one training step as plain data: tasks on lanes, with dependencies (DESIGN §1).
//
// The builder compiles a placement, a number of micro-batches and a prefetch depth into the
// tasks of one step, in an order that is a valid sequential execution: every dependency of a
// task comes earlier in `tasks`. Each lane runs its tasks in that order. This makes every
// schedule deadlock-free by construction (the earliest unfinished task overall always has its
// dependencies done and is first on its lane), and validate() checks it.
//
// Steps repeat. A task's `prev` dependencies name tasks of the previous step's instance of
// the same schedule: this is how the next step's forward of unit u waits only for unit u's
// update (DESIGN §3.4) and how buffers reused across steps are ordered. In the first step they
// are satisfied from the start.
//
// Lanes (DESIGN §1): gpu[i].compute, gpu[i].h2d, gpu[i].d2h, gpu[i].comm, cpu.adam,
// nvme.read, nvme.write. A collective is one task per rank on each rank's comm lane, the
// tasks sharing a `group`: they start together (when all of them are ready) and finish
// together. The executor runs the group as one call; the simulator occupies every lane of the
// group for its duration.
//
// Neither the executor nor the simulator builds schedules: both read this.
#pragma once

#include "tier/placement.h"

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace strata {

enum class LaneKind { compute, h2d, d2h, comm, cpu_adam, nvme_read, nvme_write };
std::string_view lane_kind_name(LaneKind k);  // "compute", "h2d", ..., "cpu.adam", ...

struct Lane {
  LaneKind kind = LaneKind::compute;
  int device = -1;           // GPU lanes: the rank; cpu.adam and nvme lanes: -1
  std::string name() const;  // "gpu[0].compute", "cpu.adam", "nvme.read"
  bool operator==(const Lane&) const = default;
};

enum class TaskKind {
  // parameters, before a unit's forward or backward
  param_read,       // nvme.read: P[u] shards of every rank from NVMe into pinned buffers
  param_h2d,        // gpu[r].h2d: P[u][r] from its host home (or a pinned buffer) to the GPU
  gather,           // gpu[r].comm: all-gather unit u into a working buffer (group)
  forward,          // gpu[r].compute: unit u's forward for micro-batch m
  backward,         // gpu[r].compute: recompute, then unit u's backward for micro-batch m
  reduce_scatter,   // gpu[r].comm: unit u's working gradients summed into G[u] shards (group)
  grad_d2h,         // gpu[r].d2h: the reduce-scattered shard to its host home (G home cpu)
  grad_accumulate,  // cpu.adam: G[u] += the shard brought by grad_d2h (micro-batches > 1)
  grad_stats,       // cpu.adam or gpu[r].compute: unit u's share of the global norm/overflow
  // G home nvme: G[u] of every rank between NVMe and a pinned buffer
  grad_write,  // nvme.write: the step's gradients so far to NVMe (after each micro-batch)
  grad_read,   // nvme.read: G[u] back, to add a micro-batch's gradients to, or for CPU Adam
  // optimizer, once the global norm is known, in forward order (or, with
  // ScheduleOptions::update_during_backward, each unit once its gradients are final)
  grad_offload,  // gpu[r].d2h: G[u][r], summed on the GPU, into a pinned buffer for CPU Adam
                 // (G home gpu, O on the host; replicated units: rank 0 only)
  optim_read,    // nvme.read: O[u] shards (master, m, v) from NVMe into pinned buffers
  adam,          // cpu.adam (or gpu[r].compute when O is on the GPU): update O[u], write P[u]
  optim_write,   // nvme.write: O[u] back to NVMe
  param_write,   // nvme.write: updated P[u] to NVMe (P home nvme)
  param_upload,  // gpu[r].h2d: updated P[u][r] to its GPU home (P home gpu, O on the host)
  param_d2h,     // gpu[r].d2h: updated P[u][r] to its host home or a pinned buffer (P home cpu
                 // or nvme while O is on the GPU)
  // activation checkpoints in host RAM (RunShape::offload_activations), block u's input
  act_d2h,  // gpu[r].d2h: to the host, after the forward that wrote it (micro-batch m)
  act_h2d,  // gpu[r].h2d: back into its slot of the GPU's ring, before backward(u, m)
};
inline constexpr int kTaskKinds = static_cast<int>(TaskKind::act_h2d) + 1;
std::string_view task_kind_name(TaskKind k);

struct Task {
  int id = 0;  // index in Schedule::tasks
  TaskKind kind = TaskKind::forward;
  int lane = 0;          // index in Schedule::lanes
  int unit = -1;         // model unit
  int rank = -1;         // GPU-lane tasks: the rank; -1 for host-wide tasks
  int micro_batch = -1;  // forward/backward and what serves them; -1 for the optimizer
  int group = -1;        // collectives: the tasks of one call share it; -1 otherwise
  // The GPU working buffer (0..working_buffers-1) a gather fills (and the param_h2d before it
  // lands in), or a reduce-scatter, or one rank's grad_d2h, reads the unit's working gradients
  // from; -1 otherwise.
  int slot = -1;
  // The pinned host buffer (0..pinned_buffers-1) the task writes or reads; -1 when none.
  int buffer = -1;
  // The work, for the simulator: bytes moved (transfers; collectives: what one rank moves in
  // a ring, (R-1)/R of the unit; with one rank, what the device copies in its own memory:
  // nothing for a gather, which uses the unit where it lies, nor for a reduce-scatter whose
  // grad_d2h reads the working gradients; the gradients into a staging shard, or, added to a
  // resident shard in place, 1.5 times their bytes: an add reads two and writes one), FLOPs
  // (compute), elements updated (Adam, grad stats).
  uint64_t bytes = 0;
  // Collectives: bytes the rank also writes in its own memory, at the device's copy rate, not
  // the link's: the unit's working gradients zeroed (by a gather for a backward, or after a
  // reduce-scatter that the next backward of the same group waits for).
  uint64_t local_bytes = 0;
  double flops = 0;
  uint64_t elements = 0;
  std::vector<int> deps;  // ids of tasks of this step, each < id
  std::vector<int> prev;  // ids of tasks of the previous step
};

// FLOPs of a unit's forward for `batch` sequences of `seq_len` tokens: the matmuls (2 per
// multiply-add) and causal attention (QKᵀ and PV over half the keys on average); the head's
// (each vocabulary piece's) logits of its rows; the embedding counts 0.
double unit_forward_flops(const LlamaConfig& config, const UnitLayout& unit, int64_t batch,
                          int64_t seq_len);
// FLOPs of unit u's backward task: the two gradients' matmuls are twice the forward's, and with
// `recompute` (activation checkpointing) the forward runs again first: 3× the forward. Without
// it a block's backward is 2× (the norms and SwiGLU it redoes are not counted), while the head
// still recomputes its logits chunk by chunk (3×).
double unit_backward_flops(const LlamaConfig& config, const UnitLayout& unit, int64_t batch,
                           int64_t seq_len, bool recompute);

struct ScheduleOptions {
  int micro_batches = 1;   // gradient accumulation steps
  int prefetch_depth = 1;  // units fetched ahead of use (bounded by the placement's buffers)
  // Evaluation: each micro-batch's forwards and the fetches and gathers that feed them; no
  // backward, gradients or optimizer, so the model state is read and never written.
  bool forward_only = false;
  // Each unit whose optimizer is on the host (CPU Adam) is updated as soon as its gradients are
  // final, in backward order under the rest of the backward, instead of after the whole
  // backward in forward order. Only without gradient clipping, which needs the global norm
  // before any update: the executor refuses a step with max_grad_norm > 0, and a non-finite
  // gradient stops the run instead of skipping the step (units are updated already).
  bool update_during_backward = false;
  // With micro-batch groups (RunShape::micro_batch_group > 1): each unit's working gradients
  // sum the group's micro-batches on every GPU, and are reduce-scattered (all-reduced for a
  // replicated unit) once per group, after its last backward, instead of once per micro-batch.
  // A group of G sends 1/G of the gradient traffic over the GPUs' links (and, with gradients
  // on the host, over PCIe), at the cost of the bits: each element sums the micro-batches
  // before the ranks, so the result differs from G = 1 in rounding (placements still agree
  // with each other bit for bit).
  bool reduce_per_group = false;
};

struct Schedule {
  std::vector<Lane> lanes;
  std::vector<Task> tasks;
  ScheduleOptions options;
  int ranks = 1;
  int units = 0;
  // An adam task's work per element relative to Adam's, which a profile's optimizer rates are
  // measured on: the update is memory-bound (`strata bench adam`), so the ratio of its bytes a
  // parameter, gradient + state read and written + the copy: 1 for Adam; for Lion and Adagrad
  // (8 bytes of state, Adam's 12) 22 / 30 with f32 gradients and a 16-bit copy.
  double optimizer_cost = 1.0;
  int working_buffers = 0;  // the placement's, that `slot` indexes
  int pinned_buffers = 0;   // the placement's, that `buffer` indexes
  int prefetch_depth = 0;   // effective: min(options.prefetch_depth, working_buffers - 1)
  // Effective: min(the placement's RunShape::micro_batch_group, options.micro_batches).
  // Micro-batches g*G .. g*G+G-1 run unit by unit: forward(u, m) for every m of the group
  // before forward(u + 1, ·), then the backwards likewise; micro-batch m's activations are
  // in set m % G of the model's (ModelOptions::activation_sets).
  int micro_batch_group = 1;

  // The rules are in schedule.cpp's header comment. Throws Error, naming the setting and its
  // value, when the placement cannot be scheduled (too few pinned or working buffers, homes
  // that contradict each other, micro_batches < 1, a training schedule from a placement that
  // holds parameters only, ...).
  static Schedule build(const Placement& placement, const ScheduleOptions& options);

  // Throws Error naming the first task that breaks a rule: a dependency not earlier, an
  // unknown lane or task id, a group whose tasks differ in kind or unit or share a lane or are
  // not consecutive, a task on a lane of the wrong kind, a slot or buffer out of range.
  void validate() const;
  // The tasks of one lane, in order.
  std::vector<int> lane_tasks(int lane) const;
  int lane_index(const Lane& lane) const;  // -1 when absent
  // One line per task ("  17 gpu[0].comm gather u=3 m=0 deps=[12,15] prev=[40]"), for
  // `strata plan --print-schedule` and for diffs in tests; and a per-lane summary.
  std::string str() const;
  std::string summary() const;
};

}  // namespace strata
