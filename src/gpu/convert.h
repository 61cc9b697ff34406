// convert.h: the dtype conversion kernel (f32 <-> bf16 <-> f16) on a CUDA stream.
//
// It must agree bit for bit with strata::convert (core/dtype.h), the host reference, for
// every non-NaN input: round to nearest even, overflow to infinity, subnormals kept. A NaN
// stays a NaN, though the GPU may return a canonical NaN where the host keeps the payload.
// Included by .cu files: no fmt here.
#pragma once

#include "core/dtype.h"

#include <cuda_runtime_api.h>

#include <cstdint>

namespace strata {

// Queues dst[i] = src[i] cast to dst_type for i < n on `stream` (the current device must be
// the stream's). Same dtype: an asynchronous device-to-device copy. dst and src are device
// memory and must not overlap.
void launch_convert(void* dst, DType dst_type, const void* src, DType src_type, uint64_t n,
                    cudaStream_t stream);

}  // namespace strata
