// attention_tiles.cuh: what the two tensor-core attention files share (attention_mma.cu with
// mma.sync, attention_tc.cu with wmma): blocks of 4 warps over tiles of 64 rows of one head,
// staged in shared memory as bf16 by 16-byte copies; the dispatch on head_dim; the grid.
#pragma once

#include "core/kernels.h"
#include "gpu/kernel_common.cuh"

#include <cstdint>
#include <cstring>
#include <initializer_list>

namespace strata::gpu::attention_tiles {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kTile = 64;         // query rows or keys of a block, and of the tiles it walks
constexpr int kMaxHeadDim = 128;  // of dispatch_slices (wmma_attention_head_dim's largest)

// 16 bytes from src to dst, both 16-byte aligned (the emulator copies bytes, which C++ allows).
__device__ __forceinline__ void copy16(void* dst, const void* src) {
#if defined(STRATA_CUDA_EMU)
  std::memcpy(dst, src, 16);
#else
  *static_cast<uint4*>(dst) = *static_cast<const uint4*>(src);
#endif
}
__device__ __forceinline__ void zero16(void* dst) {
#if defined(STRATA_CUDA_EMU)
  std::memset(dst, 0, 16);
#else
  *static_cast<uint4*>(dst) = uint4{0, 0, 0, 0};
#endif
}

// Rows [t0, t0 + 64) of one head into shared memory with row stride `ld`, 16 bytes per thread
// and step; rows at or past `seq` are zero. `src` points at the head's first element of token 0.
__device__ __forceinline__ void load_tile(bf16* dst, int ld, const bf16* __restrict__ src,
                                          int64_t token_stride, int64_t t0, int64_t seq, int hd) {
  const int pieces = hd / 8;
  for (int e = static_cast<int>(threadIdx.x); e < kTile * pieces; e += kThreads) {
    const int r = e / pieces, c = (e - r * pieces) * 8;
    const int64_t t = t0 + r;
    if (t < seq)
      copy16(dst + r * ld + c, src + t * token_stride + c);
    else
      zero16(dst + r * ld + c);
  }
}

// Calls f.template operator()<NS>() with NS = head_dim / 16 (1 to 8): accumulators are arrays
// of NS fragments, which stay in registers only with NS known at compile time.
template <int NS = 1, typename F>
void dispatch_slices(int64_t head_dim, F&& f) {
  if constexpr (NS < kMaxHeadDim / 16) {
    if (head_dim / 16 != NS) return dispatch_slices<NS + 1>(head_dim, f);
  }
  f.template operator()<NS>();
}

// Whether a tensor-core path that is switched on (`enabled`) and takes this head_dim
// (`head_dim_ok`: attention_kernels.h's rule for that path) takes a call of
// dtype t needing `bytes` of shared memory per block: bf16, the device allowing the memory, every
// pointer 16-byte aligned, and as many queries as keys (their tiles walk whole sequences;
// decoding's few queries against cached keys go to the SIMT kernel).
inline bool applies(bool enabled, bool head_dim_ok, DType t, const AttentionDims& d, uint64_t bytes,
                    uint64_t max_shared_bytes, std::initializer_list<const void*> pointers) {
  if (!enabled || !head_dim_ok || t != DType::bf16 || d.keys() != d.seq) return false;
  if (bytes > max_shared_bytes) return false;
  for (const void* p : pointers)
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  return true;
}

// One block per tile of 64 rows, head and sequence.
inline dim3 grid_of(int64_t seq, int64_t heads, int64_t batch) {
  return dim3(static_cast<unsigned>((seq + kTile - 1) / kTile), static_cast<unsigned>(heads),
              static_cast<unsigned>(batch));
}

}  // namespace strata::gpu::attention_tiles
