// executor.cpp: the step executor (see executor.h for the contract).
//
// Before the first step every task is resolved once against the schedule: which staging
// buffer it fills, which earlier task filled the buffer it reads, which gathered units a
// compute task uses. Staging buffers are handed out greedily in task order; a buffer goes to a
// producing task only when the buffer's previous producer and every task that read from it
// have finished whenever that task may start: they are among its transitive dependencies (a
// group counts as one task) or run before one of those on its lane (Ancestry). A consumer
// whose producer is not among its dependencies is a schedule bug and is refused up front.
#include "schedule/executor.h"

#include "core/bytes.h"
#include "core/error.h"
#include "core/log.h"
#include "core/pinned_pool.h"
#include "cpu_adam/kernels.h"
#include "model/safetensors.h"
#include "model/weights.h"
#include "nvme/swap_store.h"
#include "partition/zero.h"

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <future>
#include <mutex>
#include <thread>

namespace strata {

namespace {

constexpr uint64_t kPage = 4096;
uint64_t round_up(uint64_t x, uint64_t a) {
  return (x + a - 1) / a * a;
}

// Where host rank q's part begins in a pinned buffer that holds a unit's shard of
// `shard_bytes` for every host rank (an NVMe read, an update on its way out): each part starts
// on a page, so the swap store reads and writes it in place with O_DIRECT instead of through
// bounce buffers of its own (pinned memory that no placement counts). Placement sizes the
// buffers the same way (host_bytes).
uint64_t rank_part(int q, uint64_t shard_bytes) {
  return static_cast<uint64_t>(q) * round_up(shard_bytes, kPage);
}

// Host memory for state homed in RAM when pin_memory is off: page aligned, not locked.
struct AlignedFree {
  void operator()(char* p) const { std::free(p); }
};
using AlignedBlock = std::unique_ptr<char, AlignedFree>;

// memcpy (src) or memset to 0 (src null) on every core for a shard's worth of bytes: a
// checkpoint copies each unit out of RAM, and loading writes host RAM for the first time, whose
// page faults (the kernel zeroing each page) then run on every core too.
void copy_bytes(void* dst, const void* src, uint64_t bytes) {
  constexpr uint64_t kBlock = 4ull << 20;
  auto part = [&](uint64_t a, uint64_t b) {
    if (src != nullptr)
      std::memcpy(static_cast<char*>(dst) + a, static_cast<const char*>(src) + a, b - a);
    else
      std::memset(static_cast<char*>(dst) + a, 0, b - a);
  };
  if (bytes < 2 * kBlock) {
    part(0, bytes);
    return;
  }
  tbb::parallel_for(tbb::blocked_range<uint64_t>(0, (bytes + kBlock - 1) / kBlock),
                    [&](const tbb::blocked_range<uint64_t>& r) {
                      part(r.begin() * kBlock, std::min(bytes, r.end() * kBlock));
                    });
}

// A page-aligned host copy of one shard, for the swap store's calls outside a step (loading,
// checkpoints, reading state back), which it then moves in place like the step's pinned
// buffers: a heap vector would send every stripe through the store's own bounce buffers, a
// pinned pool of queue depth x stripe per ring that no placement counts.
AlignedBlock page_block(uint64_t bytes, const char* what) {
  char* p =
      static_cast<char*>(std::aligned_alloc(kPage, round_up(std::max<uint64_t>(bytes, 1), kPage)));
  if (p == nullptr)
    fail("executor: {} of host memory for {} could not be allocated; free host memory",
         format_bytes(bytes), what);
  return AlignedBlock(p);
}

// Two relations between the tasks of one step, a before t:
// - done(a, t): a has finished whenever t may start. That is a's being among t's dependencies,
//   transitively (a group counts as one task: its members start and end together), or before
//   one of them on its lane: a lane runs its tasks one at a time and in order, each finished,
//   its streams synchronised, before the next begins. On every lane that set is a prefix of
//   the lane's tasks, so it is one position per lane and task: T x lanes entries, where a bit
//   set per task took T^2 / 8 bytes (3.5 GiB and 10 s for the 170,000 tasks of a 70B model on 8
//   GPUs with 32 micro-batches). Enough for handing a buffer on, and for a read to be safe.
// - depends(a, t): a is among t's dependencies, transitively, lanes aside: which of a unit's
//   gathers a compute task reads from is the one it depends on, not merely one already done (a
//   deep prefetch gathers the unit's next run ahead, on the same lane). Searched backwards from
//   t over tasks no earlier than a, which for these queries are a few.
class Ancestry {
 public:
  explicit Ancestry(const Schedule& s) : s_(s), L_(s.lanes.size()) {
    const size_t T = s.tasks.size();
    pos_.resize(T);
    group_.resize(T);
    std::vector<int32_t> count(L_, 0);
    for (const Task& t : s.tasks) pos_[static_cast<size_t>(t.id)] = count[lane(t.id)]++;
    for (size_t t = 0; t < T;) {
      const size_t end = group_end(t);
      for (size_t i = t; i < end; ++i)
        group_[i] = {static_cast<int32_t>(t), static_cast<int32_t>(end)};
      t = end;
    }
    upto_.assign(T * L_, -1);
    std::vector<int> last(L_, -1);  // the latest task so far on each lane
    std::vector<int32_t> acc(L_);
    for (size_t t = 0; t < T;) {
      const size_t end = static_cast<size_t>(group_[t].second);
      std::fill(acc.begin(), acc.end(), -1);
      auto finished = [&](int d) {  // d's whole group has finished when t starts
        const auto [lo, hi] = group_[static_cast<size_t>(d)];
        const int32_t* r = row(static_cast<size_t>(lo));  // the same for every member
        for (size_t l = 0; l < L_; ++l) acc[l] = std::max(acc[l], r[l]);
        for (int g = lo; g < hi; ++g)
          acc[lane(g)] = std::max(acc[lane(g)], pos_[static_cast<size_t>(g)]);
      };
      for (size_t i = t; i < end; ++i) {
        if (last[lane(static_cast<int>(i))] >= 0) finished(last[lane(static_cast<int>(i))]);
        for (int d : s.tasks[i].deps) finished(d);
      }
      for (size_t i = t; i < end; ++i) {
        std::copy(acc.begin(), acc.end(), upto_.begin() + static_cast<ptrdiff_t>(i * L_));
        last[lane(static_cast<int>(i))] = static_cast<int>(i);
      }
      t = end;
    }
    mark_.assign(T, 0);
  }
  bool done(int a, int t) const {
    return pos_[static_cast<size_t>(a)] <= row(static_cast<size_t>(t))[lane(a)];
  }
  // Task t's group, [first, end); a task outside any group is a group of one.
  std::pair<int, int> group(int t) const { return group_[static_cast<size_t>(t)]; }
  bool depends(int a, int t) const {
    if (a >= group_[static_cast<size_t>(t)].first) return false;
    if (!done(a, t)) return false;  // done is the wider relation
    if (++stamp_ == 0) {
      std::fill(mark_.begin(), mark_.end(), 0);
      stamp_ = 1;
    }
    std::vector<int>& todo = todo_;
    todo.clear();
    // Every dependency of a group's members, and theirs, comes before the group's first
    // member; a group wholly before a is no way to it.
    auto visit = [&](int d) {  // d's group is among the dependencies: is a in it, or behind it?
      const auto [lo, hi] = group_[static_cast<size_t>(d)];
      if (hi <= a || mark_[static_cast<size_t>(lo)] == stamp_) return false;
      mark_[static_cast<size_t>(lo)] = stamp_;
      if (lo <= a) return true;
      todo.push_back(lo);
      return false;
    };
    todo.push_back(group_[static_cast<size_t>(t)].first);
    while (!todo.empty()) {
      const int g = todo.back();
      todo.pop_back();
      for (int i = g; i < group_[static_cast<size_t>(g)].second; ++i)
        for (int d : s_.tasks[static_cast<size_t>(i)].deps)
          if (visit(d)) return true;
    }
    return false;
  }

 private:
  size_t group_end(size_t t) const {
    size_t end = t + 1;  // a group's members are consecutive
    if (s_.tasks[t].group >= 0)
      while (end < s_.tasks.size() && s_.tasks[end].group == s_.tasks[t].group) ++end;
    return end;
  }
  size_t lane(int t) const { return static_cast<size_t>(s_.tasks[static_cast<size_t>(t)].lane); }
  const int32_t* row(size_t t) const { return upto_.data() + t * L_; }
  const Schedule& s_;
  size_t L_;
  std::vector<int32_t> pos_;                        // each task's place on its lane
  std::vector<std::pair<int32_t, int32_t>> group_;  // each task's group [first, end)
  std::vector<int32_t> upto_;           // per task and lane: the last position done when it starts
  mutable std::vector<uint32_t> mark_;  // per group leader: visited in search number stamp_
  mutable uint32_t stamp_ = 0;
  mutable std::vector<int> todo_;
};

// Buffers of one kind handed to producing tasks; see the file comment.
struct SlotPool {
  struct Use {
    int producer = -1;
    std::vector<int> consumers;
  };
  std::vector<Use> last;   // per slot, its latest use
  std::vector<int> first;  // per slot, its first producer
  // `preferred`: the schedule's own choice (Task::slot or Task::buffer), taken when the
  // dependencies allow it; else the first free one, else a new one. `also`: the other ranks'
  // tasks that write their parts of the same buffer; a slot is free only when its last users
  // are done before each of them too.
  int take(int producer, const std::vector<int>& consumers, const Ancestry& anc, int preferred,
           const std::vector<int>& also = {}) {
    auto done_before = [&](const Use& u, int w) {
      bool free = anc.done(u.producer, w);
      for (int c : u.consumers) free = free && anc.done(c, w);
      return free;
    };
    auto is_free = [&](const Use& u) {
      if (u.producer < 0) return true;
      bool free = done_before(u, producer);
      for (int w : also) free = free && done_before(u, w);
      return free;
    };
    if (preferred >= 0) {
      if (last.size() <= static_cast<size_t>(preferred)) {
        last.resize(static_cast<size_t>(preferred) + 1);
        first.resize(last.size(), -1);
      }
      if (is_free(last[static_cast<size_t>(preferred)])) return use(preferred, producer, consumers);
    }
    for (size_t i = 0; i < last.size(); ++i)
      if (is_free(last[i])) return use(static_cast<int>(i), producer, consumers);
    last.emplace_back();
    first.push_back(-1);
    return use(static_cast<int>(last.size()) - 1, producer, consumers);
  }
  int use(int i, int producer, const std::vector<int>& consumers) {
    if (first[static_cast<size_t>(i)] < 0) first[static_cast<size_t>(i)] = producer;
    last[static_cast<size_t>(i)] = Use{producer, consumers};
    return i;
  }
  // The next step's first writer of each buffer waits for its last users in this one.
  void order_across_steps(std::vector<std::vector<int>>& xprev) const {
    for (size_t i = 0; i < last.size(); ++i) {
      if (first[i] < 0) continue;
      std::vector<int>& x = xprev[static_cast<size_t>(first[i])];
      x.push_back(last[i].producer);
      x.insert(x.end(), last[i].consumers.begin(), last[i].consumers.end());
    }
  }
};

std::string task_label(const Schedule& s, const Task& t) {
  return fmt::format("task {} ({} u={} r={} m={} on {})", t.id, task_kind_name(t.kind), t.unit,
                     t.rank, t.micro_batch, s.lanes[static_cast<size_t>(t.lane)].name());
}

}  // namespace

struct Executor::State {
  const Placement& pl;
  const Schedule* sc;  // the schedule the lanes run: the step's, or evaluation's (swap())
  Communicator& comm;
  ExecutorOptions opt;
  int N = 1, U = 0, M = 1;
  ModelLayout layout;
  DType pt = DType::f32, gt = DType::f32;
  uint64_t ps = 4, gs = 4;
  // The optimizer and its state: os bytes an element, `oa` f32 arrays (core/optimizer.h).
  OptimizerType ot = OptimizerType::adam;
  uint64_t os = 12;
  int oa = 3;
  // Which array of a shard's state block holds field k (0 the master, 1 m, 2 v): the block is
  // the master then the moments the type keeps, n floats each. -1 where the type keeps none.
  int array_of(size_t k) const {
    if (k == 0) return 0;
    if (k == 1) return optimizer_keeps_m(ot) ? 1 : -1;
    return optimizer_keeps_v(ot) ? (optimizer_keeps_m(ot) ? 2 : 1) : -1;
  }

  std::unique_ptr<ZeroModel> zero;
  std::vector<std::unique_ptr<LlamaModel>> models;
  std::vector<DeviceBuffer> act_a, act_b, ids_dev, tgt_dev, doc_dev, chunk_sums, param_tmp;
  // Decoding (RunShape::kv_cache): the positions of the Executor::decode() call in flight
  // (n = 0: none), each rank's last-position logits [vocab] f32, and rank 0's on the host.
  int64_t decode_pos = 0, decode_n = 0;
  std::vector<DeviceBuffer> logits_dev;
  std::vector<float> logits;
  std::vector<std::vector<DeviceBuffer>> o_dev;  // [u][r*3 + {master, m, v}]
  struct RankStreams {
    // tail: the cpu.adam lane's work on the device (zeroing resident gradients)
    std::unique_ptr<Stream> compute, h2d, d2h, comm, setup, tail;
  };
  std::vector<RankStreams> streams;
  std::unique_ptr<CpuAdam> adam;

  std::unique_ptr<PinnedPool> pool;
  std::vector<void*> pool_blocks;
  std::vector<AlignedBlock> plain_blocks;
  // Host homes per unit and host rank (replicated units: rank 0's copy only).
  std::vector<std::vector<char*>> host_p, host_g, host_o;  // host_o: master | m | v
  // Offloaded activation checkpoints (RunShape::offload_activations): blocks act_first ..
  // act_first + act_n - 1 keep their inputs here between the forward and the backward, per rank
  // one block of activation sets x act_n checkpoints of act_stride bytes.
  std::vector<char*> host_act;
  int act_first = 0, act_n = 0;
  uint64_t act_stride = 0;
  char* act_home(int u, int r, int set) const {
    return host_act[static_cast<size_t>(r)] +
           static_cast<uint64_t>(set * act_n + (u - act_first)) * act_stride;
  }
  // The swap store, with a ring per NVMe lane: nvme.read's tasks run on channel 0,
  // nvme.write's on channel 1, at once (the schedule never reads and writes one shard
  // together); outside the steps (load, init, parameters()) channel 0.
  std::unique_ptr<nvme::SwapStore> store;
  static constexpr unsigned kReadChannel = 0, kWriteChannel = 1;
  // Unit state moved outside a step (loading, resuming, checkpoints) runs one unit ahead of
  // the caller on NVMe: a checkpoint writes unit u to its file while unit u + 1's shards are
  // read (read_ahead), and loading or resuming reads unit u + 1 from its files while unit u's
  // shards are written (write_unit's write behind). A unit's shards of a kind lie in a
  // page-aligned block, rank r's at rank_part(r, shard bytes): `job`, which the one job at a
  // time (on a thread of its own) reads into or writes from, and `held`, which the caller
  // reads (nvme_unit; a finished read ahead's block becomes it). Both are reused from unit to
  // unit, so their pages are faulted in once. Every other use of the store waits for the job:
  // step(), evaluate(), decode() and finish() free both first.
  struct Block {
    AlignedBlock data;
    uint64_t capacity = 0;
    char* room(uint64_t bytes) {
      if (capacity < bytes) {
        data.reset();  // freed before its successor is allocated
        capacity = 0;
        data = page_block(bytes, "a unit's shards on their way to or from NVMe or a GPU");
        capacity = bytes;
      }
      return data.get();
    }
  };
  struct Transfer {
    Block job, held;
    std::future<void> pending;
    char ahead_kind = 0;  // what `job` holds once `pending` is done: a read ahead of unit
    int ahead_unit = -1;  // ahead_unit's shards of ahead_kind ('P' or 'O'), or -1
  } transfer;
  // Waits for the job in flight; its error is thrown here (and its read ahead forgotten).
  void transfer_wait();
  // Waits, forgets any read ahead and returns `job` with room for `bytes`.
  char* job_block(uint64_t bytes);
  // Waits and frees both blocks.
  void transfer_done();
  // One rank's shard of unit u's `kind`: 'P' parameters, 'G' gradients, 'O' the master and
  // the moments (array_of).
  uint64_t shard_bytes(char kind, int u) const {
    return shard(u) * (kind == 'O' ? os : kind == 'G' ? gs : ps);
  }
  // Unit u's swap-store shards of `kind`, every host rank's, into or from `block` (rank r's at
  // rank_part(r, shard_bytes(kind, u))).
  void read_shards(char kind, int u, char* block) {
    const uint64_t bytes = shard_bytes(kind, u);
    for (int r = 0; r < host_ranks(u); ++r)
      store->read(shard_name(kind, u, r), block + rank_part(r, bytes), kReadChannel);
  }
  void write_shards(char kind, int u, const char* block) {
    const uint64_t bytes = shard_bytes(kind, u);
    for (int r = 0; r < host_ranks(u); ++r)
      store->write(shard_name(kind, u, r), block + rank_part(r, bytes), kWriteChannel);
  }
  // Unit u's shards of `kind` (homed on NVMe) in `held`, taken from the read ahead when it has
  // them, else read now; valid until the next transfer.
  char* nvme_unit(char kind, int u);
  // Starts reading unit u's shards of `kind` into `job` when they live on NVMe.
  void read_ahead(char kind, int u);

  // Staging, and each task's resolution.
  std::vector<std::vector<DeviceBuffer>> dev_param, dev_grad;  // [rank][slot]
  std::vector<char*> pinned;                                   // slots
  uint64_t pinned_slot_bytes = 0;
  std::vector<int> slot;               // producers: their slot
  std::vector<std::vector<int>> src;   // consumers: the producing task per rank
  std::vector<std::vector<int>> uses;  // compute tasks: the gather leaders they read
  std::vector<char> gather_bwd;        // gather leaders: for backward
  // Reduce-scatter leaders: a later backward of the still-gathered unit waits for them (a
  // micro-batch group), so the working gradients are cleared once they are read.
  std::vector<char> rs_clear;
  // Gather leaders: the compute tasks and reduce-scatters that use the gathered unit; the
  // last of them to finish releases it.
  std::vector<int> holders;
  // Reduce-scatter leaders, and one rank's direct grad_d2h tasks: the gather leader they read.
  std::vector<int> rs_gather;
  // One rank's grad_d2h tasks that copy the working gradients themselves to the host (the
  // schedule gives them the working buffer, Task::slot), and their reduce-scatters, which then
  // do nothing: the unit stays gathered until the copy is done.
  std::vector<char> direct;
  std::vector<char> d2h_staged;               // grad_d2h: via a pinned buffer (accumulated)
  std::vector<std::vector<int>> lanes;        // tasks per lane
  std::vector<std::pair<int, int>> group_of;  // per task: [first, end) of its group
  std::vector<char> front;                    // per task: runs before the optimizer's tasks
  // Per task: tasks of the previous step it waits for beyond Task::prev, because it is the
  // step's first writer of a staging buffer they used last (see the file comment).
  std::vector<std::vector<int>> xprev;

  // The forward-only schedule of evaluate() and its resolution, built at its first call. It
  // stages through the step's buffers (it needs no more of them), so it allocates nothing.
  struct Resolved {
    Schedule schedule;
    const Schedule* sc = nullptr;
    std::vector<int> slot, holders, rs_gather;
    std::vector<std::vector<int>> src, uses, lanes;
    std::vector<char> gather_bwd, rs_clear, d2h_staged, front, direct;
    std::vector<std::pair<int, int>> group_of;
    std::vector<std::vector<int>> xprev;
    std::vector<int64_t> done_at;
    std::vector<int> arrived, users_left;
  };
  std::unique_ptr<Resolved> eval;
  // Exchanges the resolution the lanes run with `r`'s (twice restores it).
  void swap(Resolved& r) {
    std::swap(sc, r.sc);
    slot.swap(r.slot);
    holders.swap(r.holders);
    rs_gather.swap(r.rs_gather);
    src.swap(r.src);
    uses.swap(r.uses);
    lanes.swap(r.lanes);
    gather_bwd.swap(r.gather_bwd);
    rs_clear.swap(r.rs_clear);
    d2h_staged.swap(r.d2h_staged);
    direct.swap(r.direct);
    group_of.swap(r.group_of);
    front.swap(r.front);
    xprev.swap(r.xprev);
    done_at.swap(r.done_at);
    arrived.swap(r.arrived);
    users_left.swap(r.users_left);
  }

  // The lanes' run. done_at[t]: the last step instance (0, 1, ...) whose task t is done, -1
  // before the first; arrived: a group's members waiting for its last; users_left: per gather
  // leader, the holders that have not let go of the gathered unit.
  std::mutex mu;
  // The step's caller waits on cv (lanes done, front tasks done, stop), as do the lane threads
  // between steps (release, quit). Within a step each lane thread waits on its own variable in
  // lane_waits, saying what for, so that a finished task wakes only the lanes it lets go on:
  // one notify_all of a shared variable woke every lane at every task, 3.5 wake-ups (each a
  // context switch) per task run in the placement sweeps.
  std::condition_variable cv;
  struct LaneWait {
    enum What : uint8_t { kNone, kTask, kDone, kAny };
    What what = kNone;
    const Task* task = nullptr;  // kTask: until ready(*task, k)
    int id = 0;                  // kDone: until done_at[id] >= k
    int64_t k = 0;
    std::condition_variable cv;  // kAny: woken at every finished task
  };
  std::unique_ptr<LaneWait[]> lane_waits;
  size_t lane_wait_count = 0;
  std::vector<int64_t> done_at;
  std::vector<int> arrived, users_left;
  std::vector<std::vector<UnitBuffers>> views;  // [rank][unit]
  // Per replicated unit, while its working gradients are gathered: the step instance and
  // micro-batch they belong to.
  std::vector<std::pair<int64_t, int>> rep_owner;
  bool stop = false, broken = false;
  std::exception_ptr error;
  std::string error_task, error_what;  // the failed task, and "step N" or "evaluation"
  // The lane threads of the steps (started by the first step): each runs its lane's tasks of
  // instance 0, 1, ... as they are released; lane_done: per lane, the last instance it ran.
  std::vector<std::thread> workers;
  int64_t released = -1;
  bool quit = false;
  std::vector<int64_t> lane_done;
  int64_t instances = 0;  // steps released so far
  int front_left = 0;     // front tasks of the latest released step not yet done
  int front_tasks = 0;    // front tasks in a step
  // What a step's optimizer reads, per step instance modulo 2 (two steps may be in flight).
  struct StepSlot {
    StepParams params;
    std::vector<std::vector<GradStats>> stats;  // [unit][rank]
    bool have_global = false;
    GradStats global;
    float grad_scale = 1;
  };
  StepSlot step_slots[2];
  StepSlot& slot_of(int64_t k) { return step_slots[k % 2]; }
  std::vector<std::vector<std::vector<float>>> losses;  // [m][r]
  std::vector<std::vector<int64_t>> batch_sizes;        // [m][r]
  std::vector<std::vector<bool>> with_docs;             // [m][r]: HostBatch::doc_start given
  float backward_scale = 1;
  // Timing: every finished span since the last period began (for its busy times), every span
  // (with ExecutorOptions::record), the start of the task each lane is running (-1: none), and
  // the end of the last step() (the next period's start while a step is in flight).
  std::vector<TaskSpan> spans, recorded;
  std::vector<double> running_since;
  double last_return = 0;
  std::chrono::steady_clock::time_point epoch = std::chrono::steady_clock::now();

  State(const Placement& p, const Schedule& s, Communicator& c, const ExecutorOptions& o)
      : pl(p), sc(&s), comm(c), opt(o) {}

  const UnitPartition& up(int u) const { return pl.partition.units[static_cast<size_t>(u)]; }
  uint64_t shard(int u) const { return up(u).shard; }
  int host_ranks(int u) const { return up(u).replicated ? 1 : N; }
  const UnitHomes& home(int u) const { return pl.homes[static_cast<size_t>(u)]; }
  Device& dev(int r) const { return comm.device(r); }
  std::vector<int> task_ranks(const Task& t, int u) const {
    std::vector<int> out;
    if (t.rank >= 0) {
      if (t.rank < host_ranks(u) || home(u).optimizer == Tier::gpu) out.push_back(t.rank);
    } else {
      for (int r = 0; r < host_ranks(u); ++r) out.push_back(r);
    }
    return out;
  }
  std::vector<Stream*> comm_streams() const {
    std::vector<Stream*> v;
    for (const auto& s : streams) v.push_back(s.comm.get());
    return v;
  }
  double now() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - epoch).count();
  }
  // g[e] += a[e] for e in [begin, end), both of the gradient dtype (rounded to nearest even).
  void accumulate(char* g, const char* a, size_t begin, size_t end) const {
    if (gt == DType::f32) {
      float* x = reinterpret_cast<float*>(g);
      const float* y = reinterpret_cast<const float*>(a);
      for (size_t e = begin; e < end; ++e) x[e] += y[e];
      return;
    }
    for (size_t e = begin; e < end; ++e)
      store_f32(g, gt, e, load_f32(g, gt, e) + load_f32(a, gt, e));
  }
  char* host_alloc(uint64_t bytes, const std::string& what, bool pinned_memory) {
    if (bytes == 0) return nullptr;
    if (pinned_memory) {
      void* p = pool->allocate(bytes, what);
      pool_blocks.push_back(p);
      return static_cast<char*>(p);
    }
    char* p = static_cast<char*>(std::aligned_alloc(kPage, round_up(bytes, kPage)));
    if (p == nullptr)
      fail(
          "executor: {} bytes of host memory for {} could not be allocated; lower --cpu-memory "
          "or offload to NVMe",
          bytes, what);
    plain_blocks.emplace_back(p);
    return p;
  }
  static std::string shard_name(char kind, int u, int r) {
    return fmt::format("{}.{}.{}", kind, u, r);
  }

  // Resolves sc's tasks; with `allocate_staging` false the staging it needs must fit in the
  // buffers there are (evaluation's).
  void resolve(bool allocate_staging);
  void allocate();
  // The micro-batches' ids and targets onto the devices; returns the targets that count.
  int64_t upload(const std::vector<std::vector<HostBatch>>& batches, const char* what);
  // Runs the evaluation schedule swapped into sc once, one thread per lane, while the step
  // lanes are idle; on failure marks the executor broken and throws.
  void run_lanes();
  // Throws when an earlier step or evaluation failed.
  void check_usable() const;
  // The step lanes: started by the first step, stopped by the destructor.
  void start_workers();
  void worker(int lane);
  // Waits until every lane has run instance k (k < 0: returns at once); throws when a task
  // failed. drain(): every released step.
  void wait_lanes(int64_t k);
  void drain() { wait_lanes(released); }
  // Under mu: marks the executor broken after a failure, waits for the streams, throws.
  [[noreturn]] void fail_stopped();
  // The global gradient statistics and combined scale of slot `sl`'s step (under mu).
  void ensure_global(StepSlot& sl) const;
  double loss_sum() const;
  void run_task(const Task& t, int64_t k);
  // Adam on unit u's shards with gradient statistics `stats` (the step's global ones, or the
  // unit's when updating during the backward) and the combined scale.
  void update(const Task& t, const StepSlot& sl, const GradStats& stats, float grad_scale);
  // Whether the optimizer runs during the backward (ScheduleOptions::update_during_backward).
  bool early() const { return sc->options.update_during_backward; }
  // Micro-batches whose gradients one reduction sums (ScheduleOptions::reduce_per_group).
  int reduce_span() const { return sc->options.reduce_per_group ? sc->micro_batch_group : 1; }
  // Whether slot k's step is skipped (non-finite gradients); never while updating during the
  // backward, where a non-finite gradient stops the run instead.
  bool skipped(int64_t k) { return !early() && slot_of(k).global.non_finite; }
  void zero_unit_grads(const Task& t);
  void run_group(int first, int end, int lane);
  // An Error unless the placement holds training state (RunShape::training): `what` needs it.
  void check_training(const char* what) const {
    if (!pl.shape.training)
      fail(
          "executor: {} needs gradients and optimizer state, but this executor holds "
          "parameters only (built for evaluation); build it from a placement with training state",
          what);
  }
  // A replicated unit's view: its resident parameters, no gradient buffer.
  void reset_replicated(int x) {
    for (int q = 0; q < N; ++q)
      views[static_cast<size_t>(q)][static_cast<size_t>(x)] =
          UnitBuffers{zero->param_shard(x, q).data, nullptr};
  }
  // One holder of a gathered unit is done with it (called under mu); the last releases it.
  void let_go(int leader) {
    if (--users_left[static_cast<size_t>(leader)] > 0) return;
    const int x = sc->tasks[static_cast<size_t>(leader)].unit;
    zero->release(x, comm_streams());
    for (auto& v : views) v[static_cast<size_t>(x)] = UnitBuffers{};
  }
  // Runs lane's tasks of instance k (its dependencies: done_at >= k, prev ones >= k - 1),
  // recording spans as step `span_step`.
  void lane_loop(int lane, int64_t k, int span_step);
  // Whether task t of instance k may start: its deps done in instance k, its prev ones (and
  // xprev's) in k - 1 (under mu).
  bool ready(const Task& t, int64_t k) const {
    for (int d : t.deps)
      if (done_at[static_cast<size_t>(d)] < k) return false;
    for (const std::vector<int>* v :
         {&t.prev, static_cast<const std::vector<int>*>(&xprev[static_cast<size_t>(t.id)])})
      for (int p : *v)
        if (done_at[static_cast<size_t>(p)] < k - 1) return false;
    return true;
  }
  // lane_waits for the lanes of sc; only while no lane thread is within a step.
  void size_lane_waits() {
    if (lane_wait_count >= sc->lanes.size()) return;
    lane_wait_count = sc->lanes.size();
    lane_waits = std::make_unique<LaneWait[]>(lane_wait_count);
  }
  // Whether wait w may be over (under mu): its task ready, its group done; a kAny wait's
  // condition is its waiter's to check.
  bool wait_over(const LaneWait& w) const {
    switch (w.what) {
      case LaneWait::kTask:
        return ready(*w.task, w.k);
      case LaneWait::kDone:
        return done_at[static_cast<size_t>(w.id)] >= w.k;
      case LaneWait::kAny:
        return true;
      case LaneWait::kNone:
        break;
    }
    return false;
  }
  // On `lane`'s thread, under `lock`: returns once stop or the wait {what, t, id, k} is over
  // (kTask: task t of instance k ready; kDone: task id of instance k done), or, for kAny, once
  // stop or any_over(), waiting on the lane's own variable.
  template <typename AnyOver>
  void lane_wait(std::unique_lock<std::mutex>& lock, int lane, typename LaneWait::What what,
                 const Task* t, int id, int64_t k, AnyOver any_over) {
    LaneWait& w = lane_waits[static_cast<size_t>(lane)];
    w.what = what;
    w.task = t;
    w.id = id;
    w.k = k;
    auto over = [&] { return what == LaneWait::kAny ? any_over() : wait_over(w); };
    w.cv.wait(lock, [&] { return stop || over(); });
    w.what = LaneWait::kNone;
  }
  void lane_wait(std::unique_lock<std::mutex>& lock, int lane, typename LaneWait::What what,
                 const Task* t, int id, int64_t k) {
    lane_wait(lock, lane, what, t, id, k, [] { return true; });
  }
  // Under mu, after tasks finished: wakes each lane whose wait may be over (every waiting lane
  // when `all`, as on stop).
  void wake_lanes(bool all) {
    for (size_t l = 0; l < lane_wait_count; ++l) {
      LaneWait& w = lane_waits[l];
      if (w.what != LaneWait::kNone && (all || wait_over(w))) w.cv.notify_one();
    }
  }
  // Sends unit u's staged parameters (the padded unit in its dtype) to every home, with an
  // optimizer state made from them (master = the parameters, m = v = 0), or with `state`'s
  // (master, m and v of the unit's numel elements each; the padding zero).
  void write_unit(int u, const std::vector<char>& staged,
                  const UnitOptimizerState* state = nullptr);
  // The pieces of rank r's shard of unit u that take weight decay and those that do not (the
  // 1-D norm weights and biases, Hugging Face Trainer's convention, unless `every` says all
  // do), in order: {begin, length, decay}, relative to the shard. Adam is elementwise, so
  // updating piece by piece gives the bits of one call wherever the decay is the same.
  struct Piece {
    uint64_t begin = 0, length = 0;
    bool decay = true;
  };
  std::vector<Piece> pieces(int u, int r, bool every) const {
    const uint64_t first = up(u).shard_offset(r), n = shard(u);
    if (every) return {Piece{0, n, true}};
    std::vector<Piece> out;
    uint64_t at = 0;
    for (const ParamSlot& p : layout.units[static_cast<size_t>(u)].params) {
      if (p.shape.rank != 1) continue;
      const uint64_t b = std::max(p.offset, first), e = std::min(p.offset + p.numel(), first + n);
      if (b >= e) continue;
      if (b - first > at) out.push_back({at, b - first - at, true});
      out.push_back({b - first, e - b, false});
      at = e - first;
    }
    if (at < n) out.push_back({at, n - at, true});
    return out;
  }
};

// ---- resolution of the schedule ----

void Executor::State::resolve(bool allocate_staging) {
  const size_t T = sc->tasks.size();
  const Ancestry anc(*sc);
  slot.assign(T, -1);
  src.assign(T, {});
  uses.assign(T, {});
  gather_bwd.assign(T, 0);
  rs_clear.assign(T, 0);
  holders.assign(T, 0);
  rs_gather.assign(T, -1);
  d2h_staged.assign(T, 0);
  direct.assign(T, 0);
  group_of.assign(T, {0, 0});
  xprev.assign(T, {});
  done_at.assign(T, -1);
  arrived.assign(T, 0);
  users_left.assign(T, 0);
  front.assign(T, 0);
  for (const Task& t : sc->tasks) {
    switch (t.kind) {
      case TaskKind::grad_offload:
      case TaskKind::optim_read:
      case TaskKind::adam:
      case TaskKind::optim_write:
      case TaskKind::param_write:
      case TaskKind::param_upload:
      case TaskKind::param_d2h:
        break;
      case TaskKind::grad_read:  // the optimizer's reads the step's sum back
        front[static_cast<size_t>(t.id)] = t.micro_batch >= 0 ? 1 : 0;
        break;
      default:
        front[static_cast<size_t>(t.id)] = 1;
    }
  }
  for (size_t t = 0; t < T; ++t) group_of[t] = anc.group(static_cast<int>(t));
  lanes.assign(sc->lanes.size(), {});
  for (const Task& t : sc->tasks) lanes[static_cast<size_t>(t.lane)].push_back(t.id);

  auto need = [&](int producer, const Task& consumer, const char* what) {
    if (producer < 0)
      fail(
          "schedule: {} has no earlier {} to read from; the schedule does not fit this "
          "placement",
          task_label(*sc, consumer), what);
    if (!anc.depends(producer, consumer.id))
      fail("schedule: {} reads what {} produced but does not depend on it",
           task_label(*sc, consumer), task_label(*sc, sc->tasks[static_cast<size_t>(producer)]));
  };
  // seen[kind][unit][rank + 1]: the tasks of that kind so far, in order (slot 0: all ranks).
  // A consumer reads from the latest of them that it depends on, not simply the latest: with a
  // deep prefetch the gather for a unit's next run is emitted before this run's computes.
  auto key = [&](TaskKind k, int u) { return static_cast<size_t>(k) * U + static_cast<size_t>(u); };
  std::vector<std::vector<std::vector<int>>> seen(
      static_cast<size_t>(kTaskKinds) * static_cast<size_t>(U),
      std::vector<std::vector<int>>(static_cast<size_t>(N) + 1));
  // The latest task of kind k for unit u (rank r, or all ranks) that `consumer` depends on;
  // else the latest one at all (need() then names it), else -1.
  auto latest_for = [&](TaskKind k, int u, int r, const Task& consumer) {
    int any = -1;
    const auto& v = seen[key(k, u)];
    for (const std::vector<int>* list : {&v[0], &v[static_cast<size_t>(r) + 1]})
      for (auto it = list->rbegin(); it != list->rend(); ++it) {
        any = std::max(any, *it);
        if (anc.depends(*it, consumer.id)) return *it;
      }
    return any;
  };
  // Pass 1: who reads what. pool_of: -1 none, 0 pinned, 1 + r device parameter landing
  // buffers of rank r, 1 + N + r device gradient staging of rank r.
  std::vector<int> pool_of(T, -1);
  std::vector<std::vector<int>> consumers(T);
  // grad_offload of ranks > 0: rank 0's, whose pinned buffer they write their parts of.
  std::vector<int> shared_leader(T, -1);
  auto read = [&](int producer, int consumer) {
    consumers[static_cast<size_t>(producer)].push_back(consumer);
  };
  // A per-rank task writing its part of one pinned buffer (a grad_offload, or G home nvme's
  // grad_d2h): rank 0's takes the buffer, the others write into it (rank_part).
  auto share_rank0s_buffer = [&](const Task& t) {
    if (t.rank == 0) {
      pool_of[static_cast<size_t>(t.id)] = 0;
      return;
    }
    const std::vector<int>& rank0 = seen[key(t.kind, t.unit)][1];
    if (rank0.empty())
      fail("schedule: {} has no {} of rank 0 before it to share a buffer with", task_label(*sc, t),
           task_kind_name(t.kind));
    shared_leader[static_cast<size_t>(t.id)] = rank0.back();
  };
  // G home nvme: the task whose pinned buffer holds the step's sum of unit u so far when
  // `consumer` (a grad_stats or grad_write) runs: the grad_read a grad_accumulate added into,
  // else (the step's first reduction) rank 0's grad_d2h, whose buffer every rank's shares.
  auto nvme_grads = [&](const Task& consumer) {
    const int u = consumer.unit;
    bool added = false;
    for (int d : consumer.deps) {
      const Task& p = sc->tasks[static_cast<size_t>(d)];
      added = added || (p.kind == TaskKind::grad_accumulate && p.unit == u);
    }
    const int p = added ? latest_for(TaskKind::grad_read, u, -1, consumer)
                        : latest_for(TaskKind::grad_d2h, u, 0, consumer);
    need(p, consumer, added ? "grad_read" : "grad_d2h");
    src[static_cast<size_t>(consumer.id)] = {p};
    read(p, consumer.id);
  };
  // The act_d2h or act_h2d of block v's checkpoint for consumer's micro-batch and rank, which
  // `consumer` must depend on directly.
  auto need_act = [&](TaskKind kind, int v, const Task& consumer) {
    for (int d : consumer.deps) {
      const Task& p = sc->tasks[static_cast<size_t>(d)];
      if (p.kind == kind && p.unit == v && p.rank == consumer.rank &&
          p.micro_batch == consumer.micro_batch)
        return;
    }
    fail("schedule: {} does not wait for the {} of unit {}'s activation checkpoint",
         task_label(*sc, consumer), task_kind_name(kind), up(v).name);
  };
  for (const Task& t : sc->tasks) {
    const int u = t.unit;
    const UnitHomes& h = home(u);
    const size_t id = static_cast<size_t>(t.id);
    switch (t.kind) {
      case TaskKind::param_read:
      case TaskKind::optim_read:
      case TaskKind::grad_read:
        pool_of[id] = 0;
        break;
      case TaskKind::grad_write:
        nvme_grads(t);
        break;
      case TaskKind::param_h2d:
        if (h.param == Tier::nvme) {
          const int p = latest_for(TaskKind::param_read, u, t.rank, t);
          need(p, t, "param_read");
          src[id] = {p};
          read(p, t.id);
        }
        pool_of[id] = 1 + t.rank;
        break;
      case TaskKind::gather:
        if (!zero->param_resident(u)) {
          const int p = latest_for(TaskKind::param_h2d, u, t.rank, t);
          need(p, t, "param_h2d");
          src[id] = {p};
          read(p, t.id);
        }
        break;
      case TaskKind::forward:
      case TaskKind::backward: {
        std::vector<int> units{u};
        if (const int x = layout.tied_table(u); x >= 0) units.push_back(x);
        for (int x : units) {
          if (up(x).replicated) continue;  // used in place, never gathered
          const int g = latest_for(TaskKind::gather, x, t.rank, t);
          need(g, t, "gather");
          if (N == 1 && !zero->param_resident(x)) {
            // One rank computes on the landing buffer itself (ZeroModel::gather), so it is
            // read until the run's last compute, not just by the gather.
            const int landed = latest_for(TaskKind::param_h2d, x, t.rank, t);
            need(landed, t, "param_h2d");
            read(landed, t.id);
          }
          const int leader = group_of[static_cast<size_t>(g)].first;
          uses[id].push_back(leader);
          if (t.kind == TaskKind::backward) gather_bwd[static_cast<size_t>(leader)] = 1;
          ++holders[static_cast<size_t>(leader)];
        }
        if (t.kind == TaskKind::backward)
          for (int d : t.deps) {
            const Task& p = sc->tasks[static_cast<size_t>(d)];
            if (p.unit != u || up(u).replicated) continue;
            if (p.kind == TaskKind::reduce_scatter)
              rs_clear[static_cast<size_t>(group_of[static_cast<size_t>(d)].first)] = 1;
          }
        // An offloaded checkpoint: a backward reads its input once it is back on the GPU; a
        // forward overwrites the slot of the one K units back once it is on the host.
        if (act_n > 0 && !sc->options.forward_only) {
          const int K = checkpoint_slots(pl.shape);
          const bool bwd = t.kind == TaskKind::backward;
          const int v = bwd ? u : u - K + 1;
          if (v >= act_first && v < act_first + act_n)
            need_act(bwd ? TaskKind::act_h2d : TaskKind::act_d2h, v, t);
        }
        break;
      }
      case TaskKind::act_d2h:
      case TaskKind::act_h2d:
        if (u < act_first || u >= act_first + act_n)
          fail("schedule: {} moves the input of a unit whose checkpoint is not offloaded",
               task_label(*sc, t));
        if (t.kind == TaskKind::act_h2d) need_act(TaskKind::act_d2h, u, t);
        break;
      case TaskKind::reduce_scatter:
        if (!zero->grad_resident(u)) pool_of[id] = 1 + N + t.rank;  // unless direct (below)
        if (!up(u).replicated) {
          const int g = latest_for(TaskKind::gather, u, t.rank, t);
          need(g, t, "gather");
          if (group_of[id].first == t.id) {
            rs_gather[id] = group_of[static_cast<size_t>(g)].first;
            ++holders[static_cast<size_t>(rs_gather[id])];
          }
        }
        break;
      case TaskKind::grad_d2h:
        if (t.slot >= 0) {
          if (N != 1 || zero->grad_resident(u) || up(u).replicated)
            fail(
                "schedule: {} reads a working buffer, which only one rank's grad_d2h of a "
                "sharded unit with G off the GPU does",
                task_label(*sc, t));
          const int p = latest_for(TaskKind::reduce_scatter, u, t.rank, t);
          need(p, t, "reduce_scatter");
          pool_of[static_cast<size_t>(p)] = -1;  // no staging: this copy reads the gradients
          direct[static_cast<size_t>(p)] = 1;
          direct[id] = 1;
          const int g = latest_for(TaskKind::gather, u, t.rank, t);
          need(g, t, "gather");
          rs_gather[id] = group_of[static_cast<size_t>(g)].first;
          ++holders[static_cast<size_t>(rs_gather[id])];
        } else if (!up(u).replicated) {
          const int p = latest_for(TaskKind::reduce_scatter, u, t.rank, t);  // its staging
          need(p, t, "reduce_scatter");
          src[id] = {p};
          read(p, t.id);
        }
        if (h.grad == Tier::nvme) {  // every reduction staged: each rank's part of rank 0's
          d2h_staged[id] = 1;
          share_rank0s_buffer(t);
        }
        break;
      case TaskKind::grad_accumulate:
        if (h.grad == Tier::nvme) {  // adds every rank's staged part into the sum read back
          const int g = latest_for(TaskKind::grad_read, u, -1, t);
          need(g, t, "grad_read");
          src[id] = {g};
          read(g, t.id);
          for (int r : task_ranks(t, u)) {
            const int p = latest_for(TaskKind::grad_d2h, u, r, t);
            need(p, t, "grad_d2h");
            src[id].push_back(p);
            read(p, t.id);
          }
        } else if (!up(u).replicated) {
          // The shards it adds come through pinned buffers; the first micro-batch's d2h
          // (with no grad_accumulate) writes G directly.
          // Like a grad_offload's, the staging buffer is the schedule's one pinned buffer of
          // the unit: each rank writes its part of the first rank's (rank_part).
          for (int r : task_ranks(t, u)) {
            const int p = latest_for(TaskKind::grad_d2h, u, r, t);
            need(p, t, "grad_d2h");
            if (src[id].empty())
              pool_of[static_cast<size_t>(p)] = 0;
            else
              shared_leader[static_cast<size_t>(p)] = src[id].front();
            src[id].push_back(p);
            read(p, t.id);
            d2h_staged[static_cast<size_t>(p)] = 1;
          }
        }
        break;
      case TaskKind::grad_offload:
        share_rank0s_buffer(t);
        break;
      case TaskKind::adam: {
        if (h.optimizer == Tier::nvme) {
          const int p = latest_for(TaskKind::optim_read, u, -1, t);
          need(p, t, "optim_read");
          src[id] = {p};
          read(p, t.id);
        }
        if (h.grad == Tier::nvme) {  // the step's sum read back (src's last entry)
          const int p = latest_for(TaskKind::grad_read, u, -1, t);
          need(p, t, "grad_read");
          src[id].push_back(p);
          read(p, t.id);
        }
        if (h.optimizer != Tier::gpu && h.grad == Tier::gpu) {
          // The gradients come down into rank 0's grad_offload buffer (src's last entry).
          for (int r : task_ranks(t, u))
            need(latest_for(TaskKind::grad_offload, u, r, t), t, "grad_offload");
          const int p = latest_for(TaskKind::grad_offload, u, 0, t);
          src[id].push_back(p);
          read(p, t.id);
        }
        const bool out = (h.optimizer != Tier::gpu && h.param != Tier::cpu) ||
                         (h.optimizer == Tier::gpu && h.param == Tier::nvme);
        if (out) pool_of[id] = 0;
        break;
      }
      case TaskKind::optim_write: {
        const int p = latest_for(TaskKind::optim_read, u, -1, t);
        need(p, t, "optim_read");
        src[id] = {p};
        read(p, t.id);
        break;
      }
      case TaskKind::param_write:
      case TaskKind::param_upload: {
        const std::vector<int> rs = t.rank >= 0 ? std::vector<int>{t.rank} : task_ranks(t, u);
        for (int r : rs) {
          const int p = latest_for(TaskKind::adam, u, up(u).replicated ? 0 : r, t);
          need(p, t, "adam");
          // The GPUs' adam tasks (O gpu, P nvme) each write their rank's part of the first
          // one's buffer: the schedule's one pinned buffer of the unit.
          if (!src[id].empty() && p != src[id].front())
            shared_leader[static_cast<size_t>(p)] = src[id].front();
          src[id].push_back(p);
          read(p, t.id);
        }
        break;
      }
      case TaskKind::grad_stats:
        if (h.grad == Tier::nvme) nvme_grads(t);
        break;
      case TaskKind::param_d2h:
        break;
    }
    seen[key(t.kind, u)][static_cast<size_t>(t.rank) + 1].push_back(t.id);
  }
  // Pass 2: buffers to producers, in task order, each freed by its readers.
  SlotPool pinned_pool;
  std::vector<SlotPool> param_pools(static_cast<size_t>(N)), grad_pools(static_cast<size_t>(N));
  std::vector<std::vector<int>> followers(T);
  for (size_t t = 0; t < T; ++t)
    if (shared_leader[t] >= 0)
      followers[static_cast<size_t>(shared_leader[t])].push_back(static_cast<int>(t));
  for (size_t t = 0; t < T; ++t) {
    if (shared_leader[t] >= 0) {  // every rank's part in one buffer, freed after its readers
      if (static_cast<size_t>(shared_leader[t]) >= t)
        fail("schedule: {} shares the pinned buffer of {}, which comes after it",
             task_label(*sc, sc->tasks[t]),
             task_label(*sc, sc->tasks[static_cast<size_t>(shared_leader[t])]));
      slot[t] = slot[static_cast<size_t>(shared_leader[t])];
      continue;
    }
    const int p = pool_of[t];
    if (p < 0) continue;
    SlotPool& slots = p == 0   ? pinned_pool
                      : p <= N ? param_pools[static_cast<size_t>(p - 1)]
                               : grad_pools[static_cast<size_t>(p - 1 - N)];
    const Task& task = sc->tasks[t];
    slot[t] = slots.take(static_cast<int>(t), consumers[t], anc,
                         p == 0   ? task.buffer
                         : p <= N ? task.slot
                                  : -1,
                         followers[t]);
  }
  pinned_pool.order_across_steps(xprev);
  for (int r = 0; r < N; ++r) {
    param_pools[static_cast<size_t>(r)].order_across_steps(xprev);
    grad_pools[static_cast<size_t>(r)].order_across_steps(xprev);
  }
  for (size_t t = 0; t < T; ++t)  // the leader's first write of a buffer is theirs too
    if (shared_leader[t] >= 0) xprev[t] = xprev[static_cast<size_t>(shared_leader[t])];

  if (!allocate_staging) {
    bool fits = pinned_pool.last.size() <= pinned.size();
    for (int r = 0; r < N; ++r)
      fits =
          fits &&
          param_pools[static_cast<size_t>(r)].last.size() <=
              dev_param[static_cast<size_t>(r)].size() &&
          grad_pools[static_cast<size_t>(r)].last.size() <= dev_grad[static_cast<size_t>(r)].size();
    if (!fits)
      fail(
          "executor: the forward-only schedule needs more staging buffers ({} pinned) than the "
          "step's ({}); this is a bug in strata's schedule builder",
          pinned_pool.last.size(), pinned.size());
    return;
  }
  pinned.assign(pinned_pool.last.size(), nullptr);
  dev_param.clear();
  dev_param.resize(static_cast<size_t>(N));
  dev_grad.clear();
  dev_grad.resize(static_cast<size_t>(N));
  for (int r = 0; r < N; ++r) {
    for (size_t i = 0; i < param_pools[static_cast<size_t>(r)].last.size(); ++i)
      dev_param[static_cast<size_t>(r)].emplace_back(dev(r), pl.partition.max_shard_numel() * ps,
                                                     fmt::format("parameter landing buffer {}", i),
                                                     MemoryKind::gathered);
    for (size_t i = 0; i < grad_pools[static_cast<size_t>(r)].last.size(); ++i)
      dev_grad[static_cast<size_t>(r)].emplace_back(dev(r), pl.partition.max_shard_numel() * gs,
                                                    fmt::format("gradient staging buffer {}", i),
                                                    MemoryKind::communication);
  }
}

// ---- allocation ----

void Executor::State::allocate() {
  const bool pin = pl.request.pin_memory;
  uint64_t max_shard = 0;
  for (int u = 0; u < U; ++u) max_shard = std::max(max_shard, shard(u));
  // A pinned staging buffer holds the largest transfer that goes through one (run_task): a
  // unit's P of every host rank (read from NVMe, or updated on the host or a GPU on its way
  // out), G of every host rank staged for accumulation or brought down from
  // the GPU for CPU Adam, or a unit's O of every host rank (NVMe);
  // each rank's part page aligned (rank_part).
  // The same figure as Placement's pinned_buffer_bytes.
  uint64_t slot_bytes = 0;
  for (int u = 0; u < U; ++u) {
    const int hr = host_ranks(u);
    if (home(u).param != Tier::gpu || home(u).optimizer != Tier::gpu)
      slot_bytes = std::max(slot_bytes, rank_part(hr, shard(u) * ps));
    if (home(u).grad != Tier::gpu || home(u).optimizer != Tier::gpu)  // staged, or for CPU Adam
      slot_bytes = std::max(slot_bytes, rank_part(hr, shard(u) * gs));
    if (home(u).optimizer == Tier::nvme)
      slot_bytes = std::max(slot_bytes, rank_part(hr, shard(u) * os));
  }
  pinned_slot_bytes = round_up(slot_bytes, kPage);
  // With pin_memory, the cpu-homed state a device copies to or from in place is page-locked
  // too: parameters (param_h2d, the GPU's update coming back) and gradient accumulators (a
  // one-rank d2h). Optimizer state is not: only CPU Adam and memcpy touch it, so locking it
  // would buy no transfer speed, and it is the largest part (12 bytes a parameter with Adam): on
  // one H100 machine, page-locking 73 GB for a 4.5B model took 88 s, about 54 GB of it Adam's.
  uint64_t capacity = pinned.size() * pinned_slot_bytes;
  // Offloaded activation checkpoints: a block per rank, page-locked with pin_memory (a device
  // copies every one out and back each micro-batch), as Placement counts them.
  const uint64_t act_block =
      static_cast<uint64_t>(pl.shape.micro_batch_group) * static_cast<uint64_t>(act_n) * act_stride;
  if (pin && act_block > 0) capacity += static_cast<uint64_t>(N) * round_up(act_block, kPage);
  for (int u = 0; u < U; ++u) {
    for (int r = 0; r < host_ranks(u); ++r) {
      if (!pin) break;
      if (home(u).param == Tier::cpu) capacity += round_up(shard(u) * ps, kPage);
      if (home(u).grad == Tier::cpu) capacity += round_up(shard(u) * gs, kPage);
    }
  }
  bool cuda = false;
  for (int r = 0; r < N; ++r) cuda = cuda || dev(r).backend() == Backend::cuda;
  if (capacity > 0 && opt.pinned_limit > 0 && capacity > opt.pinned_limit)
    fail(
        "pinned pool: {} of staging buffers ({} x {}){} must be page-locked, but the pinned-memory "
        "limit is {}; raise it (--pinned-memory, ulimit -l), set pin_memory false, or lower the "
        "buffer count",
        format_bytes(capacity), pinned.size(), format_bytes(pinned_slot_bytes),
        pin ? " and cpu-homed parameters and gradients" : "", format_bytes(opt.pinned_limit));
  if (capacity > 0) {
    PinnedPoolOptions po;
    po.capacity = capacity;
    po.cuda = cuda;
    pool = std::make_unique<PinnedPool>(po);
  }
  for (size_t i = 0; i < pinned.size(); ++i) {
    pinned[i] =
        static_cast<char*>(pool->allocate(pinned_slot_bytes, fmt::format("staging buffer {}", i)));
    pool_blocks.push_back(pinned[i]);
  }
  host_act.assign(static_cast<size_t>(N), nullptr);
  for (int r = 0; r < N; ++r)
    host_act[static_cast<size_t>(r)] = host_alloc(
        act_block, fmt::format("the activation checkpoints of rank {} (offloaded)", r), pin);
  host_p.assign(static_cast<size_t>(U), {});
  host_g.assign(static_cast<size_t>(U), {});
  host_o.assign(static_cast<size_t>(U), {});
  uint64_t nvme_bytes = 0;
  for (int u = 0; u < U; ++u)
    for (int r = 0; r < host_ranks(u); ++r) {
      const std::string what = fmt::format("unit {} rank {}", up(u).name, r);
      const uint64_t n = shard(u);
      host_p[static_cast<size_t>(u)].push_back(
          home(u).param == Tier::cpu ? host_alloc(n * ps, "parameters of " + what, pin) : nullptr);
      host_g[static_cast<size_t>(u)].push_back(
          home(u).grad == Tier::cpu ? host_alloc(n * gs, "gradients of " + what, pin) : nullptr);
      host_o[static_cast<size_t>(u)].push_back(
          home(u).optimizer == Tier::cpu ? host_alloc(n * os, "optimizer state of " + what, false)
                                         : nullptr);
      if (home(u).param == Tier::nvme) nvme_bytes += round_up(n * ps, pl.request.nvme_stripe);
      if (home(u).optimizer == Tier::nvme) nvme_bytes += round_up(n * os, pl.request.nvme_stripe);
      if (pl.shape.training && home(u).grad == Tier::nvme)
        nvme_bytes += round_up(n * gs, pl.request.nvme_stripe);
    }
  if (nvme_bytes > 0) {
    nvme::SwapStoreOptions so;
    so.paths = pl.request.nvme_paths;
    so.capacity = nvme_bytes;
    so.stripe = pl.request.nvme_stripe;
    so.io = opt.io;
    so.io.queue_depth = pl.request.nvme_queue_depth;
    so.channels = 2;
    for (const nvme::Fault& f : nvme::faults_from_env()) so.io.faults.push_back(f);
    if (!so.io.faults.empty())
      log_warn("STRATA_NVME_FAULTS: injecting {} fault(s) into the swap store's I/O",
               so.io.faults.size());
    store = std::make_unique<nvme::SwapStore>(so);
    for (int u = 0; u < U; ++u)
      for (int r = 0; r < host_ranks(u); ++r) {
        if (home(u).param == Tier::nvme) store->add_shard(shard_name('P', u, r), shard(u) * ps);
        if (home(u).optimizer == Tier::nvme) store->add_shard(shard_name('O', u, r), shard(u) * os);
        if (pl.shape.training && home(u).grad == Tier::nvme)
          store->add_shard(shard_name('G', u, r), shard(u) * gs);
      }
  }
  o_dev.clear();
  o_dev.resize(static_cast<size_t>(U));
  bool gpu_stats = false, gpu_adam_off = false;  // gradients on a device: their statistics too
  for (int u = 0; u < U && pl.shape.training; ++u) {
    gpu_stats = gpu_stats || home(u).grad == Tier::gpu;
    if (home(u).optimizer != Tier::gpu) continue;
    gpu_adam_off = gpu_adam_off || home(u).param != Tier::gpu;
    const std::array<std::string, 3> parts = {
        "master weights", fmt::format("{} m", optimizer_type_name(ot)),
        fmt::format("{} {}", optimizer_type_name(ot),
                    ot == OptimizerType::adagrad ? "sum of squares" : "v")};
    for (int r = 0; r < N; ++r)
      for (size_t k = 0; k < parts.size(); ++k)
        if (array_of(k) >= 0)
          o_dev[static_cast<size_t>(u)].emplace_back(
              dev(r), shard(u) * 4, fmt::format("{} of unit {}", parts[k], up(u).name),
              MemoryKind::optimizer);
  }
  for (int r = 0; r < N; ++r) {
    if (gpu_stats)
      chunk_sums.emplace_back(dev(r), cpu_adam::chunk_count(max_shard, CpuAdam::kStatsChunk) * 8,
                              "gradient chunk sums", MemoryKind::other);
    if (gpu_adam_off)
      param_tmp.emplace_back(dev(r), max_shard * ps, "updated parameters on their way out",
                             MemoryKind::other);
  }
}

Executor::Executor(const Placement& placement, const Schedule& schedule, Communicator& comm,
                   const ExecutorOptions& options)
    : placement_(placement), schedule_(schedule) {
  schedule_.validate();
  s_ = std::make_unique<State>(placement_, schedule_, comm, options);
  State& s = *s_;
  const RunShape& shape = placement_.shape;
  s.N = comm.size();
  s.M = schedule_.options.micro_batches;
  s.layout = ModelLayout::build(shape.model);
  s.U = s.layout.num_units();
  s.pt = shape.param_dtype;
  s.gt = shape.grad_dtype;
  s.ps = dtype_size(s.pt);
  s.gs = dtype_size(s.gt);
  s.ot = shape.optimizer;
  s.os = optimizer_state_bytes(s.ot);
  s.oa = optimizer_state_arrays(s.ot);
  if (shape.ranks != s.N || schedule_.ranks != s.N || schedule_.units != s.U ||
      placement_.partition.num_units() != s.U ||
      placement_.homes.size() != static_cast<size_t>(s.U))
    fail(
        "executor: the placement is for {} ranks and {} units, the schedule for {} ranks and {} "
        "units, the devices are {} and the model has {} units; build all from the same run "
        "shape",
        shape.ranks, placement_.homes.size(), schedule_.ranks, schedule_.units, s.N, s.U);

  if (!shape.training && !schedule_.options.forward_only)
    fail(
        "executor: the placement holds parameters only (built for evaluation), but the schedule "
        "trains; build the schedule with forward_only, or the placement with training state");
  ZeroOptions zo;
  zo.param_dtype = s.pt;
  zo.grad_dtype = s.gt;
  zo.with_grads = shape.training;
  zo.persistence_threshold = shape.persistence_threshold;
  zo.working_buffers = shape.working_buffers;
  for (int u = 0; u < s.U; ++u) {
    zo.param_resident.push_back(s.home(u).param == Tier::gpu || s.up(u).replicated);
    zo.grad_resident.push_back(s.home(u).grad == Tier::gpu || s.up(u).replicated);
  }
  s.zero = std::make_unique<ZeroModel>(s.layout, comm, zo);
  if (s.zero->partition().num_units() != s.U ||
      s.zero->partition().max_unit_numel() != placement_.partition.max_unit_numel())
    fail(
        "executor: the placement's partition differs from the model state's; build the "
        "placement with this model's persistence threshold and alignment");
  ModelOptions mo;
  mo.param_dtype = s.pt;
  mo.grad_dtype = s.gt;
  mo.max_batch = shape.micro_batch;
  mo.seq_len = shape.seq_len;
  mo.recompute = shape.recompute;
  mo.activation_sets = shape.micro_batch_group;  // as the placement counts them
  mo.forward_only = !shape.training;
  mo.kv_cache = shape.kv_cache;
  mo.checkpoint_slots = checkpoint_slots(shape);
  s.act_first = s.layout.first_block();
  s.act_n = offloaded_checkpoints(shape.model, mo.checkpoint_slots);
  s.act_stride = activation_bytes(shape);
  if (schedule_.micro_batch_group > shape.micro_batch_group)
    fail(
        "executor: the schedule runs micro-batches in groups of {} but the placement keeps the "
        "activations of {}; build both from the same run shape",
        schedule_.micro_batch_group, shape.micro_batch_group);
  const uint64_t rows = static_cast<uint64_t>(shape.micro_batch * shape.seq_len);
  for (int r = 0; r < s.N; ++r) {
    Device& d = s.dev(r);
    s.models.push_back(std::make_unique<LlamaModel>(shape.model, mo, d));
    if (shape.training) {  // the gradients flowing between units in the backward
      const uint64_t act = static_cast<uint64_t>(shape.micro_batch_group) * rows *
                           static_cast<uint64_t>(shape.model.hidden_size) * s.ps;
      s.act_a.emplace_back(d, act, "activation gradient", MemoryKind::activations);
      s.act_b.emplace_back(d, act, "activation gradient", MemoryKind::activations);
    }
    s.ids_dev.emplace_back(d, rows * 4 * static_cast<uint64_t>(s.M), "token ids",
                           MemoryKind::activations);
    s.tgt_dev.emplace_back(d, rows * 4 * static_cast<uint64_t>(s.M), "targets",
                           MemoryKind::activations);
    if (shape.training || !shape.kv_cache)  // packed documents: training and evaluation
      s.doc_dev.emplace_back(d, rows * 4 * static_cast<uint64_t>(s.M), "document starts",
                             MemoryKind::activations);
    if (shape.kv_cache)
      s.logits_dev.emplace_back(d, static_cast<uint64_t>(shape.model.vocab_size) * 4, "logits",
                                MemoryKind::activations);
    State::RankStreams rs;
    rs.compute = d.create_stream(fmt::format("gpu[{}].compute", r));
    d.kernels().prepare(*rs.compute);  // no allocation once the lanes run
    rs.h2d = d.create_stream(fmt::format("gpu[{}].h2d", r));
    rs.d2h = d.create_stream(fmt::format("gpu[{}].d2h", r));
    rs.comm = d.create_stream(fmt::format("gpu[{}].comm", r));
    rs.setup = d.create_stream(fmt::format("gpu[{}].setup", r));
    rs.tail = d.create_stream(fmt::format("gpu[{}].tail", r));
    s.streams.push_back(std::move(rs));
  }
  s.resolve(true);
  s.allocate();
  if (shape.training) {
    CpuAdamOptions ao;
    ao.threads = options.cpu_adam_threads;
    s.adam = std::make_unique<CpuAdam>(ao);
  }
  s.views.assign(static_cast<size_t>(s.N), std::vector<UnitBuffers>(static_cast<size_t>(s.U)));
  s.rep_owner.assign(static_cast<size_t>(s.U), {-1, -1});
  for (int u = 0; u < s.U; ++u)
    if (s.up(u).replicated) s.reset_replicated(u);
  s.front_tasks = static_cast<int>(std::count(s.front.begin(), s.front.end(), char{1}));
}

Executor::~Executor() {
  if (!s_) return;
  try {
    s_->transfer_wait();  // a write behind or read ahead still running
  } catch (...) {
    // The transfer's caller has gone; nothing more to do while tearing down.
  }
  {
    // A step in flight runs to its end first: its lanes look at `quit` between steps only.
    std::lock_guard lock(s_->mu);
    s_->quit = true;
    s_->cv.notify_all();
  }
  for (std::thread& w : s_->workers) w.join();
  for (auto& rs : s_->streams)
    for (Stream* st : {rs.compute.get(), rs.h2d.get(), rs.d2h.get(), rs.comm.get(), rs.setup.get(),
                       rs.tail.get()}) {
      try {
        st->synchronize();
      } catch (const Error&) {
        // Reported by the step that failed; nothing more to do while tearing down.
      }
    }
  if (s_->pool)
    for (void* p : s_->pool_blocks) s_->pool->release(p);
}

// ---- model state ----

void Executor::State::transfer_wait() {
  if (!transfer.pending.valid()) return;
  try {
    transfer.pending.get();
  } catch (...) {
    transfer.ahead_unit = -1;
    throw;
  }
}

char* Executor::State::job_block(uint64_t bytes) {
  transfer_wait();
  transfer.ahead_unit = -1;
  return transfer.job.room(bytes);
}

void Executor::State::transfer_done() {
  transfer_wait();
  transfer.ahead_unit = -1;
  transfer.job = Block{};
  transfer.held = Block{};
}

char* Executor::State::nvme_unit(char kind, int u) {
  transfer_wait();
  if (transfer.ahead_kind == kind && transfer.ahead_unit == u) {
    std::swap(transfer.job, transfer.held);
    transfer.ahead_unit = -1;
    return transfer.held.data.get();
  }
  char* block = transfer.held.room(rank_part(host_ranks(u), shard_bytes(kind, u)));
  read_shards(kind, u, block);
  return block;
}

void Executor::State::read_ahead(char kind, int u) {
  if ((kind == 'O' ? home(u).optimizer : home(u).param) != Tier::nvme) return;
  char* block = job_block(rank_part(host_ranks(u), shard_bytes(kind, u)));
  transfer.ahead_kind = kind;
  transfer.ahead_unit = u;
  transfer.pending =
      std::async(std::launch::async, [this, kind, u, block] { read_shards(kind, u, block); });
}

// Unit u's padded parameters (param dtype) to their home, and the optimizer state to its
// home: `state`'s master, m and v when given (each shard's part, the padding zero), else the
// master as the parameters in f32 and zeroed moments. What goes to NVMe is written behind: the
// call returns once the shards are staged in the transfer block, and the next transfer (or
// step) waits for the writes.
void Executor::State::write_unit(int u, const std::vector<char>& staged,
                                 const UnitOptimizerState* state) {
  const uint64_t n = shard(u), numel = up(u).numel;
  const bool training = pl.shape.training;
  // The block: each rank's optimizer state on its way to the GPU or NVMe, then each host
  // rank's parameters on their way to NVMe.
  const Tier oh = home(u).optimizer;
  const int o_ranks = !training ? 0 : oh == Tier::gpu ? N : oh == Tier::nvme ? host_ranks(u) : 0;
  const int p_ranks = home(u).param == Tier::nvme ? host_ranks(u) : 0;
  const uint64_t o_part = round_up(n * os, kPage), p_part = round_up(n * ps, kPage);
  char* block = o_ranks + p_ranks > 0 ? job_block(static_cast<uint64_t>(o_ranks) * o_part +
                                                  static_cast<uint64_t>(p_ranks) * p_part)
                                      : nullptr;
  char* p_block = block == nullptr ? nullptr : block + static_cast<uint64_t>(o_ranks) * o_part;
  for (int r = 0; r < N; ++r) {
    const uint64_t off = up(u).shard_offset(r);
    const char* p = staged.data() + off * ps;
    // The shard's optimizer state (a placement without training has none: its homes keep the
    // optimizer "gpu", so only the branch below needs the check), made where it lives when that
    // is host RAM.
    float* o = nullptr;
    if (oh == Tier::cpu && r < host_ranks(u))
      o = reinterpret_cast<float*>(host_o[static_cast<size_t>(u)][static_cast<size_t>(r)]);
    else if (r < o_ranks)
      o = reinterpret_cast<float*>(block + static_cast<uint64_t>(r) * o_part);
    if (training && o != nullptr) {
      if (state != nullptr) {
        const uint64_t have = off < numel ? std::min(n, numel - off) : 0;
        const std::array<const std::vector<float>*, 3> from = {&state->master, &state->m,
                                                               &state->v};
        for (size_t k = 0; k < 3; ++k) {
          if (array_of(k) < 0) continue;
          float* to = o + static_cast<uint64_t>(array_of(k)) * n;
          if (have > 0) copy_bytes(to, from[k]->data() + off, have * 4);
          copy_bytes(to + have, nullptr, (n - have) * 4);
        }
      } else {
        convert(o, DType::f32, p, pt, n);
        copy_bytes(o + n, nullptr, static_cast<uint64_t>(oa - 1) * n * 4);
      }
    }
    if (training && oh == Tier::gpu) {
      Stream& st = *streams[static_cast<size_t>(r)].setup;
      auto& b = o_dev[static_cast<size_t>(u)];
      for (int k = 0; k < oa; ++k)
        dev(r).copy_to_device(b[static_cast<size_t>(r * oa + k)].data(), o + k * n, n * 4, st);
      st.synchronize();
    }
    if (r >= host_ranks(u)) continue;
    if (home(u).param == Tier::cpu)
      copy_bytes(host_p[static_cast<size_t>(u)][static_cast<size_t>(r)], p, n * ps);
    if (home(u).param == Tier::nvme)
      copy_bytes(p_block + static_cast<uint64_t>(r) * p_part, p, n * ps);
    if (home(u).grad == Tier::cpu)
      copy_bytes(host_g[static_cast<size_t>(u)][static_cast<size_t>(r)], nullptr, n * gs);
  }
  const bool o_writes = oh == Tier::nvme && o_ranks > 0;
  if (!o_writes && p_ranks == 0) return;
  transfer.pending = std::async(std::launch::async, [this, u, block, p_block, o_writes, p_ranks] {
    if (o_writes) write_shards('O', u, block);
    if (p_ranks > 0) write_shards('P', u, p_block);
  });
}

// Each unit is made or read once and staged on the host, then sent to every home it has: the
// ZeroModel's resident shards, host RAM, NVMe, the optimizer's tiers. (Letting the ZeroModel
// load or initialise the model itself first read every tensor twice: 2 x 141 GB from disk for
// a 70B model in bf16.)
void Executor::init_random(uint64_t seed) {
  State& s = *s_;
  s.drain();
  s.zero->zero_grads();
  for (int u = 0; u < s.U; ++u) {
    std::vector<char> staged(s.up(u).padded * s.ps, char{0});
    init_unit_random(s.layout, u, seed, s.pt, staged.data());
    s.zero->scatter_staged(u, staged);
    s.write_unit(u, staged);
  }
  s.transfer_done();
}

void Executor::load(const SafetensorsReader& reader) {
  State& s = *s_;
  s.drain();
  s.zero->check_tensor_names(reader);
  s.zero->zero_grads();
  for (int u = 0; u < s.U; ++u) {
    std::vector<char> staged(s.up(u).padded * s.ps, char{0});
    for (const ParamSlot& p : s.layout.units[static_cast<size_t>(u)].params)
      read_parameter(reader, p, staged.data() + p.offset * s.ps, s.pt);
    s.zero->scatter_staged(u, staged);
    s.write_unit(u, staged);
  }
  s.transfer_done();
}

std::vector<float> Executor::parameters(int u) const {
  std::vector<float> out;
  parameters(u, out);
  return out;
}

void Executor::parameters(int u, std::vector<float>& out, int next) const {
  State& s = *s_;
  s.drain();
  if (u < 0 || u >= s.U) fail("parameters of unit {}: the model has units 0..{}", u, s.U - 1);
  if (next >= s.U) fail("parameters read ahead: unit {} is not one of 0..{}", next, s.U - 1);
  if (s.home(u).param == Tier::gpu) {
    out = s.zero->download_unit(u, false);
  } else {
    // Each shard converted straight into `out`, sized to the padded unit while it is filled.
    out.resize(s.up(u).padded);
    const char* block = s.home(u).param == Tier::nvme ? s.nvme_unit('P', u) : nullptr;
    for (int r = 0; r < s.host_ranks(u); ++r) {
      const char* shard = block != nullptr
                              ? block + rank_part(r, s.shard_bytes('P', u))
                              : s.host_p[static_cast<size_t>(u)][static_cast<size_t>(r)];
      convert(out.data() + s.up(u).shard_offset(r), DType::f32, shard, s.pt, s.shard(u));
    }
    out.resize(s.up(u).numel);  // the padding dropped, the capacity kept
  }
  if (next >= 0)
    s.read_ahead('P', next);
  else
    s.transfer_done();
}

UnitOptimizerState Executor::optimizer_state(int u) const {
  UnitOptimizerState out;
  optimizer_state(u, out);
  return out;
}

void Executor::optimizer_state(int u, UnitOptimizerState& out) const {
  const OptimizerStateView view = optimizer_state_view(u);
  std::array<std::vector<float>*, 3> dst = {&out.master, &out.m, &out.v};
  for (size_t k = 0; k < 3; ++k) {
    dst[k]->resize(s_->array_of(k) >= 0 ? s_->up(u).numel : 0);
    float* at = dst[k]->data();
    for (const std::span<const float>& part : view.parts[k]) {
      copy_bytes(at, part.data(), part.size_bytes());
      at += part.size();
    }
  }
  s_->transfer_done();
}

Executor::OptimizerStateView Executor::optimizer_state_view(int u, int next) const {
  State& s = *s_;
  s.drain();
  s.check_training("the optimizer state");
  if (u < 0 || u >= s.U) fail("optimizer state of unit {}: the model has units 0..{}", u, s.U - 1);
  if (next >= s.U) fail("optimizer state read ahead: unit {} is not one of 0..{}", next, s.U - 1);
  const uint64_t n = s.shard(u);
  const Tier home = s.home(u).optimizer;
  // Each shard's master | m | v where it lies: in host RAM, or in `held` (read from NVMe, or
  // copied from every GPU; a replicated unit's later ranks compared with rank 0's).
  std::vector<const float*> shards;
  if (home == Tier::cpu) {
    for (int r = 0; r < s.host_ranks(u); ++r)
      shards.push_back(
          reinterpret_cast<const float*>(s.host_o[static_cast<size_t>(u)][static_cast<size_t>(r)]));
  } else if (home == Tier::nvme) {
    const char* block = s.nvme_unit('O', u);
    for (int r = 0; r < s.host_ranks(u); ++r)
      shards.push_back(reinterpret_cast<const float*>(block + rank_part(r, n * s.os)));
  } else {
    s.transfer_wait();
    char* block = s.transfer.held.room(static_cast<uint64_t>(s.N) * round_up(n * s.os, kPage));
    for (int r = 0; r < s.N; ++r) {
      auto* o = reinterpret_cast<float*>(block + rank_part(r, n * s.os));
      Stream& st = *s.streams[static_cast<size_t>(r)].setup;
      for (int k = 0; k < s.oa; ++k)
        s.dev(r).copy_to_host(
            o + k * n, s.o_dev[static_cast<size_t>(u)][static_cast<size_t>(r * s.oa + k)].data(),
            n * 4, st);
      st.synchronize();
      if (s.up(u).replicated && r > 0 && std::memcmp(o, block, n * s.os) != 0)
        fail(
            "optimizer state of replicated unit {}: rank {} differs from rank 0; this is a "
            "bug in the executor",
            s.up(u).name, r);
      if (r == 0 || !s.up(u).replicated) shards.push_back(o);
    }
  }
  OptimizerStateView view;
  for (size_t r = 0; r < shards.size(); ++r) {
    const uint64_t have = s.up(u).shard_real(static_cast<int>(r));
    if (have == 0) continue;
    for (size_t k = 0; k < 3; ++k)
      if (s.array_of(k) >= 0)
        view.parts[k].emplace_back(shards[r] + static_cast<uint64_t>(s.array_of(k)) * n, have);
  }
  if (next >= 0) s.read_ahead('O', next);
  return view;
}

std::vector<float> Executor::master(int u) const {
  return optimizer_state(u).master;
}

void Executor::set_optimizer_state(int u, const UnitOptimizerState& state) {
  State& s = *s_;
  s.drain();
  s.check_training("the optimizer state");
  if (u < 0 || u >= s.U) fail("optimizer state of unit {}: the model has units 0..{}", u, s.U - 1);
  const uint64_t numel = s.up(u).numel, padded = s.up(u).padded;
  size_t k = 0;
  for (const auto& [what, v] : {std::pair{"master weights", &state.master},
                                std::pair{"m", &state.m}, std::pair{"v", &state.v}})
    if (s.array_of(k++) >= 0 && v->size() != numel)
      fail("optimizer state of unit {}: {}'s {} has {} values for the unit's {} elements",
           s.up(u).name, optimizer_type_name(s.ot), what, v->size(), numel);
  // The parameters are the master rounded to their dtype, as every Adam step leaves them (the
  // padding zero).
  std::vector<char> staged(padded * s.ps, char{0});
  convert(staged.data(), s.pt, state.master.data(), DType::f32, numel);
  if (s.zero->param_resident(u)) s.zero->upload_unit(u, state.master);
  s.write_unit(u, staged, &state);
}

// ---- running tasks ----

void Executor::State::run_group(int first, int end, int lane) {
  const Task& t = sc->tasks[static_cast<size_t>(first)];
  const int u = t.unit;
  std::vector<Stream*> cs = comm_streams();
  if (end - first != N)
    fail("schedule: the group of {} has {} tasks for {} ranks", task_label(*sc, t), end - first, N);
  if (t.kind == TaskKind::gather) {
    std::vector<TensorView> shards;
    if (!zero->param_resident(u))
      for (int i = first; i < end; ++i) {
        const Task& m = sc->tasks[static_cast<size_t>(i)];
        const int p = src[static_cast<size_t>(i)][0];
        shards.push_back(dev_param[static_cast<size_t>(m.rank)]
                                  [static_cast<size_t>(slot[static_cast<size_t>(p)])]
                                      .view(pt, {static_cast<int64_t>(shard(u))}));
      }
    std::unique_lock lock(mu);
    // The unit's previous use (a forward on another lane, say) may still hold it, and the
    // buffer the schedule gives this gather may still be held by its previous run's last user.
    lane_wait(lock, lane, LaneWait::kAny, nullptr, 0, 0,
              [&] { return !zero->gathered(u) && zero->free_working_buffers() > 0; });
    if (stop) return;
    const std::vector<UnitBuffers> g =
        zero->gather(u, cs, gather_bwd[static_cast<size_t>(first)] != 0, shards);
    for (int r = 0; r < N; ++r)
      views[static_cast<size_t>(r)][static_cast<size_t>(u)] = g[static_cast<size_t>(r)];
    users_left[static_cast<size_t>(first)] = holders[static_cast<size_t>(first)];
  } else if (t.kind == TaskKind::reduce_scatter) {
    if (direct[static_cast<size_t>(first)]) {  // the grad_d2h reads the working gradients
      if (rs_clear[static_cast<size_t>(first)] != 0)
        fail("schedule: a backward adds into unit {}'s working gradients before {} reads them",
             up(u).name, task_label(*sc, t));
      std::lock_guard lock(mu);
      if (rs_gather[static_cast<size_t>(first)] >= 0) let_go(rs_gather[static_cast<size_t>(first)]);
      return;
    }
    std::vector<TensorView> out;
    if (!zero->grad_resident(u))
      for (int i = first; i < end; ++i) {
        const Task& m = sc->tasks[static_cast<size_t>(i)];
        out.push_back(
            dev_grad[static_cast<size_t>(m.rank)][static_cast<size_t>(slot[static_cast<size_t>(i)])]
                .view(gt, {static_cast<int64_t>(shard(u))}));
      }
    std::lock_guard lock(mu);
    zero->reduce_scatter_grads(u, cs, out);
    if (rs_clear[static_cast<size_t>(first)] != 0) zero->clear_working_grads(u, cs);
    if (rs_gather[static_cast<size_t>(first)] >= 0) let_go(rs_gather[static_cast<size_t>(first)]);
    if (up(u).replicated) {
      zero->release(u, cs);
      reset_replicated(u);
    }
  } else {
    fail("schedule: {} is in a group, but only gathers and reduce-scatters are collectives",
         task_label(*sc, t));
  }
  for (Stream* st : cs) st->synchronize();
}

// Unit u's Adam update of step slot `sl` (the adam task), wherever its optimizer state lives.
void Executor::State::update(const Task& t, const StepSlot& sl, const GradStats& global,
                             float grad_scale) {
  const int u = t.unit, r = t.rank;
  const uint64_t n = shard(u);
  auto pin = [&](int producer) {
    return pinned[static_cast<size_t>(slot[static_cast<size_t>(producer)])];
  };
  const StepParams& params = sl.params;
  if (global.non_finite) return;
  if (home(u).optimizer == Tier::gpu) {
    const std::vector<int> rs = r >= 0 ? std::vector<int>{r} : task_ranks(t, u);
    const cpu_adam::StepConstants k =
        cpu_adam::step_constants(params.step, params.adam, grad_scale);
    for (int q : rs) {
      Stream& st = *streams[static_cast<size_t>(q)].compute;
      const auto& b = o_dev[static_cast<size_t>(u)];
      auto f32 = [&](size_t field) {  // 0 master, 1 m, 2 v; empty where the type keeps none
        if (array_of(field) < 0) return TensorView{};
        return b[static_cast<size_t>(q * oa + array_of(field))].view(DType::f32,
                                                                     {static_cast<int64_t>(n)});
      };
      const bool resident = zero->param_resident(u);
      const TensorView copy =
          resident ? zero->param_shard(u, q)
                   : param_tmp[static_cast<size_t>(q)].view(pt, {static_cast<int64_t>(n)});
      const TensorView g = zero->grad_shard(u, q);
      AdamParams no_decay = params.adam;
      no_decay.weight_decay = 0.0f;
      const cpu_adam::StepConstants k0 =
          cpu_adam::step_constants(params.step, no_decay, grad_scale);
      for (const Piece& pc : pieces(u, q, params.decay_every_parameter)) {
        auto part = [&](const TensorView& v) {
          if (v.data == nullptr) return v;
          TensorView x = v;
          x.data = static_cast<char*>(v.data) + pc.begin * dtype_size(v.dtype);
          x.shape = Shape{static_cast<int64_t>(pc.length)};
          return x;
        };
        dev(q).kernels().adam_update(part(f32(0)), part(f32(1)), part(f32(2)), part(g), part(copy),
                                     pc.decay ? k : k0, st);
      }
      if (!resident) {
        char* to = home(u).param == Tier::cpu
                       ? host_p[static_cast<size_t>(u)][static_cast<size_t>(q)]
                       : pin(t.id) + rank_part(q, n * ps);
        dev(q).copy_to_host(to, copy.data, n * ps, st);
      }
      st.synchronize();
    }
    return;
  }
  for (int q : task_ranks(t, u)) {
    char* o = home(u).optimizer == Tier::cpu
                  ? host_o[static_cast<size_t>(u)][static_cast<size_t>(q)]
                  : pin(src[static_cast<size_t>(t.id)][0]) + rank_part(q, n * os);
    float* f = reinterpret_cast<float*>(o);
    auto field = [&](size_t k) { return array_of(k) < 0 ? nullptr : f + array_of(k) * n; };
    char* p = home(u).param == Tier::cpu ? host_p[static_cast<size_t>(u)][static_cast<size_t>(q)]
                                         : pin(t.id) + rank_part(q, n * ps);
    const char* g = home(u).grad != Tier::cpu  // brought down, or read back from NVMe
                        ? pin(src[static_cast<size_t>(t.id)].back()) + rank_part(q, n * gs)
                        : host_g[static_cast<size_t>(u)][static_cast<size_t>(q)];
    AdamParams no_decay = params.adam;
    no_decay.weight_decay = 0.0f;
    for (const Piece& pc : pieces(u, q, params.decay_every_parameter)) {
      std::optional<ParamCopy> copy;
      if (pt != DType::f32) copy = ParamCopy{p + pc.begin * ps, pt};
      auto at = [&](float* x) { return x == nullptr ? nullptr : x + pc.begin; };
      const AdamShard part{f + pc.begin, at(field(1)), at(field(2)), pc.length};
      adam->update(part, GradShard{g + pc.begin * gs, gt, pc.length}, params.step,
                   pc.decay ? params.adam : no_decay, grad_scale, global, copy);
    }
    if (pt == DType::f32) std::memcpy(p, f, n * 4);
  }
}

// Zeroes unit u's gradient accumulators of the adam task's ranks: host G, and resident G on
// the devices (a GPU adam task: its rank's, on its compute stream, after the update).
void Executor::State::zero_unit_grads(const Task& t) {
  const int u = t.unit;
  if (t.rank >= 0) {
    if (!zero->grad_resident(u)) return;
    Stream& st = *streams[static_cast<size_t>(t.rank)].compute;
    zero->zero_grad(u, t.rank, st);
    st.synchronize();
    return;
  }
  for (int q = 0; q < host_ranks(u); ++q)
    if (char* g = host_g[static_cast<size_t>(u)][static_cast<size_t>(q)]; g != nullptr)
      std::memset(g, 0, shard(u) * gs);
  if (!zero->grad_resident(u)) return;
  for (int q = 0; q < N; ++q) zero->zero_grad(u, q, *streams[static_cast<size_t>(q)].tail);
  for (int q = 0; q < N; ++q) streams[static_cast<size_t>(q)].tail->synchronize();
}

void Executor::State::run_task(const Task& t, int64_t k) {
  const int u = t.unit, r = t.rank;
  const uint64_t n = u >= 0 ? shard(u) : 0;
  auto pin = [&](int producer) {
    return pinned[static_cast<size_t>(slot[static_cast<size_t>(producer)])];
  };
  switch (t.kind) {
    case TaskKind::act_d2h:
    case TaskKind::act_h2d: {
      const int m = t.micro_batch;
      const int64_t b = batch_sizes[static_cast<size_t>(m)][static_cast<size_t>(r)];
      if (b == 0) return;  // the rank had no sequence in this micro-batch
      const int set = m % sc->micro_batch_group;
      const TensorView at = models[static_cast<size_t>(r)]->checkpoint(u, b, set);
      char* host = act_home(u, r, set);
      if (t.kind == TaskKind::act_d2h) {
        Stream& st = *streams[static_cast<size_t>(r)].d2h;
        dev(r).copy_to_host(host, at.data, at.bytes(), st);
        st.synchronize();
      } else {
        Stream& st = *streams[static_cast<size_t>(r)].h2d;
        dev(r).copy_to_device(at.data, host, at.bytes(), st);
        st.synchronize();
      }
      return;
    }
    case TaskKind::param_read:
      read_shards('P', u, pin(t.id));
      return;
    case TaskKind::param_h2d: {
      const char* from = home(u).param == Tier::cpu
                             ? host_p[static_cast<size_t>(u)][static_cast<size_t>(r)]
                             : pin(src[static_cast<size_t>(t.id)][0]) + rank_part(r, n * ps);
      Stream& st = *streams[static_cast<size_t>(r)].h2d;
      dev(r).copy_to_device(
          dev_param[static_cast<size_t>(r)][static_cast<size_t>(slot[static_cast<size_t>(t.id)])]
              .data(),
          from, n * ps, st);
      st.synchronize();
      return;
    }
    case TaskKind::forward:
    case TaskKind::backward: {
      std::vector<UnitBuffers> v;
      {
        std::lock_guard lock(mu);
        // Replicated units are used in place; their backward still needs zeroed working
        // gradients (a buffer of the unit's own, outside the pool), which the first rank to get
        // there takes for all; the all-reduce gives it back. The schedule makes the first
        // backward of micro-batch m that adds into them wait for the all-reduce of m - 1, so a
        // unit still gathered here was gathered by this micro-batch's earlier backward (the
        // head's, for a tied unit 0) or by another rank for this one.
        std::vector<int> xs{u};
        if (const int x = layout.tied_table(u); x >= 0) xs.push_back(x);
        for (int x : xs) {
          if (t.kind != TaskKind::backward || !up(x).replicated) continue;
          auto& owner = rep_owner[static_cast<size_t>(x)];
          // Reducing once per group, the group's micro-batches share the working gradients.
          const std::pair<int64_t, int> now{k, t.micro_batch / reduce_span()};
          if (zero->gathered(x)) {
            if (owner != now)
              fail(
                  "unit {}'s working gradients still hold micro-batch {} of step {} when "
                  "micro-batch {} adds into them; this is a bug in strata's schedule",
                  up(x).name, owner.second * reduce_span(), owner.first + 1, t.micro_batch);
            continue;
          }
          const std::vector<Stream*> cs = comm_streams();
          const std::vector<UnitBuffers> g = zero->gather(x, cs, true);
          for (int q = 0; q < N; ++q)
            views[static_cast<size_t>(q)][static_cast<size_t>(x)] = g[static_cast<size_t>(q)];
          for (Stream* st : cs) st->synchronize();
          owner = now;
        }
        v = views[static_cast<size_t>(r)];
      }
      const int m = t.micro_batch;
      const int64_t b = batch_sizes[static_cast<size_t>(m)][static_cast<size_t>(r)];
      LlamaModel& model = *models[static_cast<size_t>(r)];
      Stream& st = *streams[static_cast<size_t>(r)].compute;
      const int64_t T = model.options().seq_len, rows = model.options().max_batch * T;
      const int32_t* ids =
          static_cast<const int32_t*>(ids_dev[static_cast<size_t>(r)].data()) + m * rows;
      const int32_t* tg =
          static_cast<const int32_t*>(tgt_dev[static_cast<size_t>(r)].data()) + m * rows;
      const int32_t* docs =
          with_docs[static_cast<size_t>(m)][static_cast<size_t>(r)]
              ? static_cast<const int32_t*>(doc_dev[static_cast<size_t>(r)].data()) + m * rows
              : nullptr;
      // Micro-batch m's activations (and the gradients flowing between its units): set m % G.
      const int set = m % sc->micro_batch_group;
      if (b > 0 && decode_n > 0) {  // Executor::decode(): forwards only, one sequence
        const TensorView in = u == 0 ? TensorView{} : model.decode_slot(u, decode_n);
        const TensorView out = u + 1 < U ? model.decode_slot(u + 1, decode_n) : TensorView{};
        const TensorView lg =
            logits_dev[static_cast<size_t>(r)].view(DType::f32, {1, model.config().vocab_size});
        model.decode_unit(u, v, ids, decode_pos, decode_n, in, out, lg, st);
        if (u == U - 1) dev(r).copy_to_host(logits.data(), lg.data, logits.size() * 4, st);
      } else if (b > 0) {
        const TensorView in = u == 0 ? TensorView{} : model.checkpoint(u, b, set);
        if (t.kind == TaskKind::forward) {
          const TensorView out = u + 1 < U ? model.checkpoint(u + 1, b, set) : TensorView{};
          model.forward_unit(u, v, ids, tg, in, out, b, st, set, docs);
          if (u == U - 1) {
            auto& l = losses[static_cast<size_t>(m)][static_cast<size_t>(r)];
            l.resize(static_cast<size_t>(b * T));
            dev(r).copy_to_host(l.data(), model.losses(b).data, l.size() * 4, st);
          }
        } else {
          const int j = U - 1 - u;  // the activation gradients alternate, as in ZeroRunner
          const int64_t D = model.config().hidden_size;
          const uint64_t at = static_cast<uint64_t>(set * rows * D) * ps;
          const TensorView a{static_cast<char*>(act_a[static_cast<size_t>(r)].data()) + at,
                             pt,
                             {b * T, D},
                             &dev(r)};
          const TensorView c{static_cast<char*>(act_b[static_cast<size_t>(r)].data()) + at,
                             pt,
                             {b * T, D},
                             &dev(r)};
          model.backward_unit(u, v, ids, tg, backward_scale, in, j % 2 == 0 ? a : c,
                              j % 2 == 0 ? c : a, b, st, set, docs);
        }
      }
      st.synchronize();
      std::lock_guard lock(mu);
      for (int leader : uses[static_cast<size_t>(t.id)]) let_go(leader);
      return;
    }
    case TaskKind::grad_d2h: {
      if (up(u).replicated) {
        // Accumulated on the device (all-reduced into resident G): rank 0's copy is the sum.
        if (r != 0) return;
        Stream& st = *streams[0].d2h;
        dev(0).copy_to_host(host_g[static_cast<size_t>(u)][0], zero->grad_shard(u, 0).data, n * gs,
                            st);
        st.synchronize();
        return;
      }
      char* to = d2h_staged[static_cast<size_t>(t.id)]
                     ? pin(t.id) + rank_part(r, n * gs)
                     : host_g[static_cast<size_t>(u)][static_cast<size_t>(r)];
      Stream& st = *streams[static_cast<size_t>(r)].d2h;
      if (direct[static_cast<size_t>(t.id)]) {
        const void* g = nullptr;
        {
          std::lock_guard lock(mu);
          g = views[0][static_cast<size_t>(u)].grads;
        }
        if (g == nullptr)
          fail("executor: {} finds unit {} not gathered; this is a bug in strata's schedule",
               task_label(*sc, t), up(u).name);
        dev(0).copy_to_host(to, g, n * gs, st);
        st.synchronize();
        std::lock_guard lock(mu);
        let_go(rs_gather[static_cast<size_t>(t.id)]);
        return;
      }
      const int p = src[static_cast<size_t>(t.id)][0];
      dev(r).copy_to_host(
          to,
          dev_grad[static_cast<size_t>(r)][static_cast<size_t>(slot[static_cast<size_t>(p)])]
              .data(),
          n * gs, st);
      st.synchronize();
      return;
    }
    case TaskKind::grad_accumulate: {
      if (up(u).replicated) return;
      const std::vector<int> rs = task_ranks(t, u);
      const std::vector<int>& from = src[static_cast<size_t>(t.id)];
      const bool nvme = home(u).grad == Tier::nvme;  // into the sum read back: src[0]'s buffer
      for (size_t i = 0; i < rs.size(); ++i) {
        char* g = nvme ? pin(from[0]) + rank_part(rs[i], n * gs)
                       : host_g[static_cast<size_t>(u)][static_cast<size_t>(rs[i])];
        const char* a = pin(from[nvme ? i + 1 : i]) + rank_part(rs[i], n * gs);
        // On CPU Adam's threads, in its statistics chunks, as the simulator assumes (one thread
        // ran at an eighth of grad_stats' rate on 2 cores); each element's sum is the same
        // whatever the split.
        adam->for_each_chunk(
            g, n * gs, cpu_adam::chunk_count(n, CpuAdam::kStatsChunk), [&](size_t c) {
              const cpu_adam::ChunkRange cr = cpu_adam::chunk_range(n, CpuAdam::kStatsChunk, c);
              accumulate(g, a, cr.begin, cr.begin + cr.n);
            });
      }
      return;
    }
    case TaskKind::grad_stats: {
      if (home(u).grad != Tier::gpu) {
        for (int q : task_ranks(t, u)) {
          const char* g = home(u).grad == Tier::nvme
                              ? pin(src[static_cast<size_t>(t.id)][0]) + rank_part(q, n * gs)
                              : host_g[static_cast<size_t>(u)][static_cast<size_t>(q)];
          slot_of(k).stats[static_cast<size_t>(u)][static_cast<size_t>(q)] =
              adam->grad_stats(GradShard{g, gt, n});
        }
        return;
      }
      const std::vector<int> rs = r >= 0 ? std::vector<int>{r} : task_ranks(t, u);
      for (int q : rs) {
        if (up(u).replicated && q > 0) continue;  // every rank holds the same sum
        const size_t chunks = cpu_adam::chunk_count(n, CpuAdam::kStatsChunk);
        std::vector<double> sums(chunks);
        Stream& st = *streams[static_cast<size_t>(q)].compute;
        dev(q).kernels().grad_chunk_sums(
            zero->grad_shard(u, q), static_cast<double*>(chunk_sums[static_cast<size_t>(q)].data()),
            st);
        dev(q).copy_to_host(sums.data(), chunk_sums[static_cast<size_t>(q)].data(), chunks * 8, st);
        st.synchronize();
        GradStats gsum;
        for (double c : sums) gsum.sum_squares += c;
        gsum.non_finite = !std::isfinite(gsum.sum_squares);
        slot_of(k).stats[static_cast<size_t>(u)][static_cast<size_t>(q)] = gsum;
      }
      return;
    }
    case TaskKind::grad_offload: {
      // The sum over the step's micro-batches, from the resident accumulator into this rank's
      // part of the buffer CPU Adam reads.
      Stream& st = *streams[static_cast<size_t>(r)].d2h;
      dev(r).copy_to_host(pin(t.id) + rank_part(up(u).replicated ? 0 : r, n * gs),
                          zero->grad_shard(u, r).data, n * gs, st);
      st.synchronize();
      return;
    }
    case TaskKind::optim_read:
    case TaskKind::grad_read:
      read_shards(t.kind == TaskKind::optim_read ? 'O' : 'G', u, pin(t.id));
      return;
    case TaskKind::optim_write:
    case TaskKind::grad_write:
      write_shards(t.kind == TaskKind::optim_write ? 'O' : 'G', u,
                   pin(src[static_cast<size_t>(t.id)][0]));
      return;
    case TaskKind::adam: {
      StepSlot& sl = slot_of(k);
      if (early()) {
        // The unit's own statistics: the clip coefficient is 1 (step() refused a clip), so the
        // scale is the one the global statistics give.
        GradStats own;
        for (int q = 0; q < N; ++q) own += sl.stats[static_cast<size_t>(u)][static_cast<size_t>(q)];
        if (own.non_finite)
          fail(
              "unit {}'s gradients hold NaN or Inf; the optimizer updates each unit during the "
              "backward (--update-during-backward on), so other units of this step are updated "
              "already and the step cannot be skipped: resume from the last checkpoint with "
              "--update-during-backward off, which skips such steps",
              up(u).name);
        update(t, sl, own, combined_grad_scale(own, sl.params.loss_scale, 0.0f));
      } else {
        {
          std::lock_guard lock(mu);
          ensure_global(sl);
        }
        update(t, sl, sl.global, sl.grad_scale);
      }
      // The update has read the gradients: zero them for the next step (a skipped step's too).
      zero_unit_grads(t);
      return;
    }
    case TaskKind::param_write: {
      if (skipped(k)) return;
      const std::vector<int> rs = task_ranks(t, u);
      for (size_t i = 0; i < rs.size(); ++i)
        store->write(shard_name('P', u, rs[i]),
                     pin(src[static_cast<size_t>(t.id)][i]) + rank_part(rs[i], n * ps),
                     kWriteChannel);
      return;
    }
    case TaskKind::param_upload: {
      if (skipped(k)) return;
      const int hr = up(u).replicated ? 0 : r;
      Stream& st = *streams[static_cast<size_t>(r)].h2d;
      dev(r).copy_to_device(zero->param_shard(u, r).data,
                            pin(src[static_cast<size_t>(t.id)][0]) + rank_part(hr, n * ps), n * ps,
                            st);
      st.synchronize();
      return;
    }
    case TaskKind::param_d2h:
      // The GPU adam task brought the updated shard down already (it owns the buffer).
      return;
    case TaskKind::gather:
    case TaskKind::reduce_scatter:
      break;
  }
  fail("executor: {} is a collective outside a group", task_label(*sc, t));
}

void Executor::State::lane_loop(int lane, int64_t k, int span_step) {
  // Marks tasks [first, end) of instance k done, under mu, and wakes whom that lets go on.
  auto finish = [&](int first, int end, double start, double end_s) {
    bool front_done = false;
    for (int i = first; i < end; ++i) {
      done_at[static_cast<size_t>(i)] = k;
      const TaskSpan sp{i, span_step, start, end_s};
      spans.push_back(sp);
      if (opt.record && span_step >= 0) recorded.push_back(sp);
      if (span_step >= 0 && front[static_cast<size_t>(i)]) front_done = --front_left == 0;
    }
    running_since[static_cast<size_t>(lane)] = -1;
    wake_lanes(false);
    if (front_done) cv.notify_all();  // the step's caller waits for its front tasks
  };
  for (int id : lanes[static_cast<size_t>(lane)]) {
    const Task& t = sc->tasks[static_cast<size_t>(id)];
    try {
      {
        std::unique_lock lock(mu);
        lane_wait(lock, lane, LaneWait::kTask, &t, 0, k);
        if (stop) return;
      }
      const auto [first, end] = group_of[static_cast<size_t>(id)];
      if (t.group >= 0) {
        double start = 0;
        {
          std::unique_lock lock(mu);
          if (++arrived[static_cast<size_t>(first)] < end - first) {
            lane_wait(lock, lane, LaneWait::kDone, nullptr, id, k);
            if (stop) return;
            continue;
          }
          arrived[static_cast<size_t>(first)] = 0;
          start = now();
          running_since[static_cast<size_t>(lane)] = start;
        }
        run_group(first, end, lane);
        const double end_s = now();
        std::lock_guard lock(mu);
        finish(first, end, start, end_s);
        continue;
      }
      double start = 0;
      {
        std::lock_guard lock(mu);
        start = now();
        running_since[static_cast<size_t>(lane)] = start;
      }
      run_task(t, k);
      const double end_s = now();
      std::lock_guard lock(mu);
      finish(id, id + 1, start, end_s);
    } catch (const std::exception& e) {
      std::lock_guard lock(mu);
      if (!error) {
        error = std::current_exception();
        error_task = fmt::format("{}: {}", task_label(*sc, t), e.what());
        error_what = span_step >= 0 ? fmt::format("step {}", slot_of(k).params.step)
                                    : std::string("evaluation");
      }
      stop = true;
      running_since[static_cast<size_t>(lane)] = -1;
      wake_lanes(true);
      cv.notify_all();
      return;
    }
  }
}

void Executor::State::worker(int lane) {
  for (int64_t k = 0;; ++k) {
    {
      std::unique_lock lock(mu);
      cv.wait(lock, [&] { return quit || stop || released >= k; });
      if (quit || stop) return;
    }
    lane_loop(lane, k, static_cast<int>(k));
    std::lock_guard lock(mu);
    if (stop) return;
    lane_done[static_cast<size_t>(lane)] = k;
    cv.notify_all();
  }
}

void Executor::State::start_workers() {
  if (!workers.empty()) return;
  lane_done.assign(sc->lanes.size(), -1);
  running_since.assign(sc->lanes.size(), -1.0);
  size_lane_waits();
  for (size_t l = 0; l < sc->lanes.size(); ++l)
    workers.emplace_back([this, l] { worker(static_cast<int>(l)); });
}

void Executor::State::wait_lanes(int64_t k) {
  if (k < 0 || workers.empty()) return;
  std::unique_lock lock(mu);
  cv.wait(lock, [&] {
    return stop ||
           std::all_of(lane_done.begin(), lane_done.end(), [&](int64_t d) { return d >= k; });
  });
  if (stop) fail_stopped();
}

void Executor::State::fail_stopped() {
  broken = true;
  for (auto& rs : streams)
    for (Stream* st :
         {rs.compute.get(), rs.h2d.get(), rs.d2h.get(), rs.comm.get(), rs.tail.get()}) {
      try {
        st->synchronize();
      } catch (const Error&) {
        // The task that queued it has failed already; that error is the one reported.
      }
    }
  fail("executor: {} stopped at {}", error_what, error_task);
}

void Executor::State::ensure_global(StepSlot& sl) const {
  if (sl.have_global) return;
  sl.global = GradStats{};
  for (int x = 0; x < U; ++x)
    for (int q = 0; q < N; ++q)
      sl.global += sl.stats[static_cast<size_t>(x)][static_cast<size_t>(q)];
  sl.grad_scale = sl.global.non_finite ? 0.0f
                                       : combined_grad_scale(sl.global, sl.params.loss_scale,
                                                             sl.params.max_grad_norm);
  sl.have_global = true;
}

void Executor::State::check_usable() const {
  if (broken)
    fail(
        "executor: an earlier {} failed ({}), so the model state is undefined; start again "
        "from a checkpoint",
        error_what, error_task);
}

int64_t Executor::State::upload(const std::vector<std::vector<HostBatch>>& batches,
                                const char* what) {
  check_usable();
  const RunShape& shape = pl.shape;
  if (batches.size() != static_cast<size_t>(M))
    fail("executor {}: {} micro-batches given, the schedule has {}", what, batches.size(), M);
  const int64_t T = shape.seq_len, rows = shape.micro_batch * T;
  int64_t count = 0;
  batch_sizes.assign(static_cast<size_t>(M), std::vector<int64_t>(static_cast<size_t>(N)));
  with_docs.assign(static_cast<size_t>(M), std::vector<bool>(static_cast<size_t>(N)));
  for (int m = 0; m < M; ++m) {
    if (batches[static_cast<size_t>(m)].size() != static_cast<size_t>(N))
      fail("executor {}: micro-batch {} has {} rank batches for {} ranks", what, m,
           batches[static_cast<size_t>(m)].size(), N);
    for (int r = 0; r < N; ++r) {
      const HostBatch& b = batches[static_cast<size_t>(m)][static_cast<size_t>(r)];
      const auto len = static_cast<size_t>(b.batch * T);
      if (b.batch < 0 || b.batch > shape.micro_batch || b.ids.size() != len ||
          b.targets.size() != len)
        fail(
            "executor {}: rank {}'s micro-batch {} has {} sequences ({} ids, {} targets); at "
            "most {} sequences of {} tokens fit",
            what, r, m, b.batch, b.ids.size(), b.targets.size(), shape.micro_batch, T);
      // The CUDA kernels index tables with these ids unchecked: an id past the vocabulary
      // would read or write another buffer (or end the GPU context), so it is refused here.
      const int64_t vocab = shape.model.vocab_size;
      for (size_t i = 0; i < len; ++i) {
        const int32_t id = b.ids[i], t = b.targets[i];
        if (id < 0 || id >= vocab || (t != kIgnoreIndex && (t < 0 || t >= vocab)))
          fail(
              "executor {}: rank {}'s micro-batch {}, token {}: id {} / target {} is outside "
              "the vocabulary [0, {}) (targets may also be {}, ignored); check the token file "
              "against the model's vocab_size",
              what, r, m, i, id, t, vocab, kIgnoreIndex);
        count += t != kIgnoreIndex ? 1 : 0;
      }
      batch_sizes[static_cast<size_t>(m)][static_cast<size_t>(r)] = b.batch;
      // Documents packed into the sequences: checked here, as the CUDA kernels trust them.
      const bool docs = !b.doc_start.empty();
      if (docs && (b.doc_start.size() != len || doc_dev.empty()))
        fail("executor {}: rank {}'s micro-batch {} has {} document starts for {} tokens{}", what,
             r, m, b.doc_start.size(), len,
             doc_dev.empty() ? "; a decoding run packs no documents" : "");
      if (docs)
        check_doc_start(fmt::format("executor {}: rank {}'s micro-batch {}", what, r, m).c_str(),
                        b.doc_start.data(), b.batch, T);
      with_docs[static_cast<size_t>(m)][static_cast<size_t>(r)] = docs;
      Stream& st = *streams[static_cast<size_t>(r)].setup;
      char* ids = static_cast<char*>(ids_dev[static_cast<size_t>(r)].data()) + m * rows * 4;
      char* tg = static_cast<char*>(tgt_dev[static_cast<size_t>(r)].data()) + m * rows * 4;
      if (len > 0) {
        dev(r).copy_to_device(ids, b.ids.data(), len * 4, st);
        dev(r).copy_to_device(tg, b.targets.data(), len * 4, st);
        if (docs) {
          char* ds = static_cast<char*>(doc_dev[static_cast<size_t>(r)].data()) + m * rows * 4;
          dev(r).copy_to_device(ds, b.doc_start.data(), len * 4, st);
        }
      }
      st.synchronize();
    }
  }
  losses.assign(static_cast<size_t>(M), std::vector<std::vector<float>>(static_cast<size_t>(N)));
  return count;
}

void Executor::State::run_lanes() {
  std::fill(done_at.begin(), done_at.end(), -1);
  std::fill(arrived.begin(), arrived.end(), 0);
  std::fill(users_left.begin(), users_left.end(), 0);
  std::vector<double> steps_running = std::move(running_since);
  running_since.assign(sc->lanes.size(), -1.0);
  size_lane_waits();  // the step lanes are between steps, on cv
  {
    std::vector<std::thread> threads;
    for (size_t l = 0; l < sc->lanes.size(); ++l)
      threads.emplace_back([this, l] { lane_loop(static_cast<int>(l), 0, -1); });
    for (auto& th : threads) th.join();
  }
  running_since = std::move(steps_running);
  spans.clear();
  if (!error) return;
  std::lock_guard lock(mu);
  fail_stopped();
}

double Executor::State::loss_sum() const {
  double sum = 0;
  for (const auto& per_rank : losses)
    for (const auto& l : per_rank)
      for (float x : l) sum += x;
  return sum;
}

StepResult Executor::step(const std::vector<std::vector<HostBatch>>& batches,
                          const StepParams& params) {
  State& s = *s_;
  s.check_training("a training step");
  if (params.adam.type != s.ot)
    fail(
        "executor: the step asks for {} but the placement sized the optimizer state for {}; build "
        "the placement with RunShape::optimizer {}",
        optimizer_type_name(params.adam.type), optimizer_type_name(s.ot),
        optimizer_type_name(params.adam.type));
  const int64_t k = s.instances;
  s.check_usable();
  s.transfer_done();
  if (s.early() && params.max_grad_norm > 0)
    fail(
        "executor: gradient clipping at {} needs the whole step's gradient norm before any "
        "update, but this schedule updates each unit during the backward "
        "(--update-during-backward on); turn clipping off (--clip 0, gradient_clipping 0) or "
        "--update-during-backward off",
        params.max_grad_norm);
  s.start_workers();
  // Two steps may be in flight: the slot this step takes was the one before the previous's.
  s.wait_lanes(k - 2);
  const int64_t count = s.upload(batches, "step");
  State::StepSlot& sl = s.slot_of(k);
  sl.params = params;
  sl.have_global = false;
  sl.stats.assign(static_cast<size_t>(s.U), std::vector<GradStats>(static_cast<size_t>(s.N)));
  s.backward_scale = params.loss_scale / static_cast<float>(std::max<int64_t>(count, 1));
  double t0 = 0, t1 = 0;
  StepResult out;
  {
    std::unique_lock lock(s.mu);
    const bool idle =
        std::all_of(s.lane_done.begin(), s.lane_done.end(), [&](int64_t d) { return d >= k - 1; });
    t0 = idle ? s.now() : s.last_return;
    s.front_left = s.front_tasks;
    s.released = k;
    s.instances = k + 1;
    s.cv.notify_all();
    s.cv.wait(lock, [&] { return s.stop || s.front_left == 0; });
    if (s.stop) s.fail_stopped();
    s.ensure_global(sl);
    // Updating during the backward, a non-finite unit's update fails the run (see run_task):
    // report that failure rather than a skipped step.
    if (s.early() && sl.global.non_finite) {
      s.cv.wait(lock, [&] { return s.stop; });
      s.fail_stopped();
    }
    t1 = s.now();
    s.last_return = t1;
    // The period's busy times: spans clipped to [t0, t1], and the tasks still running.
    out.lane_busy_s.assign(schedule_.lanes.size(), 0.0);
    std::vector<std::pair<double, double>> nvme;
    auto busy = [&](int lane, double a, double b) {
      a = std::max(a, t0);
      b = std::min(b, t1);
      if (b <= a) return;
      out.lane_busy_s[static_cast<size_t>(lane)] += b - a;
      if (is_nvme_lane(schedule_.lanes[static_cast<size_t>(lane)])) nvme.emplace_back(a, b);
    };
    for (const TaskSpan& sp : s.spans)
      busy(schedule_.tasks[static_cast<size_t>(sp.task)].lane, sp.start_s, sp.end_s);
    for (size_t l = 0; l < s.running_since.size(); ++l)
      if (s.running_since[l] >= 0) busy(static_cast<int>(l), s.running_since[l], t1);
    out.nvme_busy_s = union_seconds(std::move(nvme));
    s.spans.clear();
  }
  out.loss = s.loss_sum() / static_cast<double>(std::max<int64_t>(count, 1));
  out.skipped = sl.global.non_finite;
  out.grad_norm = sl.global.non_finite
                      ? std::nan("")
                      : std::sqrt(sl.global.sum_squares) / static_cast<double>(params.loss_scale);
  out.step_s = t1 - t0;
  const double busiest =
      std::max(*std::max_element(out.lane_busy_s.begin(), out.lane_busy_s.end()), out.nvme_busy_s);
  out.overlap = out.step_s > 0 ? busiest / out.step_s : 0;
  timeline_.steps = static_cast<int>(k + 1);
  return out;
}

void Executor::finish() {
  s_->drain();
  s_->transfer_done();
}

const Timeline& Executor::timeline() const {
  s_->drain();
  std::lock_guard lock(s_->mu);
  timeline_.spans = s_->recorded;
  return timeline_;
}

void Executor::run_forward_only() {
  State& s = *s_;
  if (!s.eval) {
    ScheduleOptions so = schedule_.options;
    so.forward_only = true;
    auto e = std::make_unique<State::Resolved>();
    e->schedule = Schedule::build(placement_, so);
    e->schedule.validate();
    e->sc = &e->schedule;
    s.swap(*e);
    try {
      s.resolve(false);
    } catch (...) {
      s.swap(*e);
      throw;
    }
    s.swap(*e);
    s.eval = std::move(e);
  }
  s.swap(*s.eval);
  try {
    s.run_lanes();
  } catch (...) {
    s.swap(*s.eval);
    throw;
  }
  s.swap(*s.eval);
}

EvalResult Executor::evaluate(const std::vector<std::vector<HostBatch>>& batches) {
  State& s = *s_;
  s.drain();
  s.transfer_done();
  const int64_t count = s.upload(batches, "evaluation");
  const double t0 = s.now();
  run_forward_only();
  EvalResult out;
  out.loss_sum = s.loss_sum();
  out.targets = count;
  out.seconds = s.now() - t0;
  return out;
}

const std::vector<float>& Executor::decode(const std::vector<int32_t>& ids, int64_t pos) {
  State& s = *s_;
  s.drain();
  s.transfer_done();
  const RunShape& shape = placement_.shape;
  if (!shape.kv_cache)
    fail(
        "executor: decode() needs a placement with a KV cache (RunShape::kv_cache); this is a "
        "bug in strata");
  s.check_usable();
  const auto n = static_cast<int64_t>(ids.size());
  if (n < 1 || pos < 0 || pos + n > shape.seq_len)
    fail(
        "executor decode: positions [{}, {}) do not fit the placement's {} positions; start a "
        "new sequence, or place the run with a longer one",
        pos, pos + n, shape.seq_len);
  for (size_t i = 0; i < ids.size(); ++i)
    if (ids[i] < 0 || ids[i] >= shape.model.vocab_size)
      fail("executor decode: token {} (position {}) is id {}, outside the vocabulary [0, {})", i,
           pos + static_cast<int64_t>(i), ids[i], shape.model.vocab_size);
  // Rank 0 decodes; the other ranks take part in the gathers only (batch 0).
  s.batch_sizes.assign(static_cast<size_t>(s.M), std::vector<int64_t>(static_cast<size_t>(s.N)));
  s.batch_sizes[0][0] = 1;
  s.with_docs.assign(static_cast<size_t>(s.M), std::vector<bool>(static_cast<size_t>(s.N)));
  Stream& st = *s.streams[0].setup;
  s.dev(0).copy_to_device(s.ids_dev[0].data(), ids.data(), ids.size() * 4, st);
  st.synchronize();
  s.logits.assign(static_cast<size_t>(shape.model.vocab_size), 0.0f);
  s.decode_pos = pos;
  s.decode_n = n;
  try {
    run_forward_only();
  } catch (...) {
    s.decode_n = 0;
    throw;
  }
  s.decode_n = 0;
  return s.logits;
}

void Executor::trace(const std::string& path) const {
  write_trace(path, schedule_, timeline());
}

ExecutorMemory Executor::memory() const {
  // No waiting for the steps in flight: everything read here is fixed at construction (the
  // lanes never allocate), so a trainer may log it after every step without ending the overlap.
  const State& s = *s_;
  ExecutorMemory m;
  if (s.pool) {
    m.pinned_capacity = s.pool->capacity();
    m.pinned_peak = s.pool->stats().high_water;
    m.pinned_allocations = s.pool->allocations_made();
  }
  m.device_param_staging = s.dev_param.empty() ? 0 : static_cast<int>(s.dev_param[0].size());
  m.device_grad_staging = s.dev_grad.empty() ? 0 : static_cast<int>(s.dev_grad[0].size());
  m.pinned_staging = static_cast<int>(s.pinned.size());
  const uint64_t align = s.pl.shape.device_alignment;
  for (const auto* v : {&s.ids_dev, &s.tgt_dev, &s.doc_dev, &s.chunk_sums, &s.param_tmp})
    if (!v->empty()) m.device_extra_bytes += round_up((*v)[0].bytes(), align);
  if (s.store) m.swap_bounce_bytes = s.store->own_staging_bytes();
  return m;
}

}  // namespace strata
