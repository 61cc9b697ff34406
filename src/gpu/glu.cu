// glu.cu: the gated MLP's activation, h = act(gate) * up, and its backward (core/kernels.h):
// SiLU (Llama's SwiGLU), GELU with erf, or its tanh approximation (Gemma's GeGLU).
//
// Elementwise, one grid-stride loop, the activation chosen at compile time (one kernel per
// activation, so the loop has no branch). Each thread reads all of its inputs before it stores,
// so an output may alias an input at the same index (in-place use is safe). The formulas are
// the host's (src/host/ops.cpp), in f32 with the device's expf, erff and tanhf.
#include "gpu/kernel_common.cuh"
#include "gpu/ops.h"

namespace strata {
namespace {

using gpu::from_f32;
using gpu::to_f32;

constexpr float kSqrtHalf = 0.70710678118654752f;    // 1 / sqrt(2)
constexpr float kInvSqrt2Pi = 0.39894228040143268f;  // 1 / sqrt(2 pi)
constexpr float kTanhBeta = 0.79788456080286536f;    // sqrt(2 / pi)
constexpr float kTanhKappa = 0.044715f;

// act(g) and act'(g).
template <Activation A>
__device__ __forceinline__ void activation(float g, float& value, float& slope) {
  if constexpr (A == Activation::silu) {
    const float e = expf(-g);
    const float s = 1.0f / (1.0f + e);
    value = g / (1.0f + e);
    slope = s * (1.0f + g * (1.0f - s));
  } else if constexpr (A == Activation::gelu) {
    const float cdf = 0.5f * (1.0f + erff(g * kSqrtHalf));
    value = g * cdf;
    slope = cdf + g * expf(-0.5f * g * g) * kInvSqrt2Pi;
  } else {
    const float t = tanhf(kTanhBeta * (g + kTanhKappa * g * g * g));
    value = 0.5f * g * (1.0f + t);
    slope = 0.5f * (1.0f + t) +
            0.5f * g * ((1.0f - t * t) * kTanhBeta * (1.0f + 3.0f * kTanhKappa * g * g));
  }
}

template <Activation A, typename H, typename G, typename U>
__global__ void glu_forward_kernel(H* h, const G* gate, const U* up, int64_t n) {
  gpu::grid_stride(n, [&](int64_t i) {
    float value = 0.0f, slope = 0.0f;
    activation<A>(to_f32(gate[i]), value, slope);
    h[i] = from_f32<H>(value * to_f32(up[i]));
  });
}

template <Activation A, typename DG, typename DU, typename DH, typename G, typename U>
__global__ void glu_backward_kernel(DG* dgate, DU* dup, const DH* dh, const G* gate, const U* up,
                                    int64_t n) {
  gpu::grid_stride(n, [&](int64_t i) {
    const float g = to_f32(gate[i]), u = to_f32(up[i]), d = to_f32(dh[i]);
    float value = 0.0f, slope = 0.0f;
    activation<A>(g, value, slope);
    dgate[i] = from_f32<DG>(d * u * slope);
    dup[i] = from_f32<DU>(d * value);
  });
}

// f with the activation as a template argument.
template <typename F>
void dispatch_activation(Activation act, F&& f) {
  switch (act) {
    case Activation::silu:
      f.template operator()<Activation::silu>();
      return;
    case Activation::gelu:
      f.template operator()<Activation::gelu>();
      return;
    case Activation::gelu_tanh:
      f.template operator()<Activation::gelu_tanh>();
      return;
  }
}

}  // namespace

void launch_glu_forward(void* h, DType h_t, const void* gate, DType gate_t, const void* up,
                        DType up_t, int64_t n, Activation act, cudaStream_t stream) {
  if (n == 0) return;
  dispatch_activation(act, [&]<Activation A>() {
    gpu::dispatch(h_t, [&]<typename H>() {
      gpu::dispatch(gate_t, [&]<typename G>() {
        gpu::dispatch(up_t, [&]<typename U>() {
          glu_forward_kernel<A, H, G, U>
              <<<gpu::grid_for(static_cast<uint64_t>(n)), gpu::kThreads, 0, stream>>>(
                  static_cast<H*>(h), static_cast<const G*>(gate), static_cast<const U*>(up), n);
          CUDA_CHECK_LAUNCH();
        });
      });
    });
  });
}

void launch_glu_backward(void* dgate, DType dgate_t, void* dup, DType dup_t, const void* dh,
                         DType dh_t, const void* gate, DType gate_t, const void* up, DType up_t,
                         int64_t n, Activation act, cudaStream_t stream) {
  if (n == 0) return;
  dispatch_activation(act, [&]<Activation A>() {
    gpu::dispatch(dgate_t, [&]<typename DG>() {
      gpu::dispatch(dup_t, [&]<typename DU>() {
        gpu::dispatch(dh_t, [&]<typename DH>() {
          gpu::dispatch(gate_t, [&]<typename G>() {
            gpu::dispatch(up_t, [&]<typename U>() {
              glu_backward_kernel<A, DG, DU, DH, G, U>
                  <<<gpu::grid_for(static_cast<uint64_t>(n)), gpu::kThreads, 0, stream>>>(
                      static_cast<DG*>(dgate), static_cast<DU*>(dup), static_cast<const DH*>(dh),
                      static_cast<const G*>(gate), static_cast<const U*>(up), n);
              CUDA_CHECK_LAUNCH();
            });
          });
        });
      });
    });
  });
}

}  // namespace strata
