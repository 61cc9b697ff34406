// attention_kernels.h: which of the CUDA backend's attention kernels take the calls they apply
// to, process-wide, for tests and benchmarks that compare them. Declared apart from ops.h so that
// code compiled once for every backend (tools/bench_attention.cpp) can ask without CUDA's headers;
// without the CUDA backend (runtime_absent.cpp) the choice is kept and changes nothing.
#pragma once

#include <cstdint>

namespace strata {

// All three in turn (kMma, the default), wmma then SIMT (kWmma), or SIMT only (kSimt).
enum class AttentionKernels { kMma, kWmma, kSimt };
void attention_kernels(AttentionKernels k);
AttentionKernels attention_kernels();
// How many forward and backward calls each path has taken in this process (tests check that
// the path they asked for ran). Always 0 without the CUDA backend.
uint64_t attention_calls(AttentionKernels k);

// The head_dims each tensor-core path takes (in bf16, where the GPU's shared memory allows):
// attention_mma.cu's multiples of 16 up to 128, and 256; attention_tc.cu's (wmma) multiples of 16
// up to 128. Every other call runs the SIMT kernels.
constexpr bool mma_attention_head_dim(int64_t hd) {
  return hd > 0 && hd % 16 == 0 && (hd <= 128 || hd == 256);
}
constexpr bool wmma_attention_head_dim(int64_t hd) {
  return hd > 0 && hd % 16 == 0 && hd <= 128;
}

}  // namespace strata
