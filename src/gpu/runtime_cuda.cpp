// runtime_cuda.cpp: runtime.h when the CUDA backend is compiled in (runtime_absent.cpp when
// not): the one-time probe, pinned host memory. open_cuda_device is in cuda_device.cpp.
//
// The probe never throws. A machine with the toolkit but no driver or no GPU is normal (CI
// has nvcc and no GPU), and `strata info` reports it: every case without a usable GPU has the
// status "compiled, no device", and `detail` says why (no driver, driver too old, no GPU).
// Each failed probe call is cleared with cudaGetLastError() so that it cannot resurface in a
// later kernel-launch check.
#include "core/bytes.h"
#include "core/error.h"
#include "core/log.h"
#include "gpu/cuda_check.h"
#include "gpu/runtime.h"

#include <nccl.h>

#include <algorithm>

namespace strata {
namespace {

std::string no_device_detail(cudaError_t err, int driver_version) {
  const std::string text = cuda_error_text(err);
  if (err == cudaErrorInsufficientDriver && driver_version == 0)
    return fmt::format("no NVIDIA driver (libcuda.so.1 not found): {}", text);
  if (err == cudaErrorInsufficientDriver)
    return fmt::format(
        "NVIDIA driver {}.{} is older than the CUDA {}.{} runtime strata was built "
        "with; update the driver: {}",
        driver_version / 1000, driver_version % 1000 / 10, CUDART_VERSION / 1000,
        CUDART_VERSION % 1000 / 10, text);
  return text;
}

// Records a failed per-GPU probe call in `detail` and clears it.
void note(CudaRuntime& rt, int gpu, const char* call, cudaError_t err) {
  (void)cudaGetLastError();
  if (!rt.detail.empty()) rt.detail += "; ";
  rt.detail += fmt::format("cuda:{}: {} failed: {}", gpu, call, cuda_error_text(err));
}

CudaRuntime probe() {
  CudaRuntime rt;
  rt.compiled = true;
  rt.runtime_version = CUDART_VERSION;
  rt.nccl_version = NCCL_VERSION_CODE;
  int version = 0;
  if (ncclGetVersion(&version) == ncclSuccess) rt.nccl_runtime_version = version;
  version = 0;
  if (cudaDriverGetVersion(&version) == cudaSuccess)
    rt.driver_version = version;
  else
    (void)cudaGetLastError();

  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count <= 0) {
    (void)cudaGetLastError();
    rt.status = "compiled, no device";
    rt.detail = err != cudaSuccess ? no_device_detail(err, rt.driver_version)
                                   : "the driver reports no GPU; check nvidia-smi and "
                                     "CUDA_VISIBLE_DEVICES";
    return rt;
  }

  // Properties only: they need no context, so a run on one GPU of a shared node leaves the
  // others untouched (a context costs hundreds of MiB of each GPU's memory).
  for (int i = 0; i < count; ++i) {
    CudaGpu g;
    g.index = i;
    cudaDeviceProp prop{};
    if (cudaError_t e = cudaGetDeviceProperties(&prop, i); e == cudaSuccess) {
      g.name = prop.name;
      g.total_memory = prop.totalGlobalMem;
      g.compute_capability = prop.major * 10 + prop.minor;
      g.multiprocessors = prop.multiProcessorCount;
    } else {
      note(rt, i, "cudaGetDeviceProperties", e);
    }
    char bus[32] = {};
    if (cudaError_t e = cudaDeviceGetPCIBusId(bus, sizeof bus, i); e == cudaSuccess)
      g.pci_bus_id = bus;
    else
      note(rt, i, "cudaDeviceGetPCIBusId", e);
    rt.gpus.push_back(std::move(g));
  }
  rt.status = "ok";
  return rt;
}

}  // namespace

const CudaRuntime& cuda_runtime() {
  static const CudaRuntime rt = probe();
  return rt;
}

uint64_t cuda_free_memory(int index) {
  if (index < 0 || index >= static_cast<int>(cuda_runtime().gpus.size())) return 0;
  int previous = 0;
  if (cudaGetDevice(&previous) != cudaSuccess) (void)cudaGetLastError();
  size_t free_bytes = 0, total_bytes = 0;
  cudaError_t e = cudaSetDevice(index);
  if (e == cudaSuccess) e = cudaMemGetInfo(&free_bytes, &total_bytes);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    free_bytes = 0;
  }
  if (cudaSetDevice(previous) != cudaSuccess) (void)cudaGetLastError();
  return free_bytes;
}

void* cuda_host_alloc(uint64_t bytes) {
  if (cuda_runtime().gpus.empty()) return nullptr;
  void* ptr = nullptr;
  const cudaError_t err = cudaHostAlloc(&ptr, std::max<uint64_t>(bytes, 1), cudaHostAllocPortable);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    fail(
        "pinned host memory: cudaHostAlloc of {} failed: {}; lower the pinned buffer pool or "
        "the state offloaded to host RAM, or free host memory",
        format_bytes(bytes), cuda_error_text(err));
  }
  return ptr;
}

void cuda_host_free(void* ptr) {
  if (ptr == nullptr) return;
  if (const cudaError_t err = cudaFreeHost(ptr); err != cudaSuccess) {
    (void)cudaGetLastError();
    log_error("pinned host memory: cudaFreeHost({}) failed: {}", ptr, cuda_error_text(err));
  }
}

}  // namespace strata
