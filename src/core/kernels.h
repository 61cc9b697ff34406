// kernels.h: the kernel table (DESIGN §4), every forward/backward op the Llama model needs,
// and the optimizer's update for when its home is the device.
//
// Each Device returns one Kernels (Device::kernels()). The host backend runs the plain C++
// reference ops of src/host/ops.h as host tasks in stream order; the CUDA backend launches
// its kernels (src/gpu/) and cuBLASLt on the stream. Both must compute the same thing: the
// host backend is the oracle every CUDA op is tested against.
//
// Conventions, for every op:
// - Tensors are dense, row-major views into the memory of the device that owns this table.
//   Token ids and targets are int32 arrays in that same device memory.
// - Float tensors are f32 or bf16 (the host also accepts f16; both backends accept it for the
//   optimizer's gradient and parameter copy). Arithmetic is f32; every
//   store into a 16-bit tensor rounds to nearest even. Tensors named *_stats (rstd, lse,
//   row_max, row_sum, target_logit, losses) are always f32.
// - "+=" outputs accumulate into what is there (the caller zero-fills first); "=" outputs
//   overwrite, and their old contents (even NaN) are ignored.
// - Shapes are checked before anything is queued, by the check_* functions below, which
//   both backends share: a mismatch throws Error naming the op, the tensor and its shape.
// - Ids and targets are not range-checked here: the data loader checks them on the host
//   (an id >= vocab is an error naming its position there). A target of -100 is ignored.
#pragma once

#include "core/optimizer.h"
#include "core/tensor.h"

#include <cstdint>

namespace strata {

class Stream;

// The rows of the whole embedding table that a `table` operand holds: the ids
// [first, first + its rows) of a vocabulary of `vocab` ids (0: the operand's rows, the whole
// table). A vocabulary piece (ModelLayout's pieces of a large embedding) skips the ids outside
// it: its forward sets their rows of out to 0 when zero_others (the first piece), else leaves
// them (the others'), and its backward adds nothing for them.
struct TableRows {
  int64_t first = 0;
  int64_t vocab = 0;
  bool zero_others = true;
};

namespace cpu_adam {
struct StepConstants;  // cpu_adam/kernels.h
}  // namespace cpu_adam

// Ids of ignored target positions, as in PyTorch's cross_entropy(ignore_index=-100).
inline constexpr int32_t kIgnoreIndex = -100;

// The activation of the MLP's gate (Kernels::glu_forward): SiLU (Llama's SwiGLU), GELU with
// erf (torch's gelu) or its tanh approximation (torch's gelu(approximate="tanh"), Gemma's
// GeGLU).
enum class Activation : uint8_t { silu, gelu, gelu_tanh };
const char* activation_name(Activation a);  // "silu", "gelu", "gelu_pytorch_tanh"

// Which keys a query sees besides the causal rule (Kernels::attention_forward): those of its own
// packed document (doc_start, device memory, or null for one document a sequence) and, with a
// sliding window (window > 0, Mistral's), the last `window` positions, itself included. Query t
// of sequence b, at position t + shift (shift = Tk - T, the cached keys before the queries when
// decoding), sees keys first_key(b, T, t, shift) .. t + shift. Built from a doc_start pointer
// alone where a call has no window, so the callers that pack documents pass their pointer as
// before.
// And how a score is formed, where a model departs from Llama's q·k / sqrt(head_dim) (Gemma 2):
// `scale` multiplies q·k (0: 1 / sqrt(head_dim)), and softcap > 0 then passes the scaled score
// s through softcap · tanh(s / softcap).
struct AttentionMask {
  const int32_t* doc_start = nullptr;
  int64_t window = 0;
  float scale = 0.0f;
  float softcap = 0.0f;
  AttentionMask(const int32_t* starts = nullptr, int64_t w = 0, float scale_ = 0.0f,
                float softcap_ = 0.0f)  // NOLINT: implicit on purpose
      : doc_start(starts), window(w), scale(scale_), softcap(softcap_) {}
  // For host memory: max(the document's start, t + shift - window + 1).
  int64_t first_key(int64_t b, int64_t seq, int64_t t, int64_t shift = 0) const {
    const int64_t doc = doc_start != nullptr ? doc_start[b * seq + t] : 0;
    const int64_t p = t + shift;
    return window > 0 && p - window + 1 > doc ? p - window + 1 : doc;
  }
};

class Kernels {
 public:
  virtual ~Kernels() = default;

  // Allocates now what ops on `s` would otherwise allocate on first use (CUDA: the stream's
  // workspace, a cudaMalloc that waits for the whole GPU, collectives in flight included), so
  // that nothing is allocated while a schedule's streams run. Optional; the host needs nothing.
  virtual void prepare(Stream& /*s*/) {}

  // c = alpha * op(a) · op(b) + beta * c, all rank 2. op(a) is [m,k]: a is [m,k], or [k,m]
  // read transposed when trans_a. op(b) is [k,n]: b is [k,n], or [n,k] when trans_b. a and b
  // have one dtype; c has that dtype or f32 (bf16 inputs, f32 gradient accumulators).
  // beta == 0 ignores c's contents. A linear layer y = x·Wᵀ (W [out,in], as Hugging Face
  // stores it) is matmul(y, x, false, W, true, 1, 0); dx = dy·W; dW += dyᵀ·x.
  virtual void matmul(const TensorView& c, const TensorView& a, bool trans_a, const TensorView& b,
                      bool trans_b, float alpha, float beta, Stream& s) = 0;

  // out[n,:] = table[ids[n],:] * scale. out [N,D], table [V,D]. scale is 1 but for Gemma,
  // which multiplies its embeddings by sqrt(hidden_size) rounded to the activations' dtype; the
  // product is rounded once, as torch rounds it. `rows`: which ids the table holds (TableRows).
  virtual void embedding_forward(const TensorView& out, const TensorView& table, const int32_t* ids,
                                 float scale, const TableRows& rows, Stream& s) = 0;
  // dtable[ids[n],:] += dout[n,:] * scale, each product rounded to dout's dtype first (as
  // torch's backward of the multiplication rounds it; exact when scale is 1). dtable [V,D] (f32
  // or dout's dtype), dout [N,D].
  virtual void embedding_backward(const TensorView& dtable, const TensorView& dout,
                                  const int32_t* ids, float scale, const TableRows& rows,
                                  Stream& s) = 0;

  // y = x * rstd * (w + weight_offset) with rstd[n] = 1 / sqrt(mean_d(x[n,d]^2) + eps), in f32
  // and rounded once. x, y [N,D]; w [D]; rstd_stats [N] (kept for backward). weight_offset is
  // 0, or 1 for Gemma, whose norms store the weight's difference from 1.
  virtual void rmsnorm_forward(const TensorView& y, const TensorView& rstd_stats,
                               const TensorView& x, const TensorView& w, float eps,
                               float weight_offset, Stream& s) = 0;
  // dx += ∂L/∂x and dw += ∂L/∂w, from dy and the forward's x, w, rstd_stats, weight_offset.
  virtual void rmsnorm_backward(const TensorView& dx, const TensorView& dw, const TensorView& dy,
                                const TensorView& x, const TensorView& w,
                                const TensorView& rstd_stats, float weight_offset, Stream& s) = 0;

  // Rotary embedding in place, Hugging Face's rotate-half layout: x [N, heads, head_dim],
  // token n at position n % seq_len; cos_sin [seq_len, R] (f32; R = head_dim, or for a partial
  // rotation as Phi-4-mini's fewer, even) holds the cosines of positions' angles in columns
  // [0, R/2) and the sines in [R/2, R). For i < h = R/2:
  // x'[i] = x[i]·c[i] - x[i+h]·s[i];  x'[i+h] = x[i+h]·c[i] + x[i]·s[i]; x[R..head_dim) unchanged.
  // inverse = true rotates by minus the angle: the backward of the forward (dx from dx').
  virtual void rope(const TensorView& x, const TensorView& cos_sin, int64_t seq_len, bool inverse,
                    Stream& s) = 0;

  // Causal attention with grouped-query heads: q [B,T,H,hd], k and v [B,Tk,Hkv,hd] with
  // Tk >= T, out [B,T,H,hd], H a multiple of Hkv, all four of one dtype; query head h reads kv
  // head h / (H / Hkv). Scores scale 1/sqrt(hd). The queries are the last T of the Tk
  // positions: query t sits at position t + Tk - T and attends to keys 0..t + Tk - T of its
  // own sequence (Tk = T in training; Tk > T when decoding new tokens against cached keys and
  // values). Each query row's output is the same function of its visible keys whatever T is.
  // lse_stats [B,H,T] holds each row's log-sum-exp of the scaled scores (kept for backward).
  // doc_start: null, or int32 [B*T] in the device's memory (as ids are), for several documents
  // packed into each sequence (Tk = T only): doc_start[b*T + t] is the position of the first
  // token of query t's document, and query t attends to keys doc_start[b*T + t] .. t alone, so
  // each document's rows are what the document alone would give. Documents are contiguous:
  // doc_start[b*T] = 0 and doc_start[b*T + t] is t (a new document) or doc_start[b*T + t - 1].
  // The host backend checks that rule; the CUDA kernels rely on it. mask.window > 0 (a sliding
  // window, Mistral's) also hides the keys before position p - window + 1 from the query at
  // position p, in training and decoding alike. mask.scale and mask.softcap replace the scores'
  // 1/sqrt(hd) and cap them (Gemma 2's query_pre_attn_scalar and attn_logit_softcapping); lse
  // is then over the capped scores. On CUDA the tensor-core paths take plain scores only: other
  // calls run the SIMT path.
  // `mask` converts from a plain doc_start pointer.
  virtual void attention_forward(const TensorView& out, const TensorView& lse_stats,
                                 const TensorView& q, const TensorView& k, const TensorView& v,
                                 AttentionMask mask, Stream& s) = 0;
  // dq, dk, dv (shapes of q, k, v) = the gradients, from dout and the forward's q, k, v, out,
  // lse_stats and the same mask. Training's shapes only: Tk = T.
  virtual void attention_backward(const TensorView& dq, const TensorView& dk, const TensorView& dv,
                                  const TensorView& dout, const TensorView& q, const TensorView& k,
                                  const TensorView& v, const TensorView& out,
                                  const TensorView& lse_stats, AttentionMask mask, Stream& s) = 0;

  // The gated MLP's activation: h = act(gate) * up, all [N,F]. silu(x) = x / (1 + exp(-x))
  // (SwiGLU); gelu(x) = x/2 (1 + erf(x / sqrt 2)); gelu_tanh(x) = x/2 (1 + tanh(sqrt(2/pi)
  // (x + 0.044715 x^3))) (GeGLU as Gemma computes it). In f32, rounded once.
  virtual void glu_forward(const TensorView& h, const TensorView& gate, const TensorView& up,
                           Activation act, Stream& s) = 0;
  // dgate, dup = the gradients of h = act(gate) * up, from dh.
  virtual void glu_backward(const TensorView& dgate, const TensorView& dup, const TensorView& dh,
                            const TensorView& gate, const TensorView& up, Activation act,
                            Stream& s) = 0;

  // out = a + b, same shapes; out may be a or b (the residual add, in place).
  virtual void add(const TensorView& out, const TensorView& a, const TensorView& b, Stream& s) = 0;
  // Every element of x = value (e.g. -inf for the cross-entropy running maximum).
  virtual void fill(const TensorView& x, float value, Stream& s) = 0;
  // In place, x = cap · tanh(x / cap) (cap > 0): Gemma 2's final_logit_softcapping, on a chunk
  // of logits before the cross-entropy or sampling reads it.
  virtual void softcap(const TensorView& x, float cap, Stream& s) = 0;

  // A projection's bias (Hugging Face's Linear with bias=True): y[n,:] = b, y [N,C], b [C] of
  // y's dtype. The matmul that follows with beta = 1 adds x·Wᵀ to it in f32, so y is rounded
  // once, as torch's addmm rounds it.
  virtual void broadcast_rows(const TensorView& y, const TensorView& b, Stream& s) = 0;
  // The bias's gradient: db[c] += Σ_n dy[n,c], summed in double in row order. db [C] (f32 or
  // dy's dtype), dy [N,C].
  virtual void bias_backward(const TensorView& db, const TensorView& dy, Stream& s) = 0;

  // Softmax cross-entropy over the vocabulary in chunks, so the [N, vocab] logits never
  // exist at once. `logits` [N, C] are columns [v0, v0+C) of the full logits. Folds the chunk
  // into each row's online softmax state, all [N] f32: row_max (start at -inf), row_sum
  // (start at 0; the sum of exp(logit - row_max)) and target_logit (the logit of targets[n]
  // when it lies in this chunk). Rows whose target is kIgnoreIndex are folded too (harmless).
  virtual void xent_forward_chunk(const TensorView& logits, int64_t v0, const int32_t* targets,
                                  const TensorView& row_max, const TensorView& row_sum,
                                  const TensorView& target_logit, Stream& s) = 0;
  // After the last chunk: lse[n] = row_max + log(row_sum); losses[n] = lse[n] - target_logit[n],
  // or 0 where targets[n] is kIgnoreIndex. All [N] f32; lse may alias row_max.
  virtual void xent_finish(const TensorView& losses, const TensorView& lse,
                           const TensorView& row_max, const TensorView& row_sum,
                           const TensorView& target_logit, const int32_t* targets, Stream& s) = 0;
  // In place, on the same chunk's logits recomputed: logits = scale * (softmax - onehot), i.e.
  // scale * (exp(logit - lse[n]) - [v0 + j == targets[n]]), and 0 on ignored rows. With
  // softcap > 0 the logits given are softcap(x, cap)'s output y, and the gradient goes on back
  // to its input: times 1 - (y / cap)^2.
  virtual void xent_backward_chunk(const TensorView& logits, int64_t v0, const int32_t* targets,
                                   const TensorView& lse, float scale, float softcap,
                                   Stream& s) = 0;

  // ---- the optimizer, where its home is this device (DESIGN §2) ----
  // One step of the optimizer k.type (Adam/AdamW, Lion or Adagrad), elementwise over master, m,
  // v (f32 [n]) with grad [n] (f32, bf16 or f16): the IEEE operations of cpu_adam/formula.h in
  // the same order (no contraction), so master, m and v get exactly CpuAdam::update's bits. A
  // moment the type does not keep (core/optimizer.h: Lion's v, Adagrad's m) is neither checked
  // nor touched; pass an empty view. param_copy, unless its data is null,
  // receives the updated master in its dtype (f32, bf16 or f16, rounded to nearest even).
  // `k` comes from cpu_adam::step_constants(step, params, grad_scale) (exposed in cpu_adam.h).
  virtual void adam_update(const TensorView& master, const TensorView& m, const TensorView& v,
                           const TensorView& grad, const TensorView& param_copy,
                           const cpu_adam::StepConstants& k, Stream& s) = 0;
  // For each chunk c of CpuAdam::kStatsChunk elements of grad (f32, bf16, f16), its sum of
  // squares in double exactly as CpuAdam::grad_stats sums a chunk (the same lanes, the same
  // order), into chunk_sums[c] (this device's memory, cpu_adam::chunk_count(n, kStatsChunk)
  // doubles). Adding them in chunk order on the host gives grad_stats' bits; a non-finite sum
  // means a non-finite element.
  virtual void grad_chunk_sums(const TensorView& grad, double* chunk_sums, Stream& s) = 0;
};

// ---- shape checks shared by both backends (src/core/kernels.cpp) ----
// Each returns the op's sizes, or throws Error naming the op, the tensor and the shapes.

struct MatmulDims {
  int64_t m = 0, n = 0, k = 0;
};
MatmulDims check_matmul(const TensorView& c, const TensorView& a, bool trans_a, const TensorView& b,
                        bool trans_b);

struct RowDims {  // N rows of D elements
  int64_t rows = 0, cols = 0;
};
// `piece`: which ids the table holds; its range must lie in [0, vocab).
RowDims check_embedding(const char* op, const TensorView& rows, const TensorView& table,
                        const TableRows& piece = {});
// The vocabulary a table of `piece` belongs to: piece.vocab, or the table's rows.
inline int64_t table_vocab(const TensorView& table, const TableRows& piece) {
  return piece.vocab > 0 ? piece.vocab : table.shape[0];
}
// broadcast_rows and bias_backward: rows [N, C] and bias [C] (f32 or rows' dtype in the
// backward; rows' dtype forward).
RowDims check_bias(const char* op, const TensorView& rows, const TensorView& bias);
RowDims check_rmsnorm(const char* op, const TensorView& y, const TensorView& rstd_stats,
                      const TensorView& x, const TensorView& w);

struct RopeDims {
  int64_t tokens = 0, heads = 0, head_dim = 0;
  int64_t rotary = 0;  // the dimensions rotated: the table's width (head_dim, or fewer)
};
RopeDims check_rope(const TensorView& x, const TensorView& cos_sin, int64_t seq_len);

struct AttentionDims {
  int64_t batch = 0, seq = 0, heads = 0, kv_heads = 0, head_dim = 0;
  int64_t kv_seq = -1;  // Tk, the keys' positions; -1 means seq (every backward)
  // The documents packed into each sequence (Kernels::attention_forward), or null for one.
  const int32_t* doc_start = nullptr;
  int64_t window = 0;  // AttentionMask::window
  // AttentionMask::scale and softcap as given (0: 1 / sqrt(head_dim), and no cap).
  float scale = 0.0f, softcap = 0.0f;
  int64_t keys() const { return kv_seq < 0 ? seq : kv_seq; }
  // Whether the scores are Llama's plain q·k / sqrt(head_dim).
  bool plain_scores() const { return scale == 0.0f && softcap == 0.0f; }
};
// doc_start needs Tk = T (a decoding call packs no documents); a window slides either way.
AttentionDims check_attention(const char* op, const TensorView& out, const TensorView& lse_stats,
                              const TensorView& q, const TensorView& k, const TensorView& v,
                              AttentionMask mask = {});
// doc_start's rule (Kernels::attention_forward) over host memory; an Error naming the op, the
// sequence and the position that breaks it.
void check_doc_start(const char* op, const int32_t* doc_start, int64_t batch, int64_t seq);

// Same element count and shape for every non-null view (glu, add).
int64_t check_same_shape(const char* op, std::initializer_list<const TensorView*> views);

struct XentDims {
  int64_t rows = 0, chunk = 0;
};
// `logits` [N, C]; each stats view [N] f32. xent_finish, which has no logits, passes its
// `losses` [N] f32 as `logits` (chunk 0).
// A vocabulary chunk's first column: refused when negative (a target would be read from the
// wrong column).
void check_chunk_start(const char* op, int64_t v0);
// softcap's and xent_backward_chunk's cap: positive and finite (or 0 where `zero_ok`).
void check_softcap(const char* op, float cap, bool zero_ok);
XentDims check_xent(const char* op, const TensorView& logits,
                    std::initializer_list<const TensorView*> stats);

// adam_update: master and the moments `type` keeps f32 of one shape, grad of that shape, and
// param_copy too unless its data is null (then it is ignored). Returns the element count n.
int64_t check_adam_update(const TensorView& master, const TensorView& m, const TensorView& v,
                          const TensorView& grad, const TensorView& param_copy, OptimizerType type);
// grad_chunk_sums: returns the number of chunks, i.e. of doubles chunk_sums must hold (a null
// chunk_sums is refused unless that is 0).
int64_t check_grad_chunk_sums(const TensorView& grad, const double* chunk_sums);

}  // namespace strata
