// test_host_ops.cpp: the host reference ops (host/ops.h) and the host kernel table.
//
// The reference ops are the oracle for the CUDA kernels, so they are checked against
// independent formulas: forwards against naive double-precision loops, backwards against
// central finite differences of a loss L = Σ R·out (R random), computed in double from the
// ops' own f32 forwards. Sizes are tiny and odd on purpose (T = 5 and 7, vocab chunks that do
// not divide the vocabulary), so the test is fast under ASan too.
#include "core/device.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/kernels.h"
#include "host/host_device.h"
#include "host/ops.h"

#include <gtest/gtest.h>
#include <tbb/global_control.h>
#include "testing.h"

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <numbers>
#include <random>
#include <string>
#include <tuple>
#include <vector>

namespace strata {
namespace {

using test::expect_error;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// A dense tensor in ordinary host memory.
struct Tensor {
  DType dtype = DType::f32;
  Shape shape;
  std::vector<float> storage;  // f32 words; 16-bit tensors use the first half of the bytes

  Tensor() = default;
  Tensor(DType t, Shape s, float value = kNaN) : dtype(t), shape(s) {
    storage.resize(static_cast<size_t>((shape.numel() * 4 + 3) / 4 + 1));
    for (int64_t i = 0; i < numel(); ++i) set(i, value);
  }
  int64_t numel() const { return shape.numel(); }
  TensorView view() { return TensorView{storage.data(), dtype, shape, nullptr}; }
  float at(int64_t i) const { return load_f32(storage.data(), dtype, static_cast<size_t>(i)); }
  void set(int64_t i, float v) { store_f32(storage.data(), dtype, static_cast<size_t>(i), v); }
  std::vector<float> values() const {
    std::vector<float> v(static_cast<size_t>(numel()));
    for (int64_t i = 0; i < numel(); ++i) v[static_cast<size_t>(i)] = at(i);
    return v;
  }
  uint64_t bytes() const { return static_cast<uint64_t>(numel()) * dtype_size(dtype); }
};

class Random {
 public:
  explicit Random(uint32_t seed) : gen_(seed) {}
  float uniform(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(gen_); }
  Tensor tensor(DType t, Shape s, float lo = -1.0f, float hi = 1.0f) {
    Tensor x(t, s);
    for (int64_t i = 0; i < x.numel(); ++i) x.set(i, uniform(lo, hi));
    return x;
  }
  std::vector<double> weights(int64_t n) {
    std::vector<double> w(static_cast<size_t>(n));
    for (double& v : w) v = uniform(-1.0f, 1.0f);
    return w;
  }

 private:
  std::mt19937 gen_;
};

// Σ R·out in double: the scalar whose gradient with respect to out is R.
double dot_loss(const Tensor& out, const std::vector<double>& r) {
  double l = 0.0;
  for (int64_t i = 0; i < out.numel(); ++i) l += r[static_cast<size_t>(i)] * out.at(i);
  return l;
}

Tensor from_weights(const std::vector<double>& r, Shape s, DType t = DType::f32) {
  Tensor x(t, s);
  for (int64_t i = 0; i < x.numel(); ++i) x.set(i, static_cast<float>(r[static_cast<size_t>(i)]));
  return x;
}

// Central differences of loss() with respect to every element of x (an f32 tensor), divided
// by the step actually taken after rounding to f32.
std::vector<double> numeric_grad(Tensor& x, const std::function<double()>& loss,
                                 double eps = 1e-2) {
  std::vector<double> g(static_cast<size_t>(x.numel()));
  for (int64_t i = 0; i < x.numel(); ++i) {
    const float orig = x.at(i);
    const auto hi = static_cast<float>(orig + eps), lo = static_cast<float>(orig - eps);
    x.set(i, hi);
    const double lhi = loss();
    x.set(i, lo);
    const double llo = loss();
    x.set(i, orig);
    g[static_cast<size_t>(i)] = (lhi - llo) / (static_cast<double>(hi) - lo);
  }
  return g;
}

// Every element within 2e-3 of the largest gradient plus 1% of its own size; a sign error
// or a missing term is off by a sizeable fraction of the gradient and fails.
void expect_grad(const std::vector<double>& analytic, const std::vector<double>& numeric,
                 const std::string& what) {
  ASSERT_EQ(analytic.size(), numeric.size()) << what;
  double scale = 0.0;
  for (double v : numeric) scale = std::max(scale, std::abs(v));
  ASSERT_GT(scale, 1e-2) << what << ": the gradient is (nearly) zero, the check would be vacuous";
  int shown = 0;
  for (size_t i = 0; i < numeric.size(); ++i) {
    const double tol = 2e-3 * scale + 1e-2 * std::abs(numeric[i]);
    if (!(std::abs(analytic[i] - numeric[i]) <= tol) && shown++ < 5)
      ADD_FAILURE() << what << "[" << i << "]: analytic " << analytic[i] << ", finite difference "
                    << numeric[i] << " (tolerance " << tol << ")";
  }
}

// The change of a "+=" output: what it holds minus what it held before.
std::vector<double> delta(const Tensor& after, const Tensor& before) {
  std::vector<double> d(static_cast<size_t>(after.numel()));
  for (int64_t i = 0; i < after.numel(); ++i)
    d[static_cast<size_t>(i)] = static_cast<double>(after.at(i)) - before.at(i);
  return d;
}
std::vector<double> as_double(const Tensor& t) {
  return delta(t, Tensor(t.dtype, t.shape, 0.0f));
}

// Relative precision of a dtype's stores (half an ulp at 1).
double unit_roundoff(DType t) {
  return t == DType::bf16 ? 1.0 / 256 : t == DType::f16 ? 1.0 / 2048 : 1.0 / (1 << 24);
}

void expect_close(const Tensor& got, const std::vector<double>& want, double abs_tol,
                  const std::string& what) {
  ASSERT_EQ(static_cast<size_t>(got.numel()), want.size()) << what;
  const double rel = 2 * unit_roundoff(got.dtype);
  int shown = 0;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double w = want[static_cast<size_t>(i)];
    const double tol = abs_tol + rel * std::abs(w);
    if (!(std::abs(got.at(i) - w) <= tol) && shown++ < 5)
      ADD_FAILURE() << what << "[" << i << "]: got " << got.at(i) << ", want " << w
                    << " (tolerance " << tol << ")";
  }
}

// ---------------------------------------------------------------------------------------
// matmul

// c = alpha op(a) op(b) + beta c0 in double, from the stored operand values.
std::vector<double> naive_matmul(const Tensor& a, bool ta, const Tensor& b, bool tb,
                                 const Tensor& c0, float alpha, float beta, int64_t m, int64_t n,
                                 int64_t k) {
  std::vector<double> c(static_cast<size_t>(m * n));
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double s = 0.0;
      for (int64_t p = 0; p < k; ++p)
        s += static_cast<double>(a.at(ta ? p * m + i : i * k + p)) *
             b.at(tb ? j * k + p : p * n + j);
      c[static_cast<size_t>(i * n + j)] =
          alpha * s + (beta == 0.0f ? 0.0 : beta * static_cast<double>(c0.at(i * n + j)));
    }
  return c;
}

TEST(HostOps, MatmulMatchesNaiveForEveryTransposeAndDtype) {
  Random rng(1);
  const int64_t m = 3, n = 5, k = 4;
  struct Types {
    DType ab, c;
  };
  for (const Types t : {Types{DType::f32, DType::f32}, Types{DType::bf16, DType::f32},
                        Types{DType::bf16, DType::bf16}, Types{DType::f16, DType::f16}})
    for (bool ta : {false, true})
      for (bool tb : {false, true})
        for (float beta : {0.0f, 1.0f, -0.5f}) {
          const std::string what = std::string(dtype_name(t.ab)) + "->" +
                                   std::string(dtype_name(t.c)) + (ta ? " aT" : " a") +
                                   (tb ? " bT" : " b") + " beta " + std::to_string(beta);
          Tensor a = rng.tensor(t.ab, ta ? Shape{k, m} : Shape{m, k});
          Tensor b = rng.tensor(t.ab, tb ? Shape{n, k} : Shape{k, n});
          // beta == 0 must ignore c's NaN garbage; otherwise c accumulates.
          Tensor c = beta == 0.0f ? Tensor(t.c, {m, n}, kNaN) : rng.tensor(t.c, {m, n});
          const std::vector<double> want = naive_matmul(a, ta, b, tb, c, 0.75f, beta, m, n, k);
          host::matmul(c.view(), a.view(), ta, b.view(), tb, 0.75f, beta);
          expect_close(c, want, 1e-5, what);
        }
  // k == 0: the product is empty, c = beta c (and 0 over NaN when beta == 0).
  Tensor a(DType::f32, {m, 0}), b(DType::f32, {0, n});
  Tensor c = rng.tensor(DType::f32, {m, n});
  const Tensor c0 = c;
  host::matmul(c.view(), a.view(), false, b.view(), false, 1.0f, 2.0f);
  for (int64_t i = 0; i < c.numel(); ++i) EXPECT_EQ(c.at(i), 2.0f * c0.at(i));
  Tensor z(DType::bf16, {m, n}, kNaN);
  host::matmul(z.view(), Tensor(DType::bf16, {m, 0}).view(), false,
               Tensor(DType::bf16, {0, n}).view(), false, 1.0f, 0.0f);
  for (int64_t i = 0; i < z.numel(); ++i) EXPECT_EQ(z.at(i), 0.0f);
}

// Big enough that matmul splits C's columns into several sgemm calls (about 4 MFLOP each),
// with a last block narrower than the others, for every transpose.
TEST(HostOps, MatmulSplitIntoColumnBlocksMatchesNaive) {
  Random rng(16);
  const int64_t m = 40, n = 1000, k = 70;  // 2 m k = 5600 flops a column: blocks of 768
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      const std::string what = std::string(ta ? "aT" : "a") + (tb ? " bT" : " b");
      Tensor a = rng.tensor(DType::f32, ta ? Shape{k, m} : Shape{m, k});
      Tensor b = rng.tensor(DType::f32, tb ? Shape{n, k} : Shape{k, n});
      Tensor c = rng.tensor(DType::f32, {m, n});
      const std::vector<double> want = naive_matmul(a, ta, b, tb, c, 1.5f, 0.5f, m, n, k);
      host::matmul(c.view(), a.view(), ta, b.view(), tb, 1.5f, 0.5f);
      expect_close(c, want, 1e-5, what);
    }
}

// dA and dB of L = Σ R·(op(a) op(b)) through matmul itself, as the model's backward does.
TEST(HostOps, MatmulGradientsMatchFiniteDifferences) {
  Random rng(2);
  const int64_t m = 3, n = 4, k = 5;
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      const std::string what = std::string(ta ? "aT" : "a") + (tb ? " bT" : " b");
      Tensor a = rng.tensor(DType::f32, ta ? Shape{k, m} : Shape{m, k});
      Tensor b = rng.tensor(DType::f32, tb ? Shape{n, k} : Shape{k, n});
      const std::vector<double> r = rng.weights(m * n);
      Tensor rt = from_weights(r, {m, n});
      auto loss = [&] {
        Tensor c(DType::f32, {m, n});
        host::matmul(c.view(), a.view(), ta, b.view(), tb, 1.0f, 0.0f);
        return dot_loss(c, r);
      };
      // dop(a) = R op(b)ᵀ and dop(b) = op(a)ᵀ R, transposed back when a or b was read so.
      Tensor da(DType::f32, a.shape, kNaN);
      if (!ta)
        host::matmul(da.view(), rt.view(), false, b.view(), !tb, 1.0f, 0.0f);
      else
        host::matmul(da.view(), b.view(), tb, rt.view(), true, 1.0f, 0.0f);
      // dB accumulates (beta 1), as a weight gradient does.
      Tensor db0 = rng.tensor(DType::f32, b.shape);
      Tensor db = db0;
      if (!tb)
        host::matmul(db.view(), a.view(), !ta, rt.view(), false, 1.0f, 1.0f);
      else
        host::matmul(db.view(), rt.view(), true, a.view(), ta, 1.0f, 1.0f);
      expect_grad(as_double(da), numeric_grad(a, loss), "matmul da " + what);
      expect_grad(delta(db, db0), numeric_grad(b, loss), "matmul db " + what);
    }
}

// ---------------------------------------------------------------------------------------
// embedding

TEST(HostOps, EmbeddingGathersRowsAndScatterAddsGradients) {
  Random rng(3);
  const int64_t V = 6, D = 5, N = 5;
  const std::vector<int32_t> ids = {0, 3, 5, 3, 1};  // id 3 twice: its gradient rows add
  for (DType t : {DType::f32, DType::bf16}) {
    Tensor table = rng.tensor(t, {V, D});
    Tensor out(DType::f32, {N, D}, kNaN);
    host::embedding_forward(out.view(), table.view(), ids.data());
    for (int64_t r = 0; r < N; ++r)
      for (int64_t j = 0; j < D; ++j)
        EXPECT_EQ(out.at(r * D + j), table.at(ids[static_cast<size_t>(r)] * D + j));
  }
  Tensor table = rng.tensor(DType::f32, {V, D});
  const std::vector<double> r = rng.weights(N * D);
  // Scaled as Gemma scales its rows (by sqrt(hidden_size)), and not.
  for (const float scale : {1.0f, 2.5f}) {
    auto loss = [&] {
      Tensor out(DType::f32, {N, D});
      host::embedding_forward(out.view(), table.view(), ids.data(), scale);
      return dot_loss(out, r);
    };
    Tensor dtable0 = rng.tensor(DType::f32, {V, D});
    Tensor dtable = dtable0;
    host::embedding_backward(dtable.view(), from_weights(r, {N, D}).view(), ids.data(), scale);
    expect_grad(delta(dtable, dtable0), numeric_grad(table, loss),
                fmt::format("embedding dtable, scale {}", scale));
  }
  Tensor dtable0 = rng.tensor(DType::f32, {V, D});
  Tensor dtable = dtable0;
  host::embedding_backward(dtable.view(), from_weights(r, {N, D}).view(), ids.data());
  // Rows no id names keep their contents exactly.
  for (int64_t j = 0; j < D; ++j) {
    EXPECT_EQ(dtable.at(2 * D + j), dtable0.at(2 * D + j));
    EXPECT_EQ(dtable.at(4 * D + j), dtable0.at(4 * D + j));
  }
  // A bf16 gradient table accumulates too, rounding after each add.
  Tensor g16(DType::bf16, {V, D}, 1.0f);
  Tensor dout16(DType::bf16, {N, D}, 0.5f);
  host::embedding_backward(g16.view(), dout16.view(), ids.data());
  EXPECT_EQ(g16.at(3 * D), 2.0f);
  EXPECT_EQ(g16.at(0), 1.5f);
  EXPECT_EQ(g16.at(2 * D), 1.0f);
  // Scaled, each product is rounded to dout's dtype before it adds, as torch's backward of the
  // multiplication rounds it: 0.5 x 1.3 is 0.6484375 in bf16, not f32's 0.65.
  Tensor g32(DType::f32, {V, D}, 0.0f);
  host::embedding_backward(g32.view(), dout16.view(), ids.data(), 1.3f);
  EXPECT_EQ(g32.at(0), 0.6484375f);
  EXPECT_EQ(g32.at(3 * D), 2 * 0.6484375f);
  // The forward's product is rounded once, to out's dtype.
  Tensor row16(DType::bf16, {N, D});
  host::embedding_forward(row16.view(), g16.view(), ids.data(), 1.3f);
  EXPECT_EQ(row16.at(0), bf16_to_f32(f32_to_bf16(1.5f * 1.3f)));

  const std::vector<int32_t> bad = {0, 1, 6, 2, 0};
  Tensor out(DType::f32, {N, D});
  expect_error([&] { host::embedding_forward(out.view(), table.view(), bad.data()); },
               {"embedding_forward", "ids[2] = 6", "6 rows"});
  expect_error([&] { host::embedding_backward(table.view(), out.view(), bad.data()); },
               {"embedding_backward", "ids[2] = 6"});
}

// A table cut into vocabulary pieces (rows [0, 2), [2, 5), [5, 6)) computes the whole table's
// rows and gradients exactly: each token's row comes from the one piece that holds its id.
TEST(HostOps, EmbeddingPiecesComputeTheWholeTablesBits) {
  Random rng(5);
  const int64_t V = 6, D = 5, N = 6;
  const std::vector<int32_t> ids = {0, 3, 5, 3, 1, 4};
  const int64_t bounds[] = {0, 2, 5, V};
  auto rows = [&](const Tensor& t, int p) {
    const int64_t first = bounds[p], n = bounds[p + 1] - first;
    Tensor part(t.dtype, {n, D});
    for (int64_t i = 0; i < n * D; ++i) part.set(i, t.at(first * D + i));
    return part;
  };
  const float scale = 1.7f;
  Tensor table = rng.tensor(DType::bf16, {V, D});
  Tensor whole(DType::bf16, {N, D}), pieced(DType::bf16, {N, D}, kNaN);
  host::embedding_forward(whole.view(), table.view(), ids.data(), scale);
  for (int p = 0; p < 3; ++p) {
    Tensor part = rows(table, p);
    host::embedding_forward(pieced.view(), part.view(), ids.data(), scale,
                            TableRows{bounds[p], V, p == 0});
  }
  for (int64_t i = 0; i < N * D; ++i) EXPECT_EQ(pieced.at(i), whole.at(i)) << i;
  // Only the first piece zeroes the rows it does not hold; the others leave them.
  Tensor last = rows(table, 2);
  Tensor alone(DType::bf16, {N, D}, 3.0f);
  host::embedding_forward(alone.view(), last.view(), ids.data(), scale, TableRows{5, V, false});
  EXPECT_EQ(alone.at(0), 3.0f);
  EXPECT_EQ(alone.at(2 * D), whole.at(2 * D));  // id 5
  host::embedding_forward(alone.view(), last.view(), ids.data(), scale, TableRows{5, V, true});
  EXPECT_EQ(alone.at(0), 0.0f);

  const Tensor dout = rng.tensor(DType::bf16, {N, D});
  Tensor dtable = rng.tensor(DType::f32, {V, D});
  std::vector<Tensor> parts;
  for (int p = 0; p < 3; ++p) parts.push_back(rows(dtable, p));
  Tensor d = dout;
  host::embedding_backward(dtable.view(), d.view(), ids.data(), scale);
  for (int p = 0; p < 3; ++p) {
    host::embedding_backward(parts[static_cast<size_t>(p)].view(), d.view(), ids.data(), scale,
                             TableRows{bounds[p], V, true});
    const Tensor want = rows(dtable, p);
    for (int64_t i = 0; i < want.numel(); ++i)
      EXPECT_EQ(parts[static_cast<size_t>(p)].at(i), want.at(i)) << "piece " << p << " " << i;
  }

  // Ids are checked against the whole vocabulary, and a piece must lie inside it.
  const std::vector<int32_t> bad = {0, 1, 6, 2, 0, 1};
  Tensor part = rows(table, 1);
  expect_error(
      [&] {
        host::embedding_forward(whole.view(), part.view(), bad.data(), 1.0f, TableRows{2, V, true});
      },
      {"embedding_forward", "ids[2] = 6", "[0, 6)"});
  expect_error(
      [&] {
        host::embedding_forward(whole.view(), part.view(), ids.data(), 1.0f, TableRows{4, V, true});
      },
      {"embedding_forward", "holds ids [4, 7)", "vocabulary of 6"});
}

// ---------------------------------------------------------------------------------------
// rmsnorm

TEST(HostOps, RmsnormForwardMatchesTheFormula) {
  Random rng(4);
  const int64_t N = 3, D = 7;
  const float eps = 0.05f;  // large enough that leaving it out fails
  // weight_offset 1: Gemma's norms, which multiply by 1 + w.
  for (const float offset : {0.0f, 1.0f})
    for (DType t : {DType::f32, DType::bf16, DType::f16}) {
      Tensor x = rng.tensor(t, {N, D}, -2.0f, 2.0f), w = rng.tensor(t, {D}, -0.5f, 1.5f);
      Tensor y(t, {N, D}, kNaN), rstd(DType::f32, {N}, kNaN);
      host::rmsnorm_forward(y.view(), rstd.view(), x.view(), w.view(), eps, offset);
      std::vector<double> want_y(static_cast<size_t>(N * D)), want_r(static_cast<size_t>(N));
      for (int64_t r = 0; r < N; ++r) {
        double ss = 0.0;
        for (int64_t j = 0; j < D; ++j)
          ss += static_cast<double>(x.at(r * D + j)) * x.at(r * D + j);
        const double rs = 1.0 / std::sqrt(ss / D + eps);
        want_r[static_cast<size_t>(r)] = rs;
        for (int64_t j = 0; j < D; ++j)
          want_y[static_cast<size_t>(r * D + j)] = x.at(r * D + j) * rs * (w.at(j) + offset);
      }
      const std::string what = fmt::format("{} offset {}", dtype_name(t), offset);
      expect_close(rstd, want_r, 1e-6, "rmsnorm rstd " + what);
      expect_close(y, want_y, 1e-5, "rmsnorm y " + what);
    }
}

TEST(HostOps, RmsnormGradientsMatchFiniteDifferencesAndAccumulate) {
  Random rng(5);
  const int64_t N = 3, D = 8;
  const float eps = 1e-5f;
  for (const float offset : {0.0f, 1.0f}) {
    Tensor x = rng.tensor(DType::f32, {N, D}, -2.0f, 2.0f);
    Tensor w = rng.tensor(DType::f32, {D}, 0.5f - offset, 1.5f - offset);
    const std::vector<double> r = rng.weights(N * D);
    Tensor y(DType::f32, {N, D}), rstd(DType::f32, {N});
    auto loss = [&] {
      host::rmsnorm_forward(y.view(), rstd.view(), x.view(), w.view(), eps, offset);
      return dot_loss(y, r);
    };
    loss();
    Tensor dx0 = rng.tensor(DType::f32, {N, D}), dw0 = rng.tensor(DType::f32, {D});
    Tensor dx = dx0, dw = dw0;
    host::rmsnorm_backward(dx.view(), dw.view(), from_weights(r, {N, D}).view(), x.view(), w.view(),
                           rstd.view(), offset);
    expect_grad(delta(dx, dx0), numeric_grad(x, loss),
                fmt::format("rmsnorm dx, offset {}", offset));
    expect_grad(delta(dw, dw0), numeric_grad(w, loss),
                fmt::format("rmsnorm dw, offset {}", offset));
  }
}

// ---------------------------------------------------------------------------------------
// rope

// cos_sin of Llama's angles: position p, pair i turns by p · 10000^(-2i/head_dim).
double rope_angle(int64_t pos, int64_t i, int64_t head_dim) {
  return static_cast<double>(pos) * std::pow(10000.0, -2.0 * static_cast<double>(i) / head_dim);
}
Tensor rope_table(int64_t seq_len, int64_t head_dim) {
  Tensor cs(DType::f32, {seq_len, head_dim});
  for (int64_t p = 0; p < seq_len; ++p)
    for (int64_t i = 0; i < head_dim / 2; ++i) {
      cs.set(p * head_dim + i, static_cast<float>(std::cos(rope_angle(p, i, head_dim))));
      cs.set(p * head_dim + head_dim / 2 + i,
             static_cast<float>(std::sin(rope_angle(p, i, head_dim))));
    }
  return cs;
}

TEST(HostOps, RopeRotatesHalvesByThePositionsAngles) {
  Random rng(6);
  const int64_t seq = 3, N = 6, heads = 2, hd = 8, h = hd / 2;  // two sequences of 3
  const Tensor cs = rope_table(seq, hd);
  for (DType t : {DType::f32, DType::bf16}) {
    Tensor x = rng.tensor(t, {N, heads, hd});
    const Tensor x0 = x;
    host::rope(x.view(), Tensor(cs).view(), seq, false);
    std::vector<double> want(static_cast<size_t>(x.numel()));
    for (int64_t n = 0; n < N; ++n)
      for (int64_t hh = 0; hh < heads; ++hh)
        for (int64_t i = 0; i < h; ++i) {
          // (x_i + i x_{i+h}) e^{iθ}: the rotate-half pair as a complex number.
          const double th = rope_angle(n % seq, i, hd);
          const int64_t base = (n * heads + hh) * hd;
          const double re = x0.at(base + i), im = x0.at(base + h + i);
          want[static_cast<size_t>(base + i)] = re * std::cos(th) - im * std::sin(th);
          want[static_cast<size_t>(base + h + i)] = im * std::cos(th) + re * std::sin(th);
        }
    expect_close(x, want, 1e-6, "rope " + std::string(dtype_name(t)));
    host::rope(x.view(), Tensor(cs).view(), seq, true);  // the inverse undoes it
    // Two roundings to t of values up to sqrt(2) in size: a few units of t's precision.
    expect_close(x, as_double(x0), 1e-6 + 4 * unit_roundoff(t),
                 "rope inverse " + std::string(dtype_name(t)));
  }
  // A quarter turn: x' = (-x[i+h], x[i]) exactly.
  Tensor quarter(DType::f32, {1, hd}, 0.0f);
  for (int64_t i = 0; i < h; ++i) quarter.set(h + i, 1.0f);  // cos 0, sin 1
  Tensor v(DType::f32, {1, 1, hd});
  for (int64_t i = 0; i < hd; ++i) v.set(i, static_cast<float>(i + 1));
  host::rope(v.view(), quarter.view(), 1, false);
  for (int64_t i = 0; i < h; ++i) {
    EXPECT_EQ(v.at(i), -static_cast<float>(h + i + 1));
    EXPECT_EQ(v.at(h + i), static_cast<float>(i + 1));
  }
}

// A partial rotation (Phi-4-mini's partial_rotary_factor): a table of R < head_dim columns turns
// the pairs (i, i + R/2) of the first R dimensions and leaves the rest bit for bit; tables wider
// than the head or of odd width are refused.
TEST(HostOps, RopeOfPartOfEachHead) {
  Random rng(16);
  const int64_t seq = 4, N = 8, heads = 3, hd = 10, R = 6, h = R / 2;
  const Tensor cs = rope_table(seq, R);
  Tensor x = rng.tensor(DType::f32, {N, heads, hd});
  const Tensor x0 = x;
  host::rope(x.view(), Tensor(cs).view(), seq, false);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t hh = 0; hh < heads; ++hh) {
      const int64_t base = (n * heads + hh) * hd;
      for (int64_t i = 0; i < h; ++i) {
        const double th = rope_angle(n % seq, i, R);
        const double re = x0.at(base + i), im = x0.at(base + h + i);
        EXPECT_NEAR(x.at(base + i), re * std::cos(th) - im * std::sin(th), 1e-6);
        EXPECT_NEAR(x.at(base + h + i), im * std::cos(th) + re * std::sin(th), 1e-6);
      }
      for (int64_t i = R; i < hd; ++i) EXPECT_EQ(x.at(base + i), x0.at(base + i)) << i;
    }
  const std::vector<double> r = rng.weights(x.numel());
  Tensor y = x0;
  auto loss = [&] {
    Tensor z = y;
    host::rope(z.view(), Tensor(cs).view(), seq, false);
    return dot_loss(z, r);
  };
  Tensor dx = from_weights(r, x.shape);
  host::rope(dx.view(), Tensor(cs).view(), seq, true);
  expect_grad(as_double(dx), numeric_grad(y, loss), "partial rope dx");
  Tensor wide = rope_table(seq, 12), odd(DType::f32, {seq, 5});
  expect_error([&] { host::rope(x.view(), wide.view(), seq, false); },
               {"rope", "at most head_dim 10"});
  expect_error([&] { host::rope(x.view(), odd.view(), seq, false); }, {"rope", "even"});
}

TEST(HostOps, RopeInverseIsTheGradient) {
  Random rng(7);
  const int64_t seq = 5, N = 10, heads = 3, hd = 4;
  Tensor cs = rope_table(seq, hd);
  Tensor x = rng.tensor(DType::f32, {N, heads, hd});
  const std::vector<double> r = rng.weights(x.numel());
  auto loss = [&] {
    Tensor y = x;
    host::rope(y.view(), cs.view(), seq, false);
    return dot_loss(y, r);
  };
  Tensor dx = from_weights(r, x.shape);
  host::rope(dx.view(), cs.view(), seq, true);
  expect_grad(as_double(dx), numeric_grad(x, loss), "rope dx");
}

// ---------------------------------------------------------------------------------------
// attention

struct AttnShape {
  int64_t B, T, H, Hkv, hd;
};

std::string str(const AttnShape& s) {
  return fmt::format("B{} T{} H{} Hkv{} hd{}", s.B, s.T, s.H, s.Hkv, s.hd);
}

// Softmax over all T keys with the causal mask as -inf scores, in double; scale 0 is
// 1/sqrt(hd), and softcap > 0 caps each score s at softcap · tanh(s / softcap) (Gemma 2's).
void naive_attention(const AttnShape& s, const Tensor& q, const Tensor& k, const Tensor& v,
                     std::vector<double>& out, std::vector<double>& lse, double scale_ = 0,
                     double softcap = 0) {
  out.assign(static_cast<size_t>(s.B * s.T * s.H * s.hd), 0.0);
  lse.assign(static_cast<size_t>(s.B * s.H * s.T), 0.0);
  const double scale = scale_ > 0 ? scale_ : 1.0 / std::sqrt(static_cast<double>(s.hd));
  std::vector<double> sc(static_cast<size_t>(s.T));
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t h = 0; h < s.H; ++h) {
      const int64_t g = h / (s.H / s.Hkv);
      for (int64_t t = 0; t < s.T; ++t) {
        double m = -INFINITY;
        for (int64_t j = 0; j < s.T; ++j) {
          double dot = 0.0;
          for (int64_t e = 0; e < s.hd; ++e)
            dot += static_cast<double>(q.at(((b * s.T + t) * s.H + h) * s.hd + e)) *
                   k.at(((b * s.T + j) * s.Hkv + g) * s.hd + e);
          const double scaled =
              softcap > 0 ? softcap * std::tanh(dot * scale / softcap) : dot * scale;
          sc[static_cast<size_t>(j)] = j <= t ? scaled : -INFINITY;
          m = std::max(m, sc[static_cast<size_t>(j)]);
        }
        double sum = 0.0;
        for (int64_t j = 0; j < s.T; ++j) sum += std::exp(sc[static_cast<size_t>(j)] - m);
        lse[static_cast<size_t>((b * s.H + h) * s.T + t)] = m + std::log(sum);
        for (int64_t j = 0; j < s.T; ++j) {
          const double p = std::exp(sc[static_cast<size_t>(j)] - m) / sum;
          for (int64_t e = 0; e < s.hd; ++e)
            out[static_cast<size_t>(((b * s.T + t) * s.H + h) * s.hd + e)] +=
                p * v.at(((b * s.T + j) * s.Hkv + g) * s.hd + e);
        }
      }
    }
}

TEST(HostOps, AttentionMatchesNaiveCausalSoftmax) {
  Random rng(8);
  for (const AttnShape s :
       {AttnShape{2, 5, 4, 2, 8}, AttnShape{1, 7, 2, 2, 6}, AttnShape{2, 7, 4, 1, 4}})
    for (DType t : {DType::f32, DType::bf16}) {
      const std::string what = str(s) + " " + std::string(dtype_name(t));
      Tensor q = rng.tensor(t, {s.B, s.T, s.H, s.hd}, -2.0f, 2.0f);
      Tensor k = rng.tensor(t, {s.B, s.T, s.Hkv, s.hd}, -2.0f, 2.0f);
      Tensor v = rng.tensor(t, {s.B, s.T, s.Hkv, s.hd});
      Tensor out(t, q.shape, kNaN), lse(DType::f32, {s.B, s.H, s.T}, kNaN);
      host::attention_forward(out.view(), lse.view(), q.view(), k.view(), v.view());
      std::vector<double> want_out, want_lse;
      naive_attention(s, q, k, v, want_out, want_lse);
      expect_close(out, want_out, 1e-5, "attention out " + what);
      expect_close(lse, want_lse, 1e-5, "attention lse " + what);
      // Gemma 2's scores: another scale, a cap, both.
      for (const auto& [scale, cap] : {std::pair{0.3f, 0.0f}, {0.0f, 0.8f}, {0.5f, 1.5f}}) {
        host::attention_forward(out.view(), lse.view(), q.view(), k.view(), v.view(),
                                AttentionMask(nullptr, 0, scale, cap));
        naive_attention(s, q, k, v, want_out, want_lse, scale, cap);
        const std::string how = fmt::format("{} scale {} softcap {}", what, scale, cap);
        expect_close(out, want_out, 1e-5, "attention out " + how);
        expect_close(lse, want_lse, 1e-5, "attention lse " + how);
      }
    }
  // A negative or non-finite scale or cap is refused, naming it.
  Tensor q(DType::f32, {1, 2, 1, 4}), out(DType::f32, {1, 2, 1, 4}), lse(DType::f32, {1, 1, 2});
  expect_error(
      [&] {
        host::attention_forward(out.view(), lse.view(), q.view(), q.view(), q.view(),
                                AttentionMask(nullptr, 0, 0.0f, -1.0f));
      },
      {"attention_forward", "softcap is -1"});
  expect_error(
      [&] {
        host::attention_forward(out.view(), lse.view(), q.view(), q.view(), q.view(),
                                AttentionMask(nullptr, 0, INFINITY, 0.0f));
      },
      {"attention_forward", "scale is inf"});
}

// Decoding: the last Tq queries against all Tk keys give the whole sequence's last Tq rows bit
// for bit (out and lse), which is what lets a KV cache reproduce a full forward.
TEST(HostOps, AttentionOfTheLastQueriesEqualsTheWholeSequencesRows) {
  Random rng(12);
  struct Case {
    AttnShape s;
    int64_t tq;
  };
  // Window 0: none; 3: a sliding window that decoding's queries outrun (Mistral's, decoded
  // against a cache of every position).
  for (const Case c :
       {Case{{2, 9, 4, 2, 8}, 1}, Case{{1, 7, 2, 2, 6}, 3}, Case{{2, 5, 4, 1, 4}, 5}})
    for (DType t : {DType::f32, DType::bf16})
      for (const int64_t window : {0, 3}) {
        const AttnShape& s = c.s;
        const std::string what =
            fmt::format("{} last {} queries {} window {}", str(s), c.tq, dtype_name(t), window);
        const AttentionMask mask(nullptr, window);
        Tensor q = rng.tensor(t, {s.B, s.T, s.H, s.hd}, -2.0f, 2.0f);
        Tensor k = rng.tensor(t, {s.B, s.T, s.Hkv, s.hd}, -2.0f, 2.0f);
        Tensor v = rng.tensor(t, {s.B, s.T, s.Hkv, s.hd});
        Tensor out(t, q.shape), lse(DType::f32, {s.B, s.H, s.T});
        host::attention_forward(out.view(), lse.view(), q.view(), k.view(), v.view(), mask);
        // The last tq positions of each sequence's queries.
        Tensor ql(t, {s.B, c.tq, s.H, s.hd});
        const int64_t row = s.H * s.hd, skip = s.T - c.tq;
        for (int64_t b = 0; b < s.B; ++b)
          for (int64_t i = 0; i < c.tq * row; ++i)
            ql.set(b * c.tq * row + i, q.at((b * s.T + skip) * row + i));
        Tensor outl(t, ql.shape, kNaN), lsel(DType::f32, {s.B, s.H, c.tq}, kNaN);
        host::attention_forward(outl.view(), lsel.view(), ql.view(), k.view(), v.view(), mask);
        for (int64_t b = 0; b < s.B; ++b) {
          for (int64_t i = 0; i < c.tq * row; ++i)
            ASSERT_EQ(std::bit_cast<uint32_t>(outl.at(b * c.tq * row + i)),
                      std::bit_cast<uint32_t>(out.at((b * s.T + skip) * row + i)))
                << what << ": out of sequence " << b << ", element " << i;
          for (int64_t h = 0; h < s.H; ++h)
            for (int64_t i = 0; i < c.tq; ++i)
              ASSERT_EQ(std::bit_cast<uint32_t>(lsel.at((b * s.H + h) * c.tq + i)),
                        std::bit_cast<uint32_t>(lse.at((b * s.H + h) * s.T + skip + i)))
                  << what << ": lse of sequence " << b << ", head " << h << ", query " << i;
        }
      }
  // More queries than keys, and a backward of decoding's shapes, are refused by name.
  Tensor q(DType::f32, {1, 4, 2, 4}), k(DType::f32, {1, 3, 2, 4}), v(DType::f32, {1, 3, 2, 4});
  Tensor out(DType::f32, q.shape), lse(DType::f32, {1, 2, 4});
  expect_error(
      [&] { host::attention_forward(out.view(), lse.view(), q.view(), k.view(), v.view()); },
      {"attention_forward", "3 positions", "at least as many"});
  Tensor q1(DType::f32, {1, 2, 2, 4}), out1(DType::f32, q1.shape), lse1(DType::f32, {1, 2, 2});
  Tensor dq(DType::f32, q1.shape), dk(DType::f32, k.shape), dv(DType::f32, v.shape);
  expect_error(
      [&] {
        host::attention_backward(dq.view(), dk.view(), dv.view(), out1.view(), q1.view(), k.view(),
                                 v.view(), out1.view(), lse1.view());
      },
      {"attention_backward", "3 positions", "whole sequences"});
}

// Documents packed into sequences (doc_start): each document's rows of out and lse, and its
// rows of dq, dk and dv, are bit for bit those of the document run alone as a sequence of its
// own, whatever shares its sequence. A doc_start that breaks the rule, and one given to a
// decoding call, are refused by name.
TEST(HostOps, AttentionOverPackedDocumentsIsEachDocumentAlone) {
  Random rng(31);
  const int64_t B = 2, T = 13, H = 4, Hkv = 2, hd = 8;
  struct Doc {
    int64_t b, start, n;
  };
  const std::vector<Doc> docs = {{0, 0, 5}, {0, 5, 1}, {0, 6, 7}, {1, 0, 13}};
  std::vector<int32_t> doc_start(B * T);
  for (const Doc& d : docs)
    for (int64_t t = d.start; t < d.start + d.n; ++t)
      doc_start[size_t(d.b * T + t)] = static_cast<int32_t>(d.start);
  for (DType t : {DType::f32, DType::bf16}) {
    Tensor q = rng.tensor(t, {B, T, H, hd}, -2.0f, 2.0f), k = rng.tensor(t, {B, T, Hkv, hd});
    Tensor v = rng.tensor(t, {B, T, Hkv, hd}), dout = rng.tensor(t, {B, T, H, hd});
    Tensor out(t, q.shape), lse(DType::f32, {B, H, T});
    Tensor dq(t, q.shape), dk(t, k.shape), dv(t, v.shape);
    host::attention_forward(out.view(), lse.view(), q.view(), k.view(), v.view(), doc_start.data());
    host::attention_backward(dq.view(), dk.view(), dv.view(), dout.view(), q.view(), k.view(),
                             v.view(), out.view(), lse.view(), doc_start.data());
    // Rows [start, start + n) of sequence b of x ([B, T, heads, hd]) as a sequence of its own.
    const auto cut = [&](const Tensor& x, const Doc& d) {
      const int64_t row = x.shape[2] * x.shape[3];
      Tensor y(x.dtype, {1, d.n, x.shape[2], x.shape[3]});
      for (int64_t i = 0; i < d.n * row; ++i) y.set(i, x.at((d.b * T + d.start) * row + i));
      return y;
    };
    for (const Doc& d : docs) {
      const std::string what = fmt::format("{} document at {} of sequence {} ({} tokens)",
                                           dtype_name(t), d.start, d.b, d.n);
      Tensor qa = cut(q, d), ka = cut(k, d), va = cut(v, d), da = cut(dout, d);
      Tensor oa(t, qa.shape), la(DType::f32, {1, H, d.n});
      Tensor dqa(t, qa.shape), dka(t, ka.shape), dva(t, va.shape);
      host::attention_forward(oa.view(), la.view(), qa.view(), ka.view(), va.view());
      host::attention_backward(dqa.view(), dka.view(), dva.view(), da.view(), qa.view(), ka.view(),
                               va.view(), oa.view(), la.view());
      for (const auto& [name, packed, alone] :
           {std::tuple<const char*, const Tensor*, const Tensor*>{"out", &out, &oa},
            {"dq", &dq, &dqa},
            {"dk", &dk, &dka},
            {"dv", &dv, &dva}}) {
        const Tensor rows = cut(*packed, d);
        for (int64_t i = 0; i < rows.numel(); ++i)
          ASSERT_EQ(std::bit_cast<uint32_t>(rows.at(i)), std::bit_cast<uint32_t>(alone->at(i)))
              << what << ": " << name << " element " << i;
      }
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < d.n; ++i)
          ASSERT_EQ(std::bit_cast<uint32_t>(lse.at((d.b * H + h) * T + d.start + i)),
                    std::bit_cast<uint32_t>(la.at(h * d.n + i)))
              << what << ": lse of head " << h << ", query " << i;
    }
  }
  Tensor q(DType::f32, {B, T, H, hd}), k(DType::f32, {B, T, Hkv, hd});
  Tensor out(DType::f32, q.shape), lse(DType::f32, {B, H, T});
  std::vector<int32_t> bad = doc_start;
  bad[size_t(T + 4)] = 2;  // neither 4 nor the start before it (0)
  expect_error(
      [&] {
        host::attention_forward(out.view(), lse.view(), q.view(), k.view(), k.view(), bad.data());
      },
      {"attention_forward", "doc_start of sequence 1 at position 4 is 2"});
  Tensor q1(DType::f32, {B, 2, H, hd}), out1(DType::f32, q1.shape), lse1(DType::f32, {B, H, 2});
  expect_error(
      [&] {
        host::attention_forward(out1.view(), lse1.view(), q1.view(), k.view(), k.view(),
                                doc_start.data());
      },
      {"attention_forward", "doc_start", "2 queries against 13 keys", "whole sequences"});
}

// dq, dk and dv under `mask` against central differences of a random linear function of the
// output, in f32; the backward's "=" outputs start as NaN garbage, which must be overwritten.
void expect_attention_gradients(Random& rng, const AttnShape& s, const AttentionMask& mask,
                                const std::string& what) {
  Tensor q = rng.tensor(DType::f32, {s.B, s.T, s.H, s.hd}, -1.5f, 1.5f);
  Tensor k = rng.tensor(DType::f32, {s.B, s.T, s.Hkv, s.hd}, -1.5f, 1.5f);
  Tensor v = rng.tensor(DType::f32, {s.B, s.T, s.Hkv, s.hd});
  const std::vector<double> r = rng.weights(q.numel());
  Tensor out(DType::f32, q.shape), lse(DType::f32, {s.B, s.H, s.T});
  auto loss = [&] {
    host::attention_forward(out.view(), lse.view(), q.view(), k.view(), v.view(), mask);
    return dot_loss(out, r);
  };
  loss();
  Tensor dq(DType::f32, q.shape, kNaN), dk(DType::f32, k.shape, kNaN),
      dv(DType::f32, v.shape, kNaN);
  host::attention_backward(dq.view(), dk.view(), dv.view(), from_weights(r, q.shape).view(),
                           q.view(), k.view(), v.view(), out.view(), lse.view(), mask);
  expect_grad(as_double(dq), numeric_grad(q, loss), "attention dq " + what);
  expect_grad(as_double(dk), numeric_grad(k, loss), "attention dk " + what);
  expect_grad(as_double(dv), numeric_grad(v, loss), "attention dv " + what);
}

TEST(HostOps, AttentionGradientsMatchFiniteDifferences) {
  Random rng(9);
  // Llama's scores, and Gemma 2's (another scale and a cap that bends them).
  for (const AttentionMask mask : {AttentionMask{}, AttentionMask(nullptr, 0, 0.7f, 1.2f)})
    for (const AttnShape s :
         {AttnShape{2, 5, 4, 2, 4}, AttnShape{1, 7, 2, 2, 6}, AttnShape{1, 7, 4, 1, 4}})
      expect_attention_gradients(
          rng, s, mask, fmt::format("{} scale {} softcap {}", str(s), mask.scale, mask.softcap));
}

// A sliding window (Mistral's): query t sees keys max(its document's start, t - W + 1) .. t.
// Forward: each row is, bit for bit, the last row of attention over those keys run alone as a
// sequence of their own. Backward: against finite differences, with and without documents.
TEST(HostOps, SlidingWindowRowsAreTheirWindowsAlone) {
  Random rng(37);
  const int64_t B = 2, T = 11, H = 4, Hkv = 2, hd = 6, W = 4;
  // Sequence 0: documents at 0, 5 and 6; sequence 1: one document.
  std::vector<int32_t> doc_start(B * T, 0);
  for (int64_t t = 0; t < T; ++t) doc_start[size_t(t)] = t < 5 ? 0 : t < 6 ? 5 : 6;
  for (const bool docs : {false, true}) {
    const AttentionMask mask(docs ? doc_start.data() : nullptr, W);
    for (DType dt : {DType::f32, DType::bf16}) {
      Tensor q = rng.tensor(dt, {B, T, H, hd}, -2.0f, 2.0f), k = rng.tensor(dt, {B, T, Hkv, hd});
      Tensor v = rng.tensor(dt, {B, T, Hkv, hd});
      Tensor out(dt, q.shape), lse(DType::f32, {B, H, T});
      host::attention_forward(out.view(), lse.view(), q.view(), k.view(), v.view(), mask);
      for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0; t < T; ++t) {
          const int64_t first = mask.first_key(b, T, t), n = t - first + 1;
          EXPECT_EQ(first, std::max<int64_t>(docs ? doc_start[size_t(b * T + t)] : 0, t - W + 1));
          const auto cut = [&](const Tensor& x) {
            const int64_t row = x.shape[2] * x.shape[3];
            Tensor y(x.dtype, {1, n, x.shape[2], x.shape[3]});
            for (int64_t i = 0; i < n * row; ++i) y.set(i, x.at((b * T + first) * row + i));
            return y;
          };
          Tensor qa = cut(q), ka = cut(k), va = cut(v);
          Tensor oa(dt, qa.shape), la(DType::f32, {1, H, n});
          host::attention_forward(oa.view(), la.view(), qa.view(), ka.view(), va.view());
          for (int64_t i = 0; i < H * hd; ++i)
            ASSERT_EQ(std::bit_cast<uint32_t>(out.at((b * T + t) * H * hd + i)),
                      std::bit_cast<uint32_t>(oa.at((n - 1) * H * hd + i)))
                << dtype_name(dt) << " docs " << docs << ": row " << t << " of sequence " << b;
          for (int64_t h = 0; h < H; ++h)
            ASSERT_EQ(std::bit_cast<uint32_t>(lse.at((b * H + h) * T + t)),
                      std::bit_cast<uint32_t>(la.at(h * n + n - 1)));
        }
    }
    expect_attention_gradients(rng, AttnShape{B, T, H, Hkv, hd}, mask,
                               fmt::format("window {} docs {}", W, docs));
  }
  // A window is never negative. (Decoding's shapes, fewer queries than keys, slide it too:
  // AttentionOfTheLastQueriesEqualsTheWholeSequencesRows.)
  Tensor q(DType::f32, {B, T, H, hd}), k(DType::f32, {B, T, Hkv, hd});
  Tensor out(DType::f32, q.shape), lse(DType::f32, {B, H, T});
  expect_error(
      [&] {
        host::attention_forward(out.view(), lse.view(), q.view(), k.view(), k.view(),
                                AttentionMask(nullptr, -1));
      },
      {"attention_forward", "sliding window is -1"});
}

TEST(HostOps, AttentionBackwardInBf16StaysNearTheF32Gradients) {
  Random rng(10);
  const AttnShape s{1, 5, 4, 2, 8};
  Tensor q = rng.tensor(DType::bf16, {s.B, s.T, s.H, s.hd}, -1.5f, 1.5f);
  Tensor k = rng.tensor(DType::bf16, {s.B, s.T, s.Hkv, s.hd}, -1.5f, 1.5f);
  Tensor v = rng.tensor(DType::bf16, {s.B, s.T, s.Hkv, s.hd});
  Tensor dout = rng.tensor(DType::bf16, q.shape);
  auto run = [&](DType t, std::vector<Tensor>& grads) {
    auto cast = [&](const Tensor& x) {
      Tensor y(t, x.shape);
      for (int64_t i = 0; i < x.numel(); ++i) y.set(i, x.at(i));
      return y;
    };
    Tensor qc = cast(q), kc = cast(k), vc = cast(v), dc = cast(dout);
    Tensor out(t, q.shape), lse(DType::f32, {s.B, s.H, s.T});
    host::attention_forward(out.view(), lse.view(), qc.view(), kc.view(), vc.view());
    grads = {Tensor(t, q.shape), Tensor(t, k.shape), Tensor(t, v.shape)};
    host::attention_backward(grads[0].view(), grads[1].view(), grads[2].view(), dc.view(),
                             qc.view(), kc.view(), vc.view(), out.view(), lse.view());
  };
  std::vector<Tensor> g16, g32;
  run(DType::bf16, g16);
  run(DType::f32, g32);
  for (size_t i = 0; i < 3; ++i)
    expect_close(g16[i], as_double(g32[i]), 1e-3, "bf16 attention grad");
}

// ---------------------------------------------------------------------------------------
// glu, add, fill

// SiLU, GELU and GELU's tanh approximation in double, as torch defines them.
double activation_reference(Activation act, double g) {
  switch (act) {
    case Activation::silu:
      return g / (1.0 + std::exp(-g));
    case Activation::gelu:
      return 0.5 * g * (1.0 + std::erf(g / std::sqrt(2.0)));
    case Activation::gelu_tanh:
      return 0.5 * g *
             (1.0 + std::tanh(std::sqrt(2.0 / std::numbers::pi) * (g + 0.044715 * g * g * g)));
  }
  return 0.0;
}

TEST(HostOps, GluOfEachActivationMatchesTheFormulaAndItsGradients) {
  Random rng(11);
  const int64_t N = 4, F = 6;
  for (const Activation act : {Activation::silu, Activation::gelu, Activation::gelu_tanh}) {
    SCOPED_TRACE(activation_name(act));
    for (DType t : {DType::f32, DType::bf16}) {
      Tensor gate = rng.tensor(t, {N, F}, -4.0f, 4.0f), up = rng.tensor(t, {N, F}, -2.0f, 2.0f);
      Tensor h(t, {N, F}, kNaN);
      host::glu_forward(h.view(), gate.view(), up.view(), act);
      std::vector<double> want(static_cast<size_t>(N * F));
      for (int64_t i = 0; i < N * F; ++i)
        want[static_cast<size_t>(i)] = activation_reference(act, gate.at(i)) * up.at(i);
      expect_close(h, want, 1e-6, "glu h " + std::string(dtype_name(t)));
    }
    Tensor gate = rng.tensor(DType::f32, {N, F}, -4.0f, 4.0f);
    Tensor up = rng.tensor(DType::f32, {N, F}, -2.0f, 2.0f);
    const std::vector<double> r = rng.weights(N * F);
    auto loss = [&] {
      Tensor h(DType::f32, {N, F});
      host::glu_forward(h.view(), gate.view(), up.view(), act);
      return dot_loss(h, r);
    };
    Tensor dgate(DType::f32, {N, F}, kNaN), dup(DType::f32, {N, F}, kNaN);
    host::glu_backward(dgate.view(), dup.view(), from_weights(r, {N, F}).view(), gate.view(),
                       up.view(), act);
    expect_grad(as_double(dgate), numeric_grad(gate, loss), "glu dgate");
    expect_grad(as_double(dup), numeric_grad(up, loss), "glu dup");
  }
  // The two GELUs differ by up to 4.7e-4, at |g| = 2.7: a swapped formula shows.
  Tensor g(DType::f32, {1, 1}, 2.7f), u(DType::f32, {1, 1}, 1.0f), h(DType::f32, {1, 1});
  host::glu_forward(h.view(), g.view(), u.view(), Activation::gelu);
  const float exact = h.at(0);
  host::glu_forward(h.view(), g.view(), u.view(), Activation::gelu_tanh);
  EXPECT_GT(std::abs(exact - h.at(0)), 4e-4f);
}

TEST(HostOps, AddAndFill) {
  Random rng(12);
  Tensor a = rng.tensor(DType::bf16, {3, 5}), b = rng.tensor(DType::f32, {3, 5});
  Tensor out(DType::f32, {3, 5}, kNaN);
  host::add(out.view(), a.view(), b.view());
  for (int64_t i = 0; i < 15; ++i) EXPECT_EQ(out.at(i), a.at(i) + b.at(i));
  const Tensor a0 = a;
  host::add(a.view(), a.view(), b.view());  // in place, the residual add
  for (int64_t i = 0; i < 15; ++i) EXPECT_EQ(a.at(i), bf16_to_f32(f32_to_bf16(a0.at(i) + b.at(i))));
  for (DType t : {DType::f32, DType::bf16, DType::f16}) {
    Tensor x(t, {7}, kNaN);
    host::fill(x.view(), -kInf);
    for (int64_t i = 0; i < 7; ++i) EXPECT_EQ(x.at(i), -kInf);
    host::fill(x.view(), 0.1f);
    for (int64_t i = 0; i < 7; ++i) {
      Tensor one(t, {1}, 0.1f);
      EXPECT_EQ(x.at(i), one.at(0));
    }
  }
}

TEST(HostOps, BiasBroadcastIntoAMatmulAndItsGradient) {
  Random rng(21);
  const int64_t N = 37, K = 9, C = 300;  // C past one block of 256 columns
  for (DType t : {DType::f32, DType::bf16, DType::f16}) {
    SCOPED_TRACE(dtype_name(t));
    Tensor x = rng.tensor(t, {N, K}), w = rng.tensor(t, {C, K}), b = rng.tensor(t, {C});
    Tensor y(t, {N, C}, kNaN);
    host::broadcast_rows(y.view(), b.view());
    for (int64_t i = 0; i < N * C; ++i) ASSERT_EQ(y.at(i), b.at(i % C)) << i;
    // y = x·Wᵀ + b, rounded once.
    host::matmul(y.view(), x.view(), false, w.view(), true, 1.0f, 1.0f);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t c = 0; c < C; ++c) {
        double want = b.at(c);
        for (int64_t k = 0; k < K; ++k) want += double{x.at(n * K + k)} * w.at(c * K + k);
        Tensor one(t, {1}, static_cast<float>(want));
        EXPECT_NEAR(y.at(n * C + c), one.at(0), t == DType::f32 ? 1e-5 : 1e-2 * std::abs(want))
            << n << "," << c;
      }
  }
  // db += column sums, in f32 or the rows' dtype; accumulates.
  for (DType t : {DType::f32, DType::bf16}) {
    for (DType gt : {DType::f32, t}) {
      SCOPED_TRACE(fmt::format("dy {} db {}", dtype_name(t), dtype_name(gt)));
      Tensor dy = rng.tensor(t, {N, C}), db = rng.tensor(gt, {C});
      const Tensor before = db;
      host::bias_backward(db.view(), dy.view());
      for (int64_t c = 0; c < C; ++c) {
        double sum = before.at(c);
        for (int64_t n = 0; n < N; ++n) sum += dy.at(n * C + c);
        Tensor one(gt, {1}, static_cast<float>(sum));
        EXPECT_NEAR(db.at(c), one.at(0), 1e-5 * std::max(1.0, std::abs(sum))) << c;
      }
    }
  }
  // Shapes and dtypes, named.
  Tensor y(DType::f32, {4, 6}), b5(DType::f32, {5}), b16(DType::bf16, {6}), g16(DType::f16, {6});
  test::expect_error([&] { host::broadcast_rows(y.view(), b5.view()); },
                     {"broadcast_rows", "b", "[5]", "[6]"});
  test::expect_error([&] { host::broadcast_rows(y.view(), b16.view()); },
                     {"broadcast_rows", "b", "bf16", "y's dtype"});
  Tensor dy16(DType::bf16, {4, 6});
  test::expect_error([&] { host::bias_backward(g16.view(), dy16.view()); },
                     {"bias_backward", "db", "f16", "f32 or dy's dtype"});
}

// ---------------------------------------------------------------------------------------
// cross-entropy

constexpr int64_t kRows = 5, kVocab = 11;
const std::vector<int32_t> kTargets = {3, kIgnoreIndex, 10, 0, kIgnoreIndex};

// Runs the chunked forward over full logits [N, V] (of dtype t) with chunks of `chunk`
// columns; returns losses and lse.
void chunked_xent(const Tensor& logits, int64_t chunk, DType t, Tensor& losses, Tensor& lse) {
  const int64_t N = logits.shape[0], V = logits.shape[1];
  Tensor row_max(DType::f32, {N}, kNaN), row_sum(DType::f32, {N}, kNaN),
      target_logit(DType::f32, {N}, kNaN);
  host::fill(row_max.view(), -kInf);
  host::fill(row_sum.view(), 0.0f);
  host::fill(target_logit.view(), 0.0f);
  for (int64_t v0 = 0; v0 < V; v0 += chunk) {
    const int64_t c = std::min(chunk, V - v0);
    Tensor part(t, {N, c});
    for (int64_t r = 0; r < N; ++r)
      for (int64_t j = 0; j < c; ++j) part.set(r * c + j, logits.at(r * V + v0 + j));
    host::xent_forward_chunk(part.view(), v0, kTargets.data(), row_max.view(), row_sum.view(),
                             target_logit.view());
  }
  losses = Tensor(DType::f32, {N}, kNaN);
  lse = row_max;  // lse may alias row_max: finish writes it over row_max's own memory
  host::xent_finish(losses.view(), lse.view(), lse.view(), row_sum.view(), target_logit.view(),
                    kTargets.data());
}

// Gemma 2's final_logit_softcapping: softcap() caps the logits in place, and
// xent_backward_chunk given the capped chunk and the cap takes the gradient back through it,
// against finite differences of the mean loss over the raw logits (chunks of 4: 4, 4, 3).
TEST(HostOps, SoftcappedLogitsAndTheirGradients) {
  Random rng(31);
  const float cap = 2.5f;  // below the logits' reach, so the cap bends them
  Tensor x = rng.tensor(DType::f32, {kRows, kVocab}, -6.0f, 6.0f);
  Tensor capped = x;
  host::softcap(capped.view(), cap);
  for (int64_t i = 0; i < x.numel(); ++i)
    EXPECT_NEAR(capped.at(i), cap * std::tanh(static_cast<double>(x.at(i)) / cap), 1e-6) << i;
  const int64_t chunk = 4;
  auto loss = [&] {
    Tensor y = x, losses, lse;
    host::softcap(y.view(), cap);
    chunked_xent(y, chunk, DType::f32, losses, lse);
    double sum = 0;
    for (int64_t r = 0; r < kRows; ++r) sum += losses.at(r);
    return sum / 3;  // three targets count
  };
  Tensor y = x, losses, lse;
  host::softcap(y.view(), cap);
  chunked_xent(y, chunk, DType::f32, losses, lse);
  std::vector<double> grad(static_cast<size_t>(kRows * kVocab));
  for (int64_t v0 = 0; v0 < kVocab; v0 += chunk) {
    const int64_t c = std::min(chunk, kVocab - v0);
    Tensor part(DType::f32, {kRows, c});
    for (int64_t r = 0; r < kRows; ++r)
      for (int64_t j = 0; j < c; ++j) part.set(r * c + j, x.at(r * kVocab + v0 + j));
    host::softcap(part.view(), cap);  // as the head recomputes a chunk
    host::xent_backward_chunk(part.view(), v0, kTargets.data(), lse.view(), 1.0f / 3, cap);
    for (int64_t r = 0; r < kRows; ++r)
      for (int64_t j = 0; j < c; ++j)
        grad[static_cast<size_t>(r * kVocab + v0 + j)] = part.at(r * c + j);
  }
  expect_grad(grad, numeric_grad(x, loss), "softcapped cross-entropy");
  Tensor logits(DType::f32, {2, 3}, 0.0f), stats(DType::f32, {2}, 0.0f);
  expect_error([&] { host::softcap(logits.view(), 0.0f); }, {"softcap", "softcap = 0"});
  expect_error(
      [&] {
        host::xent_backward_chunk(logits.view(), 0, kTargets.data(), stats.view(), 1.0f, -2.0f);
      },
      {"xent_backward_chunk", "softcap = -2"});
}

TEST(HostOps, ChunkedCrossEntropyEqualsDirectLogSoftmax) {
  Random rng(13);
  for (DType t : {DType::f32, DType::bf16}) {
    Tensor logits = rng.tensor(t, {kRows, kVocab}, -4.0f, 4.0f);
    std::vector<double> want_loss(kRows), want_lse(kRows);
    for (int64_t r = 0; r < kRows; ++r) {
      double m = -INFINITY, s = 0.0;
      for (int64_t j = 0; j < kVocab; ++j) m = std::max<double>(m, logits.at(r * kVocab + j));
      for (int64_t j = 0; j < kVocab; ++j) s += std::exp(logits.at(r * kVocab + j) - m);
      const double l = m + std::log(s);
      const int32_t tg = kTargets[static_cast<size_t>(r)];
      want_lse[static_cast<size_t>(r)] = l;
      want_loss[static_cast<size_t>(r)] = tg == kIgnoreIndex ? 0.0 : l - logits.at(r * kVocab + tg);
    }
    for (int64_t chunk : {1, 3, 4, 5, 11, 16}) {
      Tensor losses, lse;
      chunked_xent(logits, chunk, t, losses, lse);
      const std::string what = std::string(dtype_name(t)) + " chunk " + std::to_string(chunk);
      expect_close(losses, want_loss, 1e-5, "xent loss " + what);
      expect_close(lse, want_lse, 1e-5, "xent lse " + what);
      EXPECT_EQ(losses.at(1), 0.0f);
      EXPECT_EQ(losses.at(4), 0.0f);
    }
  }
}

TEST(HostOps, CrossEntropyBackwardIsTheGradientOfTheMeanLoss) {
  Random rng(14);
  Tensor logits = rng.tensor(DType::f32, {kRows, kVocab}, -3.0f, 3.0f);
  const int64_t chunk = 4;  // 4 + 4 + 3
  int counted = 0;
  for (int32_t t : kTargets) counted += t != kIgnoreIndex;
  const float scale = 1.0f / static_cast<float>(counted);
  auto loss = [&] {
    Tensor losses, lse;
    chunked_xent(logits, chunk, DType::f32, losses, lse);
    double sum = 0.0;
    for (int64_t r = 0; r < kRows; ++r) sum += losses.at(r);
    return sum / counted;
  };
  Tensor losses, lse;
  chunked_xent(logits, chunk, DType::f32, losses, lse);
  std::vector<double> grad(static_cast<size_t>(kRows * kVocab));
  for (int64_t v0 = 0; v0 < kVocab; v0 += chunk) {
    const int64_t c = std::min(chunk, kVocab - v0);
    Tensor part(DType::f32, {kRows, c});
    for (int64_t r = 0; r < kRows; ++r)
      for (int64_t j = 0; j < c; ++j) part.set(r * c + j, logits.at(r * kVocab + v0 + j));
    host::xent_backward_chunk(part.view(), v0, kTargets.data(), lse.view(), scale);
    for (int64_t r = 0; r < kRows; ++r)
      for (int64_t j = 0; j < c; ++j)
        grad[static_cast<size_t>(r * kVocab + v0 + j)] = part.at(r * c + j);
  }
  for (int64_t j = 0; j < kVocab; ++j) {  // ignored rows: exactly zero
    EXPECT_EQ(grad[static_cast<size_t>(1 * kVocab + j)], 0.0);
    EXPECT_EQ(grad[static_cast<size_t>(4 * kVocab + j)], 0.0);
  }
  expect_grad(grad, numeric_grad(logits, loss), "xent dlogits");
}

TEST(HostOps, CrossEntropyRejectsBadTargets) {
  Tensor logits(DType::f32, {2, 3}, 0.0f), m(DType::f32, {2}, 0.0f), s(DType::f32, {2}, 0.0f),
      tl(DType::f32, {2}, 0.0f);
  const std::vector<int32_t> bad = {1, -5};
  expect_error(
      [&] {
        host::xent_forward_chunk(logits.view(), 0, bad.data(), m.view(), s.view(), tl.view());
      },
      {"xent_forward_chunk", "targets[1] = -5", "-100"});
  const std::vector<int32_t> ok = {1, 2};
  expect_error(
      [&] {
        host::xent_forward_chunk(logits.view(), -1, ok.data(), m.view(), s.view(), tl.view());
      },
      {"xent_forward_chunk", "v0 = -1"});
}

// ---------------------------------------------------------------------------------------
// shape checks

TEST(HostOps, BadShapesThrowNamingTheOpTensorAndShapes) {
  auto t = [](DType d, Shape s) { return Tensor(d, s, 0.0f); };
  Tensor a = t(DType::f32, {3, 4}), b = t(DType::f32, {5, 6}), c = t(DType::f32, {3, 6});
  expect_error([&] { host::matmul(c.view(), a.view(), false, b.view(), false, 1, 0); },
               {"matmul", "b is f32[5, 6] on host memory", "[4, 6]"});
  Tensor b2 = t(DType::f32, {4, 6}), c2 = t(DType::f32, {6, 3});
  expect_error([&] { host::matmul(c2.view(), a.view(), false, b2.view(), false, 1, 0); },
               {"matmul", "c is f32[6, 3]", "expected [3, 6]"});
  Tensor b16 = t(DType::bf16, {4, 6});
  expect_error([&] { host::matmul(c.view(), a.view(), false, b16.view(), false, 1, 0); },
               {"matmul", "bf16[4, 6]", "one dtype"});
  Tensor a16 = t(DType::bf16, {3, 4}), c16 = t(DType::f16, {3, 6});
  expect_error([&] { host::matmul(c16.view(), a16.view(), false, b16.view(), false, 1, 0); },
               {"matmul", "c is f16[3, 6]", "bf16 or f32"});
  Tensor v = t(DType::f32, {3});
  expect_error([&] { host::matmul(c.view(), v.view(), false, b2.view(), false, 1, 0); },
               {"matmul", "a is f32[3]", "rank 2"});
  TensorView null_a = a.view();
  null_a.data = nullptr;
  expect_error([&] { host::matmul(c.view(), null_a, false, b2.view(), false, 1, 0); },
               {"matmul", "a f32[3, 4]", "null"});

  const std::vector<int32_t> ids = {0, 1, 2};
  Tensor table = t(DType::f32, {4, 5}), out = t(DType::f32, {3, 6});
  expect_error([&] { host::embedding_forward(out.view(), table.view(), ids.data()); },
               {"embedding_forward", "out is f32[3, 6]", "[3, 5]"});
  Tensor dtable16 = t(DType::bf16, {4, 5}), dout16 = t(DType::f16, {3, 5});
  expect_error([&] { host::embedding_backward(dtable16.view(), dout16.view(), ids.data()); },
               {"embedding_backward", "dtable is bf16[4, 5]", "f32 or dout's dtype"});

  Tensor x = t(DType::f32, {3, 4}), w = t(DType::f32, {5}), y = t(DType::f32, {3, 4});
  Tensor r = t(DType::f32, {3}), r16 = t(DType::bf16, {3}), w4 = t(DType::f32, {4});
  expect_error([&] { host::rmsnorm_forward(y.view(), r.view(), x.view(), w.view(), 1e-5f); },
               {"rmsnorm_forward", "w is f32[5]", "expected [4]"});
  expect_error([&] { host::rmsnorm_forward(y.view(), r16.view(), x.view(), w4.view(), 1e-5f); },
               {"rmsnorm_forward", "rstd_stats is bf16[3]", "f32"});
  Tensor dy = t(DType::f32, {3, 5});
  expect_error(
      [&] {
        host::rmsnorm_backward(y.view(), w4.view(), dy.view(), x.view(), w4.view(), r.view());
      },
      {"rmsnorm_backward", "f32[3, 5]", "expected [3, 4]"});

  Tensor xr = t(DType::f32, {4, 2, 6}), cs = t(DType::f32, {2, 6}), xo = t(DType::f32, {4, 2, 5});
  expect_error([&] { host::rope(xr.view(), cs.view(), 3, false); },
               {"rope", "cos_sin is f32[2, 6]", "expected [3, 6]"});
  expect_error([&] { host::rope(xo.view(), cs.view(), 2, false); }, {"rope", "head_dim 5", "even"});

  Tensor q = t(DType::f32, {1, 5, 3, 4}), k = t(DType::f32, {1, 5, 2, 4}),
         o = t(DType::f32, {1, 5, 3, 4}), lse = t(DType::f32, {1, 3, 5});
  expect_error([&] { host::attention_forward(o.view(), lse.view(), q.view(), k.view(), k.view()); },
               {"attention_forward", "3 heads", "2 kv heads"});
  Tensor q4 = t(DType::f32, {1, 5, 4, 4}), o4 = t(DType::f32, {1, 5, 4, 4}),
         lse_bad = t(DType::f32, {1, 5, 4}), lse4 = t(DType::f32, {1, 4, 5});
  expect_error(
      [&] { host::attention_forward(o4.view(), lse_bad.view(), q4.view(), k.view(), k.view()); },
      {"attention_forward", "lse_stats is f32[1, 5, 4]", "expected [1, 4, 5]"});
  Tensor k16 = t(DType::bf16, {1, 5, 2, 4});
  expect_error(
      [&] { host::attention_forward(o4.view(), lse4.view(), q4.view(), k16.view(), k.view()); },
      {"attention_forward", "k is bf16[1, 5, 2, 4]", "one dtype"});
  Tensor dk_bad = t(DType::f32, {1, 5, 4, 4});
  expect_error(
      [&] {
        host::attention_backward(q4.view(), dk_bad.view(), k.view(), o4.view(), q4.view(), k.view(),
                                 k.view(), o4.view(), lse4.view());
      },
      {"attention_backward", "dk is f32[1, 5, 4, 4]", "expected [1, 5, 2, 4]"});

  Tensor g = t(DType::f32, {2, 3}), u = t(DType::f32, {3, 2});
  expect_error([&] { host::glu_forward(g.view(), g.view(), u.view()); },
               {"glu_forward", "f32[3, 2]", "[2, 3]"});
  expect_error([&] { host::add(g.view(), u.view(), g.view()); }, {"add", "f32[2, 3]", "[3, 2]"});

  Tensor logits = t(DType::f32, {2, 3}), m3 = t(DType::f32, {3}), m2 = t(DType::f32, {2}),
         m16 = t(DType::bf16, {2});
  const std::vector<int32_t> tg = {0, 1};
  expect_error(
      [&] {
        host::xent_forward_chunk(logits.view(), 0, tg.data(), m3.view(), m2.view(), m2.view());
      },
      {"xent_forward_chunk", "f32[3]", "expected [2]"});
  expect_error(
      [&] { host::xent_finish(m2.view(), m2.view(), m2.view(), m16.view(), m2.view(), tg.data()); },
      {"xent_finish", "bf16[2]", "f32"});
}

// ---------------------------------------------------------------------------------------
// determinism

TEST(HostOps, ResultsDoNotDependOnThreadCount) {
  Random rng(15);
  const AttnShape s{2, 64, 4, 2, 16};
  Tensor q = rng.tensor(DType::f32, {s.B, s.T, s.H, s.hd}),
         k = rng.tensor(DType::f32, {s.B, s.T, s.Hkv, s.hd}), v = rng.tensor(DType::f32, k.shape),
         dout = rng.tensor(DType::f32, q.shape);
  Tensor x = rng.tensor(DType::f32, {512, 64}), w = rng.tensor(DType::f32, {64});
  Tensor ma = rng.tensor(DType::f32, {64, 96}), mb = rng.tensor(DType::f32, {700, 96});
  auto run = [&] {
    std::vector<Tensor> r = {Tensor(DType::f32, q.shape),    Tensor(DType::f32, {s.B, s.H, s.T}),
                             Tensor(DType::f32, q.shape),    Tensor(DType::f32, k.shape),
                             Tensor(DType::f32, k.shape),    Tensor(DType::f32, x.shape),
                             Tensor(DType::f32, {512}),      Tensor(DType::f32, x.shape, 0.0f),
                             Tensor(DType::f32, {64}, 0.0f), Tensor(DType::f32, {64, 700})};
    host::attention_forward(r[0].view(), r[1].view(), q.view(), k.view(), v.view());
    host::attention_backward(r[2].view(), r[3].view(), r[4].view(), dout.view(), q.view(), k.view(),
                             v.view(), r[0].view(), r[1].view());
    host::rmsnorm_forward(r[5].view(), r[6].view(), x.view(), w.view(), 1e-6f);
    host::rmsnorm_backward(r[7].view(), r[8].view(), r[5].view(), x.view(), w.view(), r[6].view());
    host::matmul(r[9].view(), ma.view(), false, mb.view(), true, 1.0f, 0.0f);  // 2 blocks
    return r;
  };
  const std::vector<Tensor> parallel = run();
  std::vector<Tensor> serial;
  {
    tbb::global_control one(tbb::global_control::max_allowed_parallelism, 1);
    serial = run();
  }
  for (size_t i = 0; i < parallel.size(); ++i)
    EXPECT_EQ(
        std::memcmp(parallel[i].storage.data(), serial[i].storage.data(), parallel[i].bytes()), 0)
        << "output " << i << " differs between 1 thread and the default";
}

// ---------------------------------------------------------------------------------------
// the host device's kernel table

constexpr uint64_t kMiB = 1ull << 20;

// A tensor's copy in a device's memory.
struct OnDevice {
  DeviceBuffer buffer;
  TensorView view;
  OnDevice(Device& dev, const Tensor& t, Stream& s)
      : buffer(dev, t.bytes(), "test tensor"), view(buffer.view(t.dtype, t.shape)) {
    dev.copy_to_device(buffer.data(), t.storage.data(), t.bytes(), s);
  }
  Tensor read(Device& dev, Stream& s) const {
    Tensor t(view.dtype, view.shape);
    dev.copy_to_host(t.storage.data(), buffer.data(), t.bytes(), s);
    s.synchronize();
    return t;
  }
};

void expect_same_bits(const Tensor& a, const Tensor& b, const std::string& what) {
  ASSERT_EQ(a.bytes(), b.bytes()) << what;
  EXPECT_EQ(std::memcmp(a.storage.data(), b.storage.data(), a.bytes()), 0) << what;
}

TEST(HostKernels, RunOpsOnAStreamLikeTheReference) {
  auto dev = open_host_device(0, 4 * kMiB);
  auto s = dev->create_stream("compute");
  Kernels& k = dev->kernels();
  Random rng(16);

  // matmul, bf16 operands into an f32 accumulator with beta 1.
  Tensor a = rng.tensor(DType::bf16, {6, 5}), b = rng.tensor(DType::bf16, {7, 5});
  Tensor c = rng.tensor(DType::f32, {6, 7});
  OnDevice da(*dev, a, *s), db(*dev, b, *s), dc(*dev, c, *s);
  s->synchronize();  // the copies have read the host tensors the reference then changes
  k.matmul(dc.view, da.view, false, db.view, true, 0.5f, 1.0f, *s);
  host::matmul(c.view(), a.view(), false, b.view(), true, 0.5f, 1.0f);
  expect_same_bits(dc.read(*dev, *s), c, "matmul");

  // attention forward and backward with GQA.
  const AttnShape sh{1, 5, 4, 2, 8};
  Tensor q = rng.tensor(DType::bf16, {sh.B, sh.T, sh.H, sh.hd});
  Tensor kk = rng.tensor(DType::bf16, {sh.B, sh.T, sh.Hkv, sh.hd});
  Tensor v = rng.tensor(DType::bf16, kk.shape), dout = rng.tensor(DType::bf16, q.shape);
  Tensor out(DType::bf16, q.shape, kNaN), lse(DType::f32, {sh.B, sh.H, sh.T}, kNaN);
  Tensor dq(DType::bf16, q.shape, kNaN), dk(DType::bf16, kk.shape, kNaN),
      dv(DType::bf16, kk.shape, kNaN);
  OnDevice dq_(*dev, q, *s), dk_(*dev, kk, *s), dv_(*dev, v, *s), ddout(*dev, dout, *s),
      dout_(*dev, out, *s), dlse(*dev, lse, *s), ddq(*dev, dq, *s), ddk(*dev, dk, *s),
      ddv(*dev, dv, *s);
  s->synchronize();
  k.attention_forward(dout_.view, dlse.view, dq_.view, dk_.view, dv_.view, nullptr, *s);
  k.attention_backward(ddq.view, ddk.view, ddv.view, ddout.view, dq_.view, dk_.view, dv_.view,
                       dout_.view, dlse.view, nullptr, *s);
  host::attention_forward(out.view(), lse.view(), q.view(), kk.view(), v.view());
  host::attention_backward(dq.view(), dk.view(), dv.view(), dout.view(), q.view(), kk.view(),
                           v.view(), out.view(), lse.view());
  expect_same_bits(dout_.read(*dev, *s), out, "attention out");
  expect_same_bits(dlse.read(*dev, *s), lse, "attention lse");
  expect_same_bits(ddq.read(*dev, *s), dq, "attention dq");
  expect_same_bits(ddk.read(*dev, *s), dk, "attention dk");
  expect_same_bits(ddv.read(*dev, *s), dv, "attention dv");

  // cross-entropy with its targets in device memory, and an embedding with device ids.
  Tensor logits = rng.tensor(DType::f32, {kRows, 4}, -3.0f, 3.0f);
  Tensor mx(DType::f32, {kRows}, -kInf), sm(DType::f32, {kRows}, 0.0f),
      tl(DType::f32, {kRows}, 0.0f), losses(DType::f32, {kRows}, kNaN);
  DeviceBuffer targets(*dev, kTargets.size() * sizeof(int32_t), "targets");
  dev->copy_to_device(targets.data(), kTargets.data(), kTargets.size() * sizeof(int32_t), *s);
  const auto* dtargets = static_cast<const int32_t*>(targets.data());
  OnDevice dlogits(*dev, logits, *s), dmx(*dev, mx, *s), dsm(*dev, sm, *s), dtl(*dev, tl, *s),
      dlosses(*dev, losses, *s);
  s->synchronize();
  k.xent_forward_chunk(dlogits.view, 0, dtargets, dmx.view, dsm.view, dtl.view, *s);
  k.xent_finish(dlosses.view, dmx.view, dmx.view, dsm.view, dtl.view, dtargets, *s);
  k.xent_backward_chunk(dlogits.view, 0, dtargets, dmx.view, 0.25f, 0.0f, *s);
  host::xent_forward_chunk(logits.view(), 0, kTargets.data(), mx.view(), sm.view(), tl.view());
  host::xent_finish(losses.view(), mx.view(), mx.view(), sm.view(), tl.view(), kTargets.data());
  host::xent_backward_chunk(logits.view(), 0, kTargets.data(), mx.view(), 0.25f);
  expect_same_bits(dlosses.read(*dev, *s), losses, "xent losses");
  expect_same_bits(dlogits.read(*dev, *s), logits, "xent dlogits");

  // An id out of range fails in the task: the stream's synchronize() reports it.
  Tensor table = rng.tensor(DType::f32, {4, 3}), rows(DType::f32, {5, 3});
  OnDevice dtable(*dev, table, *s), drows(*dev, rows, *s);
  k.embedding_forward(drows.view, dtable.view, dtargets, 1.0f, {}, *s);  // holds -100
  expect_error([&] { s->synchronize(); }, {"stream 'compute'", "embedding_forward", "ids[1]"});
}

TEST(HostKernels, CheckShapesAndMemoryWhenQueued) {
  auto dev = open_host_device(0, 1 * kMiB);
  auto other = open_host_device(1, 1 * kMiB);
  auto s = dev->create_stream("compute");
  auto s_other = other->create_stream("theirs");
  Kernels& k = dev->kernels();
  Tensor a(DType::f32, {2, 3}, 1.0f), b(DType::f32, {3, 4}, 1.0f), c(DType::f32, {2, 4}, 0.0f);
  OnDevice da(*dev, a, *s), db(*dev, b, *s), dc(*dev, c, *s);
  s->synchronize();
  // Ordinary host memory is not this device's.
  expect_error([&] { k.matmul(dc.view, a.view(), false, db.view, false, 1, 0, *s); },
               {"host:0", "matmul", "tensor a", "not inside host:0's memory"});
  // Nor is another device's.
  OnDevice foreign(*other, c, *s_other);
  s_other->synchronize();
  expect_error([&] { k.matmul(foreign.view, da.view, false, db.view, false, 1, 0, *s); },
               {"matmul", "tensor c", "on host:1", "not inside host:0's memory"});
  // Bad shapes throw at the call, before anything runs.
  expect_error([&] { k.matmul(dc.view, db.view, false, db.view, false, 1, 0, *s); },
               {"matmul", "b is f32[3, 4] on host:0"});
  // Ids and targets must be device memory too.
  const std::vector<int32_t> ids = {0, 1};
  expect_error([&] { k.embedding_forward(dc.view, db.view, ids.data(), 1.0f, {}, *s); },
               {"embedding_forward", "ids (int32[2])", "not inside host:0's memory"});
  // A stream of another device is refused.
  expect_error([&] { k.fill(dc.view, 1.0f, *s_other); }, {"stream 'theirs'", "host:0"});
  // A valid op still runs after all that.
  k.matmul(dc.view, da.view, false, db.view, false, 1, 0, *s);
  const Tensor got = dc.read(*dev, *s);
  for (int64_t i = 0; i < got.numel(); ++i) EXPECT_EQ(got.at(i), 3.0f);
}

}  // namespace
}  // namespace strata
