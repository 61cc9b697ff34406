// embedding.cu: the token embedding's forward (a row gather) and backward (a row scatter-add).
//
// The backward adds with atomics: rows sharing an id add in an unspecified order, so an f32
// dtable may differ between runs in its last bits, and a bf16 dtable rounds after every add
// (as the host does, but in another order). A deterministic version would sort the ids first;
// the embedding's gradient is one small tensor per step, so the atomics are kept for now.
#include "gpu/kernel_common.cuh"
#include "gpu/ops.h"

namespace strata {
namespace {

using gpu::bf16;
using gpu::from_f32;
using gpu::to_f32;

template <typename O, typename Tb>
__global__ void embedding_forward_kernel(O* __restrict__ out, const Tb* __restrict__ table,
                                         const int32_t* __restrict__ ids, int64_t rows,
                                         int64_t dim) {
  const int64_t n = rows * dim;
  gpu::grid_stride(n, [&](int64_t i) {
    const int64_t row = i / dim, d = i - row * dim;
    out[i] = from_f32<O>(to_f32(table[int64_t{ids[row]} * dim + d]));
  });
}

__device__ __forceinline__ void add_to(float* p, float v) {
  atomicAdd(p, v);
}
__device__ __forceinline__ void add_to(bf16* p, float v) {
  atomicAdd(p, __float2bfloat16_rn(v));
}

template <typename G, typename D>
__global__ void embedding_backward_kernel(G* dtable, const D* __restrict__ dout,
                                          const int32_t* __restrict__ ids, int64_t rows,
                                          int64_t dim) {
  const int64_t n = rows * dim;
  gpu::grid_stride(n, [&](int64_t i) {
    const int64_t row = i / dim, d = i - row * dim;
    add_to(dtable + int64_t{ids[row]} * dim + d, to_f32(dout[i]));
  });
}

}  // namespace

void launch_embedding_forward(void* out, DType out_t, const void* table, DType table_t,
                              const int32_t* ids, int64_t rows, int64_t dim, cudaStream_t stream) {
  if (rows * dim == 0) return;
  gpu::dispatch(out_t, [&]<typename O>() {
    gpu::dispatch(table_t, [&]<typename Tb>() {
      embedding_forward_kernel<O, Tb>
          <<<gpu::grid_for(static_cast<uint64_t>(rows * dim)), gpu::kThreads, 0, stream>>>(
              static_cast<O*>(out), static_cast<const Tb*>(table), ids, rows, dim);
      CUDA_CHECK_LAUNCH();
    });
  });
}

void launch_embedding_backward(void* dtable, DType dtable_t, const void* dout, DType dout_t,
                               const int32_t* ids, int64_t rows, int64_t dim, cudaStream_t stream) {
  if (rows * dim == 0) return;
  gpu::dispatch(dtable_t, [&]<typename G>() {
    gpu::dispatch(dout_t, [&]<typename D>() {
      embedding_backward_kernel<G, D>
          <<<gpu::grid_for(static_cast<uint64_t>(rows * dim)), gpu::kThreads, 0, stream>>>(
              static_cast<G*>(dtable), static_cast<const D*>(dout), ids, rows, dim);
      CUDA_CHECK_LAUNCH();
    });
  });
}

}  // namespace strata
