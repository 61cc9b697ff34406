#include "model/config.h"

#include "core/error.h"
#include "model/file_io.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <limits>
#include <system_error>

namespace strata {

namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

// Bounds that keep every size product below 2^62 (no overflow in parameter counts).
constexpr int64_t kMaxSize = int64_t{1} << 24;   // hidden, intermediate, vocab, positions
constexpr int64_t kMaxCount = int64_t{1} << 16;  // layers, heads, head_dim

// A value as config.json spelled it, shortened for error messages.
std::string shown(const json& v) {
  std::string s = v.dump();
  if (s.size() > 80) s = s.substr(0, 77) + "...";
  return s;
}

// The field, or null when it is absent or JSON null (Hugging Face writes null for "unset").
const json* field(const json& j, const std::string& key) {
  const auto it = j.find(key);
  return it == j.end() || it->is_null() ? nullptr : &*it;
}

[[noreturn]] void type_error(std::string_view src, std::string_view key, std::string_view want,
                             const json& v) {
  fail("{}: field '{}' must be {}, got {} {}; fix config.json", src, key, want, v.type_name(),
       shown(v));
}

[[noreturn]] void missing(std::string_view src, std::string_view key) {
  fail(
      "{}: required field '{}' is missing; a Llama config.json sets it (compare with the "
      "model's published config.json)",
      src, key);
}

int64_t as_int(const json& v, std::string_view src, std::string_view key) {
  if (!v.is_number_integer()) type_error(src, key, "an integer", v);
  if (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t{std::numeric_limits<int64_t>::max()})
    fail("{}: field '{}' = {} is out of range; fix config.json", src, key, shown(v));
  return v.get<int64_t>();
}
double as_number(const json& v, std::string_view src, std::string_view key) {
  if (!v.is_number()) type_error(src, key, "a number", v);
  return v.get<double>();
}
bool as_bool(const json& v, std::string_view src, std::string_view key) {
  if (!v.is_boolean()) type_error(src, key, "true or false", v);
  return v.get<bool>();
}
const std::string& as_string(const json& v, std::string_view src, std::string_view key) {
  if (!v.is_string()) type_error(src, key, "a string", v);
  return v.get_ref<const std::string&>();
}

// The field converted by `as`; `prefix` makes nested names whole ("rope_scaling.factor").
template <typename Convert>
auto required(const json& j, const std::string& key, std::string_view src, Convert as,
              std::string_view prefix = "") {
  const std::string name = std::string(prefix) + key;
  const json* v = field(j, key);
  if (v == nullptr) missing(src, name);
  return as(*v, src, name);
}

}  // namespace

std::string_view rope_scaling_name(RopeScalingKind k) {
  switch (k) {
    case RopeScalingKind::none:
      return "default";
    case RopeScalingKind::llama3:
      return "llama3";
    case RopeScalingKind::linear:
      return "linear";
    case RopeScalingKind::dynamic:
      return "dynamic";
    case RopeScalingKind::yarn:
      return "yarn";
    case RopeScalingKind::longrope:
      return "longrope";
  }
  return "default";
}

namespace {

// A rope_scaling (or transformers 5's rope_parameters) object. Hugging Face has written the
// kind as "type" and later as "rope_type", sometimes both.
RopeScaling parse_rope_scaling(const json& r, std::string_view src, const std::string& key) {
  if (!r.is_object()) type_error(src, key, "an object or null", r);
  const json* rope_type = field(r, "rope_type");
  const json* type = field(r, "type");
  if (rope_type != nullptr && type != nullptr && *rope_type != *type)
    fail("{}: {}.rope_type {} and {}.type {} disagree; keep one of them", src, key,
         shown(*rope_type), key, shown(*type));
  const std::string kind_key = key + (rope_type != nullptr ? ".rope_type" : ".type");
  const json* kind = rope_type != nullptr ? rope_type : type;
  if (kind == nullptr)
    fail(
        "{}: {} has no rope_type (or type); set it to \"llama3\", \"linear\", \"dynamic\" or "
        "\"yarn\", or make {} null",
        src, key, key);
  const std::string& k = as_string(*kind, src, kind_key);
  RopeScaling s;
  if (k == "default") return s;  // Hugging Face's name for plain rotary embeddings
  const std::string prefix = key + ".";
  auto optional_number = [&](const char* name) -> std::optional<double> {
    if (const json* v = field(r, name)) return as_number(*v, src, prefix + name);
    return std::nullopt;
  };
  if (k == "llama3") {
    s.kind = RopeScalingKind::llama3;
    s.factor = required(r, "factor", src, as_number, prefix);
    s.low_freq_factor = required(r, "low_freq_factor", src, as_number, prefix);
    s.high_freq_factor = required(r, "high_freq_factor", src, as_number, prefix);
    s.original_max_position_embeddings =
        required(r, "original_max_position_embeddings", src, as_int, prefix);
    return s;
  }
  if (k == "linear" || k == "dynamic" || k == "yarn") {
    s.kind = k == "linear"    ? RopeScalingKind::linear
             : k == "dynamic" ? RopeScalingKind::dynamic
                              : RopeScalingKind::yarn;
    s.factor = required(r, "factor", src, as_number, prefix);
    if (const json* v = field(r, "original_max_position_embeddings"))
      s.original_max_position_embeddings =
          as_int(*v, src, prefix + "original_max_position_embeddings");
    if (s.kind != RopeScalingKind::yarn) return s;
    s.attention_factor = optional_number("attention_factor");
    s.beta_fast = optional_number("beta_fast");
    s.beta_slow = optional_number("beta_slow");
    s.mscale = optional_number("mscale");
    s.mscale_all_dim = optional_number("mscale_all_dim");
    if (const json* v = field(r, "truncate")) s.truncate = as_bool(*v, src, prefix + "truncate");
    return s;
  }
  if (k == "longrope" || k == "su") {  // "su": Phi-3's first name for it
    s.kind = RopeScalingKind::longrope;
    if (const json* v = field(r, "factor")) s.factor = as_number(*v, src, prefix + "factor");
    s.attention_factor = optional_number("attention_factor");
    if (const json* v = field(r, "original_max_position_embeddings"))
      s.original_max_position_embeddings =
          as_int(*v, src, prefix + "original_max_position_embeddings");
    for (const auto& [name, list] :
         {std::pair{"long_factor", &s.long_factor}, {"short_factor", &s.short_factor}}) {
      const json& v = required(
          r, name, src, [](const json& x, auto, auto) { return x; }, prefix);
      if (!v.is_array()) type_error(src, prefix + name, "a list of numbers", v);
      for (const json& x : v) list->push_back(as_number(x, src, prefix + name));
    }
    return s;
  }
  fail(
      "{}: {} '{}' is not supported; strata implements plain rotary embeddings ('default') and "
      "the 'llama3', 'linear', 'dynamic', 'yarn' and 'longrope' scalings",
      src, kind_key, k);
}

std::string_view hf_dtype_name(DType t) {
  return t == DType::f32 ? "float32" : t == DType::bf16 ? "bfloat16" : "float16";
}

struct KnownArchitecture {
  Architecture arch;
  const char* cls;
  const char* model_type;
};
constexpr KnownArchitecture kArchitectures[] = {
    {Architecture::llama, "LlamaForCausalLM", "llama"},
    {Architecture::mistral, "MistralForCausalLM", "mistral"},
    {Architecture::qwen2, "Qwen2ForCausalLM", "qwen2"},
    {Architecture::qwen3, "Qwen3ForCausalLM", "qwen3"},
    {Architecture::phi3, "Phi3ForCausalLM", "phi3"},
    {Architecture::gemma, "GemmaForCausalLM", "gemma"},
    {Architecture::gemma2, "Gemma2ForCausalLM", "gemma2"},
    {Architecture::gemma3, "Gemma3ForCausalLM", "gemma3_text"},
    {Architecture::smollm3, "SmolLM3ForCausalLM", "smollm3"},
    {Architecture::granite, "GraniteForCausalLM", "granite"},
};
constexpr const char* kKnownClasses =
    "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, "
    "Phi3ForCausalLM, GemmaForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM, "
    "SmolLM3ForCausalLM or GraniteForCausalLM";

// The architecture from "architectures" (the first class strata knows) and "model_type", which
// must agree where both are given.
Architecture parse_architecture(const json& j, std::string_view src) {
  const json* arch = field(j, "architectures");
  const json* model_type = field(j, "model_type");
  std::optional<Architecture> from_class, from_type;
  if (arch != nullptr) {
    if (!arch->is_array()) type_error(src, "architectures", "a list of strings", *arch);
    for (const json& a : *arch)
      for (const KnownArchitecture& k : kArchitectures)
        if (!from_class && a.is_string() && a == k.cls) from_class = k.arch;
    if (!from_class)
      fail(
          "{}: architectures {} names no class strata implements; strata trains the Llama "
          "family: {}",
          src, shown(*arch), kKnownClasses);
  }
  if (model_type != nullptr) {
    const std::string& t = as_string(*model_type, src, "model_type");
    for (const KnownArchitecture& k : kArchitectures)
      if (t == k.model_type) from_type = k.arch;
    if (!from_type)
      fail(
          "{}: model_type '{}' is not one strata implements; strata trains the Llama family: "
          "llama, mistral, qwen2, qwen3, phi3, gemma, gemma2, gemma3_text, smollm3 or granite",
          src, t);
  }
  if (from_class && from_type && *from_class != *from_type)
    fail("{}: architectures {} and model_type '{}' name different models; fix config.json", src,
         shown(*arch), model_type->get<std::string>());
  if (!from_class && !from_type)
    fail(
        "{}: neither architectures nor model_type is set, so this is not known to be a Llama "
        "config; add \"architectures\": [\"LlamaForCausalLM\"] (or the Mistral or Qwen2 class)",
        src);
  return from_class ? *from_class : *from_type;
}

// The attention window the model's layers use, 0 for none: Mistral's sliding_window (every
// layer); Qwen2's and Qwen3's when use_sliding_window is set and a layer uses it (layer_types,
// or the layers from max_window_layers on, as Hugging Face's configs derive them); Gemma 2's in
// the layers layer_types names, else every other layer from the first (4096 where
// sliding_window is absent, as Gemma2Config's default); those layers flagged in `sliding` (left
// empty where every layer slides). Llama and Gemma have none. SmolLM3's, with use_sliding_window,
// in the layers layer_types names, else its NoPE layers (`nope`, one flag a layer).
int64_t parse_sliding_window(const json& j, std::string_view src, Architecture arch, int64_t layers,
                             std::vector<bool>& sliding, const std::vector<bool>& nope) {
  sliding.clear();
  if (arch == Architecture::llama || arch == Architecture::gemma || arch == Architecture::granite)
    return 0;
  const json* w = field(j, "sliding_window");
  int64_t window = w != nullptr ? as_int(*w, src, "sliding_window") : 0;
  if (w != nullptr && window < 1)
    fail("{}: sliding_window = {} must be a positive number of positions, or null; fix config.json",
         src, window);
  if (arch == Architecture::mistral || arch == Architecture::phi3) return window;
  if (arch == Architecture::gemma2 || arch == Architecture::gemma3) {
    if (w == nullptr) window = 4096;
  } else {
    const json* use = field(j, "use_sliding_window");
    if (use == nullptr || !as_bool(*use, src, "use_sliding_window")) return 0;
    if (window == 0) return 0;
  }
  if (const json* types = field(j, "layer_types")) {
    if (!types->is_array()) type_error(src, "layer_types", "a list of strings", *types);
    if (static_cast<int64_t>(types->size()) != layers)
      fail("{}: layer_types has {} entries for {} layers (num_hidden_layers); give one a layer",
           src, types->size(), layers);
    for (const json& t : *types) {
      const std::string& s = as_string(t, src, "layer_types");
      if (s != "full_attention" && s != "sliding_attention")
        fail("{}: layer_types holds '{}'; strata knows full_attention and sliding_attention", src,
             s);
      sliding.push_back(s == "sliding_attention");
    }
  } else if (arch == Architecture::smollm3) {
    // SmolLM3Config: the NoPE layers slide.
    for (int64_t l = 0; l < layers; ++l) sliding.push_back(nope[static_cast<size_t>(l)]);
  } else if (arch == Architecture::gemma2) {
    for (int64_t l = 0; l < layers; ++l) sliding.push_back(l % 2 == 0);
  } else if (arch == Architecture::gemma3) {
    // Gemma3TextConfig's sliding_window_pattern: every pattern-th layer sees everything.
    const json* p = field(j, "sliding_window_pattern");
    const int64_t pattern = p != nullptr ? as_int(*p, src, "sliding_window_pattern") : 6;
    if (pattern < 1)
      fail("{}: sliding_window_pattern = {} must be at least 1; fix config.json", src, pattern);
    for (int64_t l = 0; l < layers; ++l) sliding.push_back((l + 1) % pattern != 0);
  } else {
    const json* m = field(j, "max_window_layers");
    const int64_t first_sliding = m != nullptr ? as_int(*m, src, "max_window_layers") : 28;
    for (int64_t l = 0; l < layers; ++l) sliding.push_back(l >= first_sliding);
  }
  const auto count = std::count(sliding.begin(), sliding.end(), true);
  if (count == 0) {
    sliding.clear();
    return 0;
  }
  if (count == layers) sliding.clear();  // every layer: the plain form
  return window;
}

// SmolLM3's NoPE layers: the zeros of no_rope_layers (one entry a layer, at least; extra ones
// ignored, as SmolLM3Config indexes it), else every no_rope_layer_interval-th layer (4). Empty
// where every layer rotates.
std::vector<bool> parse_nope_layers(const json& j, std::string_view src, int64_t layers) {
  std::vector<bool> nope;
  if (const json* list = field(j, "no_rope_layers")) {
    if (!list->is_array()) type_error(src, "no_rope_layers", "a list of 0 and 1", *list);
    if (static_cast<int64_t>(list->size()) < layers)
      fail("{}: no_rope_layers has {} entries for {} layers (num_hidden_layers); give one a layer",
           src, list->size(), layers);
    for (int64_t l = 0; l < layers; ++l) {
      const int64_t v = as_int((*list)[static_cast<size_t>(l)], src, "no_rope_layers");
      if (v != 0 && v != 1)
        fail("{}: no_rope_layers[{}] = {}; each is 1 (rotary embeddings) or 0 (none)", src, l, v);
      nope.push_back(v == 0);
    }
  } else {
    const json* i = field(j, "no_rope_layer_interval");
    const int64_t interval = i != nullptr ? as_int(*i, src, "no_rope_layer_interval") : 4;
    if (interval < 1)
      fail("{}: no_rope_layer_interval = {} must be at least 1; fix config.json", src, interval);
    for (int64_t l = 0; l < layers; ++l) nope.push_back((l + 1) % interval == 0);
  }
  if (std::find(nope.begin(), nope.end(), true) == nope.end()) nope.clear();
  return nope;
}

LlamaConfig make_preset(std::string name, int64_t hidden, int64_t intermediate, int64_t layers,
                        int64_t heads, int64_t kv_heads, int64_t vocab, int64_t positions,
                        double rope_theta, DType dtype, RopeScaling scaling = {}) {
  LlamaConfig c;
  c.name = std::move(name);
  c.hidden_size = hidden;
  c.intermediate_size = intermediate;
  c.num_hidden_layers = layers;
  c.num_attention_heads = heads;
  c.num_key_value_heads = kv_heads;
  c.head_dim = hidden / heads;
  c.vocab_size = vocab;
  c.max_position_embeddings = positions;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = rope_theta;
  c.rope_scaling = scaling;
  c.tie_word_embeddings = false;
  c.torch_dtype = dtype;
  return c;
}

// Llama 3.2's 1B and 3B share their embedding with the head.
LlamaConfig tied(LlamaConfig c) {
  c.tie_word_embeddings = true;
  return c;
}
// Mistral 7B v0.3 (no sliding window), as published.
LlamaConfig mistral(LlamaConfig c) {
  c.architecture = Architecture::mistral;
  return c;
}
// Qwen2.5's: biases on q, k and v, eps 1e-6.
LlamaConfig qwen2(LlamaConfig c) {
  c.architecture = Architecture::qwen2;
  c.qkv_bias = true;
  c.rms_norm_eps = 1e-6;
  return c;
}
// Gemma's (the first, 2B and 7B): head_dim 256 whatever hidden / heads is, eps 1e-6, tied, the
// tanh GELU; its norms and embeddings follow the class (norm_weight_offset, embedding_scale).
LlamaConfig gemma(LlamaConfig c) {
  c.architecture = Architecture::gemma;
  c.head_dim = 256;
  c.rms_norm_eps = 1e-6;
  c.tie_word_embeddings = true;
  c.hidden_act = Activation::gelu_tanh;
  return c;
}
// Gemma 2's: Gemma's, with a window of 4096 in every other layer (the first included), scores
// capped at 50 and scaled by query_pre_attn_scalar^-1/2, logits capped at 30.
LlamaConfig gemma2(LlamaConfig c, int64_t head_dim, double query_pre_attn_scalar) {
  c = gemma(c);
  c.architecture = Architecture::gemma2;
  c.head_dim = head_dim;
  c.query_pre_attn_scalar = query_pre_attn_scalar;
  c.attn_logit_softcapping = 50.0;
  c.final_logit_softcapping = 30.0;
  c.sliding_window = 4096;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) c.sliding_layers.push_back(l % 2 == 0);
  return c;
}
// Gemma 3 1B's text model: Gemma 2's with q and k norms, no caps, a window of 512 in five layers
// of six, the sliding layers rotating with base 10000 and the others with rope_theta.
LlamaConfig gemma3(LlamaConfig c, int64_t window) {
  c = gemma2(c, 256, 256);
  c.architecture = Architecture::gemma3;
  c.qk_norm = true;
  c.attn_logit_softcapping = c.final_logit_softcapping = 0;
  c.sliding_window = window;
  c.rope_local_base_freq = 10000.0;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l)
    c.sliding_layers[static_cast<size_t>(l)] = (l + 1) % 6 != 0;
  return c;
}
// The language model of Gemma 3 4B, 12B and 27B (Gemma3ForConditionalGeneration's text_config):
// a window of 1024, linear rope scaling by 8 on the global layers.
LlamaConfig gemma3_image_text(LlamaConfig c, int64_t head_dim, double query_pre_attn_scalar) {
  c = gemma3(c, 1024);
  c.head_dim = head_dim;
  c.query_pre_attn_scalar = query_pre_attn_scalar;
  c.rope_scaling.kind = RopeScalingKind::linear;
  c.rope_scaling.factor = 8.0;
  return c;
}
// SmolLM3's: Llama's, tied, eps 1e-6, NoPE in every fourth layer (no_rope_layer_interval 4).
LlamaConfig smollm3(LlamaConfig c) {
  c.architecture = Architecture::smollm3;
  c.tie_word_embeddings = true;
  c.rms_norm_eps = 1e-6;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) c.nope_layers.push_back((l + 1) % 4 == 0);
  return c;
}
// Granite 3's: Llama's, tied, with its four multipliers.
LlamaConfig granite3(LlamaConfig c, double embedding, double residual, double attention,
                     double logits) {
  c.architecture = Architecture::granite;
  c.tie_word_embeddings = true;
  c.embedding_multiplier = embedding;
  c.residual_multiplier = residual;
  c.attention_multiplier = attention;
  c.logits_scaling = logits;
  return c;
}
// Phi-3's and Phi-4's class: Mistral's equations, fused projections in the files.
LlamaConfig phi3(LlamaConfig c, int64_t window) {
  c.architecture = Architecture::phi3;
  c.sliding_window = window;
  return c;
}
// Qwen3's: norms on q and k, head_dim 128 whatever hidden / heads is, eps 1e-6.
LlamaConfig qwen3(LlamaConfig c, bool tied) {
  c.architecture = Architecture::qwen3;
  c.qk_norm = true;
  c.head_dim = 128;
  c.rms_norm_eps = 1e-6;
  c.tie_word_embeddings = tied;
  return c;
}

const std::vector<LlamaConfig>& presets() {
  // Shapes as published in each model's Hugging Face config.json.
  static const std::vector<LlamaConfig> all = [] {
    RopeScaling llama31;
    llama31.kind = RopeScalingKind::llama3;
    llama31.factor = 8.0;
    llama31.low_freq_factor = 1.0;
    llama31.high_freq_factor = 4.0;
    llama31.original_max_position_embeddings = 8192;
    RopeScaling llama32 = llama31;  // Llama 3.2's small models: the same scheme, factor 32
    llama32.factor = 32.0;
    return std::vector<LlamaConfig>{
        make_preset("tiny", 64, 172, 2, 4, 2, 512, 256, 10000.0, DType::f32),
        make_preset("llama2-7b", 4096, 11008, 32, 32, 32, 32000, 4096, 10000.0, DType::f16),
        make_preset("llama2-13b", 5120, 13824, 40, 40, 40, 32000, 4096, 10000.0, DType::f16),
        make_preset("llama2-70b", 8192, 28672, 80, 64, 8, 32000, 4096, 10000.0, DType::f16),
        make_preset("llama3-8b", 4096, 14336, 32, 32, 8, 128256, 8192, 500000.0, DType::bf16),
        make_preset("llama3-70b", 8192, 28672, 80, 64, 8, 128256, 8192, 500000.0, DType::bf16),
        make_preset("llama3.1-8b", 4096, 14336, 32, 32, 8, 128256, 131072, 500000.0, DType::bf16,
                    llama31),
        make_preset("llama3.1-70b", 8192, 28672, 80, 64, 8, 128256, 131072, 500000.0, DType::bf16,
                    llama31),
        tied(make_preset("llama3.2-1b", 2048, 8192, 16, 32, 8, 128256, 131072, 500000.0,
                         DType::bf16, llama32)),
        tied(make_preset("llama3.2-3b", 3072, 8192, 28, 24, 8, 128256, 131072, 500000.0,
                         DType::bf16, llama32)),
        mistral(make_preset("mistral-7b", 4096, 14336, 32, 32, 8, 32768, 32768, 1e6, DType::bf16)),
        qwen2(make_preset("qwen2.5-7b", 3584, 18944, 28, 28, 4, 152064, 32768, 1e6, DType::bf16)),
        qwen2(make_preset("qwen2.5-72b", 8192, 29568, 80, 64, 8, 152064, 32768, 1e6, DType::bf16)),
        qwen3(make_preset("qwen3-0.6b", 1024, 3072, 28, 16, 8, 151936, 40960, 1e6, DType::bf16),
              true),
        qwen3(make_preset("qwen3-8b", 4096, 12288, 36, 32, 8, 151936, 40960, 1e6, DType::bf16),
              false),
        // Phi-3-mini-4k (a window of 2047) and Phi-4 (14B).
        phi3(make_preset("phi3-mini", 3072, 8192, 32, 32, 32, 32064, 4096, 10000.0, DType::bf16),
             2047),
        phi3(make_preset("phi4", 5120, 17920, 40, 40, 10, 100352, 16384, 250000.0, DType::bf16), 0),
        // Gemma 2B (one key/value head) and 7B.
        gemma(make_preset("gemma-2b", 2048, 16384, 18, 8, 1, 256000, 8192, 10000.0, DType::bf16)),
        gemma(make_preset("gemma-7b", 3072, 24576, 28, 16, 16, 256000, 8192, 10000.0, DType::bf16)),
        // Gemma 2 2B, 9B and 27B (whose scores scale by 144^-1/2, hidden / heads, not head_dim's).
        gemma2(make_preset("gemma2-2b", 2304, 9216, 26, 8, 4, 256000, 8192, 10000.0, DType::f32),
               256, 256),
        gemma2(make_preset("gemma2-9b", 3584, 14336, 42, 16, 8, 256000, 8192, 10000.0, DType::f32),
               256, 256),
        gemma2(
            make_preset("gemma2-27b", 4608, 36864, 46, 32, 16, 256000, 8192, 10000.0, DType::f32),
            128, 144),
        // SmolLM3 3B: Llama's block, tied, every fourth layer without rotary embeddings.
        smollm3(make_preset("smollm3-3b", 2048, 11008, 36, 16, 4, 128256, 65536, 5e6, DType::bf16)),
        // Granite 3.1 8B: scores times 1/128 (not 1/sqrt(128)), embeddings times 12, each
        // sublayer's output times 0.22, logits divided by 16.
        granite3(
            make_preset("granite-3.1-8b", 4096, 12800, 40, 32, 8, 49155, 131072, 1e7, DType::bf16),
            12.0, 0.22, 0.0078125, 16.0),
        // Gemma 3 270M and 1B (text models; the larger Gemma 3s are image-text models).
        gemma3(make_preset("gemma3-270m", 640, 2048, 18, 4, 1, 262144, 32768, 1e6, DType::bf16),
               512),
        gemma3(make_preset("gemma3-1b", 1152, 6912, 26, 4, 1, 262144, 32768, 1e6, DType::bf16),
               512),
        // The language models of the image-text Gemma 3s (their text_config): a window of
        // 1024, the global layers' rotation stretched 8 times (linear).
        gemma3_image_text(
            make_preset("gemma3-4b", 2560, 10240, 34, 8, 4, 262208, 131072, 1e6, DType::bf16), 256,
            256),
        gemma3_image_text(
            make_preset("gemma3-12b", 3840, 15360, 48, 16, 8, 262208, 131072, 1e6, DType::bf16),
            256, 256),
        gemma3_image_text(
            make_preset("gemma3-27b", 5376, 21504, 62, 32, 16, 262208, 131072, 1e6, DType::bf16),
            128, 168),
    };
  }();
  return all;
}

}  // namespace

void validate_llama_config(const LlamaConfig& c, std::string_view src) {
  auto in_range = [&](std::string_view key, int64_t v, int64_t max) {
    if (v < 1 || v > max)
      fail("{}: {} = {} is out of range; it must be between 1 and {}", src, key, v, max);
  };
  in_range("hidden_size", c.hidden_size, kMaxSize);
  in_range("intermediate_size", c.intermediate_size, kMaxSize);
  in_range("vocab_size", c.vocab_size, kMaxSize);
  in_range("max_position_embeddings", c.max_position_embeddings, kMaxSize);
  in_range("num_hidden_layers", c.num_hidden_layers, kMaxCount);
  in_range("num_attention_heads", c.num_attention_heads, kMaxCount);
  in_range("num_key_value_heads", c.num_key_value_heads, kMaxCount);
  in_range("head_dim", c.head_dim, kMaxCount);
  // The biases each architecture's Hugging Face class builds (a config.json cannot ask for
  // others, and an exported one must load as it was trained).
  const bool attention_bias = c.qkv_bias == c.o_bias;
  bool fits = false;
  switch (c.architecture) {
    case Architecture::llama:
    case Architecture::smollm3:
      fits = attention_bias && !c.qk_norm;
      break;
    case Architecture::gemma:
    case Architecture::gemma2:
      fits = attention_bias && !c.mlp_bias && !c.qk_norm;
      break;
    case Architecture::gemma3:
      fits = attention_bias && !c.mlp_bias && c.qk_norm;
      break;
    case Architecture::mistral:
    case Architecture::phi3:
    case Architecture::granite:  // its biases would be scaled with the outputs: not built here
      fits = !c.qkv_bias && !c.o_bias && !c.mlp_bias && !c.qk_norm;
      break;
    case Architecture::qwen2:
      fits = c.qkv_bias && !c.o_bias && !c.mlp_bias && !c.qk_norm;
      break;
    case Architecture::qwen3:
      fits = attention_bias && !c.mlp_bias && c.qk_norm;
      break;
  }
  if (!fits)
    fail(
        "{}: biases on q/k/v {}, o {}, MLP {} and q/k norms {} are not what {} builds (Llama: "
        "attention_bias puts biases on q, k, v and o together; Mistral and Phi-3: none; Qwen2: "
        "q, k and v only; Qwen3: q and k norms, attention_bias as Llama's; Gemma and Gemma 2: "
        "attention_bias as Llama's, no MLP bias; Gemma 3: those and q and k norms; SmolLM3: "
        "Llama's; Granite: none, as its published checkpoints: strata does not build Granite's "
        "attention_bias or mlp_bias)",
        src, c.qkv_bias, c.o_bias, c.mlp_bias, c.qk_norm, architecture_class(c.architecture));
  if (c.sliding_window < 0 || c.sliding_window > kMaxSize ||
      (c.sliding_window > 0 &&
       (c.architecture == Architecture::llama || c.architecture == Architecture::gemma)))
    fail(
        "{}: sliding_window = {} is not valid for {}; it is a positive window for Mistral, Qwen2, "
        "Phi-3, Gemma 2, Gemma 3 or SmolLM3",
        src, c.sliding_window, architecture_class(c.architecture));
  for (const auto& [name, v] : {std::pair{"query_pre_attn_scalar", c.query_pre_attn_scalar},
                                {"attn_logit_softcapping", c.attn_logit_softcapping},
                                {"final_logit_softcapping", c.final_logit_softcapping}}) {
    if (!std::isfinite(v) || v < 0)
      fail("{}: {} = {} must be a positive number (or null for none)", src, name, v);
    if (v != 0 && c.architecture != Architecture::gemma2 && c.architecture != Architecture::gemma3)
      fail("{}: {} = {} is Gemma 2's and Gemma 3's; {} has no such setting", src, name, v,
           architecture_class(c.architecture));
  }
  const bool granite = c.architecture == Architecture::granite;
  for (const auto& [name, v, plain] :
       {std::tuple{"embedding_multiplier", c.embedding_multiplier, 1.0},
        {"residual_multiplier", c.residual_multiplier, 1.0},
        {"attention_multiplier", c.attention_multiplier, 0.0},
        {"logits_scaling", c.logits_scaling, 1.0}}) {
    if (granite && !(std::isfinite(v) && v > 0 && v < 1e6))
      fail("{}: {} = {} must be a positive number below 1e6; fix config.json", src, name, v);
    if (!granite && v != plain)
      fail("{}: {} = {} is Granite's; {} has no such setting", src, name, v,
           architecture_class(c.architecture));
  }
  if (granite && c.head_dim * c.num_attention_heads != c.hidden_size)
    fail(
        "{}: head_dim = {} with {} heads for hidden_size {}; Granite's attention splits the "
        "hidden size among the heads (head_dim = hidden_size / num_attention_heads)",
        src, c.head_dim, c.num_attention_heads, c.hidden_size);
  if (!std::isfinite(c.rope_local_base_freq) || c.rope_local_base_freq < 0 ||
      (c.rope_local_base_freq != 0 && c.architecture != Architecture::gemma3))
    fail("{}: rope_local_base_freq = {} is Gemma 3's positive base for its sliding layers", src,
         c.rope_local_base_freq);
  if (!c.nope_layers.empty() && (c.architecture != Architecture::smollm3 ||
                                 static_cast<int64_t>(c.nope_layers.size()) != c.num_hidden_layers))
    fail(
        "{}: {} layers are flagged as NoPE (no rotary embeddings), which only SmolLM3's {} "
        "layers can be; {} rotates every layer",
        src, c.nope_layers.size(), c.num_hidden_layers, architecture_class(c.architecture));
  if (!c.sliding_layers.empty() &&
      static_cast<int64_t>(c.sliding_layers.size()) != c.num_hidden_layers)
    fail("{}: {} layers are flagged for the sliding window, but the model has {}", src,
         c.sliding_layers.size(), c.num_hidden_layers);
  if (c.num_attention_heads % c.num_key_value_heads != 0)
    fail(
        "{}: num_attention_heads = {} is not a multiple of num_key_value_heads = {}; grouped-query "
        "attention shares each key/value head among a whole number of query heads",
        src, c.num_attention_heads, c.num_key_value_heads);
  if (c.head_dim % 2 != 0)
    fail("{}: head_dim = {} is odd; rotary embeddings rotate pairs of dimensions", src, c.head_dim);
  if (!(c.partial_rotary_factor > 0 && c.partial_rotary_factor <= 1))
    fail("{}: partial_rotary_factor = {} must be in (0, 1]: the fraction of each head rotated", src,
         c.partial_rotary_factor);
  if (c.partial_rotary_factor != 1.0 && c.architecture != Architecture::phi3)
    fail("{}: partial_rotary_factor = {} is Phi-3's; {} rotates every dimension of a head", src,
         c.partial_rotary_factor, architecture_class(c.architecture));
  if (c.rotary_dim() < 2 || c.rotary_dim() % 2 != 0)
    fail(
        "{}: partial_rotary_factor = {} rotates {} of head_dim {}; rotary embeddings rotate "
        "pairs, so it must be an even count of at least 2",
        src, c.partial_rotary_factor, c.rotary_dim(), c.head_dim);
  if (!(c.rms_norm_eps > 0) || !std::isfinite(c.rms_norm_eps))
    fail("{}: rms_norm_eps = {} must be a positive number (Llama uses 1e-5 or 1e-6)", src,
         c.rms_norm_eps);
  if (!(c.rope_theta > 0) || !std::isfinite(c.rope_theta))
    fail("{}: rope_theta = {} must be a positive number (Llama 2 uses 10000, Llama 3 500000)", src,
         c.rope_theta);
  const RopeScaling& rs = c.rope_scaling;
  if (rs.kind != RopeScalingKind::none && rs.kind != RopeScalingKind::llama3) {
    const bool absent = rs.kind == RopeScalingKind::longrope && rs.factor == 0;
    if (!absent && (!(rs.factor > 0) || !std::isfinite(rs.factor)))
      fail("{}: rope_scaling.factor = {} must be a positive number (the context's stretch)", src,
           rs.factor);
    if (rs.original_max_position_embeddings != 0)
      in_range("rope_scaling.original_max_position_embeddings", rs.original_max_position_embeddings,
               kMaxSize);
    for (const auto& [name, v] : {std::pair{"attention_factor", rs.attention_factor},
                                  {"beta_fast", rs.beta_fast},
                                  {"beta_slow", rs.beta_slow},
                                  {"mscale", rs.mscale},
                                  {"mscale_all_dim", rs.mscale_all_dim}})
      if (v && (!std::isfinite(*v) || *v < 0))
        fail("{}: rope_scaling.{} = {} must be a finite number >= 0", src, name, *v);
    if (rs.kind == RopeScalingKind::yarn && rs.original_max_position_embeddings != 0 &&
        c.max_position_embeddings <= 0)
      fail("{}: yarn's original_max_position_embeddings needs max_position_embeddings", src);
    if (rs.kind == RopeScalingKind::longrope)
      for (const auto& [name, list] :
           {std::pair{"long_factor", &rs.long_factor}, {"short_factor", &rs.short_factor}}) {
        if (static_cast<int64_t>(list->size()) != c.rotary_dim() / 2)
          fail(
              "{}: rope_scaling.{} has {} entries; longrope needs one per rotated pair of "
              "dimensions: {} (head_dim {} x partial_rotary_factor {}, halved)",
              src, name, list->size(), c.rotary_dim() / 2, c.head_dim, c.partial_rotary_factor);
        for (const double x : *list)
          if (!(x > 0) || !std::isfinite(x))
            fail("{}: rope_scaling.{} holds {}; each factor must be a positive number", src, name,
                 x);
      }
  }
  if (c.rope_scaling.kind == RopeScalingKind::llama3) {
    const RopeScaling& r = c.rope_scaling;
    if (!(r.factor > 0) || !std::isfinite(r.factor))
      fail("{}: rope_scaling.factor = {} must be a positive number (Llama 3.1 uses 8)", src,
           r.factor);
    if (!(r.low_freq_factor > 0) || !std::isfinite(r.low_freq_factor))
      fail("{}: rope_scaling.low_freq_factor = {} must be a positive number (Llama 3.1 uses 1)",
           src, r.low_freq_factor);
    if (!(r.high_freq_factor > r.low_freq_factor) || !std::isfinite(r.high_freq_factor))
      fail(
          "{}: rope_scaling.high_freq_factor = {} must be larger than low_freq_factor = {} "
          "(Llama 3.1 uses 4 and 1)",
          src, r.high_freq_factor, r.low_freq_factor);
    in_range("rope_scaling.original_max_position_embeddings", r.original_max_position_embeddings,
             kMaxSize);
  }
}

// Whether `j` is a Gemma3ForConditionalGeneration's config (Gemma 3 4B, 12B and 27B: a text
// model and a vision tower).
bool image_text_gemma3(const json& j) {
  const json* arch = field(j, "architectures");
  const json* type = field(j, "model_type");
  const bool by_class =
      arch != nullptr && arch->is_array() &&
      std::find(arch->begin(), arch->end(), "Gemma3ForConditionalGeneration") != arch->end();
  return by_class || (type != nullptr && type->is_string() && *type == "gemma3");
}

// The text model of a Gemma3ForConditionalGeneration config: its text_config, which such
// configs write as the keys that differ from Gemma3TextConfig's defaults (Gemma 3 4B's holds
// six), completed with those defaults, as transformers builds it; the checkpoint's dtype where
// the text_config has none.
json gemma3_text_config(const json& j, std::string_view src) {
  const json* text = field(j, "text_config");
  if (text == nullptr || !text->is_object())
    fail(
        "{}: a Gemma3ForConditionalGeneration config without a text_config object; strata trains "
        "its language model, described there",
        src);
  json t = *text;
  const json defaults = {{"vocab_size", 262208},
                         {"hidden_size", 2304},
                         {"intermediate_size", 9216},
                         {"num_hidden_layers", 26},
                         {"num_attention_heads", 8},
                         {"num_key_value_heads", 4},
                         {"head_dim", 256},
                         {"hidden_activation", "gelu_pytorch_tanh"},
                         {"max_position_embeddings", 131072},
                         {"rms_norm_eps", 1e-6},
                         {"tie_word_embeddings", true},
                         {"rope_theta", 1e6},
                         {"query_pre_attn_scalar", 256},
                         {"sliding_window", 4096},
                         {"rope_local_base_freq", 10000.0},
                         {"sliding_window_pattern", 6}};
  for (const auto& [key, value] : defaults.items())
    if (!t.contains(key)) t[key] = value;
  if (const json* type = field(t, "model_type");
      type != nullptr && !(type->is_string() && *type == "gemma3_text"))
    fail("{}: text_config.model_type is {}, where Gemma 3's text model is gemma3_text", src,
         shown(*type));
  t["model_type"] = "gemma3_text";
  t.erase("architectures");
  for (const char* key : {"torch_dtype", "dtype"})
    if (!t.contains("torch_dtype") && !t.contains("dtype") && j.contains(key)) t[key] = j[key];
  return t;
}

LlamaConfig parse_llama_config(const json& j, std::string_view src) {
  if (!j.is_object())
    fail("{}: a config.json holds a JSON object, got {}; pass a Hugging Face config.json", src,
         j.type_name());
  if (image_text_gemma3(j)) {
    LlamaConfig c =
        parse_llama_config(gemma3_text_config(j, src), fmt::format("{} (text_config)", src));
    c.name = std::string(src);
    c.image_text_config = j;
    return c;
  }

  const Architecture arch = parse_architecture(j, src);
  LlamaConfig c;
  c.name = std::string(src);
  c.architecture = arch;

  // Biases, and what would change the math and is not implemented: refused by name. Mistral
  // and Qwen2 fix their biases in code (none; q, k and v), whatever the keys say.
  if (arch == Architecture::qwen2) c.qkv_bias = true;
  const bool gemma_like =
      arch == Architecture::gemma || arch == Architecture::gemma2 || arch == Architecture::gemma3;
  const bool granite = arch == Architecture::granite;
  if (arch == Architecture::llama || arch == Architecture::qwen3 || arch == Architecture::smollm3 ||
      gemma_like || granite) {
    if (const json* v = field(j, "attention_bias"))
      c.qkv_bias = c.o_bias = as_bool(*v, src, "attention_bias");
  }
  if (arch == Architecture::llama || arch == Architecture::smollm3 || granite)
    if (const json* v = field(j, "mlp_bias")) c.mlp_bias = as_bool(*v, src, "mlp_bias");
  if (granite) {
    // GraniteConfig's defaults where a key is absent: 1 each, scores included.
    c.attention_multiplier = 1.0;
    for (const auto& [key, v] :
         {std::pair<const char*, double*>{"embedding_multiplier", &c.embedding_multiplier},
          {"residual_multiplier", &c.residual_multiplier},
          {"attention_multiplier", &c.attention_multiplier},
          {"logits_scaling", &c.logits_scaling}})
      if (const json* x = field(j, key)) *v = as_number(*x, src, key);
  }
  c.qk_norm = arch == Architecture::qwen3 || arch == Architecture::gemma3;
  c.num_hidden_layers = required(j, "num_hidden_layers", src, as_int);
  if (arch == Architecture::smollm3) c.nope_layers = parse_nope_layers(j, src, c.num_hidden_layers);
  std::vector<bool> nope = c.nope_layers;
  nope.resize(static_cast<size_t>(std::max<int64_t>(c.num_hidden_layers, 0)), false);
  c.sliding_window =
      parse_sliding_window(j, src, arch, c.num_hidden_layers, c.sliding_layers, nope);
  // The MLP's activation. Gemma's configs name it twice: hidden_activation (which transformers
  // 4.38 to 4.4x read, taking gelu_pytorch_tanh where it was absent, whatever hidden_act said)
  // and hidden_act ("gelu" in Google's first configs, meaning the tanh approximation the model
  // was trained with). So for Gemma hidden_activation wins, and a lone hidden_act "gelu" is
  // read as Gemma's tanh GELU. Exports write both keys, the same.
  c.hidden_act = gemma_like ? Activation::gelu_tanh : Activation::silu;
  std::string act_key = "hidden_act";
  const json* act_field = field(j, act_key);
  if (const json* v = field(j, "hidden_activation"); v && gemma_like) {
    act_field = v;
    act_key = "hidden_activation";
  }
  if (act_field != nullptr) {
    const std::string& act = as_string(*act_field, src, act_key);
    if (act == "silu" || act == "swish")  // the same function under two names
      c.hidden_act = Activation::silu;
    else if (act == "gelu_pytorch_tanh" || act == "gelu_new")  // the same, rounded alike in f32
      c.hidden_act = Activation::gelu_tanh;
    else if (act == "gelu")
      c.hidden_act =
          gemma_like && act_key == "hidden_act" ? Activation::gelu_tanh : Activation::gelu;
    else
      fail(
          "{}: {} '{}' is not supported; strata's gated MLP takes silu (SwiGLU), gelu or "
          "gelu_pytorch_tanh (GeGLU)",
          src, act_key, act);
  }
  // Phi-3's dropouts and partial rotation (Phi-4-mini rotates 3/4 of each head).
  for (const char* key : {"resid_pdrop", "embd_pdrop"})
    if (const json* v = field(j, key); v && as_number(*v, src, key) != 0.0)
      fail("{}: {} = {} is not supported; strata has no dropout, set it to 0.0", src, key,
           shown(*v));
  if (const json* v = field(j, "partial_rotary_factor")) {
    c.partial_rotary_factor = as_number(*v, src, "partial_rotary_factor");
    if (arch != Architecture::phi3 && c.partial_rotary_factor != 1.0)
      fail(
          "{}: partial_rotary_factor = {} is not supported for {}; its Hugging Face class "
          "rotates every dimension of a head (partial_rotary_factor 1.0)",
          src, shown(*v), architecture_class(arch));
  }
  if (const json* v = field(j, "attention_dropout");
      v && as_number(*v, src, "attention_dropout") != 0.0)
    fail("{}: attention_dropout = {} is not supported; strata has no dropout, set it to 0.0", src,
         v->get<double>());
  if (field(j, "quantization_config") != nullptr)
    fail(
        "{}: quantization_config is set; quantized checkpoints (GPTQ, AWQ, bitsandbytes, ...) "
        "are not supported, use the original f32/bf16/f16 weights",
        src);
  // pretraining_tp only slices the same matmuls differently in Hugging Face: harmless.

  c.hidden_size = required(j, "hidden_size", src, as_int);
  c.intermediate_size = required(j, "intermediate_size", src, as_int);
  c.num_attention_heads = required(j, "num_attention_heads", src, as_int);
  c.vocab_size = required(j, "vocab_size", src, as_int);
  c.max_position_embeddings = required(j, "max_position_embeddings", src, as_int);
  // Llama 1 used 1e-6 and Llama 2/3 1e-5: no default is safe, so it is required.
  c.rms_norm_eps = required(j, "rms_norm_eps", src, as_number);
  // Hugging Face's defaults: as many key/value heads as query heads, theta 10000, untied.
  const json* kv = field(j, "num_key_value_heads");
  c.num_key_value_heads =
      kv != nullptr ? as_int(*kv, src, "num_key_value_heads") : c.num_attention_heads;
  if (const json* v = field(j, "head_dim"); v != nullptr && !granite) {
    c.head_dim = as_int(*v, src, "head_dim");
  } else if (gemma_like) {
    c.head_dim = 256;  // GemmaConfig's and Gemma2Config's default
  } else {
    // Non-positive sizes are left to validate_llama_config, which names them.
    if (c.num_attention_heads > 0 && c.hidden_size % c.num_attention_heads != 0)
      fail(
          "{}: hidden_size = {} is not a multiple of num_attention_heads = {} and there is no "
          "head_dim; set head_dim or fix the sizes",
          src, c.hidden_size, c.num_attention_heads);
    c.head_dim = c.num_attention_heads > 0 ? c.hidden_size / c.num_attention_heads : 0;
  }
  // Gemma's configs leave it out: GemmaConfig and SmolLM3Config tie by default, the others do not.
  c.tie_word_embeddings = gemma_like || arch == Architecture::smollm3;
  if (const json* v = field(j, "tie_word_embeddings"))
    c.tie_word_embeddings = as_bool(*v, src, "tie_word_embeddings");
  if (const json* v = field(j, "rope_theta")) c.rope_theta = as_number(*v, src, "rope_theta");
  if (const json* v = field(j, "rope_scaling"))
    c.rope_scaling = parse_rope_scaling(*v, src, "rope_scaling");
  // transformers 5 folds rope_theta and rope_scaling into rope_parameters.
  if (const json* v = field(j, "rope_parameters")) {
    const RopeScaling s = parse_rope_scaling(*v, src, "rope_parameters");
    double theta = c.rope_theta;
    if (const json* t = field(*v, "rope_theta"))
      theta = as_number(*t, src, "rope_parameters.rope_theta");
    const bool has_old = field(j, "rope_scaling") != nullptr || field(j, "rope_theta") != nullptr;
    if (has_old && (!(s == c.rope_scaling) || theta != c.rope_theta))
      fail(
          "{}: rope_parameters disagrees with rope_scaling/rope_theta; keep one description of "
          "the rotary embeddings",
          src);
    c.rope_scaling = s;
    c.rope_theta = theta;
  }
  // longrope's original context is a top-level key of config.json (transformers reads it
  // there); one inside rope_scaling must agree with it.
  if (const json* v = field(j, "original_max_position_embeddings");
      v != nullptr && c.rope_scaling.kind == RopeScalingKind::longrope) {
    const int64_t top = as_int(*v, src, "original_max_position_embeddings");
    int64_t& inner = c.rope_scaling.original_max_position_embeddings;
    if (inner != 0 && inner != top)
      fail(
          "{}: original_max_position_embeddings is {} but rope_scaling's is {}; keep one of "
          "them",
          src, top, inner);
    inner = top;
  }
  // Gemma 2's scores and logits (Gemma2Config's defaults where absent; null: no cap).
  if (arch == Architecture::gemma2 || arch == Architecture::gemma3) {
    c.query_pre_attn_scalar = 256;
    const double cap = arch == Architecture::gemma2 ? 1.0 : 0.0;  // Gemma 3: none by default
    c.attn_logit_softcapping = 50 * cap;
    c.final_logit_softcapping = 30 * cap;
    for (const auto& [key, v] :
         {std::pair<const char*, double*>{"query_pre_attn_scalar", &c.query_pre_attn_scalar},
          {"attn_logit_softcapping", &c.attn_logit_softcapping},
          {"final_logit_softcapping", &c.final_logit_softcapping}}) {
      const auto it = j.find(key);
      if (it != j.end()) *v = it->is_null() ? 0.0 : as_number(*it, src, key);
    }
    if (c.query_pre_attn_scalar == 0)
      fail("{}: query_pre_attn_scalar is null; Gemma 2 scales its scores by its -1/2 power, set it",
           src);
  }
  // SmolLM3Config's rotary base where none is given.
  if (arch == Architecture::smollm3 && field(j, "rope_theta") == nullptr &&
      field(j, "rope_parameters") == nullptr)
    c.rope_theta = 2e6;
  if (arch == Architecture::gemma3) {
    // The sliding layers' rotary base (Gemma3TextConfig's default 10000), and the global one's
    // default of 1e6 where rope_theta is absent.
    c.rope_local_base_freq = 10000.0;
    if (const json* v = field(j, "rope_local_base_freq"))
      c.rope_local_base_freq = as_number(*v, src, "rope_local_base_freq");
    if (field(j, "rope_theta") == nullptr && field(j, "rope_parameters") == nullptr)
      c.rope_theta = 1e6;
  }
  for (const char* key : {"bos_token_id", "eos_token_id", "pad_token_id"})
    if (const json* v = field(j, key)) {
      const bool ids =
          v->is_array() && !v->empty() &&
          std::all_of(v->begin(), v->end(), [](const json& e) { return e.is_number_integer(); });
      if (!v->is_number_integer() && !ids) type_error(src, key, "a token id or a list of them", *v);
      c.token_ids[key] = *v;
    }
  // transformers 4.56 renamed torch_dtype to dtype.
  const std::string dtype_key = field(j, "torch_dtype") != nullptr ? "torch_dtype" : "dtype";
  if (const json* v = field(j, dtype_key)) {
    const std::string& text = as_string(*v, src, dtype_key);
    try {
      c.torch_dtype = parse_dtype(text);
    } catch (const Error&) {
      fail("{}: {} '{}' is not supported; strata reads float32, bfloat16 and float16 weights", src,
           dtype_key, text);
    }
  }
  validate_llama_config(c, src);
  return c;
}

LlamaConfig load_llama_config(const fs::path& path) {
  std::error_code ec;
  const bool is_dir = fs::is_directory(path, ec);
  const fs::path file = is_dir ? path / "config.json" : path;
  if (is_dir && !fs::exists(file, ec))
    fail(
        "{}: no config.json in this directory; a Hugging Face checkpoint directory holds "
        "config.json and model*.safetensors",
        path.string());
  LlamaConfig c = parse_llama_config(read_json_file(file, "model config"), file.string());
  // Named after the checkpoint directory ("Meta-Llama-3-8B"), as a user would call it.
  const fs::path dir = fs::weakly_canonical(fs::absolute(file, ec), ec).parent_path();
  c.name = dir.filename().empty() ? dir.string() : dir.filename().string();
  return c;
}

std::string_view architecture_class(Architecture a) {
  for (const KnownArchitecture& k : kArchitectures)
    if (k.arch == a) return k.cls;
  return "unknown";
}
std::string_view architecture_model_type(Architecture a) {
  for (const KnownArchitecture& k : kArchitectures)
    if (k.arch == a) return k.model_type;
  return "unknown";
}

std::vector<std::string> preset_names() {
  std::vector<std::string> names;
  for (const LlamaConfig& c : presets()) names.push_back(c.name);
  return names;
}

std::optional<LlamaConfig> find_preset(std::string_view name) {
  for (const LlamaConfig& c : presets())
    if (c.name == name) return c;
  return std::nullopt;
}

LlamaConfig resolve_model(std::string_view dir_or_preset) {
  const fs::path path(dir_or_preset);
  std::error_code ec;
  if (!dir_or_preset.empty() && fs::exists(path, ec)) return load_llama_config(path);
  if (std::optional<LlamaConfig> c = find_preset(dir_or_preset)) return *c;
  fail(
      "model '{}' is neither a checkpoint directory (config.json + safetensors) nor a preset; "
      "pass a directory, or one of the presets: {}",
      dir_or_preset, fmt::join(preset_names(), ", "));
}

namespace {
// Each layer's attention as config.json's layer_types names it.
json layer_types_json(const LlamaConfig& c) {
  json types = json::array();
  for (int64_t l = 0; l < c.num_hidden_layers; ++l)
    types.push_back(c.layer_slides(l) ? "sliding_attention" : "full_attention");
  return types;
}
}  // namespace

json to_hf_config_json(const LlamaConfig& c) {
  json j;
  j["architectures"] = json::array({architecture_class(c.architecture)});
  j["model_type"] = architecture_model_type(c.architecture);
  j["hidden_size"] = c.hidden_size;
  j["intermediate_size"] = c.intermediate_size;
  j["num_hidden_layers"] = c.num_hidden_layers;
  j["num_attention_heads"] = c.num_attention_heads;
  j["num_key_value_heads"] = c.num_key_value_heads;
  j["head_dim"] = c.head_dim;
  j["vocab_size"] = c.vocab_size;
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["rope_theta"] = c.rope_theta;
  const RopeScaling& r = c.rope_scaling;
  if (r.kind == RopeScalingKind::llama3) {
    j["rope_scaling"] = {{"rope_type", "llama3"},
                         {"factor", r.factor},
                         {"low_freq_factor", r.low_freq_factor},
                         {"high_freq_factor", r.high_freq_factor},
                         {"original_max_position_embeddings", r.original_max_position_embeddings}};
  } else if (r.kind == RopeScalingKind::longrope) {
    // factor only where the source gave one: transformers 5 takes a written factor as the
    // stretch, where Phi-3's configs leave it to the two lengths.
    json s = {{"rope_type", "longrope"},
              {"long_factor", r.long_factor},
              {"short_factor", r.short_factor}};
    if (r.factor > 0) s["factor"] = r.factor;
    if (r.attention_factor) s["attention_factor"] = *r.attention_factor;
    j["rope_scaling"] = s;
    if (r.original_max_position_embeddings != 0)  // where transformers reads it
      j["original_max_position_embeddings"] = r.original_max_position_embeddings;
  } else if (r.kind != RopeScalingKind::none) {
    json s = {{"rope_type", rope_scaling_name(r.kind)}, {"factor", r.factor}};
    if (r.original_max_position_embeddings != 0)
      s["original_max_position_embeddings"] = r.original_max_position_embeddings;
    for (const auto& [name, v] : {std::pair{"attention_factor", r.attention_factor},
                                  {"beta_fast", r.beta_fast},
                                  {"beta_slow", r.beta_slow},
                                  {"mscale", r.mscale},
                                  {"mscale_all_dim", r.mscale_all_dim}})
      if (v) s[name] = *v;
    if (r.truncate) s["truncate"] = *r.truncate;
    j["rope_scaling"] = s;
  } else {
    j["rope_scaling"] = nullptr;
  }
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  for (const auto& [key, ids] : c.token_ids.items()) j[key] = ids;
  j["torch_dtype"] = hf_dtype_name(c.torch_dtype);
  // What strata computes, spelled out so Hugging Face builds the same model.
  j["hidden_act"] = activation_name(c.hidden_act);
  j["attention_dropout"] = 0.0;
  j["initializer_range"] = 0.02;
  switch (c.architecture) {
    case Architecture::llama:
      j["attention_bias"] = c.qkv_bias;
      j["mlp_bias"] = c.mlp_bias;
      j["pretraining_tp"] = 1;
      break;
    case Architecture::gemma:  // transformers 4.38 to 4.4x read the second key alone
      j["attention_bias"] = c.qkv_bias;
      j["hidden_activation"] = activation_name(c.hidden_act);
      break;
    case Architecture::gemma2:
    case Architecture::gemma3: {
      j["attention_bias"] = c.qkv_bias;
      j["hidden_activation"] = activation_name(c.hidden_act);
      j["query_pre_attn_scalar"] = c.query_pre_attn_scalar;
      const auto cap = [](double v) { return v > 0 ? json(v) : json(nullptr); };
      j["attn_logit_softcapping"] = cap(c.attn_logit_softcapping);
      j["final_logit_softcapping"] = cap(c.final_logit_softcapping);
      // The window and, for transformers 4.5x, the layers it applies to; older versions slide
      // every other layer from the first, which is what Gemma 2's checkpoints do.
      j["sliding_window"] = c.sliding_window > 0 ? json(c.sliding_window) : json(nullptr);
      j["layer_types"] = layer_types_json(c);
      if (c.architecture == Architecture::gemma3) {
        j["rope_local_base_freq"] = c.rope_local_base_freq;
        // For transformers 4.50 to 4.52, which read the pattern: written where the layers
        // follow one.
        for (int64_t p = 1; p <= c.num_hidden_layers + 1; ++p) {
          bool follows = true;
          for (int64_t l = 0; l < c.num_hidden_layers; ++l)
            follows = follows && c.layer_slides(l) == ((l + 1) % p != 0);
          if (follows) {
            j["sliding_window_pattern"] = p;
            break;
          }
        }
      }
      break;
    }
    case Architecture::mistral:
      j["sliding_window"] = c.sliding_window > 0 ? json(c.sliding_window) : json(nullptr);
      break;
    case Architecture::smollm3: {
      j["attention_bias"] = c.qkv_bias;
      j["mlp_bias"] = c.mlp_bias;
      json rope = json::array();  // 1: rotary embeddings, 0: a NoPE layer
      for (int64_t l = 0; l < c.num_hidden_layers; ++l) rope.push_back(c.layer_rotates(l) ? 1 : 0);
      j["no_rope_layers"] = rope;
      j["use_sliding_window"] = c.sliding_window > 0;
      j["sliding_window"] = c.sliding_window > 0 ? json(c.sliding_window) : json(nullptr);
      if (c.sliding_window > 0) {
        j["layer_types"] = layer_types_json(c);
      }
      break;
    }
    case Architecture::granite:
      j["attention_bias"] = false;
      j["mlp_bias"] = false;
      j["embedding_multiplier"] = c.embedding_multiplier;
      j["residual_multiplier"] = c.residual_multiplier;
      j["attention_multiplier"] = c.attention_multiplier;
      j["logits_scaling"] = c.logits_scaling;
      break;
    case Architecture::phi3:
      j["sliding_window"] = c.sliding_window > 0 ? json(c.sliding_window) : json(nullptr);
      j["resid_pdrop"] = 0.0;
      j["embd_pdrop"] = 0.0;
      j["partial_rotary_factor"] = c.partial_rotary_factor;
      break;
    case Architecture::qwen2:
    case Architecture::qwen3: {
      if (c.architecture == Architecture::qwen3) j["attention_bias"] = c.qkv_bias;
      j["use_sliding_window"] = c.sliding_window > 0;
      j["sliding_window"] = c.sliding_window > 0 ? json(c.sliding_window) : json(nullptr);
      // The layers that slide: from max_window_layers on, as older transformers read it, and
      // each one in layer_types, which newer ones read first (and which also says a pattern
      // that is not a suffix).
      int64_t first = c.num_hidden_layers;
      while (first > 0 && c.layer_slides(first - 1)) --first;
      j["max_window_layers"] = first;
      if (c.sliding_window > 0) {
        j["layer_types"] = layer_types_json(c);
      }
      break;
    }
  }
  j["use_cache"] = true;
  return j;
}

json to_hf_image_text_config_json(const LlamaConfig& c) {
  if (!c.image_text_checkpoint())
    fail("{}: not read from an image-text checkpoint; this is a bug in strata", c.name);
  json outer = c.image_text_config;
  json text = to_hf_config_json(c);
  text.erase("architectures");
  outer["torch_dtype"] = text["torch_dtype"];
  outer.erase("dtype");  // transformers 4.56's name for it: one of the two is written
  outer["text_config"] = std::move(text);
  return outer;
}

namespace {
bool gemma_family(const LlamaConfig& c) {
  return c.architecture == Architecture::gemma || c.architecture == Architecture::gemma2 ||
         c.architecture == Architecture::gemma3;
}
}  // namespace

float norm_weight_offset(const LlamaConfig& c) {
  return gemma_family(c) ? 1.0f : 0.0f;
}

bool sandwich_norms(const LlamaConfig& c) {
  return c.architecture == Architecture::gemma2 || c.architecture == Architecture::gemma3;
}

AttentionMask attention_scores(const LlamaConfig& c) {
  if (c.architecture == Architecture::granite)
    return {nullptr, 0, static_cast<float>(c.attention_multiplier), 0.0f};
  const double qpas = c.query_pre_attn_scalar;
  const bool scaled = qpas > 0 && qpas != static_cast<double>(c.head_dim);
  return {nullptr, 0, scaled ? static_cast<float>(1.0 / std::sqrt(qpas)) : 0.0f,
          static_cast<float>(c.attn_logit_softcapping)};
}

float residual_scale(const LlamaConfig& c) {
  return static_cast<float>(c.residual_multiplier);
}

float logits_scale(const LlamaConfig& c) {
  return static_cast<float>(1.0 / c.logits_scaling);
}

float embedding_scale(const LlamaConfig& c, DType t) {
  // Granite's: a Python float times the embeddings, computed in f32 and rounded once.
  if (c.architecture == Architecture::granite) return static_cast<float>(c.embedding_multiplier);
  if (!gemma_family(c)) return 1.0f;
  // Python's hidden_size ** 0.5, a float32 tensor, then the weights' dtype.
  const auto f = static_cast<float>(std::sqrt(static_cast<double>(c.hidden_size)));
  if (t == DType::bf16) return bf16_to_f32(f32_to_bf16(f));
  if (t == DType::f16) return f16_to_f32(f32_to_f16(f));
  return f;
}

int64_t HfTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::vector<HfTensor> llama_hf_tensors(const LlamaConfig& c) {
  const int64_t D = c.hidden_size, F = c.intermediate_size, V = c.vocab_size;
  const int64_t Hq = c.num_attention_heads * c.head_dim, Hk = c.num_key_value_heads * c.head_dim;
  std::vector<HfTensor> t;
  t.push_back({"model.embed_tokens.weight", {V, D}});
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = fmt::format("model.layers.{}.", l);
    // A projection's weight [out, in], then its bias [out] where the config has one.
    auto linear = [&](const char* name, int64_t out, int64_t in, bool bias) {
      t.push_back({fmt::format("{}{}.weight", p, name), {out, in}});
      if (bias) t.push_back({fmt::format("{}{}.bias", p, name), {out}});
    };
    t.push_back({p + "input_layernorm.weight", {D}});
    linear("self_attn.q_proj", Hq, D, c.qkv_bias);
    linear("self_attn.k_proj", Hk, D, c.qkv_bias);
    linear("self_attn.v_proj", Hk, D, c.qkv_bias);
    linear("self_attn.o_proj", D, Hq, c.o_bias);
    if (c.qk_norm) {
      t.push_back({p + "self_attn.q_norm.weight", {c.head_dim}});
      t.push_back({p + "self_attn.k_norm.weight", {c.head_dim}});
    }
    t.push_back({p + "post_attention_layernorm.weight", {D}});
    if (sandwich_norms(c)) t.push_back({p + "pre_feedforward_layernorm.weight", {D}});
    linear("mlp.gate_proj", F, D, c.mlp_bias);
    linear("mlp.up_proj", F, D, c.mlp_bias);
    linear("mlp.down_proj", D, F, c.mlp_bias);
    if (sandwich_norms(c)) t.push_back({p + "post_feedforward_layernorm.weight", {D}});
  }
  t.push_back({"model.norm.weight", {D}});
  if (!c.tie_word_embeddings) t.push_back({"lm_head.weight", {V, D}});
  return t;
}

std::vector<HfFileTensor> hf_file_tensors(const LlamaConfig& c) {
  std::vector<HfFileTensor> files;
  for (const HfTensor& t : llama_hf_tensors(c)) {
    // Phi-3's fused projections: q (k and v follow) and gate (up follows) open them.
    if (c.architecture == Architecture::phi3) {
      const auto fused = [&](std::string_view first, const char* name) {
        if (!t.name.ends_with(first)) return false;
        const std::string prefix = t.name.substr(0, t.name.size() - first.size());
        files.push_back({prefix + name, t.shape, {t.name}});
        return true;
      };
      if (fused("self_attn.q_proj.weight", "self_attn.qkv_proj.weight") ||
          fused("mlp.gate_proj.weight", "mlp.gate_up_proj.weight"))
        continue;
      if (t.name.ends_with("self_attn.k_proj.weight") ||
          t.name.ends_with("self_attn.v_proj.weight") || t.name.ends_with("mlp.up_proj.weight")) {
        HfFileTensor& f = files.back();  // the fused tensor opened just before
        f.shape[0] += t.shape[0];
        f.parts.push_back(t.name);
        continue;
      }
    }
    files.push_back({t.name, t.shape, {t.name}});
  }
  return files;
}

uint64_t parameter_count(const LlamaConfig& c) {
  uint64_t n = 0;
  for (const HfTensor& t : llama_hf_tensors(c)) n += static_cast<uint64_t>(t.numel());
  return n;
}

double model_flops_per_token(const LlamaConfig& c, int64_t seq_len) {
  return 6.0 * static_cast<double>(parameter_count(c)) +
         6.0 * static_cast<double>(c.num_hidden_layers * c.num_attention_heads * c.head_dim *
                                   seq_len);
}

}  // namespace strata
