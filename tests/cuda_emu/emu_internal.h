// emu_internal.h: what the pieces of the CUDA emulator share (not part of any CUDA API).
//
// The emulator (tests/cuda_emu, built with -DSTRATA_CUDA=EMU) runs strata's CUDA backend on the
// CPU: the runtime API (runtime.cpp), kernels launched with <<<...>>> (kernel.cpp, fibers per
// thread block), cuBLASLt matmuls (cublaslt.cpp) and NCCL collectives (nccl.cpp). It is an
// oracle for the logic of the kernels and of the host code around them, not for a GPU's speed,
// memory model or rounding: see README.md beside this file.
//
// Emulated GPUs: STRATA_EMU_GPUS (default 1) of STRATA_EMU_GPU_MEMORY bytes each (default 4 GiB,
// suffixes K/M/G accepted), STRATA_EMU_SHARED_OPTIN bytes of opt-in shared memory per block
// (default 232448, an H100's).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <functional>
#include <stdexcept>
#include <string>

namespace cuda_emu {

// Queues `task` on `stream` (nullptr: the current device's default stream). Tasks of one stream
// run in order on that stream's own worker thread, with the stream's device current there. A
// task that throws Fault (or any std::exception) marks the device with a sticky
// cudaErrorLaunchFailure, prints what() to stderr once, and the stream's later tasks are
// dropped; every later call on that device returns the sticky error, as on a GPU.
void enqueue(cudaStream_t stream, std::function<void()> task);

// A kernel or library call that went wrong while running (a barrier not reached by every
// thread, a shuffle with a lane that is not there, an address outside every allocation...).
struct Fault : std::runtime_error {
  using std::runtime_error::runtime_error;
};

int stream_device(cudaStream_t stream);  // the device a stream belongs to (nullptr: current)
int current_device();                    // the calling thread's current device
int device_count();

// What cudaGetLastError / cudaPeekAtLastError return next on the calling thread.
void set_last_error(cudaError_t err);
// The device's sticky error, or cudaSuccess.
cudaError_t sticky_error(int device);

// True when [p, p + bytes) lies within one live cudaMalloc allocation; `*device` gets its device.
bool device_range(const void* p, size_t bytes, int* device);
// True when p lies in memory from cudaHostAlloc / cudaMallocHost.
bool pinned_range(const void* p, size_t bytes);

// cudaFuncAttributeMaxDynamicSharedMemorySize as set by cudaFuncSetAttribute for `func` on the
// current device (0 when never set).
int func_max_dynamic_shared(const void* func);
int max_shared_per_block_optin(int device);  // STRATA_EMU_SHARED_OPTIN

}  // namespace cuda_emu
