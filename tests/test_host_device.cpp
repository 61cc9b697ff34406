// test_host_device.cpp: the host backend's memory, streams, events, copies and convert.
//
// Ordering tests write plain (non-atomic) data on one stream and read it on another, so a
// missing happens-before edge is both a wrong value here and a data race under TSan.
#include "core/bytes.h"
#include "core/device.h"
#include "core/dtype.h"
#include "core/error.h"
#include "host/host_device.h"

#include <gtest/gtest.h>
#include "testing.h"

#include <atomic>
#include <chrono>
#include <cstring>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

namespace strata {
namespace {

using test::expect_error;

using namespace std::chrono_literals;

constexpr uint64_t kMiB = 1ull << 20;

TEST(HostDevice, OpensWithNameIndexAndCap) {
  auto dev = open_host_device(2, 4 * kMiB);
  EXPECT_EQ(dev->backend(), Backend::host);
  EXPECT_EQ(dev->index(), 2);
  EXPECT_EQ(dev->name(), "host:2");
  const ArenaStats m = dev->memory();
  EXPECT_EQ(m.capacity, 4 * kMiB);
  EXPECT_EQ(m.in_use, 0u);
  expect_error([] { open_host_device(0, 0); }, {"host:0", "--device-memory"});
}

TEST(HostDevice, AllocatesAlignedBlocksAndReleasesThem) {
  auto dev = open_host_device(0, 1 * kMiB);
  void* a = dev->allocate(1, "a");
  void* b = dev->allocate(1000, "b");
  void* z = dev->allocate(0, "empty");
  for (void* p : {a, b, z}) {
    ASSERT_NE(p, nullptr);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 256, 0u) << p;
  }
  EXPECT_NE(a, b);
  EXPECT_NE(a, z);
  EXPECT_NE(b, z);
  EXPECT_EQ(dev->memory().allocations, 3u);
  EXPECT_EQ(dev->memory().in_use, 256u + 1024u + 256u);
  std::memset(b, 0x5a, 1000);  // the memory is usable from the host
  dev->release(a);
  dev->release(b);
  dev->release(z);
  dev->release(nullptr);  // no-op
  EXPECT_EQ(dev->memory().in_use, 0u);
  EXPECT_EQ(dev->memory().allocations, 0u);
  EXPECT_EQ(dev->memory().largest_free, 1 * kMiB);
}

TEST(HostDevice, ReleaseOfForeignOrStalePointerThrows) {
  auto dev = open_host_device(0, 1 * kMiB);
  int on_stack = 0;
  expect_error([&] { dev->release(&on_stack); }, {"host:0", "not host:0 memory"});
  void* p = dev->allocate(512, "x");
  dev->release(p);
  expect_error([&] { dev->release(p); }, {"device host:0", "never allocated"});
  void* q = dev->allocate(512, "y");
  expect_error([&] { dev->release(static_cast<char*>(q) + 256); }, {"device host:0"});
  dev->release(q);
}

TEST(HostDevice, AllocationPastTheCapNamesCapAndRequest) {
  const uint64_t cap = 8 * kMiB;
  auto dev = open_host_device(1, cap);
  void* held = dev->allocate(6 * kMiB, "weights");
  const uint64_t request = 3 * kMiB;
  expect_error([&] { dev->allocate(request, "activations"); },
               {"device host:1", "activations", format_bytes(request), format_bytes(cap),
                "--device-memory"});
  expect_error([&] { dev->allocate(cap + 1, "huge"); }, {format_bytes(cap + 1), format_bytes(cap)});
  dev->release(held);
  void* fits = dev->allocate(request, "activations");  // fits once the weights are gone
  dev->release(fits);
}

TEST(HostDevice, ArenaIsReservedNotCommitted) {
  // 64 GiB per device would not fit in this machine's RAM if the pages were committed.
  auto dev = open_host_device(0, 64ull << 30);
  void* p = dev->allocate(32ull << 30, "big");
  static_cast<char*>(p)[0] = 1;  // touch one page only
  dev->release(p);
}

TEST(HostStream, RunsTasksInOrder) {
  auto dev = open_host_device(0, 1 * kMiB);
  auto s = dev->create_stream("compute");
  EXPECT_EQ(s->name(), "compute");
  std::vector<int> seen;  // touched only by the stream thread until synchronize()
  for (int i = 0; i < 1000; ++i) s->host_task([&seen, i] { seen.push_back(i); });
  s->synchronize();
  std::vector<int> expected(1000);
  std::iota(expected.begin(), expected.end(), 0);
  EXPECT_EQ(seen, expected);
}

TEST(HostStream, TasksRunOffTheCallingThread) {
  auto dev = open_host_device(0, 1 * kMiB);
  auto s = dev->create_stream("compute");
  std::thread::id ran_on;
  s->host_task([&] { ran_on = std::this_thread::get_id(); });
  s->synchronize();
  EXPECT_NE(ran_on, std::this_thread::get_id());
  EXPECT_NE(ran_on, std::thread::id());
}

TEST(HostStream, DestroyingAStreamDrainsItsQueue) {
  auto dev = open_host_device(0, 1 * kMiB);
  int count = 0;
  {
    auto s = dev->create_stream("drain");
    s->host_task([] { std::this_thread::sleep_for(20ms); });
    for (int i = 0; i < 100; ++i) s->host_task([&count] { ++count; });
  }
  EXPECT_EQ(count, 100);
}

TEST(HostStream, EventsOrderWorkAcrossStreams) {
  auto dev = open_host_device(0, 1 * kMiB);
  auto a = dev->create_stream("a");
  auto b = dev->create_stream("b");
  auto ev = dev->create_event();
  int value = -1;  // written on a, read on b: plain int on purpose (see the file note)
  std::vector<int> observed;
  constexpr int kRounds = 200;
  for (int i = 0; i < kRounds; ++i) {
    a->host_task([&value, i] {
      std::this_thread::sleep_for(std::chrono::microseconds(100 + 50 * (i % 5)));
      value = i;
    });
    a->record(*ev);
    b->wait(*ev);
    b->host_task([&value, &observed] { observed.push_back(value); });
    // b must not run ahead into the next round's write either.
    b->record(*ev);
    a->wait(*ev);
  }
  b->synchronize();
  a->synchronize();
  ASSERT_EQ(observed.size(), static_cast<size_t>(kRounds));
  for (int i = 0; i < kRounds; ++i) ASSERT_EQ(observed[static_cast<size_t>(i)], i) << "round " << i;
}

TEST(HostStream, WaitCapturesTheRecordAtCallTime) {
  // b waits on the first record; a later record (behind a blocked task) must not hold b up.
  auto dev = open_host_device(0, 1 * kMiB);
  auto a = dev->create_stream("a");
  auto b = dev->create_stream("b");
  auto ev = dev->create_event();
  std::atomic<bool> release_a{false};
  a->record(*ev);
  b->wait(*ev);
  a->host_task([&] {
    while (!release_a.load()) std::this_thread::sleep_for(1ms);
  });
  a->record(*ev);
  std::atomic<bool> b_ran{false};
  b->host_task([&] { b_ran = true; });
  for (int i = 0; i < 2000 && !b_ran.load(); ++i) std::this_thread::sleep_for(1ms);
  EXPECT_TRUE(b_ran.load()) << "b waited for a record made after its wait() call";
  EXPECT_FALSE(ev->query());
  release_a = true;
  b->synchronize();
  ev->synchronize();
  EXPECT_TRUE(ev->query());
}

TEST(HostStream, WaitOnANeverRecordedEventDoesNotBlock) {
  auto dev = open_host_device(0, 1 * kMiB);
  auto s = dev->create_stream("s");
  auto ev = dev->create_event();
  EXPECT_TRUE(ev->query());
  ev->synchronize();  // returns at once
  s->wait(*ev);
  bool ran = false;
  s->host_task([&ran] { ran = true; });
  s->synchronize();
  EXPECT_TRUE(ran);
}

TEST(HostStream, EventQueryAndSynchronizeFollowTheWork) {
  auto dev = open_host_device(0, 1 * kMiB);
  auto s = dev->create_stream("s");
  auto ev = dev->create_event();
  std::atomic<bool> go{false};
  int done = 0;
  s->host_task([&] {
    while (!go.load()) std::this_thread::sleep_for(1ms);
    done = 1;
  });
  s->record(*ev);
  std::this_thread::sleep_for(10ms);
  EXPECT_FALSE(ev->query()) << "event completed before the work before it";
  go = true;
  ev->synchronize();
  EXPECT_TRUE(ev->query());
  EXPECT_EQ(done, 1);  // synchronize() orders the task's write before this read
  s->synchronize();
}

TEST(HostStream, AnEventMayBeDestroyedWithWorkQueuedOnIt) {
  // Destroying an event with work still queued on it is allowed (as in CUDA).
  auto dev = open_host_device(0, 1 * kMiB);
  auto a = dev->create_stream("a");
  auto b = dev->create_stream("b");
  {
    auto ev = dev->create_event();
    a->host_task([] { std::this_thread::sleep_for(5ms); });
    a->record(*ev);
    b->wait(*ev);
  }
  dev->synchronize();
}

TEST(HostStream, ATaskErrorSkipsLaterWorkAndIsReportedOnce) {
  auto dev = open_host_device(0, 1 * kMiB);
  auto s = dev->create_stream("h2d");
  auto ev = dev->create_event();
  bool later_ran = false;
  s->host_task([] { fail("disk on fire"); });
  s->host_task([] { throw std::runtime_error("second error"); });
  s->host_task([&later_ran] { later_ran = true; });
  s->record(*ev);
  // The marker still runs, so other streams waiting on this one do not hang.
  for (int i = 0; i < 2000 && !ev->query(); ++i) std::this_thread::sleep_for(1ms);
  ASSERT_TRUE(ev->query()) << "an event recorded after a failed task never completed";
  try {
    s->synchronize();
    ADD_FAILURE() << "the error was not reported";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("stream 'h2d' on host:0: disk on fire"), std::string::npos) << msg;
    EXPECT_EQ(msg.find("second error"), std::string::npos) << "not the first error: " << msg;
  }
  EXPECT_FALSE(later_ran) << "a task after a failed one ran";
  // Reported once; the stream then runs new work again.
  s->synchronize();
  dev->synchronize();
  bool after_ran = false;
  s->host_task([&after_ran] { after_ran = true; });
  s->synchronize();
  EXPECT_TRUE(after_ran);
}

TEST(HostStream, SynchronizeFromItsOwnTaskIsAnError) {
  auto dev = open_host_device(0, 1 * kMiB);
  auto s = dev->create_stream("self");
  Stream* raw = s.get();
  s->host_task([raw] { raw->synchronize(); });
  expect_error([&] { s->synchronize(); }, {"stream 'self' on host:0", "its own tasks"});
}

TEST(HostDevice, SynchronizeWaitsForEveryStream) {
  auto dev = open_host_device(0, 1 * kMiB);
  constexpr int kStreams = 4;
  std::vector<std::unique_ptr<Stream>> streams;
  std::vector<int> counts(kStreams, 0);  // each written by its own stream only
  for (int i = 0; i < kStreams; ++i) streams.push_back(dev->create_stream(fmt::format("s{}", i)));
  for (int round = 0; round < 50; ++round)
    for (int i = 0; i < kStreams; ++i)
      streams[static_cast<size_t>(i)]->host_task([&counts, i, round] {
        if (round % 10 == 0) std::this_thread::sleep_for(std::chrono::microseconds(300 * (i + 1)));
        ++counts[static_cast<size_t>(i)];
      });
  streams.pop_back();  // a destroyed stream leaves the device's list (and drained itself)
  dev->synchronize();
  for (int i = 0; i < kStreams; ++i)
    EXPECT_EQ(counts[static_cast<size_t>(i)], 50) << "stream " << i;
  // An error on any one stream surfaces from the device's synchronize().
  streams[1]->host_task([] { fail("boom"); });
  expect_error([&] { dev->synchronize(); }, {"stream 's1' on host:0", "boom"});
  streams[1]->synchronize();  // the device's synchronize() reported it already
}

TEST(HostDevice, CopiesRoundTripThroughDeviceMemory) {
  auto dev = open_host_device(0, 4 * kMiB);
  auto h2d = dev->create_stream("h2d");
  auto compute = dev->create_stream("compute");
  auto d2h = dev->create_stream("d2h");
  auto loaded = dev->create_event();
  auto computed = dev->create_event();
  constexpr size_t n = 100'003;  // odd size
  std::vector<float> in(n), out(n, -1.0f), zeros(n, -1.0f);
  for (size_t i = 0; i < n; ++i) in[i] = static_cast<float>(i) * 0.5f - 7.0f;
  const uint64_t bytes = n * sizeof(float);
  void* d0 = dev->allocate(bytes, "d0");
  void* d1 = dev->allocate(bytes, "d1");

  dev->copy_to_device(d0, in.data(), bytes, *h2d);
  h2d->record(*loaded);
  compute->wait(*loaded);
  dev->copy_on_device(d1, d0, bytes, *compute);
  dev->fill_zero(d0, bytes, *compute);
  compute->record(*computed);
  d2h->wait(*computed);
  dev->copy_to_host(out.data(), d1, bytes, *d2h);
  dev->copy_to_host(zeros.data(), d0, bytes, *d2h);
  d2h->synchronize();

  EXPECT_EQ(std::memcmp(out.data(), in.data(), bytes), 0);
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(zeros[i], 0.0f) << "element " << i;
  dev->synchronize();
  dev->release(d0);
  dev->release(d1);
}

TEST(HostDevice, CopiesCheckPointersWhenQueued) {
  auto dev = open_host_device(0, 1 * kMiB);
  auto s = dev->create_stream("s");
  void* d = dev->allocate(1024, "d");
  std::vector<char> host(4096);
  const std::string p = fmt::format("{}", static_cast<void*>(host.data()));
  // Host memory passed as device memory.
  expect_error([&] { dev->copy_to_device(host.data(), host.data(), 64, *s); },
               {"host:0", "copy_to_device destination", p, format_bytes(64)});
  expect_error([&] { dev->copy_to_host(host.data(), host.data(), 64, *s); },
               {"copy_to_host source", p});
  expect_error([&] { dev->fill_zero(host.data(), 64, *s); }, {"fill_zero destination", p});
  expect_error([&] { dev->copy_on_device(d, host.data(), 64, *s); }, {"copy_on_device source"});
  // Device memory passed as host memory (the CUDA backend could not read it).
  expect_error([&] { dev->copy_to_device(d, d, 64, *s); }, {"copy_to_device source"});
  // A range that runs off the end of the arena.
  char* last = static_cast<char*>(d) + (1 * kMiB) - 64;
  expect_error([&] { dev->fill_zero(last, 128, *s); },
               {"fill_zero destination", format_bytes(128)});
  // A stream of another device.
  auto other = open_host_device(1, 1 * kMiB);
  auto foreign = other->create_stream("theirs");
  expect_error([&] { dev->fill_zero(d, 64, *foreign); }, {"stream 'theirs'", "host:0"});
  s->synchronize();  // nothing bad was queued
  dev->release(d);
}

TEST(HostDevice, ConvertMatchesTheHostReference) {
  auto dev = open_host_device(0, 4 * kMiB);
  auto s = dev->create_stream("compute");
  constexpr int64_t n = 4099;
  std::vector<float> in(static_cast<size_t>(n));
  uint32_t x = 12345;
  for (auto& v : in) {  // values with low mantissa bits set, so rounding matters
    x = x * 1664525u + 1013904223u;
    v = std::bit_cast<float>((x & 0x8fffffffu) | 0x30000000u);
  }
  in[0] = 1.0f + 0x1p-8f;            // an exact tie, rounds to even (1.0)
  in[1] = 1.0f + 0x1p-8f + 0x1p-7f;  // a tie that rounds up
  void* src = dev->allocate(static_cast<uint64_t>(n) * 4, "src");
  void* dst = dev->allocate(static_cast<uint64_t>(n) * 2, "dst");
  const TensorView vsrc{src, DType::f32, Shape{n}, dev.get()};
  const TensorView vdst{dst, DType::bf16, Shape{n}, dev.get()};
  dev->copy_to_device(src, in.data(), vsrc.bytes(), *s);
  dev->convert(vdst, vsrc, *s);
  std::vector<uint16_t> out(static_cast<size_t>(n), 0xdead);
  dev->copy_to_host(out.data(), dst, vdst.bytes(), *s);
  s->synchronize();
  for (int64_t i = 0; i < n; ++i)
    ASSERT_EQ(out[static_cast<size_t>(i)], f32_to_bf16(in[static_cast<size_t>(i)]))
        << "element " << i << " = " << in[static_cast<size_t>(i)];
  EXPECT_EQ(out[0], 0x3f80);
  EXPECT_EQ(out[1], 0x3f82);

  // Mismatched element counts and tensors outside the arena are refused, naming both.
  const TensorView short_dst{dst, DType::bf16, Shape{n - 1}, dev.get()};
  expect_error([&] { dev->convert(short_dst, vsrc, *s); },
               {"host:0", vsrc.str(), short_dst.str(), "4099", "4098"});
  std::vector<float> host(static_cast<size_t>(n));
  const TensorView on_host{host.data(), DType::f32, Shape{n}, nullptr};
  expect_error([&] { dev->convert(vdst, on_host, *s); }, {vdst.str(), on_host.str(), "source"});
  dev->release(src);
  dev->release(dst);
}

TEST(HostDevice, SeveralDevicesAreIndependent) {
  const auto devices = open_devices(parse_device_spec("host:3"), 64 * kMiB);
  ASSERT_EQ(devices.size(), 3u);
  std::vector<std::unique_ptr<Stream>> streams;
  std::vector<void*> mem;
  std::vector<std::vector<uint32_t>> out(3, std::vector<uint32_t>(1024, 0));
  for (size_t i = 0; i < 3; ++i) {
    Device& d = *devices[i];
    EXPECT_EQ(d.name(), fmt::format("host:{}", i));
    EXPECT_EQ(d.index(), static_cast<int>(i));
    EXPECT_EQ(d.memory().capacity, 64 * kMiB);
    streams.push_back(d.create_stream("h2d"));
    mem.push_back(d.allocate((i + 1) * kMiB, "block"));
  }
  // Each device's arena is its own: usage is counted per device.
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(devices[i]->memory().in_use, (i + 1) * kMiB);
  // Memory of one device is not memory of another.
  expect_error([&] { devices[0]->release(mem[1]); }, {"host:0"});
  expect_error([&] { devices[1]->fill_zero(mem[0], 64, *streams[1]); }, {"host:1"});
  for (size_t i = 0; i < 3; ++i) {
    std::vector<uint32_t> in(1024, static_cast<uint32_t>(0xabc0 + i));
    devices[i]->copy_to_device(mem[i], in.data(), 4096, *streams[i]);
    devices[i]->copy_to_host(out[i].data(), mem[i], 4096, *streams[i]);
    devices[i]->synchronize();  // `in` dies at the end of this iteration
  }
  for (size_t i = 0; i < 3; ++i)
    for (uint32_t v : out[i]) ASSERT_EQ(v, 0xabc0 + i) << "device " << i;
  // An error on one device does not leak into another.
  streams[2]->host_task([] { fail("only here"); });
  expect_error([&] { devices[2]->synchronize(); }, {"host:2", "only here"});
  devices[0]->synchronize();
  devices[1]->synchronize();
  for (size_t i = 0; i < 3; ++i) devices[i]->release(mem[i]);
}

// A peer copy reads another host device's arena on the destination's stream, ordered after the
// source's producer by an event; its pointers and stream are checked when it is queued.
TEST(HostDevice, CopiesFromAPeerInStreamOrder) {
  auto a = open_host_device(0, 4 * kMiB);
  auto b = open_host_device(1, 4 * kMiB);
  auto sa = a->create_stream("a");
  auto sb = b->create_stream("b");
  auto written = a->create_event();
  constexpr size_t n = 50'001;
  const uint64_t bytes = n * sizeof(uint32_t);
  auto* src = static_cast<uint32_t*>(a->allocate(bytes, "src"));
  void* dst = b->allocate(bytes, "dst");
  EXPECT_TRUE(a->owns(src, bytes));
  EXPECT_FALSE(b->owns(src, bytes));
  EXPECT_FALSE(a->owns(src, 4 * kMiB + 1));  // runs past the end of the arena
  // The producer writes late, on a's stream; b's copy must still see what it wrote.
  sa->host_task([src] {
    std::this_thread::sleep_for(30ms);
    for (size_t i = 0; i < n; ++i) src[i] = static_cast<uint32_t>(i * 2654435761u);
  });
  sa->record(*written);
  sb->wait(*written);
  b->copy_from_peer(dst, *a, src, bytes, *sb);
  std::vector<uint32_t> out(n, 0);
  b->copy_to_host(out.data(), dst, bytes, *sb);
  sb->synchronize();
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(out[i], static_cast<uint32_t>(i * 2654435761u)) << i;

  // Within one device it is a copy too (ranges may overlap: a memmove).
  auto* d = static_cast<uint32_t*>(dst);
  b->copy_from_peer(d + 1, *b, d, 4 * sizeof(uint32_t), *sb);
  b->copy_to_host(out.data(), dst, 5 * sizeof(uint32_t), *sb);
  sb->synchronize();
  EXPECT_EQ(out[1], static_cast<uint32_t>(0));
  EXPECT_EQ(out[4], static_cast<uint32_t>(3 * 2654435761u));

  std::vector<char> host(64);
  expect_error([&] { b->copy_from_peer(dst, *a, dst, 64, *sb); },
               {"host:1", "copy_from_peer source", "not inside host:0's memory"});
  expect_error([&] { b->copy_from_peer(src, *a, src, 64, *sb); },
               {"host:1", "copy_from_peer destination"});
  expect_error([&] { b->copy_from_peer(dst, *a, host.data(), 64, *sb); },
               {"copy_from_peer source", "host:0"});
  // The stream is checked even for an empty copy, which queues nothing.
  expect_error([&] { b->copy_from_peer(dst, *a, src, 0, *sa); }, {"stream 'a'", "host:1"});
  b->copy_from_peer(dst, *a, src, 0, *sb);
  sb->synchronize();
  a->release(src);
  b->release(dst);
}

TEST(HostDevice, AStreamMayOutliveItsDevice) {
  auto dev = open_host_device(0, 1 * kMiB);
  auto s = dev->create_stream("late");
  void* d = dev->allocate(256, "d");
  std::vector<char> in(256, 7), out(256, 0);
  dev->copy_to_device(d, in.data(), 256, *s);
  dev->copy_to_host(out.data(), d, 256, *s);
  dev.reset();
  s->synchronize();
  EXPECT_EQ(out, in);
}

}  // namespace
}  // namespace strata
