// matmul.cpp: Kernels::matmul through cuBLASLt (see matmul.h for the row-major mapping).
//
// Host code only (fmt is fine here). A plan (descriptors + the heuristic's best algorithm) is
// built once per Key under the mutex and never freed until the device goes, so run() can use
// it after dropping the lock. The alignment preferences are the pointers' real alignments (up
// to 256 bytes), so the algorithm chosen never assumes more than a view into the arena gives.
#include "gpu/matmul.h"

#include "gpu/cublaslt.h"

#include "core/error.h"
#include "core/log.h"

#include <string_view>
#include <utility>

namespace strata {
namespace {

const char* cublas_hint(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_ALLOC_FAILED:
      return "leave GPU memory outside the arena for cuBLASLt (pass a smaller --device-memory)";
    case CUBLAS_STATUS_ARCH_MISMATCH:
      return "strata's CUDA backend needs an sm_80 (Ampere) or newer GPU";
    case CUBLAS_STATUS_NOT_INITIALIZED:
    case CUBLAS_STATUS_EXECUTION_FAILED:
      return "check the GPU and driver with nvidia-smi, and rerun under compute-sanitizer";
    default:
      return "this is a bug in strata's cuBLASLt call: report it with the shapes above";
  }
}

// `call` is the failing call's text, "cublaslt().Name(args)": named as cuBLASLt names it.
[[noreturn]] void cublas_fail(const std::string& device, cublasStatus_t status, const char* call,
                              const std::string& what) {
  std::string name = call;
  if (constexpr std::string_view table = "cublaslt()."; name.starts_with(table))
    name = "cublasLt" + name.substr(table.size());
  fail("{}: matmul {}: {} failed: {} ({}); {}", device, what, name,
       cublaslt().GetStatusName(status), cublaslt().GetStatusString(status), cublas_hint(status));
}

#define CUBLASLT_CHECK(call, what)                       \
  do {                                                   \
    const cublasStatus_t strata_status_ = (call);        \
    if (strata_status_ != CUBLAS_STATUS_SUCCESS)         \
      cublas_fail(device_, strata_status_, #call, what); \
  } while (0)

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::f32:
      return CUDA_R_32F;
    case DType::bf16:
      return CUDA_R_16BF;
    case DType::f16:
      return CUDA_R_16F;
  }
  return CUDA_R_32F;
}

// The largest power of two up to 256 that divides the address.
uint32_t alignment_of(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  uint32_t align = 256;
  while (align > 1 && a % align != 0) align /= 2;
  return align;
}

// "c f32[4,6] = a bf16[5,4]^T x b bf16[5,6]": the operands as stored, for error messages.
std::string describe(int64_t m, int64_t n, int64_t k, bool trans_a, bool trans_b, DType ab,
                     DType c) {
  return fmt::format("c {}[{},{}] = a {}[{},{}]{} x b {}[{},{}]{}", dtype_name(c), m, n,
                     dtype_name(ab), trans_a ? k : m, trans_a ? m : k, trans_a ? "^T" : "",
                     dtype_name(ab), trans_b ? n : k, trans_b ? k : n, trans_b ? "^T" : "");
}

}  // namespace

struct CublasLtMatmul::Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t lt_a = nullptr, lt_b = nullptr, lt_c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  uint64_t workspace_bytes = 0;  // what the algorithm needs

  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  ~Plan() {
    // Destroying a descriptor only frees host memory: failures are not expected, and ignored.
    if (lt_c != nullptr) (void)cublaslt().MatrixLayoutDestroy(lt_c);
    if (lt_b != nullptr) (void)cublaslt().MatrixLayoutDestroy(lt_b);
    if (lt_a != nullptr) (void)cublaslt().MatrixLayoutDestroy(lt_a);
    if (desc != nullptr) (void)cublaslt().MatmulDescDestroy(desc);
  }
};

CublasLtMatmul::CublasLtMatmul(std::string device) : device_(std::move(device)) {}

CublasLtMatmul::~CublasLtMatmul() {
  plans_.clear();
  if (handle_ != nullptr) {
    if (const cublasStatus_t st = cublaslt().Destroy(handle_); st != CUBLAS_STATUS_SUCCESS)
      log_error("{}: cublasLtDestroy failed: {} ({})", device_, cublaslt().GetStatusName(st),
                cublaslt().GetStatusString(st));
  }
}

const CublasLtMatmul::Plan& CublasLtMatmul::plan(const Key& key) {
  std::lock_guard lock(mutex_);
  if (auto it = plans_.find(key); it != plans_.end()) return *it->second;

  const auto [m, n, k, trans_a, trans_b, ab_type, c_type, align_a, align_b, align_c,
              workspace_bytes] = key;
  const std::string what = describe(m, n, k, trans_a, trans_b, ab_type, c_type);
  if (handle_ == nullptr) CUBLASLT_CHECK(cublaslt().Create(&handle_), what);

  auto p = std::make_unique<Plan>();
  CUBLASLT_CHECK(cublaslt().MatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), what);
  // cuBLASLt's A is our b, its B our a (column-major view of row-major storage).
  const cublasOperation_t op_a = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  CUBLASLT_CHECK(
      cublaslt().MatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof op_a),
      what);
  CUBLASLT_CHECK(
      cublaslt().MatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof op_b),
      what);
  // A row-major [rows, cols] matrix is column-major [cols, rows] with leading dimension cols.
  const int64_t b_rows = trans_b ? n : k, b_cols = trans_b ? k : n;
  const int64_t a_rows = trans_a ? k : m, a_cols = trans_a ? m : k;
  CUBLASLT_CHECK(
      cublaslt().MatrixLayoutCreate(&p->lt_a, cuda_type(ab_type), static_cast<uint64_t>(b_cols),
                                    static_cast<uint64_t>(b_rows), b_cols),
      what);
  CUBLASLT_CHECK(
      cublaslt().MatrixLayoutCreate(&p->lt_b, cuda_type(ab_type), static_cast<uint64_t>(a_cols),
                                    static_cast<uint64_t>(a_rows), a_cols),
      what);
  CUBLASLT_CHECK(
      cublaslt().MatrixLayoutCreate(&p->lt_c, cuda_type(c_type), static_cast<uint64_t>(n),
                                    static_cast<uint64_t>(m), n),
      what);

  cublasLtMatmulPreference_t pref = nullptr;
  CUBLASLT_CHECK(cublaslt().MatmulPreferenceCreate(&pref), what);
  struct PrefGuard {
    cublasLtMatmulPreference_t p;
    ~PrefGuard() { (void)cublaslt().MatmulPreferenceDestroy(p); }
  } guard{pref};
  const uint64_t max_ws = workspace_bytes;
  CUBLASLT_CHECK(cublaslt().MatmulPreferenceSetAttribute(
                     pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &max_ws, sizeof max_ws),
                 what);
  // cuBLASLt's A is b and its B is a; C and D are both c.
  const uint32_t aligns[4] = {align_b, align_a, align_c, align_c};
  const cublasLtMatmulPreferenceAttributes_t align_attrs[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 4; ++i)
    CUBLASLT_CHECK(
        cublaslt().MatmulPreferenceSetAttribute(pref, align_attrs[i], &aligns[i], sizeof aligns[i]),
        what);

  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t st = cublaslt().MatmulAlgoGetHeuristic(
      handle_, p->desc, p->lt_a, p->lt_b, p->lt_c, p->lt_c, pref, 1, &result, &found);
  if (st == CUBLAS_STATUS_NOT_SUPPORTED || (st == CUBLAS_STATUS_SUCCESS && found == 0))
    fail(
        "{}: matmul {}: cuBLASLt has no algorithm for these dtypes, shapes and alignments "
        "(a {} B, b {} B, c {} B aligned, workspace {} B); use f32 or bf16 operands with c "
        "of their dtype or f32",
        device_, what, align_a, align_b, align_c, workspace_bytes);
  CUBLASLT_CHECK(st, what);
  p->algo = result.algo;
  p->workspace_bytes = result.workspaceSize;
  return *plans_.emplace(key, std::move(p)).first->second;
}

void CublasLtMatmul::run(const MatmulDims& dims, void* c, DType c_type, const void* a, bool trans_a,
                         const void* b, bool trans_b, DType ab_type, float alpha, float beta,
                         void* workspace, uint64_t workspace_bytes, cudaStream_t stream) {
  const Key key{dims.m, dims.n,          dims.k,          trans_a,         trans_b,        ab_type,
                c_type, alignment_of(a), alignment_of(b), alignment_of(c), workspace_bytes};
  const Plan& p = plan(key);
  // alpha and beta are host scalars (the default pointer mode), read before this returns.
  CUBLASLT_CHECK(cublaslt().Matmul(handle_, p.desc, &alpha, b, p.lt_a, a, p.lt_b, &beta, c, p.lt_c,
                                   c, p.lt_c, &p.algo, workspace, p.workspace_bytes, stream),
                 describe(dims.m, dims.n, dims.k, trans_a, trans_b, ab_type, c_type));
}

}  // namespace strata
