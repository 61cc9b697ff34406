#include "device_args.h"

#include "core/bytes.h"
#include "core/error.h"
#include "core/log.h"
#include "core/system.h"
#include "gpu/runtime.h"
#include "model/config.h"
#include "model/llama.h"

#include <filesystem>

namespace strata::cli {

std::vector<std::unique_ptr<Device>> open_cli_devices(const std::string& devices,
                                                      const std::string& device_memory,
                                                      size_t max_devices) {
  const std::string text =
      !devices.empty() ? devices : (cuda_runtime().gpus.empty() ? "host" : "cuda:0");
  DeviceSpec spec = parse_device_spec(text);
  if (max_devices > 0 && spec.indices.size() > max_devices) {
    log_warn("this command runs on {} device(s); using the first of --devices {}", max_devices,
             text);
    spec.indices.resize(max_devices);
  }
  uint64_t cap = device_memory.empty() ? 0 : parse_bytes(device_memory);
  if (spec.backend == Backend::host && cap == 0) cap = memory_info().available / 10 * 8;
  return open_devices(spec, cap);
}

DType model_dtype(const Device& device, const std::string& dtype) {
  if (dtype.empty()) return device.backend() == Backend::host ? DType::f32 : DType::bf16;
  const DType t = parse_dtype(dtype);
  check_model_dtype(device, t, "--dtype " + dtype);
  return t;
}

void check_model_dtype(const Device& device, DType dtype, std::string_view source) {
  if (dtype == DType::f16 && device.backend() == Backend::cuda)
    fail(
        "{}: f16 parameters and activations need f16 kernels, which strata's CUDA backend does "
        "not have ({} computes in f32 or bf16); use bf16 (--dtype bf16, or \"bf16\": "
        "{{\"enabled\": true}} in the DeepSpeed config: the same memory, and no loss scaling "
        "needed), or host devices (--devices host:N)",
        source, device.name());
}

void apply_vocab_pieces(int64_t flag, LlamaConfig& model) {
  if (flag < 0) fail("--vocab-pieces {}: give a count of pieces, or 0 to let strata choose", flag);
  model.vocab_pieces = flag;
  try {
    (void)ModelLayout::build(model);
  } catch (const Error& e) {
    fail("--vocab-pieces {}: {}", flag, e.what());
  }
}

DType grad_dtype_for(const std::string& flag, std::optional<DType> from_config, DType params,
                     const std::string& config_path) {
  DType t = from_config.value_or(DType::f32);
  std::string source = fmt::format("{}: data_types.grad_accum_dtype", config_path);
  if (!flag.empty()) {
    if (flag != "f32" && flag != "bf16" && flag != "f16")
      fail("--grad-dtype '{}' is not one of f32, bf16, f16", flag);
    t = parse_dtype(flag);
    source = "--grad-dtype " + flag;
  }
  if (t != DType::f32 && t != params)
    fail(
        "{}: {} gradients with {} parameters; 16-bit gradients need parameters of the same "
        "dtype (--dtype {}), or keep them in f32 (--grad-dtype f32)",
        source, dtype_name(t), dtype_name(params), dtype_name(t));
  return t;
}

bool weights_from_model_dir(const std::string& model, const std::string& init,
                            std::string_view use) {
  if (!init.empty() && init != "random")
    fail("--init '{}' is not known; the only initialisation is 'random'", init);
  if (!std::filesystem::is_directory(model) && init.empty() && !find_preset(model)) {
    if (std::filesystem::exists(model))
      fail(
          "--model {}: is a file; pass the Hugging Face checkpoint directory that holds "
          "config.json and model.safetensors",
          model);
    (void)resolve_model(model);  // an Error naming the model and listing the presets
  }
  if (!std::filesystem::is_directory(model) && init.empty())
    fail(
        "--model {} is a preset without weights; pass --init random (with --seed) to {} a "
        "randomly initialised model, or a Hugging Face checkpoint directory",
        model, use);
  return init.empty();
}

std::optional<DsConfig> load_cli_config(const std::string& path) {
  if (path.empty()) return std::nullopt;
  DsConfig ds = load_ds_config(path);
  if (!ds.ignored.empty()) {
    std::string keys;
    for (const std::string& k : ds.ignored) keys += (keys.empty() ? "" : ", ") + k;
    log_warn("config {}: not acted on by strata: {}", path, keys);
  }
  if (ds.zero.stage && *ds.zero.stage != 3)
    log_warn(
        "config {}: zero_optimization.stage is {}; strata runs every stage as stage 3: the "
        "parameters are partitioned across the GPUs too (the same updates, 1/N of the model "
        "state on each GPU, each unit gathered before use)",
        path, *ds.zero.stage);
  return ds;
}

bool offload_activations_flag(const std::string& flag, std::optional<bool> from_config) {
  if (flag.empty()) return from_config.value_or(false);
  if (flag == "cpu") return true;
  if (flag == "none" || flag == "gpu") return false;
  fail(
      "--offload-activations {}: expected none (the activation checkpoints stay on the GPU) or "
      "cpu (in host RAM, copied out after each block's forward and back before its backward)",
      flag);
}

void apply_offload_flags(OffloadRequest& request, const std::string& param,
                         const std::string& optimizer, const std::string& gradients) {
  if (!gradients.empty()) {
    try {
      request.grads = parse_grad_home(gradients);
    } catch (const Error& e) {
      fail("--offload-gradients {}: {}", gradients, e.what());
    }
  }
  for (const auto& [flag, value, tier] :
       {std::tuple{"--offload-param", &param, &request.param},
        std::tuple{"--offload-optimizer", &optimizer, &request.optimizer}}) {
    if (value->empty()) continue;
    // A config's max_in_cpu (DeepSpeed's 1e9 a rank where it gives none) belongs to its
    // offload_param.device nvme: a flag that homes the parameters elsewhere drops it.
    if (tier == &request.param && *value != "nvme") request.max_in_cpu = 0;
    if (*value == "auto") {
      request.automatic = true;
      continue;
    }
    try {
      *tier = parse_tier(*value);
    } catch (const Error& e) {
      fail("{} {}: {}", flag, *value, e.what());
    }
  }
}

int64_t count_flag(const char* flag, int64_t value, int64_t fallback, const char* counts) {
  if (value == kUnsetFlag) return fallback;
  if (value < 1) fail("{} {}: it counts {}, so it must be at least 1", flag, value, counts);
  return value;
}

int prefetch_depth_flag(int64_t value, int fallback) {
  if (value == kUnsetFlag) return fallback;
  if (value < 0 || value > 64)
    fail("--prefetch-depth {}: units fetched ahead of their use, expected 0..64", value);
  return static_cast<int>(value);
}

uint64_t budget_flag(const char* flag, const std::string& text, const char* what,
                     const char* example) {
  if (text.empty()) return 0;
  const uint64_t bytes = parse_bytes(text);
  if (bytes == 0) fail("{} {}: no {} at all; give a size such as {}", flag, text, what, example);
  return bytes;
}

int micro_batch_group_flag(int64_t value, int64_t micro_batches) {
  const int64_t g =
      count_flag("--micro-batch-group", value, 1, "micro-batches run unit by unit at once");
  if (g > micro_batches)
    fail(
        "--micro-batch-group {}: the step has only {} micro-batch(es) (--grad-accum); a group is "
        "at most the step's micro-batches, so give --micro-batch-group {} or raise --grad-accum",
        g, micro_batches, micro_batches);
  return static_cast<int>(g);
}

std::pair<int64_t, int64_t> resolve_batch(const std::optional<DsConfig>& config,
                                          const DsBatch& from_config, int world, int64_t micro_flag,
                                          int64_t accum_flag) {
  const int64_t micro = count_flag("--micro-batch", micro_flag, from_config.micro_batch.value_or(1),
                                   "sequences per device per micro-batch");
  const int64_t accum = count_flag("--grad-accum", accum_flag, from_config.grad_accum.value_or(1),
                                   "micro-batches per optimizer step");
  const bool micro_given = micro_flag != kUnsetFlag, accum_given = accum_flag != kUnsetFlag;
  if (!config || !config->train_batch_size || (!micro_given && !accum_given)) return {micro, accum};
  // DeepSpeed's arithmetic over the flags and the values the config fixes: with two of
  // train_batch_size, micro-batch and accumulation the third is derived, with three they agree.
  const int64_t want = *config->train_batch_size, w = world;
  const std::optional<int64_t> mb =
      micro_given ? std::optional<int64_t>(micro) : config->train_micro_batch_size_per_gpu;
  const std::optional<int64_t> ga =
      accum_given ? std::optional<int64_t>(accum) : config->gradient_accumulation_steps;
  const std::string src = config->source;
  const auto unfixable = [&](const std::string& what, const std::string& fix) {
    fail(
        "{} x {} device(s) does not divide the train_batch_size {} that DeepSpeed config {} "
        "sets (DeepSpeed refuses such a run); {}, or set train_batch_size to \"auto\"",
        what, w, want, src, fix);
  };
  if (mb && !ga) {
    if (want % (*mb * w) != 0)
      unfixable(fmt::format("--micro-batch {}", *mb),
                "pass a --micro-batch that divides " + std::to_string(want / w));
    return {*mb, want / (*mb * w)};
  }
  if (ga && !mb) {
    if (want % (*ga * w) != 0)
      unfixable(fmt::format("--grad-accum {}", *ga),
                "pass a --grad-accum that divides " + std::to_string(want / w));
    return {want / (*ga * w), *ga};
  }
  const int64_t got = *mb * *ga * w;
  if (got == want) return {*mb, *ga};
  const std::string m = micro_given ? fmt::format("--micro-batch {}", *mb)
                                    : fmt::format("train_micro_batch_size_per_gpu {}", *mb);
  const std::string g = accum_given ? fmt::format("--grad-accum {}", *ga)
                                    : fmt::format("gradient_accumulation_steps {}", *ga);
  std::string fix;
  if (!accum_given && want % (*mb * w) == 0)
    fix = fmt::format("add --grad-accum {}", want / (*mb * w));
  else if (!micro_given && want % (*ga * w) == 0)
    fix = fmt::format("add --micro-batch {}", want / (*ga * w));
  else
    fix = fmt::format("choose --micro-batch x --grad-accum = {} / {} device(s)", want, w);
  fail(
      "{} x {} x {} device(s) = {} sequences per step, but DeepSpeed config {} sets "
      "train_batch_size {} (DeepSpeed refuses such a run); {}, or set train_batch_size to "
      "\"auto\" in the config",
      m, g, w, got, src, want, fix);
}

DType run_dtype(const Device& device, const std::string& dtype, const DsPlanSettings& plan,
                const std::string& config_path) {
  if (!dtype.empty() || !plan.param_dtype) return model_dtype(device, dtype);
  check_model_dtype(device, *plan.param_dtype, fmt::format("{}: fp16.enabled", config_path));
  return *plan.param_dtype;
}

void add_param_placement_options(CLI::App* cmd, ParamPlacementArgs& a) {
  cmd->add_option("--persistence-threshold", a.persistence_threshold,
                  "units of at most this many parameters stay whole on every device instead of "
                  "sharded (DeepSpeed's stage3_param_persistence_threshold, default 100000; 0 "
                  "shards all)");
  cmd->add_option("--config", a.config,
                  "DeepSpeed JSON config: its offload_param (device, nvme_path, buffer_count, "
                  "pin_memory), aio, bf16/fp16 and stage3 settings");
  cmd->add_option("--offload-param", a.offload_param,
                  "where the parameter shards live: none (default), cpu, nvme or auto (the "
                  "fastest tier with room; overrides --config)");
  cmd->add_option("--nvme-path", a.nvme_paths, "NVMe directories for --offload-param nvme")
      ->delimiter(',');
  cmd->add_option("--prefetch-depth", a.prefetch_depth, "units fetched ahead (default 1)");
  cmd->add_option("--cpu-memory", a.cpu_memory,
                  "host RAM the parameters may use (default 80% of what is available)");
  cmd->add_option("--pinned-memory", a.pinned_memory,
                  "page-locked memory allowed (default and at most ulimit -l)");
}

OffloadRequest param_request(const ParamPlacementArgs& a, const DsPlanSettings& plan) {
  OffloadRequest request = plan.offload;
  apply_offload_flags(request, a.offload_param, "");
  if (!a.nvme_paths.empty()) request.nvme_paths = a.nvme_paths;
  return request;
}

ForwardRun place_forward_run(RunShape shape, const ParamPlacementArgs& a,
                             const DsPlanSettings& plan, const std::vector<Device*>& ranks) {
  const uint64_t cpu_memory = budget_flag("--cpu-memory", a.cpu_memory, "host RAM", "64GiB");
  const uint64_t pinned_memory =
      budget_flag("--pinned-memory", a.pinned_memory, "page-locked memory", "2GiB");
  ForwardRun run;
  shape.persistence_threshold = a.persistence_threshold >= 0
                                    ? static_cast<uint64_t>(a.persistence_threshold)
                                    : plan.persistence_threshold.value_or(100000);
  run.prefetch_depth = prefetch_depth_flag(a.prefetch_depth, plan.prefetch_depth.value_or(1));
  shape.working_buffers = working_buffers_for(run.prefetch_depth, shape.model.tie_word_embeddings);
  shape.training = false;
  run.placement = place_locally(shape, param_request(a, plan), ranks[0]->memory().capacity,
                                cpu_memory, pinned_memory);
  log_debug("{}", run.placement.str());
  ScheduleOptions so;
  so.prefetch_depth = run.prefetch_depth;
  so.forward_only = true;
  run.comm = make_communicator(ranks);
  run.executor =
      std::make_unique<Executor>(run.placement, Schedule::build(run.placement, so), *run.comm);
  return run;
}

nlohmann::json homes_json(const Placement& pl) {
  nlohmann::json j = nlohmann::json::object();
  for (Tier t : {Tier::gpu, Tier::cpu, Tier::nvme})
    j[std::string(tier_name(t))] = std::count_if(pl.homes.begin(), pl.homes.end(),
                                                 [t](const UnitHomes& h) { return h.param == t; });
  return j;
}

std::string homes_text(const Placement& pl) {
  const nlohmann::json counts = homes_json(pl);
  std::string out;
  for (Tier t : {Tier::gpu, Tier::cpu, Tier::nvme})
    if (const int64_t n = counts[std::string(tier_name(t))]; n > 0)
      out += fmt::format("{}{} {}", out.empty() ? "" : ", ", tier_name(t), n);
  return out;
}

}  // namespace strata::cli
