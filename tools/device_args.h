// device_args.h: the --devices / --device-memory / --dtype and --model / --init handling that
// the model commands (eval, generate, bench model) share.
#pragma once

#include "core/device.h"
#include "partition/communicator.h"
#include "schedule/executor.h"
#include "tier/placement.h"
#include "train/ds_config.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <limits>
#include <optional>
#include <utility>

#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace strata::cli {

// The devices of --devices (default: cuda:0 when a GPU is usable, else host), each capped at
// --device-memory; host devices default to 80% of available RAM (their arenas only reserve
// address space until touched). `max_devices` > 0 keeps the first ones, with a warning.
std::vector<std::unique_ptr<Device>> open_cli_devices(const std::string& devices,
                                                      const std::string& device_memory,
                                                      size_t max_devices);

// --dtype, or the default for the device: f32 on the host backend, bf16 on CUDA.
DType model_dtype(const Device& device, const std::string& dtype);
// An Error unless `device`'s kernels compute in `dtype`: the CUDA backend has no f16 kernels
// (f32 and bf16 only). `source` names where the dtype came from ("--dtype f16").
void check_model_dtype(const Device& device, DType dtype, std::string_view source);

// --dtype, else the DeepSpeed config's bf16/fp16 (`plan.param_dtype`, from `config_path`), else
// the device's default; checked against the device's kernels.
DType run_dtype(const Device& device, const std::string& dtype, const DsPlanSettings& plan,
                const std::string& config_path);

// --grad-dtype, else the DeepSpeed config's data_types.grad_accum_dtype (`from_config`, read from
// `config_path`), else f32; an Error unless it is f32 or the parameters' dtype `params` (the
// backward writes 16-bit gradients from 16-bit activations, and the kernels take no other mix).
DType grad_dtype_for(const std::string& flag, std::optional<DType> from_config, DType params,
                     const std::string& config_path);

// --vocab-pieces N (train, plan): the vocabulary pieces `model`'s embedding and head are cut
// into (LlamaConfig::vocab_pieces; 0, the default, lets strata choose). Sets it on `model`; an
// Error naming the flag for a count the model cannot take.
void apply_vocab_pieces(int64_t flag, LlamaConfig& model);

// Whether the weights come from the directory --model names (true) or from --init random
// (false). An Error for an --init other than 'random', and for a preset (no weights) without
// --init random; `use` is what the model is for in that message ("evaluate", "sample from").
bool weights_from_model_dir(const std::string& model, const std::string& init,
                            std::string_view use);

// The DeepSpeed config of --config (none when the flag is empty), with the keys strata does not
// act on listed once as a warning (plan, train).
std::optional<DsConfig> load_cli_config(const std::string& path);

// --offload-param / --offload-optimizer over what the config asked for: none, cpu, nvme, or
// auto (placement within the budgets); an empty flag leaves the config's choice. An unknown
// tier is an Error naming the flag and the value. --offload-gradients (`gradients`): auto, none
// (or gpu), cpu (OffloadRequest::grads); empty leaves the request's.
void apply_offload_flags(OffloadRequest& request, const std::string& param,
                         const std::string& optimizer, const std::string& gradients = "");

// --offload-activations (`flag`: none, cpu, or empty when not given) over the DeepSpeed config's
// activation_checkpointing.cpu_checkpointing: whether the activation checkpoints live in host
// RAM (RunShape::offload_activations). Another value is an Error naming the flag.
bool offload_activations_flag(const std::string& flag, std::optional<bool> from_config);

// The value of a count flag that was not given (so that `--micro-batch 0` is not mistaken for
// leaving it out).
inline constexpr int64_t kUnsetFlag = std::numeric_limits<int64_t>::min();

// A count flag: `fallback` when it was not given (kUnsetFlag), else its value, which must be at
// least 1: an Error names the flag, the value and what it counts.
int64_t count_flag(const char* flag, int64_t value, int64_t fallback, const char* counts);

// --prefetch-depth: `fallback` when it was not given (kUnsetFlag), else its value, units
// fetched ahead of their use, 0..64; an Error names the flag and the value.
int prefetch_depth_flag(int64_t value, int fallback);

// A memory budget flag (--cpu-memory, --pinned-memory): 0 when not given (empty), else its
// bytes (parse_bytes), which must be more than 0: an Error names the flag, the value, `what`
// it budgets and an `example` size.
uint64_t budget_flag(const char* flag, const std::string& text, const char* what,
                     const char* example);

// --micro-batch-group (kUnsetFlag: not given, 1): micro-batches run unit by unit, at least 1 and
// at most the step's `micro_batches`; an Error names the flag, its value and the limit.
int micro_batch_group_flag(int64_t value, int64_t micro_batches);

// The micro-batch and gradient accumulation steps of a run on `world` devices: --micro-batch
// and --grad-accum (kUnsetFlag: not given) over what the DeepSpeed config resolves to
// (`from_config`), else 1. When the config fixes train_batch_size, DeepSpeed refuses a run
// whose micro-batch x accumulation x world differs from it, and so does this: flags that
// break the product are an Error naming both sides and the flag value that would agree.
std::pair<int64_t, int64_t> resolve_batch(const std::optional<DsConfig>& config,
                                          const DsBatch& from_config, int world, int64_t micro_flag,
                                          int64_t accum_flag);

// ---- the parameters of a forward-only run (eval, generate) in whichever tier has room ----

struct ParamPlacementArgs {
  int64_t persistence_threshold = -1;  // -1: the config's, else DeepSpeed's default
  std::string config;                  // --config ds_config.json
  std::string offload_param;
  std::vector<std::string> nvme_paths;
  int64_t prefetch_depth = kUnsetFlag;
  std::string cpu_memory, pinned_memory;
};
// --persistence-threshold, --config, --offload-param, --nvme-path, --prefetch-depth,
// --cpu-memory and --pinned-memory.
void add_param_placement_options(CLI::App* cmd, ParamPlacementArgs& args);

// Where the parameters are asked to live: the DeepSpeed config's offload_param (`plan`) with
// --offload-param and --nvme-path over it.
OffloadRequest param_request(const ParamPlacementArgs& args, const DsPlanSettings& plan);

// A forward-only run: the parameters of `shape` (its model, ranks, dtype, micro-batch, sequence
// length and kv_cache; the rest is set here, training off) homed as param_request() asks, placed
// and checked against this machine's budgets (an Error with the table when they do not fit, before
// anything is allocated), with its forward-only schedule and executor over `ranks`.
struct ForwardRun {
  Placement placement;
  int prefetch_depth = 1;
  std::unique_ptr<Communicator> comm;
  std::unique_ptr<Executor> executor;
};
ForwardRun place_forward_run(RunShape shape, const ParamPlacementArgs& args,
                             const DsPlanSettings& plan, const std::vector<Device*>& ranks);

// Units per tier of the parameters' homes: {"gpu": n, "cpu": n, "nvme": n}, and as text
// ("gpu 2, nvme 3").
nlohmann::json homes_json(const Placement& placement);
std::string homes_text(const Placement& placement);

}  // namespace strata::cli
