// kernels.cpp: the shape and dtype checks every backend runs before it queues an op.
//
// Both backends call these at enqueue time, so a caller learns of a bad shape at the call
// that caused it, with the same message on either backend. Each message names the op, the
// tensor (by its parameter name in core/kernels.h), its shape and dtype, and the shape that
// was expected. The check functions of ops with a forward and a backward serve both: for a
// backward op the roles are named by both names ("y/dx/dy"), since the views passed there are
// the gradients' counterparts of the forward's tensors.
#include "core/kernels.h"

#include "core/error.h"
#include "cpu_adam/cpu_adam.h"

#include <cmath>
#include <string>
#include <string_view>
#include <utility>

namespace strata {
namespace {

bool is_backward(const char* op) {
  return std::string_view(op).find("backward") != std::string_view::npos;
}

std::string dims(std::initializer_list<int64_t> d) {
  return Shape(d).str();
}

// Every tensor an op reads or writes: a known float dtype, and data unless it is empty.
void check_float(const char* op, std::string_view name, const TensorView& t) {
  if (static_cast<unsigned>(t.dtype) > static_cast<unsigned>(DType::f16))
    fail("{}: {} has an unknown dtype (code {}); use f32, bf16 or f16", op, name,
         static_cast<unsigned>(t.dtype));
  if (t.data == nullptr && t.numel() > 0)
    fail("{}: {} {} has no data (null pointer); pass allocated memory", op, name, t.str());
}

void check_rank(const char* op, std::string_view name, const TensorView& t, int rank,
                std::string_view expected) {
  check_float(op, name, t);
  if (t.shape.rank != rank)
    fail("{}: {} is {}, of rank {}; expected rank {} ({}); pass a tensor of that shape", op, name,
         t.str(), t.shape.rank, rank, expected);
}

void check_shape(const char* op, std::string_view name, const TensorView& t, const Shape& want,
                 std::string_view meaning) {
  check_float(op, name, t);
  if (!(t.shape == want))
    fail("{}: {} is {}; expected {} ({}); pass a tensor of that shape", op, name, t.str(),
         want.str(), meaning);
}

// *_stats tensors are f32 whatever the activations' dtype: they feed exp/log in backward.
void check_stats(const char* op, std::string_view name, const TensorView& t, const Shape& want,
                 std::string_view meaning) {
  check_shape(op, name, t, want, meaning);
  if (t.dtype != DType::f32)
    fail("{}: {} is {}; statistics are always f32; allocate it as f32{}", op, name, t.str(),
         want.str());
}

}  // namespace

const char* activation_name(Activation a) {
  switch (a) {
    case Activation::silu:
      return "silu";
    case Activation::gelu:
      return "gelu";
    case Activation::gelu_tanh:
      return "gelu_pytorch_tanh";
  }
  return "unknown";
}

MatmulDims check_matmul(const TensorView& c, const TensorView& a, bool trans_a, const TensorView& b,
                        bool trans_b) {
  const char* op = "matmul";
  check_rank(op, "a", a, 2, trans_a ? "[k, m], read transposed" : "[m, k]");
  check_rank(op, "b", b, 2, trans_b ? "[n, k], read transposed" : "[k, n]");
  check_rank(op, "c", c, 2, "[m, n]");
  MatmulDims d;
  d.m = trans_a ? a.shape[1] : a.shape[0];
  d.k = trans_a ? a.shape[0] : a.shape[1];
  d.n = trans_b ? b.shape[0] : b.shape[1];
  const int64_t kb = trans_b ? b.shape[1] : b.shape[0];
  if (kb != d.k)
    fail(
        "matmul: b is {}{}; expected {} to match a {}{} (k = {}); pass operands whose inner "
        "dimensions agree",
        b.str(), trans_b ? " (transposed)" : "", trans_b ? dims({d.n, d.k}) : dims({d.k, d.n}),
        a.str(), trans_a ? " (transposed)" : "", d.k);
  check_shape(op, "c", c, Shape{d.m, d.n},
              fmt::format("[m, n] of op(a) {} times op(b) {}", dims({d.m, d.k}), dims({d.k, d.n})));
  if (a.dtype != b.dtype)
    fail("matmul: a is {} but b is {}; the operands must share one dtype; convert one of them",
         a.str(), b.str());
  if (c.dtype != a.dtype && c.dtype != DType::f32)
    fail("matmul: c is {} with operands of {}; c must be {} or f32; allocate c as one of those",
         c.str(), dtype_name(a.dtype), dtype_name(a.dtype));
  return d;
}

RowDims check_embedding(const char* op, const TensorView& rows, const TensorView& table,
                        const TableRows& piece) {
  const bool backward = is_backward(op);
  const char* rows_name = backward ? "dout" : "out";
  const char* table_name = backward ? "dtable" : "table";
  check_rank(op, table_name, table, 2, "[vocab, dim]");
  check_rank(op, rows_name, rows, 2, "[tokens, dim]");
  if (rows.shape[1] != table.shape[1])
    fail("{}: {} is {}; expected {} (one row of {}'s width {} per token, {} is {})", op, rows_name,
         rows.str(), dims({rows.shape[0], table.shape[1]}), table_name, table.shape[1], table_name,
         table.str());
  if (backward && table.dtype != DType::f32 && table.dtype != rows.dtype)
    fail("{}: dtable is {} with dout {}; dtable must be f32 or dout's dtype; allocate it so", op,
         table.str(), rows.str());
  if (piece.first < 0 || piece.vocab < 0 ||
      piece.first + table.shape[0] > table_vocab(table, piece))
    fail(
        "{}: {} {} holds ids [{}, {}), outside the vocabulary of {}; the piece's rows must lie "
        "in the table",
        op, table_name, table.str(), piece.first, piece.first + table.shape[0],
        table_vocab(table, piece));
  return {rows.shape[0], rows.shape[1]};
}

RowDims check_bias(const char* op, const TensorView& rows, const TensorView& bias) {
  const bool backward = is_backward(op);
  const char* rows_name = backward ? "dy" : "y";
  const char* bias_name = backward ? "db" : "b";
  check_rank(op, rows_name, rows, 2, "[tokens, features]");
  check_shape(op, bias_name, bias, Shape{rows.shape[1]},
              fmt::format("one element per column of {} {}", rows_name, rows.str()));
  if (backward ? bias.dtype != DType::f32 && bias.dtype != rows.dtype : bias.dtype != rows.dtype)
    fail("{}: {} is {} with {} {}; it must be {}; allocate it so", op, bias_name, bias.str(),
         rows_name, rows.str(), backward ? "f32 or dy's dtype" : "y's dtype");
  return {rows.shape[0], rows.shape[1]};
}

RowDims check_rmsnorm(const char* op, const TensorView& y, const TensorView& rstd_stats,
                      const TensorView& x, const TensorView& w) {
  const bool backward = is_backward(op);
  check_rank(op, "x", x, 2, "[tokens, dim]");
  const int64_t n = x.shape[0], d = x.shape[1];
  check_shape(op, backward ? "dx/dy" : "y", y, x.shape, fmt::format("the shape of x {}", x.str()));
  check_shape(op, backward ? "w/dw" : "w", w, Shape{d},
              fmt::format("one weight per column of x {}", x.str()));
  check_stats(op, "rstd_stats", rstd_stats, Shape{n}, fmt::format("one per row of x {}", x.str()));
  return {n, d};
}

RopeDims check_rope(const TensorView& x, const TensorView& cos_sin, int64_t seq_len) {
  const char* op = "rope";
  check_rank(op, "x", x, 3, "[tokens, heads, head_dim]");
  check_rank(op, "cos_sin", cos_sin, 2, "[seq_len, rotated dimensions]");
  const RopeDims r{x.shape[0], x.shape[1], x.shape[2], cos_sin.shape[1]};
  if (r.head_dim % 2 != 0 || r.head_dim == 0)
    fail("rope: x is {}; head_dim {} must be even and positive (rotate-half pairs i, i + {})",
         x.str(), r.head_dim, r.head_dim / 2);
  if (r.rotary % 2 != 0 || r.rotary <= 0 || r.rotary > r.head_dim)
    fail(
        "rope: cos_sin is {}; its width, the dimensions rotated, must be even, positive and at "
        "most head_dim {} (x {})",
        cos_sin.str(), r.head_dim, x.str());
  if (seq_len <= 0)
    fail("rope: seq_len is {}; pass the sequence length (> 0) that x's tokens repeat with",
         seq_len);
  check_stats(op, "cos_sin", cos_sin, Shape{seq_len, r.rotary},
              fmt::format("[seq_len {}, rotated {}]: cosines, then sines", seq_len, r.rotary));
  return r;
}

AttentionDims check_attention(const char* op, const TensorView& out, const TensorView& lse_stats,
                              const TensorView& q, const TensorView& k, const TensorView& v,
                              AttentionMask mask) {
  const int32_t* doc_start = mask.doc_start;
  check_rank(op, "q", q, 4, "[batch, seq, heads, head_dim]");
  check_rank(op, "k", k, 4, "[batch, seq, kv_heads, head_dim]");
  AttentionDims d{q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.shape[3], k.shape[1]};
  const std::string kv_meaning =
      fmt::format("[batch, seq, kv_heads, head_dim] matching q {}", q.str());
  if (d.kv_seq < d.seq)
    fail(
        "{}: k is {} with {} positions but q is {} with {}; the queries are the last of the "
        "keys' positions, so k and v need at least as many",
        op, k.str(), d.kv_seq, q.str(), d.seq);
  check_shape(op, "k", k, Shape{d.batch, d.kv_seq, d.kv_heads, d.head_dim}, kv_meaning);
  check_shape(op, "v", v, k.shape, kv_meaning);
  check_shape(op, "out", out, q.shape, fmt::format("the shape of q {}", q.str()));
  if (d.kv_heads == 0 || d.heads % d.kv_heads != 0)
    fail(
        "{}: q is {} with {} heads and k is {} with {} kv heads; the heads must be a positive "
        "multiple of the kv heads (grouped-query attention)",
        op, q.str(), d.heads, k.str(), d.kv_heads);
  if (d.head_dim == 0) fail("{}: q is {}; head_dim must be positive", op, q.str());
  // One dtype for the four, as both backends' kernels read them with one element type.
  for (const auto& [name, t] :
       {std::pair<const char*, const TensorView*>{"k", &k}, {"v", &v}, {"out", &out}})
    if (t->dtype != q.dtype)
      fail("{}: {} is {} but q is {}; q, k, v and out must share one dtype; convert them", op, name,
           t->str(), q.str());
  check_stats(op, "lse_stats", lse_stats, Shape{d.batch, d.heads, d.seq},
              "[batch, heads, seq]: one log-sum-exp per query row");
  if (doc_start != nullptr && d.kv_seq != d.seq)
    fail(
        "{}: doc_start is given with {} queries against {} keys; documents are packed into "
        "whole sequences only (as many keys as queries), not into decoding's cached keys",
        op, d.seq, d.kv_seq);
  if (mask.window < 0)
    fail("{}: the sliding window is {} positions; it is 0 (none) or a positive count", op,
         mask.window);
  for (const auto& [name, value] : {std::pair{"scale", mask.scale}, {"softcap", mask.softcap}})
    if (!(value >= 0.0f) || !std::isfinite(value))
      fail("{}: the scores' {} is {}; it is 0 (the default) or a positive finite number", op, name,
           value);
  d.doc_start = doc_start;
  d.window = mask.window;
  d.scale = mask.scale;
  d.softcap = mask.softcap;
  return d;
}

void check_doc_start(const char* op, const int32_t* doc_start, int64_t batch, int64_t seq) {
  if (doc_start == nullptr) return;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t t = 0; t < seq; ++t) {
      const int32_t first = doc_start[b * seq + t];
      const int32_t before = t > 0 ? doc_start[b * seq + t - 1] : 0;
      if (first != t && first != before)
        fail(
            "{}: doc_start of sequence {} at position {} is {}; each position's document starts "
            "there ({}) or where the previous position's does ({}), and the first at 0",
            op, b, t, first, t, before);
    }
}

int64_t check_same_shape(const char* op, std::initializer_list<const TensorView*> views) {
  const TensorView* first = nullptr;
  for (const TensorView* t : views) {
    if (t == nullptr) continue;
    check_float(op, "a tensor", *t);
    if (first == nullptr) {
      first = t;
    } else if (!(t->shape == first->shape)) {
      std::string all;
      for (const TensorView* u : views)
        if (u != nullptr) all += (all.empty() ? "" : ", ") + u->str();
      fail("{}: tensors differ in shape: {} is not {} (all: {}); give them one shape", op, t->str(),
           first->shape.str(), all);
    }
  }
  return first == nullptr ? 0 : first->numel();
}

void check_softcap(const char* op, float cap, bool zero_ok) {
  if (!std::isfinite(cap) || cap < 0.0f || (cap == 0.0f && !zero_ok))
    fail("{}: softcap = {}; it is a positive finite cap{}", op, cap,
         zero_ok ? ", or 0 for uncapped logits" : "");
}

void check_chunk_start(const char* op, int64_t v0) {
  if (v0 < 0) fail("{}: v0 = {} is negative; pass the chunk's first vocabulary column", op, v0);
}

XentDims check_xent(const char* op, const TensorView& logits,
                    std::initializer_list<const TensorView*> stats) {
  XentDims d;
  if (logits.shape.rank == 1) {
    // xent_finish has no logits: it passes one of its [N] f32 views here (chunk 0).
    check_stats(op, "losses", logits, Shape{logits.shape[0]}, "[rows]");
    d.rows = logits.shape[0];
  } else {
    check_rank(op, "logits", logits, 2, "[rows, chunk]");
    d.rows = logits.shape[0];
    d.chunk = logits.shape[1];
  }
  const std::string meaning = fmt::format("one per row of {}", logits.str());
  for (const TensorView* t : stats)
    if (t != nullptr) check_stats(op, "a row statistic", *t, Shape{d.rows}, meaning);
  return d;
}

int64_t check_adam_update(const TensorView& master, const TensorView& m, const TensorView& v,
                          const TensorView& grad, const TensorView& param_copy,
                          OptimizerType type) {
  const char* op = "adam_update";
  const std::string meaning = fmt::format("the shape of master {}", master.str());
  for (const auto& [name, t] :
       {std::pair<const char*, const TensorView*>{"master", &master}, {"m", &m}, {"v", &v}}) {
    if ((t == &m && !optimizer_keeps_m(type)) || (t == &v && !optimizer_keeps_v(type))) continue;
    check_shape(op, name, *t, master.shape, meaning);
    if (t->dtype != DType::f32)
      fail("{}: {} is {}; the optimizer state (master, m, v) is always f32; allocate it as f32", op,
           name, t->str());
  }
  check_shape(op, "grad", grad, master.shape, meaning);
  if (param_copy.data != nullptr) check_shape(op, "param_copy", param_copy, master.shape, meaning);
  return master.numel();
}

int64_t check_grad_chunk_sums(const TensorView& grad, const double* chunk_sums) {
  const char* op = "grad_chunk_sums";
  check_float(op, "grad", grad);
  const auto chunks = static_cast<int64_t>(
      cpu_adam::chunk_count(static_cast<size_t>(grad.numel()), CpuAdam::kStatsChunk));
  if (chunks > 0 && chunk_sums == nullptr)
    fail(
        "{}: chunk_sums is null for grad {}; pass device memory for {} doubles (one per chunk of "
        "{} elements)",
        op, grad.str(), chunks, CpuAdam::kStatsChunk);
  return chunks;
}

}  // namespace strata
