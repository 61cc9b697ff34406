// rmsnorm.cu: RMSNorm forward and backward, one block per row (gpu::row_threads wide), f32
// reductions.
//
// Forward: rstd = 1 / sqrt(mean(x^2) + eps) (IEEE sqrt and division, not rsqrtf, to stay close
// to the host), y = x * rstd * w, where w is the stored weight plus weight_offset (Gemma's 1).
// Backward, with g = dy * w: dx += rstd * g - x * (rstd^3 * sum(g * x) / D), and
// dw += sum over rows of dy * x * rstd. dw is deterministic: each of G blocks sums its rows
// into its own f32 partial row of the caller's scratch, then a second kernel adds the G
// partials into dw in a fixed order. Each thread owns the same columns of every row it
// visits, so it alone reads and writes those partial entries: no atomics, no barrier.
#include "gpu/kernel_common.cuh"
#include "gpu/ops.h"

namespace strata {
namespace {

using gpu::from_f32;
using gpu::to_f32;

constexpr int64_t kMaxPartials = 256;  // blocks of the backward (rows are shared among them)

template <typename Y, typename X, typename W>
__global__ void rmsnorm_forward_kernel(Y* y, float* __restrict__ rstd, const X* x,
                                       const W* __restrict__ w, int64_t rows, int64_t dim,
                                       float eps, float weight_offset) {
  __shared__ float scratch[32];
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const X* xr = x + row * dim;
    float ss = 0.0f;
    for (int64_t d = threadIdx.x; d < dim; d += blockDim.x) {
      const float v = to_f32(xr[d]);
      ss += v * v;
    }
    ss = gpu::block_sum(ss, scratch);
    const float r = 1.0f / sqrtf((dim > 0 ? ss / static_cast<float>(dim) : 0.0f) + eps);
    if (threadIdx.x == 0) rstd[row] = r;
    Y* yr = y + row * dim;
    for (int64_t d = threadIdx.x; d < dim; d += blockDim.x)
      yr[d] = from_f32<Y>(to_f32(xr[d]) * r * (to_f32(w[d]) + weight_offset));
  }
}

template <typename DX, typename DY, typename X, typename W>
__global__ void rmsnorm_backward_kernel(DX* dx, const DY* __restrict__ dy, const X* __restrict__ x,
                                        const W* __restrict__ w, float weight_offset,
                                        const float* __restrict__ rstd, int64_t rows, int64_t dim,
                                        float* __restrict__ partials) {
  __shared__ float scratch[32];
  float* part = partials + int64_t{blockIdx.x} * dim;
  for (int64_t d = threadIdx.x; d < dim; d += blockDim.x) part[d] = 0.0f;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const DY* dyr = dy + row * dim;
    const X* xr = x + row * dim;
    float gx = 0.0f;
    for (int64_t d = threadIdx.x; d < dim; d += blockDim.x)
      gx += to_f32(dyr[d]) * (to_f32(w[d]) + weight_offset) * to_f32(xr[d]);
    gx = gpu::block_sum(gx, scratch);
    const float r = rstd[row];
    const float k = r * r * r * gx / static_cast<float>(dim);
    DX* dxr = dx + row * dim;
    for (int64_t d = threadIdx.x; d < dim; d += blockDim.x) {
      const float xv = to_f32(xr[d]), dyv = to_f32(dyr[d]);
      dxr[d] = from_f32<DX>(to_f32(dxr[d]) + (r * dyv * (to_f32(w[d]) + weight_offset) - xv * k));
      part[d] += dyv * xv * r;
    }
  }
}

template <typename DW>
__global__ void rmsnorm_dw_kernel(DW* dw, const float* __restrict__ partials, int64_t blocks,
                                  int64_t dim) {
  gpu::grid_stride(dim, [&](int64_t d) {
    float sum = 0.0f;
    for (int64_t b = 0; b < blocks; ++b) sum += partials[b * dim + d];
    dw[d] = from_f32<DW>(to_f32(dw[d]) + sum);
  });
}

}  // namespace

void launch_rmsnorm_forward(void* y, DType y_t, float* rstd, const void* x, DType x_t,
                            const void* w, DType w_t, int64_t rows, int64_t dim, float eps,
                            float weight_offset, cudaStream_t stream) {
  if (rows == 0) return;
  gpu::dispatch(y_t, [&]<typename Y>() {
    gpu::dispatch(x_t, [&]<typename X>() {
      gpu::dispatch(w_t, [&]<typename W>() {
        rmsnorm_forward_kernel<Y, X, W><<<gpu::grid_rows(rows), gpu::row_threads(dim), 0, stream>>>(
            static_cast<Y*>(y), rstd, static_cast<const X*>(x), static_cast<const W*>(w), rows, dim,
            eps, weight_offset);
        CUDA_CHECK_LAUNCH();
      });
    });
  });
}

uint64_t rmsnorm_scratch_min(int64_t dim) {
  return static_cast<uint64_t>(dim) * sizeof(float);
}

uint64_t rmsnorm_scratch_max(int64_t rows, int64_t dim) {
  return static_cast<uint64_t>(std::clamp<int64_t>(rows, 1, kMaxPartials)) *
         rmsnorm_scratch_min(dim);
}

void launch_rmsnorm_backward(void* dx, DType dx_t, void* dw, DType dw_t, const void* dy, DType dy_t,
                             const void* x, DType x_t, const void* w, DType w_t,
                             float weight_offset, const float* rstd, int64_t rows, int64_t dim,
                             float* scratch, uint64_t scratch_bytes, cudaStream_t stream) {
  if (rows == 0 || dim == 0) return;
  const auto fit = static_cast<int64_t>(scratch_bytes / rmsnorm_scratch_min(dim));
  const int64_t blocks = std::min({rows, kMaxPartials, fit});
  gpu::dispatch(dx_t, [&]<typename DX>() {
    gpu::dispatch(dy_t, [&]<typename DY>() {
      gpu::dispatch(x_t, [&]<typename X>() {
        gpu::dispatch(w_t, [&]<typename W>() {
          rmsnorm_backward_kernel<DX, DY, X, W>
              <<<static_cast<unsigned>(blocks), gpu::row_threads(dim), 0, stream>>>(
                  static_cast<DX*>(dx), static_cast<const DY*>(dy), static_cast<const X*>(x),
                  static_cast<const W*>(w), weight_offset, rstd, rows, dim, scratch);
          CUDA_CHECK_LAUNCH();
        });
      });
    });
  });
  gpu::dispatch(dw_t, [&]<typename DW>() {
    rmsnorm_dw_kernel<DW><<<gpu::grid_for(static_cast<uint64_t>(dim)), gpu::kThreads, 0, stream>>>(
        static_cast<DW*>(dw), scratch, blocks, dim);
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace strata
