// test_communicator.cpp: the in-process communicator over host devices (communicator.h).
//
// Labels unit and tsan: collectives order work across the ranks' stream threads with events
// only, so a missing fence is a wrong result here and a data race under TSan. The same checks
// run on CUDA in test_communicator_gpu.cpp (communicator_testing.h holds them).
#include "core/bytes.h"
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

Ranks host_ranks(int n, uint64_t memory = 64 * kMiB) {
  std::vector<std::unique_ptr<Device>> devices;
  for (int r = 0; r < n; ++r) devices.push_back(open_host_device(r, memory));
  return Ranks(std::move(devices));
}

TEST(InProcessCommunicator, CollectivesAreBitExactForEveryRankCountAndSize) {
  for (int n = 1; n <= 4; ++n) {
    Ranks ranks = host_ranks(n);
    auto comm = make_inprocess_communicator(ranks.devices);
    EXPECT_EQ(comm->size(), n);
    EXPECT_EQ(comm->name(), "in-process");
    for (int r = 0; r < n; ++r) EXPECT_EQ(&comm->device(r), ranks.devices[r]);
    test::check_collective_matrix(*comm, ranks);
    if (HasFailure()) return;
  }
}

TEST(InProcessCommunicator, SumsInRankOrderWithTheSameBitsEveryRun) {
  for (int n : {2, 3, 4}) {
    Ranks ranks = host_ranks(n);
    auto comm = make_inprocess_communicator(ranks.devices);
    for (DType dtype : {DType::f32, DType::bf16})
      for (int64_t count : {7, 1025}) test::check_rank_order_sums(*comm, ranks, dtype, count);
  }
}

TEST(InProcessCommunicator, WaitsForWorkQueuedBeforeIt) {
  for (int n : {1, 3}) {
    Ranks ranks = host_ranks(n);
    auto comm = make_inprocess_communicator(ranks.devices);
    test::check_waits_for_producers(*comm, ranks);
  }
}

TEST(InProcessCommunicator, WorkQueuedAfterItCannotDisturbPeers) {
  for (int n : {2, 4}) {
    Ranks ranks = host_ranks(n);
    auto comm = make_inprocess_communicator(ranks.devices);
    test::check_send_reusable_after(*comm, ranks);
  }
}

TEST(InProcessCommunicator, CollectivesRunInCallOrderAcrossStreams) {
  for (int n : {1, 2, 3}) {
    Ranks ranks = host_ranks(n);
    auto comm = make_inprocess_communicator(ranks.devices);
    test::check_call_order_across_streams(*comm, ranks);
  }
}

TEST(InProcessCommunicator, EmptyTensorsQueueNothing) {
  for (int n : {1, 3}) {
    Ranks ranks = host_ranks(n);
    auto comm = make_inprocess_communicator(ranks.devices);
    test::check_empty_collectives(*comm, ranks);
    EXPECT_EQ(ranks.device(0).memory().in_use, 0u);  // no staging for nothing
  }
}

// Staging comes from the rank's arena, is kept between calls, and an arena too small for it
// says it is the communicator's.
TEST(InProcessCommunicator, StagingIsKeptAndNamedInOutOfMemoryErrors) {
  Ranks ranks = host_ranks(2, 256 * 1024);
  auto comm = make_inprocess_communicator(ranks.devices);
  std::vector<Guarded> send = test::guarded(ranks, DType::f32, 2 * 1000),
                       recv = test::guarded(ranks, DType::f32, 1000);
  const uint64_t before = ranks.device(1).memory().in_use;
  comm->reduce_scatter(test::views(send), test::views(recv), ranks.streams);
  ranks.synchronize();
  const uint64_t with_staging = ranks.device(1).memory().in_use;
  EXPECT_GE(with_staging, before + 1000 * 4);
  comm->reduce_scatter(test::views(send), test::views(recv), ranks.streams);
  ranks.synchronize();
  EXPECT_EQ(ranks.device(1).memory().in_use, with_staging);  // reused, not allocated again

  // A larger collective whose tensors fit but whose staging does not: the error says whose
  // memory it is, and nothing was queued.
  const int64_t count = 10000;  // below the host add's parallel grain: no TBB under TSan
  std::vector<Guarded> big_send = test::guarded(ranks, DType::f32, 2 * count),
                       big_recv = test::guarded(ranks, DType::f32, count);
  const ArenaStats m = ranks.device(1).memory();
  DeviceBuffer filler(ranks.device(1), m.largest_free - count * 4 / 2, "filler");
  expect_error(
      [&] { comm->reduce_scatter(test::views(big_send), test::views(big_recv), ranks.streams); },
      {"host:1", "in-process communicator staging", format_bytes(count * 4)});
  filler.reset();
  comm->reduce_scatter(test::views(big_send), test::views(big_recv), ranks.streams);
  ranks.synchronize();
}

TEST(InProcessCommunicator, RejectsMismatchedCallsNamingRankAndTensor) {
  Ranks ranks = host_ranks(3, 4 * kMiB);
  auto comm = make_inprocess_communicator(ranks.devices);
  std::vector<Guarded> send = test::guarded(ranks, DType::f32, 7),
                       recv = test::guarded(ranks, DType::f32, 21);
  const std::vector<TensorView> s = test::views(send), r = test::views(recv);
  auto with = [](std::vector<TensorView> v, size_t i, const TensorView& t) {
    v[i] = t;
    return v;
  };
  // A rank's count differs.
  expect_error([&] { comm->all_gather(with(s, 1, send[1].view(0, 6)), r, ranks.streams); },
               {"all_gather", "rank 1's send", "6 elements", "must have 7"});
  expect_error([&] { comm->all_gather(s, with(r, 2, recv[2].view(0, 20)), ranks.streams); },
               {"all_gather", "rank 2's recv", "20 elements", "must have 21", "3 ranks x"});
  expect_error([&] { comm->reduce_scatter(r, with(s, 1, send[1].view(0, 6)), ranks.streams); },
               {"reduce_scatter", "rank 1's recv", "6 elements", "must have 7"});
  expect_error([&] { comm->reduce_scatter(with(r, 0, recv[0].view(0, 20)), s, ranks.streams); },
               {"reduce_scatter", "rank 0's send", "20 elements", "must have 21",
                "3 ranks x rank 0's recv count 7"});
  expect_error([&] { comm->all_reduce(with(s, 2, send[2].view(0, 5)), ranks.streams); },
               {"all_reduce", "rank 2's buf", "5 elements", "must have 7"});
  // Dtypes.
  TensorView as_bf16 = send[1].view(0, 7);
  as_bf16.dtype = DType::bf16;
  expect_error(
      [&] { comm->all_gather(with(s, 1, as_bf16), r, ranks.streams); },
      {"all_gather", "rank 1's send bf16[7] on host:1", "rank 0's send f32[7]", "same dtype"});
  TensorView as_f16 = as_bf16;
  as_f16.dtype = DType::f16;
  expect_error([&] { comm->all_reduce(with(s, 1, as_f16), ranks.streams); },
               {"all_reduce", "rank 1's buf f16[7]", "f32 or bf16"});
  // One entry per rank.
  expect_error(
      [&] {
        comm->all_gather({s[0], s[1]}, r, ranks.streams);
      },
      {"all_gather over 3 ranks", "2 send tensors given"});
  expect_error(
      [&] {
        comm->all_reduce(s, {ranks.streams[0], ranks.streams[1]});
      },
      {"all_reduce over 3 ranks", "2 streams given"});
  // Tensors and streams of the wrong rank.
  expect_error([&] { comm->all_reduce(with(s, 1, s[2]), ranks.streams); },
               {"all_reduce", "rank 1's buf", "belongs to host:2", "rank 1 is host:1"});
  TensorView unowned = s[2];
  unowned.device = nullptr;
  expect_error([&] { comm->all_reduce(with(s, 1, unowned), ranks.streams); },
               {"all_reduce", "rank 1's buf", "not in host:1's memory"});
  expect_error(
      [&] {
        comm->all_reduce(s, {ranks.streams[0], ranks.streams[2], ranks.streams[2]});
      },
      {"all_reduce", "rank 1's stream", "host:1"});
  expect_error(
      [&] {
        comm->all_reduce(s, {ranks.streams[0], nullptr, ranks.streams[2]});
      },
      {"rank 1's stream is null"});
  // Overlaps: two ranks' tensors on one device, or reduce_scatter in place.
  auto same = make_inprocess_communicator({ranks.devices[0], ranks.devices[0]});
  expect_error(
      [&] {
        same->all_reduce({s[0], s[0]}, {ranks.streams[0], ranks.streams[0]});
      },
      {"all_reduce", "rank 0's buf", "rank 1's buf", "overlap"});
  std::vector<TensorView> scatter_send = {recv[0].view(0, 21), recv[1].view(0, 21),
                                          recv[2].view(0, 21)};
  expect_error(
      [&] { comm->reduce_scatter(scatter_send, with(s, 1, recv[1].view(7, 7)), ranks.streams); },
      {"reduce_scatter", "rank 1's send", "rank 1's recv", "overlap"});
  expect_error([&] { comm->all_gather(with(s, 1, recv[1].view(0, 7)), r, ranks.streams); },
               {"all_gather", "rank 1's send", "rank 1's recv", "overlap", "own chunk"});
  expect_error([&] { comm->device(3); }, {"rank 3", "0..2"});
  // Nothing was queued by the failed calls: the buffers are as they were.
  for (int q = 0; q < 3; ++q) {
    const std::vector<uint8_t> got = recv[q].download(ranks.stream(q), "untouched");
    EXPECT_EQ(got, std::vector<uint8_t>(got.size(), Guarded::kSentinel));
  }
}

TEST(InProcessCommunicator, RejectsDevicesItCannotJoin) {
  expect_error([] { make_inprocess_communicator({}); }, {"in-process communicator", "no devices"});
  auto dev = open_host_device(0, 1 * kMiB);
  expect_error(
      [&] {
        make_inprocess_communicator({dev.get(), nullptr});
      },
      {"in-process communicator", "rank 1 is null"});
}

// make_communicator keeps host devices in-process; NCCL refuses them, naming the device (or, in
// a build without CUDA, saying NCCL is not compiled in).
TEST(MakeCommunicator, HostDevicesGoInProcessAndNcclRefusesThem) {
  Ranks ranks = host_ranks(2, 1 * kMiB);
  EXPECT_EQ(make_communicator(ranks.devices)->name(), "in-process");
  EXPECT_EQ(make_communicator({ranks.devices[0]})->name(), "in-process");
  expect_error([&] { make_nccl_communicator(ranks.devices); }, {"NCCL communicator", "host:0"});
}

}  // namespace
}  // namespace strata
