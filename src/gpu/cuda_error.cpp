// cuda_error.cpp: the messages behind CUDA_CHECK, CUDA_CHECK_LAUNCH and NCCL_CHECK.
//
// Plain C++ (not nvcc) so that it can use fmt. A hint is appended for the errors a user can
// do something about.
#include "core/error.h"
#include "gpu/cuda_check.h"

#include <nccl.h>

#include <string_view>

namespace strata {
namespace {

// "/work/main/src/gpu/cuda_device.cpp" -> "src/gpu/cuda_device.cpp".
std::string_view short_path(std::string_view file) {
  const size_t at = file.rfind("/src/");
  return at == std::string_view::npos ? file : file.substr(at + 1);
}

std::string_view cuda_hint(cudaError_t err) {
  switch (err) {
    case cudaErrorInsufficientDriver:
      return "; install or update the NVIDIA driver (nvidia-smi must work)";
    case cudaErrorNoDevice:
      return "; no GPU is visible: check nvidia-smi and CUDA_VISIBLE_DEVICES";
    case cudaErrorMemoryAllocation:
      return "; lower the micro-batch, offload more state, or pass a smaller --device-memory";
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorAssert:
      return "; the GPU context is now unusable: rerun under compute-sanitizer (or with "
             "CUDA_LAUNCH_BLOCKING=1) to find the faulting kernel";
    case cudaErrorNoKernelImageForDevice:
      return "; this GPU's architecture was not compiled in: rebuild with "
             "-DCMAKE_CUDA_ARCHITECTURES=<its compute capability>";
    default:
      return "";
  }
}

const char* nccl_result_name(int result) {
  switch (result) {
    case ncclSuccess:
      return "ncclSuccess";
    case ncclUnhandledCudaError:
      return "ncclUnhandledCudaError";
    case ncclSystemError:
      return "ncclSystemError";
    case ncclInternalError:
      return "ncclInternalError";
    case ncclInvalidArgument:
      return "ncclInvalidArgument";
    case ncclInvalidUsage:
      return "ncclInvalidUsage";
    case ncclRemoteError:
      return "ncclRemoteError";
    case ncclInProgress:
      return "ncclInProgress";
    default:
      return "ncclResult(unknown)";
  }
}

}  // namespace

std::string cuda_error_text(cudaError_t err) {
  return fmt::format("{} ({})", cudaGetErrorName(err), cudaGetErrorString(err));
}

// Names the GPU that was current: strata makes a call's GPU current right before it (and
// cudaGetDevice answers even after a sticky error), so on a machine of several GPUs the message
// says which one failed.
void cuda_fail(cudaError_t err, const char* call, const char* file, int line) {
  (void)cudaGetLastError();
  int device = -1;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    device = -1;
  }
  const std::string on = device >= 0 ? fmt::format(" on cuda:{}", device) : std::string();
  throw Error(fmt::format("{} failed{}: {} at {}:{}{}", call, on, cuda_error_text(err),
                          short_path(file), line, cuda_hint(err)));
}

void nccl_fail(int result, const char* call, const char* file, int line) {
  const char* last = ncclGetLastError(nullptr);
  const bool has_last = last != nullptr && *last != '\0';
  throw Error(fmt::format("{} failed: {} ({}){}{} at {}:{}; set NCCL_DEBUG=WARN for details", call,
                          nccl_result_name(result),
                          ncclGetErrorString(static_cast<ncclResult_t>(result)),
                          has_last ? ": " : "", has_last ? last : "", short_path(file), line));
}

}  // namespace strata
