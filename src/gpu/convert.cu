// convert.cu: the dtype conversion kernel; the host reference is strata::convert (dtype.cpp).
//
// One grid-stride loop with 64-bit indices per (dst, src) pair. The rounding is the hardware
// cvt.rn instructions behind __float2bfloat16_rn / __float2half_rn (sm_80 and later), which
// keep subnormals (no .ftz) and round ties to even, as the host code does. 16-bit to f32 is
// exact. 16-bit to 16-bit goes through f32, which is exact, so it rounds once, as on the host.
#include "gpu/convert.h"
#include "gpu/cuda_check.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

namespace strata {
namespace {

struct F32 {
  using T = float;
  __device__ static float load(T v) { return v; }
  __device__ static T store(float f) { return f; }
};
struct BF16 {
  using T = __nv_bfloat16;
  __device__ static float load(T v) { return __bfloat162float(v); }
  __device__ static T store(float f) { return __float2bfloat16_rn(f); }
};
struct F16 {
  using T = __half;
  __device__ static float load(T v) { return __half2float(v); }
  __device__ static T store(float f) { return __float2half_rn(f); }
};

template <typename Dst, typename Src>
__global__ void convert_kernel(typename Dst::T* __restrict__ dst,
                               const typename Src::T* __restrict__ src, uint64_t n) {
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  for (uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += stride)
    dst[i] = Dst::store(Src::load(src[i]));
}

template <typename Dst, typename Src>
void launch(void* dst, const void* src, uint64_t n, cudaStream_t stream) {
  constexpr unsigned kThreads = 256;
  constexpr uint64_t kMaxBlocks = 8192;  // the grid-stride loop covers the rest
  const auto blocks = static_cast<unsigned>(std::min((n + kThreads - 1) / kThreads, kMaxBlocks));
  convert_kernel<Dst, Src><<<blocks, kThreads, 0, stream>>>(
      static_cast<typename Dst::T*>(dst), static_cast<const typename Src::T*>(src), n);
  CUDA_CHECK_LAUNCH();
}

template <typename Dst>
void launch_from(void* dst, const void* src, DType src_type, uint64_t n, cudaStream_t stream) {
  switch (src_type) {
    case DType::f32:
      launch<Dst, F32>(dst, src, n, stream);
      break;
    case DType::bf16:
      launch<Dst, BF16>(dst, src, n, stream);
      break;
    case DType::f16:
      launch<Dst, F16>(dst, src, n, stream);
      break;
  }
}

}  // namespace

void launch_convert(void* dst, DType dst_type, const void* src, DType src_type, uint64_t n,
                    cudaStream_t stream) {
  if (n == 0) return;
  if (dst_type == src_type) {
    if (dst != src)
      CUDA_CHECK(
          cudaMemcpyAsync(dst, src, n * dtype_size(dst_type), cudaMemcpyDeviceToDevice, stream));
    return;
  }
  switch (dst_type) {
    case DType::f32:
      launch_from<F32>(dst, src, src_type, n, stream);
      break;
    case DType::bf16:
      launch_from<BF16>(dst, src, src_type, n, stream);
      break;
    case DType::f16:
      launch_from<F16>(dst, src, src_type, n, stream);
      break;
  }
}

}  // namespace strata
