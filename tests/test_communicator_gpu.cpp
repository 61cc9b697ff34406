// test_communicator_gpu.cpp: the communicators on CUDA devices (label gpu).
//
// The in-process communicator runs over N CudaDevice objects opened on cuda:0 (virtual ranks
// sharing one GPU) with the very checks the host suite runs (communicator_testing.h), so its
// sums must match the host's rank-order sums bit for bit. NCCL runs over one GPU (a single rank,
// so its code path runs on any GPU machine) and over distinct GPUs when there are at least two.
// Every test skips with the runtime's status when no GPU is usable.
#include "core/bytes.h"
#include "gpu/runtime.h"
#include "host/host_device.h"
#include "partition/communicator.h"

#include <gtest/gtest.h>
#include "communicator_testing.h"
#include "testing.h"

namespace strata {
namespace {

using test::expect_error;
using test::Guarded;
using test::Ranks;

constexpr uint64_t kMiB = uint64_t{1} << 20;

#define SKIP_WITHOUT_GPU()                                                                        \
  do {                                                                                            \
    const CudaRuntime& rt_ = cuda_runtime();                                                      \
    if (rt_.gpus.empty()) GTEST_SKIP() << "no CUDA device: " << rt_.status << ": " << rt_.detail; \
  } while (0)

Ranks cuda_ranks(const std::vector<int>& gpus, uint64_t memory = 64 * kMiB) {
  std::vector<std::unique_ptr<Device>> devices;
  for (int g : gpus) devices.push_back(open_cuda_device(g, memory));
  return Ranks(std::move(devices));
}

std::vector<int> gpu0_times(int n) {
  return std::vector<int>(static_cast<size_t>(n), 0);
}

TEST(CudaInProcessCommunicator, CollectivesAreBitExactOnVirtualRanks) {
  SKIP_WITHOUT_GPU();
  for (int n = 1; n <= 4; ++n) {
    Ranks ranks = cuda_ranks(gpu0_times(n));
    auto comm = make_inprocess_communicator(ranks.devices);
    EXPECT_EQ(comm->name(), "in-process");
    test::check_collective_matrix(*comm, ranks);
    if (HasFailure()) return;
  }
}

TEST(CudaInProcessCommunicator, SumsInRankOrderWithTheHostsBits) {
  SKIP_WITHOUT_GPU();
  for (int n : {2, 3, 4}) {
    Ranks ranks = cuda_ranks(gpu0_times(n));
    auto comm = make_inprocess_communicator(ranks.devices);
    for (DType dtype : {DType::f32, DType::bf16})
      for (int64_t count : {7, 1025}) test::check_rank_order_sums(*comm, ranks, dtype, count);
  }
}

TEST(CudaInProcessCommunicator, OrdersWorkAcrossStreams) {
  SKIP_WITHOUT_GPU();
  for (int n : {1, 2, 4}) {
    Ranks ranks = cuda_ranks(gpu0_times(n));
    auto comm = make_inprocess_communicator(ranks.devices);
    test::check_waits_for_producers(*comm, ranks);
    test::check_send_reusable_after(*comm, ranks);
    test::check_call_order_across_streams(*comm, ranks);
    test::check_empty_collectives(*comm, ranks);
  }
}

TEST(CudaPeerCopy, CopiesBetweenDevicesOnOneGpuAndChecksPointers) {
  SKIP_WITHOUT_GPU();
  Ranks ranks = cuda_ranks({0, 0}, 4 * kMiB);
  Guarded a(ranks.device(0), ranks.stream(0), DType::f32, 1000);
  Guarded b(ranks.device(1), ranks.stream(1), DType::f32, 1000);
  a.upload(test::rank_values(0, 1000), ranks.stream(0));
  ranks.device(1).copy_from_peer(b.view().data, ranks.device(0), a.view().data, 4000,
                                 ranks.stream(1));
  test::expect_bits(b.download(ranks.stream(1), "peer copy"), test::rank_values(0, 1000),
                    DType::f32, "copy_from_peer cuda:0 -> cuda:0");
  EXPECT_TRUE(ranks.device(0).owns(a.view().data, 4000));
  EXPECT_FALSE(ranks.device(1).owns(a.view().data, 4000));
  expect_error(
      [&] {
        ranks.device(1).copy_from_peer(b.view().data, ranks.device(1), a.view().data, 4000,
                                       ranks.stream(1));
      },
      {"copy_from_peer source", "not in cuda:0's memory"});
  expect_error(
      [&] {
        ranks.device(1).copy_from_peer(a.view().data, ranks.device(0), a.view().data, 4000,
                                       ranks.stream(1));
      },
      {"copy_from_peer", "destination"});
  expect_error(
      [&] {
        ranks.device(1).copy_from_peer(b.view().data, ranks.device(0), a.view().data, 0,
                                       ranks.stream(0));
      },
      {"stream 'comm'"});
  auto host = open_host_device(0, 1 * kMiB);
  DeviceBuffer on_host(*host, 4000, "host");
  expect_error(
      [&] {
        ranks.device(1).copy_from_peer(b.view().data, *host, on_host.data(), 4000, ranks.stream(1));
      },
      {"host:0", "another backend"});
}

TEST(MakeCommunicator, VirtualRanksOnOneGpuGoInProcessAndNcclRefusesThem) {
  SKIP_WITHOUT_GPU();
  Ranks ranks = cuda_ranks({0, 0}, 4 * kMiB);
  EXPECT_EQ(make_communicator(ranks.devices)->name(), "in-process");
  expect_error([&] { make_nccl_communicator(ranks.devices); },
               {"NCCL communicator", "ranks 0 and 1 are both cuda:0", "distinct GPU"});
}

// A single-rank NCCL communicator runs NCCL's code path (init, grouped calls, in-place
// all_gather, teardown) on a one-GPU machine.
TEST(NcclCommunicator, RunsOnOneGpu) {
  SKIP_WITHOUT_GPU();
  Ranks ranks = cuda_ranks({0});
  auto comm = make_nccl_communicator(ranks.devices);
  EXPECT_EQ(comm->name(), "nccl");
  EXPECT_EQ(comm->size(), 1);
  test::check_collective_matrix(*comm, ranks);
  test::check_waits_for_producers(*comm, ranks);
  test::check_send_reusable_after(*comm, ranks);
  test::check_empty_collectives(*comm, ranks);
}

TEST(NcclCommunicator, CollectivesAreBitExactOverDistinctGpus) {
  SKIP_WITHOUT_GPU();
  const int gpus = static_cast<int>(cuda_runtime().gpus.size());
  if (gpus < 2)
    GTEST_SKIP() << "NCCL over distinct GPUs needs at least 2 GPUs; this machine has " << gpus;
  for (int n = 2; n <= std::min(gpus, 4); ++n) {
    std::vector<int> indices;
    for (int g = 0; g < n; ++g) indices.push_back(g);
    Ranks ranks = cuda_ranks(indices);
    auto comm = make_communicator(ranks.devices);
    EXPECT_EQ(comm->name(), "nccl");
    test::check_collective_matrix(*comm, ranks);
    test::check_waits_for_producers(*comm, ranks);
    test::check_send_reusable_after(*comm, ranks);
    test::check_empty_collectives(*comm, ranks);
    if (HasFailure()) return;
  }
}

}  // namespace
}  // namespace strata
