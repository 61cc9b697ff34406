// runtime_absent.cpp: runtime.h for a strata built without the CUDA backend.
//
// Nothing here touches CUDA: the answers say the backend is not compiled, pinned memory
// falls back to the caller's page-aligned allocation, and opening a GPU explains how to get
// a binary that can.
#include "core/error.h"
#include "gpu/attention_kernels.h"
#include "gpu/runtime.h"

#include <atomic>

namespace strata {

const CudaRuntime& cuda_runtime() {
  static const CudaRuntime rt = [] {
    CudaRuntime r;
    r.status = "not compiled";
    r.detail = "built without the CUDA backend (STRATA_CUDA=OFF or no CUDA toolkit found)";
    return r;
  }();
  return rt;
}

uint64_t cuda_free_memory(int /*index*/) {
  return 0;
}

void* cuda_host_alloc(uint64_t /*bytes*/) {
  return nullptr;
}

void cuda_host_free(void* /*ptr*/) {}

std::unique_ptr<Device> open_cuda_device(int index, uint64_t /*arena_bytes*/) {
  fail(
      "cuda:{}: this strata was built without the CUDA backend; rebuild with -DSTRATA_CUDA=ON "
      "on a machine with the CUDA toolkit and NCCL, or use --devices host:N",
      index);
}

namespace {
std::atomic<AttentionKernels> g_attention_kernels{AttentionKernels::kMma};
}  // namespace

void attention_kernels(AttentionKernels k) {
  g_attention_kernels = k;
}

AttentionKernels attention_kernels() {
  return g_attention_kernels;
}

uint64_t attention_calls(AttentionKernels /*k*/) {
  return 0;
}

}  // namespace strata
