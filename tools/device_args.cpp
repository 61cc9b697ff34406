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

}  // namespace strata::cli
