// runtime.h: what strata knows of CUDA, whether or not the CUDA backend was compiled.
//
// src/gpu/runtime.cu implements it when the toolkit is present; runtime_absent.cpp when not.
// Nothing here throws when there is no driver or no GPU: the answer says so instead.
#pragma once

#include "core/device.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace strata {

struct CudaGpu {
  int index = 0;
  std::string name;
  uint64_t total_memory = 0;
  std::string pci_bus_id;      // "0000:17:00.0", for hwloc's NUMA lookup
  int compute_capability = 0;  // 90 for sm_90
  int multiprocessors = 0;
};

struct CudaRuntime {
  bool compiled = false;    // the CUDA backend is part of this binary
  std::string status;       // "not compiled", "compiled, no driver", "compiled, no device", "ok"
  std::string detail;       // the CUDA error text behind a "no driver"/"no device" status
  int runtime_version = 0;  // CUDART_VERSION compiled in, e.g. 13000
  int driver_version = 0;   // 0 without a driver
  int nccl_version = 0;     // NCCL_VERSION_CODE compiled in
  int nccl_runtime_version = 0;
  std::vector<CudaGpu> gpus;
};

// Probes once and caches the answer. It reads each GPU's properties, which opens no context.
const CudaRuntime& cuda_runtime();

// GPU `index`'s free memory now (0 when it cannot be read). This opens a context on that GPU
// (hundreds of MiB of its memory, until the process exits): for `strata info`, not for a run.
uint64_t cuda_free_memory(int index);

// Pinned host memory through cudaHostAlloc. Returns nullptr when there is no CUDA device
// (the caller falls back to page-aligned, mlock'ed memory); throws Error if the driver
// refuses a request on a machine that has a device.
void* cuda_host_alloc(uint64_t bytes);
void cuda_host_free(void* ptr);

// Opens GPU `index` with an arena of `arena_bytes` (0: all free memory but a reserve).
// Throws Error when CUDA is not compiled in or the GPU does not exist.
std::unique_ptr<Device> open_cuda_device(int index, uint64_t arena_bytes);

}  // namespace strata
