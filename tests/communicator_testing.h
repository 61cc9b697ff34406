// communicator_testing.h: checks of communicator.h shared by the host (test_communicator.cpp)
// and GPU (test_communicator_gpu.cpp) suites, so every backend runs the very same checks.
//
// Data are integer-valued floats in [-60, 60]: exact in f32 and bf16, and so are their sums over
// up to 4 ranks, which makes every result comparable bit for bit whatever order a communicator
// adds in (nccl-tests' approach). The rank-order check uses random data instead, against a host
// sum formed in rank order with one rounding per add. Every device buffer has guard elements on
// both sides, checked after each collective.
#pragma once

#include "core/device.h"
#include "core/dtype.h"
#include "core/error.h"
#include "partition/communicator.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace strata::test {

// The devices of one communicator with one stream each (destroy the communicator first).
struct Ranks {
  std::vector<std::unique_ptr<Device>> owned;
  std::vector<Device*> devices;
  std::vector<std::unique_ptr<Stream>> owned_streams;
  std::vector<Stream*> streams;

  explicit Ranks(std::vector<std::unique_ptr<Device>> opened) : owned(std::move(opened)) {
    for (auto& d : owned) devices.push_back(d.get());
    streams = make_streams("comm");
  }
  int size() const { return static_cast<int>(devices.size()); }
  Device& device(int r) const { return *devices[static_cast<size_t>(r)]; }
  Stream& stream(int r) const { return *streams[static_cast<size_t>(r)]; }
  // Another stream on every rank, owned here.
  std::vector<Stream*> make_streams(const std::string& name) {
    std::vector<Stream*> s;
    for (Device* d : devices) {
      owned_streams.push_back(d->create_stream(name));
      s.push_back(owned_streams.back().get());
    }
    return s;
  }
  void synchronize() const {
    for (Device* d : devices) d->synchronize();
  }
};

// f32 or bf16 bytes of `values` (exact for the values these tests use).
inline std::vector<uint8_t> encode(const std::vector<float>& values, DType dtype) {
  std::vector<uint8_t> bytes(values.size() * dtype_size(dtype));
  for (size_t i = 0; i < values.size(); ++i) store_f32(bytes.data(), dtype, i, values[i]);
  return bytes;
}

inline float element(const std::vector<uint8_t>& bytes, DType dtype, size_t i) {
  return load_f32(bytes.data(), dtype, i);
}

// Integer-valued data of `rank`, elements [offset, offset + n) of its sequence.
inline std::vector<float> rank_values(int rank, int64_t n, int64_t offset = 0) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    v[static_cast<size_t>(i)] = static_cast<float>((rank * 37 + (offset + i) * 11 + 5) % 121 - 60);
  return v;
}

// Random values in [-1, 1), already rounded to `dtype`.
inline std::vector<float> random_values(std::mt19937& rng, int64_t n, DType dtype) {
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = load_f32(encode({dist(rng)}, dtype).data(), dtype, 0);
  return v;
}

// Reports the first element whose bits differ (the values too), or nothing.
inline void expect_bits(const std::vector<uint8_t>& got, const std::vector<float>& want,
                        DType dtype, const std::string& what) {
  const std::vector<uint8_t> expected = encode(want, dtype);
  ASSERT_EQ(got.size(), expected.size()) << what;
  if (got == expected) return;
  const size_t es = dtype_size(dtype);
  size_t bad = 0;
  for (size_t i = 0; i < want.size(); ++i)
    if (std::memcmp(&got[i * es], &expected[i * es], es) != 0) {
      if (bad++ == 0)
        ADD_FAILURE() << what << ": element " << i << " is " << element(got, dtype, i)
                      << ", expected " << want[i];
    }
  ADD_FAILURE() << what << ": " << bad << " of " << want.size() << " elements differ";
}

// A device buffer of n elements between two guards of kGuard elements, all filled with a
// sentinel at first.
class Guarded {
 public:
  static constexpr int64_t kGuard = 64;
  static constexpr uint8_t kSentinel = 0x7b;  // 0x7b7b...: finite in f32 and bf16

  Guarded(Device& device, Stream& s, DType dtype, int64_t n)
      : device_(&device),
        dtype_(dtype),
        n_(n),
        buf_(device, static_cast<uint64_t>(n + 2 * kGuard) * dtype_size(dtype), "test buffer") {
    const std::vector<uint8_t> fill(buf_.bytes(), kSentinel);
    device.copy_to_device(buf_.data(), fill.data(), fill.size(), s);
    s.synchronize();
  }
  // Elements [offset, offset + n) of the guarded range.
  TensorView view(int64_t offset = 0, int64_t n = -1) const {
    return TensorView{at(offset), dtype_, Shape{n < 0 ? n_ - offset : n}, device_};
  }
  void upload(const std::vector<float>& values, Stream& s, int64_t offset = 0) const {
    const std::vector<uint8_t> bytes = encode(values, dtype_);
    device_->copy_to_device(at(offset), bytes.data(), bytes.size(), s);
    s.synchronize();
  }
  // The guarded range's bytes; a damaged guard fails the test.
  std::vector<uint8_t> download(Stream& s, const std::string& what) const {
    std::vector<uint8_t> all(buf_.bytes());
    device_->copy_to_host(all.data(), buf_.data(), all.size(), s);
    s.synchronize();
    const size_t guard = static_cast<size_t>(kGuard) * dtype_size(dtype_);
    for (size_t i = 0; i < guard; ++i) {
      if (all[i] != kSentinel || all[all.size() - 1 - i] != kSentinel) {
        ADD_FAILURE() << what << ": a write outside the tensor, in the guard of " << view().str();
        break;
      }
    }
    return {all.begin() + static_cast<std::ptrdiff_t>(guard),
            all.end() - static_cast<std::ptrdiff_t>(guard)};
  }

 private:
  char* at(int64_t offset) const {
    return static_cast<char*>(buf_.data()) +
           static_cast<uint64_t>(kGuard + offset) * dtype_size(dtype_);
  }
  Device* device_;
  DType dtype_;
  int64_t n_;
  DeviceBuffer buf_;
};

inline std::vector<Guarded> guarded(const Ranks& ranks, DType dtype, int64_t n) {
  std::vector<Guarded> g;
  for (int r = 0; r < ranks.size(); ++r) g.emplace_back(ranks.device(r), ranks.stream(r), dtype, n);
  return g;
}
inline std::vector<TensorView> views(const std::vector<Guarded>& g) {
  std::vector<TensorView> v;
  for (const Guarded& b : g) v.push_back(b.view());
  return v;
}

// all_gather (out of place and in place), reduce_scatter and all_reduce on integer-valued data,
// every rank's result checked bit for bit.
inline void check_collectives(Communicator& comm, const Ranks& ranks, DType dtype, int64_t count) {
  const int n = ranks.size();
  const std::string ctx =
      fmt::format("{} N={} count={} {}", comm.name(), n, count, dtype_name(dtype));
  std::vector<float> gathered;
  for (int q = 0; q < n; ++q) {
    const std::vector<float> v = rank_values(q, count);
    gathered.insert(gathered.end(), v.begin(), v.end());
  }
  {  // all_gather, out of place
    std::vector<Guarded> send = guarded(ranks, dtype, count),
                         recv = guarded(ranks, dtype, count * n);
    for (int r = 0; r < n; ++r) send[r].upload(rank_values(r, count), ranks.stream(r));
    comm.all_gather(views(send), views(recv), ranks.streams);
    for (int r = 0; r < n; ++r) {
      expect_bits(recv[r].download(ranks.stream(r), ctx), gathered, dtype,
                  ctx + fmt::format(" all_gather rank {} recv", r));
      expect_bits(send[r].download(ranks.stream(r), ctx), rank_values(r, count), dtype,
                  ctx + fmt::format(" all_gather rank {} send (unchanged)", r));
    }
  }
  {  // all_gather in place: send is the rank's own chunk of recv
    std::vector<Guarded> recv = guarded(ranks, dtype, count * n);
    std::vector<TensorView> send;
    for (int r = 0; r < n; ++r) {
      recv[r].upload(rank_values(r, count), ranks.stream(r), r * count);
      send.push_back(recv[r].view(r * count, count));
    }
    comm.all_gather(send, views(recv), ranks.streams);
    for (int r = 0; r < n; ++r)
      expect_bits(recv[r].download(ranks.stream(r), ctx), gathered, dtype,
                  ctx + fmt::format(" all_gather in place rank {}", r));
  }
  {  // reduce_scatter: rank r gets the sum of chunk r
    std::vector<Guarded> send = guarded(ranks, dtype, count * n),
                         recv = guarded(ranks, dtype, count);
    for (int r = 0; r < n; ++r) send[r].upload(rank_values(r, count * n), ranks.stream(r));
    comm.reduce_scatter(views(send), views(recv), ranks.streams);
    for (int r = 0; r < n; ++r) {
      std::vector<float> want(static_cast<size_t>(count), 0.0f);
      for (int q = 0; q < n; ++q) {
        const std::vector<float> v = rank_values(q, count, r * count);
        for (size_t i = 0; i < want.size(); ++i) want[i] += v[i];
      }
      expect_bits(recv[r].download(ranks.stream(r), ctx), want, dtype,
                  ctx + fmt::format(" reduce_scatter rank {}", r));
      expect_bits(send[r].download(ranks.stream(r), ctx), rank_values(r, count * n), dtype,
                  ctx + fmt::format(" reduce_scatter rank {} send (unchanged)", r));
    }
  }
  {  // all_reduce
    std::vector<Guarded> buf = guarded(ranks, dtype, count);
    std::vector<float> want(static_cast<size_t>(count), 0.0f);
    for (int r = 0; r < n; ++r) {
      const std::vector<float> v = rank_values(r, count);
      buf[r].upload(v, ranks.stream(r));
      for (size_t i = 0; i < want.size(); ++i) want[i] += v[i];
    }
    comm.all_reduce(views(buf), ranks.streams);
    for (int r = 0; r < n; ++r)
      expect_bits(buf[r].download(ranks.stream(r), ctx), want, dtype,
                  ctx + fmt::format(" all_reduce rank {}", r));
  }
}

// Every count and dtype of the suites: sizes that do not divide nicely, both dtypes, with one
// communicator throughout (its staging grows along the way).
inline void check_collective_matrix(Communicator& comm, const Ranks& ranks) {
  for (const DType dtype : {DType::f32, DType::bf16})
    for (const int64_t count : {1, 7, 1000, 1025}) {
      check_collectives(comm, ranks, dtype, count);
      if (::testing::Test::HasFailure()) return;  // one failing case says enough
    }
}

// reduce_scatter and all_reduce on random data, three times: the same bits each time, equal to
// a host sum in rank order 0..N-1 rounded to the dtype once per add (the in-process contract).
inline void check_rank_order_sums(Communicator& comm, const Ranks& ranks, DType dtype,
                                  int64_t count) {
  const int n = ranks.size();
  const std::string ctx =
      fmt::format("{} N={} count={} {} random data", comm.name(), n, count, dtype_name(dtype));
  std::mt19937 rng(1234);
  std::vector<std::vector<float>> data;
  for (int r = 0; r < n; ++r) data.push_back(random_values(rng, count * n, dtype));
  const auto rank_order_sum = [&](int64_t offset, int64_t len) {
    std::vector<float> sum(data[0].begin() + offset, data[0].begin() + offset + len);
    for (int q = 1; q < n; ++q)
      for (int64_t i = 0; i < len; ++i) {
        float& s = sum[static_cast<size_t>(i)];
        s = load_f32(
            encode({s + data[static_cast<size_t>(q)][static_cast<size_t>(offset + i)]}, dtype)
                .data(),
            dtype, 0);
      }
    return sum;
  };
  for (int run = 0; run < 3; ++run) {
    std::vector<Guarded> send = guarded(ranks, dtype, count * n),
                         recv = guarded(ranks, dtype, count);
    for (int r = 0; r < n; ++r) send[r].upload(data[static_cast<size_t>(r)], ranks.stream(r));
    comm.reduce_scatter(views(send), views(recv), ranks.streams);
    for (int r = 0; r < n; ++r)
      expect_bits(recv[r].download(ranks.stream(r), ctx), rank_order_sum(r * count, count), dtype,
                  ctx + fmt::format(" reduce_scatter run {} rank {}", run, r));
    std::vector<Guarded> buf = guarded(ranks, dtype, count * n);
    for (int r = 0; r < n; ++r) buf[r].upload(data[static_cast<size_t>(r)], ranks.stream(r));
    comm.all_reduce(views(buf), ranks.streams);
    for (int r = 0; r < n; ++r)
      expect_bits(buf[r].download(ranks.stream(r), ctx), rank_order_sum(0, count * n), dtype,
                  ctx + fmt::format(" all_reduce run {} rank {}", run, r));
  }
}

// A collective sees what was queued before it on each rank's stream: each send buffer is filled
// by a copy queued behind a sleeping host task.
inline void check_waits_for_producers(Communicator& comm, const Ranks& ranks) {
  const int n = ranks.size();
  const int64_t count = 4096;
  std::vector<Guarded> source = guarded(ranks, DType::f32, count),
                       send = guarded(ranks, DType::f32, count),
                       recv = guarded(ranks, DType::f32, count * n);
  std::vector<float> gathered;
  for (int r = 0; r < n; ++r) {
    const std::vector<float> v = rank_values(r, count);
    source[r].upload(v, ranks.stream(r));
    gathered.insert(gathered.end(), v.begin(), v.end());
  }
  for (int r = 0; r < n; ++r) {
    ranks.stream(r).host_task(
        [r] { std::this_thread::sleep_for(std::chrono::milliseconds(20 * (r + 1))); });
    ranks.device(r).copy_on_device(send[r].view().data, source[r].view().data,
                                   send[r].view().bytes(), ranks.stream(r));
  }
  comm.all_gather(views(send), views(recv), ranks.streams);
  for (int r = 0; r < n; ++r)
    expect_bits(recv[r].download(ranks.stream(r), "producer"), gathered, DType::f32,
                fmt::format("{} all_gather after a slow producer, rank {}", comm.name(), r));
}

// Work queued on a rank's stream right after a collective (here: overwriting its send buffer)
// must not change what its peers receive. Long copies leave a wide window for a missing fence.
inline void check_send_reusable_after(Communicator& comm, const Ranks& ranks) {
  const int n = ranks.size();
  const int64_t count = int64_t{1} << 20;
  std::vector<Guarded> send = guarded(ranks, DType::f32, count),
                       other = guarded(ranks, DType::f32, count),
                       recv = guarded(ranks, DType::f32, count * n);
  std::vector<float> gathered;
  for (int r = 0; r < n; ++r) {
    const std::vector<float> v = rank_values(r, count);
    send[r].upload(v, ranks.stream(r));
    other[r].upload(rank_values(r + 7, count), ranks.stream(r));
    gathered.insert(gathered.end(), v.begin(), v.end());
  }
  comm.all_gather(views(send), views(recv), ranks.streams);
  for (int r = 0; r < n; ++r)
    ranks.device(r).copy_on_device(send[r].view().data, other[r].view().data,
                                   send[r].view().bytes(), ranks.stream(r));
  for (int r = 0; r < n; ++r)
    expect_bits(
        recv[r].download(ranks.stream(r), "reuse"), gathered, DType::f32,
        fmt::format("{} all_gather, send overwritten right after, rank {}", comm.name(), r));
}

// In-process only (NCCL promises nothing across streams): collectives run in call order on every
// rank even on different streams. The first all_gather is held back on rank 0; the second, on
// other streams into the same recv buffers, must still land last.
inline void check_call_order_across_streams(Communicator& comm, Ranks& ranks) {
  const int n = ranks.size();
  const int64_t count = int64_t{1} << 16;
  const std::vector<Stream*> later = ranks.make_streams("comm-2");
  std::vector<Guarded> first = guarded(ranks, DType::f32, count),
                       second = guarded(ranks, DType::f32, count),
                       recv = guarded(ranks, DType::f32, count * n);
  std::vector<float> gathered;
  for (int r = 0; r < n; ++r) {
    const std::vector<float> v = rank_values(r + 3, count);
    first[r].upload(rank_values(r, count), ranks.stream(r));
    second[r].upload(v, ranks.stream(r));
    gathered.insert(gathered.end(), v.begin(), v.end());
  }
  ranks.stream(0).host_task([] { std::this_thread::sleep_for(std::chrono::milliseconds(100)); });
  comm.all_gather(views(first), views(recv), ranks.streams);
  comm.all_gather(views(second), views(recv), later);
  ranks.synchronize();
  for (int r = 0; r < n; ++r)
    expect_bits(
        recv[r].download(ranks.stream(r), "order"), gathered, DType::f32,
        fmt::format("{} all_gather on other streams after a delayed one, rank {}", comm.name(), r));
}

// Empty tensors: every collective accepts them and queues nothing.
inline void check_empty_collectives(Communicator& comm, const Ranks& ranks) {
  std::vector<TensorView> empty;
  for (int r = 0; r < ranks.size(); ++r)
    empty.push_back(TensorView{nullptr, DType::f32, Shape{0}, &ranks.device(r)});
  comm.all_gather(empty, empty, ranks.streams);
  comm.reduce_scatter(empty, empty, ranks.streams);
  comm.all_reduce(empty, ranks.streams);
  ranks.synchronize();
}

}  // namespace strata::test
