// The Llama model on the host backend: layout, rotary table, and the whole model's gradient
// against finite differences of its loss (the per-op checks are in test_host_ops).
#include "core/device.h"
#include "host/host_device.h"
#include "model/llama.h"
#include "model/weights.h"
#include "testing.h"

#include <gtest/gtest.h>
#include <tbb/task_arena.h>

#include <cmath>
#include <cstring>
#include <numeric>
#include <random>

namespace strata {
namespace {

LlamaConfig small_config(bool tied) {
  LlamaConfig c;
  c.name = "test-small";
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 6;  // deliberately not hidden / heads
  c.vocab_size = 29;
  c.max_position_embeddings = 64;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 10000.0;
  c.tie_word_embeddings = tied;
  return c;
}

TEST(LlamaLayout, NamesShapesAndAlignment) {
  for (bool tied : {false, true}) {
    const LlamaConfig c = small_config(tied);
    const ModelLayout layout = ModelLayout::build(c);
    ASSERT_EQ(layout.num_units(), 4);
    EXPECT_EQ(layout.units[0].kind, UnitKind::embedding);
    EXPECT_EQ(layout.units[3].kind, UnitKind::head);
    EXPECT_EQ(layout.units[3].params.size(), tied ? 1u : 2u);
    const auto [u, slot] = layout.find("model.layers.1.self_attn.k_proj.weight");
    EXPECT_EQ(u, 2);
    EXPECT_EQ(slot->shape, (Shape{12, 16}));
    EXPECT_EQ(layout.find("model.layers.0.self_attn.o_proj.weight").second->shape, (Shape{16, 24}));
    uint64_t real = 0, total = 0;
    for (const UnitLayout& unit : layout.units) {
      total += unit.numel;
      uint64_t end = 0;
      for (const ParamSlot& p : unit.params) {
        EXPECT_EQ(p.offset % ModelLayout::kAlign, 0u) << p.name;
        EXPECT_GE(p.offset, end) << p.name << " overlaps the tensor before it";
        end = p.offset + static_cast<uint64_t>(p.numel());
        real += static_cast<uint64_t>(p.numel());
      }
      EXPECT_LE(end, unit.numel);
    }
    EXPECT_EQ(total, layout.total_numel);
    // Embedding + per layer (2 norms, q, k, v, o, gate, up, down) + norm (+ head).
    const uint64_t per_layer = 2 * 16 + 24 * 16 + 2 * 12 * 16 + 16 * 24 + 3 * 24 * 16;
    EXPECT_EQ(real, 29 * 16 + 2 * per_layer + 16 + (tied ? 0 : 29 * 16));
    test::expect_error([&] { (void)layout.find("model.layers.7.mlp.up_proj.weight"); },
                       {"model.layers.7.mlp.up_proj.weight"});
  }
}

TEST(LlamaRope, PlainAndLlama3Scaling) {
  LlamaConfig c = small_config(false);
  c.head_dim = 8;
  const auto plain = rope_table(c, 5);
  ASSERT_EQ(plain.size(), 40u);
  for (int t = 0; t < 5; ++t)
    for (int i = 0; i < 4; ++i) {
      const double angle = t * std::pow(10000.0, -2.0 * i / 8.0);
      EXPECT_NEAR(plain[static_cast<size_t>(t * 8 + i)], std::cos(angle), 2e-6);
      EXPECT_NEAR(plain[static_cast<size_t>(t * 8 + 4 + i)], std::sin(angle), 2e-6);
    }
  // llama3 scaling with a short original context: the lowest frequency is divided by the
  // factor, the highest is untouched, one in between is blended.
  c.rope_scaling.kind = RopeScalingKind::llama3;
  c.rope_scaling.factor = 8.0;
  c.rope_scaling.low_freq_factor = 1.0;
  c.rope_scaling.high_freq_factor = 4.0;
  c.rope_scaling.original_max_position_embeddings = 64;
  c.rope_theta = 500000.0;
  const auto scaled = rope_table(c, 3);
  c.rope_scaling = RopeScaling{};
  const auto unscaled = rope_table(c, 3);
  const int t = 2;
  EXPECT_FLOAT_EQ(scaled[t * 8 + 0], unscaled[t * 8 + 0]);  // inv_freq 1: wavelength 2π < 16
  const double low = std::pow(500000.0, -6.0 / 8.0);        // wavelength ~ 118000 > 64
  EXPECT_NEAR(scaled[t * 8 + 3], std::cos(t * low / 8.0), 1e-6);
}

// The whole model in f32: every parameter's gradient against central differences of the mean
// loss, for a few coordinates of every tensor, with and without tied embeddings.
// Variants: untied, tied, Qwen2's q/k/v biases with tied embeddings, Llama with a bias on every
// projection (attention_bias and mlp_bias), Qwen3's q and k norms (tied, as its small models),
// Qwen3 with attention_bias, Gemma (tied; embeddings times sqrt(hidden), norms times
// 1 + weight, the tanh GELU's gate) and Gemma 2 (Gemma's, with norms on the sublayers' outputs,
// a window of 3, scores scaled by 5^-1/2 and capped at 1.5, logits capped at 2) and Gemma 3
// (Gemma 2's without caps, with q and k norms and the sliding layers rotating with base 100) and
// SmolLM3 (Llama's, tied, with MLP biases, its second layer a NoPE layer: no rotary embeddings)
// and Granite (tied; embeddings times 4, sublayer outputs times 0.4, scores times 0.3, logits
// divided by 3) and pieces (untied, the embedding and the head each in three vocabulary pieces
// of 10, 10 and 9 rows) and tied_pieces (tied, the table in those pieces, which the head's read).
enum class Variant {
  untied,
  tied,
  qwen2_tied,
  every_bias,
  qwen3_tied,
  qwen3_bias,
  gemma,
  gemma2,
  gemma3,
  smollm3,
  granite,
  pieces,
  tied_pieces
};

LlamaConfig variant_config(Variant v) {
  LlamaConfig c =
      small_config(v == Variant::tied || v == Variant::qwen2_tied || v == Variant::qwen3_tied ||
                   v == Variant::gemma || v == Variant::gemma2 || v == Variant::gemma3 ||
                   v == Variant::smollm3 || v == Variant::granite || v == Variant::tied_pieces);
  if (v == Variant::gemma || v == Variant::gemma2 || v == Variant::gemma3) {
    c.architecture = Architecture::gemma;
    c.hidden_act = Activation::gelu_tanh;
  }
  if (v == Variant::gemma2) {
    c.architecture = Architecture::gemma2;
    c.sliding_window = 3;
    c.query_pre_attn_scalar = 5;
    c.attn_logit_softcapping = 1.5;
    c.final_logit_softcapping = 2.0;
  }
  if (v == Variant::gemma3) {
    c.architecture = Architecture::gemma3;
    c.qk_norm = true;
    c.sliding_window = 3;
    c.query_pre_attn_scalar = 5;
    c.rope_local_base_freq = 100.0;
  }
  if (v == Variant::qwen2_tied) {
    c.architecture = Architecture::qwen2;
    c.qkv_bias = true;
  }
  if (v == Variant::every_bias) c.qkv_bias = c.o_bias = c.mlp_bias = true;
  if (v == Variant::smollm3) {
    c.architecture = Architecture::smollm3;
    c.mlp_bias = true;
    c.nope_layers = {false, true};
  }
  if (v == Variant::granite) {
    c.architecture = Architecture::granite;
    c.head_dim = c.hidden_size / c.num_attention_heads;  // Granite's rule
    c.embedding_multiplier = 4.0;
    c.residual_multiplier = 0.4;
    c.attention_multiplier = 0.3;
    c.logits_scaling = 3.0;
  }
  if (v == Variant::pieces || v == Variant::tied_pieces) c.vocab_pieces = 3;
  if (v == Variant::qwen3_tied || v == Variant::qwen3_bias) {
    c.architecture = Architecture::qwen3;
    c.qk_norm = true;
    c.qkv_bias = c.o_bias = v == Variant::qwen3_bias;
  }
  return c;
}

const char* variant_name(Variant v) {
  const char* names[] = {"untied",     "tied",   "qwen2_tied", "every_bias", "qwen3_tied",
                         "qwen3_bias", "gemma",  "gemma2",     "gemma3",     "smollm3",
                         "granite",    "pieces", "tied_pieces"};
  return names[static_cast<int>(v)];
}

// init_random leaves biases at 0, as Hugging Face initialises them: give them values that
// change the output.
void randomize_biases(ResidentWeights& w, const ModelLayout& layout, Stream& s) {
  std::mt19937 rng(3);
  std::normal_distribution<float> dist(0.0f, 0.3f);
  for (int u = 0; u < layout.num_units(); ++u) {
    std::vector<float> v = w.download(u, false, s);
    bool any = false;
    for (const ParamSlot& p : layout.units[static_cast<size_t>(u)].params)
      if (p.name.ends_with(".bias")) {
        any = true;
        for (int64_t k = 0; k < p.numel(); ++k) v[p.offset + static_cast<uint64_t>(k)] = dist(rng);
      }
    if (any) w.upload(u, v, s);
  }
}

// n token ids (i x 11 + 2) and targets (i x target_step + 5, every fifth from the fourth
// ignored), modulo the vocabulary, in the device's memory.
class Tokens {
 public:
  Tokens(Device& device, Stream& stream, int n, int vocab, int target_step)
      : ids_(device, static_cast<uint64_t>(n) * 4, "ids"),
        targets_(device, static_cast<uint64_t>(n) * 4, "targets") {
    std::vector<int32_t> ids(static_cast<size_t>(n)), targets(ids.size());
    for (int i = 0; i < n; ++i) {
      ids[static_cast<size_t>(i)] = (i * 11 + 2) % vocab;
      targets[static_cast<size_t>(i)] = i % 5 == 3 ? kIgnoreIndex : (i * target_step + 5) % vocab;
    }
    device.copy_to_device(ids_.data(), ids.data(), ids.size() * 4, stream);
    device.copy_to_device(targets_.data(), targets.data(), targets.size() * 4, stream);
    stream.synchronize();  // the host vectors are freed on return
  }
  const int32_t* ids_data() const { return static_cast<const int32_t*>(ids_.data()); }
  const int32_t* targets_data() const { return static_cast<const int32_t*>(targets_.data()); }

 private:
  DeviceBuffer ids_, targets_;
};

void PrintTo(Variant v, std::ostream* os) {
  *os << variant_name(v);
}

class LlamaGradient : public ::testing::TestWithParam<Variant> {};

TEST_P(LlamaGradient, MatchesFiniteDifferences) {
  const LlamaConfig c = variant_config(GetParam());
  auto device = open_host_device(0, 64ull << 20);
  auto stream = device->create_stream("test");
  ModelOptions o;
  o.max_batch = 2;
  o.seq_len = 5;
  o.vocab_chunk = 11;  // three chunks, the last one short
  LlamaModel model(c, o, *device);
  ResidentWeights w(model.layout(), *device, DType::f32, DType::f32, true);
  // Larger weights than a real init, so gradients are large against f32 rounding.
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> dist(-0.4f, 0.4f);
  std::vector<std::vector<float>> values;
  for (int u = 0; u < model.layout().num_units(); ++u) {
    values.push_back(w.download(u, false, *stream));
    for (float& x : values.back()) x = dist(rng);
    w.upload(u, values.back(), *stream);
  }
  const int64_t N = 10;
  std::vector<int32_t> host_ids(N), host_targets(N);
  for (int64_t i = 0; i < N; ++i) {
    host_ids[static_cast<size_t>(i)] = static_cast<int32_t>((i * 7 + 3) % 29);
    host_targets[static_cast<size_t>(i)] =
        i % 4 == 1 ? kIgnoreIndex : static_cast<int32_t>((i * 5 + 1) % 29);
  }
  DeviceBuffer ids(*device, N * 4, "ids"), targets(*device, N * 4, "targets");
  device->copy_to_device(ids.data(), host_ids.data(), N * 4, *stream);
  device->copy_to_device(targets.data(), host_targets.data(), N * 4, *stream);
  const double valid = 7;  // positions 1, 5, 9 are ignored

  auto loss = [&]() {
    model.forward(w.units(), static_cast<int32_t*>(ids.data()),
                  static_cast<int32_t*>(targets.data()), 2, false, *stream);
    std::vector<float> l(N);
    device->copy_to_host(l.data(), model.losses(2).data, N * 4, *stream);
    stream->synchronize();
    double sum = 0;
    for (int64_t i = 0; i < N; ++i) {
      if (host_targets[static_cast<size_t>(i)] == kIgnoreIndex) {
        EXPECT_EQ(l[static_cast<size_t>(i)], 0.0f);
      }
      sum += l[static_cast<size_t>(i)];
    }
    return sum / valid;
  };

  w.zero_grads(*stream);
  model.forward(w.units(), static_cast<int32_t*>(ids.data()), static_cast<int32_t*>(targets.data()),
                2, true, *stream);
  model.backward(w.units(), static_cast<int32_t*>(ids.data()),
                 static_cast<int32_t*>(targets.data()), 2, static_cast<float>(1.0 / valid),
                 *stream);
  stream->synchronize();

  std::mt19937 pick(11);
  int checked = 0;
  for (int u = 0; u < model.layout().num_units(); ++u) {
    const std::vector<float> grad = w.download(u, true, *stream);
    for (const ParamSlot& p : model.layout().units[static_cast<size_t>(u)].params) {
      for (int trial = 0; trial < 4; ++trial) {
        const uint64_t i = p.offset + pick() % static_cast<uint64_t>(p.numel());
        std::vector<float> v = values[static_cast<size_t>(u)];
        const float eps = 1e-2f;
        v[i] = values[static_cast<size_t>(u)][i] + eps;
        w.upload(u, v, *stream);
        const double up = loss();
        v[i] = values[static_cast<size_t>(u)][i] - eps;
        w.upload(u, v, *stream);
        const double down = loss();
        const double fd = (up - down) / (2.0 * eps);
        EXPECT_NEAR(grad[i], fd, 2e-3 + 2e-2 * std::abs(fd))
            << p.name << " element " << i - p.offset;
        ++checked;
      }
      w.upload(u, values[static_cast<size_t>(u)], *stream);
    }
  }
  EXPECT_GE(checked, 4 * static_cast<int>(llama_hf_tensors(c).size()));
  EXPECT_GE(checked, 4 * 19);
}

INSTANTIATE_TEST_SUITE_P(Variants, LlamaGradient,
                         ::testing::Values(Variant::untied, Variant::tied, Variant::qwen2_tied,
                                           Variant::every_bias, Variant::qwen3_tied,
                                           Variant::qwen3_bias, Variant::gemma, Variant::gemma2,
                                           Variant::gemma3, Variant::smollm3, Variant::granite,
                                           Variant::pieces, Variant::tied_pieces),
                         [](const auto& p) { return std::string(variant_name(p.param)); });

// The planner sizes activations with workspace_bytes_for(); it must be what the constructor
// allocates, in every dtype (bf16 adds the logits-gradient chunk) and with the arena's rounding.
TEST(LlamaModel, WorkspaceBytesForIsWhatTheConstructorAllocates) {
  for (Variant variant : {Variant::untied, Variant::tied, Variant::qwen3_tied, Variant::gemma2,
                          Variant::pieces, Variant::tied_pieces})
    for (DType t : {DType::f32, DType::bf16})
      for (int64_t batch : {1, 3})
        for (int mode : {0, 1, 2, 3}) {  // recompute, keep the activations, forward only, KV
          if (mode == 3 && batch != 1) continue;  // a KV cache holds one sequence
          const LlamaConfig c = variant_config(variant);
          auto device = open_host_device(0, 64ull << 20);
          ModelOptions o;
          o.param_dtype = t;
          o.max_batch = batch;
          o.seq_len = 13;
          o.vocab_chunk = 8;
          o.recompute = mode != 1;
          o.forward_only = mode >= 2;
          o.kv_cache = mode == 3;
          const uint64_t before = device->memory().in_use;
          LlamaModel model(c, o, *device);
          EXPECT_EQ(LlamaModel::workspace_bytes_for(c, o), model.workspace_bytes());
          EXPECT_GT(model.workspace_bytes(), 0u);
          // The host arena rounds every buffer to 256 bytes.
          EXPECT_EQ(LlamaModel::workspace_bytes_for(c, o, 256), device->memory().in_use - before);
          EXPECT_EQ(LlamaModel::workspace_bytes_for(c, o, 256),
                    device->memory().peak_of(MemoryKind::activations));
        }
  ModelOptions bad;
  bad.seq_len = 65;  // past max_position_embeddings
  EXPECT_THROW(LlamaModel::workspace_bytes_for(small_config(false), bad), Error);
  // The KV cache: layers x keys and values x positions x kv heads x head_dim, on top of the
  // forward-only model's workspace; only for forward-only models of one sequence.
  ModelOptions f;
  f.seq_len = 13;
  f.forward_only = true;
  ModelOptions kv = f;
  kv.kv_cache = true;
  EXPECT_EQ(LlamaModel::workspace_bytes_for(small_config(false), kv) -
                LlamaModel::workspace_bytes_for(small_config(false), f),
            2u * 2 * 13 * 2 * 6 * 4);
  kv.forward_only = false;
  test::expect_error([&] { LlamaModel::workspace_bytes_for(small_config(false), kv); },
                     {"KV cache", "forward_only false"});
  kv.forward_only = true;
  kv.max_batch = 2;
  test::expect_error([&] { LlamaModel::workspace_bytes_for(small_config(false), kv); },
                     {"KV cache", "batch 2"});
}

// Decoding with a KV cache (ModelOptions::kv_cache): a prompt in one call, then one token per
// call, gives the logits of a forward over the whole sequence at every position; a call may
// start again from an earlier position; positions never run, and past the sequence length,
// are refused. With a sliding window the sequence outruns (Mistral's in every layer, Qwen2's in
// some), decoding slides it over the cache as the whole forward slides it.
TEST(LlamaModel, DecodingWithAKvCacheGivesTheWholeSequencesLogits) {
  struct Case {
    Variant variant;
    int64_t window;
    std::vector<bool> sliding_layers;
  };
  const std::vector<Case> cases = {{Variant::untied, 0, {}},
                                   {Variant::tied, 0, {}},
                                   {Variant::qwen2_tied, 0, {}},
                                   {Variant::every_bias, 0, {}},
                                   {Variant::qwen3_tied, 0, {}},
                                   {Variant::gemma, 0, {}},
                                   {Variant::gemma2, 4, {true, false, true}},
                                   {Variant::gemma3, 4, {true, false, true}},
                                   {Variant::smollm3, 0, {}},
                                   {Variant::smollm3, 4, {false, true, false}},
                                   {Variant::granite, 0, {}},
                                   {Variant::untied, 4, {}},
                                   {Variant::qwen2_tied, 3, {false, true, true}}};
  for (const Case& cs : cases)
    for (DType dt : {DType::f32, DType::bf16}) {
      const Variant variant = cs.variant;
      SCOPED_TRACE(
          fmt::format("{} {} window {}", dtype_name(dt), variant_name(variant), cs.window));
      LlamaConfig c = variant_config(variant);
      c.num_hidden_layers = 3;
      if (!c.nope_layers.empty()) c.nope_layers.resize(3, false);
      c.sliding_window = cs.window;
      c.sliding_layers = cs.sliding_layers;
      const int64_t T = 11, V = c.vocab_size, prompt = 4;
      auto device = open_host_device(0, 64ull << 20);
      auto stream = device->create_stream("test");
      ModelOptions o;
      o.param_dtype = dt;
      o.seq_len = T;
      o.forward_only = true;
      ModelOptions kv = o;
      kv.kv_cache = true;
      LlamaModel whole(c, o, *device), decoder(c, kv, *device);
      ResidentWeights w(whole.layout(), *device, dt, DType::f32, false);
      w.init_random(7, *stream);
      randomize_biases(w, whole.layout(), *stream);
      std::vector<int32_t> host_ids(static_cast<size_t>(T));
      for (int64_t i = 0; i < T; ++i) host_ids[static_cast<size_t>(i)] = (i * 13 + 5) % 29;
      const std::vector<int32_t> host_targets(static_cast<size_t>(T), kIgnoreIndex);
      DeviceBuffer ids(*device, T * 4, "ids"), targets(*device, T * 4, "targets");
      DeviceBuffer all(*device, T * V * 4, "logits"), one(*device, V * 4, "last logits");
      device->copy_to_device(ids.data(), host_ids.data(), T * 4, *stream);
      device->copy_to_device(targets.data(), host_targets.data(), T * 4, *stream);
      auto* i = static_cast<int32_t*>(ids.data());
      whole.forward(w.units(), i, static_cast<int32_t*>(targets.data()), 1, false, *stream);
      whole.logits(w.units(), all.view(DType::f32, {T, V}), 1, *stream);
      std::vector<float> want(static_cast<size_t>(T * V)), got(static_cast<size_t>(V));
      device->copy_to_host(want.data(), all.data(), want.size() * 4, *stream);
      stream->synchronize();
      // Position p's logits from decode(), against row p of the whole forward.
      auto check = [&](int64_t pos, int64_t n) {
        decoder.decode(w.units(), i + pos, pos, n, one.view(DType::f32, {1, V}), *stream);
        device->copy_to_host(got.data(), one.data(), got.size() * 4, *stream);
        stream->synchronize();
        const int64_t p = pos + n - 1;
        double worst = 0, scale = 0;
        for (int64_t v = 0; v < V; ++v) {
          const float x = want[static_cast<size_t>(p * V + v)];
          worst = std::max(worst, std::abs(double(got[static_cast<size_t>(v)]) - x));
          scale = std::max(scale, std::abs(double(x)));
        }
        // The attention rows are the same bits; a matmul of one row may sum in another order
        // than one of many, and in bf16 the activations round after each op.
        EXPECT_LE(worst, (dt == DType::f32 ? 1e-5 : 2e-2) * scale)
            << "position " << p << " decoded from " << pos;
        EXPECT_EQ(decoder.cached_positions(), pos + n);
      };
      check(0, prompt);
      for (int64_t p = prompt; p < T; ++p) check(p, 1);
      check(2, 3);  // start again from position 2: positions 2..4 rerun, their cache rewritten
      check(5, 6);  // and on to the end in one call
      const TensorView out = one.view(DType::f32, {1, V});
      test::expect_error([&] { decoder.decode(w.units(), i, 10, 2, out, *stream); },
                         {"positions [10, 12)", "sequence length 11"});
      check(0, 2);
      test::expect_error([&] { decoder.decode(w.units(), i, 4, 1, out, *stream); },
                         {"position 4 follows only 2 cached positions", "[2, 4)"});
      test::expect_error([&] { whole.decode(w.units(), i, 0, 1, out, *stream); },
                         {"without a KV cache"});
    }
}

// LongRoPE while decoding, as transformers chooses per forward: calls whose positions stay
// within the original context (6 here) rotate with the short factors, so they give the logits of
// a whole forward of that length; a call past it rotates with the long ones, so a prompt of 8
// gives those of a whole forward of 11 (which takes the long factors too). The two tables
// differ, so the choice shows.
TEST(LlamaModel, DecodingWithLongRopeChoosesItsFactorsPerCall) {
  LlamaConfig c = small_config(false);
  c.num_hidden_layers = 2;
  c.architecture = Architecture::phi3;
  c.max_position_embeddings = 24;
  c.rope_scaling.kind = RopeScalingKind::longrope;
  c.rope_scaling.original_max_position_embeddings = 6;
  c.rope_scaling.short_factor.assign(static_cast<size_t>(c.head_dim / 2), 1.0);
  c.rope_scaling.long_factor.assign(static_cast<size_t>(c.head_dim / 2), 6.0);
  ASSERT_TRUE(decoding_switches_rope(c, 11));
  ASSERT_FALSE(decoding_switches_rope(c, 6));
  const int64_t V = c.vocab_size;
  auto device = open_host_device(0, 64ull << 20);
  auto stream = device->create_stream("test");
  std::vector<int32_t> host_ids(11);
  for (int64_t i = 0; i < 11; ++i) host_ids[static_cast<size_t>(i)] = (i * 7 + 3) % 29;
  DeviceBuffer ids(*device, 11 * 4, "ids"), targets(*device, 11 * 4, "targets");
  device->copy_to_device(ids.data(), host_ids.data(), 11 * 4, *stream);
  const std::vector<int32_t> ignored(11, kIgnoreIndex);
  device->copy_to_device(targets.data(), ignored.data(), 11 * 4, *stream);
  auto* i = static_cast<int32_t*>(ids.data());
  ModelOptions o;
  o.forward_only = true;
  o.seq_len = 11;
  ModelOptions kv = o;
  kv.kv_cache = true;
  LlamaModel decoder(c, kv, *device);
  ResidentWeights w(decoder.layout(), *device, DType::f32, DType::f32, false);
  w.init_random(3, *stream);
  // Row p of a whole forward over the first `len` tokens.
  auto whole = [&](int64_t len) {
    ModelOptions wo = o;
    wo.seq_len = len;
    LlamaModel m(c, wo, *device);
    DeviceBuffer all(*device, static_cast<uint64_t>(len * V) * 4, "logits");
    m.forward(w.units(), i, static_cast<int32_t*>(targets.data()), 1, false, *stream);
    m.logits(w.units(), all.view(DType::f32, {len, V}), 1, *stream);
    std::vector<float> out(static_cast<size_t>(len * V));
    device->copy_to_host(out.data(), all.data(), out.size() * 4, *stream);
    stream->synchronize();
    return out;
  };
  const std::vector<float> short_rows = whole(6), long_rows = whole(11);
  DeviceBuffer one(*device, static_cast<uint64_t>(V) * 4, "last logits");
  auto decoded = [&](int64_t pos, int64_t n) {
    decoder.decode(w.units(), i + pos, pos, n, one.view(DType::f32, {1, V}), *stream);
    std::vector<float> got(static_cast<size_t>(V));
    device->copy_to_host(got.data(), one.data(), got.size() * 4, *stream);
    stream->synchronize();
    return got;
  };
  auto distance = [&](const std::vector<float>& got, const std::vector<float>& rows, int64_t p) {
    double worst = 0, scale = 0;
    for (int64_t v = 0; v < V; ++v) {
      const double x = rows[static_cast<size_t>(p * V + v)];
      worst = std::max(worst, std::abs(got[static_cast<size_t>(v)] - x));
      scale = std::max(scale, std::abs(x));
    }
    return worst / scale;
  };
  std::vector<float> got = decoded(0, 4);
  EXPECT_LE(distance(got, short_rows, 3), 1e-5);
  EXPECT_GT(distance(got, long_rows, 3), 1e-4) << "the long factors would change position 3";
  for (int64_t p = 4; p < 6; ++p) EXPECT_LE(distance(decoded(p, 1), short_rows, p), 1e-5) << p;
  got = decoded(0, 8);  // a prompt past the original context: long factors for all of it
  EXPECT_LE(distance(got, long_rows, 7), 1e-5);
}

TEST(LlamaModel, CheckpointingDoesNotChangeTheLossAndBackwardNeedsIt) {
  const LlamaConfig c = small_config(false);
  auto device = open_host_device(0, 64ull << 20);
  auto stream = device->create_stream("test");
  ModelOptions o;
  o.max_batch = 1;
  o.seq_len = 7;
  LlamaModel model(c, o, *device);
  ResidentWeights w(model.layout(), *device, DType::f32, DType::f32, true);
  w.init_random(3, *stream);
  std::vector<int32_t> host_ids = {1, 5, 9, 2, 28, 0, 7}, host_targets = {5, 9, 2, 28, 0, 7, 3};
  DeviceBuffer ids(*device, 28, "ids"), targets(*device, 28, "targets");
  device->copy_to_device(ids.data(), host_ids.data(), 28, *stream);
  device->copy_to_device(targets.data(), host_targets.data(), 28, *stream);
  auto* i = static_cast<int32_t*>(ids.data());
  auto* t = static_cast<int32_t*>(targets.data());
  std::vector<float> a(7), b(7);
  model.forward(w.units(), i, t, 1, false, *stream);
  device->copy_to_host(a.data(), model.losses(1).data, 28, *stream);
  test::expect_error([&] { model.backward(w.units(), i, t, 1, 1.0f, *stream); },
                     {"keep_checkpoints"});
  model.forward(w.units(), i, t, 1, true, *stream);
  device->copy_to_host(b.data(), model.losses(1).data, 28, *stream);
  stream->synchronize();
  EXPECT_EQ(a, b);
  // A random init predicts nothing: every loss is close to log(vocab).
  for (float l : a) EXPECT_NEAR(l, std::log(29.0), 0.2);
  test::expect_error([&] { model.forward(w.units(), i, t, 2, false, *stream); }, {"batch of 2"});
  ModelOptions too_long = o;
  too_long.seq_len = 65;
  test::expect_error([&] { LlamaModel m(c, too_long, *device); }, {"max_position_embeddings"});
}

// Evaluation's model (ModelOptions::forward_only): the same losses bit for bit as a training
// model's forward, in two activation slots and no backward scratch; with activation sets, each
// set's slots apart. Backward and kept checkpoints are refused.
TEST(LlamaModel, ForwardOnlyGivesTheSameLossesInLessMemory) {
  for (DType dt : {DType::f32, DType::bf16})
    for (bool recompute : {true, false}) {
      SCOPED_TRACE(fmt::format("{} recompute {}", dtype_name(dt), recompute));
      LlamaConfig c = small_config(false);
      c.num_hidden_layers = 5;  // more units than two slots
      auto device = open_host_device(0, 64ull << 20);
      auto stream = device->create_stream("test");
      ModelOptions o;
      o.param_dtype = dt;
      o.max_batch = 2;
      o.seq_len = 7;
      o.vocab_chunk = 8;
      o.recompute = recompute;
      o.activation_sets = 2;
      ModelOptions f = o;
      f.forward_only = true;
      LlamaModel train(c, o, *device), eval(c, f, *device);
      EXPECT_LT(eval.workspace_bytes(), train.workspace_bytes());
      // The slots: two per set instead of one per unit (5 blocks + head = 6), and no backward
      // scratch: at least the activation gradients and the nine gradient buffers of a block.
      const uint64_t row = 2 * 7 * 16 * dtype_size(dt);
      EXPECT_GE(train.workspace_bytes() - eval.workspace_bytes(), 2 * (6 - 2) * row + 2 * row);
      ResidentWeights w(train.layout(), *device, dt, DType::f32, false);
      w.init_random(5, *stream);
      std::vector<int32_t> host_ids(14), host_targets(14);
      for (int i = 0; i < 14; ++i) {
        host_ids[size_t(i)] = (i * 7 + 3) % 29;
        host_targets[size_t(i)] = (i * 11 + 1) % 29;
      }
      DeviceBuffer ids(*device, 56, "ids"), targets(*device, 56, "targets");
      device->copy_to_device(ids.data(), host_ids.data(), 56, *stream);
      device->copy_to_device(targets.data(), host_targets.data(), 56, *stream);
      auto* i = static_cast<int32_t*>(ids.data());
      auto* t = static_cast<int32_t*>(targets.data());
      std::vector<float> want(14), got(14);
      train.forward(w.units(), i, t, 2, false, *stream);
      device->copy_to_host(want.data(), train.losses(2).data, 56, *stream);
      eval.forward(w.units(), i, t, 2, false, *stream);
      device->copy_to_host(got.data(), eval.losses(2).data, 56, *stream);
      stream->synchronize();
      EXPECT_EQ(got, want);
      // Unit by unit, as the executor runs it, in set 1: each unit's input from checkpoint(u),
      // its output to checkpoint(u + 1), distinct slots.
      const int U = eval.layout().num_units();
      for (int u = 0; u < U; ++u) {
        const TensorView in = u == 0 ? TensorView{} : eval.checkpoint(u, 2, 1);
        const TensorView out = u + 1 < U ? eval.checkpoint(u + 1, 2, 1) : TensorView{};
        if (in.data != nullptr && out.data != nullptr) {
          EXPECT_NE(in.data, out.data);
        }
        if (u > 0) {
          EXPECT_NE(eval.checkpoint(u, 2, 1).data, eval.checkpoint(u, 2, 0).data);
        }
        eval.forward_unit(u, w.units(), i, t, in, out, 2, *stream, 1);
      }
      std::fill(got.begin(), got.end(), 0.0f);
      device->copy_to_host(got.data(), eval.losses(2).data, 56, *stream);
      stream->synchronize();
      EXPECT_EQ(got, want);
      test::expect_error([&] { eval.forward(w.units(), i, t, 2, true, *stream); },
                         {"forward keeping the activation checkpoints", "forward_only"});
      test::expect_error([&] { eval.backward(w.units(), i, t, 2, 1.0f, *stream); },
                         {"backward", "evaluation"});
      test::expect_error(
          [&] {
            eval.backward_unit(U - 1, w.units(), i, t, 1.0f, eval.checkpoint(U - 1, 2, 0),
                               TensorView{}, TensorView{}, 2, *stream, 0);
          },
          {"backward_unit", "evaluation"});
    }
}

// A ring of K activation checkpoint slots (ModelOptions::checkpoint_slots, for checkpoints
// offloaded to the host): position p (block p's input, the head's at p = L) in slot p % K of
// its set, the head pieces' normed input in a slot of its own, L + 1 - K fewer slots per set;
// blocks 0..L-K offloaded; K > L changes nothing; a ring of 1, or one without recompute, is
// refused, and so is the whole-model forward keeping checkpoints.
TEST(LlamaModel, CheckpointSlotsFormARingPerSet) {
  for (const int pieces : {1, 3}) {
    SCOPED_TRACE(pieces);
    LlamaConfig c = small_config(false);
    c.num_hidden_layers = 5;
    c.vocab_pieces = pieces;
    auto device = open_host_device(0, 64ull << 20);
    ModelOptions o;
    o.max_batch = 2;
    o.seq_len = 7;
    o.vocab_chunk = 8;
    o.activation_sets = 2;
    const uint64_t row = 2 * 7 * 16 * 4;
    for (const int K : {2, 3, 5}) {
      SCOPED_TRACE(K);
      ModelOptions r = o;
      r.checkpoint_slots = K;
      LlamaModel all(c, o, *device), ring(c, r, *device);
      EXPECT_EQ(offloaded_checkpoints(c, K), 5 - K + 1);
      EXPECT_EQ(all.workspace_bytes() - ring.workspace_bytes(), 2 * uint64_t(5 + 1 - K) * row);
      EXPECT_EQ(LlamaModel::workspace_bytes_for(c, r), ring.workspace_bytes());
      const ModelLayout& l = ring.layout();
      const int b0 = l.first_block(), U = l.num_units();
      for (int set : {0, 1})
        for (int u = b0; u <= l.first_head(); ++u)
          for (int v = b0; v <= l.first_head(); ++v) {
            const bool same = ring.checkpoint(u, 2, set).data == ring.checkpoint(v, 2, set).data;
            EXPECT_EQ(same, (u - v) % K == 0) << u << " " << v;
            EXPECT_NE(ring.checkpoint(u, 2, set).data, ring.checkpoint(v, 2, 1 - set).data);
          }
      for (int u = l.first_head() + 1; u < U; ++u)  // the normed input, apart from the ring
        for (int v = b0; v <= l.first_head(); ++v)
          EXPECT_NE(ring.checkpoint(u, 2, 0).data, ring.checkpoint(v, 2, 0).data);
      auto stream = device->create_stream("test");
      ResidentWeights w(ring.layout(), *device, DType::f32, DType::f32, false);
      test::expect_error([&] { ring.forward(w.units(), nullptr, nullptr, 2, true, *stream); },
                         {"ring of", "only the executor"});
    }
    ModelOptions wide = o;
    wide.checkpoint_slots = 6;  // more than the 5 blocks: nothing leaves the device
    EXPECT_EQ(offloaded_checkpoints(c, 6), 0);
    EXPECT_EQ(LlamaModel::workspace_bytes_for(c, wide), LlamaModel::workspace_bytes_for(c, o));
    ModelOptions one = o;
    one.checkpoint_slots = 1;
    test::expect_error([&] { LlamaModel m(c, one, *device); },
                       {"checkpoint slots 1", "at least 2"});
    ModelOptions kept = o;
    kept.checkpoint_slots = 2;
    kept.recompute = false;
    test::expect_error([&] { LlamaModel m(c, kept, *device); },
                       {"need activation checkpointing", "--activation-checkpointing on"});
  }
}

// The bf16 path (what the CUDA backend runs): bf16 parameters and activations, f32 gradient
// accumulators, the logits gradient cast to bf16 per chunk. Agrees with f32 to bf16 accuracy.
TEST(LlamaModel, Bf16AgreesWithF32) {
  const LlamaConfig c = small_config(true);
  auto device = open_host_device(0, 64ull << 20);
  auto stream = device->create_stream("test");
  ModelOptions o;
  o.max_batch = 2;
  o.seq_len = 6;
  o.vocab_chunk = 8;
  std::vector<int32_t> host_ids(12), host_targets(12);
  for (int i = 0; i < 12; ++i) {
    host_ids[static_cast<size_t>(i)] = (i * 11 + 2) % 29;
    host_targets[static_cast<size_t>(i)] = (i * 3 + 5) % 29;
  }
  DeviceBuffer ids(*device, 48, "ids"), targets(*device, 48, "targets");
  device->copy_to_device(ids.data(), host_ids.data(), 48, *stream);
  device->copy_to_device(targets.data(), host_targets.data(), 48, *stream);
  auto* i = static_cast<int32_t*>(ids.data());
  auto* t = static_cast<int32_t*>(targets.data());

  std::vector<std::vector<float>> loss(2), grads(2);
  for (int run = 0; run < 2; ++run) {
    o.param_dtype = run == 0 ? DType::f32 : DType::bf16;
    LlamaModel model(c, o, *device);
    ResidentWeights w(model.layout(), *device, o.param_dtype, DType::f32, true);
    w.init_random(17, *stream);
    w.zero_grads(*stream);
    model.forward(w.units(), i, t, 2, true, *stream);
    loss[static_cast<size_t>(run)].resize(12);
    device->copy_to_host(loss[static_cast<size_t>(run)].data(), model.losses(2).data, 48, *stream);
    model.backward(w.units(), i, t, 2, 1.0f / 12, *stream);
    for (int u = 0; u < model.layout().num_units(); ++u) {
      const std::vector<float> g = w.download(u, true, *stream);
      grads[static_cast<size_t>(run)].insert(grads[static_cast<size_t>(run)].end(), g.begin(),
                                             g.end());
    }
  }
  for (size_t k = 0; k < 12; ++k)
    EXPECT_NEAR(loss[1][k], loss[0][k], 0.03 * loss[0][k] + 0.02) << k;
  // Each tensor's gradient within 3% normalised error (bf16 has 8 bits of mantissa; measured
  // about 1% at this init).
  const ModelLayout layout = ModelLayout::build(c);
  size_t base = 0;
  for (const UnitLayout& u : layout.units) {
    for (const ParamSlot& p : u.params) {
      double diff = 0, norm = 0;
      for (int64_t k = 0; k < p.numel(); ++k) {
        const size_t j = base + p.offset + static_cast<size_t>(k);
        diff += (grads[1][j] - grads[0][j]) * (grads[1][j] - grads[0][j]);
        norm += grads[0][j] * grads[0][j];
      }
      EXPECT_GT(norm, 0.0) << p.name;
      EXPECT_LT(std::sqrt(diff / norm), 0.03) << p.name;
    }
    base += u.numel;
  }
}

// Without recompute each block keeps its activations from the forward and its backward redoes
// only the norms and the SwiGLU: the same kernels on the same inputs, so the loss and every
// gradient are the same bits as with recompute, in f32 and bf16, for a full batch and a short
// one (which uses the front of each block's kept buffers), accumulated over two batches. It
// costs more memory for a model of more than one block.
TEST(LlamaModel, WithoutRecomputeTheGradientsAreTheSameBits) {
  for (const auto& [dt, variant] : {std::pair{DType::f32, Variant::untied},
                                    {DType::bf16, Variant::tied},
                                    {DType::f32, Variant::every_bias},
                                    {DType::bf16, Variant::qwen2_tied},
                                    {DType::f32, Variant::qwen3_bias},
                                    {DType::bf16, Variant::qwen3_tied},
                                    {DType::f32, Variant::gemma2},
                                    {DType::bf16, Variant::gemma2},
                                    {DType::bf16, Variant::gemma3},
                                    {DType::bf16, Variant::smollm3},
                                    {DType::bf16, Variant::granite},
                                    {DType::bf16, Variant::pieces},
                                    {DType::bf16, Variant::tied_pieces}}) {
    LlamaConfig c = variant_config(variant);
    c.num_hidden_layers = 3;
    if (!c.nope_layers.empty()) c.nope_layers.resize(3, false);
    auto device = open_host_device(0, 64ull << 20);
    auto stream = device->create_stream("test");
    ModelOptions o;
    o.param_dtype = dt;
    o.max_batch = 3;
    o.seq_len = 6;
    o.vocab_chunk = 8;
    const Tokens tokens(*device, *stream, 18, 29, 3);
    const int32_t* i = tokens.ids_data();
    const int32_t* t = tokens.targets_data();

    std::vector<float> loss[2], grads[2];
    uint64_t workspace[2] = {};
    for (int run = 0; run < 2; ++run) {
      o.recompute = run == 0;
      LlamaModel model(c, o, *device);
      workspace[run] = model.workspace_bytes();
      ResidentWeights w(model.layout(), *device, dt, DType::f32, true);
      w.init_random(5, *stream);
      randomize_biases(w, model.layout(), *stream);
      w.zero_grads(*stream);
      for (int64_t batch : {3, 2}) {
        model.forward(w.units(), i, t, batch, true, *stream);
        std::vector<float> l(static_cast<size_t>(batch * 6));
        device->copy_to_host(l.data(), model.losses(batch).data, l.size() * 4, *stream);
        stream->synchronize();  // the copy lands before l is read (and freed)
        loss[run].insert(loss[run].end(), l.begin(), l.end());
        model.backward(w.units(), i, t, batch, 0.25f, *stream);
      }
      for (int u = 0; u < model.layout().num_units(); ++u) {
        const std::vector<float> g = w.download(u, true, *stream);
        grads[run].insert(grads[run].end(), g.begin(), g.end());
      }
    }
    SCOPED_TRACE(fmt::format("{} {}", dtype_name(dt), variant_name(variant)));
    EXPECT_EQ(loss[0], loss[1]);
    ASSERT_EQ(grads[0].size(), grads[1].size());
    size_t differ = 0, nonzero = 0;
    for (size_t k = 0; k < grads[0].size(); ++k) {
      differ += std::memcmp(&grads[0][k], &grads[1][k], 4) != 0;
      nonzero += grads[0][k] != 0.0f;
    }
    EXPECT_EQ(differ, 0u) << "of " << grads[0].size() << " gradient elements";
    EXPECT_GT(nonzero, grads[0].size() / 2);
    EXPECT_GT(workspace[1], workspace[0]);
  }
}

void vocabulary_pieces_compute_the_whole_models_loss_and_gradients(bool tied) {
  LlamaConfig whole_c = small_config(tied);
  whole_c.vocab_size = 30;
  LlamaConfig cut_c = whole_c;
  cut_c.vocab_pieces = 3;
  const ModelLayout whole_l = ModelLayout::build(whole_c), cut_l = ModelLayout::build(cut_c);
  ASSERT_EQ(cut_l.num_units(), 2 + 2 * 3);
  EXPECT_EQ(cut_l.first_block(), 3);
  EXPECT_EQ(cut_l.first_head(), 5);
  const char* names[] = {"embedding", "embedding.1", "embedding.2", "layers.0",
                         "layers.1",  "head",        "head.1",      "head.2"};
  for (int u = 0; u < cut_l.num_units(); ++u) {
    const UnitLayout& unit = cut_l.units[static_cast<size_t>(u)];
    EXPECT_EQ(unit.name, names[u]);
    EXPECT_EQ(cut_l.input_position(u), u < 3 ? 0 : u < 5 ? u - 3 : u == 5 ? 2 : 3) << unit.name;
    if (unit.kind == UnitKind::block) continue;
    EXPECT_EQ(unit.vocab_first, 10 * unit.piece);
    EXPECT_EQ(unit.vocab_rows, 10);
    if (tied && unit.kind == UnitKind::head) continue;  // below
    const ParamSlot& table = unit.slot(unit.kind == UnitKind::head ? "lm_head" : "embed_tokens");
    EXPECT_EQ(table.file_name,
              unit.kind == UnitKind::head ? "lm_head.weight" : "model.embed_tokens.weight");
    EXPECT_EQ(table.file_row, unit.vocab_first);
    EXPECT_EQ(table.file_shape, (std::vector<int64_t>{30, 16}));
    EXPECT_EQ(table.shape, (Shape{10, 16}));
    EXPECT_EQ(unit.params.size(), unit.kind == UnitKind::head && unit.piece == 0 ? 2u : 1u);
  }
  if (!tied) {
    EXPECT_EQ(cut_l.units[6].params[0].name, "lm_head.weight[10:20]");
  }

  for (const DType dt : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dt));
    auto device = open_host_device(0, 64ull << 20);
    auto stream = device->create_stream("test");
    ModelOptions o;
    o.param_dtype = dt;
    o.max_batch = 2;
    o.seq_len = 6;
    o.vocab_chunk = 5;  // two chunks a piece, the whole head's chunks
    const Tokens tokens(*device, *stream, 12, 30, 7);
    const int32_t* i = tokens.ids_data();
    const int32_t* t = tokens.targets_data();

    LlamaModel whole(whole_c, o, *device), cut(cut_c, o, *device);
    ResidentWeights ww(whole_l, *device, dt, DType::f32, true),
        cw(cut_l, *device, dt, DType::f32, true);
    ww.init_random(9, *stream);
    std::vector<std::vector<float>> whole_values;
    for (int u = 0; u < whole_l.num_units(); ++u)
      whole_values.push_back(ww.download(u, false, *stream));
    auto whole_unit = [&](int v) -> const std::vector<float>& {
      return whole_values[static_cast<size_t>(v)];
    };
    for (int u = 0; u < cut_l.num_units(); ++u)
      cw.upload(u, relaid_unit(whole_l, whole_unit, cut_l, u), *stream);
    ww.zero_grads(*stream);
    cw.zero_grads(*stream);
    std::vector<float> loss[2], logits[2];
    DeviceBuffer all(*device, 12 * 30 * 4, "logits");
    for (int run = 0; run < 2; ++run) {
      LlamaModel& m = run == 0 ? whole : cut;
      ResidentWeights& w = run == 0 ? ww : cw;
      m.forward(w.units(), i, t, 2, true, *stream);
      loss[run].resize(12);
      device->copy_to_host(loss[run].data(), m.losses(2).data, 48, *stream);
      m.backward(w.units(), i, t, 2, 0.1f, *stream);
      // Every row's logits: each piece's columns in their place.
      m.logits(w.units(), all.view(DType::f32, {12, 30}), 2, *stream);
      logits[run].resize(12 * 30);
      device->copy_to_host(logits[run].data(), all.data(), all.bytes(), *stream);
      stream->synchronize();
    }
    EXPECT_EQ(loss[0], loss[1]);
    EXPECT_GT(loss[0][0], 0.0f);
    for (size_t k = 0; k < logits[0].size(); ++k)
      EXPECT_NEAR(logits[1][k], logits[0][k], 1e-6 * std::max(1.0f, std::abs(logits[0][k])))
          << "logit " << k;
    // The gradients, laid out as the whole model's.
    std::vector<std::vector<float>> cut_grads;
    for (int u = 0; u < cut_l.num_units(); ++u) cut_grads.push_back(cw.download(u, true, *stream));
    for (int u = 0; u < whole_l.num_units(); ++u) {
      const std::vector<float> want = ww.download(u, true, *stream);
      const std::vector<float> got = relaid_unit(
          cut_l, [&](int v) -> const std::vector<float>& { return cut_grads[size_t(v)]; }, whole_l,
          u);
      const bool head = whole_l.units[static_cast<size_t>(u)].kind == UnitKind::head;
      double worst = 0, scale = 0;
      size_t differ = 0;
      for (size_t k = 0; k < want.size(); ++k) {
        worst = std::max(worst, std::abs(double(got[k]) - double(want[k])));
        scale = std::max(scale, std::abs(double(want[k])));
        differ += std::memcmp(&got[k], &want[k], 4) != 0;
      }
      EXPECT_GT(scale, 0.0) << whole_l.units[static_cast<size_t>(u)].name;
      if (head && !tied) {  // its own rows' gradients are the same products; the norm's after
        const ParamSlot& lm = whole_l.units[static_cast<size_t>(u)].slot("lm_head");
        for (int64_t k = 0; k < lm.numel(); ++k)
          EXPECT_EQ(got[lm.offset + uint64_t(k)], want[lm.offset + uint64_t(k)]) << "lm_head " << k;
      }
      // bf16 rounds the normed input's gradient after every piece's sum.
      EXPECT_LE(worst, (dt == DType::f32 ? 1e-5 : 2e-2) * scale)
          << whole_l.units[static_cast<size_t>(u)].name << ": " << differ << " elements differ";
    }
  }

  // Decoding: the pieces write their columns of the last token's logits.
  {
    auto device = open_host_device(0, 64ull << 20);
    auto stream = device->create_stream("test");
    ModelOptions o;
    o.seq_len = 6;
    o.forward_only = true;
    o.kv_cache = true;
    LlamaModel whole(whole_c, o, *device), cut(cut_c, o, *device);
    ResidentWeights ww(whole_l, *device, DType::f32, DType::f32, false),
        cw(cut_l, *device, DType::f32, DType::f32, false);
    ww.init_random(3, *stream);
    std::vector<std::vector<float>> values;
    for (int u = 0; u < whole_l.num_units(); ++u) values.push_back(ww.download(u, false, *stream));
    for (int u = 0; u < cut_l.num_units(); ++u)
      cw.upload(u,
                relaid_unit(
                    whole_l, [&](int v) -> const std::vector<float>& { return values[size_t(v)]; },
                    cut_l, u),
                *stream);
    const std::vector<int32_t> prompt = {4, 17, 29, 0, 12};
    DeviceBuffer ids(*device, 20, "ids"), logits(*device, 30 * 4, "logits");
    device->copy_to_device(ids.data(), prompt.data(), 20, *stream);
    std::vector<float> got[2];
    for (int run = 0; run < 2; ++run) {
      LlamaModel& m = run == 0 ? whole : cut;
      ResidentWeights& w = run == 0 ? ww : cw;
      m.decode(w.units(), static_cast<int32_t*>(ids.data()), 0, 4, logits.view(DType::f32, {1, 30}),
               *stream);
      m.decode(w.units(), static_cast<int32_t*>(ids.data()) + 4, 4, 1,
               logits.view(DType::f32, {1, 30}), *stream);
      got[run].resize(30);
      device->copy_to_host(got[run].data(), logits.data(), 120, *stream);
      stream->synchronize();
      EXPECT_EQ(m.cached_positions(), 5);
    }
    for (int k = 0; k < 30; ++k) EXPECT_NEAR(got[1][size_t(k)], got[0][size_t(k)], 1e-6) << k;
  }
}

// The embedding and the head cut into vocabulary pieces compute what the whole model computes
// from the same weights: the same losses bit for bit (the pieces' rows are whole chunks of the
// loss), the head's gradients the same bits, the others' to rounding (the pieces add the normed
// input's gradient in another order); decoding gives the same logits. Tied, the head's pieces
// read (and add their gradients into) the embedding's pieces of their rows, with the same
// results. A layout's units, names and file rows; the pieces chosen for Llama 3 8B; bad counts
// refused.
TEST(LlamaModel, VocabularyPiecesComputeTheWholeModelsLossAndGradients) {
  for (const bool tied : {false, true}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    vocabulary_pieces_compute_the_whole_models_loss_and_gradients(tied);
  }
  // Tied: the head's pieces hold the final norm (piece 0) or a buffer of padding, and read the
  // embedding's piece of their rows.
  LlamaConfig tied_c = small_config(true);
  tied_c.vocab_size = 30;
  tied_c.vocab_pieces = 3;
  const ModelLayout tied_l = ModelLayout::build(tied_c);
  ASSERT_EQ(tied_l.num_units(), 2 + 2 * 3);
  for (int u = 0; u < tied_l.num_units(); ++u) {
    const UnitLayout& unit = tied_l.units[static_cast<size_t>(u)];
    EXPECT_EQ(tied_l.table_unit(u), u < 5 ? -1 : u - 5) << unit.name;
    if (unit.kind != UnitKind::head) continue;
    EXPECT_EQ(unit.vocab_first, 10 * unit.piece);
    EXPECT_EQ(unit.params.size(), unit.piece == 0 ? 1u : 0u);
    if (unit.piece > 0) {
      EXPECT_EQ(unit.numel, ModelLayout::kAlign);
    }
  }
  EXPECT_EQ(tied_l.units[1].params[0].name, "model.embed_tokens.weight[10:20]");
  EXPECT_EQ(tied_l.units[1].params[0].file_row, 10);
  EXPECT_EQ(ModelLayout::build(small_config(false)).table_unit(3), 3);

  // Chosen: Llama 3 8B's 525M-element tables in three pieces of 42,752 rows (175M elements),
  // each smaller than a block (218M); Llama 2 7B's table (131M) is smaller than a block: whole.
  // Gemma 2 9B's tied table (917M) in five of 51,200 rows (183M, a block 198M).
  const ModelLayout l3 = ModelLayout::build(*find_preset("llama3-8b"));
  EXPECT_EQ(l3.vocab_pieces, 3);
  EXPECT_EQ(l3.units[0].vocab_rows, 42752);
  EXPECT_EQ(l3.units[2].vocab_first, 2 * 42752);
  EXPECT_EQ(l3.units[2].vocab_rows, 42752);
  uint64_t largest = 0;
  for (const UnitLayout& u : l3.units) largest = std::max(largest, u.numel);
  EXPECT_EQ(largest, l3.units[static_cast<size_t>(l3.first_block())].numel);
  EXPECT_EQ(ModelLayout::build(*find_preset("llama2-7b")).vocab_pieces, 1);
  const ModelLayout g2 = ModelLayout::build(*find_preset("gemma2-9b"));
  EXPECT_EQ(g2.vocab_pieces, 5);
  EXPECT_EQ(g2.units[0].vocab_rows, 51200);
  EXPECT_EQ(g2.table_unit(g2.first_head() + 4), 4);
  LlamaConfig bad = small_config(false);
  bad.vocab_size = 30;
  bad.vocab_pieces = 31;
  test::expect_error([&] { (void)ModelLayout::build(bad); }, {"31 vocabulary pieces", "30"});
  bad.vocab_pieces = 7;  // pieces of 5 rows make 6
  test::expect_error([&] { (void)ModelLayout::build(bad); }, {"7 vocabulary pieces", "choose 6"});
}

TEST(LlamaModel, RandomInitIsDeterministicAndScaled) {
  const LlamaConfig c = small_config(false);
  const ModelLayout layout = ModelLayout::build(c);
  std::vector<float> a(layout.units[1].numel), b(layout.units[1].numel), d(layout.units[1].numel);
  init_unit_random(layout, 1, 42, DType::f32, a.data());
  init_unit_random(layout, 1, 42, DType::f32, b.data());
  init_unit_random(layout, 1, 43, DType::f32, d.data());
  EXPECT_EQ(a, b);
  EXPECT_NE(a, d);
  const ParamSlot& norm = layout.units[1].slot("input_layernorm");
  for (int64_t i = 0; i < norm.numel(); ++i)
    EXPECT_EQ(a[norm.offset + static_cast<uint64_t>(i)], 1.0f);
  const ParamSlot& up = layout.units[1].slot("up_proj");
  double sq = 0;
  for (int64_t i = 0; i < up.numel(); ++i)
    sq += a[up.offset + static_cast<uint64_t>(i)] * a[up.offset + static_cast<uint64_t>(i)];
  EXPECT_NEAR(std::sqrt(sq / static_cast<double>(up.numel())), 0.02, 0.003);
}

// Tensors are made in pieces of 65536 elements, in parallel: the bits do not depend on the
// threads, and every piece draws its own numbers.
TEST(LlamaModel, RandomInitIsTheSameOnAnyNumberOfThreads) {
  LlamaConfig c = small_config(false);
  c.hidden_size = 256;
  c.intermediate_size = 384;  // gate, up, down: 98304 elements, a piece and a part
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 64;
  const ModelLayout layout = ModelLayout::build(c);
  const uint64_t n = layout.units[1].numel;
  std::vector<float> one(n, -7.0f), many(n, -7.0f);
  tbb::task_arena(1).execute([&] { init_unit_random(layout, 1, 9, DType::f32, one.data()); });
  tbb::task_arena(4).execute([&] { init_unit_random(layout, 1, 9, DType::f32, many.data()); });
  EXPECT_EQ(0, std::memcmp(one.data(), many.data(), n * 4));
  const ParamSlot& up = layout.units[1].slot("up_proj");
  ASSERT_GT(up.numel(), 65536);
  const float* w = one.data() + up.offset;
  EXPECT_NE(std::vector<float>(w, w + 64), std::vector<float>(w + 65536, w + 65536 + 64));
  double sum = 0, sq = 0;
  for (int64_t i = 0; i < up.numel(); ++i) {
    sum += w[i];
    sq += double(w[i]) * w[i];
  }
  EXPECT_NEAR(sum / double(up.numel()), 0.0, 3e-4);
  EXPECT_NEAR(std::sqrt(sq / double(up.numel())), 0.02, 3e-4);
  // Padding after each tensor is zero, never left as it was.
  for (uint64_t i = 0; i < n; ++i) ASSERT_NE(one[i], -7.0f) << i;
}

}  // namespace
}  // namespace strata
