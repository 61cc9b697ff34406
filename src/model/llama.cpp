#include "model/llama.h"

#include "core/bytes.h"
#include "core/error.h"

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <map>
#include <numbers>
#include <utility>

namespace strata {
namespace {

uint64_t align_up(uint64_t n, uint64_t a) {
  return (n + a - 1) / a * a;
}

void add_slot(UnitLayout& unit, std::string name, Shape shape) {
  ParamSlot slot{std::move(name), shape, unit.numel};
  unit.numel = align_up(unit.numel + static_cast<uint64_t>(shape.numel()), ModelLayout::kAlign);
  unit.params.push_back(std::move(slot));
}

// splitmix64: a small, well-mixed generator whose output is the same on every platform.
uint64_t splitmix(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

double uniform01(uint64_t& state) {  // (0, 1]
  return (static_cast<double>(splitmix(state) >> 11) + 1.0) * 0x1.0p-53;
}

// Without recompute, each block keeps q, k, v, the attention output, its log-sum-exp, the
// residual, gate and up for options.max_batch sequences, with qk_norm q and k before their
// norms and the norms' statistics, and with sandwich norms o_proj's and down_proj's outputs:
// their byte offsets in the block's part of the stash, each on 256 bytes (as a device arena
// aligns a buffer), and [14] the part's size.
constexpr size_t kStashParts = 14;

// The MLP's input norm: post_attention_layernorm, or with sandwich norms (Gemma 2, whose
// post_attention_layernorm norms the attention's output) pre_feedforward_layernorm.
const char* mlp_norm(const LlamaConfig& c) {
  return sandwich_norms(c) ? "pre_feedforward_layernorm" : "post_attention_layernorm";
}

std::array<uint64_t, kStashParts + 1> stash_offsets(const LlamaConfig& c, const ModelOptions& o) {
  const auto n = static_cast<uint64_t>(o.max_batch * o.seq_len);
  const uint64_t a = dtype_size(o.param_dtype);
  const auto D = static_cast<uint64_t>(c.hidden_size),
             F = static_cast<uint64_t>(c.intermediate_size);
  const auto Hq = static_cast<uint64_t>(c.num_attention_heads * c.head_dim);
  const auto Hk = static_cast<uint64_t>(c.num_key_value_heads * c.head_dim);
  const uint64_t qk = c.qk_norm ? 1 : 0, sw = sandwich_norms(c) ? 1 : 0;
  const uint64_t bytes[kStashParts] = {n * Hq * a,
                                       n * Hk * a,
                                       n * Hk * a,
                                       n * Hq * a,
                                       n * static_cast<uint64_t>(c.num_attention_heads) * 4,
                                       n * D * a,
                                       n * F * a,
                                       n * F * a,
                                       qk * n * Hq * a,
                                       qk * n * Hk * a,
                                       qk * n * static_cast<uint64_t>(c.num_attention_heads) * 4,
                                       qk * n * static_cast<uint64_t>(c.num_key_value_heads) * 4,
                                       sw * n * D * a,
                                       sw * n * D * a};
  std::array<uint64_t, kStashParts + 1> off{};
  for (size_t i = 0; i < kStashParts; ++i) off[i + 1] = off[i] + align_up(bytes[i], 256);
  return off;
}

// A [rows, heads·hd] view as [rows·heads, hd]: a row per head, for Qwen3's q and k norms.
TensorView heads(const TensorView& v, int64_t n_heads) {
  TensorView r = v;
  r.shape = Shape{v.shape[0] * n_heads, v.shape[1] / n_heads};
  return r;
}

}  // namespace

// ---- layout ----

const ParamSlot& UnitLayout::slot(std::string_view short_name) const {
  for (const ParamSlot& p : params) {
    const std::string_view n = std::string_view(p.name).substr(0, p.name.find('['));  // a piece's
    const std::string suffix = short_name.ends_with(".bias") || short_name.ends_with(".weight")
                                   ? std::string(short_name)
                                   : fmt::format("{}.weight", short_name);
    if (n == suffix ||
        (n.size() > suffix.size() && n.ends_with(suffix) && n[n.size() - suffix.size() - 1] == '.'))
      return p;
  }
  fail("unit {}: no parameter '{}'; this is a bug in strata's model layout", name, short_name);
}

namespace {

// Rows of each vocabulary piece (the last may have fewer), for `pieces` of a table of V rows:
// an even share. (Not rounded to the loss's chunks: a piece ends its last chunk short, which
// costs nothing, where rounding up would make pieces larger than the blocks they are sized to.)
int64_t piece_rows(int64_t V, int64_t pieces) {
  return (V + pieces - 1) / pieces;
}

// Elements of layer 0's unit, as ModelLayout::build lays it out.
uint64_t block_numel(const LlamaConfig& c) {
  UnitLayout unit;
  for (const HfTensor& t : llama_hf_tensors(c)) {
    if (!t.name.starts_with("model.layers.0.")) continue;
    Shape shape;
    shape.rank = static_cast<int>(t.shape.size());
    std::copy(t.shape.begin(), t.shape.end(), shape.dims.begin());
    add_slot(unit, t.name, shape);
  }
  return unit.numel;
}

}  // namespace

int offloaded_checkpoints(const LlamaConfig& config, int slots) {
  const auto L = static_cast<int>(config.num_hidden_layers);
  return slots >= 2 && slots <= L ? L - slots + 1 : 0;
}

int64_t vocab_pieces_for(const LlamaConfig& c) {
  if (c.vocab_pieces > 0) return c.vocab_pieces;
  const uint64_t table = static_cast<uint64_t>(c.vocab_size) * static_cast<uint64_t>(c.hidden_size);
  const uint64_t block = block_numel(c);  // every layer has layer 0's shapes
  if (table < (uint64_t{16} << 20) || block == 0 || table <= block) return 1;
  // An even share of rows may leave fewer pieces (ceil(V / ceil(V / p)) <= p): settle.
  int64_t pieces = static_cast<int64_t>((table + block - 1) / block);
  for (;;) {
    const int64_t rows = piece_rows(c.vocab_size, pieces);
    const int64_t n = (c.vocab_size + rows - 1) / rows;
    if (n == pieces) return pieces;
    pieces = n;
  }
}

int ModelLayout::table_unit(int u) const {
  const UnitLayout& unit = units.at(static_cast<size_t>(u));
  if (unit.kind != UnitKind::head) return -1;
  return tied ? unit.piece : u;
}

int ModelLayout::input_position(int u) const {
  const UnitLayout& unit = units.at(static_cast<size_t>(u));
  switch (unit.kind) {
    case UnitKind::embedding:
      return 0;
    case UnitKind::block:
      return unit.layer;
    case UnitKind::head:
      break;
  }
  return num_units() - 2 * vocab_pieces + (unit.piece > 0 ? 1 : 0);  // L, or L + 1
}

ModelLayout ModelLayout::build(const LlamaConfig& c) {
  // Hugging Face's tensors, in their order: the embedding, each layer's nine, then the final
  // norm (and the head unless tied). Units follow the name prefixes; the embedding's table and
  // the head's are cut into the vocabulary pieces, if any.
  ModelLayout layout;
  const int64_t pieces = vocab_pieces_for(c);
  if (pieces < 1 || pieces > c.vocab_size)
    fail(
        "model {}: {} vocabulary pieces for a vocabulary of {}; choose between 1 and the "
        "vocabulary size (0 lets strata choose)",
        c.name, pieces, c.vocab_size);
  const int64_t rows = piece_rows(c.vocab_size, pieces);
  if ((c.vocab_size + rows - 1) / rows != pieces)
    fail(
        "model {}: {} vocabulary pieces of a vocabulary of {}: pieces of {} rows make {}; choose "
        "{} pieces",
        c.name, pieces, c.vocab_size, rows, (c.vocab_size + rows - 1) / rows,
        (c.vocab_size + rows - 1) / rows);
  layout.vocab_pieces = static_cast<int>(pieces);
  layout.tied = c.tie_word_embeddings;
  layout.norm_init = 1.0f - norm_weight_offset(c);
  const int E = static_cast<int>(pieces);
  auto piece_unit = [&](UnitKind kind, int k) {
    UnitLayout u{kind, -1, kind == UnitKind::embedding ? "embedding" : "head", {}, 0};
    if (k > 0) u.name += fmt::format(".{}", k);
    u.piece = k;
    u.vocab_first = k * rows;
    u.vocab_rows = std::min(rows, c.vocab_size - u.vocab_first);
    return u;
  };
  for (int k = 0; k < E; ++k) layout.units.push_back(piece_unit(UnitKind::embedding, k));
  for (int64_t l = 0; l < c.num_hidden_layers; ++l)
    layout.units.push_back(
        {UnitKind::block, static_cast<int>(l), fmt::format("layers.{}", l), {}, 0});
  for (int k = 0; k < E; ++k) layout.units.push_back(piece_unit(UnitKind::head, k));
  const int head = layout.first_head();
  for (const HfTensor& t : llama_hf_tensors(c)) {
    Shape shape;
    shape.rank = static_cast<int>(t.shape.size());
    std::copy(t.shape.begin(), t.shape.end(), shape.dims.begin());
    const bool embedding = t.name == "model.embed_tokens.weight";
    if (embedding || t.name == "lm_head.weight") {
      // A table: its rows, piece by piece. Cut, each piece's slot is the file tensor's rows
      // (ParamSlot::file_row), named with them.
      for (int k = 0; k < E; ++k) {
        UnitLayout& unit = layout.units.at(static_cast<size_t>(embedding ? k : head + k));
        if (E == 1) {
          add_slot(unit, t.name, shape);
          continue;
        }
        Shape part = shape;
        part.dims[0] = unit.vocab_rows;
        add_slot(
            unit,
            fmt::format("{}[{}:{}]", t.name, unit.vocab_first, unit.vocab_first + unit.vocab_rows),
            part);
        ParamSlot& slot = unit.params.back();
        slot.file_name = t.name;
        slot.file_shape = t.shape;
        slot.file_row = unit.vocab_first;
      }
      continue;
    }
    UnitLayout* unit = &layout.units.at(static_cast<size_t>(head));  // the final norm
    if (t.name.starts_with("model.layers.")) {
      const int64_t l = std::stoll(t.name.substr(13));
      unit = &layout.units.at(static_cast<size_t>(E + l));
    }
    add_slot(*unit, t.name, shape);
  }
  // Tied, the head's later pieces hold no tensor: a buffer of padding, as every unit has one.
  for (UnitLayout& u : layout.units)
    if (u.numel == 0) u.numel = ModelLayout::kAlign;
  std::map<std::string, ParamSlot*, std::less<>> by_name;
  for (UnitLayout& u : layout.units)
    for (ParamSlot& p : u.params) by_name[p.name] = &p;
  for (const HfFileTensor& f : hf_file_tensors(c)) {
    int64_t row = 0;
    if (!by_name.contains(f.parts.front())) continue;  // a table cut into pieces (above)
    for (const std::string& part : f.parts) {
      ParamSlot& slot = *by_name.at(part);
      slot.file_name = f.name;
      slot.file_shape = f.shape;
      slot.file_row = row;
      row += slot.shape.dims[0];
    }
  }
  for (const UnitLayout& u : layout.units) layout.total_numel += u.numel;
  return layout;
}

std::vector<float> relaid_unit(const ModelLayout& from,
                               const std::function<const std::vector<float>&(int)>& unit,
                               const ModelLayout& to, int u) {
  const UnitLayout& dst = to.units.at(static_cast<size_t>(u));
  std::vector<float> out(dst.numel, 0.0f);
  for (const ParamSlot& p : dst.params) {
    const int64_t rows = p.shape.dims[0], width = p.numel() / std::max<int64_t>(rows, 1);
    const int64_t a = p.file_row, b = p.file_row + rows;
    int64_t found = 0;
    for (int v = 0; v < from.num_units(); ++v)
      for (const ParamSlot& q : from.units[static_cast<size_t>(v)].params) {
        if (q.file_name != p.file_name) continue;
        const int64_t c = q.file_row, d = q.file_row + q.shape.dims[0];
        const int64_t lo = std::max(a, c), hi = std::min(b, d);
        if (lo >= hi) continue;
        const std::vector<float>& values = unit(v);
        if (values.size() != from.units[static_cast<size_t>(v)].numel)
          fail("unit {}: {} values where the layout has {}; this is a bug in strata",
               from.units[static_cast<size_t>(v)].name, values.size(),
               from.units[static_cast<size_t>(v)].numel);
        std::copy_n(values.begin() + static_cast<ptrdiff_t>(q.offset) + (lo - c) * width,
                    (hi - lo) * width,
                    out.begin() + static_cast<ptrdiff_t>(p.offset) + (lo - a) * width);
        found += hi - lo;
      }
    if (found != rows)
      fail("{}: {} of its {} rows are in the other layout; the two are of different models", p.name,
           found, rows);
  }
  return out;
}

std::pair<int, const ParamSlot*> ModelLayout::find(std::string_view hf_name) const {
  for (size_t u = 0; u < units.size(); ++u)
    for (const ParamSlot& p : units[u].params)
      if (p.name == hf_name) return {static_cast<int>(u), &p};
  fail(
      "tensor '{}' is not a parameter of this Llama model; expected Hugging Face names such as "
      "model.layers.0.self_attn.q_proj.weight",
      hf_name);
}

// ---- rotary table ----

bool decoding_switches_rope(const LlamaConfig& c, int64_t seq_len) {
  return c.rope_scaling.kind == RopeScalingKind::longrope &&
         longrope_parameters(c, seq_len).long_factors;
}

std::vector<float> rope_table(const LlamaConfig& c, int64_t seq_len, int64_t longest) {
  // The rotated dimensions (all of head_dim but for Phi-3's partial rotation), which set the
  // frequencies as transformers' `dim` does.
  const int64_t hd = c.rotary_dim(), half = hd / 2;
  // As Hugging Face: theta^(2i/hd) in f32 (each pair's wavelength over 2 pi), and its
  // reciprocal, the plain frequency, which the scalings below change.
  std::vector<float> pos_freq(static_cast<size_t>(half)), inv_freq(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(hd);
    pos_freq[static_cast<size_t>(i)] =
        static_cast<float>(std::pow(static_cast<double>(c.rope_theta), exponent));
    inv_freq[static_cast<size_t>(i)] = 1.0f / pos_freq[static_cast<size_t>(i)];
  }
  if (c.rope_scaling.kind == RopeScalingKind::llama3) {
    const RopeScaling& r = c.rope_scaling;
    const double old_len = static_cast<double>(r.original_max_position_embeddings);
    const double low_wavelen = old_len / r.low_freq_factor;
    const double high_wavelen = old_len / r.high_freq_factor;
    for (float& f : inv_freq) {
      const double wavelen = 2.0 * std::numbers::pi / f;
      if (wavelen < high_wavelen) continue;  // high frequencies: unchanged
      if (wavelen > low_wavelen) {           // low frequencies: divided by the factor
        f = static_cast<float>(f / r.factor);
        continue;
      }
      const double smooth =
          (old_len / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
      f = static_cast<float>((1.0 - smooth) * f / r.factor + smooth * f);
    }
  }
  if (c.rope_scaling.kind == RopeScalingKind::linear) {
    const auto factor = static_cast<float>(c.rope_scaling.factor);
    for (float& f : inv_freq) f /= factor;  // f32, as transformers divides its tensor
  }
  // dynamic: within max_position_embeddings (every sequence strata runs) the plain frequencies.
  float attention_factor = 1.0f;
  if (c.rope_scaling.kind == RopeScalingKind::longrope) {
    const LongRopeParameters l = longrope_parameters(c, longest < 0 ? seq_len : longest);
    attention_factor = static_cast<float>(l.attention_factor);
    const std::vector<double>& ext =
        l.long_factors ? c.rope_scaling.long_factor : c.rope_scaling.short_factor;
    for (int64_t i = 0; i < half; ++i)  // transformers: 1 / (factor * base ** (2i / dim)), f32
      inv_freq[static_cast<size_t>(i)] = 1.0f / (static_cast<float>(ext[static_cast<size_t>(i)]) *
                                                 pos_freq[static_cast<size_t>(i)]);
  }
  if (c.rope_scaling.kind == RopeScalingKind::yarn) {
    const YarnParameters y = yarn_parameters(c);
    attention_factor = static_cast<float>(y.attention_factor);
    const auto factor = static_cast<float>(y.factor);
    const double span = y.high == y.low ? 0.001 : y.high - y.low;  // as transformers: no 0/0
    for (int64_t i = 0; i < half; ++i) {
      // Each term in f32 as transformers computes its tensors; the ramp blends each frequency
      // from the interpolated (divided by the factor) at low dimensions' far end to the
      // extrapolated (unchanged) one.
      const float p = pos_freq[static_cast<size_t>(i)];
      const float extrapolated = 1.0f / p, interpolated = 1.0f / (factor * p);
      const float ramp =
          std::clamp(static_cast<float>((static_cast<double>(i) - y.low) / span), 0.0f, 1.0f);
      const float keep = 1.0f - ramp;
      inv_freq[static_cast<size_t>(i)] = interpolated * (1.0f - keep) + extrapolated * keep;
    }
  }
  std::vector<float> table(static_cast<size_t>(seq_len * hd));
  for (int64_t t = 0; t < seq_len; ++t)
    for (int64_t i = 0; i < half; ++i) {
      const float angle = static_cast<float>(t) * inv_freq[static_cast<size_t>(i)];  // f32
      float cos = static_cast<float>(std::cos(double{angle}));
      float sin = static_cast<float>(std::sin(double{angle}));
      if (attention_factor != 1.0f) {  // YaRN's and longrope's scaling of cos and sin, in f32
        cos *= attention_factor;
        sin *= attention_factor;
      }
      table[static_cast<size_t>(t * hd + i)] = cos;
      table[static_cast<size_t>(t * hd + half + i)] = sin;
    }
  return table;
}

namespace {

// YaRN's and LongRoPE's context: (the stretch, the original context), as transformers 5 takes
// them: the stretch is factor where given (LongRoPE's may be absent: then
// max_position_embeddings over the original), the original context
// original_max_position_embeddings where given, else max_position_embeddings. (transformers
// 4.5x let the two lengths' ratio override a given factor, which made Qwen's recommended YaRN,
// factor 4 over an unchanged max_position_embeddings, a no-op there.)
std::pair<double, double> rope_stretch(const LlamaConfig& c) {
  const RopeScaling& r = c.rope_scaling;
  const auto longest = static_cast<double>(c.max_position_embeddings);
  const double original = r.original_max_position_embeddings > 0
                              ? static_cast<double>(r.original_max_position_embeddings)
                              : longest;
  return {r.factor > 0 ? r.factor : longest / original, original};
}

}  // namespace

LongRopeParameters longrope_parameters(const LlamaConfig& c, int64_t seq_len) {
  const RopeScaling& r = c.rope_scaling;
  LongRopeParameters l;
  const std::pair<double, double> stretch = rope_stretch(c);
  const double factor = stretch.first, original = stretch.second;
  if (r.attention_factor)
    l.attention_factor = *r.attention_factor;
  else
    l.attention_factor =
        factor <= 1.0 ? 1.0 : std::sqrt(1.0 + std::log(factor) / std::log(original));
  l.long_factors = static_cast<double>(seq_len) > original;
  return l;
}

YarnParameters yarn_parameters(const LlamaConfig& c) {
  const RopeScaling& r = c.rope_scaling;
  YarnParameters y;
  // Plain variables, not a structured binding: clang 14 cannot capture one in a lambda.
  const std::pair<double, double> stretch = rope_stretch(c);
  const double original = stretch.second;
  y.factor = stretch.first;
  auto mscale = [](double scale, double m) {
    return scale <= 1.0 ? 1.0 : 0.1 * m * std::log(scale) + 1.0;
  };
  if (r.attention_factor)
    y.attention_factor = *r.attention_factor;
  else if (r.mscale.value_or(0.0) != 0.0 && r.mscale_all_dim.value_or(0.0) != 0.0)
    y.attention_factor = mscale(y.factor, *r.mscale) / mscale(y.factor, *r.mscale_all_dim);
  else
    y.attention_factor = mscale(y.factor, 1.0);
  // 0 or absent: the defaults (transformers' `or`).
  const double fast = r.beta_fast.value_or(0.0) != 0.0 ? *r.beta_fast : 32.0;
  const double slow = r.beta_slow.value_or(0.0) != 0.0 ? *r.beta_slow : 1.0;
  const auto dim = static_cast<double>(c.rotary_dim());
  // The dimension whose wavelength turns `rotations` times over the original context.
  auto correction_dim = [&](double rotations) {
    return dim * std::log(original / (rotations * 2.0 * std::numbers::pi)) /
           (2.0 * std::log(c.rope_theta));
  };
  y.low = correction_dim(fast);
  y.high = correction_dim(slow);
  if (r.truncate.value_or(true)) {
    y.low = std::floor(y.low);
    y.high = std::ceil(y.high);
  }
  y.low = std::max(y.low, 0.0);
  y.high = std::min(y.high, dim - 1.0);
  return y;
}

// ---- random initialisation ----

void init_unit_random(const ModelLayout& layout, int u, uint64_t seed, DType dtype, void* host) {
  const UnitLayout& unit = layout.units.at(static_cast<size_t>(u));
  // Each tensor of the checkpoint (ParamSlot::file_name) in blocks of kBlock elements, each
  // block from a generator of its own seeded by (seed, tensor name, block): the same bits on
  // any number of threads, a large model's units made on every core (one core draws the 8
  // billion normals of an 8B model in minutes), and the same model however it is laid out in
  // units (a table cut into vocabulary pieces, a fused projection): a slot that starts inside
  // a block draws the block from its start and keeps its own part.
  constexpr uint64_t kBlock = uint64_t{1} << 16;  // even: Box-Muller pairs stay inside a block
  struct Piece {
    size_t slot;
    uint64_t begin, end;  // elements of the checkpoint's tensor
  };
  std::vector<Piece> pieces;
  uint64_t covered = 0;  // padding between tensors and after the last one is zero
  for (size_t p = 0; p < unit.params.size(); ++p) {
    const ParamSlot& slot = unit.params[p];
    for (uint64_t i = covered; i < slot.offset; ++i) store_f32(host, dtype, i, 0.0f);
    const auto n = static_cast<uint64_t>(slot.numel());
    const uint64_t width = n / static_cast<uint64_t>(std::max<int64_t>(slot.shape.dims[0], 1));
    const uint64_t first = static_cast<uint64_t>(slot.file_row) * width;
    for (uint64_t b = first / kBlock * kBlock; b < first + n; b += kBlock)
      pieces.push_back({p, std::max(b, first), std::min(first + n, b + kBlock)});
    covered = slot.offset + n;
  }
  for (uint64_t i = covered; i < unit.numel; ++i) store_f32(host, dtype, i, 0.0f);
  tbb::parallel_for(tbb::blocked_range<size_t>(0, pieces.size()), [&](const auto& range) {
    for (size_t k = range.begin(); k != range.end(); ++k) {
      const Piece& piece = pieces[k];
      const ParamSlot& slot = unit.params[piece.slot];
      const uint64_t width = static_cast<uint64_t>(slot.numel()) /
                             static_cast<uint64_t>(std::max<int64_t>(slot.shape.dims[0], 1));
      // Where the slot's first element lies in the checkpoint's tensor, and in the unit.
      const uint64_t first = static_cast<uint64_t>(slot.file_row) * width;
      if (slot.shape.rank == 1) {  // norm weights 1 (Gemma's 0), biases 0
        const float value = slot.name.ends_with(".bias") ? 0.0f : layout.norm_init;
        for (uint64_t e = piece.begin; e < piece.end; ++e)
          store_f32(host, dtype, slot.offset + (e - first), value);
        continue;
      }
      uint64_t name_hash = 0xcbf29ce484222325ull;  // FNV-1a of the tensor's name
      for (const char ch : slot.file_name)
        name_hash = (name_hash ^ static_cast<uint8_t>(ch)) * 0x100000001b3ull;
      const uint64_t block = piece.begin / kBlock;
      uint64_t state =
          seed ^ (0x51ed270b2a2b8f35ull * name_hash) ^ (0x9fb21c651e98df25ull * (block + 1));
      (void)splitmix(state);  // one step mixes the seed's bits
      for (uint64_t e = block * kBlock; e < piece.end; e += 2) {
        // Box-Muller: two normals per pair of uniforms.
        const double r = std::sqrt(-2.0 * std::log(uniform01(state)));
        const double a = 2.0 * std::numbers::pi * uniform01(state);
        const double z[2] = {r * std::cos(a), r * std::sin(a)};
        for (uint64_t j = 0; j < 2; ++j)
          if (e + j >= piece.begin && e + j < piece.end)
            store_f32(host, dtype, slot.offset + (e + j - first), static_cast<float>(0.02 * z[j]));
      }
    }
  });
}

// ---- the model ----

std::vector<LlamaModel::WorkspaceBuffer> LlamaModel::workspace(const LlamaConfig& config,
                                                               const ModelOptions& options) {
  const int64_t T = options.seq_len, B = options.max_batch;
  if (T <= 0 || T > config.max_position_embeddings)
    fail(
        "sequence length {} is outside 1..{} (max_position_embeddings of model {}); choose a "
        "--seq-len within it",
        T, config.max_position_embeddings, config.name);
  if (B <= 0) fail("batch size {} must be at least 1", B);
  if (options.vocab_chunk <= 0) fail("vocab chunk {} must be at least 1", options.vocab_chunk);
  if (options.activation_sets < 1)
    fail("activation sets {}: a model keeps at least one micro-batch's activations",
         options.activation_sets);
  if (options.checkpoint_slots < 0 || options.checkpoint_slots == 1)
    fail(
        "activation checkpoint slots {}: a ring needs at least 2 (a block reads one and writes "
        "the next), or 0 to keep every checkpoint; this is a bug in strata",
        options.checkpoint_slots);
  if (options.checkpoint_slots > 0 && !options.recompute && !options.forward_only)
    fail(
        "activation checkpoints offloaded to host RAM need activation checkpointing: without "
        "recompute every block keeps all of its activations on the device; turn "
        "--activation-checkpointing on or keep the checkpoints on the device "
        "(--offload-activations none)");
  if (options.kv_cache && (!options.forward_only || B != 1))
    fail(
        "a KV cache is for generation: it needs a forward-only model of batch 1 (asked: "
        "forward_only {}, batch {}); this is a bug in strata",
        options.forward_only, B);
  const auto sets = static_cast<uint64_t>(options.activation_sets);
  const int64_t N = B * T, D = config.hidden_size, F = config.intermediate_size;
  const int64_t Hq = config.num_attention_heads * config.head_dim;
  const int64_t Hk = config.num_key_value_heads * config.head_dim;
  const int64_t C = std::min(options.vocab_chunk, config.vocab_size);
  const uint64_t a = dtype_size(options.param_dtype), f4 = 4;
  const auto n = static_cast<uint64_t>(N);
  // The units' inputs (ModelLayout::input_position), without building the layout: each block's,
  // the head's, and with vocabulary pieces the normed input of the head's later pieces.
  const auto positions =
      static_cast<uint64_t>(config.num_hidden_layers) + 1 + (vocab_pieces_for(config) > 1 ? 1 : 0);
  const bool fwd = options.forward_only;
  // Evaluation keeps no unit's input past the next unit's forward: two slots per set. With the
  // checkpoints offloaded, positions 0..L share a ring of checkpoint_slots and the head pieces'
  // normed input keeps its own.
  const int ring = offloaded_checkpoints(config, options.checkpoint_slots) > 0
                       ? options.checkpoint_slots + (vocab_pieces_for(config) > 1 ? 1 : 0)
                       : 0;
  const uint64_t slots = fwd        ? 2
                         : ring > 0 ? static_cast<uint64_t>(ring)
                                    : std::max<uint64_t>(positions, 2);
  std::vector<WorkspaceBuffer> w = {
      {&LlamaModel::rope_, static_cast<uint64_t>(T * config.rotary_dim()) * f4, "rotary table"},
      {&LlamaModel::checkpoints_, sets * slots * n * D * a, "activation checkpoints"},
  };
  if (!fwd) {
    w.push_back({&LlamaModel::grad_a_, n * D * a, "activation gradient"});
    w.push_back({&LlamaModel::grad_b_, n * D * a, "activation gradient"});
  }
  w.insert(w.end(), {
                        {&LlamaModel::xn_, n * D * a, "normed activations"},
                        {&LlamaModel::hn_, n * D * a, "normed residual"},
                        {&LlamaModel::act_, n * F * a, "SwiGLU output"},
                        {&LlamaModel::rstd1_, n * f4, "RMSNorm statistics"},
                        {&LlamaModel::rstd2_, n * f4, "RMSNorm statistics"},
                    });
  const bool sandwich = sandwich_norms(config);
  if (sandwich)
    w.insert(w.end(), {{&LlamaModel::rstd3_, n * f4, "RMSNorm statistics"},
                       {&LlamaModel::rstd4_, n * f4, "RMSNorm statistics"}});
  if (options.recompute || fwd) {
    w.insert(w.end(),
             {
                 {&LlamaModel::q_, n * Hq * a, "queries"},
                 {&LlamaModel::k_buf_, n * Hk * a, "keys"},
                 {&LlamaModel::v_, n * Hk * a, "values"},
                 {&LlamaModel::att_, n * Hq * a, "attention output"},
                 {&LlamaModel::lse_, n * config.num_attention_heads * f4, "attention log-sum-exp"},
                 {&LlamaModel::h_, n * D * a, "residual"},
                 {&LlamaModel::gate_, n * F * a, "gate projection"},
                 {&LlamaModel::up_, n * F * a, "up projection"},
             });
    if (config.qk_norm)
      w.insert(
          w.end(),
          {
              {&LlamaModel::q_raw_, n * Hq * a, "queries before their norm"},
              {&LlamaModel::k_raw_, n * Hk * a, "keys before their norm"},
              {&LlamaModel::q_rstd_, n * static_cast<uint64_t>(config.num_attention_heads) * f4,
               "query norm statistics"},
              {&LlamaModel::k_rstd_, n * static_cast<uint64_t>(config.num_key_value_heads) * f4,
               "key norm statistics"},
          });
    if (sandwich)
      w.insert(w.end(), {{&LlamaModel::o_raw_, n * D * a, "attention output before its norm"},
                         {&LlamaModel::m_raw_, n * D * a, "MLP output before its norm"}});
  } else {
    w.push_back({&LlamaModel::stash_,
                 sets * static_cast<uint64_t>(config.num_hidden_layers) *
                     stash_offsets(config, options)[kStashParts],
                 "activations kept for backward (no recompute)"});
  }
  if (!fwd)
    w.insert(w.end(), {
                          {&LlamaModel::d_big_, n * F * a, "SwiGLU gradient"},
                          {&LlamaModel::d_gate_, n * F * a, "gate gradient"},
                          {&LlamaModel::d_up_, n * F * a, "up gradient"},
                          {&LlamaModel::dq_, n * Hq * a, "query gradient"},
                          {&LlamaModel::dk_, n * Hk * a, "key gradient"},
                          {&LlamaModel::dv_, n * Hk * a, "value gradient"},
                          {&LlamaModel::d_att_, n * Hq * a, "attention gradient"},
                          {&LlamaModel::d_h_, n * D * a, "residual gradient"},
                          {&LlamaModel::d_small_, n * D * a, "normed-input gradient"},
                      });
  if (!fwd && sandwich) w.push_back({&LlamaModel::d_sub_, n * D * a, "sublayer output gradient"});
  if (!fwd && config.qk_norm)
    w.insert(w.end(), {
                          {&LlamaModel::dq_raw_, n * Hq * a, "query gradient before its norm"},
                          {&LlamaModel::dk_raw_, n * Hk * a, "key gradient before its norm"},
                      });
  w.push_back({&LlamaModel::chunk_, n * static_cast<uint64_t>(C) * f4, "logits chunk"});
  if (options.param_dtype != DType::f32 && !fwd)
    w.push_back(
        {&LlamaModel::chunk_act_, n * static_cast<uint64_t>(C) * a, "logits gradient chunk"});
  // The log-sum-exp per token, from the head's forward to its backward: one per set.
  w.push_back({&LlamaModel::row_max_, sets * n * f4, "cross-entropy state"});
  // The running sum and the target's logit too, for vocabulary pieces (a group of micro-batches
  // runs each piece's forward for every one of them before the next piece's).
  w.push_back({&LlamaModel::row_sum_, sets * n * f4, "cross-entropy state"});
  w.push_back({&LlamaModel::target_logit_, sets * n * f4, "cross-entropy state"});
  w.push_back({&LlamaModel::losses_, n * f4, "per-token losses"});
  if (config.rope_local_base_freq > 0)
    w.push_back({&LlamaModel::rope_local_, static_cast<uint64_t>(T * config.rotary_dim()) * f4,
                 "rotary table (sliding layers)"});
  if (options.kv_cache && decoding_switches_rope(config, T))
    w.push_back({&LlamaModel::rope_short_, static_cast<uint64_t>(T * config.rotary_dim()) * f4,
                 "rotary table (short factors)"});
  if (options.kv_cache)
    w.push_back({&LlamaModel::kv_, static_cast<uint64_t>(config.num_hidden_layers) * 2 * n * Hk * a,
                 "KV cache"});
  return w;
}

uint64_t LlamaModel::workspace_bytes_for(const LlamaConfig& config, const ModelOptions& options,
                                         uint64_t alignment) {
  if (alignment == 0) fail("workspace alignment 0: pass 1 for exact bytes");
  uint64_t total = 0;
  for (const WorkspaceBuffer& b : workspace(config, options)) total += align_up(b.bytes, alignment);
  return total;
}

LlamaModel::LlamaModel(const LlamaConfig& config, const ModelOptions& options, Device& device)
    : config_(config),
      layout_(ModelLayout::build(config)),
      options_(options),
      device_(device),
      k_(device.kernels()) {
  // A forward-only model keeps no block's activations: its blocks work in the scratch, as
  // recomputation's do.
  if (options_.forward_only) options_.recompute = true;
  const int64_t T = options.seq_len;
  for (const WorkspaceBuffer& b : workspace(config, options)) {
    // The model's workspace: activations and scratch.
    this->*b.member = DeviceBuffer(device, b.bytes, b.what, MemoryKind::activations);
    workspace_bytes_ += b.bytes;
  }

  // The rotary table, uploaded once (synchronously: the host copy is a temporary).
  const std::vector<float> table = rope_table(config, T);
  auto s = device.create_stream("model setup");
  device.copy_to_device(rope_.data(), table.data(), table.size() * sizeof(float), *s);
  // Rotated with the short factors, all T rows of them; alive until the copy is done.
  std::vector<float> short_table;
  if (rope_short_.data() != nullptr) {
    short_table = rope_table(config, T, config.rope_scaling.original_max_position_embeddings);
    device.copy_to_device(rope_short_.data(), short_table.data(),
                          short_table.size() * sizeof(float), *s);
  }
  // Gemma 3's sliding layers: their own base, unscaled.
  std::vector<float> local_table;
  if (rope_local_.data() != nullptr) {
    LlamaConfig local = config;
    local.rope_theta = config.rope_local_base_freq;
    local.rope_scaling = RopeScaling{};
    local_table = rope_table(local, T);
    device.copy_to_device(rope_local_.data(), local_table.data(),
                          local_table.size() * sizeof(float), *s);
  }
  s->synchronize();
}

TensorView LlamaModel::rows(const DeviceBuffer& buf, DType dtype, int64_t n, int64_t cols) const {
  return buf.view(dtype, cols > 0 ? Shape{n, cols} : Shape{n});
}

TensorView LlamaModel::slot(int index, int64_t batch) const {
  const int64_t N = batch * options_.seq_len, D = config_.hidden_size;
  const uint64_t bytes = static_cast<uint64_t>(N * D) * dtype_size(options_.param_dtype);
  const uint64_t stride = static_cast<uint64_t>(options_.max_batch * options_.seq_len * D) *
                          dtype_size(options_.param_dtype);
  char* base = static_cast<char*>(checkpoints_.data()) + static_cast<uint64_t>(index) * stride;
  if (static_cast<uint64_t>(index) * stride + bytes > checkpoints_.bytes())
    fail("activation slot {} is past the checkpoint buffer; this is a bug in strata", index);
  return TensorView{base, options_.param_dtype, {N, D}, &device_};
}

void LlamaModel::refuse_if_forward_only(const char* what) const {
  if (options_.forward_only)
    fail(
        "{}: model {} was built for evaluation (ModelOptions::forward_only) and has no room for "
        "a backward; build it without forward_only to train; this is a bug in strata",
        what, config_.name);
}

void LlamaModel::check_set(int set) const {
  if (set < 0 || set >= options_.activation_sets)
    fail("activation set {} is outside 0..{}; this is a bug in strata", set,
         options_.activation_sets - 1);
}

TensorView LlamaModel::checkpoint(int u, int64_t batch, int set) const {
  if (u < 1 || u >= layout_.num_units())
    fail("unit {} has no activation checkpoint (units 1..{} do)", u, layout_.num_units() - 1);
  check_set(set);
  const int at = layout_.input_position(u);
  if (options_.forward_only) return slot(set * 2 + at % 2, batch);  // alternating
  if (const int K = options_.checkpoint_slots; offloaded_checkpoints(config_, K) > 0) {
    const int L = static_cast<int>(config_.num_hidden_layers);
    const int per_set = K + (layout_.vocab_pieces > 1 ? 1 : 0);
    return slot(set * per_set + (at <= L ? at % K : K), batch);
  }
  const int per_set = std::max(
      static_cast<int>(config_.num_hidden_layers) + 1 + (layout_.vocab_pieces > 1 ? 1 : 0), 2);
  return slot(set * per_set + at, batch);
}

TensorView LlamaModel::losses(int64_t batch) const {
  return rows(losses_, DType::f32, batch * options_.seq_len, 0);
}

TensorView LlamaModel::param(const std::vector<UnitBuffers>& units, int u, std::string_view name,
                             bool grad) const {
  const UnitLayout& unit = layout_.units[static_cast<size_t>(u)];
  const ParamSlot& p = unit.slot(name);
  const UnitBuffers& b = units.at(static_cast<size_t>(u));
  const DType t = grad ? options_.grad_dtype : options_.param_dtype;
  void* base = grad ? b.grads : b.params;
  if (base == nullptr)
    fail("unit {}: no {} buffer given; pass one for every unit", unit.name,
         grad ? "gradient" : "parameter");
  return TensorView{static_cast<char*>(base) + p.offset * dtype_size(t), t, p.shape, &device_};
}

LlamaModel::BlockActs LlamaModel::acts(int u, int64_t batch, int set) const {
  const LlamaConfig& c = config_;
  const DType t = options_.param_dtype;
  const int64_t T = options_.seq_len, N = batch * T, D = c.hidden_size, F = c.intermediate_size;
  const int64_t H = c.num_attention_heads, Hq = H * c.head_dim;
  const int64_t Hk = c.num_key_value_heads * c.head_dim;
  const int64_t Hkv = c.num_key_value_heads;
  if (options_.recompute) {
    BlockActs a{rows(q_, t, N, Hq),
                rows(k_buf_, t, N, Hk),
                rows(v_, t, N, Hk),
                rows(att_, t, N, Hq),
                lse_.view(DType::f32, {batch, H, T}),
                rows(h_, t, N, D),
                rows(gate_, t, N, F),
                rows(up_, t, N, F)};
    if (c.qk_norm) {
      a.q_raw = rows(q_raw_, t, N, Hq);
      a.k_raw = rows(k_raw_, t, N, Hk);
      a.q_rstd = rows(q_rstd_, DType::f32, N * H, 0);
      a.k_rstd = rows(k_rstd_, DType::f32, N * Hkv, 0);
    }
    if (sandwich_norms(c)) {
      a.o_raw = rows(o_raw_, t, N, D);
      a.m_raw = rows(m_raw_, t, N, D);
    }
    return a;
  }
  if (u < 0 || u >= layout_.num_units() || layer(u) < 0 || batch < 1 ||
      batch > options_.max_batch || set < 0 || set >= options_.activation_sets)
    fail(
        "block activations of unit {} for {} sequences in set {}: none kept; this is a bug in "
        "strata",
        u, batch, set);
  const std::array<uint64_t, kStashParts + 1> off = stash_offsets(c, options_);
  const auto index = static_cast<uint64_t>(set) * static_cast<uint64_t>(c.num_hidden_layers) +
                     static_cast<uint64_t>(layer(u));
  char* base = static_cast<char*>(stash_.data()) + index * off[kStashParts];
  auto at = [&](int i, DType dt, Shape shape) {
    return TensorView{base + off[static_cast<size_t>(i)], dt, shape, &device_};
  };
  BlockActs a{at(0, t, {N, Hq}),
              at(1, t, {N, Hk}),
              at(2, t, {N, Hk}),
              at(3, t, {N, Hq}),
              at(4, DType::f32, {batch, H, T}),
              at(5, t, {N, D}),
              at(6, t, {N, F}),
              at(7, t, {N, F})};
  if (c.qk_norm) {
    a.q_raw = at(8, t, {N, Hq});
    a.k_raw = at(9, t, {N, Hk});
    a.q_rstd = at(10, DType::f32, {N * H});
    a.k_rstd = at(11, DType::f32, {N * Hkv});
  }
  if (sandwich_norms(c)) {
    a.o_raw = at(12, t, {N, D});
    a.m_raw = at(13, t, {N, D});
  }
  return a;
}

void LlamaModel::block_forward(int u, const std::vector<UnitBuffers>& units, const TensorView& x,
                               const TensorView& out, int64_t batch, int set, Stream& s,
                               const int32_t* doc_start, const Span* span) {
  const LlamaConfig& c = config_;
  const DType t = options_.param_dtype;
  const int64_t D = c.hidden_size, F = c.intermediate_size;
  const int64_t H = c.num_attention_heads, Hkv = c.num_key_value_heads, hd = c.head_dim;
  // Tokens per sequence in this call, the first one's position and the keys' positions.
  const int64_t T = span ? span->tokens : options_.seq_len, N = batch * T;
  const int64_t pos = span ? span->pos : 0, Tk = pos + T;
  auto w = [&](std::string_view n) { return param(units, u, n, false); };
  BlockActs a = acts(u, batch, set);
  // The keys and values attention reads: the block's own T positions, or with a span the
  // cache's first pos + T, whose last T this call's projections write.
  TensorView keys{a.k.data, t, {batch, T, Hkv, hd}, &device_};
  TensorView values{a.v.data, t, {batch, T, Hkv, hd}, &device_};
  if (span) {
    const int64_t Hq = H * hd, Hk = Hkv * hd;
    const uint64_t plane = static_cast<uint64_t>(options_.seq_len * Hk) * dtype_size(t);
    char* k_cache = static_cast<char*>(kv_.data()) + static_cast<uint64_t>(layer(u)) * 2 * plane;
    char* v_cache = k_cache + plane;
    const uint64_t at_pos = static_cast<uint64_t>(pos * Hk) * dtype_size(t);
    keys = TensorView{k_cache, t, {1, Tk, Hkv, hd}, &device_};
    values = TensorView{v_cache, t, {1, Tk, Hkv, hd}, &device_};
    // The scratch's first N rows.
    auto first = [&](const TensorView& v, Shape shape) {
      return TensorView{v.data, v.dtype, shape, &device_};
    };
    const BlockActs whole = a;
    a = {first(a.q, {N, Hq}),
         TensorView{k_cache + at_pos, t, {N, Hk}, &device_},
         TensorView{v_cache + at_pos, t, {N, Hk}, &device_},
         first(a.att, {N, Hq}),
         first(a.lse, {batch, H, T}),
         first(a.h, {N, D}),
         first(a.gate, {N, F}),
         first(a.up, {N, F})};
    if (c.qk_norm) {
      a.q_raw = first(whole.q_raw, {N, Hq});
      a.k_raw = first(whole.k_raw, {N, Hk});
      a.q_rstd = first(whole.q_rstd, {N * H});
      a.k_rstd = first(whole.k_rstd, {N * Hkv});
    }
    if (sandwich_norms(c)) {
      a.o_raw = first(whole.o_raw, {N, D});
      a.m_raw = first(whole.m_raw, {N, D});
    }
  }
  const TensorView &q = a.q, &kk = a.k, &v = a.v, &att = a.att, &h = a.h, &gate = a.gate;
  const TensorView& up = a.up;
  const TensorView xn = rows(xn_, t, N, D), hn = rows(hn_, t, N, D), act = rows(act_, t, N, F);
  const TensorView rstd1 = rows(rstd1_, DType::f32, N, 0), rstd2 = rows(rstd2_, DType::f32, N, 0);
  // Rows pos.. of the rotary table: token n of a sequence takes row n % T of this view. A
  // LongRoPE decoding call whose positions stay within the original context takes the short
  // factors' table, as transformers' forward of those positions does.
  const int64_t rd = c.rotary_dim();
  const DeviceBuffer& table = c.layer_rotates_locally(layer(u)) ? rope_local_
                              : span != nullptr && rope_short_.data() != nullptr &&
                                      Tk <= c.rope_scaling.original_max_position_embeddings
                                  ? rope_short_
                                  : rope_;
  const TensorView rope{static_cast<char*>(table.data()) + static_cast<uint64_t>(pos * rd) * 4,
                        DType::f32,
                        {T, rd},
                        &device_};

  // y = alpha·x·Wᵀ, plus the bias where the config has one (broadcast into y, which the matmul
  // adds to: one rounding, as torch's addmm). alpha is 1 but for Granite's sublayer outputs
  // (residual_scale), which have no biases.
  auto linear = [&](const TensorView& y, const TensorView& in, std::string_view name, bool bias,
                    float alpha = 1.0f) {
    if (bias) k_.broadcast_rows(y, w(fmt::format("{}.bias", name)), s);
    k_.matmul(y, in, false, w(name), true, alpha, bias ? 1.0f : 0.0f, s);
  };
  const float residual = residual_scale(c);
  const float eps = static_cast<float>(c.rms_norm_eps), offset = norm_weight_offset(c);
  k_.rmsnorm_forward(xn, rstd1, x, w("input_layernorm"), eps, offset, s);
  if (c.qk_norm) {
    // Qwen3: each head of q and k through its norm, from the projections' output.
    linear(a.q_raw, xn, "q_proj", c.qkv_bias);
    linear(a.k_raw, xn, "k_proj", c.qkv_bias);
    k_.rmsnorm_forward(heads(q, H), a.q_rstd, heads(a.q_raw, H), w("q_norm"), eps, offset, s);
    k_.rmsnorm_forward(heads(kk, Hkv), a.k_rstd, heads(a.k_raw, Hkv), w("k_norm"), eps, offset, s);
  } else {
    linear(q, xn, "q_proj", c.qkv_bias);
    linear(kk, xn, "k_proj", c.qkv_bias);
  }
  linear(v, xn, "v_proj", c.qkv_bias);
  const TensorView q3{q.data, t, {N, H, hd}, &device_}, k3{kk.data, t, {N, Hkv, hd}, &device_};
  if (c.layer_rotates(layer(u))) {  // SmolLM3's NoPE layers attend without positions
    k_.rope(q3, rope, T, false, s);
    k_.rope(k3, rope, T, false, s);
  }
  k_.attention_forward(TensorView{att.data, t, {batch, T, H, hd}, &device_}, a.lse,
                       TensorView{q.data, t, {batch, T, H, hd}, &device_}, keys, values,
                       attention_mask(u, doc_start), s);
  // With sandwich norms (Gemma 2) each sublayer's output is normed before it joins the
  // residual, and the MLP's input norm is pre_feedforward_layernorm.
  const bool sandwich = sandwich_norms(c);
  if (sandwich) {
    linear(a.o_raw, att, "o_proj", c.o_bias);
    k_.rmsnorm_forward(h, rows(rstd3_, DType::f32, N, 0), a.o_raw, w("post_attention_layernorm"),
                       eps, offset, s);
  } else {
    linear(h, att, "o_proj", c.o_bias, residual);
  }
  k_.add(h, h, x, s);
  k_.rmsnorm_forward(hn, rstd2, h, w(mlp_norm(c)), eps, offset, s);
  linear(gate, hn, "gate_proj", c.mlp_bias);
  linear(up, hn, "up_proj", c.mlp_bias);
  k_.glu_forward(act, gate, up, c.hidden_act, s);
  if (out.data == nullptr) return;  // recomputation for backward: the output is not needed
  if (sandwich) {
    linear(a.m_raw, act, "down_proj", c.mlp_bias);
    k_.rmsnorm_forward(out, rows(rstd4_, DType::f32, N, 0), a.m_raw,
                       w("post_feedforward_layernorm"), eps, offset, s);
  } else {
    linear(out, act, "down_proj", c.mlp_bias, residual);
  }
  k_.add(out, out, h, s);
}

AttentionMask LlamaModel::attention_mask(int u, const int32_t* doc_start) const {
  // Block u is layer layer(u). Within the window every earlier key is in view already, so the
  // window is passed only where the sequences (or decoding's cache) outrun it. Decoding keeps
  // every position's keys and values, as transformers' default cache does; the window only
  // hides the old ones from each new query.
  const bool window = config_.layer_slides(layer(u)) && options_.seq_len > config_.sliding_window;
  AttentionMask mask = attention_scores(config_);  // Gemma 2's scale and cap
  mask.doc_start = doc_start;
  mask.window = window ? config_.sliding_window : 0;
  return mask;
}

void LlamaModel::block_backward(int u, const std::vector<UnitBuffers>& units, const TensorView& x,
                                const TensorView& dout, const TensorView& din, int64_t batch,
                                int set, Stream& s, const int32_t* doc_start) {
  const LlamaConfig& c = config_;
  const DType t = options_.param_dtype;
  const int64_t T = options_.seq_len, N = batch * T, D = c.hidden_size, F = c.intermediate_size;
  const int64_t H = c.num_attention_heads, Hkv = c.num_key_value_heads, hd = c.head_dim;
  auto w = [&](std::string_view n) { return param(units, u, n, false); };
  auto g = [&](std::string_view n) { return param(units, u, n, true); };
  const BlockActs a = acts(u, batch, set);
  const TensorView &q = a.q, &kk = a.k, &v = a.v, &att = a.att, &h = a.h, &gate = a.gate;
  const TensorView& up = a.up;
  const TensorView xn = rows(xn_, t, N, D), hn = rows(hn_, t, N, D), act = rows(act_, t, N, F);
  const TensorView rstd1 = rows(rstd1_, DType::f32, N, 0), rstd2 = rows(rstd2_, DType::f32, N, 0);
  if (options_.recompute) {
    block_forward(u, units, x, TensorView{}, batch, set, s, doc_start);
  } else {
    // The forward kept the rest; these three are the same kernels on the same inputs, so the
    // same bits as the forward's.
    const float eps = static_cast<float>(c.rms_norm_eps);
    k_.rmsnorm_forward(xn, rstd1, x, w("input_layernorm"), eps, norm_weight_offset(c), s);
    k_.rmsnorm_forward(hn, rstd2, h, w(mlp_norm(c)), eps, norm_weight_offset(c), s);
    k_.glu_forward(act, gate, up, c.hidden_act, s);
  }

  const TensorView da = rows(d_big_, t, N, F), dgate = rows(d_gate_, t, N, F);
  const TensorView dup = rows(d_up_, t, N, F), dsmall = rows(d_small_, t, N, D);
  const TensorView dh = rows(d_h_, t, N, D), datt = rows(d_att_, t, N, H * hd);
  const TensorView dq = rows(dq_, t, N, H * hd), dk = rows(dk_, t, N, Hkv * hd);
  const TensorView dv = rows(dv_, t, N, Hkv * hd);
  const TensorView rope = (c.layer_rotates_locally(layer(u)) ? rope_local_ : rope_)
                              .view(DType::f32, {T, c.rotary_dim()});

  // MLP: out = h + down(act(gate(hn)) * up(hn)), or with sandwich norms h + norm(down(...)).
  const float offset = norm_weight_offset(c), eps = static_cast<float>(c.rms_norm_eps);
  const bool sandwich = sandwich_norms(c);
  const TensorView rstd3 = sandwich ? rows(rstd3_, DType::f32, N, 0) : TensorView{};
  const TensorView rstd4 = sandwich ? rows(rstd4_, DType::f32, N, 0) : TensorView{};
  // With sandwich norms: the gradient at a sublayer's output, before its norm, from dy after it
  // (into d_sub_, which holds one at a time).
  auto before_norm = [&](const TensorView& dy, const TensorView& raw, const char* norm,
                         const TensorView& rstd) {
    const TensorView d = rows(d_sub_, t, N, D);
    k_.fill(d, 0.0f, s);
    k_.rmsnorm_backward(d, g(norm), dy, raw, w(norm), rstd, offset, s);
    return d;
  };
  TensorView dm = dout;  // the gradient at down_proj's output
  if (sandwich) {
    // The forward that recomputed the block stopped before down_proj; then the output norms'
    // statistics it did not leave (the same kernels on the same inputs: the forward's bits),
    // their outputs into dsmall, which the MLP's backward overwrites.
    if (options_.recompute) {
      if (c.mlp_bias) k_.broadcast_rows(a.m_raw, w("down_proj.bias"), s);
      k_.matmul(a.m_raw, act, false, w("down_proj"), true, 1.0f, c.mlp_bias ? 1.0f : 0.0f, s);
    }
    if (!options_.recompute)  // a recomputing forward left rstd3 already
      k_.rmsnorm_forward(dsmall, rstd3, a.o_raw, w("post_attention_layernorm"), eps, offset, s);
    k_.rmsnorm_forward(dsmall, rstd4, a.m_raw, w("post_feedforward_layernorm"), eps, offset, s);
    dm = before_norm(dout, a.m_raw, "post_feedforward_layernorm", rstd4);
  }
  // Granite's sublayer outputs were scaled by residual_scale (1 elsewhere): so are their
  // gradients.
  const float residual = residual_scale(c);
  k_.matmul(da, dm, false, w("down_proj"), false, residual, 0.0f, s);
  k_.matmul(g("down_proj"), dm, true, act, false, residual, 1.0f, s);
  if (c.mlp_bias) k_.bias_backward(g("down_proj.bias"), dm, s);
  k_.glu_backward(dgate, dup, da, gate, up, c.hidden_act, s);
  if (c.mlp_bias) {
    k_.bias_backward(g("gate_proj.bias"), dgate, s);
    k_.bias_backward(g("up_proj.bias"), dup, s);
  }
  k_.matmul(dsmall, dgate, false, w("gate_proj"), false, 1.0f, 0.0f, s);
  k_.matmul(dsmall, dup, false, w("up_proj"), false, 1.0f, 1.0f, s);
  k_.matmul(g("gate_proj"), dgate, true, hn, false, 1.0f, 1.0f, s);
  k_.matmul(g("up_proj"), dup, true, hn, false, 1.0f, 1.0f, s);
  device_.copy_on_device(dh.data, dout.data, dh.bytes(), s);
  k_.rmsnorm_backward(dh, g(mlp_norm(c)), dsmall, h, w(mlp_norm(c)), rstd2, offset, s);

  // Attention: h = x + o_proj(attention(rope(q), rope(k), v)), or with sandwich norms
  // x + norm(o_proj(...)).
  // The gradient at o_proj's output.
  const TensorView d_o =
      sandwich ? before_norm(dh, a.o_raw, "post_attention_layernorm", rstd3) : dh;
  k_.matmul(datt, d_o, false, w("o_proj"), false, residual, 0.0f, s);
  k_.matmul(g("o_proj"), d_o, true, att, false, residual, 1.0f, s);
  if (c.o_bias) k_.bias_backward(g("o_proj.bias"), d_o, s);
  k_.attention_backward(TensorView{dq.data, t, {batch, T, H, hd}, &device_},
                        TensorView{dk.data, t, {batch, T, Hkv, hd}, &device_},
                        TensorView{dv.data, t, {batch, T, Hkv, hd}, &device_},
                        TensorView{datt.data, t, {batch, T, H, hd}, &device_},
                        TensorView{q.data, t, {batch, T, H, hd}, &device_},
                        TensorView{kk.data, t, {batch, T, Hkv, hd}, &device_},
                        TensorView{v.data, t, {batch, T, Hkv, hd}, &device_},
                        TensorView{att.data, t, {batch, T, H, hd}, &device_}, a.lse,
                        attention_mask(u, doc_start), s);
  if (c.layer_rotates(layer(u))) {
    k_.rope(TensorView{dq.data, t, {N, H, hd}, &device_}, rope, T, true, s);
    k_.rope(TensorView{dk.data, t, {N, Hkv, hd}, &device_}, rope, T, true, s);
  }
  // dq and dk now reach the norms' outputs (Qwen3) or the projections' (else).
  TensorView dq_proj = dq, dk_proj = dk;
  if (c.qk_norm) {
    dq_proj = rows(dq_raw_, t, N, H * hd);
    dk_proj = rows(dk_raw_, t, N, Hkv * hd);
    k_.fill(dq_proj, 0.0f, s);
    k_.fill(dk_proj, 0.0f, s);
    k_.rmsnorm_backward(heads(dq_proj, H), g("q_norm"), heads(dq, H), heads(a.q_raw, H),
                        w("q_norm"), a.q_rstd, offset, s);
    k_.rmsnorm_backward(heads(dk_proj, Hkv), g("k_norm"), heads(dk, Hkv), heads(a.k_raw, Hkv),
                        w("k_norm"), a.k_rstd, offset, s);
  }
  if (c.qkv_bias) {
    k_.bias_backward(g("q_proj.bias"), dq_proj, s);
    k_.bias_backward(g("k_proj.bias"), dk_proj, s);
    k_.bias_backward(g("v_proj.bias"), dv, s);
  }
  k_.matmul(dsmall, dq_proj, false, w("q_proj"), false, 1.0f, 0.0f, s);
  k_.matmul(dsmall, dk_proj, false, w("k_proj"), false, 1.0f, 1.0f, s);
  k_.matmul(dsmall, dv, false, w("v_proj"), false, 1.0f, 1.0f, s);
  k_.matmul(g("q_proj"), dq_proj, true, xn, false, 1.0f, 1.0f, s);
  k_.matmul(g("k_proj"), dk_proj, true, xn, false, 1.0f, 1.0f, s);
  k_.matmul(g("v_proj"), dv, true, xn, false, 1.0f, 1.0f, s);
  device_.copy_on_device(din.data, dh.data, din.bytes(), s);
  k_.rmsnorm_backward(din, g("input_layernorm"), dsmall, x, w("input_layernorm"), rstd1, offset, s);
}

void LlamaModel::head_norm(const std::vector<UnitBuffers>& units, const TensorView& x,
                           const TensorView& xf, Stream& s) {
  const TensorView rstd = rows(rstd1_, DType::f32, x.shape[0], 0);
  k_.rmsnorm_forward(xf, rstd, x, param(units, layout_.first_head(), "norm", false),
                     static_cast<float>(config_.rms_norm_eps), norm_weight_offset(config_), s);
}

void LlamaModel::piece_logits(int u, const std::vector<UnitBuffers>& units, const TensorView& xf,
                              const TensorView& out, Stream& s) {
  const LlamaConfig& c = config_;
  const TensorView w = param(units, layout_.table_unit(u),
                             c.tie_word_embeddings ? "embed_tokens" : "lm_head", false);
  k_.matmul(out, xf, false, w, true, logits_scale(c), 0.0f, s);
  if (c.final_logit_softcapping > 0)
    k_.softcap(out, static_cast<float>(c.final_logit_softcapping), s);
}

void LlamaModel::head(int u, const std::vector<UnitBuffers>& units, const TensorView& x,
                      const int32_t* targets, int64_t batch, bool backward, float loss_scale,
                      const TensorView& xn_out, const TensorView& dout, const TensorView& dx,
                      int set, Stream& s) {
  const LlamaConfig& c = config_;
  const DType t = options_.param_dtype;
  const int64_t N = batch * options_.seq_len, D = c.hidden_size;
  const UnitLayout& unit = layout_.units.at(static_cast<size_t>(u));
  const int pieces = layout_.vocab_pieces;
  const bool first = unit.piece == 0, last = unit.piece == pieces - 1;
  const int w_unit = layout_.table_unit(u);
  const char* w_name = c.tie_word_embeddings ? "embed_tokens" : "lm_head";
  const TensorView w = param(units, w_unit, w_name, false);
  // The cross-entropy's state of set `set`, from the first piece's forward to the last piece's
  // backward.
  const uint64_t at = static_cast<uint64_t>(set * options_.max_batch * options_.seq_len) * 4;
  auto state = [&](const DeviceBuffer& b) {
    return TensorView{static_cast<char*>(b.data()) + at, DType::f32, {N}, &device_};
  };
  const TensorView row_max = state(row_max_), row_sum = state(row_sum_),
                   target_logit = state(target_logit_);
  // The normed input: piece 0 norms x (for the later pieces, into xn_out, in a forward); the
  // later pieces' x is it.
  TensorView xf = x;
  if (first) {
    xf = pieces > 1 && !backward ? xn_out : rows(xn_, t, N, D);
    head_norm(units, x, xf, s);
  }
  if (!backward && first) {
    k_.fill(row_max, -std::numeric_limits<float>::infinity(), s);
    k_.fill(row_sum, 0.0f, s);
    k_.fill(target_logit, 0.0f, s);
  }
  // The gradient of the normed input: the last piece starts it, each earlier piece adds its own
  // to what came down (dout); piece 0's then goes back through the norm.
  const TensorView dxf = !backward ? TensorView{} : first ? rows(d_small_, t, N, D) : dx;
  bool accumulate = false;
  if (backward && !last) {
    device_.copy_on_device(dxf.data, dout.data, dxf.bytes(), s);
    accumulate = true;
  }
  const int64_t V = unit.vocab_rows, v_first = unit.vocab_first;
  const int64_t chunk = std::min(options_.vocab_chunk, V);
  const auto cap = static_cast<float>(c.final_logit_softcapping);
  const float scale = logits_scale(c);  // Granite's 1 / logits_scaling, 1 elsewhere
  for (int64_t v0 = 0; v0 < V; v0 += chunk) {
    const int64_t C = std::min(chunk, V - v0);
    const TensorView wc{static_cast<char*>(w.data) + static_cast<uint64_t>(v0 * D) * dtype_size(t),
                        t,
                        {C, D},
                        &device_};
    const TensorView logits = chunk_.view(DType::f32, {N, C});
    k_.matmul(logits, xf, false, wc, true, scale, 0.0f, s);
    if (cap > 0.0f) k_.softcap(logits, cap, s);  // Gemma 2's final_logit_softcapping
    if (!backward) {
      k_.xent_forward_chunk(logits, v_first + v0, targets, row_max, row_sum, target_logit, s);
      continue;
    }
    // row_max holds the log-sum-exp since the last piece's xent_finish.
    k_.xent_backward_chunk(logits, v_first + v0, targets, row_max, loss_scale, cap, s);
    TensorView dlogits = logits;
    if (t != DType::f32) {
      dlogits = chunk_act_.view(t, {N, C});
      device_.convert(dlogits, logits, s);
    }
    const TensorView gw = param(units, w_unit, w_name, true);
    const TensorView gwc{
        static_cast<char*>(gw.data) + static_cast<uint64_t>(v0 * D) * dtype_size(gw.dtype),
        gw.dtype,
        {C, D},
        &device_};
    k_.matmul(dxf, dlogits, false, wc, false, scale, accumulate ? 1.0f : 0.0f, s);
    accumulate = true;
    k_.matmul(gwc, dlogits, true, xf, false, scale, 1.0f, s);
  }
  if (!backward) {
    if (last) k_.xent_finish(losses(batch), row_max, row_max, row_sum, target_logit, targets, s);
    return;
  }
  if (!first) return;
  device_.fill_zero(dx.data, dx.bytes(), s);
  k_.rmsnorm_backward(dx, param(units, u, "norm", true), dxf, x, param(units, u, "norm", false),
                      rows(rstd1_, DType::f32, N, 0), norm_weight_offset(c), s);
}

void LlamaModel::forward_unit(int u, const std::vector<UnitBuffers>& units, const int32_t* ids,
                              const int32_t* targets, const TensorView& in, const TensorView& out,
                              int64_t batch, Stream& s, int set, const int32_t* doc_start) {
  check_set(set);
  const UnitLayout& unit = layout_.units.at(static_cast<size_t>(u));
  switch (unit.kind) {
    case UnitKind::embedding:
      k_.embedding_forward(out, param(units, u, "embed_tokens", false), ids,
                           embedding_scale(config_, options_.param_dtype), table_rows(u), s);
      break;
    case UnitKind::block:
      block_forward(u, units, in, out, batch, set, s, doc_start);
      break;
    case UnitKind::head:
      head(u, units, in, targets, batch, false, 0.0f, out, TensorView{}, TensorView{}, set, s);
      break;
  }
}

void LlamaModel::backward_unit(int u, const std::vector<UnitBuffers>& units, const int32_t* ids,
                               const int32_t* targets, float loss_scale, const TensorView& in,
                               const TensorView& dout, const TensorView& din, int64_t batch,
                               Stream& s, int set, const int32_t* doc_start) {
  check_set(set);
  refuse_if_forward_only("backward_unit");
  const UnitLayout& unit = layout_.units.at(static_cast<size_t>(u));
  switch (unit.kind) {
    case UnitKind::embedding:
      k_.embedding_backward(param(units, u, "embed_tokens", true), dout, ids,
                            embedding_scale(config_, options_.param_dtype), table_rows(u), s);
      // The earlier pieces read the same gradient: it goes on down as din.
      if (u > 0) device_.copy_on_device(din.data, dout.data, din.bytes(), s);
      break;
    case UnitKind::block:
      block_backward(u, units, in, dout, din, batch, set, s, doc_start);
      break;
    case UnitKind::head:
      head(u, units, in, targets, batch, true, loss_scale, TensorView{}, dout, din, set, s);
      break;
  }
}

void LlamaModel::forward(const std::vector<UnitBuffers>& units, const int32_t* ids,
                         const int32_t* targets, int64_t batch, bool keep_checkpoints, Stream& s,
                         const int32_t* doc_start) {
  if (batch < 1 || batch > options_.max_batch)
    fail("batch of {} sequences is outside 1..{} (the model's max batch); split it", batch,
         options_.max_batch);
  if (units.size() != layout_.units.size())
    fail("forward: {} unit buffers given for a model of {} units", units.size(),
         layout_.units.size());
  if (keep_checkpoints) refuse_if_forward_only("forward keeping the activation checkpoints");
  if (keep_checkpoints && offloaded_checkpoints(config_, options_.checkpoint_slots) > 0)
    fail(
        "forward: model {} keeps its activation checkpoints in a ring of {} slots "
        "(ModelOptions::checkpoint_slots), which only the executor's schedule moves to the host "
        "and back; this is a bug in strata",
        config_.name, options_.checkpoint_slots);
  const int U = layout_.num_units();
  // The input of unit u (u ≥ 1) goes to the slot of its position, or alternates between two
  // slots when the inputs need not be kept.
  auto slot_of = [&](int u) {
    const int at = layout_.input_position(u);
    return keep_checkpoints ? at : at % 2;
  };
  for (int u = 0; u < U; ++u) {
    const TensorView in = u == 0 ? TensorView{} : slot(slot_of(u), batch);
    const TensorView out = u + 1 < U ? slot(slot_of(u + 1), batch) : TensorView{};
    forward_unit(u, units, ids, targets, in, out, batch, s, 0, doc_start);
  }
  last_slot_ = slot_of(layout_.first_head());
  kept_ = keep_checkpoints;
}

void LlamaModel::backward(const std::vector<UnitBuffers>& units, const int32_t* ids,
                          const int32_t* targets, int64_t batch, float loss_scale, Stream& s,
                          const int32_t* doc_start) {
  refuse_if_forward_only("backward");
  const int U = layout_.num_units();
  if (!kept_)
    fail(
        "backward: the last forward did not keep its activation checkpoints; run forward with "
        "keep_checkpoints = true first");
  const int64_t N = batch * options_.seq_len, D = config_.hidden_size;
  TensorView dout = rows(grad_a_, options_.param_dtype, N, D);
  TensorView din = rows(grad_b_, options_.param_dtype, N, D);
  for (int u = U - 1; u >= 0; --u) {
    const TensorView in = u == 0 ? TensorView{} : checkpoint(u, batch);
    backward_unit(u, units, ids, targets, loss_scale, in, dout, din, batch, s, 0, doc_start);
    std::swap(dout, din);
  }
}

void LlamaModel::logits(const std::vector<UnitBuffers>& units, const TensorView& out, int64_t batch,
                        Stream& s) {
  const int64_t N = batch * options_.seq_len;
  const TensorView xf = rows(xn_, options_.param_dtype, N, config_.hidden_size);
  head_norm(units, slot(last_slot_, batch), xf, s);
  if (layout_.vocab_pieces == 1 || N == 1) {  // each piece's columns contiguous in `out`
    for (int u = layout_.first_head(); u < layout_.num_units(); ++u)
      piece_logits(u, units, xf, logits_columns(u, out), s);
    return;
  }
  const int64_t V = config_.vocab_size;
  const UnitLayout& widest = layout_.units.at(static_cast<size_t>(layout_.first_head()));
  DeviceBuffer piece(device_, static_cast<uint64_t>(N * widest.vocab_rows) * 4, "piece logits");
  for (int u = layout_.first_head(); u < layout_.num_units(); ++u) {
    const UnitLayout& unit = layout_.units.at(static_cast<size_t>(u));
    const int64_t C = unit.vocab_rows;
    piece_logits(u, units, xf, piece.view(DType::f32, {N, C}), s);
    for (int64_t r = 0; r < N; ++r)
      device_.copy_on_device(
          static_cast<char*>(out.data) + static_cast<uint64_t>(r * V + unit.vocab_first) * 4,
          static_cast<char*>(piece.data()) + static_cast<uint64_t>(r * C) * 4,
          static_cast<uint64_t>(C) * 4, s);
  }
  s.synchronize();
}

TensorView LlamaModel::logits_columns(int u, const TensorView& out) const {
  const UnitLayout& unit = layout_.units.at(static_cast<size_t>(u));
  if (layout_.vocab_pieces == 1) return out;
  return TensorView{static_cast<char*>(out.data) + static_cast<uint64_t>(unit.vocab_first) * 4,
                    DType::f32,
                    {out.shape[0], unit.vocab_rows},
                    &device_};
}

TensorView LlamaModel::decode_slot(int u, int64_t n) const {
  // Unit u's input in the slot of its position's parity, as a forward that keeps nothing
  // alternates them.
  return TensorView{slot(layout_.input_position(u) % 2, 1).data,
                    options_.param_dtype,
                    {n, config_.hidden_size},
                    &device_};
}

void LlamaModel::decode_unit(int u, const std::vector<UnitBuffers>& units, const int32_t* ids,
                             int64_t pos, int64_t n, const TensorView& in, const TensorView& out,
                             const TensorView& logits_out, Stream& s) {
  if (!options_.kv_cache)
    fail(
        "decode: the model was built without a KV cache (ModelOptions::kv_cache); this is a bug "
        "in strata");
  if (units.size() != layout_.units.size())
    fail("decode: {} unit buffers given for a model of {} units", units.size(),
         layout_.units.size());
  const int64_t T = options_.seq_len;
  if (n < 1 || pos < 0 || pos + n > T)
    fail(
        "decode: positions [{}, {}) do not fit the model's sequence length {}; start a new "
        "sequence, or build the model with a longer one",
        pos, pos + n, T);
  if (pos > cached_)
    fail("decode: position {} follows only {} cached positions; run positions [{}, {}) first", pos,
         cached_, cached_, pos);
  const UnitLayout& unit = layout_.units.at(static_cast<size_t>(u));
  const Span span{pos, n};
  switch (unit.kind) {
    case UnitKind::embedding:
      k_.embedding_forward(out, param(units, u, "embed_tokens", false), ids,
                           embedding_scale(config_, options_.param_dtype), table_rows(u), s);
      break;
    case UnitKind::block:
      block_forward(u, units, in, out, 1, 0, s, nullptr, &span);
      break;
    case UnitKind::head: {  // the last token only
      // Piece 0 norms the last row of `in`, into the first row of `out` when the head is cut:
      // the later pieces' `in`.
      const int64_t D = config_.hidden_size;
      const uint64_t row = static_cast<uint64_t>(D) * dtype_size(options_.param_dtype);
      TensorView xf{in.data, options_.param_dtype, {1, D}, &device_};
      if (unit.piece == 0) {
        const TensorView last{static_cast<char*>(in.data) + static_cast<uint64_t>(n - 1) * row,
                              options_.param_dtype,
                              {1, D},
                              &device_};
        xf = layout_.vocab_pieces > 1 ? TensorView{out.data, options_.param_dtype, {1, D}, &device_}
                                      : rows(xn_, options_.param_dtype, 1, D);
        head_norm(units, last, xf, s);
      }
      piece_logits(u, units, xf, logits_columns(u, logits_out), s);
      // Every block has written its keys and values by now.
      if (u + 1 == layout_.num_units()) cached_ = pos + n;
      break;
    }
  }
}

void LlamaModel::decode(const std::vector<UnitBuffers>& units, const int32_t* ids, int64_t pos,
                        int64_t n, const TensorView& logits_out, Stream& s) {
  const int U = layout_.num_units();
  for (int u = 0; u < U; ++u)
    decode_unit(u, units, ids, pos, n, u == 0 ? TensorView{} : decode_slot(u, n),
                u + 1 < U ? decode_slot(u + 1, n) : TensorView{}, logits_out, s);
}

}  // namespace strata
