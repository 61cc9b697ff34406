// kernel_common.cuh: what every model kernel (src/gpu/*.cu) shares: storage types, warp and
// block reductions, dtype dispatch and grid sizing.
//
// Storage is f32 or bf16 (`float`, `__nv_bfloat16`); arithmetic is always f32, and every store
// into bf16 rounds to nearest even (__float2bfloat16_rn), as the host reference does. Grids are
// capped and kernels loop grid-stride with 64-bit indices, so a tensor of more than 2^31
// elements is fine. Only .cu files include this: no fmt.
#pragma once

#include "core/dtype.h"
#include "gpu/cuda_check.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <utility>

namespace strata::gpu {

using bf16 = __nv_bfloat16;

__device__ __forceinline__ float to_f32(float v) {
  return v;
}
__device__ __forceinline__ float to_f32(bf16 v) {
  return __bfloat162float(v);
}

template <typename T>
__device__ __forceinline__ T from_f32(float v);
template <>
__device__ __forceinline__ float from_f32<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ bf16 from_f32<bf16>(float v) {
  return __float2bfloat16_rn(v);
}

constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) {
  return a < b ? a : b;
}

// The first key query t of sequence b sees (AttentionMask::first_key): its packed document's
// first position (AttentionDims::doc_start; 0 where there are no documents), or with a sliding
// window (AttentionDims::window > 0) t + shift - window + 1 where that is later (shift: the
// cached keys before the queries, Tk - T, when decoding). Non-decreasing in t, which the
// kernels' walks over key and query tiles rely on.
__device__ __forceinline__ int64_t doc_first(const int32_t* doc_start, int64_t window, int64_t b,
                                             int64_t seq, int64_t t, int64_t shift = 0) {
  const int64_t doc = doc_start != nullptr ? doc_start[b * seq + t] : 0;
  const int64_t p = t + shift;
  return window > 0 && p - window + 1 > doc ? p - window + 1 : doc;
}

struct Sum {
  __device__ static float apply(float a, float b) { return a + b; }
  static constexpr float kIdentity = 0.0f;
};
struct Max {  // fmaxf: a NaN loses to a number
  __device__ static float apply(float a, float b) { return fmaxf(a, b); }
  static constexpr float kIdentity = -INFINITY;
};

template <typename Op>
__device__ __forceinline__ float warp_reduce(float v) {
  for (int o = 16; o > 0; o >>= 1) v = Op::apply(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}
__device__ __forceinline__ float warp_sum(float v) {
  return warp_reduce<Sum>(v);
}
__device__ __forceinline__ float warp_max(float v) {
  return warp_reduce<Max>(v);
}

// `v` reduced over the block, returned to every thread. blockDim.x must be a multiple of 32;
// `scratch` holds 32 floats of shared memory. Safe to call repeatedly with one scratch: the
// leading barrier keeps a call's writes from racing the previous call's reads.
template <typename Op>
__device__ __forceinline__ float block_reduce(float v, float* scratch) {
  v = warp_reduce<Op>(v);
  const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < (blockDim.x >> 5) ? scratch[lane] : Op::kIdentity;
  return warp_reduce<Op>(v);
}
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  return block_reduce<Sum>(v, scratch);
}
__device__ __forceinline__ float block_max(float v, float* scratch) {
  return block_reduce<Max>(v, scratch);
}

// Calls f(i) for every i < n, spread over the whole grid (64-bit indices).
template <typename F>
__device__ __forceinline__ void grid_stride(int64_t n, F&& f) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += stride) f(i);
}

// Calls f.template operator()<T>() with T the storage type of `t` (f32 or bf16). The caller
// (cuda_kernels.cpp) has rejected f16 already.
template <typename F>
void dispatch(DType t, F&& f) {
  if (t == DType::bf16)
    f.template operator()<bf16>();
  else
    f.template operator()<float>();
}

// Lets `kernel` take `bytes` of dynamic shared memory on the current device
// (cudaFuncSetAttribute, needed past 48 KiB). The limit is only ever raised: one kernel instance
// serves a bucket of sizes whose needs differ, and a lower limit set by another thread between
// this one's call and its launch would make the launch fail.
template <typename Kernel>
void allow_dynamic_shared(Kernel kernel, uint64_t bytes) {
  static std::mutex mutex;
  static std::map<std::pair<int, const void*>, uint64_t> limits;
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard lock(mutex);
  uint64_t& have = limits[{device, reinterpret_cast<const void*>(kernel)}];
  if (bytes <= have) return;
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(bytes)));
  have = bytes;
}

constexpr unsigned kThreads = 256;

// Blocks for a grid-stride loop over n items (at least 1; the loop covers the rest).
inline unsigned grid_for(uint64_t n, unsigned threads = kThreads) {
  constexpr uint64_t kMaxBlocks = 16384;
  return static_cast<unsigned>(std::clamp<uint64_t>((n + threads - 1) / threads, 1, kMaxBlocks));
}

// Threads for a one-block-per-row kernel over rows of `width` elements: a warp per 128 elements
// (at least 4 to a thread), up to kThreads. A narrow row no longer leaves most of a 256-thread
// block idle through its reductions (a 64-wide norm ran 224 idle threads through every barrier
// and shuffle); rows of 1024 elements and more take kThreads as before.
inline unsigned row_threads(int64_t width) {
  return 32u * static_cast<unsigned>(std::clamp<int64_t>((width + 127) / 128, 1, kThreads / 32));
}

// Blocks for a one-block-per-row kernel that loops over rows past the grid.
inline unsigned grid_rows(int64_t rows) {
  constexpr int64_t kMaxBlocks = int64_t{1} << 20;
  return static_cast<unsigned>(std::clamp<int64_t>(rows, 1, kMaxBlocks));
}

}  // namespace strata::gpu
