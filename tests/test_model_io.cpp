// test_model_io.cpp: what strata reads and writes of a model: config.json (published Llama 2,
// Llama 3 and 3.1 configs, every rejection path), presets and their published parameter
// counts, safetensors files (round trips single and sharded in F32/BF16/F16 with conversion on
// read, and one damaged file per check the reader makes, each error naming the file and the
// tensor), and token files (both llm.c magics, raw files, sizes, ids and sequence windows).
#include "core/bytes.h"
#include "core/dtype.h"
#include "model/config.h"
#include "model/file_io.h"
#include "model/llama.h"
#include "model/safetensors.h"
#include "model/tokens.h"
#include "nvme/io_ring.h"
#include "testing.h"

#include <fcntl.h>
#include <sys/statvfs.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>
#include <nlohmann/json.hpp>
#include <stdlib.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <numbers>
#include <string>
#include <vector>

namespace strata {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using test::expect_error;

// A fresh directory, removed with everything in it.
struct TempDir {
  fs::path path;
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "strata-model-io-XXXXXX").string();
    if (mkdtemp(tmpl.data()) == nullptr) ADD_FAILURE() << "mkdtemp " << tmpl;
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  fs::path operator/(const std::string& name) const { return path / name; }
};

void write_text(const fs::path& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << text;
}

std::string read_bytes(const fs::path& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

// ---------------------------------------------------------------- config.json

// Meta-Llama-3-8B's config.json as published.
const char* kLlama3_8b = R"({
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 128000,
  "eos_token_id": 128001,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 14336,
  "max_position_embeddings": 8192,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": null,
  "rope_theta": 500000.0,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.40.0.dev0",
  "use_cache": true,
  "vocab_size": 128256
})";

// Meta-Llama-3.1-8B's: llama3 rope scaling and 131072 positions.
const char* kLlama31_8b = R"({
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 128000,
  "eos_token_id": [128001, 128008, 128009],
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 14336,
  "max_position_embeddings": 131072,
  "mlp_bias": false,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3"
  },
  "rope_theta": 500000.0,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.43.0.dev0",
  "use_cache": true,
  "vocab_size": 128256
})";

// Llama-2-7b-hf's: no rope_theta, no head_dim, float16.
const char* kLlama2_7b = R"({
  "_name_or_path": "meta-llama/Llama-2-7b-hf",
  "architectures": ["LlamaForCausalLM"],
  "bos_token_id": 1,
  "eos_token_id": 2,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 11008,
  "max_position_embeddings": 4096,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 32,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": null,
  "tie_word_embeddings": false,
  "torch_dtype": "float16",
  "transformers_version": "4.31.0.dev0",
  "use_cache": true,
  "vocab_size": 32000
})";

// Llama-3.2-3B's: tied, head_dim given, rope scaling factor 32.
const char* kLlama32_3b = R"({
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 128000,
  "eos_token_id": 128001,
  "head_dim": 128,
  "hidden_act": "silu",
  "hidden_size": 3072,
  "initializer_range": 0.02,
  "intermediate_size": 8192,
  "max_position_embeddings": 131072,
  "mlp_bias": false,
  "model_type": "llama",
  "num_attention_heads": 24,
  "num_hidden_layers": 28,
  "num_key_value_heads": 8,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": {
    "factor": 32.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3"
  },
  "rope_theta": 500000.0,
  "tie_word_embeddings": true,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.45.0.dev0",
  "use_cache": true,
  "vocab_size": 128256
})";

// Qwen2.5-7B-Instruct's: biases on q, k and v are implied by the class; a window that is not
// used (use_sliding_window false).
const char* kQwen25_7b = R"({
  "architectures": ["Qwen2ForCausalLM"],
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "eos_token_id": 151645,
  "hidden_act": "silu",
  "hidden_size": 3584,
  "initializer_range": 0.02,
  "intermediate_size": 18944,
  "max_position_embeddings": 32768,
  "max_window_layers": 28,
  "model_type": "qwen2",
  "num_attention_heads": 28,
  "num_hidden_layers": 28,
  "num_key_value_heads": 4,
  "rms_norm_eps": 1e-06,
  "rope_theta": 1000000.0,
  "sliding_window": 131072,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.43.1",
  "use_cache": true,
  "use_sliding_window": false,
  "vocab_size": 152064
})";

// Mistral-7B-Instruct-v0.3's: no sliding window.
const char* kMistral7b = R"({
  "architectures": ["MistralForCausalLM"],
  "attention_dropout": 0.0,
  "bos_token_id": 1,
  "eos_token_id": 2,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 14336,
  "max_position_embeddings": 32768,
  "model_type": "mistral",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "rms_norm_eps": 1e-05,
  "rope_theta": 1000000.0,
  "sliding_window": null,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.42.0.dev0",
  "use_cache": true,
  "vocab_size": 32768
})";

// Phi-3-mini-4k-instruct's: Phi3ForCausalLM (fused projections in its files), a window of 2047,
// the dropouts 0, and keys the class reads for longrope (here unused).
const char* kPhi3Mini = R"({
  "architectures": ["Phi3ForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 1,
  "embd_pdrop": 0.0,
  "eos_token_id": 32000,
  "hidden_act": "silu",
  "hidden_size": 3072,
  "initializer_range": 0.02,
  "intermediate_size": 8192,
  "max_position_embeddings": 4096,
  "model_type": "phi3",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 32,
  "original_max_position_embeddings": 4096,
  "pad_token_id": 32000,
  "resid_pdrop": 0.0,
  "rms_norm_eps": 1e-05,
  "rope_scaling": null,
  "rope_theta": 10000.0,
  "sliding_window": 2047,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.40.2",
  "use_cache": true,
  "vocab_size": 32064
})";

// Qwen3-0.6B's: q and k norms implied by the class, head_dim 128 ≠ 1024 / 16, tied.
const char* kQwen3_06b = R"({
  "architectures": ["Qwen3ForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "eos_token_id": 151645,
  "head_dim": 128,
  "hidden_act": "silu",
  "hidden_size": 1024,
  "initializer_range": 0.02,
  "intermediate_size": 3072,
  "max_position_embeddings": 40960,
  "max_window_layers": 28,
  "model_type": "qwen3",
  "num_attention_heads": 16,
  "num_hidden_layers": 28,
  "num_key_value_heads": 8,
  "rms_norm_eps": 1e-06,
  "rope_scaling": null,
  "rope_theta": 1000000,
  "sliding_window": null,
  "tie_word_embeddings": true,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.51.0",
  "use_cache": true,
  "use_sliding_window": false,
  "vocab_size": 151936
})";

LlamaConfig parse_text(const std::string& text, const std::string& source = "cfg.json") {
  return parse_llama_config(json::parse(text), source);
}

// The published config.json parses to the preset with the same shape, field for field, and its
// token ids are read as given (presets have none: they make random models).
void expect_matches_preset(const char* text, const char* preset) {
  LlamaConfig c = parse_text(text);
  EXPECT_EQ(c.name, "cfg.json");
  c.name = preset;
  const json j = json::parse(text);
  for (const char* key : {"bos_token_id", "eos_token_id", "pad_token_id"})
    if (j.contains(key) && !j[key].is_null()) {
      EXPECT_EQ(c.token_ids[key], j[key]) << preset << " " << key;
    } else {
      EXPECT_FALSE(c.token_ids.contains(key)) << preset << " " << key;
    }
  c.token_ids = json::object();
  const auto p = find_preset(preset);
  ASSERT_TRUE(p.has_value()) << preset;
  EXPECT_EQ(c, *p) << preset;
}

TEST(LlamaConfigParse, PublishedConfigsMatchPresets) {
  expect_matches_preset(kLlama3_8b, "llama3-8b");
  expect_matches_preset(kLlama31_8b, "llama3.1-8b");
  expect_matches_preset(kLlama2_7b, "llama2-7b");

  const LlamaConfig c = parse_text(kLlama31_8b);
  EXPECT_EQ(c.hidden_size, 4096);
  EXPECT_EQ(c.intermediate_size, 14336);
  EXPECT_EQ(c.num_hidden_layers, 32);
  EXPECT_EQ(c.num_attention_heads, 32);
  EXPECT_EQ(c.num_key_value_heads, 8);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.vocab_size, 128256);
  EXPECT_EQ(c.max_position_embeddings, 131072);
  EXPECT_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_EQ(c.rope_theta, 500000.0);
  EXPECT_EQ(c.rope_scaling.kind, RopeScalingKind::llama3);
  EXPECT_EQ(c.rope_scaling.factor, 8.0);
  EXPECT_EQ(c.rope_scaling.low_freq_factor, 1.0);
  EXPECT_EQ(c.rope_scaling.high_freq_factor, 4.0);
  EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 8192);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.torch_dtype, DType::bf16);

  expect_matches_preset(kLlama32_3b, "llama3.2-3b");
  expect_matches_preset(kQwen25_7b, "qwen2.5-7b");
  expect_matches_preset(kMistral7b, "mistral-7b");
  expect_matches_preset(kQwen3_06b, "qwen3-0.6b");
  expect_matches_preset(kPhi3Mini, "phi3-mini");
  // Its files: q, k and v in one tensor per layer, gate and up in another, rows in that order.
  const std::vector<HfFileTensor> files = hf_file_tensors(*find_preset("phi3-mini"));
  EXPECT_EQ(files.size(), 3u + 32 * 6);
  const HfFileTensor& qkv = files[2];
  EXPECT_EQ(qkv.name, "model.layers.0.self_attn.qkv_proj.weight");
  EXPECT_EQ(qkv.shape, (std::vector<int64_t>{9216, 3072}));
  EXPECT_EQ(qkv.parts, (std::vector<std::string>{"model.layers.0.self_attn.q_proj.weight",
                                                 "model.layers.0.self_attn.k_proj.weight",
                                                 "model.layers.0.self_attn.v_proj.weight"}));
  const HfFileTensor& gate_up = files[5];
  EXPECT_EQ(gate_up.name, "model.layers.0.mlp.gate_up_proj.weight");
  EXPECT_EQ(gate_up.shape, (std::vector<int64_t>{16384, 3072}));
  EXPECT_EQ(gate_up.parts.size(), 2u);
  const ModelLayout layout = ModelLayout::build(*find_preset("phi3-mini"));
  const ParamSlot& v = layout.units[1].slot("self_attn.v_proj");
  EXPECT_EQ(v.file_name, "model.layers.0.self_attn.qkv_proj.weight");
  EXPECT_EQ(v.file_row, 6144);
  const ParamSlot& up = layout.units[1].slot("mlp.up_proj");
  EXPECT_EQ(up.file_row, 8192);
  EXPECT_EQ(layout.units[1].slot("self_attn.o_proj").file_name,
            "model.layers.0.self_attn.o_proj.weight");
  // Another class's files hold each parameter under its own name.
  for (const HfFileTensor& f : hf_file_tensors(*find_preset("mistral-7b")))
    EXPECT_EQ(f.parts, std::vector<std::string>{f.name});
  const LlamaConfig q3 = parse_text(kQwen3_06b);
  EXPECT_TRUE(q3.qk_norm);
  EXPECT_FALSE(q3.qkv_bias || q3.o_bias || q3.mlp_bias);
  const LlamaConfig q = parse_text(kQwen25_7b);
  EXPECT_EQ(q.architecture, Architecture::qwen2);
  EXPECT_TRUE(q.qkv_bias);
  EXPECT_FALSE(q.o_bias || q.mlp_bias);
  EXPECT_EQ(q.sliding_window, 0);  // use_sliding_window false: the window is not used

  const LlamaConfig l2 = parse_text(kLlama2_7b);
  EXPECT_EQ(l2.rope_theta, 10000.0);  // Hugging Face's default when absent
  EXPECT_EQ(l2.torch_dtype, DType::f16);
  EXPECT_EQ(l2.rope_scaling.kind, RopeScalingKind::none);
}

// A minimal valid config to mutate.
json minimal() {
  return json{{"architectures", {"LlamaForCausalLM"}},
              {"hidden_size", 64},
              {"intermediate_size", 172},
              {"num_hidden_layers", 2},
              {"num_attention_heads", 4},
              {"vocab_size", 512},
              {"max_position_embeddings", 256},
              {"rms_norm_eps", 1e-6}};
}

// Llama 3.1's rope_scaling, to mutate.
json llama3_scaling() {
  return json{{"rope_type", "llama3"},
              {"factor", 8.0},
              {"low_freq_factor", 1.0},
              {"high_freq_factor", 4.0},
              {"original_max_position_embeddings", 8192}};
}

// Gemma 7B's as Google first published it: hidden_act "gelu" (the tanh form the model was
// trained with, which transformers 4.38 took whatever hidden_act said), no tie_word_embeddings
// (GemmaConfig ties by default), head_dim 256 != 3072 / 16.
const char* kGemma7b = R"({
  "architectures": ["GemmaForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 2,
  "eos_token_id": 1,
  "head_dim": 256,
  "hidden_act": "gelu",
  "hidden_size": 3072,
  "initializer_range": 0.02,
  "intermediate_size": 24576,
  "max_position_embeddings": 8192,
  "model_type": "gemma",
  "num_attention_heads": 16,
  "num_hidden_layers": 28,
  "num_key_value_heads": 16,
  "pad_token_id": 0,
  "rms_norm_eps": 1e-06,
  "rope_scaling": null,
  "rope_theta": 10000.0,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.38.0.dev0",
  "use_cache": true,
  "vocab_size": 256000
})";

TEST(LlamaConfigParse, GemmaAsItsHuggingFaceClassBuildsIt) {
  expect_matches_preset(kGemma7b, "gemma-7b");
  const LlamaConfig g = parse_text(kGemma7b);
  EXPECT_EQ(g.architecture, Architecture::gemma);
  EXPECT_EQ(g.hidden_act, Activation::gelu_tanh);
  EXPECT_TRUE(g.tie_word_embeddings);
  EXPECT_EQ(g.head_dim, 256);
  // Its rules: norms times 1 + w (initialised at 0), embeddings times sqrt(3072) = 55.4256,
  // rounded as transformers rounds it: 55.5 in bf16.
  EXPECT_EQ(norm_weight_offset(g), 1.0f);
  EXPECT_EQ(ModelLayout::build(g).norm_init, 0.0f);
  EXPECT_EQ(embedding_scale(g, DType::bf16), 55.5f);
  EXPECT_EQ(embedding_scale(g, DType::f32), static_cast<float>(std::sqrt(3072.0)));
  EXPECT_EQ(embedding_scale(*find_preset("gemma-2b"), DType::bf16), 45.25f);  // sqrt(2048)
  for (const char* other : {"llama3-8b", "qwen3-8b", "phi4"}) {
    EXPECT_EQ(norm_weight_offset(*find_preset(other)), 0.0f) << other;
    EXPECT_EQ(embedding_scale(*find_preset(other), DType::bf16), 1.0f) << other;
    EXPECT_EQ(ModelLayout::build(*find_preset(other)).norm_init, 1.0f) << other;
  }

  // hidden_activation, the key later Gemma configs add, wins; "gelu" there is the exact GELU.
  json j = json::parse(kGemma7b);
  j["hidden_activation"] = "gelu_pytorch_tanh";
  EXPECT_EQ(parse_llama_config(j, "g.json").hidden_act, Activation::gelu_tanh);
  j["hidden_activation"] = "gelu";
  EXPECT_EQ(parse_llama_config(j, "g.json").hidden_act, Activation::gelu);
  j.erase("hidden_activation");
  j.erase("hidden_act");  // GemmaConfig's default
  EXPECT_EQ(parse_llama_config(j, "g.json").hidden_act, Activation::gelu_tanh);
  j["tie_word_embeddings"] = false;
  j.erase("head_dim");  // GemmaConfig's default, whatever hidden / heads is
  const LlamaConfig untied = parse_llama_config(j, "g.json");
  EXPECT_FALSE(untied.tie_word_embeddings);
  EXPECT_EQ(untied.head_dim, 256);
  j["attention_bias"] = true;  // as Llama's: q, k, v and o
  const LlamaConfig biased = parse_llama_config(j, "g.json");
  EXPECT_TRUE(biased.qkv_bias && biased.o_bias && !biased.mlp_bias);
  test::expect_error(
      [&] {
        j["hidden_activation"] = "relu";
        parse_llama_config(j, "g.json");
      },
      {"g.json", "hidden_activation 'relu'", "silu", "gelu_pytorch_tanh"});

  // Any class's hidden_act: Llama's "gelu" is the exact one, and Llama reads no
  // hidden_activation.
  json l = minimal();
  l["hidden_act"] = "gelu";
  l["hidden_activation"] = "gelu_pytorch_tanh";
  EXPECT_EQ(parse_llama_config(l, "l.json").hidden_act, Activation::gelu);
  l["hidden_act"] = "gelu_new";
  EXPECT_EQ(parse_llama_config(l, "l.json").hidden_act, Activation::gelu_tanh);
  l["hidden_act"] = "swish";
  EXPECT_EQ(parse_llama_config(l, "l.json").hidden_act, Activation::silu);
}

// Gemma 2 9B's: the window in every other layer, the caps, query_pre_attn_scalar, f32 weights,
// and keys the class reads for its cache (harmless here).
const char* kGemma2_9b = R"({
  "architectures": ["Gemma2ForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "attn_logit_softcapping": 50.0,
  "bos_token_id": 2,
  "cache_implementation": "hybrid",
  "eos_token_id": 1,
  "final_logit_softcapping": 30.0,
  "head_dim": 256,
  "hidden_act": "gelu_pytorch_tanh",
  "hidden_activation": "gelu_pytorch_tanh",
  "hidden_size": 3584,
  "initializer_range": 0.02,
  "intermediate_size": 14336,
  "max_position_embeddings": 8192,
  "model_type": "gemma2",
  "num_attention_heads": 16,
  "num_hidden_layers": 42,
  "num_key_value_heads": 8,
  "pad_token_id": 0,
  "query_pre_attn_scalar": 256,
  "rms_norm_eps": 1e-06,
  "rope_theta": 10000.0,
  "sliding_window": 4096,
  "sliding_window_size": 4096,
  "torch_dtype": "float32",
  "transformers_version": "4.42.0.dev0",
  "use_cache": true,
  "vocab_size": 256000
})";

TEST(LlamaConfigParse, Gemma2AsItsHuggingFaceClassBuildsIt) {
  expect_matches_preset(kGemma2_9b, "gemma2-9b");
  const LlamaConfig g = parse_text(kGemma2_9b);
  EXPECT_EQ(g.architecture, Architecture::gemma2);
  EXPECT_TRUE(sandwich_norms(g));
  EXPECT_FALSE(sandwich_norms(*find_preset("gemma-7b")));
  EXPECT_EQ(norm_weight_offset(g), 1.0f);
  EXPECT_EQ(g.sliding_window, 4096);
  for (int64_t l = 0; l < 42; ++l) EXPECT_EQ(g.layer_slides(l), l % 2 == 0) << l;
  EXPECT_EQ(g.attn_logit_softcapping, 50.0);
  EXPECT_EQ(g.final_logit_softcapping, 30.0);
  EXPECT_EQ(g.query_pre_attn_scalar, 256.0);
  EXPECT_TRUE(g.tie_word_embeddings);
  // Four norms a layer: the sublayers' inputs and outputs.
  const ModelLayout layout = ModelLayout::build(g);
  for (const char* norm : {"input_layernorm", "post_attention_layernorm",
                           "pre_feedforward_layernorm", "post_feedforward_layernorm"})
    EXPECT_EQ(layout.units[size_t(layout.first_block())].slot(norm).shape.dims[0], 3584) << norm;

  // Null caps are none; layer_types says which layers slide; the defaults where keys are absent.
  json j = json::parse(kGemma2_9b);
  j["attn_logit_softcapping"] = nullptr;
  j["final_logit_softcapping"] = nullptr;
  j["layer_types"] = json::array();
  for (int l = 0; l < 42; ++l)
    j["layer_types"].push_back(l < 21 ? "sliding_attention" : "full_attention");
  const LlamaConfig uncapped = parse_llama_config(j, "g2.json");
  EXPECT_EQ(uncapped.attn_logit_softcapping, 0.0);
  EXPECT_EQ(uncapped.final_logit_softcapping, 0.0);
  EXPECT_TRUE(uncapped.layer_slides(20) && !uncapped.layer_slides(21));
  for (const char* key : {"attn_logit_softcapping", "final_logit_softcapping",
                          "query_pre_attn_scalar", "sliding_window", "layer_types"})
    j.erase(key);
  const LlamaConfig defaults = parse_llama_config(j, "g2.json");
  EXPECT_EQ(defaults.attn_logit_softcapping, 50.0);
  EXPECT_EQ(defaults.final_logit_softcapping, 30.0);
  EXPECT_EQ(defaults.query_pre_attn_scalar, 256.0);
  EXPECT_EQ(defaults.sliding_window, 4096);
  EXPECT_TRUE(defaults.layer_slides(0) && !defaults.layer_slides(1));
  test::expect_error(
      [&] {
        j["query_pre_attn_scalar"] = nullptr;
        parse_llama_config(j, "g2.json");
      },
      {"g2.json", "query_pre_attn_scalar is null"});
  test::expect_error(
      [&] {
        j["query_pre_attn_scalar"] = -4;
        parse_llama_config(j, "g2.json");
      },
      {"g2.json", "query_pre_attn_scalar = -4"});
  // Another class's keys of these names change nothing it computes: not read.
  json l = minimal();
  l["final_logit_softcapping"] = 30.0;
  EXPECT_EQ(parse_llama_config(l, "l.json").final_logit_softcapping, 0.0);
  LlamaConfig capped_llama = *find_preset("tiny");
  capped_llama.attn_logit_softcapping = 10;
  test::expect_error([&] { validate_llama_config(capped_llama, "tiny"); },
                     {"attn_logit_softcapping = 10", "Gemma 2's"});
}

// Gemma 3 1B's: the text model's class, q and k norms implied, no caps (null), a window of 512
// in five layers of six, the sliding layers' rotary base.
const char* kGemma3_1b = R"({
  "architectures": ["Gemma3ForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "attn_logit_softcapping": null,
  "bos_token_id": 2,
  "cache_implementation": "hybrid",
  "eos_token_id": [1, 106],
  "final_logit_softcapping": null,
  "head_dim": 256,
  "hidden_activation": "gelu_pytorch_tanh",
  "hidden_size": 1152,
  "initializer_range": 0.02,
  "intermediate_size": 6912,
  "max_position_embeddings": 32768,
  "model_type": "gemma3_text",
  "num_attention_heads": 4,
  "num_hidden_layers": 26,
  "num_key_value_heads": 1,
  "pad_token_id": 0,
  "query_pre_attn_scalar": 256,
  "rms_norm_eps": 1e-06,
  "rope_local_base_freq": 10000,
  "rope_scaling": null,
  "rope_theta": 1000000,
  "sliding_window": 512,
  "sliding_window_pattern": 6,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.50.0.dev0",
  "use_cache": true,
  "vocab_size": 262144
})";

TEST(LlamaConfigParse, Gemma3AsItsHuggingFaceClassBuildsIt) {
  expect_matches_preset(kGemma3_1b, "gemma3-1b");
  const LlamaConfig g = parse_text(kGemma3_1b);
  EXPECT_EQ(g.architecture, Architecture::gemma3);
  EXPECT_TRUE(g.qk_norm && sandwich_norms(g));
  EXPECT_EQ(g.attn_logit_softcapping, 0.0);
  EXPECT_EQ(g.final_logit_softcapping, 0.0);
  for (int64_t l = 0; l < 26; ++l) {
    EXPECT_EQ(g.layer_slides(l), (l + 1) % 6 != 0) << l;
    EXPECT_EQ(g.layer_rotates_locally(l), (l + 1) % 6 != 0) << l;
  }
  EXPECT_EQ(g.rope_local_base_freq, 10000.0);
  EXPECT_EQ(g.rope_theta, 1e6);
  // Its export writes the pattern back for transformers 4.50, and layer_types for later ones.
  const json out = to_hf_config_json(g);
  EXPECT_EQ(out["model_type"], "gemma3_text");
  EXPECT_EQ(out["sliding_window_pattern"], 6);
  EXPECT_EQ(out["layer_types"][5], "full_attention");
  // Another pattern, and Gemma3TextConfig's defaults.
  json j = json::parse(kGemma3_1b);
  j["sliding_window_pattern"] = 2;
  EXPECT_TRUE(parse_llama_config(j, "g3.json").layer_slides(0));
  EXPECT_FALSE(parse_llama_config(j, "g3.json").layer_slides(1));
  for (const char* key : {"sliding_window_pattern", "rope_local_base_freq", "rope_theta",
                          "attn_logit_softcapping", "final_logit_softcapping"})
    j.erase(key);
  const LlamaConfig d = parse_llama_config(j, "g3.json");
  EXPECT_EQ(d.rope_theta, 1e6);
  EXPECT_EQ(d.rope_local_base_freq, 10000.0);
  EXPECT_EQ(d.final_logit_softcapping, 0.0);
  EXPECT_FALSE(d.layer_slides(5));
  test::expect_error(
      [&] {
        j["sliding_window_pattern"] = 0;
        parse_llama_config(j, "g3.json");
      },
      {"g3.json", "sliding_window_pattern = 0"});
}

// SmolLM3-3B's (HuggingFaceTB/SmolLM3-3B), its 36-entry lists built below: NoPE in every fourth
// layer, no window, tied by SmolLM3Config's default.
json smollm3_3b() {
  json rope = json::array(), types = json::array();
  for (int l = 0; l < 36; ++l) {
    rope.push_back((l + 1) % 4 != 0 ? 1 : 0);
    types.push_back("full_attention");
  }
  return json{{"architectures", {"SmolLM3ForCausalLM"}},
              {"attention_bias", false},
              {"attention_dropout", 0.0},
              {"bos_token_id", nullptr},
              {"eos_token_id", 128012},
              {"hidden_act", "silu"},
              {"hidden_size", 2048},
              {"initializer_range", 0.02},
              {"intermediate_size", 11008},
              {"layer_types", types},
              {"max_position_embeddings", 65536},
              {"max_window_layers", 28},
              {"mlp_bias", false},
              {"model_type", "smollm3"},
              {"no_rope_layer_interval", 4},
              {"no_rope_layers", rope},
              {"num_attention_heads", 16},
              {"num_hidden_layers", 36},
              {"num_key_value_heads", 4},
              {"pad_token_id", 128004},
              {"pretraining_tp", 2},
              {"rms_norm_eps", 1e-6},
              {"rope_scaling", nullptr},
              {"rope_theta", 5000000.0},
              {"sliding_window", nullptr},
              {"torch_dtype", "bfloat16"},
              {"use_cache", false},
              {"use_sliding_window", false},
              {"vocab_size", 128256}};
}

// SmolLM3: Llama's block with NoPE layers from no_rope_layers, else every
// no_rope_layer_interval-th; with use_sliding_window the NoPE layers slide unless layer_types
// says otherwise; exports write the list back.
TEST(LlamaConfigParse, SmolLM3AsItsHuggingFaceClassBuildsIt) {
  LlamaConfig c = parse_llama_config(smollm3_3b(), "cfg.json");
  c.name = "smollm3-3b";
  EXPECT_EQ(c.token_ids["eos_token_id"], smollm3_3b()["eos_token_id"]);
  c.token_ids = json::object();  // presets have none
  EXPECT_EQ(c, *find_preset("smollm3-3b"));
  EXPECT_EQ(c.architecture, Architecture::smollm3);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_TRUE(c.layer_rotates(2));
  EXPECT_FALSE(c.layer_rotates(3));
  EXPECT_EQ(c.sliding_window, 0);
  const json out = to_hf_config_json(c);
  EXPECT_EQ(out["architectures"], json::array({"SmolLM3ForCausalLM"}));
  EXPECT_EQ(out["no_rope_layers"], smollm3_3b()["no_rope_layers"]);
  LlamaConfig back = parse_llama_config(out, "cfg.json");
  back.name = c.name;
  EXPECT_EQ(back, c);
  // SmolLM3Config's defaults: the interval, the base, tied.
  json j = smollm3_3b();
  for (const char* key : {"no_rope_layers", "rope_theta", "layer_types"}) j.erase(key);
  j["no_rope_layer_interval"] = 3;
  const LlamaConfig d = parse_llama_config(j, "s.json");
  EXPECT_EQ(d.rope_theta, 2e6);
  for (int64_t l = 0; l < 36; ++l) EXPECT_EQ(d.layer_rotates(l), (l + 1) % 3 != 0) << l;
  // A window slides the NoPE layers.
  j["use_sliding_window"] = true;
  j["sliding_window"] = 512;
  const LlamaConfig w = parse_llama_config(j, "s.json");
  EXPECT_EQ(w.sliding_window, 512);
  for (int64_t l = 0; l < 36; ++l) EXPECT_EQ(w.layer_slides(l), !w.layer_rotates(l)) << l;
  const LlamaConfig w_back = parse_llama_config(to_hf_config_json(w), "s.json");
  EXPECT_EQ(w_back.sliding_layers, w.sliding_layers);
  EXPECT_EQ(w_back.nope_layers, w.nope_layers);
  // Bad lists are named.
  j = smollm3_3b();
  j["no_rope_layers"][5] = 2;
  test::expect_error([&] { parse_llama_config(j, "s.json"); }, {"s.json", "no_rope_layers[5] = 2"});
  j["no_rope_layers"] = json::array({1, 0});
  test::expect_error([&] { parse_llama_config(j, "s.json"); },
                     {"s.json", "no_rope_layers has 2 entries for 36 layers"});
  j.erase("no_rope_layers");
  j["no_rope_layer_interval"] = 0;
  test::expect_error([&] { parse_llama_config(j, "s.json"); },
                     {"s.json", "no_rope_layer_interval = 0"});
  // Another class's NoPE layers cannot be asked for.
  LlamaConfig llama = *find_preset("tiny");
  llama.nope_layers = {false, true};
  test::expect_error([&] { validate_llama_config(llama, "tiny"); }, {"NoPE", "SmolLM3"});
}

// Granite 3.1 8B's (ibm-granite/granite-3.1-8b-instruct), as its config.json gives it.
json granite_31_8b() {
  return json{{"architectures", {"GraniteForCausalLM"}},
              {"attention_bias", false},
              {"attention_multiplier", 0.0078125},
              {"bos_token_id", 0},
              {"embedding_multiplier", 12.0},
              {"eos_token_id", 0},
              {"hidden_act", "silu"},
              {"hidden_size", 4096},
              {"initializer_range", 0.02},
              {"intermediate_size", 12800},
              {"logits_scaling", 16.0},
              {"max_position_embeddings", 131072},
              {"mlp_bias", false},
              {"model_type", "granite"},
              {"num_attention_heads", 32},
              {"num_hidden_layers", 40},
              {"num_key_value_heads", 8},
              {"pad_token_id", 0},
              {"residual_multiplier", 0.22},
              {"rms_norm_eps", 1e-5},
              {"rope_scaling", nullptr},
              {"rope_theta", 10000000.0},
              {"tie_word_embeddings", true},
              {"torch_dtype", "bfloat16"},
              {"use_cache", true},
              {"vocab_size", 49155}};
}

// Granite: Llama's block with its four multipliers, GraniteConfig's 1s where a key is absent,
// head_dim always hidden / heads, no biases; exports write the multipliers back.
TEST(LlamaConfigParse, GraniteAsItsHuggingFaceClassBuildsIt) {
  LlamaConfig c = parse_llama_config(granite_31_8b(), "cfg.json");
  c.name = "granite-3.1-8b";
  EXPECT_EQ(c.token_ids["eos_token_id"], granite_31_8b()["eos_token_id"]);
  c.token_ids = json::object();  // presets have none
  EXPECT_EQ(c, *find_preset("granite-3.1-8b"));
  EXPECT_EQ(c.architecture, Architecture::granite);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(attention_scores(c).scale, 0.0078125f);   // 1/128, not 128^-1/2
  EXPECT_EQ(embedding_scale(c, DType::bf16), 12.0f);  // a Python float: not rounded to bf16
  EXPECT_EQ(residual_scale(c), 0.22f);
  EXPECT_EQ(logits_scale(c), 1.0f / 16.0f);
  const json out = to_hf_config_json(c);
  EXPECT_EQ(out["architectures"], json::array({"GraniteForCausalLM"}));
  for (const char* key :
       {"embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"})
    EXPECT_EQ(out[key], granite_31_8b()[key]) << key;
  LlamaConfig back = parse_llama_config(out, "cfg.json");
  back.name = c.name;
  EXPECT_EQ(back, c);
  // GraniteConfig's defaults: every multiplier 1, the scores' too; head_dim is not read.
  json j = granite_31_8b();
  for (const char* key :
       {"embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"})
    j.erase(key);
  j["head_dim"] = 64;
  const LlamaConfig d = parse_llama_config(j, "g.json");
  EXPECT_EQ(d.embedding_multiplier, 1.0);
  EXPECT_EQ(d.residual_multiplier, 1.0);
  EXPECT_EQ(d.attention_multiplier, 1.0);
  EXPECT_EQ(d.logits_scaling, 1.0);
  EXPECT_EQ(d.head_dim, 128);
  EXPECT_EQ(attention_scores(d).scale, 1.0f);
  // Biases are not built for Granite; bad multipliers and other classes' are named.
  for (const char* bias : {"attention_bias", "mlp_bias"}) {
    j = granite_31_8b();
    j[bias] = true;
    test::expect_error([&] { parse_llama_config(j, "g.json"); }, {"g.json", "Granite"});
  }
  for (const double bad : {0.0, -2.0}) {
    j = granite_31_8b();
    j["logits_scaling"] = bad;
    test::expect_error([&] { parse_llama_config(j, "g.json"); },
                       {"g.json", "logits_scaling", "positive"});
  }
  LlamaConfig llama = *find_preset("tiny");
  llama.residual_multiplier = 0.5;
  test::expect_error([&] { validate_llama_config(llama, "tiny"); },
                     {"residual_multiplier = 0.5", "Granite's", "LlamaForCausalLM"});
  LlamaConfig uneven = c;
  uneven.head_dim = 64;
  test::expect_error([&] { validate_llama_config(uneven, "g"); }, {"head_dim = 64", "Granite"});
}

// Gemma 3 4B's (google/gemma-3-4b-it): an image-text model whose text_config holds only the keys
// that differ from Gemma3TextConfig's defaults.
const char* kGemma3_4b = R"({
  "architectures": ["Gemma3ForConditionalGeneration"],
  "boi_token_index": 255999,
  "eoi_token_index": 256000,
  "eos_token_id": [1, 106],
  "image_token_index": 262144,
  "initializer_range": 0.02,
  "mm_tokens_per_image": 256,
  "model_type": "gemma3",
  "text_config": {
    "hidden_size": 2560,
    "intermediate_size": 10240,
    "model_type": "gemma3_text",
    "num_hidden_layers": 34,
    "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
    "sliding_window": 1024
  },
  "torch_dtype": "bfloat16",
  "transformers_version": "4.50.0.dev0",
  "vision_config": {
    "hidden_size": 1152,
    "image_size": 896,
    "intermediate_size": 4304,
    "model_type": "siglip_vision_model",
    "num_attention_heads": 16,
    "num_hidden_layers": 27,
    "patch_size": 14,
    "vision_use_head": false
  }
})";

// The image-text Gemma 3s: their language model, from the text_config completed with
// Gemma3TextConfig's defaults, marked as read from an image-text checkpoint.
TEST(LlamaConfigParse, Gemma3sImageTextConfigBuildsItsLanguageModel) {
  LlamaConfig c = parse_text(kGemma3_4b);
  EXPECT_TRUE(c.image_text_checkpoint());
  EXPECT_EQ(c.name, "cfg.json");
  EXPECT_EQ(c.image_text_config, json::parse(kGemma3_4b));
  // Written back whole, its text_config the language model's every key.
  const json back = to_hf_image_text_config_json(c);
  EXPECT_EQ(back["vision_config"], c.image_text_config["vision_config"]);
  EXPECT_EQ(back["architectures"], json::array({"Gemma3ForConditionalGeneration"}));
  EXPECT_EQ(back["text_config"]["num_attention_heads"], 8);
  EXPECT_FALSE(back["text_config"].contains("architectures"));
  LlamaConfig again = parse_llama_config(back, "cfg.json");
  EXPECT_EQ(again.image_text_config, back);
  again.image_text_config = c.image_text_config;
  EXPECT_EQ(again, c);
  c.image_text_config = nullptr;
  c.name = "gemma3-4b";
  EXPECT_EQ(c, *find_preset("gemma3-4b"));
  EXPECT_EQ(c.vocab_size, 262208);
  EXPECT_EQ(c.num_attention_heads, 8);
  EXPECT_EQ(c.num_key_value_heads, 4);
  EXPECT_TRUE(c.tie_word_embeddings && c.qk_norm);
  EXPECT_EQ(c.rope_scaling.kind, RopeScalingKind::linear);
  EXPECT_EQ(c.torch_dtype, DType::bf16);  // the top level's
  EXPECT_FALSE(c.layer_slides(5));
  EXPECT_TRUE(c.layer_slides(6));
  // Its exports are the language model alone.
  const json out = to_hf_config_json(c);
  EXPECT_EQ(out["architectures"], json::array({"Gemma3ForCausalLM"}));
  EXPECT_EQ(out["model_type"], "gemma3_text");
  // 27B's text_config names its own head_dim and score scale; model_type alone identifies it.
  json j = json::parse(kGemma3_4b);
  j.erase("architectures");
  j["text_config"] = {{"head_dim", 128},
                      {"hidden_size", 5376},
                      {"intermediate_size", 21504},
                      {"model_type", "gemma3_text"},
                      {"num_attention_heads", 32},
                      {"num_hidden_layers", 62},
                      {"num_key_value_heads", 16},
                      {"query_pre_attn_scalar", 168},
                      {"rope_scaling", {{"factor", 8.0}, {"rope_type", "linear"}}},
                      {"sliding_window", 1024}};
  LlamaConfig big = parse_llama_config(j, "27b.json");
  big.image_text_config = nullptr;
  big.name = "gemma3-27b";
  EXPECT_EQ(big, *find_preset("gemma3-27b"));
  // A text_config of another model, or none, is named.
  j["text_config"]["model_type"] = "gemma2";
  test::expect_error([&] { parse_llama_config(j, "27b.json"); },
                     {"27b.json", "text_config.model_type is \"gemma2\"", "gemma3_text"});
  j.erase("text_config");
  test::expect_error([&] { parse_llama_config(j, "27b.json"); },
                     {"27b.json", "without a text_config"});
}

TEST(LlamaConfigParse, MistralAndQwen2AsTheirHuggingFaceClassesBuildThem) {
  // Mistral: Llama's equations; biases never (the class fixes them), the window kept.
  json j = minimal();
  j["architectures"] = {"MistralForCausalLM"};
  j["attention_bias"] = true;  // MistralForCausalLM builds no biases whatever this says
  j["sliding_window"] = 128;
  LlamaConfig c = parse_llama_config(j, "m.json");
  EXPECT_EQ(c.architecture, Architecture::mistral);
  EXPECT_FALSE(c.qkv_bias || c.o_bias || c.mlp_bias);
  EXPECT_EQ(c.sliding_window, 128);
  EXPECT_TRUE(c.sliding_layers.empty() && c.layer_slides(0) && c.layer_slides(1));
  ModelOptions o;
  o.seq_len = 129;  // past the window: the attention slides it
  EXPECT_GT(LlamaModel::workspace_bytes_for(c, o), 0u);
  o.forward_only = o.kv_cache = true;  // decoding slides it over a cache of every position
  EXPECT_GT(LlamaModel::workspace_bytes_for(c, o), 0u);

  // Qwen2: q, k and v biases always; the window only where use_sliding_window is set and a
  // layer uses it.
  j = minimal();
  j.erase("architectures");
  j["model_type"] = "qwen2";
  j["sliding_window"] = 64;
  c = parse_llama_config(j, "m.json");
  EXPECT_EQ(c.architecture, Architecture::qwen2);
  EXPECT_TRUE(c.qkv_bias);
  EXPECT_FALSE(c.o_bias || c.mlp_bias);
  EXPECT_EQ(c.sliding_window, 0);
  j["use_sliding_window"] = true;
  j["max_window_layers"] = 2;  // = num_hidden_layers: no layer slides
  EXPECT_EQ(parse_llama_config(j, "m.json").sliding_window, 0);
  j["max_window_layers"] = 1;
  c = parse_llama_config(j, "m.json");
  EXPECT_EQ(c.sliding_window, 64);
  EXPECT_EQ(c.sliding_layers, (std::vector<bool>{false, true}));  // the layers from 1 on
  EXPECT_FALSE(c.layer_slides(0));
  EXPECT_TRUE(c.layer_slides(1));
  // Exported with both forms, and read back the same.
  json out = to_hf_config_json(c);
  EXPECT_EQ(out["max_window_layers"], 1);
  EXPECT_EQ(out["layer_types"], json({"full_attention", "sliding_attention"}));
  EXPECT_EQ(parse_llama_config(out, "m.json").sliding_layers, c.sliding_layers);
  j["max_window_layers"] = 0;  // every layer: the plain form
  EXPECT_TRUE(parse_llama_config(j, "m.json").sliding_layers.empty());
  j["layer_types"] = {"full_attention", "full_attention"};  // layer_types rules when given
  EXPECT_EQ(parse_llama_config(j, "m.json").sliding_window, 0);
  j["layer_types"] = {"sliding_attention", "full_attention"};  // not a suffix
  c = parse_llama_config(j, "m.json");
  EXPECT_EQ(c.sliding_layers, (std::vector<bool>{true, false}));
  out = to_hf_config_json(c);
  EXPECT_EQ(out["max_window_layers"], 2);  // no suffix slides, as older transformers read it
  EXPECT_EQ(parse_llama_config(out, "m.json").sliding_layers, c.sliding_layers);  // exactly
  j["layer_types"] = {"sliding_attention"};
  expect_error([&] { parse_llama_config(j, "m.json"); },
               {"m.json", "layer_types has 1 entries for 2 layers"});

  // Llama: attention_bias puts biases on q, k, v and o; mlp_bias on gate, up and down.
  j = minimal();
  j["attention_bias"] = true;
  c = parse_llama_config(j, "m.json");
  EXPECT_TRUE(c.qkv_bias && c.o_bias);
  EXPECT_FALSE(c.mlp_bias);
  j["mlp_bias"] = true;
  EXPECT_TRUE(parse_llama_config(j, "m.json").mlp_bias);
  j["sliding_window"] = 16;  // not a Llama key: LlamaForCausalLM ignores it
  EXPECT_EQ(parse_llama_config(j, "m.json").sliding_window, 0);

  // Qwen3: q and k norms always; attention_bias as Llama's (q, k, v and o).
  j = minimal();
  j["architectures"] = {"Qwen3ForCausalLM"};
  j["attention_bias"] = true;
  j["mlp_bias"] = true;  // Qwen3's MLP has no biases whatever this says
  c = parse_llama_config(j, "m.json");
  EXPECT_EQ(c.architecture, Architecture::qwen3);
  EXPECT_TRUE(c.qk_norm && c.qkv_bias && c.o_bias);
  EXPECT_FALSE(c.mlp_bias);
  LlamaConfig q3 = *find_preset("qwen3-0.6b");
  const std::vector<HfTensor> q3t = llama_hf_tensors(q3);
  const auto has = [&](const std::string& name, std::vector<int64_t> shape) {
    return std::any_of(q3t.begin(), q3t.end(),
                       [&](const HfTensor& x) { return x.name == name && x.shape == shape; });
  };
  EXPECT_TRUE(has("model.layers.27.self_attn.q_norm.weight", {128}));
  EXPECT_TRUE(has("model.layers.0.self_attn.k_norm.weight", {128}));
  EXPECT_TRUE(has("model.layers.0.self_attn.q_proj.weight", {2048, 1024}));
  // Qwen3-0.6B: 596,049,920 parameters (0.6B, tied; the 0.44B Qwen counts without the
  // embedding).
  EXPECT_EQ(parameter_count(q3), 596049920u);

  // A config no class builds is refused before anything uses it.
  LlamaConfig bad = *find_preset("qwen2.5-7b");
  bad.o_bias = true;
  expect_error([&] { validate_llama_config(bad, "x"); }, {"Qwen2ForCausalLM", "q, k and v only"});
  bad = *find_preset("tiny");
  bad.sliding_window = 8;
  expect_error([&] { validate_llama_config(bad, "x"); },
               {"sliding_window = 8", "LlamaForCausalLM"});

  // Each bias follows its projection's weight, shaped [out].
  LlamaConfig q = *find_preset("tiny");
  q.architecture = Architecture::qwen2;
  q.qkv_bias = true;
  const std::vector<HfTensor> t = llama_hf_tensors(q);
  ASSERT_EQ(t.size(), 1 + 12 * 2 + 1 + 1u);
  const std::vector<std::pair<std::string, std::vector<int64_t>>> first = {
      {"model.layers.0.input_layernorm.weight", {64}},
      {"model.layers.0.self_attn.q_proj.weight", {64, 64}},
      {"model.layers.0.self_attn.q_proj.bias", {64}},
      {"model.layers.0.self_attn.k_proj.weight", {32, 64}},
      {"model.layers.0.self_attn.k_proj.bias", {32}},
      {"model.layers.0.self_attn.v_proj.weight", {32, 64}},
      {"model.layers.0.self_attn.v_proj.bias", {32}},
      {"model.layers.0.self_attn.o_proj.weight", {64, 64}},
  };
  for (size_t i = 0; i < first.size(); ++i) {
    EXPECT_EQ(t[1 + i].name, first[i].first);
    EXPECT_EQ(t[1 + i].shape, first[i].second) << first[i].first;
  }
  EXPECT_EQ(parameter_count(q), parameter_count(*find_preset("tiny")) + 2 * (64 + 32 + 32));
  // qwen2.5-7b: 7.62 billion parameters, as Qwen publishes.
  EXPECT_EQ(parameter_count(*find_preset("qwen2.5-7b")), 7615616512u);
  EXPECT_EQ(parameter_count(*find_preset("mistral-7b")), 7248023552u);
}

TEST(LlamaConfigParse, DefaultsAndHarmlessKeys) {
  LlamaConfig c = parse_llama_config(minimal(), "m.json");
  EXPECT_EQ(c.num_key_value_heads, 4);  // = heads when absent
  EXPECT_EQ(c.head_dim, 16);            // = hidden / heads when absent
  EXPECT_EQ(c.torch_dtype, DType::bf16);
  EXPECT_EQ(c.rope_theta, 10000.0);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.rms_norm_eps, 1e-6);

  json j = minimal();
  j.erase("architectures");
  j["model_type"] = "llama";  // no architectures: model_type alone is enough
  j["head_dim"] = 32;         // not hidden / heads: kept as given
  j["num_key_value_heads"] = 2;
  j["dtype"] = "float32";  // transformers 4.56's name for torch_dtype
  j["tie_word_embeddings"] = true;
  j["pretraining_tp"] = 2;  // harmless
  j["bos_token_id"] = 1;
  j["transformers_version"] = "4.44.0";
  j["use_cache"] = false;
  j["initializer_range"] = 0.01;
  j["some_future_key"] = {{"x", 1}};
  j["attention_bias"] = false;
  j["mlp_bias"] = false;
  j["attention_dropout"] = 0;
  j["hidden_act"] = "silu";
  j["rope_scaling"] = {{"rope_type", "default"}};  // plain rotary embeddings
  c = parse_llama_config(j, "m.json");
  EXPECT_EQ(c.head_dim, 32);
  EXPECT_EQ(c.num_key_value_heads, 2);
  EXPECT_EQ(c.torch_dtype, DType::f32);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.rope_scaling.kind, RopeScalingKind::none);

  // transformers 5's rope_parameters carries theta and the scaling.
  j = minimal();
  j["rope_parameters"] = llama3_scaling();
  j["rope_parameters"]["rope_theta"] = 500000.0;
  j["rope_parameters"]["original_max_position_embeddings"] = 64;
  c = parse_llama_config(j, "m.json");
  EXPECT_EQ(c.rope_theta, 500000.0);
  EXPECT_EQ(c.rope_scaling.kind, RopeScalingKind::llama3);
  EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 64);
  j["rope_theta"] = 10000.0;
  expect_error([&] { parse_llama_config(j, "m.json"); }, {"m.json", "rope_parameters"});
}

// Each mutation of the minimal config must be refused with the file and these words named.
struct Rejection {
  const char* what;
  std::function<void(json&)> mutate;
  std::vector<std::string> words;
};

TEST(LlamaConfigParse, EveryRejectionNamesTheField) {
  const std::vector<Rejection> cases = {
      {"other architecture",
       [](json& j) { j["architectures"] = {"Olmo2ForCausalLM"}; },
       {"architectures", "Olmo2ForCausalLM", "LlamaForCausalLM", "Gemma3ForCausalLM"}},
      {"architectures and model_type disagree",
       [](json& j) {
         j["architectures"] = {"MistralForCausalLM"};
         j["model_type"] = "qwen2";
       },
       {"architectures", "MistralForCausalLM", "model_type 'qwen2'"}},
      {"mistral window 0",
       [](json& j) {
         j["architectures"] = {"MistralForCausalLM"};
         j["sliding_window"] = 0;
       },
       {"sliding_window = 0"}},
      {"qwen2 layer type unknown",
       [](json& j) {
         j["architectures"] = {"Qwen2ForCausalLM"};
         j["use_sliding_window"] = true;
         j["sliding_window"] = 64;
         j["layer_types"] = {"full_attention", "chunked_attention"};
       },
       {"layer_types", "chunked_attention"}},
      {"architectures not a list",
       [](json& j) { j["architectures"] = "LlamaForCausalLM"; },
       {"architectures", "string"}},
      {"other model_type", [](json& j) { j["model_type"] = "gpt2"; }, {"model_type", "gpt2"}},
      {"eos_token_id not an id",
       [](json& j) { j["eos_token_id"] = "</s>"; },
       {"eos_token_id", "a token id or a list of them", "</s>"}},
      {"eos_token_id an empty list",
       [](json& j) { j["eos_token_id"] = json::array(); },
       {"eos_token_id", "a token id or a list of them"}},
      {"no architecture at all",
       [](json& j) { j.erase("architectures"); },
       {"architectures", "model_type"}},
      {"hidden_size a string",
       [](json& j) { j["hidden_size"] = "4096"; },
       {"hidden_size", "string", "\"4096\""}},
      {"hidden_size a float",
       [](json& j) { j["hidden_size"] = 64.5; },
       {"hidden_size", "integer", "64.5"}},
      {"vocab_size a bool", [](json& j) { j["vocab_size"] = true; }, {"vocab_size", "boolean"}},
      {"rms_norm_eps a string",
       [](json& j) { j["rms_norm_eps"] = "1e-5"; },
       {"rms_norm_eps", "number"}},
      {"rope_theta a list",
       [](json& j) {
         j["rope_theta"] = {1, 2};
       },
       {"rope_theta", "array"}},
      {"tie_word_embeddings a string",
       [](json& j) { j["tie_word_embeddings"] = "false"; },
       {"tie_word_embeddings", "string"}},
      {"head_dim a string", [](json& j) { j["head_dim"] = "16"; }, {"head_dim", "string"}},
      {"hidden_size 0", [](json& j) { j["hidden_size"] = 0; }, {"hidden_size = 0"}},
      {"negative layers", [](json& j) { j["num_hidden_layers"] = -2; }, {"num_hidden_layers = -2"}},
      {"vocab 0", [](json& j) { j["vocab_size"] = 0; }, {"vocab_size = 0"}},
      {"intermediate too large",
       [](json& j) { j["intermediate_size"] = int64_t{1} << 40; },
       {"intermediate_size = 1099511627776"}},
      {"heads not divisible by kv heads",
       [](json& j) { j["num_key_value_heads"] = 3; },
       {"num_attention_heads = 4", "num_key_value_heads = 3"}},
      {"hidden not divisible by heads",
       [](json& j) {
         j["hidden_size"] = 66;
         j["num_attention_heads"] = 4;
       },
       {"hidden_size = 66", "num_attention_heads = 4", "head_dim"}},
      {"odd head_dim", [](json& j) { j["head_dim"] = 7; }, {"head_dim = 7"}},
      {"zero eps", [](json& j) { j["rms_norm_eps"] = 0.0; }, {"rms_norm_eps = 0"}},
      {"negative theta", [](json& j) { j["rope_theta"] = -1.0; }, {"rope_theta = -1"}},
      {"rope type ntk",
       [](json& j) {
         j["rope_scaling"] = {{"type", "ntk"}, {"factor", 2.0}};
       },
       {"rope_scaling.type", "ntk", "'linear'", "'yarn'", "'longrope'"}},
      {"rope_type dynamic without a factor",
       [](json& j) {
         j["rope_scaling"] = {{"rope_type", "dynamic"}};
       },
       {"rope_scaling.factor", "missing"}},
      {"linear factor 0",
       [](json& j) {
         j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 0.0}};
       },
       {"rope_scaling.factor = 0"}},
      {"yarn beta negative",
       [](json& j) {
         j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}, {"beta_fast", -1.0}};
       },
       {"rope_scaling.beta_fast = -1"}},
      {"yarn truncate a number",
       [](json& j) {
         j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}, {"truncate", 1}};
       },
       {"rope_scaling.truncate", "true or false"}},
      {"llama rotating part of each head",
       [](json& j) { j["partial_rotary_factor"] = 0.75; },
       {"partial_rotary_factor = 0.75", "LlamaForCausalLM", "every dimension"}},
      {"phi3 rotating more than each head",
       [](json& j) {
         j["architectures"] = {"Phi3ForCausalLM"};
         j["partial_rotary_factor"] = 1.5;
       },
       {"partial_rotary_factor = 1.5", "(0, 1]"}},
      {"phi3 rotating an odd count",
       [](json& j) {
         j["architectures"] = {"Phi3ForCausalLM"};
         j["head_dim"] = 16;
         j["partial_rotary_factor"] = 0.3125;
       },
       {"partial_rotary_factor = 0.3125", "rotates 5 of head_dim 16", "even"}},
      {"phi3 residual dropout",
       [](json& j) {
         j["architectures"] = {"Phi3ForCausalLM"};
         j["resid_pdrop"] = 0.1;
       },
       {"resid_pdrop = 0.1", "no dropout"}},
      {"rope type and rope_type disagree",
       [](json& j) {
         j["rope_scaling"] = {{"rope_type", "llama3"}, {"type", "linear"}};
       },
       {"rope_scaling.rope_type", "rope_scaling.type", "linear"}},
      {"rope_scaling without a kind",
       [](json& j) {
         j["rope_scaling"] = {{"factor", 8.0}};
       },
       {"rope_scaling", "rope_type"}},
      {"rope_scaling a string",
       [](json& j) { j["rope_scaling"] = "llama3"; },
       {"rope_scaling", "string"}},
      {"llama3 without factor",
       [](json& j) {
         j["rope_scaling"] = llama3_scaling();
         j["rope_scaling"].erase("factor");
       },
       {"rope_scaling.factor", "missing"}},
      {"llama3 high <= low",
       [](json& j) {
         j["rope_scaling"] = llama3_scaling();
         j["rope_scaling"]["low_freq_factor"] = 4.0;
         j["rope_scaling"]["high_freq_factor"] = 1.0;
       },
       {"rope_scaling.high_freq_factor = 1", "low_freq_factor = 4"}},
      {"llama3 original positions a float",
       [](json& j) {
         j["rope_scaling"] = llama3_scaling();
         j["rope_scaling"]["original_max_position_embeddings"] = 8192.5;
       },
       {"rope_scaling.original_max_position_embeddings", "integer"}},
      {"attention_bias a string",
       [](json& j) { j["attention_bias"] = "yes"; },
       {"attention_bias", "string"}},
      {"mlp_bias a number", [](json& j) { j["mlp_bias"] = 1; }, {"mlp_bias", "number"}},
      {"relu", [](json& j) { j["hidden_act"] = "relu"; }, {"hidden_act 'relu'", "gelu"}},
      {"dropout", [](json& j) { j["attention_dropout"] = 0.1; }, {"attention_dropout = 0.1"}},
      {"quantized",
       [](json& j) {
         j["quantization_config"] = {{"quant_method", "gptq"}};
       },
       {"quantization_config"}},
      {"float64", [](json& j) { j["torch_dtype"] = "float64"; }, {"torch_dtype", "float64"}},
      {"int8 dtype", [](json& j) { j["dtype"] = "int8"; }, {"dtype", "int8"}},
  };
  for (const Rejection& r : cases) {
    SCOPED_TRACE(r.what);
    json j = minimal();
    r.mutate(j);
    std::vector<std::string> words = r.words;
    words.push_back("bad.json");
    const std::string msg = test::error_message([&] { parse_llama_config(j, "bad.json"); });
    for (const std::string& w : words)
      EXPECT_NE(msg.find(w), std::string::npos) << "'" << w << "' missing from: " << msg;
  }

  // Every required field, missing in turn.
  for (const char* key :
       {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "vocab_size", "max_position_embeddings", "rms_norm_eps"}) {
    json j = minimal();
    j.erase(key);
    expect_error([&] { parse_llama_config(j, "bad.json"); }, {"bad.json", key, "missing"});
    j = minimal();
    j[key] = nullptr;  // null is "unset" in Hugging Face's files
    expect_error([&] { parse_llama_config(j, "bad.json"); }, {"bad.json", key, "missing"});
  }
  expect_error([&] { parse_llama_config(json::array({1, 2}), "bad.json"); }, {"bad.json", "array"});
}

TEST(LlamaConfigLoad, DirectoryFileAndDamagedJson) {
  TempDir tmp;
  const fs::path dir = tmp / "Meta-Llama-3-8B";
  fs::create_directories(dir);
  write_text(dir / "config.json", kLlama3_8b);
  LlamaConfig c = load_llama_config(dir);
  EXPECT_EQ(c.name, "Meta-Llama-3-8B");
  EXPECT_EQ(c.vocab_size, 128256);
  c = load_llama_config(dir / "config.json");
  EXPECT_EQ(c.name, "Meta-Llama-3-8B");
  c = resolve_model((dir / "").string());  // a trailing slash names the same directory
  EXPECT_EQ(c.name, "Meta-Llama-3-8B");

  // A repeated key is refused (nlohmann would keep the last one silently).
  write_text(dir / "config.json", R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
    "hidden_size": 128})");
  expect_error([&] { load_llama_config(dir); }, {"config.json", "hidden_size", "twice"});
  write_text(dir / "config.json", R"({"architectures": ["LlamaForCausalLM"], "hidden_size": )");
  expect_error([&] { load_llama_config(dir); }, {(dir / "config.json").string(), "JSON"});
  // Missing field: the error names the file it came from.
  json j = minimal();
  j.erase("vocab_size");
  write_text(dir / "config.json", j.dump());
  expect_error([&] { load_llama_config(dir); },
               {(dir / "config.json").string(), "vocab_size", "missing"});

  const fs::path empty = tmp / "empty";
  fs::create_directories(empty);
  expect_error([&] { load_llama_config(empty); }, {empty.string(), "config.json"});
}

// parse_json_strict, which reads config.json, safetensors headers and DeepSpeed configs.
TEST(StrictJson, DuplicatesNestingAndManyKeys) {
  // The same key in two different objects is fine; twice in one object is not.
  EXPECT_EQ(parse_json_strict(R"({"a": {"k": 1}, "b": {"k": 2}})", "x.json")["b"]["k"], 2);
  expect_error([&] { parse_json_strict(R"({"a": {"k": 1, "k": 2}})", "x.json"); },
               {"x.json", "'k' appears twice"});
  // Nesting: 64 levels are read, deeper is refused before a recursive walk can overflow the
  // stack (a value nested 100,000 deep used to crash dump() when an error message quoted it).
  EXPECT_NO_THROW(parse_json_strict(std::string(64, '[') + std::string(64, ']'), "x.json"));
  expect_error(
      [&] { parse_json_strict(std::string(100000, '[') + std::string(100000, ']'), "x.json"); },
      {"x.json", "nested more than 64 levels"});
  expect_error([&] { parse_json_strict(R"({"a": )" + std::string(65, '['), "x.json"); },
               {"x.json", "nested more than 64"});
  // A number past a double's range is nlohmann's out_of_range, not a parse_error: it used to
  // escape as a foreign exception (found by the fuzz targets).
  expect_error([&] { parse_json_strict(R"({"a": 1E7777})", "x.json"); },
               {"x.json", "not valid JSON", "number overflow"});
  // A header with 200,000 tensors: duplicate detection must not be quadratic.
  std::string many = "{";
  for (int i = 0; i < 200000; ++i) many += fmt::format("{}\"t{}\": {}", i ? "," : "", i, i);
  many += "}";
  EXPECT_EQ(parse_json_strict(many, "x.json").size(), 200000u);
}

TEST(LlamaConfigPresets, PublishedParameterCounts) {
  const std::vector<std::string> names = preset_names();
  for (const char* n : {"tiny", "llama2-7b", "llama2-13b", "llama2-70b", "llama3-8b", "llama3-70b",
                        "llama3.1-8b", "llama3.1-70b"})
    EXPECT_NE(std::find(names.begin(), names.end(), n), names.end()) << n;
  for (const std::string& n : names) {
    const auto c = find_preset(n);
    ASSERT_TRUE(c.has_value());
    EXPECT_EQ(c->name, n);
    validate_llama_config(*c, n);  // throws if a preset were malformed
  }
  EXPECT_FALSE(find_preset("llama4").has_value());

  // Counts as published for the Hugging Face checkpoints.
  EXPECT_EQ(parameter_count(*find_preset("llama2-7b")), 6'738'415'616u);
  EXPECT_EQ(parameter_count(*find_preset("llama2-13b")), 13'015'864'320u);
  EXPECT_EQ(parameter_count(*find_preset("llama2-70b")), 68'976'648'192u);
  EXPECT_EQ(parameter_count(*find_preset("llama3-8b")), 8'030'261'248u);
  EXPECT_EQ(parameter_count(*find_preset("llama3-70b")), 70'553'706'496u);
  EXPECT_EQ(parameter_count(*find_preset("llama3.1-8b")), 8'030'261'248u);
  EXPECT_EQ(parameter_count(*find_preset("llama3.1-70b")), 70'553'706'496u);
  EXPECT_EQ(parameter_count(*find_preset("llama3.2-1b")), 1'235'814'400u);
  EXPECT_EQ(parameter_count(*find_preset("llama3.2-3b")), 3'212'749'824u);
  EXPECT_EQ(parameter_count(*find_preset("phi3-mini")), 3'821'079'552u);
  EXPECT_EQ(parameter_count(*find_preset("phi4")), 14'659'507'200u);
  EXPECT_EQ(parameter_count(*find_preset("gemma-2b")), 2'506'172'416u);
  EXPECT_EQ(parameter_count(*find_preset("gemma-7b")), 8'537'680'896u);
  EXPECT_EQ(parameter_count(*find_preset("gemma2-2b")), 2'614'341'888u);
  EXPECT_EQ(parameter_count(*find_preset("gemma2-9b")), 9'241'705'984u);
  EXPECT_EQ(parameter_count(*find_preset("gemma2-27b")), 27'227'128'320u);
  EXPECT_EQ(parameter_count(*find_preset("gemma3-1b")), 999'885'952u);
  EXPECT_EQ(parameter_count(*find_preset("gemma3-270m")), 268'098'176u);
  EXPECT_EQ(parameter_count(*find_preset("smollm3-3b")), 3'075'098'624u);
  EXPECT_EQ(parameter_count(*find_preset("granite-3.1-8b")), 8'170'848'256u);  // 8.17B
  // The image-text Gemma 3s' language models: Keras's published text-only counts, which use a
  // vocabulary of 262144 where Hugging Face's embeddings have 64 more rows.
  EXPECT_EQ(parameter_count(*find_preset("gemma3-4b")), 3'880'099'328u + 64u * 2560u);
  EXPECT_EQ(parameter_count(*find_preset("gemma3-12b")), 11'765'788'416u + 64u * 3840u);
  EXPECT_EQ(parameter_count(*find_preset("gemma3-27b")), 27'009'002'240u + 64u * 5376u);
  // Model FLOPs per token at 4096 positions: 6 per parameter, and attention 6 x 32 layers x 32
  // heads x 128 x 4096 (QKᵀ and PV over half the keys, forward and backward).
  EXPECT_EQ(model_flops_per_token(*find_preset("llama2-7b"), 4096),
            6.0 * 6'738'415'616.0 + 6.0 * 32 * 32 * 128 * 4096);
  // tiny by hand: embeddings and head 512x64 each, per layer two norms, q and o 64x64, k and v
  // 32x64 (2 kv heads of 16), three 172x64 MLP matrices, and the final norm.
  const uint64_t tiny_layer = 2 * 64 + 2 * 64 * 64 + 2 * 32 * 64 + 3 * 172 * 64;
  EXPECT_EQ(parameter_count(*find_preset("tiny")), 2 * 512 * 64 + 2 * tiny_layer + 64);

  const LlamaConfig l3 = *find_preset("llama3-8b");
  EXPECT_EQ(l3.max_position_embeddings, 8192);
  EXPECT_EQ(l3.rope_scaling.kind, RopeScalingKind::none);
  const LlamaConfig l31 = *find_preset("llama3.1-70b");
  EXPECT_EQ(l31.max_position_embeddings, 131072);
  EXPECT_EQ(l31.rope_scaling.kind, RopeScalingKind::llama3);
  EXPECT_EQ(l31.num_key_value_heads, 8);
  const LlamaConfig tiny = *find_preset("tiny");
  EXPECT_EQ(tiny.hidden_size, 64);
  EXPECT_EQ(tiny.num_key_value_heads, 2);
  EXPECT_EQ(tiny.max_position_embeddings, 256);
}

TEST(LlamaConfigPresets, ResolveModel) {
  EXPECT_EQ(resolve_model("llama2-13b").hidden_size, 5120);
  EXPECT_EQ(resolve_model("tiny").name, "tiny");
  const std::string msg = test::error_message([] { resolve_model("/no/such/model-dir"); });
  for (const char* w : {"/no/such/model-dir", "tiny", "llama2-7b", "llama3-8b", "llama3.1-70b"})
    EXPECT_NE(msg.find(w), std::string::npos) << w << " missing from: " << msg;
}

TEST(LlamaConfigJson, RoundTripsThroughHuggingFaceJson) {
  std::vector<LlamaConfig> configs;
  for (const std::string& n : preset_names()) configs.push_back(*find_preset(n));
  LlamaConfig odd = *find_preset("tiny");
  odd.name = "odd";
  odd.head_dim = 24;  // not hidden / heads
  odd.tie_word_embeddings = true;
  odd.rms_norm_eps = 1.25e-6;
  odd.rope_theta = 123456.5;
  odd.torch_dtype = DType::f16;
  odd.rope_scaling = {RopeScalingKind::llama3, 2.5, 0.5, 3.0, 96};
  // Llama 3.1 Instruct's ids, eos a list; original Llama's pad_token_id -1 is carried as given.
  odd.token_ids = {
      {"bos_token_id", 128000}, {"eos_token_id", {128001, 128008, 128009}}, {"pad_token_id", -1}};
  configs.push_back(odd);
  // The other scalings, each optional field given and not.
  for (const RopeScalingKind k :
       {RopeScalingKind::linear, RopeScalingKind::dynamic, RopeScalingKind::yarn}) {
    LlamaConfig scaled = *find_preset("tiny");
    scaled.name = fmt::format("tiny {}", rope_scaling_name(k));
    scaled.rope_scaling.kind = k;
    scaled.rope_scaling.factor = 4.0;
    configs.push_back(scaled);
  }
  LlamaConfig partial = *find_preset("phi4");  // Phi-4-mini's partial rotation and LongRoPE
  partial.name = "phi partial";
  partial.partial_rotary_factor = 0.75;
  partial.max_position_embeddings = 131072;
  partial.rope_scaling.kind = RopeScalingKind::longrope;
  partial.rope_scaling.original_max_position_embeddings = 4096;
  partial.rope_scaling.short_factor.assign(48, 1.25);
  partial.rope_scaling.long_factor.assign(48, 3.5);
  configs.push_back(partial);
  LlamaConfig yarn = *find_preset("qwen3-8b");
  yarn.name = "qwen3 yarn";
  yarn.max_position_embeddings = 131072;
  yarn.rope_scaling = {
      RopeScalingKind::yarn, 4.0, 1.0, 4.0, 32768, 1.5, 16.0, 2.0, 0.7, 0.5, false};
  configs.push_back(yarn);
  LlamaConfig gelu = *find_preset("gemma-2b");  // Gemma with the exact GELU, untied, biased
  gelu.name = "gemma erf";
  gelu.hidden_act = Activation::gelu;
  gelu.tie_word_embeddings = false;
  gelu.qkv_bias = gelu.o_bias = true;
  configs.push_back(gelu);
  LlamaConfig gemma2 = *find_preset("gemma2-27b");  // uncapped, its layers' own pattern
  gemma2.name = "gemma2 uncapped";
  gemma2.attn_logit_softcapping = gemma2.final_logit_softcapping = 0;
  gemma2.sliding_layers.assign(46, false);
  gemma2.sliding_layers[3] = true;
  configs.push_back(gemma2);
  LlamaConfig gemma3 = *find_preset("gemma3-1b");  // caps, global scaling, another pattern
  gemma3.name = "gemma3 capped";
  gemma3.final_logit_softcapping = 30;
  gemma3.rope_scaling.kind = RopeScalingKind::linear;
  gemma3.rope_scaling.factor = 8.0;
  for (int64_t l = 0; l < 26; ++l) gemma3.sliding_layers[static_cast<size_t>(l)] = l % 3 != 1;
  configs.push_back(gemma3);
  LlamaConfig llama_gelu = *find_preset("tiny");
  llama_gelu.name = "llama gelu";
  llama_gelu.hidden_act = Activation::gelu_tanh;
  configs.push_back(llama_gelu);
  LlamaConfig biased = odd;  // Llama's attention_bias and mlp_bias
  biased.name = "biased";
  biased.qkv_bias = biased.o_bias = biased.mlp_bias = true;
  configs.push_back(biased);
  LlamaConfig windowed = *find_preset("mistral-7b");  // Mistral 7B v0.1's window
  windowed.name = "windowed";
  windowed.sliding_window = 4096;
  configs.push_back(windowed);
  LlamaConfig qwen_windowed = *find_preset("qwen2.5-7b");
  qwen_windowed.name = "qwen_windowed";
  qwen_windowed.sliding_window = 2048;
  configs.push_back(qwen_windowed);
  for (const LlamaConfig& c : configs) {
    SCOPED_TRACE(c.name);
    const json j = to_hf_config_json(c);
    EXPECT_EQ(j["architectures"], json::array({architecture_class(c.architecture)}));
    EXPECT_EQ(j["model_type"], architecture_model_type(c.architecture));
    EXPECT_EQ(j["hidden_act"], activation_name(c.hidden_act));
    if (c.architecture == Architecture::gemma) {
      EXPECT_EQ(j["hidden_activation"], j["hidden_act"]);
    }
    for (const auto& [key, ids] : c.token_ids.items()) EXPECT_EQ(j[key], ids) << key;
    if (!c.token_ids.contains("eos_token_id")) {
      EXPECT_FALSE(j.contains("eos_token_id"));
    }
    EXPECT_EQ(j["torch_dtype"], c.torch_dtype == DType::bf16  ? "bfloat16"
                                : c.torch_dtype == DType::f16 ? "float16"
                                                              : "float32");
    // Through text, as a file would go.
    LlamaConfig back = parse_llama_config(json::parse(j.dump(2)), "rt.json");
    back.name = c.name;
    EXPECT_EQ(back, c);
  }
  EXPECT_TRUE(to_hf_config_json(*find_preset("llama3-8b"))["rope_scaling"].is_null());
  EXPECT_EQ(to_hf_config_json(*find_preset("llama3.1-8b"))["rope_scaling"]["rope_type"], "llama3");
  // What was not given is not written.
  LlamaConfig bare = *find_preset("tiny");
  bare.rope_scaling.kind = RopeScalingKind::yarn;
  bare.rope_scaling.factor = 4.0;
  EXPECT_EQ(to_hf_config_json(bare)["rope_scaling"],
            (json{{"rope_type", "yarn"}, {"factor", 4.0}}));
}

// The rotary scalings past llama3's, as transformers 5 derives them. Qwen3's recommended YaRN
// (factor 4 over 32768 positions, here with max_position_embeddings raised to 131072): the
// stretch 4, the cos/sin factor 0.1 ln 4 + 1, and the ramp from
// dimension floor(23.6) = 23 to ceil(39.6) = 40 of 128 (worked out by hand from the YaRN
// paper's formula d(r) = hd ln(L / 2 pi r) / 2 ln theta at r = 32 and 1).
TEST(LlamaConfigParse, RopeScalingsAsTransformersDerivesThem) {
  json j = minimal();
  j["head_dim"] = 128;
  j["rope_theta"] = 1000000.0;
  j["max_position_embeddings"] = 131072;
  j["rope_scaling"] = {
      {"rope_type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 32768}};
  LlamaConfig c = parse_llama_config(j, "q.json");
  EXPECT_EQ(c.rope_scaling.kind, RopeScalingKind::yarn);
  EXPECT_FALSE(c.rope_scaling.attention_factor || c.rope_scaling.truncate);
  YarnParameters y = yarn_parameters(c);
  EXPECT_DOUBLE_EQ(y.factor, 4.0);
  EXPECT_NEAR(y.attention_factor, 1.0 + 0.1 * std::log(4.0), 1e-15);
  EXPECT_EQ(y.low, 23.0);
  EXPECT_EQ(y.high, 40.0);
  // The same context untruncated: the ends where the formula puts them.
  j["rope_scaling"]["truncate"] = false;
  y = yarn_parameters(parse_llama_config(j, "q.json"));
  const double two_ln_theta = 2.0 * std::log(1e6);
  EXPECT_NEAR(y.low, 128.0 * std::log(32768.0 / (32 * 2 * std::numbers::pi)) / two_ln_theta, 1e-12);
  EXPECT_NEAR(y.high, 128.0 * std::log(32768.0 / (2 * std::numbers::pi)) / two_ln_theta, 1e-12);
  // Qwen's snippet as its model cards give it, max_position_embeddings left at the original
  // 32768: the stated factor stands, as in transformers 5 (4.5x took the lengths' ratio, 1, and
  // so the plain table), and the ramp is the same, counted over the original context.
  j["max_position_embeddings"] = 32768;
  j["rope_scaling"].erase("truncate");
  c = parse_llama_config(j, "q.json");
  y = yarn_parameters(c);
  EXPECT_EQ(y.factor, 4.0);
  EXPECT_NEAR(y.attention_factor, 1.0 + 0.1 * std::log(4.0), 1e-15);
  EXPECT_EQ(y.low, 23.0);
  EXPECT_EQ(y.high, 40.0);
  LlamaConfig plain = c;
  plain.rope_scaling = {};
  EXPECT_NE(rope_table(c, 300), rope_table(plain, 300));
  // Without an original context the factor stands; mscale over mscale_all_dim sets the scale;
  // an attention_factor overrides both; cos and sin are scaled by it.
  j.erase("rope_scaling");
  j["max_position_embeddings"] = 4096;
  j["rope_scaling"] = {
      {"rope_type", "yarn"}, {"factor", 8.0}, {"mscale", 1.0}, {"mscale_all_dim", 0.5}};
  c = parse_llama_config(j, "q.json");
  y = yarn_parameters(c);
  EXPECT_EQ(y.factor, 8.0);
  EXPECT_NEAR(y.attention_factor, (1 + 0.1 * std::log(8.0)) / (1 + 0.05 * std::log(8.0)), 1e-15);
  j["rope_scaling"]["attention_factor"] = 0.75;
  c = parse_llama_config(j, "q.json");
  EXPECT_EQ(yarn_parameters(c).attention_factor, 0.75);
  const std::vector<float> t = rope_table(c, 2);
  EXPECT_FLOAT_EQ(t[0], 0.75f);  // position 0: cos 1, sin 0, each times the factor
  EXPECT_EQ(t[64], 0.0f);
  // Below the ramp's start (dimension 13 here) the frequency is the plain one; past its end
  // (31) it is divided by the factor; linear divides every one; dynamic none. Position 1's
  // angle is the frequency itself (under pi / 2), read back through its sine.
  plain = c;
  plain.rope_scaling = {};
  const std::vector<float> p = rope_table(plain, 2);
  y = yarn_parameters(c);
  EXPECT_EQ(y.low, 13.0);
  EXPECT_EQ(y.high, 31.0);
  auto angle = [](const std::vector<float>& table, int i, float scale = 1.0f) {
    return std::asin(static_cast<double>(table[128 + 64 + i] / scale));
  };
  for (int i : {0, 5, 12}) EXPECT_NEAR(angle(t, i, 0.75f), angle(p, i), 1e-6 * angle(p, i)) << i;
  for (int i : {32, 50, 63})
    EXPECT_NEAR(angle(t, i, 0.75f), angle(p, i) / 8.0, 1e-5 * angle(p, i)) << i;
  const double mid = angle(t, 20, 0.75f);  // inside the ramp: between the two
  EXPECT_LT(mid, angle(p, 20));
  EXPECT_GT(mid, angle(p, 20) / 8.0);
  LlamaConfig linear = plain;
  linear.rope_scaling.kind = RopeScalingKind::linear;
  linear.rope_scaling.factor = 2.0;
  const std::vector<float> l = rope_table(linear, 2);
  for (int i = 0; i < 64; ++i) EXPECT_NEAR(angle(l, i), angle(p, i) / 2.0, 1e-6 * angle(p, i)) << i;
  LlamaConfig dynamic = plain;
  dynamic.rope_scaling.kind = RopeScalingKind::dynamic;
  dynamic.rope_scaling.factor = 2.0;
  EXPECT_EQ(rope_table(dynamic, 4096), rope_table(plain, 4096));

  // LongRoPE as Phi-3.5-mini's config.json writes it: "type" longrope, the factors inside
  // rope_scaling, the original context at the top level. 131072 / 4096 = 32 sets the scale
  // sqrt(1 + ln 32 / ln 4096) = sqrt(1 + 5/12); sequences up to 4096 take the short factors.
  j = minimal();
  j["architectures"] = {"Phi3ForCausalLM"};
  j["head_dim"] = 8;
  j["max_position_embeddings"] = 131072;
  j["original_max_position_embeddings"] = 4096;
  j["rope_scaling"] = {{"type", "longrope"},
                       {"long_factor", {1.0, 2.0, 8.0, 40.0}},
                       {"short_factor", {1.0, 1.5, 2.0, 3.0}}};
  c = parse_llama_config(j, "phi.json");
  EXPECT_EQ(c.rope_scaling.kind, RopeScalingKind::longrope);
  EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 4096);
  LongRopeParameters lp = longrope_parameters(c, 4096);
  EXPECT_FALSE(lp.long_factors);
  EXPECT_NEAR(lp.attention_factor, std::sqrt(1.0 + 5.0 / 12.0), 1e-15);
  EXPECT_TRUE(longrope_parameters(c, 4097).long_factors);
  plain = c;
  plain.rope_scaling = {};
  const std::vector<float> sp = rope_table(plain, 2), ss = rope_table(c, 2);
  const float sc = static_cast<float>(lp.attention_factor);
  const double shorts[] = {1.0, 1.5, 2.0, 3.0};
  for (int i = 0; i < 4; ++i)  // position 1: the angle is the frequency
    EXPECT_NEAR(std::asin(static_cast<double>(ss[8 + 4 + i] / sc)),
                std::asin(static_cast<double>(sp[8 + 4 + i])) / shorts[i], 1e-6)
        << i;
  // Its export puts the original context back at the top level, and reads back the same.
  json out = to_hf_config_json(c);
  EXPECT_EQ(out["original_max_position_embeddings"], 4096);
  EXPECT_EQ(out["rope_scaling"]["rope_type"], "longrope");
  LlamaConfig back = parse_llama_config(json::parse(out.dump()), "phi.json");
  EXPECT_EQ(back, c);
  // No factor is written where none was read: transformers 5 would take a written one (say 1)
  // as the stretch instead of the lengths' 32. A given factor stands there, and here.
  EXPECT_FALSE(out["rope_scaling"].contains("factor"));
  json given = j;
  given["rope_scaling"]["factor"] = 16.0;
  const LlamaConfig g16 = parse_llama_config(given, "phi.json");
  EXPECT_NEAR(longrope_parameters(g16, 4096).attention_factor,
              std::sqrt(1.0 + std::log(16.0) / std::log(4096.0)), 1e-15);
  EXPECT_EQ(to_hf_config_json(g16)["rope_scaling"]["factor"], 16.0);
  // "su", Phi-3's first name for it; factors of another count, or two original contexts that
  // disagree, are named.
  j["rope_scaling"]["type"] = "su";
  EXPECT_EQ(parse_llama_config(j, "phi.json").rope_scaling.kind, RopeScalingKind::longrope);
  j["rope_scaling"]["short_factor"] = {1.0, 1.5, 2.0};
  expect_error([&] { parse_llama_config(j, "phi.json"); },
               {"rope_scaling.short_factor", "3 entries", "rotated pair of dimensions: 4",
                "head_dim 8 x partial_rotary_factor 1"});
  j["rope_scaling"]["short_factor"] = {1.0, 1.5, 2.0, 0.0};
  expect_error([&] { parse_llama_config(j, "phi.json"); }, {"short_factor", "holds 0"});
  j["rope_scaling"]["short_factor"] = {1.0, 1.5, 2.0, 3.0};
  j["rope_scaling"]["original_max_position_embeddings"] = 8192;
  expect_error([&] { parse_llama_config(j, "phi.json"); },
               {"original_max_position_embeddings is 4096", "8192"});
  j["rope_scaling"].erase("original_max_position_embeddings");
  j["rope_scaling"].erase("long_factor");
  expect_error([&] { parse_llama_config(j, "phi.json"); }, {"rope_scaling.long_factor"});
}

TEST(LlamaConfigJson, HuggingFaceTensorNamesAndShapes) {
  LlamaConfig c = *find_preset("tiny");
  c.head_dim = 24;
  const std::vector<HfTensor> t = llama_hf_tensors(c);
  ASSERT_EQ(t.size(), 1 + 9 * 2 + 1 + 1u);
  EXPECT_EQ(t[0].name, "model.embed_tokens.weight");
  EXPECT_EQ(t[0].shape, (std::vector<int64_t>{512, 64}));
  const std::vector<std::pair<std::string, std::vector<int64_t>>> layer1 = {
      {"model.layers.1.input_layernorm.weight", {64}},
      {"model.layers.1.self_attn.q_proj.weight", {96, 64}},
      {"model.layers.1.self_attn.k_proj.weight", {48, 64}},
      {"model.layers.1.self_attn.v_proj.weight", {48, 64}},
      {"model.layers.1.self_attn.o_proj.weight", {64, 96}},
      {"model.layers.1.post_attention_layernorm.weight", {64}},
      {"model.layers.1.mlp.gate_proj.weight", {172, 64}},
      {"model.layers.1.mlp.up_proj.weight", {172, 64}},
      {"model.layers.1.mlp.down_proj.weight", {64, 172}},
  };
  for (size_t i = 0; i < layer1.size(); ++i) {
    EXPECT_EQ(t[10 + i].name, layer1[i].first);
    EXPECT_EQ(t[10 + i].shape, layer1[i].second) << layer1[i].first;
  }
  EXPECT_EQ(t[19].name, "model.norm.weight");
  EXPECT_EQ(t[20].name, "lm_head.weight");
  EXPECT_EQ(t[20].shape, (std::vector<int64_t>{512, 64}));
  c.tie_word_embeddings = true;
  EXPECT_EQ(llama_hf_tensors(c).back().name, "model.norm.weight");
  EXPECT_EQ(parameter_count(c), parameter_count(*find_preset("tiny")) - 512 * 64 +
                                    2 * (2 * 64 * 32 + 2 * 64 * 16));  // larger q/k/v/o
}

// ---------------------------------------------------------------- safetensors

// Values that need rounding in bf16 and f16, with a sign change and a few magnitudes.
std::vector<float> pattern(size_t n, float seed) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i)
    v[i] = std::sin(static_cast<float>(i) * 0.731f + seed) * (1.0f + static_cast<float>(i % 7));
  return v;
}
std::vector<uint16_t> to_16(const std::vector<float>& v, DType t) {
  std::vector<uint16_t> out(v.size());
  convert(out.data(), t, v.data(), DType::f32, v.size());
  return out;
}

std::vector<char> read_tensor(const SafetensorsReader& r, const std::string& name, DType t) {
  const SafetensorsEntry* e = r.find(name);
  if (e == nullptr) {
    ADD_FAILURE() << "no tensor " << name;
    return {};
  }
  std::vector<char> out(static_cast<size_t>(e->numel()) * dtype_size(t));
  r.read(name, out.data(), t);
  return out;
}

template <typename T>
bool same_bytes(const std::vector<char>& got, const std::vector<T>& want) {
  return got.size() == want.size() * sizeof(T) &&
         (got.empty() || std::memcmp(got.data(), want.data(), got.size()) == 0);
}

TEST(Safetensors, RoundTripEveryDtypeWithConversion) {
  TempDir tmp;
  const std::vector<float> a = pattern(15, 0.1f);
  const std::vector<uint16_t> b = to_16(pattern(7, 0.2f), DType::bf16);
  const std::vector<uint16_t> h = to_16(pattern(12, 0.3f), DType::f16);
  const float scalar = 3.25f;
  const std::vector<SafetensorsTensor> tensors = {
      {"z.f16", DType::f16, {2, 2, 3}, h.data()}, {"a.f32", DType::f32, {3, 5}, a.data()},
      {"m.bf16", DType::bf16, {7}, b.data()},     {"scalar", DType::f32, {}, &scalar},
      {"empty", DType::bf16, {0, 4}, nullptr},
  };
  const fs::path path = tmp / "t.safetensors";
  write_safetensors(path, tensors, {{"format", "pt"}, {"note", "strata test"}});
  EXPECT_FALSE(fs::exists(tmp / "t.safetensors.tmp"));

  // The bytes as the format lays them out: an 8-byte length, the JSON header padded with
  // spaces to a multiple of 8, then every tensor back to back from offset 0, 4-byte dtypes
  // first (each tensor aligned to its element size), names in order within a dtype size.
  const std::string bytes = read_bytes(path);
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  EXPECT_EQ(n % 8, 0u);
  const std::string header_text = bytes.substr(8, n);
  const size_t close = header_text.find_last_of('}');
  EXPECT_LT(n - (close + 1), 8u);
  EXPECT_EQ(header_text.find_first_not_of(' ', close + 1), std::string::npos) << header_text;
  const json header = json::parse(header_text);
  EXPECT_EQ(header["__metadata__"], (json{{"format", "pt"}, {"note", "strata test"}}));
  const std::vector<std::pair<std::string, std::pair<uint64_t, uint64_t>>> layout = {
      {"a.f32", {0, 60}},   {"scalar", {60, 64}}, {"empty", {64, 64}},
      {"m.bf16", {64, 78}}, {"z.f16", {78, 102}},
  };
  for (const auto& [name, range] : layout) {
    EXPECT_EQ(header[name]["data_offsets"], json::array({range.first, range.second})) << name;
  }
  EXPECT_EQ(header["z.f16"]["dtype"], "F16");
  EXPECT_EQ(header["m.bf16"]["dtype"], "BF16");
  EXPECT_EQ(header["a.f32"]["shape"], json::array({3, 5}));
  EXPECT_EQ(header["scalar"]["shape"], json::array());
  EXPECT_EQ(bytes.size(), 8 + n + 102);
  EXPECT_EQ(std::memcmp(bytes.data() + 8 + n, a.data(), 60), 0);

  const SafetensorsReader r = SafetensorsReader::open(path);
  EXPECT_EQ(r.source(), path.string());
  EXPECT_EQ(r.names(), (std::vector<std::string>{"a.f32", "empty", "m.bf16", "scalar", "z.f16"}));
  EXPECT_EQ(r.metadata().at("note"), "strata test");
  const SafetensorsEntry* e = r.find("a.f32");
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->dtype, DType::f32);
  EXPECT_EQ(e->shape, (std::vector<int64_t>{3, 5}));
  EXPECT_EQ(e->file, path.string());
  EXPECT_EQ(e->bytes, 60u);
  EXPECT_EQ(r.find("z.f16")->dtype, DType::f16);
  EXPECT_EQ(r.find("scalar")->numel(), 1);
  EXPECT_EQ(r.find("empty")->numel(), 0);
  EXPECT_EQ(r.find("nope"), nullptr);

  // Same dtype: the bytes written. Another dtype: the exact conversion.
  EXPECT_TRUE(same_bytes(read_tensor(r, "a.f32", DType::f32), a));
  EXPECT_TRUE(same_bytes(read_tensor(r, "m.bf16", DType::bf16), b));
  EXPECT_TRUE(same_bytes(read_tensor(r, "z.f16", DType::f16), h));
  EXPECT_TRUE(same_bytes(read_tensor(r, "a.f32", DType::bf16), to_16(a, DType::bf16)));
  EXPECT_TRUE(same_bytes(read_tensor(r, "a.f32", DType::f16), to_16(a, DType::f16)));
  std::vector<float> b32(b.size()), h32(h.size());
  for (size_t i = 0; i < b.size(); ++i) b32[i] = bf16_to_f32(b[i]);
  for (size_t i = 0; i < h.size(); ++i) h32[i] = f16_to_f32(h[i]);
  EXPECT_TRUE(same_bytes(read_tensor(r, "m.bf16", DType::f32), b32));
  EXPECT_TRUE(same_bytes(read_tensor(r, "z.f16", DType::f32), h32));
  EXPECT_TRUE(same_bytes(read_tensor(r, "z.f16", DType::bf16), to_16(h32, DType::bf16)));
  EXPECT_TRUE(same_bytes(read_tensor(r, "m.bf16", DType::f16), to_16(b32, DType::f16)));
  EXPECT_TRUE(same_bytes(read_tensor(r, "scalar", DType::f32), std::vector<float>{3.25f}));
  EXPECT_TRUE(read_tensor(r, "empty", DType::f32).empty());

  // The same tensors in another order give the same bytes.
  const std::vector<SafetensorsTensor> shuffled = {tensors[4], tensors[2], tensors[0], tensors[3],
                                                   tensors[1]};
  write_safetensors(tmp / "u.safetensors", shuffled, {{"note", "strata test"}, {"format", "pt"}});
  EXPECT_EQ(read_bytes(tmp / "u.safetensors"), bytes);

  // No metadata: no __metadata__ entry at all.
  write_safetensors(tmp / "v.safetensors", tensors);
  EXPECT_TRUE(SafetensorsReader::open(tmp / "v.safetensors").metadata().empty());
}

TEST(Safetensors, ReadCheckedAndMissingTensorsNameEverything) {
  TempDir tmp;
  const std::vector<float> a = pattern(15, 0.4f);
  write_safetensors(tmp / "model.safetensors",
                    std::vector<SafetensorsTensor>{{"w", DType::f32, {3, 5}, a.data()}});
  const SafetensorsReader r = SafetensorsReader::open(tmp.path);  // the directory
  std::vector<float> out(15);
  const std::vector<int64_t> right = {3, 5}, wrong = {5, 3};
  r.read_checked("w", out.data(), DType::f32, right);
  EXPECT_EQ(out, a);
  expect_error([&] { r.read_checked("w", out.data(), DType::f32, wrong); },
               {(tmp / "model.safetensors").string(), "'w'", "[3, 5]", "[5, 3]"});
  expect_error([&] { r.read("v", out.data(), DType::f32); }, {tmp.path.string(), "'v'"});
  expect_error([&] { r.read_checked("v", out.data(), DType::f32, right); }, {"'v'"});
}

// select(): the tensors given a name are read under it, the rest are gone; two given one name are
// refused naming both files.
TEST(Safetensors, SelectRenamesAndDropsTensors) {
  TempDir tmp;
  const std::vector<float> a = pattern(6, 0.4f), b = pattern(6, 1.5f);
  write_safetensors(tmp / "model.safetensors",
                    std::vector<SafetensorsTensor>{{"outer.x", DType::f32, {6}, a.data()},
                                                   {"outer.y", DType::f32, {2, 3}, b.data()},
                                                   {"other.z", DType::f32, {6}, b.data()}});
  SafetensorsReader r = SafetensorsReader::open(tmp.path);
  r.select([](const std::string& name) -> std::optional<std::string> {
    if (name.starts_with("outer.")) return "inner." + name.substr(6);
    return std::nullopt;
  });
  EXPECT_EQ(r.names(), (std::vector<std::string>{"inner.x", "inner.y"}));
  std::vector<float> out(6);
  r.read("inner.y", out.data(), DType::f32);
  EXPECT_EQ(out, b);
  EXPECT_EQ(r.find("other.z"), nullptr);
  EXPECT_EQ(r.find("outer.x"), nullptr);
  expect_error(
      [&] { r.select([](const std::string&) -> std::optional<std::string> { return "same"; }); },
      {"'same' appears twice"});
}

// Resident kB of this process's mappings of `path`, from /proc/self/smaps.
int64_t mapped_rss_kb(const std::string& path) {
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  bool ours = false;
  int64_t kb = 0;
  while (std::getline(smaps, line)) {
    // A mapping's first line starts "start-end perms ...": hex digits and a dash before a space.
    const size_t space = line.find(' ');
    const bool range = space != std::string::npos && line.find('-') < space &&
                       line.find_first_not_of("0123456789abcdef-") == space;
    if (range) {
      ours = line.ends_with(" " + path);
      continue;
    }
    if (ours && line.starts_with("Rss:")) kb += std::stoll(line.substr(4));
  }
  return kb;
}

TEST(Safetensors, LargeTensorStreamsInChunks) {
  // 12 MB of f32: more than one read chunk, and an odd element count.
  TempDir tmp;
  const std::vector<float> big = pattern(3'000'001, 0.5f);
  write_safetensors(tmp / "big.safetensors",
                    std::vector<SafetensorsTensor>{{"big", DType::f32, {3'000'001}, big.data()}});
  const SafetensorsReader r = SafetensorsReader::open(tmp / "big.safetensors");
  EXPECT_TRUE(same_bytes(read_tensor(r, "big", DType::bf16), to_16(big, DType::bf16)));
  // The pages read were dropped from our mapping: well under the 12 MB the read touched.
  EXPECT_LT(mapped_rss_kb((tmp / "big.safetensors").string()), 1024);
  // Read twice: the pages released after the first read fault back in.
  EXPECT_TRUE(same_bytes(read_tensor(r, "big", DType::f32), big));
  // Stored bytes copied out as they are (an image-text model's vision tower into a checkpoint)
  // fault pages in; release_pages drops them.
  const SafetensorsEntry& e = *r.find("big");
  std::vector<char> copy(e.bytes);
  std::memcpy(copy.data(), r.stored_bytes(e), e.bytes);
  EXPECT_EQ(std::memcmp(copy.data(), big.data(), e.bytes), 0);
  EXPECT_GT(mapped_rss_kb((tmp / "big.safetensors").string()), 8 * 1024);
  r.release_pages();
  EXPECT_LT(mapped_rss_kb((tmp / "big.safetensors").string()), 1024);
  // Large reads go past the mapping (pread): rows from the middle, in both dtypes.
  std::vector<float> rows(2'500'000);
  r.read_rows("big", 1000, 2'500'000, rows.data(), DType::f32);
  EXPECT_EQ(std::memcmp(rows.data(), big.data() + 1000, rows.size() * 4), 0);
  std::vector<uint16_t> rows16(2'500'000);
  r.read_rows("big", 499'999, 2'500'000, rows16.data(), DType::bf16);
  const std::vector<uint16_t> want16 = to_16(big, DType::bf16);
  EXPECT_TRUE(std::equal(rows16.begin(), rows16.end(), want16.begin() + 499'999));
  // A file cut short under an open reader is an error naming it, never garbage.
  fs::resize_file(tmp / "big.safetensors", fs::file_size(tmp / "big.safetensors") - 4096);
  std::vector<float> cut(big.size());
  expect_error([&] { r.read("big", cut.data(), DType::f32); },
               {(tmp / "big.safetensors").string(), "truncated or replaced"});
}

// A file made by hand: the length, the header text exactly as given, then the data.
void write_raw(const fs::path& path, const std::string& header, const std::string& data,
               uint64_t length_override = 0) {
  const uint64_t n = length_override ? length_override : header.size();
  std::string bytes(8, '\0');
  std::memcpy(bytes.data(), &n, 8);
  write_text(path, bytes + header + data);
}

TEST(Safetensors, UnalignedDataIsReadCorrectly) {
  // A legal header of 61 bytes leaves the data at an odd offset.
  TempDir tmp;
  const std::vector<float> v = {1.5f, -2.25f, 3.0f};
  std::string header = R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,12]}})";
  header.append(61 - header.size(), ' ');
  write_raw(tmp / "odd.safetensors", header,
            std::string(reinterpret_cast<const char*>(v.data()), 12));
  const SafetensorsReader r = SafetensorsReader::open(tmp / "odd.safetensors");
  EXPECT_TRUE(same_bytes(read_tensor(r, "w", DType::f32), v));
  EXPECT_TRUE(same_bytes(read_tensor(r, "w", DType::f16), to_16(v, DType::f16)));
}

TEST(Safetensors, DamagedFilesNameTheFileAndTensor) {
  TempDir tmp;
  const std::string data16(16, '\x01');
  struct Case {
    const char* what;
    std::string header, data;
    uint64_t length_override;
    std::vector<std::string> words;
  };
  const std::vector<Case> cases = {
      {"header length huge", "{}", "", uint64_t{1} << 40, {"header length 1099511627776", "limit"}},
      {"header past the end", R"({"w":{}})", "", 4096, {"header length 4096", "truncated"}},
      {"bad JSON", R"({"w": {"dtype": "F32", )", "", 0, {"JSON"}},
      {"not an object", R"(["w"])", "", 0, {"'{'"}},
      {"offsets out of range",
       R"({"w":{"dtype":"F32","shape":[100],"data_offsets":[0,400]}})",
       data16,
       0,
       {"'w'", "[0, 400]", "16 bytes"}},
      {"begin after end",
       R"({"w":{"dtype":"F32","shape":[0],"data_offsets":[8,4]}})",
       data16,
       0,
       {"'w'", "[8, 4]"}},
      {"overlapping",
       R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
       data16,
       0,
       {"'a'", "'b'", "overlap"}},
      {"wrong size for shape",
       R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,12]}})",
       data16,
       0,
       {"'w'", "[4]", "needs 16"}},
      {"unknown dtype",
       R"({"w":{"dtype":"I64","shape":[2],"data_offsets":[0,16]}})",
       data16,
       0,
       {"'w'", "I64", "F32, BF16 and F16"}},
      {"F64",
       R"({"w":{"dtype":"F64","shape":[2],"data_offsets":[0,16]}})",
       data16,
       0,
       {"'w'", "F64"}},
      {"duplicate names",
       R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"w":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})",
       data16,
       0,
       {"'w'", "twice"}},
      {"negative dim",
       R"({"w":{"dtype":"F32","shape":[-4],"data_offsets":[0,16]}})",
       data16,
       0,
       {"'w'", "-4"}},
      {"dim not an integer",
       R"({"w":{"dtype":"F32","shape":[2.5],"data_offsets":[0,16]}})",
       data16,
       0,
       {"'w'", "2.5"}},
      {"no dtype", R"({"w":{"shape":[4],"data_offsets":[0,16]}})", data16, 0, {"'w'", "dtype"}},
      {"unknown key",
       R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16],"x":1}})",
       data16,
       0,
       {"'w'", "'x'"}},
      {"offsets not two",
       R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0]}})",
       data16,
       0,
       {"'w'", "data_offsets"}},
      {"metadata not strings", R"({"__metadata__":{"step":3}})", "", 0, {"__metadata__", "step"}},
      {"entry not an object", R"({"w":[1,2]})", "", 0, {"'w'", "array"}},
      {"shape overflow",
       R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,16]}})",
       data16,
       0,
       {"'w'", "too large"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const fs::path path = tmp / "bad.safetensors";
    write_raw(path, c.header, c.data, c.length_override);
    const std::string msg = test::error_message([&] { SafetensorsReader::open(path); });
    EXPECT_NE(msg.find(path.string()), std::string::npos) << msg;
    for (const std::string& w : c.words)
      EXPECT_NE(msg.find(w), std::string::npos) << "'" << w << "' missing from: " << msg;
  }
  // Shorter than the length itself.
  write_text(tmp / "short.safetensors", "abcde");
  expect_error([&] { SafetensorsReader::open(tmp / "short.safetensors"); },
               {(tmp / "short.safetensors").string(), "truncated", "5 bytes"});
  expect_error([&] { SafetensorsReader::open(tmp / "absent.safetensors"); },
               {(tmp / "absent.safetensors").string(), "cannot open"});
  // A directory without safetensors says what it found.
  const fs::path dir = tmp / "ckpt";
  fs::create_directories(dir);
  write_text(dir / "pytorch_model.bin", "x");
  expect_error([&] { SafetensorsReader::open(dir); },
               {dir.string(), "model.safetensors", "pytorch_model.bin"});
}

// A tensor given by a source is asked for once, when the writer reaches it, and its pointer is
// used before the next source is called: the checkpoint streams a model bigger than RAM
// through one buffer this way. Here every source fills the same scratch buffer, so a writer
// that asked ahead or kept a stale pointer would write the wrong bytes.
TEST(Safetensors, SourcesAreAskedInFileOrderAndStreamThroughOneBuffer) {
  TempDir tmp;
  std::vector<float> scratch;
  std::vector<std::string> asked;
  auto tensor_values = [](int t, int n) {
    std::vector<float> v(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) v[static_cast<size_t>(i)] = static_cast<float>(t * 1000 + i);
    return v;
  };
  std::vector<SafetensorsTensor> tensors;
  const std::vector<std::pair<std::string, int>> given = {{"c", 5}, {"a", 3}, {"b", 8}, {"d", 1}};
  for (int t = 0; t < static_cast<int>(given.size()); ++t) {
    // Not a structured binding: clang 14 cannot capture one.
    const std::string name = given[static_cast<size_t>(t)].first;
    const int n = given[static_cast<size_t>(t)].second;
    tensors.push_back({name, DType::f32, {n}, nullptr, [&, t, name, n]() -> const void* {
                         asked.push_back(name);
                         scratch = tensor_values(t, n);
                         return scratch.data();
                       }});
  }
  const std::vector<float> held = {7.5f, -1.0f};
  tensors.push_back({"0.held", DType::f32, {2}, held.data()});  // data and sources mix
  const fs::path path = tmp / "s.safetensors";
  const FileDigest d = write_safetensors(path, tensors);
  EXPECT_EQ(asked, (std::vector<std::string>{"a", "b", "c", "d"}));  // file order, once each
  const SafetensorsReader r = SafetensorsReader::open(path);
  for (int t = 0; t < static_cast<int>(given.size()); ++t) {
    const auto& [name, n] = given[static_cast<size_t>(t)];
    std::vector<float> got(static_cast<size_t>(n));
    const std::vector<int64_t> shape{n};
    r.read_checked(name, got.data(), DType::f32, shape);
    EXPECT_EQ(got, tensor_values(t, n)) << name;
    EXPECT_EQ(d.tensors.at(name), xxh3_64(got.data(), got.size() * 4)) << name;
  }
  std::vector<float> got(2);
  const std::vector<int64_t> two{2};
  r.read_checked("0.held", got.data(), DType::f32, two);
  EXPECT_EQ(got, held);

  // A source that gives nothing is the caller's bug, named; no file is left.
  const std::vector<SafetensorsTensor> broken = {
      {"w", DType::f32, {2}, nullptr, []() -> const void* { return nullptr; }}};
  expect_error([&] { write_safetensors(tmp / "b.safetensors", broken); }, {"'w'", "gave no data"});
  EXPECT_FALSE(fs::exists(tmp / "b.safetensors"));
  EXPECT_FALSE(fs::exists(tmp / "b.safetensors.tmp"));
}

// Whether `dir`'s filesystem takes O_DIRECT (tmpfs does not).
bool takes_o_direct(const fs::path& dir) {
  const fs::path probe = dir / "o-direct-probe";
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_DIRECT | O_CLOEXEC, 0644);
  if (fd >= 0) ::close(fd);
  std::error_code ec;
  fs::remove(probe, ec);
  return fd >= 0;
}

// Bytes that differ at every offset that matters (a chunk's seams, its pages).
std::string pattern_bytes(uint64_t n, uint32_t seed) {
  std::string s(n, '\0');
  uint32_t x = seed;
  for (uint64_t i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    s[i] = static_cast<char>(x >> 24);
  }
  return s;
}

// AtomicFile's staging: a file past one chunk goes to the disk with O_DIRECT where the
// filesystem takes it (and through the page cache where it does not: /dev/shm), written in
// pieces of every awkward size across the chunks' seams, with an odd tail; write_at patches
// bytes already on the disk and bytes still staged. Every byte arrives, the digest is the
// file's, and a file smaller than a chunk never sets up a ring.
TEST(AtomicFile, LargeFilesGoDirectAndEveryByteArrives) {
  TempDir tmp;
  std::vector<fs::path> dirs = {tmp.path};
  if (fs::is_directory("/dev/shm")) {
    dirs.push_back(fs::path("/dev/shm") / fmt::format("strata-atomic-{}", ::getpid()));
    fs::create_directories(dirs.back());
  }
  const uint64_t chunk = AtomicFile::kStagingChunk;
  const uint64_t n = 3 * chunk + chunk / 2 + 12345;  // several chunks in flight, an odd tail
  for (const fs::path& dir : dirs) {
    SCOPED_TRACE(dir.string());
    const bool direct = takes_o_direct(dir);
    std::string want = pattern_bytes(n, 7);
    const fs::path path = dir / "big.bin";
    {
      AtomicFile f(path);
      const std::vector<uint64_t> sizes = {1, 4095, chunk - 4096, 3, chunk + 7, 1 << 20, 8191};
      uint64_t at = 0;
      for (size_t i = 0; at < n; ++i) {
        const uint64_t k = std::min(sizes[i % sizes.size()], n - at);
        f.write(want.data() + at, k);
        at += k;
      }
      EXPECT_EQ(f.direct(), direct);
      EXPECT_EQ(f.size(), n);
      EXPECT_FALSE(fs::exists(path));    // not before commit
      f.write_at(5, "HEAD", 4);          // long since on the disk
      f.write_at(chunk - 2, "SEAM", 4);  // across the first chunks' seam
      f.write_at(n - 10, "TAIL", 4);     // still staged
      f.commit();
    }
    want.replace(5, 4, "HEAD");
    want.replace(chunk - 2, 4, "SEAM");
    want.replace(n - 10, 4, "TAIL");
    EXPECT_TRUE(read_bytes(path) == want) << "the file's bytes differ from those written";
    EXPECT_FALSE(fs::exists(dir / "big.bin.tmp"));

    const std::string again = pattern_bytes(n, 11);
    AtomicFile g(dir / "digest.bin");
    g.write(again.data(), again.size());
    const FileDigest d = g.digest();
    g.commit();
    EXPECT_EQ(d.bytes, n);
    EXPECT_EQ(d.xxh3, xxh3_64(again.data(), again.size()));
    EXPECT_TRUE(read_bytes(dir / "digest.bin") == again);

    AtomicFile small(dir / "small.txt");
    small.write("hello", 5);
    small.commit();
    EXPECT_FALSE(small.direct());
    EXPECT_EQ(read_bytes(dir / "small.txt"), "hello");
  }
  if (dirs.size() > 1) {
    std::error_code ec;
    fs::remove_all(dirs.back(), ec);
  }
}

// A file reserved past its filesystem's free space is refused before a byte is written, naming
// the file, the bytes it needs and those free; nothing is left behind.
TEST(AtomicFile, AFileThatCannotFitIsRefusedBeforeItIsWritten) {
  TempDir tmp;
  struct statvfs vfs {};
  ASSERT_EQ(::statvfs(tmp.path.c_str(), &vfs), 0);
  const uint64_t free_bytes = uint64_t{vfs.f_bavail} * vfs.f_frsize;
  const uint64_t need = free_bytes + (uint64_t{1} << 40);  // within ext4's and tmpfs's largest file
  {
    AtomicFile f(tmp / "huge.bin");
    expect_error([&] { f.reserve(need); },
                 {(tmp / "huge.bin.tmp").string(), "it needs " + format_bytes(need), "free;",
                  "free space there"});
  }
  EXPECT_FALSE(fs::exists(tmp / "huge.bin"));
  EXPECT_FALSE(fs::exists(tmp / "huge.bin.tmp"));
  AtomicFile g(tmp / "fits.bin");  // what fits is reserved and written as ever
  g.reserve(1 << 20);
  const std::string bytes = pattern_bytes(1 << 20, 5);
  g.write(bytes.data(), bytes.size());
  g.commit();
  EXPECT_TRUE(read_bytes(tmp / "fits.bin") == bytes);
}

// Faults in an AtomicFile's ring (injected at its N-th chunk): a full filesystem and an I/O
// error each fail the write naming the file, the error and what to do, and leave neither the
// file nor its temporary; a short write is resumed and the file is whole.
TEST(AtomicFile, FaultsInItsWritesAreNamedAndLeaveNoFile) {
  TempDir tmp;
  if (!takes_o_direct(tmp.path))
    GTEST_SKIP() << tmp.path << " refuses O_DIRECT, so large files there are written through "
                 << "the page cache and no ring's faults can be injected";
  struct Reset {
    ~Reset() { atomic_file_faults_for_testing({}); }
  } reset;
  const uint64_t n = 5 * AtomicFile::kStagingChunk + 333;
  const std::string bytes = pattern_bytes(n, 3);
  auto write_all = [&](const fs::path& path) {
    AtomicFile f(path);
    for (uint64_t at = 0; at < n; at += 1 << 20)
      f.write(bytes.data() + at, std::min<uint64_t>(1 << 20, n - at));
    f.commit();
  };
  using nvme::FaultKind;
  for (const auto& [kind, request, words] :
       std::vector<std::tuple<FaultKind, uint64_t, std::vector<std::string>>>{
           {FaultKind::enospc, 1, {"No space left on device", "free space on that filesystem"}},
           {FaultKind::eio, 4, {"Input/output error", "dmesg"}},
           {FaultKind::enospc, 5, {"No space left on device"}}}) {  // the tail, in commit()
    const std::string name = fmt::format("fault-{}-{}.bin", static_cast<int>(kind), request);
    SCOPED_TRACE(name);
    atomic_file_faults_for_testing({{kind, request}});
    const std::string msg = test::error_message([&] { write_all(tmp / name); });
    EXPECT_NE(msg.find((tmp / (name + ".tmp")).string()), std::string::npos) << msg;
    for (const std::string& w : words) EXPECT_NE(msg.find(w), std::string::npos) << msg;
    EXPECT_FALSE(fs::exists(tmp / name));
    EXPECT_FALSE(fs::exists(tmp / (name + ".tmp")));
  }
  atomic_file_faults_for_testing({{FaultKind::short_io, 2}});
  write_all(tmp / "short.bin");
  EXPECT_TRUE(read_bytes(tmp / "short.bin") == bytes);
}

// A tensor handed over in parts is written as the same tensor whole would be: the same file,
// bit for bit, and the same checksum; parts that give too few or too many bytes are the
// caller's bug, named, and leave no file.
TEST(Safetensors, TensorsInPartsAreWrittenAsTheWholeTensor) {
  TempDir tmp;
  std::vector<float> big(3000017), small = {1.5f, -2.0f, 3.25f};
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<float>(i % 7919) * 0.25f - 99.0f;
  const std::vector<SafetensorsTensor> whole = {{"b.weight", DType::f32, {3000017}, big.data()},
                                                {"a", DType::f32, {3}, small.data()}};
  const FileDigest want = write_safetensors(tmp / "whole.safetensors", whole);
  auto in_parts = [&](std::vector<size_t> cuts) {
    std::vector<SafetensorsTensor> t = whole;
    t[0].data = nullptr;
    t[0].parts = [&big, cuts](const SafetensorsTensor::Put& put) {
      size_t at = 0;
      for (size_t c : cuts) {
        put(big.data() + at, (c - at) * 4);
        at = c;
      }
    };
    return t;
  };
  // Uneven cuts, one of them empty, one past a staging chunk.
  const FileDigest got =
      write_safetensors(tmp / "parts.safetensors", in_parts({1, 1, 5, 2500000, 2999999, 3000017}));
  EXPECT_EQ(read_bytes(tmp / "parts.safetensors"), read_bytes(tmp / "whole.safetensors"));
  EXPECT_EQ(got.xxh3, want.xxh3);
  EXPECT_EQ(got.tensors, want.tensors);
  expect_error(
      [&] {
        write_safetensors(tmp / "short.safetensors", in_parts({1000, 3000016}));
      },
      {"'b.weight'", "gave 12000064 of its 12000068 bytes", "bug"});
  expect_error(
      [&] {
        write_safetensors(tmp / "long.safetensors", in_parts({3000017, 3000018}));
      },
      {"'b.weight'", "run past its 12000068 bytes", "bug"});
  for (const char* name : {"short.safetensors", "long.safetensors"}) {
    EXPECT_FALSE(fs::exists(tmp / name)) << name;
    EXPECT_FALSE(fs::exists(tmp / (std::string(name) + ".tmp"))) << name;
  }
}

TEST(Safetensors, WriterRefusesBadInput) {
  TempDir tmp;
  const float x[2] = {1, 2};
  const std::vector<SafetensorsTensor> dup = {{"w", DType::f32, {2}, x}, {"w", DType::f32, {2}, x}};
  expect_error([&] { write_safetensors(tmp / "d.safetensors", dup); }, {"'w'", "twice"});
  const std::vector<SafetensorsTensor> null_data = {{"w", DType::f32, {2}, nullptr}};
  expect_error([&] { write_safetensors(tmp / "d.safetensors", null_data); }, {"'w'", "no data"});
  const std::vector<SafetensorsTensor> negative = {{"w", DType::f32, {-2}, x}};
  expect_error([&] { write_safetensors(tmp / "d.safetensors", negative); }, {"'w'", "[-2]"});
  EXPECT_FALSE(fs::exists(tmp / "d.safetensors"));
  EXPECT_FALSE(fs::exists(tmp / "d.safetensors.tmp"));
  expect_error(
      [&] { write_safetensors(tmp / "no" / "dir.safetensors", std::vector<SafetensorsTensor>{}); },
      {(tmp / "no" / "dir.safetensors.tmp").string()});
}

TEST(Safetensors, ShardedRoundTripAndLayoutChanges) {
  TempDir tmp;
  // 400 + 200 + 200 + 1000 + 100 bytes: with a 500-byte limit, shards {a}, {b, c}, {big}, {d}.
  const std::vector<float> a = pattern(100, 1), b = pattern(50, 2), c = pattern(50, 3),
                           big = pattern(250, 4);
  const std::vector<uint16_t> d = to_16(pattern(50, 5), DType::bf16);
  const std::vector<SafetensorsTensor> tensors = {
      {"model.a", DType::f32, {10, 10}, a.data()}, {"model.b", DType::f32, {50}, b.data()},
      {"model.c", DType::f32, {5, 10}, c.data()},  {"model.big", DType::f32, {250}, big.data()},
      {"model.d", DType::bf16, {50}, d.data()},
  };
  const fs::path dir = tmp / "ckpt";
  const std::vector<fs::path> files = write_safetensors_sharded(dir, tensors, 500);
  ASSERT_EQ(files.size(), 5u);
  EXPECT_EQ(files[0], dir / "model-00001-of-00004.safetensors");
  EXPECT_EQ(files[3], dir / "model-00004-of-00004.safetensors");
  EXPECT_EQ(files[4], dir / "model.safetensors.index.json");
  const json index = json::parse(read_bytes(files[4]));
  EXPECT_EQ(index["metadata"]["total_size"], 1900);
  EXPECT_EQ(index["weight_map"]["model.a"], "model-00001-of-00004.safetensors");
  EXPECT_EQ(index["weight_map"]["model.b"], "model-00002-of-00004.safetensors");
  EXPECT_EQ(index["weight_map"]["model.c"], "model-00002-of-00004.safetensors");
  EXPECT_EQ(index["weight_map"]["model.big"], "model-00003-of-00004.safetensors");
  EXPECT_EQ(index["weight_map"]["model.d"], "model-00004-of-00004.safetensors");
  EXPECT_EQ(index["weight_map"].size(), 5u);

  for (const fs::path& open_path : {dir, dir / "model.safetensors.index.json"}) {
    const SafetensorsReader r = SafetensorsReader::open(open_path);
    EXPECT_EQ(r.tensors().size(), 5u);
    EXPECT_EQ(r.find("model.c")->file, (dir / "model-00002-of-00004.safetensors").string());
    EXPECT_EQ(r.metadata().at("format"), "pt");  // Hugging Face needs it
    EXPECT_TRUE(same_bytes(read_tensor(r, "model.a", DType::f32), a));
    EXPECT_TRUE(same_bytes(read_tensor(r, "model.c", DType::f32), c));
    EXPECT_TRUE(same_bytes(read_tensor(r, "model.big", DType::bf16), to_16(big, DType::bf16)));
    EXPECT_TRUE(same_bytes(read_tensor(r, "model.d", DType::bf16), d));
  }
  // One shard alone is a valid safetensors file too.
  EXPECT_EQ(SafetensorsReader::open(files[1]).names(),
            (std::vector<std::string>{"model.b", "model.c"}));

  // Everything fits: one model.safetensors, and the old shards and index are gone.
  const std::vector<fs::path> single = write_safetensors_sharded(dir, tensors, 1 << 20);
  ASSERT_EQ(single.size(), 1u);
  EXPECT_EQ(single[0], dir / "model.safetensors");
  size_t entries = 0;
  for ([[maybe_unused]] const auto& de : fs::directory_iterator(dir)) ++entries;
  EXPECT_EQ(entries, 1u);
  EXPECT_TRUE(same_bytes(read_tensor(SafetensorsReader::open(dir), "model.big", DType::f32), big));

  // And back to shards: model.safetensors would shadow the index, so it is removed.
  write_safetensors_sharded(dir, tensors, 700);
  EXPECT_FALSE(fs::exists(dir / "model.safetensors"));
  EXPECT_EQ(SafetensorsReader::open(dir).tensors().size(), 5u);
  expect_error([&] { write_safetensors_sharded(dir, tensors, 0); }, {dir.string(), "0 bytes"});
}

TEST(Safetensors, DamagedShardedCheckpoints) {
  TempDir tmp;
  const std::vector<float> v = pattern(4, 6);
  auto one = [&](const fs::path& path, const std::vector<std::string>& names) {
    std::vector<SafetensorsTensor> t;
    for (const std::string& n : names) t.push_back({n, DType::f32, {4}, v.data()});
    write_safetensors(path, t);
  };
  auto index = [&](const fs::path& dir, const json& weight_map) {
    write_text(dir / "model.safetensors.index.json",
               json{{"metadata", {{"total_size", 32}}}, {"weight_map", weight_map}}.dump());
  };
  const fs::path dir = tmp / "ckpt";
  fs::create_directories(dir);

  // The same tensor in two shards.
  one(dir / "s1.safetensors", {"x", "y"});
  one(dir / "s2.safetensors", {"x"});
  index(dir, {{"x", "s1.safetensors"}, {"y", "s2.safetensors"}});
  expect_error(
      [&] { SafetensorsReader::open(dir); },
      {"'x'", "twice", (dir / "s1.safetensors").string(), (dir / "s2.safetensors").string()});

  // A missing shard names itself and a tensor it should hold.
  one(dir / "s1.safetensors", {"x"});
  index(dir, {{"x", "s1.safetensors"}, {"y", "s3.safetensors"}});
  expect_error([&] { SafetensorsReader::open(dir); },
               {(dir / "s3.safetensors").string(), "'y'", "does not exist"});

  // The index lists a tensor its shard does not hold.
  one(dir / "s2.safetensors", {"z"});
  index(dir, {{"x", "s1.safetensors"}, {"y", "s2.safetensors"}, {"z", "s2.safetensors"}});
  expect_error([&] { SafetensorsReader::open(dir); },
               {"'y'", (dir / "s2.safetensors").string(), "does not hold"});

  // A shard holds a tensor the index does not list, or lists elsewhere.
  one(dir / "s2.safetensors", {"y", "w"});
  index(dir, {{"x", "s1.safetensors"}, {"y", "s2.safetensors"}});
  expect_error([&] { SafetensorsReader::open(dir); },
               {"'w'", (dir / "s2.safetensors").string(), "does not list"});
  index(dir, {{"x", "s1.safetensors"}, {"y", "s2.safetensors"}, {"w", "s1.safetensors"}});
  expect_error([&] { SafetensorsReader::open(dir); }, {"'w'", "s1.safetensors", "mapped"});

  // A shard outside the directory, a bad weight_map, a damaged shard.
  index(dir, {{"x", "../s1.safetensors"}});
  expect_error([&] { SafetensorsReader::open(dir); }, {"'x'", "../s1.safetensors"});
  index(dir, {{"x", 3}});
  expect_error([&] { SafetensorsReader::open(dir); }, {"'x'", "number"});
  write_text(dir / "model.safetensors.index.json", R"({"metadata": {}})");
  expect_error([&] { SafetensorsReader::open(dir); }, {"weight_map"});
  index(dir, {{"x", "s1.safetensors"}});
  write_text(dir / "s1.safetensors", "abc");
  expect_error([&] { SafetensorsReader::open(dir); },
               {(dir / "s1.safetensors").string(), "truncated"});
}

// ---------------------------------------------------------------- token files

std::vector<uint32_t> iota_tokens(size_t n, uint32_t stride) {
  std::vector<uint32_t> t(n);
  for (size_t i = 0; i < n; ++i) t[i] = static_cast<uint32_t>(i) * stride % 100003u;
  return t;
}

TEST(TokenFiles, LlmcBothMagics) {
  TempDir tmp;
  const std::vector<uint32_t> small = iota_tokens(1000, 37);  // all below 65536
  write_llmc_tokens(tmp / "a.bin", small, TokenWidth::u16);
  const std::string bytes = read_bytes(tmp / "a.bin");
  ASSERT_EQ(bytes.size(), 1024 + 2000u);
  int32_t header[3];
  std::memcpy(header, bytes.data(), 12);
  EXPECT_EQ(header[0], 20240520);
  EXPECT_EQ(header[1], 1);
  EXPECT_EQ(header[2], 1000);
  const TokenFile a = TokenFile::open(tmp / "a.bin");
  EXPECT_TRUE(a.llmc());
  EXPECT_EQ(a.width(), TokenWidth::u16);
  ASSERT_EQ(a.size(), 1000);
  for (int64_t i = 0; i < a.size(); ++i) ASSERT_EQ(a.get(i), small[static_cast<size_t>(i)]);

  const std::vector<uint32_t> wide = iota_tokens(777, 1237);  // ids past 65535
  write_llmc_tokens(tmp / "b.bin", wide, TokenWidth::u32);
  std::memcpy(header, read_bytes(tmp / "b.bin").data(), 12);
  EXPECT_EQ(header[0], 20240801);
  EXPECT_EQ(header[1], 7);
  EXPECT_EQ(header[2], 777);
  const TokenFile b = TokenFile::open(tmp / "b.bin", "");
  EXPECT_EQ(b.width(), TokenWidth::u32);
  ASSERT_EQ(b.size(), 777);
  for (int64_t i = 0; i < b.size(); ++i) ASSERT_EQ(b.get(i), wide[static_cast<size_t>(i)]);
  expect_error([&] { (void)b.get(777); }, {(tmp / "b.bin").string(), "777"});

  expect_error([&] { write_llmc_tokens(tmp / "c.bin", wide, TokenWidth::u16); },
               {(tmp / "c.bin").string(), "uint16", "position 53", std::to_string(wide[53])});
  EXPECT_FALSE(fs::exists(tmp / "c.bin"));
}

TEST(TokenFiles, RawFilesOfEitherWidth) {
  TempDir tmp;
  const std::vector<uint16_t> t16 = {5, 9, 65535, 0, 17};
  const std::vector<uint32_t> t32 = {70000, 1, 2, 4000000000u};
  write_text(tmp / "t16.raw", std::string(reinterpret_cast<const char*>(t16.data()), 10));
  write_text(tmp / "t32.raw", std::string(reinterpret_cast<const char*>(t32.data()), 16));
  const TokenFile a = TokenFile::open(tmp / "t16.raw", "uint16");
  EXPECT_FALSE(a.llmc());
  ASSERT_EQ(a.size(), 5);
  for (int64_t i = 0; i < 5; ++i) EXPECT_EQ(a.get(i), t16[static_cast<size_t>(i)]);
  const TokenFile b = TokenFile::open(tmp / "t32.raw", TokenWidth::u32);
  ASSERT_EQ(b.size(), 4);
  for (int64_t i = 0; i < 4; ++i) EXPECT_EQ(b.get(i), t32[static_cast<size_t>(i)]);
  EXPECT_EQ(TokenFile::open(tmp / "t32.raw", "u16").size(), 8);

  expect_error([&] { TokenFile::open(tmp / "t16.raw", "uint32"); },
               {(tmp / "t16.raw").string(), "10 bytes", "uint32"});
  expect_error([&] { TokenFile::open(tmp / "t16.raw", "int8"); }, {"int8", "uint16"});
  // Without a width, a raw file is refused with the way out named.
  expect_error([&] { TokenFile::open(tmp / "t16.raw"); },
               {(tmp / "t16.raw").string(), "10 bytes", "uint16 or uint32"});
  write_text(tmp / "big.raw", std::string(2048, '\x07'));
  expect_error([&] { TokenFile::open(tmp / "big.raw"); },
               {(tmp / "big.raw").string(), "magic 117901063", "20240520"});
  expect_error([&] { TokenFile::open(tmp / "none.bin"); }, {(tmp / "none.bin").string()});
}

TEST(TokenFiles, WrongSizesAndVersions) {
  TempDir tmp;
  write_llmc_tokens(tmp / "a.bin", iota_tokens(100, 3), TokenWidth::u16);
  std::string bytes = read_bytes(tmp / "a.bin");
  write_text(tmp / "short.bin", bytes.substr(0, bytes.size() - 2));
  expect_error([&] { TokenFile::open(tmp / "short.bin"); },
               {(tmp / "short.bin").string(), "1224 bytes", "1222"});
  write_text(tmp / "long.bin", bytes + "xyzw");
  expect_error([&] { TokenFile::open(tmp / "long.bin"); },
               {(tmp / "long.bin").string(), "1224 bytes", "1228"});
  std::string v2 = bytes;
  v2[4] = 2;  // version 2
  write_text(tmp / "v2.bin", v2);
  expect_error([&] { TokenFile::open(tmp / "v2.bin"); },
               {(tmp / "v2.bin").string(), "version 2", "20240520"});
  std::string neg = bytes;
  const int32_t minus = -5;
  std::memcpy(neg.data() + 8, &minus, 4);
  write_text(tmp / "neg.bin", neg);
  expect_error([&] { TokenFile::open(tmp / "neg.bin"); }, {(tmp / "neg.bin").string(), "-5"});
}

TEST(TokenFiles, ValidateNamesTheFirstBadPosition) {
  TempDir tmp;
  std::vector<uint32_t> t = iota_tokens(50, 1);  // 0..49
  t[7] = 150;
  t[20] = 300;
  write_llmc_tokens(tmp / "a.bin", t, TokenWidth::u16);
  const TokenFile f = TokenFile::open(tmp / "a.bin");
  f.validate(301);
  expect_error([&] { f.validate(100); },
               {(tmp / "a.bin").string(), "position 7", "token id 150", "vocab_size is 100"});
  expect_error([&] { f.validate(151); }, {"position 20", "token id 300"});
  expect_error([&] { f.validate(0); }, {"vocab_size 0"});
}

TEST(TokenFiles, SequencesShiftTargetsByOne) {
  TempDir tmp;
  const int64_t T = 8;
  const std::vector<uint32_t> t = iota_tokens(T + 1, 11);
  write_llmc_tokens(tmp / "one.bin", t, TokenWidth::u32);
  const TokenFile f = TokenFile::open(tmp / "one.bin");
  ASSERT_EQ(f.num_sequences(T), 1);  // exactly T + 1 tokens: one sequence
  std::vector<int32_t> in(T), tg(T);
  f.sequence(0, T, in.data(), tg.data());
  for (int64_t j = 0; j < T; ++j) {
    EXPECT_EQ(in[static_cast<size_t>(j)], static_cast<int32_t>(t[static_cast<size_t>(j)]));
    EXPECT_EQ(tg[static_cast<size_t>(j)], static_cast<int32_t>(t[static_cast<size_t>(j + 1)]));
  }
  expect_error([&] { f.sequence(1, T, in.data(), tg.data()); },
               {(tmp / "one.bin").string(), "sequence 1", "9 tokens make 1 sequences"});
  EXPECT_EQ(f.num_sequences(T + 1), 0);  // T + 1 tokens are no sequence of T + 1
  EXPECT_EQ(f.num_sequences(1), static_cast<int64_t>(T));
  expect_error([&] { (void)f.num_sequences(0); }, {"sequence length 0"});

  // 2T + 1 tokens (plus a spare): two sequences sharing their boundary token.
  const std::vector<uint32_t> u = iota_tokens(2 * T + 2, 5);
  write_llmc_tokens(tmp / "two.bin", u, TokenWidth::u16);
  const TokenFile g = TokenFile::open(tmp / "two.bin");
  ASSERT_EQ(g.num_sequences(T), 2);
  g.sequence(1, T, in.data(), tg.data());
  EXPECT_EQ(in[0], static_cast<int32_t>(u[T]));
  EXPECT_EQ(in[T - 1], static_cast<int32_t>(u[2 * T - 1]));
  EXPECT_EQ(tg[T - 1], static_cast<int32_t>(u[2 * T]));

  write_llmc_tokens(tmp / "empty.bin", {}, TokenWidth::u16);
  EXPECT_EQ(TokenFile::open(tmp / "empty.bin").size(), 0);
  EXPECT_EQ(TokenFile::open(tmp / "empty.bin").num_sequences(4), 0);
}

}  // namespace
}  // namespace strata
