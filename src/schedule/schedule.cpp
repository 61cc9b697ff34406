// schedule.cpp: compiles a placement into the tasks of one training step (see schedule.h).
//
// The rules Schedule::build follows (U units, R ranks, M micro-batches, W working buffers,
// B pinned buffers, d = min(prefetch_depth, W - 1)):
//
// Lanes: for each rank r gpu[r].compute, gpu[r].h2d, gpu[r].d2h, gpu[r].comm, then cpu.adam,
// nvme.read, nvme.write, in that order, keeping only the lanes that get tasks.
//
// Uses. The compute of a step is a list of uses: for each micro-batch m, forward(u) for
// u = 0..U-1, then backward(u) for u = U-1..0, one task per rank on gpu[r].compute. With
// micro-batch groups of G > 1 (RunShape::micro_batch_group), each group of G consecutive
// micro-batches runs unit by unit instead: forward(u, m) for every m of the group, u = 0..U-1,
// then backward(u, m) likewise, u = U-1..0, so each unit's uses by the group are consecutive and
// it is fetched and gathered once for them (once per group where G = 1 fetches it per
// micro-batch). A unit step is a unit's uses in one direction by one group (one use when
// G = 1). In a run of several backwards, each backward waits for every rank's reduce-scatter
// of the previous one, which has read its working gradients (the executor then clears them),
// so each micro-batch's gradients reach G[u] as they do with G = 1: the same bits. Tied
// embeddings with G > 1 need the gradients reduced once per group (below): the head's
// gradients of the whole group reach unit 0's working gradients before the embedding's of its
// first micro-batch, which only a reduction of the group's sum allows. A sharded
// unit is gathered into a working buffer for a run of consecutive uses that need it, and that
// buffer is released after the run's last compute: the head is gathered once for its forward
// and backward of the same micro-batch, and unit 0 once for backward(0, m) and forward(0, m+1).
// With tied embeddings the head reads unit 0's table: unit 0 is gathered before the head for
// forward(head) and stays gathered until backward(0) (the head adds into its gradients, which
// are reduce-scattered once, after backward(0)), as ZeroRunner does. Tied and cut into
// vocabulary pieces, head piece k reads embedding piece k (ModelLayout::table_unit), gathered
// for head piece k's uses as for its own, and its gradients are reduced after head piece k's
// backward (that reduction writes G, being the step's first) and again after its own (which
// adds, and ends them): no piece of the table stays gathered across the blocks, as the whole
// one does. Replicated units are resident on every GPU: no fetch, no gather, and they count no
// working buffer.
//
// Fetch and gather. For a gathered run of unit u: P home nvme -> param_read (nvme.read, all
// ranks' shards into one pinned buffer) then param_h2d per rank; P home cpu -> param_h2d per
// rank; P home gpu -> nothing. param_h2d lands in the rank's part of the working buffer; then
// the gather group, one task per rank on gpu[r].comm, emitted consecutively. These tasks are
// emitted before the compute of use i for every run starting at a unit step <= i's + d
// (prefetch), as long as a working buffer is free; they always are for the runs use i needs.
// The first of them (param_read, else param_h2d, else the gather) waits for the last compute of
// unit step p - d - 1, p being the step of the run's first use, so at most d + 1 units are
// fetched ahead of the compute lane: d = 0 fetches each unit after the previous compute, as
// without prefetch.
//
// Buffers. Working buffers and pinned buffers are pools handed out first-released-first
// (round-robin while every holder gives its buffer back before the next take). A task that
// first writes a buffer depends on the tasks that last used it: a gather (and the param_h2d
// landing in the buffer) on rank r on the compute task of rank r that ended the previous run
// in it (the next gather is queued behind the previous run's reduce-scatter on the same comm
// lane, and a param_h2d fills the parameter part, which the reduce-scatter does not read); a
// pinned buffer's first writers on all its last users. A pinned buffer holds one unit's shards
// of every rank (or a replicated unit's one copy). Pinned buffers carry: P[u]
// read from NVMe until every param_h2d has read it; a grad_d2h's shard for micro-batch m > 0
// until grad_accumulate added it into G (G home nvme: every micro-batch's, until it is added or
// written, and G read back from grad_read to its grad_write, or to adam); G[u] of every rank
// from its grad_offloads to adam;
// O[u] (master and moments: 12 bytes an element for Adam, 8 for Lion and Adagrad) from
// optim_read to optim_write; the updated P[u]
// from adam (or param_d2h) to param_write or the param_uploads. When both the fetches (and gradient
// staging) and the optimizer use pinned buffers and there are enough, they take from two pools:
// buffers 0..F-1 for the fetches and staging, F = min(d + 1 + what they hold at once (2 with G
// home nvme, else 1), B - what the optimizer of one unit holds at once) where that leaves them
// what they hold at once, the rest for the optimizer. Steps overlap (the next step's first fetches
// run under this step's optimizer), and a first take waits for the buffer's last users of the
// previous step: from one shared pool, the next step's first fetch would get a buffer the optimizer
// used last, near its end.
//
// Gradients. After backward(u, m): a reduce_scatter group (replicated units: the group is an
// all-reduce of the whole unit; their working gradients are one buffer per unit, so the first
// backward of micro-batch m + 1 that adds into them, the head's for a tied unit 0, waits for
// it; across steps, every task of a step but the optimizer's ends before the next step
// starts). G home gpu: the group writes G on the GPU for m == 0 and adds into it for m > 0
// (with O on the host, the first of a step waits for the previous step's grad_offload of the
// unit on its rank).
// G home cpu: grad_d2h per rank (replicated units: rank 0 only, all ranks hold the same
// sum); m == 0 writes G directly, m > 0 stages into a pinned buffer and a grad_accumulate on
// cpu.adam adds it into G. A reduce_scatter on rank r waits for that rank's previous grad_d2h (the
// reduce-scatter output on the GPU is one buffer per rank). One rank has nothing to reduce: its
// grad_d2h of a sharded unit copies the working gradients from the working buffer (its
// Task::slot), the reduce_scatter moves nothing, and the buffer's next gather (which zeroes the
// gradients; not a param_h2d, which fills its own landing buffer) waits for that grad_d2h as
// for a last user; but where a later backward of the run adds into the gradients (a micro-batch
// group reduced per micro-batch) they go through the staging as with several ranks. After the last
// micro-batch: one grad_stats per unit on cpu.adam (G home cpu; emitted right after the unit's
// gradients are final) or one per rank on gpu[r].compute (emitted after the last backward, in
// backward order).
// G home nvme (sharded units whose optimizer is on the host): every reduction's grad_d2hs stage
// into a pinned buffer (one rank: straight from the working buffer, as above). The step's first
// reduction of the unit writes it to NVMe from there (grad_write, which waits (`prev`) for the
// previous step's update to have read G back); a later one reads G back into a second buffer
// (grad_read, after the last grad_write), a grad_accumulate on cpu.adam adds the staging into
// it, and a grad_write writes it. After the last, the grad_stats reads that buffer before it is
// given back. The optimizer reads G back (grad_read into a buffer of its pool, after the last
// grad_write) for adam, as a grad_offload brings it down for G home gpu.
//
// Optimizer, u = 0..U-1: O home nvme -> optim_read, then adam (cpu.adam over all ranks'
// shards when O is on the host, else one per rank on gpu[r].compute) after every grad_stats,
// optim_write (O home nvme). O on the host with G home gpu: before adam, a grad_offload per
// rank (a replicated unit: rank 0's) on gpu[r].d2h brings the step's sum into one pinned
// buffer, which adam reads: one transfer a step where G home cpu moves one a micro-batch. P[u]: O
// host and P cpu -> adam writes it in place; O host and P gpu -> param_upload per rank; O host and
// P nvme -> param_write; O gpu and P cpu -> param_d2h per rank; O gpu and P nvme -> param_d2h per
// rank into a pinned buffer, then param_write (the adams wait for that buffer: the executor's
// adam brings the shard down itself). optim_reads run ahead, from the last micro-batch's
// backward once no param_read is left, while at least max(2, what one unit's optimizer holds)
// pinned buffers are free (what stays covers the mandatory takes: the gradients and the updated
// parameters).
//
// Update during the backward (ScheduleOptions::update_during_backward): the optimizer of a unit
// whose optimizer is on the host is emitted as soon as its gradients are final, in backward
// order, and its adam waits only for that unit's grad_stats; with G home cpu right after the
// grad_stats on cpu.adam, with G home gpu after the next backward's compute (the grad_stats
// per rank on gpu[r].compute follow it there, so the compute lane does not wait for the
// reduce-scatter). The optim_reads run ahead from the last micro-batch's backward of a unit
// for that unit and the next in backward order (param_reads may be left: they go first on the
// read lane). Units with their optimizer on the GPU are updated after the backward as before,
// each after its own grad_stats. No clipping is possible: the executor refuses a clip.
//
// Reduced once per group (ScheduleOptions::reduce_per_group): the reduce_scatter group (and what
// follows it: grad_d2h, grad_accumulate, grad_stats) comes after a unit's last backward of a
// micro-batch group only, so the group's backwards add into the same working gradients with no
// wait between them and no clearing; "m == 0" above reads "the first group" (m < G): its
// reduction writes G, the later groups' add into it.
//
// Activation checkpoints in host RAM (RunShape::offload_activations): each GPU keeps its block
// inputs (and the head's) in a ring of K = checkpoint_slots() slots per activation set, position
// p in slot p % K, so forward(v + K - 1) overwrites block v's input for v = first block ..
// first block + offloaded_checkpoints() - 1. For those v, per micro-batch m and rank r: act_d2h
// on gpu[r].d2h right after forward(v - 1, m), which wrote it, and forward(v + K - 1, m) waits
// for it; act_h2d on gpu[r].h2d right after backward(v + K, m), the last reader of the slot (the
// head's for v + K = the head), waiting for it and for the act_d2h, and backward(v, m) waits
// for the act_h2d. Each moves micro_batch x seq_len x hidden activations in param dtype. Slots
// and host copies reused by the next micro-batch of a set, or the next step, are ordered by the
// compute lane: every copy of micro-batch m is done before backward(v, m) ends, which is before
// any later forward.
//
// Forward only (evaluation): the uses are the forwards alone, fetched and gathered by the same
// rules; nothing after them; no checkpoint is copied (nothing reads one back).
//
// Next step (`prev`). The first use of P[u] in a step (its param_read, param_h2d or gather, or
// its forward when resident) waits for the previous step's last writer of P[u] (adam,
// param_write, param_upload or param_d2h); optim_read(u) for the previous optim_write(u); the
// first take of each buffer for its last users in the previous step. Everything else follows
// from lane order and these.
//
// Work. Transfers of one rank: param dtype x shard elements (grad dtype for gradients); tasks
// over all ranks sum their shards; optim_read/optim_write optimizer_state_bytes an element.
// Collectives count what one rank moves in a ring, which is what a bus bandwidth (NCCL's busbw) is
// the rate of: gather (R-1)/R of the padded unit in param dtype, reduce_scatter (R-1)/R of it in
// grad dtype, the all-reduce of a replicated unit 2(R-1)/R of it; with one rank they move nothing
// over a link (bytes: what the device copies, none for a gather, which uses the unit where it
// lies). Their local_bytes, the working gradients zeroed in the device's own memory, go at its copy
// rate, not the link's. Forward FLOPs per rank, with t = micro_batch x seq_len tokens: a block 2 x
// (its q, k, v, o, gate, up, down weights) x t + causal attention 2 x micro_batch x seq_len^2 x
// heads x head_dim (QK^T and PV are 2 x T^2 x head_dim each per head and sequence, halved by
// causality); the head 2 x vocab x hidden x t (tied or not); the embedding 0 (a lookup). backward =
// 3 x forward (recompute + twice the forward for the two gradients), 2 x for a block when the
// placement's shape turns recompute off (unit_backward_flops). adam, grad_stats, grad_accumulate:
// elements (padded shards; replicated units their numel).
#include "schedule/schedule.h"

#include "core/bytes.h"
#include "core/error.h"

#include <algorithm>
#include <array>
#include <deque>
#include <map>
#include <utility>

namespace strata {

double unit_forward_flops(const LlamaConfig& c, const UnitLayout& unit, int64_t batch,
                          int64_t seq_len) {
  const double b = static_cast<double>(batch);
  const double t = static_cast<double>(seq_len);
  const double tokens = b * t;
  if (unit.kind == UnitKind::head)
    return 2.0 * static_cast<double>(unit.vocab_rows) * static_cast<double>(c.hidden_size) * tokens;
  if (unit.kind == UnitKind::embedding) return 0;
  const double D = static_cast<double>(c.hidden_size);
  const double q = static_cast<double>(c.num_attention_heads * c.head_dim);
  const double kv = static_cast<double>(c.num_key_value_heads * c.head_dim);
  const double matmul =
      D * q + 2 * D * kv + q * D + 3 * D * static_cast<double>(c.intermediate_size);
  const double attention = 2.0 * b * t * t * static_cast<double>(c.num_attention_heads) *
                           static_cast<double>(c.head_dim);
  return 2.0 * matmul * tokens + attention;
}

double unit_backward_flops(const LlamaConfig& c, const UnitLayout& unit, int64_t batch,
                           int64_t seq_len, bool recompute) {
  const bool head = unit.kind == UnitKind::head;
  return (recompute || head ? 3.0 : 2.0) * unit_forward_flops(c, unit, batch, seq_len);
}

std::string_view lane_kind_name(LaneKind k) {
  switch (k) {
    case LaneKind::compute:
      return "compute";
    case LaneKind::h2d:
      return "h2d";
    case LaneKind::d2h:
      return "d2h";
    case LaneKind::comm:
      return "comm";
    case LaneKind::cpu_adam:
      return "cpu.adam";
    case LaneKind::nvme_read:
      return "nvme.read";
    case LaneKind::nvme_write:
      return "nvme.write";
  }
  return "?";
}

std::string Lane::name() const {
  if (device >= 0) return fmt::format("gpu[{}].{}", device, lane_kind_name(kind));
  return std::string(lane_kind_name(kind));
}

std::string_view task_kind_name(TaskKind k) {
  switch (k) {
    case TaskKind::param_read:
      return "param_read";
    case TaskKind::param_h2d:
      return "param_h2d";
    case TaskKind::gather:
      return "gather";
    case TaskKind::forward:
      return "forward";
    case TaskKind::backward:
      return "backward";
    case TaskKind::reduce_scatter:
      return "reduce_scatter";
    case TaskKind::grad_d2h:
      return "grad_d2h";
    case TaskKind::grad_accumulate:
      return "grad_accumulate";
    case TaskKind::grad_stats:
      return "grad_stats";
    case TaskKind::grad_write:
      return "grad_write";
    case TaskKind::grad_read:
      return "grad_read";
    case TaskKind::grad_offload:
      return "grad_offload";
    case TaskKind::optim_read:
      return "optim_read";
    case TaskKind::adam:
      return "adam";
    case TaskKind::optim_write:
      return "optim_write";
    case TaskKind::param_write:
      return "param_write";
    case TaskKind::param_upload:
      return "param_upload";
    case TaskKind::param_d2h:
      return "param_d2h";
    case TaskKind::act_d2h:
      return "act_d2h";
    case TaskKind::act_h2d:
      return "act_h2d";
  }
  return "?";
}

namespace {

// Whether a task of `kind` may run on a lane of `lane`.
bool lane_fits(TaskKind kind, LaneKind lane) {
  switch (kind) {
    case TaskKind::param_read:
    case TaskKind::optim_read:
    case TaskKind::grad_read:
      return lane == LaneKind::nvme_read;
    case TaskKind::optim_write:
    case TaskKind::param_write:
    case TaskKind::grad_write:
      return lane == LaneKind::nvme_write;
    case TaskKind::param_h2d:
    case TaskKind::param_upload:
    case TaskKind::act_h2d:
      return lane == LaneKind::h2d;
    case TaskKind::grad_d2h:
    case TaskKind::grad_offload:
    case TaskKind::param_d2h:
    case TaskKind::act_d2h:
      return lane == LaneKind::d2h;
    case TaskKind::gather:
    case TaskKind::reduce_scatter:
      return lane == LaneKind::comm;
    case TaskKind::forward:
    case TaskKind::backward:
      return lane == LaneKind::compute;
    case TaskKind::grad_accumulate:
      return lane == LaneKind::cpu_adam;
    case TaskKind::grad_stats:
    case TaskKind::adam:
      return lane == LaneKind::cpu_adam || lane == LaneKind::compute;
  }
  return false;
}

void sort_unique(std::vector<int>& ids) {
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
}

std::string id_list(const std::vector<int>& ids) {
  std::string s = "[";
  for (size_t i = 0; i < ids.size(); ++i) s += fmt::format("{}{}", i ? "," : "", ids[i]);
  return s + "]";
}

// A pool of interchangeable buffers, handed out first-released-first. Each buffer remembers
// the tasks that last used it (per rank for working buffers, whose users are per-rank tasks);
// a buffer not yet used in this step was last used by the previous step, which the builder
// resolves once the step is complete.
// Its buffers are numbered first, first + 1, ... (first + n - 1).
class BufferPool {
 public:
  BufferPool() = default;
  explicit BufferPool(int n, int first = 0)
      : first_(first),
        last_users_(static_cast<size_t>(n)),
        used_(static_cast<size_t>(n)),
        late_(static_cast<size_t>(n)),
        holdings_(static_cast<size_t>(n), 0) {
    for (int b = 0; b < n; ++b) free_.push_back(first + b);
  }
  int size() const { return static_cast<int>(used_.size()); }
  bool holds(int b) const { return b >= first_ && b < first_ + size(); }
  int free_count() const { return static_cast<int>(free_.size()); }
  int take() {
    const int b = free_.front();
    free_.pop_front();
    return b;
  }
  // Whether buffer b was last used in this step (else in the previous one).
  bool used_this_step(int b) const { return used_[static_cast<size_t>(b - first_)]; }
  const std::vector<int>& last_users(int b) const {
    return last_users_[static_cast<size_t>(b - first_)];
  }
  void give_back(int b, std::vector<int> users) {
    const size_t i = static_cast<size_t>(b - first_);
    last_users_[i] = std::move(users);
    used_[i] = true;
    free_.push_back(b);
    // The previous holding's late readers come before this one's users (its first writer
    // waited for them); this holding's own stay.
    std::erase_if(late_[i], [&](const Late& l) { return l.holding < holdings_[i]; });
  }
  // A working buffer's holding: counts the takes of b, so late readers know whose they are.
  void took(int b) { ++holdings_[static_cast<size_t>(b - first_)]; }
  // A reader of b's working gradients outside the computes, whose last one gives b back: one
  // rank's grad_d2h, which copies the gradients to the host from there. A later writer of the
  // gradient part (a gather that zeroes them) waits for it too.
  void add_late_reader(int b, int id) {
    const size_t i = static_cast<size_t>(b - first_);
    late_[i].push_back({id, holdings_[i]});
  }
  std::vector<int> late_readers(int b) const {
    std::vector<int> out;
    for (const Late& l : late_[static_cast<size_t>(b - first_)]) out.push_back(l.id);
    return out;
  }

 private:
  struct Late {
    int id = -1;
    int holding = 0;
  };
  int first_ = 0;
  std::deque<int> free_;
  std::vector<std::vector<int>> last_users_;
  std::vector<bool> used_;
  std::vector<std::vector<Late>> late_;
  std::vector<int> holdings_;
};

struct Use {
  bool backward = false;
  int unit = 0;
  int m = 0;
  int pos = 0;               // the unit step it belongs to: uses of one unit and direction in a
                             // micro-batch group share it (with groups of 1, the use's index)
  std::vector<int> needs;    // gathered units it reads, in gather order
  std::vector<int> compute;  // its task per rank, once emitted
};

// A run of consecutive uses of one gathered unit: one fetch, one gather, one working buffer.
struct Run {
  int unit = 0;
  int first_use = 0, last_use = 0;
  int slot = -1;
  std::vector<int> gather;  // per rank
  int prev = -1;            // the unit's run before this one, or -1
};

// A `prev` dependency that names the previous step's tasks, resolved once the step is built
// (the same tasks of this step, as every step is the same).
struct PrevFix {
  enum class What {
    param_writer,
    optim_write,
    grad_offload,
    grad_read,
    working_buffer,
    pinned_buffer
  };
  int task = 0;
  What what = What::param_writer;
  int index = 0;       // unit, or buffer
  int rank = -1;       // the user's rank; -1: wait for every last user
  bool grads = false;  // working_buffer: the task writes its gradient part (wait_for_slot)
};

class Builder {
 public:
  Builder(const Placement& placement, const ScheduleOptions& options)
      : pl_(placement),
        part_(placement.partition),
        layout_(ModelLayout::build(placement.shape.model)),
        opt_(options),
        U_(part_.num_units()),
        R_(part_.ranks),
        M_(options.micro_batches),
        G_(std::clamp(placement.shape.micro_batch_group, 1, std::max(options.micro_batches, 1))),
        W_(placement.shape.working_buffers),
        B_(placement.pinned_buffers),
        tied_(placement.shape.model.tie_word_embeddings && part_.num_units() >= 2),
        cut_table_(tied_ && layout_.vocab_pieces > 1),
        early_(options.update_during_backward && !options.forward_only),
        per_group_(options.reduce_per_group && !options.forward_only),
        ps_(dtype_size(placement.shape.param_dtype)),
        gs_(dtype_size(placement.shape.grad_dtype)),
        os_(optimizer_state_bytes(placement.shape.optimizer)),
        slots_(std::max(W_, 0)) {
    check();
    d_ = std::min(options.prefetch_depth, W_ - 1);
    // Activation checkpoints offloaded: blocks act_first_ .. act_first_ + act_n_ - 1 have their
    // input copied out after the forward before them and back K_ units ahead of their backward.
    if (!options.forward_only && placement.shape.offload_activations) {
      K_ = checkpoint_slots(placement.shape);
      act_first_ = layout_.first_block();
      act_n_ = offloaded_checkpoints(placement.shape.model, K_);
      act_bytes_ = activation_bytes(placement.shape);
      act_ids_.assign(static_cast<size_t>(M_ * act_n_ * R_ * 2), -1);
    }
    // Two pinned pools when the buffers allow it (see the file comment): the fetches and
    // gradient staging before the optimizer take from the first, d + 1 + what they hold at once
    // (1; 2 with G home nvme) at most; the optimizer from the rest, which must hold what one
    // unit needs at once.
    const int front = std::min(B_ - optim_need_, d_ + 1 + front_need_);
    split_ = front_need_ > 0 && optim_need_ > 0 && front >= front_need_;
    if (split_) {
      pinned_ = BufferPool(front, 0);
      optim_pinned_ = BufferPool(B_ - front, front);
    } else {
      pinned_ = BufferPool(std::max(B_, 0), 0);
    }
    writer_.resize(static_cast<size_t>(U_));
    g_writer_.resize(static_cast<size_t>(U_));
    rep_reduce_.resize(static_cast<size_t>(U_));
    optim_read_.assign(static_cast<size_t>(U_), -1);
    optim_write_.assign(static_cast<size_t>(U_), -1);
    o_buffer_.assign(static_cast<size_t>(U_), -1);
    grad_read_.assign(static_cast<size_t>(U_), -1);
    grad_offload_.resize(static_cast<size_t>(U_));
    first_use_done_.assign(static_cast<size_t>(U_), false);
    last_grad_d2h_.assign(static_cast<size_t>(R_), -1);
    run_rs_.resize(static_cast<size_t>(U_));
    run_rs_first_.assign(static_cast<size_t>(U_), -1);
    unit_stats_.resize(static_cast<size_t>(U_));
  }

  int pos_of(int use) const { return uses_[static_cast<size_t>(use)].pos; }

  Schedule build() {
    plan_uses();
    for (int i = 0; i < static_cast<int>(uses_.size()); ++i) {
      prefetch(i);
      emit_compute(i);
      if (early_) emit_pending_updates();
      if (reduces_after(i)) {
        const int u = uses_[static_cast<size_t>(i)].unit;
        emit_gradients(i, u);
        if (cut_table_ && table_of(u) >= 0) emit_gradients(i, table_of(u));
      }
      open_optim_lookahead(i);
      optim_lookahead();
    }
    if (!opt_.forward_only) {
      if (early_)
        emit_pending_updates();
      else
        emit_gpu_grad_stats();
      for (int u = 0; u < U_; ++u) {
        if (early_ && o_host(u)) continue;  // updated during the backward
        emit_optimizer(u);
        optim_lookahead();
      }
    }
    resolve_prev();
    return finish();
  }

 private:
  const UnitPartition& unit(int u) const { return part_.units[static_cast<size_t>(u)]; }
  const UnitHomes& homes(int u) const { return pl_.homes[static_cast<size_t>(u)]; }
  bool gathered(int u) const { return !unit(u).replicated; }
  int table_of(int u) const { return layout_.tied_table(u); }
  bool o_host(int u) const { return homes(u).optimizer != Tier::gpu; }
  // Elements the host-side optimizer works on for unit u: every rank's shard, or the one copy.
  uint64_t all_elements(int u) const { return unit(u).replicated ? unit(u).numel : unit(u).padded; }

  void check() {
    const RunShape& s = pl_.shape;
    if (R_ < 1) fail("schedule: the partition has {} ranks; it needs at least 1", R_);
    if (U_ < 1) fail("schedule: the partition has no units; build it from the model's layout");
    if (s.ranks != R_)
      fail(
          "schedule: the placement is for {} ranks but its partition has {}; build both for the "
          "same number of devices",
          s.ranks, R_);
    if (pl_.homes.size() != static_cast<size_t>(U_))
      fail("schedule: the placement has homes for {} units, the partition has {} units",
           pl_.homes.size(), U_);
    if (M_ < 1) fail("schedule: micro_batches = {}; it must be at least 1", M_);
    if (s.micro_batch_group < 1)
      fail(
          "schedule: micro_batch_group = {}; it must be at least 1 (1 runs each micro-batch "
          "through every unit before the next)",
          s.micro_batch_group);
    if (G_ > 1 && tied_ && !opt_.forward_only && !opt_.reduce_per_group)
      fail(
          "schedule: model {} ties its embeddings, so in micro-batch groups ({} micro-batches "
          "unit by unit) the head's gradients of the whole group reach the embedding table's "
          "before the embedding's own of the first micro-batch, a sum in another order than "
          "without groups; reduce the gradients once per group (--reduce-per-group on) or use a "
          "micro-batch group of 1 (--micro-batch-group 1)",
          s.model.name, G_);
    if (opt_.prefetch_depth < 0)
      fail("schedule: prefetch_depth = {}; it must be 0 (no prefetch) or more",
           opt_.prefetch_depth);
    if (s.micro_batch < 1 || s.seq_len < 1)
      fail(
          "schedule: the run shape has micro_batch = {} and seq_len = {}; both must be at least 1 "
          "(the schedule's FLOPs count tokens)",
          s.micro_batch, s.seq_len);
    if (W_ < 1) fail("schedule: working_buffers = {}; at least 1 is needed", W_);
    bool table_gathered = false;
    for (int u = 0; u < U_; ++u)
      table_gathered = table_gathered || (table_of(u) >= 0 && gathered(table_of(u)));
    if (W_ < 2 && table_gathered)
      fail(
          "schedule: model {} ties its embeddings, so the head and unit 0 are gathered together; "
          "it needs at least 2 working buffers (the placement has {})",
          s.model.name, W_);
    if (B_ < 0) fail("schedule: pinned_buffers = {}; it cannot be negative", B_);
    int need = 0;  // pinned buffers one unit holds at once
    for (int u = 0; u < U_; ++u) {
      const UnitHomes& h = homes(u);
      const std::string& name = unit(u).name;
      if (unit(u).replicated && h.param != Tier::gpu)
        fail(
            "schedule: unit {} is replicated (at most {} elements) but its parameters' home is "
            "{}; replicated units stay on every GPU, so their home must be gpu",
            name, part_.persistence_threshold, tier_name(h.param));
      if (h.grad == Tier::nvme && (h.optimizer == Tier::gpu || unit(u).replicated))
        fail(
            "schedule: unit {}'s gradients have their home on nvme, but {}; gradients on NVMe "
            "are for CPU Adam, and only for sharded units",
            name,
            unit(u).replicated ? "the unit is replicated (its gradients are all-reduced on every "
                                 "GPU)"
                               : "its optimizer is on the GPU");
      if (h.grad == Tier::cpu && h.optimizer == Tier::gpu)
        fail(
            "schedule: unit {} has its gradients in host RAM but its optimizer on the GPU; "
            "gradients in host RAM are for CPU Adam (an optimizer on the CPU or NVMe)",
            name);
      int n = optimizer_pinned_buffers(h);
      optim_need_ = std::max(optim_need_, n);
      // Buffers the fetches and the gradients' staging hold at once: a parameter shard from
      // NVMe, a micro-batch's gradients on their way to host RAM, or those beside the step's
      // sum read back from NVMe.
      const int front = h.grad == Tier::nvme                                       ? 2
                        : h.param == Tier::nvme || (h.grad == Tier::cpu && M_ > 1) ? 1
                                                                                   : 0;
      front_need_ = std::max(front_need_, front);
      need = std::max({need, n, front});
    }
    if (B_ < need)
      fail(
          "schedule: the placement has {} pinned buffers, but its homes need {} at once (an "
          "optimizer shard from NVMe beside an updated parameter shard and the gradients CPU "
          "Adam reads, or staged parameters or gradients); raise buffer_count",
          B_, need);
  }

  // ---- lanes: a fixed key per lane, compacted at the end ----
  int lane_key(LaneKind k, int rank) const {
    switch (k) {
      case LaneKind::compute:
        return rank * 4;
      case LaneKind::h2d:
        return rank * 4 + 1;
      case LaneKind::d2h:
        return rank * 4 + 2;
      case LaneKind::comm:
        return rank * 4 + 3;
      case LaneKind::cpu_adam:
        return R_ * 4;
      case LaneKind::nvme_read:
        return R_ * 4 + 1;
      case LaneKind::nvme_write:
        return R_ * 4 + 2;
    }
    return -1;
  }
  Lane lane_of_key(int key) const {
    if (key < R_ * 4) {
      static constexpr std::array<LaneKind, 4> gpu = {LaneKind::compute, LaneKind::h2d,
                                                      LaneKind::d2h, LaneKind::comm};
      return Lane{gpu[static_cast<size_t>(key % 4)], key / 4};
    }
    static constexpr std::array<LaneKind, 3> host = {LaneKind::cpu_adam, LaneKind::nvme_read,
                                                     LaneKind::nvme_write};
    return Lane{host[static_cast<size_t>(key - R_ * 4)], -1};
  }

  int add(TaskKind kind, LaneKind lane, int rank, int u, int m, std::vector<int> deps) {
    Task t;
    t.id = static_cast<int>(tasks_.size());
    t.kind = kind;
    t.lane = lane_key(lane, rank < 0 ? 0 : rank);
    t.unit = u;
    t.rank = rank;
    t.micro_batch = m;
    sort_unique(deps);
    t.deps = std::move(deps);
    tasks_.push_back(std::move(t));
    return tasks_.back().id;
  }
  Task& task(int id) { return tasks_[static_cast<size_t>(id)]; }

  void add_deps(int id, const std::vector<int>& more) {
    std::vector<int>& deps = task(id).deps;
    deps.insert(deps.end(), more.begin(), more.end());
    sort_unique(deps);
  }

  // ---- buffers ----
  // Makes `id` (a first writer of working buffer `slot` on `rank`) wait for its last user,
  // and, if it writes the gradient part (`grads`: a gather, which zeroes them), for the late
  // readers of the previous holding's gradients.
  void wait_for_slot(int id, int slot, int rank, bool grads) {
    if (slots_.used_this_step(slot)) {
      add_deps(id, {slots_.last_users(slot)[static_cast<size_t>(rank)]});
      if (grads) add_deps(id, slots_.late_readers(slot));
    } else {
      fixes_.push_back({id, PrevFix::What::working_buffer, slot, rank, grads});
    }
    task(id).slot = slot;
  }
  BufferPool& pool_of(int buffer) { return pinned_.holds(buffer) ? pinned_ : optim_pinned_; }
  BufferPool& optim_pool() { return split_ ? optim_pinned_ : pinned_; }
  void wait_for_pinned(int id, int buffer) {
    if (pool_of(buffer).used_this_step(buffer))
      add_deps(id, pool_of(buffer).last_users(buffer));
    else
      fixes_.push_back({id, PrevFix::What::pinned_buffer, buffer, -1});
    task(id).buffer = buffer;
  }
  // From the optimizer's pool (`optimizer`) or the fetches' one.
  int take_pinned(const char* what, int u, bool optimizer = false) {
    BufferPool& pool = optimizer ? optim_pool() : pinned_;
    if (pool.free_count() == 0)
      fail(
          "schedule: no pinned buffer is free for {} of unit {} (the placement has {}); this is "
          "a bug in strata's schedule builder",
          what, unit(u).name, B_);
    return pool.take();
  }

  // Makes the first use of P[u] in the step wait for the previous step's last writer.
  void wait_for_param_writer(int id, int u, int rank) {
    fixes_.push_back({id, PrevFix::What::param_writer, u, rank});
  }

  // ---- uses and runs ----
  void plan_uses() {
    const int head = U_ - 1;
    int pos = 0;
    for (int g0 = 0; g0 < M_; g0 += G_) {
      const int g1 = std::min(M_, g0 + G_);
      for (int u = 0; u < U_; ++u, ++pos)
        for (int m = g0; m < g1; ++m) {
          Use use{false, u, m, pos, {}, {}};
          if (table_of(u) >= 0 && gathered(table_of(u))) use.needs.push_back(table_of(u));
          if (gathered(u)) use.needs.push_back(u);
          uses_.push_back(use);
        }
      for (int u = head; u >= 0 && !opt_.forward_only; --u, ++pos)
        for (int m = g0; m < g1; ++m) {
          Use use{true, u, m, pos, {}, {}};
          if (gathered(u)) use.needs.push_back(u);
          if (cut_table_) {  // the table's gradients are reduced after the head piece too
            if (table_of(u) >= 0 && gathered(table_of(u))) use.needs.push_back(table_of(u));
          } else if (tied_ && u != 0 && gathered(0)) {
            // Unit 0's working gradients hold the head's share until backward(0).
            use.needs.push_back(0);
          }
          uses_.push_back(use);
        }
    }
    for (int i = 0; i < static_cast<int>(uses_.size()); ++i)
      last_at_pos_.resize(static_cast<size_t>(uses_[static_cast<size_t>(i)].pos) + 1, i);
    std::vector<int> open(static_cast<size_t>(U_), -1);
    for (int i = 0; i < static_cast<int>(uses_.size()); ++i)
      for (int u : uses_[static_cast<size_t>(i)].needs) {
        int& r = open[static_cast<size_t>(u)];
        if (r >= 0 && runs_[static_cast<size_t>(r)].last_use == i - 1) {
          runs_[static_cast<size_t>(r)].last_use = i;
        } else {
          const int before = r;
          r = static_cast<int>(runs_.size());
          runs_.push_back(Run{u, i, i, -1, {}, before});
        }
      }
    for (const Run& r : runs_)
      if (homes(r.unit).param == Tier::nvme) ++param_reads_left_;
  }

  void prefetch(int i) {
    while (next_run_ < runs_.size()) {
      Run& run = runs_[next_run_];
      if (pos_of(run.first_use) > pos_of(i) + d_) break;
      // One gathered copy of a unit at a time: a deep prefetch must not gather a unit's next
      // run before its previous run's last compute (and reduce-scatter) is emitted, or the
      // gather would wait on the comm lane for a release queued behind it.
      if (run.prev >= 0 && runs_[static_cast<size_t>(run.prev)].last_use >= i) break;
      if (slots_.free_count() == 0) {
        if (run.first_use > i) break;  // prefetch waits for a buffer to come back
        fail(
            "schedule: no working buffer is free to gather unit {} (the placement has {}); "
            "this is a bug in strata's schedule builder",
            unit(run.unit).name, W_);
      }
      emit_fetch_and_gather(run);
      ++next_run_;
    }
  }

  void emit_fetch_and_gather(Run& run) {
    const int u = run.unit;
    const UnitPartition& up = unit(u);
    const int m = uses_[static_cast<size_t>(run.first_use)].m;
    const bool first = !first_use_done_[static_cast<size_t>(u)];
    first_use_done_[static_cast<size_t>(u)] = true;
    run.slot = slots_.take();
    slots_.took(run.slot);
    // The prefetch depth: the fetch for a run starting at unit step p (a use, with groups of 1)
    // starts once step p - d - 1 has been computed.
    const int gate_pos = pos_of(run.first_use) - d_ - 1;
    const int gate_use = gate_pos < 0 ? -1 : last_at_pos_[static_cast<size_t>(gate_pos)];
    auto gate = [&](int rank) {
      if (gate_use < 0) return std::vector<int>{};
      const std::vector<int>& c = uses_[static_cast<size_t>(gate_use)].compute;
      return rank < 0 ? c : std::vector<int>{c[static_cast<size_t>(rank)]};
    };
    std::vector<int> h2d(static_cast<size_t>(R_), -1);
    const Tier home = homes(u).param;
    if (home == Tier::nvme) {
      const int buf = take_pinned("param_read", u);
      const int read = add(TaskKind::param_read, LaneKind::nvme_read, -1, u, m, gate(-1));
      task(read).bytes = up.padded * ps_;
      wait_for_pinned(read, buf);
      if (first) wait_for_param_writer(read, u, -1);
      for (int r = 0; r < R_; ++r) {
        h2d[static_cast<size_t>(r)] = add(TaskKind::param_h2d, LaneKind::h2d, r, u, m, {read});
        task(h2d[static_cast<size_t>(r)]).bytes = up.shard * ps_;
        task(h2d[static_cast<size_t>(r)]).buffer = buf;
        wait_for_slot(h2d[static_cast<size_t>(r)], run.slot, r, false);
      }
      pinned_.give_back(buf, h2d);
      --param_reads_left_;
    } else if (home == Tier::cpu) {
      for (int r = 0; r < R_; ++r) {
        h2d[static_cast<size_t>(r)] = add(TaskKind::param_h2d, LaneKind::h2d, r, u, m, gate(r));
        task(h2d[static_cast<size_t>(r)]).bytes = up.shard * ps_;
        wait_for_slot(h2d[static_cast<size_t>(r)], run.slot, r, false);
        if (first) wait_for_param_writer(h2d[static_cast<size_t>(r)], u, r);
      }
    }
    bool backward = false;  // the working gradients are cleared when a backward reads the run
    for (int i = run.first_use; i <= run.last_use; ++i)
      backward = backward || uses_[static_cast<size_t>(i)].backward;
    const int group = next_group_++;
    for (int r = 0; r < R_; ++r) {
      std::vector<int> deps = h2d[static_cast<size_t>(r)] >= 0
                                  ? std::vector<int>{h2d[static_cast<size_t>(r)]}
                                  : gate(r);
      const int g = add(TaskKind::gather, LaneKind::comm, r, u, m, deps);
      task(g).group = group;
      // One rank uses the unit where it lies (ZeroModel::gather): nothing to copy.
      task(g).bytes = R_ > 1 ? up.padded * ps_ * uint64_t(R_ - 1) / uint64_t(R_) : 0;
      if (backward) task(g).local_bytes = up.padded * gs_;  // the working gradients zeroed
      wait_for_slot(g, run.slot, r, true);
      if (first && home == Tier::gpu) wait_for_param_writer(g, u, r);
      run.gather.push_back(g);
    }
  }

  double compute_flops(int u, bool backward) const {
    const RunShape& s = pl_.shape;
    const UnitLayout& unit = layout_.units.at(static_cast<size_t>(u));
    return backward ? unit_backward_flops(s.model, unit, s.micro_batch, s.seq_len, s.recompute)
                    : unit_forward_flops(s.model, unit, s.micro_batch, s.seq_len);
  }

  // The runs covering use i (the gathered units it reads).
  std::vector<const Run*> runs_at(int i) const {
    std::vector<const Run*> out;
    for (size_t k = 0; k < next_run_; ++k)
      if (runs_[k].first_use <= i && i <= runs_[k].last_use) out.push_back(&runs_[k]);
    return out;
  }

  void emit_compute(int i) {
    Use& use = uses_[static_cast<size_t>(i)];
    const std::vector<const Run*> runs = runs_at(i);
    const int u = use.unit;
    const bool first_resident = !gathered(u) && !first_use_done_[static_cast<size_t>(u)];
    if (first_resident) first_use_done_[static_cast<size_t>(u)] = true;
    const double flops = compute_flops(u, use.backward);
    for (int r = 0; r < R_; ++r) {
      std::vector<int> deps;
      for (const Run* run : runs) deps.push_back(run->gather[static_cast<size_t>(r)]);
      if (i > 0 && (use.backward || use.unit > 0))
        deps.push_back(uses_[static_cast<size_t>(i - 1)].compute[static_cast<size_t>(r)]);
      // A replicated unit's working gradients are one buffer of its own: the first backward
      // of a micro-batch that adds into them waits until the previous one's all-reduce has
      // read (and handed back) them.
      if (use.backward)
        for (int x : added_into(u))
          if (!rep_reduce_[static_cast<size_t>(x)].empty())
            deps.push_back(rep_reduce_[static_cast<size_t>(x)][static_cast<size_t>(r)]);
      // A sharded unit's working gradients, in a run of several backwards (a micro-batch
      // group), hold one micro-batch at a time: the next backward waits until every rank's
      // reduce-scatter of the previous one has read them (and cleared them: the executor clears
      // the working gradients after a reduce-scatter a backward waits for).
      if (use.backward)
        for (const Run* run : runs)
          if (run->unit == u && run_rs_first_[static_cast<size_t>(u)] == run->first_use)
            for (int x : run_rs_[static_cast<size_t>(u)]) deps.push_back(x);
      // Offloaded activation checkpoints: a forward writes the slot of the checkpoint K units
      // back once it is on the host; a backward reads its input once it is back.
      if (const int v = use.backward ? u : u - K_ + 1; offloaded(v))
        deps.push_back(use.backward ? act_h2d(v, use.m, r) : act_d2h(v, use.m, r));
      const int id = add(use.backward ? TaskKind::backward : TaskKind::forward, LaneKind::compute,
                         r, u, use.m, deps);
      task(id).flops = flops;
      if (first_resident) wait_for_param_writer(id, u, r);
      use.compute.push_back(id);
      // The checkpoint this forward wrote goes to the host; the one whose slot this backward
      // has freed comes back.
      if (!use.backward && offloaded(u + 1)) {
        const int t = add(TaskKind::act_d2h, LaneKind::d2h, r, u + 1, use.m, {id});
        task(t).bytes = act_bytes_;
        act_d2h(u + 1, use.m, r) = t;
      } else if (use.backward && offloaded(u - K_)) {
        const int v = u - K_;
        const int t =
            add(TaskKind::act_h2d, LaneKind::h2d, r, v, use.m, {id, act_d2h(v, use.m, r)});
        task(t).bytes = act_bytes_;
        act_h2d(v, use.m, r) = t;
      }
    }
    if (use.backward)
      for (int x : added_into(u)) rep_reduce_[static_cast<size_t>(x)].clear();
    for (const Run* run : runs)
      if (run->last_use == i) slots_.give_back(run->slot, use.compute);
  }

  // Whether unit v is a block whose input (activation checkpoint) is offloaded to the host.
  bool offloaded(int v) const { return v >= act_first_ && v < act_first_ + act_n_; }
  int& act_d2h(int v, int m, int r) { return act_ids_[act_index(v, m, r, 0)]; }
  int& act_h2d(int v, int m, int r) { return act_ids_[act_index(v, m, r, 1)]; }
  size_t act_index(int v, int m, int r, int which) const {
    return ((static_cast<size_t>(m) * static_cast<size_t>(act_n_) +
             static_cast<size_t>(v - act_first_)) *
                static_cast<size_t>(R_) +
            static_cast<size_t>(r)) *
               2 +
           static_cast<size_t>(which);
  }

  // The replicated units whose working gradients backward(u) adds into: u, and unit 0 from
  // the head when the embeddings are tied.
  std::vector<int> added_into(int u) const {
    std::vector<int> out;
    if (unit(u).replicated) out.push_back(u);
    if (table_of(u) >= 0 && unit(table_of(u)).replicated) out.push_back(table_of(u));
    return out;
  }

  // Whether the gradients of use i are reduced after it: after every backward, or, reducing
  // once per group, after a unit's last backward of the group (its next use is not one).
  bool reduces_after(int i) const {
    const Use& use = uses_[static_cast<size_t>(i)];
    if (!use.backward) return false;
    if (!per_group_) return true;
    const size_t next = static_cast<size_t>(i) + 1;
    return next == uses_.size() || !uses_[next].backward || uses_[next].unit != use.unit;
  }

  // Whether the reduction at micro-batch m is the step's first of its unit: it writes G (or
  // G's first holding on the host) where the later ones add into it.
  bool first_reduction(int m) const { return per_group_ ? m < G_ : m == 0; }

  // The reduction of unit u's working gradients after use i: of use i's unit, or, tied and cut
  // (cut_table_), of the table a head piece's backward added into. Then the table's gradients
  // are reduced twice a micro-batch: the head piece's reduction comes first in the step, so it
  // writes G, and the embedding piece's own last, so it ends them.
  void emit_gradients(int i, int u) {
    const Use& use = uses_[static_cast<size_t>(i)];
    const int m = use.m;
    const UnitPartition& up = unit(u);
    const bool table_own =
        cut_table_ && u == use.unit && layout_.units[size_t(u)].kind == UnitKind::embedding;
    const bool first = first_reduction(m) && !table_own;
    const bool last = m == M_ - 1 && !(cut_table_ && u != use.unit);
    // When the run ended at this use its buffer is back in the pool, but nothing can gather
    // into it before this reduce-scatter has read the working gradients: the next gather is
    // emitted later on the same comm lanes.
    int slot = -1;
    bool more = false;  // whether a later backward of the run adds into the working gradients
    for (const Run* run : runs_at(i))
      if (run->unit == u) {
        slot = run->slot;
        for (int j = i + 1; j <= run->last_use; ++j)
          more = more || uses_[static_cast<size_t>(j)].backward;
        if (more) run_rs_first_[static_cast<size_t>(u)] = run->first_use;
      }
    // G off the GPU: in host RAM, or on NVMe through a pinned buffer.
    const bool g_nvme = homes(u).grad == Tier::nvme;
    const bool g_off = homes(u).grad != Tier::gpu;
    // One rank copies a sharded unit's gradients to the host from its working buffer: the
    // reduce-scatter moves nothing, and the grad_d2h is a late reader of the buffer. Not where
    // a later backward of the run adds into them (micro-batch groups reduced per micro-batch),
    // which would wait for the copy where a device copy into a staging buffer is quicker: the
    // placement counts that staging.
    const bool direct = R_ == 1 && g_off && !up.replicated && !more;
    const int group = next_group_++;
    std::vector<int> rs;
    for (int r = 0; r < R_; ++r) {
      std::vector<int> deps = {use.compute[static_cast<size_t>(r)]};
      if (g_off && last_grad_d2h_[static_cast<size_t>(r)] >= 0)
        deps.push_back(last_grad_d2h_[static_cast<size_t>(r)]);
      const int id = add(TaskKind::reduce_scatter, LaneKind::comm, r, u, m, deps);
      task(id).group = group;
      if (first && o_host(u) && homes(u).grad == Tier::gpu)
        fixes_.push_back({id, PrevFix::What::grad_offload, u, up.replicated ? 0 : r});
      if (R_ > 1)
        task(id).bytes = up.replicated ? 2 * up.numel * gs_ * uint64_t(R_ - 1) / uint64_t(R_)
                                       : up.padded * gs_ * uint64_t(R_ - 1) / uint64_t(R_);
      else  // one rank: the add into the replicated shard; nothing where the grad_d2h reads the
        // working gradients, else a copy out, or an add of them into the resident shard (two
        // read, one written: a copy and a half)
        task(id).bytes = up.replicated ? up.numel * gs_
                         : direct      ? 0
                         : g_off       ? up.padded * gs_
                                       : up.padded * gs_ * 3 / 2;
      if (more) task(id).local_bytes = up.padded * gs_;  // the working gradients cleared
      task(id).slot = slot;
      rs.push_back(id);
    }
    if (up.replicated) rep_reduce_[static_cast<size_t>(u)] = rs;
    run_rs_[static_cast<size_t>(u)] = more ? rs : std::vector<int>{};
    if (!more) run_rs_first_[static_cast<size_t>(u)] = -1;
    std::vector<int>& g_writer = g_writer_[static_cast<size_t>(u)];
    if (!g_off) {
      g_writer = rs;
      if (early_ && last) pending_.push_back(u);
      return;
    }
    const int copies = up.replicated ? 1 : R_;
    const bool staged = !first || g_nvme;
    const int buf = staged ? take_pinned("grad_d2h staging", u) : -1;
    std::vector<int> d2h;
    for (int r = 0; r < copies; ++r) {
      const int id = add(TaskKind::grad_d2h, LaneKind::d2h, r, u, m, {rs[static_cast<size_t>(r)]});
      task(id).bytes = up.shard * gs_;
      if (staged) wait_for_pinned(id, buf);
      if (direct) {  // the buffer's next gather (which zeroes the gradients) waits for it
        task(id).slot = slot;
        slots_.add_late_reader(slot, id);
      }
      last_grad_d2h_[static_cast<size_t>(r)] = id;
      d2h.push_back(id);
    }
    if (g_nvme) {
      emit_nvme_gradients(u, m, first, last, buf, d2h);
      return;
    }
    if (staged) {
      std::vector<int> deps = d2h;
      deps.insert(deps.end(), g_writer.begin(), g_writer.end());
      const int acc = add(TaskKind::grad_accumulate, LaneKind::cpu_adam, -1, u, m, deps);
      task(acc).elements = all_elements(u);
      task(acc).buffer = buf;
      pinned_.give_back(buf, {acc});
      g_writer = {acc};
    } else {
      g_writer = d2h;
    }
    if (last) {
      const int stats = add(TaskKind::grad_stats, LaneKind::cpu_adam, -1, u, -1, g_writer);
      task(stats).elements = all_elements(u);
      grad_stats_.push_back(stats);
      unit_stats_[static_cast<size_t>(u)] = {stats};
      if (early_ && o_host(u)) emit_optimizer(u);
    }
  }

  // G home nvme, after the grad_d2hs (`d2h`) brought a reduction's gradients into pinned
  // buffer `staging`: the step's first reduction writes them to NVMe from there; a later one
  // reads G back into a second buffer, adds the staging into it on cpu.adam, and writes that.
  // After the last, the statistics come from the buffer written.
  void emit_nvme_gradients(int u, int m, bool first, bool last, int staging,
                           const std::vector<int>& d2h) {
    std::vector<int>& g_writer = g_writer_[static_cast<size_t>(u)];
    const uint64_t bytes = all_elements(u) * gs_;
    std::vector<int> ready = d2h;  // after which `held` holds the step's sum so far
    int held = staging;
    if (!first) {
      held = take_pinned("the gradients read back", u);
      const int read = add(TaskKind::grad_read, LaneKind::nvme_read, -1, u, m, g_writer);
      task(read).bytes = bytes;
      wait_for_pinned(read, held);
      std::vector<int> deps = d2h;
      deps.push_back(read);
      const int acc = add(TaskKind::grad_accumulate, LaneKind::cpu_adam, -1, u, m, deps);
      task(acc).elements = all_elements(u);
      task(acc).buffer = staging;
      pinned_.give_back(staging, {acc});
      ready = {acc};
    }
    std::vector<int> readers;
    if (last) {
      const int stats = add(TaskKind::grad_stats, LaneKind::cpu_adam, -1, u, -1, ready);
      task(stats).elements = all_elements(u);
      task(stats).buffer = held;
      grad_stats_.push_back(stats);
      unit_stats_[static_cast<size_t>(u)] = {stats};
      readers.push_back(stats);
    }
    const int write = add(TaskKind::grad_write, LaneKind::nvme_write, -1, u, m, ready);
    task(write).bytes = bytes;
    task(write).buffer = held;
    // It overwrites what the previous step's update read back.
    if (first) fixes_.push_back({write, PrevFix::What::grad_read, u, -1});
    readers.push_back(write);
    pinned_.give_back(held, readers);
    g_writer = {write};
    if (last && early_ && o_host(u)) emit_optimizer(u);
  }

  // Update during the backward: the grad_stats per rank of the units whose gradients (home
  // gpu) became final at an earlier use, then the optimizer of those whose optimizer is on the
  // host.
  void emit_pending_updates() {
    for (int u : pending_) {
      emit_gpu_grad_stats_of(u);
      if (o_host(u)) emit_optimizer(u);
    }
    pending_.clear();
  }

  void emit_gpu_grad_stats() {
    for (int u = U_ - 1; u >= 0; --u)
      if (homes(u).grad == Tier::gpu) emit_gpu_grad_stats_of(u);
  }

  void emit_gpu_grad_stats_of(int u) {
    for (int r = 0; r < R_; ++r) {
      const int id = add(TaskKind::grad_stats, LaneKind::compute, r, u, -1,
                         {g_writer_[static_cast<size_t>(u)][static_cast<size_t>(r)]});
      task(id).elements = unit(u).shard;
      grad_stats_.push_back(id);
      unit_stats_[static_cast<size_t>(u)].push_back(id);
    }
  }

  // The optimizer visits units in forward order, or in backward order while updating during the
  // backward: the unit at position k, which is also the position of unit k.
  int optim_order(int k) const { return early_ ? U_ - 1 - k : k; }

  // What unit u's update waits for: every grad_stats (the global norm), or, updating during the
  // backward, the unit's own.
  const std::vector<int>& stats_for(int u) const {
    return early_ ? unit_stats_[static_cast<size_t>(u)] : grad_stats_;
  }

  // ---- optimizer ----
  void open_optim_lookahead(int i) {
    const Use& use = uses_[static_cast<size_t>(i)];
    if (use.m != M_ - 1 || !use.backward) return;
    if (early_) {
      lookahead_open_ = true;
      optim_limit_ = optim_order(use.unit) + 1;
    } else if (param_reads_left_ == 0) {
      lookahead_open_ = true;
    }
  }

  void emit_optim_read(int u) {
    const int buf = take_pinned("optim_read", u, true);
    const int id = add(TaskKind::optim_read, LaneKind::nvme_read, -1, u, -1, {});
    task(id).bytes = all_elements(u) * os_;
    wait_for_pinned(id, buf);
    fixes_.push_back({id, PrevFix::What::optim_write, u, -1});
    optim_read_[static_cast<size_t>(u)] = id;
    o_buffer_[static_cast<size_t>(u)] = buf;
  }

  void optim_lookahead() {
    if (!lookahead_open_) return;
    while (next_optim_ < U_) {
      if (early_ && next_optim_ > optim_limit_) return;
      const int u = optim_order(next_optim_);
      if (homes(u).optimizer == Tier::nvme && optim_read_[static_cast<size_t>(u)] < 0) {
        // Leave what the optimizer of one unit takes besides its O buffer.
        if (optim_pool().free_count() < std::max(2, optim_need_)) return;
        emit_optim_read(u);
      }
      ++next_optim_;
    }
  }

  void emit_optimizer(int u) {
    const UnitHomes& h = homes(u);
    const UnitPartition& up = unit(u);
    std::vector<int>& writer = writer_[static_cast<size_t>(u)];
    if (h.optimizer == Tier::nvme && optim_read_[static_cast<size_t>(u)] < 0) emit_optim_read(u);
    const int pos = optim_order(u);
    if (next_optim_ <= pos) next_optim_ = pos + 1;
    if (o_host(u)) {
      std::vector<int> deps = stats_for(u);
      if (optim_read_[static_cast<size_t>(u)] >= 0)
        deps.push_back(optim_read_[static_cast<size_t>(u)]);
      int gbuf = -1;
      if (h.grad == Tier::nvme) {  // the step's sum, read back for CPU Adam
        gbuf = take_pinned("the gradients", u, true);
        const int id = add(TaskKind::grad_read, LaneKind::nvme_read, -1, u, -1,
                           g_writer_[static_cast<size_t>(u)]);
        task(id).bytes = all_elements(u) * gs_;
        wait_for_pinned(id, gbuf);
        grad_read_[static_cast<size_t>(u)] = id;
        deps.push_back(id);
      }
      if (h.grad == Tier::gpu) {  // the sums come down for CPU Adam, each rank's into its part
        gbuf = take_pinned("the gradients", u, true);
        const std::vector<int>& g_writer = g_writer_[static_cast<size_t>(u)];
        std::vector<int>& off = grad_offload_[static_cast<size_t>(u)];
        for (int r = 0; r < (up.replicated ? 1 : R_); ++r) {
          const int id = add(TaskKind::grad_offload, LaneKind::d2h, r, u, -1,
                             {g_writer[static_cast<size_t>(r)]});
          task(id).bytes = up.shard * gs_;
          wait_for_pinned(id, gbuf);
          off.push_back(id);
          deps.push_back(id);
        }
      }
      const bool p_stage = h.param != Tier::cpu;
      const int pbuf = p_stage ? take_pinned("the updated parameters", u, true) : -1;
      const int adam = add(TaskKind::adam, LaneKind::cpu_adam, -1, u, -1, deps);
      task(adam).elements = all_elements(u);
      if (p_stage) wait_for_pinned(adam, pbuf);
      if (gbuf >= 0) optim_pool().give_back(gbuf, {adam});
      if (h.optimizer == Tier::nvme) {
        const int w = add(TaskKind::optim_write, LaneKind::nvme_write, -1, u, -1, {adam});
        task(w).bytes = all_elements(u) * os_;
        task(w).buffer = o_buffer_[static_cast<size_t>(u)];
        optim_pool().give_back(o_buffer_[static_cast<size_t>(u)], {w});
        optim_write_[static_cast<size_t>(u)] = w;
      }
      if (h.param == Tier::nvme) {
        const int w = add(TaskKind::param_write, LaneKind::nvme_write, -1, u, -1, {adam});
        task(w).bytes = all_elements(u) * ps_;
        task(w).buffer = pbuf;
        optim_pool().give_back(pbuf, {w});
        writer = {w};
      } else if (h.param == Tier::gpu) {
        std::vector<int> up_ids;
        for (int r = 0; r < R_; ++r) {
          const int id = add(TaskKind::param_upload, LaneKind::h2d, r, u, -1, {adam});
          task(id).bytes = up.shard * ps_;
          task(id).buffer = pbuf;
          up_ids.push_back(id);
        }
        optim_pool().give_back(pbuf, up_ids);
        writer = up_ids;
      } else {
        writer = {adam};
      }
      return;
    }
    // P on NVMe: each rank's adam brings its updated shard down into its part of a pinned
    // buffer as it ends (the executor's param_d2h has nothing left to do), so the adams wait
    // for the buffer's last users as its first writers.
    const bool p_stage = h.param == Tier::nvme;
    const int pbuf = p_stage ? take_pinned("the updated parameters", u, true) : -1;
    std::vector<int> adams;
    for (int r = 0; r < R_; ++r) {
      const int id = add(TaskKind::adam, LaneKind::compute, r, u, -1, stats_for(u));
      task(id).elements = up.shard;
      if (p_stage) wait_for_pinned(id, pbuf);
      adams.push_back(id);
    }
    if (h.param == Tier::gpu) {
      writer = adams;
      return;
    }
    std::vector<int> d2h;
    for (int r = 0; r < R_; ++r) {
      const int id =
          add(TaskKind::param_d2h, LaneKind::d2h, r, u, -1, {adams[static_cast<size_t>(r)]});
      task(id).bytes = up.shard * ps_;
      if (p_stage) wait_for_pinned(id, pbuf);
      d2h.push_back(id);
    }
    if (!p_stage) {
      writer = d2h;
      return;
    }
    const int w = add(TaskKind::param_write, LaneKind::nvme_write, -1, u, -1, d2h);
    task(w).bytes = up.padded * ps_;
    task(w).buffer = pbuf;
    optim_pool().give_back(pbuf, {w});
    writer = {w};
  }

  // ---- the previous step ----
  void resolve_prev() {
    for (const PrevFix& f : fixes_) {
      std::vector<int> ids;
      switch (f.what) {
        case PrevFix::What::param_writer: {
          const std::vector<int>& w = writer_[static_cast<size_t>(f.index)];
          if (f.rank >= 0 && w.size() == static_cast<size_t>(R_))
            ids.push_back(w[static_cast<size_t>(f.rank)]);
          else
            ids = w;
          break;
        }
        case PrevFix::What::optim_write:
          ids.push_back(optim_write_[static_cast<size_t>(f.index)]);
          break;
        case PrevFix::What::grad_read:
          ids.push_back(grad_read_[static_cast<size_t>(f.index)]);
          break;
        case PrevFix::What::grad_offload: {
          const std::vector<int>& off = grad_offload_[static_cast<size_t>(f.index)];
          if (static_cast<size_t>(f.rank) < off.size())
            ids.push_back(off[static_cast<size_t>(f.rank)]);
          break;
        }
        case PrevFix::What::working_buffer:
          if (slots_.used_this_step(f.index)) {
            ids.push_back(slots_.last_users(f.index)[static_cast<size_t>(f.rank)]);
            if (f.grads) {
              const std::vector<int> late = slots_.late_readers(f.index);
              ids.insert(ids.end(), late.begin(), late.end());
            }
          }
          break;
        case PrevFix::What::pinned_buffer:
          if (pool_of(f.index).used_this_step(f.index)) ids = pool_of(f.index).last_users(f.index);
          break;
      }
      std::vector<int>& prev = task(f.task).prev;
      for (int id : ids)
        if (id >= 0) prev.push_back(id);
      sort_unique(prev);
    }
  }

  Schedule finish() {
    Schedule s;
    s.options = opt_;
    s.ranks = R_;
    s.units = U_;
    const uint64_t copy = ps_ == 4 ? 0 : ps_;  // an fp32 run's master is its parameters
    s.optimizer_cost =
        static_cast<double>(gs_ + 2 * os_ + copy) /
        static_cast<double>(gs_ + 2 * optimizer_state_bytes(OptimizerType::adam) + copy);
    s.working_buffers = W_;
    s.pinned_buffers = B_;
    s.prefetch_depth = d_;
    s.micro_batch_group = G_;
    std::vector<int> used(static_cast<size_t>(R_ * 4 + 3), -1);
    for (const Task& t : tasks_) used[static_cast<size_t>(t.lane)] = 0;
    for (size_t k = 0; k < used.size(); ++k)
      if (used[k] == 0) {
        used[k] = static_cast<int>(s.lanes.size());
        s.lanes.push_back(lane_of_key(static_cast<int>(k)));
      }
    for (Task& t : tasks_) t.lane = used[static_cast<size_t>(t.lane)];
    s.tasks = std::move(tasks_);
    return s;
  }

  const Placement& pl_;
  const Partition& part_;
  ModelLayout layout_;  // the model's units, for their FLOPs
  ScheduleOptions opt_;
  int U_, R_, M_, G_, W_, B_, d_ = 0;  // G_: micro-batches per group, at most M_
  bool tied_;
  bool cut_table_;  // tied and cut into vocabulary pieces: the table's gradients reduced twice
  bool early_;      // update during the backward
  bool per_group_;  // one reduce-scatter per unit and group (ScheduleOptions::reduce_per_group)
  uint64_t ps_, gs_, os_;  // bytes an element: parameters, gradients, optimizer state
  BufferPool slots_, pinned_, optim_pinned_;  // optim_pinned_: empty unless split_
  bool split_ = false;
  int optim_need_ = 0;  // pinned buffers the optimizer of one unit holds at once
  // Offloaded activation checkpoints (see offloaded()): the GPU's ring, the blocks, the bytes of
  // one, and the act_d2h and act_h2d of each (block, micro-batch, rank).
  int K_ = 0, act_first_ = 0, act_n_ = 0;
  uint64_t act_bytes_ = 0;
  std::vector<int> act_ids_;
  int front_need_ = 0;  // pinned buffers the fetches or gradient staging hold at once
  std::vector<Task> tasks_;
  std::vector<Use> uses_;
  std::vector<Run> runs_;
  size_t next_run_ = 0;
  int next_group_ = 0;
  int param_reads_left_ = 0;
  bool lookahead_open_ = false;
  int next_optim_ = 0;
  std::vector<bool> first_use_done_;
  std::vector<std::vector<int>> writer_;    // per unit: the last writers of P[u]
  std::vector<std::vector<int>> g_writer_;  // per unit: the last writers of G[u] so far
  // Per replicated unit: its last all-reduce, until the next backward that adds into its
  // working gradients has waited for it.
  std::vector<std::vector<int>> rep_reduce_;
  std::vector<int> last_grad_d2h_;  // per rank
  // Per sharded unit: the reduce-scatter of the last backward of a run that has more
  // backwards, and that run's first use (-1: none pending), for the next backward to wait on.
  std::vector<std::vector<int>> run_rs_;
  std::vector<int> run_rs_first_;
  std::vector<int> last_at_pos_;  // per unit step: its last use
  std::vector<int> grad_stats_;
  std::vector<std::vector<int>> unit_stats_;  // per unit: its grad_stats
  std::vector<int> pending_;  // units (G home gpu) whose gradients are final, stats not emitted
  // How far optim_reads may run ahead in the optimizer's order while updating during the
  // backward (a position, see optim_order).
  int optim_limit_ = -1;
  std::vector<std::vector<int>> grad_offload_;  // per unit: its grad_offload per rank
  std::vector<int> grad_read_;                  // per unit (G home nvme): the optimizer's grad_read
  std::vector<int> optim_read_, optim_write_, o_buffer_;
  std::vector<PrevFix> fixes_;
};

}  // namespace

Schedule Schedule::build(const Placement& placement, const ScheduleOptions& options) {
  if (!placement.shape.training && !options.forward_only)
    fail(
        "schedule: the placement holds parameters only (RunShape::training off, for "
        "evaluation), so only a forward-only schedule can be built from it");
  return Builder(placement, options).build();
}

std::vector<int> Schedule::lane_tasks(int lane) const {
  std::vector<int> out;
  for (const Task& t : tasks)
    if (t.lane == lane) out.push_back(t.id);
  return out;
}

int Schedule::lane_index(const Lane& lane) const {
  for (size_t i = 0; i < lanes.size(); ++i)
    if (lanes[i] == lane) return static_cast<int>(i);
  return -1;
}

namespace {

// A task without its id: its lane, kind, unit, micro-batch, group, buffers, work and deps.
std::string task_line(const Schedule& s, const Task& t) {
  std::string line = t.lane >= 0 && t.lane < static_cast<int>(s.lanes.size())
                         ? s.lanes[static_cast<size_t>(t.lane)].name()
                         : fmt::format("lane{}", t.lane);
  line += fmt::format(" {}", task_kind_name(t.kind));
  if (t.unit >= 0) line += fmt::format(" u={}", t.unit);
  if (t.micro_batch >= 0) line += fmt::format(" m={}", t.micro_batch);
  if (t.group >= 0) line += fmt::format(" g={}", t.group);
  if (t.slot >= 0) line += fmt::format(" slot={}", t.slot);
  if (t.buffer >= 0) line += fmt::format(" buf={}", t.buffer);
  if (t.bytes > 0) line += fmt::format(" bytes={}", t.bytes);
  if (t.local_bytes > 0) line += fmt::format(" local_bytes={}", t.local_bytes);
  if (t.flops > 0) line += fmt::format(" flops={:.0f}", t.flops);
  if (t.elements > 0) line += fmt::format(" elements={}", t.elements);
  line += fmt::format(" deps={}", id_list(t.deps));
  if (!t.prev.empty()) line += fmt::format(" prev={}", id_list(t.prev));
  return line;
}

}  // namespace

void Schedule::validate() const {
  const int n = static_cast<int>(tasks.size());
  const int L = static_cast<int>(lanes.size());
  for (int l = 0; l < L; ++l) {
    const Lane& lane = lanes[static_cast<size_t>(l)];
    const bool gpu = lane.kind == LaneKind::compute || lane.kind == LaneKind::h2d ||
                     lane.kind == LaneKind::d2h || lane.kind == LaneKind::comm;
    if (gpu ? (lane.device < 0 || lane.device >= ranks) : lane.device != -1)
      fail("schedule: lane {} ({}) has device {}, outside what its kind allows with {} ranks", l,
           lane.name(), lane.device, ranks);
    for (int k = 0; k < l; ++k)
      if (lanes[static_cast<size_t>(k)] == lane)
        fail("schedule: lane {} ({}) is listed twice (also as lane {})", l, lane.name(), k);
  }
  auto bad = [&](const Task& t, const std::string& what) {
    fail("schedule: task {} ({}): {}; the schedule is broken (a bug in whatever built it)", t.id,
         task_line(*this, t), what);
  };
  for (int i = 0; i < n; ++i) {
    const Task& t = tasks[static_cast<size_t>(i)];
    if (t.id != i) bad(t, fmt::format("its id is {} but it is at index {}", t.id, i));
    if (t.lane < 0 || t.lane >= L)
      bad(t, fmt::format("lane {} is not one of the {} lanes", t.lane, L));
    const Lane& lane = lanes[static_cast<size_t>(t.lane)];
    if (!lane_fits(t.kind, lane.kind))
      bad(t, fmt::format("a {} task cannot run on a {} lane", task_kind_name(t.kind),
                         lane_kind_name(lane.kind)));
    if (lane.device >= 0 && t.rank != lane.device)
      bad(t, fmt::format("its rank {} is not its lane's device {}", t.rank, lane.device));
    if (t.unit < -1 || t.unit >= units)
      bad(t, fmt::format("unit {} is outside 0..{}", t.unit, units - 1));
    for (int d : t.deps)
      if (d < 0 || d >= i) bad(t, fmt::format("dependency {} is not an earlier task", d));
    for (int p : t.prev)
      if (p < 0 || p >= n)
        bad(t, fmt::format("previous-step dependency {} is not a task id (0..{})", p, n - 1));
    if (t.slot < -1 || t.slot >= working_buffers)
      bad(t, fmt::format("working buffer {} is outside 0..{}", t.slot, working_buffers - 1));
    if (t.buffer < -1 || t.buffer >= pinned_buffers)
      bad(t, fmt::format("pinned buffer {} is outside 0..{}", t.buffer, pinned_buffers - 1));
  }
  // Groups: consecutive, one kind and unit, distinct lanes, each group id in one run only.
  std::map<int, int> seen;  // group -> first task
  for (int i = 0; i < n;) {
    const Task& t = tasks[static_cast<size_t>(i)];
    if (t.group < 0) {
      ++i;
      continue;
    }
    if (t.kind != TaskKind::gather && t.kind != TaskKind::reduce_scatter)
      bad(t, "only gathers and reduce-scatters are collectives, but it has a group");
    if (auto it = seen.find(t.group); it != seen.end())
      bad(t,
          fmt::format("group {} started at task {} and is not consecutive", t.group, it->second));
    seen[t.group] = i;
    int j = i + 1;
    while (j < n && tasks[static_cast<size_t>(j)].group == t.group) {
      const Task& o = tasks[static_cast<size_t>(j)];
      if (o.kind != t.kind || o.unit != t.unit || o.micro_batch != t.micro_batch)
        bad(o, fmt::format("its group {} began with task {} of another kind, unit or micro-batch",
                           t.group, i));
      for (int k = i; k < j; ++k)
        if (tasks[static_cast<size_t>(k)].lane == o.lane)
          bad(o, fmt::format("task {} of its group {} is on the same lane", k, t.group));
      ++j;
    }
    i = j;
  }
}

std::string Schedule::str() const {
  std::string out;
  for (const Task& t : tasks) out += fmt::format("{:5} {}\n", t.id, task_line(*this, t));
  return out;
}

std::string Schedule::summary() const {
  std::string out = fmt::format(
      "schedule: {} tasks on {} lanes; {} units, {} ranks, {} micro-batches{}{}{}, prefetch depth "
      "{} (asked {}), {} working buffers, {} pinned buffers\n",
      tasks.size(), lanes.size(), units, ranks, options.micro_batches,
      micro_batch_group > 1 ? fmt::format(" in groups of {}", micro_batch_group) : "",
      options.update_during_backward && !options.forward_only
          ? ", CPU Adam updating each unit during the backward"
          : "",
      options.reduce_per_group && !options.forward_only && micro_batch_group > 1
          ? ", gradients reduced once per group"
          : "",
      prefetch_depth, options.prefetch_depth, working_buffers, pinned_buffers);
  out += fmt::format("  {:<16} {:>7} {:>12} {:>12} {:>14}\n", "lane", "tasks", "bytes", "TFLOP",
                     "elements");
  uint64_t bytes = 0, elements = 0;
  double flops = 0;
  size_t count = 0;
  for (size_t l = 0; l < lanes.size(); ++l) {
    uint64_t b = 0, e = 0;
    double f = 0;
    size_t c = 0;
    for (const Task& t : tasks)
      if (t.lane == static_cast<int>(l)) {
        b += t.bytes;
        e += t.elements;
        f += t.flops;
        ++c;
      }
    out += fmt::format("  {:<16} {:>7} {:>12} {:>12.3f} {:>14}\n", lanes[l].name(), c,
                       format_bytes(b), f / 1e12, e);
    bytes += b;
    elements += e;
    flops += f;
    count += c;
  }
  out += fmt::format("  {:<16} {:>7} {:>12} {:>12.3f} {:>14}\n", "total", count,
                     format_bytes(bytes), flops / 1e12, elements);
  return out;
}

}  // namespace strata
