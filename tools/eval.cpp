// eval.cpp: `strata eval`, the mean loss and perplexity of a model over a token file.
//
// Sequence i takes its inputs from tokens [i·T, i·T+T) and its targets from the next T
// tokens shifted by one, so a file of exactly T+1 tokens is one sequence. Sequences are
// evaluated in order, `--batch` at a time; the loss is the mean over every target token.
#include "commands.h"
#include "device_args.h"
#include "core/device.h"
#include "core/error.h"
#include "model/config.h"
#include "model/llama.h"
#include "model/safetensors.h"
#include "model/tokens.h"
#include "model/weights.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <optional>

namespace strata::cli {
namespace {

struct EvalArgs {
  std::string model;
  std::string init;
  uint64_t seed = 0;
  std::string data;
  std::string data_dtype;
  int64_t seq_len = 0;
  int64_t batch = 1;
  int64_t max_sequences = 0;
  std::string devices;
  std::string device_memory;
  std::string dtype;
  bool json = false;
};

int run_eval(const EvalArgs& a) {
  namespace fs = std::filesystem;
  const bool is_dir = fs::is_directory(a.model);
  const LlamaConfig config = resolve_model(a.model);
  if (!a.init.empty() && a.init != "random")
    fail("--init '{}' is not known; the only initialisation is 'random'", a.init);
  if (!is_dir && a.init.empty())
    fail(
        "--model {} is a preset without weights; pass --init random (with --seed) to evaluate "
        "a randomly initialised model, or a Hugging Face checkpoint directory",
        a.model);

  // Tokens first: a bad file fails before any memory is reserved.
  const TokenFile tokens = TokenFile::open(a.data, a.data_dtype);
  tokens.validate(config.vocab_size);
  const int64_t T =
      a.seq_len > 0 ? a.seq_len : std::min<int64_t>(1024, config.max_position_embeddings);
  if (a.batch < 1) fail("--batch {} must be at least 1", a.batch);
  if (T < 1 || T > config.max_position_embeddings)
    fail("--seq-len {} is outside 1..{} (max_position_embeddings of {}); choose a shorter one", T,
         config.max_position_embeddings, config.name);
  int64_t sequences = tokens.num_sequences(T);
  if (sequences == 0)
    fail(
        "--data {}: {} tokens make no sequence of --seq-len {} (one needs {} tokens: inputs "
        "plus the shifted target); give more data or a shorter --seq-len",
        a.data, tokens.size(), T, T + 1);
  if (a.max_sequences > 0) sequences = std::min(sequences, a.max_sequences);

  // One device: the first of --devices (ZeRO-3 across several comes with partitioning).
  auto devices = open_cli_devices(a.devices, a.device_memory, 1);
  Device& device = *devices.at(0);
  const DType dtype = model_dtype(device, a.dtype);
  ModelOptions options;
  options.param_dtype = dtype;
  options.grad_dtype = dtype;
  options.max_batch = std::min<int64_t>(a.batch, sequences);
  options.seq_len = T;
  LlamaModel model(config, options, device);
  ResidentWeights weights(model.layout(), device, dtype, dtype, false);
  auto stream = device.create_stream("eval");
  if (is_dir && a.init.empty()) {
    const SafetensorsReader reader = SafetensorsReader::open(a.model);
    weights.load(reader, *stream);
  } else {
    weights.init_random(a.seed, *stream);
  }

  const int64_t B = options.max_batch;
  std::vector<int32_t> ids(static_cast<size_t>(B * T)), targets(ids.size());
  std::vector<float> losses(ids.size());
  DeviceBuffer d_ids(device, ids.size() * 4, "token ids"),
      d_targets(device, ids.size() * 4, "targets");
  double sum = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t first = 0; first < sequences; first += B) {
    const int64_t b = std::min(B, sequences - first);
    for (int64_t i = 0; i < b; ++i)
      tokens.sequence(first + i, T, ids.data() + i * T, targets.data() + i * T);
    const uint64_t bytes = static_cast<uint64_t>(b * T) * 4;
    device.copy_to_device(d_ids.data(), ids.data(), bytes, *stream);
    device.copy_to_device(d_targets.data(), targets.data(), bytes, *stream);
    model.forward(weights.units(), static_cast<int32_t*>(d_ids.data()),
                  static_cast<int32_t*>(d_targets.data()), b, false, *stream);
    device.copy_to_host(losses.data(), model.losses(b).data, bytes, *stream);
    stream->synchronize();
    for (int64_t i = 0; i < b * T; ++i) sum += losses[static_cast<size_t>(i)];
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const int64_t count = sequences * T;
  const double loss = sum / static_cast<double>(count);
  if (!std::isfinite(loss))
    fail("eval of {} on {}: the loss is {}; the weights or the data hold non-finite values",
         a.model, a.data, loss);
  const double tokens_per_s = static_cast<double>(count) / seconds;
  if (a.json) {
    nlohmann::json j = {{"loss", loss},
                        {"perplexity", std::exp(loss)},
                        {"tokens", count},
                        {"sequences", sequences},
                        {"seq_len", T},
                        {"model", config.name},
                        {"device", device.name()},
                        {"dtype", dtype_name(dtype)},
                        {"tokens_per_s", tokens_per_s}};
    fmt::print("{}\n", j.dump());
  } else {
    fmt::print(
        "eval: {} ({} parameters, {}) on {}: {} sequences x {} tokens\n"
        "  loss {:.6f}  perplexity {:.4f}  ({:.0f} tokens/s)\n",
        config.name, parameter_count(config), dtype_name(dtype), device.name(), sequences, T, loss,
        std::exp(loss), tokens_per_s);
  }
  return 0;
}

}  // namespace

Command add_eval(CLI::App& app) {
  auto args = std::make_shared<EvalArgs>();
  CLI::App* cmd = app.add_subcommand("eval", "mean loss and perplexity of a model over token data");
  cmd->add_option("--model", args->model,
                  "Hugging Face checkpoint directory (config.json + safetensors) or a preset "
                  "(tiny, llama2-7b, llama3-8b, ...)")
      ->required();
  cmd->add_option("--init", args->init, "'random': initialise the weights instead of loading");
  cmd->add_option("--seed", args->seed, "seed of --init random");
  cmd->add_option("--data", args->data,
                  "token file: llm.c shard (.bin) or raw uint16/uint32 with --data-dtype")
      ->required();
  cmd->add_option("--data-dtype", args->data_dtype, "raw token files: uint16 or uint32");
  cmd->add_option("--seq-len", args->seq_len,
                  "tokens per sequence (default: min(1024, max_position_embeddings))");
  cmd->add_option("--batch", args->batch, "sequences per forward pass")->capture_default_str();
  cmd->add_option("--max-sequences", args->max_sequences, "evaluate at most this many sequences");
  cmd->add_option("--devices", args->devices,
                  "host, host:N, cuda or cuda:0 (default: cuda:0 if a "
                  "GPU is usable, else host)");
  cmd->add_option("--device-memory", args->device_memory,
                  "cap of the device's memory, e.g. 2GiB (default: host 80% of available RAM, "
                  "cuda all free memory)");
  cmd->add_option("--dtype", args->dtype, "f32 or bf16 (default: f32 on host, bf16 on cuda)");
  cmd->add_flag("--json", args->json, "one JSON object: loss, perplexity, tokens, ...");
  return {cmd, [args] { return run_eval(*args); }};
}

}  // namespace strata::cli
