// test_llama_reference.cpp: strata's Llama on the host backend against the Llama equations
// written out in PyTorch (tests/reference/llama_reference.py, Debian's python3-torch, no
// transformers library), for tiny random models with grouped-query attention and odd sizes.
//
// Each case writes a Hugging Face checkpoint (config.json + model.safetensors) and a batch of
// tokens, runs the reference in float64, then loads the same checkpoint through strata's
// reader and compares, in f32: the mean loss, every logit and every parameter's gradient, each
// tensor by normalised error ||ours - torch|| / ||torch|| <= 1e-5. The same checkpoint then goes
// through `strata eval --json`, whose loss must match the reference's too. Without torch the
// test reports a skip, not a pass.
#include "core/device.h"
#include "host/host_device.h"
#include "model/config.h"
#include "model/llama.h"
#include "model/safetensors.h"
#include "model/tokens.h"
#include "model/weights.h"
#include "testing.h"
#include "train/checkpoint.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>

namespace strata {
namespace {

namespace fs = std::filesystem;

struct Case {
  const char* name;
  LlamaConfig config;
  int64_t batch, seq_len, vocab_chunk;
};

// Named in test listings by its name, not its bytes (which hold pointers: a name that changed
// with every build).
void PrintTo(const Case& c, std::ostream* os) {
  *os << c.name;
}

LlamaConfig base(int64_t hidden, int64_t heads, int64_t kv, int64_t head_dim, int64_t ffn,
                 int64_t vocab, int64_t layers) {
  LlamaConfig c;
  c.name = "reference";
  c.hidden_size = hidden;
  c.num_attention_heads = heads;
  c.num_key_value_heads = kv;
  c.head_dim = head_dim;
  c.intermediate_size = ffn;
  c.vocab_size = vocab;
  c.num_hidden_layers = layers;
  c.max_position_embeddings = 64;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 10000.0;
  c.torch_dtype = DType::f32;
  return c;
}

std::vector<Case> cases() {
  std::vector<Case> out;
  // GQA 6:2 with head_dim 8 != hidden / heads, untied.
  out.push_back({"gqa_untied", base(36, 6, 2, 8, 70, 97, 2), 2, 7, 40});
  // GQA 6:3, tied embeddings, llama3 rope scaling with a short original context so that all
  // three frequency bands occur.
  Case tied{"gqa_tied_llama3", base(36, 6, 3, 6, 54, 61, 2), 2, 9, 16};
  tied.config.tie_word_embeddings = true;
  tied.config.rope_theta = 500000.0;
  tied.config.rope_scaling.kind = RopeScalingKind::llama3;
  tied.config.rope_scaling.factor = 8.0;
  tied.config.rope_scaling.low_freq_factor = 1.0;
  tied.config.rope_scaling.high_freq_factor = 4.0;
  tied.config.rope_scaling.original_max_position_embeddings = 16;
  out.push_back(tied);
  // Plain multi-head attention, one layer, batch 3.
  out.push_back({"mha_one_layer", base(20, 4, 4, 10, 33, 50, 1), 3, 5, 50});
  // Qwen2: biases on q, k and v, tied embeddings (as Qwen2.5's small models), eps 1e-6.
  Case qwen{"qwen2_qkv_bias_tied", base(36, 6, 2, 8, 70, 97, 2), 2, 7, 40};
  qwen.config.architecture = Architecture::qwen2;
  qwen.config.qkv_bias = true;
  qwen.config.tie_word_embeddings = true;
  qwen.config.rms_norm_eps = 1e-6;
  qwen.config.rope_theta = 1e6;
  out.push_back(qwen);
  // Llama with attention_bias and mlp_bias: a bias on every projection.
  Case biased{"llama_every_bias", base(20, 4, 2, 10, 33, 50, 2), 2, 6, 24};
  biased.config.qkv_bias = biased.config.o_bias = biased.config.mlp_bias = true;
  out.push_back(biased);
  // Mistral with a sliding window as long as the sequence: every key still in view.
  Case mistral{"mistral_window", base(36, 6, 2, 8, 70, 97, 1), 2, 7, 97};
  mistral.config.architecture = Architecture::mistral;
  mistral.config.sliding_window = 7;
  out.push_back(mistral);
  // Mistral with a window of 3 in sequences of 9: each query sees itself and the two before.
  Case slides{"mistral_window_3_of_9", base(36, 6, 2, 8, 70, 97, 2), 2, 9, 97};
  slides.config.architecture = Architecture::mistral;
  slides.config.sliding_window = 3;
  out.push_back(slides);
  // Qwen2 with use_sliding_window: only the second of three layers slides (layer_types).
  Case qwen_window{"qwen2_second_layer_slides", base(36, 6, 2, 8, 70, 97, 3), 2, 9, 40};
  qwen_window.config.architecture = Architecture::qwen2;
  qwen_window.config.qkv_bias = true;
  qwen_window.config.sliding_window = 4;
  qwen_window.config.sliding_layers = {false, true, false};
  out.push_back(qwen_window);
  // Qwen3: q and k norms over head_dim 8 (≠ hidden / heads), tied; and with attention_bias.
  Case qwen3{"qwen3_qk_norm_tied", base(36, 6, 2, 8, 70, 97, 2), 2, 7, 40};
  qwen3.config.architecture = Architecture::qwen3;
  qwen3.config.qk_norm = true;
  qwen3.config.tie_word_embeddings = true;
  qwen3.config.rms_norm_eps = 1e-6;
  out.push_back(qwen3);
  Case qwen3_bias{"qwen3_attention_bias", base(20, 4, 2, 10, 33, 50, 1), 3, 5, 50};
  qwen3_bias.config.architecture = Architecture::qwen3;
  qwen3_bias.config.qk_norm = true;
  qwen3_bias.config.qkv_bias = qwen3_bias.config.o_bias = true;
  out.push_back(qwen3_bias);
  // Rotary scalings past llama3's: linear (every frequency over 2.5); YaRN with an original
  // context of 16 in 64 and a factor of 3 (the stretch, as transformers 5 takes it; 4.5x took the
  // lengths' 4) whose ramp, counted over the original context, runs from dimension 0 to 2 of 8; and
  // YaRN without one, untruncated betas putting the ramp's ends inside dimensions, and cos and sin
  // scaled by mscale over mscale_all_dim.
  Case linear{"linear_rope", base(36, 6, 2, 8, 70, 97, 1), 2, 9, 40};
  linear.config.rope_scaling.kind = RopeScalingKind::linear;
  linear.config.rope_scaling.factor = 2.5;
  out.push_back(linear);
  Case yarn{"yarn_original_16", base(36, 4, 2, 16, 70, 97, 2), 2, 9, 40};
  yarn.config.rope_theta = 100.0;
  yarn.config.rope_scaling.kind = RopeScalingKind::yarn;
  yarn.config.rope_scaling.factor = 3.0;
  yarn.config.rope_scaling.original_max_position_embeddings = 16;
  out.push_back(yarn);
  Case yarn_m{"yarn_untruncated_mscale", base(36, 4, 2, 16, 70, 97, 1), 2, 9, 40};
  RopeScaling& m = yarn_m.config.rope_scaling;
  m.kind = RopeScalingKind::yarn;
  m.factor = 2.0;
  m.beta_fast = 4.0;
  m.beta_slow = 0.25;
  m.truncate = false;
  m.mscale = 1.0;
  m.mscale_all_dim = 0.5;
  out.push_back(yarn_m);
  // Phi-3: q, k and v in one tensor of the files, gate and up in another; a window of 4 in
  // sequences of 9, grouped-query heads (as Phi-4's).
  Case phi3{"phi3_fused_projections_window", base(36, 6, 2, 8, 70, 97, 2), 2, 9, 40};
  phi3.config.architecture = Architecture::phi3;
  phi3.config.sliding_window = 4;
  out.push_back(phi3);
  // Phi-3.5's LongRoPE: sequences of 9 within an original context of 16 (the short factors)
  // and past one of 8 (the long ones); the stretch 64 / original sets the cos/sin scale.
  for (const int64_t original : {16, 8}) {
    Case lr{original == 16 ? "phi3_longrope_short" : "phi3_longrope_long",
            base(36, 6, 2, 8, 70, 97, 1), 2, 9, 40};
    lr.config.architecture = Architecture::phi3;
    RopeScaling& r = lr.config.rope_scaling;
    r.kind = RopeScalingKind::longrope;
    r.original_max_position_embeddings = original;
    r.short_factor = {1.0, 1.3, 2.5, 4.0};
    r.long_factor = {1.1, 3.0, 9.5, 30.0};
    out.push_back(lr);
  }
  // Phi-4-mini's partial rotation: 6 of 8 dimensions of each head rotated; and half of them
  // under LongRoPE, whose factors then count the rotated pairs alone.
  Case partial{"phi3_partial_rotary", base(36, 6, 2, 8, 70, 97, 2), 2, 9, 40};
  partial.config.architecture = Architecture::phi3;
  partial.config.partial_rotary_factor = 0.75;
  out.push_back(partial);
  Case mini{"phi4_mini_partial_longrope", base(36, 6, 2, 8, 70, 97, 1), 2, 9, 40};
  mini.config.architecture = Architecture::phi3;
  mini.config.tie_word_embeddings = true;
  mini.config.partial_rotary_factor = 0.5;
  mini.config.rope_scaling.kind = RopeScalingKind::longrope;
  mini.config.rope_scaling.original_max_position_embeddings = 8;
  mini.config.rope_scaling.short_factor = {1.0, 2.0};
  mini.config.rope_scaling.long_factor = {1.5, 7.0};
  out.push_back(mini);
  // Gemma: embeddings times sqrt(hidden), norms times 1 + weight, GeGLU (the tanh GELU), tied,
  // head_dim 8 != hidden / heads; and Gemma 2B's single key/value head with attention_bias and
  // the exact (erf) GELU, which its hidden_activation may name.
  Case gemma{"gemma_geglu_tied", base(36, 6, 2, 8, 70, 97, 2), 2, 7, 40};
  gemma.config.architecture = Architecture::gemma;
  gemma.config.hidden_act = Activation::gelu_tanh;
  gemma.config.tie_word_embeddings = true;
  gemma.config.rms_norm_eps = 1e-6;
  out.push_back(gemma);
  Case gemma_mqa{"gemma_one_kv_head_bias_erf_gelu", base(20, 4, 1, 10, 33, 50, 2), 3, 5, 50};
  gemma_mqa.config.architecture = Architecture::gemma;
  gemma_mqa.config.hidden_act = Activation::gelu;
  gemma_mqa.config.qkv_bias = gemma_mqa.config.o_bias = true;
  gemma_mqa.config.tie_word_embeddings = true;
  out.push_back(gemma_mqa);
  // Gemma 2: norms on each sublayer's input and output, a window of 4 in the first and third of
  // three layers, scores scaled by 12^-1/2 (not head_dim 8's) and capped, logits capped; the
  // caps small against this init's scores and logits so that they bend them. And Gemma 2
  // untied, without caps (null in config.json), its scale head_dim's.
  Case gemma2{"gemma2_sandwich_window_caps", base(36, 6, 2, 8, 70, 97, 3), 2, 9, 40};
  gemma2.config.architecture = Architecture::gemma2;
  gemma2.config.hidden_act = Activation::gelu_tanh;
  gemma2.config.tie_word_embeddings = true;
  gemma2.config.rms_norm_eps = 1e-6;
  gemma2.config.sliding_window = 4;
  gemma2.config.sliding_layers = {true, false, true};
  gemma2.config.query_pre_attn_scalar = 12;
  gemma2.config.attn_logit_softcapping = 0.04;
  gemma2.config.final_logit_softcapping = 0.1;
  out.push_back(gemma2);
  Case gemma2_plain{"gemma2_untied_uncapped", base(20, 4, 2, 10, 33, 50, 2), 2, 6, 24};
  gemma2_plain.config.architecture = Architecture::gemma2;
  gemma2_plain.config.hidden_act = Activation::gelu_tanh;
  gemma2_plain.config.query_pre_attn_scalar = 10;
  out.push_back(gemma2_plain);
  // SmolLM3: Llama's block, its third layer a NoPE layer (no rotary embeddings) that also
  // slides a window of 4 (use_sliding_window), tied, with MLP biases.
  Case smollm3{"smollm3_nope_layer_window", base(36, 6, 2, 8, 70, 97, 3), 2, 9, 40};
  smollm3.config.architecture = Architecture::smollm3;
  smollm3.config.tie_word_embeddings = true;
  smollm3.config.mlp_bias = true;
  smollm3.config.nope_layers = {false, false, true};
  smollm3.config.sliding_window = 4;
  smollm3.config.sliding_layers = {false, false, true};
  out.push_back(smollm3);
  // Gemma 3's text model: Gemma 2's sandwich norms with q and k norms (1 + w), a window of 4
  // in the first two of three layers (sliding_window_pattern 3), which rotate with a base of
  // 100 and no scaling while the third takes rope_theta with linear scaling 2; scores scaled by
  // 6^-1/2; no caps.
  Case gemma3{"gemma3_qk_norms_local_rope", base(36, 6, 2, 8, 70, 97, 3), 2, 9, 40};
  gemma3.config.architecture = Architecture::gemma3;
  gemma3.config.qk_norm = true;
  gemma3.config.hidden_act = Activation::gelu_tanh;
  gemma3.config.tie_word_embeddings = true;
  gemma3.config.rms_norm_eps = 1e-6;
  gemma3.config.sliding_window = 4;
  gemma3.config.sliding_layers = {true, true, false};
  gemma3.config.query_pre_attn_scalar = 6;
  gemma3.config.rope_local_base_freq = 100.0;
  gemma3.config.rope_scaling.kind = RopeScalingKind::linear;
  gemma3.config.rope_scaling.factor = 2.0;
  out.push_back(gemma3);
  // Granite: tied, embeddings times 3, each sublayer's output times 0.5 before the residual,
  // scores times 0.2 (not 8^-1/2), logits divided by 4.
  Case granite{"granite_multipliers", base(48, 6, 2, 8, 70, 97, 2), 2, 9, 40};
  granite.config.architecture = Architecture::granite;
  granite.config.tie_word_embeddings = true;
  granite.config.embedding_multiplier = 3.0;
  granite.config.residual_multiplier = 0.5;
  granite.config.attention_multiplier = 0.2;
  granite.config.logits_scaling = 4.0;
  out.push_back(granite);
  // Llama's class with another hidden_act than silu (transformers honours it).
  Case llama_gelu{"llama_gelu_tanh_mlp", base(20, 4, 2, 10, 33, 50, 1), 2, 6, 24};
  llama_gelu.config.hidden_act = Activation::gelu_tanh;
  out.push_back(llama_gelu);
  // The tables in 3 vocabulary pieces (97 rows: 33, 33, 31; chunks of 16 inside each), untied,
  // and tied (61 rows: 21, 21, 19; the head's pieces reading the embedding's): each piece's
  // gradients against its rows of torch's whole table's.
  Case untied_pieces{"gqa_untied_pieces", base(36, 6, 2, 8, 70, 97, 2), 2, 7, 16};
  untied_pieces.config.vocab_pieces = 3;
  out.push_back(untied_pieces);
  Case tied_pieces = tied;
  tied_pieces.name = "gqa_tied_pieces";
  tied_pieces.config.vocab_pieces = 3;
  out.push_back(tied_pieces);
  return out;
}

double normalised_error(const std::vector<float>& ours, const float* ref, size_t n) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < n; ++i) {
    diff += (static_cast<double>(ours[i]) - ref[i]) * (static_cast<double>(ours[i]) - ref[i]);
    norm += static_cast<double>(ref[i]) * ref[i];
  }
  return norm == 0 ? std::sqrt(diff) : std::sqrt(diff / norm);
}

class LlamaReference : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           fmt::format("strata_llama_ref_{}_{}", GetParam().name, ::getpid());
    fs::create_directories(dir_ / "model");
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

TEST_P(LlamaReference, LossLogitsAndGradientsMatchTorch) {
  const Case& tc = GetParam();
  const LlamaConfig& c = tc.config;
  const ModelLayout layout = ModelLayout::build(c);

  // A checkpoint with random weights; norm weights away from 1 (Gemma's 1 + w too) so that they
  // matter.
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> jitter(0.7f, 1.3f);
  std::normal_distribution<float> bias(0.0f, 0.1f);  // biases start at 0: give them values
  std::vector<std::vector<float>> units(static_cast<size_t>(layout.num_units()));
  for (int u = 0; u < layout.num_units(); ++u) {
    auto& v = units[static_cast<size_t>(u)];
    v.resize(layout.units[static_cast<size_t>(u)].numel);
    init_unit_random(layout, u, 99, DType::f32, v.data());
    for (const ParamSlot& p : layout.units[static_cast<size_t>(u)].params) {
      const bool is_bias = p.name.ends_with(".bias");
      if (p.shape.rank == 1)
        for (int64_t i = 0; i < p.numel(); ++i) {
          float& x = v[p.offset + static_cast<uint64_t>(i)];
          x = is_bias ? bias(rng)
                      : (x + 1.0f - layout.norm_init) * jitter(rng) - 1.0f + layout.norm_init;
        }
    }
  }
  // As the files hold them (Phi-3's fused projections included), through the writer training's
  // checkpoints use.
  const std::vector<SafetensorsTensor> tensors = streamed_model_tensors(
      layout, DType::f32,
      [&](int u, std::vector<float>& out, int) { out = units[static_cast<size_t>(u)]; });
  write_safetensors(dir_ / "model" / "model.safetensors", tensors, {});
  {
    std::ofstream f(dir_ / "model" / "config.json");
    f << to_hf_config_json(c).dump(2);
  }

  // Tokens: inputs then targets, some targets ignored; plus the same stream as a token file.
  const int64_t B = tc.batch, T = tc.seq_len, N = B * T;
  std::vector<int32_t> stream_tokens(static_cast<size_t>(B * T + 1));
  for (auto& t : stream_tokens)
    t = static_cast<int32_t>(rng() % static_cast<uint32_t>(c.vocab_size));
  std::vector<int32_t> ids(static_cast<size_t>(N)), targets(static_cast<size_t>(N));
  for (int64_t i = 0; i < N; ++i) {
    ids[static_cast<size_t>(i)] = stream_tokens[static_cast<size_t>(i)];
    targets[static_cast<size_t>(i)] = stream_tokens[static_cast<size_t>(i + 1)];
  }
  std::vector<int32_t> masked = targets;
  for (int64_t i = 2; i < N; i += 5) masked[static_cast<size_t>(i)] = kIgnoreIndex;
  {
    // Then the unmasked targets, whose loss `strata eval` is compared with below.
    std::ofstream f(dir_ / "tokens.i32", std::ios::binary);
    f.write(reinterpret_cast<const char*>(ids.data()), N * 4);
    f.write(reinterpret_cast<const char*>(masked.data()), N * 4);
    f.write(reinterpret_cast<const char*>(targets.data()), N * 4);
  }

  const std::string command =
      fmt::format("'{}' '{}/llama_reference.py' '{}' '{}' '{}' --batch {} --seq-len {} 2>&1",
                  STRATA_PYTHON, STRATA_REFERENCE_DIR, (dir_ / "model").string(),
                  (dir_ / "tokens.i32").string(), (dir_ / "ref.safetensors").string(), B, T);
  const int status = std::system(command.c_str());
  if (WIFEXITED(status) && WEXITSTATUS(status) == 77)
    GTEST_SKIP() << "PyTorch is not importable by " << STRATA_PYTHON
                 << "; install python3-torch to run the Llama reference test";
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << command << " failed";
  const SafetensorsReader ref = SafetensorsReader::open(dir_ / "ref.safetensors");
  auto ref_tensor = [&](const std::string& name) {
    std::vector<float> v(static_cast<size_t>(ref.find(name)->numel()));
    ref.read(name, v.data(), DType::f32);
    return v;
  };

  // strata, host backend, f32, loading the checkpoint through its own reader.
  auto device = open_host_device(0, 256ull << 20);
  auto stream = device->create_stream("test");
  ModelOptions o;
  o.max_batch = B;
  o.seq_len = T;
  o.vocab_chunk = tc.vocab_chunk;
  LlamaModel model(c, o, *device);
  ResidentWeights w(model.layout(), *device, DType::f32, DType::f32, true);
  w.load(SafetensorsReader::open(dir_ / "model"), *stream);
  w.zero_grads(*stream);
  DeviceBuffer d_ids(*device, static_cast<uint64_t>(N) * 4, "ids");
  DeviceBuffer d_targets(*device, static_cast<uint64_t>(N) * 4, "targets");
  device->copy_to_device(d_ids.data(), ids.data(), static_cast<uint64_t>(N) * 4, *stream);
  device->copy_to_device(d_targets.data(), masked.data(), static_cast<uint64_t>(N) * 4, *stream);
  auto* di = static_cast<int32_t*>(d_ids.data());
  auto* dt = static_cast<int32_t*>(d_targets.data());
  int64_t valid = 0;
  for (int32_t t : masked) valid += t != kIgnoreIndex;

  model.forward(w.units(), di, dt, B, true, *stream);
  std::vector<float> losses(static_cast<size_t>(N));
  device->copy_to_host(losses.data(), model.losses(B).data, static_cast<uint64_t>(N) * 4, *stream);
  model.backward(w.units(), di, dt, B, 1.0f / static_cast<float>(valid), *stream);
  DeviceBuffer d_logits(*device, static_cast<uint64_t>(N * c.vocab_size) * 4, "logits");
  model.logits(w.units(), d_logits.view(DType::f32, {N, c.vocab_size}), B, *stream);
  std::vector<float> logits(static_cast<size_t>(N * c.vocab_size));
  device->copy_to_host(logits.data(), d_logits.data(), d_logits.bytes(), *stream);
  stream->synchronize();

  double sum = 0;
  for (float l : losses) sum += l;
  const double loss = sum / static_cast<double>(valid);
  const double ref_loss = ref_tensor("loss")[0];
  EXPECT_NEAR(loss, ref_loss, 1e-5 * std::abs(ref_loss)) << "mean loss";
  const std::vector<float> ref_logits = ref_tensor("logits");
  ASSERT_EQ(ref_logits.size(), logits.size());
  double worst = normalised_error(logits, ref_logits.data(), logits.size());
  EXPECT_LE(worst, 1e-5) << "logits";

  int compared = 0;
  std::set<std::string> tensors_seen;  // Hugging Face names, a piece's rows counted with its table
  for (int u = 0; u < layout.num_units(); ++u) {
    const std::vector<float> grad = w.download(u, true, *stream);
    for (const ParamSlot& p : layout.units[static_cast<size_t>(u)].params) {
      // The reference's gradient of the file's tensor: this parameter's rows of it.
      const std::vector<float> whole = ref_tensor("grad." + p.file_name);
      const auto row = static_cast<int64_t>(whole.size()) / p.file_shape.at(0);
      ASSERT_GE(static_cast<int64_t>(whole.size()), (p.file_row + p.shape.dims[0]) * row);
      const std::vector<float> g(whole.begin() + p.file_row * row,
                                 whole.begin() + (p.file_row + p.shape.dims[0]) * row);
      ASSERT_EQ(g.size(), static_cast<size_t>(p.numel())) << p.name;
      const std::vector<float> ours(grad.begin() + static_cast<int64_t>(p.offset),
                                    grad.begin() + static_cast<int64_t>(p.offset) + p.numel());
      const double err = normalised_error(ours, g.data(), g.size());
      EXPECT_LE(err, 1e-5) << "gradient of " << p.name;
      worst = std::max(worst, err);
      ++compared;
      tensors_seen.insert(p.name.substr(0, p.name.find('[')));
    }
  }
  EXPECT_EQ(tensors_seen.size(), llama_hf_tensors(c).size());
  EXPECT_EQ(compared, static_cast<int>(llama_hf_tensors(c).size()) +
                          (layout.vocab_pieces - 1) * (c.tie_word_embeddings ? 1 : 2));
  std::printf("%s: worst normalised error of the logits and %d gradients: %.2e\n", tc.name,
              compared, worst);

  // `strata eval` over the same stream as an llm.c token file, unmasked: the reference's loss
  // against the unmasked targets, from the same run of the script.
  write_llmc_tokens(dir_ / "tokens.bin",
                    std::vector<uint32_t>(stream_tokens.begin(), stream_tokens.end()),
                    TokenWidth::u16);
  const double unmasked = ref_tensor("loss_other")[0];
  EXPECT_GT(std::abs(unmasked - ref_loss), 0.0) << "masking changed nothing";
  const auto r = test::run_command(
      fmt::format("'{}' eval --model '{}' --data '{}' --seq-len {} --batch {} --devices host "
                  "--device-memory 256MiB --json",
                  STRATA_BINARY, (dir_ / "model").string(), (dir_ / "tokens.bin").string(), T, B));
  ASSERT_EQ(r.status, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["tokens"].get<int64_t>(), N);
  EXPECT_NEAR(j["loss"].get<double>(), unmasked, 1e-5 * unmasked);
  EXPECT_NEAR(j["perplexity"].get<double>(), std::exp(unmasked), 1e-4 * std::exp(unmasked));
}

INSTANTIATE_TEST_SUITE_P(Shapes, LlamaReference, ::testing::ValuesIn(cases()),
                         [](const auto& p) { return std::string(p.param.name); });

}  // namespace
}  // namespace strata
