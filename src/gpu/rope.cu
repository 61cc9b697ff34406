// rope.cu: rotary position embedding in place, Hugging Face's rotate-half layout.
//
// One thread per (token, head, i < rotary/2) rotates the pair (x[i], x[i + rotary/2]), so every
// element is read and written by exactly one thread and the in-place update is race-free. The
// dimensions from `rotary` to head_dim (a partial rotation, Phi-4-mini's) are left as they are.
#include "gpu/kernel_common.cuh"
#include "gpu/ops.h"

namespace strata {
namespace {

using gpu::from_f32;
using gpu::to_f32;

template <typename T>
__global__ void rope_kernel(T* x, const float* __restrict__ cos_sin, int64_t tokens, int64_t heads,
                            int64_t head_dim, int64_t rotary, int64_t seq_len, float sign) {
  const int64_t half = rotary / 2;
  const int64_t n = tokens * heads * half;
  gpu::grid_stride(n, [&](int64_t i) {
    const int64_t pair = i / half, j = i - pair * half;  // pair = token * heads + head
    const int64_t pos = (pair / heads) % seq_len;
    const float c = cos_sin[pos * rotary + j];
    const float s = sign * cos_sin[pos * rotary + half + j];
    T* p = x + pair * head_dim;
    const float a = to_f32(p[j]), b = to_f32(p[j + half]);
    p[j] = from_f32<T>(a * c - b * s);
    p[j + half] = from_f32<T>(b * c + a * s);
  });
}

}  // namespace

void launch_rope(void* x, DType x_t, const float* cos_sin, int64_t tokens, int64_t heads,
                 int64_t head_dim, int64_t rotary, int64_t seq_len, bool inverse,
                 cudaStream_t stream) {
  const int64_t n = tokens * heads * (rotary / 2);
  if (n == 0) return;
  gpu::dispatch(x_t, [&]<typename T>() {
    rope_kernel<T><<<gpu::grid_for(static_cast<uint64_t>(n)), gpu::kThreads, 0, stream>>>(
        static_cast<T*>(x), cos_sin, tokens, heads, head_dim, rotary, seq_len,
        inverse ? -1.0f : 1.0f);
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace strata
