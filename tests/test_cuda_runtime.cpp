// test_cuda_runtime.cpp: what strata says about CUDA when it cannot use a GPU.
//
// Label `unit`, so it runs in CI, which has no GPU (and sometimes no CUDA backend): the probe
// must not throw, and asking for CUDA devices must fail with a message a user can act on.
// On a machine with a GPU the no-GPU cases skip.
#include "core/device.h"
#include "core/error.h"
#include "gpu/runtime.h"
#if defined(STRATA_HAVE_CUDA)
#include "gpu/cublaslt.h"
#endif

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace strata {
namespace {

std::string open_error(const char* spec) {
  try {
    open_devices(parse_device_spec(spec), 0);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no Error thrown)";
}

#if defined(STRATA_HAVE_CUDA)
// cuBLASLt is opened at the first matmul, not linked (gpu/cublaslt.h). Opening it needs no GPU,
// so CI checks here that the library the build found opens and has every function strata calls,
// and that one that cannot be opened is named with what to do.
TEST(CublasLt, OpensTheBuildsLibraryWithEveryFunction) {
  const std::vector<std::string> candidates = cublaslt_candidates();
  ASSERT_FALSE(candidates.empty());
  EXPECT_EQ(candidates.back(), "libcublasLt.so." + std::to_string(CUBLAS_VER_MAJOR));
  const CublasLtApi& api = cublaslt();
  EXPECT_EQ(&api, &cublaslt());  // opened once
#define STRATA_EXPECT_FOUND(name) EXPECT_NE(api.name, nullptr) << #name;
  STRATA_CUBLASLT_FUNCTIONS(STRATA_EXPECT_FOUND)
#undef STRATA_EXPECT_FOUND
  EXPECT_STREQ(api.GetStatusName(CUBLAS_STATUS_NOT_SUPPORTED), "CUBLAS_STATUS_NOT_SUPPORTED");
}

TEST(CublasLt, ALibraryThatDoesNotOpenIsNamed) {
  try {
    open_cublaslt({"/nonexistent/libcublasLt.so.99", "libcublasLt-missing.so.99"});
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("cannot load cuBLASLt"), std::string::npos) << what;
    EXPECT_NE(what.find("/nonexistent/libcublasLt.so.99"), std::string::npos) << what;
    EXPECT_NE(what.find("libcublasLt-missing.so.99"), std::string::npos) << what;
    EXPECT_NE(what.find("LD_LIBRARY_PATH"), std::string::npos) << what;
  }
}
#endif

TEST(CudaRuntime, ProbeDescribesTheBuildWithoutThrowing) {
  const CudaRuntime& rt = cuda_runtime();
  EXPECT_EQ(&rt, &cuda_runtime());  // probed once
  if (!rt.compiled) {
    EXPECT_EQ(rt.status, "not compiled");
    EXPECT_TRUE(rt.gpus.empty());
    EXPECT_EQ(rt.runtime_version, 0);
    return;
  }
  EXPECT_GE(rt.runtime_version, 12000);
  EXPECT_GT(rt.nccl_version, 0);
  EXPECT_GT(rt.nccl_runtime_version, 0);
  if (rt.gpus.empty()) {
    EXPECT_EQ(rt.status, "compiled, no device");
    EXPECT_FALSE(rt.detail.empty());
  } else {
    EXPECT_EQ(rt.status, "ok");
    for (size_t i = 0; i < rt.gpus.size(); ++i) {
      const CudaGpu& g = rt.gpus[i];
      EXPECT_EQ(g.index, static_cast<int>(i));
      EXPECT_FALSE(g.name.empty());
      EXPECT_GT(g.total_memory, 0u);
      const uint64_t free_bytes = cuda_free_memory(g.index);
      EXPECT_GT(free_bytes, 0u);
      EXPECT_LE(free_bytes, g.total_memory);
      EXPECT_GE(g.compute_capability, 50);
      EXPECT_GT(g.multiprocessors, 0);
      EXPECT_EQ(g.pci_bus_id.size(), 12u) << g.pci_bus_id;  // "0000:17:00.0"
    }
  }
}

TEST(CudaRuntime, NoPinnedMemoryWithoutAGpu) {
  if (!cuda_runtime().gpus.empty()) GTEST_SKIP() << "a GPU is present";
  EXPECT_EQ(cuda_host_alloc(4096), nullptr);
  cuda_host_free(nullptr);
}

TEST(CudaRuntime, OpeningCudaDevicesWithoutAGpuSaysWhatToDo) {
  const CudaRuntime& rt = cuda_runtime();
  if (!rt.gpus.empty()) GTEST_SKIP() << "a GPU is present";
  for (const char* spec : {"cuda", "cuda:0", "cuda:1,0"}) {
    const std::string msg = open_error(spec);
    EXPECT_NE(msg.find("--devices host:N"), std::string::npos) << msg;
    if (!rt.compiled)
      EXPECT_NE(msg.find("built without the CUDA backend"), std::string::npos) << msg;
    else
      EXPECT_NE(msg.find(rt.detail), std::string::npos) << msg;
  }
  try {
    open_cuda_device(0, 0);
    ADD_FAILURE() << "open_cuda_device(0, 0) did not throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("host:N"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace strata
