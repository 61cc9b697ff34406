// llama.h: the Llama model as units of flat parameter buffers, and its forward and backward
// over the kernel table (DESIGN §1-§4).
//
// Units are the embedding, each transformer block, and the final norm plus the LM head (a large
// embedding and head each in several units: vocabulary pieces, below). Each
// unit's parameters live in one flat buffer (the shape that partitioning and offload move
// around); a ParamSlot says where each Hugging Face tensor sits inside it. With tied word
// embeddings the head unit holds only the final norm and reads (and accumulates gradients
// into) the embedding unit's table (ModelLayout::table_unit).
//
// LlamaModel runs on one Device. It does not own parameters or gradients: the caller hands
// each call the unit buffers it should use (gathered shards, later), so the same code serves
// eval, tests, and the trainer. Activation checkpointing is at unit granularity: forward keeps
// only each unit's input; backward recomputes the unit's forward, then runs its backward.
// With ModelOptions::recompute off, each block's forward keeps what its backward reads (q, k, v,
// the attention output and its log-sum-exp, the residual, gate and up) and its backward redoes
// only the two RMSNorms and the SwiGLU, which are cheap next to the matmuls and attention: more
// memory for a third fewer FLOPs per block, the same bits.
#pragma once

#include "core/device.h"
#include "model/config.h"

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace strata {

enum class UnitKind { embedding, block, head };

struct ParamSlot {
  std::string name;     // Hugging Face name, e.g. "model.layers.3.mlp.up_proj.weight"
  Shape shape;          // Hugging Face shape ([out, in] for projections)
  uint64_t offset = 0;  // first element inside the unit's flat buffer
  // Where checkpoints hold it (hf_file_tensors): the tensor named `file_name`, of
  // `file_shape`, from its row `file_row`; `name`, `shape` and 0 but for Phi-3's fused
  // projections.
  std::string file_name;
  std::vector<int64_t> file_shape;
  int64_t file_row = 0;
  int64_t numel() const { return shape.numel(); }
};

struct UnitLayout {
  UnitKind kind = UnitKind::block;
  int layer = -1;    // blocks: 0..L-1
  std::string name;  // "embedding", "layers.3", "head"; later pieces "embedding.1", "head.1", ...
  std::vector<ParamSlot> params;
  uint64_t numel = 0;  // elements of the flat buffer, padding included
  // The embedding's and the head's units: their piece of the vocabulary (ModelLayout's pieces),
  // the ids [vocab_first, vocab_first + vocab_rows) of the table's rows they hold; piece 0 of the
  // head holds the final norm too.
  int piece = 0;
  int64_t vocab_first = 0, vocab_rows = 0;

  const ParamSlot& slot(std::string_view short_name) const;  // "q_proj", "input_layernorm", ...
};

// Vocabulary pieces. Every working buffer, and every pinned buffer, is the size of the largest
// unit, which with a large vocabulary is the embedding or the head (Llama 3 8B's are 525M
// elements to a block's 218M). So their tables are cut into pieces of whole rows, each a unit of
// its own: the embedding's pieces one after another at the front (each looks up the tokens whose
// ids it holds; TableRows), the head's at the back (each adds its columns of logits to the
// online softmax, its backward the gradients of its rows; piece 0 holds the final norm). The
// forward of the head's pieces ends with the loss; their backward (in reverse) needs each
// piece again, after the last one's. With tied embeddings the table is cut once, into the
// embedding's pieces, and head piece k reads (and adds its gradients into) embedding piece k's
// rows (ModelLayout::table_unit): the head's pieces hold no table, piece 0 the final norm and
// the later ones nothing (kAlign elements of padding, so that every unit has a buffer).
// Chosen (config.vocab_pieces 0): tables of at least 16M elements larger than the largest
// block, cut into as many pieces as make each no larger than it; 1 otherwise.
int64_t vocab_pieces_for(const LlamaConfig& config);

struct ModelLayout {
  // Every parameter starts on a multiple of this many elements: 256 bytes even in bf16, the
  // alignment cuBLASLt and vector loads want.
  static constexpr uint64_t kAlign = 128;

  std::vector<UnitLayout> units;  // embedding pieces, blocks..., head pieces
  uint64_t total_numel = 0;       // sum of units' numel (padding included)
  // A norm weight's initial value: 1, or 0 for Gemma, whose norms multiply by 1 + the weight.
  float norm_init = 1.0f;
  int vocab_pieces = 1;  // units of the embedding, and of the head
  bool tied = false;     // the head reads the embedding's table (tie_word_embeddings)

  static ModelLayout build(const LlamaConfig& config);
  int num_units() const { return static_cast<int>(units.size()); }
  int first_block() const { return vocab_pieces; }
  int first_head() const { return num_units() - vocab_pieces; }
  // Unit u's input among the activations the model keeps (LlamaModel::checkpoint): layer l's
  // input is l, the head's L (its first piece's), its later pieces' L + 1 (the normed input,
  // which the first writes as its output), and every embedding piece's 0, the first block's
  // input, which each piece fills in: a unit's output is the next unit's input everywhere.
  int input_position(int u) const;
  // The unit holding the table rows head unit u multiplies by: u itself, or, tied, the
  // embedding's piece of the same rows (unit `piece`); -1 for the other units.
  int table_unit(int u) const;
  // With tied embeddings, the embedding unit whose table head unit u reads (and adds its
  // gradients into): what the partition, placement and schedule must gather beside u; -1 for
  // every other unit and without tied embeddings.
  int tied_table(int u) const { return tied ? table_unit(u) : -1; }
  // The unit and slot holding a Hugging Face tensor name; throws Error naming it if none.
  std::pair<int, const ParamSlot*> find(std::string_view hf_name) const;
};

// The buffers one call works on, per unit, in the device's memory: parameters in
// `param_dtype`, gradients (accumulated, +=) in `grad_dtype`.
struct UnitBuffers {
  void* params = nullptr;
  void* grads = nullptr;
};

struct ModelOptions {
  DType param_dtype = DType::f32;  // also the activations' dtype
  DType grad_dtype = DType::f32;
  int64_t max_batch = 1;       // sequences per call
  int64_t seq_len = 0;         // T (≤ max_position_embeddings)
  int64_t vocab_chunk = 8192;  // columns of logits computed at once by the loss
  // Activation checkpointing (Hugging Face's gradient_checkpointing): backward recomputes each
  // block's forward. Off: every block keeps its activations for one batch (see above).
  bool recompute = true;
  // Micro-batches whose activations are kept at once (each unit's input, and without recompute
  // each block's stash), indexed by the `set` argument of forward_unit, backward_unit and
  // checkpoint: a schedule that runs a group of micro-batches unit by unit needs one set per
  // micro-batch of the group. The scratch a unit's forward or backward works in is shared.
  int activation_sets = 1;
  // Activation checkpoints offloaded to host RAM (RunShape::offload_activations): 0 keeps every
  // unit's input in a slot of its own. K >= 2 keeps the block inputs and the head's input
  // (positions 0..L, L = num_hidden_layers) in a ring of K slots per set, position p in slot
  // p % K, so the forward of block p + K - 1 overwrites position p: positions 0..L-K (the inputs
  // of blocks 0..L-K, offloaded_checkpoints()) must be copied to the host before it and back
  // before their block's backward, which the executor's schedule does (act_d2h, act_h2d). The
  // last K positions stay for the backward. K > L changes nothing. Needs recompute; the
  // whole-model forward(keep_checkpoints) and backward() refuse a ring.
  int checkpoint_slots = 0;
  // Evaluation: forwards only. Each unit's input alternates between two slots per set instead
  // of one slot per unit, and nothing for a backward is allocated (the activation gradients,
  // the gradient scratch, the logits-gradient chunk, a block's kept activations: `recompute`
  // does not apply). For llama2-70b at 4096 tokens in bf16 that is 6 GiB less of the GPU.
  // backward(), backward_unit() and forward(keep_checkpoints) refuse.
  bool forward_only = false;
  // Generation: each block keeps the keys and values of every position up to seq_len
  // (num_hidden_layers × 2 × seq_len × kv_heads × head_dim in param_dtype), and decode() runs
  // only the new tokens against them. Needs forward_only and max_batch 1.
  bool kv_cache = false;
};

// Cosines then sines of every position's rotary angles, [seq_len, head_dim] f32, with the
// config's rope_scaling (llama3, linear, dynamic, yarn, longrope; as transformers computes them;
// YaRN's and LongRoPE's attention factors multiply cos and sin). LongRoPE's factors are those of
// a forward whose longest position is `longest` (default seq_len): transformers chooses them per
// forward.
std::vector<float> rope_table(const LlamaConfig& config, int64_t seq_len, int64_t longest = -1);

// Whether decoding `config` with a cache of seq_len positions needs a second rotary table: a
// LongRoPE model generating past its original context, whose calls within that context rotate
// with the short factors and later ones with the long (transformers switches when a forward's
// positions pass it, the cached keys staying as they were rotated).
bool decoding_switches_rope(const LlamaConfig& config, int64_t seq_len);

// YaRN's constants for config.rope_scaling (kind yarn), as transformers derives them: the
// factor (max_position_embeddings / original_max_position_embeddings where the latter is
// given), the scale of cos and sin, and the ramp's dimensions [low, high], below which the
// frequencies are kept and above which they are divided by the factor.
// Block inputs a model of `config` built with checkpoint_slots = `slots` does not keep on the
// device: those of blocks 0..n-1 (units first_block()..first_block() + n - 1). 0 for slots 0.
int offloaded_checkpoints(const LlamaConfig& config, int slots);

struct YarnParameters {
  double factor = 1.0, attention_factor = 1.0, low = 0.0, high = 0.0;
};
YarnParameters yarn_parameters(const LlamaConfig& config);

// longrope's choice for a forward whose longest position is `seq_len`, as transformers makes
// it: the long factors past original_max_position_embeddings (else the short ones), and the
// scale of cos and sin. Decoding chooses per call too (decoding_switches_rope).
struct LongRopeParameters {
  bool long_factors = false;
  double attention_factor = 1.0;
};
LongRopeParameters longrope_parameters(const LlamaConfig& config, int64_t seq_len);

class LlamaModel {
 public:
  LlamaModel(const LlamaConfig& config, const ModelOptions& options, Device& device);
  LlamaModel(const LlamaModel&) = delete;
  LlamaModel& operator=(const LlamaModel&) = delete;

  const LlamaConfig& config() const { return config_; }
  const ModelLayout& layout() const { return layout_; }
  const ModelOptions& options() const { return options_; }
  Device& device() const { return device_; }
  // Bytes of device memory this model's activations and scratch take (allocated already).
  uint64_t workspace_bytes() const { return workspace_bytes_; }
  // What the constructor allocates for `config` and `options`, without a device: the planner's
  // figure for activations. With `alignment` > 1 each buffer is rounded up to it, as a device
  // arena rounds it. Throws the constructor's errors for a bad sequence length or batch.
  static uint64_t workspace_bytes_for(const LlamaConfig& config, const ModelOptions& options,
                                      uint64_t alignment = 1);

  // ---- one batch: queue everything on `stream`; nothing synchronises ----
  // ids, targets: int32 [batch * seq_len] in device memory (targets may hold kIgnoreIndex).
  // `units` holds one UnitBuffers per unit (grads may be null for forward only).
  //
  // Runs the forward of every unit and the loss; per-token losses land in losses() (f32
  // [batch*seq_len], 0 on ignored targets). With keep_checkpoints the inputs of every unit
  // are kept for backward().
  // doc_start: null, or int32 [batch * seq_len] in device memory for several documents packed
  // into each sequence (Kernels::attention_forward): each token attends to the tokens of its
  // own document only, so each document computes what it would alone (its positions go on
  // from the sequence's, which rotary attention does not see: its scores depend on the
  // distance between two positions alone).
  void forward(const std::vector<UnitBuffers>& units, const int32_t* ids, const int32_t* targets,
               int64_t batch, bool keep_checkpoints, Stream& stream,
               const int32_t* doc_start = nullptr);
  // Gradients of `loss_scale` × (sum of per-token losses) with respect to every parameter,
  // accumulated (+=) into units[u].grads; needs forward(keep_checkpoints = true) just before.
  // For the mean loss over a batch pass 1 / (number of non-ignored targets).
  void backward(const std::vector<UnitBuffers>& units, const int32_t* ids, const int32_t* targets,
                int64_t batch, float loss_scale, Stream& stream,
                const int32_t* doc_start = nullptr);
  // Full logits [batch*seq_len, vocab] f32 into `out` (device memory), for tests and small
  // vocabularies; queued after a forward that set up the head's input. With the head in
  // vocabulary pieces each piece's columns go through a buffer of their own, row by row (and
  // the call waits for the stream, which the buffer must outlive).
  void logits(const std::vector<UnitBuffers>& units, const TensorView& out, int64_t batch,
              Stream& stream);

  TensorView losses(int64_t batch) const;

  // ---- decoding, with ModelOptions::kv_cache ----
  // Runs the n tokens `ids` (int32 in device memory) of one sequence at positions
  // [pos, pos + n) against the cached keys and values of positions [0, pos), which earlier calls
  // left (pos ≤ cached_positions(); a smaller pos starts again from there), and adds theirs to
  // the cache. The logits of the last of them go to `logits_out` [1, vocab] f32 in device
  // memory. pos + n ≤ seq_len. A prompt goes in as one call (or several), each new token as a
  // call of n = 1: the same logits as a forward over the whole sequence, to rounding (on the
  // host the attention rows are the same bits; the matmuls of one row may sum in another order
  // than those of many).
  void decode(const std::vector<UnitBuffers>& units, const int32_t* ids, int64_t pos, int64_t n,
              const TensorView& logits_out, Stream& stream);
  // Positions whose keys and values the cache holds.
  int64_t cached_positions() const { return cached_; }
  // decode() unit by unit (the executor's way, with each unit's parameters gathered in turn):
  // the embedding writes `out`, a block reads `in` and writes `out` (both [n, hidden]), the head
  // reads the last row of `in` and writes `logits_out`. The cache holds the new positions once
  // the head has run.
  void decode_unit(int u, const std::vector<UnitBuffers>& units, const int32_t* ids, int64_t pos,
                   int64_t n, const TensorView& in, const TensorView& out,
                   const TensorView& logits_out, Stream& stream);
  // The activation slot holding unit u's input (u >= 1) in a decode call of n tokens.
  TensorView decode_slot(int u, int64_t n) const;

  // The unit-level pieces forward/backward are made of (the step schedule calls these).
  // `in` and `out` are [batch*seq_len, hidden] activations (unused by the embedding's input and
  // the head's output: the embedding reads ids, the head writes losses()).
  // `set` (0..activation_sets-1) picks the block's stash when recompute is off.
  void forward_unit(int u, const std::vector<UnitBuffers>& units, const int32_t* ids,
                    const int32_t* targets, const TensorView& in, const TensorView& out,
                    int64_t batch, Stream& stream, int set = 0, const int32_t* doc_start = nullptr);
  // Recomputes unit u's forward from `in`, then din = ∂/∂in given dout (the head starts from
  // its loss, scaled by loss_scale, and ignores dout; the embedding has no din).
  void backward_unit(int u, const std::vector<UnitBuffers>& units, const int32_t* ids,
                     const int32_t* targets, float loss_scale, const TensorView& in,
                     const TensorView& dout, const TensorView& din, int64_t batch, Stream& stream,
                     int set = 0, const int32_t* doc_start = nullptr);
  // The activation slot holding unit u's input (u ≥ 1) after forward(keep_checkpoints), in
  // activation set `set`.
  TensorView checkpoint(int u, int64_t batch, int set = 0) const;

 private:
  // One workspace buffer: the member it goes to, its size and what it holds. The constructor
  // and workspace_bytes_for() both read this list, so the planner counts what is allocated.
  struct WorkspaceBuffer {
    DeviceBuffer LlamaModel::*member;
    uint64_t bytes;
    const char* what;
  };
  static std::vector<WorkspaceBuffer> workspace(const LlamaConfig& config,
                                                const ModelOptions& options);
  // What a block's backward reads from its forward: in the shared scratch when recomputing,
  // else in that block's part of stash_.
  struct BlockActs {
    TensorView q, k, v, att, lse, h, gate, up;
    // With qk_norm: q and k as projected (before their norms) and the norms' statistics, which
    // the norms' backward reads; null views otherwise.
    TensorView q_raw, k_raw, q_rstd, k_rstd;
    // With sandwich norms (Gemma 2): the attention's and the MLP's outputs before their norms
    // (o_proj's and down_proj's); null views otherwise.
    TensorView o_raw, m_raw;
  };
  BlockActs acts(int u, int64_t batch, int set) const;
  void check_set(int set) const;  // throws unless 0 <= set < activation_sets
  int layer(int u) const { return layout_.units[static_cast<size_t>(u)].layer; }  // block u's
  // The rows of the whole table embedding unit u holds.
  TableRows table_rows(int u) const {
    const UnitLayout& unit = layout_.units[static_cast<size_t>(u)];
    return TableRows{unit.vocab_first, config_.vocab_size, unit.piece == 0};
  }
  void refuse_if_forward_only(const char* what) const;  // throws for a forward-only model

  TensorView param(const std::vector<UnitBuffers>& units, int u, std::string_view name,
                   bool grad) const;
  TensorView rows(const DeviceBuffer& buf, DType dtype, int64_t n, int64_t cols) const;
  TensorView slot(int index, int64_t batch) const;
  // The final norm of the head's input x into xf (with its statistics in rstd1_), with the
  // weight of the head's first piece.
  void head_norm(const std::vector<UnitBuffers>& units, const TensorView& x, const TensorView& xf,
                 Stream& stream);
  // Logits [rows of xf, the head piece's rows] f32 into `out` from the normed input xf, through
  // head piece u's rows of the LM head (the embedding's table when tied).
  void piece_logits(int u, const std::vector<UnitBuffers>& units, const TensorView& xf,
                    const TensorView& out, Stream& stream);
  // Head piece u's columns of logits `out` [1 or more rows, vocab] f32 (all of them when whole).
  TensorView logits_columns(int u, const TensorView& out) const;
  // Head piece u's forward (the loss after the last piece) or backward. Piece 0 reads the head's
  // input x and norms it, into `xn_out` when the head is cut (the later pieces' input); the later
  // pieces read that as x. The gradient of the normed input comes down the pieces from the last
  // (dout, which the last ignores) and leaves piece 0 through the norm as dx.
  void head(int u, const std::vector<UnitBuffers>& units, const TensorView& x,
            const int32_t* targets, int64_t batch, bool backward, float loss_scale,
            const TensorView& xn_out, const TensorView& dout, const TensorView& dx, int set,
            Stream& stream);
  // The tokens of a decode() call: `tokens` new positions from `pos` on, one sequence.
  struct Span {
    int64_t pos = 0, tokens = 0;
  };
  // With `span`, x and out are [span->tokens, hidden], the keys and values go into the block's
  // cache and the queries attend to every cached position up to their own.
  // doc_start: the documents packed into each sequence (forward_unit), or null.
  void block_forward(int u, const std::vector<UnitBuffers>& units, const TensorView& x,
                     const TensorView& out, int64_t batch, int set, Stream& stream,
                     const int32_t* doc_start = nullptr, const Span* span = nullptr);
  void block_backward(int u, const std::vector<UnitBuffers>& units, const TensorView& x,
                      const TensorView& dout, const TensorView& din, int64_t batch, int set,
                      Stream& stream, const int32_t* doc_start);
  // The keys block u's queries see: their documents' (doc_start) and, in a layer with a sliding
  // window that the sequences outrun, the window's.
  AttentionMask attention_mask(int u, const int32_t* doc_start) const;

  LlamaConfig config_;
  ModelLayout layout_;
  ModelOptions options_;
  Device& device_;
  Kernels& k_;
  uint64_t workspace_bytes_ = 0;

  DeviceBuffer rope_;             // [T, rotary_dim] f32
  DeviceBuffer rope_short_;       // the same with LongRoPE's short factors (decoding_switches_rope)
  DeviceBuffer rope_local_;       // Gemma 3's sliding layers': rope_local_base_freq, unscaled
  DeviceBuffer checkpoints_;      // inputs of units 1..U-1: sets × (U-1) × [B*T, D]
  DeviceBuffer grad_a_, grad_b_;  // the gradient flowing between units, [B*T, D]
  // Block scratch, [B*T, ·]: normed input, q, k, v, attention out, lse, residual, normed
  // residual, gate, up, the gate's activation times up, rstd × 2, and gradients of the same.
  DeviceBuffer xn_, q_, k_buf_, v_, att_, lse_, h_, hn_, gate_, up_, act_, rstd1_, rstd2_;
  // Without recompute: per set and block, the BlockActs of one batch (q_ .. up_ above stay
  // empty).
  DeviceBuffer stash_;
  DeviceBuffer d_big_, d_gate_, d_up_, dq_, dk_, dv_, d_att_, d_h_, d_small_;
  // With qk_norm: q and k before their norms with the norms' statistics (the forward's scratch),
  // and the gradients reaching the projections through the norms.
  DeviceBuffer q_raw_, k_raw_, q_rstd_, k_rstd_, dq_raw_, dk_raw_;
  // With sandwich norms: o_proj's and down_proj's outputs (the scratch's; without recompute the
  // stash keeps them), their norms' statistics, and the gradient reaching either.
  DeviceBuffer o_raw_, m_raw_, rstd3_, rstd4_, d_sub_;
  // Head: logits chunk [B*T, C], online-softmax state and per-token losses, [B*T] f32 each.
  DeviceBuffer chunk_, chunk_act_, row_max_, row_sum_, target_logit_, losses_;
  DeviceBuffer kv_;     // decoding: per block, keys then values, [seq_len, kv_heads * head_dim]
  int64_t cached_ = 0;  // positions in kv_
  int last_slot_ = 0;   // the slot holding the head's input after the last forward
  bool kept_ = false;   // whether the last forward kept every unit's input
};

// Unit u of layout `to` from the values of a layout `from` of the same model with its vocabulary
// in other pieces (a checkpoint of another cut): each parameter's rows from the units of `from`
// that hold them, `unit(v)` giving unit v of `from` (numel values); padding 0.
std::vector<float> relaid_unit(const ModelLayout& from,
                               const std::function<const std::vector<float>&(int)>& unit,
                               const ModelLayout& to, int u);

// Deterministic random initialisation (Hugging Face's: normal(0, 0.02) weights, norm weights
// layout.norm_init, biases 0) of one unit's flat buffer, in host memory of `dtype`; the same seed
// gives the same bits, and the same model whatever units the layout cuts it into (each
// checkpoint tensor's elements are drawn by its name and place).
void init_unit_random(const ModelLayout& layout, int u, uint64_t seed, DType dtype, void* host);

}  // namespace strata
