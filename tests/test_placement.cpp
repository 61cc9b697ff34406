// test_placement.cpp: homes for every request, needs() against what ZeroModel, LlamaModel and
// ZeroRunner really allocate on host devices, check()'s refusal table, the automatic
// placement's spill order, and llama2-70b's figures by hand.
#include "core/bytes.h"
#include "core/system.h"
#include "host/host_device.h"
#include "partition/communicator.h"
#include "partition/zero.h"
#include "testing.h"
#include "tier/placement.h"

#include <gtest/gtest.h>

namespace strata {
namespace {

using test::expect_error;

RunShape tiny_shape(int ranks, uint64_t threshold = 0) {
  RunShape s;
  s.model = *find_preset("tiny");
  s.ranks = ranks;
  s.micro_batch = 2;
  s.seq_len = 32;
  s.persistence_threshold = threshold;
  return s;
}

TierBudgets roomy() {
  TierBudgets b;
  b.gpu_memory = 1ull << 40;
  b.cpu_memory = 1ull << 40;
  b.nvme_free = 1ull << 40;
  return b;
}

OffloadRequest request(Tier param, Tier optimizer, GradHome grads = GradHome::automatic) {
  OffloadRequest r;
  r.param = param;
  r.optimizer = optimizer;
  r.grads = grads;
  r.nvme_paths = {"/nvme0", "/nvme1"};
  return r;
}

uint64_t round256(uint64_t n) {
  return n == 0 ? 0 : (n + 255) / 256 * 256;
}

TEST(Placement, TierAndKindNames) {
  EXPECT_EQ(parse_tier("none"), Tier::gpu);
  EXPECT_EQ(parse_tier("gpu"), Tier::gpu);
  EXPECT_EQ(parse_tier("cpu"), Tier::cpu);
  EXPECT_EQ(parse_tier("nvme"), Tier::nvme);
  expect_error([] { parse_tier("disk"); }, {"'disk'", "none", "cpu", "nvme"});
  EXPECT_EQ(tier_name(Tier::nvme), "nvme");
  EXPECT_EQ(state_kind_name(StateKind::activations), "activations");
}

TEST(Placement, HomesFollowTheRequest) {
  const RunShape s = tiny_shape(2, 40000);  // the embedding (32768) replicated, blocks sharded
  for (GradHome grads : {GradHome::automatic, GradHome::gpu, GradHome::cpu})
    for (Tier param : {Tier::gpu, Tier::cpu, Tier::nvme})
      for (Tier opt : {Tier::gpu, Tier::cpu, Tier::nvme}) {
        SCOPED_TRACE(fmt::format("param {} optimizer {} gradients {}", tier_name(param),
                                 tier_name(opt), grad_home_name(grads)));
        const Placement p = Placement::make(s, request(param, opt, grads), roomy());
        ASSERT_EQ(p.homes.size(), 4u);
        for (size_t u = 0; u < p.homes.size(); ++u) {
          const bool replicated = p.partition.units[u].replicated;
          EXPECT_EQ(p.homes[u].param, replicated ? Tier::gpu : param) << u;
          EXPECT_EQ(p.homes[u].optimizer, opt) << u;
          // With room on the GPU, gradients stay there unless host RAM is asked for.
          EXPECT_EQ(p.homes[u].grad,
                    opt != Tier::gpu && grads == GradHome::cpu ? Tier::cpu : Tier::gpu)
              << u;
        }
        EXPECT_TRUE(p.partition.units[0].replicated);
        EXPECT_FALSE(p.partition.units[1].replicated);
        const bool off = param != Tier::gpu || opt != Tier::gpu;
        EXPECT_EQ(p.offloaded(), off);
        EXPECT_EQ(p.pinned_buffers, off ? 5 : 0);
        EXPECT_EQ(p.pinned_bytes() > 0, off);
        const TierBytes t = p.needs();
        EXPECT_EQ(t.at(Tier::cpu, StateKind::buffers), p.pinned_bytes());
        EXPECT_EQ(t.at(Tier::nvme, StateKind::optimizer) > 0, opt == Tier::nvme);
        EXPECT_EQ(t.at(Tier::nvme, StateKind::parameters) > 0, param == Tier::nvme);
        EXPECT_EQ(t.at(Tier::gpu, StateKind::optimizer) > 0, opt == Tier::gpu);
        EXPECT_NE(p.str().find("embedding"), std::string::npos);
      }
}

TEST(Placement, ImpossibleRequestsNameTheSetting) {
  const RunShape s = tiny_shape(1);
  OffloadRequest r = request(Tier::gpu, Tier::nvme);
  r.nvme_paths.clear();
  expect_error([&] { Placement::make(s, r, roomy()); }, {"offload_optimizer.device", "nvme_path"});
  r = request(Tier::cpu, Tier::cpu);
  r.buffer_count = 0;
  expect_error([&] { Placement::make(s, r, roomy()); }, {"buffer_count 0"});
  r = request(Tier::gpu, Tier::nvme);
  r.nvme_stripe = 6000;
  expect_error([&] { Placement::make(s, r, roomy()); }, {"aio.block_size", "6000", "4 KiB"});
  r = request(Tier::gpu, Tier::nvme);
  r.nvme_queue_depth = 0;
  expect_error([&] { Placement::make(s, r, roomy()); }, {"aio.queue_depth", "0", "1 to 4096"});
  RunShape bad = s;
  bad.micro_batch = 0;
  expect_error([&] { Placement::make(bad, request(Tier::gpu, Tier::gpu), roomy()); },
               {"micro-batch 0"});
  bad = s;
  bad.seq_len = 100000;
  expect_error([&] { Placement::make(bad, request(Tier::gpu, Tier::gpu), roomy()); },
               {"sequence length 100000"});
}

// DeepSpeed's max_in_cpu: with the parameters on NVMe, each rank keeps its first max_in_cpu
// partition elements in host RAM, units in forward order; with them in host RAM it changes
// nothing.
TEST(Placement, MaxInCpuKeepsEachRanksFirstElementsInHostRam) {
  for (int ranks : {1, 2}) {
    SCOPED_TRACE(ranks);
    RunShape s = tiny_shape(ranks);
    const Placement all = Placement::make(s, request(Tier::cpu, Tier::cpu), roomy());
    const uint64_t shard0 = all.partition.units[0].shard, shard1 = all.partition.units[1].shard;
    EXPECT_EQ(all.partition.units[0].padded, shard0 * uint64_t(ranks));
    OffloadRequest r = request(Tier::nvme, Tier::cpu);
    r.max_in_cpu = shard0 + shard1;  // a rank's part of units 0 and 1, not of the whole units
    const Placement p = Placement::make(s, r, roomy());
    EXPECT_EQ(p.homes[0].param, Tier::cpu);
    EXPECT_EQ(p.homes[1].param, Tier::cpu);
    for (size_t u = 2; u < p.homes.size(); ++u) EXPECT_EQ(p.homes[u].param, Tier::nvme) << u;
    r.max_in_cpu = shard0 + shard1 - 1;
    const Placement q = Placement::make(s, r, roomy());
    EXPECT_EQ(q.homes[0].param, Tier::cpu);
    EXPECT_EQ(q.homes[1].param, Tier::nvme);
    r.max_in_cpu = 0;
    for (const UnitHomes& h : Placement::make(s, r, roomy()).homes) EXPECT_EQ(h.param, Tier::nvme);
    // Homed in host RAM, parameters stay there whatever max_in_cpu says, and need no drive.
    r = request(Tier::cpu, Tier::cpu);
    r.max_in_cpu = shard0;
    r.nvme_paths.clear();
    for (const UnitHomes& h : Placement::make(s, r, roomy()).homes) EXPECT_EQ(h.param, Tier::cpu);
  }
}

// N host devices of 64 MiB and their communicator.
struct HostRanks {
  std::vector<std::unique_ptr<Device>> devices;
  std::unique_ptr<Communicator> comm;
  explicit HostRanks(int n) {
    std::vector<Device*> ptrs;
    for (int r = 0; r < n; ++r) {
      devices.push_back(open_host_device(r, 64ull << 20));
      ptrs.push_back(devices.back().get());
    }
    comm = make_communicator(ptrs);
  }
};

// needs() by hand for the tiny model, and against the allocations of the real thing.
class PlacementAllocations : public ::testing::TestWithParam<std::tuple<int, uint64_t, bool>> {};

TEST_P(PlacementAllocations, GpuFiguresEqualTheArenasPeaks) {
  const auto [N, threshold, tied] = GetParam();
  RunShape s = tiny_shape(N, threshold);
  s.model.tie_word_embeddings = tied;
  s.param_dtype = DType::f32;  // as the host backend runs
  s.grad_dtype = DType::f32;
  const Placement p = Placement::make(s, request(Tier::gpu, Tier::gpu), roomy());
  const TierBytes t = p.needs();

  // By hand: every unit's resident elements in f32, each buffer rounded to 256 bytes.
  // The working buffers: a pool of two for gathered units (parameters and gradients; one rank
  // uses a unit's parameters where they lie, so gradients alone), and the working gradients of
  // each replicated unit. The staging of the sums added into sharded G: several ranks only.
  uint64_t params = 0, gather = 0, replicated = 0;
  for (const UnitPartition& up : p.partition.units) {
    params += round256(up.resident() * 4);
    if (!up.replicated) gather = std::max(gather, up.padded);
    if (up.replicated) replicated += round256(up.numel * 4);
  }
  EXPECT_EQ(t.at(Tier::gpu, StateKind::parameters), params);
  EXPECT_EQ(t.at(Tier::gpu, StateKind::gradients), params);
  EXPECT_EQ(t.at(Tier::gpu, StateKind::working),
            (N > 1 ? 2 : 1) * 2 * round256(gather * 4) + replicated);
  EXPECT_EQ(t.at(Tier::gpu, StateKind::other),
            N > 1 && gather > 0 ? round256(p.partition.max_shard_numel() * 4) : 0);
  uint64_t optimizer = 0;
  for (const UnitPartition& up : p.partition.units) optimizer += 3 * round256(up.resident() * 4);
  EXPECT_EQ(t.at(Tier::gpu, StateKind::optimizer), optimizer);
  // Host RAM holds nothing but what a checkpoint stages, one unit at a time (the largest, at
  // 24 + 2 x 4 bytes an element in f32, and the writer's chunks).
  uint64_t largest = 0;
  for (const UnitPartition& up : p.partition.units) largest = std::max(largest, up.padded);
  EXPECT_EQ(t.total(Tier::cpu), t.at(Tier::cpu, StateKind::checkpoint));
  EXPECT_EQ(t.at(Tier::cpu, StateKind::checkpoint), 32 * largest + (32ull << 20));
  EXPECT_EQ(t.total(Tier::nvme), 0u);

  // The real allocations on N host devices.
  HostRanks ranks(N);
  const auto& devices = ranks.devices;
  Communicator& comm = *ranks.comm;
  ZeroOptions zo;
  zo.persistence_threshold = threshold;
  zo.working_buffers = s.working_buffers;
  ZeroModel zero(ModelLayout::build(s.model), comm, zo);
  ModelOptions mo;
  mo.max_batch = s.micro_batch;
  mo.seq_len = s.seq_len;
  std::vector<std::unique_ptr<LlamaModel>> models;
  std::vector<LlamaModel*> model_ptrs;
  for (int r = 0; r < N; ++r) {
    models.push_back(std::make_unique<LlamaModel>(s.model, mo, *devices[size_t(r)]));
    model_ptrs.push_back(models.back().get());
  }
  ZeroRunner runner(zero, model_ptrs);
  for (int r = 0; r < N; ++r) {
    SCOPED_TRACE("device " + std::to_string(r));
    const ArenaStats m = devices[size_t(r)]->memory();
    EXPECT_EQ(m.peak_of(MemoryKind::parameters), t.at(Tier::gpu, StateKind::parameters));
    EXPECT_EQ(m.peak_of(MemoryKind::gradients), t.at(Tier::gpu, StateKind::gradients));
    EXPECT_EQ(m.peak_of(MemoryKind::gathered), t.at(Tier::gpu, StateKind::working));
    EXPECT_EQ(m.peak_of(MemoryKind::activations), t.at(Tier::gpu, StateKind::activations));
    EXPECT_EQ(m.peak_of(MemoryKind::communication), t.at(Tier::gpu, StateKind::other));
  }
}

// With the state on the host, the model state keeps on the GPU only what the placement
// counts there (the executor's residency flags: replicated units, and gpu homes).
TEST_P(PlacementAllocations, OffloadedStateLeavesOnlyReplicatedUnitsOnTheGpu) {
  const auto [N, threshold, tied] = GetParam();
  RunShape s = tiny_shape(N, threshold);
  s.model.tie_word_embeddings = tied;
  s.param_dtype = DType::f32;
  const Placement p = Placement::make(s, request(Tier::cpu, Tier::cpu), roomy());
  const TierBytes t = p.needs();
  HostRanks ranks(N);
  const auto& devices = ranks.devices;
  Communicator& comm = *ranks.comm;
  ZeroOptions zo;
  zo.persistence_threshold = threshold;
  for (size_t u = 0; u < p.homes.size(); ++u) {
    zo.param_resident.push_back(p.homes[u].param == Tier::gpu || p.partition.units[u].replicated);
    zo.grad_resident.push_back(p.homes[u].grad == Tier::gpu || p.partition.units[u].replicated);
  }
  ZeroModel zero(ModelLayout::build(s.model), comm, zo);
  for (int r = 0; r < N; ++r) {
    const ArenaStats m = devices[size_t(r)]->memory();
    EXPECT_EQ(m.peak_of(MemoryKind::parameters), t.at(Tier::gpu, StateKind::parameters));
    EXPECT_EQ(m.peak_of(MemoryKind::gradients), t.at(Tier::gpu, StateKind::gradients));
  }
  EXPECT_EQ(t.at(Tier::gpu, StateKind::parameters) == 0, threshold == 0);
}

INSTANTIATE_TEST_SUITE_P(RanksThresholdTied, PlacementAllocations,
                         ::testing::Combine(::testing::Values(1, 3), ::testing::Values(0, 40000),
                                            ::testing::Bool()));

// Without recompute every block keeps its activations: the placement counts what the model and
// ZeroRunner allocate then, in f32 and bf16, and it is more than with recompute.
TEST(Placement, ActivationsWithoutRecomputeAreWhatIsAllocated) {
  for (DType dt : {DType::f32, DType::bf16}) {
    uint64_t figure[2] = {};
    for (bool recompute : {true, false}) {
      SCOPED_TRACE(fmt::format("{} recompute {}", dtype_name(dt), recompute));
      RunShape s = tiny_shape(2);
      s.param_dtype = dt;
      s.recompute = recompute;
      const Placement p = Placement::make(s, request(Tier::gpu, Tier::gpu), roomy());
      figure[recompute] = p.needs().at(Tier::gpu, StateKind::activations);
      HostRanks ranks(2);
      ZeroOptions zo;
      zo.param_dtype = dt;
      zo.working_buffers = s.working_buffers;
      ZeroModel zero(ModelLayout::build(s.model), *ranks.comm, zo);
      ModelOptions mo;
      mo.param_dtype = dt;
      mo.max_batch = s.micro_batch;
      mo.seq_len = s.seq_len;
      mo.recompute = recompute;
      std::vector<std::unique_ptr<LlamaModel>> models;
      std::vector<LlamaModel*> model_ptrs;
      for (auto& d : ranks.devices) {
        models.push_back(std::make_unique<LlamaModel>(s.model, mo, *d));
        model_ptrs.push_back(models.back().get());
      }
      ZeroRunner runner(zero, model_ptrs);
      for (auto& d : ranks.devices)
        EXPECT_EQ(d->memory().peak_of(MemoryKind::activations), figure[recompute]);
    }
    EXPECT_GT(figure[false], figure[true]);
  }
}

TEST(Placement, HostAndNvmeBytesByHand) {
  RunShape s = tiny_shape(3);  // every unit sharded
  s.param_dtype = DType::bf16;
  OffloadRequest r = request(Tier::nvme, Tier::cpu, GradHome::cpu);
  r.nvme_stripe = 4096;
  const Placement p = Placement::make(s, r, roomy());
  const TierBytes t = p.needs();
  const auto page = [](uint64_t b) { return (b + 4095) / 4096 * 4096; };
  uint64_t optimizer = 0, grads = 0, stripes = 0, largest = 0;
  for (const UnitPartition& up : p.partition.units) {
    optimizer += 3 * page(up.shard * 12);  // one page-rounded block per rank
    grads += 3 * page(up.shard * 4);
    stripes += 3 * ((up.shard * 2 + 4095) / 4096);
    // A buffer carries every rank's P shard, each from a page boundary so the swap store
    // reads it in place, or every rank's f32 gradient shard staged for accumulation.
    largest = std::max({largest, 3 * page(up.shard * 2), 3 * page(up.shard * 4)});
  }
  EXPECT_EQ(t.at(Tier::cpu, StateKind::optimizer), optimizer);
  EXPECT_EQ(t.at(Tier::cpu, StateKind::gradients), grads);
  EXPECT_EQ(t.at(Tier::cpu, StateKind::parameters), 0u);
  // Two paths: the files hold whole stripes on both.
  EXPECT_EQ(t.total(Tier::nvme), (stripes + 1) / 2 * 2 * 4096);
  EXPECT_EQ(t.at(Tier::gpu, StateKind::parameters), 0u);
  EXPECT_EQ(t.at(Tier::gpu, StateKind::gradients), 0u);
  EXPECT_EQ(p.pinned_buffers, 5);
  EXPECT_EQ(p.pinned_buffer_bytes, page(largest));
  // pin_memory locks what devices copy in place: cpu-homed G (and P), not CPU Adam's state.
  EXPECT_EQ(p.pinned_need(), p.pinned_bytes() + grads);
  r.pin_memory = false;
  EXPECT_EQ(Placement::make(s, r, roomy()).pinned_need(), p.pinned_bytes());
  // Optimizer on NVMe: a buffer carries a whole unit's master, m and v.
  const Placement o = Placement::make(s, request(Tier::gpu, Tier::nvme), roomy());
  EXPECT_EQ(o.pinned_buffer_bytes, 3 * page(p.partition.units[1].shard * 12));

  // Gradients kept on the GPU: each device holds its f32 shards, host RAM none, and a buffer
  // carries every rank's gradient shard down to CPU Adam.
  r.pin_memory = true;
  r.grads = GradHome::gpu;
  const Placement g = Placement::make(s, r, roomy());
  const TierBytes tg = g.needs();
  uint64_t device_grads = 0, largest_g = 0;
  for (const UnitPartition& up : g.partition.units) {
    device_grads += round256(up.shard * 4);
    largest_g = std::max({largest_g, 3 * page(up.shard * 2), 3 * page(up.shard * 4)});
  }
  for (const UnitHomes& h : g.homes) EXPECT_EQ(h.grad, Tier::gpu);
  EXPECT_EQ(tg.at(Tier::gpu, StateKind::gradients), device_grads);
  EXPECT_EQ(tg.at(Tier::cpu, StateKind::gradients), 0u);
  EXPECT_EQ(tg.at(Tier::cpu, StateKind::optimizer), optimizer);
  EXPECT_EQ(g.pinned_buffer_bytes, page(largest_g));
  EXPECT_EQ(g.pinned_need(), g.pinned_bytes());
  // Automatic: on the GPU while its budget allows, in forward order. With three ranks the
  // first G on the GPU brings ZeroModel's staging of the sums it adds there.
  r.grads = GradHome::automatic;
  TierBudgets b = roomy();
  const uint64_t staging = round256(g.partition.max_shard_numel() * 4);
  EXPECT_EQ(p.needs().at(Tier::gpu, StateKind::other), staging);  // the executor's alone
  EXPECT_EQ(g.needs().at(Tier::gpu, StateKind::other), staging);  // ZeroModel's alone
  b.gpu_memory = p.needs().total(Tier::gpu) + round256(g.partition.units[0].shard * 4) + staging +
                 round256(g.partition.units[1].shard * 4) / 2;
  const Placement part = Placement::make(s, r, b);
  EXPECT_EQ(part.homes[0].grad, Tier::gpu);
  for (size_t u = 1; u < part.homes.size(); ++u) EXPECT_EQ(part.homes[u].grad, Tier::cpu) << u;
  EXPECT_EQ(part.needs().at(Tier::gpu, StateKind::other), 2 * staging);  // both
  EXPECT_NO_THROW(part.check(b));
  b.gpu_memory -= staging;  // without room for ZeroModel's staging, unit 0's G stays on the host
  EXPECT_EQ(Placement::make(s, r, b).homes[0].grad, Tier::cpu);
  b.gpu_memory += staging;
  // Asked for on the GPU where it does not fit: check() refuses it.
  r.grads = GradHome::gpu;
  expect_error([&] { Placement::make(s, r, b).check(b); }, {"gpu (per device)", "gradients"});
  // Too few pinned buffers for the optimizer to hold the gradients beside the updated
  // parameters: automatic keeps them in host RAM, gpu says which setting to change.
  r.buffer_count = 1;
  expect_error([&] { (void)Placement::make(s, r, roomy()); },
               {"buffer_count is 1", "--offload-gradients cpu"});
  r.grads = GradHome::automatic;
  for (const UnitHomes& h : Placement::make(s, r, roomy()).homes) EXPECT_EQ(h.grad, Tier::cpu);
}

// Gradients on NVMe (--offload-gradients nvme): the sharded units' accumulators are swap-store
// shards, counted in whole stripes beside P and O; replicated units keep theirs in host RAM;
// the optimizer holds one more pinned buffer (the sum read back). Automatic placement sends
// the accumulators of the last units to NVMe where host RAM cannot hold them.
TEST(Placement, GradientsOnNvmeAreStripesOfTheSwapStore) {
  RunShape s = tiny_shape(3, 40000);  // the norms replicated
  s.param_dtype = DType::bf16;
  OffloadRequest r = request(Tier::cpu, Tier::nvme, GradHome::nvme);
  r.nvme_stripe = 4096;
  const Placement p = Placement::make(s, r, roomy());
  const TierBytes t = p.needs();
  const auto page = [](uint64_t b) { return (b + 4095) / 4096 * 4096; };
  uint64_t g_stripes = 0, o_stripes = 0, host_grads = 0;
  for (size_t u = 0; u < p.homes.size(); ++u) {
    const UnitPartition& up = p.partition.units[u];
    EXPECT_EQ(p.homes[u].grad, up.replicated ? Tier::cpu : Tier::nvme) << up.name;
    if (up.replicated) {
      host_grads += page(up.numel * 4);
      o_stripes += (up.numel * 12 + 4095) / 4096;
    } else {
      g_stripes += 3 * ((up.shard * 4 + 4095) / 4096);
      o_stripes += 3 * ((up.shard * 12 + 4095) / 4096);
    }
  }
  ASSERT_GT(host_grads, 0u);
  EXPECT_EQ(t.at(Tier::nvme, StateKind::gradients), g_stripes * 4096);
  EXPECT_EQ(t.at(Tier::cpu, StateKind::gradients), host_grads);
  EXPECT_EQ(t.total(Tier::nvme), (g_stripes + o_stripes + 1) / 2 * 2 * 4096);
  EXPECT_EQ(t.at(Tier::nvme, StateKind::parameters), 0u);
  for (const UnitHomes& h : p.homes) {
    if (h.grad == Tier::nvme) {
      EXPECT_EQ(optimizer_pinned_buffers(h), 2);  // O and G; P in host RAM is updated in place
    }
  }
  // No nvme path to put them on.
  OffloadRequest no_paths = request(Tier::cpu, Tier::cpu, GradHome::nvme);
  no_paths.nvme_paths.clear();
  expect_error([&] { (void)Placement::make(s, no_paths, roomy()); },
               {"--offload-gradients nvme", "--nvme-path"});
  // Too few pinned buffers for the optimizer to hold them beside its state and the update.
  r.param = Tier::nvme;
  r.buffer_count = 2;
  expect_error([&] { (void)Placement::make(s, r, roomy()); }, {"buffer_count is 2", "3 pinned"});

  // Automatic, host RAM short of the f32 accumulators: the last units' go to NVMe, as many as
  // it takes, and check() then holds.
  RunShape sharded = tiny_shape(3);
  OffloadRequest a = request(Tier::nvme, Tier::nvme, GradHome::automatic);
  TierBudgets b = roomy();
  b.gpu_memory = Placement::make(sharded, request(Tier::nvme, Tier::nvme, GradHome::cpu), b)
                     .needs()
                     .total(Tier::gpu);  // no room for gradients on the GPU
  const Placement all_cpu = Placement::make(sharded, a, b);
  for (const UnitHomes& h : all_cpu.homes) EXPECT_EQ(h.grad, Tier::cpu);
  const TierBytes c = all_cpu.needs();
  const uint64_t first = page(all_cpu.partition.units[0].shard * 4) * 3;
  b.cpu_memory = c.total(Tier::cpu) - c.at(Tier::cpu, StateKind::gradients) + first;
  const Placement spilled = Placement::make(sharded, a, b);
  EXPECT_EQ(spilled.homes[0].grad, Tier::cpu);
  for (size_t u = 1; u < spilled.homes.size(); ++u) EXPECT_EQ(spilled.homes[u].grad, Tier::nvme);
  EXPECT_EQ(spilled.needs().at(Tier::cpu, StateKind::gradients), first);
  EXPECT_NO_THROW(spilled.check(b));
  EXPECT_EQ(spilled.offloaded_gradients().on_nvme, static_cast<int>(spilled.homes.size()) - 1);
  // Not without nvme paths, nor when asked for host RAM: check() refuses, naming them.
  a.grads = GradHome::cpu;
  expect_error([&] { Placement::make(sharded, a, b).check(b); },
               {"cpu: gradients", "--grad-dtype bf16"});
}

// Replicated units keep parameters and gradients on every GPU whatever the homes say, as
// ZeroModel requires; their host copies are counted once.
TEST(Placement, ReplicatedUnitsStayOnTheGpu) {
  const RunShape s = tiny_shape(2, 40000);  // the embedding replicated
  const Placement p = Placement::make(s, request(Tier::cpu, Tier::cpu, GradHome::cpu), roomy());
  ASSERT_TRUE(p.partition.units[0].replicated);
  const TierBytes t = p.needs();
  const auto page = [](uint64_t b) { return (b + 4095) / 4096 * 4096; };
  uint64_t gpu_params = 0, gpu_grads = 0, host_grads = 0;
  for (const UnitPartition& up : p.partition.units) {
    if (up.replicated) {
      gpu_params += round256(up.numel * 2);
      gpu_grads += round256(up.numel * 4);
      host_grads += page(up.numel * 4);
    } else {
      host_grads += 2 * page(up.shard * 4);
    }
  }
  EXPECT_GT(gpu_params, 0u);
  EXPECT_EQ(t.at(Tier::gpu, StateKind::parameters), gpu_params);
  EXPECT_EQ(t.at(Tier::gpu, StateKind::gradients), gpu_grads);
  EXPECT_EQ(t.at(Tier::cpu, StateKind::gradients), host_grads);
  // Gradients kept on the GPU even with no room for them: a replicated unit's are there anyway.
  TierBudgets b = roomy();
  b.gpu_memory = 0;
  const Placement g = Placement::make(s, request(Tier::cpu, Tier::cpu), b);
  uint64_t sharded_host_grads = 0;
  for (size_t u = 0; u < g.homes.size(); ++u) {
    const UnitPartition& up = g.partition.units[u];
    EXPECT_EQ(g.homes[u].grad, up.replicated ? Tier::gpu : Tier::cpu) << u;
    if (!up.replicated) sharded_host_grads += 2 * page(up.shard * 4);
  }
  EXPECT_LT(sharded_host_grads, host_grads);
  EXPECT_EQ(g.needs().at(Tier::gpu, StateKind::gradients), gpu_grads);
  EXPECT_EQ(g.needs().at(Tier::cpu, StateKind::gradients), sharded_host_grads);
}

TEST(Placement, CheckRefusesWithATable) {
  const RunShape s = tiny_shape(2);
  const Placement p = Placement::make(s, request(Tier::gpu, Tier::gpu), roomy());
  const TierBytes t = p.needs();
  TierBudgets b = roomy();
  b.gpu_memory = t.total(Tier::gpu);
  EXPECT_NO_THROW(p.check(b));  // exactly enough fits
  b.gpu_memory = t.total(Tier::gpu) - 1;
  expect_error([&] { p.check(b); },
               {"does not fit", "tier", "needed", "available", "over by", "gpu (per device)",
                format_bytes(t.total(Tier::gpu)), "1 B", "optimizer", "activations",
                "--offload-optimizer cpu", "micro-batch", "--offload-param cpu or nvme"});

  const Placement host = Placement::make(s, request(Tier::cpu, Tier::cpu), roomy());
  b = roomy();
  b.cpu_memory = host.needs().total(Tier::cpu) / 2;
  expect_error([&] { host.check(b); },
               {"cpu", format_bytes(host.needs().total(Tier::cpu)), "--offload-optimizer nvme",
                "--offload-param nvme", "--cpu-memory"});
  {
    // Short of host RAM with the optimizer on NVMe: what is left there is the gradients, whose
    // dtype and home the hints name, with their bytes.
    RunShape bf16 = s;
    bf16.param_dtype = DType::bf16;
    bf16.grad_dtype = DType::f32;
    const Placement g =
        Placement::make(bf16, request(Tier::nvme, Tier::nvme, GradHome::cpu), roomy());
    const uint64_t grads = g.needs().at(Tier::cpu, StateKind::gradients);
    ASSERT_GT(grads, 0u);
    TierBudgets tight = roomy();
    tight.cpu_memory = g.needs().total(Tier::cpu) - 1;
    const std::string msg = test::error_message([&] { g.check(tight); });
    for (const std::string& want : std::vector<std::string>{
             "cpu: gradients " + format_bytes(grads), "bf16 gradients (--grad-dtype bf16",
             "the f32 accumulators take " + format_bytes(grads),
             "(--offload-gradients nvme), as ZeRO-Infinity swaps them: up to " +
                 format_bytes(grads),
             "--offload-gradients auto): " + format_bytes(grads)})
      EXPECT_NE(msg.find(want), std::string::npos) << want << " not in: " << msg;
    EXPECT_EQ(msg.find("--offload-optimizer nvme"), std::string::npos) << msg;
    // In 16-bit already, and kept on the GPUs where they fit: neither hint.
    bf16.grad_dtype = DType::bf16;
    const Placement h = Placement::make(bf16, request(Tier::nvme, Tier::nvme), roomy());
    tight.cpu_memory = h.needs().total(Tier::cpu) - 1;
    const std::string other = test::error_message([&] { h.check(tight); });
    EXPECT_EQ(other.find("--grad-dtype"), std::string::npos) << other;
    EXPECT_EQ(other.find("--offload-gradients"), std::string::npos) << other;
  }
  b = roomy();
  b.pinned_limit = 64 << 10;
  expect_error([&] { host.check(b); }, {"pinned", "ulimit -l", "pin_memory false"});
  b.pinned_limit = kUnlimited;
  EXPECT_NO_THROW(host.check(b));
  // Short of GPU memory with the parameters offloaded: the replicated units left on the GPU
  // are no reason to suggest offloading them, but a lower persistence threshold would move
  // them.
  // Fewer working buffers where the model allows (two with tied embeddings), naming the unit
  // they are sized to.
  {
    RunShape shape = tiny_shape(1);
    const Placement one = Placement::make(shape, request(Tier::cpu, Tier::cpu), roomy());
    TierBudgets small = roomy();
    small.gpu_memory = one.needs().total(Tier::gpu) - 1;
    const uint64_t each = one.needs().at(Tier::gpu, StateKind::working) / 2;
    expect_error(
        [&] { one.check(small); },
        {"a smaller --prefetch-depth (now 1: 2 working buffers",
         "sized to the largest unit (layers.0, 45568 parameters), about " + format_bytes(each),
         "bf16 gradients (--grad-dtype bf16"});
    // Gradients in the parameters' dtype already, or f32 parameters: no such hint.
    for (const auto& [params, grads] :
         {std::pair{DType::bf16, DType::bf16}, std::pair{DType::f32, DType::f32}}) {
      RunShape other = shape;
      other.param_dtype = params;
      other.grad_dtype = grads;
      const Placement o = Placement::make(other, request(Tier::cpu, Tier::cpu), roomy());
      TierBudgets short_by_one = roomy();
      short_by_one.gpu_memory = o.needs().total(Tier::gpu) - 1;
      const std::string msg = test::error_message([&] { o.check(short_by_one); });
      EXPECT_EQ(msg.find("--grad-dtype"), std::string::npos) << msg;
    }
    shape.model.tie_word_embeddings = true;
    const Placement tied = Placement::make(shape, request(Tier::cpu, Tier::cpu), roomy());
    small.gpu_memory = tied.needs().total(Tier::gpu) - 1;
    const std::string msg = test::error_message([&] { tied.check(small); });
    EXPECT_NE(msg.find("gpu (per device)"), std::string::npos) << msg;
    EXPECT_EQ(msg.find("--prefetch-depth"), std::string::npos) << msg;
  }
  const Placement norms =
      Placement::make(tiny_shape(2, 40000), request(Tier::cpu, Tier::cpu), roomy());
  ASSERT_GT(norms.needs().at(Tier::gpu, StateKind::parameters), 0u);
  b.gpu_memory = norms.needs().total(Tier::gpu) - 1;
  const std::string msg = test::error_message([&] { norms.check(b); });
  EXPECT_NE(msg.find("gpu (per device)"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("offload the parameters"), std::string::npos) << msg;
  EXPECT_NE(msg.find("a lower --persistence-threshold (now 40000"), std::string::npos) << msg;
  b = roomy();

  const Placement nvme = Placement::make(s, request(Tier::nvme, Tier::nvme), roomy());
  b = roomy();
  b.nvme_free = 4096;
  expect_error([&] { nvme.check(b); }, {"nvme", "add nvme paths"});
}

TEST(Placement, AutomaticSpillsInOrderAsBudgetsShrink) {
  RunShape s = tiny_shape(1);
  OffloadRequest r = request(Tier::gpu, Tier::gpu);
  r.automatic = true;
  const Placement all_gpu = Placement::make(s, request(Tier::gpu, Tier::gpu), roomy());
  const Placement fixed_only =
      Placement::make(s, request(Tier::cpu, Tier::nvme, GradHome::cpu), roomy());
  const uint64_t full = all_gpu.needs().total(Tier::gpu);

  // Everything fits: nothing leaves the GPU.
  const Placement a = Placement::make(s, r, roomy());
  for (const UnitHomes& h : a.homes) EXPECT_EQ(h.optimizer, Tier::gpu);
  EXPECT_EQ(a.pinned_buffers, 0);
  EXPECT_NO_THROW(a.check(roomy()));

  // Shrinking the GPU pushes optimizer state, then parameters, off it; units late in the
  // forward order go first. Every placement chosen fits its budgets.
  int last_gpu_units = 1 << 30;
  const uint64_t floor = fixed_only.needs().total(Tier::gpu);
  std::vector<uint64_t> gpu_budgets;
  for (int i = 0; i <= 8; ++i) gpu_budgets.push_back(full - (full - floor) * uint64_t(i) / 8);
  for (uint64_t gpu : gpu_budgets) {
    TierBudgets b = roomy();
    b.gpu_memory = gpu;
    b.cpu_memory = 1ull << 30;
    const Placement p = Placement::make(s, r, b);
    EXPECT_NO_THROW(p.check(b)) << gpu;
    int on_gpu = 0;
    bool seen_off = false;
    for (const UnitHomes& h : p.homes) {
      if (h.optimizer == Tier::gpu) {
        EXPECT_FALSE(seen_off) << "a later unit's optimizer stayed on the GPU";
        ++on_gpu;
      } else {
        EXPECT_EQ(h.optimizer, Tier::cpu);  // host RAM has room: NVMe is not needed
        seen_off = true;
      }
    }
    EXPECT_LE(on_gpu, last_gpu_units);
    last_gpu_units = on_gpu;
    if (gpu < full) {
      EXPECT_TRUE(p.offloaded());
      EXPECT_GT(p.pinned_buffers, 0);
    }
  }
  EXPECT_EQ(last_gpu_units, 0);

  // No GPU room for state and host RAM only for the gradients and the pinned buffers:
  // optimizer state and parameters go to NVMe, and that fits.
  TierBudgets b = roomy();
  b.gpu_memory = floor;
  const Placement host = Placement::make(s, request(Tier::cpu, Tier::nvme, GradHome::cpu), roomy());
  b.cpu_memory = host.needs().at(Tier::cpu, StateKind::gradients) + host.pinned_bytes() +
                 host.checkpoint_bytes() + 1024;
  const Placement p = Placement::make(s, r, b);
  EXPECT_NO_THROW(p.check(b)) << p.str();
  for (const UnitHomes& h : p.homes) {
    EXPECT_EQ(h.optimizer, Tier::nvme);
    EXPECT_EQ(h.param, Tier::nvme);
    EXPECT_EQ(h.grad, Tier::cpu);
  }
  // Nowhere to go at all: the placement is made, and check() refuses it.
  b.nvme_free = 0;
  const Placement none = Placement::make(s, r, b);
  EXPECT_THROW(none.check(b), Error);
}

// Without training (strata eval) only the parameters are placed: no tier counts gradients or
// optimizer state, whatever the request says of the optimizer, the pinned buffers carry
// parameters, and `auto` spills the parameters to host RAM, then NVMe, as budgets shrink.
TEST(Placement, ParametersOnlyPlaceTheParametersAlone) {
  RunShape s = tiny_shape(3);
  s.training = false;
  const auto no_training_state = [](const Placement& p) {
    const TierBytes t = p.needs();
    for (Tier tier : {Tier::gpu, Tier::cpu, Tier::nvme})
      for (StateKind k : {StateKind::gradients, StateKind::optimizer})
        EXPECT_EQ(t.at(tier, k), 0u) << tier_name(tier) << " " << state_kind_name(k) << p.str();
    for (const UnitHomes& h : p.homes) EXPECT_EQ(h.optimizer, Tier::gpu);
  };
  // The optimizer asked for NVMe without a path: no optimizer, so no path is needed.
  OffloadRequest cpu_params = request(Tier::cpu, Tier::nvme);
  cpu_params.nvme_paths.clear();
  const Placement off = Placement::make(s, cpu_params, roomy());
  no_training_state(off);
  const Placement on = Placement::make(s, request(Tier::gpu, Tier::gpu), roomy());
  no_training_state(on);
  EXPECT_EQ(on.pinned_buffers, 0);
  // The GPU keeps its working buffers and activations, not the training extras: less than a
  // training placement of the same homes by the working gradients, staging and optimizer.
  RunShape trained = s;
  trained.training = true;
  // The buffers carry what they carry in training with only the parameters moving: a unit's
  // parameters of every rank.
  const Placement t_off = Placement::make(trained, request(Tier::cpu, Tier::gpu), roomy());
  EXPECT_EQ(off.pinned_buffers, t_off.pinned_buffers);
  EXPECT_EQ(off.pinned_buffer_bytes, t_off.pinned_buffer_bytes);
  EXPECT_EQ(off.needs().at(Tier::cpu, StateKind::parameters),
            t_off.needs().at(Tier::cpu, StateKind::parameters));
  const TierBytes t_on = Placement::make(trained, request(Tier::gpu, Tier::gpu), roomy()).needs();
  EXPECT_LT(on.needs().at(Tier::gpu, StateKind::working), t_on.at(Tier::gpu, StateKind::working));
  EXPECT_LT(on.needs().at(Tier::gpu, StateKind::activations),
            t_on.at(Tier::gpu, StateKind::activations));
  EXPECT_EQ(on.needs().at(Tier::gpu, StateKind::other), 0u);
  EXPECT_EQ(on.needs().at(Tier::gpu, StateKind::parameters),
            t_on.at(Tier::gpu, StateKind::parameters));

  // auto: the GPU at the floor (every sharded unit's parameters off it) sends them to host
  // RAM; host RAM for the buffers alone sends them to NVMe. Each fits its budgets.
  OffloadRequest r = request(Tier::gpu, Tier::gpu);
  r.automatic = true;
  TierBudgets b = roomy();
  b.gpu_memory = off.needs().total(Tier::gpu);
  const Placement to_cpu = Placement::make(s, r, b);
  no_training_state(to_cpu);
  EXPECT_NO_THROW(to_cpu.check(b)) << to_cpu.str();
  for (size_t u = 0; u < to_cpu.homes.size(); ++u)
    EXPECT_EQ(to_cpu.homes[u].param, to_cpu.partition.units[u].replicated ? Tier::gpu : Tier::cpu);
  b.cpu_memory = to_cpu.pinned_bytes() + 1024;
  const Placement to_nvme = Placement::make(s, r, b);
  no_training_state(to_nvme);
  EXPECT_NO_THROW(to_nvme.check(b)) << to_nvme.str();
  EXPECT_GT(to_nvme.needs().at(Tier::nvme, StateKind::parameters), 0u);
  for (size_t u = 0; u < to_nvme.homes.size(); ++u)
    EXPECT_EQ(to_nvme.homes[u].param,
              to_nvme.partition.units[u].replicated ? Tier::gpu : Tier::nvme);
  // Nothing from the optimizer request: the same placement when it asks for NVMe.
  OffloadRequest r_nvme = r;
  r_nvme.optimizer = Tier::nvme;
  EXPECT_EQ(Placement::make(s, r_nvme, b).str(), to_nvme.str());
}

TEST(Placement, TiedEmbeddingsKeepTheHeadWithUnitZero) {
  RunShape s = tiny_shape(1);
  s.model.tie_word_embeddings = true;
  OffloadRequest r = request(Tier::gpu, Tier::gpu);
  r.automatic = true;
  const Placement all = Placement::make(s, request(Tier::gpu, Tier::gpu), roomy());
  for (uint64_t cut = 0; cut < 6; ++cut) {
    TierBudgets b = roomy();
    b.gpu_memory = all.needs().total(Tier::gpu) - cut * (all.needs().total(Tier::gpu) / 16);
    const Placement p = Placement::make(s, r, b);
    EXPECT_EQ(p.homes.front().optimizer, p.homes.back().optimizer) << cut;
    EXPECT_EQ(p.homes.front().param, p.homes.back().param) << cut;
  }
}

TEST(Placement, Llama2_70bFiguresAreSane) {
  RunShape s;
  s.model = *find_preset("llama2-70b");
  s.ranks = 4;
  s.micro_batch = 1;
  s.seq_len = 4096;
  const uint64_t n = parameter_count(s.model);
  ASSERT_GT(n, 68'000'000'000ull);
  const Placement cpu = Placement::make(s, request(Tier::cpu, Tier::cpu, GradHome::cpu), roomy());
  const TierBytes t = cpu.needs();
  // P in bf16 (2 B) and O as master+m+v (12 B) per element, padding within 0.1%.
  EXPECT_GE(t.at(Tier::cpu, StateKind::parameters), 2 * n);
  EXPECT_LE(t.at(Tier::cpu, StateKind::parameters), 2 * n + 2 * n / 1000);
  EXPECT_GE(t.at(Tier::cpu, StateKind::optimizer), 12 * n);
  EXPECT_LE(t.at(Tier::cpu, StateKind::optimizer), 12 * n + 12 * n / 1000);
  EXPECT_GE(t.at(Tier::cpu, StateKind::gradients), 4 * n);  // f32 accumulators
  // Per GPU: no model state, but two gathered 70b blocks (856M elements: 1.6 GiB bf16 + 3.2
  // GiB of f32 gradients each) and the activations of 4096 tokens.
  EXPECT_EQ(t.at(Tier::gpu, StateKind::parameters), 0u);
  EXPECT_GT(t.at(Tier::gpu, StateKind::working), 8ull << 30);
  EXPECT_LT(t.at(Tier::gpu, StateKind::working), 12ull << 30);
  EXPECT_GT(t.at(Tier::gpu, StateKind::activations), 1ull << 30);
  EXPECT_LT(t.total(Tier::gpu), 24ull << 30);

  const Placement none = Placement::make(s, request(Tier::gpu, Tier::gpu), roomy());
  const TierBytes g = none.needs();
  EXPECT_GE(g.at(Tier::gpu, StateKind::parameters), 2 * n / 4);
  EXPECT_LE(g.at(Tier::gpu, StateKind::parameters), 2 * n / 4 + 2 * n / 4000);
  EXPECT_GE(g.at(Tier::gpu, StateKind::optimizer), 12 * n / 4);
  TierBudgets b = roomy();
  b.gpu_memory = 24ull << 30;
  expect_error([&] { none.check(b); }, {"gpu (per device)", "--offload-optimizer cpu"});

  // Gradients kept on 24 GiB GPUs where they fit: some units' are, the rest in host RAM,
  // and the placement fits.
  b.cpu_memory = 2ull << 40;
  const Placement some = Placement::make(s, request(Tier::cpu, Tier::cpu), b);
  EXPECT_NO_THROW(some.check(b));
  const TierBytes st = some.needs();
  EXPECT_GT(st.at(Tier::gpu, StateKind::gradients), 4ull << 30);  // of 17.5 GiB per device
  EXPECT_GT(st.at(Tier::cpu, StateKind::gradients), 0u);
  EXPECT_LT(st.at(Tier::cpu, StateKind::gradients), 4 * n - (4ull << 30) * 4);
  EXPECT_EQ(some.homes.front().grad, Tier::gpu);
  EXPECT_EQ(some.homes[40].grad, Tier::cpu);
}

}  // namespace
}  // namespace strata
