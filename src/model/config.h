// config.h: a Llama-family model's shape, read from a Hugging Face config.json or taken from a
// preset.
//
// The family is Llama's decoder (RMSNorm, rotary embeddings, causal grouped-query attention,
// SwiGLU) as Hugging Face's LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
// Qwen3ForCausalLM, Phi3ForCausalLM and GemmaForCausalLM define it: Mistral is Llama with a
// sliding attention window, Qwen2 adds biases to the q, k and v projections, Qwen3 an RMSNorm
// over each head of q and k before the rotation, Phi-3 (Phi-3 and Phi-4) is Mistral with q, k
// and v stored as one tensor in its files, and gate and up as another (hf_file_tensors), and
// Gemma (the first Gemma, 2B and 7B) multiplies its embeddings by sqrt(hidden_size), stores
// each norm's weight as its difference from 1 and gates its MLP with GELU's tanh
// approximation (GeGLU). Gemma 2 (Gemma2ForCausalLM) is Gemma with a sliding window in every
// other layer, a norm on each sublayer's output as well as its input (post_attention_layernorm
// then normalises the attention's output, pre_ and post_feedforward_layernorm the MLP's input
// and output), attention scores scaled by query_pre_attn_scalar^-1/2 and capped by
// attn_logit_softcapping, and logits capped by final_logit_softcapping. Gemma 3's text model
// (Gemma3ForCausalLM, model_type gemma3_text: Gemma 3 1B) is Gemma 2 with Qwen3's q and k norms
// (Gemma's 1 + w), no caps by default, the window in five layers of six, and the sliding layers
// rotating with their own base, rope_local_base_freq, unscaled. Granite (GraniteForCausalLM:
// IBM's Granite 3) is Llama with four multipliers: on the embeddings, on each sublayer's output
// before it joins the residual, on the attention's scores (in place of 1/sqrt(head_dim)), and a
// divisor of the logits. Llama's (and Qwen3's)
// attention_bias and Llama's mlp_bias put biases on the other projections too; any class's
// hidden_act may be silu, gelu or gelu_pytorch_tanh.
//
// Parsing is strict on purpose: a field that changes the model's math and that strata does not
// implement (another activation, another rotary scaling, a sliding window that would cut a
// sequence, quantisation) is an error that names it, never silently ignored; a training run on
// the wrong equations would look fine until its loss did not. Keys that change nothing (token
// ids, use_cache, transformers_version, ...) are accepted.
#pragma once

#include "core/dtype.h"
#include "core/kernels.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace strata {

enum class RopeScalingKind : uint8_t { none, llama3, linear, dynamic, yarn, longrope };
std::string_view rope_scaling_name(RopeScalingKind k);  // "default", "llama3", "linear", ...

// Hugging Face's rope_scaling (transformers 5: rope_parameters), as transformers computes each
// kind's frequencies (rope_table in llama.h):
//   llama3  (Llama 3.1): factor, low_freq_factor, high_freq_factor and
//           original_max_position_embeddings, all required;
//   linear  (position interpolation): every frequency divided by factor;
//   dynamic (dynamic NTK): the frequencies change only for sequences longer than
//           max_position_embeddings, which strata never runs, so they are the plain ones;
//   yarn    (YaRN): factor (the stretch), and optionally original_max_position_embeddings (the
//           context the ramp's dimensions are counted over; else max_position_embeddings),
//           attention_factor (else from the factor, mscale and mscale_all_dim), beta_fast (32),
//           beta_slow (1) and truncate (true), as transformers 5 computes it (4.5x took the
//           stretch from max_position_embeddings / original_max_position_embeddings instead);
//   longrope (Phi-3's 128k models, Phi-3.5; "su" is its older name): each frequency divided by
//           its short_factor, or its long_factor where the sequences are longer than
//           original_max_position_embeddings (config.json's top level, as transformers reads
//           it), cos and sin scaled by attention_factor, else sqrt(1 + ln stretch / ln original)
//           past a stretch of 1; the stretch is factor where given (0 here: not given, as in
//           Phi-3's configs), else max_position_embeddings / original.
// The optional fields are kept as given, so that an export writes back what was read.
struct RopeScaling {
  RopeScalingKind kind = RopeScalingKind::none;
  double factor = 0.0;  // 0: not given (LongRoPE's may be absent; the other kinds require it)
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 0;  // 0: not given (llama3 requires it)
  std::optional<double> attention_factor, beta_fast, beta_slow, mscale, mscale_all_dim;
  std::optional<bool> truncate;
  std::vector<double> long_factor, short_factor;  // longrope: head_dim / 2 each

  bool operator==(const RopeScaling&) const = default;
};

// The Hugging Face class a checkpoint is written for (its "architectures" and "model_type"),
// kept so that an exported model loads as the class it came from.
enum class Architecture : uint8_t {
  llama,
  mistral,
  qwen2,
  qwen3,
  phi3,
  gemma,
  gemma2,
  gemma3,
  smollm3,
  granite
};
std::string_view architecture_class(Architecture a);       // "LlamaForCausalLM", ...
std::string_view architecture_model_type(Architecture a);  // "llama", "mistral", "qwen2", ...

struct LlamaConfig {
  std::string name;  // the preset's name, or the checkpoint directory's
  Architecture architecture = Architecture::llama;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;  // hidden_size / num_attention_heads when config.json has none
  // Phi-3's partial_rotary_factor (Phi-4-mini's 0.75): the first head_dim x it dimensions of
  // each head are rotated, the rest pass as they are. 1 for every other class.
  double partial_rotary_factor = 1.0;
  int64_t rotary_dim() const {
    return static_cast<int64_t>(static_cast<double>(head_dim) * partial_rotary_factor);
  }
  int64_t vocab_size = 0;
  int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-5;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  bool tie_word_embeddings = false;
  // Biases (".bias" tensors of the projection's output size): on q, k and v (Qwen2; Llama's
  // attention_bias), on o (Llama's attention_bias), on gate, up and down (Llama's mlp_bias).
  bool qkv_bias = false;
  bool o_bias = false;
  bool mlp_bias = false;
  // Qwen3: q and k, each head on its own, through an RMSNorm (weights "q_norm", "k_norm" of
  // head_dim) after their projections and before the rotation.
  bool qk_norm = false;
  // The MLP's gate: silu (SwiGLU, every class's default but Gemma's) or GELU (Gemma's
  // gelu_pytorch_tanh; hidden_act, or Gemma's hidden_activation, in config.json).
  Activation hidden_act = Activation::silu;
  // Gemma 2's: the attention's scores times query_pre_attn_scalar^-1/2 (0: head_dim's), capped
  // at attn_logit_softcapping, and the logits capped at final_logit_softcapping (c · tanh(x / c);
  // 0: no cap).
  double query_pre_attn_scalar = 0;
  double attn_logit_softcapping = 0;
  double final_logit_softcapping = 0;
  // Granite's: the embeddings times embedding_multiplier, each sublayer's output times
  // residual_multiplier before it is added to the residual, the attention's scores times
  // attention_multiplier (0: 1/sqrt(head_dim), every other class's), the logits divided by
  // logits_scaling. 1, 1, 0 and 1 for every other class.
  double embedding_multiplier = 1.0;
  double residual_multiplier = 1.0;
  double attention_multiplier = 0.0;
  double logits_scaling = 1.0;
  // Gemma 3's: the sliding layers' rotary base (rope_local_base_freq), without rope_scaling,
  // which applies to the other layers alone. 0: every layer rotates alike.
  double rope_local_base_freq = 0;
  // Whether layer l rotates with the local base.
  bool layer_rotates_locally(int64_t layer) const {
    return rope_local_base_freq > 0 && layer_slides(layer);
  }
  // SmolLM3's NoPE layers (no_rope_layers' zeros, every fourth by default): their q and k are
  // not rotated at all. Empty: every layer rotates.
  std::vector<bool> nope_layers;
  bool layer_rotates(int64_t layer) const {
    return nope_layers.empty() || !nope_layers[static_cast<size_t>(layer)];
  }
  // Mistral's sliding window: each query sees the last `sliding_window` positions, itself
  // included (AttentionMask::window), in the layers that slide: `sliding_layers` (one flag a
  // layer; Qwen2's max_window_layers or layer_types), every layer where it is empty. 0: no
  // window. Sequences within the window see every earlier position either way.
  int64_t sliding_window = 0;
  std::vector<bool> sliding_layers;
  bool layer_slides(int64_t layer) const {
    return sliding_window > 0 &&
           (sliding_layers.empty() || sliding_layers[static_cast<size_t>(layer)]);
  }
  DType torch_dtype = DType::bf16;  // the dtype the checkpoint was saved in
  // bos_token_id, eos_token_id and pad_token_id as config.json gives them (a token id, or for
  // eos a list of them), carried into checkpoints and exports, where generation and
  // tokenizer-side code reads them: without them transformers takes LlamaConfig's defaults (1
  // and 2), not Llama 3's 128000 and 128001. An object, empty where none is given.
  nlohmann::json token_ids = nlohmann::json::object();
  // Where the weights were read from a Gemma3ForConditionalGeneration checkpoint (Gemma 3 4B,
  // 12B, 27B): this is its text_config, and the files hold the language model's tensors under
  // language_model.model.* (or model.language_model.*, as transformers 4.52 saves them) beside
  // a vision tower, which strata does not train (open_model_weights). Checkpoints and exports
  // carry the vision tower's tensors unchanged and are that class again
  // (to_hf_image_text_config_json), as long as a run has them (not with --init random).
  nlohmann::json image_text_config;  // the image-text config.json, whole; null otherwise
  bool image_text_checkpoint() const { return image_text_config.is_object(); }
  // strata's, not config.json's: the vocabulary pieces the embedding and the head are cut into
  // (ModelLayout::build); 0 chooses (vocab_pieces_for), 1 keeps each whole.
  int64_t vocab_pieces = 0;

  bool operator==(const LlamaConfig&) const = default;
};

// Gemma's rules, 1 and 0 (or 1) for every other class: the norms multiply by 1 + their stored
// weight (Kernels::rmsnorm_forward's weight_offset), and the embeddings' rows are multiplied by
// sqrt(hidden_size) rounded to f32 and then to the activations' dtype `t`, as transformers
// rounds its normaliser (sqrt(3072) = 55.4256 becomes 55.5 in bf16).
float norm_weight_offset(const LlamaConfig& config);
float embedding_scale(const LlamaConfig& config, DType t);
// Granite's residual_multiplier and 1 / logits_scaling as f32, 1 for every other class: the
// matmuls that make a sublayer's output and the logits multiply by them (their alpha), forward
// and backward.
float residual_scale(const LlamaConfig& config);
float logits_scale(const LlamaConfig& config);
// Gemma 2's norms on each sublayer's output too (post_attention_layernorm on the attention's,
// post_feedforward_layernorm on the MLP's; pre_feedforward_layernorm is the MLP's input norm).
bool sandwich_norms(const LlamaConfig& config);
// How the model's attention forms its scores (AttentionMask's scale and softcap; no documents,
// no window): Gemma 2's and 3's query_pre_attn_scalar^-1/2 where it is not head_dim's own
// 1/sqrt(head_dim) (0 then), Granite's attention_multiplier, and attn_logit_softcapping.
AttentionMask attention_scores(const LlamaConfig& config);

// Checks sizes and their relations; errors name `source`, the field and its value.
void validate_llama_config(const LlamaConfig& config, std::string_view source);

// A config.json's contents; `source` names the file in errors. The result is named `source`.
LlamaConfig parse_llama_config(const nlohmann::json& json, std::string_view source);
// `path` is a checkpoint directory holding config.json, or the config file itself. The result
// is named after the directory.
LlamaConfig load_llama_config(const std::filesystem::path& path);

// Presets with the published shapes: tiny, llama2-7b/13b/70b, llama3-8b/70b (Llama 3: 8192
// positions, no rope scaling), llama3.1-8b/70b (131072 positions, llama3 rope scaling),
// llama3.2-1b/3b (tied, rope scaling factor 32),
// mistral-7b (v0.3: no sliding window), qwen2.5-7b/72b (q, k, v biases), qwen3-0.6b/8b
// (q and k norms), phi3-mini, phi4, gemma-2b/7b, gemma2-2b/9b/27b, gemma3-270m/1b,
// gemma3-4b/12b/27b (the image-text models' language models), smollm3-3b (NoPE every fourth
// layer) and granite-3.1-8b.
std::vector<std::string> preset_names();
std::optional<LlamaConfig> find_preset(std::string_view name);
// A checkpoint directory (or config.json) when the path exists, otherwise a preset name; an
// error lists the presets when it is neither.
LlamaConfig resolve_model(std::string_view dir_or_preset);

// A config.json that Hugging Face's class for the config's architecture loads;
// parse_llama_config reads it back to the same config (name aside).
nlohmann::json to_hf_config_json(const LlamaConfig& config);
// For a config read from an image-text Gemma 3's (image_text_checkpoint): that config.json with
// its text_config written as to_hf_config_json writes the language model's (every key, no
// architectures) and its dtype the language model's.
nlohmann::json to_hf_image_text_config_json(const LlamaConfig& config);

// One parameter tensor as Hugging Face names and shapes it ([out, in] for projections).
struct HfTensor {
  std::string name;
  std::vector<int64_t> shape;
  int64_t numel() const;
};
// Every parameter of the model in Hugging Face's order: embed_tokens, each layer (input norm,
// q, k, v, o, post-attention norm, gate, up, down, each projection's bias after its weight
// where the config has one), the final norm, and lm_head unless the embeddings are tied.
std::vector<HfTensor> llama_hf_tensors(const LlamaConfig& config);

// A tensor of a checkpoint's safetensors files and the parameters (llama_hf_tensors) it holds,
// their rows one after another in this order: for every class the parameter alone under its
// own name, but Phi3ForCausalLM's self_attn.qkv_proj (q, k, v) and mlp.gate_up_proj (gate,
// up). In llama_hf_tensors' order.
struct HfFileTensor {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<std::string> parts;
};
std::vector<HfFileTensor> hf_file_tensors(const LlamaConfig& config);
// The number of parameters (the sum over llama_hf_tensors): llama2-7b has 6,738,415,616.
uint64_t parameter_count(const LlamaConfig& config);
// Model FLOPs of one training step per token at `seq_len` tokens a sequence: 6 per parameter
// (forward 2, backward 4) and causal attention, QKᵀ and PV over on average T/2 keys:
// 6 · 2 · L · H · hd · T / 2. Not the recomputation activation checkpointing adds: what MFU
// counts.
double model_flops_per_token(const LlamaConfig& config, int64_t seq_len);

}  // namespace strata
