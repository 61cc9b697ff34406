// test_device_optimizer.cpp: the optimizer ops of the kernel table (adam_update,
// grad_chunk_sums) on the host backend, against CpuAdam itself, bit for bit.
//
// The trainer's rule is that an optimizer whose home is a device gives the very bits of the CPU
// optimizer, so nothing here has a tolerance: every master, m, v, parameter copy and chunk sum
// is compared by its bytes. CpuAdam runs its best SIMD path (every path gives the scalar path's
// bits, tests/test_cpu_adam.cpp), the host table runs the scalar path. The data is built to make
// a wrong order show: gradients span eight decades (and f32/bf16 subnormals), and one case checks
// that summing a chunk in plain order would give other bits than the 16 lanes do.
#include "core/device.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/kernels.h"
#include "cpu_adam/cpu_adam.h"
#include "cpu_adam/kernels.h"
#include "host/host_device.h"

#include <gtest/gtest.h>
#include "testing.h"

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

namespace strata {
namespace {

using test::expect_error;

constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr DType kDTypes[] = {DType::f32, DType::bf16, DType::f16};
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// Raw elements of one dtype in ordinary host memory.
struct Bytes {
  DType dtype = DType::f32;
  size_t n = 0;
  std::vector<uint8_t> data;
  Bytes(DType t, size_t count) : dtype(t), n(count), data(count * dtype_size(t)) {}
  void set(size_t i, float v) { store_f32(data.data(), dtype, i, v); }
  float at(size_t i) const { return load_f32(data.data(), dtype, i); }
};

// Random values of either sign over eight decades; now and then a subnormal where the dtype
// has the range (f16's smallest subnormal is 6e-8: it rounds those to zero, still a value).
class Values {
 public:
  explicit Values(uint32_t seed) : gen_(seed) {}
  float next() {
    const float mag = std::pow(10.0f, std::uniform_real_distribution<float>(-5.0f, 3.0f)(gen_));
    const float sign = (gen_() & 1u) != 0 ? -1.0f : 1.0f;
    if (gen_() % 97 == 0) return sign * 3e-39f;
    return sign * mag;
  }
  float unit() { return std::uniform_real_distribution<float>(-1.0f, 1.0f)(gen_); }
  Bytes bytes(DType t, size_t n) {
    Bytes b(t, n);
    for (size_t i = 0; i < n; ++i) b.set(i, next());
    return b;
  }

 private:
  std::mt19937 gen_;
};

// A device buffer holding a copy of host bytes, read back on demand.
class OnDevice {
 public:
  OnDevice(Device& dev, Stream& s, uint64_t bytes)
      : dev_(&dev), s_(&s), buffer_(dev, bytes, "optimizer test") {}
  void* data() const { return buffer_.data(); }
  void upload(const void* src, uint64_t bytes) {
    if (bytes > 0) dev_->copy_to_device(buffer_.data(), src, bytes, *s_);
    s_->synchronize();
  }
  std::vector<uint8_t> read(uint64_t bytes) const {
    std::vector<uint8_t> out(bytes);
    if (bytes > 0) dev_->copy_to_host(out.data(), buffer_.data(), bytes, *s_);
    s_->synchronize();
    return out;
  }
  TensorView view(DType t, int64_t n) const { return buffer_.view(t, Shape{n}); }

 private:
  Device* dev_;
  Stream* s_;
  DeviceBuffer buffer_;
};

template <typename T>
std::vector<uint8_t> as_bytes(const std::vector<T>& v) {
  std::vector<uint8_t> out(v.size() * sizeof(T));
  if (!v.empty()) std::memcpy(out.data(), v.data(), out.size());
  return out;
}

// Where two byte images first differ, as elements of `elem` bytes; -1 when they are equal.
int64_t first_difference(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b,
                         size_t elem) {
  if (a.size() != b.size()) return 0;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) return static_cast<int64_t>(i / elem);
  return -1;
}

class DeviceOptimizer : public ::testing::Test {
 protected:
  void SetUp() override {
    dev_ = open_host_device(0, 16 * kMiB);
    s_ = dev_->create_stream("optimizer");
  }
  Kernels& k() { return dev_->kernels(); }

  std::unique_ptr<Device> dev_;
  std::unique_ptr<Stream> s_;
  CpuAdam cpu_{CpuAdamOptions{.threads = 2, .simd = "best", .numa = false}};
};

// nullopt: no parameter copy.
struct AdamCase {
  DType grad;
  std::optional<DType> copy;
  bool adamw;
  bool bias_correction;
};

// Three steps of both optimizers from the same state, compared after every step.
void run_adam_case(Device& dev, Stream& s, Kernels& k, CpuAdam& cpu, const AdamCase& c, size_t n,
                   uint32_t seed) {
  Values rnd(seed);
  std::vector<float> master(n), m(n), v(n);
  for (size_t i = 0; i < n; ++i) {
    master[i] = rnd.unit();
    m[i] = 0.01f * rnd.unit();
    const float u = rnd.unit();
    v[i] = 1e-4f * u * u;  // a square, as v always is
  }
  const size_t copy_size = c.copy ? dtype_size(*c.copy) : 0;
  const auto ni = static_cast<int64_t>(n);
  OnDevice dmaster(dev, s, n * 4), dm(dev, s, n * 4), dv(dev, s, n * 4);
  OnDevice dgrad(dev, s, n * dtype_size(c.grad)), dcopy(dev, s, n * copy_size);
  dmaster.upload(master.data(), n * 4);
  dm.upload(m.data(), n * 4);
  dv.upload(v.data(), n * 4);
  const TensorView copy_view = c.copy ? dcopy.view(*c.copy, ni) : TensorView{};

  // CpuAdam writes only bf16/f16 copies; an f32 copy must equal its master.
  const bool cpu_copy = c.copy && *c.copy != DType::f32;
  std::vector<uint8_t> ref_copy(cpu_copy ? n * copy_size : 0);
  const AdamShard shard{master.data(), m.data(), v.data(), n};
  const AdamParams params{
      .lr = 3e-3f, .weight_decay = 0.1f, .adamw = c.adamw, .bias_correction = c.bias_correction};
  for (int64_t step = 1; step <= 3; ++step) {
    SCOPED_TRACE(fmt::format("step {}", step));
    const std::vector<float> before = master;
    const Bytes grad = rnd.bytes(c.grad, n);
    dgrad.upload(grad.data.data(), grad.data.size());
    const float grad_scale = 0.7f / static_cast<float>(1 << (4 * step));
    k.adam_update(dmaster.view(DType::f32, ni), dm.view(DType::f32, ni), dv.view(DType::f32, ni),
                  dgrad.view(c.grad, ni), copy_view,
                  cpu_adam::step_constants(step, params, grad_scale), s);
    std::optional<ParamCopy> copy;
    if (cpu_copy) copy = ParamCopy{ref_copy.data(), *c.copy};
    ASSERT_TRUE(cpu.update(shard, GradShard{grad.data.data(), c.grad, n}, step, params, grad_scale,
                           GradStats{}, copy));
    EXPECT_EQ(first_difference(dmaster.read(n * 4), as_bytes(master), 4), -1) << "master";
    EXPECT_EQ(first_difference(dm.read(n * 4), as_bytes(m), 4), -1) << "m";
    EXPECT_EQ(first_difference(dv.read(n * 4), as_bytes(v), 4), -1) << "v";
    if (c.copy) {
      const std::vector<uint8_t> want = cpu_copy ? ref_copy : as_bytes(master);
      EXPECT_EQ(first_difference(dcopy.read(n * copy_size), want, copy_size), -1) << "copy";
    }
    // The step moved the weights: the comparisons above are not of untouched buffers.
    if (n > 0) {
      EXPECT_NE(as_bytes(before), as_bytes(master));
    }
  }
}

TEST_F(DeviceOptimizer, AdamUpdateIsCpuAdamBitForBit) {
  const size_t lengths[] = {0, 1, 7, 17, 1023, 65537 + 5};
  uint32_t seed = 1;
  for (const DType grad : kDTypes)
    for (const std::optional<DType> copy : {std::optional<DType>{}, std::optional{DType::f32},
                                            std::optional{DType::bf16}, std::optional{DType::f16}})
      for (const bool adamw : {true, false})
        for (const bool bias : {true, false})
          for (const size_t n : lengths) {
            SCOPED_TRACE(fmt::format("grad {} copy {} {} bias correction {} n {}", dtype_name(grad),
                                     copy ? dtype_name(*copy) : "none", adamw ? "AdamW" : "Adam",
                                     bias, n));
            run_adam_case(*dev_, *s_, k(), cpu_, AdamCase{grad, copy, adamw, bias}, n, seed++);
            if (HasFatalFailure()) return;
          }
}

// Lion and Adagrad: the moment each does not keep goes to neither side (an empty view, a null
// pointer), and the one it keeps, the master and the copy are CpuAdam's bits after every step.
// Some elements have a zero gradient and a zero momentum: Lion's sign is 0 there on both sides.
TEST_F(DeviceOptimizer, LionAndAdagradUpdatesAreCpuAdamBitForBit) {
  uint32_t seed = 100;
  for (const OptimizerType type : {OptimizerType::lion, OptimizerType::adagrad})
    for (const DType grad_t : kDTypes)
      for (const std::optional<DType> copy_t :
           {std::optional<DType>{}, std::optional{DType::bf16}, std::optional{DType::f16}})
        for (const size_t n : {size_t{0}, size_t{1}, size_t{17}, size_t{65537 + 5}}) {
          SCOPED_TRACE(fmt::format("{} grad {} copy {} n {}", optimizer_type_name(type),
                                   dtype_name(grad_t), copy_t ? dtype_name(*copy_t) : "none", n));
          Values rnd(seed++);
          const bool lion = type == OptimizerType::lion;
          std::vector<float> master(n), moment(n);
          for (size_t i = 0; i < n; ++i) {
            master[i] = rnd.unit();
            const float u = rnd.unit();
            moment[i] = i % 5 == 2 ? 0.0f : lion ? 0.01f * u : 1e-4f * u * u;
          }
          const auto ni = static_cast<int64_t>(n);
          const size_t copy_size = copy_t ? dtype_size(*copy_t) : 0;
          OnDevice dmaster(*dev_, *s_, n * 4), dmoment(*dev_, *s_, n * 4);
          OnDevice dgrad(*dev_, *s_, n * dtype_size(grad_t)), dcopy(*dev_, *s_, n * copy_size);
          dmaster.upload(master.data(), n * 4);
          dmoment.upload(moment.data(), n * 4);
          std::vector<uint8_t> ref_copy(n * copy_size);
          const AdamShard shard{master.data(), lion ? moment.data() : nullptr,
                                lion ? nullptr : moment.data(), n};
          const AdamParams params{
              .type = type, .lr = 3e-3f, .eps = 1e-10f, .weight_decay = 0.1f, .adamw = lion};
          for (int64_t step = 1; step <= 3; ++step) {
            SCOPED_TRACE(fmt::format("step {}", step));
            const std::vector<float> before = master;
            Bytes grad = rnd.bytes(grad_t, n);
            for (size_t i = 2; i < n; i += 5) grad.set(i, 0.0f);
            dgrad.upload(grad.data.data(), grad.data.size());
            const float grad_scale = 0.7f / static_cast<float>(1 << (4 * step));
            const TensorView mv = dmoment.view(DType::f32, ni);
            k().adam_update(dmaster.view(DType::f32, ni), lion ? mv : TensorView{},
                            lion ? TensorView{} : mv, dgrad.view(grad_t, ni),
                            copy_t ? dcopy.view(*copy_t, ni) : TensorView{},
                            cpu_adam::step_constants(step, params, grad_scale), *s_);
            std::optional<ParamCopy> copy;
            if (copy_t) copy = ParamCopy{ref_copy.data(), *copy_t};
            ASSERT_TRUE(cpu_.update(shard, GradShard{grad.data.data(), grad_t, n}, step, params,
                                    grad_scale, GradStats{}, copy));
            EXPECT_EQ(first_difference(dmaster.read(n * 4), as_bytes(master), 4), -1) << "master";
            EXPECT_EQ(first_difference(dmoment.read(n * 4), as_bytes(moment), 4), -1)
                << (lion ? "m" : "sum of squares");
            if (copy_t) {
              EXPECT_EQ(first_difference(dcopy.read(n * copy_size), ref_copy, copy_size), -1)
                  << "copy";
            }
            if (n > 0) {
              EXPECT_NE(as_bytes(before), as_bytes(master));
            }
            if (HasFatalFailure()) return;
          }
        }
}

// The lane order, written out here once more: what grad_stats' chunks must equal.
double plain_sum_of_squares(const Bytes& g, size_t begin, size_t n) {
  double sum = 0.0;
  for (size_t i = begin; i < begin + n; ++i) {
    const double x = g.at(i);
    sum += x * x;
  }
  return sum;
}

// The chunk sums of `grad` from the host table.
std::vector<double> chunk_sums(Device& dev, Stream& s, Kernels& k, const Bytes& grad) {
  const size_t chunks = cpu_adam::chunk_count(grad.n, CpuAdam::kStatsChunk);
  OnDevice dgrad(dev, s, grad.data.size()), dsums(dev, s, (chunks + 1) * sizeof(double));
  dgrad.upload(grad.data.data(), grad.data.size());
  const std::vector<double> sentinel(chunks + 1, -1.0);
  dsums.upload(sentinel.data(), sentinel.size() * sizeof(double));
  k.grad_chunk_sums(dgrad.view(grad.dtype, static_cast<int64_t>(grad.n)),
                    static_cast<double*>(dsums.data()), s);
  const std::vector<uint8_t> raw = dsums.read((chunks + 1) * sizeof(double));
  std::vector<double> out(chunks + 1);
  std::memcpy(out.data(), raw.data(), raw.size());
  EXPECT_EQ(out[chunks], -1.0) << "written past the last chunk";
  out.pop_back();
  return out;
}

TEST_F(DeviceOptimizer, ChunkSumsAddedInOrderAreGradStatsBitForBit) {
  const size_t chunk = CpuAdam::kStatsChunk;
  const size_t lengths[] = {0, 1, 17, chunk - 1, chunk, chunk + 1, 3 * chunk + 5};
  uint32_t seed = 100;
  bool order_matters = false;
  for (const DType t : kDTypes)
    for (const size_t n : lengths) {
      SCOPED_TRACE(fmt::format("{} n {}", dtype_name(t), n));
      Values rnd(seed++);
      const Bytes grad = rnd.bytes(t, n);
      const std::vector<double> sums = chunk_sums(*dev_, *s_, k(), grad);
      ASSERT_EQ(sums.size(), cpu_adam::chunk_count(n, chunk));
      double total = 0.0;
      for (double c : sums) total += c;
      const GradStats want = cpu_.grad_stats(GradShard{grad.data.data(), t, n});
      EXPECT_EQ(std::bit_cast<uint64_t>(total), std::bit_cast<uint64_t>(want.sum_squares))
          << total << " vs " << want.sum_squares;
      EXPECT_FALSE(want.non_finite);
      EXPECT_TRUE(std::isfinite(total));
      for (size_t c = 0; c < sums.size(); ++c) {
        const cpu_adam::ChunkRange r = cpu_adam::chunk_range(n, chunk, c);
        const double plain = plain_sum_of_squares(grad, r.begin, r.n);
        // Within rounding of the plain sum (a chunk summed from the wrong place would not be)...
        EXPECT_NEAR(sums[c], plain, 1e-10 * plain) << "chunk " << c;
        // ...and, for long chunks, usually not its bits: the data can tell the orders apart.
        order_matters = order_matters || sums[c] != plain;
      }
    }
  EXPECT_TRUE(order_matters) << "the test data cannot distinguish the lane order from a plain sum";
}

TEST_F(DeviceOptimizer, ChunkSumsFlagNanAndInfInTheirOwnChunk) {
  const size_t chunk = CpuAdam::kStatsChunk;
  const size_t n = 2 * chunk + 100;
  struct Spot {
    size_t at;
    float value;
  };
  for (const DType t : kDTypes)
    for (const Spot spot : {Spot{0, kNaN}, Spot{chunk + 5, kInf}, Spot{n - 1, -kInf}}) {
      SCOPED_TRACE(fmt::format("{} {} at {}", dtype_name(t), spot.value, spot.at));
      Values rnd(7);
      Bytes grad = rnd.bytes(t, n);
      grad.set(spot.at, spot.value);
      const std::vector<double> sums = chunk_sums(*dev_, *s_, k(), grad);
      ASSERT_EQ(sums.size(), 3u);
      for (size_t c = 0; c < sums.size(); ++c)
        EXPECT_EQ(std::isfinite(sums[c]), c != spot.at / chunk) << "chunk " << c;
      double total = 0.0;
      for (double c : sums) total += c;
      EXPECT_FALSE(std::isfinite(total));
      EXPECT_TRUE(cpu_.grad_stats(GradShard{grad.data.data(), t, n}).non_finite);
    }
}

TEST_F(DeviceOptimizer, BadShapesDtypesAndMemoryAreRefusedWhenQueued) {
  OnDevice a(*dev_, *s_, 64), b(*dev_, *s_, 64), c(*dev_, *s_, 64), g(*dev_, *s_, 64);
  for (const OnDevice* d : {&a, &b, &c, &g}) dev_->fill_zero(d->data(), 64, *s_);
  const auto k1 = cpu_adam::step_constants(1, AdamParams{}, 1.0f);
  const TensorView m7 = a.view(DType::f32, 7), v7 = b.view(DType::f32, 7);
  const TensorView p7 = c.view(DType::f32, 7), g7 = g.view(DType::bf16, 7);
  expect_error([&] { k().adam_update(p7, a.view(DType::f32, 6), v7, g7, TensorView{}, k1, *s_); },
               {"adam_update", "m is f32[6] on host:0", "expected [7]"});
  expect_error([&] { k().adam_update(c.view(DType::bf16, 7), m7, v7, g7, TensorView{}, k1, *s_); },
               {"adam_update", "master is bf16[7]", "always f32"});
  expect_error([&] { k().adam_update(p7, m7, v7, g.view(DType::f16, 8), TensorView{}, k1, *s_); },
               {"adam_update", "grad is f16[8]", "expected [7]"});
  expect_error([&] { k().adam_update(p7, m7, v7, g7, g.view(DType::bf16, 5), k1, *s_); },
               {"adam_update", "param_copy is bf16[5]", "expected [7]"});
  std::vector<float> outside(7);
  expect_error(
      [&] {
        k().adam_update(p7, m7, v7, g7, TensorView{outside.data(), DType::f32, {7}, nullptr}, k1,
                        *s_);
      },
      {"adam_update", "param_copy", "not inside host:0's memory"});
  expect_error([&] { k().grad_chunk_sums(g7, nullptr, *s_); },
               {"grad_chunk_sums", "chunk_sums is null", "bf16[7]", "1 doubles"});
  double host_sum = 0.0;
  expect_error([&] { k().grad_chunk_sums(g7, &host_sum, *s_); },
               {"grad_chunk_sums", "chunk_sums (double[1])", "not inside host:0's memory"});
  // An empty gradient needs no chunk_sums; a null param_copy's shape is never looked at.
  k().grad_chunk_sums(g.view(DType::f32, 0), nullptr, *s_);
  k().adam_update(p7, m7, v7, g7, TensorView{nullptr, DType::bf16, {3}, nullptr}, k1, *s_);
  s_->synchronize();
  expect_error([] { (void)cpu_adam::step_constants(0, AdamParams{}, 1.0f); },
               {"step 0 is not valid", "count from 1"});
}

}  // namespace
}  // namespace strata
