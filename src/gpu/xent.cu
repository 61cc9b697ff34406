// xent.cu: softmax cross-entropy over vocabulary chunks (core/kernels.h), one block per row.
//
// The forward keeps each row's online-softmax state (row_max, row_sum = sum of
// exp(logit - row_max)) in f32. Every thread folds its strided share of the chunk into a
// private (max, sum) pair, the block merges the pairs, and thread 0 merges the result into the
// row's state. rescale(a, m) = exp(a - m), but exactly 1 when a == m, so that an all -inf row
// (m = -inf) gives row_sum > 0 and lse = -inf instead of exp(-inf + inf) = NaN. A NaN logit
// makes the row's sum, and so its loss, NaN.
#include "gpu/kernel_common.cuh"
#include "gpu/ops.h"

namespace strata {
namespace {

using gpu::from_f32;
using gpu::to_f32;

__device__ __forceinline__ float rescale(float a, float m) {
  return a == m ? 1.0f : expf(a - m);
}

template <typename T>
__global__ void xent_forward_kernel(const T* __restrict__ logits, int64_t rows, int64_t chunk,
                                    int64_t v0, const int32_t* __restrict__ targets,
                                    float* __restrict__ row_max, float* __restrict__ row_sum,
                                    float* __restrict__ target_logit) {
  __shared__ float scratch[32];
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* lr = logits + row * chunk;
    float m = -INFINITY, s = 0.0f;
    for (int64_t j = threadIdx.x; j < chunk; j += blockDim.x) {
      const float x = to_f32(lr[j]);
      if (x > m) {
        s = s * rescale(m, x) + 1.0f;
        m = x;
      } else {
        s += rescale(x, m);
      }
    }
    const float block_m = gpu::block_max(m, scratch);
    const float block_s = gpu::block_sum(s * rescale(m, block_m), scratch);
    if (threadIdx.x == 0) {
      const float old_m = row_max[row];
      const float new_m = fmaxf(old_m, block_m);
      row_sum[row] = row_sum[row] * rescale(old_m, new_m) + block_s * rescale(block_m, new_m);
      row_max[row] = new_m;
      const int64_t t = targets[row];
      if (t >= v0 && t < v0 + chunk) target_logit[row] = to_f32(lr[t - v0]);
    }
  }
}

// lse may alias row_max: each element is read before it is written, by the same thread.
__global__ void xent_finish_kernel(float* losses, float* lse, const float* row_max,
                                   const float* row_sum, const float* target_logit,
                                   const int32_t* targets, int64_t rows) {
  gpu::grid_stride(rows, [&](int64_t i) {
    const float l = row_max[i] + logf(row_sum[i]);
    const float target = target_logit[i];
    lse[i] = l;
    losses[i] = targets[i] == kIgnoreIndex ? 0.0f : l - target;
  });
}

template <typename T>
__global__ void xent_backward_kernel(T* logits, int64_t rows, int64_t chunk, int64_t v0,
                                     const int32_t* __restrict__ targets,
                                     const float* __restrict__ lse, float scale, float softcap) {
  const int64_t n = rows * chunk;
  gpu::grid_stride(n, [&](int64_t i) {
    const int64_t row = i / chunk, j = i - row * chunk;
    const int64_t t = targets[row];
    const float y = to_f32(logits[i]);
    float g = 0.0f;
    if (t != kIgnoreIndex) g = scale * (expf(y - lse[row]) - (v0 + j == t ? 1.0f : 0.0f));
    if (softcap > 0.0f) g *= 1.0f - (y / softcap) * (y / softcap);  // back through the cap
    logits[i] = from_f32<T>(g);
  });
}

}  // namespace

void launch_xent_forward_chunk(const void* logits, DType logits_t, int64_t rows, int64_t chunk,
                               int64_t v0, const int32_t* targets, float* row_max, float* row_sum,
                               float* target_logit, cudaStream_t stream) {
  if (rows == 0) return;
  gpu::dispatch(logits_t, [&]<typename T>() {
    xent_forward_kernel<T><<<gpu::grid_rows(rows), gpu::row_threads(chunk), 0, stream>>>(
        static_cast<const T*>(logits), rows, chunk, v0, targets, row_max, row_sum, target_logit);
    CUDA_CHECK_LAUNCH();
  });
}

void launch_xent_finish(float* losses, float* lse, const float* row_max, const float* row_sum,
                        const float* target_logit, const int32_t* targets, int64_t rows,
                        cudaStream_t stream) {
  if (rows == 0) return;
  xent_finish_kernel<<<gpu::grid_for(static_cast<uint64_t>(rows)), gpu::kThreads, 0, stream>>>(
      losses, lse, row_max, row_sum, target_logit, targets, rows);
  CUDA_CHECK_LAUNCH();
}

void launch_xent_backward_chunk(void* logits, DType logits_t, int64_t rows, int64_t chunk,
                                int64_t v0, const int32_t* targets, const float* lse, float scale,
                                float softcap, cudaStream_t stream) {
  const int64_t n = rows * chunk;
  if (n == 0) return;
  gpu::dispatch(logits_t, [&]<typename T>() {
    xent_backward_kernel<T><<<gpu::grid_for(static_cast<uint64_t>(n)), gpu::kThreads, 0, stream>>>(
        static_cast<T*>(logits), rows, chunk, v0, targets, lse, scale, softcap);
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace strata
