// device_args.h: the --devices / --device-memory / --dtype handling that the model commands
// (eval, bench model) share.
#pragma once

#include "core/device.h"

#include <memory>
#include <string>
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

}  // namespace strata::cli
