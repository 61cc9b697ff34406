// eval.cpp: `strata eval`, the mean loss and perplexity of a model over a token file.
//
// Sequence i takes its inputs from tokens [i·T, i·T+T) and its targets from the next T
// tokens shifted by one, so a file of exactly T+1 tokens is one sequence. The loss is the mean
// over every target token.
//
// The model runs through the executor, as training's held-out evaluation does: a placement of
// the parameters alone (RunShape::training off: no gradients, no optimizer state) puts each
// unit's shards on the devices, in host RAM or on NVMe (--offload-param, or offload_param of a
// DeepSpeed --config), checked against this machine's budgets before anything is allocated, and
// a forward-only schedule fetches and gathers each unit ahead of its use. Every device of
// --devices takes part, the state ZeRO-3 partitioned across them: sequences are dealt to ranks
// (rank r gets sequences r, r+N, ..., up to `--batch` per rank at a time), and the per-token
// losses are summed, so the loss is the one device's to rounding, and the same bits wherever
// the parameters live.
#include "commands.h"
#include "device_args.h"
#include "core/bytes.h"
#include "core/device.h"
#include "core/error.h"
#include "core/log.h"
#include "model/config.h"
#include "model/safetensors.h"
#include "model/weights.h"
#include "model/tokens.h"
#include "partition/communicator.h"
#include "schedule/executor.h"
#include "schedule/schedule.h"
#include "tier/placement.h"
#include "train/data_loader.h"

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
  std::vector<std::string> data;
  std::string data_dtype;
  std::string loss_mask = "auto", packing = "auto";
  int64_t seq_len = 0;
  int64_t batch = 1;
  int64_t max_sequences = 0;
  std::string devices;
  std::string device_memory;
  std::string dtype;
  ParamPlacementArgs placement;
  bool json = false;
};

// How many units' parameters each tier holds: {"gpu": 2, "cpu": 4, "nvme": 0}.
int run_eval(const EvalArgs& a) {
  const std::optional<DsConfig> ds = load_cli_config(a.placement.config);
  const LlamaConfig config = resolve_model(a.model);
  const bool load = weights_from_model_dir(a.model, a.init, "evaluate");

  // Tokens first: a bad file fails before any memory is reserved.
  const int64_t T =
      a.seq_len > 0 ? a.seq_len : std::min<int64_t>(1024, config.max_position_embeddings);
  if (a.batch < 1) fail("--batch {} must be at least 1", a.batch);
  if (T < 1 || T > config.max_position_embeddings)
    fail("--seq-len {} is outside 1..{} (max_position_embeddings of {}); choose a shorter one", T,
         config.max_position_embeddings, config.name);
  const std::vector<std::filesystem::path> files(a.data.begin(), a.data.end());
  const bool masks = a.loss_mask == "auto";
  const Packing packing =
      a.packing == "auto" ? auto_packing(files, masks) : parse_packing(a.packing);
  const TokenSequences tokens(files, T, config.vocab_size, parse_token_width(a.data_dtype),
                              "--data", masks, packing);
  int64_t sequences = tokens.size();
  if (a.max_sequences > 0) sequences = std::min(sequences, a.max_sequences);

  auto devices = open_cli_devices(a.devices, a.device_memory, 0);
  const auto N = static_cast<int64_t>(devices.size());
  std::vector<Device*> ranks;
  for (auto& d : devices) ranks.push_back(d.get());
  DsPlanSettings plan;
  if (ds) plan = ds_plan_settings(*ds, static_cast<int>(N), config);
  const DType dtype = run_dtype(*ranks[0], a.dtype, plan, a.placement.config);

  RunShape shape;
  shape.model = config;
  shape.ranks = static_cast<int>(N);
  shape.param_dtype = dtype;
  shape.grad_dtype = dtype;
  shape.micro_batch = std::min<int64_t>(a.batch, (sequences + N - 1) / N);
  shape.seq_len = T;
  ForwardRun run = place_forward_run(shape, a.placement, plan, ranks);
  const Placement& placement = run.placement;
  const int depth = run.prefetch_depth;
  Executor& executor = *run.executor;
  if (load) {
    executor.load(open_model_weights(a.model, config));
  } else {
    executor.init_random(a.seed);
  }

  // Rounds of N·B sequences, one forward-only pass each: rank r takes the round's sequences
  // r, r+N, ... (its batch may be short, or empty, in the last round).
  const int64_t B = shape.micro_batch;
  double sum = 0;
  int64_t count = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t first = 0; first < sequences; first += N * B) {
    const int64_t last = std::min(sequences, first + N * B);
    std::vector<std::vector<HostBatch>> batches(1, std::vector<HostBatch>(static_cast<size_t>(N)));
    const bool docs = tokens.packs_documents();
    for (HostBatch& b : batches[0]) {
      b.ids.resize(static_cast<size_t>(B * T));
      b.targets.resize(b.ids.size());
      if (docs) b.doc_start.resize(b.ids.size());
    }
    for (int64_t s = first; s < last; ++s) {
      HostBatch& b = batches[0][static_cast<size_t>((s - first) % N)];
      tokens.read(s, b.ids.data() + b.batch * T, b.targets.data() + b.batch * T,
                  docs ? b.doc_start.data() + b.batch * T : nullptr);
      ++b.batch;
    }
    for (HostBatch& b : batches[0]) {
      b.ids.resize(static_cast<size_t>(b.batch * T));
      b.targets.resize(b.ids.size());
      if (docs) b.doc_start.resize(b.ids.size());
    }
    const EvalResult e = executor.evaluate(batches);
    sum += e.loss_sum;
    count += e.targets;
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (count == 0)
    fail(
        "eval of {} on {}: no target of the {} sequences evaluated counts (their loss masks "
        "mark none); evaluate more sequences (--max-sequences), or pass --loss-mask off",
        a.model, fmt::join(a.data, ","), sequences);
  const double loss = sum / static_cast<double>(std::max<int64_t>(count, 1));
  if (!std::isfinite(loss))
    fail("eval of {} on {}: the loss is {}; the weights or the data hold non-finite values",
         a.model, fmt::join(a.data, ","), loss);
  const double tokens_per_s = static_cast<double>(count) / seconds;
  std::vector<std::string> device_names;
  for (Device* d : ranks) device_names.push_back(d->name());
  const TierBytes need = placement.needs();
  if (a.json) {
    nlohmann::json j = {{"loss", loss},
                        {"perplexity", std::exp(loss)},
                        {"tokens", count},
                        {"sequences", sequences},
                        {"seq_len", T},
                        {"packing", packing_name(packing)},
                        {"model", config.name},
                        {"device", fmt::format("{}", fmt::join(device_names, ","))},
                        {"devices", device_names},
                        {"persistence_threshold", placement.shape.persistence_threshold},
                        {"dtype", dtype_name(dtype)},
                        {"prefetch_depth", depth},
                        {"parameter_homes", homes_json(placement)},
                        {"memory",
                         {{"gpu_per_device", need.to_json(Tier::gpu)},
                          {"cpu", need.to_json(Tier::cpu)},
                          {"nvme", need.to_json(Tier::nvme)}}},
                        {"tokens_per_s", tokens_per_s}};
    fmt::print("{}\n", j.dump());
  } else {
    fmt::print(
        "eval: {} ({} parameters, {}) on {}: {} sequences x {} tokens\n"
        "  parameters of {} units: {} (gpu {} per device, cpu {}, nvme {})\n"
        "  loss {:.6f}  perplexity {:.4f}  ({:.0f} tokens/s)\n",
        config.name, parameter_count(config), dtype_name(dtype), fmt::join(device_names, ","),
        sequences, T, placement.homes.size(), homes_text(placement),
        format_bytes(need.total(Tier::gpu)), format_bytes(need.total(Tier::cpu)),
        format_bytes(need.total(Tier::nvme)), loss, std::exp(loss), tokens_per_s);
    if (packing != Packing::wrapped) fmt::print("  {}\n", describe_documents(tokens));
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
                  "token files, their sequences in order: llm.c shards (.bin) or raw "
                  "uint16/uint32 with --data-dtype")
      ->delimiter(',')
      ->required();
  cmd->add_option("--data-dtype", args->data_dtype, "raw token files: uint16 or uint32");
  cmd->add_option("--loss-mask", args->loss_mask,
                  "auto: where a token file has a loss mask beside it (FILE.mask, from strata "
                  "tokenize), the loss is over the targets it marks only; off: over every target")
      ->check(CLI::IsMember({"auto", "off"}))
      ->capture_default_str();
  cmd->add_option("--packing", args->packing,
                  "how sequences are cut from the token files: wrapped (end to end, cut into "
                  "--seq-len windows), none (one document per sequence, padded, cut after "
                  "--seq-len + 1 tokens; needs strata tokenize's document index), bfd (those "
                  "documents packed whole into sequences by best fit decreasing, each attending "
                  "to itself alone), auto (none for files with loss masks and document indexes, "
                  "else wrapped)")
      ->check(CLI::IsMember({"auto", "wrapped", "none", "bfd"}))
      ->capture_default_str();
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
  add_param_placement_options(cmd, args->placement);
  cmd->add_flag("--json", args->json, "one JSON object: loss, perplexity, tokens, ...");
  return {cmd, [args] { return run_eval(*args); }};
}

}  // namespace strata::cli
