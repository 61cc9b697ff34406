// test_cuda_ops.cpp: every op of the CUDA kernel table against the host reference ops.
//
// Label `gpu`: every test skips, with the runtime's status and detail, when no GPU is usable.
// Each op runs on cuda:0 through Device::kernels() and on the host through strata::host::*, on
// the same random inputs. Outputs are compared by normalised error,
// sqrt(sum (gpu - host)^2) / sqrt(sum host^2), against a tolerance per dtype; NaN and Inf must
// sit at the same positions; and every device tensor has guard bytes on both sides that must
// survive the op. "=" outputs start as NaN on the device, so an op that reads them shows up.
//
// STRATA_OPS_TEST_DEVICE=host:1 runs the same comparisons against the host backend's kernel
// table instead: a check of this harness (and of the host table) on a machine without a GPU.
#include "core/device.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/kernels.h"
#include "cpu_adam/cpu_adam.h"
#include "cpu_adam/kernels.h"
#include "gpu/runtime.h"
#if STRATA_HAVE_CUDA
#include "gpu/cuda_check.h"
#include "gpu/cuda_stream.h"
#include "gpu/ops.h"
#endif
#include "host/ops.h"

#include <gtest/gtest.h>
#include "testing.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

namespace strata {
namespace {

using test::error_message;

constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint64_t kGuard = 256;  // bytes each side; keeps the body 256-byte aligned
constexpr uint8_t kGuardByte = 0x5a;
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr DType f32 = DType::f32;
constexpr DType bf16 = DType::bf16;

std::string device_spec() {
  const char* env = std::getenv("STRATA_OPS_TEST_DEVICE");
  return env != nullptr && *env != '\0' ? env : "cuda:0";
}

// A tensor in ordinary host memory, for the host reference.
struct HostTensor {
  DType dtype = f32;
  Shape shape;
  std::vector<uint8_t> bytes;

  HostTensor() = default;
  HostTensor(DType t, const Shape& s)
      : dtype(t), shape(s), bytes(static_cast<size_t>(s.numel()) * dtype_size(t)) {}
  int64_t numel() const { return shape.numel(); }
  float at(int64_t i) const { return load_f32(bytes.data(), dtype, static_cast<size_t>(i)); }
  void set(int64_t i, float v) { store_f32(bytes.data(), dtype, static_cast<size_t>(i), v); }
  TensorView view() { return TensorView{bytes.data(), dtype, shape, nullptr}; }
};

class Rng {
 public:
  explicit Rng(uint32_t seed) : gen_(seed) {}
  float uniform(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(gen_); }
  int32_t below(int32_t n) { return std::uniform_int_distribution<int32_t>(0, n - 1)(gen_); }

 private:
  std::mt19937 gen_;
};

// Rows [first, first + n) of a [rows, cols] tensor.
HostTensor rows_of(const HostTensor& h, int64_t first, int64_t n) {
  HostTensor part(h.dtype, {n, h.shape[1]});
  const size_t row = static_cast<size_t>(h.shape[1]) * dtype_size(h.dtype);
  std::memcpy(part.bytes.data(), h.bytes.data() + static_cast<size_t>(first) * row,
              static_cast<size_t>(n) * row);
  return part;
}

HostTensor random_tensor(DType t, const Shape& s, Rng& rng, float lo = -1.0f, float hi = 1.0f) {
  HostTensor h(t, s);
  for (int64_t i = 0; i < h.numel(); ++i) h.set(i, rng.uniform(lo, hi));
  return h;
}

// A tensor in the device's arena with guard bytes before and after it.
class DeviceTensor {
 public:
  // The body starts as 0xff bytes: NaN in f32 and in bf16.
  DeviceTensor(Device& device, Stream& stream, DType t, const Shape& shape)
      : device_(&device),
        stream_(&stream),
        dtype_(t),
        shape_(shape),
        body_(static_cast<uint64_t>(shape.numel()) * dtype_size(t)),
        buffer_(device, body_ + 2 * kGuard, "ops test tensor") {
    std::vector<uint8_t> init(body_ + 2 * kGuard, kGuardByte);
    std::fill(init.begin() + kGuard, init.end() - kGuard, uint8_t{0xff});
    device.copy_to_device(buffer_.data(), init.data(), init.size(), stream);
    stream.synchronize();
  }

  void* data() const { return static_cast<char*>(buffer_.data()) + kGuard; }
  TensorView view() const { return TensorView{data(), dtype_, shape_, device_}; }

  void upload(const HostTensor& h) {
    ASSERT_EQ(h.bytes.size(), body_);
    device_->copy_to_device(data(), h.bytes.data(), body_, *stream_);
    stream_->synchronize();
  }

  // The body, after checking that both guards are intact.
  HostTensor fetch(const std::string& what) const {
    std::vector<uint8_t> all(body_ + 2 * kGuard);
    device_->copy_to_host(all.data(), buffer_.data(), all.size(), *stream_);
    stream_->synchronize();
    int64_t before = 0, after = 0;
    for (uint64_t i = 0; i < kGuard; ++i) {
      before += all[i] != kGuardByte;
      after += all[kGuard + body_ + i] != kGuardByte;
    }
    EXPECT_EQ(before + after, 0) << what << ": guard bytes overwritten: " << before
                                 << " before the tensor, " << after << " after it";
    HostTensor h(dtype_, shape_);
    std::memcpy(h.bytes.data(), all.data() + kGuard, body_);
    return h;
  }

 private:
  Device* device_;
  Stream* stream_;
  DType dtype_;
  Shape shape_;
  uint64_t body_;
  DeviceBuffer buffer_;
};

// int32 ids or targets in the arena.
class DeviceInts {
 public:
  DeviceInts(Device& device, Stream& stream, const std::vector<int32_t>& values)
      : buffer_(device, values.size() * sizeof(int32_t), "ops test ids") {
    device.copy_to_device(buffer_.data(), values.data(), buffer_.bytes(), stream);
    stream.synchronize();
  }
  const int32_t* data() const { return static_cast<const int32_t*>(buffer_.data()); }

 private:
  DeviceBuffer buffer_;
};

// f32 ~1e-5; an f32 result of bf16 inputs (the same numbers, summed in another order) 1e-4;
// a bf16 result ~1e-2 (one rounding of 2^-9, in a different place now and then).
double tolerance(DType out, DType in) {
  if (out == bf16) return 1e-2;
  return in == bf16 ? 1e-4 : 1e-5;
}

// `floor`: the smallest magnitude the error is measured against, per element. A result that is
// zero in exact arithmetic comes out of both backends as rounding noise, and noise against noise
// is no measure of anything.
void expect_close(const std::string& what, const HostTensor& got, const HostTensor& want,
                  double tol, double floor = 0.0) {
  ASSERT_EQ(got.numel(), want.numel()) << what;
  double num = 0.0, den = 0.0, worst = -1.0;
  int64_t worst_at = -1, special = 0;
  std::string specials;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const float g = got.at(i), w = want.at(i);
    if (!std::isfinite(g) || !std::isfinite(w)) {
      const bool same = (std::isnan(g) && std::isnan(w)) ||
                        (std::isinf(g) && std::isinf(w) && std::signbit(g) == std::signbit(w));
      if (!same && special++ < 5) specials += fmt::format(" [{}] gpu {} host {};", i, g, w);
      continue;
    }
    const double d = static_cast<double>(g) - static_cast<double>(w);
    num += d * d;
    den += static_cast<double>(w) * w;
    if (std::abs(d) > worst) {
      worst = std::abs(d);
      worst_at = i;
    }
  }
  EXPECT_EQ(special, 0) << what << ": NaN/Inf positions differ:" << specials;
  den = std::max(den, floor * floor * static_cast<double>(got.numel()));
  const double err = den > 0.0 ? std::sqrt(num / den) : std::sqrt(num);
  EXPECT_LE(err, tol) << what << ": normalised error " << err << " over " << got.numel()
                      << " elements; largest difference at [" << worst_at << "]: gpu "
                      << (worst_at >= 0 ? got.at(worst_at) : 0.0f) << ", host "
                      << (worst_at >= 0 ? want.at(worst_at) : 0.0f);
}

void expect_same_bits(const std::string& what, const HostTensor& got, const HostTensor& want) {
  ASSERT_EQ(got.bytes.size(), want.bytes.size()) << what;
  const size_t size = dtype_size(want.dtype);
  for (size_t i = 0; i < got.bytes.size(); ++i)
    if (got.bytes[i] != want.bytes[i]) {
      const auto at = static_cast<int64_t>(i / size);
      ADD_FAILURE() << what << ": bits differ first at [" << at << "]: gpu " << got.at(at)
                    << ", host " << want.at(at);
      return;
    }
}

struct AttentionCase;

class CudaOpsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const DeviceSpec spec = parse_device_spec(device_spec());
    if (spec.backend == Backend::cuda) {
      const CudaRuntime& rt = cuda_runtime();
      if (rt.gpus.empty()) GTEST_SKIP() << "no CUDA device: " << rt.status << ": " << rt.detail;
    }
    auto devices = open_devices(spec, 512 * kMiB);
    ASSERT_FALSE(devices.empty());
    device_ = std::move(devices.front());
    stream_ = device_->create_stream("ops test");
  }

  bool on_cuda() const { return device_->backend() == Backend::cuda; }
  Kernels& gpu() { return device_->kernels(); }
  Stream& stream() { return *stream_; }
  void sync() { stream_->synchronize(); }

  DeviceTensor empty(DType t, const Shape& s) { return DeviceTensor(*device_, *stream_, t, s); }
  DeviceTensor upload(const HostTensor& h) {
    DeviceTensor d(*device_, *stream_, h.dtype, h.shape);
    d.upload(h);
    return d;
  }
  DeviceInts ints(const std::vector<int32_t>& v) { return DeviceInts(*device_, *stream_, v); }
  // One attention case against the host backend (below), over documents where doc_start is not
  // empty, with a sliding window where `window` > 0.
  // scale, softcap: AttentionMask's (Gemma 2's scores), 0 for Llama's.
  void attention_against_host(const AttentionCase& c, const std::vector<int32_t>& doc_start,
                              Rng& rng, int64_t window = 0, float scale = 0.0f,
                              float softcap = 0.0f);

  std::unique_ptr<Device> device_;
  std::unique_ptr<Stream> stream_;
};

// ---- matmul ----

struct MatmulTypes {
  DType ab, c;
};

TEST_F(CudaOpsTest, MatmulMatchesHostForEveryTransposeDtypeAndBeta) {
  Rng rng(1);
  const int64_t sizes[][3] = {{1, 1, 1}, {17, 33, 65}, {128, 96, 64}, {5, 300, 7}, {64, 1, 129}};
  for (const MatmulTypes types : {MatmulTypes{f32, f32}, {bf16, bf16}, {bf16, f32}}) {
    for (const auto& size : sizes) {
      const int64_t m = size[0], n = size[1], k = size[2];
      for (int t = 0; t < 4; ++t) {
        for (const float beta : {0.0f, 1.0f}) {
          const bool ta = (t & 1) != 0, tb = (t & 2) != 0;
          const float alpha = beta == 0.0f ? 1.0f : 0.5f;
          SCOPED_TRACE(fmt::format("ab {} c {} m {} n {} k {} trans_a {} trans_b {} beta {}",
                                   dtype_name(types.ab), dtype_name(types.c), m, n, k, ta, tb,
                                   beta));
          HostTensor a = random_tensor(types.ab, ta ? Shape{k, m} : Shape{m, k}, rng);
          HostTensor b = random_tensor(types.ab, tb ? Shape{n, k} : Shape{k, n}, rng);
          HostTensor c = random_tensor(types.c, {m, n}, rng);
          DeviceTensor da = upload(a), db = upload(b);
          // beta == 0: c starts as NaN on the device, and must not be read.
          DeviceTensor dc = beta == 0.0f ? empty(types.c, {m, n}) : upload(c);
          gpu().matmul(dc.view(), da.view(), ta, db.view(), tb, alpha, beta, stream());
          host::matmul(c.view(), a.view(), ta, b.view(), tb, alpha, beta);
          expect_close("c", dc.fetch("c"), c, tolerance(types.c, types.ab));
        }
      }
    }
  }
}

TEST_F(CudaOpsTest, MatmulOnViewsAlignedToOneElement) {
  // Views that start one element into a buffer: cuBLASLt must pick an algorithm that allows it.
  Rng rng(2);
  const int64_t m = 33, n = 18, k = 47;
  for (const DType t : {f32, bf16}) {
    SCOPED_TRACE(dtype_name(t));
    HostTensor a = random_tensor(t, {m * k + 1}, rng), b = random_tensor(t, {n * k + 1}, rng);
    HostTensor c(f32, {m * n + 1});
    DeviceTensor da = upload(a), db = upload(b), dc = empty(f32, {m * n + 1});
    auto shifted = [](TensorView v, DType dt, const Shape& s) {
      return TensorView{static_cast<char*>(v.data) + dtype_size(dt), dt, s, v.device};
    };
    gpu().matmul(shifted(dc.view(), f32, {m, n}), shifted(da.view(), t, {m, k}), false,
                 shifted(db.view(), t, {n, k}), true, 1.0f, 0.0f, stream());
    host::matmul(shifted(c.view(), f32, {m, n}), shifted(a.view(), t, {m, k}), false,
                 shifted(b.view(), t, {n, k}), true, 1.0f, 0.0f);
    HostTensor got = dc.fetch("c");
    HostTensor got_body(f32, {m * n}), want_body(f32, {m * n});
    std::memcpy(got_body.bytes.data(), got.bytes.data() + 4, got_body.bytes.size());
    std::memcpy(want_body.bytes.data(), c.bytes.data() + 4, want_body.bytes.size());
    expect_close("c", got_body, want_body, tolerance(f32, t));
    EXPECT_TRUE(std::isnan(got.at(0))) << "the element before the shifted view was written";
  }
}

TEST_F(CudaOpsTest, MatmulWithAnEmptyInnerDimensionScalesC) {
  Rng rng(3);
  HostTensor a(f32, {3, 0}), b(f32, {0, 4});
  HostTensor c = random_tensor(f32, {3, 4}, rng);
  DeviceTensor da = upload(a), db = upload(b), dc = upload(c);
  gpu().matmul(dc.view(), da.view(), false, db.view(), false, 1.0f, 0.5f, stream());
  host::matmul(c.view(), a.view(), false, b.view(), false, 1.0f, 0.5f);
  expect_close("c", dc.fetch("c"), c, 1e-6);
}

// ---- embedding ----

TEST_F(CudaOpsTest, EmbeddingForward) {
  Rng rng(4);
  const int64_t vocab = 50, dim = 33, rows = 40;
  std::vector<int32_t> ids(rows);
  for (auto& id : ids) id = rng.below(10);  // repeats: a row read more than once
  ids[7] = static_cast<int32_t>(vocab - 1);
  DeviceInts dids = ints(ids);

  // 1 copies the rows; 55.5 is Gemma 7B's sqrt(3072) in bf16.
  for (const float scale : {1.0f, 55.5f})
    for (const DType table_t : {f32, bf16}) {
      for (const DType out_t : {f32, bf16}) {
        SCOPED_TRACE(
            fmt::format("table {} out {} scale {}", dtype_name(table_t), dtype_name(out_t), scale));
        HostTensor table = random_tensor(table_t, {vocab, dim}, rng);
        HostTensor out(out_t, {rows, dim});
        DeviceTensor dtable = upload(table), dout = empty(out_t, {rows, dim});
        gpu().embedding_forward(dout.view(), dtable.view(), dids.data(), scale, {}, stream());
        host::embedding_forward(out.view(), table.view(), ids.data(), scale);
        expect_close("out", dout.fetch("out"), out, 0.0);  // a gather and one product: exact
        // The same table as three vocabulary pieces (uneven, the last shorter), each a buffer of
        // its own: the first zeroes the rows it does not hold, the others fill theirs.
        DeviceTensor pieced = empty(out_t, {rows, dim});
        const int64_t bounds[] = {0, 17, 34, vocab};
        for (int p = 0; p < 3; ++p) {
          const int64_t first = bounds[p], n = bounds[p + 1] - first;
          DeviceTensor dpart = upload(rows_of(table, first, n));
          gpu().embedding_forward(pieced.view(), dpart.view(), dids.data(), scale,
                                  TableRows{first, vocab, p == 0}, stream());
        }
        expect_same_bits("out from pieces", pieced.fetch("out"), out);
      }
    }
}

// The backward adds rows sharing an id in token order, as the host does: the same bits, every
// run. Shapes: few rows; rows past one chunk of the id scan (1024) and columns past one block,
// with one id taking most rows (a long chain, as padding makes); every id distinct.
TEST_F(CudaOpsTest, EmbeddingBackwardIsTheHostsBitForBit) {
  Rng rng(14);
  struct Case {
    int64_t vocab, dim, rows;
    int repeats_below;  // ids drawn below this (0: every id distinct, in shuffled order)
  };
  for (const Case c : {Case{50, 33, 40, 10}, Case{300, 700, 2500, 3}, Case{4096, 64, 3000, 0}}) {
    std::vector<int32_t> ids(static_cast<size_t>(c.rows));
    for (size_t i = 0; i < ids.size(); ++i)
      ids[i] = c.repeats_below ? static_cast<int32_t>(rng.below(c.repeats_below))
                               : static_cast<int32_t>((i * 2654435761u) % c.vocab);
    ids.back() = static_cast<int32_t>(c.vocab - 1);
    DeviceInts dids = ints(ids);
    for (const MatmulTypes types : {MatmulTypes{f32, f32}, {bf16, f32}, {bf16, bf16}}) {
      const DType dout_t = types.ab, dtable_t = types.c;
      const float scale = dout_t == bf16 ? 45.25f : 1.0f;  // Gemma's products, rounded to dout's
      SCOPED_TRACE(fmt::format("vocab {} dim {} rows {}: dtable {} dout {} scale {}", c.vocab,
                               c.dim, c.rows, dtype_name(dtable_t), dtype_name(dout_t), scale));
      HostTensor dtable = random_tensor(dtable_t, {c.vocab, c.dim}, rng);
      HostTensor dout = random_tensor(dout_t, {c.rows, c.dim}, rng);
      DeviceTensor ddtable = upload(dtable), ddout = upload(dout);
      // The table's middle third as a piece of its own, before the whole table changes.
      const int64_t first = c.vocab / 3, n = c.vocab / 3;
      DeviceTensor dpart = upload(rows_of(dtable, first, n));
      gpu().embedding_backward(ddtable.view(), ddout.view(), dids.data(), scale, {}, stream());
      gpu().embedding_backward(dpart.view(), ddout.view(), dids.data(), scale,
                               TableRows{first, c.vocab, true}, stream());
      host::embedding_backward(dtable.view(), dout.view(), ids.data(), scale);
      expect_same_bits("dtable", ddtable.fetch("dtable"), dtable);
      // The piece: the whole table's rows, the same bits.
      expect_same_bits("dtable piece", dpart.fetch("dtable piece"), rows_of(dtable, first, n));
    }
  }
}

// ---- rmsnorm ----

TEST_F(CudaOpsTest, RmsnormForwardAndBackward) {
  Rng rng(5);
  // Widths for one warp (64), three (300), and the full block (1000, 4096).
  const int64_t shapes[][2] = {{1, 64}, {5, 300}, {7, 1000}, {300, 4096}};
  struct Types {
    DType x, w;  // y, dy, dx take x's dtype; dw is f32 (a gradient accumulator) or w's dtype
  };
  // weight_offset 1: Gemma's norms, whose weights are stored as their difference from 1.
  for (const float offset : {0.0f, 1.0f})
    for (const Types types : {Types{f32, f32}, {bf16, bf16}, {bf16, f32}}) {
      for (const auto& shape : shapes) {
        const int64_t rows = shape[0], dim = shape[1];
        SCOPED_TRACE(fmt::format("x {} w {} rows {} dim {} offset {}", dtype_name(types.x),
                                 dtype_name(types.w), rows, dim, offset));
        const float eps = 1e-5f;
        HostTensor x = random_tensor(types.x, {rows, dim}, rng, -2.0f, 2.0f);
        HostTensor w = random_tensor(types.w, {dim}, rng, 0.5f - offset, 1.5f - offset);
        HostTensor y(types.x, {rows, dim}), rstd(f32, {rows});
        DeviceTensor x_dev = upload(x), w_dev = upload(w);
        DeviceTensor y_dev = empty(types.x, {rows, dim}), rstd_dev = empty(f32, {rows});
        gpu().rmsnorm_forward(y_dev.view(), rstd_dev.view(), x_dev.view(), w_dev.view(), eps,
                              offset, stream());
        host::rmsnorm_forward(y.view(), rstd.view(), x.view(), w.view(), eps, offset);
        expect_close("y", y_dev.fetch("y"), y, tolerance(types.x, types.x));
        expect_close("rstd", rstd_dev.fetch("rstd"), rstd, tolerance(f32, types.x));

        // Backward from the host's rstd on both sides; dx and dw accumulate (+=).
        const DType dw_t = types.w == bf16 ? bf16 : f32;
        HostTensor dy = random_tensor(types.x, {rows, dim}, rng);
        HostTensor dx = random_tensor(types.x, {rows, dim}, rng);
        HostTensor dw = random_tensor(dw_t, {dim}, rng);
        DeviceTensor dy_dev = upload(dy), dx_dev = upload(dx), dw_dev = upload(dw),
                     rstd_in = upload(rstd);
        gpu().rmsnorm_backward(dx_dev.view(), dw_dev.view(), dy_dev.view(), x_dev.view(),
                               w_dev.view(), rstd_in.view(), offset, stream());
        host::rmsnorm_backward(dx.view(), dw.view(), dy.view(), x.view(), w.view(), rstd.view(),
                               offset);
        expect_close("dx", dx_dev.fetch("dx"), dx, tolerance(types.x, types.x));
        expect_close("dw", dw_dev.fetch("dw"), dw, tolerance(dw_t, types.x));
      }
    }
}

// ---- rope ----

HostTensor rope_table(int64_t seq_len, int64_t head_dim) {
  HostTensor t(f32, {seq_len, head_dim});
  const int64_t half = head_dim / 2;
  for (int64_t p = 0; p < seq_len; ++p)
    for (int64_t i = 0; i < half; ++i) {
      const double angle =
          static_cast<double>(p) *
          std::pow(10000.0, -2.0 * static_cast<double>(i) / static_cast<double>(head_dim));
      t.set(p * head_dim + i, static_cast<float>(std::cos(angle)));
      t.set(p * head_dim + half + i, static_cast<float>(std::sin(angle)));
    }
  return t;
}

// Whole heads, and a partial rotation (Phi-4-mini's: the table rotates 96 of 128 dimensions,
// the rest pass), against the host.
TEST_F(CudaOpsTest, RopeForwardAndInverse) {
  Rng rng(6);
  const int64_t batch = 3, seq = 17, heads = 4;
  for (const auto& [head_dim, rotary] :
       {std::pair<int64_t, int64_t>{64, 64}, {128, 128}, {128, 96}, {40, 10}}) {
    HostTensor table = rope_table(seq, rotary);
    DeviceTensor dtable = upload(table);
    for (const DType t : {f32, bf16}) {
      for (const bool inverse : {false, true}) {
        SCOPED_TRACE(fmt::format("{} head_dim {} rotary {} inverse {}", dtype_name(t), head_dim,
                                 rotary, inverse));
        HostTensor x = random_tensor(t, {batch * seq, heads, head_dim}, rng);
        DeviceTensor dx = upload(x);
        gpu().rope(dx.view(), dtable.view(), seq, inverse, stream());
        host::rope(x.view(), table.view(), seq, inverse);
        expect_close("x", dx.fetch("x"), x, tolerance(t, t));
      }
    }
  }
}

// ---- attention ----

struct AttentionCase {
  int64_t batch, seq, heads, kv_heads, head_dim;
  DType dtype;
  int64_t kv_seq = -1;  // the keys' positions; -1: seq (decoding's calls have more)
  int64_t keys() const { return kv_seq < 0 ? seq : kv_seq; }
};

// Random inputs of a case and the host's forward of them.
struct AttentionForward {
  Shape qs, ks, ls;
  HostTensor q, k, v, out, lse;
};
AttentionForward host_attention_forward(const AttentionCase& c, Rng& rng, AttentionMask mask = {}) {
  AttentionForward f;
  f.qs = Shape{c.batch, c.seq, c.heads, c.head_dim};
  f.ks = Shape{c.batch, c.keys(), c.kv_heads, c.head_dim};
  f.ls = Shape{c.batch, c.heads, c.seq};
  // q spans a wider range than k so that some rows' softmax is sharp.
  f.q = random_tensor(c.dtype, f.qs, rng, -3.0f, 3.0f);
  f.k = random_tensor(c.dtype, f.ks, rng);
  f.v = random_tensor(c.dtype, f.ks, rng);
  f.out = HostTensor(c.dtype, f.qs);
  f.lse = HostTensor(f32, f.ls);
  host::attention_forward(f.out.view(), f.lse.view(), f.q.view(), f.k.view(), f.v.view(), mask);
  return f;
}

std::vector<AttentionCase> attention_cases() {
  std::vector<AttentionCase> cases;
  for (const int64_t t : {1, 17, 64, 129, 300}) {
    cases.push_back({2, t, 8, 2, 64, f32});   // grouped-query, 4 heads per kv head
    cases.push_back({1, t, 8, 2, 128, f32});  // Llama's head_dim
    cases.push_back({1, t, 4, 4, 64, f32});   // one kv head per head
  }
  for (const int64_t t : {1, 17, 64, 65})  // bf16 on the tensor cores
    cases.push_back({2, t, 8, 2, 64, bf16});
  cases.push_back({2, 129, 8, 2, 128, bf16});
  cases.push_back({1, 300, 8, 2, 64, bf16});
  cases.push_back({1, 64, 4, 4, 128, bf16});
  cases.push_back({1, 200, 4, 1, 16, bf16});  // the tiny model's head_dim, 4 heads per kv head
  cases.push_back({1, 70, 2, 2, 48, bf16});
  cases.push_back({1, 129, 4, 2, 96, f32});  // other multiples of 8, up to 256
  cases.push_back({1, 33, 2, 2, 40, f32});
  cases.push_back({1, 65, 2, 1, 256, f32});
  for (const int64_t t : {1, 40, 64, 129})  // Gemma's head_dim: mma.sync, else SIMT
    cases.push_back({t == 129 ? 2 : 1, t, 4, t == 40 ? 1 : 2, 256, bf16});
  cases.push_back({1, 33, 2, 2, 40, bf16});  // not a multiple of 16: SIMT in bf16
  return cases;
}

// Whether the CUDA backend's tensor-core attention takes a case: attention_mma.cu's (head_dim a
// multiple of 16 up to 128, or 256; any scores), attention_tc.cu's (up to 128, plain scores).
bool on_mma(const AttentionCase& c) {
  return c.dtype == bf16 && c.head_dim % 16 == 0 && (c.head_dim <= 128 || c.head_dim == 256);
}
bool on_wmma(const AttentionCase& c, bool plain_scores) {
  return plain_scores && c.dtype == bf16 && c.head_dim % 16 == 0 && c.head_dim <= 128;
}

#if STRATA_HAVE_CUDA
// Whether this GPU's shared memory per block holds a tensor-core backward needing `bytes`.
bool backward_fits(uint64_t bytes) {
  int device = 0, optin = 0;
  return cudaGetDevice(&device) == cudaSuccess &&
         cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) ==
             cudaSuccess &&
         bytes <= static_cast<uint64_t>(optin);
}

// attention_kernels(k) for a scope.
struct AttentionPath {
  explicit AttentionPath(AttentionKernels k) { attention_kernels(k); }
  ~AttentionPath() { attention_kernels(AttentionKernels::kMma); }
  AttentionPath(const AttentionPath&) = delete;
  AttentionPath& operator=(const AttentionPath&) = delete;
};
#endif

// Each case against the host backend; bf16 cases the tensor cores take run on each path in turn
// (mma.sync, wmma, SIMT), which must all pass, and the path asked for must be the one that ran
// (a call the path does not take, or whose shared memory this GPU lacks, takes the next path:
// wmma refuses head_dim 256 and scaled or capped scores).
void CudaOpsTest::attention_against_host(const AttentionCase& c,
                                         const std::vector<int32_t>& doc_start, Rng& rng,
                                         int64_t window, float scale, float softcap) {
  const int32_t* docs = doc_start.empty() ? nullptr : doc_start.data();
  AttentionForward f = host_attention_forward(c, rng, AttentionMask(docs, window, scale, softcap));
  const Shape &qs = f.qs, &ks = f.ks, &ls = f.ls;
  HostTensor &q = f.q, &k = f.k, &v = f.v, &out = f.out, &lse = f.lse;
  HostTensor dout = random_tensor(c.dtype, qs, rng);
  HostTensor dq(c.dtype, qs), dk(c.dtype, ks), dv(c.dtype, ks);
  host::attention_backward(dq.view(), dk.view(), dv.view(), dout.view(), q.view(), k.view(),
                           v.view(), out.view(), lse.view(),
                           AttentionMask(docs, window, scale, softcap));
  std::optional<DeviceInts> docs_dev;
  if (docs != nullptr) docs_dev.emplace(ints(doc_start));
  const AttentionMask on_device(docs_dev ? docs_dev->data() : nullptr, window, scale, softcap);
  DeviceTensor q_dev = upload(q), k_dev = upload(k), v_dev = upload(v);
  DeviceTensor dout_dev = upload(dout), out_in = upload(out), lse_in = upload(lse);
  const bool plain = scale == 0.0f && softcap == 0.0f;
  const bool all_paths = on_cuda() && on_mma(c);
  const int paths = all_paths ? 3 : 1;
  for (int path = 0; path < paths; ++path) {
#if STRATA_HAVE_CUDA
    std::optional<AttentionPath> scope;
    if (all_paths) scope.emplace(static_cast<AttentionKernels>(path));
#endif
    static constexpr const char* kNames[] = {" mma.sync", " wmma", " SIMT"};
    SCOPED_TRACE(fmt::format(
        "{} batch {} seq {} heads {} kv_heads {} head_dim {}{}{} window {} scale {} softcap {}",
        dtype_name(c.dtype), c.batch, c.seq, c.heads, c.kv_heads, c.head_dim,
        all_paths ? kNames[path] : "", docs ? " documents" : "", window, scale, softcap));
#if STRATA_HAVE_CUDA
    // The paths the forward and the backward must take.
    AttentionKernels forward_path = AttentionKernels::kSimt, backward_path = forward_path;
    if (all_paths) {
      const bool wmma = on_wmma(c, plain);
      backward_path = AttentionKernels::kSimt;
      if (path == 0 && backward_fits(attention_mma_forward_shared_bytes(c.head_dim)))
        forward_path = AttentionKernels::kMma;
      else if (path <= 1 && wmma)
        forward_path = AttentionKernels::kWmma;
      if (path == 0 && backward_fits(attention_mma_backward_shared_bytes(c.head_dim)))
        backward_path = AttentionKernels::kMma;
      else if (path <= 1 && wmma && backward_fits(attention_tc_backward_shared_bytes(c.head_dim)))
        backward_path = AttentionKernels::kWmma;
    }
    const uint64_t forward_calls = attention_calls(forward_path);
#endif
    DeviceTensor out_dev = empty(c.dtype, qs), lse_dev = empty(f32, ls);
    gpu().attention_forward(out_dev.view(), lse_dev.view(), q_dev.view(), k_dev.view(),
                            v_dev.view(), on_device, stream());
#if STRATA_HAVE_CUDA
    if (on_cuda()) {
      EXPECT_EQ(attention_calls(forward_path), forward_calls + 1)
          << "the forward did not take path " << static_cast<int>(forward_path);
    }
    const uint64_t backward_calls = attention_calls(backward_path);
#endif
    expect_close("out", out_dev.fetch("out"), out, tolerance(c.dtype, c.dtype));
    expect_close("lse", lse_dev.fetch("lse"), lse, tolerance(f32, c.dtype));

    // Backward from the host's out and lse on both sides.
    DeviceTensor dq_dev = empty(c.dtype, qs), dk_dev = empty(c.dtype, ks),
                 dv_dev = empty(c.dtype, ks);
    gpu().attention_backward(dq_dev.view(), dk_dev.view(), dv_dev.view(), dout_dev.view(),
                             q_dev.view(), k_dev.view(), v_dev.view(), out_in.view(), lse_in.view(),
                             on_device, stream());
    // With one key (seq 1) P = 1 and dS = 0: dq and dk are zero in exact arithmetic and up to
    // ~1e-6 of rounding noise on either backend (different noise: the GPU sums in another
    // order), so they are measured against elements of 0.1, the size of real gradients here.
    const double tol = tolerance(c.dtype, c.dtype), floor = 0.1;
#if STRATA_HAVE_CUDA
    if (on_cuda()) {
      EXPECT_EQ(attention_calls(backward_path), backward_calls + 1)
          << "the backward did not take path " << static_cast<int>(backward_path);
    }
#endif
    expect_close("dq", dq_dev.fetch("dq"), dq, tol, floor);
    expect_close("dk", dk_dev.fetch("dk"), dk, tol, floor);
    expect_close("dv", dv_dev.fetch("dv"), dv, tol, floor);
  }
}

TEST_F(CudaOpsTest, AttentionForwardAndBackward) {
  Rng rng(7);
  for (const AttentionCase& c : attention_cases()) attention_against_host(c, {}, rng);
}

// Documents packed into sequences (doc_start): lengths of 1, tile edges and past them, so that
// boundaries fall inside, at the start and at the end of the kernels' 32- and 64-key tiles, and
// one document crosses several; every path against the host backend, which test_host_ops checks
// against each document alone.
TEST_F(CudaOpsTest, AttentionOverPackedDocuments) {
  Rng rng(21);
  const std::vector<AttentionCase> cases = {{2, 300, 8, 2, 64, f32},  {1, 129, 4, 2, 128, f32},
                                            {1, 65, 2, 1, 256, f32},  {2, 300, 8, 2, 64, bf16},
                                            {1, 200, 4, 1, 16, bf16}, {1, 129, 8, 2, 128, bf16},
                                            {1, 70, 2, 2, 40, bf16}};
  const int32_t lengths[] = {1, 2, 7, 31, 32, 33, 63, 64, 65, 100, 150};
  for (const AttentionCase& c : cases) {
    std::vector<int32_t> doc_start(static_cast<size_t>(c.batch * c.seq));
    for (int64_t b = 0; b < c.batch; ++b)
      for (int64_t t = 0; t < c.seq;) {
        const int64_t n = std::min<int64_t>(
            lengths[rng.below(static_cast<int32_t>(std::size(lengths)))], c.seq - t);
        for (int64_t i = t; i < t + n; ++i)
          doc_start[static_cast<size_t>(b * c.seq + i)] = static_cast<int32_t>(t);
        t += n;
      }
    attention_against_host(c, doc_start, rng);
  }
}

// A sliding window (Mistral's), alone and over packed documents: windows shorter than, equal to
// and longer than the kernels' 32- and 64-key tiles, so a window's first key falls inside, at
// the start and at the end of a tile, and blocks of queries whose windows start in different
// tiles; every path against the host backend, which test_host_ops checks against each window
// alone and finite differences.
TEST_F(CudaOpsTest, AttentionInASlidingWindow) {
  Rng rng(23);
  struct WindowCase {
    AttentionCase c;
    int64_t window;
    bool docs;
  };
  const std::vector<WindowCase> cases = {
      {{2, 300, 8, 2, 64, f32}, 50, false},    {{1, 129, 4, 2, 128, f32}, 64, true},
      {{1, 200, 4, 1, 16, bf16}, 1, false},    {{2, 300, 8, 2, 64, bf16}, 33, true},
      {{1, 129, 8, 2, 128, bf16}, 100, false}, {{1, 70, 2, 2, 40, bf16}, 31, true},
      {{1, 150, 4, 2, 64, bf16}, 149, false}};
  for (const WindowCase& w : cases) {
    std::vector<int32_t> doc_start;
    if (w.docs) {
      doc_start.resize(static_cast<size_t>(w.c.batch * w.c.seq));
      for (int64_t b = 0; b < w.c.batch; ++b)
        for (int64_t t = 0; t < w.c.seq;) {
          const int64_t n = std::min<int64_t>(17 + 40 * (b + t % 3), w.c.seq - t);
          for (int64_t i = t; i < t + n; ++i)
            doc_start[static_cast<size_t>(b * w.c.seq + i)] = static_cast<int32_t>(t);
          t += n;
        }
    }
    attention_against_host(w.c, doc_start, rng, w.window);
  }
}

// Gemma 2's scores: q·k times another scale than 1/sqrt(head_dim) (its query_pre_attn_scalar),
// capped by softcap · tanh(s / softcap) (its attn_logit_softcapping, here small enough against
// the scores to bend them), with a sliding window and packed documents too; the tensor-core
// shapes among them run mma.sync and SIMT (wmma computes plain scores only), which the call
// counts check.
TEST_F(CudaOpsTest, AttentionWithScaledAndCappedScores) {
  Rng rng(29);
  struct ScoreCase {
    AttentionCase c;
    float scale, softcap;
    int64_t window;
    bool docs;
  };
  const std::vector<ScoreCase> cases = {{{2, 70, 4, 2, 64, f32}, 0.0f, 1.5f, 0, false},
                                        {{1, 129, 4, 2, 128, bf16}, 0.2f, 2.0f, 0, false},
                                        {{1, 65, 2, 1, 256, f32}, 1.0f / 12.0f, 1.0f, 40, false},
                                        {{2, 100, 4, 2, 256, bf16}, 0.0625f, 0.0f, 33, true},
                                        {{1, 40, 8, 2, 32, bf16}, 0.0f, 0.75f, 0, true},
                                        {{2, 150, 8, 4, 256, bf16}, 0.0625f, 1.5f, 100, false},
                                        {{1, 300, 4, 2, 64, bf16}, 0.0f, 1.0f, 0, true}};
  for (const ScoreCase& sc : cases) {
    std::vector<int32_t> doc_start;
    if (sc.docs) {
      doc_start.resize(static_cast<size_t>(sc.c.batch * sc.c.seq));
      for (int64_t b = 0; b < sc.c.batch; ++b)
        for (int64_t t = 0; t < sc.c.seq; ++t)
          doc_start[static_cast<size_t>(b * sc.c.seq + t)] = static_cast<int32_t>(t / 37 * 37);
    }
    attention_against_host(sc.c, doc_start, rng, sc.window, sc.scale, sc.softcap);
  }
  // Decoding's shapes take them too.
  const AttentionCase c{1, 3, 4, 2, 64, f32, 50};
  const AttentionMask mask(nullptr, 0, 0.3f, 1.25f);
  const AttentionForward f = host_attention_forward(c, rng, mask);
  DeviceTensor q_dev = upload(f.q), k_dev = upload(f.k), v_dev = upload(f.v);
  DeviceTensor out_dev = empty(c.dtype, f.qs), lse_dev = empty(f32, f.ls);
  gpu().attention_forward(out_dev.view(), lse_dev.view(), q_dev.view(), k_dev.view(), v_dev.view(),
                          mask, stream());
  expect_close("out", out_dev.fetch("out"), f.out, tolerance(c.dtype, c.dtype));
  expect_close("lse", lse_dev.fetch("lse"), f.lse, tolerance(f32, c.dtype));
}

// Decoding: the last few queries against more keys (a KV cache), against the host backend. The
// tensor-core paths take whole sequences only, so every case must run the SIMT kernel, whichever
// path is asked for; blocks whose rows see different key counts and key tiles past a row's last
// key are both covered. Each case runs without a window and with one (Mistral's, decoded over a
// cache of every position) whose first key falls inside a key tile.
TEST_F(CudaOpsTest, AttentionForwardOfTheLastQueriesAgainstMoreKeys) {
  Rng rng(12);
  // batch, queries, heads, kv heads, head_dim, dtype, keys
  const std::vector<AttentionCase> cases = {
      {2, 1, 8, 2, 64, f32, 37},   {1, 1, 8, 2, 128, bf16, 300}, {1, 5, 4, 1, 16, bf16, 70},
      {2, 40, 4, 2, 32, f32, 100}, {1, 33, 2, 2, 40, bf16, 34},  {1, 1, 4, 4, 64, f32, 1},
      {1, 17, 4, 2, 256, f32, 129}};
  for (const AttentionCase& c : cases)
    for (const int64_t window : {int64_t{0}, std::max<int64_t>(1, c.keys() / 3 + 5)}) {
      SCOPED_TRACE(fmt::format(
          "{} batch {} seq {} kv_seq {} heads {} kv_heads {} head_dim {} window {}",
          dtype_name(c.dtype), c.batch, c.seq, c.keys(), c.heads, c.kv_heads, c.head_dim, window));
      const AttentionMask mask(nullptr, window);
      const AttentionForward f = host_attention_forward(c, rng, mask);
      DeviceTensor q_dev = upload(f.q), k_dev = upload(f.k), v_dev = upload(f.v);
      DeviceTensor out_dev = empty(c.dtype, f.qs), lse_dev = empty(f32, f.ls);
#if STRATA_HAVE_CUDA
      const uint64_t simt_calls = attention_calls(AttentionKernels::kSimt);
#endif
      gpu().attention_forward(out_dev.view(), lse_dev.view(), q_dev.view(), k_dev.view(),
                              v_dev.view(), mask, stream());
#if STRATA_HAVE_CUDA
      if (on_cuda() && c.seq != c.keys()) {
        EXPECT_EQ(attention_calls(AttentionKernels::kSimt), simt_calls + 1)
            << "decoding's shapes did not take the SIMT kernel";
      }
#endif
      expect_close("out", out_dev.fetch("out"), f.out, tolerance(c.dtype, c.dtype));
      expect_close("lse", lse_dev.fetch("lse"), f.lse, tolerance(f32, c.dtype));
    }
}

#if STRATA_HAVE_CUDA
// A failed CUDA call's message names the call, the GPU that was current (where there is one),
// the error and the line. Runs without a GPU too.
TEST(CudaCheck, NamesTheCallTheGpuTheErrorAndTheLine) {
  const int line = __LINE__ + 1;
  const std::string msg = test::error_message([] { CUDA_CHECK(cudaErrorInvalidValue); });
  EXPECT_NE(msg.find("cudaErrorInvalidValue failed"), std::string::npos) << msg;
  EXPECT_NE(msg.find("cudaErrorInvalidValue (invalid argument)"), std::string::npos) << msg;
  EXPECT_NE(msg.find(fmt::format("test_cuda_ops.cpp:{}", line)), std::string::npos) << msg;
  if (!cuda_runtime().gpus.empty()) {
    int current = -1;
    ASSERT_EQ(cudaGetDevice(&current), cudaSuccess);
    EXPECT_NE(msg.find(fmt::format("failed on cuda:{}:", current)), std::string::npos) << msg;
  }
}

// The backward's smaller query tiles (16 and 8 rows), which a GPU with less shared memory per
// block than the test's takes for large heads (99 KiB, as on an RTX 4090, at head_dim 256):
// forced by telling the launcher that only that tile's memory is available.
TEST_F(CudaOpsTest, AttentionBackwardWithSmallerQueryTiles) {
  if (!on_cuda()) GTEST_SKIP() << "the query tile is the CUDA backward's; nothing to force here";
  const AttentionPath simt(AttentionKernels::kSimt);  // the tiles are the SIMT backward's
  Rng rng(11);
  const std::vector<AttentionCase> cases = {{2, 129, 8, 2, 64, f32},
                                            {1, 65, 4, 2, 128, bf16},
                                            {1, 40, 2, 1, 256, f32},
                                            {1, 7, 2, 2, 96, f32}};
  // A tile the GPU cannot hold at all is left out (16 rows at head_dim 256 need 100.25 KiB).
  int optin = 0;
  ASSERT_EQ(
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device_->index()),
      cudaSuccess);
  for (const int64_t rows : {16, 8})
    for (const AttentionCase& c : cases) {
      if (attention_backward_shared_bytes(c.head_dim, rows) > static_cast<uint64_t>(optin))
        continue;
      SCOPED_TRACE(
          fmt::format("{}-row query tiles, {} batch {} seq {} heads {} kv_heads {} "
                      "head_dim {}",
                      rows, dtype_name(c.dtype), c.batch, c.seq, c.heads, c.kv_heads, c.head_dim));
      const Shape qs{c.batch, c.seq, c.heads, c.head_dim};
      const Shape ks{c.batch, c.seq, c.kv_heads, c.head_dim};
      const Shape ls{c.batch, c.heads, c.seq};
      HostTensor q = random_tensor(c.dtype, qs, rng, -3.0f, 3.0f);
      HostTensor k = random_tensor(c.dtype, ks, rng), v = random_tensor(c.dtype, ks, rng);
      HostTensor out(c.dtype, qs), lse(f32, ls), dout = random_tensor(c.dtype, qs, rng);
      host::attention_forward(out.view(), lse.view(), q.view(), k.view(), v.view());
      HostTensor dq(c.dtype, qs), dk(c.dtype, ks), dv(c.dtype, ks);
      host::attention_backward(dq.view(), dk.view(), dv.view(), dout.view(), q.view(), k.view(),
                               v.view(), out.view(), lse.view());
      DeviceTensor q_dev = upload(q), k_dev = upload(k), v_dev = upload(v);
      DeviceTensor out_dev = upload(out), lse_dev = upload(lse), dout_dev = upload(dout);
      DeviceTensor dq_dev = empty(c.dtype, qs), dk_dev = empty(c.dtype, ks),
                   dv_dev = empty(c.dtype, ks);
      AttentionDims dims;
      dims.batch = c.batch;
      dims.seq = c.seq;
      dims.heads = c.heads;
      dims.kv_heads = c.kv_heads;
      dims.head_dim = c.head_dim;
      launch_attention_backward(dq_dev.data(), dk_dev.data(), dv_dev.data(), dout_dev.data(),
                                q_dev.data(), k_dev.data(), v_dev.data(), out_dev.data(),
                                static_cast<const float*>(lse_dev.data()), c.dtype, dims,
                                attention_backward_shared_bytes(c.head_dim, rows),
                                cuda_stream_handle(*device_, stream()));
      sync();
      const double tol = tolerance(c.dtype, c.dtype);
      expect_close("dq", dq_dev.fetch("dq"), dq, tol);
      expect_close("dk", dk_dev.fetch("dk"), dk, tol);
      expect_close("dv", dv_dev.fetch("dv"), dv, tol);
    }
}
#endif

// ---- glu, add, fill ----

TEST_F(CudaOpsTest, GluForwardAndBackwardOfEachActivation) {
  Rng rng(8);
  const Shape shape{3, 1001};
  for (const Activation act : {Activation::silu, Activation::gelu, Activation::gelu_tanh})
    for (const MatmulTypes types : {MatmulTypes{f32, f32}, {bf16, bf16}, {bf16, f32}}) {
      const DType in_t = types.ab, out_t = types.c;  // gate, up, dh; h, dgate, dup
      SCOPED_TRACE(fmt::format("{}: in {} out {}", activation_name(act), dtype_name(in_t),
                               dtype_name(out_t)));
      HostTensor gate = random_tensor(in_t, shape, rng, -8.0f, 8.0f);
      HostTensor up = random_tensor(in_t, shape, rng, -2.0f, 2.0f);
      gate.set(0, kNaN);     // propagates
      gate.set(1, 100.0f);   // exp(-g) underflows to 0
      gate.set(2, -100.0f);  // exp(-g) overflows to inf: silu is -0 (and GELU's are)
      up.set(3, kNaN);
      HostTensor h(out_t, shape);
      DeviceTensor gate_dev = upload(gate), up_dev = upload(up), h_dev = empty(out_t, shape);
      gpu().glu_forward(h_dev.view(), gate_dev.view(), up_dev.view(), act, stream());
      host::glu_forward(h.view(), gate.view(), up.view(), act);
      expect_close("h", h_dev.fetch("h"), h, tolerance(out_t, in_t));

      HostTensor dh = random_tensor(in_t, shape, rng);
      HostTensor dgate(out_t, shape), dup(out_t, shape);
      DeviceTensor dh_dev = upload(dh), dgate_dev = empty(out_t, shape),
                   dup_dev = empty(out_t, shape);
      gpu().glu_backward(dgate_dev.view(), dup_dev.view(), dh_dev.view(), gate_dev.view(),
                         up_dev.view(), act, stream());
      host::glu_backward(dgate.view(), dup.view(), dh.view(), gate.view(), up.view(), act);
      expect_close("dgate", dgate_dev.fetch("dgate"), dgate, tolerance(out_t, in_t));
      expect_close("dup", dup_dev.fetch("dup"), dup, tolerance(out_t, in_t));
    }
}

TEST_F(CudaOpsTest, AddOutOfPlaceAndInPlace) {
  Rng rng(9);
  const Shape shape{5, 777};
  struct Types {
    DType out, a, b;
  };
  for (const Types t : {Types{f32, f32, f32}, {bf16, bf16, bf16}, {f32, f32, bf16}}) {
    SCOPED_TRACE(
        fmt::format("out {} a {} b {}", dtype_name(t.out), dtype_name(t.a), dtype_name(t.b)));
    HostTensor a = random_tensor(t.a, shape, rng), b = random_tensor(t.b, shape, rng);
    a.set(3, kInf);
    b.set(3, -kInf);  // NaN
    a.set(4, kNaN);
    a.set(5, kInf);  // inf
    HostTensor out(t.out, shape);
    DeviceTensor da = upload(a), db = upload(b), dout = empty(t.out, shape);
    gpu().add(dout.view(), da.view(), db.view(), stream());
    host::add(out.view(), a.view(), b.view());
    expect_close("out", dout.fetch("out"), out, tolerance(t.out, t.a));
    if (t.out == t.a) {  // the residual add: out is a
      gpu().add(da.view(), da.view(), db.view(), stream());
      host::add(a.view(), a.view(), b.view());
      expect_close("a += b", da.fetch("a"), a, tolerance(t.out, t.a));
    }
  }
}

TEST_F(CudaOpsTest, BiasBroadcastIntoAMatmulAndItsGradient) {
  Rng rng(31);
  // 1001 rows: not a multiple of the 8 row groups; 70 columns: past two blocks of 32.
  const int64_t N = 1001, K = 24, C = 70;
  for (const DType t : {f32, bf16}) {
    SCOPED_TRACE(dtype_name(t));
    HostTensor x = random_tensor(t, {N, K}, rng), w = random_tensor(t, {C, K}, rng);
    HostTensor b = random_tensor(t, {C}, rng);
    b.set(5, kNaN);  // a NaN bias reaches its column only
    HostTensor y(t, {N, C});
    DeviceTensor x_dev = upload(x), w_dev = upload(w), b_dev = upload(b), y_dev = empty(t, {N, C});
    gpu().broadcast_rows(y_dev.view(), b_dev.view(), stream());
    host::broadcast_rows(y.view(), b.view());
    const HostTensor rows = y_dev.fetch("y");
    ASSERT_EQ(rows.bytes, y.bytes) << "broadcast_rows copies bits";
    gpu().matmul(y_dev.view(), x_dev.view(), false, w_dev.view(), true, 1.0f, 1.0f, stream());
    host::matmul(y.view(), x.view(), false, w.view(), true, 1.0f, 1.0f);
    expect_close("x·Wᵀ + b", y_dev.fetch("y"), y, tolerance(t, t));

    for (const DType gt : {f32, t}) {
      SCOPED_TRACE(fmt::format("db {}", dtype_name(gt)));
      HostTensor dy = random_tensor(t, {N, C}, rng), db = random_tensor(gt, {C}, rng);
      dy.set(3 * C + 7, kInf);  // column 7's sum is inf
      DeviceTensor dy_dev = upload(dy), db_dev = upload(db);
      gpu().bias_backward(db_dev.view(), dy_dev.view(), stream());
      host::bias_backward(db.view(), dy.view());
      expect_close("db", db_dev.fetch("db"), db, tolerance(gt, t));
    }
  }
}

TEST_F(CudaOpsTest, FillWritesEveryElementAndNothingElse) {
  for (const DType t : {f32, bf16}) {
    for (const float value : {-kInf, 0.0f, 0.5f, 3.14159f}) {
      SCOPED_TRACE(fmt::format("{} {}", dtype_name(t), value));
      HostTensor x(t, {1000003});
      DeviceTensor dx = empty(t, {1000003});
      gpu().fill(dx.view(), value, stream());
      host::fill(x.view(), value);
      expect_close("x", dx.fetch("x"), x, 0.0);
    }
  }
}

// ---- cross-entropy ----

TEST_F(CudaOpsTest, CrossEntropyOverChunksWithIgnoredTargets) {
  Rng rng(10);
  const int64_t rows = 37, vocab = 1000, chunk = 300;  // chunks of 300, 300, 300 and 100
  std::vector<int32_t> targets(rows);
  int valid = 0;
  for (int64_t r = 0; r < rows; ++r) {
    targets[static_cast<size_t>(r)] =
        r % 5 == 2 ? kIgnoreIndex : rng.below(static_cast<int32_t>(vocab));
    valid += targets[static_cast<size_t>(r)] != kIgnoreIndex;
  }
  DeviceInts dtargets = ints(targets);
  const float scale = 1.0f / static_cast<float>(valid);

  // cap 3.5: Gemma 2's softcapped logits (softcap, and the backward through it).
  for (const float cap : {0.0f, 3.5f})
    for (const DType t : {f32, bf16}) {
      SCOPED_TRACE(fmt::format("{} softcap {}", dtype_name(t), cap));
      HostTensor logits = random_tensor(t, {rows, vocab}, rng, -6.0f, 6.0f);
      std::vector<HostTensor> chunks;
      std::vector<DeviceTensor> dchunks;
      for (int64_t v0 = 0; v0 < vocab; v0 += chunk) {
        const int64_t c = std::min(chunk, vocab - v0);
        HostTensor part(t, {rows, c});
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t j = 0; j < c; ++j) part.set(r * c + j, logits.at(r * vocab + v0 + j));
        dchunks.push_back(upload(part));
        if (cap > 0.0f) {
          gpu().softcap(dchunks.back().view(), cap, stream());
          host::softcap(part.view(), cap);
          expect_close("capped logits", dchunks.back().fetch("capped"), part, tolerance(t, t));
        }
        chunks.push_back(std::move(part));
      }

      HostTensor row_max(f32, {rows}), row_sum(f32, {rows}), target(f32, {rows});
      HostTensor losses(f32, {rows});
      DeviceTensor drow_max = empty(f32, {rows}), drow_sum = empty(f32, {rows});
      DeviceTensor dtarget = empty(f32, {rows}), dlosses = empty(f32, {rows});
      gpu().fill(drow_max.view(), -kInf, stream());
      gpu().fill(drow_sum.view(), 0.0f, stream());
      gpu().fill(dtarget.view(), 0.0f, stream());
      host::fill(row_max.view(), -kInf);
      host::fill(row_sum.view(), 0.0f);
      host::fill(target.view(), 0.0f);
      for (size_t i = 0; i < chunks.size(); ++i) {
        const int64_t v0 = static_cast<int64_t>(i) * chunk;
        gpu().xent_forward_chunk(dchunks[i].view(), v0, dtargets.data(), drow_max.view(),
                                 drow_sum.view(), dtarget.view(), stream());
        host::xent_forward_chunk(chunks[i].view(), v0, targets.data(), row_max.view(),
                                 row_sum.view(), target.view());
      }
      expect_close("target_logit", dtarget.fetch("target_logit"), target, 0.0);
      // lse aliases row_max, as in the model.
      gpu().xent_finish(dlosses.view(), drow_max.view(), drow_max.view(), drow_sum.view(),
                        dtarget.view(), dtargets.data(), stream());
      host::xent_finish(losses.view(), row_max.view(), row_max.view(), row_sum.view(),
                        target.view(), targets.data());
      expect_close("losses", dlosses.fetch("losses"), losses, 1e-5);
      expect_close("lse", drow_max.fetch("lse"), row_max, 1e-5);
      for (int64_t r = 0; r < rows; ++r) {
        if (targets[static_cast<size_t>(r)] == kIgnoreIndex) {
          EXPECT_EQ(losses.at(r), 0.0f) << r;
        }
      }

      for (size_t i = 0; i < chunks.size(); ++i) {
        const int64_t v0 = static_cast<int64_t>(i) * chunk;
        gpu().xent_backward_chunk(dchunks[i].view(), v0, dtargets.data(), drow_max.view(), scale,
                                  cap, stream());
        host::xent_backward_chunk(chunks[i].view(), v0, targets.data(), row_max.view(), scale, cap);
        expect_close(fmt::format("dlogits of chunk {}", i), dchunks[i].fetch("dlogits"), chunks[i],
                     tolerance(t, t));
      }
    }
}

// ---- the optimizer: CpuAdam's bits (host::adam_update runs its scalar path), no tolerance ----

// Values of either sign over eight decades, now and then an f32 (and bf16) subnormal: a
// flushed subnormal or a fused multiply-add changes some bits here.
float wide_value(Rng& rng) {
  const float sign = rng.uniform(-1.0f, 1.0f) < 0.0f ? -1.0f : 1.0f;
  if (rng.below(97) == 0) return sign * 3e-39f;
  return sign * std::pow(10.0f, rng.uniform(-5.0f, 3.0f));
}

HostTensor wide_tensor(DType t, int64_t n, Rng& rng) {
  HostTensor h(t, {n});
  for (int64_t i = 0; i < n; ++i) h.set(i, wide_value(rng));
  return h;
}

TEST_F(CudaOpsTest, AdamUpdateMatchesHostBitForBit) {
  Rng rng(12);
  const DType types[] = {f32, bf16, DType::f16};
  struct Case {
    DType grad;
    std::optional<DType> copy;
    bool adamw, bias_correction;
    int64_t n;
  };
  std::vector<Case> cases;
  for (const DType g : types)
    for (const std::optional<DType> copy : {std::optional<DType>{}, std::optional{f32},
                                            std::optional{bf16}, std::optional{DType::f16}})
      for (const bool adamw : {true, false})
        for (const bool bias : {true, false})
          for (const int64_t n : {0, 1, 7, 17, 1023, 65537 + 5})
            cases.push_back({g, copy, adamw, bias, n});
  cases.push_back({bf16, bf16, true, true, 5'000'011});  // past one grid-stride sweep

  for (const Case& c : cases) {
    SCOPED_TRACE(fmt::format("grad {} copy {} {} bias correction {} n {}", dtype_name(c.grad),
                             c.copy ? dtype_name(*c.copy) : "none", c.adamw ? "AdamW" : "Adam",
                             c.bias_correction, c.n));
    HostTensor master(f32, {c.n}), m(f32, {c.n}), v(f32, {c.n});
    for (int64_t i = 0; i < c.n; ++i) {
      master.set(i, rng.uniform(-1.0f, 1.0f));
      m.set(i, rng.uniform(-0.01f, 0.01f));
      const float u = rng.uniform(-0.01f, 0.01f);
      v.set(i, u * u);
    }
    DeviceTensor dmaster = upload(master), dm = upload(m), dv = upload(v);
    std::optional<HostTensor> copy;
    std::optional<DeviceTensor> dcopy;
    if (c.copy) {
      copy.emplace(*c.copy, Shape{c.n});
      dcopy.emplace(empty(*c.copy, {c.n}));
    }
    const AdamParams params{
        .lr = 3e-3f, .weight_decay = 0.1f, .adamw = c.adamw, .bias_correction = c.bias_correction};
    for (int64_t step = 1; step <= 3; ++step) {
      SCOPED_TRACE(fmt::format("step {}", step));
      HostTensor grad = wide_tensor(c.grad, c.n, rng);
      DeviceTensor dgrad = upload(grad);
      const cpu_adam::StepConstants k =
          cpu_adam::step_constants(step, params, 0.7f / static_cast<float>(1 << (4 * step)));
      gpu().adam_update(dmaster.view(), dm.view(), dv.view(), dgrad.view(),
                        dcopy ? dcopy->view() : TensorView{}, k, stream());
      host::adam_update(master.view(), m.view(), v.view(), grad.view(),
                        copy ? copy->view() : TensorView{}, k);
      expect_same_bits("master", dmaster.fetch("master"), master);
      expect_same_bits("m", dm.fetch("m"), m);
      expect_same_bits("v", dv.fetch("v"), v);
      if (copy) expect_same_bits("param_copy", dcopy->fetch("param_copy"), *copy);
      dgrad.fetch("grad");  // read only: its guards are intact
      if (HasFailure()) return;
    }
  }
}

// Lion and Adagrad on the GPU: the moment each keeps, the master and the copy, the other moment
// an empty view on both sides. Zero gradients over zero momentum (Lion's sign 0) included.
TEST_F(CudaOpsTest, LionAndAdagradUpdatesMatchHostBitForBit) {
  Rng rng(14);
  for (const OptimizerType type : {OptimizerType::lion, OptimizerType::adagrad})
    for (const DType g : {f32, bf16, DType::f16})
      for (const std::optional<DType> copy_t : {std::optional<DType>{}, std::optional{bf16}})
        for (const int64_t n : {0, 1, 17, 65537 + 5}) {
          SCOPED_TRACE(fmt::format("{} grad {} copy {} n {}", optimizer_type_name(type),
                                   dtype_name(g), copy_t ? dtype_name(*copy_t) : "none", n));
          const bool lion = type == OptimizerType::lion;
          HostTensor master(f32, {n}), moment(f32, {n});
          for (int64_t i = 0; i < n; ++i) {
            master.set(i, rng.uniform(-1.0f, 1.0f));
            const float u = rng.uniform(-0.01f, 0.01f);
            moment.set(i, i % 5 == 2 ? 0.0f : lion ? u : u * u);
          }
          DeviceTensor dmaster = upload(master), dmoment = upload(moment);
          std::optional<HostTensor> copy;
          std::optional<DeviceTensor> dcopy;
          if (copy_t) {
            copy.emplace(*copy_t, Shape{n});
            dcopy.emplace(empty(*copy_t, {n}));
          }
          const AdamParams params{
              .type = type, .lr = 3e-3f, .eps = 1e-10f, .weight_decay = 0.1f, .adamw = lion};
          for (int64_t step = 1; step <= 3; ++step) {
            SCOPED_TRACE(fmt::format("step {}", step));
            HostTensor grad = wide_tensor(g, n, rng);
            for (int64_t i = 2; i < n; i += 5) grad.set(i, 0.0f);
            DeviceTensor dgrad = upload(grad);
            const cpu_adam::StepConstants k =
                cpu_adam::step_constants(step, params, 0.7f / static_cast<float>(1 << (4 * step)));
            const TensorView dm = dmoment.view(), hm = moment.view();
            gpu().adam_update(dmaster.view(), lion ? dm : TensorView{}, lion ? TensorView{} : dm,
                              dgrad.view(), dcopy ? dcopy->view() : TensorView{}, k, stream());
            host::adam_update(master.view(), lion ? hm : TensorView{}, lion ? TensorView{} : hm,
                              grad.view(), copy ? copy->view() : TensorView{}, k);
            expect_same_bits("master", dmaster.fetch("master"), master);
            expect_same_bits("moment", dmoment.fetch("moment"), moment);
            if (copy) expect_same_bits("param_copy", dcopy->fetch("param_copy"), *copy);
            dgrad.fetch("grad");
            if (HasFailure()) return;
          }
        }
}

TEST_F(CudaOpsTest, GradChunkSumsMatchHostBitForBit) {
  Rng rng(13);
  const int64_t chunk = static_cast<int64_t>(CpuAdam::kStatsChunk);
  for (const DType t : {f32, bf16, DType::f16}) {
    for (const int64_t n : {int64_t{0}, int64_t{1}, int64_t{17}, chunk - 1, chunk, chunk + 1,
                            3 * chunk + 5, 40 * chunk + 3}) {
      for (const float special : {0.0f, kNaN, kInf, -kInf}) {
        if (special != 0.0f && n < 3) continue;
        SCOPED_TRACE(fmt::format("{} n {} special {}", dtype_name(t), n, special));
        HostTensor grad = wide_tensor(t, n, rng);
        if (special != 0.0f) grad.set(n / 2 + 1, special);
        const auto chunks = static_cast<int64_t>(
            cpu_adam::chunk_count(static_cast<size_t>(n), CpuAdam::kStatsChunk));
        // Doubles in an f32 tensor of twice the count: the guard bytes come with it.
        HostTensor sums(f32, {2 * chunks});
        DeviceTensor dgrad = upload(grad), dsums = empty(f32, {2 * chunks});
        gpu().grad_chunk_sums(dgrad.view(), static_cast<double*>(dsums.data()), stream());
        host::grad_chunk_sums(grad.view(), reinterpret_cast<double*>(sums.bytes.data()));
        const HostTensor got = dsums.fetch("chunk_sums");
        for (int64_t c = 0; c < chunks; ++c) {
          double g = 0.0, h = 0.0;
          std::memcpy(&g, got.bytes.data() + c * 8, 8);
          std::memcpy(&h, sums.bytes.data() + c * 8, 8);
          if (std::isnan(h)) {  // NaN's payload may differ; it must stay NaN
            EXPECT_TRUE(std::isnan(g)) << "chunk " << c << ": gpu " << g;
          } else {
            EXPECT_EQ(std::memcmp(&g, &h, 8), 0)
                << "chunk " << c << ": gpu " << g << ", host " << h;
          }
        }
        if (HasFailure()) return;
      }
    }
  }
  // chunk_sums must be device memory too.
  HostTensor grad = wide_tensor(f32, 5, rng);
  DeviceTensor dgrad = upload(grad);
  double host_sum = 0.0;
  test::expect_error([&] { gpu().grad_chunk_sums(dgrad.view(), &host_sum, stream()); },
                     {"grad_chunk_sums", "chunk_sums"});
}

// ---- what the CUDA table refuses ----

TEST_F(CudaOpsTest, F16IsRefusedWithAClearMessage) {
  if (!on_cuda()) GTEST_SKIP() << "the host backend accepts f16";
  DeviceTensor a = empty(DType::f16, {4, 4}), b = empty(DType::f16, {4, 4});
  DeviceTensor c = empty(DType::f16, {4, 4});
  const std::string msg = error_message(
      [&] { gpu().matmul(c.view(), a.view(), false, b.view(), false, 1.0f, 0.0f, stream()); });
  EXPECT_NE(msg.find("cuda:0"), std::string::npos) << msg;
  EXPECT_NE(msg.find("f16"), std::string::npos) << msg;
  EXPECT_NE(msg.find("f32 or bf16"), std::string::npos) << msg;
}

TEST_F(CudaOpsTest, PointersOutsideTheArenaAreRefused) {
  if (!on_cuda()) GTEST_SKIP() << "host devices run on host memory";
  std::vector<float> host_memory(64);
  const TensorView outside{host_memory.data(), f32, {8, 8}, device_.get()};
  DeviceTensor x = empty(f32, {8, 8});
  std::string msg = error_message([&] { gpu().add(x.view(), outside, x.view(), stream()); });
  EXPECT_NE(msg.find("not in this device's memory"), std::string::npos) << msg;
  DeviceTensor table = empty(f32, {10, 8});
  std::vector<int32_t> ids(8, 0);
  msg = error_message(
      [&] { gpu().embedding_forward(x.view(), table.view(), ids.data(), 1.0f, {}, stream()); });
  EXPECT_NE(msg.find("ids"), std::string::npos) << msg;
  EXPECT_NE(msg.find("not in this device's memory"), std::string::npos) << msg;
  x.fetch("x");  // nothing was queued: the guards are intact
}

// Both tables refuse a negative chunk start: on CUDA it would read the wrong column as the
// target's logit (the host refused it first).
TEST_F(CudaOpsTest, NegativeVocabularyChunkStartIsRefused) {
  DeviceTensor logits = empty(f32, {2, 3}), m = empty(f32, {2}), s = empty(f32, {2}),
               tl = empty(f32, {2}), lse = empty(f32, {2});
  DeviceInts targets = ints({1, 2});
  test::expect_error(
      [&] {
        gpu().xent_forward_chunk(logits.view(), -1, targets.data(), m.view(), s.view(), tl.view(),
                                 stream());
      },
      {"xent_forward_chunk", "v0 = -1"});
  test::expect_error(
      [&] {
        gpu().xent_backward_chunk(logits.view(), -2, targets.data(), lse.view(), 1.0f, 0.0f,
                                  stream());
      },
      {"xent_backward_chunk", "v0 = -2"});
}

// Rows of no columns: rstd is 1 / sqrt(eps) on both backends (mean(x^2) of nothing is 0),
// not 0 / 0.
TEST_F(CudaOpsTest, RmsNormOfEmptyRowsGivesFiniteStats) {
  const float eps = 1e-5f;
  DeviceTensor y = empty(f32, {3, 0}), x = empty(f32, {3, 0}), w = empty(f32, {0});
  DeviceTensor rstd = empty(f32, {3});
  gpu().rmsnorm_forward(y.view(), rstd.view(), x.view(), w.view(), eps, 0.0f, stream());
  const HostTensor got = rstd.fetch("rstd");
  for (int64_t r = 0; r < 3; ++r) EXPECT_FLOAT_EQ(got.at(r), 1.0f / std::sqrt(eps)) << r;
}

TEST_F(CudaOpsTest, ShapeMismatchesThrowBeforeAnythingIsQueued) {
  DeviceTensor a = empty(f32, {4, 5}), b = empty(f32, {6, 3}), c = empty(f32, {4, 3});
  test::expect_error(
      [&] { gpu().matmul(c.view(), a.view(), false, b.view(), false, 1.0f, 0.0f, stream()); },
      {"matmul", "[6, 3]"});
  HostTensor untouched = c.fetch("c");
  for (int64_t i = 0; i < untouched.numel(); ++i) EXPECT_TRUE(std::isnan(untouched.at(i))) << i;
}

}  // namespace
}  // namespace strata
