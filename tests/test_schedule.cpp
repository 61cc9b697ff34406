// test_schedule.cpp: the step schedule's builder rules, validation and printing; the simulator
// against hand-computed timelines; Chrome traces and timeline checks; hardware profile JSON.
//
// Task counts are computed here from the rules in closed form (how many runs of consecutive
// uses each gathered unit has), not by walking the builder's own structures, so a builder that
// drops or duplicates a fetch, a gather or an optimizer task fails.
#include "schedule/schedule.h"
#include "schedule/simulator.h"
#include "schedule/trace.h"
#include "testing.h"

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <tuple>

namespace strata {
namespace {

using test::expect_error;

LlamaConfig tiny(bool tied) {
  LlamaConfig c = *find_preset("tiny");
  c.tie_word_embeddings = tied;
  return c;
}

// A placement written by hand: P home `p` for sharded units (replicated ones stay on the GPU),
// O home `o`, G on the GPU with O there or `g_gpu`, else in host RAM.
Placement make_placement(const LlamaConfig& c, int ranks, Tier p, Tier o, uint64_t threshold,
                         int working = 2, int pinned = 4, bool g_gpu = false, bool g_nvme = false) {
  Placement pl;
  pl.shape.model = c;
  pl.shape.ranks = ranks;
  pl.shape.param_dtype = DType::bf16;
  pl.shape.grad_dtype = DType::f32;
  pl.shape.micro_batch = 2;
  pl.shape.seq_len = 64;
  pl.shape.persistence_threshold = threshold;
  pl.shape.working_buffers = working;
  pl.partition = Partition::build(ModelLayout::build(c), ranks, ModelLayout::kAlign, threshold);
  for (const UnitPartition& up : pl.partition.units)
    pl.homes.push_back(UnitHomes{up.replicated ? Tier::gpu : p,
                                 o == Tier::gpu || g_gpu    ? Tier::gpu
                                 : g_nvme && !up.replicated ? Tier::nvme
                                                            : Tier::cpu,
                                 o});
  pl.pinned_buffers = pinned;
  pl.pinned_buffer_bytes = pl.partition.max_unit_numel() * 12;
  return pl;
}

HardwareProfile test_profile() {
  HardwareProfile p;
  p.name = "test";
  p.gpu_flops = 5e11;
  p.h2d_bytes_per_s = 2e9;
  p.d2h_bytes_per_s = 2.5e9;
  p.comm_bytes_per_s = 8e9;
  p.adam_elements_per_s = 3e8;
  p.stats_elements_per_s = 2e9;
  p.gpu_adam_elements_per_s = 5e9;
  p.nvme_read_bytes_per_s = 1.5e9;
  p.nvme_write_bytes_per_s = 1e9;
  p.task_latency_s = 2e-6;
  return p;
}

std::map<TaskKind, int> count_kinds(const Schedule& s) {
  std::map<TaskKind, int> n;
  for (const Task& t : s.tasks) ++n[t.kind];
  return n;
}

// How many times unit u is gathered in one step: once per run of consecutive uses that read
// it (the head serves its forward and backward; unit 0 its backward and the next
// micro-batch's forward; with tied embeddings unit 0 stays from forward(head) to backward(0)).
// Gathered runs of sharded unit u per step, M micro-batches in groups of G: one per group for
// the head (forward and backward), two per group (forward, backward) for the blocks, and for
// unit 0 the first group's forward, then one per group: its backward shares a gather with the
// next group's forward. (So with vocabulary pieces too: the head's pieces but the last, and
// the embedding's but the first, are gathered for their forward and again for their backward.)
int runs_of(int u, int U, int M, int G = 1) {
  const int groups = (M + G - 1) / G;
  if (u == U - 1) return groups;
  if (u == 0) return groups + 1;
  return 2 * groups;
}

struct Expected {
  std::map<TaskKind, int> kinds;
  int groups = 0;
};

// `per_group`: gradients reduced once per group (ScheduleOptions::reduce_per_group).
Expected expected_counts(const Placement& pl, int M, int G = 1, bool per_group = false) {
  const Partition& part = pl.partition;
  const int U = part.num_units(), R = part.ranks;
  const int groups = per_group ? (M + G - 1) / G : M;  // reductions per unit and step
  // Tied and cut into vocabulary pieces, embedding piece k is gathered for head piece k's uses
  // too (one run per group for the last piece, whose forward and backward are adjacent, two
  // for the others), and its gradients are reduced after them as well as after its own.
  const ModelLayout layout = ModelLayout::build(pl.shape.model);
  const bool cut_table = pl.shape.model.tie_word_embeddings && layout.vocab_pieces > 1;
  const int P = layout.vocab_pieces, runs_per_group = (M + G - 1) / G;
  Expected e;
  auto& k = e.kinds;
  for (int u = 0; u < U; ++u) {
    const UnitPartition& up = part.units[static_cast<size_t>(u)];
    const UnitHomes& h = pl.homes[static_cast<size_t>(u)];
    const bool o_host = h.optimizer != Tier::gpu;
    const bool table = cut_table && u < P;
    const int reductions = table ? 2 * groups : groups;
    if (!up.replicated) {
      const int runs =
          runs_of(u, U, M, G) + (table ? (u == P - 1 ? runs_per_group : 2 * runs_per_group) : 0);
      k[TaskKind::gather] += R * runs;
      e.groups += runs;
      if (h.param == Tier::nvme) k[TaskKind::param_read] += runs;
      if (h.param != Tier::gpu) k[TaskKind::param_h2d] += R * runs;
    }
    k[TaskKind::forward] += R * M;
    k[TaskKind::backward] += R * M;
    k[TaskKind::reduce_scatter] += R * reductions;
    e.groups += reductions;
    if (o_host) {
      if (h.grad == Tier::gpu) {  // summed on the GPU, brought down once for CPU Adam
        k[TaskKind::grad_offload] += up.replicated ? 1 : R;
        k[TaskKind::grad_stats] += R;
      } else if (h.grad == Tier::nvme) {  // each reduction written, the later ones added into
        k[TaskKind::grad_d2h] += reductions * R;  // what is read back; the sum read for Adam
        k[TaskKind::grad_write] += reductions;
        k[TaskKind::grad_read] += reductions;
        k[TaskKind::grad_accumulate] += reductions - 1;
        k[TaskKind::grad_stats] += 1;
      } else {
        k[TaskKind::grad_d2h] += reductions * (up.replicated ? 1 : R);
        k[TaskKind::grad_accumulate] += reductions - 1;
        k[TaskKind::grad_stats] += 1;
      }
      k[TaskKind::adam] += 1;
      if (h.param == Tier::gpu) k[TaskKind::param_upload] += R;
      if (h.param == Tier::nvme) k[TaskKind::param_write] += 1;
    } else {
      k[TaskKind::grad_stats] += R;
      k[TaskKind::adam] += R;
      if (h.param != Tier::gpu) k[TaskKind::param_d2h] += R;
      if (h.param == Tier::nvme) k[TaskKind::param_write] += 1;
    }
    if (h.optimizer == Tier::nvme) {
      k[TaskKind::optim_read] += 1;
      k[TaskKind::optim_write] += 1;
    }
  }
  for (auto it = k.begin(); it != k.end();) it = it->second == 0 ? k.erase(it) : std::next(it);
  return e;
}

// before(b, a): task a ends before task b starts in every execution of one step, through
// dependencies, lane order and groups (a group starts when all its members could). One row of
// bits per task, whose predecessors' rows are OR'ed in a word at a time (vector<bool>'s bit
// by bit took most of the schedule tests' time, 10 times more under ASan).
class HappensBefore {
 public:
  explicit HappensBefore(const Schedule& s)
      : n_(s.tasks.size()), words_((n_ + 63) / 64), bits_(n_ * words_, 0) {
    std::vector<int> last_on_lane(s.lanes.size(), -1);
    std::vector<uint64_t> acc(words_);
    for (size_t i = 0; i < n_;) {
      size_t j = i + 1;
      if (s.tasks[i].group >= 0)
        while (j < n_ && s.tasks[j].group == s.tasks[i].group) ++j;
      std::fill(acc.begin(), acc.end(), 0);
      for (size_t k = i; k < j; ++k) {
        std::vector<int> preds = s.tasks[k].deps;
        if (last_on_lane[static_cast<size_t>(s.tasks[k].lane)] >= 0)
          preds.push_back(last_on_lane[static_cast<size_t>(s.tasks[k].lane)]);
        for (int p : preds) {
          const auto q = static_cast<size_t>(p);
          acc[q / 64] |= uint64_t{1} << (q % 64);
          const uint64_t* row = &bits_[q * words_];
          for (size_t w = 0; w < words_; ++w) acc[w] |= row[w];
        }
      }
      for (size_t k = i; k < j; ++k) {
        std::copy(acc.begin(), acc.end(), bits_.begin() + static_cast<std::ptrdiff_t>(k * words_));
        last_on_lane[static_cast<size_t>(s.tasks[k].lane)] = static_cast<int>(k);
      }
      i = j;
    }
  }
  bool operator()(size_t b, size_t a) const {
    return (bits_[b * words_ + a / 64] >> (a % 64) & 1) != 0;
  }

 private:
  size_t n_, words_;
  std::vector<uint64_t> bits_;
};

// Every buffer is reused only after its previous holder is done with it: for each pinned
// buffer, and each working buffer on each rank, every task of one holding happens before
// every task of the next. Holdings: a pinned buffer is held by one fetch (param_read and its
// h2ds), one staged gradient (grad_d2hs and grad_accumulate), one optimizer shard (optim_read
// and optim_write) or one updated parameter shard (adam or param_d2hs, then param_write or
// param_uploads); a working buffer by one gather (its h2d, the gather, the computes that read
// it and the reduce-scatter of the same unit).
// Returns the first violation, or an empty string.
std::string buffer_reuse_violation(const Schedule& s) {
  const HappensBefore before(s);
  std::map<std::pair<int, int>, std::vector<std::vector<int>>> holdings;  // (buffer, rank) ->
  std::map<int, std::pair<std::pair<int, int>, size_t>> holding_of;       // gather -> its holding
  auto family = [](TaskKind k) {
    switch (k) {
      case TaskKind::param_read:
      case TaskKind::param_h2d:
        return 0;
      case TaskKind::grad_d2h:
      case TaskKind::grad_accumulate:
      case TaskKind::grad_write:
        return 1;
      case TaskKind::optim_read:
      case TaskKind::optim_write:
        return 2;
      case TaskKind::grad_offload:
        return 4;
      default:
        return 3;
    }
  };
  // grad_offload (or the optimizer's grad_read) -> its holding: CPU Adam reads the gradients
  // it brought, from that buffer.
  std::map<int, std::pair<int, size_t>> offload_holding;
  std::map<int, std::tuple<int, int, int>> pinned_key;  // buffer -> (family, unit, m) held now
  for (const Task& t : s.tasks) {
    if (t.buffer >= 0) {
      auto& list = holdings[{t.buffer, -1}];
      // G on NVMe: the backward's grad_read starts a holding of a reduction (m) that its
      // grad_write ends, the last one's grad_stats reading it between them; the optimizer's
      // (m -1) one that Adam reads.
      const bool reads_back = t.kind == TaskKind::grad_read;
      std::tuple<int, int, int> key{reads_back ? (t.micro_batch < 0 ? 4 : 1) : family(t.kind),
                                    t.unit, t.micro_batch};
      auto it = pinned_key.find(t.buffer);
      if (t.kind == TaskKind::grad_stats && it != pinned_key.end() &&
          std::get<0>(it->second) == 1 && std::get<1>(it->second) == t.unit)
        key = it->second;
      if (it == pinned_key.end() || it->second != key || reads_back) list.emplace_back();
      pinned_key[t.buffer] = key;
      list.back().push_back(t.id);
      if (t.kind == TaskKind::grad_offload || (reads_back && t.micro_batch < 0))
        offload_holding[t.id] = {t.buffer, list.size() - 1};
    }
    if (t.kind == TaskKind::adam)
      for (int d : t.deps)
        if (auto h = offload_holding.find(d); h != offload_holding.end()) {
          auto& held = holdings[{h->second.first, -1}][h->second.second];
          if (held.back() != t.id) held.push_back(t.id);
        }
    if (t.slot >= 0) {
      auto& list = holdings[{100 + t.slot, t.rank}];
      // One rank's grad_d2h reads the working gradients of the holding it follows.
      const bool joins =
          t.kind == TaskKind::reduce_scatter || t.kind == TaskKind::grad_d2h ||
          (t.kind == TaskKind::gather && !list.empty() &&
           s.tasks[static_cast<size_t>(list.back().back())].kind == TaskKind::param_h2d &&
           s.tasks[static_cast<size_t>(list.back().back())].unit == t.unit);
      if (!joins) list.emplace_back();
      list.back().push_back(t.id);
      if (t.kind == TaskKind::gather) holding_of[t.id] = {{100 + t.slot, t.rank}, list.size() - 1};
    }
    if (t.kind == TaskKind::forward || t.kind == TaskKind::backward)
      for (int d : t.deps)
        if (auto h = holding_of.find(d); h != holding_of.end())
          holdings[h->second.first][h->second.second].push_back(t.id);
  }
  for (const auto& [key, list] : holdings)
    for (size_t k = 0; k + 1 < list.size(); ++k)
      for (int a : list[k])
        for (int b : list[k + 1]) {
          // A param_h2d fills the parameter part; a reduce-scatter or a grad_d2h reads the
          // gradient part.
          const TaskKind ka = s.tasks[static_cast<size_t>(a)].kind;
          if ((ka == TaskKind::reduce_scatter || ka == TaskKind::grad_d2h) &&
              s.tasks[static_cast<size_t>(b)].kind == TaskKind::param_h2d)
            continue;
          if (!before(static_cast<size_t>(b), static_cast<size_t>(a)))
            return fmt::format(
                "buffer {} rank {}: task {} of one holding is not ordered before task {} of the "
                "next",
                key.first, key.second, a, b);
        }
  return "";
}

// A replicated unit's working gradients are one buffer per rank, not a pool slot: held from
// the first backward of a micro-batch that adds into them (the head's, for a tied unit 0)
// through that micro-batch's all-reduce. Every task of one such holding must happen before
// every task of the next on the same rank. Returns the first violation, or an empty string.
std::string replicated_gradient_violation(const Schedule& s, const Placement& pl) {
  const HappensBefore before(s);
  const ModelLayout layout = ModelLayout::build(pl.shape.model);
  auto replicated = [&](int u) { return pl.partition.units[static_cast<size_t>(u)].replicated; };
  // (unit, rank) -> holdings; a holding is closed by its all-reduce.
  std::map<std::pair<int, int>, std::vector<std::vector<int>>> holdings;
  std::map<std::pair<int, int>, bool> closed;
  for (const Task& t : s.tasks) {
    std::vector<int> xs;
    if (t.kind == TaskKind::backward) {
      if (replicated(t.unit)) xs.push_back(t.unit);
      // Tied, a head unit adds into the table it reads (unit 0's, or its vocabulary piece's).
      const int table = layout.tied_table(t.unit);
      if (table >= 0 && replicated(table)) xs.push_back(table);
    } else if (t.kind == TaskKind::reduce_scatter && replicated(t.unit)) {
      xs.push_back(t.unit);
    }
    for (int x : xs) {
      auto& list = holdings[{x, t.rank}];
      bool& done = closed[{x, t.rank}];
      if (list.empty() || done) list.emplace_back();
      list.back().push_back(t.id);
      done = t.kind == TaskKind::reduce_scatter;
    }
  }
  for (const auto& [key, list] : holdings)
    for (size_t k = 0; k + 1 < list.size(); ++k)
      for (int a : list[k])
        for (int b : list[k + 1])
          if (!before(static_cast<size_t>(b), static_cast<size_t>(a)))
            return fmt::format(
                "working gradients of replicated unit {} on rank {}: task {} ({} m={}) is not "
                "ordered before task {} ({} m={}) of the next micro-batch",
                key.first, key.second, a, task_kind_name(s.tasks[static_cast<size_t>(a)].kind),
                s.tasks[static_cast<size_t>(a)].micro_batch, b,
                task_kind_name(s.tasks[static_cast<size_t>(b)].kind),
                s.tasks[static_cast<size_t>(b)].micro_batch);
  return "";
}

int count_groups(const Schedule& s) {
  int n = 0;
  for (size_t i = 0; i < s.tasks.size(); ++i)
    if (s.tasks[i].group >= 0 && (i == 0 || s.tasks[i - 1].group != s.tasks[i].group)) ++n;
  return n;
}

// ---- the builder over every placement ----

// Calls fn(placement, M, d) for each case the sweeps below cover, under a trace naming it: tied
// embeddings or not, each whole or in vocabulary pieces, every unit sharded, the small ones
// replicated or every one replicated (nothing on the comm lanes but all-reduces), P and O each in
// every tier, 1 or 3 ranks, 1 or 2 micro-batches, prefetch depth 0..2 (3 working buffers); with O
// off the GPU, G in host RAM or on the GPU.
template <typename Fn>
int for_every_placement(Fn&& fn) {
  const std::array<Tier, 3> tiers = {Tier::gpu, Tier::cpu, Tier::nvme};
  int cases = 0;
  // untied, tied, untied in three vocabulary pieces, tied in three
  for (int variant : {0, 1, 2, 3})
    for (uint64_t threshold : {uint64_t{0}, uint64_t{40000}, uint64_t{1} << 40})
      for (Tier p : tiers)
        for (Tier o : tiers)
          for (Tier g : tiers)  // G's home with the optimizer on the host
            for (int R : {1, 3})
              for (int M : {1, 2})
                for (int d = 0; d <= 2; ++d) {
                  if (o == Tier::gpu && g != Tier::cpu) continue;  // the same placement
                  SCOPED_TRACE(fmt::format("variant={} threshold={} P={} O={} G={} R={} M={} d={}",
                                           variant, threshold, int(p), int(o), int(g), R, M, d));
                  LlamaConfig c = tiny(variant == 1 || variant == 3);
                  if (variant >= 2) c.vocab_pieces = 3;
                  fn(make_placement(c, R, p, o, threshold, 3, 4, g == Tier::gpu, g == Tier::nvme),
                     M, d);
                  ++cases;
                }
  return cases;
}

// The first two tasks on host-core lanes (every lane but NVMe's) that run at once, a group's
// members counted as one, or "".
std::string cores_overlap(const Schedule& s, const Timeline& tl) {
  std::vector<const TaskSpan*> spans;
  for (const TaskSpan& x : tl.spans) {
    const Task& t = s.tasks[size_t(x.task)];
    const LaneKind k = s.lanes[size_t(t.lane)].kind;
    if (k == LaneKind::nvme_read || k == LaneKind::nvme_write || x.end_s <= x.start_s) continue;
    if (t.group >= 0 && x.task > 0 && s.tasks[size_t(x.task) - 1].group == t.group) continue;
    spans.push_back(&x);
  }
  std::sort(spans.begin(), spans.end(),
            [](const TaskSpan* a, const TaskSpan* b) { return a->start_s < b->start_s; });
  for (size_t i = 1; i < spans.size(); ++i)
    if (spans[i]->start_s < spans[i - 1]->end_s - 1e-12)
      return fmt::format("step {} task {} [{}, {}) and step {} task {} [{}, {})",
                         spans[i - 1]->step, spans[i - 1]->task, spans[i - 1]->start_s,
                         spans[i - 1]->end_s, spans[i]->step, spans[i]->task, spans[i]->start_s,
                         spans[i]->end_s);
  return "";
}

TEST(Schedule, EveryPlacementValidatesCountsAndSimulates) {
  const int built = for_every_placement([](const Placement& pl, int M, int d) {
    const Schedule s = Schedule::build(pl, ScheduleOptions{M, d});
    ASSERT_NO_THROW(s.validate());
    EXPECT_EQ(buffer_reuse_violation(s), "") << s.str();
    EXPECT_EQ(replicated_gradient_violation(s, pl), "") << s.str();
    // G on NVMe: a step's first grad_write of a unit overwrites what the previous step's update
    // read back, so it waits for that grad_read.
    for (int u = 0; u < static_cast<int>(pl.homes.size()); ++u) {
      if (pl.homes[size_t(u)].grad != Tier::nvme) continue;
      int first_write = -1, update_read = -1;
      for (const Task& t : s.tasks) {
        if (t.unit != u) continue;
        if (t.kind == TaskKind::grad_write && first_write < 0) first_write = t.id;
        if (t.kind == TaskKind::grad_read && t.micro_batch < 0) update_read = t.id;
      }
      ASSERT_GE(first_write, 0);
      ASSERT_GE(update_read, 0);
      const std::vector<int>& prev = s.tasks[size_t(first_write)].prev;
      EXPECT_NE(std::find(prev.begin(), prev.end(), update_read), prev.end())
          << "unit " << u << "\n"
          << s.str();
    }
    const Expected e = expected_counts(pl, M);
    EXPECT_EQ(count_kinds(s), e.kinds);
    EXPECT_EQ(count_groups(s), e.groups);
    EXPECT_EQ(s.prefetch_depth, std::min(d, 2));
    // Lanes appear in the fixed order and only when used.
    for (size_t l = 1; l < s.lanes.size(); ++l) {
      const Lane& a = s.lanes[l - 1];
      const Lane& b = s.lanes[l];
      const bool ordered = (a.device >= 0 && b.device < 0) ||
                           (a.device >= 0 && b.device >= 0 &&
                            (a.device < b.device || (a.device == b.device && a.kind < b.kind))) ||
                           (a.device < 0 && b.device < 0 && a.kind < b.kind);
      EXPECT_TRUE(ordered) << a.name() << " before " << b.name();
    }
    for (size_t l = 0; l < s.lanes.size(); ++l)
      EXPECT_FALSE(s.lane_tasks(static_cast<int>(l)).empty()) << s.lanes[l].name();
    bool nvme = false;
    for (const UnitHomes& h : pl.homes)
      nvme = nvme || h.param == Tier::nvme || h.optimizer == Tier::nvme || h.grad == Tier::nvme;
    EXPECT_EQ(s.lane_index(Lane{LaneKind::nvme_read, -1}) >= 0, nvme);
    const Prediction pred = simulate(s, test_profile(), 3);
    ASSERT_NO_THROW(check_timeline(s, pred.timeline));
    EXPECT_GT(pred.step_s, 0);
    EXPECT_LE(pred.overlap, 1.0 + 1e-9);
    // On host devices the device lanes and cpu.adam share the cores: with host_cpu_mixed 1
    // no two of their tasks (a group counted once) run at once; with 2 the timeline holds.
    for (double mixed : {1.0, 2.0}) {
      HardwareProfile hw = test_profile();
      hw.host_cpu_mixed = mixed;
      const Prediction m = simulate(s, hw, 3);
      ASSERT_NO_THROW(check_timeline(s, m.timeline)) << mixed;
      EXPECT_LE(m.overlap, 1.0 + 1e-9) << mixed;
      if (mixed == 1.0) {
        EXPECT_EQ(cores_overlap(s, m.timeline), "") << s.str();
      }
    }
    // Drives that serve reads and writes at once can only make the step shorter.
    if (nvme)
      for (double mixed : {1.5, 2.0}) {
        HardwareProfile hw = test_profile();
        hw.nvme_mixed = mixed;
        const Prediction m = simulate(s, hw, 3);
        ASSERT_NO_THROW(check_timeline(s, m.timeline)) << mixed;
        EXPECT_LE(m.step_s, pred.step_s * (1 + 1e-9)) << mixed;
        EXPECT_LE(m.overlap, 1.0 + 1e-9) << mixed;
      }
  });
  // O gpu with G gpu, O cpu or nvme with G in any tier
  EXPECT_EQ(built, 4 * 3 * 3 * 7 * 2 * 2 * 3);
}

// Activation checkpoints offloaded (RunShape::offload_activations): for every block v whose
// input leaves the GPU's ring of K slots, each micro-batch on each rank copies it out after the
// forward that wrote it (forward(v - 1)) and before the forward that overwrites its slot
// (forward(v + K - 1)), and back after the backward that last read the slot (backward(v + K))
// and before its own backward; the copies are on the rank's d2h and h2d lanes with the bytes of
// one [micro_batch x seq_len, hidden] activation, and the simulator times them. Evaluation moves
// none.
TEST(Schedule, OffloadedActivationCheckpointsGoOutAndComeBackInTime) {
  LlamaConfig c = tiny(false);
  c.num_hidden_layers = 6;
  int checked = 0;
  for (const int R : {1, 2})
    for (const Tier t : {Tier::gpu, Tier::cpu})
      for (const int working : {2, 3, 4})
        for (const int M : {1, 3})
          for (const int G : {1, 2}) {
            Placement pl = make_placement(c, R, t, t, 0, working);
            pl.shape.offload_activations = true;
            pl.shape.micro_batch_group = G;
            const Schedule s = Schedule::build(pl, ScheduleOptions{M, working - 1});
            const std::string what =
                fmt::format("R {} P/O {} working {} M {} G {}", R, tier_name(t), working, M, G);
            ASSERT_NO_THROW(s.validate()) << what;
            EXPECT_EQ(buffer_reuse_violation(s), "") << what;
            const HappensBefore before(s);
            std::map<std::tuple<TaskKind, int, int, int>, int> at;  // (kind, unit, m, rank)
            for (const Task& x : s.tasks)
              if (x.micro_batch >= 0) at[{x.kind, x.unit, x.micro_batch, x.rank}] = x.id;
            const int K = checkpoint_slots(pl.shape);
            ASSERT_EQ(K, working) << what;
            const int first = ModelLayout::build(c).first_block();
            const int n = offloaded_checkpoints(c, K);
            ASSERT_EQ(n, 6 - K + 1) << what;
            int moved = 0;
            for (const Task& x : s.tasks) {
              if (x.kind != TaskKind::act_d2h && x.kind != TaskKind::act_h2d) continue;
              ++moved;
              EXPECT_EQ(x.bytes, uint64_t{2 * 64 * 64 * 2}) << what;  // bf16 [2 x 64, 64]
              EXPECT_EQ(s.lanes[size_t(x.lane)].kind,
                        x.kind == TaskKind::act_d2h ? LaneKind::d2h : LaneKind::h2d);
              EXPECT_EQ(s.lanes[size_t(x.lane)].device, x.rank);
            }
            EXPECT_EQ(moved, 2 * n * M * R) << what;
            for (int v = first; v < first + n; ++v)
              for (int m = 0; m < M; ++m)
                for (int r = 0; r < R; ++r) {
                  const auto get = [&](TaskKind k, int u) {
                    const auto it = at.find({k, u, m, r});
                    return it == at.end() ? -1 : it->second;
                  };
                  const int out = get(TaskKind::act_d2h, v), back = get(TaskKind::act_h2d, v);
                  ASSERT_GE(out, 0) << what << " v " << v;
                  ASSERT_GE(back, 0) << what << " v " << v;
                  const auto ok = [&](int later, int earlier) {
                    return later >= 0 && earlier >= 0 && before(size_t(later), size_t(earlier));
                  };
                  EXPECT_TRUE(ok(out, get(TaskKind::forward, v - 1))) << what << " v " << v;
                  EXPECT_TRUE(ok(get(TaskKind::forward, v + K - 1), out)) << what << " v " << v;
                  EXPECT_TRUE(ok(back, get(TaskKind::backward, v + K))) << what << " v " << v;
                  EXPECT_TRUE(ok(back, out)) << what << " v " << v;
                  EXPECT_TRUE(ok(get(TaskKind::backward, v), back)) << what << " v " << v;
                  ++checked;
                }
            const Prediction p = simulate(s, test_profile(), 2);
            ASSERT_NO_THROW(check_timeline(s, p.timeline)) << what;
            // Without the offload: no copies, and the same step but for them.
            Placement kept = pl;
            kept.shape.offload_activations = false;
            const Schedule k = Schedule::build(kept, ScheduleOptions{M, working - 1});
            EXPECT_EQ(k.tasks.size() + static_cast<size_t>(2 * n * M * R), s.tasks.size());
            ScheduleOptions eval{M, working - 1};
            eval.forward_only = true;
            for (const Task& x : Schedule::build(pl, eval).tasks)
              EXPECT_TRUE(x.kind != TaskKind::act_d2h && x.kind != TaskKind::act_h2d) << what;
          }
  // (ranks 1 + 2) x 2 placements x (5 + 4 + 3 blocks offloaded) x (micro-batches 1 + 3) x 2
  EXPECT_EQ(checked, 3 * 2 * 12 * 4 * 2);
}

// Evaluation's schedule: each micro-batch's forwards and what fetches and gathers them; every
// sharded unit gathered once per micro-batch, nothing written back. With tied embeddings unit 0
// is gathered again for the last micro-batch's head (the other heads share their gather with
// the next micro-batch's embedding, the use right after them); cut into vocabulary pieces,
// each table piece is gathered again for its head piece in every micro-batch.
TEST(Schedule, ForwardOnlyHasTheForwardsAndTheirFetchesAlone) {
  for_every_placement([](const Placement& pl, int M, int d) {
    ScheduleOptions so{M, d};
    so.forward_only = true;
    const Schedule s = Schedule::build(pl, so);
    ASSERT_NO_THROW(s.validate());
    EXPECT_EQ(buffer_reuse_violation(s), "") << s.str();
    const int U = pl.partition.num_units(), R = pl.shape.ranks;
    int sharded = 0;
    for (const UnitPartition& up : pl.partition.units) sharded += up.replicated ? 0 : 1;
    const ModelLayout layout = ModelLayout::build(pl.shape.model);
    int again = 0;  // gathers of the table for the head
    if (pl.shape.model.tie_word_embeddings)
      for (int k = 0; k < layout.vocab_pieces; ++k)
        if (!pl.partition.units[static_cast<size_t>(k)].replicated)
          again += layout.vocab_pieces == 1 ? 1 : M;
    std::map<TaskKind, int> kinds;
    for (const Task& t : s.tasks) ++kinds[t.kind];
    for (const auto& [k, n] : kinds)
      EXPECT_TRUE(k == TaskKind::param_read || k == TaskKind::param_h2d || k == TaskKind::gather ||
                  k == TaskKind::forward)
          << n << " x " << task_kind_name(k);
    EXPECT_EQ(kinds[TaskKind::forward], U * M * R);
    EXPECT_EQ(kinds[TaskKind::gather], (sharded * M + again) * R);
    const Prediction pred = simulate(s, test_profile(), 2);
    ASSERT_NO_THROW(check_timeline(s, pred.timeline));
  });
}

TEST(Schedule, BufferCheckCatchesAGatherThatDoesNotWaitForItsBuffer) {
  const Placement pl = make_placement(tiny(false), 2, Tier::gpu, Tier::nvme, 0, 2, 2);
  const Schedule s = Schedule::build(pl, {2, 1});
  ASSERT_EQ(buffer_reuse_violation(s), "");
  // The third gather reuses the first one's working buffer: without its wait on forward(0)
  // (and the lane order that follows), the forward may still read what it overwrites.
  int gathers = 0;
  for (const Task& t : s.tasks)
    if (t.kind == TaskKind::gather && t.rank == 0 && ++gathers == 3) {
      Schedule broken = s;
      broken.tasks[static_cast<size_t>(t.id)].deps.clear();
      EXPECT_NE(buffer_reuse_violation(broken).find(fmt::format("before task {}", t.id)),
                std::string::npos);
    }
  // The second optim_read reuses a pinned buffer of the first, after its optim_write.
  for (const Task& t : s.tasks)
    if (t.kind == TaskKind::optim_read && !t.deps.empty()) {
      Schedule broken = s;
      broken.tasks[static_cast<size_t>(t.id)].deps.clear();
      EXPECT_NE(buffer_reuse_violation(broken), "") << t.id;
      break;
    }
}

TEST(Schedule, SameInputsPrintTheSameSchedule) {
  const Placement pl = make_placement(tiny(true), 3, Tier::nvme, Tier::nvme, 0, 3);
  const Schedule a = Schedule::build(pl, {2, 2});
  const Schedule b = Schedule::build(pl, {2, 2});
  EXPECT_EQ(a.str(), b.str());
  const Schedule c = Schedule::build(pl, {2, 1});
  EXPECT_NE(a.str(), c.str());
  // One line per task, in the documented shape.
  const std::string text = a.str();
  EXPECT_EQ(static_cast<size_t>(std::count(text.begin(), text.end(), '\n')), a.tasks.size());
  EXPECT_NE(text.find("gpu[2].comm gather u=1 m=0 g="), std::string::npos) << text;
  EXPECT_NE(text.find("nvme.read param_read u=0 m=0 buf=0"), std::string::npos) << text;
  const std::string sum = a.summary();
  EXPECT_NE(sum.find(fmt::format("{} tasks", a.tasks.size())), std::string::npos) << sum;
  for (const Lane& l : a.lanes) EXPECT_NE(sum.find(l.name()), std::string::npos) << sum;
}

TEST(Schedule, PrefetchEmitsTheNextGatherBeforeTheCurrentForward) {
  const Placement pl = make_placement(tiny(false), 1, Tier::cpu, Tier::cpu, 0, 3);
  auto position = [](const Schedule& s, TaskKind kind, int u) {
    for (const Task& t : s.tasks)
      if (t.kind == kind && t.unit == u && t.micro_batch == 0) return t.id;
    return -1;
  };
  for (int d = 0; d <= 2; ++d) {
    const Schedule s = Schedule::build(pl, {1, d});
    const int fwd1 = position(s, TaskKind::forward, 1);
    // Units 1 + d' for d' <= d are gathered before forward(1); the next one after it.
    for (int k = 1; k <= d; ++k) EXPECT_LT(position(s, TaskKind::gather, 1 + k), fwd1) << d;
    if (2 + d < s.units) {
      EXPECT_GT(position(s, TaskKind::gather, 2 + d), fwd1) << d;
    }
    // The fetch of unit 2 (first used by forward(2)) starts after forward(1 - d).
    const Task& h2 = s.tasks[static_cast<size_t>(position(s, TaskKind::param_h2d, 2))];
    if (d <= 1) {
      EXPECT_NE(std::find(h2.deps.begin(), h2.deps.end(), position(s, TaskKind::forward, 1 - d)),
                h2.deps.end())
          << d;
    } else {
      EXPECT_TRUE(h2.deps.empty()) << d;
    }
    // The h2d lands in the gather's working buffer, which the gather also names.
    const Task& g = s.tasks[static_cast<size_t>(position(s, TaskKind::gather, 2))];
    const Task& h = s.tasks[static_cast<size_t>(position(s, TaskKind::param_h2d, 2))];
    EXPECT_EQ(g.slot, h.slot);
    EXPECT_GE(g.slot, 0);
  }
  // With W = 2 a gather reuses the buffer of the unit two gathers earlier, after its forward.
  const Placement two = make_placement(tiny(false), 1, Tier::gpu, Tier::gpu, 0, 2);
  const Schedule s = Schedule::build(two, {1, 1});
  const Task& g2 = s.tasks[static_cast<size_t>(position(s, TaskKind::gather, 2))];
  const int fwd0 = position(s, TaskKind::forward, 0);
  EXPECT_NE(std::find(g2.deps.begin(), g2.deps.end(), fwd0), g2.deps.end()) << s.str();
}

TEST(Schedule, PrefetchShortensTheSimulatedStep) {
  const Placement pl = make_placement(tiny(false), 2, Tier::nvme, Tier::cpu, 0, 3);
  HardwareProfile p = test_profile();
  p.gpu_flops = 2e9;  // compute comparable to the transfers, so overlap matters
  p.nvme_read_bytes_per_s = 5e6;
  const double none = simulate(Schedule::build(pl, {2, 0}), p).step_s;
  const double two = simulate(Schedule::build(pl, {2, 2}), p).step_s;
  EXPECT_LT(two, none * 0.95) << none << " " << two;
}

// Without recompute a block's backward is twice its forward's FLOPs, not three times; the
// head still recomputes its logits (3x) and the embedding counts nothing. Less compute, so a
// compute-bound step is predicted shorter.
TEST(Schedule, BackwardFlopsFollowActivationCheckpointing) {
  Placement pl = make_placement(tiny(false), 1, Tier::gpu, Tier::gpu, 0);
  const int U = pl.partition.num_units();
  for (bool recompute : {true, false}) {
    SCOPED_TRACE(recompute ? "recompute" : "no recompute");
    pl.shape.recompute = recompute;
    const Schedule s = Schedule::build(pl, {1, 1});
    std::vector<double> fwd(size_t(U), -1), bwd(size_t(U), -1);
    for (const Task& t : s.tasks) {
      if (t.kind == TaskKind::forward) fwd[size_t(t.unit)] = t.flops;
      if (t.kind == TaskKind::backward) bwd[size_t(t.unit)] = t.flops;
    }
    EXPECT_EQ(fwd[0], 0.0);
    EXPECT_EQ(bwd[0], 0.0);
    for (int u = 1; u < U; ++u) {
      ASSERT_GT(fwd[size_t(u)], 0.0) << u;
      EXPECT_EQ(bwd[size_t(u)], (recompute || u == U - 1 ? 3.0 : 2.0) * fwd[size_t(u)]) << u;
    }
  }
  HardwareProfile p = test_profile();
  p.gpu_flops = 1e9;  // compute-bound
  pl.shape.recompute = true;
  const double with = simulate(Schedule::build(pl, {1, 1}), p).step_s;
  pl.shape.recompute = false;
  const double without = simulate(Schedule::build(pl, {1, 1}), p).step_s;
  EXPECT_LT(without, with * 0.85) << with << " " << without;
}

TEST(Schedule, NextStepWaitsOnlyForItsUnitsUpdate) {
  // P on the GPU, O in host RAM: forward's first gather of unit u waits for u's upload only.
  const Placement pl = make_placement(tiny(false), 2, Tier::gpu, Tier::cpu, 0);
  const Schedule s = Schedule::build(pl, {1, 1});
  std::map<std::pair<int, int>, int> first;  // (unit, rank) -> its first gather
  for (const Task& t : s.tasks)
    if (t.kind == TaskKind::gather) first.emplace(std::pair{t.unit, t.rank}, t.id);
  ASSERT_EQ(first.size(), static_cast<size_t>(s.units * s.ranks));
  for (const auto& [key, id] : first) {
    int uploads = 0;
    for (int p : s.tasks[static_cast<size_t>(id)].prev) {
      const Task& w = s.tasks[static_cast<size_t>(p)];
      if (w.kind != TaskKind::param_upload) continue;
      EXPECT_EQ(w.unit, key.first);
      EXPECT_EQ(w.rank, key.second);
      ++uploads;
    }
    EXPECT_EQ(uploads, 1) << "unit " << key.first << " rank " << key.second;
  }
  // Simulated: the next step's forward(0) starts while the CPU still updates the last unit.
  HardwareProfile p = test_profile();
  p.adam_elements_per_s = 1e6;
  const Prediction pred = simulate(s, p);
  EXPECT_EQ(pred.critical_lane, s.lane_index(Lane{LaneKind::cpu_adam, -1}));
  double forward0 = -1, last_adam = -1;
  for (const TaskSpan& sp : pred.timeline.spans) {
    const Task& t = s.tasks[static_cast<size_t>(sp.task)];
    if (sp.step == 2 && t.kind == TaskKind::forward && t.unit == 0 && t.rank == 0)
      forward0 = sp.start_s;
    if (sp.step == 1 && t.kind == TaskKind::adam && t.unit == s.units - 1) last_adam = sp.end_s;
  }
  EXPECT_GT(forward0, 0);
  EXPECT_LT(forward0, last_adam);
}

TEST(Schedule, RejectsPlacementsItCannotSchedule) {
  Placement pl = make_placement(tiny(false), 2, Tier::nvme, Tier::nvme, 0, 2, 1);
  expect_error(
      [&] {
        Schedule::build(pl, {1, 1});
      },
      {"1 pinned buffers", "need 2", "buffer_count"});
  pl = make_placement(tiny(true), 1, Tier::gpu, Tier::gpu, 0, 1);
  expect_error([&] { Schedule::build(pl, {1, 0}); }, {"ties its embeddings", "2 working buffers"});
  pl = make_placement(tiny(false), 1, Tier::gpu, Tier::gpu, 0);
  expect_error([&] { Schedule::build(pl, {0, 1}); }, {"micro_batches = 0"});
  pl.homes[1].grad = Tier::cpu;
  expect_error(
      [&] {
        Schedule::build(pl, {1, 1});
      },
      {"unit layers.0", "gradients in host RAM", "optimizer on the GPU"});
  pl = make_placement(tiny(false), 1, Tier::gpu, Tier::gpu, 40000);
  pl.homes[0].param = Tier::nvme;
  expect_error([&] { Schedule::build(pl, {1, 1}); }, {"unit embedding is replicated", "nvme"});
}

TEST(Schedule, MicroBatchGroupsFetchEachUnitOncePerGroup) {
  // M micro-batches in groups of G run unit by unit: every sharded unit is fetched and
  // gathered once per group for its forwards and once for its backwards, each backward of a
  // group waits for every rank's reduce-scatter of the one before, and the steps validate and
  // simulate for every placement.
  const std::array<Tier, 3> tiers = {Tier::gpu, Tier::cpu, Tier::nvme};
  int cases = 0;
  for (uint64_t threshold : {uint64_t{0}, uint64_t{40000}})
    for (Tier p : tiers)
      for (Tier o : tiers)
        for (int R : {1, 3})
          for (const auto& [M, G] :
               {std::pair{4, 2}, std::pair{4, 4}, std::pair{5, 3}, std::pair{2, 8}})
            for (int d = 0; d <= 2; ++d) {
              SCOPED_TRACE(fmt::format("threshold={} P={} O={} R={} M={} G={} d={}", threshold,
                                       int(p), int(o), R, M, G, d));
              Placement pl = make_placement(tiny(false), R, p, o, threshold, 3, 4);
              pl.shape.micro_batch_group = G;
              const Schedule s = Schedule::build(pl, ScheduleOptions{M, d});
              ++cases;
              ASSERT_NO_THROW(s.validate());
              EXPECT_EQ(s.micro_batch_group, std::min(M, G));
              EXPECT_EQ(buffer_reuse_violation(s), "") << s.str();
              EXPECT_EQ(replicated_gradient_violation(s, pl), "") << s.str();
              const Expected e = expected_counts(pl, M, std::min(M, G));
              EXPECT_EQ(count_kinds(s), e.kinds);
              EXPECT_EQ(count_groups(s), e.groups);
              // Uses run group by group, unit by unit within a group.
              int last_m = -1, last_u = -1;
              for (const Task& t : s.tasks) {
                if (t.rank != 0 || t.kind != TaskKind::forward) continue;
                if (t.unit == last_u) {
                  EXPECT_EQ(t.micro_batch, last_m + 1);
                }
                last_m = t.micro_batch;
                last_u = t.unit;
              }
              // A backward of a sharded unit after another of the same unit (its run) waits for
              // the reduce-scatter of that one on every rank.
              std::map<std::pair<int, int>, std::vector<int>> rs;  // (unit, m): its tasks
              for (const Task& t : s.tasks)
                if (t.kind == TaskKind::reduce_scatter) rs[{t.unit, t.micro_batch}].push_back(t.id);
              for (const Task& t : s.tasks) {
                if (t.kind != TaskKind::backward || pl.partition.units[size_t(t.unit)].replicated ||
                    t.micro_batch % std::min(M, G) == 0)
                  continue;
                for (int x : rs[{t.unit, t.micro_batch - 1}])
                  EXPECT_NE(std::find(t.deps.begin(), t.deps.end(), x), t.deps.end())
                      << "backward " << t.id << " does not wait for reduce-scatter " << x;
              }
              const Prediction pred = simulate(s, test_profile(), 3);
              ASSERT_NO_THROW(check_timeline(s, pred.timeline));
            }
  EXPECT_EQ(cases, 2 * 3 * 3 * 2 * 4 * 3);
}

TEST(Schedule, MicroBatchGroupsShortenAnNvmeBoundStep) {
  // Parameters on NVMe, 8 micro-batches: fetched once per group of 8 instead of once per
  // micro-batch, the drive's lane has about an eighth of the reads to do.
  Placement pl = make_placement(tiny(false), 1, Tier::nvme, Tier::cpu, 0, 3, 4);
  const Prediction one = simulate(Schedule::build(pl, {8, 2}), test_profile(), 3);
  const Placement pl1 = pl;
  pl.shape.micro_batch_group = 8;
  const Schedule s = Schedule::build(pl, {8, 2});
  const Prediction eight = simulate(s, test_profile(), 3);
  auto lanes = [&](const Schedule& sc, const Prediction& pr) {
    std::string out;
    for (size_t l = 0; l < pr.lanes.size(); ++l)
      out += fmt::format(" {}={:.3g}", sc.lanes[l].name(), pr.lanes[l].busy_s);
    return out;
  };
  const Schedule s1 = Schedule::build(pl1, {8, 2});
  const int read1 = s1.lane_index(Lane{LaneKind::nvme_read, -1});
  const int read8 = s.lane_index(Lane{LaneKind::nvme_read, -1});
  ASSERT_GE(read1, 0);
  ASSERT_GE(read8, 0);
  // The reads: 8 of each block's per step (forward and backward of each micro-batch) become
  // 1 (the forward and the backward of the group); the step, NVMe-bound before, is bound by
  // the compute lane after.
  EXPECT_LT(eight.lanes[size_t(read8)].busy_s, one.lanes[size_t(read1)].busy_s / 6)
      << lanes(s1, one) << " vs " << lanes(s, eight);
  EXPECT_EQ(one.critical_lane, read1) << lanes(s1, one);
  EXPECT_LT(eight.step_s, 0.75 * one.step_s)
      << one.step_s << lanes(s1, one) << " vs " << eight.step_s << lanes(s, eight);
  EXPECT_NE(s.summary().find("8 micro-batches in groups of 8"), std::string::npos) << s.summary();
  // Tied embeddings in groups need the gradients reduced once per group: refused without,
  // naming both ways out.
  Placement tied = make_placement(tiny(true), 1, Tier::cpu, Tier::cpu, 0, 3, 4);
  tied.shape.micro_batch_group = 2;
  expect_error(
      [&] {
        Schedule::build(tied, {2, 1});
      },
      {"ties its embeddings", "--reduce-per-group on", "micro-batch group of 1"});
  ScheduleOptions per_group{2, 1};
  per_group.reduce_per_group = true;
  EXPECT_NO_THROW(Schedule::build(tied, per_group).validate());
  tied.shape.micro_batch_group = 0;
  expect_error([&] { Schedule::build(tied, {2, 1}); }, {"micro_batch_group = 0"});
}

TEST(Schedule, ReducingOncePerGroupForEveryPlacement) {
  // Gradients reduced once per group: one reduce-scatter (all-reduce) per unit and group, after
  // the unit's last backward of the group; no backward waits for a reduction of its own unit
  // within a group; every rule kept, with and without updating during the backward. With
  // groups of 1 the option changes nothing.
  // Tied embeddings too, which groups need this for: the head adds the whole group's share
  // into unit 0's working gradients before the embedding's backwards.
  const std::array<Tier, 3> tiers = {Tier::gpu, Tier::cpu, Tier::nvme};
  int cases = 0;
  for (bool tied : {false, true})
    for (uint64_t threshold : {uint64_t{0}, uint64_t{40000}})
      for (Tier p : tiers)
        for (Tier o : tiers)
          for (Tier g : tiers)
            for (int R : {1, 3})
              for (const auto& [M, G] : {std::pair{4, 2}, std::pair{5, 3}, std::pair{3, 1}})
                for (bool early : {false, true}) {
                  if (o == Tier::gpu && g != Tier::cpu) continue;  // the same placement
                  SCOPED_TRACE(
                      fmt::format("tied={} threshold={} P={} O={} G={} R={} M={} G={} early={}",
                                  tied, threshold, int(p), int(o), int(g), R, M, G, early));
                  Placement pl = make_placement(tiny(tied), R, p, o, threshold, 3, 4,
                                                g == Tier::gpu, g == Tier::nvme);
                  pl.shape.micro_batch_group = G;
                  ScheduleOptions so{M, 1};
                  so.update_during_backward = early;
                  so.reduce_per_group = true;
                  const Schedule s = Schedule::build(pl, so);
                  ++cases;
                  ASSERT_NO_THROW(s.validate());
                  EXPECT_EQ(buffer_reuse_violation(s), "") << s.str();
                  EXPECT_EQ(replicated_gradient_violation(s, pl), "") << s.str();
                  const Expected e = expected_counts(pl, M, G, true);
                  EXPECT_EQ(count_kinds(s), e.kinds);
                  EXPECT_EQ(count_groups(s), e.groups);
                  // Each reduction follows the last backward of its group; nothing of the group
                  // waits for it.
                  std::map<std::pair<int, int>, int> last_backward;  // (unit, group): task id
                  for (const Task& t : s.tasks)
                    if (t.kind == TaskKind::backward)
                      last_backward[{t.unit, t.micro_batch / G}] = t.id;
                  for (const Task& t : s.tasks) {
                    if (t.kind == TaskKind::reduce_scatter) {
                      EXPECT_EQ((t.micro_batch + 1) % G == 0 || t.micro_batch == M - 1, true)
                          << "reduction " << t.id << " at m=" << t.micro_batch;
                      const int after = last_backward[{t.unit, t.micro_batch / G}];
                      EXPECT_GT(t.id, after);
                    }
                    if (t.kind != TaskKind::backward) continue;
                    for (int x : t.deps) {
                      const Task& d = s.tasks[size_t(x)];
                      if (d.kind == TaskKind::reduce_scatter && d.unit == t.unit) {
                        EXPECT_LT(d.micro_batch / G, t.micro_batch / G)
                            << "backward " << t.id << " waits for reduction " << x;
                      }
                    }
                  }
                  const Prediction pred = simulate(s, test_profile(), 3);
                  ASSERT_NO_THROW(check_timeline(s, pred.timeline));
                  if (G == 1) {
                    ScheduleOptions each = so;
                    each.reduce_per_group = false;
                    EXPECT_EQ(s.str(), Schedule::build(pl, each).str());
                  }
                }
  EXPECT_EQ(cases, 2 * 2 * 3 * (3 * 3 - 2) * 2 * 3 * 2);
}

TEST(Schedule, ReducingOncePerGroupCutsTheGradientTraffic) {
  // Three ranks on a slow link, 4 micro-batches in one group, P on the GPU: reducing once per
  // group sends a quarter of the reduce-scatter bytes, and the step, bound by the comm lanes,
  // gets shorter. With the gradients in host RAM, a quarter of the gradient copies too.
  for (bool g_gpu : {true, false}) {
    SCOPED_TRACE(fmt::format("G gpu={}", g_gpu));
    Placement pl = make_placement(tiny(false), 3, Tier::gpu, Tier::cpu, 0, 3, 4, g_gpu);
    pl.shape.micro_batch_group = 4;
    HardwareProfile hw = test_profile();
    hw.comm_bytes_per_s = 2e8;
    const Schedule each = Schedule::build(pl, {4, 1});
    ScheduleOptions so{4, 1};
    so.reduce_per_group = true;
    const Schedule once = Schedule::build(pl, so);
    auto bytes = [](const Schedule& s, TaskKind k) {
      uint64_t b = 0;
      for (const Task& t : s.tasks)
        if (t.kind == k) b += t.bytes;
      return b;
    };
    EXPECT_EQ(4 * bytes(once, TaskKind::reduce_scatter), bytes(each, TaskKind::reduce_scatter));
    // Nor are the working gradients zeroed between a group's backwards.
    for (const Task& t : once.tasks)
      if (t.kind == TaskKind::reduce_scatter) {
        EXPECT_EQ(t.local_bytes, 0u) << t.id;
      }
    EXPECT_EQ(4 * bytes(once, TaskKind::grad_d2h), bytes(each, TaskKind::grad_d2h));
    const Prediction a = simulate(each, hw, 3);
    const Prediction b = simulate(once, hw, 3);
    const int comm = each.lane_index(Lane{LaneKind::comm, 0});
    ASSERT_GE(comm, 0);
    EXPECT_EQ(a.critical_lane, comm);
    EXPECT_LT(b.step_s, 0.75 * a.step_s) << a.step_s << " vs " << b.step_s;
    EXPECT_NE(once.summary().find("gradients reduced once per group"), std::string::npos);
    EXPECT_EQ(each.summary().find("once per group"), std::string::npos);
  }
}

TEST(Schedule, UpdatingDuringTheBackwardForEveryPlacement) {
  // Each unit whose optimizer is on the host is updated as soon as its gradients are final:
  // the same tasks as updating after the backward, every rule kept, and the update of every
  // unit but the last two in backward order emitted (so able to run) before the backward of
  // unit 0 ends, waiting for no other unit's gradient statistics.
  int early_adams = 0;
  const int built = for_every_placement([&](const Placement& base, int M, int d) {
    for (const int G : {1, 2}) {
      if (G > 1 && base.shape.model.tie_word_embeddings) continue;  // refused with groups
      SCOPED_TRACE(fmt::format("G={}", G));
      Placement pl = base;
      pl.shape.micro_batch_group = G;
      ScheduleOptions so{M, d};
      so.update_during_backward = true;
      const Schedule s = Schedule::build(pl, so);
      ASSERT_NO_THROW(s.validate());
      EXPECT_EQ(buffer_reuse_violation(s), "") << s.str();
      EXPECT_EQ(replicated_gradient_violation(s, pl), "") << s.str();
      const Expected e = expected_counts(pl, M, std::min(M, G));
      EXPECT_EQ(count_kinds(s), e.kinds);
      EXPECT_EQ(count_groups(s), e.groups);
      int last_backward0 = -1;
      for (const Task& t : s.tasks)
        if (t.kind == TaskKind::backward && t.unit == 0) last_backward0 = t.id;
      for (const Task& t : s.tasks) {
        if (t.kind != TaskKind::adam) continue;
        for (int x : t.deps)
          if (s.tasks[size_t(x)].kind == TaskKind::grad_stats) {
            EXPECT_EQ(s.tasks[size_t(x)].unit, t.unit) << "adam " << t.id;
          }
        if (pl.homes[size_t(t.unit)].optimizer != Tier::gpu && t.unit >= 2) {
          EXPECT_LT(t.id, last_backward0) << s.str();
          ++early_adams;
        }
      }
      const Prediction pred = simulate(s, test_profile(), 3);
      ASSERT_NO_THROW(check_timeline(s, pred.timeline));
      HardwareProfile hw = test_profile();
      hw.host_cpu_mixed = 1.0;
      const Prediction m = simulate(s, hw, 3);
      ASSERT_NO_THROW(check_timeline(s, m.timeline));
      EXPECT_EQ(cores_overlap(s, m.timeline), "") << s.str();
      // Evaluation has no optimizer: the setting changes nothing.
      ScheduleOptions eval = so;
      eval.forward_only = true;
      ScheduleOptions eval0 = eval;
      eval0.update_during_backward = false;
      EXPECT_EQ(Schedule::build(pl, eval).str(), Schedule::build(pl, eval0).str());
    }
  });
  EXPECT_EQ(built, 4 * 3 * 3 * 7 * 2 * 2 * 3);
  EXPECT_GT(early_adams, 0);
}

TEST(Schedule, UpdatingDuringTheBackwardHidesCpuAdamUnderIt) {
  // Parameters on the GPU, CPU Adam as long as the compute: updating after the backward, the
  // next step's forward overlaps the Adam but the backward does not (about Adam + backward a
  // step); during it, the backward overlaps the Adam of every unit but the embedding (about
  // forward + Adam). Eight blocks and a small vocabulary, so the blocks are most of the state.
  LlamaConfig c = tiny(false);
  c.num_hidden_layers = 8;
  c.vocab_size = 64;
  // Two micro-batches in one group: the backwards of both run after both forwards, so
  // updating during them overlaps Adam with the whole backward (without the group, only with
  // the last micro-batch's).
  Placement pl = make_placement(c, 1, Tier::gpu, Tier::cpu, 0, 3, 4, true);
  pl.shape.micro_batch_group = 2;
  HardwareProfile hw = test_profile();
  const Schedule late = Schedule::build(pl, {2, 1});
  ScheduleOptions so{2, 1};
  so.update_during_backward = true;
  const Schedule early = Schedule::build(pl, so);
  // Adam as long as the compute of a step: elements / rate = FLOPs / rate.
  double flops = 0;
  uint64_t elements = 0;
  for (const Task& t : late.tasks) {
    flops += t.flops;
    if (t.kind == TaskKind::adam) elements += t.elements;
  }
  hw.adam_elements_per_s = static_cast<double>(elements) / (flops / hw.gpu_flops);
  const Prediction a = simulate(late, hw, 3);
  const Prediction b = simulate(early, hw, 3);
  EXPECT_LT(b.step_s, 0.8 * a.step_s) << a.step_s << " vs " << b.step_s;
  EXPECT_NE(early.summary().find("updating each unit during the backward"), std::string::npos);
  EXPECT_EQ(late.summary().find("during the backward"), std::string::npos);
}

// ---- validate() ----

Schedule tiny_schedule() {
  return Schedule::build(make_placement(tiny(false), 2, Tier::cpu, Tier::cpu, 0), {2, 1});
}

int first_of(const Schedule& s, TaskKind kind) {
  for (const Task& t : s.tasks)
    if (t.kind == kind) return t.id;
  return -1;
}

TEST(ScheduleValidate, RejectsADependencyNotEarlier) {
  Schedule s = tiny_schedule();
  const int f = first_of(s, TaskKind::forward);
  s.tasks[static_cast<size_t>(f)].deps.push_back(f + 3);
  expect_error([&] { s.validate(); }, {fmt::format("task {} (gpu[0].compute forward u=0 m=0", f),
                                       fmt::format("dependency {} is not an earlier task", f + 3)});
}

TEST(ScheduleValidate, RejectsBrokenGroupsLanesAndIds) {
  Schedule s = tiny_schedule();
  const int g = first_of(s, TaskKind::gather);
  {
    Schedule b = s;  // both ranks' gathers on one lane
    b.tasks[static_cast<size_t>(g + 1)].lane = b.tasks[static_cast<size_t>(g)].lane;
    b.tasks[static_cast<size_t>(g + 1)].rank = 0;
    expect_error([&] { b.validate(); }, {fmt::format("task {} (", g + 1), "same lane"});
  }
  {
    Schedule b = s;  // a group split by another task
    std::swap(b.tasks[static_cast<size_t>(g + 1)], b.tasks[static_cast<size_t>(g + 2)]);
    b.tasks[static_cast<size_t>(g + 1)].id = g + 1;
    b.tasks[static_cast<size_t>(g + 2)].id = g + 2;
    b.tasks[static_cast<size_t>(g + 2)].deps.clear();
    b.tasks[static_cast<size_t>(g + 1)].deps.clear();
    expect_error([&] { b.validate(); }, {"not consecutive"});
  }
  {
    Schedule b = s;  // a forward on a copy lane
    const int f = first_of(b, TaskKind::forward);
    b.tasks[static_cast<size_t>(f)].lane = b.lane_index(Lane{LaneKind::h2d, 0});
    expect_error([&] { b.validate(); },
                 {fmt::format("task {} (", f), "a forward task cannot run on a h2d lane"});
  }
  {
    Schedule b = s;
    b.tasks.back().prev.push_back(static_cast<int>(b.tasks.size()) + 5);
    expect_error([&] { b.validate(); }, {"previous-step dependency", "is not a task id"});
  }
}

// ---- the simulator on hand-made schedules ----

Task make_task(int id, TaskKind kind, int lane, std::vector<int> deps = {}) {
  Task t;
  t.id = id;
  t.kind = kind;
  t.lane = lane;
  t.deps = std::move(deps);
  return t;
}

HardwareProfile unit_rates() {
  HardwareProfile p;
  p.gpu_flops = 1;
  p.h2d_bytes_per_s = 1;
  p.comm_bytes_per_s = 1;
  p.adam_elements_per_s = 1;
  return p;
}

// Four units: h2d (2 s) then forward (3 s) each, forward(i) after h2d(i) and forward(i - 1).
Schedule pipeline(bool prev_across_steps) {
  Schedule s;
  s.lanes = {Lane{LaneKind::compute, 0}, Lane{LaneKind::h2d, 0}};
  for (int i = 0; i < 4; ++i) {
    Task h = make_task(static_cast<int>(s.tasks.size()), TaskKind::param_h2d, 1);
    h.rank = 0;
    h.unit = i;
    h.bytes = 2;
    s.tasks.push_back(h);
    std::vector<int> deps = {h.id};
    if (i > 0) deps.push_back(h.id - 1);
    Task f = make_task(h.id + 1, TaskKind::forward, 0, deps);
    f.rank = 0;
    f.unit = i;
    f.flops = 3;
    s.tasks.push_back(f);
  }
  if (prev_across_steps) s.tasks[0].prev = {7};
  s.units = 4;
  return s;
}

TEST(Simulator, TwoLanePipelineByHand) {
  const Schedule s = pipeline(false);
  ASSERT_NO_THROW(s.validate());
  const Prediction one = simulate(s, unit_rates(), 1);
  EXPECT_DOUBLE_EQ(one.step_s, 14.0);  // 2 + 4 x 3
  // Steady state: the next step's copies run under this step's compute; the compute lane
  // alone sets the pace.
  const Prediction p = simulate(s, unit_rates(), 3);
  EXPECT_DOUBLE_EQ(p.step_s, 12.0);
  EXPECT_EQ(p.critical_lane, 0);
  EXPECT_DOUBLE_EQ(p.lanes[0].busy_s, 12.0);
  EXPECT_DOUBLE_EQ(p.lanes[1].busy_s, 8.0);
  EXPECT_DOUBLE_EQ(p.overlap, 1.0);
  EXPECT_EQ(p.lanes[1].lane, "gpu[0].h2d");
  // The reported step (2) begins with its first copy at 16 s: 8 (step 0) + 8 (step 1).
  EXPECT_DOUBLE_EQ(p.start_s[0], 0.0);
  EXPECT_DOUBLE_EQ(p.start_s[1], 26.0 - 16.0);  // forward(0) of step 2 starts when step 1's ends
  ASSERT_NO_THROW(check_timeline(s, p.timeline));
  // A `prev` from the first copy to the last forward serialises the steps: 14 s each.
  const Prediction serial = simulate(pipeline(true), unit_rates(), 3);
  EXPECT_DOUBLE_EQ(serial.step_s, 14.0);
  ASSERT_NO_THROW(check_timeline(pipeline(true), serial.timeline));
  // A latency is added to every task.
  HardwareProfile lat = unit_rates();
  lat.task_latency_s = 0.5;
  EXPECT_DOUBLE_EQ(simulate(s, lat, 1).step_s, 2.5 + 4 * 3.5);
}

TEST(Simulator, GroupStartsWhenAllMembersAreReady) {
  Schedule s;
  s.ranks = 2;
  s.lanes = {Lane{LaneKind::compute, 1}, Lane{LaneKind::h2d, 0}, Lane{LaneKind::comm, 0},
             Lane{LaneKind::comm, 1}};
  s.lanes[0] = Lane{LaneKind::compute, 1};
  Task h = make_task(0, TaskKind::param_h2d, 1);
  h.rank = 0;
  h.bytes = 5;
  Task g0 = make_task(1, TaskKind::gather, 2, {0});
  g0.rank = 0;
  g0.group = 0;
  g0.bytes = 2;
  Task g1 = make_task(2, TaskKind::gather, 3);
  g1.rank = 1;
  g1.group = 0;
  g1.bytes = 2;
  Task f = make_task(3, TaskKind::forward, 0, {2});
  f.rank = 1;
  f.flops = 1;
  s.tasks = {h, g0, g1, f};
  ASSERT_NO_THROW(s.validate());
  const Prediction p = simulate(s, unit_rates(), 1);
  EXPECT_DOUBLE_EQ(p.start_s[1], 5.0);
  EXPECT_DOUBLE_EQ(p.start_s[2], 5.0);  // rank 1 was ready at 0, but the call waits for rank 0
  EXPECT_DOUBLE_EQ(p.end_s[2], 7.0);
  EXPECT_DOUBLE_EQ(p.start_s[3], 7.0);
  EXPECT_DOUBLE_EQ(p.step_s, 8.0);
  EXPECT_EQ(p.critical_lane, 1);
}

// The optimizer–forward overlap of DESIGN §3.4 in miniature: forward(0), forward(1), then
// adam(0), adam(1) after both; the next step's forward(u) waits for adam(u) only.
Schedule optimizer_overlap(bool per_unit) {
  Schedule s;
  s.lanes = {Lane{LaneKind::compute, 0}, Lane{LaneKind::cpu_adam, -1}};
  for (int u = 0; u < 2; ++u) {
    Task f = make_task(u, TaskKind::forward, 0, u ? std::vector<int>{0} : std::vector<int>{});
    f.rank = 0;
    f.unit = u;
    f.flops = 1;
    f.prev = {per_unit ? 2 + u : 3};
    s.tasks.push_back(f);
  }
  for (int u = 0; u < 2; ++u) {
    Task a = make_task(2 + u, TaskKind::adam, 1, {0, 1});
    a.unit = u;
    a.elements = 2;
    s.tasks.push_back(a);
  }
  s.units = 2;
  return s;
}

TEST(Simulator, PrevDependenciesGiveTheOptimizerForwardOverlap) {
  // Per unit: step 1 runs forward(0) 4-5, forward(1) 6-7, adam 7-9, 9-11: 5 s a step.
  const Prediction overlap = simulate(optimizer_overlap(true), unit_rates(), 3);
  EXPECT_DOUBLE_EQ(overlap.step_s, 5.0);
  // Waiting for the whole optimizer: 2 + 4 = 6 s a step.
  const Prediction serial = simulate(optimizer_overlap(false), unit_rates(), 3);
  EXPECT_DOUBLE_EQ(serial.step_s, 6.0);
  EXPECT_DOUBLE_EQ(overlap.lanes[1].busy_s, 4.0);
  EXPECT_DOUBLE_EQ(overlap.overlap, 4.0 / 5.0);
  ASSERT_NO_THROW(check_timeline(optimizer_overlap(true), overlap.timeline));
  // A step in the timeline: step_stats gives the same figures.
  const StepStats st = step_stats(optimizer_overlap(true), overlap.timeline, 1);
  EXPECT_DOUBLE_EQ(st.step_s, 5.0);
  EXPECT_EQ(st.busiest_lane, 1);
}

// An optional profile key, with `p` holding a value for it that is not the default: read
// back as written, `absent` when the key is left out, and each of `bad` refused with an error
// naming the key, the value and `why`.
void expect_optional_key(const HardwareProfile& p, const std::string& key,
                         double HardwareProfile::*member, double absent,
                         std::initializer_list<nlohmann::json> bad, const std::string& why) {
  SCOPED_TRACE(key);
  nlohmann::json j = nlohmann::json::parse(p.to_json());
  EXPECT_EQ(HardwareProfile::from_json_text(j.dump(), "m").*member, p.*member);
  j.erase(key);
  EXPECT_EQ(HardwareProfile::from_json_text(j.dump(), "m").*member, absent);
  for (const nlohmann::json& b : bad) {
    j[key] = b;
    expect_error([&] { HardwareProfile::from_json_text(j.dump(), "m"); },
                 {"/" + key, b.dump(), why});
  }
}

// The NVMe lanes share the drives. Reads of 4 s and 2 s (one after the other on nvme.read) and
// a write of 4 s, all ready at 0, in the order read, write, read; by hand for each nvme_mixed:
//   1: one direction at a time; the write takes the first gap that holds all of it, 4-8, and
//      the second read the next, 8-10.
//   2: each task holds the drives for half its length; the read holds [0, 2), the write its
//      first free 2 s, [2, 4), so it runs 0-4 beside the read, and the second read (4-6)
//      holds [4, 5).
//   1.6: the read holds [0, 2.5); the write needs 2.5 s free within its span, which [t, t + 4)
//      has from t = 1 (free 2.5-5), and takes [2.5, 5); the second read, ready at 4, needs
//      1.25 s free within [t, t + 2): [5, 6.25) from t = 4.25.
TEST(Simulator, NvmeLanesShareTheDrivesAsTheProfileSays) {
  Schedule s;
  s.lanes = {Lane{LaneKind::nvme_read, -1}, Lane{LaneKind::nvme_write, -1}};
  Task r0 = make_task(0, TaskKind::param_read, 0);
  r0.bytes = 4;
  Task w = make_task(1, TaskKind::optim_write, 1);
  w.bytes = 4;
  Task r1 = make_task(2, TaskKind::optim_read, 0);
  r1.bytes = 2;
  for (Task* t : {&r0, &w, &r1}) t->unit = 0;
  s.tasks = {r0, w, r1};
  s.units = 1;
  ASSERT_NO_THROW(s.validate());
  HardwareProfile p;
  p.nvme_read_bytes_per_s = p.nvme_write_bytes_per_s = 1;
  struct Case {
    double mixed, w_start, r1_start, step;
  };
  for (const Case& c : {Case{1, 4, 8, 10}, Case{2, 0, 4, 6}, Case{1.6, 1, 4.25, 6.25}}) {
    SCOPED_TRACE(c.mixed);
    p.nvme_mixed = c.mixed;
    const Prediction one = simulate(s, p, 1);
    EXPECT_DOUBLE_EQ(one.start_s[0], 0.0);
    EXPECT_NEAR(one.start_s[1], c.w_start, 1e-12);
    EXPECT_NEAR(one.end_s[1], c.w_start + 4, 1e-12);
    EXPECT_NEAR(one.start_s[2], c.r1_start, 1e-12);
    EXPECT_NEAR(one.step_s, c.step, 1e-12);
    ASSERT_NO_THROW(check_timeline(s, one.timeline));
  }
  // The key is optional in a profile, and checked.
  p.nvme_mixed = 1.5;
  expect_optional_key(p, "nvme_mixed", &HardwareProfile::nvme_mixed, 1.0,
                      {nlohmann::json(0.5), nlohmann::json(2.5), nlohmann::json("2")}, "from 1");
}

// On host devices the lanes share the cores. A forward of 3 s (gpu[0].compute) and an Adam of
// 2 s (cpu.adam), both ready at 0, in that order; by hand for each host_cpu_mixed:
//   0: a GPU: they run side by side, Adam 0-2; the step is 3 s.
//   1: one at a time: Adam waits for the forward, 3-5.
//   2: each holds the cores for half its length: the forward [0, 1.5); Adam needs 1 s free
//      within [t, t + 2), which it has from t = 0.5, and runs 0.5-2.5.
// Then a gather of two ranks (one call, 1 s) on the comm lanes, ready at 0: it takes the cores
// once, for 1 s with mixed 1 (5-6, after Adam) and for 0.5 s within its span with 2 (the cores
// are held until 2.5, so 2-3).
TEST(Simulator, HostCoresAreSharedAsTheProfileSays) {
  Schedule s;
  s.ranks = 2;
  s.lanes = {Lane{LaneKind::compute, 0}, Lane{LaneKind::comm, 0}, Lane{LaneKind::comm, 1},
             Lane{LaneKind::cpu_adam, -1}};
  Task f = make_task(0, TaskKind::forward, 0);
  f.rank = 0;
  f.flops = 3;
  Task a = make_task(1, TaskKind::adam, 3);
  a.elements = 2;
  Task g0 = make_task(2, TaskKind::gather, 1);
  Task g1 = make_task(3, TaskKind::gather, 2);
  for (Task* t : {&g0, &g1}) {
    t->rank = t == &g0 ? 0 : 1;
    t->group = 0;
    t->bytes = 1;
  }
  for (Task* t : {&f, &a, &g0, &g1}) t->unit = 0;
  s.tasks = {f, a, g0, g1};
  s.units = 1;
  ASSERT_NO_THROW(s.validate());
  struct Case {
    double mixed, adam_start, gather_start, step;
  };
  for (const Case& c : {Case{0, 0, 0, 3}, Case{1, 3, 5, 6}, Case{2, 0.5, 2, 3}}) {
    SCOPED_TRACE(c.mixed);
    HardwareProfile p = unit_rates();
    p.host_cpu_mixed = c.mixed;
    const Prediction one = simulate(s, p, 1);
    EXPECT_DOUBLE_EQ(one.start_s[0], 0.0);
    EXPECT_NEAR(one.start_s[1], c.adam_start, 1e-12);
    EXPECT_NEAR(one.start_s[2], c.gather_start, 1e-12);
    EXPECT_NEAR(one.start_s[3], c.gather_start, 1e-12);  // the group starts together
    EXPECT_NEAR(one.step_s, c.step, 1e-12);
    ASSERT_NO_THROW(check_timeline(s, one.timeline));
  }
  // The key is optional in a profile (0 without it), and checked.
  HardwareProfile p = unit_rates();
  p.host_cpu_mixed = 1.25;
  expect_optional_key(
      p, "host_cpu_mixed", &HardwareProfile::host_cpu_mixed, 0.0,
      {nlohmann::json(0.5), nlohmann::json(2.5), nlohmann::json(-1), nlohmann::json("1")},
      "neither 0");
}

// A collective of one rank is a copy within the device: its bytes over
// device_copy_bytes_per_s, or free (the task latency) when the profile has no such rate; with
// two ranks it is the link's.
TEST(Simulator, OneRankCollectivesAreDeviceCopies) {
  Task g = make_task(0, TaskKind::gather, 0);
  g.bytes = 8;
  const Lane comm{LaneKind::comm, 0};
  HardwareProfile p;
  p.comm_bytes_per_s = 1;
  p.task_latency_s = 0.5;
  EXPECT_DOUBLE_EQ(task_seconds(g, comm, 1, p), 0.5);
  p.device_copy_bytes_per_s = 4;
  EXPECT_DOUBLE_EQ(task_seconds(g, comm, 1, p), 2.5);
  EXPECT_DOUBLE_EQ(task_seconds(g, comm, 2, p), 8.5);
  g.kind = TaskKind::reduce_scatter;
  EXPECT_DOUBLE_EQ(task_seconds(g, comm, 1, p), 2.5);
  p.comm_bytes_per_s = 0;
  expect_error([&] { task_seconds(g, comm, 2, p); }, {"comm_bytes_per_s is 0", "reduce_scatter"});
  // Optional in the JSON, 0 without it, and checked as a rate.
  EXPECT_EQ(p.device_copy_bytes_per_s, 4.0);
  expect_optional_key(p, "device_copy_bytes_per_s", &HardwareProfile::device_copy_bytes_per_s, 0.0,
                      {nlohmann::json(-2)}, "not a rate");
}

// A reduce-scatter of several ranks goes at reduce_bytes_per_s where the profile has it (it adds
// as well as moves, and runs slower than the all-gather), else at the all-gather's rate; the
// all-gather never takes it; one rank's is still a device copy. Optional in the JSON.
TEST(Simulator, ReduceScattersHaveTheirOwnRate) {
  Task rs = make_task(0, TaskKind::reduce_scatter, 0);
  rs.bytes = 12;
  rs.local_bytes = 4;
  Task g = rs;
  g.kind = TaskKind::gather;
  const Lane comm{LaneKind::comm, 0};
  HardwareProfile p;
  p.comm_bytes_per_s = 4;
  p.device_copy_bytes_per_s = 2;
  p.task_latency_s = 0.25;
  EXPECT_DOUBLE_EQ(task_seconds(rs, comm, 2, p), 3 + 2 + 0.25);  // none of its own
  p.reduce_bytes_per_s = 1;
  EXPECT_DOUBLE_EQ(task_seconds(rs, comm, 2, p), 12 + 2 + 0.25);
  EXPECT_DOUBLE_EQ(task_seconds(rs, comm, 3, p), 12 + 2 + 0.25);
  EXPECT_DOUBLE_EQ(task_seconds(g, comm, 2, p), 3 + 2 + 0.25);
  EXPECT_DOUBLE_EQ(task_seconds(rs, comm, 1, p), 6 + 2 + 0.25);  // a copy within the device
  // With its own rate the all-gather's is not needed for it, and without either it is named.
  p.comm_bytes_per_s = 0;
  EXPECT_DOUBLE_EQ(task_seconds(rs, comm, 2, p), 12 + 2 + 0.25);
  expect_error([&] { task_seconds(g, comm, 2, p); }, {"comm_bytes_per_s is 0", "gather"});
  p.reduce_bytes_per_s = 0;
  expect_error([&] { task_seconds(rs, comm, 2, p); }, {"comm_bytes_per_s is 0", "reduce_scatter"});
  p.comm_bytes_per_s = 4;
  p.reduce_bytes_per_s = 1;
  expect_optional_key(p, "reduce_bytes_per_s", &HardwareProfile::reduce_bytes_per_s, 0.0,
                      {nlohmann::json(-1)}, "not a rate");
}

// An NVMe task is one swap-store call: its direction's fixed cost plus its bytes over the rate
// (the line strata tune fits through two transfer sizes); a task moving nothing pays neither.
// Optional in the JSON, checked as a rate and refused past a second.
TEST(Simulator, NvmeTasksPayAPerCallLatency) {
  Task rd = make_task(0, TaskKind::optim_read, 0);
  rd.bytes = 8;
  const Lane read{LaneKind::nvme_read, -1}, write{LaneKind::nvme_write, -1};
  HardwareProfile p;
  p.nvme_read_bytes_per_s = 4;
  p.nvme_write_bytes_per_s = 2;
  p.task_latency_s = 0.25;
  EXPECT_DOUBLE_EQ(task_seconds(rd, read, 1, p), 2 + 0.25);  // without latencies: as before
  p.nvme_read_latency_s = 0.5;
  p.nvme_write_latency_s = 0.125;
  EXPECT_DOUBLE_EQ(task_seconds(rd, read, 1, p), 2 + 0.5 + 0.25);
  rd.kind = TaskKind::param_read;
  EXPECT_DOUBLE_EQ(task_seconds(rd, read, 1, p), 2 + 0.5 + 0.25);
  Task wr = rd;
  wr.kind = TaskKind::optim_write;
  EXPECT_DOUBLE_EQ(task_seconds(wr, write, 1, p), 4 + 0.125 + 0.25);
  wr.kind = TaskKind::param_write;
  EXPECT_DOUBLE_EQ(task_seconds(wr, write, 1, p), 4 + 0.125 + 0.25);
  wr.bytes = 0;
  EXPECT_DOUBLE_EQ(task_seconds(wr, write, 1, p), 0.25);
  expect_optional_key(p, "nvme_read_latency_s", &HardwareProfile::nvme_read_latency_s, 0.0,
                      {nlohmann::json(-1)}, "not a rate");
  expect_optional_key(p, "nvme_write_latency_s", &HardwareProfile::nvme_write_latency_s, 0.0,
                      {nlohmann::json(3)}, "not a per-call latency");
}

// The statistics pass on a device: gpu_stats_elements_per_s where the profile has it, else
// bounded by gpu_adam_elements_per_s; on the CPU, stats_elements_per_s. Optional in the JSON.
TEST(Simulator, DeviceGradStatsHaveTheirOwnRate) {
  Task t = make_task(0, TaskKind::grad_stats, 0);
  t.elements = 12;
  const Lane compute{LaneKind::compute, 0}, cpu{LaneKind::cpu_adam, -1};
  HardwareProfile p;
  p.gpu_adam_elements_per_s = 3;
  p.stats_elements_per_s = 6;
  p.task_latency_s = 0.5;
  EXPECT_DOUBLE_EQ(task_seconds(t, compute, 1, p), 4.5);  // no own rate: Adam's bounds it
  p.gpu_stats_elements_per_s = 24;
  EXPECT_DOUBLE_EQ(task_seconds(t, compute, 1, p), 1.0);
  EXPECT_DOUBLE_EQ(task_seconds(t, cpu, 1, p), 2.5);
  t.kind = TaskKind::adam;  // Adam itself keeps Adam's rate
  EXPECT_DOUBLE_EQ(task_seconds(t, compute, 1, p), 4.5);
  expect_optional_key(p, "gpu_stats_elements_per_s", &HardwareProfile::gpu_stats_elements_per_s,
                      0.0, {nlohmann::json("fast")}, "expected a number");
}

// What a one-rank schedule's collectives copy within the device (schedule.h, Task::bytes).
TEST(Schedule, OneRankCollectivesCountTheDeviceCopies) {
  for (const auto& [o, g_gpu] :
       {std::pair{Tier::gpu, true}, std::pair{Tier::cpu, false}, std::pair{Tier::cpu, true}}) {
    SCOPED_TRACE(fmt::format("O {} G {}", tier_name(o), g_gpu ? "gpu" : "cpu"));
    const Placement pl = make_placement(tiny(false), 1, Tier::gpu, o, 0, 2, 4, g_gpu);
    const uint64_t gs = dtype_size(pl.shape.grad_dtype);
    const Schedule s = Schedule::build(pl, {1, 1});
    int for_backward = 0;
    for (const Task& t : s.tasks) {
      const UnitPartition& up = pl.partition.units[size_t(t.unit)];
      if (t.kind == TaskKind::gather) {
        ASSERT_FALSE(up.replicated);
        EXPECT_EQ(t.bytes, 0u);  // the unit is used where it lies
        EXPECT_TRUE(t.local_bytes == 0 || t.local_bytes == up.padded * gs) << t.local_bytes;
        for_backward += t.local_bytes == up.padded * gs;
      } else if (t.kind == TaskKind::reduce_scatter) {
        // Out to the host: nothing (the grad_d2h reads the working gradients); into a resident
        // shard: an add in place (a copy and a half of traffic).
        EXPECT_EQ(t.bytes, g_gpu ? up.padded * gs * 3 / 2 : 0) << up.name;
      } else if (t.kind == TaskKind::grad_d2h) {
        EXPECT_EQ(t.slot >= 0, !up.replicated) << up.name;  // from the working buffer
      }
    }
    EXPECT_EQ(for_backward, s.units);  // every unit is gathered once for its backward
    ScheduleOptions eval;
    eval.forward_only = true;
    for (const Task& t : Schedule::build(pl, eval).tasks) {
      if (t.kind == TaskKind::gather) {
        EXPECT_EQ(t.bytes, 0u);
      }
    }
  }
}

TEST(Simulator, MissingRateIsAnErrorNamingTheField) {
  const Schedule s =
      Schedule::build(make_placement(tiny(false), 1, Tier::nvme, Tier::cpu, 0), {1, 1});
  HardwareProfile p = test_profile();
  p.nvme_read_bytes_per_s = 0;
  expect_error([&] { simulate(s, p); }, {"nvme_read_bytes_per_s is 0", "param_read"});
  expect_error([&] { simulate(s, test_profile(), 0); }, {"0 steps"});
}

// ---- check_timeline ----

TEST(Timeline, RejectsOverlapEarlyStartAndMissingTasks) {
  const Schedule s = tiny_schedule();
  const Prediction p = simulate(s, test_profile(), 2);
  ASSERT_NO_THROW(check_timeline(s, p.timeline));
  auto span_of = [](Timeline& tl, int task, int step) -> TaskSpan& {
    for (TaskSpan& sp : tl.spans)
      if (sp.task == task && sp.step == step) return sp;
    throw std::runtime_error("no span");
  };
  const int f = first_of(s, TaskKind::forward);
  {
    Timeline tl = p.timeline;  // forward(0) started before its gather ended
    TaskSpan& sp = span_of(tl, f, 1);
    const double gather_end = span_of(tl, s.tasks[static_cast<size_t>(f)].deps[0], 1).end_s;
    const double len = sp.end_s - sp.start_s;
    sp.start_s = gather_end - 1e-3;
    sp.end_s = sp.start_s + len;
    expect_error([&] { check_timeline(s, tl); },
                 {fmt::format("task {} (gpu[0].compute forward u=0 m=0) of step 1", f),
                  "before its dependency"});
  }
  {
    Timeline tl = p.timeline;  // a task that never ran
    tl.spans.erase(tl.spans.begin() + 7);
    const TaskSpan gone = p.timeline.spans[7];
    expect_error([&] { check_timeline(s, tl); }, {fmt::format("task {} (", gone.task),
                                                  fmt::format("never ran in step {}", gone.step)});
  }
  {
    Timeline tl = p.timeline;  // a task that ran twice
    tl.spans.push_back(tl.spans[3]);
    expect_error([&] { check_timeline(s, tl); }, {"ran twice"});
  }
}

TEST(Timeline, RejectsTasksOverlappingOnALane) {
  // The pipeline's copies have no dependencies: h2d(1) moved from 2-4 s to 1-3 s only
  // overlaps h2d(0) (0-2 s) on the lane, and forward(1) (5-8 s) still starts after it.
  const Schedule s = pipeline(false);
  Timeline tl = simulate(s, unit_rates(), 1).timeline;
  ASSERT_NO_THROW(check_timeline(s, tl));
  for (TaskSpan& sp : tl.spans)
    if (sp.task == 2) {
      EXPECT_DOUBLE_EQ(sp.start_s, 2.0);
      sp.start_s = 1.0;
      sp.end_s = 3.0;
    }
  expect_error([&] { check_timeline(s, tl); },
               {"task 2 (gpu[0].h2d param_h2d u=1) of step 0 started at 1000.000000 ms",
                "task 0 (gpu[0].h2d param_h2d u=0) of step 0", "a lane runs one task at a time"});
}

TEST(Timeline, TraceJsonHasOneTrackPerLaneAndEveryTask) {
  const Schedule s = tiny_schedule();
  const Prediction p = simulate(s, test_profile(), 2);
  const nlohmann::json j = nlohmann::json::parse(trace_json(s, p.timeline));
  EXPECT_EQ(j.at("displayTimeUnit"), "ms");
  std::map<int, std::string> names;
  size_t complete = 0;
  for (const auto& e : j.at("traceEvents")) {
    EXPECT_EQ(e.at("pid"), 1);
    if (e.at("ph") == "M" && e.at("name") == "thread_name")
      names[e.at("tid").get<int>()] = e.at("args").at("name").get<std::string>();
    if (e.at("ph") != "X") continue;
    ++complete;
    const int task = e.at("args").at("task").get<int>();
    const Task& t = s.tasks[static_cast<size_t>(task)];
    EXPECT_EQ(e.at("tid").get<int>(), t.lane + 1);
    EXPECT_EQ(e.at("args").at("unit").get<int>(), t.unit);
    EXPECT_EQ(e.at("args").at("bytes").get<uint64_t>(), t.bytes);
    EXPECT_GE(e.at("dur").get<double>(), 0);
  }
  EXPECT_EQ(complete, p.timeline.spans.size());
  ASSERT_EQ(names.size(), s.lanes.size());
  for (size_t l = 0; l < s.lanes.size(); ++l)
    EXPECT_EQ(names[static_cast<int>(l) + 1], s.lanes[l].name());
  // The first forward's event is at its simulated start, in microseconds.
  const std::string path = testing::TempDir() + "strata_trace_test.json";
  write_trace(path, s, p.timeline);
  std::ifstream in(path);
  EXPECT_EQ(nlohmann::json::parse(in), j);
  std::filesystem::remove(path);
  expect_error([&] { write_trace("/nonexistent-dir/x/trace.json", s, p.timeline); },
               {"/nonexistent-dir/x/trace.json"});
}

// ---- hardware profiles ----

TEST(HardwareProfile, JsonRoundTripAndErrorsNameThePath) {
  HardwareProfile p = test_profile();
  p.name = "box";
  p.gpu_flops = 1.0 / 3.0 * 1e14;
  p.task_latency_s = 0;
  const HardwareProfile q = HardwareProfile::from_json_text(p.to_json(), "mem");
  EXPECT_EQ(q.name, "box");
  EXPECT_EQ(q.gpu_flops, p.gpu_flops);
  EXPECT_EQ(q.h2d_bytes_per_s, p.h2d_bytes_per_s);
  EXPECT_EQ(q.d2h_bytes_per_s, p.d2h_bytes_per_s);
  EXPECT_EQ(q.comm_bytes_per_s, p.comm_bytes_per_s);
  EXPECT_EQ(q.adam_elements_per_s, p.adam_elements_per_s);
  EXPECT_EQ(q.stats_elements_per_s, p.stats_elements_per_s);
  EXPECT_EQ(q.gpu_adam_elements_per_s, p.gpu_adam_elements_per_s);
  EXPECT_EQ(q.nvme_read_bytes_per_s, p.nvme_read_bytes_per_s);
  EXPECT_EQ(q.nvme_write_bytes_per_s, p.nvme_write_bytes_per_s);
  EXPECT_EQ(q.task_latency_s, p.task_latency_s);
  EXPECT_EQ(q.to_json(), p.to_json());

  const std::string path = testing::TempDir() + "strata_profile_test.json";
  auto with = [&](const std::string& key, const nlohmann::json& value) {
    nlohmann::json j = nlohmann::json::parse(p.to_json());
    if (value.is_null())
      j.erase(key);
    else
      j[key] = value;
    std::ofstream(path) << j.dump();
  };
  with("gpu_flops", nullptr);
  expect_error([&] { HardwareProfile::load(path); }, {path, "/gpu_flops", "missing"});
  with("h2d_bytes_per_s", -1.0);
  expect_error([&] { HardwareProfile::load(path); }, {path, "/h2d_bytes_per_s", "-1"});
  with("nvme_write_bytes_per_s", "fast");
  expect_error([&] { HardwareProfile::load(path); },
               {path, "/nvme_write_bytes_per_s", "expected a number", "\"fast\""});
  with("nvme_speed", 1.0);
  expect_error([&] { HardwareProfile::load(path); }, {path, "/nvme_speed", "unknown key"});
  with("gpu_flops", 2e14);
  EXPECT_EQ(HardwareProfile::load(path).gpu_flops, 2e14);
  std::ofstream(path) << "{\"gpu_flops\": ";
  expect_error([&] { HardwareProfile::load(path); }, {path, "not valid JSON"});
  std::filesystem::remove(path);
  expect_error([&] { HardwareProfile::load(path); }, {path, "cannot open"});
}

TEST(HardwareProfile, NotesAndNvmePathsRoundTripAndAreCheckedStrictly) {
  HardwareProfile p = test_profile();
  // Without them the JSON has neither key (profiles written before them read the same).
  EXPECT_FALSE(nlohmann::json::parse(p.to_json()).contains("notes"));
  EXPECT_FALSE(nlohmann::json::parse(p.to_json()).contains("nvme"));
  p.notes["gpu_flops"] = "measured: forward + backward";
  p.notes["comm_bytes_per_s"] = "absent: one device";
  p.nvme_block_size = 1 << 20;
  p.nvme_queue_depth = 8;
  p.nvme_paths = {{"/mnt/a", 3e9, 2e9, true}, {"/mnt/b", 1.5e9, 1e9, false}};
  const HardwareProfile q = HardwareProfile::from_json_text(p.to_json(), "mem");
  EXPECT_EQ(q.notes, p.notes);
  EXPECT_EQ(q.nvme_block_size, 1u << 20);
  EXPECT_EQ(q.nvme_queue_depth, 8u);
  ASSERT_EQ(q.nvme_paths.size(), 2u);
  EXPECT_EQ(q.nvme_paths[1].path, "/mnt/b");
  EXPECT_EQ(q.nvme_paths[1].read_bytes_per_s, 1.5e9);
  EXPECT_EQ(q.nvme_paths[1].write_bytes_per_s, 1e9);
  EXPECT_FALSE(q.nvme_paths[1].direct);
  EXPECT_TRUE(q.nvme_paths[0].direct);
  EXPECT_EQ(q.to_json(), p.to_json());

  auto with = [&](const std::string& pointer, const nlohmann::json& value) {
    nlohmann::json j = nlohmann::json::parse(p.to_json());
    j[nlohmann::json::json_pointer(pointer)] = value;
    return j.dump();
  };
  auto load = [](const std::string& text) { return HardwareProfile::from_json_text(text, "f"); };
  expect_error([&] { load(with("/notes/fast", "x")); }, {"f", "/notes/fast", "not a rate"});
  expect_error([&] { load(with("/notes/gpu_flops", 3)); },
               {"/notes/gpu_flops", "expected a string"});
  expect_error([&] { load(with("/nvme/speed", 1)); }, {"/nvme/speed", "unknown key"});
  expect_error([&] { load(with("/nvme/queue_depth", -1)); }, {"/nvme/queue_depth", "-1"});
  expect_error([&] { load(with("/nvme/paths/0/read_bytes_per_s", "x")); },
               {"/nvme/paths/0/read_bytes_per_s", "expected a number"});
  expect_error([&] { load(with("/nvme/paths/1/direct", 1)); },
               {"/nvme/paths/1/direct", "expected a boolean"});
  expect_error([&] { load(with("/nvme/paths/1/drive", 1)); },
               {"/nvme/paths/1/drive", "unknown key"});
  nlohmann::json missing = nlohmann::json::parse(p.to_json());
  missing["nvme"]["paths"][0].erase("path");
  expect_error([&] { load(missing.dump()); }, {"/nvme/paths/0/path", "missing"});
}

// ---- llama2-70b: what `strata plan` runs ----

TEST(Schedule, Llama70bBuildsAndSimulatesWellUnderASecond) {
  const LlamaConfig c = *find_preset("llama2-70b");
  Placement pl = make_placement(c, 4, Tier::nvme, Tier::nvme, 100000, 2, 5);
  pl.shape.micro_batch = 1;
  pl.shape.seq_len = 4096;
  HardwareProfile hw = test_profile();
  hw.gpu_flops = 4e14;
  hw.h2d_bytes_per_s = 2.5e10;
  hw.d2h_bytes_per_s = 2.5e10;
  hw.comm_bytes_per_s = 1e11;
  hw.adam_elements_per_s = 2e9;
  hw.stats_elements_per_s = 1e10;
  hw.nvme_read_bytes_per_s = 1.2e10;
  hw.nvme_write_bytes_per_s = 8e9;
  const auto t0 = std::chrono::steady_clock::now();
  const Schedule s = Schedule::build(pl, {8, 1});
  const Prediction p = simulate(s, hw);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(took, 1.0);
  ASSERT_NO_THROW(s.validate());
  const Expected e = expected_counts(pl, 8);
  EXPECT_EQ(count_kinds(s), e.kinds);
  const std::string sum = s.summary();
  EXPECT_NE(sum.find("82 units, 4 ranks, 8 micro-batches"), std::string::npos) << sum;
  EXPECT_NE(sum.find("gpu[3].comm"), std::string::npos) << sum;
  // Sane figures: the step is at least the busiest lane's work and the NVMe reads of the
  // optimizer alone (12 bytes for each of ~69e9 parameters).
  uint64_t read = 0;
  for (const Task& t : s.tasks)
    if (t.kind == TaskKind::optim_read) read += t.bytes;
  EXPECT_GT(read, uint64_t{12} * 68'000'000'000);
  EXPECT_GE(p.step_s, static_cast<double>(read) / hw.nvme_read_bytes_per_s);
  EXPECT_LE(p.overlap, 1.0 + 1e-9);
  EXPECT_EQ(s.lanes[static_cast<size_t>(p.critical_lane)].name(), "nvme.read") << sum;
  std::printf(
      "%s  predicted step %.1f s, critical lane %s, overlap %.2f, built and simulated in %.0f ms\n",
      sum.c_str(), p.step_s, s.lanes[static_cast<size_t>(p.critical_lane)].name().c_str(),
      p.overlap, took * 1e3);
}

}  // namespace
}  // namespace strata
