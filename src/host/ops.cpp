// ops.cpp: the host reference ops (see ops.h; semantics in core/kernels.h).
//
// Before editing, know: every parallel loop splits independent rows (or columns) only; a sum
// never spans two tasks, so the bits do not depend on how oneTBB splits the work. Sums that
// mix many terms (means of squares, softmax sums, attention's weighted sums and gradients)
// run in double. Inputs of several dtypes are widened to f32 once (F32Input) and outputs are
// stored element by element with store_f32, which rounds to nearest even.
#include "host/ops.h"

#include "core/dtype.h"
#include "core/error.h"

#include <cblas.h>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

namespace strata::host {
namespace {

// About this many elements per task: big enough that scheduling costs little.
constexpr int64_t kGrainElements = 1 << 14;

int64_t rows_grain(int64_t cols) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, cols));
}

// Runs body(begin, end) over [0, n) in independent pieces, in parallel when n exceeds grain.
template <typename Body>
void parallel_ranges(int64_t n, int64_t grain, const Body& body) {
  if (n <= 0) return;
  if (n <= grain) {
    body(int64_t{0}, n);
    return;
  }
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, n, grain),
                    [&](const tbb::blocked_range<int64_t>& r) { body(r.begin(), r.end()); });
}

// A tensor's elements as f32: its own memory when it is f32, else a widened copy (exact).
class F32Input {
 public:
  explicit F32Input(const TensorView& t) {
    if (t.dtype == DType::f32) {
      data_ = static_cast<const float*>(t.data);
      return;
    }
    const auto n = static_cast<size_t>(t.numel());
    copy_.resize(n);
    convert(copy_.data(), DType::f32, t.data, t.dtype, n);
    data_ = copy_.data();
  }
  F32Input(const F32Input&) = delete;
  F32Input& operator=(const F32Input&) = delete;

  const float* data() const { return data_; }
  float operator[](int64_t i) const { return data_[i]; }

 private:
  std::vector<float> copy_;
  const float* data_ = nullptr;
};

float get(const TensorView& t, int64_t i) {
  return load_f32(t.data, t.dtype, static_cast<size_t>(i));
}
void put(const TensorView& t, int64_t i, float v) {
  store_f32(t.data, t.dtype, static_cast<size_t>(i), v);
}
float* f32(const TensorView& t) {
  return static_cast<float*>(t.data);
}
// v rounded to t's precision (to nearest even), as a store into a tensor of t rounds it.
float rounded(DType t, float v) {
  if (t == DType::bf16) return bf16_to_f32(f32_to_bf16(v));
  if (t == DType::f16) return f16_to_f32(f32_to_f16(v));
  return v;
}

void check_ids(const char* op, const int32_t* ids, int64_t n, int64_t vocab) {
  if (n > 0 && ids == nullptr) fail("{}: ids is null for {} tokens; pass the token ids", op, n);
  for (int64_t i = 0; i < n; ++i)
    if (ids[i] < 0 || ids[i] >= vocab)
      fail("{}: ids[{}] = {} is outside the table's {} rows; ids must lie in [0, {})", op, i,
           ids[i], vocab, vocab);
}

void check_targets(const char* op, const int32_t* targets, int64_t n) {
  if (n > 0 && targets == nullptr)
    fail("{}: targets is null for {} rows; pass the target ids", op, n);
  for (int64_t i = 0; i < n; ++i)
    if (targets[i] < 0 && targets[i] != kIgnoreIndex)
      fail("{}: targets[{}] = {} is neither a vocabulary id (>= 0) nor the ignore index {}", op, i,
           targets[i], kIgnoreIndex);
}

void check_like(const char* op, const char* name, const TensorView& t, const char* ref_name,
                const TensorView& ref) {
  check_same_shape(op, {&t});  // its dtype and data
  if (!(t.shape == ref.shape))
    fail("{}: {} is {}; expected {} (the shape of {} {}); pass a tensor of that shape", op, name,
         t.str(), ref.shape.str(), ref_name, ref.str());
}

int blas_int(int64_t v, const char* what, const MatmulDims& d) {
  if (v > INT_MAX)
    fail("matmul: {} = {} (m {}, n {}, k {}) exceeds the host BLAS's 32-bit sizes; split it", what,
         v, d.m, d.n, d.k);
  return static_cast<int>(v);
}

// OpenBLAS's own thread pool is turned off: its idle workers spin (sched_yield) for about
// 0.1 s after every call, taking cores from oneTBB's workers and from the executor's other
// lanes (CPU Adam, I/O) on a machine with few of them, and for the small products of a
// pipelined step its threading costs more than it gains. matmul spreads the work over oneTBB
// instead (the same threads as every other host op).
void blas_on_the_calling_thread() {
  static const bool once = [] {
    openblas_set_num_threads(1);
    return true;
  }();
  (void)once;
}

// Columns of C per sgemm call: about 4 MFLOP each (a few tens of microseconds on a core, so
// scheduling costs little), a multiple of 64 (every sgemm kernel's column unroll divides it).
int64_t matmul_block_cols(int64_t m, int64_t k) {
  constexpr int64_t kBlockFlops = int64_t{4} << 20;
  const int64_t per_col = std::max<int64_t>(1, 2 * m * k);
  const int64_t cols = (kBlockFlops + per_col - 1) / per_col;
  return std::max<int64_t>(64, (cols + 63) / 64 * 64);
}

// exp(a - m), but exactly 1 when a == m: an all -inf row (m = -inf) then sums to its count
// instead of exp(-inf + inf) = NaN, as in the CUDA kernel.
double rescale(double a, double m) {
  return a == m ? 1.0 : std::exp(a - m);
}

}  // namespace

// ---------------------------------------------------------------------------------------
// matmul

void matmul(const TensorView& c, const TensorView& a, bool trans_a, const TensorView& b,
            bool trans_b, float alpha, float beta) {
  const MatmulDims d = check_matmul(c, a, trans_a, b, trans_b);
  if (d.m == 0 || d.n == 0) return;
  const int64_t mn = d.m * d.n;
  // c's f32 values: c itself when it is f32, else a scratch copy stored back at the end.
  std::vector<float> c_copy;
  float* cp = f32(c);
  if (c.dtype != DType::f32) {
    c_copy.resize(static_cast<size_t>(mn));
    cp = c_copy.data();
    if (beta != 0.0f) convert(cp, DType::f32, c.data, c.dtype, static_cast<size_t>(mn));
  }
  // beta == 0 ignores c's contents, NaN included: zero it rather than trust BLAS to.
  if (beta == 0.0f) std::fill(cp, cp + mn, 0.0f);
  if (d.k == 0) {
    if (beta != 0.0f && beta != 1.0f)
      for (int64_t i = 0; i < mn; ++i) cp[i] *= beta;
  } else {
    const F32Input fa(a), fb(b);
    const int m = blas_int(d.m, "m", d), n = blas_int(d.n, "n", d), k = blas_int(d.k, "k", d);
    blas_on_the_calling_thread();
    // Blocks of C's columns, each one single-threaded sgemm over the whole of k. The blocks
    // depend only on the shape, so the bits do not depend on how many threads run them.
    const int64_t cols = matmul_block_cols(d.m, d.k);
    parallel_ranges((d.n + cols - 1) / cols, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t blk = b0; blk < b1; ++blk) {
        const int64_t j0 = blk * cols;
        const int nj = static_cast<int>(std::min(cols, d.n - j0));
        const float* bj = fb.data() + (trans_b ? j0 * d.k : j0);
        cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
                    trans_b ? CblasTrans : CblasNoTrans, m, nj, k, alpha, fa.data(),
                    trans_a ? m : k, bj, trans_b ? k : n, beta, cp + j0, n);
      }
    });
  }
  if (c.dtype != DType::f32) convert(c.data, c.dtype, cp, DType::f32, static_cast<size_t>(mn));
}

// ---------------------------------------------------------------------------------------
// embedding

void embedding_forward(const TensorView& out, const TensorView& table, const int32_t* ids,
                       float scale, const TableRows& piece) {
  const char* op = "embedding_forward";
  const RowDims d = check_embedding(op, out, table, piece);
  check_ids(op, ids, d.rows, table_vocab(table, piece));
  const int64_t first = piece.first, end = piece.first + table.shape[0];
  parallel_ranges(d.rows, rows_grain(d.cols), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t dst = r * d.cols;
      if (ids[r] < first || ids[r] >= end) {  // another piece's row
        if (piece.zero_others)
          for (int64_t j = 0; j < d.cols; ++j) put(out, dst + j, 0.0f);
        continue;
      }
      const int64_t src = (int64_t{ids[r]} - first) * d.cols;
      for (int64_t j = 0; j < d.cols; ++j) put(out, dst + j, get(table, src + j) * scale);
    }
  });
}

void embedding_backward(const TensorView& dtable, const TensorView& dout, const int32_t* ids,
                        float scale, const TableRows& piece) {
  const char* op = "embedding_backward";
  const RowDims d = check_embedding(op, dout, dtable, piece);
  check_ids(op, ids, d.rows, table_vocab(dtable, piece));
  const int64_t first = piece.first, end = piece.first + dtable.shape[0];
  // Split over columns so that rows sharing an id add in token order (deterministic); a
  // 16-bit dtable rounds after every add, as the CUDA kernel's does.
  parallel_ranges(d.cols, std::max<int64_t>(16, rows_grain(d.rows)), [&](int64_t j0, int64_t j1) {
    for (int64_t r = 0; r < d.rows; ++r) {
      if (ids[r] < first || ids[r] >= end) continue;
      const int64_t dst = (int64_t{ids[r]} - first) * d.cols, src = r * d.cols;
      for (int64_t j = j0; j < j1; ++j)
        put(dtable, dst + j,
            get(dtable, dst + j) + rounded(dout.dtype, get(dout, src + j) * scale));
    }
  });
}

// ---------------------------------------------------------------------------------------
// rmsnorm

namespace {

// The norm's weight as it multiplies: w + weight_offset in f32 (Gemma's 1 + w).
std::vector<float> norm_weight(const TensorView& w, float weight_offset) {
  const F32Input in(w);
  std::vector<float> out(static_cast<size_t>(w.numel()));
  for (size_t j = 0; j < out.size(); ++j) out[j] = in[static_cast<int64_t>(j)] + weight_offset;
  return out;
}

}  // namespace

void rmsnorm_forward(const TensorView& y, const TensorView& rstd_stats, const TensorView& x,
                     const TensorView& w, float eps, float weight_offset) {
  const RowDims d = check_rmsnorm("rmsnorm_forward", y, rstd_stats, x, w);
  const std::vector<float> weight = norm_weight(w, weight_offset);
  const float* wf = weight.data();
  parallel_ranges(d.rows, rows_grain(d.cols), [&](int64_t r0, int64_t r1) {
    std::vector<float> row(static_cast<size_t>(d.cols));  // read first: y may alias x
    for (int64_t r = r0; r < r1; ++r) {
      double squares = 0.0;
      for (int64_t j = 0; j < d.cols; ++j) {
        const float v = get(x, r * d.cols + j);
        row[static_cast<size_t>(j)] = v;
        squares += static_cast<double>(v) * v;
      }
      const double mean = d.cols > 0 ? squares / static_cast<double>(d.cols) : 0.0;
      const auto rstd = static_cast<float>(1.0 / std::sqrt(mean + static_cast<double>(eps)));
      f32(rstd_stats)[r] = rstd;
      for (int64_t j = 0; j < d.cols; ++j)
        put(y, r * d.cols + j, row[static_cast<size_t>(j)] * rstd * wf[j]);
    }
  });
}

RowDims check_rmsnorm_backward(const TensorView& dx, const TensorView& dw, const TensorView& dy,
                               const TensorView& x, const TensorView& w,
                               const TensorView& rstd_stats) {
  const char* op = "rmsnorm_backward";
  check_rmsnorm(op, dy, rstd_stats, x, dw);
  return check_rmsnorm(op, dx, rstd_stats, x, w);
}

void rmsnorm_backward(const TensorView& dx, const TensorView& dw, const TensorView& dy,
                      const TensorView& x, const TensorView& w, const TensorView& rstd_stats,
                      float weight_offset) {
  const RowDims d = check_rmsnorm_backward(dx, dw, dy, x, w, rstd_stats);
  const std::vector<float> weight = norm_weight(w, weight_offset);
  const float* wf = weight.data();
  const float* rstd = f32(rstd_stats);
  const auto cols = static_cast<double>(d.cols);
  // y_j = x_j r w_j with r = (mean(x²) + eps)^-1/2 and ∂r/∂x_j = -r³ x_j / D, so
  // dx_j = r w_j dy_j - x_j r³ / D · Σ_i dy_i w_i x_i.
  parallel_ranges(d.rows, rows_grain(d.cols), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t base = r * d.cols;
      const double rs = rstd[r];
      double dot = 0.0;
      for (int64_t j = 0; j < d.cols; ++j)
        dot += static_cast<double>(get(dy, base + j)) * wf[j] * get(x, base + j);
      const double coef = rs * rs * rs * dot / cols;
      for (int64_t j = 0; j < d.cols; ++j) {
        const double g = rs * wf[j] * get(dy, base + j) - coef * get(x, base + j);
        put(dx, base + j, get(dx, base + j) + static_cast<float>(g));
      }
    }
  });
  // dw_j = Σ_rows dy x r: split over columns, each summed over rows in order.
  parallel_ranges(d.cols, std::max<int64_t>(16, rows_grain(d.rows)), [&](int64_t j0, int64_t j1) {
    std::vector<double> sum(static_cast<size_t>(j1 - j0), 0.0);
    for (int64_t r = 0; r < d.rows; ++r)
      for (int64_t j = j0; j < j1; ++j)
        sum[static_cast<size_t>(j - j0)] +=
            static_cast<double>(get(dy, r * d.cols + j)) * get(x, r * d.cols + j) * rstd[r];
    for (int64_t j = j0; j < j1; ++j)
      put(dw, j, get(dw, j) + static_cast<float>(sum[static_cast<size_t>(j - j0)]));
  });
}

// ---------------------------------------------------------------------------------------
// rope

void rope(const TensorView& x, const TensorView& cos_sin, int64_t seq_len, bool inverse) {
  const RopeDims d = check_rope(x, cos_sin, seq_len);
  const int64_t half = d.rotary / 2;  // dimensions past d.rotary pass unrotated
  const float* table = f32(cos_sin);
  const float sign = inverse ? -1.0f : 1.0f;  // the inverse rotates by minus the angle
  parallel_ranges(d.tokens, rows_grain(d.heads * d.head_dim), [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const float* cs = table + (n % seq_len) * d.rotary;
      for (int64_t h = 0; h < d.heads; ++h) {
        const int64_t base = (n * d.heads + h) * d.head_dim;
        for (int64_t i = 0; i < half; ++i) {
          const float c = cs[i], s = sign * cs[half + i];
          const float x0 = get(x, base + i), x1 = get(x, base + half + i);
          put(x, base + i, x0 * c - x1 * s);
          put(x, base + half + i, x1 * c + x0 * s);
        }
      }
    }
  });
}

// ---------------------------------------------------------------------------------------
// attention: the T×T scores of each (batch, head) are materialised one query row at a time.

namespace {

// The factor on q·k: the mask's, or 1 / sqrt(head_dim).
double score_scale(const AttentionMask& mask, int64_t hd) {
  return mask.scale > 0 ? static_cast<double>(mask.scale)
                        : 1.0 / std::sqrt(static_cast<double>(hd));
}
// A scaled score through the softcap c (none where c is 0): c tanh(s / c).
double capped_score(double s, double cap) {
  return cap > 0 ? cap * std::tanh(s / cap) : s;
}

}  // namespace

void attention_forward(const TensorView& out, const TensorView& lse_stats, const TensorView& q,
                       const TensorView& k, const TensorView& v, AttentionMask mask) {
  const AttentionDims d = check_attention("attention_forward", out, lse_stats, q, k, v, mask);
  check_doc_start("attention_forward", mask.doc_start, d.batch, d.seq);
  const F32Input qf(q), kf(k), vf(v);
  const int64_t B = d.batch, T = d.seq, H = d.heads, Hkv = d.kv_heads, hd = d.head_dim;
  const int64_t Tk = d.keys(), shift = Tk - T;  // query t sits at position t + shift
  const int64_t group = H / Hkv;
  const double scale = score_scale(mask, hd), cap = mask.softcap;
  float* lse = f32(lse_stats);
  // One task row per (b, h, t), in lse_stats' [B, H, T] order. A row's arithmetic depends only
  // on its query and the keys it sees, so decoding's rows equal the whole sequence's bit for
  // bit.
  parallel_ranges(
      B * H * T, std::max<int64_t>(1, rows_grain(Tk * hd)), [&](int64_t i0, int64_t i1) {
        std::vector<double> scores(static_cast<size_t>(Tk)), acc(static_cast<size_t>(hd));
        for (int64_t i = i0; i < i1; ++i) {
          const int64_t t = i % T, h = (i / T) % H, b = i / (T * H), g = h / group;
          const int64_t last = t + shift;                        // the last key this query sees
          const int64_t first = mask.first_key(b, T, t, shift);  // and the first
          const float* qrow = qf.data() + ((b * T + t) * H + h) * hd;
          double m = -std::numeric_limits<double>::infinity();
          for (int64_t j = first; j <= last; ++j) {
            const float* krow = kf.data() + ((b * Tk + j) * Hkv + g) * hd;
            double dot = 0.0;
            for (int64_t e = 0; e < hd; ++e) dot += static_cast<double>(qrow[e]) * krow[e];
            const double s = capped_score(dot * scale, cap);
            scores[static_cast<size_t>(j)] = s;
            m = std::max(m, s);
          }
          double sum = 0.0;
          for (int64_t j = first; j <= last; ++j)
            sum += std::exp(scores[static_cast<size_t>(j)] - m);
          const double l = m + std::log(sum);
          lse[i] = static_cast<float>(l);
          std::fill(acc.begin(), acc.end(), 0.0);
          for (int64_t j = first; j <= last; ++j) {
            const double p = std::exp(scores[static_cast<size_t>(j)] - l);
            const float* vrow = vf.data() + ((b * Tk + j) * Hkv + g) * hd;
            for (int64_t e = 0; e < hd; ++e) acc[static_cast<size_t>(e)] += p * vrow[e];
          }
          const int64_t o = ((b * T + t) * H + h) * hd;
          for (int64_t e = 0; e < hd; ++e)
            put(out, o + e, static_cast<float>(acc[static_cast<size_t>(e)]));
        }
      });
}

AttentionDims check_attention_backward(const TensorView& dq, const TensorView& dk,
                                       const TensorView& dv, const TensorView& dout,
                                       const TensorView& q, const TensorView& k,
                                       const TensorView& v, const TensorView& out,
                                       const TensorView& lse_stats, AttentionMask mask) {
  const char* op = "attention_backward";
  const AttentionDims d = check_attention(op, out, lse_stats, q, k, v, mask);
  if (d.keys() != d.seq)
    fail(
        "{}: k is {} with {} positions but q is {} with {}; the backward takes whole sequences "
        "(as many keys as queries), not decoding's cached keys",
        op, k.str(), d.keys(), q.str(), d.seq);
  check_like(op, "dq", dq, "q", q);
  check_like(op, "dk", dk, "k", k);
  check_like(op, "dv", dv, "v", v);
  check_like(op, "dout", dout, "out", out);
  return d;
}

void attention_backward(const TensorView& dq, const TensorView& dk, const TensorView& dv,
                        const TensorView& dout, const TensorView& q, const TensorView& k,
                        const TensorView& v, const TensorView& out, const TensorView& lse_stats,
                        AttentionMask mask) {
  const AttentionDims d = check_attention_backward(dq, dk, dv, dout, q, k, v, out, lse_stats, mask);
  check_doc_start("attention_backward", mask.doc_start, d.batch, d.seq);
  const F32Input qf(q), kf(k), vf(v), dof(dout);
  const int64_t B = d.batch, T = d.seq, H = d.heads, Hkv = d.kv_heads, hd = d.head_dim;
  const int64_t group = H / Hkv;
  const double scale = score_scale(mask, hd), cap = mask.softcap;
  const float* lse = f32(lse_stats);
  // One task per (batch, kv head): it owns dk and dv of that head, summed over the query
  // heads of its group in a fixed order, and dq of those query heads.
  // With P = exp(s - lse), dP = dO·v, D = Σ P dP: ds = P (dP - D), dq = scale Σ ds k,
  // dk = scale Σ ds q, dv = Σ P dO. D is summed from P and dP rather than taken as dO·out,
  // so a rounded 16-bit `out` does not bias it. With a softcap c, s = c tanh(r / c) of the
  // scaled product r, and ds is multiplied by ds/dr = 1 - (s / c)^2.
  parallel_ranges(B * Hkv, 1, [&](int64_t i0, int64_t i1) {
    const auto tsz = static_cast<size_t>(T), hsz = static_cast<size_t>(hd);
    std::vector<double> p(tsz), dp(tsz), slope(tsz), dq_acc(hsz), dk_acc(tsz * hsz),
        dv_acc(tsz * hsz);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / Hkv, g = i % Hkv;
      std::fill(dk_acc.begin(), dk_acc.end(), 0.0);
      std::fill(dv_acc.begin(), dv_acc.end(), 0.0);
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        for (int64_t t = 0; t < T; ++t) {
          const int64_t qo = ((b * T + t) * H + h) * hd;
          const float* qrow = qf.data() + qo;
          const float* dorow = dof.data() + qo;
          const double l = lse[(b * H + h) * T + t];
          const int64_t first = mask.first_key(b, T, t);
          double D = 0.0;
          for (int64_t j = first; j <= t; ++j) {
            const int64_t ko = ((b * T + j) * Hkv + g) * hd;
            double s = 0.0, dpj = 0.0;
            for (int64_t e = 0; e < hd; ++e) {
              s += static_cast<double>(qrow[e]) * kf[ko + e];
              dpj += static_cast<double>(dorow[e]) * vf[ko + e];
            }
            const auto js = static_cast<size_t>(j);
            const double sc = capped_score(s * scale, cap);
            p[js] = std::exp(sc - l);
            slope[js] = cap > 0 ? 1.0 - (sc / cap) * (sc / cap) : 1.0;
            dp[js] = dpj;
            D += p[js] * dpj;
          }
          std::fill(dq_acc.begin(), dq_acc.end(), 0.0);
          for (int64_t j = first; j <= t; ++j) {
            const auto js = static_cast<size_t>(j);
            const int64_t ko = ((b * T + j) * Hkv + g) * hd;
            const double ds = p[js] * (dp[js] - D) * slope[js];
            for (int64_t e = 0; e < hd; ++e) {
              const auto je = js * hsz + static_cast<size_t>(e);
              dq_acc[static_cast<size_t>(e)] += ds * kf[ko + e];
              dk_acc[je] += scale * ds * qrow[e];
              dv_acc[je] += p[js] * dorow[e];
            }
          }
          for (int64_t e = 0; e < hd; ++e)
            put(dq, qo + e, static_cast<float>(scale * dq_acc[static_cast<size_t>(e)]));
        }
      }
      for (int64_t j = 0; j < T; ++j) {
        const int64_t ko = ((b * T + j) * Hkv + g) * hd;
        for (int64_t e = 0; e < hd; ++e) {
          const auto je = static_cast<size_t>(j) * hsz + static_cast<size_t>(e);
          put(dk, ko + e, static_cast<float>(dk_acc[je]));
          put(dv, ko + e, static_cast<float>(dv_acc[je]));
        }
      }
    }
  });
}

// ---------------------------------------------------------------------------------------
// glu, add, fill: elementwise; every element is read before it is written, so an output
// may alias an input.

namespace {

// The gate's activation and its derivative in f32, as torch's CPU kernels write them.
constexpr float kSqrtHalf = 0.70710678118654752f;    // 1 / sqrt(2)
constexpr float kInvSqrt2Pi = 0.39894228040143268f;  // 1 / sqrt(2 pi)
constexpr float kTanhBeta = 0.79788456080286536f;    // sqrt(2 / pi)
constexpr float kTanhKappa = 0.044715f;

float activation(Activation act, float g) {
  switch (act) {
    case Activation::silu:
      return g / (1.0f + std::exp(-g));
    case Activation::gelu:
      return g * 0.5f * (1.0f + std::erf(g * kSqrtHalf));
    case Activation::gelu_tanh:
      return 0.5f * g * (1.0f + std::tanh(kTanhBeta * (g + kTanhKappa * g * g * g)));
  }
  return 0.0f;
}

float activation_slope(Activation act, float g) {
  switch (act) {
    case Activation::silu: {  // σ(g) (1 + g (1 - σ(g)))
      const float sig = 1.0f / (1.0f + std::exp(-g));
      return sig * (1.0f + g * (1.0f - sig));
    }
    case Activation::gelu:  // Φ(g) + g φ(g)
      return 0.5f * (1.0f + std::erf(g * kSqrtHalf)) + g * std::exp(-0.5f * g * g) * kInvSqrt2Pi;
    case Activation::gelu_tanh: {
      const float t = std::tanh(kTanhBeta * (g + kTanhKappa * g * g * g));
      return 0.5f * (1.0f + t) +
             0.5f * g * ((1.0f - t * t) * kTanhBeta * (1.0f + 3.0f * kTanhKappa * g * g));
    }
  }
  return 0.0f;
}

}  // namespace

void glu_forward(const TensorView& h, const TensorView& gate, const TensorView& up,
                 Activation act) {
  const int64_t n = check_same_shape("glu_forward", {&h, &gate, &up});
  parallel_ranges(n, kGrainElements, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) put(h, i, activation(act, get(gate, i)) * get(up, i));
  });
}

int64_t check_glu_backward(const TensorView& dgate, const TensorView& dup, const TensorView& dh,
                           const TensorView& gate, const TensorView& up) {
  return check_same_shape("glu_backward", {&dgate, &dup, &dh, &gate, &up});
}

void glu_backward(const TensorView& dgate, const TensorView& dup, const TensorView& dh,
                  const TensorView& gate, const TensorView& up, Activation act) {
  const int64_t n = check_glu_backward(dgate, dup, dh, gate, up);
  parallel_ranges(n, kGrainElements, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const float g = get(gate, i), u = get(up, i), d = get(dh, i);
      put(dgate, i, d * u * activation_slope(act, g));
      put(dup, i, d * activation(act, g));
    }
  });
}

void add(const TensorView& out, const TensorView& a, const TensorView& b) {
  const int64_t n = check_same_shape("add", {&out, &a, &b});
  parallel_ranges(n, kGrainElements, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) put(out, i, get(a, i) + get(b, i));
  });
}

void fill(const TensorView& x, float value) {
  const int64_t n = check_same_shape("fill", {&x});
  if (x.dtype == DType::f32) {
    std::fill(f32(x), f32(x) + n, value);
    return;
  }
  const uint16_t bits = x.dtype == DType::bf16 ? f32_to_bf16(value) : f32_to_f16(value);
  std::fill(static_cast<uint16_t*>(x.data), static_cast<uint16_t*>(x.data) + n, bits);
}

void softcap(const TensorView& x, float cap) {
  const int64_t n = check_same_shape("softcap", {&x});
  check_softcap("softcap", cap, false);
  parallel_ranges(n, kGrainElements, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) put(x, i, cap * std::tanh(get(x, i) / cap));
  });
}

void broadcast_rows(const TensorView& y, const TensorView& b) {
  const RowDims d = check_bias("broadcast_rows", y, b);
  parallel_ranges(d.rows, rows_grain(d.cols), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      std::memcpy(
          static_cast<char*>(y.data) + static_cast<uint64_t>(r * d.cols) * dtype_size(y.dtype),
          b.data, static_cast<uint64_t>(d.cols) * dtype_size(y.dtype));
  });
}

void bias_backward(const TensorView& db, const TensorView& dy) {
  const RowDims d = check_bias("bias_backward", dy, db);
  // Blocks of columns on the threads; within one, every row in order into double sums.
  constexpr int64_t kColumns = 256;
  parallel_ranges((d.cols + kColumns - 1) / kColumns, 1, [&](int64_t b0, int64_t b1) {
    std::vector<double> sum(static_cast<size_t>(kColumns));
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t c0 = blk * kColumns, c1 = std::min(d.cols, c0 + kColumns);
      std::fill(sum.begin(), sum.end(), 0.0);
      for (int64_t r = 0; r < d.rows; ++r)
        for (int64_t c = c0; c < c1; ++c)
          sum[static_cast<size_t>(c - c0)] += get(dy, r * d.cols + c);
      for (int64_t c = c0; c < c1; ++c)
        put(db, c, static_cast<float>(get(db, c) + sum[static_cast<size_t>(c - c0)]));
    }
  });
}

// ---------------------------------------------------------------------------------------
// cross-entropy over vocabulary chunks

void xent_forward_chunk(const TensorView& logits, int64_t v0, const int32_t* targets,
                        const TensorView& row_max, const TensorView& row_sum,
                        const TensorView& target_logit) {
  const char* op = "xent_forward_chunk";
  const XentDims d = check_xent(op, logits, {&row_max, &row_sum, &target_logit});
  check_chunk_start(op, v0);
  check_targets(op, targets, d.rows);
  parallel_ranges(d.rows, rows_grain(d.chunk), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t base = r * d.chunk;
      double m = -std::numeric_limits<double>::infinity();
      for (int64_t j = 0; j < d.chunk; ++j) m = std::max<double>(m, get(logits, base + j));
      double s = 0.0;  // a NaN logit makes s, and so the row's loss, NaN
      for (int64_t j = 0; j < d.chunk; ++j) s += rescale(get(logits, base + j), m);
      const double old_m = f32(row_max)[r];
      const double new_m = std::max(old_m, m);
      f32(row_sum)[r] =
          static_cast<float>(f32(row_sum)[r] * rescale(old_m, new_m) + s * rescale(m, new_m));
      f32(row_max)[r] = static_cast<float>(new_m);
      const int64_t t = targets[r];
      if (t >= v0 && t < v0 + d.chunk) f32(target_logit)[r] = get(logits, base + t - v0);
    }
  });
}

XentDims check_xent_finish(const TensorView& losses, const TensorView& lse,
                           const TensorView& row_max, const TensorView& row_sum,
                           const TensorView& target_logit) {
  return check_xent("xent_finish", losses, {&lse, &row_max, &row_sum, &target_logit});
}

void xent_finish(const TensorView& losses, const TensorView& lse, const TensorView& row_max,
                 const TensorView& row_sum, const TensorView& target_logit,
                 const int32_t* targets) {
  const XentDims d = check_xent_finish(losses, lse, row_max, row_sum, target_logit);
  check_targets("xent_finish", targets, d.rows);
  for (int64_t r = 0; r < d.rows; ++r) {
    // Read row_max before writing lse: they may alias.
    const double l = static_cast<double>(f32(row_max)[r]) + std::log(f32(row_sum)[r]);
    const double target = f32(target_logit)[r];
    f32(lse)[r] = static_cast<float>(l);
    f32(losses)[r] = targets[r] == kIgnoreIndex ? 0.0f : static_cast<float>(l - target);
  }
}

void xent_backward_chunk(const TensorView& logits, int64_t v0, const int32_t* targets,
                         const TensorView& lse, float scale, float softcap) {
  const char* op = "xent_backward_chunk";
  const XentDims d = check_xent(op, logits, {&lse});
  check_chunk_start(op, v0);
  check_softcap(op, softcap, true);
  check_targets(op, targets, d.rows);
  parallel_ranges(d.rows, rows_grain(d.chunk), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t t = targets[r], base = r * d.chunk;
      const double l = f32(lse)[r];
      for (int64_t j = 0; j < d.chunk; ++j) {
        double g = 0.0;
        const double y = get(logits, base + j);
        if (t != kIgnoreIndex) g = scale * (std::exp(y - l) - (v0 + j == t ? 1.0 : 0.0));
        if (softcap > 0) g *= 1.0 - (y / softcap) * (y / softcap);
        put(logits, base + j, static_cast<float>(g));
      }
    }
  });
}

}  // namespace strata::host
