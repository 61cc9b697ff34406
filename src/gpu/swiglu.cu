// swiglu.cu: the Llama MLP's gate, h = silu(gate) * up, and its backward.
//
// Elementwise, one grid-stride loop. Each thread reads all of its inputs before it stores,
// so an output may alias an input at the same index (in-place use is safe).
// With e = exp(-g), s = 1 / (1 + e): silu(g) = g / (1 + e), silu'(g) = s * (1 + g * (1 - s)).
#include "gpu/kernel_common.cuh"
#include "gpu/ops.h"

namespace strata {
namespace {

using gpu::from_f32;
using gpu::to_f32;

template <typename H, typename G, typename U>
__global__ void swiglu_forward_kernel(H* h, const G* gate, const U* up, int64_t n) {
  gpu::grid_stride(n, [&](int64_t i) {
    const float g = to_f32(gate[i]);
    h[i] = from_f32<H>(g / (1.0f + expf(-g)) * to_f32(up[i]));
  });
}

template <typename DG, typename DU, typename DH, typename G, typename U>
__global__ void swiglu_backward_kernel(DG* dgate, DU* dup, const DH* dh, const G* gate, const U* up,
                                       int64_t n) {
  gpu::grid_stride(n, [&](int64_t i) {
    const float g = to_f32(gate[i]), u = to_f32(up[i]), d = to_f32(dh[i]);
    const float e = expf(-g);
    const float s = 1.0f / (1.0f + e);
    const float silu = g / (1.0f + e);
    dgate[i] = from_f32<DG>(d * u * (s * (1.0f + g * (1.0f - s))));
    dup[i] = from_f32<DU>(d * silu);
  });
}

}  // namespace

void launch_swiglu_forward(void* h, DType h_t, const void* gate, DType gate_t, const void* up,
                           DType up_t, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  gpu::dispatch(h_t, [&]<typename H>() {
    gpu::dispatch(gate_t, [&]<typename G>() {
      gpu::dispatch(up_t, [&]<typename U>() {
        swiglu_forward_kernel<H, G, U>
            <<<gpu::grid_for(static_cast<uint64_t>(n)), gpu::kThreads, 0, stream>>>(
                static_cast<H*>(h), static_cast<const G*>(gate), static_cast<const U*>(up), n);
        CUDA_CHECK_LAUNCH();
      });
    });
  });
}

void launch_swiglu_backward(void* dgate, DType dgate_t, void* dup, DType dup_t, const void* dh,
                            DType dh_t, const void* gate, DType gate_t, const void* up, DType up_t,
                            int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  gpu::dispatch(dgate_t, [&]<typename DG>() {
    gpu::dispatch(dup_t, [&]<typename DU>() {
      gpu::dispatch(dh_t, [&]<typename DH>() {
        gpu::dispatch(gate_t, [&]<typename G>() {
          gpu::dispatch(up_t, [&]<typename U>() {
            swiglu_backward_kernel<DG, DU, DH, G, U>
                <<<gpu::grid_for(static_cast<uint64_t>(n)), gpu::kThreads, 0, stream>>>(
                    static_cast<DG*>(dgate), static_cast<DU*>(dup), static_cast<const DH*>(dh),
                    static_cast<const G*>(gate), static_cast<const U*>(up), n);
            CUDA_CHECK_LAUNCH();
          });
        });
      });
    });
  });
}

}  // namespace strata
