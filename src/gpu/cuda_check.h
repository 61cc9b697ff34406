// cuda_check.h: every CUDA and NCCL call is checked through these macros.
//
// A failure throws strata::Error naming the call as written, the GPU that was current, the
// error's name and text, and the file and line: "cudaMalloc(&p, bytes) failed on cuda:0:
// cudaErrorMemoryAllocation (out of memory) at src/gpu/cuda_device.cpp:42". Call
// CUDA_CHECK_LAUNCH() right after every kernel launch.
// This header is included by .cu files, so it must not pull in fmt (its consteval format
// strings do not compile under nvcc): the messages are built in cuda_error.cpp. NCCL_CHECK
// needs <nccl.h> included by the file that uses it.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

namespace strata {

// "cudaErrorMemoryAllocation (out of memory)".
std::string cuda_error_text(cudaError_t err);
// Throws Error for a failed CUDA call. Clears the thread's last CUDA error first, so that a
// non-sticky failure does not resurface in a later CUDA_CHECK_LAUNCH().
[[noreturn]] void cuda_fail(cudaError_t err, const char* call, const char* file, int line);
// Throws Error for a failed NCCL call (`result` is the ncclResult_t).
[[noreturn]] void nccl_fail(int result, const char* call, const char* file, int line);

}  // namespace strata

#define CUDA_CHECK(call)                                                \
  do {                                                                  \
    const cudaError_t strata_cuda_err_ = (call);                        \
    if (strata_cuda_err_ != cudaSuccess)                                \
      ::strata::cuda_fail(strata_cuda_err_, #call, __FILE__, __LINE__); \
  } while (0)

#define CUDA_CHECK_LAUNCH()                                                       \
  do {                                                                            \
    const cudaError_t strata_cuda_err_ = cudaGetLastError();                      \
    if (strata_cuda_err_ != cudaSuccess)                                          \
      ::strata::cuda_fail(strata_cuda_err_, "kernel launch", __FILE__, __LINE__); \
  } while (0)

#define NCCL_CHECK(call)                                                                  \
  do {                                                                                    \
    const ncclResult_t strata_nccl_res_ = (call);                                         \
    if (strata_nccl_res_ != ncclSuccess)                                                  \
      ::strata::nccl_fail(static_cast<int>(strata_nccl_res_), #call, __FILE__, __LINE__); \
  } while (0)
