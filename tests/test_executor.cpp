// test_executor.cpp: the step executor on host devices. Same math wherever the state lives:
// every placement gives the all-GPU run's weights bit for bit, and the all-GPU run equals a
// plain loop over ZeroRunner and CpuAdam written here independently.
//
// STRATA_EXECUTOR_TEST_DEVICES=cuda runs the same suite on GPUs (ctest's ExecutorSuiteOnCuda,
// label `gpu`), one GPU per rank with NCCL between them: the CUDA kernels are deterministic and
// the device's optimizer gives CpuAdam's bits, so the same equalities hold. A test needing more
// GPUs than there are skips, saying so.
#include "core/device.h"
#include "gpu/runtime.h"
#include "cpu_adam/cpu_adam.h"
#include "model/config.h"
#include "model/llama.h"
#include "model/weights.h"
#include "partition/communicator.h"
#include "partition/zero.h"
#include "schedule/executor.h"
#include "schedule/trace.h"
#include "testing.h"

#include <gtest/gtest.h>
#include <sys/resource.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>

namespace strata {
namespace {

constexpr int kMicro = 2;
constexpr int64_t kBatch = 2, kSeq = 16;
constexpr int kSteps = 3;
constexpr uint64_t kDeviceMemory = 256ull << 20;

Backend test_backend() {
  const char* env = std::getenv("STRATA_EXECUTOR_TEST_DEVICES");
  return env != nullptr && std::string(env) == "cuda" ? Backend::cuda : Backend::host;
}

// Why `n` ranks cannot run here, or empty when they can.
std::string missing_devices(int n) {
  if (test_backend() == Backend::host) return {};
  const CudaRuntime& rt = cuda_runtime();
  if (static_cast<int>(rt.gpus.size()) >= n) return {};
  return fmt::format("{} ranks need {} GPUs, this machine has {} ({}: {})", n, n, rt.gpus.size(),
                     rt.status, rt.detail);
}

#define REQUIRE_DEVICES(n)                                                             \
  do {                                                                                 \
    if (const std::string why = missing_devices(n); !why.empty()) GTEST_SKIP() << why; \
  } while (0)

// Where a run costs many runs on plain host devices, the every-placement sweeps run each
// placement on one of their two rank counts, alternating, so every placement and both counts
// still run: on the CPU emulator of CUDA (CI's emu tests, about 20 times the cost) and under
// the sanitizers (TSan's purpose is the lanes' synchronisation and ASan's every buffer's bounds,
// which every placement still exercises, and each rank count's shard arithmetic). The Release
// build on host devices, and a real GPU, run every pair.
bool halve_sweeps() {
#if defined(STRATA_TEST_TSAN) || defined(STRATA_TEST_ASAN)
  return true;
#elif defined(STRATA_CUDA_EMU)
  return test_backend() == Backend::cuda;
#else
  return false;
#endif
}

struct Rig {
  std::vector<std::unique_ptr<Device>> devices;
  std::unique_ptr<Communicator> comm;
  explicit Rig(int n) {
    DeviceSpec spec;
    spec.backend = test_backend();
    for (int i = 0; i < n; ++i) spec.indices.push_back(i);
    devices = open_devices(spec, kDeviceMemory);
    std::vector<Device*> ptrs;
    for (auto& d : devices) ptrs.push_back(d.get());
    comm = make_communicator(ptrs);  // in-process on host devices, NCCL across GPUs
  }
};

LlamaConfig tiny(bool tied) {
  LlamaConfig c = *find_preset("tiny");
  c.tie_word_embeddings = tied;
  return c;
}

TierBudgets test_budgets() {
  TierBudgets budgets;
  budgets.gpu_memory = kDeviceMemory;
  budgets.cpu_memory = 8ull << 30;
  budgets.nvme_free = 8ull << 30;
  return budgets;
}

Placement make_placement(const LlamaConfig& c, int N, Tier p, Tier o, const std::string& dir,
                         uint64_t threshold = 0, int depth = 1, bool recompute = true,
                         GradHome grads = GradHome::automatic, int group = 1,
                         DType dtype = DType::f32, DType grad_dtype = DType::f32,
                         bool offload_activations = false,
                         OptimizerType optimizer = OptimizerType::adam) {
  RunShape shape;
  shape.model = c;
  shape.optimizer = optimizer;
  shape.ranks = N;
  shape.param_dtype = dtype;
  shape.grad_dtype = grad_dtype;
  shape.micro_batch = kBatch;
  shape.seq_len = kSeq;
  shape.persistence_threshold = threshold;
  shape.working_buffers = std::max(2, depth + 1);
  shape.recompute = recompute;
  shape.micro_batch_group = group;
  shape.offload_activations = offload_activations;
  OffloadRequest req;
  req.param = p;
  req.optimizer = o;
  req.buffer_count = 4;
  req.grads = grads;
  if (p == Tier::nvme || o == Tier::nvme || grads == GradHome::nvme) req.nvme_paths = {dir};
  req.nvme_stripe = 64 * 1024;  // small: the tiny model's shards span several stripes
  return Placement::make(shape, req, test_budgets());
}

// batches[step][m][r], deterministic, with a few ignored targets. With more than kMicro
// micro-batches, rank 0's last one is a single sequence (a short batch).
std::vector<std::vector<std::vector<HostBatch>>> make_batches(int N, int vocab,
                                                              int micro = kMicro) {
  std::mt19937 rng(1234);
  std::vector<std::vector<std::vector<HostBatch>>> out(kSteps);
  for (auto& step : out) {
    step.resize(static_cast<size_t>(micro));
    for (int m = 0; m < micro; ++m)
      for (int r = 0; r < N; ++r) {
        auto& mb = step[static_cast<size_t>(m)];
        HostBatch b;
        b.batch = micro > kMicro && m == micro - 1 && r == 0 ? 1 : kBatch;
        for (int64_t i = 0; i < b.batch * kSeq; ++i) {
          b.ids.push_back(static_cast<int32_t>(rng() % static_cast<uint32_t>(vocab)));
          b.targets.push_back(rng() % 11 == 0
                                  ? kIgnoreIndex
                                  : static_cast<int32_t>(rng() % static_cast<uint32_t>(vocab)));
        }
        mb.push_back(std::move(b));
      }
  }
  return out;
}

constexpr float kLr = 1e-2f;

// `clip`: a clip small enough that every step clips; else none.
StepParams step_params(int64_t step, bool clip = true,
                       OptimizerType optimizer = OptimizerType::adam) {
  StepParams p;
  p.step = step;
  p.adam.type = optimizer;
  p.adam.lr = kLr;
  p.adam.weight_decay = 0.1f;
  p.adam.adamw = optimizer != OptimizerType::adagrad;
  p.loss_scale = 8.0f;
  p.max_grad_norm = clip ? 0.05f : 0.0f;  // small: every step clips
  return p;
}

struct RunResult {
  std::vector<double> losses, norms;
  std::vector<std::vector<float>> master, params;
  double final_eval = 0;  // evaluate() on step 0's batches after the last step (executor runs)
  uint64_t act_high_water = 0;  // device 0's activations at their peak (executor runs)
};

int count_tasks(const Schedule& sc, TaskKind kind) {
  return static_cast<int>(std::count_if(sc.tasks.begin(), sc.tasks.end(),
                                        [&](const Task& t) { return t.kind == kind; }));
}

void expect_bits(const std::vector<float>& a, const std::vector<float>& b,
                 const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  size_t first = a.size();
  for (size_t i = 0; i < a.size() && first == a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], 4) != 0) first = i;
  EXPECT_EQ(first, a.size()) << what << ": first difference at " << first << ": " << a[first]
                             << " vs " << b[first];
}

std::string kinds(const Placement& pl, Device& d) {
  std::string out;
  const TierBytes nb = pl.needs();
  for (int k = 0; k < kStateKinds; ++k)
    out +=
        fmt::format(" need[{}]={}", state_kind_name(StateKind(k)), nb.at(Tier::gpu, StateKind(k)));
  const ArenaStats st = d.memory();
  for (int k = 0; k < kMemoryKinds; ++k)
    out += fmt::format(" hw[{}]={}", memory_kind_name(MemoryKind(k)),
                       st.high_water_by_kind[size_t(k)]);
  return out;
}

// An executor of `c` on N ranks with P and O homed as asked (NVMe in a directory of its own),
// kMicro micro-batches a step.
struct TestExecutor {
  test::TempDir dir{"strata-exec"};
  Rig rig;
  Placement pl;
  Schedule sc;
  Executor ex;
  TestExecutor(const LlamaConfig& c, int N, Tier p, Tier o, const ExecutorOptions& eo,
               uint64_t threshold = 0, GradHome grads = GradHome::automatic)
      : rig(N),
        pl(make_placement(c, N, p, o, dir.path.string(), threshold, 1, true, grads)),
        sc(Schedule::build(pl, micro_batches(kMicro))),
        ex(pl, sc, *rig.comm, eo) {}
  static ScheduleOptions micro_batches(int n) {
    ScheduleOptions so;
    so.micro_batches = n;
    return so;
  }
};

// Micro-batches per step and how many run unit by unit at once (RunShape::micro_batch_group);
// whether the steps clip (step_params) and whether CPU Adam updates each unit during the
// backward (ScheduleOptions::update_during_backward, which needs no clipping).
struct Micro {
  int batches = kMicro;
  int group = 1;
  bool clip = true;
  bool early = false;
  bool per_group = false;                         // ScheduleOptions::reduce_per_group
  DType dtype = DType::f32;                       // the parameters' (RunShape::param_dtype)
  DType grad_dtype = DType::f32;                  // RunShape::grad_dtype
  bool offload_activations = false;               // RunShape::offload_activations
  OptimizerType optimizer = OptimizerType::adam;  // RunShape::optimizer, StepParams::adam.type
};

// `grads`: automatic keeps the gradients of an offloaded optimizer on the (roomy) devices.
RunResult run_executor(const LlamaConfig& c, int N, Tier p, Tier o, uint64_t threshold = 0,
                       int depth = 1, bool recompute = true, GradHome grads = GradHome::automatic,
                       Micro micro = {}) {
  const test::TempDir dir("strata-exec");
  Rig rig(N);
  const Placement pl =
      make_placement(c, N, p, o, dir.path.string(), threshold, depth, recompute, grads, micro.group,
                     micro.dtype, micro.grad_dtype, micro.offload_activations, micro.optimizer);
  for (size_t u = 0; u < pl.homes.size(); ++u) {
    const UnitHomes& h = pl.homes[u];
    const bool off = h.optimizer != Tier::gpu;
    const bool replicated = pl.partition.units[u].replicated;
    EXPECT_EQ(h.grad, off && grads == GradHome::cpu                  ? Tier::cpu
                      : off && grads == GradHome::nvme && replicated ? Tier::cpu
                      : off && grads == GradHome::nvme               ? Tier::nvme
                                                                     : Tier::gpu);
  }
  ScheduleOptions so;
  so.micro_batches = micro.batches;
  so.prefetch_depth = depth;
  so.update_during_backward = micro.early;
  so.reduce_per_group = micro.per_group;
  const Schedule sc = Schedule::build(pl, so);
  EXPECT_EQ(sc.micro_batch_group, std::min(micro.group, micro.batches));
  ExecutorOptions eo;
  eo.record = true;
  eo.cpu_adam_threads = 2;
  Executor ex(pl, sc, *rig.comm, eo);
  ex.init_random(42);
  const auto batches = make_batches(N, c.vocab_size, micro.batches);
  RunResult out;
  for (int s = 0; s < kSteps; ++s) {
    // A forward-only pass over the step's batches sees the parameters the step's forward does,
    // so it gives the step's loss bit for bit; and it writes nothing, which the final weights
    // (equal to the reference loop's, which never evaluates) show.
    const EvalResult e = ex.evaluate(batches[static_cast<size_t>(s)]);
    const StepResult r =
        ex.step(batches[static_cast<size_t>(s)], step_params(s + 1, micro.clip, micro.optimizer));
    EXPECT_EQ(e.loss(), r.loss) << "step " << s;
    EXPECT_GT(e.targets, 0);
    EXPECT_FALSE(r.skipped);
    if (micro.clip) {
      EXPECT_GT(r.grad_norm, 0.05) << "the test wants clipping active";
    }
    EXPECT_EQ(r.lane_busy_s.size(), sc.lanes.size());
    out.losses.push_back(r.loss);
    out.norms.push_back(r.grad_norm);
  }
  out.final_eval = ex.evaluate(batches[0]).loss();
  EXPECT_NE(out.final_eval, out.losses[0]) << "three steps changed nothing";
  for (int u = 0; u < static_cast<int>(pl.homes.size()); ++u) {
    const UnitOptimizerState st = ex.optimizer_state(u);
    // The moments the optimizer keeps, and only those (core/optimizer.h).
    EXPECT_EQ(st.m.size(), optimizer_keeps_m(micro.optimizer) ? st.master.size() : 0) << u;
    EXPECT_EQ(st.v.size(), optimizer_keeps_v(micro.optimizer) ? st.master.size() : 0) << u;
    out.master.push_back(st.master);
    out.params.push_back(ex.parameters(u));
  }
  const std::string name = fmt::format("P {} O {} N {}", tier_name(p), tier_name(o), N);
  out.act_high_water = rig.devices[0]->memory().high_water_by_kind[size_t(MemoryKind::activations)];
  if (micro.offload_activations) {
    const int K = checkpoint_slots(pl.shape);
    const int n = offloaded_checkpoints(c, K);
    EXPECT_EQ(count_tasks(sc, TaskKind::act_d2h), n * micro.batches * N) << name;
    EXPECT_EQ(count_tasks(sc, TaskKind::act_h2d), n * micro.batches * N) << name;
  }
  EXPECT_NO_THROW(check_timeline(sc, ex.timeline())) << name;
  EXPECT_EQ(ex.timeline().steps, kSteps);
  const ExecutorMemory mem = ex.memory();
  {
    // Beyond the placement's count: the executor's own extras (token ids and targets, chunk
    // sums) and, with several ranks, the in-process communicator's staging (host devices;
    // NCCL needs none): a shard for a reduce-scatter, two 256-byte aligned slices for an
    // all-reduce of a replicated unit (see partition/inprocess_communicator.cpp).
    uint64_t comm_staging = 0;
    auto r256 = [](uint64_t b) { return (b + 255) / 256 * 256; };
    if (N > 1)
      for (const UnitPartition& up : pl.partition.units)
        comm_staging = std::max(comm_staging, up.replicated ? 2 * r256((up.numel + N - 1) / N * 4)
                                                            : r256(up.shard * 4));
    const uint64_t need = pl.needs().total(Tier::gpu) + mem.device_extra_bytes + comm_staging;
    for (auto& d : rig.devices)
      EXPECT_LE(d->memory().high_water, need) << name << " on " << d->name() << kinds(pl, *d);
  }
  EXPECT_LE(mem.pinned_peak, mem.pinned_capacity) << name;
  // No more page-locked memory than the placement counts (pin_memory on: its buffers and the
  // cpu-homed P and G, never CPU Adam's state, which no device copies).
  EXPECT_LE(mem.pinned_capacity, pl.pinned_need()) << name;
  // Every buffer handed to the swap store (each rank's part of a pinned buffer, the loading
  // and read-back copies) is page aligned, so the store never makes its own pool of bounce
  // buffers, pinned memory outside the placement. With N = 3 and 128-element shards the ranks'
  // parts were not, nor were the heap vectors of init_random and master().
  EXPECT_EQ(mem.swap_bounce_bytes, 0u) << name;
  return out;
}

// The reference: ZeroRunner forward/backward per micro-batch, then CpuAdam by hand on the
// shards copied to the host, the stats summed in (unit, rank) order.
RunResult run_reference(const LlamaConfig& c, int N, uint64_t threshold = 0) {
  Rig rig(N);
  const ModelLayout layout = ModelLayout::build(c);
  ZeroOptions zo;
  zo.persistence_threshold = threshold;
  ZeroModel zero(layout, *rig.comm, zo);
  zero.init_random(42);
  zero.zero_grads();
  ModelOptions mo;
  mo.max_batch = kBatch;
  mo.seq_len = kSeq;
  std::vector<std::unique_ptr<LlamaModel>> models;
  std::vector<LlamaModel*> ptrs;
  std::vector<std::unique_ptr<Stream>> streams;
  std::vector<Stream*> sp;
  std::vector<DeviceBuffer> ids, tgs;
  for (int r = 0; r < N; ++r) {
    Device& d = *rig.devices[static_cast<size_t>(r)];
    models.push_back(std::make_unique<LlamaModel>(c, mo, d));
    ptrs.push_back(models.back().get());
    streams.push_back(d.create_stream("reference"));
    sp.push_back(streams.back().get());
    ids.emplace_back(d, kBatch * kSeq * 4, "ids");
    tgs.emplace_back(d, kBatch * kSeq * 4, "targets");
  }
  ZeroRunner runner(zero, ptrs);
  const Partition& part = zero.partition();
  const int U = part.num_units();
  // master, m, v per (unit, rank): the parameters in f32, zeros.
  std::vector<std::vector<std::vector<float>>> master(static_cast<size_t>(U)), m1(master.size()),
      v1(master.size());
  for (int u = 0; u < U; ++u)
    for (int r = 0; r < N; ++r) {
      const uint64_t n = part.units[static_cast<size_t>(u)].shard;
      std::vector<float> x(n);
      rig.devices[static_cast<size_t>(r)]->copy_to_host(x.data(), zero.param_shard(u, r).data,
                                                        n * 4, *sp[static_cast<size_t>(r)]);
      sp[static_cast<size_t>(r)]->synchronize();
      master[static_cast<size_t>(u)].push_back(x);
      m1[static_cast<size_t>(u)].emplace_back(n, 0.0f);
      v1[static_cast<size_t>(u)].emplace_back(n, 0.0f);
    }
  CpuAdamOptions ao;
  ao.threads = 2;
  CpuAdam adam(ao);
  const auto batches = make_batches(N, c.vocab_size);
  RunResult out;
  for (int s = 0; s < kSteps; ++s) {
    const StepParams prm = step_params(s + 1);
    int64_t count = 0;
    for (const auto& mb : batches[static_cast<size_t>(s)])
      for (const HostBatch& b : mb)
        for (int32_t t : b.targets) count += t != kIgnoreIndex ? 1 : 0;
    const float scale = prm.loss_scale / static_cast<float>(count);
    double sum = 0;
    for (const auto& mb : batches[static_cast<size_t>(s)]) {
      std::vector<RankBatch> rb;
      for (int r = 0; r < N; ++r) {
        const HostBatch& b = mb[static_cast<size_t>(r)];
        Device& d = *rig.devices[static_cast<size_t>(r)];
        d.copy_to_device(ids[static_cast<size_t>(r)].data(), b.ids.data(), b.ids.size() * 4,
                         *sp[static_cast<size_t>(r)]);
        d.copy_to_device(tgs[static_cast<size_t>(r)].data(), b.targets.data(), b.targets.size() * 4,
                         *sp[static_cast<size_t>(r)]);
        rb.push_back({static_cast<const int32_t*>(ids[static_cast<size_t>(r)].data()),
                      static_cast<const int32_t*>(tgs[static_cast<size_t>(r)].data()), b.batch});
      }
      runner.forward(rb, sp);
      for (int r = 0; r < N; ++r) {
        std::vector<float> l(static_cast<size_t>(kBatch * kSeq));
        rig.devices[static_cast<size_t>(r)]->copy_to_host(
            l.data(), ptrs[static_cast<size_t>(r)]->losses(kBatch).data, l.size() * 4,
            *sp[static_cast<size_t>(r)]);
        sp[static_cast<size_t>(r)]->synchronize();
        for (float x : l) sum += x;
      }
      runner.backward(rb, scale, sp);
      for (Stream* st : sp) st->synchronize();
    }
    out.losses.push_back(sum / static_cast<double>(count));
    std::vector<std::vector<std::vector<float>>> grads(static_cast<size_t>(U));
    GradStats global;
    for (int u = 0; u < U; ++u)
      for (int r = 0; r < N; ++r) {
        const uint64_t n = part.units[static_cast<size_t>(u)].shard;
        std::vector<float> g(n);
        rig.devices[static_cast<size_t>(r)]->copy_to_host(g.data(), zero.grad_shard(u, r).data,
                                                          n * 4, *sp[static_cast<size_t>(r)]);
        sp[static_cast<size_t>(r)]->synchronize();
        // A replicated unit's gradients are the same sum on every rank: counted once.
        if (!part.units[static_cast<size_t>(u)].replicated || r == 0)
          global += adam.grad_stats(GradShard{g.data(), DType::f32, n});
        grads[static_cast<size_t>(u)].push_back(std::move(g));
      }
    out.norms.push_back(std::sqrt(global.sum_squares) / prm.loss_scale);
    const float gscale = combined_grad_scale(global, prm.loss_scale, prm.max_grad_norm);
    for (int u = 0; u < U; ++u)
      for (int r = 0; r < N; ++r) {
        const auto i = static_cast<size_t>(u), k = static_cast<size_t>(r);
        const uint64_t n = part.units[i].shard;
        // Weight decay on matrices and embeddings, not on the 1-D norm weights: update a copy
        // without decay and take its elements where a norm weight lies.
        std::vector<float> m0 = master[i][k], a0 = m1[i][k], b0 = v1[i][k];
        const AdamShard sh{master[i][k].data(), m1[i][k].data(), v1[i][k].data(), n};
        EXPECT_TRUE(adam.update(sh, GradShard{grads[i][k].data(), DType::f32, n}, prm.step,
                                prm.adam, gscale, global));
        AdamParams no_decay = prm.adam;
        no_decay.weight_decay = 0.0f;
        EXPECT_TRUE(adam.update(AdamShard{m0.data(), a0.data(), b0.data(), n},
                                GradShard{grads[i][k].data(), DType::f32, n}, prm.step, no_decay,
                                gscale, global));
        const uint64_t first = part.units[i].shard_offset(r);
        for (const ParamSlot& ps : layout.units[i].params) {
          if (ps.shape.rank != 1) continue;
          for (uint64_t e = ps.offset; e < ps.offset + static_cast<uint64_t>(ps.numel()); ++e)
            if (e >= first && e < first + n) {
              master[i][k][e - first] = m0[e - first];
              m1[i][k][e - first] = a0[e - first];
              v1[i][k][e - first] = b0[e - first];
            }
        }
        rig.devices[k]->copy_to_device(zero.param_shard(u, r).data, master[i][k].data(), n * 4,
                                       *sp[k]);
        sp[k]->synchronize();
      }
    zero.zero_grads();
  }
  for (int u = 0; u < U; ++u) {
    const UnitPartition& up = part.units[static_cast<size_t>(u)];
    std::vector<float> all(up.padded);
    for (int r = 0; r < N; ++r)
      std::copy(master[static_cast<size_t>(u)][static_cast<size_t>(r)].begin(),
                master[static_cast<size_t>(u)][static_cast<size_t>(r)].end(),
                all.begin() + static_cast<std::ptrdiff_t>(up.shard_offset(r)));
    all.resize(up.numel);
    out.master.push_back(all);
    out.params.push_back(zero.download_unit(u, false));
  }
  return out;
}

void expect_same(const RunResult& a, const RunResult& b, const std::string& what) {
  ASSERT_EQ(a.master.size(), b.master.size());
  if (a.final_eval != 0 && b.final_eval != 0) {
    EXPECT_EQ(a.final_eval, b.final_eval) << what << " evaluation after the last step";
  }
  for (size_t u = 0; u < a.master.size(); ++u) {
    expect_bits(a.master[u], b.master[u], what + fmt::format(" master of unit {}", u));
    expect_bits(a.params[u], b.params[u], what + fmt::format(" parameters of unit {}", u));
  }
}

class ExecutorPlacements : public ::testing::TestWithParam<int> {};

TEST_P(ExecutorPlacements, EveryPlacementGivesTheAllGpuBits) {
  const int N = GetParam();
  REQUIRE_DEVICES(N);
  const LlamaConfig c = tiny(false);
  const RunResult gpu = run_executor(c, N, Tier::gpu, Tier::gpu);
  const RunResult ref = run_reference(c, N);
  ASSERT_EQ(gpu.losses.size(), ref.losses.size());
  for (size_t s = 0; s < ref.losses.size(); ++s) {
    EXPECT_EQ(gpu.losses[s], ref.losses[s]) << "step " << s;
    EXPECT_EQ(gpu.norms[s], ref.norms[s]) << "step " << s;
  }
  expect_same(gpu, ref, "all-GPU executor vs reference loop:");
  for (Tier p : {Tier::gpu, Tier::cpu, Tier::nvme})
    for (Tier o : {Tier::gpu, Tier::cpu, Tier::nvme})
      for (GradHome g : {GradHome::automatic, GradHome::cpu}) {
        // Gradients of an offloaded optimizer summed on the device and brought down once per
        // step (automatic, with room), or every micro-batch's added in host RAM (cpu).
        if ((p == Tier::gpu && o == Tier::gpu) || (o == Tier::gpu && g == GradHome::cpu)) continue;
        const std::string what =
            fmt::format("P {} O {} G {}", tier_name(p), tier_name(o), grad_home_name(g));
        SCOPED_TRACE(what);
        const RunResult r = run_executor(c, N, p, o, 0, 1, true, g);
        for (size_t s = 0; s < r.losses.size(); ++s) EXPECT_EQ(r.losses[s], gpu.losses[s]);
        expect_same(r, gpu, what + ":");
      }
}

INSTANTIATE_TEST_SUITE_P(Ranks, ExecutorPlacements, ::testing::Values(1, 3));

// 16-bit gradients (`strata train --grad-dtype bf16`, with bf16 parameters): every home of the
// parameters, optimizer and gradients trains to the all-GPU run's bits, on 1 and 3 ranks, and
// the gradients are half the f32 run's bytes wherever they live.
TEST(Executor, SixteenBitGradientsTrainToTheSameBitsInEveryTier) {
  const LlamaConfig c = tiny(false);
  Micro bf16, f32_grads;
  bf16.dtype = bf16.grad_dtype = f32_grads.dtype = DType::bf16;
  for (int N : {1, 3}) {
    REQUIRE_DEVICES(N);
    const RunResult gpu =
        run_executor(c, N, Tier::gpu, Tier::gpu, 0, 1, true, GradHome::automatic, bf16);
    EXPECT_NEAR(gpu.losses.front(), std::log(static_cast<double>(c.vocab_size)), 1.0);
    // Against the same run with f32 gradients: other bits, the same training to bf16's
    // rounding (Adam's steps on near-zero gradients can flip, so the losses are compared, not
    // the weights one by one).
    const RunResult wide =
        run_executor(c, N, Tier::gpu, Tier::gpu, 0, 1, true, GradHome::automatic, f32_grads);
    EXPECT_NE(gpu.master[1], wide.master[1]);
    for (size_t s = 0; s < gpu.losses.size(); ++s)
      EXPECT_NEAR(gpu.losses[s], wide.losses[s], 2e-3 * wide.losses[s])
          << "N " << N << " step " << s;
    for (const auto& [p, o, g] : {std::tuple{Tier::cpu, Tier::cpu, GradHome::cpu},
                                  {Tier::cpu, Tier::cpu, GradHome::automatic},
                                  {Tier::nvme, Tier::nvme, GradHome::cpu},
                                  {Tier::gpu, Tier::cpu, GradHome::cpu}}) {
      const std::string what =
          fmt::format("N {} P {} O {} G {}", N, tier_name(p), tier_name(o), grad_home_name(g));
      SCOPED_TRACE(what);
      expect_same(run_executor(c, N, p, o, 0, 1, true, g, bf16), gpu, what + ":");
    }
    const test::TempDir dir("strata-exec-bf16");
    const Placement half = make_placement(c, N, Tier::cpu, Tier::cpu, dir.path.string(), 0, 1, true,
                                          GradHome::cpu, 1, DType::bf16, DType::bf16);
    const Placement full = make_placement(c, N, Tier::cpu, Tier::cpu, dir.path.string(), 0, 1, true,
                                          GradHome::cpu, 1, DType::bf16, DType::f32);
    EXPECT_LT(half.needs().at(Tier::cpu, StateKind::gradients),
              full.needs().at(Tier::cpu, StateKind::gradients) * 6 / 10);
  }
}

// Qwen2's biases on q, k and v (with tied embeddings, as its small models have), and Qwen3's q
// and k norms (with attention_bias, untied): the executor trains them to the reference loop's
// bits, and every home of the parameters and optimizer to the all-GPU run's. The biases start
// at 0, so from the second step on they change the forward.
TEST(Executor, BiasedProjectionsTrainToTheSameBitsInEveryTier) {
  LlamaConfig qwen2 = tiny(true);
  qwen2.architecture = Architecture::qwen2;
  qwen2.qkv_bias = true;
  LlamaConfig qwen3 = tiny(false);
  qwen3.architecture = Architecture::qwen3;
  qwen3.qk_norm = qwen3.qkv_bias = qwen3.o_bias = true;
  for (int N : {1, 3})
    for (const LlamaConfig& c : {qwen2, qwen3}) {
      REQUIRE_DEVICES(N);
      SCOPED_TRACE(architecture_class(c.architecture));
      const RunResult gpu = run_executor(c, N, Tier::gpu, Tier::gpu);
      const RunResult ref = run_reference(c, N);
      ASSERT_EQ(gpu.losses.size(), ref.losses.size());
      for (size_t s = 0; s < ref.losses.size(); ++s) EXPECT_EQ(gpu.losses[s], ref.losses[s]);
      expect_same(gpu, ref, fmt::format("N {} all-GPU executor vs reference loop:", N));
      // The biases moved: their master copies are not all zero after the steps.
      const ModelLayout layout = ModelLayout::build(c);
      const ParamSlot& qb = layout.units[1].slot("q_proj.bias");
      bool moved = false;
      for (int64_t i = 0; i < qb.numel(); ++i)
        moved = moved || gpu.master[1][qb.offset + i] != 0.0f;
      EXPECT_TRUE(moved) << "the q bias never left 0";
      for (const auto& [p, o] :
           {std::pair{Tier::cpu, Tier::cpu}, {Tier::nvme, Tier::nvme}, {Tier::gpu, Tier::cpu}}) {
        const std::string what = fmt::format("N {} P {} O {}", N, tier_name(p), tier_name(o));
        SCOPED_TRACE(what);
        expect_same(run_executor(c, N, p, o), gpu, what + ":");
      }
    }
}

// Generation through the executor (RunShape::kv_cache, as `strata generate --offload-param`
// places it): a prompt, single tokens and a restart from an earlier position give the logits of
// a resident model decoding on one device, wherever the parameters live and over 1 or 3 ranks
// (rank 0 decodes, the others take part in the gathers). Bit for bit on host devices. Bad
// positions and ids are refused by name.
TEST(Executor, DecodesWithAKvCacheToTheResidentModelsLogits) {
  constexpr int64_t T = 12;
  // (ids, pos) of each call: a prompt, three tokens one by one, a restart at position 2.
  const std::vector<std::pair<std::vector<int32_t>, int64_t>> calls = {
      {{5, 17, 3, 200, 9}, 0}, {{41}, 5}, {{7}, 6}, {{250}, 7}, {{1, 2, 3}, 2}, {{99}, 5}};
  for (int N : {1, 3}) {
    REQUIRE_DEVICES(N);
    // untied, tied, untied in three vocabulary pieces, tied in three
    for (int variant : {0, 1, 2, 3}) {
      const bool tied = variant == 1 || variant == 3;
      LlamaConfig c = tiny(tied);
      if (variant >= 2) c.vocab_pieces = 3;
      std::vector<std::vector<float>> want;
      {
        Rig rig(1);
        Device& d = *rig.devices[0];
        ModelOptions mo;
        mo.seq_len = T;
        mo.forward_only = true;
        mo.kv_cache = true;
        LlamaModel model(c, mo, d);
        ResidentWeights w(model.layout(), d, DType::f32, DType::f32, false);
        auto st = d.create_stream("reference");
        w.init_random(42, *st);
        DeviceBuffer ids(d, T * 4, "ids"), logits(d, c.vocab_size * 4, "logits");
        for (const auto& [tokens, pos] : calls) {
          d.copy_to_device(ids.data(), tokens.data(), tokens.size() * 4, *st);
          model.decode(w.units(), static_cast<int32_t*>(ids.data()), pos,
                       static_cast<int64_t>(tokens.size()),
                       logits.view(DType::f32, {1, c.vocab_size}), *st);
          std::vector<float> l(static_cast<size_t>(c.vocab_size));
          d.copy_to_host(l.data(), logits.data(), l.size() * 4, *st);
          st->synchronize();
          want.push_back(std::move(l));
        }
      }
      for (Tier p : {Tier::gpu, Tier::cpu, Tier::nvme}) {
        const std::string name =
            fmt::format("N {} tied {} pieces {} P {}", N, tied, c.vocab_pieces, tier_name(p));
        SCOPED_TRACE(name);
        const test::TempDir dir("strata-exec-decode");
        RunShape shape;
        shape.model = c;
        shape.ranks = N;
        shape.param_dtype = DType::f32;
        shape.grad_dtype = DType::f32;
        shape.micro_batch = 1;
        shape.seq_len = T;
        shape.persistence_threshold = 0;
        shape.working_buffers = 2;
        shape.training = false;
        shape.kv_cache = true;
        OffloadRequest req;
        req.param = p;
        req.buffer_count = 4;
        if (p == Tier::nvme) req.nvme_paths = {dir.path.string()};
        req.nvme_stripe = 64 * 1024;
        const Placement pl = Placement::make(shape, req, test_budgets());
        ScheduleOptions fo;
        fo.forward_only = true;
        Rig rig(N);
        Executor ex(pl, Schedule::build(pl, fo), *rig.comm);
        ex.init_random(42);
        for (size_t i = 0; i < calls.size(); ++i) {
          const std::vector<float>& got = ex.decode(calls[i].first, calls[i].second);
          if (test_backend() == Backend::host) {
            expect_bits(got, want[i], fmt::format("{} call {}", name, i));
          } else {  // cuBLASLt may pick another algorithm for other pointers
            double worst = 0, scale = 0;
            for (size_t v = 0; v < got.size(); ++v) {
              worst = std::max(worst, std::abs(double(got[v]) - want[i][v]));
              scale = std::max(scale, std::abs(double(want[i][v])));
            }
            EXPECT_LE(worst, 1e-5 * scale) << "call " << i;
          }
        }
        for (auto& dv : rig.devices)
          EXPECT_LE(dv->memory().high_water,
                    pl.needs().total(Tier::gpu) + ex.memory().device_extra_bytes)
              << dv->name() << kinds(pl, *dv);
        test::expect_error([&] { ex.decode({1, 2}, 11); }, {"positions [11, 13)", "12 positions"});
        test::expect_error([&] { ex.decode({static_cast<int32_t>(c.vocab_size)}, 0); },
                           {"outside the vocabulary"});
        test::expect_error([&] { ex.decode({1}, 9); }, {"position 9 follows only 6 cached"});
      }
    }
  }
}

// A placement of the parameters alone (RunShape::training off, as `strata eval` places them):
// the executor allocates no gradients, optimizer state or activation gradients, and its
// forward-only pass gives the training executor's evaluation bit for bit wherever the
// parameters live, within the placement's smaller GPU figure. What needs training state is
// refused.
TEST(Executor, ParametersOnlyEvaluateToTheTrainingExecutorsBits) {
  for (int N : {1, 3}) {
    REQUIRE_DEVICES(N);
    for (bool tied : {false, true}) {
      const LlamaConfig c = tiny(tied);
      const auto batches = make_batches(N, c.vocab_size);
      ScheduleOptions so;
      so.micro_batches = kMicro;
      double reference = 0;
      uint64_t training_high_water = 0;
      std::vector<std::vector<float>> params;
      {
        Rig rig(N);
        const Placement pl = make_placement(c, N, Tier::gpu, Tier::gpu, "");
        Executor ex(pl, Schedule::build(pl, so), *rig.comm);
        ex.init_random(42);
        reference = ex.evaluate(batches[0]).loss();
        for (int u = 0; u < static_cast<int>(pl.homes.size()); ++u)
          params.push_back(ex.parameters(u));
        training_high_water = rig.devices[0]->memory().high_water;
      }
      for (Tier p : {Tier::gpu, Tier::cpu, Tier::nvme}) {
        const std::string name = fmt::format("N {} tied {} P {}", N, tied, tier_name(p));
        SCOPED_TRACE(name);
        const test::TempDir dir("strata-exec-eval");
        // The optimizer asked for NVMe: ignored (there is none), so it needs no nvme path.
        const Placement training = make_placement(c, N, p, Tier::gpu, dir.path.string());
        RunShape shape = training.shape;
        shape.training = false;
        OffloadRequest req = training.request;
        req.optimizer = Tier::nvme;
        if (p != Tier::nvme) req.nvme_paths.clear();
        const Placement pl = Placement::make(shape, req, test_budgets());
        const TierBytes need = pl.needs();
        for (Tier t : {Tier::gpu, Tier::cpu, Tier::nvme}) {
          EXPECT_EQ(need.at(t, StateKind::gradients), 0u) << tier_name(t);
          EXPECT_EQ(need.at(t, StateKind::optimizer), 0u) << tier_name(t);
        }
        for (const UnitHomes& h : pl.homes) EXPECT_EQ(h.optimizer, Tier::gpu);
        EXPECT_LT(need.total(Tier::gpu), training.needs().total(Tier::gpu));
        EXPECT_EQ(pl.pinned_buffers > 0, p != Tier::gpu);
        EXPECT_THROW(Schedule::build(pl, so), Error);  // a training schedule needs training state

        ScheduleOptions fo = so;
        fo.forward_only = true;
        const Schedule sc = Schedule::build(pl, fo);
        Rig rig(N);
        Executor ex(pl, sc, *rig.comm);
        ex.init_random(42);
        EXPECT_EQ(ex.evaluate(batches[0]).loss(), reference);
        EXPECT_EQ(ex.evaluate(batches[0]).loss(), reference) << "a second pass";
        for (int u = 0; u < static_cast<int>(pl.homes.size()); ++u)
          expect_bits(ex.parameters(u), params[static_cast<size_t>(u)],
                      fmt::format("{} unit {}", name, u));
        const ExecutorMemory mem = ex.memory();
        for (auto& d : rig.devices) {
          const ArenaStats st = d->memory();
          EXPECT_EQ(st.high_water_by_kind[size_t(MemoryKind::gradients)], 0u) << d->name();
          EXPECT_EQ(st.high_water_by_kind[size_t(MemoryKind::optimizer)], 0u) << d->name();
          EXPECT_EQ(st.high_water_by_kind[size_t(MemoryKind::communication)], 0u) << d->name();
          EXPECT_LE(st.high_water, need.total(Tier::gpu) + mem.device_extra_bytes)
              << d->name() << kinds(pl, *d);
          EXPECT_LT(st.high_water, training_high_water) << d->name();
        }
        EXPECT_LE(mem.pinned_capacity, pl.pinned_need());
        EXPECT_EQ(mem.swap_bounce_bytes, 0u);
        try {
          ex.step(batches[0], step_params(1));
          ADD_FAILURE() << "a training step on a parameters-only executor ran";
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("parameters only"), std::string::npos) << e.what();
        }
        EXPECT_THROW(ex.master(0), Error);
        EXPECT_THROW(ex.set_optimizer_state(0, {}), Error);
      }
    }
  }
}

TEST(Executor, TiedEmbeddings) {
  REQUIRE_DEVICES(2);
  const LlamaConfig c = tiny(true);
  const RunResult gpu = run_executor(c, 2, Tier::gpu, Tier::gpu);
  const RunResult ref = run_reference(c, 2);
  expect_same(gpu, ref, "tied all-GPU vs reference:");
  const RunResult off = run_executor(c, 2, Tier::cpu, Tier::nvme);
  expect_same(off, gpu, "tied P cpu O nvme:");
}

TEST(Executor, ReplicatedUnits) {
  REQUIRE_DEVICES(2);
  // 40,000 elements: the embedding and the head stay whole on every rank, the blocks are
  // sharded.
  const uint64_t threshold = 40000;
  const LlamaConfig c = tiny(false);
  const RunResult gpu = run_executor(c, 2, Tier::gpu, Tier::gpu, threshold);
  const RunResult ref = run_reference(c, 2, threshold);
  for (size_t s = 0; s < ref.losses.size(); ++s) EXPECT_EQ(gpu.losses[s], ref.losses[s]);
  expect_same(gpu, ref, "replicated all-GPU vs reference:");
  for (auto [p, o] : {std::pair{Tier::cpu, Tier::cpu}, std::pair{Tier::nvme, Tier::nvme},
                      std::pair{Tier::gpu, Tier::cpu}})
    for (GradHome g : {GradHome::automatic, GradHome::cpu}) {
      const RunResult r = run_executor(c, 2, p, o, threshold, 1, true, g);
      expect_same(
          r, gpu,
          fmt::format("replicated P {} O {} G {}:", tier_name(p), tier_name(o), grad_home_name(g)));
    }
}

TEST(Executor, TiedEmbeddingsWithReplicatedUnits) {
  REQUIRE_DEVICES(2);
  // The head adds into a replicated embedding's working gradients, which are a buffer of the
  // unit's own: with the embedding and head replicated, and with every unit replicated (the
  // comm lanes then run nothing but all-reduces, so no gather orders the compute lane behind
  // them), each micro-batch's first backward into them must wait for the previous all-reduce.
  // Before it did, `strata train` lost gradients of the tied table in ~1 run of 6 and
  // deadlocked on two devices.
  const LlamaConfig c = tiny(true);
  for (const uint64_t threshold : {uint64_t{40000}, uint64_t{1} << 40})
    for (const int N : {1, 2}) {
      SCOPED_TRACE(fmt::format("threshold {} N {}", threshold, N));
      const RunResult gpu = run_executor(c, N, Tier::gpu, Tier::gpu, threshold);
      const RunResult ref = run_reference(c, N, threshold);
      for (size_t s = 0; s < ref.losses.size(); ++s) EXPECT_EQ(gpu.losses[s], ref.losses[s]);
      expect_same(gpu, ref, "tied replicated all-GPU vs reference:");
    }
}

TEST(Executor, DeepPrefetchGivesTheSameBits) {
  REQUIRE_DEVICES(2);
  // A prefetch as deep as the model: the gathers of a unit's backward are emitted before its
  // forward has run, so every consumer must read from the gather it depends on.
  const LlamaConfig c = tiny(false);
  const RunResult gpu = run_executor(c, 2, Tier::gpu, Tier::gpu);
  for (int depth : {2, 3, 5})
    for (auto [p, o] : {std::pair{Tier::gpu, Tier::gpu}, std::pair{Tier::nvme, Tier::nvme},
                        std::pair{Tier::cpu, Tier::gpu}}) {
      const RunResult r = run_executor(c, 2, p, o, 0, depth);
      expect_same(r, gpu, fmt::format("depth {} P {} O {}:", depth, tier_name(p), tier_name(o)));
    }
}

TEST(Executor, WithoutRecomputeGivesTheSameBits) {
  REQUIRE_DEVICES(2);
  // Blocks keeping their activations (activation checkpointing off) run the same kernels on
  // the same inputs, with two micro-batches and an evaluation before each step writing the
  // same kept buffers in between.
  const LlamaConfig c = tiny(false);
  const RunResult gpu = run_executor(c, 2, Tier::gpu, Tier::gpu);
  for (auto [p, o] : {std::pair{Tier::gpu, Tier::gpu}, std::pair{Tier::nvme, Tier::cpu}}) {
    const RunResult r = run_executor(c, 2, p, o, 0, 1, false);
    expect_same(r, gpu, fmt::format("no recompute, P {} O {}:", tier_name(p), tier_name(o)));
  }
}

// Lion and Adagrad keep one moment beside the master (8 bytes an element, Adam 12): every home
// of P and O, with the gradients in host RAM once, on 1 and 3 ranks, gives the all-GPU run's
// bits, and host RAM holds two thirds of Adam's optimizer state.
TEST(Executor, LionAndAdagradTrainToTheSameBitsInEveryTier) {
  REQUIRE_DEVICES(3);
  const LlamaConfig c = tiny(false);
  for (const OptimizerType type : {OptimizerType::lion, OptimizerType::adagrad}) {
    Micro micro;
    micro.optimizer = type;
    for (const int N : {1, 3}) {
      if (halve_sweeps() && N == 1) continue;
      const RunResult base =
          run_executor(c, N, Tier::gpu, Tier::gpu, 0, 1, true, GradHome::automatic, micro);
      int k = 0;
      for (auto [p, o, g] : {std::tuple{Tier::gpu, Tier::cpu, GradHome::automatic},
                             std::tuple{Tier::cpu, Tier::cpu, GradHome::cpu},
                             std::tuple{Tier::cpu, Tier::nvme, GradHome::automatic},
                             std::tuple{Tier::nvme, Tier::gpu, GradHome::automatic},
                             std::tuple{Tier::nvme, Tier::nvme, GradHome::nvme}}) {
        if (halve_sweeps() && (k++ + static_cast<int>(type)) % 2 != 0) continue;
        const std::string what = fmt::format("{} N {} P {} O {} G {}", optimizer_type_name(type), N,
                                             tier_name(p), tier_name(o), grad_home_name(g));
        SCOPED_TRACE(what);
        expect_same(run_executor(c, N, p, o, 0, 1, true, g, micro), base, what + ":");
      }
    }
    const test::TempDir dir("strata-exec");
    const Placement adam = make_placement(c, 3, Tier::cpu, Tier::cpu, dir.path.string());
    const Placement one =
        make_placement(c, 3, Tier::cpu, Tier::cpu, dir.path.string(), 0, 1, true,
                       GradHome::automatic, 1, DType::f32, DType::f32, false, type);
    const uint64_t a = adam.needs().at(Tier::cpu, StateKind::optimizer),
                   b = one.needs().at(Tier::cpu, StateKind::optimizer);
    EXPECT_GT(a, 0u);
    EXPECT_NEAR(static_cast<double>(b) / static_cast<double>(a), 2.0 / 3.0, 0.01);
  }
}

// The same sums in another order: losses and gradient norms to f32 rounding, and weights within
// a small fraction of the learning rate (2%: Adam divides each gradient by its own scale, so an
// element whose gradient is near zero moves a visible part of a step on rounding alone).
void expect_close(const RunResult& r, const RunResult& base, const std::string& what) {
  ASSERT_EQ(r.losses.size(), base.losses.size()) << what;
  for (size_t s = 0; s < base.losses.size(); ++s) {
    EXPECT_NEAR(r.losses[s], base.losses[s], 1e-5 * std::abs(base.losses[s])) << what << " " << s;
    EXPECT_NEAR(r.norms[s], base.norms[s], 1e-5 * base.norms[s]) << what << " " << s;
  }
  ASSERT_EQ(r.master.size(), base.master.size()) << what;
  float worst = 0;
  for (size_t u = 0; u < base.master.size(); ++u)
    for (size_t i = 0; i < base.master[u].size(); ++i)
      worst = std::max(worst, std::abs(r.master[u][i] - base.master[u][i]));
  EXPECT_LT(worst, 2e-2f * kLr) << what;
}

// P and O on the CPU, 3 micro-batches with clipping, on 1 and 3 ranks, sharded and replicated:
// reduced once in a group of 3 against reduced every micro-batch in groups of `each_group`,
// within rounding (expect_close).
void expect_once_per_group_close(const LlamaConfig& c, int each_group) {
  for (const int N : {1, 3})
    for (const uint64_t threshold : {uint64_t{0}, uint64_t{40000}}) {
      const std::string what = fmt::format("N {} threshold {}", N, threshold);
      SCOPED_TRACE(what);
      const RunResult each = run_executor(c, N, Tier::cpu, Tier::cpu, threshold, 1, true,
                                          GradHome::automatic, {3, each_group, true, false});
      const RunResult once = run_executor(c, N, Tier::cpu, Tier::cpu, threshold, 1, true,
                                          GradHome::automatic, {3, 3, true, false, true});
      expect_close(once, each, what);
    }
}

// Every P x O x gradient home on 1 and 3 ranks, three micro-batches (rank 0's last a single
// sequence) in each group size of `groups` (the last of several: one placement per optimizer
// home, P and O in the same tier), with `clip` and `early` (Micro), against the all-GPU run of
// each micro-batch alone updating after the backward: the same losses, norms and bits.
// `per_group`: gradients reduced once per group, against the all-device run with the same
// groups (which sums in the same order); otherwise against the all-device run without groups.
void expect_every_placement_gives_the_bits(const std::vector<int>& groups, bool clip, bool early,
                                           bool per_group = false, bool tied = false) {
  const LlamaConfig c = tiny(tied);
  for (const int N : {1, 3}) {
    RunResult base = run_executor(c, N, Tier::gpu, Tier::gpu, 0, 1, true, GradHome::automatic,
                                  {3, 1, clip, false});
    for (const int group : groups) {
      if (per_group)
        base = run_executor(c, N, Tier::gpu, Tier::gpu, 0, 1, true, GradHome::automatic,
                            {3, group, clip, false, true});
      int k = 0;  // the placement's place in the sweep
      for (Tier p : {Tier::gpu, Tier::cpu, Tier::nvme})
        for (Tier o : {Tier::gpu, Tier::cpu, Tier::nvme})
          for (GradHome g : {GradHome::automatic, GradHome::cpu}) {
            if (o == Tier::gpu && g == GradHome::cpu) continue;
            if (groups.size() > 1 && group == groups.back() && (o != p || g != GradHome::automatic))
              continue;
            if (halve_sweeps() && (k++ + (N > 1 ? 1 : 0)) % 2 != 0) continue;
            const std::string what = fmt::format("N {} group {} P {} O {} G {}", N, group,
                                                 tier_name(p), tier_name(o), grad_home_name(g));
            SCOPED_TRACE(what);
            const RunResult r =
                run_executor(c, N, p, o, 0, 1, true, g, {3, group, clip, early, per_group});
            for (size_t s = 0; s < r.losses.size(); ++s) {
              EXPECT_EQ(r.losses[s], base.losses[s]);
              EXPECT_EQ(r.norms[s], base.norms[s]);
            }
            expect_same(r, base, what + ":");
          }
    }
  }
}

TEST(Executor, MicroBatchGroupsGiveTheSameBits) {
  REQUIRE_DEVICES(3);
  // Groups of 2 (a short last group; every placement) and 3: each unit is fetched once per
  // group, and each backward of a group waits for the previous one's reduce-scatter, so every
  // micro-batch's gradients reach the accumulators as without groups: the same bits.
  expect_every_placement_gives_the_bits({2, 3}, true, false);
  const LlamaConfig c = tiny(false);
  // Replicated units (all-reduced per micro-batch), no recompute (a stash per micro-batch of
  // the group) and a deeper prefetch.
  const RunResult base2 =
      run_executor(c, 2, Tier::gpu, Tier::gpu, 40000, 1, true, GradHome::automatic, {3, 1});
  const RunResult rep =
      run_executor(c, 2, Tier::nvme, Tier::cpu, 40000, 1, true, GradHome::automatic, {3, 3});
  expect_same(rep, base2, "replicated units, group 3:");
  const RunResult base3 =
      run_executor(c, 2, Tier::gpu, Tier::gpu, 0, 1, false, GradHome::automatic, {3, 1});
  for (const int depth : {1, 3}) {
    const RunResult r =
        run_executor(c, 2, Tier::cpu, Tier::nvme, 0, depth, false, GradHome::automatic, {3, 2});
    expect_same(r, base3, fmt::format("no recompute, group 2, depth {}:", depth));
  }
}

// Activation checkpoints in host RAM (RunShape::offload_activations): each block's input goes to
// the host after the forward that writes it and comes back before its backward, the GPU keeping
// a ring of max(2, prefetch depth + 1) of them, so a forward overwrites a slot whose checkpoint
// is still needed. The same bits as keeping them all on the device, for every home of P and O,
// on 1 and 3 ranks, at prefetch depths 1 to 3, in micro-batch groups of 2 (a short last group:
// a ring per set), with vocabulary pieces (the head's normed input in a slot of its own), with
// evaluation before each step (forwards only, over the same ring); and less activation memory.
TEST(Executor, OffloadedActivationCheckpointsGiveTheSameBits) {
  REQUIRE_DEVICES(3);
  LlamaConfig c = tiny(false);
  c.num_hidden_layers = 5;  // blocks 0..3 offloaded with a ring of 2, 0..2 with 3, 0..1 with 4
  for (const int N : {1, 3}) {
    const RunResult base = run_executor(c, N, Tier::gpu, Tier::gpu);
    int k = 0;
    for (Tier p : {Tier::gpu, Tier::cpu, Tier::nvme})
      for (Tier o : {Tier::gpu, Tier::cpu, Tier::nvme}) {
        if (halve_sweeps() && (k++ + N) % 2 != 0) continue;
        const std::string what = fmt::format("N {} P {} O {}", N, tier_name(p), tier_name(o));
        SCOPED_TRACE(what);
        Micro off;
        off.offload_activations = true;
        const RunResult r = run_executor(c, N, p, o, 0, 1, true, GradHome::automatic, off);
        expect_same(r, base, what + ":");
        if (p == Tier::gpu && o == Tier::gpu) {
          EXPECT_LT(r.act_high_water, base.act_high_water) << what;
        }
      }
    for (const int depth : {2, 3}) {
      Micro off;
      off.offload_activations = true;
      expect_same(
          run_executor(c, N, Tier::cpu, Tier::cpu, 0, depth, true, GradHome::automatic, off), base,
          fmt::format("N {} depth {}:", N, depth));
    }
  }
  const Micro alone3{3, 1}, groups{3, 2, true, false, false, DType::f32, DType::f32, true};
  expect_same(run_executor(c, 2, Tier::nvme, Tier::cpu, 0, 1, true, GradHome::cpu, groups),
              run_executor(c, 2, Tier::gpu, Tier::gpu, 0, 1, true, GradHome::automatic, alone3),
              "groups of 2 of 3:");
  LlamaConfig pieces = c;
  pieces.vocab_pieces = 3;
  Micro off;
  off.offload_activations = true;
  expect_same(run_executor(pieces, 2, Tier::cpu, Tier::nvme, 0, 1, true, GradHome::automatic, off),
              run_executor(pieces, 2, Tier::gpu, Tier::gpu), "vocabulary pieces:");
}

// The embedding and the head in three vocabulary pieces each (units of their own): the
// reference loop's bits on the all-GPU executor, and every home of P, O and G gives them, on 1
// and 3 ranks, in groups of 2 and with updates during the backward too; the losses and the
// gradient norms are the whole model's to rounding (the loss's chunks are the pieces' rows, not
// the whole head's). Tied (`tied`), head piece k reads embedding piece k's rows, gathered
// beside it, and the table's gradients are reduced after the head piece's backward and again
// after the embedding piece's own (no piece stays gathered across the blocks): the same, with
// replicated units too (the head's pieces and the norms all-reduced), and in groups reduced
// once per group, as tied embeddings in groups need.
void vocabulary_pieces_train_to_the_same_bits_in_every_tier(bool tied) {
  LlamaConfig c = tiny(tied);
  c.vocab_pieces = 3;
  ASSERT_EQ(ModelLayout::build(c).num_units(), 2 * 3 + 2);
  for (const int N : {1, 3}) {
    const RunResult ref = run_reference(c, N);
    const RunResult gpu = run_executor(c, N, Tier::gpu, Tier::gpu);
    const RunResult whole = run_executor(tiny(tied), N, Tier::gpu, Tier::gpu);
    for (size_t s = 0; s < ref.losses.size(); ++s) {
      EXPECT_EQ(gpu.losses[s], ref.losses[s]) << "step " << s;
      EXPECT_EQ(gpu.norms[s], ref.norms[s]) << "step " << s;
      // init_random draws each tensor alike however it is cut: the whole model's run. The
      // first step's norm is of the same weights (rounding alone); later ones of weights that
      // Adam moved apart by its rounding (on 3 emulated GPUs 1.7e-5 at the third step).
      EXPECT_NEAR(gpu.losses[s], whole.losses[s], 1e-5 * whole.losses[s]) << "step " << s;
      EXPECT_NEAR(gpu.norms[s], whole.norms[s], (s == 0 ? 1e-5 : 1e-4) * whole.norms[s])
          << "step " << s;
    }
    expect_same(gpu, ref, fmt::format("N {} all-GPU executor vs reference loop:", N));
    int k = 0;
    for (Tier p : {Tier::gpu, Tier::cpu, Tier::nvme})
      for (Tier o : {Tier::gpu, Tier::cpu, Tier::nvme})
        for (GradHome g : {GradHome::automatic, GradHome::cpu}) {
          if ((p == Tier::gpu && o == Tier::gpu) || (o == Tier::gpu && g == GradHome::cpu))
            continue;
          if (halve_sweeps() && (k++ + N) % 2 != 0) continue;
          const std::string what =
              fmt::format("N {} P {} O {} G {}", N, tier_name(p), tier_name(o), grad_home_name(g));
          SCOPED_TRACE(what);
          expect_same(run_executor(c, N, p, o, 0, 1, true, g), gpu, what + ":");
        }
    // Groups: each piece of the head runs its forward for both micro-batches before the next
    // piece's, so each keeps its own cross-entropy state. Untied, the bits of no groups.
    const Micro group2{kMicro, 2, true, false, tied};
    const RunResult base2 =
        run_executor(c, N, Tier::gpu, Tier::gpu, 0, 1, true, GradHome::automatic, group2);
    if (!tied) {
      for (size_t s = 0; s < ref.losses.size(); ++s) EXPECT_EQ(base2.losses[s], gpu.losses[s]);
      expect_same(base2, gpu, fmt::format("N {} group 2:", N));
    }
    const Micro group2of3{3, 2, true, false, tied}, alone3{3, tied ? 2 : 1, true, false, tied};
    expect_same(run_executor(c, N, Tier::cpu, Tier::nvme, 0, 2, false, GradHome::cpu, group2of3),
                run_executor(c, N, Tier::gpu, Tier::gpu, 0, 1, true, GradHome::automatic, alone3),
                fmt::format("N {} groups of 2 of 3, no recompute, depth 2:", N));
    expect_same(run_executor(c, N, Tier::cpu, Tier::cpu, 0, 1, true, GradHome::automatic,
                             {kMicro, 1, false, true}),
                run_executor(c, N, Tier::gpu, Tier::gpu, 0, 1, true, GradHome::automatic,
                             {kMicro, 1, false, false}),
                fmt::format("N {} updates during the backward:", N));
    if (tied) {
      const RunResult rep = run_executor(c, N, Tier::gpu, Tier::gpu, 40000);
      expect_same(rep, run_reference(c, N, 40000), fmt::format("N {} replicated vs reference:", N));
      expect_same(run_executor(c, N, Tier::nvme, Tier::cpu, 40000, 2, true, GradHome::cpu), rep,
                  fmt::format("N {} replicated, depth 2:", N));
    }
  }
}

TEST(Executor, VocabularyPiecesTrainToTheSameBitsInEveryTier) {
  REQUIRE_DEVICES(3);
  vocabulary_pieces_train_to_the_same_bits_in_every_tier(false);
}

TEST(Executor, TiedVocabularyPiecesTrainToTheSameBitsInEveryTier) {
  REQUIRE_DEVICES(3);
  vocabulary_pieces_train_to_the_same_bits_in_every_tier(true);
}

TEST(Executor, UpdatingDuringTheBackwardGivesTheSameBits) {
  REQUIRE_DEVICES(3);
  // Without clipping, CPU Adam updates each unit as soon as its gradients are final, under the
  // rest of the backward: the same updates as after the whole backward, so the same bits, one
  // micro-batch at a time and in groups of 2.
  expect_every_placement_gives_the_bits({1, 2}, false, true);
  const LlamaConfig c = tiny(false);
  // Replicated units and a deeper prefetch.
  const RunResult base2 = run_executor(c, 2, Tier::gpu, Tier::gpu, 40000, 1, true,
                                       GradHome::automatic, {3, 1, false, false});
  const RunResult rep = run_executor(c, 2, Tier::nvme, Tier::cpu, 40000, 3, true,
                                     GradHome::automatic, {3, 1, false, true});
  expect_same(rep, base2, "replicated units, depth 3:");
}

TEST(Executor, ReducingOncePerGroupGivesOneBitsForEveryPlacement) {
  REQUIRE_DEVICES(3);
  // Gradients reduced once per group: every placement gives the all-device run's bits with the
  // same groups, in groups of 2 (a short last group; every placement) and 3, with clipping and,
  // without it, updating during the backward.
  expect_every_placement_gives_the_bits({2, 3}, true, false, true);
  expect_every_placement_gives_the_bits({3}, false, true, true);
  // Replicated units (all-reduced once per group) and a deeper prefetch.
  const LlamaConfig c = tiny(false);
  const RunResult base = run_executor(c, 2, Tier::gpu, Tier::gpu, 40000, 1, true,
                                      GradHome::automatic, {3, 3, true, false, true});
  const RunResult rep = run_executor(c, 2, Tier::nvme, Tier::cpu, 40000, 3, true,
                                     GradHome::automatic, {3, 3, true, false, true});
  expect_same(rep, base, "replicated units, group 3, depth 3:");
}

TEST(Executor, TiedEmbeddingsInGroupsGiveOneBitsForEveryPlacement) {
  REQUIRE_DEVICES(3);
  // The head adds the whole group's share into unit 0's working gradients before the
  // embedding's backwards, so tied embeddings run in groups with the gradients reduced once
  // per group: every placement gives the all-device run's bits with the same groups, in groups
  // of 2 (a short last group; every placement) and 3.
  expect_every_placement_gives_the_bits({2, 3}, true, false, true, true);
  // Against each micro-batch alone: the same sums in another order. A share of the head's
  // lost or counted twice moves the norm by far more than rounding.
  expect_once_per_group_close(tiny(true), 1);
}

TEST(Executor, ReducingOncePerGroupAgreesWithEachMicroBatchToRounding) {
  REQUIRE_DEVICES(3);
  // The same sums in another order: losses and gradient norms to f32 rounding, and weights
  // within a small fraction of the learning rate of the run reducing every micro-batch (a
  // micro-batch's gradients lost or counted twice moves the norm by tens of percent).
  expect_once_per_group_close(tiny(false), 3);
}

// Gradient accumulators on NVMe (--offload-gradients nvme, as ZeRO-Infinity swaps them): each
// micro-batch's gradients are written to the swap store (the step's first) or added to what is
// read back (the later ones), and CPU Adam reads the sum back. Every P x O home with the
// optimizer off the devices trains to the all-device run's bits on 1 and 3 ranks; so do groups
// of micro-batches reduced per micro-batch and once per group, updates during the backward,
// replicated units (whose gradients stay in host RAM), the tied table cut into pieces (reduced
// twice a micro-batch) and a deep prefetch.
TEST(Executor, GradientsOnNvmeTrainToTheSameBits) {
  const LlamaConfig c = tiny(false);
  for (const int N : {1, 3}) {
    REQUIRE_DEVICES(N);
    const RunResult gpu = run_executor(c, N, Tier::gpu, Tier::gpu);
    int k = 0;
    for (Tier p : {Tier::gpu, Tier::cpu, Tier::nvme})
      for (Tier o : {Tier::cpu, Tier::nvme}) {
        if (halve_sweeps() && (k++ + N) % 2 != 0) continue;
        const std::string what =
            fmt::format("N {} P {} O {} G nvme", N, tier_name(p), tier_name(o));
        SCOPED_TRACE(what);
        const RunResult r = run_executor(c, N, p, o, 0, 1, true, GradHome::nvme);
        for (size_t s = 0; s < r.losses.size(); ++s) {
          EXPECT_EQ(r.losses[s], gpu.losses[s]);
          EXPECT_EQ(r.norms[s], gpu.norms[s]);
        }
        expect_same(r, gpu, what + ":");
      }
    const RunResult three = run_executor(c, N, Tier::gpu, Tier::gpu, 0, 1, true,
                                         GradHome::automatic, {3, 1, true, false});
    expect_same(
        run_executor(c, N, Tier::cpu, Tier::nvme, 0, 1, true, GradHome::nvme, {3, 2, true, false}),
        three, fmt::format("N {} group 2 of 3:", N));
    expect_same(
        run_executor(c, N, Tier::nvme, Tier::cpu, 0, 3, false, GradHome::nvme, {3, 1, true, false}),
        three, fmt::format("N {} depth 3, no recompute:", N));
    expect_same(
        run_executor(c, N, Tier::nvme, Tier::nvme, 0, 1, true, GradHome::nvme, {3, 1, false, true}),
        run_executor(c, N, Tier::gpu, Tier::gpu, 0, 1, true, GradHome::automatic,
                     {3, 1, false, false}),
        fmt::format("N {} updates during the backward:", N));
    expect_same(run_executor(c, N, Tier::gpu, Tier::nvme, 0, 1, true, GradHome::nvme,
                             {3, 2, true, false, true}),
                run_executor(c, N, Tier::gpu, Tier::gpu, 0, 1, true, GradHome::automatic,
                             {3, 2, true, false, true}),
                fmt::format("N {} group 2 of 3 reduced once per group:", N));
    expect_same(run_executor(c, N, Tier::cpu, Tier::cpu, 40000, 1, true, GradHome::nvme),
                run_executor(c, N, Tier::gpu, Tier::gpu, 40000),
                fmt::format("N {} replicated units:", N));
    LlamaConfig cut = tiny(true);
    cut.vocab_pieces = 3;
    expect_same(run_executor(cut, N, Tier::nvme, Tier::nvme, 0, 1, true, GradHome::nvme),
                run_executor(cut, N, Tier::gpu, Tier::gpu),
                fmt::format("N {} tied table in 3 pieces:", N));
    // The homes and what they hold: G of the sharded units in the swap store, nothing of it in
    // host RAM; the swap files hold P, G and O.
    const test::TempDir dir("strata-exec-gnvme");
    const Placement pl =
        make_placement(c, N, Tier::cpu, Tier::nvme, dir.path.string(), 0, 1, true, GradHome::nvme);
    const TierBytes t = pl.needs();
    EXPECT_EQ(t.at(Tier::cpu, StateKind::gradients), 0u);
    EXPECT_GT(t.at(Tier::nvme, StateKind::gradients), 0u);
    const Placement on_cpu =
        make_placement(c, N, Tier::cpu, Tier::nvme, dir.path.string(), 0, 1, true, GradHome::cpu);
    EXPECT_GE(t.at(Tier::nvme, StateKind::gradients),
              on_cpu.needs().at(Tier::cpu, StateKind::gradients) / 2);
    EXPECT_EQ(pl.offloaded_gradients().on_nvme, static_cast<int>(pl.homes.size()));
  }
}

TEST(Executor, UpdatingDuringTheBackwardRefusesAClipAndStopsOnNonFiniteGradients) {
  REQUIRE_DEVICES(2);
  const LlamaConfig c = tiny(false);
  const test::TempDir dir("strata-exec");
  Rig rig(2);
  const Placement pl = make_placement(c, 2, Tier::cpu, Tier::nvme, dir.path.string());
  ScheduleOptions so;
  so.micro_batches = kMicro;
  so.update_during_backward = true;
  const Schedule sc = Schedule::build(pl, so);
  EXPECT_NE(sc.summary().find("updating each unit during the backward"), std::string::npos);
  Executor ex(pl, sc, *rig.comm);
  ex.init_random(3);
  const auto batches = make_batches(2, c.vocab_size);
  // A clip needs the global norm before any update: refused before the step starts, and the
  // executor stays usable.
  test::expect_error([&] { ex.step(batches[0], step_params(1, true)); },
                     {"gradient clipping at 0.05", "--update-during-backward off", "--clip 0"});
  EXPECT_FALSE(ex.step(batches[0], step_params(1, false)).skipped);
  // A non-finite gradient cannot skip a step whose units are being updated: the run stops,
  // naming a unit and what to do, and the executor refuses to go on.
  StepParams p = step_params(2, false);
  p.loss_scale = std::nanf("");
  test::expect_error(
      [&] { ex.step(batches[1], p); },
      {"gradients hold NaN or Inf", "cannot be skipped", "--update-during-backward off"});
  test::expect_error([&] { ex.step(batches[2], step_params(3, false)); },
                     {"start again from a checkpoint"});
}

TEST(Executor, NonFiniteGradientsSkipTheStep) {
  REQUIRE_DEVICES(2);
  const LlamaConfig c = tiny(false);
  const test::TempDir dir("strata-exec");
  Rig rig(2);
  const Placement pl = make_placement(c, 2, Tier::cpu, Tier::nvme, dir.path.string());
  ScheduleOptions so;
  so.micro_batches = kMicro;
  const Schedule sc = Schedule::build(pl, so);
  Executor ex(pl, sc, *rig.comm);
  ex.init_random(3);
  const auto batches = make_batches(2, c.vocab_size);
  std::vector<std::vector<float>> before, before_master;
  for (int u = 0; u < static_cast<int>(pl.homes.size()); ++u) {
    before.push_back(ex.parameters(u));
    before_master.push_back(ex.master(u));
  }
  StepParams p = step_params(1);
  p.loss_scale = std::nanf("");
  const StepResult r = ex.step(batches[0], p);
  EXPECT_TRUE(r.skipped);
  for (int u = 0; u < static_cast<int>(pl.homes.size()); ++u) {
    expect_bits(ex.parameters(u), before[static_cast<size_t>(u)], "parameters after a skip");
    expect_bits(ex.master(u), before_master[static_cast<size_t>(u)], "master after a skip");
  }
  // The next, finite step runs normally from zeroed gradients.
  const StepResult ok = ex.step(batches[1], step_params(1));
  EXPECT_FALSE(ok.skipped);
}

TEST(Executor, NextStepsForwardRunsUnderThisStepsOptimizer) {
  REQUIRE_DEVICES(1);
  // DESIGN §3.4: step() returns once the loss and the norm are known, and the next step's
  // first fetches start while this step's optimizer is still writing. A slow drive (every
  // request 5 ms late) makes the optimizer's tail of 2 x units writes far longer than the
  // time the test takes to call step() again, so every step but the first starts before the
  // previous one ends, and the timeline still honours every dependency.
  const LlamaConfig c = tiny(false);
  ExecutorOptions eo;
  eo.record = true;
  eo.io.faults = {nvme::Fault{nvme::FaultKind::slow, 0}};
  TestExecutor t(c, 1, Tier::nvme, Tier::nvme, eo);
  const Schedule& sc = t.sc;
  Executor& ex = t.ex;
  ex.init_random(3);
  const auto batches = make_batches(1, c.vocab_size);
  for (int s = 0; s < kSteps; ++s) {
    const StepResult r = ex.step(batches[static_cast<size_t>(s)], step_params(s + 1));
    EXPECT_GT(r.step_s, 0.0);
    EXPECT_GT(r.nvme_busy_s, 0.0);
    EXPECT_GT(r.overlap, 0.0);
    EXPECT_LE(r.overlap, 1.0 + 1e-9);
  }
  const Timeline& tl = ex.timeline();
  EXPECT_NO_THROW(check_timeline(sc, tl));
  std::vector<double> first(kSteps, 1e300), last(kSteps, -1e300);
  for (const TaskSpan& sp : tl.spans) {
    first[static_cast<size_t>(sp.step)] = std::min(first[static_cast<size_t>(sp.step)], sp.start_s);
    last[static_cast<size_t>(sp.step)] = std::max(last[static_cast<size_t>(sp.step)], sp.end_s);
  }
  for (int k = 1; k < kSteps; ++k)
    EXPECT_LT(first[static_cast<size_t>(k)], last[static_cast<size_t>(k - 1)])
        << "step " << k << " started only after step " << k - 1 << " had ended";
}

TEST(Executor, NvmeFaultStopsTheStepNamingTheTask) {
  REQUIRE_DEVICES(2);
  const LlamaConfig c = tiny(false);
  ExecutorOptions eo;
  // init_random writes every O shard (one request each at least); fail a later request, which
  // falls in the step's optimizer traffic.
  eo.io.faults = {nvme::Fault{nvme::FaultKind::eio, 200}};
  TestExecutor t(c, 2, Tier::gpu, Tier::nvme, eo);
  Executor& ex = t.ex;
  ex.init_random(3);
  const auto batches = make_batches(2, c.vocab_size);
  // The optimizer's tasks may still run after step() returns: a failure among them surfaces
  // at the next call (the next step(), or finish()).
  const std::string msg = test::error_message([&] {
    for (int s = 0; s < kSteps; ++s) ex.step(batches[static_cast<size_t>(s)], step_params(s + 1));
    ex.finish();
  });
  // The task (an optimizer read or write on an NVMe lane) and the I/O error both appear.
  EXPECT_NE(msg.find("executor: step"), std::string::npos) << msg;
  EXPECT_TRUE(msg.find("optim_read") != std::string::npos ||
              msg.find("optim_write") != std::string::npos)
      << msg;
  EXPECT_NE(msg.find("on nvme."), std::string::npos) << msg;
  test::expect_error([&] { ex.step(batches[0], step_params(4)); }, {"an earlier step 3 failed"});

  // Gradients on NVMe (and nothing else there): the swap store's third request is one of the
  // first step's gradient writes or reads back, in the backward; step() throws naming the task
  // and the swap file.
  ExecutorOptions g_eo;
  g_eo.io.faults = {nvme::Fault{nvme::FaultKind::eio, 3}};
  TestExecutor g(c, 2, Tier::gpu, Tier::cpu, g_eo, 0, GradHome::nvme);
  g.ex.init_random(3);
  const std::string gm = test::error_message([&] { g.ex.step(batches[0], step_params(1)); });
  EXPECT_NE(gm.find("executor: step 1"), std::string::npos) << gm;
  EXPECT_TRUE(gm.find("grad_write") != std::string::npos ||
              gm.find("grad_read") != std::string::npos)
      << gm;
  EXPECT_NE(gm.find("on nvme."), std::string::npos) << gm;
}

// Outside a step the executor moves a unit's NVMe shards one unit ahead of its caller: a
// checkpoint reads unit u + 1's state while it writes unit u's (optimizer_state_view() and
// parameters() with `next`), and a resume writes unit u's state while it reads unit u + 1's
// (set_optimizer_state()'s write behind). The caller sees what lies in the tiers whatever it
// asks for next, and nothing read ahead outlives a change to what it read.
std::vector<float> flat(const Executor::OptimizerStateView& view, size_t k) {
  std::vector<float> out;
  for (const std::span<const float>& part : view.parts[k])
    out.insert(out.end(), part.begin(), part.end());
  return out;
}

void expect_state(const Executor::OptimizerStateView& view, const UnitOptimizerState& want,
                  const std::string& what) {
  expect_bits(flat(view, 0), want.master, what + " master");
  expect_bits(flat(view, 1), want.m, what + " m");
  expect_bits(flat(view, 2), want.v, what + " v");
}

TEST(Executor, UnitsReadAheadAndWrittenBehindAreWhatLiesInTheTiers) {
  const LlamaConfig c = tiny(false);
  for (const int N : {1, 3}) {
    REQUIRE_DEVICES(N);
    // With 3 ranks the embedding and the head stay whole on every rank (ReplicatedUnits).
    const uint64_t threshold = N == 1 ? 0 : 40000;
    for (auto [p, o] : {std::pair{Tier::nvme, Tier::nvme}, std::pair{Tier::cpu, Tier::nvme},
                        std::pair{Tier::nvme, Tier::cpu}, std::pair{Tier::gpu, Tier::gpu}}) {
      const std::string name = fmt::format("P {} O {} N {}:", tier_name(p), tier_name(o), N);
      SCOPED_TRACE(name);
      ExecutorOptions eo;
      eo.cpu_adam_threads = 2;
      TestExecutor t(c, N, p, o, eo, threshold);
      Executor& ex = t.ex;
      ex.init_random(7);
      const auto batches = make_batches(N, c.vocab_size);
      ex.step(batches[0], step_params(1));
      const int U = static_cast<int>(t.pl.homes.size());
      ASSERT_GE(U, 3);
      // What lies in the tiers, each unit read on its own.
      std::vector<UnitOptimizerState> want;
      std::vector<std::vector<float>> want_p;
      for (int u = 0; u < U; ++u) {
        want.push_back(ex.optimizer_state(u));
        want_p.push_back(ex.parameters(u));
      }
      // In order, each call naming the next.
      std::vector<float> got;
      for (int u = 0; u < U; ++u) {
        const int next = u + 1 < U ? u + 1 : -1;
        expect_state(ex.optimizer_state_view(u, next), want[static_cast<size_t>(u)],
                     fmt::format("{} unit {} in order", name, u));
        ex.parameters(u, got, next);
        expect_bits(got, want_p[static_cast<size_t>(u)], fmt::format("{} unit {}", name, u));
      }
      // Out of the order foreseen: a read ahead not taken up at once.
      ex.optimizer_state_view(0, 2);
      expect_state(ex.optimizer_state_view(1), want[1], name + " unit 1 out of order");
      expect_state(ex.optimizer_state_view(2), want[2], name + " unit 2 out of order");
      ex.parameters(0, got, 2);
      ex.parameters(1, got);
      expect_bits(got, want_p[1], name + " parameters of unit 1 out of order");
      ex.parameters(2, got);
      expect_bits(got, want_p[2], name + " parameters of unit 2 out of order");
      // A read ahead does not outlive a change to what it read, or to its block: new state
      // set for its unit, or for another...
      UnitOptimizerState changed = want[1];
      for (float& x : changed.m) x += 1.0f;
      ex.optimizer_state_view(0, 1);
      ex.set_optimizer_state(1, changed);
      expect_state(ex.optimizer_state_view(1), changed, name + " unit 1 set after a read ahead");
      ex.set_optimizer_state(1, want[1]);
      ex.optimizer_state_view(0, 1);
      ex.set_optimizer_state(2, want[2]);
      expect_state(ex.optimizer_state_view(1), want[1], name + " unit 1 after unit 2 was set");
      // ... or a step.
      ex.optimizer_state_view(0, 1);
      ex.step(batches[1], step_params(2));
      const UnitOptimizerState stepped = [&] {
        const Executor::OptimizerStateView v = ex.optimizer_state_view(1);
        return UnitOptimizerState{flat(v, 0), flat(v, 1), flat(v, 2)};
      }();
      const UnitOptimizerState fresh = ex.optimizer_state(1);
      expect_bits(stepped.master, fresh.master, name + " master after a step");
      expect_bits(stepped.m, fresh.m, name + " m after a step");
      EXPECT_NE(fresh.m, want[1].m) << "the step changed nothing";
      ex.parameters(0, got, 1);
      ex.step(batches[2], step_params(3));
      ex.parameters(1, got);
      expect_bits(got, ex.parameters(1), name + " parameters after a step");
      // Written behind: each unit's state set while the previous one's is written, then read.
      std::vector<UnitOptimizerState> set = want;
      for (int u = 0; u < U; ++u) {
        for (float& x : set[static_cast<size_t>(u)].v) x *= 0.5f;
        ex.set_optimizer_state(u, set[static_cast<size_t>(u)]);
      }
      ex.finish();
      for (int u = 0; u < U; ++u) {
        const UnitOptimizerState back = ex.optimizer_state(u);
        expect_bits(back.master, set[static_cast<size_t>(u)].master, name + " master set");
        expect_bits(back.v, set[static_cast<size_t>(u)].v, name + " v set");
        expect_bits(ex.parameters(u), set[static_cast<size_t>(u)].master, name + " parameters set");
      }
    }
  }
}

// A write behind that fails is not lost: set_optimizer_state() or finish() throws its error,
// naming the shard's file.
TEST(Executor, AWriteBehindThatFailsIsReported) {
  REQUIRE_DEVICES(1);
  ExecutorOptions eo;
  eo.io.faults = {nvme::Fault{nvme::FaultKind::eio, 300}};
  TestExecutor t(tiny(false), 1, Tier::nvme, Tier::nvme, eo);
  Executor& ex = t.ex;
  ex.init_random(3);
  const int U = static_cast<int>(t.pl.homes.size());
  std::vector<UnitOptimizerState> state;
  for (int u = 0; u < U; ++u) state.push_back(ex.optimizer_state(u));
  const std::string msg = test::error_message([&] {
    for (int round = 0; round < 1000; ++round)
      for (int u = 0; u < U; ++u) ex.set_optimizer_state(u, state[static_cast<size_t>(u)]);
    ex.finish();
  });
  EXPECT_NE(msg.find("write of"), std::string::npos) << msg;
  EXPECT_NE(msg.find("Input/output error"), std::string::npos) << msg;
  EXPECT_NE(msg.find(t.dir.path.string()), std::string::npos) << msg;
}

// The CUDA kernels index the embedding and the logits with these ids unchecked, so the
// executor refuses one outside the vocabulary before anything runs, naming where it is; the
// executor stays usable.
// Resolving a step takes memory in proportion to its tasks, not their square: 80 layers on 8
// ranks with 32 micro-batches is a step of 170,000 tasks, as many as llama3-70b's on 8 GPUs. A
// bit set of every task's ancestors took 3.3 GiB more and 10 s to construct here; the positions
// per lane that replaced it take 24 MB.
TEST(Executor, ResolvesAStepOf170000TasksInLittleMemory) {
  REQUIRE_DEVICES(8);
  LlamaConfig c = tiny(false);
  c.num_hidden_layers = 80;
  const test::TempDir dir("strata-exec");
  Rig rig(8);
  // Gradients in host RAM: every micro-batch's come down, the most tasks a step has.
  const Placement pl =
      make_placement(c, 8, Tier::cpu, Tier::cpu, dir.path.string(), 0, 1, true, GradHome::cpu);
  ScheduleOptions so;
  so.micro_batches = 32;
  const Schedule sc = Schedule::build(pl, so);
  ASSERT_GT(sc.tasks.size(), 150000u);
  auto peak_kib = [] {
    rusage ru{};
    getrusage(RUSAGE_SELF, &ru);
    return static_cast<double>(ru.ru_maxrss);
  };
  const double before = peak_kib();
  { Executor ex(pl, sc, *rig.comm, ExecutorOptions{}); }
  const double grown = (peak_kib() - before) / 1024.0;
  std::printf("[ resolve  ] %zu tasks: peak RSS grew %.1f MiB\n", sc.tasks.size(), grown);
  EXPECT_LT(grown, 512.0);
}

// The tiny model on two devices with everything on them, initialised: for the checks of what
// the executor is given.
struct TwoDeviceRun {
  LlamaConfig c = tiny(false);
  Rig rig{2};
  Placement pl = make_placement(c, 2, Tier::gpu, Tier::gpu, "");
  Schedule sc = Schedule::build(pl, [] {
    ScheduleOptions so;
    so.micro_batches = kMicro;
    return so;
  }());
  Executor ex{pl, sc, *rig.comm, ExecutorOptions{}};
  TwoDeviceRun() { ex.init_random(3); }
};

TEST(Executor, TokenIdsOutsideTheVocabularyAreRefused) {
  REQUIRE_DEVICES(2);
  TwoDeviceRun run;
  const LlamaConfig& c = run.c;
  Executor& ex = run.ex;
  const auto good = make_batches(2, c.vocab_size);
  auto bad = good[0];
  bad[1][1].ids[5] = static_cast<int32_t>(c.vocab_size);
  test::expect_error([&] { ex.step(bad, step_params(1)); },
                     {"rank 1's micro-batch 1, token 5", "id " + std::to_string(c.vocab_size),
                      "outside the vocabulary"});
  bad = good[0];
  bad[0][0].targets[3] = -1;
  test::expect_error([&] { ex.evaluate(bad); }, {"target -1", "vocab_size"});
  EXPECT_GT(ex.evaluate(good[0]).targets, 0);
  EXPECT_FALSE(ex.step(good[0], step_params(1)).skipped);
}

// Documents packed into the sequences (HostBatch::doc_start) reach the attention kernels: one
// document per sequence is plain causal attention, the same bits; a document per token changes
// the loss. Starts that break the rule, or do not match the tokens, are refused by name before
// anything runs (the CUDA kernels trust them).
TEST(Executor, PackedDocumentsReachTheAttention) {
  REQUIRE_DEVICES(2);
  TwoDeviceRun run;
  Executor& ex = run.ex;
  const auto plain = make_batches(2, run.c.vocab_size)[0];
  auto whole = plain, each = plain;
  for (auto& mb : whole)
    for (HostBatch& b : mb) b.doc_start.assign(b.ids.size(), 0);
  for (auto& mb : each)
    for (HostBatch& b : mb) {
      b.doc_start.resize(b.ids.size());
      for (size_t i = 0; i < b.ids.size(); ++i)
        b.doc_start[i] = static_cast<int32_t>(i % static_cast<size_t>(kSeq));
    }
  const EvalResult base = ex.evaluate(plain);
  EXPECT_EQ(ex.evaluate(whole).loss_sum, base.loss_sum);
  EXPECT_NE(ex.evaluate(each).loss_sum, base.loss_sum);
  auto bad = whole;
  bad[1][0].doc_start[kSeq + 3] = 2;
  test::expect_error([&] { ex.evaluate(bad); },
                     {"executor evaluation: rank 0's micro-batch 1: doc_start of sequence 1 "
                      "at position 3 is 2",
                      "previous position's"});
  bad = whole;
  bad[0][1].doc_start.pop_back();
  test::expect_error([&] { ex.step(bad, step_params(1)); },
                     {"rank 1's micro-batch 0", "document starts for"});
  EXPECT_FALSE(ex.step(whole, step_params(1)).skipped);
}

TEST(ZeroModelResidency, OffDeviceShardsGatherAndReduceScatterThroughCallerBuffers) {
  REQUIRE_DEVICES(3);
  // A unit whose P and G are not resident: gather from caller shards, reduce-scatter into
  // caller buffers, with integer-valued data so sums are exact.
  const int N = 3;
  Rig rig(N);
  const ModelLayout layout = ModelLayout::build(tiny(false));
  ZeroOptions zo;
  zo.persistence_threshold = 0;
  const int U = layout.num_units();
  zo.param_resident.assign(static_cast<size_t>(U), true);
  zo.grad_resident.assign(static_cast<size_t>(U), true);
  zo.param_resident[1] = false;
  zo.grad_resident[1] = false;
  ZeroModel zero(layout, *rig.comm, zo);
  const UnitPartition& up = zero.partition().units[1];
  std::vector<std::unique_ptr<Stream>> streams;
  std::vector<Stream*> sp;
  std::vector<DeviceBuffer> shards, outs;
  std::vector<TensorView> sv, ov;
  for (int r = 0; r < N; ++r) {
    Device& d = *rig.devices[static_cast<size_t>(r)];
    streams.push_back(d.create_stream("t"));
    sp.push_back(streams.back().get());
    shards.emplace_back(d, up.shard * 4, "shard");
    outs.emplace_back(d, up.shard * 4, "out");
    std::vector<float> x(up.shard);
    for (uint64_t i = 0; i < up.shard; ++i) x[i] = static_cast<float>(r * 1000 + i % 97);
    d.copy_to_device(shards.back().data(), x.data(), x.size() * 4, *sp.back());
    sp.back()->synchronize();  // x goes out of scope
    sv.push_back(shards.back().view(DType::f32, {static_cast<int64_t>(up.shard)}));
    ov.push_back(outs.back().view(DType::f32, {static_cast<int64_t>(up.shard)}));
  }
  test::expect_error([&] { zero.gather(1, sp, false); }, {"not resident"});
  test::expect_error([&] { zero.param_shard(1, 0); }, {"do not live on the devices"});
  const std::vector<UnitBuffers> g = zero.gather(1, sp, true, sv);
  for (int r = 0; r < N; ++r) {
    std::vector<float> full(up.padded);
    rig.devices[static_cast<size_t>(r)]->copy_to_host(full.data(), g[static_cast<size_t>(r)].params,
                                                      full.size() * 4, *sp[static_cast<size_t>(r)]);
    sp[static_cast<size_t>(r)]->synchronize();
    for (int q = 0; q < N; ++q)
      for (uint64_t i = 0; i < up.shard; i += 13)
        ASSERT_EQ(full[q * up.shard + i], static_cast<float>(q * 1000 + i % 97));
    // Working gradients: rank r writes r + 1 everywhere.
    std::vector<float> w(up.padded, static_cast<float>(r + 1));
    rig.devices[static_cast<size_t>(r)]->copy_to_device(g[static_cast<size_t>(r)].grads, w.data(),
                                                        w.size() * 4, *sp[static_cast<size_t>(r)]);
    sp[static_cast<size_t>(r)]->synchronize();
  }
  test::expect_error([&] { zero.reduce_scatter_grads(1, sp); }, {"not resident"});
  zero.reduce_scatter_grads(1, sp, ov);
  zero.release(1, sp);
  for (int r = 0; r < N; ++r) {
    std::vector<float> o(up.shard);
    rig.devices[static_cast<size_t>(r)]->copy_to_host(o.data(), outs[static_cast<size_t>(r)].data(),
                                                      o.size() * 4, *sp[static_cast<size_t>(r)]);
    sp[static_cast<size_t>(r)]->synchronize();
    for (float x : o) ASSERT_EQ(x, static_cast<float>(N * (N + 1) / 2));
  }
  // Resident units refuse caller buffers.
  test::expect_error([&] { zero.gather(0, sp, false, sv); }, {"live on the devices"});
}

}  // namespace
}  // namespace strata
