// cublaslt.cpp (CUDA emulator): cuBLASLt's matmul on the CPU.
//
// The emulator is an oracle for matmul.cpp's use of cuBLASLt, so every check is made where the
// real library would fail or, worse, would compute something plausible from a wrong call:
// - descriptors: leading dimension >= rows at layout creation; attribute sizes and values;
// - the heuristic: f32, bf16 or f16 A and B of one dtype, C and D of that dtype or f32, compute
//   CUBLAS_COMPUTE_32F with f32 scales, else CUBLAS_STATUS_NOT_SUPPORTED and no algorithm;
//   op(A) m x k, op(B) k x n, C and D m x n, else CUBLAS_STATUS_INVALID_VALUE. The algorithm it
//   returns records the problem and the preference's minimum alignments (checksummed, so an
//   algorithm the heuristic did not return is refused);
// - the matmul: the same problem checks, the algorithm made for these dtypes and transposes,
//   each pointer aligned as the preference promised (the chosen kernel may rely on it) and to
//   its element, each matrix inside one live allocation of the stream's device, D overlapping
//   neither A nor B, C either D itself (same layout) or apart from it.
// The product is queued on the stream: op(A) and op(B) are widened to f32, each D element is
// acc = acc + a * b over k in order from 0 (no FMA: the emulator builds with -ffp-contract=off),
// then d = alpha * acc, plus beta * c only when beta != 0 (C is not read at all otherwise, so a
// NaN there cannot reach D), rounded to D's dtype to nearest even.
#include "emu_internal.h"

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

struct cublasLtContext {
  int device;  // current at cublasLtCreate (informative: the stream decides where work runs)
};

struct cublasLtMatmulDescOpaque_t {
  cublasComputeType_t compute;
  cudaDataType_t scale;
  int32_t pointer_mode = CUBLASLT_POINTER_MODE_HOST;
  int32_t trans_a = CUBLAS_OP_N, trans_b = CUBLAS_OP_N;
};

struct cublasLtMatrixLayoutOpaque_t {
  cudaDataType_t type;
  uint64_t rows, cols;
  int64_t ld;
};

struct cublasLtMatmulPreferenceOpaque_t {
  uint64_t max_workspace = 0;
  uint32_t min_align[4] = {256, 256, 256, 256};  // A, B, C, D: the library's defaults
};

namespace {

using Desc = cublasLtMatmulDescOpaque_t;
using Layout = cublasLtMatrixLayoutOpaque_t;

// The status, after saying why on stderr: a bare CUBLAS_STATUS_INVALID_VALUE in strata's error
// message would leave the reader guessing which check failed.
cublasStatus_t refuse(cublasStatus_t status, const char* function, const std::string& why) {
  std::fprintf(stderr, "cuda_emu: %s: %s: %s\n", function, cublasLtGetStatusName(status),
               why.c_str());
  return status;
}

const char* type_name(cudaDataType_t t) {
  switch (t) {
    case CUDA_R_32F:
      return "CUDA_R_32F";
    case CUDA_R_16F:
      return "CUDA_R_16F";
    case CUDA_R_16BF:
      return "CUDA_R_16BF";
    case CUDA_R_64F:
      return "CUDA_R_64F";
    case CUDA_R_8I:
      return "CUDA_R_8I";
    case CUDA_R_32I:
      return "CUDA_R_32I";
    case CUDA_R_8F_E4M3:
      return "CUDA_R_8F_E4M3";
    case CUDA_R_8F_E5M2:
      return "CUDA_R_8F_E5M2";
    default:
      return "another cudaDataType_t";
  }
}

bool known_type(int32_t t) {
  return t >= CUDA_R_32F && t <= CUDA_R_8F_E5M2;
}

bool known_compute(int32_t c) {
  switch (c) {
    case CUBLAS_COMPUTE_16F:
    case CUBLAS_COMPUTE_16F_PEDANTIC:
    case CUBLAS_COMPUTE_32F:
    case CUBLAS_COMPUTE_32F_PEDANTIC:
    case CUBLAS_COMPUTE_32F_FAST_16F:
    case CUBLAS_COMPUTE_32F_FAST_16BF:
    case CUBLAS_COMPUTE_32F_FAST_TF32:
    case CUBLAS_COMPUTE_64F:
    case CUBLAS_COMPUTE_64F_PEDANTIC:
    case CUBLAS_COMPUTE_32I:
    case CUBLAS_COMPUTE_32I_PEDANTIC:
      return true;
    default:
      return false;
  }
}

// Bytes per element of the dtypes the emulator computes with (0: not one of them).
size_t element_bytes(cudaDataType_t t) {
  switch (t) {
    case CUDA_R_32F:
      return 4;
    case CUDA_R_16BF:
    case CUDA_R_16F:
      return 2;
    default:
      return 0;
  }
}

bool is_transposed(int32_t op) {
  return op != CUBLAS_OP_N;  // CUBLAS_OP_C is CUBLAS_OP_T for real dtypes
}

std::string layout_text(const char* name, const Layout& l) {
  return std::string(name) + " " + type_name(l.type) + " " + std::to_string(l.rows) + "x" +
         std::to_string(l.cols) + " ld " + std::to_string(l.ld);
}

// The product the descriptors describe, once checked.
struct Problem {
  cudaDataType_t ab, cd;
  bool trans_a, trans_b;
  uint64_t m, n, k;
  int64_t lda, ldb, ldc, ldd;
};

cublasStatus_t check_problem(const char* fn, const Desc* desc, const Layout* a, const Layout* b,
                             const Layout* c, const Layout* d, Problem* out) {
  if (desc == nullptr || a == nullptr || b == nullptr || c == nullptr || d == nullptr)
    return refuse(CUBLAS_STATUS_INVALID_VALUE, fn, "a descriptor or layout is NULL");
  if (desc->compute != CUBLAS_COMPUTE_32F || desc->scale != CUDA_R_32F)
    return refuse(CUBLAS_STATUS_NOT_SUPPORTED, fn,
                  "the emulator implements compute CUBLAS_COMPUTE_32F with CUDA_R_32F scales "
                  "only, not compute type " +
                      std::to_string(desc->compute) + " with " + type_name(desc->scale));
  if (a->type != b->type || element_bytes(a->type) == 0)
    return refuse(CUBLAS_STATUS_NOT_SUPPORTED, fn,
                  std::string("A and B must be both CUDA_R_32F, CUDA_R_16BF or CUDA_R_16F, not ") +
                      type_name(a->type) + " and " + type_name(b->type));
  if (c->type != d->type || (d->type != a->type && d->type != CUDA_R_32F))
    return refuse(CUBLAS_STATUS_NOT_SUPPORTED, fn,
                  std::string("C and D must be both of A's dtype or both CUDA_R_32F; A is ") +
                      type_name(a->type) + ", C " + type_name(c->type) + ", D " +
                      type_name(d->type));
  const bool ta = is_transposed(desc->trans_a), tb = is_transposed(desc->trans_b);
  const uint64_t m = d->rows, n = d->cols;
  const uint64_t opa_rows = ta ? a->cols : a->rows, k = ta ? a->rows : a->cols;
  const uint64_t opb_rows = tb ? b->cols : b->rows, opb_cols = tb ? b->rows : b->cols;
  const std::string layouts = layout_text("A", *a) + (ta ? " (op T)" : " (op N)") + ", " +
                              layout_text("B", *b) + (tb ? " (op T)" : " (op N)") + ", " +
                              layout_text("C", *c) + ", " + layout_text("D", *d);
  if (opa_rows != m || opb_rows != k || opb_cols != n || c->rows != m || c->cols != n)
    return refuse(CUBLAS_STATUS_INVALID_VALUE, fn,
                  "op(A) must be m x k, op(B) k x n, C and D m x n: " + layouts);
  if (m == 0 || n == 0 || k == 0)
    return refuse(CUBLAS_STATUS_INVALID_VALUE, fn,
                  "the emulator takes m, n, k > 0 (strata's matmul.h promises it): " + layouts);
  *out = Problem{a->type, d->type, ta, tb, m, n, k, a->ld, b->ld, c->ld, d->ld};
  return CUBLAS_STATUS_SUCCESS;
}

// The algorithm's encoding: what the heuristic was asked, checksummed.
constexpr uint64_t kAlgoMagic = 0x31474c4155454d45;  // "EMUALGO1"

uint64_t algo_checksum(const cublasLtMatmulAlgo_t& algo) {
  uint64_t h = 0xcbf29ce484222325;  // FNV-1a over the words
  for (int i = 0; i < 7; ++i) {
    h ^= algo.data[i];
    h *= 0x100000001b3;
  }
  return h;
}

struct AlgoInfo {
  cudaDataType_t ab, cd;
  bool trans_a, trans_b;
  uint32_t align[4];  // A, B, C, D
  uint64_t workspace;
};

cublasLtMatmulAlgo_t encode_algo(const AlgoInfo& info) {
  cublasLtMatmulAlgo_t algo{};
  algo.data[0] = kAlgoMagic;
  algo.data[1] = static_cast<uint64_t>(info.ab) | static_cast<uint64_t>(info.cd) << 16 |
                 uint64_t{info.trans_a} << 32 | uint64_t{info.trans_b} << 33;
  algo.data[2] = uint64_t{info.align[0]} | uint64_t{info.align[1]} << 32;
  algo.data[3] = uint64_t{info.align[2]} | uint64_t{info.align[3]} << 32;
  algo.data[4] = info.workspace;
  algo.data[7] = algo_checksum(algo);
  return algo;
}

bool decode_algo(const cublasLtMatmulAlgo_t& algo, AlgoInfo* info) {
  if (algo.data[0] != kAlgoMagic || algo.data[7] != algo_checksum(algo)) return false;
  info->ab = static_cast<cudaDataType_t>(algo.data[1] & 0xffff);
  info->cd = static_cast<cudaDataType_t>((algo.data[1] >> 16) & 0xffff);
  info->trans_a = (algo.data[1] >> 32) & 1;
  info->trans_b = (algo.data[1] >> 33) & 1;
  info->align[0] = static_cast<uint32_t>(algo.data[2]);
  info->align[1] = static_cast<uint32_t>(algo.data[2] >> 32);
  info->align[2] = static_cast<uint32_t>(algo.data[3]);
  info->align[3] = static_cast<uint32_t>(algo.data[3] >> 32);
  info->workspace = algo.data[4];
  return true;
}

// Bytes from a column-major matrix's first element to just past its last one (0 on overflow).
uint64_t span_bytes(uint64_t rows, uint64_t cols, int64_t ld, cudaDataType_t type) {
  uint64_t elements = 0, bytes = 0;
  if (__builtin_mul_overflow(cols - 1, static_cast<uint64_t>(ld), &elements) ||
      __builtin_add_overflow(elements, rows, &elements) ||
      __builtin_mul_overflow(elements, element_bytes(type), &bytes))
    return 0;
  return bytes;
}

bool overlap(const void* p, uint64_t p_bytes, const void* q, uint64_t q_bytes) {
  const auto a = reinterpret_cast<uintptr_t>(p), b = reinterpret_cast<uintptr_t>(q);
  return a < b + q_bytes && b < a + p_bytes;
}

float load(cudaDataType_t t, const void* base, uint64_t i) {
  const auto* p = static_cast<const unsigned char*>(base);
  if (t == CUDA_R_32F) {
    float f;
    std::memcpy(&f, p + i * 4, 4);
    return f;
  }
  uint16_t bits;
  std::memcpy(&bits, p + i * 2, 2);
  return t == CUDA_R_16BF ? __bfloat162float(__nv_bfloat16{bits}) : __half2float(__half{bits});
}

void store(cudaDataType_t t, void* base, uint64_t i, float v) {
  auto* p = static_cast<unsigned char*>(base);
  if (t == CUDA_R_32F) {
    std::memcpy(p + i * 4, &v, 4);
    return;
  }
  const uint16_t bits = t == CUDA_R_16BF ? __float2bfloat16_rn(v).x : __float2half_rn(v).x;
  std::memcpy(p + i * 2, &bits, 2);
}

// One queued product, with everything copied at the call (descriptors may go right after it).
struct Job {
  Problem p;
  const void *a, *b, *c;
  void* d;
  uint64_t a_bytes, b_bytes, c_bytes, d_bytes;
  float alpha, beta;
};

void check_live(const void* p, uint64_t bytes, const char* name) {
  int device = -1;
  if (!cuda_emu::device_range(p, bytes, &device))
    throw cuda_emu::Fault(std::string("cublasLtMatmul: matrix ") + name +
                          " was freed before the queued matmul ran");
}

void run_job(const Job& j) {
  check_live(j.a, j.a_bytes, "A");
  check_live(j.b, j.b_bytes, "B");
  if (j.beta != 0.0f) check_live(j.c, j.c_bytes, "C");
  check_live(j.d, j.d_bytes, "D");
  const Problem& p = j.p;
  const uint64_t m = p.m, n = p.n, k = p.k;
  const auto lda = static_cast<uint64_t>(p.lda), ldb = static_cast<uint64_t>(p.ldb);
  const auto ldc = static_cast<uint64_t>(p.ldc), ldd = static_cast<uint64_t>(p.ldd);
  // op(A) as column-major m x k and op(B) as k x n with each column contiguous, in f32: the
  // inner loop then runs over i with unit stride and m independent accumulators.
  std::vector<float> a(m * k), b(k * n);
  for (uint64_t kk = 0; kk < k; ++kk)
    for (uint64_t i = 0; i < m; ++i)
      a[kk * m + i] = load(p.ab, j.a, p.trans_a ? kk + i * lda : i + kk * lda);
  for (uint64_t col = 0; col < n; ++col)
    for (uint64_t kk = 0; kk < k; ++kk)
      b[col * k + kk] = load(p.ab, j.b, p.trans_b ? col + kk * ldb : kk + col * ldb);

  const auto columns = [&](uint64_t begin, uint64_t end) {
    std::vector<float> acc(m);
    for (uint64_t col = begin; col < end; ++col) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (uint64_t kk = 0; kk < k; ++kk) {
        const float bv = b[col * k + kk];
        const float* ak = &a[kk * m];
        for (uint64_t i = 0; i < m; ++i) acc[i] = acc[i] + ak[i] * bv;
      }
      for (uint64_t i = 0; i < m; ++i) {
        float v = j.alpha * acc[i];
        if (j.beta != 0.0f) v = v + j.beta * load(p.cd, j.c, i + col * ldc);
        store(p.cd, j.d, i + col * ldd, v);
      }
    }
  };
  // Large products split their columns over threads; each element is computed the same way
  // whichever thread does it, so the result does not depend on the split.
  const uint64_t work = m * n * k;
  const uint64_t hw = std::max(1u, std::thread::hardware_concurrency());
  const uint64_t threads = work < (uint64_t{1} << 22) ? 1 : std::min({hw, n, uint64_t{16}});
  if (threads <= 1) {
    columns(0, n);
    return;
  }
  std::vector<std::thread> pool;
  for (uint64_t t = 0; t < threads; ++t)
    pool.emplace_back(columns, n * t / threads, n * (t + 1) / threads);
  for (std::thread& th : pool) th.join();
}

}  // namespace

extern "C" {

const char* cublasLtGetStatusName(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS:
      return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED:
      return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED:
      return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE:
      return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH:
      return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR:
      return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED:
      return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR:
      return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_LICENSE_ERROR:
      return "CUBLAS_STATUS_LICENSE_ERROR";
  }
  return "CUBLAS_STATUS_UNKNOWN";
}

const char* cublasLtGetStatusString(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS:
      return "success";
    case CUBLAS_STATUS_NOT_INITIALIZED:
      return "the library was not initialized";
    case CUBLAS_STATUS_ALLOC_FAILED:
      return "the resource allocation failed";
    case CUBLAS_STATUS_INVALID_VALUE:
      return "an invalid value was passed as an argument";
    case CUBLAS_STATUS_ARCH_MISMATCH:
      return "the device lacks an architectural feature the call needs";
    case CUBLAS_STATUS_MAPPING_ERROR:
      return "an access to GPU memory failed";
    case CUBLAS_STATUS_EXECUTION_FAILED:
      return "the GPU program failed to execute";
    case CUBLAS_STATUS_INTERNAL_ERROR:
      return "an internal operation failed";
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return "the requested functionality is not supported";
    case CUBLAS_STATUS_LICENSE_ERROR:
      return "the license check failed";
  }
  return "unknown status";
}

cublasStatus_t cublasLtCreate(cublasLtHandle_t* lightHandle) {
  if (lightHandle == nullptr)
    return refuse(CUBLAS_STATUS_INVALID_VALUE, "cublasLtCreate", "lightHandle is NULL");
  if (cuda_emu::device_count() == 0)
    return refuse(CUBLAS_STATUS_NOT_INITIALIZED, "cublasLtCreate", "no emulated GPU");
  *lightHandle = new cublasLtContext{cuda_emu::current_device()};
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtDestroy(cublasLtHandle_t lightHandle) {
  if (lightHandle == nullptr)
    return refuse(CUBLAS_STATUS_NOT_INITIALIZED, "cublasLtDestroy", "the handle is NULL");
  delete lightHandle;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* matLayout, cudaDataType type,
                                          uint64_t rows, uint64_t cols, int64_t ld) {
  const char* fn = "cublasLtMatrixLayoutCreate";
  if (matLayout == nullptr) return refuse(CUBLAS_STATUS_INVALID_VALUE, fn, "matLayout is NULL");
  if (!known_type(type))
    return refuse(CUBLAS_STATUS_INVALID_VALUE, fn,
                  "type " + std::to_string(static_cast<int>(type)) + " is no cudaDataType_t");
  // Column-major (the default order): a column's `rows` elements must fit in `ld`.
  if (ld < 1 || static_cast<uint64_t>(ld) < rows)
    return refuse(CUBLAS_STATUS_INVALID_VALUE, fn,
                  std::to_string(rows) + "x" + std::to_string(cols) + " matrix with leading " +
                      "dimension " + std::to_string(ld) + " < its rows");
  *matLayout = new Layout{type, rows, cols, ld};
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t matLayout) {
  delete matLayout;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* matmulDesc,
                                        cublasComputeType_t computeType, cudaDataType_t scaleType) {
  const char* fn = "cublasLtMatmulDescCreate";
  if (matmulDesc == nullptr) return refuse(CUBLAS_STATUS_INVALID_VALUE, fn, "matmulDesc is NULL");
  if (!known_compute(computeType) || !known_type(scaleType))
    return refuse(CUBLAS_STATUS_INVALID_VALUE, fn, "unknown compute or scale type");
  auto* desc = new Desc;
  desc->compute = computeType;
  desc->scale = scaleType;
  *matmulDesc = desc;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t matmulDesc) {
  delete matmulDesc;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t matmulDesc,
                                              cublasLtMatmulDescAttributes_t attr, const void* buf,
                                              size_t sizeInBytes) {
  const char* fn = "cublasLtMatmulDescSetAttribute";
  if (matmulDesc == nullptr || buf == nullptr)
    return refuse(CUBLAS_STATUS_INVALID_VALUE, fn, "matmulDesc or buf is NULL");
  int32_t v = 0;  // every attribute the emulator takes is 4 bytes
  const bool four = sizeInBytes == sizeof v;
  if (four) std::memcpy(&v, buf, sizeof v);
  const std::string what = "attribute " + std::to_string(static_cast<int>(attr));
  switch (attr) {
    case CUBLASLT_MATMUL_DESC_COMPUTE_TYPE:
    case CUBLASLT_MATMUL_DESC_SCALE_TYPE:
    case CUBLASLT_MATMUL_DESC_POINTER_MODE:
    case CUBLASLT_MATMUL_DESC_TRANSA:
    case CUBLASLT_MATMUL_DESC_TRANSB:
    case CUBLASLT_MATMUL_DESC_TRANSC:
    case CUBLASLT_MATMUL_DESC_EPILOGUE:
      if (!four)
        return refuse(CUBLAS_STATUS_INVALID_VALUE, fn,
                      what + " takes 4 bytes, not " + std::to_string(sizeInBytes));
      break;
    default:
      return refuse(CUBLAS_STATUS_NOT_SUPPORTED, fn, what + " is not emulated");
  }
  switch (attr) {
    case CUBLASLT_MATMUL_DESC_COMPUTE_TYPE:
      if (!known_compute(v)) return refuse(CUBLAS_STATUS_INVALID_VALUE, fn, "bad compute type");
      matmulDesc->compute = static_cast<cublasComputeType_t>(v);
      break;
    case CUBLASLT_MATMUL_DESC_SCALE_TYPE:
      if (!known_type(v)) return refuse(CUBLAS_STATUS_INVALID_VALUE, fn, "bad scale type");
      matmulDesc->scale = static_cast<cudaDataType_t>(v);
      break;
    case CUBLASLT_MATMUL_DESC_POINTER_MODE:
      if (v != CUBLASLT_POINTER_MODE_HOST)
        return refuse(CUBLAS_STATUS_NOT_SUPPORTED, fn,
                      "the emulator takes alpha and beta as host pointers only");
      break;
    case CUBLASLT_MATMUL_DESC_TRANSA:
    case CUBLASLT_MATMUL_DESC_TRANSB:
      if (v != CUBLAS_OP_N && v != CUBLAS_OP_T && v != CUBLAS_OP_C)
        return refuse(CUBLAS_STATUS_INVALID_VALUE, fn,
                      what + ": " + std::to_string(v) + " is not CUBLAS_OP_N, _T or _C");
      (attr == CUBLASLT_MATMUL_DESC_TRANSA ? matmulDesc->trans_a : matmulDesc->trans_b) = v;
      break;
    case CUBLASLT_MATMUL_DESC_TRANSC:
      if (v != CUBLAS_OP_N)
        return refuse(CUBLAS_STATUS_NOT_SUPPORTED, fn, "C must not be transposed");
      break;
    case CUBLASLT_MATMUL_DESC_EPILOGUE:
      if (v != CUBLASLT_EPILOGUE_DEFAULT)
        return refuse(CUBLAS_STATUS_NOT_SUPPORTED, fn, "epilogues are not emulated");
      break;
    default:
      break;
  }
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* pref) {
  if (pref == nullptr)
    return refuse(CUBLAS_STATUS_INVALID_VALUE, "cublasLtMatmulPreferenceCreate", "pref is NULL");
  *pref = new cublasLtMatmulPreferenceOpaque_t;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref) {
  delete pref;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t pref,
                                                    cublasLtMatmulPreferenceAttributes_t attr,
                                                    const void* buf, size_t sizeInBytes) {
  const char* fn = "cublasLtMatmulPreferenceSetAttribute";
  if (pref == nullptr || buf == nullptr)
    return refuse(CUBLAS_STATUS_INVALID_VALUE, fn, "pref or buf is NULL");
  size_t want = 0;
  switch (attr) {
    case CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES:
    case CUBLASLT_MATMUL_PREF_IMPL_MASK:
      want = sizeof(uint64_t);
      break;
    case CUBLASLT_MATMUL_PREF_SEARCH_MODE:
    case CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK:
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES:
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES:
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES:
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES:
    case CUBLASLT_MATMUL_PREF_MAX_WAVES_COUNT:
      want = sizeof(uint32_t);
      break;
    default:
      return refuse(CUBLAS_STATUS_NOT_SUPPORTED, fn,
                    "attribute " + std::to_string(static_cast<int>(attr)) + " is not emulated");
  }
  if (sizeInBytes != want)
    return refuse(CUBLAS_STATUS_INVALID_VALUE, fn,
                  "attribute " + std::to_string(static_cast<int>(attr)) + " takes " +
                      std::to_string(want) + " bytes, not " + std::to_string(sizeInBytes));
  if (attr == CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES) {
    std::memcpy(&pref->max_workspace, buf, sizeof pref->max_workspace);
  } else if (attr >= CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES &&
             attr <= CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES) {
    std::memcpy(&pref->min_align[attr - CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES], buf,
                sizeof(uint32_t));
  }
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(
    cublasLtHandle_t lightHandle, cublasLtMatmulDesc_t operationDesc, cublasLtMatrixLayout_t Adesc,
    cublasLtMatrixLayout_t Bdesc, cublasLtMatrixLayout_t Cdesc, cublasLtMatrixLayout_t Ddesc,
    cublasLtMatmulPreference_t preference, int requestedAlgoCount,
    cublasLtMatmulHeuristicResult_t heuristicResultsArray[], int* returnAlgoCount) {
  const char* fn = "cublasLtMatmulAlgoGetHeuristic";
  if (lightHandle == nullptr)
    return refuse(CUBLAS_STATUS_NOT_INITIALIZED, fn, "the handle is NULL");
  if (preference == nullptr || requestedAlgoCount <= 0 || heuristicResultsArray == nullptr ||
      returnAlgoCount == nullptr)
    return refuse(CUBLAS_STATUS_INVALID_VALUE, fn,
                  "preference, results or count NULL, or requestedAlgoCount <= 0");
  *returnAlgoCount = 0;
  Problem p{};
  if (const cublasStatus_t st = check_problem(fn, operationDesc, Adesc, Bdesc, Cdesc, Ddesc, &p);
      st != CUBLAS_STATUS_SUCCESS)
    return st;
  // One algorithm, needing no workspace (so any MAX_WORKSPACE_BYTES admits it), that assumes
  // exactly the alignments the preference allowed.
  AlgoInfo info{p.ab, p.cd, p.trans_a, p.trans_b, {}, 0};
  std::copy(std::begin(preference->min_align), std::end(preference->min_align), info.align);
  cublasLtMatmulHeuristicResult_t result{};
  result.algo = encode_algo(info);
  result.workspaceSize = 0;
  result.state = CUBLAS_STATUS_SUCCESS;
  result.wavesCount = 1.0f;
  heuristicResultsArray[0] = result;
  *returnAlgoCount = 1;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t lightHandle, cublasLtMatmulDesc_t computeDesc,
                              const void* alpha, const void* A, cublasLtMatrixLayout_t Adesc,
                              const void* B, cublasLtMatrixLayout_t Bdesc, const void* beta,
                              const void* C, cublasLtMatrixLayout_t Cdesc, void* D,
                              cublasLtMatrixLayout_t Ddesc, const cublasLtMatmulAlgo_t* algo,
                              void* workspace, size_t workspaceSizeInBytes, cudaStream_t stream) {
  const char* fn = "cublasLtMatmul";
  if (lightHandle == nullptr)
    return refuse(CUBLAS_STATUS_NOT_INITIALIZED, fn, "the handle is NULL");
  if (alpha == nullptr || beta == nullptr)
    return refuse(CUBLAS_STATUS_INVALID_VALUE, fn, "alpha or beta is NULL");
  Problem p{};
  if (const cublasStatus_t st = check_problem(fn, computeDesc, Adesc, Bdesc, Cdesc, Ddesc, &p);
      st != CUBLAS_STATUS_SUCCESS)
    return st;

  // Without an algorithm the library runs its own heuristic with the pointers in view, so only
  // element alignment is required then.
  AlgoInfo info{p.ab, p.cd, p.trans_a, p.trans_b, {1, 1, 1, 1}, 0};
  if (algo != nullptr) {
    if (!decode_algo(*algo, &info))
      return refuse(CUBLAS_STATUS_INVALID_VALUE, fn,
                    "algo is not one cublasLtMatmulAlgoGetHeuristic returned (uninitialized or "
                    "overwritten?)");
    if (info.ab != p.ab || info.cd != p.cd || info.trans_a != p.trans_a ||
        info.trans_b != p.trans_b)
      return refuse(CUBLAS_STATUS_INVALID_VALUE, fn,
                    "algo was chosen for other dtypes or transposes than this call's");
  }
  if (workspaceSizeInBytes < info.workspace)
    return refuse(CUBLAS_STATUS_INVALID_VALUE, fn, "the workspace is smaller than algo needs");

  const int device = cuda_emu::stream_device(stream);
  if (device < 0) return refuse(CUBLAS_STATUS_INVALID_VALUE, fn, "the stream is not a live stream");
  if (cuda_emu::sticky_error(device) != cudaSuccess)
    return refuse(CUBLAS_STATUS_EXECUTION_FAILED, fn,
                  "cuda:" + std::to_string(device) + " has a sticky error from an earlier fault");

  Job job{};
  job.p = p;
  std::memcpy(&job.alpha, alpha, sizeof job.alpha);  // host pointers, read now
  std::memcpy(&job.beta, beta, sizeof job.beta);
  job.a = A;
  job.b = B;
  job.c = C;
  job.d = D;
  job.a_bytes = span_bytes(Adesc->rows, Adesc->cols, p.lda, p.ab);
  job.b_bytes = span_bytes(Bdesc->rows, Bdesc->cols, p.ldb, p.ab);
  job.c_bytes = span_bytes(p.m, p.n, p.ldc, p.cd);
  job.d_bytes = span_bytes(p.m, p.n, p.ldd, p.cd);

  // C is not read when beta == 0; it may then be NULL, but a pointer given is still checked.
  const bool use_c = job.beta != 0.0f || C != nullptr;
  struct Operand {
    const char* name;
    const void* ptr;
    uint64_t bytes;
    uint32_t align;
    cudaDataType_t type;
    bool used;
  };
  const Operand operands[4] = {{"A", A, job.a_bytes, info.align[0], p.ab, true},
                               {"B", B, job.b_bytes, info.align[1], p.ab, true},
                               {"C", C, job.c_bytes, info.align[2], p.cd, use_c},
                               {"D", D, job.d_bytes, info.align[3], p.cd, true}};
  for (const Operand& o : operands) {
    if (!o.used) continue;
    const std::string name = std::string("matrix ") + o.name;
    if (o.bytes == 0) return refuse(CUBLAS_STATUS_INVALID_VALUE, fn, name + ": size overflows");
    int on = -1;
    if (o.ptr == nullptr || !cuda_emu::device_range(o.ptr, o.bytes, &on))
      return refuse(CUBLAS_STATUS_INVALID_VALUE, fn,
                    name + " (" + std::to_string(o.bytes) +
                        " bytes) is not inside one live device allocation");
    if (on != device)
      return refuse(CUBLAS_STATUS_INVALID_VALUE, fn,
                    name + " is on cuda:" + std::to_string(on) +
                        ", the stream on cuda:" + std::to_string(device));
    const auto addr = reinterpret_cast<uintptr_t>(o.ptr);
    if (addr % element_bytes(o.type) != 0)
      return refuse(CUBLAS_STATUS_INVALID_VALUE, fn, name + " is not aligned to its element");
    if (o.align > 1 && addr % o.align != 0)
      return refuse(CUBLAS_STATUS_INVALID_VALUE, fn,
                    name + " is not " + std::to_string(o.align) +
                        "-byte aligned, as the preference the algorithm was chosen with promised");
  }
  if (overlap(D, job.d_bytes, A, job.a_bytes) || overlap(D, job.d_bytes, B, job.b_bytes))
    return refuse(CUBLAS_STATUS_INVALID_VALUE, fn, "D overlaps A or B");
  if (use_c && C != D && overlap(C, job.c_bytes, D, job.d_bytes))
    return refuse(CUBLAS_STATUS_INVALID_VALUE, fn, "C overlaps D without being D");
  if (use_c && C == D && p.ldc != p.ldd)
    return refuse(CUBLAS_STATUS_INVALID_VALUE, fn, "in place (C == D) with different layouts");
  if (workspaceSizeInBytes > 0) {
    int on = -1;
    if (workspace == nullptr || !cuda_emu::device_range(workspace, workspaceSizeInBytes, &on) ||
        on != device)
      return refuse(CUBLAS_STATUS_INVALID_VALUE, fn,
                    "the workspace (" + std::to_string(workspaceSizeInBytes) +
                        " bytes) is not inside one live allocation on the stream's device");
  }

  cuda_emu::enqueue(stream, [job] { run_job(job); });
  return CUBLAS_STATUS_SUCCESS;
}

}  // extern "C"
