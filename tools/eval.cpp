// eval.cpp: `strata eval`, the mean loss and perplexity of a model over a token file.
//
// Sequence i takes its inputs from tokens [i·T, i·T+T) and its targets from the next T
// tokens shifted by one, so a file of exactly T+1 tokens is one sequence. The loss is the mean
// over every target token.
//
// Every device of --devices takes part, with the model's state ZeRO-3 partitioned across them
// (src/partition/zero.h): sequences are dealt to ranks (rank r gets sequences r, r+N, ...,
// up to `--batch` per rank at a time), each rank runs the forward on its own device with the
// gathered units, and the per-token losses are summed in sequence order, so the loss is the
// one device's to rounding.
#include "commands.h"
#include "device_args.h"
#include "core/device.h"
#include "core/error.h"
#include "core/log.h"
#include "model/config.h"
#include "model/llama.h"
#include "model/safetensors.h"
#include "model/tokens.h"
#include "partition/communicator.h"
#include "partition/zero.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
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
  uint64_t persistence_threshold = ZeroOptions{}.persistence_threshold;
  bool json = false;
};

int run_eval(const EvalArgs& a) {
  const LlamaConfig config = resolve_model(a.model);
  const bool load = weights_from_model_dir(a.model, a.init, "evaluate");

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

  auto devices = open_cli_devices(a.devices, a.device_memory, 0);
  const auto N = static_cast<int64_t>(devices.size());
  std::vector<Device*> ranks;
  for (auto& d : devices) ranks.push_back(d.get());
  const DType dtype = model_dtype(*ranks[0], a.dtype);
  const auto comm = make_communicator(ranks);
  ModelOptions options;
  options.param_dtype = dtype;
  options.grad_dtype = dtype;
  options.max_batch = std::min<int64_t>(a.batch, (sequences + N - 1) / N);
  options.seq_len = T;
  ZeroOptions zero_options;
  zero_options.param_dtype = dtype;
  zero_options.grad_dtype = dtype;
  zero_options.with_grads = false;
  zero_options.persistence_threshold = a.persistence_threshold;
  ZeroModel zero(ModelLayout::build(config), *comm, zero_options);
  if (load) {
    const SafetensorsReader reader = SafetensorsReader::open(a.model);
    zero.load(reader);
  } else {
    zero.init_random(a.seed);
  }
  log_debug("eval: {}", zero.partition().str());

  // Per rank: its model (activations), stream, and token buffers.
  const int64_t B = options.max_batch;
  std::vector<std::unique_ptr<LlamaModel>> models;
  std::vector<LlamaModel*> model_ptrs;
  std::vector<std::unique_ptr<Stream>> owned_streams;
  std::vector<Stream*> streams;
  std::vector<DeviceBuffer> d_ids, d_targets;
  for (Device* d : ranks) {
    models.push_back(std::make_unique<LlamaModel>(config, options, *d));
    model_ptrs.push_back(models.back().get());
    owned_streams.push_back(d->create_stream("eval"));
    d->kernels().prepare(*owned_streams.back());
    streams.push_back(owned_streams.back().get());
    d_ids.emplace_back(*d, static_cast<uint64_t>(B * T) * 4, "token ids", MemoryKind::activations);
    d_targets.emplace_back(*d, static_cast<uint64_t>(B * T) * 4, "targets",
                           MemoryKind::activations);
  }
  ZeroRunner runner(zero, model_ptrs);

  const auto n = static_cast<size_t>(N);
  std::vector<std::vector<int32_t>> ids(n, std::vector<int32_t>(static_cast<size_t>(B * T)));
  std::vector<std::vector<int32_t>> targets = ids;
  std::vector<std::vector<float>> losses(n, std::vector<float>(static_cast<size_t>(B * T)));
  double sum = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t first = 0; first < sequences; first += N * B) {
    const int64_t last = std::min(sequences, first + N * B);  // this round: [first, last)
    std::vector<RankBatch> batches(n);
    for (int64_t s = first; s < last; ++s) {
      const auto r = static_cast<size_t>((s - first) % N);
      const int64_t i = batches[r].batch++;
      tokens.sequence(s, T, ids[r].data() + i * T, targets[r].data() + i * T);
    }
    for (size_t r = 0; r < n; ++r) {
      const uint64_t bytes = static_cast<uint64_t>(batches[r].batch * T) * 4;
      ranks[r]->copy_to_device(d_ids[r].data(), ids[r].data(), bytes, *streams[r]);
      ranks[r]->copy_to_device(d_targets[r].data(), targets[r].data(), bytes, *streams[r]);
      batches[r].ids = static_cast<const int32_t*>(d_ids[r].data());
      batches[r].targets = static_cast<const int32_t*>(d_targets[r].data());
    }
    runner.forward(batches, streams);
    for (size_t r = 0; r < n; ++r)
      if (batches[r].batch > 0)
        ranks[r]->copy_to_host(losses[r].data(), model_ptrs[r]->losses(batches[r].batch).data,
                               static_cast<uint64_t>(batches[r].batch * T) * 4, *streams[r]);
    for (Stream* st : streams) st->synchronize();
    // In sequence order, whichever rank computed it: the sum of one device.
    for (int64_t s = first; s < last; ++s) {
      const auto r = static_cast<size_t>((s - first) % N);
      const int64_t i = (s - first) / N;
      for (int64_t t = 0; t < T; ++t) sum += losses[r][static_cast<size_t>(i * T + t)];
    }
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const int64_t count = sequences * T;
  const double loss = sum / static_cast<double>(count);
  if (!std::isfinite(loss))
    fail("eval of {} on {}: the loss is {}; the weights or the data hold non-finite values",
         a.model, a.data, loss);
  const double tokens_per_s = static_cast<double>(count) / seconds;
  std::vector<std::string> device_names;
  for (Device* d : ranks) device_names.push_back(d->name());
  if (a.json) {
    nlohmann::json j = {{"loss", loss},
                        {"perplexity", std::exp(loss)},
                        {"tokens", count},
                        {"sequences", sequences},
                        {"seq_len", T},
                        {"model", config.name},
                        {"device", fmt::format("{}", fmt::join(device_names, ","))},
                        {"devices", device_names},
                        {"persistence_threshold", a.persistence_threshold},
                        {"dtype", dtype_name(dtype)},
                        {"tokens_per_s", tokens_per_s}};
    fmt::print("{}\n", j.dump());
  } else {
    fmt::print(
        "eval: {} ({} parameters, {}) on {}: {} sequences x {} tokens\n"
        "  loss {:.6f}  perplexity {:.4f}  ({:.0f} tokens/s)\n",
        config.name, parameter_count(config), dtype_name(dtype), fmt::join(device_names, ","),
        sequences, T, loss, std::exp(loss), tokens_per_s);
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
                  "host, host:N, cuda (every GPU) or cuda:0,1: the model's state is ZeRO-3 "
                  "partitioned across them and sequences are dealt to each in turn (default: "
                  "cuda:0 if a GPU is usable, else host)");
  cmd->add_option("--device-memory", args->device_memory,
                  "cap of the device's memory, e.g. 2GiB (default: host 80% of available RAM, "
                  "cuda all free memory)");
  cmd->add_option("--dtype", args->dtype, "f32 or bf16 (default: f32 on host, bf16 on cuda)");
  cmd->add_option("--persistence-threshold", args->persistence_threshold,
                  "units of at most this many parameters stay whole on every device instead of "
                  "sharded (DeepSpeed's stage3_param_persistence_threshold; 0 shards all)")
      ->capture_default_str();
  cmd->add_flag("--json", args->json, "one JSON object: loss, perplexity, tokens, ...");
  return {cmd, [args] { return run_eval(*args); }};
}

}  // namespace strata::cli
