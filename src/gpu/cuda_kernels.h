// cuda_kernels.h: the CUDA backend's kernel table (core/kernels.h) and what it needs from the
// CudaDevice that owns it (cuda_device.cpp).
//
// The table checks shapes with the shared check_* functions, rejects f16 (the CUDA kernels
// take f32 and bf16), checks that every pointer lies in the device's arena, then makes the GPU
// current and queues the kernels (ops.h) or cuBLASLt (matmul.h) on the stream.
#pragma once

#include "core/kernels.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>

namespace strata {

// Bytes of each stream's workspace: cuBLASLt's workspace, and the scratch of the kernels that
// reduce in two passes (rmsnorm's dw partials). Work on one stream runs in order, so they share
// it; it lives outside the arena (cudaMalloc'ed on the stream's first use, freed with the
// stream), within the reserve a default arena leaves free.
inline constexpr uint64_t kStreamWorkspaceBytes = uint64_t{32} << 20;

// What the kernel table needs from its device; CudaDevice implements it.
class CudaDeviceAccess {
 public:
  virtual const std::string& device_name() const = 0;  // "cuda:0"
  virtual int device_index() const = 0;
  // Makes the GPU current on the calling thread and returns the CUDA stream behind `s`; throws
  // Error when `s` was not created by this device.
  virtual cudaStream_t enter(Stream& s) const = 0;
  // The stream's workspace of kStreamWorkspaceBytes (256-byte aligned), allocated on first use.
  virtual void* workspace(Stream& s) const = 0;
  // Throws Error naming `op` and `which` unless [ptr, ptr + bytes) lies in the arena.
  virtual void check_in_arena(const char* op, const char* which, const void* ptr,
                              uint64_t bytes) const = 0;

 protected:
  ~CudaDeviceAccess() = default;
};

// The table of `device`, which must outlive it. Makes no CUDA call; its destructor (with the GPU
// current and idle) frees the cuBLASLt handle.
std::unique_ptr<Kernels> make_cuda_kernels(const CudaDeviceAccess& device);

}  // namespace strata
