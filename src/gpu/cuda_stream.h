// cuda_stream.h: the CUDA stream behind a strata Stream, for code outside src/gpu that calls a
// CUDA library itself (the NCCL communicator).
//
// Plain declarations with no fmt, so nvcc-compiled code may include it too.
#pragma once

#include <cuda_runtime_api.h>

namespace strata {

class Device;
class Stream;

// Makes `device`'s GPU current on the calling thread and returns the cudaStream_t behind `s`.
// Throws Error when `device` is not a CUDA device or `s` was not created by it.
cudaStream_t cuda_stream_handle(Device& device, Stream& s);

}  // namespace strata
