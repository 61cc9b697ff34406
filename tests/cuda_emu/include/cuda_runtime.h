// cuda_runtime.h (CUDA emulator): the runtime API (cuda_runtime_api.h) plus what CUDA C++ adds
// for kernels: the execution-space keywords, threadIdx / blockIdx / blockDim / gridDim,
// __syncthreads, warp shuffles, the explicitly rounded arithmetic intrinsics, and the launch
// that the source rewriter (tests/cuda_emu/rewrite.cpp) turns `k<<<grid, block, shared,
// stream>>>(args)` into.
//
// A kernel's threads run as fibers on the stream's worker thread, one block at a time: a fiber
// runs until it reaches __syncthreads or a shuffle, and kernel.cpp's scheduler resumes the
// others, so the block's threads meet at every barrier as on a GPU. Shared memory, static
// (`__shared__ T x[N]`, which the rewriter turns into block_shared) and dynamic
// (`extern __shared__`), is per-block storage filled with 0xff bytes (NaN in f32 and bf16)
// before each block, so reading what no thread of the block wrote shows up.
#pragma once

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __shared__ static thread_local

struct uint3 {
  unsigned x, y, z;
};

namespace cuda_emu {

// The running CUDA thread's coordinates (kernel.cpp switches this with each fiber).
struct ThreadCoords {
  uint3 thread_idx{0, 0, 0}, block_idx{0, 0, 0};
  dim3 block_dim, grid_dim;
};
extern thread_local const ThreadCoords* current_coords;

void syncthreads();
// One lane's part of a warp shuffle: `bits` is the lane's value; returns the source lane's.
// `xor_mode`: source = lane ^ param (its own value back past the end of its group of `width`
// lanes), else source = param within the lane's group.
uint64_t shuffle(unsigned mask, uint64_t bits, int param, int width, bool xor_mode);
// A warp-wide operation: every one of the warp's 32 lanes calls warp_collective with the same
// `op` and its own `arg`; once all have arrived, op(args) runs once, args[l] being lane l's
// (wmma's loads, stores and products, in mma.h, are built on it).
using WarpOp = void (*)(void* const* args);
void warp_collective(const char* name, WarpOp op, void* arg);
// The block's dynamic shared memory (`extern __shared__`).
void* dynamic_shared_memory();
// The block's static shared variable declared at `tag` (`__shared__ T x[N]`, rewritten): the
// same bytes for every thread of the block, 0xff bytes at the start of each block.
void* block_shared_bytes(const void* tag, size_t bytes, size_t align);
template <typename T>
T& block_shared(const void* tag) {
  static_assert(std::is_trivially_copyable_v<T>, "__shared__ variables must be trivial");
  return *static_cast<T*>(block_shared_bytes(tag, sizeof(T), alignof(T)));
}

struct LaunchConfig {
  dim3 grid, block;
  size_t shared_bytes;
  cudaStream_t stream;
  LaunchConfig(dim3 g, dim3 b, size_t shared = 0, cudaStream_t s = nullptr)
      : grid(g), block(b), shared_bytes(shared), stream(s) {}
};

// Checks the configuration as a GPU would (cudaGetLastError reports a bad one), then queues
// the grid's blocks on the stream; `body` runs one CUDA thread.
// `name` is the kernel as the source wrote it, for messages.
void launch_grid(const char* name, const void* kernel, const LaunchConfig& config,
                 std::function<void()> body);

template <typename... P, typename... A>
void launch(const char* name, void (*kernel)(P...), const LaunchConfig& config, A&&... args) {
  // The arguments are converted and copied at the launch, as CUDA copies them.
  auto params = std::make_shared<std::tuple<std::decay_t<P>...>>(std::forward<A>(args)...);
  launch_grid(name, reinterpret_cast<const void*>(kernel), config,
              [kernel, params] { std::apply(kernel, *params); });
}

template <typename T>
T shuffle_value(unsigned mask, T v, int param, int width, bool xor_mode) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= sizeof(uint64_t));
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof v);
  bits = shuffle(mask, bits, param, width, xor_mode);
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

}  // namespace cuda_emu

#define threadIdx (::cuda_emu::current_coords->thread_idx)
#define blockIdx (::cuda_emu::current_coords->block_idx)
#define blockDim (::cuda_emu::current_coords->block_dim)
#define gridDim (::cuda_emu::current_coords->grid_dim)
// A variable, as on the GPU (a macro would break cudaDeviceProp's member of that name).
inline constexpr int warpSize = 32;

inline void __syncthreads() {
  ::cuda_emu::syncthreads();
}

template <typename T>
T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32) {
  return ::cuda_emu::shuffle_value(mask, v, src_lane, width, false);
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  return ::cuda_emu::shuffle_value(mask, v, lane_mask, width, true);
}

// All lanes in `mask` meet here (a shuffle that exchanges nothing), as on a GPU, where
// __syncwarp also orders their shared-memory accesses.
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  ::cuda_emu::shuffle_value(mask, 0, 0, 32, true);  // each lane reads its own value
}

// The explicitly rounded intrinsics: IEEE operations, never contracted into an FMA (the
// emulator is compiled with -ffp-contract=off).
inline float __fadd_rn(float a, float b) {
  return a + b;
}
inline float __fmul_rn(float a, float b) {
  return a * b;
}
inline float __fdiv_rn(float a, float b) {
  return a / b;
}
inline float __fsqrt_rn(float a) {
  return std::sqrt(a);
}
inline double __dadd_rn(double a, double b) {
  return a + b;
}
inline double __dmul_rn(double a, double b) {
  return a * b;
}
