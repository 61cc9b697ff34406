// test_cuda_device.cpp: the CUDA backend against the Device contract and the host reference.
//
// Label `gpu`: every test skips, with the runtime's status and detail, when no GPU is usable.
// The conversion tests compare the kernel with strata::convert bit for bit, except that a
// NaN only has to stay a NaN (the GPU may return a canonical NaN where the host keeps the
// payload).
#include "core/device.h"
#include "core/dtype.h"
#include "core/error.h"
#include "gpu/runtime.h"

#include <gtest/gtest.h>
#include "testing.h"

#include <atomic>
#include <functional>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace strata {
namespace {

using test::error_message;

constexpr uint64_t kMiB = uint64_t{1} << 20;

#define SKIP_WITHOUT_GPU()                                                                        \
  do {                                                                                            \
    const CudaRuntime& rt_ = cuda_runtime();                                                      \
    if (rt_.gpus.empty()) GTEST_SKIP() << "no CUDA device: " << rt_.status << ": " << rt_.detail; \
  } while (0)

// Pinned host memory from cuda_host_alloc, freed on scope exit.
class Pinned {
 public:
  explicit Pinned(uint64_t bytes) : ptr_(cuda_host_alloc(bytes)), bytes_(bytes) {
    if (ptr_ == nullptr) throw Error("cuda_host_alloc returned nullptr with a GPU present");
  }
  ~Pinned() { cuda_host_free(ptr_); }
  Pinned(const Pinned&) = delete;
  Pinned& operator=(const Pinned&) = delete;
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  void* get() const { return ptr_; }
  uint64_t bytes() const { return bytes_; }

 private:
  void* ptr_;
  uint64_t bytes_;
};

class CudaDeviceTest : public ::testing::Test {
 protected:
  void open(uint64_t arena_bytes = 512 * kMiB) {
    device = open_cuda_device(0, arena_bytes);
    stream = device->create_stream("test");
  }
  std::unique_ptr<Device> device;
  std::unique_ptr<Stream> stream;
};

TEST_F(CudaDeviceTest, ArenaAllocatesAlignedAndNamesTheCapWhenFull) {
  SKIP_WITHOUT_GPU();
  open(64 * kMiB);
  EXPECT_EQ(device->backend(), Backend::cuda);
  EXPECT_EQ(device->name(), "cuda:0");
  EXPECT_EQ(device->memory().capacity, 64 * kMiB);
  void* a = device->allocate(1000, "a");
  void* b = device->allocate(3, "b");
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a) % 256, 0u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b) % 256, 0u);
  EXPECT_NE(a, b);
  EXPECT_EQ(device->memory().allocations, 2u);

  const std::string msg = error_message([&] { device->allocate(100 * kMiB, "the big one"); });
  EXPECT_NE(msg.find("device cuda:0"), std::string::npos) << msg;
  EXPECT_NE(msg.find("the big one"), std::string::npos) << msg;
  EXPECT_NE(msg.find("100 MiB"), std::string::npos) << msg;
  EXPECT_NE(msg.find("64 MiB"), std::string::npos) << msg;
  EXPECT_NE(msg.find("--device-memory"), std::string::npos) << msg;

  device->release(a);
  device->release(b);
  EXPECT_EQ(device->memory().in_use, 0u);
  void* whole = device->allocate(64 * kMiB, "everything");
  device->release(whole);

  int on_stack = 0;
  const std::string bad = error_message([&] { device->release(&on_stack); });
  EXPECT_NE(bad.find("cuda:0"), std::string::npos) << bad;
}

TEST_F(CudaDeviceTest, DefaultArenaLeavesAReserve) {
  SKIP_WITHOUT_GPU();
  const CudaGpu& gpu = cuda_runtime().gpus[0];
  open(0);
  const uint64_t cap = device->memory().capacity;
  EXPECT_GT(cap, 0u);
  EXPECT_LT(cap, gpu.total_memory - (uint64_t{1} << 30) + 1);
  const std::string msg = error_message([&] { open_cuda_device(0, gpu.total_memory * 2); });
  EXPECT_NE(msg.find("--device-memory"), std::string::npos) << msg;
}

TEST_F(CudaDeviceTest, CopiesRoundTripThroughPinnedMemory) {
  SKIP_WITHOUT_GPU();
  open();
  for (uint64_t bytes :
       {uint64_t{1}, uint64_t{255}, uint64_t{4096}, uint64_t{1000003}, uint64_t{64} * kMiB + 7}) {
    Pinned src(bytes), back(bytes), zeros(bytes);
    for (uint64_t i = 0; i < bytes; ++i) src.as<uint8_t>()[i] = static_cast<uint8_t>(i * 131 + 7);
    std::memset(back.get(), 0xab, bytes);
    std::memset(zeros.get(), 0xab, bytes);
    void* d1 = device->allocate(bytes, "d1");
    void* d2 = device->allocate(bytes, "d2");
    device->copy_to_device(d1, src.get(), bytes, *stream);
    device->copy_on_device(d2, d1, bytes, *stream);
    device->copy_to_host(back.get(), d2, bytes, *stream);
    device->fill_zero(d1, bytes, *stream);
    device->copy_to_host(zeros.get(), d1, bytes, *stream);
    stream->synchronize();
    EXPECT_EQ(std::memcmp(src.get(), back.get(), bytes), 0) << bytes << " bytes";
    uint64_t nonzero = 0;
    for (uint64_t i = 0; i < bytes; ++i) nonzero += zeros.as<uint8_t>()[i] != 0;
    EXPECT_EQ(nonzero, 0u) << bytes << " bytes";
    device->release(d1);
    device->release(d2);
  }
}

TEST_F(CudaDeviceTest, CopiesRejectPointersOutsideTheArena) {
  SKIP_WITHOUT_GPU();
  open(16 * kMiB);
  void* d = device->allocate(kMiB, "d");
  std::vector<uint8_t> host(2 * kMiB);
  std::string msg =
      error_message([&] { device->copy_to_device(host.data(), host.data(), 16, *stream); });
  EXPECT_NE(msg.find("cuda:0"), std::string::npos) << msg;
  EXPECT_NE(msg.find("not in this device's memory"), std::string::npos) << msg;
  // A range that starts inside the arena but runs past its end.
  char* last = static_cast<char*>(d) + 16 * kMiB - 8;
  msg = error_message([&] { device->fill_zero(last, 64, *stream); });
  EXPECT_NE(msg.find("not in this device's memory"), std::string::npos) << msg;
  msg = error_message([&] { device->copy_to_host(d, d, 16, *stream); });
  EXPECT_NE(msg.find("not host memory"), std::string::npos) << msg;
  stream->synchronize();
  device->release(d);
}

TEST_F(CudaDeviceTest, HostTasksRunInStreamOrder) {
  SKIP_WITHOUT_GPU();
  open();
  std::vector<int> order;
  order.reserve(1000);
  for (int i = 0; i < 1000; ++i) stream->host_task([&order, i] { order.push_back(i); });
  stream->synchronize();
  ASSERT_EQ(order.size(), 1000u);
  for (int i = 0; i < 1000; ++i) ASSERT_EQ(order[static_cast<size_t>(i)], i);

  // A host task sees the result of a copy queued before it.
  const uint64_t bytes = 8 * kMiB;
  Pinned src(bytes), dst(bytes);
  std::memset(src.get(), 0x5a, bytes);
  std::memset(dst.get(), 0, bytes);
  void* d = device->allocate(bytes, "d");
  device->copy_to_device(d, src.get(), bytes, *stream);
  device->copy_to_host(dst.get(), d, bytes, *stream);
  std::atomic<bool> saw{false};
  stream->host_task([&] { saw = std::memcmp(src.get(), dst.get(), bytes) == 0; });
  stream->synchronize();
  EXPECT_TRUE(saw.load());
  device->release(d);
}

TEST_F(CudaDeviceTest, EventsOrderWorkAcrossStreams) {
  SKIP_WITHOUT_GPU();
  open(1024 * kMiB);
  auto other = device->create_stream("other");
  auto event = device->create_event();
  EXPECT_TRUE(event->query());  // never recorded: complete
  other->wait(*event);          // never recorded: no-op
  other->synchronize();

  const uint64_t big = 256 * kMiB, bytes = 16 * kMiB;
  void* scratch_a = device->allocate(big, "scratch a");
  void* scratch_b = device->allocate(big, "scratch b");
  void* data = device->allocate(bytes, "data");
  Pinned src(bytes), dst(bytes);
  for (int round = 0; round < 3; ++round) {
    for (uint64_t i = 0; i < bytes / 4; ++i)
      src.as<uint32_t>()[i] = static_cast<uint32_t>(i * 2654435761u + static_cast<uint64_t>(round));
    std::memset(dst.get(), 0, bytes);
    device->fill_zero(data, bytes, *other);
    other->synchronize();
    // Stream `test`: a few milliseconds of copies, then the data, then the event.
    for (int k = 0; k < 16; ++k) device->copy_on_device(scratch_b, scratch_a, big, *stream);
    device->copy_to_device(data, src.get(), bytes, *stream);
    stream->record(*event);
    // Stream `other` must wait for all of it before reading `data`.
    other->wait(*event);
    device->copy_to_host(dst.get(), data, bytes, *other);
    other->synchronize();
    EXPECT_TRUE(event->query());
    event->synchronize();
    EXPECT_EQ(std::memcmp(src.get(), dst.get(), bytes), 0) << "round " << round;
  }
  stream->synchronize();
  device->release(scratch_a);
  device->release(scratch_b);
  device->release(data);
}

TEST_F(CudaDeviceTest, HostTaskExceptionSurfacesInSynchronize) {
  SKIP_WITHOUT_GPU();
  open();
  bool after = false;
  stream->host_task([] { throw Error("boom from a host task"); });
  stream->host_task([] { throw Error("second failure"); });
  stream->host_task([&] { after = true; });
  std::string msg = error_message([&] { stream->synchronize(); });
  EXPECT_NE(msg.find("boom from a host task"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("second failure"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'test'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("cuda:0"), std::string::npos) << msg;
  EXPECT_FALSE(after);    // host tasks after a failure are skipped until it is reported
  stream->synchronize();  // reported once
  stream->host_task([&] { after = true; });
  stream->synchronize();
  EXPECT_TRUE(after);

  stream->host_task([] { throw std::runtime_error("seen by the device"); });
  msg = error_message([&] { device->synchronize(); });
  EXPECT_NE(msg.find("seen by the device"), std::string::npos) << msg;
  device->synchronize();

  // A stream may outlive its device (as on the host backend).
  std::atomic<int> ran{0};
  auto late = device->create_stream("late");
  late->host_task([&] { ++ran; });
  device.reset();
  late->host_task([&] { ++ran; });
  late->synchronize();
  late.reset();
  EXPECT_EQ(ran.load(), 2);
}

// ---- conversion kernel against strata::convert ----

bool is_nan(DType t, const uint8_t* p) {
  uint32_t bits = 0;
  if (t == DType::f32) {
    std::memcpy(&bits, p, 4);
    return (bits & 0x7fffffffu) > 0x7f800000u;
  }
  uint16_t h = 0;
  std::memcpy(&h, p, 2);
  return t == DType::bf16 ? (h & 0x7fffu) > 0x7f80u : (h & 0x7fffu) > 0x7c00u;
}

std::string hex(DType t, const uint8_t* p) {
  uint32_t bits = 0;
  std::memcpy(&bits, p, dtype_size(t));
  char buf[16];
  std::snprintf(buf, sizeof buf, t == DType::f32 ? "0x%08x" : "0x%04x", bits);
  return buf;
}

// Converts `n` elements of `src` (host bytes of src_type) on the GPU and on the host, and
// expects the same bits (or NaN on both sides). The device views start 2 elements into
// their allocations so that unaligned starts are covered.
void expect_convert_matches(Device& device, Stream& stream, DType dst_type, DType src_type,
                            const void* src, size_t n) {
  const uint64_t src_bytes = n * dtype_size(src_type), dst_bytes = n * dtype_size(dst_type);
  const uint64_t pad = 2 * 4;
  Pinned host_src(src_bytes), host_dst(dst_bytes);
  std::memcpy(host_src.get(), src, src_bytes);
  std::memset(host_dst.get(), 0xcd, dst_bytes);
  char* d_src = static_cast<char*>(device.allocate(src_bytes + pad, "convert source"));
  char* d_dst = static_cast<char*>(device.allocate(dst_bytes + pad, "convert destination"));
  const int64_t count = static_cast<int64_t>(n);
  TensorView vs{d_src + 2 * dtype_size(src_type), src_type, Shape{count}, &device};
  TensorView vd{d_dst + 2 * dtype_size(dst_type), dst_type, Shape{count}, &device};
  device.copy_to_device(vs.data, host_src.get(), src_bytes, stream);
  device.convert(vd, vs, stream);
  device.copy_to_host(host_dst.get(), vd.data, dst_bytes, stream);
  stream.synchronize();
  device.release(d_src);
  device.release(d_dst);

  std::vector<uint8_t> want(dst_bytes);
  convert(want.data(), dst_type, src, src_type, n);
  const size_t ds = dtype_size(dst_type), ss = dtype_size(src_type);
  size_t mismatches = 0;
  for (size_t i = 0; i < n; ++i) {
    const uint8_t* got = host_dst.as<uint8_t>() + i * ds;
    const uint8_t* ref = want.data() + i * ds;
    const bool ok = is_nan(dst_type, ref) ? is_nan(dst_type, got) : std::memcmp(got, ref, ds) == 0;
    if (!ok && ++mismatches <= 8)
      ADD_FAILURE() << dtype_name(src_type) << " -> " << dtype_name(dst_type) << " of "
                    << hex(src_type, static_cast<const uint8_t*>(src) + i * ss) << ": gpu "
                    << hex(dst_type, got) << ", host " << hex(dst_type, ref);
  }
  EXPECT_EQ(mismatches, 0u) << dtype_name(src_type) << " -> " << dtype_name(dst_type) << " over "
                            << n << " values";
}

std::vector<uint16_t> all_16bit_patterns() {
  std::vector<uint16_t> v(65536);
  for (uint32_t i = 0; i < 65536; ++i) v[i] = static_cast<uint16_t>(i);
  return v;
}

// Every 16-bit pattern in the top half with the rounding-critical low halves (bf16 ties and
// their neighbours), every f16 value with its ties to the next and their neighbours, random
// floats, and the special values.
std::vector<float> hard_floats() {
  std::vector<float> v;
  for (uint32_t hi = 0; hi < 65536; ++hi)
    for (uint32_t lo : {0x0000u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu})
      v.push_back(std::bit_cast<float>(hi << 16 | lo));
  for (uint32_t h = 0; h < 65536; ++h) {
    if ((h & 0x7c00u) == 0x7c00u) continue;  // inf/nan
    const float a = f16_to_f32(static_cast<uint16_t>(h));
    v.push_back(a);
    if ((h & 0x7fffu) == 0x7bffu) {  // largest finite: the tie to infinity is 65520
      const float tie = std::copysign(65520.0f, a);
      v.insert(v.end(), {tie, std::nextafter(tie, 0.0f), std::nextafter(tie, 2 * tie)});
      continue;
    }
    const float b = f16_to_f32(static_cast<uint16_t>(h + 1));
    const float mid = a + (b - a) / 2;  // exact: 12 significant bits
    v.insert(v.end(), {mid, std::nextafter(mid, a), std::nextafter(mid, b)});
  }
  std::mt19937 rng(1234);
  for (int i = 0; i < 1 << 20; ++i) v.push_back(std::bit_cast<float>(static_cast<uint32_t>(rng())));
  std::uniform_real_distribution<float> normal(-70000.0f, 70000.0f);
  for (int i = 0; i < 1 << 16; ++i) v.push_back(normal(rng));
  constexpr float inf = std::numeric_limits<float>::infinity();
  v.insert(v.end(), {0.0f,
                     -0.0f,
                     inf,
                     -inf,
                     std::numeric_limits<float>::quiet_NaN(),
                     -std::numeric_limits<float>::quiet_NaN(),
                     std::numeric_limits<float>::signaling_NaN(),
                     std::bit_cast<float>(0x7f800001u),
                     std::bit_cast<float>(0xffc00001u),
                     std::numeric_limits<float>::denorm_min(),
                     -std::numeric_limits<float>::denorm_min(),
                     std::bit_cast<float>(0x007fffffu),
                     std::bit_cast<float>(0x807fffffu),
                     std::numeric_limits<float>::min(),
                     std::numeric_limits<float>::max(),
                     -std::numeric_limits<float>::max(),
                     std::ldexp(1.0f, -24),
                     std::ldexp(1.0f, -25),
                     std::ldexp(1.5f, -25),
                     std::ldexp(1.0f, -26),
                     65504.0f,
                     65519.99f,
                     65520.0f,
                     -65520.0f});
  return v;
}

TEST_F(CudaDeviceTest, ConvertSixteenBitToF32IsExactForEveryPattern) {
  SKIP_WITHOUT_GPU();
  open();
  const std::vector<uint16_t> all = all_16bit_patterns();
  expect_convert_matches(*device, *stream, DType::f32, DType::bf16, all.data(), all.size());
  expect_convert_matches(*device, *stream, DType::f32, DType::f16, all.data(), all.size());
}

TEST_F(CudaDeviceTest, ConvertF32ToSixteenBitRoundsLikeTheHost) {
  SKIP_WITHOUT_GPU();
  open();
  const std::vector<float> v = hard_floats();
  expect_convert_matches(*device, *stream, DType::bf16, DType::f32, v.data(), v.size());
  expect_convert_matches(*device, *stream, DType::f16, DType::f32, v.data(), v.size());
}

TEST_F(CudaDeviceTest, ConvertBetweenSixteenBitTypesForEveryPattern) {
  SKIP_WITHOUT_GPU();
  open();
  const std::vector<uint16_t> all = all_16bit_patterns();
  expect_convert_matches(*device, *stream, DType::f16, DType::bf16, all.data(), all.size());
  expect_convert_matches(*device, *stream, DType::bf16, DType::f16, all.data(), all.size());
  expect_convert_matches(*device, *stream, DType::bf16, DType::bf16, all.data(), all.size());
  expect_convert_matches(*device, *stream, DType::f16, DType::f16, all.data(), all.size());
  const std::vector<float> v = hard_floats();
  expect_convert_matches(*device, *stream, DType::f32, DType::f32, v.data(), v.size());
}

TEST_F(CudaDeviceTest, ConvertOfALargeTensorUsesTheWholeGrid) {
  SKIP_WITHOUT_GPU();
  open(1024 * kMiB);
  // More elements than one pass of the capped grid (8192 blocks x 256 threads), odd count.
  std::vector<float> v(5 * 8192 * 256 + 13);
  std::mt19937 rng(7);
  std::normal_distribution<float> dist(0.0f, 3.0f);
  for (float& x : v) x = dist(rng);
  expect_convert_matches(*device, *stream, DType::bf16, DType::f32, v.data(), v.size());
}

TEST_F(CudaDeviceTest, ConvertChecksCountsAndMemory) {
  SKIP_WITHOUT_GPU();
  open();
  void* a = device->allocate(1024, "a");
  void* b = device->allocate(1024, "b");
  TensorView src{a, DType::f32, Shape{100}, device.get()};
  TensorView dst{b, DType::bf16, Shape{99}, device.get()};
  std::string msg = error_message([&] { device->convert(dst, src, *stream); });
  EXPECT_NE(msg.find("element counts differ"), std::string::npos) << msg;
  std::vector<float> host(100);
  TensorView outside{host.data(), DType::f32, Shape{100}, nullptr};
  dst.shape = Shape{100};
  msg = error_message([&] { device->convert(dst, outside, *stream); });
  EXPECT_NE(msg.find("not in this device's memory"), std::string::npos) << msg;
  device->release(a);
  device->release(b);
}

}  // namespace
}  // namespace strata
