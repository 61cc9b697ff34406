// elementwise.cu: add (the residual stream), fill, scale (matmul's k == 0 case), and a
// projection's bias: broadcast into the rows a matmul then adds to, and its gradient.
//
// Grid-stride loops with 64-bit indices. add reads both inputs before it stores, so `out` may
// be `a` or `b` (the in-place residual add).
//
// bias_backward: each block owns 32 columns; its 8 warps take every 8th row, each lane one
// column, so a warp reads 32 adjacent elements of a row. Each thread sums in double; the 8
// partial sums of a column are then added in warp order. No atomics: the same bits every run.
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

template <typename T>
__global__ void softcap_kernel(T* x, float cap, int64_t n) {
  gpu::grid_stride(n, [&](int64_t i) { x[i] = from_f32<T>(cap * tanhf(to_f32(x[i]) / cap)); });
}

template <typename T>
__global__ void broadcast_rows_kernel(T* y, const T* __restrict__ b, int64_t rows, int64_t cols) {
  gpu::grid_stride(rows * cols, [&](int64_t i) { y[i] = b[i % cols]; });
}

constexpr int kBiasColumns = 32, kBiasGroups = 8;  // a block: 8 warps over 32 columns

template <typename DB, typename DY>
__global__ void bias_backward_kernel(DB* db, const DY* __restrict__ dy, int64_t rows,
                                     int64_t cols) {
  __shared__ double partial[kBiasGroups][kBiasColumns];
  const int lane = static_cast<int>(threadIdx.x) % kBiasColumns;
  const int group = static_cast<int>(threadIdx.x) / kBiasColumns;
  const int64_t col = int64_t{blockIdx.x} * kBiasColumns + lane;
  double sum = 0.0;
  if (col < cols)
    for (int64_t r = group; r < rows; r += kBiasGroups) sum += to_f32(dy[r * cols + col]);
  partial[group][lane] = sum;
  __syncthreads();
  if (group == 0 && col < cols) {
    double total = 0.0;
    for (int g = 0; g < kBiasGroups; ++g) total += partial[g][lane];
    db[col] = from_f32<DB>(static_cast<float>(to_f32(db[col]) + total));
  }
}

}  // namespace

void launch_broadcast_rows(void* y, DType t, const void* b, int64_t rows, int64_t cols,
                           cudaStream_t stream) {
  if (rows * cols == 0) return;
  gpu::dispatch(t, [&]<typename T>() {
    broadcast_rows_kernel<T>
        <<<gpu::grid_for(static_cast<uint64_t>(rows * cols)), gpu::kThreads, 0, stream>>>(
            static_cast<T*>(y), static_cast<const T*>(b), rows, cols);
    CUDA_CHECK_LAUNCH();
  });
}

void launch_bias_backward(void* db, DType db_t, const void* dy, DType dy_t, int64_t rows,
                          int64_t cols, cudaStream_t stream) {
  if (cols == 0) return;
  const auto blocks = static_cast<unsigned>((cols + kBiasColumns - 1) / kBiasColumns);
  gpu::dispatch(db_t, [&]<typename DB>() {
    gpu::dispatch(dy_t, [&]<typename DY>() {
      bias_backward_kernel<DB, DY><<<blocks, kBiasColumns * kBiasGroups, 0, stream>>>(
          static_cast<DB*>(db), static_cast<const DY*>(dy), rows, cols);
      CUDA_CHECK_LAUNCH();
    });
  });
}

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

void launch_softcap(void* x, DType x_t, float cap, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  gpu::dispatch(x_t, [&]<typename T>() {
    softcap_kernel<T><<<gpu::grid_for(static_cast<uint64_t>(n)), gpu::kThreads, 0, stream>>>(
        static_cast<T*>(x), cap, n);
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
