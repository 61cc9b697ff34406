// optimizer.cu: the optimizer on the GPU, for when its home is the device: adam_update (Adam,
// Lion or Adagrad, by the step constants' type) and grad_chunk_sums (core/kernels.h). The oracle is
// CpuAdam itself (host/optimizer.cpp runs its scalar path), and the contract is its exact bits, not
// a tolerance.
//
// Before editing, know: every float and double operation here is an explicitly rounded
// intrinsic (__fmul_rn, __fadd_rn, __fdiv_rn, __fsqrt_rn, __dmul_rn, __dadd_rn), which nvcc
// never fuses into an FMA and which round as IEEE 754 requires whatever -prec-div/-prec-sqrt
// say. Write a plain `a * b + c` here and nvcc may contract it, and the bits are no longer
// CpuAdam's. The update follows cpu_adam/formula.h operation by operation; the sums follow
// cpu_adam/kernels.h's lanes (element i of a chunk to lane i % 16, increasing i, then the lanes
// added 0..15 starting from 0.0). NaN inputs give NaN outputs, though the GPU may return a
// canonical NaN where the CPU keeps a payload (as convert.cu). Gradients and copies may be f16.
#include "cpu_adam/cpu_adam.h"
#include "cpu_adam/kernels.h"
#include "gpu/kernel_common.cuh"
#include "gpu/ops.h"

#include <cuda_fp16.h>

namespace strata {
namespace {

using gpu::bf16;

__device__ __forceinline__ float load(const float* p, int64_t i) {
  return p[i];
}
__device__ __forceinline__ float load(const bf16* p, int64_t i) {
  return __bfloat162float(p[i]);
}
__device__ __forceinline__ float load(const __half* p, int64_t i) {
  return __half2float(p[i]);
}

__device__ __forceinline__ void store(float* p, int64_t i, float x) {
  p[i] = x;
}
__device__ __forceinline__ void store(bf16* p, int64_t i, float x) {
  p[i] = __float2bfloat16_rn(x);
}
__device__ __forceinline__ void store(__half* p, int64_t i, float x) {
  p[i] = __float2half_rn(x);
}

// cpu_adam/formula.h's adam_element, one rounded operation per operator there, in its order.
__device__ __forceinline__ void adam_element(float& p, float g, float& m, float& v,
                                             const cpu_adam::StepConstants& k) {
  g = __fmul_rn(g, k.grad_scale);
  g = __fadd_rn(g, __fmul_rn(k.l2_decay, p));
  p = __fmul_rn(p, k.param_decay);
  m = __fadd_rn(__fmul_rn(m, k.beta1), __fmul_rn(k.one_minus_beta1, g));
  v = __fadd_rn(__fmul_rn(v, k.beta2), __fmul_rn(__fmul_rn(k.one_minus_beta2, g), g));
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), k.bias_correction2_sqrt), k.eps);
  p = __fadd_rn(p, __fdiv_rn(__fmul_rn(k.neg_step_size, m), denom));
}

// formula.h's Sign: -1, 0 or 1, and 0 for NaN.
__device__ __forceinline__ float sign_of(float x) {
  return x > 0.0f ? 1.0f : x < 0.0f ? -1.0f : 0.0f;
}

// formula.h's lion_element.
__device__ __forceinline__ void lion_element(float& p, float g, float& m,
                                             const cpu_adam::StepConstants& k) {
  g = __fmul_rn(g, k.grad_scale);
  p = __fmul_rn(p, k.param_decay);
  const float c = __fadd_rn(__fmul_rn(m, k.beta1), __fmul_rn(k.one_minus_beta1, g));
  p = __fadd_rn(p, __fmul_rn(k.neg_step_size, sign_of(c)));
  m = __fadd_rn(__fmul_rn(m, k.beta2), __fmul_rn(k.one_minus_beta2, g));
}

// formula.h's adagrad_element.
__device__ __forceinline__ void adagrad_element(float& p, float g, float& v,
                                                const cpu_adam::StepConstants& k) {
  g = __fmul_rn(g, k.grad_scale);
  g = __fadd_rn(g, __fmul_rn(k.l2_decay, p));
  v = __fadd_rn(v, __fmul_rn(g, g));
  const float denom = __fadd_rn(__fsqrt_rn(v), k.eps);
  p = __fadd_rn(p, __fmul_rn(k.neg_step_size, __fdiv_rn(g, denom)));
}

// `copy` may be null (no parameter copy); O is then float and unused. k.type picks the formula
// (the same branch for every thread); m or v, where the type keeps none, is never read.
template <typename G, typename O>
__global__ void adam_update_kernel(float* __restrict__ master, float* __restrict__ m,
                                   float* __restrict__ v, const G* __restrict__ grad,
                                   O* __restrict__ copy, cpu_adam::StepConstants k, int64_t n) {
  gpu::grid_stride(n, [&](int64_t i) {
    float p = master[i];
    switch (k.type) {
      case OptimizerType::adam: {
        float mi = m[i], vi = v[i];
        adam_element(p, load(grad, i), mi, vi, k);
        m[i] = mi;
        v[i] = vi;
        break;
      }
      case OptimizerType::lion: {
        float mi = m[i];
        lion_element(p, load(grad, i), mi, k);
        m[i] = mi;
        break;
      }
      case OptimizerType::adagrad: {
        float vi = v[i];
        adagrad_element(p, load(grad, i), vi, k);
        v[i] = vi;
        break;
      }
    }
    master[i] = p;
    if (copy != nullptr) store(copy, i, p);
  });
}

constexpr int kLanes = static_cast<int>(cpu_adam::kStatsLanes);
constexpr auto kChunk = static_cast<int64_t>(CpuAdam::kStatsChunk);
// Loads issued ahead by each lane before it adds them (still in increasing i): they are what
// keeps the memory busy with only 16 threads per chunk.
constexpr int kAhead = 8;

// One block of kLanes threads per chunk (looping when there are more chunks than blocks).
template <typename G>
__global__ void grad_chunk_sums_kernel(const G* __restrict__ grad, int64_t n, int64_t chunks,
                                       double* __restrict__ sums) {
  __shared__ double lanes[kLanes];
  const int lane = static_cast<int>(threadIdx.x);
  for (int64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    const G* chunk = grad + c * kChunk;
    const int64_t len = gpu::min64(kChunk, n - c * kChunk);
    double acc = 0.0;
    int64_t i = lane;
    for (; i + (kAhead - 1) * kLanes < len; i += kAhead * kLanes) {
      double d[kAhead];
#pragma unroll
      for (int u = 0; u < kAhead; ++u) d[u] = static_cast<double>(load(chunk, i + u * kLanes));
#pragma unroll
      for (int u = 0; u < kAhead; ++u) acc = __dadd_rn(acc, __dmul_rn(d[u], d[u]));
    }
    for (; i < len; i += kLanes) {
      const auto d = static_cast<double>(load(chunk, i));
      acc = __dadd_rn(acc, __dmul_rn(d, d));
    }
    lanes[lane] = acc;
    __syncthreads();
    if (lane == 0) {
      double sum = 0.0;
      for (int l = 0; l < kLanes; ++l) sum = __dadd_rn(sum, lanes[l]);
      sums[c] = sum;
    }
    __syncthreads();  // the next chunk reuses `lanes`
  }
}

// Calls f.template operator()<T>() with T the storage type of `t`, f16 included.
template <typename F>
void dispatch_all(DType t, F&& f) {
  switch (t) {
    case DType::f32:
      f.template operator()<float>();
      break;
    case DType::bf16:
      f.template operator()<bf16>();
      break;
    case DType::f16:
      f.template operator()<__half>();
      break;
  }
}

}  // namespace

void launch_adam_update(float* master, float* m, float* v, const void* grad, DType grad_t,
                        void* copy, DType copy_t, const cpu_adam::StepConstants& k, int64_t n,
                        cudaStream_t stream) {
  if (n == 0) return;
  const unsigned blocks = gpu::grid_for(static_cast<uint64_t>(n));
  dispatch_all(grad_t, [&]<typename G>() {
    const auto* g = static_cast<const G*>(grad);
    if (copy == nullptr) {
      adam_update_kernel<G, float>
          <<<blocks, gpu::kThreads, 0, stream>>>(master, m, v, g, nullptr, k, n);
      CUDA_CHECK_LAUNCH();
      return;
    }
    dispatch_all(copy_t, [&]<typename O>() {
      adam_update_kernel<G, O>
          <<<blocks, gpu::kThreads, 0, stream>>>(master, m, v, g, static_cast<O*>(copy), k, n);
      CUDA_CHECK_LAUNCH();
    });
  });
}

void launch_grad_chunk_sums(const void* grad, DType grad_t, int64_t n, double* chunk_sums,
                            cudaStream_t stream) {
  if (n == 0) return;
  const auto chunks =
      static_cast<int64_t>(cpu_adam::chunk_count(static_cast<size_t>(n), CpuAdam::kStatsChunk));
  const unsigned blocks = gpu::grid_rows(chunks);
  dispatch_all(grad_t, [&]<typename G>() {
    grad_chunk_sums_kernel<G>
        <<<blocks, kLanes, 0, stream>>>(static_cast<const G*>(grad), n, chunks, chunk_sums);
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace strata
