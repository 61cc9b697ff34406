// ZeRO-3 partitioning (src/partition/partition.h, zero.h) on host devices: the shard
// arithmetic, gather/release/reduce-scatter with integer-valued data (exact), and the Llama
// model's forward and backward over N = 1..4 ranks against one rank, with the memory each
// device holds by kind.
#include "core/device.h"
#include "host/host_device.h"
#include "model/llama.h"
#include "model/weights.h"
#include "partition/communicator.h"
#include "partition/partition.h"
#include "partition/zero.h"
#include "testing.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <tuple>

namespace strata {
namespace {

using test::expect_error;

ModelLayout layout_of(const std::vector<uint64_t>& numels) {
  ModelLayout layout;
  for (size_t i = 0; i < numels.size(); ++i) {
    UnitLayout u;
    u.name = fmt::format("u{}", i);
    u.numel = numels[i];
    layout.units.push_back(u);
    layout.total_numel += numels[i];
  }
  return layout;
}

uint64_t round_up(uint64_t n, uint64_t a) {
  return (n + a - 1) / a * a;
}

// ---- Partition ----

TEST(Partition, PadsToRanksTimesAlignAndSplitsEvenly) {
  const ModelLayout layout = layout_of({1000, 128, 5000, 3, 384, 1});
  for (int N = 1; N <= 4; ++N)
    for (uint64_t align : {uint64_t{1}, uint64_t{128}, uint64_t{100}}) {
      const Partition p = Partition::build(layout, N, align, 0);
      ASSERT_EQ(p.num_units(), 6);
      EXPECT_EQ(p.ranks, N);
      uint64_t resident = 0, max_unit = 0;
      for (size_t u = 0; u < p.units.size(); ++u) {
        const UnitPartition& up = p.units[u];
        const uint64_t q = static_cast<uint64_t>(N) * align;
        EXPECT_FALSE(up.replicated);
        EXPECT_EQ(up.name, layout.units[u].name);
        EXPECT_EQ(up.numel, layout.units[u].numel);
        EXPECT_EQ(up.padded, round_up(up.numel, q)) << "N " << N << " align " << align;
        EXPECT_EQ(up.padded % q, 0u);
        EXPECT_LT(up.padded - up.numel, q);
        EXPECT_EQ(up.shard * static_cast<uint64_t>(N), up.padded);
        EXPECT_EQ(up.shard % align, 0u);
        uint64_t real = 0;
        for (int r = 0; r < N; ++r) {
          EXPECT_EQ(up.shard_offset(r), static_cast<uint64_t>(r) * up.shard);
          real += up.shard_real(r);
        }
        EXPECT_EQ(real, up.numel) << "the shards' real elements add up to the unit";
        resident += up.shard;
        max_unit = std::max(max_unit, up.padded);
      }
      EXPECT_EQ(p.resident_numel(), resident);
      EXPECT_EQ(p.max_unit_numel(), max_unit);
      EXPECT_EQ(p.replicated_numel(), 0u);
      EXPECT_EQ(p.sharded_padded_numel(), resident * static_cast<uint64_t>(N));
    }
  // One case by hand: 1000 elements over 3 ranks, align 128 -> 1152 = 3 x 384; the last shard
  // holds 232 real elements and 152 of padding.
  const UnitPartition up = Partition::build(layout, 3, 128, 0).units[0];
  EXPECT_EQ(up.padded, 1152u);
  EXPECT_EQ(up.shard, 384u);
  EXPECT_EQ(up.shard_real(0), 384u);
  EXPECT_EQ(up.shard_real(2), 232u);
  // A unit smaller than the ranks' quantum: later shards are all padding.
  const UnitPartition tiny = Partition::build(layout, 4, 128, 0).units[5];
  EXPECT_EQ(tiny.padded, 512u);
  EXPECT_EQ(tiny.shard_real(0), 1u);
  EXPECT_EQ(tiny.shard_real(1), 0u);
  EXPECT_EQ(tiny.shard_real(3), 0u);
}

TEST(Partition, UnitsAtOrBelowThePersistenceThresholdStayWhole) {
  const ModelLayout layout = layout_of({1000, 128, 5000, 3, 384});
  for (int N = 1; N <= 4; ++N) {
    const Partition p = Partition::build(layout, N, 128, 384);  // DeepSpeed: numel <= threshold
    for (size_t u = 0; u < p.units.size(); ++u) {
      const UnitPartition& up = p.units[u];
      EXPECT_EQ(up.replicated, up.numel <= 384) << up.name;
      if (up.replicated) {
        EXPECT_EQ(up.padded, up.numel);
        EXPECT_EQ(up.shard, up.numel);
        EXPECT_EQ(up.resident(), up.numel);
        EXPECT_EQ(up.shard_offset(N - 1), 0u);
        EXPECT_EQ(up.shard_real(N - 1), up.numel);
      }
    }
    EXPECT_EQ(p.replicated_numel(), 128u + 3u + 384u);
    const uint64_t q = 128u * static_cast<uint64_t>(N);
    EXPECT_EQ(p.sharded_padded_numel(), round_up(1000, q) + round_up(5000, q));
    EXPECT_EQ(p.resident_numel(),
              p.sharded_padded_numel() / static_cast<uint64_t>(N) + p.replicated_numel());
    EXPECT_EQ(p.max_shard_numel(), round_up(5000, q) / static_cast<uint64_t>(N));
  }
  // Everything replicated: no shard at all.
  const Partition all = Partition::build(layout, 2, 128, 1u << 20);
  EXPECT_EQ(all.max_shard_numel(), 0u);
  EXPECT_EQ(all.resident_numel(), layout.total_numel);
}

TEST(Partition, StrAndBadArguments) {
  const ModelLayout layout = layout_of({1000, 3});
  const std::string s = Partition::build(layout, 3, 128, 10).str();
  EXPECT_NE(s.find("3 rank(s)"), std::string::npos) << s;
  EXPECT_NE(s.find("u0"), std::string::npos) << s;
  EXPECT_NE(s.find("1152"), std::string::npos) << s;
  EXPECT_NE(s.find("replicated"), std::string::npos) << s;
  expect_error([&] { Partition::build(layout, 0, 128, 0); }, {"0 ranks"});
  expect_error([&] { Partition::build(layout, 2, 0, 0); }, {"alignment of 0"});
  expect_error([&] { Partition::build(layout_of({5, 0}), 2, 1, 0); }, {"u1"});
}

// ---- ZeroModel mechanics, exact with integer values ----

struct Ranks {
  std::vector<std::unique_ptr<Device>> devices;
  std::vector<std::unique_ptr<Stream>> owned;
  std::vector<Stream*> streams;
  std::unique_ptr<Communicator> comm;

  explicit Ranks(int n, uint64_t memory = 64ull << 20) {
    std::vector<Device*> ptrs;
    for (int r = 0; r < n; ++r) {
      devices.push_back(open_host_device(r, memory));
      owned.push_back(devices.back()->create_stream("test"));
      streams.push_back(owned.back().get());
      ptrs.push_back(devices.back().get());
    }
    comm = make_communicator(ptrs);
  }
  void synchronize() {
    for (Stream* s : streams) s->synchronize();
  }
};

TEST(ZeroModel, GatherAssemblesUnitsAndReduceScatterSumsIntoShards) {
  const ModelLayout layout = layout_of({1000, 200, 384});
  for (int N = 1; N <= 4; ++N) {
    Ranks ranks(N);
    ZeroOptions o;
    o.persistence_threshold = 200;  // unit 1 replicated
    ZeroModel zero(layout, *ranks.comm, o);
    std::vector<std::vector<float>> values;
    for (int u = 0; u < 3; ++u) {
      std::vector<float> v(layout.units[static_cast<size_t>(u)].numel);
      for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>((i * 7 + u * 3) % 101) - 50;
      zero.upload_unit(u, v);
      EXPECT_EQ(zero.download_unit(u, false), v) << "unit " << u << " N " << N;
      values.push_back(v);
    }
    zero.zero_grads();

    for (int u = 0; u < 3; ++u) {
      const UnitPartition& up = zero.partition().units[static_cast<size_t>(u)];
      const std::vector<UnitBuffers> g = zero.gather(u, ranks.streams, true);
      ASSERT_EQ(g.size(), static_cast<size_t>(N));
      EXPECT_TRUE(zero.gathered(u));
      // Every rank sees the whole unit; its gradients start at zero. Rank r then writes
      // (r + 1) x value into its working gradients, twice over two rounds.
      std::vector<std::vector<float>> seen(static_cast<size_t>(N), std::vector<float>(up.numel));
      std::vector<std::vector<float>> zeros(static_cast<size_t>(N), std::vector<float>(up.numel));
      for (int r = 0; r < N; ++r) {
        Device& d = *ranks.devices[static_cast<size_t>(r)];
        d.copy_to_host(seen[static_cast<size_t>(r)].data(), g[static_cast<size_t>(r)].params,
                       up.numel * 4, *ranks.streams[static_cast<size_t>(r)]);
        d.copy_to_host(zeros[static_cast<size_t>(r)].data(), g[static_cast<size_t>(r)].grads,
                       up.numel * 4, *ranks.streams[static_cast<size_t>(r)]);
      }
      ranks.synchronize();
      for (int r = 0; r < N; ++r) {
        EXPECT_EQ(seen[static_cast<size_t>(r)], values[static_cast<size_t>(u)])
            << "unit " << u << " rank " << r << " N " << N;
        EXPECT_EQ(*std::max_element(zeros[static_cast<size_t>(r)].begin(),
                                    zeros[static_cast<size_t>(r)].end()),
                  0.0f);
      }
      std::vector<std::vector<float>> grads(static_cast<size_t>(N));
      for (int r = 0; r < N; ++r) {
        grads[static_cast<size_t>(r)] = values[static_cast<size_t>(u)];
        for (float& x : grads[static_cast<size_t>(r)]) x *= static_cast<float>(r + 1);
        ranks.devices[static_cast<size_t>(r)]->copy_to_device(
            g[static_cast<size_t>(r)].grads, grads[static_cast<size_t>(r)].data(), up.numel * 4,
            *ranks.streams[static_cast<size_t>(r)]);
      }
      zero.reduce_scatter_grads(u, ranks.streams);
      zero.release(u, ranks.streams);
      ranks.synchronize();  // the host copies above read `grads`
      EXPECT_FALSE(zero.gathered(u));
      // Sum over ranks of (r + 1) = N (N + 1) / 2.
      const float f = static_cast<float>(N * (N + 1) / 2);
      std::vector<float> want = values[static_cast<size_t>(u)];
      for (float& x : want) x *= f;
      EXPECT_EQ(zero.download_unit(u, true), want) << "unit " << u << " N " << N;

      // A second micro-batch accumulates (+=): the working gradients were zeroed again.
      const std::vector<UnitBuffers> g2 = zero.gather(u, ranks.streams, true);
      for (int r = 0; r < N; ++r)
        ranks.devices[static_cast<size_t>(r)]->copy_to_device(
            g2[static_cast<size_t>(r)].grads, grads[static_cast<size_t>(r)].data(), up.numel * 4,
            *ranks.streams[static_cast<size_t>(r)]);
      zero.reduce_scatter_grads(u, ranks.streams);
      zero.release(u, ranks.streams);
      ranks.synchronize();
      for (float& x : want) x *= 2;
      EXPECT_EQ(zero.download_unit(u, true), want) << "unit " << u << " N " << N;
    }
  }
}

TEST(ZeroModel, PoolAndStateErrorsAreNamed) {
  const ModelLayout layout = layout_of({1000, 200, 384, 500});
  Ranks ranks(2);
  ZeroOptions o;
  o.persistence_threshold = 200;
  ZeroModel zero(layout, *ranks.comm, o);
  zero.init_random(1);
  EXPECT_EQ(zero.free_working_buffers(), 2);
  zero.gather(0, ranks.streams);
  // A replicated unit gathered for forward is used in place: it takes no working buffer.
  zero.gather(1, ranks.streams);
  EXPECT_EQ(zero.free_working_buffers(), 1);
  expect_error([&] { zero.gather(0, ranks.streams); }, {"u0", "gathered already"});
  zero.gather(2, ranks.streams);
  EXPECT_EQ(zero.free_working_buffers(), 0);
  expect_error([&] { zero.gather(3, ranks.streams); }, {"u3", "u0, u2", "release one"});
  // Gathered for backward, a replicated unit gets working gradients of its own, outside the
  // pool: it never waits for a sharded unit to be released.
  zero.release(1, ranks.streams);
  const std::vector<UnitBuffers> g = zero.gather(1, ranks.streams, true);
  EXPECT_NE(g[0].grads, nullptr);
  EXPECT_EQ(zero.free_working_buffers(), 0);
  zero.release(1, ranks.streams);
  expect_error([&] { zero.release(1, ranks.streams); }, {"u1", "not gathered"});
  expect_error([&] { zero.reduce_scatter_grads(0, ranks.streams); }, {"u0", "for backward"});
  expect_error([&] { zero.gather(7, ranks.streams); }, {"unit 7", "0..3"});
  expect_error([&] { zero.gather(1, {ranks.streams[0]}); }, {"1 streams", "2 ranks"});
  zero.release(0, ranks.streams);
  zero.release(2, ranks.streams);
  EXPECT_EQ(zero.free_working_buffers(), 2);
  ranks.synchronize();

  ZeroOptions no_grads = o;
  no_grads.with_grads = false;
  ZeroModel eval(layout, *ranks.comm, no_grads);
  expect_error([&] { eval.gather(0, ranks.streams, true); }, {"without gradients"});
  expect_error([&] { (void)eval.download_unit(0, true); }, {"without gradients"});
  expect_error([&] { eval.upload_unit(0, std::vector<float>(3)); }, {"3 values", "1000"});
}

// ---- the Llama model over N ranks against one ----

LlamaConfig small_config(bool tied) {  // the shapes of test_llama.cpp
  LlamaConfig c;
  c.name = "test-small";
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 6;
  c.vocab_size = 29;
  c.max_position_embeddings = 64;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 10000.0;
  c.tie_word_embeddings = tied;
  return c;
}

constexpr int64_t kSeq = 5;
constexpr int64_t kSequences = 5;  // per micro-batch: 5 over 2, 3, 4 ranks never divides evenly

struct MicroBatch {
  std::vector<int32_t> ids, targets;  // kSequences × kSeq
  int64_t valid = 0;
};

MicroBatch make_batch(int seed) {
  MicroBatch b;
  for (int64_t i = 0; i < kSequences * kSeq; ++i) {
    b.ids.push_back(static_cast<int32_t>((i * 7 + 3 + seed * 5) % 29));
    const bool ignored = (i + seed) % 6 == 1;
    b.targets.push_back(ignored ? kIgnoreIndex : static_cast<int32_t>((i * 5 + 1 + seed) % 29));
    b.valid += ignored ? 0 : 1;
  }
  return b;
}

struct RunResult {
  double loss = 0;                         // mean over both micro-batches' valid tokens
  std::vector<std::vector<float>> grads;   // per unit, assembled
  std::vector<std::vector<float>> params;  // per unit, assembled
  std::vector<ArenaStats> memory;          // per device, after the run
  Partition partition;
};

// Two micro-batches, forward + backward over N ranks; rank r gets sequences r, r+N, ...
RunResult run_zero(const LlamaConfig& c, int N, uint64_t threshold,
                   const std::vector<std::vector<float>>& weights) {
  Ranks ranks(N);
  ModelOptions mo;
  mo.max_batch = (kSequences + N - 1) / N;
  mo.seq_len = kSeq;
  mo.vocab_chunk = 11;  // three chunks, the last one short
  ZeroOptions zo;
  zo.persistence_threshold = threshold;
  ZeroModel zero(ModelLayout::build(c), *ranks.comm, zo);
  for (int u = 0; u < zero.layout().num_units(); ++u)
    zero.upload_unit(u, weights[static_cast<size_t>(u)]);
  zero.zero_grads();
  std::vector<std::unique_ptr<LlamaModel>> models;
  std::vector<LlamaModel*> ptrs;
  for (int r = 0; r < N; ++r) {
    models.push_back(std::make_unique<LlamaModel>(c, mo, *ranks.devices[static_cast<size_t>(r)]));
    ptrs.push_back(models.back().get());
  }
  ZeroRunner runner(zero, ptrs);

  const MicroBatch mb[2] = {make_batch(0), make_batch(1)};
  const float scale = 1.0f / static_cast<float>(mb[0].valid + mb[1].valid);
  std::vector<DeviceBuffer> ids, targets;
  for (int r = 0; r < N; ++r) {
    ids.emplace_back(*ranks.devices[static_cast<size_t>(r)], mo.max_batch * kSeq * 4, "ids");
    targets.emplace_back(*ranks.devices[static_cast<size_t>(r)], mo.max_batch * kSeq * 4,
                         "targets");
  }
  double sum = 0;
  for (const MicroBatch& b : mb) {
    std::vector<RankBatch> batches(static_cast<size_t>(N));
    std::vector<std::vector<int32_t>> hid(static_cast<size_t>(N)), htg(static_cast<size_t>(N));
    for (int64_t s = 0; s < kSequences; ++s) {
      const auto r = static_cast<size_t>(s % N);
      hid[r].insert(hid[r].end(), b.ids.begin() + s * kSeq, b.ids.begin() + (s + 1) * kSeq);
      htg[r].insert(htg[r].end(), b.targets.begin() + s * kSeq, b.targets.begin() + (s + 1) * kSeq);
    }
    for (int r = 0; r < N; ++r) {
      const auto i = static_cast<size_t>(r);
      Device& d = *ranks.devices[i];
      d.copy_to_device(ids[i].data(), hid[i].data(), hid[i].size() * 4, *ranks.streams[i]);
      d.copy_to_device(targets[i].data(), htg[i].data(), htg[i].size() * 4, *ranks.streams[i]);
      batches[i] = {static_cast<const int32_t*>(ids[i].data()),
                    static_cast<const int32_t*>(targets[i].data()),
                    static_cast<int64_t>(hid[i].size()) / kSeq};
    }
    runner.forward(batches, ranks.streams);
    std::vector<std::vector<float>> losses(static_cast<size_t>(N));
    for (int r = 0; r < N; ++r) {
      const auto i = static_cast<size_t>(r);
      losses[i].resize(hid[i].size());
      if (batches[i].batch > 0)
        ranks.devices[i]->copy_to_host(losses[i].data(), ptrs[i]->losses(batches[i].batch).data,
                                       losses[i].size() * 4, *ranks.streams[i]);
    }
    runner.backward(batches, scale, ranks.streams);
    ranks.synchronize();
    for (const auto& l : losses)
      for (float x : l) sum += x;
  }
  RunResult out;
  out.loss = sum / static_cast<double>(mb[0].valid + mb[1].valid);
  for (int u = 0; u < zero.layout().num_units(); ++u) {
    out.grads.push_back(zero.download_unit(u, true));
    out.params.push_back(zero.download_unit(u, false));
  }
  for (auto& d : ranks.devices) out.memory.push_back(d->memory());
  out.partition = zero.partition();
  return out;
}

// max |a - b| over max |b|: the error relative to the tensor's scale.
double relative_error(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::abs(static_cast<double>(b[i])));
  }
  return scale > 0 ? diff / scale : diff;
}

class ZeroLlama : public ::testing::TestWithParam<std::tuple<bool, uint64_t, int>> {};

TEST_P(ZeroLlama, ForwardBackwardOverNRanksMatchesOne) {
  const auto [tied, threshold, pieces] = GetParam();
  LlamaConfig c = small_config(tied);
  c.vocab_pieces = pieces;
  const ModelLayout layout = ModelLayout::build(c);
  // Larger weights than a real init, so gradients stand well above f32 rounding.
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> dist(-0.4f, 0.4f);
  std::vector<std::vector<float>> weights;
  for (const UnitLayout& u : layout.units) {
    weights.emplace_back(u.numel);
    for (float& x : weights.back()) x = dist(rng);
  }

  // The whole model on one device, the model's own forward/backward: the ground truth the
  // ZeRO-3 path must reproduce at N = 1 too.
  double resident_loss = 0;
  std::vector<std::vector<float>> resident_grads;
  {
    auto device = open_host_device(0, 64ull << 20);
    auto stream = device->create_stream("test");
    ModelOptions mo;
    mo.max_batch = kSequences;
    mo.seq_len = kSeq;
    mo.vocab_chunk = 11;
    LlamaModel model(c, mo, *device);
    ResidentWeights w(layout, *device, DType::f32, DType::f32, true);
    for (int u = 0; u < layout.num_units(); ++u)
      w.upload(u, weights[static_cast<size_t>(u)], *stream);
    w.zero_grads(*stream);
    const MicroBatch mb[2] = {make_batch(0), make_batch(1)};
    const float scale = 1.0f / static_cast<float>(mb[0].valid + mb[1].valid);
    DeviceBuffer ids(*device, kSequences * kSeq * 4, "ids");
    DeviceBuffer targets(*device, kSequences * kSeq * 4, "targets");
    double sum = 0;
    for (const MicroBatch& b : mb) {
      device->copy_to_device(ids.data(), b.ids.data(), b.ids.size() * 4, *stream);
      device->copy_to_device(targets.data(), b.targets.data(), b.targets.size() * 4, *stream);
      auto* i = static_cast<int32_t*>(ids.data());
      auto* t = static_cast<int32_t*>(targets.data());
      model.forward(w.units(), i, t, kSequences, true, *stream);
      std::vector<float> l(b.ids.size());
      device->copy_to_host(l.data(), model.losses(kSequences).data, l.size() * 4, *stream);
      model.backward(w.units(), i, t, kSequences, scale, *stream);
      stream->synchronize();
      for (float x : l) sum += x;
    }
    resident_loss = sum / static_cast<double>(mb[0].valid + mb[1].valid);
    for (int u = 0; u < layout.num_units(); ++u)
      resident_grads.push_back(w.download(u, true, *stream));
  }

  const RunResult one = run_zero(c, 1, threshold, weights);
  EXPECT_NEAR(one.loss, resident_loss, 1e-6 * resident_loss);
  for (int u = 0; u < layout.num_units(); ++u)
    EXPECT_LE(
        relative_error(one.grads[static_cast<size_t>(u)], resident_grads[static_cast<size_t>(u)]),
        1e-6)
        << "unit " << u;
  {
    // One rank uses each unit where it lies: its working buffers hold gradients alone.
    uint64_t grads_numel = 0, own = 0;
    for (const UnitPartition& up : one.partition.units) {
      if (!up.replicated) grads_numel = std::max(grads_numel, up.padded);
      if (up.replicated) own += round_up(up.numel * 4, 256);
    }
    EXPECT_EQ(one.memory[0].peak_of(MemoryKind::gathered),
              2 * round_up(grads_numel * 4, 256) + own);
    EXPECT_EQ(one.memory[0].peak_of(MemoryKind::communication), 0u);  // adds in place
  }

  for (int N = 2; N <= 4; ++N) {
    SCOPED_TRACE("N = " + std::to_string(N));
    const RunResult run = run_zero(c, N, threshold, weights);
    const Partition& p = run.partition;
    EXPECT_NEAR(run.loss, one.loss, 1e-6 * one.loss);
    bool any_grad = false;
    for (int u = 0; u < layout.num_units(); ++u) {
      const auto i = static_cast<size_t>(u);
      EXPECT_EQ(run.params[i], weights[i]) << "unit " << u << ": parameters were changed";
      EXPECT_LE(relative_error(run.grads[i], one.grads[i]), 1e-6) << "unit " << u;
      for (float g : run.grads[i]) any_grad = any_grad || g != 0.0f;
    }
    EXPECT_TRUE(any_grad);

    // Memory by kind on every device: model state is 1/N of the sharded units plus every
    // replicated unit, exactly the partition's shards (each block rounded to 256 bytes).
    uint64_t shards = 0, gathered = 0, gather_numel = 0, own = 0;
    for (const UnitPartition& up : p.units) {
      shards += round_up(up.resident() * 4, 256);
      if (!up.replicated) gather_numel = std::max(gather_numel, up.padded);
      if (up.replicated) own += round_up(up.numel * 4, 256);
    }
    const uint64_t slots = 2;
    gathered = slots * 2 * round_up(gather_numel * 4, 256) + own;
    const uint64_t replicated = p.replicated_numel() * 4;
    const uint64_t slack = static_cast<uint64_t>(p.num_units()) *
                           (static_cast<uint64_t>(N) * ModelLayout::kAlign * 4 + 256);
    for (int r = 0; r < N; ++r) {
      const ArenaStats& m = run.memory[static_cast<size_t>(r)];
      SCOPED_TRACE("device " + std::to_string(r));
      EXPECT_EQ(m.peak_of(MemoryKind::parameters), shards);
      EXPECT_EQ(m.peak_of(MemoryKind::gradients), shards);
      const uint64_t model_state =
          m.peak_of(MemoryKind::parameters) + m.peak_of(MemoryKind::gradients);
      const uint64_t ideal =
          2 * (layout.total_numel * 4 - replicated) / static_cast<uint64_t>(N) + 2 * replicated;
      EXPECT_GE(model_state, ideal);
      EXPECT_LE(model_state, ideal + 2 * slack);
      // The gathered kind is the pool of two working buffers, never more (at most two sharded
      // units' worth of parameters and gradients), and each replicated unit's own working
      // gradients.
      EXPECT_EQ(m.peak_of(MemoryKind::gathered), gathered);
      EXPECT_LE(m.peak_of(MemoryKind::gathered),
                2 * 2 * (p.max_unit_numel() * 4 + 256) + replicated + 256 * p.num_units());
      EXPECT_GT(m.peak_of(MemoryKind::activations), 0u);
      EXPECT_EQ(m.peak_of(MemoryKind::optimizer), 0u);
    }
  }
}

// Thresholds: 0 shards every unit; 600 keeps the embedding (512 elements) and a tied head
// (128) replicated while the blocks and an untied head (640) are sharded. Pieces: the tables
// whole, or in 3 vocabulary pieces (of 10, 10 and 9 rows; tied, the head's pieces read the
// embedding's and its gradients are reduced twice).
INSTANTIATE_TEST_SUITE_P(TiedThresholdAndPieces, ZeroLlama,
                         ::testing::Combine(::testing::Bool(),
                                            ::testing::Values(uint64_t{0}, uint64_t{600}),
                                            ::testing::Values(1, 3)));

TEST(ZeroRunner, ChecksItsModels) {
  const LlamaConfig c = small_config(true);
  Ranks ranks(2);
  ModelOptions mo;
  mo.max_batch = 1;
  mo.seq_len = kSeq;
  ZeroOptions zo;
  zo.working_buffers = 1;
  ZeroModel one_buffer(ModelLayout::build(c), *ranks.comm, zo);
  LlamaModel m0(c, mo, *ranks.devices[0]), m1(c, mo, *ranks.devices[1]);
  expect_error([&] { ZeroRunner r(one_buffer, {&m0, &m1}); }, {"ties its embeddings", "2"});
  zo.working_buffers = 2;
  ZeroModel zero(ModelLayout::build(c), *ranks.comm, zo);
  expect_error([&] { ZeroRunner r(zero, {&m1, &m0}); }, {"rank 0", "host:1", "host:0"});
  expect_error([&] { ZeroRunner r(zero, {&m0}); }, {"1 models", "2 ranks"});
  ZeroRunner runner(zero, {&m0, &m1});
  expect_error(
      [&] {
        runner.forward({RankBatch{}, RankBatch{nullptr, nullptr, 2}}, ranks.streams);
      },
      {"rank 1", "batch of 2"});
}

}  // namespace
}  // namespace strata
