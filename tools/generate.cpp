// generate.cpp: `strata generate`, text sampled from a model one token at a time, so a user can
// see what training did.
//
// The model is resident on one device (ResidentWeights + LlamaModel, batch 1) with a KV cache
// (ModelOptions::kv_cache) of min(prompt + --max-new-tokens, max_position_embeddings)
// positions: the prompt runs once, then each new token alone against the cached keys and values
// of the ones before it (LlamaModel::decode), and only the last position's logits are computed.
// Each token costs one position's forward, not the whole sequence's. When --offload-param (or
// the --config's offload_param) asks for cpu, nvme or auto, or with several --devices, the
// parameters are placed as `strata eval` places them (host RAM, NVMe, ZeRO-3 shards) and each call
// runs the executor's forward-only schedule (Executor::decode): every unit fetched and gathered in
// turn, the first device decoding.
//
// Sampling is fully specified, so a seed gives the same tokens on every machine whose logits
// agree: only ids below both the model's and the tokenizer's vocabulary are candidates (a model's
// vocabulary is often padded past its tokenizer's). The temperature, top-k and top-p are the
// flags', else the model's generation_config.json's (Hugging Face's defaults for the keys it
// leaves out, do_sample false being greedy), else 0.8, 40 and 1. A repetition penalty p (Hugging
// Face's repetition_penalty, applied first, greedy or not) divides the f32 logit of every id
// already in the sequence, prompt included, by p where it is positive and multiplies it by p where
// it is negative. A no-repeat n-gram size n (Hugging Face's no_repeat_ngram_size, greedy or not)
// then rules out every id that would end an n-gram the sequence already holds, prompt included
// (n = 1: every id in it). Temperature 0 then takes the argmax (lowest id on ties). Otherwise
// candidates are ordered by logit, highest first (lower id first on ties), the first top-k kept
// with any tied with the k-th (0 keeps all), weighted by exp((logit - max) / temperature) in
// double; with --top-p below 1, only the first of those whose weights before them sum to less than
// top_p times their total stay (the nucleus, as Hugging Face's top_p: at least one), then with
// --min-p those whose weight is at least min_p (the weight of the most likely is 1: Hugging Face's
// min_p, a share of the most likely token's probability), and
// one xoshiro256** draw (train/data_loader.h, seeded by --seed) u = (next >> 11) * 2^-53 picks
// the first candidate whose running weight sum exceeds u * total. (--seed also seeds --init
// random.) Generation stops at the tokenizer's end-of-text id or one of generation_config.json's
// eos_token_id (config.json's where there is no generation config; kept in "tokens", not in the
// text), after --max-new-tokens, or when the model's context is full.
//
// The tokenizer (--tokenizer auto, the default) is the one the model directory ships
// (tokenizer.json, else tokenizer.model; `strata train` copies them into every checkpoint), else
// the byte tokenizer. Its prefix (a Hugging Face tokenizer's begin-of-text) goes before the
// prompt, as Hugging Face's generate feeds it. With --chat the prompt is a user's message
// rendered by the chat template beside the tokenizer (train/tokenizer.h, ChatFormat), as
// apply_chat_template with the generation prompt renders it, and only the reply is printed.
//
// Output: the prompt, then the generated text, on stdout; bytes that are not valid UTF-8 (the
// byte tokenizer can produce any byte) are written as they are. With --json the text fields are
// JSON strings, where such bytes become U+FFFD; "tokens" holds the exact ids.
#include "commands.h"
#include "device_args.h"
#include "core/device.h"
#include "core/error.h"
#include "core/log.h"
#include "model/config.h"
#include "model/file_io.h"
#include "model/llama.h"
#include "model/safetensors.h"
#include "model/weights.h"
#include "train/checkpoint_dir.h"
#include "train/data_loader.h"
#include "train/tokenizer.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <filesystem>
#include <functional>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace strata::cli {
namespace {

struct GenerateArgs {
  std::string model;
  std::string init;
  std::string prompt;
  std::string tokenizer = "auto";
  bool chat = false;
  std::string system;
  std::string chat_template;
  int64_t max_new_tokens = 64;
  // Unset: the model's generation_config.json, else strata's defaults.
  std::optional<double> temperature, top_p, repetition_penalty, min_p;
  std::optional<int64_t> top_k, no_repeat_ngram_size;
  uint64_t seed = 1;
  std::string devices;
  std::string device_memory;
  std::string dtype;
  ParamPlacementArgs placement;
  bool json = false;
};

// How tokens are drawn: each flag given, else the generation_config.json's settings with
// Hugging Face's defaults for the keys it leaves out (do_sample false: greedy; temperature 1,
// top_k 50, top_p 1), else strata's (temperature 0.8, top-k 40, top-p 1). repetition_penalty 1,
// min_p 0 and no_repeat_ngram_size 0 change nothing.
struct Sampling {
  double temperature = 0.8;
  int64_t top_k = 40;
  double top_p = 1.0;
  double repetition_penalty = 1.0;
  double min_p = 0.0;
  int64_t no_repeat_ngram_size = 0;
  std::string from = "defaults";  // "flags", the generation config's path, or "defaults"
};

// Hugging Face's RepetitionPenaltyLogitsProcessor on the f32 logits: each id of `seen` (below
// the logits' size) once.
void penalise_repeats(std::vector<float>& logits, const std::vector<int32_t>& seen,
                      double penalty) {
  const auto p = static_cast<float>(penalty);
  std::vector<bool> done(logits.size(), false);
  for (int32_t id : seen) {
    const auto i = static_cast<size_t>(id);
    if (id < 0 || i >= logits.size() || done[i]) continue;
    done[i] = true;
    logits[i] = logits[i] < 0 ? logits[i] * p : logits[i] / p;
  }
}

// Hugging Face's NoRepeatNGramLogitsProcessor: -inf for each id that, after `seen`, would repeat
// an n-gram of `seen` (its last n - 1 ids followed by the id, where those n - 1 ids occur before
// followed by the id); nothing while `seen` is shorter than n - 1.
void ban_repeated_ngrams(std::vector<float>& logits, const std::vector<int32_t>& seen, int64_t n) {
  const auto len = static_cast<int64_t>(seen.size());
  if (n <= 0 || len + 1 < n) return;
  const auto tail = seen.begin() + (len - (n - 1));
  for (int64_t start = 0; start + n <= len; ++start) {
    const auto at = seen.begin() + start;
    if (!std::equal(at, at + (n - 1), tail)) continue;
    const int32_t id = seen[static_cast<size_t>(start + n - 1)];
    if (id >= 0 && static_cast<size_t>(id) < logits.size())
      logits[static_cast<size_t>(id)] = -std::numeric_limits<float>::infinity();
  }
}

// The next token from the logits of the last position, penalised for repeats already (see the
// note above).
uint32_t sample_token(const std::vector<float>& logits, int64_t candidates, const Sampling& s,
                      Xoshiro256& rng) {
  const double temperature = s.temperature, top_p = s.top_p;
  const int64_t top_k = s.top_k;
  const auto n = static_cast<size_t>(candidates);
  if (temperature == 0) {
    size_t best = 0;
    for (size_t i = 1; i < n; ++i)
      if (logits[i] > logits[best]) best = i;
    return static_cast<uint32_t>(best);
  }
  std::vector<uint32_t> order(n);
  std::iota(order.begin(), order.end(), 0u);
  size_t keep = top_k > 0 ? std::min(n, static_cast<size_t>(top_k)) : n;
  const auto ranks_before = [&](uint32_t a, uint32_t b) {
    return logits[a] != logits[b] ? logits[a] > logits[b] : a < b;
  };
  std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(keep), order.end(),
                    ranks_before);
  // Every token tied with the k-th stays, as Hugging Face's top-k keeps each logit not below
  // the k-th's (in id order among them).
  const auto tied =
      std::partition(order.begin() + static_cast<std::ptrdiff_t>(keep), order.end(),
                     [&](uint32_t i) { return logits[i] == logits[order[keep - 1]]; });
  std::sort(order.begin() + static_cast<std::ptrdiff_t>(keep), tied, ranks_before);
  keep = static_cast<size_t>(tied - order.begin());
  const double top = logits[order[0]];
  std::vector<double> weights(keep);
  double total = 0;
  for (size_t i = 0; i < keep; ++i) {
    weights[i] = std::exp((static_cast<double>(logits[order[i]]) - top) / temperature);
    total += weights[i];
  }
  if (top_p < 1) {  // the nucleus: the most likely tokens until their share reaches top_p
    const double limit = top_p * total;
    double before = 0;
    size_t nucleus = 0;
    while (nucleus < keep && (nucleus == 0 || before < limit)) before += weights[nucleus++];
    keep = nucleus;
    total = before;
  }
  if (s.min_p > 0) {  // weights fall with rank, and the first's is 1: cut where one falls short
    size_t kept = 1;
    while (kept < keep && weights[kept] >= s.min_p) ++kept;
    keep = kept;
    total =
        std::accumulate(weights.begin(), weights.begin() + static_cast<std::ptrdiff_t>(keep), 0.0);
  }
  const double target = static_cast<double>(rng.next() >> 11) * 0x1.0p-53 * total;
  double sum = 0;
  for (size_t i = 0; i < keep; ++i) {
    sum += weights[i];
    if (sum > target) return order[i];
  }
  return order[keep - 1];
}

// --tokenizer auto: the tokenizer a Hugging Face model directory ships (tokenizer.json, else
// tokenizer.model), looked for in the checkpoint and then in --model itself; the byte tokenizer
// where neither has one (a preset, or a run trained on byte tokens).
std::string resolve_tokenizer(const std::string& spec, const std::string& model,
                              const std::filesystem::path& checkpoint) {
  namespace fs = std::filesystem;
  if (spec != "auto") return spec;
  std::error_code ec;
  for (const fs::path& dir : {checkpoint, fs::path(model)}) {
    if (dir.empty() || !fs::is_directory(dir, ec)) continue;
    if (const std::optional<fs::path> file = model_tokenizer_file(dir)) {
      log_info("generate: --tokenizer auto: {}", file->string());
      return file->string();
    }
  }
  return "byte";
}

// The model's generation_config.json (the checkpoint's, else --model's), as Hugging Face's
// generate reads it: the object and its path, or null where there is none.
std::pair<nlohmann::json, std::filesystem::path> generation_config(
    const std::string& model, const std::filesystem::path& checkpoint) {
  namespace fs = std::filesystem;
  std::error_code ec;
  for (const fs::path& dir : {checkpoint, fs::path(model)}) {
    const fs::path file = dir / "generation_config.json";
    if (dir.empty() || !fs::is_regular_file(file, ec)) continue;
    nlohmann::json j = read_json_file(file, "generation config");
    if (!j.is_object())
      fail("{}: not a JSON object; fix it or remove it from the model directory", file.string());
    return {std::move(j), file};
  }
  return {nullptr, {}};
}

// The ids generation stops at: the tokenizer's end-of-text, and the eos_token_id (one id or a
// list, as Llama 3 Instruct's <|end_of_text|>, <|eom_id|>, <|eot_id|>) of the
// generation_config.json, else of config.json, as Hugging Face's generate takes it from the
// model's config where the model has no generation config.
std::vector<uint32_t> stop_ids(const Tokenizer& tokenizer, const nlohmann::json& generation,
                               const std::string& generation_file, const LlamaConfig& config) {
  std::vector<uint32_t> ids;
  if (const std::optional<uint32_t> eos = tokenizer.eos_id()) ids.push_back(*eos);
  const bool from_generation = generation.is_object();
  const nlohmann::json& holder = from_generation ? generation : config.token_ids;
  const std::string source = from_generation ? generation_file : config.name + "/config.json";
  if (!holder.contains("eos_token_id") || holder["eos_token_id"].is_null()) return ids;
  const nlohmann::json& e = holder["eos_token_id"];
  for (const nlohmann::json& id : e.is_array() ? e : nlohmann::json::array({e})) {
    if (!id.is_number_unsigned() || id.get<uint64_t>() > UINT32_MAX)
      fail("{}: eos_token_id holds {}, not a token id; it must be an id or a list of ids", source,
           id.dump());
    if (std::find(ids.begin(), ids.end(), id.get<uint32_t>()) == ids.end())
      ids.push_back(id.get<uint32_t>());
  }
  return ids;
}

Sampling sampling_for(const GenerateArgs& a, const nlohmann::json& generation,
                      const std::string& generation_file) {
  Sampling s;
  if (generation.is_object()) {
    const auto number = [&](const char* key, double fallback) {
      if (!generation.contains(key) || generation[key].is_null()) return fallback;
      if (!generation[key].is_number())
        fail("{}: {} is {}; expected a number", generation_file, key, generation[key].dump());
      return generation[key].get<double>();
    };
    if (generation.contains("do_sample") && !generation["do_sample"].is_boolean())
      fail("{}: do_sample is {}; expected true or false", generation_file,
           generation["do_sample"].dump());
    const bool sample = generation.value("do_sample", false);
    s.temperature = sample ? number("temperature", 1.0) : 0.0;
    // top_k null is None to Hugging Face: no top-k at all.
    const bool no_top_k = generation.contains("top_k") && generation["top_k"].is_null();
    s.top_k = no_top_k ? 0 : static_cast<int64_t>(number("top_k", 50));
    s.top_p = number("top_p", 1.0);
    // The repetition penalty applies whether it samples or not, as Hugging Face's; min_p only
    // to sampling (greedy takes the most likely token whatever it is).
    s.repetition_penalty = number("repetition_penalty", 1.0);
    s.min_p = number("min_p", 0.0);
    const double no_repeat = number("no_repeat_ngram_size", 0.0);
    if (!(no_repeat >= 0 && no_repeat == std::floor(no_repeat) && no_repeat < 1e9))
      fail("{}: no_repeat_ngram_size is {}; expected a whole number >= 0 (0 turns it off)",
           generation_file, generation["no_repeat_ngram_size"].dump());
    s.no_repeat_ngram_size = static_cast<int64_t>(no_repeat);
    s.from = generation_file;
    // What Hugging Face's generate would do that strata's sampling does not.
    for (const auto& [key, neutral] : {std::pair{"typical_p", 1.0}, {"num_beams", 1.0}})
      if (number(key, neutral) != neutral)
        log_warn(
            "generate: {}: {} {} is not applied (strata samples with the repetition penalty, "
            "no-repeat n-grams, temperature, top-k, top-p and min-p alone)",
            generation_file, key, generation[key].dump());
  }
  // Each value is checked under the name it came from: the flag, or the generation config's key.
  const std::string file = generation.is_object() ? generation_file + ": " : "";
  std::string t = file + "temperature", k = file + "top_k", p = file + "top_p",
              r = file + "repetition_penalty", m = file + "min_p";
  if (a.temperature) std::tie(s.temperature, t) = std::pair{*a.temperature, "--temperature"};
  if (a.top_k) std::tie(s.top_k, k) = std::pair{*a.top_k, "--top-k"};
  if (a.top_p) std::tie(s.top_p, p) = std::pair{*a.top_p, "--top-p"};
  if (a.repetition_penalty)
    std::tie(s.repetition_penalty, r) = std::pair{*a.repetition_penalty, "--repetition-penalty"};
  if (a.min_p) std::tie(s.min_p, m) = std::pair{*a.min_p, "--min-p"};
  if (a.no_repeat_ngram_size) {
    if (*a.no_repeat_ngram_size < 0)
      fail("--no-repeat-ngram-size {} must be >= 0 (0 turns it off; 3 is a common choice)",
           *a.no_repeat_ngram_size);
    s.no_repeat_ngram_size = *a.no_repeat_ngram_size;
  }
  if (!std::isfinite(s.temperature) || s.temperature < 0)
    fail("{} {} must be a finite number >= 0 (0 is greedy)", t, s.temperature);
  if (s.top_k < 0) fail("{} {} must be >= 0 (0 keeps every token)", k, s.top_k);
  if (!(s.top_p > 0 && s.top_p <= 1))
    fail("{} {} must be in (0, 1] (1 keeps every token; 0.9 is a common choice)", p, s.top_p);
  if (!(std::isfinite(s.repetition_penalty) && s.repetition_penalty > 0))
    fail("{} {} must be a finite number > 0 (1 changes nothing; 1.1 is a common choice)", r,
         s.repetition_penalty);
  if (!(s.min_p >= 0 && s.min_p <= 1))
    fail("{} {} must be in [0, 1] (0 keeps every token; 0.05 is a common choice)", m, s.min_p);
  const bool flags = a.temperature || a.top_k || a.top_p || a.repetition_penalty || a.min_p ||
                     a.no_repeat_ngram_size;
  if (flags) s.from = generation.is_object() ? "flags over " + generation_file : "flags";
  return s;
}

// The checkpoint directory --model names: itself, or a run directory's newest complete one.
std::filesystem::path checkpoint_of(const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  if (fs::exists(dir / "config.json") || !is_run_dir(dir)) return dir;
  const fs::path ckpt = newest_checkpoint(dir);
  log_info("generate: run directory {}: newest complete checkpoint {}", dir.string(),
           ckpt.string());
  return ckpt;
}

int run_generate(const GenerateArgs& a) {
  namespace fs = std::filesystem;
  const bool is_dir = fs::is_directory(a.model);
  const fs::path checkpoint = is_dir ? checkpoint_of(a.model) : fs::path();
  const LlamaConfig config = resolve_model(is_dir ? checkpoint.string() : a.model);
  const bool load = weights_from_model_dir(a.model, a.init, "sample from");
  if (a.max_new_tokens < 1) fail("--max-new-tokens {} must be at least 1", a.max_new_tokens);
  const auto found = generation_config(a.model, checkpoint);
  const nlohmann::json& generation = found.first;
  const std::filesystem::path& generation_path = found.second;
  const Sampling sampling = sampling_for(a, generation, generation_path.string());

  // The prompt's tokens before any memory is reserved.
  const std::unique_ptr<Tokenizer> tokenizer =
      open_tokenizer(resolve_tokenizer(a.tokenizer, a.model, checkpoint));
  if (tokenizer->vocab_size() > config.vocab_size)
    fail(
        "--tokenizer {}: its vocabulary of {} is larger than the model's ({}, vocab_size of "
        "{}); use the tokenizer the model was trained with",
        tokenizer->name(), tokenizer->vocab_size(), config.vocab_size, config.name);
  // What Hugging Face's generate feeds: the tokenizer's prefix (Llama's begin-of-text), then the
  // prompt's tokens. With --chat, the prompt is a user's message (after --system's) rendered by
  // the model's chat template with the generation prompt, encoded whole without a prefix (the
  // template writes its own), as apply_chat_template(..., add_generation_prompt=True,
  // tokenize=True) gives it.
  if (!a.chat && (!a.system.empty() || !a.chat_template.empty()))
    fail("--system and --chat-template shape a chat prompt; add --chat");
  std::vector<uint32_t> prompt_ids;
  std::string rendered;
  if (a.chat) {
    const std::string spec = resolve_tokenizer(a.tokenizer, a.model, checkpoint);
    const std::optional<ChatFormat> format = open_chat_format(*tokenizer, spec, a.chat_template);
    if (!format)
      fail(
          "--chat: the tokenizer {} has no chat template beside it (chat_template.jinja, or a "
          "\"chat_template\" in tokenizer_config.json); pass --chat-template FILE, or drop "
          "--chat to continue the text as it is",
          tokenizer->name());
    nlohmann::ordered_json messages = nlohmann::ordered_json::array();
    if (!a.system.empty()) messages.push_back({{"role", "system"}, {"content", a.system}});
    messages.push_back({{"role", "user"}, {"content", a.prompt}});
    rendered = format->render(messages, nullptr, true);
    prompt_ids = tokenizer->encode(rendered);
  } else {
    prompt_ids = tokenizer->prefix_ids();
    const std::vector<uint32_t> text_ids = tokenizer->encode(a.prompt);
    prompt_ids.insert(prompt_ids.end(), text_ids.begin(), text_ids.end());
  }
  const auto prompt_len = static_cast<int64_t>(prompt_ids.size());
  if (prompt_len == 0)
    fail("--prompt '{}' gives no tokens with the {} tokenizer; give some text to continue",
         a.prompt, tokenizer->name());
  const int64_t context = config.max_position_embeddings;
  if (prompt_len >= context)
    fail(
        "--prompt of {} tokens ({} bytes, starting '{}...') leaves no room in the context of {} "
        "positions (max_position_embeddings of {}); shorten it to at most {} tokens",
        prompt_len, a.prompt.size(), a.prompt.substr(0, 20), context, config.name, context - 1);
  const int64_t T = std::min(prompt_len + a.max_new_tokens, context);
  if (prompt_len + a.max_new_tokens > context)
    log_warn("generate: the context of {} positions stops generation after {} new tokens", context,
             context - prompt_len);

  const std::optional<DsConfig> ds = load_cli_config(a.placement.config);
  auto devices = open_cli_devices(a.devices, a.device_memory, 0);
  std::vector<Device*> ranks;
  for (auto& d : devices) ranks.push_back(d.get());
  DsPlanSettings plan;
  if (ds) plan = ds_plan_settings(*ds, static_cast<int>(ranks.size()), config);
  const DType dtype = run_dtype(*ranks[0], a.dtype, plan, a.placement.config);
  const int64_t V = config.vocab_size;
  // decode(ids, pos): the tokens at positions [pos, pos + ids.size()) through the model, against
  // the cached positions before them; the last one's logits.
  std::function<const std::vector<float>&(const std::vector<int32_t>&, int64_t)> decode;
  std::vector<float> logits(static_cast<size_t>(V));
  std::string placed = "resident";
  // One device with the parameters asked to live on it: a resident model. Several devices, or
  // parameters in RAM, on NVMe or placed automatically: the executor's forward-only schedule, as
  // `strata eval` runs it, each unit fetched and gathered for every token.
  std::unique_ptr<LlamaModel> model;
  std::unique_ptr<ResidentWeights> weights;
  std::unique_ptr<Stream> stream;
  std::optional<DeviceBuffer> d_ids, d_logits;
  ForwardRun run;
  const OffloadRequest request = param_request(a.placement, plan);
  const bool resident = ranks.size() == 1 && !request.automatic && request.param == Tier::gpu;
  if (resident) {
    Device& device = *ranks[0];
    ModelOptions options;
    options.param_dtype = dtype;
    options.grad_dtype = dtype;
    options.max_batch = 1;
    options.seq_len = T;
    options.forward_only = true;
    options.kv_cache = true;
    model = std::make_unique<LlamaModel>(config, options, device);
    weights = std::make_unique<ResidentWeights>(model->layout(), device, dtype, dtype, false);
    stream = device.create_stream("generate");
    if (load)
      weights->load(open_model_weights(checkpoint, config), *stream);
    else
      weights->init_random(a.seed, *stream);
    d_ids.emplace(device, static_cast<uint64_t>(T) * 4, "token ids", MemoryKind::activations);
    d_logits.emplace(device, static_cast<uint64_t>(V) * 4, "logits", MemoryKind::activations);
    decode = [&](const std::vector<int32_t>& ids, int64_t pos) -> const std::vector<float>& {
      device.copy_to_device(d_ids->data(), ids.data(), ids.size() * 4, *stream);
      model->decode(weights->units(), static_cast<const int32_t*>(d_ids->data()), pos,
                    static_cast<int64_t>(ids.size()), d_logits->view(DType::f32, {1, V}), *stream);
      device.copy_to_host(logits.data(), d_logits->data(), logits.size() * 4, *stream);
      stream->synchronize();  // also keeps `ids` alive until its copy is done
      return logits;
    };
  } else {
    RunShape shape;
    shape.model = config;
    shape.ranks = static_cast<int>(ranks.size());
    shape.param_dtype = dtype;
    shape.grad_dtype = dtype;
    shape.micro_batch = 1;
    shape.seq_len = T;
    shape.kv_cache = true;
    run = place_forward_run(shape, a.placement, plan, ranks);
    if (load)
      run.executor->load(open_model_weights(checkpoint, config));
    else
      run.executor->init_random(a.seed);
    placed = homes_text(run.placement);
    decode = [&](const std::vector<int32_t>& ids, int64_t pos) -> const std::vector<float>& {
      return run.executor->decode(ids, pos);
    };
  }
  const int64_t candidates = std::min(V, tokenizer->vocab_size());
  std::vector<int32_t> ids(prompt_ids.begin(), prompt_ids.end());

  Xoshiro256 rng(a.seed);
  const std::vector<uint32_t> stops =
      stop_ids(*tokenizer, generation, generation_path.string(), config);
  std::vector<uint32_t> generated;
  std::string stop = "max_new_tokens";
  const auto t0 = std::chrono::steady_clock::now();
  // Positions [pos, len) are new to the cache: the prompt, then each sampled token.
  for (int64_t pos = 0, len = prompt_len;; pos = len++) {
    if (static_cast<int64_t>(generated.size()) == a.max_new_tokens) break;
    if (len == T) {
      stop = "context";
      break;
    }
    const std::vector<float>& last =
        decode(std::vector<int32_t>(ids.begin() + pos, ids.begin() + len), pos);
    for (int64_t i = 0; i < candidates; ++i)
      if (!std::isfinite(last[static_cast<size_t>(i)]))
        fail(
            "generate: logit {} of token id {} at position {} is not finite; the weights of {} "
            "hold non-finite values (or overflow in {})",
            last[static_cast<size_t>(i)], i, len - 1, a.model, dtype_name(dtype));
    // A penalty or a ban works on a copy of the logits; without them they are sampled as they
    // are.
    std::vector<float> penalised;
    if (sampling.repetition_penalty != 1.0 || sampling.no_repeat_ngram_size > 0) penalised = last;
    if (sampling.repetition_penalty != 1.0)
      penalise_repeats(penalised, ids, sampling.repetition_penalty);
    if (sampling.no_repeat_ngram_size > 0)
      ban_repeated_ngrams(penalised, ids, sampling.no_repeat_ngram_size);
    const uint32_t next =
        sample_token(penalised.empty() ? last : penalised, candidates, sampling, rng);
    generated.push_back(next);
    if (std::find(stops.begin(), stops.end(), next) != stops.end()) {
      stop = "eos";
      break;
    }
    ids.push_back(static_cast<int32_t>(next));
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  // The continuation as the tokenizer decodes it after the prompt (SentencePiece decodes a
  // piece's leading space only when something precedes it).
  std::vector<uint32_t> all = prompt_ids;
  all.insert(all.end(), generated.begin(), generated.end());
  const std::string whole = tokenizer->decode(all);
  const std::string prompt_text = tokenizer->decode(prompt_ids);
  const std::string text = whole.starts_with(prompt_text) ? whole.substr(prompt_text.size())
                                                          : tokenizer->decode(generated);
  const auto n_new = static_cast<int64_t>(generated.size());
  std::vector<std::string> device_names;
  for (Device* d : ranks) device_names.push_back(d->name());
  if (a.json) {
    const nlohmann::json j = {{"prompt", a.chat ? rendered : a.prompt},
                              {"chat", a.chat},
                              {"text", text},
                              {"tokens", generated},
                              {"new_tokens", n_new},
                              {"prompt_tokens", prompt_ids},
                              {"stop", stop},
                              {"model", config.name},
                              {"tokenizer", tokenizer->name()},
                              {"device", fmt::format("{}", fmt::join(device_names, ","))},
                              {"devices", device_names},
                              {"parameters", placed},
                              {"dtype", dtype_name(dtype)},
                              {"seed", a.seed},
                              {"temperature", sampling.temperature},
                              {"top_k", sampling.top_k},
                              {"top_p", sampling.top_p},
                              {"repetition_penalty", sampling.repetition_penalty},
                              {"min_p", sampling.min_p},
                              {"no_repeat_ngram_size", sampling.no_repeat_ngram_size},
                              {"sampling_from", sampling.from},
                              {"tokens_per_s", static_cast<double>(n_new) / seconds}};
    fmt::print("{}\n", j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
  } else {
    // A chat prints the reply; a continuation, the prompt and what follows it.
    fmt::print("{}{}\n", a.chat ? std::string() : a.prompt, text);
    fmt::print(stderr,
               "generate: {} new tokens in {:.2f} s ({:.1f} tokens/s) on {} (parameters: {}), "
               "stopped at {}\n",
               n_new, seconds, static_cast<double>(n_new) / seconds, fmt::join(device_names, ","),
               placed, stop);
  }
  return 0;
}

}  // namespace

Command add_generate(CLI::App& app) {
  auto a = std::make_shared<GenerateArgs>();
  CLI::App* cmd = app.add_subcommand("generate", "sample text from a model, one token at a time");
  cmd->add_option("--model", a->model,
                  "Hugging Face checkpoint directory, a run directory (its newest complete "
                  "checkpoint), or a preset with --init random")
      ->required();
  cmd->add_option("--init", a->init, "'random': initialise the weights instead of loading");
  cmd->add_option("--prompt", a->prompt, "the text to continue (with --chat: the user's message)")
      ->required();
  cmd->add_flag("--chat", a->chat,
                "send --prompt as a user's message through the model's chat template (with the "
                "generation prompt) and print the reply");
  cmd->add_option("--system", a->system, "with --chat: a system message before the user's");
  cmd->add_option("--chat-template", a->chat_template,
                  "with --chat: the template (a .jinja file, a tokenizer_config.json or a model "
                  "directory; default: the tokenizer's own)");
  cmd->add_option("--tokenizer", a->tokenizer,
                  "auto (the model directory's tokenizer.json or tokenizer.model, else byte), "
                  "byte (ids 0-255 the bytes, 256 end-of-text), a Hugging Face tokenizer.json "
                  "(or a directory holding one), or a SentencePiece .model file")
      ->capture_default_str();
  cmd->add_option("--max-new-tokens", a->max_new_tokens,
                  "stop after this many new tokens (or at end-of-text, or the model's context)")
      ->capture_default_str();
  cmd->add_option("--temperature", a->temperature,
                  "softmax temperature; 0 is greedy (argmax). Unset: the model's "
                  "generation_config.json (do_sample false: greedy; else its temperature, 1 where "
                  "it has none, as Hugging Face's generate), else 0.8");
  cmd->add_option("--top-p", a->top_p,
                  "sample among the most likely tokens whose probabilities sum to p (nucleus); 1 "
                  "keeps all. Unset: generation_config.json's, else 1");
  cmd->add_option("--top-k", a->top_k,
                  "sample among the k most likely tokens (and those tied with the k-th); 0 keeps "
                  "all. Unset: generation_config.json's (50 where it has none, as Hugging Face's), "
                  "else 40");
  cmd->add_option("--repetition-penalty", a->repetition_penalty,
                  "divide the logit of every token already in the text by this where it is "
                  "positive, multiply where negative (Hugging Face's repetition_penalty); 1 "
                  "changes nothing. Unset: generation_config.json's, else 1");
  cmd->add_option("--min-p", a->min_p,
                  "sample only among tokens at least this share of the most likely one's "
                  "probability (Hugging Face's min_p); 0 keeps all. Unset: "
                  "generation_config.json's, else 0");
  cmd->add_option("--no-repeat-ngram-size", a->no_repeat_ngram_size,
                  "never repeat an n-gram of the text, prompt included (Hugging Face's "
                  "no_repeat_ngram_size); 0 turns it off. Unset: generation_config.json's, else 0");
  cmd->add_option("--seed", a->seed, "seed of the sampling (and of --init random)")
      ->capture_default_str();
  cmd->add_option("--devices", a->devices,
                  "host, host:N, cuda (every GPU) or cuda:0,1 (default: cuda:0 if a GPU is "
                  "usable, else host); with several, the parameters are ZeRO-3 partitioned "
                  "across them and the first decodes");
  cmd->add_option("--device-memory", a->device_memory,
                  "cap of the device's memory (default: all that is free, less a reserve)");
  cmd->add_option("--dtype", a->dtype, "f32 or bf16 (default: f32 on host, bf16 on cuda)");
  add_param_placement_options(cmd, a->placement);
  cmd->add_flag("--json", a->json,
                "one JSON object: prompt, text, tokens (the new ids), new_tokens, stop, ...");
  return {cmd, [a] { return run_generate(*a); }};
}

}  // namespace strata::cli
