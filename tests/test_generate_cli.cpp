// test_generate_cli.cpp: `strata generate` as a user runs it, on tiny checkpoints written here,
// against a greedy decoder built in the test from LlamaModel::logits on the host backend (the
// model rebuilt at each exact length, so the tool's padding of the sequence is checked too);
// plus newest_checkpoint() on run directories with complete and incomplete checkpoints.
#include "host/host_device.h"
#include "model/config.h"
#include "model/llama.h"
#include "model/safetensors.h"
#include "model/weights.h"
#include "sentencepiece_testing.h"
#include "hf_tokenizer_testing.h"
#include "testing.h"
#include "train/checkpoint_dir.h"
#include "train/tokenizer.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <numeric>
#include <limits>
#include <set>

namespace strata {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using Result = test::CommandResult;

constexpr uint32_t kByteEos = 256;
constexpr int64_t kByteVocab = 257;

Result strata(const std::string& args, const std::string& redirect = "2>&1") {
  return test::run_command(std::string("'") + STRATA_BINARY + "' " + args + " " + redirect);
}

json generate_json(const std::string& args, const std::string& devices = "host") {
  const std::string cmd = "generate --devices " + devices + " --json " + args;
  const Result r = strata(cmd, "2>/dev/null");
  EXPECT_EQ(r.status, 0) << strata(cmd).out;
  const json j = json::parse(r.out, nullptr, false);
  EXPECT_FALSE(j.is_discarded()) << r.out;
  return j;
}

std::vector<uint32_t> tokens_of(const json& j) {
  return j.at("tokens").get<std::vector<uint32_t>>();
}

// Unit u's values from init_unit_random(seed), changed by `edit` (may be empty).
using UnitEdit = std::function<void(const UnitLayout&, std::vector<float>&)>;

void write_checkpoint(const fs::path& dir, const LlamaConfig& c, uint64_t seed,
                      const UnitEdit& edit = {}) {
  fs::create_directories(dir);
  const ModelLayout layout = ModelLayout::build(c);
  std::vector<std::vector<float>> units(static_cast<size_t>(layout.num_units()));
  std::vector<SafetensorsTensor> tensors;
  for (int u = 0; u < layout.num_units(); ++u) {
    const UnitLayout& unit = layout.units[static_cast<size_t>(u)];
    auto& v = units[static_cast<size_t>(u)];
    v.resize(unit.numel);
    init_unit_random(layout, u, seed, DType::f32, v.data());
    if (edit) edit(unit, v);
    for (const ParamSlot& p : unit.params)
      tensors.push_back(
          {p.name, DType::f32,
           std::vector<int64_t>(p.shape.dims.begin(), p.shape.dims.begin() + p.shape.rank),
           v.data() + p.offset});
  }
  write_safetensors(dir / "model.safetensors", tensors, {{"format", "pt"}});
  std::ofstream(dir / "config.json") << to_hf_config_json(c).dump(2);
}

// The model of a checkpoint on the host backend, and the logits of a sequence's last position.
class Reference {
 public:
  Reference(const LlamaConfig& c, const fs::path& checkpoint)
      : config_(c),
        layout_(ModelLayout::build(c)),
        device_(open_host_device(0, 256ull << 20)),
        stream_(device_->create_stream("reference")),
        weights_(layout_, *device_, DType::f32, DType::f32, false) {
    weights_.load(SafetensorsReader::open(checkpoint), *stream_);
  }

  // Built at exactly the sequence's length: no padding.
  std::vector<float> last_logits(const std::vector<uint32_t>& seq) {
    const auto T = static_cast<int64_t>(seq.size());
    const int64_t V = config_.vocab_size;
    ModelOptions o;
    o.seq_len = T;
    LlamaModel model(config_, o, *device_);
    std::vector<int32_t> ids(seq.begin(), seq.end());
    const std::vector<int32_t> targets(seq.size(), kIgnoreIndex);
    DeviceBuffer d_ids(*device_, static_cast<uint64_t>(T) * 4, "ids");
    DeviceBuffer d_targets(*device_, static_cast<uint64_t>(T) * 4, "targets");
    DeviceBuffer d_logits(*device_, static_cast<uint64_t>(T * V) * 4, "logits");
    device_->copy_to_device(d_ids.data(), ids.data(), ids.size() * 4, *stream_);
    device_->copy_to_device(d_targets.data(), targets.data(), targets.size() * 4, *stream_);
    model.forward(weights_.units(), static_cast<int32_t*>(d_ids.data()),
                  static_cast<int32_t*>(d_targets.data()), 1, false, *stream_);
    model.logits(weights_.units(), d_logits.view(DType::f32, {T, V}), 1, *stream_);
    std::vector<float> all(static_cast<size_t>(T * V));
    device_->copy_to_host(all.data(), d_logits.data(), all.size() * 4, *stream_);
    stream_->synchronize();
    return std::vector<float>(all.end() - V, all.end());
  }

  // Greedy decoding among ids below `candidates`, stopping at `eos` or after `max_new` tokens;
  // with a repetition penalty, Hugging Face's: the f32 logit of each id in the sequence so far
  // divided by it where positive, multiplied by it where negative.
  // `no_repeat` n: an id that would end an n-gram already in the sequence is never taken (the
  // n-grams collected in a set, the candidate's looked up).
  std::vector<uint32_t> greedy(const std::vector<uint32_t>& prompt, int64_t max_new,
                               int64_t candidates, uint32_t eos, float penalty = 1.0f,
                               size_t no_repeat = 0) {
    std::vector<uint32_t> seq = prompt, out;
    while (static_cast<int64_t>(out.size()) < max_new) {
      std::vector<float> l = last_logits(seq);
      const std::set<uint32_t> seen(seq.begin(), seq.end());
      for (uint32_t id : seen) l[id] = l[id] > 0 ? l[id] / penalty : l[id] * penalty;
      if (no_repeat > 0 && seq.size() + 1 >= no_repeat) {
        std::set<std::vector<uint32_t>> grams;
        for (size_t s = 0; s + no_repeat <= seq.size(); ++s)
          grams.emplace(seq.begin() + s, seq.begin() + s + no_repeat);
        std::vector<uint32_t> next(seq.end() - (no_repeat - 1), seq.end());
        next.push_back(0);
        for (uint32_t id = 0; id < static_cast<uint32_t>(candidates); ++id) {
          next.back() = id;
          if (grams.count(next)) l[id] = -std::numeric_limits<float>::infinity();
        }
      }
      const auto best =
          static_cast<uint32_t>(std::max_element(l.begin(), l.begin() + candidates) - l.begin());
      out.push_back(best);
      seq.push_back(best);
      if (best == eos) break;
    }
    return out;
  }

 private:
  LlamaConfig config_;
  ModelLayout layout_;
  std::unique_ptr<Device> device_;
  std::unique_ptr<Stream> stream_;
  ResidentWeights weights_;
};

// The ids below `candidates` (the tokenizer's vocabulary, which may be smaller than the
// model's) by logit, largest first (a stable sort: lower id first on ties).
std::vector<uint32_t> ranked(const std::vector<float>& logits, int64_t candidates) {
  std::vector<uint32_t> order(static_cast<size_t>(candidates));
  std::iota(order.begin(), order.end(), 0u);
  std::stable_sort(order.begin(), order.end(),
                   [&](uint32_t x, uint32_t y) { return logits[x] > logits[y]; });
  return order;
}

// Replays `tokens` after `prompt` with the reference's own logits: each must rank (ranked())
// below allowed(logits, ranking), the count of the tokens the sampler may draw there (at least
// 1). The check says something only if, somewhere, more than one was allowed and one that was
// not the most likely was drawn: both are required.
template <typename Allowed>
void expect_each_token_allowed(Reference& ref, std::vector<uint32_t> seq,
                               const std::vector<uint32_t>& tokens, const Allowed& allowed) {
  ASSERT_FALSE(tokens.empty());
  int not_top = 0, sizes = 0;
  for (uint32_t id : tokens) {
    const std::vector<float> l = ref.last_logits(seq);
    const std::vector<uint32_t> order = ranked(l, kByteVocab);
    const size_t size = allowed(l, order);
    const auto rank = std::find(order.begin(), order.end(), id) - order.begin();
    EXPECT_LT(static_cast<size_t>(rank), std::max<size_t>(size, 1))
        << "token " << id << " after " << seq.size() << " tokens";
    not_top += rank > 0;
    sizes += size > 1;
    seq.push_back(id);
    if (id == kByteEos) break;
  }
  EXPECT_GT(sizes, 0);
  EXPECT_GT(not_top, 0);
}

std::vector<uint32_t> bytes_of(std::string_view s) {
  return std::vector<uint32_t>(reinterpret_cast<const unsigned char*>(s.data()),
                               reinterpret_cast<const unsigned char*>(s.data()) + s.size());
}

class GenerateCli : public ::testing::Test {
 protected:
  void SetUp() override { write_checkpoint(model_dir(), tiny(), 3); }
  static LlamaConfig tiny() { return *find_preset("tiny"); }
  fs::path model_dir() const { return tmp_.path / "model"; }
  std::string model_arg() const { return "--model '" + model_dir().string() + "'"; }

  test::TempDir tmp_{"strata_generate_cli"};
};

TEST_F(GenerateCli, GreedyIsTheArgmaxOfTheModelsLogits) {
  const std::string prompt = "Hello, world";
  Reference ref(tiny(), model_dir());
  const std::vector<uint32_t> expected = ref.greedy(bytes_of(prompt), 24, kByteVocab, kByteEos);
  ASSERT_FALSE(expected.empty());

  const std::string args = "--prompt '" + prompt + "' --temperature 0 --max-new-tokens 24 ";
  const json j = generate_json(model_arg() + " " + args);
  EXPECT_EQ(tokens_of(j), expected);
  // Deterministic, and the preset with the same init seed is the same model.
  EXPECT_EQ(tokens_of(generate_json(model_arg() + " " + args)), expected);
  EXPECT_EQ(tokens_of(generate_json("--model tiny --init random --seed 3 " + args)), expected);
  EXPECT_NE(tokens_of(generate_json("--model tiny --init random --seed 4 " + args)), expected);

  // Plain output: the prompt, then the generated bytes as they are (end-of-text dropped).
  const Result plain = strata("generate --devices host " + model_arg() + " " + args, "2>/dev/null");
  ASSERT_EQ(plain.status, 0);
  std::string text = prompt;
  for (uint32_t t : expected)
    if (t != kByteEos) text.push_back(static_cast<char>(t));
  EXPECT_EQ(plain.out, text + "\n");
}

// On a GPU the KV cache's decoding (the attention of one query against the cached keys, the
// SIMT kernel) gives the host reference's greedy tokens in f32, and runs in bf16.
TEST_F(GenerateCli, OnAGpuGreedyIsTheHostsArgmax) {
  STRATA_SKIP_UNLESS_THE_BINARY_HAS_A_GPU();
  const std::string prompt = "Once upon a time";
  Reference ref(tiny(), model_dir());
  const std::vector<uint32_t> expected = ref.greedy(bytes_of(prompt), 20, kByteVocab, kByteEos);
  const std::string args = model_arg() + " --prompt '" + prompt +
                           "' --temperature 0 --max-new-tokens 20 --device-memory 1GiB ";
  const json f32 = generate_json(args + "--dtype f32", "cuda:0");
  EXPECT_EQ(f32["device"], "cuda:0");
  EXPECT_EQ(tokens_of(f32), expected);
  const json bf16 = generate_json(args + "--dtype bf16", "cuda:0");
  EXPECT_EQ(bf16["dtype"], "bf16");
  EXPECT_TRUE(bf16["new_tokens"] == 20 || bf16["stop"] == "eos") << bf16;
}

TEST_F(GenerateCli, JsonFieldsAndMaxNewTokens) {
  Reference ref(tiny(), model_dir());
  const std::vector<uint32_t> greedy = ref.greedy(bytes_of("abc"), 17, kByteVocab, kByteEos);
  for (int64_t n : {1, 5, 17}) {
    SCOPED_TRACE(n);
    const json j = generate_json(model_arg() + " --prompt abc --temperature 0 --max-new-tokens " +
                                 std::to_string(n));
    for (const char* key : {"prompt", "text", "tokens", "new_tokens", "prompt_tokens", "stop"})
      EXPECT_TRUE(j.contains(key)) << key << " missing from " << j;
    EXPECT_EQ(j["prompt"], "abc");
    EXPECT_EQ(j["prompt_tokens"], json::array({97, 98, 99}));
    const std::vector<uint32_t> tokens = tokens_of(j);
    EXPECT_EQ(j["new_tokens"].get<size_t>(), tokens.size());
    EXPECT_LE(static_cast<int64_t>(tokens.size()), n);
    const auto want = std::vector<uint32_t>(
        greedy.begin(), greedy.begin() + std::min<int64_t>(n, static_cast<int64_t>(greedy.size())));
    EXPECT_EQ(tokens, want);
    EXPECT_EQ(j["stop"], tokens.back() == kByteEos ? "eos" : "max_new_tokens");
    // The text is valid JSON; with bytes that are not UTF-8 it holds U+FFFD instead.
    EXPECT_TRUE(j["text"].is_string());
  }
  // Sampled tokens (temperature 1, every candidate): exactly max-new-tokens of them unless
  // end-of-text came first, all inside the byte vocabulary.
  const json s =
      generate_json(model_arg() + " --prompt abc --temperature 1 --top-k 0 --max-new-tokens 40");
  const std::vector<uint32_t> t = tokens_of(s);
  EXPECT_TRUE(t.size() == 40 || (!t.empty() && t.back() == kByteEos)) << s;
  for (uint32_t id : t) EXPECT_LT(id, kByteVocab);

  // The context (tiny's 256 positions) ends generation before max-new-tokens.
  const json full = generate_json(model_arg() + " --prompt " + std::string(250, 'a') +
                                  " --temperature 0 --max-new-tokens 20");
  EXPECT_EQ(full["new_tokens"], 6);
  EXPECT_EQ(full["stop"], "context");
}

TEST_F(GenerateCli, SamplingFollowsTheSeedAndTopK) {
  const std::string args =
      model_arg() + " --prompt 'Once upon a time' --temperature 1 --max-new-tokens 48 --top-k ";
  const std::vector<uint32_t> a = tokens_of(generate_json(args + "0 --seed 5"));
  EXPECT_EQ(tokens_of(generate_json(args + "0 --seed 5")), a);
  // A random tiny model is close to uniform over 257 ids: 48 equal draws do not happen by chance.
  EXPECT_NE(tokens_of(generate_json(args + "0 --seed 6")), a);

  // top-k 1 is greedy, whatever the temperature.
  const std::vector<uint32_t> greedy =
      tokens_of(generate_json(model_arg() + " --prompt 'Once upon a time' --temperature 0 "
                                            "--max-new-tokens 48"));
  EXPECT_EQ(tokens_of(generate_json(args + "1 --seed 9")), greedy);

  // top-k 3: every sampled token is among the three largest logits after its prefix, and over
  // 48 tokens not every one is the largest.
  const std::vector<uint32_t> k3 = tokens_of(generate_json(args + "3 --seed 5"));
  ASSERT_FALSE(k3.empty());
  Reference ref(tiny(), model_dir());
  std::vector<uint32_t> seq = bytes_of("Once upon a time");
  int not_top = 0;
  for (uint32_t id : k3) {
    const std::vector<float> l = ref.last_logits(seq);
    const std::vector<uint32_t> order = ranked(l, kByteVocab);
    const auto rank = std::find(order.begin(), order.end(), id) - order.begin();
    EXPECT_LT(rank, 3) << "token " << id << " after " << seq.size() << " tokens";
    not_top += rank > 0;
    seq.push_back(id);
  }
  EXPECT_GT(not_top, 0);
}

// A checkpoint whose blocks add nothing and whose head makes end-of-text win by far: generation
// stops after one token.
// --top-p (the nucleus, as Hugging Face's top_p): each sampled token lies among the most likely
// tokens whose probabilities before it sum to less than p; a tiny p is greedy; p = 1 changes
// nothing; the seed still decides. Probabilities from the test's own full-sequence logits.
TEST_F(GenerateCli, TopPSamplesFromTheNucleus) {
  const std::string prompt = "Once upon a time";
  const std::string args = model_arg() + " --prompt '" + prompt +
                           "' --temperature 0.05 --top-k 0 --max-new-tokens 32 --seed 5 ";
  const std::vector<uint32_t> all = tokens_of(generate_json(args));
  EXPECT_EQ(tokens_of(generate_json(args + "--top-p 1")), all);
  const std::vector<uint32_t> greedy = tokens_of(generate_json(
      model_arg() + " --prompt '" + prompt + "' --temperature 0 --max-new-tokens 32"));
  EXPECT_EQ(tokens_of(generate_json(args + "--top-p 1e-9")), greedy);

  const double p = 0.6;
  const json j = generate_json(args + "--top-p 0.6");
  EXPECT_EQ(j["top_p"].get<double>(), p);
  const std::vector<uint32_t> nucleus = tokens_of(j);
  ASSERT_FALSE(nucleus.empty());
  EXPECT_EQ(tokens_of(generate_json(args + "--top-p 0.6")), nucleus);
  Reference ref(tiny(), model_dir());
  // The nucleus's size, with a little room for the tool's logits rounding differently.
  const auto nucleus_size = [p](const std::vector<float>& l, const std::vector<uint32_t>& order) {
    std::vector<double> w(order.size());
    double total = 0;
    for (size_t i = 0; i < order.size(); ++i)
      total += w[i] = std::exp((double(l[order[i]]) - l[order[0]]) / 0.05);
    size_t size = 0;
    for (double before = 0; size < order.size() && before < (p + 1e-3) * total;)
      before += w[size++];
    return size;
  };
  expect_each_token_allowed(ref, bytes_of(prompt), nucleus, nucleus_size);

  for (const char* bad : {"0", "-0.5", "1.5", "nan"}) {
    const Result r =
        strata("generate --devices host " + model_arg() + " --prompt x --top-p " + bad);
    EXPECT_NE(r.status, 0) << bad;
    EXPECT_NE(r.out.find("--top-p"), std::string::npos) << r.out;
  }
}

// Hugging Face's repetition_penalty, greedy or sampled (every id already in the text, the prompt
// included: its f32 logit divided by the penalty where positive, multiplied where negative), from
// the flag or generation_config.json, against the test's own penalised argmax decoder; and
// min_p: only tokens at least min_p of the most likely one's probability are drawn (min_p 1 is
// greedy). Bad values are named.
TEST_F(GenerateCli, RepetitionPenaltyAndMinP) {
  Reference ref(tiny(), model_dir());
  const std::string prompt = "Once upon a time";
  const std::string head = model_arg() + " --prompt '" + prompt + "' --max-new-tokens 24 ";
  const std::vector<uint32_t> plain = ref.greedy(bytes_of(prompt), 24, kByteVocab, kByteEos);
  const std::vector<uint32_t> penalised =
      ref.greedy(bytes_of(prompt), 24, kByteVocab, kByteEos, 1.5f);
  EXPECT_NE(penalised, plain) << "the penalty changes nothing for this model and prompt";
  EXPECT_EQ(tokens_of(generate_json(head + "--temperature 0 --repetition-penalty 1.5")), penalised);
  EXPECT_EQ(tokens_of(generate_json(head + "--temperature 0 --repetition-penalty 1")), plain);
  std::ofstream(model_dir() / "generation_config.json")
      << R"({"do_sample": false, "repetition_penalty": 1.5})";
  const json from_file = generate_json(head);
  EXPECT_EQ(tokens_of(from_file), penalised);
  EXPECT_EQ(from_file["repetition_penalty"], 1.5);
  fs::remove(model_dir() / "generation_config.json");

  const std::string sampled = head + "--temperature 0.05 --top-k 0 ";
  for (const char* seed : {"1", "2"})
    EXPECT_EQ(tokens_of(generate_json(sampled + "--min-p 1 --seed " + seed)), plain) << seed;
  const double min_p = 0.3;
  const json j = generate_json(sampled + "--min-p 0.3 --seed 5");
  EXPECT_EQ(j["min_p"].get<double>(), min_p);
  // The tokens within min_p of the most likely, with a little room for rounding.
  const auto within_min_p = [min_p](const std::vector<float>& l,
                                    const std::vector<uint32_t>& order) {
    size_t size = 0;
    while (size < order.size() &&
           std::exp((double(l[order[size]]) - l[order[0]]) / 0.05) >= min_p - 1e-3)
      ++size;
    return size;
  };
  expect_each_token_allowed(ref, bytes_of(prompt), tokens_of(j), within_min_p);

  for (const auto& [flags, part] :
       {std::pair{"--repetition-penalty 0", "--repetition-penalty 0 must be a finite number > 0"},
        std::pair{"--min-p 1.5", "--min-p 1.5 must be in [0, 1]"}}) {
    const Result r = strata("generate --devices host " + head + flags);
    EXPECT_NE(r.status, 0) << flags;
    EXPECT_NE(r.out.find(part), std::string::npos) << r.out;
  }
}

// Hugging Face's no_repeat_ngram_size: greedy decoding that repeats itself (this model and prompt
// loop) never repeats a bigram, or with 1 a byte, of the prompt and what it wrote, each token the
// most likely of those left (the reference bans them from its own set of the n-grams); from the
// flag and from generation_config.json alike.
TEST_F(GenerateCli, NoRepeatNgramSize) {
  Reference ref(tiny(), model_dir());
  const std::string prompt = "Once upon a time";
  const std::string head = model_arg() + " --prompt '" + prompt + "' --max-new-tokens 24 ";
  const std::vector<uint32_t> plain = ref.greedy(bytes_of(prompt), 24, kByteVocab, kByteEos);
  std::vector<uint32_t> all = bytes_of(prompt);
  all.insert(all.end(), plain.begin(), plain.end());
  std::set<std::pair<uint32_t, uint32_t>> bigrams;
  bool repeats = false;
  for (size_t i = 1; i < all.size(); ++i) repeats |= !bigrams.insert({all[i - 1], all[i]}).second;
  ASSERT_TRUE(repeats) << "greedy decoding repeats no bigram here: the test proves nothing";
  for (const size_t n : {size_t{1}, size_t{2}, size_t{3}}) {
    SCOPED_TRACE(n);
    const std::vector<uint32_t> want =
        ref.greedy(bytes_of(prompt), 24, kByteVocab, kByteEos, 1.0f, n);
    EXPECT_NE(want, plain);
    const json j =
        generate_json(head + fmt::format("--temperature 0 --no-repeat-ngram-size {}", n));
    EXPECT_EQ(tokens_of(j), want);
    EXPECT_EQ(j["no_repeat_ngram_size"], n);
  }
  std::ofstream(model_dir() / "generation_config.json")
      << R"({"do_sample": false, "no_repeat_ngram_size": 2})";
  EXPECT_EQ(tokens_of(generate_json(head)),
            ref.greedy(bytes_of(prompt), 24, kByteVocab, kByteEos, 1.0f, 2));
  std::ofstream(model_dir() / "generation_config.json")
      << R"({"do_sample": false, "no_repeat_ngram_size": 2.5})";
  Result r = strata("generate --devices host " + head);
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.out.find("no_repeat_ngram_size is 2.5; expected a whole number >= 0"),
            std::string::npos)
      << r.out;
  fs::remove(model_dir() / "generation_config.json");
  r = strata("generate --devices host " + head + "--no-repeat-ngram-size -1");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.out.find("--no-repeat-ngram-size -1 must be >= 0"), std::string::npos) << r.out;
}

// Parameters in host RAM or on NVMe, or ZeRO-3 partitioned over several devices: the executor's
// forward-only schedule decodes (Executor::decode) and samples the resident model's tokens; a
// placement that does not fit is refused with the table before anything starts.
TEST_F(GenerateCli, OffloadedOrPartitionedParametersGiveTheResidentTokens) {
  const std::string args = model_arg() +
                           " --prompt 'Once upon a time' --temperature 1 --top-k 0 --seed 7 "
                           "--max-new-tokens 24 ";
  const json resident = generate_json(args);
  EXPECT_EQ(resident["parameters"], "resident");
  const std::string swap = (tmp_.path / "swap").string();
  fs::create_directories(swap);
  struct Run {
    std::string devices, flags, parameters;
  };
  for (const Run& r :
       {Run{"host", "--offload-param cpu --persistence-threshold 0", "cpu 4"},
        Run{"host", "--offload-param nvme --persistence-threshold 0 --nvme-path '" + swap + "'",
            "nvme 4"},
        Run{"host:2", "", "gpu 4"},
        Run{"host:3", "--persistence-threshold 0 --offload-param auto --prefetch-depth 2",
            "gpu 4"}}) {
    SCOPED_TRACE(r.devices + " " + r.flags);
    const json j = generate_json(args + r.flags, r.devices);
    EXPECT_EQ(j["parameters"], r.parameters);
    EXPECT_EQ(j["devices"].size(), r.devices == "host" ? 1u : r.devices.back() - '0');
    EXPECT_EQ(tokens_of(j), tokens_of(resident));
  }
  const Result refused = strata("generate --devices host:2 --device-memory 512KiB " + args);
  EXPECT_EQ(refused.status, 1) << refused.out;
  for (const char* what :
       {"placement does not fit", "nothing was allocated", "a lower --persistence-threshold"})
    EXPECT_NE(refused.out.find(what), std::string::npos) << what << "\n" << refused.out;
}

TEST_F(GenerateCli, StopsAtEndOfText) {
  const LlamaConfig c = tiny();
  ASSERT_FALSE(c.tie_word_embeddings);
  const int64_t D = c.hidden_size;
  write_checkpoint(tmp_.path / "eos", c, 3, [&](const UnitLayout& unit, std::vector<float>& v) {
    auto fill = [&](std::string_view name, const std::function<void(float*, int64_t)>& f) {
      const ParamSlot& p = unit.slot(name);
      f(v.data() + p.offset, p.numel());
    };
    if (unit.kind == UnitKind::embedding)
      fill("embed_tokens", [&](float* w, int64_t n) {
        for (int64_t r = 0; r < n / D; ++r) w[r * D] = 1.0f;  // column 0 positive everywhere
      });
    if (unit.kind == UnitKind::block)
      for (const char* name : {"o_proj", "down_proj"})
        fill(name, [](float* w, int64_t n) { std::fill(w, w + n, 0.0f); });
    if (unit.kind == UnitKind::head)
      fill("lm_head", [&](float* w, int64_t n) {
        for (int64_t r = 0; r < n / D; ++r) w[r * D] = r == kByteEos ? 100.0f : 0.0f;
      });
  });
  const std::string model = "--model '" + (tmp_.path / "eos").string() + "' --prompt hi ";
  for (const char* sampling : {"--temperature 0", "--temperature 0.8 --top-k 40"}) {
    const json j = generate_json(model + sampling);
    EXPECT_EQ(j["tokens"], json::array({kByteEos})) << j;
    EXPECT_EQ(j["new_tokens"], 1);
    EXPECT_EQ(j["stop"], "eos");
    EXPECT_EQ(j["text"], "");
  }
}

TEST_F(GenerateCli, RunDirectoryUsesItsNewestCompleteCheckpoint) {
  const fs::path run = tmp_.path / "run";
  fs::create_directories(run / "checkpoints");
  fs::copy(model_dir(), run / "checkpoints" / "step-2");
  std::ofstream(run / "checkpoints" / "step-2" / "COMPLETE");
  // step-5 was being written when the run stopped: a config and no weights, no marker.
  fs::create_directories(run / "checkpoints" / "step-5");
  fs::copy(model_dir() / "config.json", run / "checkpoints" / "step-5" / "config.json");
  EXPECT_EQ(newest_checkpoint(run), run / "checkpoints" / "step-2");

  const std::string args = " --prompt abc --temperature 0 --max-new-tokens 8";
  EXPECT_EQ(tokens_of(generate_json("--model '" + run.string() + "'" + args)),
            tokens_of(generate_json(model_arg() + args)));

  // Nothing complete: an error naming the run directory and the incomplete checkpoint.
  fs::remove(run / "checkpoints" / "step-2" / "COMPLETE");
  const Result r = strata("generate --devices host --model '" + run.string() + "'" + args);
  EXPECT_EQ(r.status, 1);
  for (const std::string& part : {run.string(), std::string("step-5"), std::string("COMPLETE")})
    EXPECT_NE(r.out.find(part), std::string::npos) << part << " missing from " << r.out;
}

TEST(NewestCheckpoint, PicksTheLargestCompleteStep) {
  const test::TempDir tmp("strata_newest_checkpoint");
  const fs::path run = tmp.path;
  test::expect_error([&] { (void)newest_checkpoint(run); }, {run.string(), "checkpoints"});
  const fs::path ckpts = run / "checkpoints";
  fs::create_directories(ckpts);
  test::expect_error([&] { (void)newest_checkpoint(run); }, {run.string(), "no checkpoint"});

  auto make = [&](const std::string& name, bool complete) {
    fs::create_directories(ckpts / name);
    if (complete) std::ofstream(ckpts / name / "COMPLETE");
  };
  make("step-5", false);
  test::expect_error([&] { (void)newest_checkpoint(run); },
                     {run.string(), "no complete checkpoint", "step-5", "COMPLETE"});
  make("step-2", true);
  EXPECT_EQ(newest_checkpoint(run), ckpts / "step-2");
  // Numerically, not by name: step-10 is newer than step-9.
  make("step-9", true);
  make("step-10", true);
  EXPECT_EQ(newest_checkpoint(run), ckpts / "step-10");
  // Not checkpoints: other names, a file called step-N, a marker that is a directory.
  make("step-11.tmp", true);
  make("step-x", true);
  make("step-", true);
  std::ofstream(ckpts / "step-12");
  fs::create_directories(ckpts / "step-13" / "COMPLETE");
  EXPECT_EQ(newest_checkpoint(run), ckpts / "step-10");

  EXPECT_EQ(checkpoint_dir_name(7), "step-7");
  EXPECT_EQ(checkpoint_step("step-7"), 7);
  EXPECT_EQ(checkpoint_step("step-007"), 7);
  EXPECT_FALSE(checkpoint_step("step--1"));
  EXPECT_FALSE(checkpoint_step("step-99999999999999999999"));  // past int64
  EXPECT_FALSE(checkpoint_step("xstep-1"));
  EXPECT_TRUE(is_run_dir(run));
  EXPECT_FALSE(is_run_dir(ckpts));
}

TEST_F(GenerateCli, SentencePieceTokenizer) {
  std::string why;
  const std::string sp = test::train_sentencepiece(tmp_.path, &why);
  if (sp.empty()) GTEST_SKIP() << "cannot train a SentencePiece model here: " << why;
  const json j = generate_json(model_arg() + " --tokenizer '" + sp +
                               "' --prompt 'the quick brown' --max-new-tokens 12 --seed 2");
  EXPECT_EQ(j["tokenizer"], sp);
  EXPECT_FALSE(j["prompt_tokens"].empty());
  for (uint32_t id : tokens_of(j)) EXPECT_LT(id, 120u);  // the model's vocabulary, not tiny's 512
  EXPECT_TRUE(j["text"].is_string());
  const Result plain = strata("generate --devices host " + model_arg() + " --tokenizer '" + sp +
                                  "' --prompt 'the quick brown' --max-new-tokens 12 --seed 2",
                              "2>/dev/null");
  EXPECT_EQ(plain.status, 0);
  EXPECT_EQ(plain.out.rfind("the quick brown", 0), 0u) << plain.out;
}

TEST_F(GenerateCli, AModelDirectorysHuggingFaceTokenizerWithItsBeginOfText) {
  // GPT-2's layout with Llama 3's begin-of-text (hf_tokenizer_testing.h): " the" is 258,
  // <|begin_of_text|> 260 goes first, <|endoftext|> 259 ends the text; 261 ids in all.
  test::write_tokenizer_json(model_dir(), test::with_begin_of_text(test::gpt2_like_tokenizer()));
  const std::string args = model_arg() + " --prompt ' the' --temperature 0 --max-new-tokens 6";
  const json j = generate_json(args);
  EXPECT_EQ(j["tokenizer"], (model_dir() / "tokenizer.json").string());  // --tokenizer auto
  EXPECT_EQ(j["prompt_tokens"].get<std::vector<uint32_t>>(), (std::vector<uint32_t>{260, 258}));
  Reference ref(tiny(), model_dir());
  const std::vector<uint32_t> expect = ref.greedy({260, 258}, 6, 261, 259);
  EXPECT_EQ(tokens_of(j), expect);
  for (uint32_t id : tokens_of(j)) EXPECT_LT(id, 261u);
  const Result plain = strata("generate --devices host " + args, "2>/dev/null");
  ASSERT_EQ(plain.status, 0);
  EXPECT_EQ(plain.out, " the" + open_tokenizer(model_dir().string())->decode(expect) + "\n");
  // generation_config.json's eos_token_id (a list, as Llama 3 Instruct's) stops generation too.
  ASSERT_GE(expect.size(), 2u);
  ASSERT_TRUE(expect[0] != expect[1] && expect[0] != 7) << "pick another eos for this model";
  std::ofstream(model_dir() / "generation_config.json")
      << json{{"eos_token_id", {7, expect[1]}}}.dump();
  const json stopped = generate_json(args);
  EXPECT_EQ(tokens_of(stopped), (std::vector<uint32_t>{expect[0], expect[1]}));
  EXPECT_EQ(stopped["stop"], "eos");
  std::ofstream(model_dir() / "generation_config.json") << R"({"eos_token_id": "x"})";
  const Result bad = strata("generate --devices host " + args);
  EXPECT_EQ(bad.status, 1);
  EXPECT_NE(bad.out.find("generation_config.json: eos_token_id holds \"x\""), std::string::npos)
      << bad.out;
  // Without sampling flags the generation config's settings draw the tokens, as Hugging Face's
  // generate takes them: do_sample false is greedy; do_sample with top_k 1 is greedy too, at
  // its default temperature 1. What strata does not apply is said.
  const std::string unflagged = model_arg() + " --prompt ' the' --max-new-tokens 6";
  std::ofstream(model_dir() / "generation_config.json")
      << R"({"do_sample": false, "typical_p": 0.9})";
  const Result greedy = strata("generate --devices host --json " + unflagged);
  ASSERT_EQ(greedy.status, 0) << greedy.out;
  EXPECT_NE(greedy.out.find("typical_p 0.9 is not applied"), std::string::npos) << greedy.out;
  const json from_file = json::parse(greedy.out.substr(greedy.out.rfind("\n{") + 1));
  EXPECT_EQ(tokens_of(from_file), expect);
  EXPECT_EQ(from_file["temperature"], 0.0);
  EXPECT_EQ(from_file["sampling_from"], (model_dir() / "generation_config.json").string());
  std::ofstream(model_dir() / "generation_config.json") << R"({"do_sample": true, "top_k": 1})";
  for (const char* seed : {" --seed 1", " --seed 2"}) {
    const json k1 = generate_json(unflagged + seed);
    EXPECT_EQ(tokens_of(k1), expect) << seed;
    EXPECT_EQ(k1["temperature"], 1.0);
    EXPECT_EQ(k1["top_k"], 1);
    EXPECT_EQ(k1["top_p"], 1.0);
  }
  // A flag wins over the file; a bad value is named with its file.
  EXPECT_EQ(generate_json(unflagged + " --top-k 0")["top_k"], 0);
  std::ofstream(model_dir() / "generation_config.json") << R"({"do_sample": true, "top_p": 0})";
  const Result bad_p = strata("generate --devices host " + unflagged);
  EXPECT_EQ(bad_p.status, 1);
  EXPECT_NE(bad_p.out.find("generation_config.json: top_p 0 must be in (0, 1]"), std::string::npos)
      << bad_p.out;
  fs::remove(model_dir() / "generation_config.json");
  // With no generation config, config.json's eos_token_id stops generation, as Hugging Face
  // takes the generation settings from the model's config then; and strata's defaults sample.
  json config = json::parse(std::ifstream(model_dir() / "config.json"));
  config["eos_token_id"] = {7, expect[1]};
  std::ofstream(model_dir() / "config.json") << config.dump(2);
  const json by_config = generate_json(args);
  EXPECT_EQ(tokens_of(by_config), (std::vector<uint32_t>{expect[0], expect[1]}));
  EXPECT_EQ(by_config["stop"], "eos");
  EXPECT_EQ(generate_json(unflagged)["top_k"], 40);
  config.erase("eos_token_id");
  std::ofstream(model_dir() / "config.json") << config.dump(2);
  // An explicit --tokenizer wins over the directory's.
  const json bytes = generate_json(args + " --tokenizer byte");
  EXPECT_EQ(bytes["tokenizer"], "byte");
  EXPECT_EQ(bytes["prompt_tokens"].get<std::vector<uint32_t>>(), bytes_of(" the"));
}

// --chat: the prompt is a user's message (after --system's) rendered by the chat template in
// the model directory's tokenizer_config.json with the generation prompt, encoded whole with no
// prefix of the tokenizer's own (the template writes begin-of-text), and only the reply printed;
// greedy from those ids is the test's own argmax decoder. Without a template, --chat is refused.
TEST_F(GenerateCli, ChatRendersTheMessageThroughTheModelsTemplate) {
  test::write_tokenizer_json(model_dir(), test::with_begin_of_text(test::gpt2_like_tokenizer()));
  const std::string args = model_arg() + " --prompt 'the' --temperature 0 --max-new-tokens 4";
  const Result none = strata("generate --devices host --chat " + args);
  EXPECT_EQ(none.status, 1);
  EXPECT_NE(none.out.find("no chat template"), std::string::npos) << none.out;
  EXPECT_NE(none.out.find("--chat-template FILE"), std::string::npos) << none.out;

  std::ofstream(model_dir() / "tokenizer_config.json")
      << json{{"bos_token", "<|begin_of_text|>"},
              {"eos_token", "<|endoftext|>"},
              {"chat_template",
               "{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}{{ eos_token }}"
               "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"}}
             .dump();
  const json j = generate_json(args + " --chat --system 'be the'");
  const auto t = open_tokenizer(model_dir().string());
  const std::string rendered =
      "<|begin_of_text|>system: be the<|endoftext|>user: the<|endoftext|>assistant:";
  EXPECT_EQ(j["prompt"], rendered);
  EXPECT_EQ(j["chat"], true);
  const std::vector<uint32_t> ids = t->encode(rendered);
  ASSERT_EQ(ids.front(), 260u);  // one begin-of-text: the template's, no prefix before it
  EXPECT_EQ(std::count(ids.begin(), ids.end(), 260u), 1);
  EXPECT_EQ(j["prompt_tokens"].get<std::vector<uint32_t>>(), ids);
  Reference ref(tiny(), model_dir());
  const std::vector<uint32_t> expect = ref.greedy(ids, 4, 261, 259);
  EXPECT_EQ(tokens_of(j), expect);
  const Result plain = strata("generate --devices host --chat " + args, "2>/dev/null");
  ASSERT_EQ(plain.status, 0);
  const std::vector<uint32_t> user_only =
      t->encode("<|begin_of_text|>user: the<|endoftext|>assistant:");
  std::vector<uint32_t> all = user_only;
  const std::vector<uint32_t> reply = ref.greedy(user_only, 4, 261, 259);
  all.insert(all.end(), reply.begin(), reply.end());
  const std::string whole = t->decode(all), before = t->decode(user_only);
  ASSERT_TRUE(whole.starts_with(before));
  EXPECT_EQ(plain.out, whole.substr(before.size()) + "\n");  // the reply alone
  const Result stray = strata("generate --devices host --system 'x' " + args);
  EXPECT_EQ(stray.status, 1);
  EXPECT_NE(stray.out.find("add --chat"), std::string::npos) << stray.out;
}

TEST_F(GenerateCli, BadInputsAreNamed) {
  // A prompt longer than tiny's 256 positions.
  const std::string long_prompt(300, 'a');
  Result r = strata("generate --devices host " + model_arg() + " --prompt " + long_prompt);
  EXPECT_EQ(r.status, 1);
  for (const char* part : {"--prompt of 300 tokens", "256", "at most 255"})
    EXPECT_NE(r.out.find(part), std::string::npos) << part << " missing from " << r.out;

  // A SentencePiece model that is not there.
  const std::string missing = (tmp_.path / "no-such.model").string();
  r = strata("generate --devices host " + model_arg() + " --prompt hi --tokenizer '" + missing +
             "'");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.out.find(missing), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("--tokenizer byte"), std::string::npos) << r.out;

  struct Case {
    std::string args, expect;
  };
  for (const Case& c : std::vector<Case>{
           {"--model tiny --prompt hi", "--init random"},
           {model_arg() + " --prompt hi --temperature -1", "--temperature -1"},
           {model_arg() + " --prompt hi --top-k -2", "--top-k -2"},
           {model_arg() + " --prompt hi --max-new-tokens 0", "--max-new-tokens 0"},
           {model_arg() + " --prompt ''", "--prompt"},
           {"--model tiny --init zeros --prompt hi", "--init 'zeros'"},
       }) {
    r = strata("generate --devices host " + c.args);
    EXPECT_EQ(r.status, 1) << c.args;
    EXPECT_NE(r.out.find(c.expect), std::string::npos) << c.args << ": " << r.out;
  }
}

}  // namespace
}  // namespace strata
