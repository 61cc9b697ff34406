// elementwise.cu: add (the residual stream), fill, and scale (matmul's k == 0 case).
//
// Grid-stride loops with 64-bit indices. add reads both inputs before it stores, so `out` may
// be `a` or `b` (the in-place residual add).
#include "gpu/kernel_common.cuh"
#include "gpu/ops.h"

namespace strata {
namespace {

using gpu::from_f32;
using gpu::to_f32;

template <typename O, typename A, typename B>
__global__ void add_kernel(O* out, const A* a, const B* b, int64_t n) {
  gpu::grid_stride(n, [&](int64_t i) { out[i] = from_f32<O>(to_f32(a[i]) + to_f32(b[i])); });
}

template <typename T>
__global__ void fill_kernel(T* x, float value, int64_t n) {
  const T v = from_f32<T>(value);
  gpu::grid_stride(n, [&](int64_t i) { x[i] = v; });
}

template <typename T>
__global__ void scale_kernel(T* x, float beta, int64_t n) {
  gpu::grid_stride(
      n, [&](int64_t i) { x[i] = from_f32<T>(beta == 0.0f ? 0.0f : beta * to_f32(x[i])); });
}

}  // namespace

void launch_add(void* out, DType out_t, const void* a, DType a_t, const void* b, DType b_t,
                int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  gpu::dispatch(out_t, [&]<typename O>() {
    gpu::dispatch(a_t, [&]<typename A>() {
      gpu::dispatch(b_t, [&]<typename B>() {
        add_kernel<O, A, B><<<gpu::grid_for(static_cast<uint64_t>(n)), gpu::kThreads, 0, stream>>>(
            static_cast<O*>(out), static_cast<const A*>(a), static_cast<const B*>(b), n);
        CUDA_CHECK_LAUNCH();
      });
    });
  });
}

void launch_fill(void* x, DType x_t, float value, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  gpu::dispatch(x_t, [&]<typename T>() {
    fill_kernel<T><<<gpu::grid_for(static_cast<uint64_t>(n)), gpu::kThreads, 0, stream>>>(
        static_cast<T*>(x), value, n);
    CUDA_CHECK_LAUNCH();
  });
}

void launch_scale(void* x, DType x_t, float beta, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  gpu::dispatch(x_t, [&]<typename T>() {
    scale_kernel<T><<<gpu::grid_for(static_cast<uint64_t>(n)), gpu::kThreads, 0, stream>>>(
        static_cast<T*>(x), beta, n);
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace strata
