// matmul.h: Kernels::matmul on one GPU through cuBLASLt.
//
// Row-major c = alpha * op(a) op(b) + beta * c is cuBLASLt's column-major c^T = op(b)^T op(a)^T:
// a row-major [r, c] matrix is the column-major [c, r] matrix with leading dimension c, so b is
// passed as cuBLASLt's A and a as its B, each with its own transpose flag, and c is [n, m] with
// leading dimension n. Compute is CUBLAS_COMPUTE_32F with f32 scales: no TF32 for f32 inputs,
// f32 accumulation for bf16 inputs (whose c may be bf16 or f32). beta == 0 means c is not read.
// Descriptors and the heuristic's algorithm are cached per shape, dtypes, transposes and the
// pointers' alignments. The workspace is the caller's (one per stream: see cuda_kernels.cpp).
#pragma once

#include "core/dtype.h"
#include "core/kernels.h"

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>

namespace strata {

class CublasLtMatmul {
 public:
  // `device` names the GPU in errors ("cuda:0"). No CUDA call is made here: the cuBLASLt handle
  // is created on the first run(), with the GPU current.
  explicit CublasLtMatmul(std::string device);
  // Call with the GPU current and its work finished. Logs (does not throw) a failure.
  ~CublasLtMatmul();
  CublasLtMatmul(const CublasLtMatmul&) = delete;
  CublasLtMatmul& operator=(const CublasLtMatmul&) = delete;

  // Queues the product on `stream` (the GPU current). m, n, k > 0; a and b of dtype ab, c of
  // dtype ab or f32. `workspace` (`workspace_bytes`, 256-byte aligned) serves only `stream`.
  void run(const MatmulDims& dims, void* c, DType c_type, const void* a, bool trans_a,
           const void* b, bool trans_b, DType ab_type, float alpha, float beta, void* workspace,
           uint64_t workspace_bytes, cudaStream_t stream);

 private:
  struct Plan;
  // m, n, k, trans_a, trans_b, ab dtype, c dtype, alignments of a, b, c, workspace bytes.
  using Key = std::tuple<int64_t, int64_t, int64_t, bool, bool, DType, DType, uint32_t, uint32_t,
                         uint32_t, uint64_t>;
  const Plan& plan(const Key& key);

  std::string device_;
  std::mutex mutex_;
  cublasLtHandle_t handle_ = nullptr;
  std::map<Key, std::unique_ptr<Plan>> plans_;
};

}  // namespace strata
