#include "device_args.h"

#include "core/bytes.h"
#include "core/error.h"
#include "core/log.h"
#include "core/system.h"
#include "gpu/runtime.h"

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
  if (!dtype.empty()) return parse_dtype(dtype);
  return device.backend() == Backend::host ? DType::f32 : DType::bf16;
}

bool weights_from_model_dir(const std::string& model, const std::string& init,
                            std::string_view use) {
  if (!init.empty() && init != "random")
    fail("--init '{}' is not known; the only initialisation is 'random'", init);
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
  return ds;
}

void apply_offload_flags(OffloadRequest& request, const std::string& param,
                         const std::string& optimizer) {
  for (const auto& [flag, value, tier] :
       {std::tuple{"--offload-param", &param, &request.param},
        std::tuple{"--offload-optimizer", &optimizer, &request.optimizer}}) {
    if (value->empty()) continue;
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

}  // namespace strata::cli
