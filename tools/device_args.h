// device_args.h: the --devices / --device-memory / --dtype and --model / --init handling that
// the model commands (eval, generate, bench model) share.
#pragma once

#include "core/device.h"
#include "tier/placement.h"
#include "train/ds_config.h"

#include <optional>

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
// tier is an Error naming the flag and the value.
void apply_offload_flags(OffloadRequest& request, const std::string& param,
                         const std::string& optimizer);

}  // namespace strata::cli
