// cuda_kernels.cpp: Kernels for one GPU: checks, then launches (ops.h) or cuBLASLt (matmul.h).
//
// Every op runs, in this order: the shared shape checks (core/kernels.cpp, and host/ops.h's for
// the ops that take several: the same calls as the host backend), the CUDA backend's own limits (no
// f16 but for the optimizer's gradient and copy; attention's head_dim, grid and shared memory), the
// arena check of every pointer, then it makes the GPU current and queues its work on the stream.
// Nothing is queued when a check fails. Empty tensors queue nothing.
#include "gpu/cuda_kernels.h"

#include "core/device.h"
#include "core/error.h"
#include "core/log.h"
#include "cpu_adam/kernels.h"
#include "gpu/cuda_check.h"
#include "gpu/matmul.h"
#include "gpu/ops.h"
#include "host/ops.h"

#include <initializer_list>
#include <mutex>

namespace strata {
namespace {

class CudaKernels final : public Kernels {
 public:
  explicit CudaKernels(const CudaDeviceAccess& device)
      : device_(device), name_(device.device_name()), matmul_(device.device_name()) {}

  void prepare(Stream& s) override { (void)device_.workspace(s); }
  void matmul(const TensorView& c, const TensorView& a, bool trans_a, const TensorView& b,
              bool trans_b, float alpha, float beta, Stream& s) override;
  void embedding_forward(const TensorView& out, const TensorView& table, const int32_t* ids,
                         float scale, const TableRows& piece, Stream& s) override;
  void embedding_backward(const TensorView& dtable, const TensorView& dout, const int32_t* ids,
                          float scale, const TableRows& piece, Stream& s) override;
  void rmsnorm_forward(const TensorView& y, const TensorView& rstd_stats, const TensorView& x,
                       const TensorView& w, float eps, float weight_offset, Stream& s) override;
  void rmsnorm_backward(const TensorView& dx, const TensorView& dw, const TensorView& dy,
                        const TensorView& x, const TensorView& w, const TensorView& rstd_stats,
                        float weight_offset, Stream& s) override;
  void rope(const TensorView& x, const TensorView& cos_sin, int64_t seq_len, bool inverse,
            Stream& s) override;
  void attention_forward(const TensorView& out, const TensorView& lse_stats, const TensorView& q,
                         const TensorView& k, const TensorView& v, AttentionMask mask,
                         Stream& s) override;
  void attention_backward(const TensorView& dq, const TensorView& dk, const TensorView& dv,
                          const TensorView& dout, const TensorView& q, const TensorView& k,
                          const TensorView& v, const TensorView& out, const TensorView& lse_stats,
                          AttentionMask mask, Stream& s) override;
  void glu_forward(const TensorView& h, const TensorView& gate, const TensorView& up,
                   Activation act, Stream& s) override;
  void glu_backward(const TensorView& dgate, const TensorView& dup, const TensorView& dh,
                    const TensorView& gate, const TensorView& up, Activation act,
                    Stream& s) override;
  void add(const TensorView& out, const TensorView& a, const TensorView& b, Stream& s) override;
  void fill(const TensorView& x, float value, Stream& s) override;
  void softcap(const TensorView& x, float cap, Stream& s) override;
  void broadcast_rows(const TensorView& y, const TensorView& b, Stream& s) override;
  void bias_backward(const TensorView& db, const TensorView& dy, Stream& s) override;
  void xent_forward_chunk(const TensorView& logits, int64_t v0, const int32_t* targets,
                          const TensorView& row_max, const TensorView& row_sum,
                          const TensorView& target_logit, Stream& s) override;
  void xent_finish(const TensorView& losses, const TensorView& lse, const TensorView& row_max,
                   const TensorView& row_sum, const TensorView& target_logit,
                   const int32_t* targets, Stream& s) override;
  void xent_backward_chunk(const TensorView& logits, int64_t v0, const int32_t* targets,
                           const TensorView& lse, float scale, float softcap, Stream& s) override;
  void adam_update(const TensorView& master, const TensorView& m, const TensorView& v,
                   const TensorView& grad, const TensorView& param_copy,
                   const cpu_adam::StepConstants& k, Stream& s) override;
  void grad_chunk_sums(const TensorView& grad, double* chunk_sums, Stream& s) override;

 private:
  struct Named {
    const char* name;
    const TensorView* view;
  };
  // Float operands: f32 or bf16, in the arena.
  void operands(const char* op, std::initializer_list<Named> views) const;
  // Views of any dtype (the optimizer's take f16 too), in the arena.
  void in_arena(const char* op, std::initializer_list<Named> views) const;
  // A stats tensor (checked f32 by the shared checks) in the arena, as float*.
  float* stats(const char* op, const char* which, const TensorView& v) const;
  // `count` int32 ids or targets in the arena.
  void ids(const char* op, const char* which, const int32_t* p, int64_t count) const;
  void check_attention_limits(const char* op, const AttentionDims& d,
                              std::initializer_list<const TensorView*> views);
  uint64_t max_shared_bytes();

  const CudaDeviceAccess& device_;
  const std::string& name_;
  CublasLtMatmul matmul_;
  std::once_flag shared_once_;
  uint64_t max_shared_ = 0;
};

void CudaKernels::operands(const char* op, std::initializer_list<Named> views) const {
  for (const auto& [which, v] : views) {
    if (v->dtype == DType::f16)
      fail(
          "{}: {}: {} is {}; the CUDA kernels take f32 or bf16: convert it (Device::convert) or "
          "run on a host device",
          name_, op, which, v->str());
  }
  in_arena(op, views);
}

void CudaKernels::in_arena(const char* op, std::initializer_list<Named> views) const {
  for (const auto& [which, v] : views)
    if (v->numel() > 0) device_.check_in_arena(op, which, v->data, v->bytes());
}

float* CudaKernels::stats(const char* op, const char* which, const TensorView& v) const {
  if (v.numel() > 0) device_.check_in_arena(op, which, v.data, v.bytes());
  return static_cast<float*>(v.data);
}

void CudaKernels::ids(const char* op, const char* which, const int32_t* p, int64_t count) const {
  if (count > 0)
    device_.check_in_arena(op, which, p, static_cast<uint64_t>(count) * sizeof(int32_t));
}

uint64_t CudaKernels::max_shared_bytes() {
  std::call_once(shared_once_, [&] {
    int bytes = 0;
    CUDA_CHECK(cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                      device_.device_index()));
    max_shared_ = static_cast<uint64_t>(bytes);
  });
  return max_shared_;
}

void CudaKernels::check_attention_limits(const char* op, const AttentionDims& d,
                                         std::initializer_list<const TensorView*> views) {
  const TensorView& first = **views.begin();
  for (const TensorView* v : views)
    if (v->dtype != first.dtype)
      fail("{}: {}: {} and {} differ in dtype; the CUDA attention takes one dtype for all", name_,
           op, first.str(), v->str());
  if (d.head_dim > kAttentionMaxHeadDim)
    fail("{}: {}: head_dim {} is over the CUDA attention's limit of {}; use a host device", name_,
         op, d.head_dim, kAttentionMaxHeadDim);
  if (d.batch > kAttentionMaxGrid || d.heads > kAttentionMaxGrid)
    fail("{}: {}: batch {} or heads {} is over CUDA's grid limit of {}; split the batch", name_, op,
         d.batch, d.heads, kAttentionMaxGrid);
  if (d.head_dim > 0 && attention_shared_bytes_min(d.head_dim) > max_shared_bytes())
    fail(
        "{}: {}: head_dim {} needs {} bytes of shared memory per block, the GPU allows {}; use a "
        "smaller head_dim or a host device",
        name_, op, d.head_dim, attention_shared_bytes_min(d.head_dim), max_shared_bytes());
}

void CudaKernels::matmul(const TensorView& c, const TensorView& a, bool trans_a,
                         const TensorView& b, bool trans_b, float alpha, float beta, Stream& s) {
  const MatmulDims d = check_matmul(c, a, trans_a, b, trans_b);
  operands("matmul", {{"c", &c}, {"a", &a}, {"b", &b}});
  const cudaStream_t stream = device_.enter(s);
  if (d.m == 0 || d.n == 0) return;
  if (d.k == 0) {  // an empty sum: c = beta * c (cuBLASLt does not take k == 0)
    launch_scale(c.data, c.dtype, beta, d.m * d.n, stream);
    return;
  }
  matmul_.run(d, c.data, c.dtype, a.data, trans_a, b.data, trans_b, a.dtype, alpha, beta,
              device_.workspace(s), kStreamWorkspaceBytes, stream);
}

void CudaKernels::embedding_forward(const TensorView& out, const TensorView& table,
                                    const int32_t* id, float scale, const TableRows& piece,
                                    Stream& s) {
  const RowDims d = check_embedding("embedding_forward", out, table, piece);
  operands("embedding_forward", {{"out", &out}, {"table", &table}});
  ids("embedding_forward", "ids", id, d.rows);
  const cudaStream_t stream = device_.enter(s);
  launch_embedding_forward(out.data, out.dtype, table.data, table.dtype, id, d.rows, d.cols, scale,
                           piece.first, table.shape[0], piece.zero_others, stream);
}

void CudaKernels::embedding_backward(const TensorView& dtable, const TensorView& dout,
                                     const int32_t* id, float scale, const TableRows& piece,
                                     Stream& s) {
  const RowDims d = check_embedding("embedding_backward", dout, dtable, piece);
  operands("embedding_backward", {{"dtable", &dtable}, {"dout", &dout}});
  ids("embedding_backward", "ids", id, d.rows);
  if (embedding_backward_scratch_bytes(d.rows) > kStreamWorkspaceBytes)
    fail(
        "{}: embedding_backward: {} rows need {} bytes of scratch, over the stream workspace's "
        "{}; pass fewer tokens per call (a smaller micro-batch or sequence)",
        name_, d.rows, embedding_backward_scratch_bytes(d.rows), kStreamWorkspaceBytes);
  const cudaStream_t stream = device_.enter(s);
  launch_embedding_backward(dtable.data, dtable.dtype, dout.data, dout.dtype, id, d.rows, d.cols,
                            scale, piece.first, dtable.shape[0], device_.workspace(s), stream);
}

void CudaKernels::rmsnorm_forward(const TensorView& y, const TensorView& rstd_stats,
                                  const TensorView& x, const TensorView& w, float eps,
                                  float weight_offset, Stream& s) {
  const RowDims d = check_rmsnorm("rmsnorm_forward", y, rstd_stats, x, w);
  operands("rmsnorm_forward", {{"y", &y}, {"x", &x}, {"w", &w}});
  float* rstd = stats("rmsnorm_forward", "rstd_stats", rstd_stats);
  const cudaStream_t stream = device_.enter(s);
  launch_rmsnorm_forward(y.data, y.dtype, rstd, x.data, x.dtype, w.data, w.dtype, d.rows, d.cols,
                         eps, weight_offset, stream);
}

void CudaKernels::rmsnorm_backward(const TensorView& dx, const TensorView& dw, const TensorView& dy,
                                   const TensorView& x, const TensorView& w,
                                   const TensorView& rstd_stats, float weight_offset, Stream& s) {
  const char* op = "rmsnorm_backward";
  const RowDims d = host::check_rmsnorm_backward(dx, dw, dy, x, w, rstd_stats);
  operands(op, {{"dx", &dx}, {"dw", &dw}, {"dy", &dy}, {"x", &x}, {"w", &w}});
  const float* rstd = stats(op, "rstd_stats", rstd_stats);
  if (rmsnorm_scratch_min(d.cols) > kStreamWorkspaceBytes)
    fail("{}: {}: rows of {} elements need {} bytes of scratch, over the stream workspace's {}",
         name_, op, d.cols, rmsnorm_scratch_min(d.cols), kStreamWorkspaceBytes);
  const cudaStream_t stream = device_.enter(s);
  if (d.rows == 0 || d.cols == 0) return;
  launch_rmsnorm_backward(dx.data, dx.dtype, dw.data, dw.dtype, dy.data, dy.dtype, x.data, x.dtype,
                          w.data, w.dtype, weight_offset, rstd, d.rows, d.cols,
                          static_cast<float*>(device_.workspace(s)), kStreamWorkspaceBytes, stream);
}

void CudaKernels::rope(const TensorView& x, const TensorView& cos_sin, int64_t seq_len,
                       bool inverse, Stream& s) {
  const RopeDims d = check_rope(x, cos_sin, seq_len);
  operands("rope", {{"x", &x}});
  const float* table = stats("rope", "cos_sin", cos_sin);
  const cudaStream_t stream = device_.enter(s);
  launch_rope(x.data, x.dtype, table, d.tokens, d.heads, d.head_dim, d.rotary, seq_len, inverse,
              stream);
}

void CudaKernels::attention_forward(const TensorView& out, const TensorView& lse_stats,
                                    const TensorView& q, const TensorView& k, const TensorView& v,
                                    AttentionMask mask, Stream& s) {
  const char* op = "attention_forward";
  const AttentionDims d = check_attention(op, out, lse_stats, q, k, v, mask);
  check_attention_limits(op, d, {&q, &k, &v, &out});
  operands(op, {{"out", &out}, {"q", &q}, {"k", &k}, {"v", &v}});
  float* lse = stats(op, "lse_stats", lse_stats);
  if (d.doc_start != nullptr) ids(op, "doc_start", d.doc_start, d.batch * d.seq);
  // bf16 training whose attention the tensor cores cannot take (a head_dim other than a
  // multiple of 16 up to 128 or 256, or a GPU without the shared memory for its backward): said
  // once, as it sets the step's speed.
  if (q.dtype == DType::bf16 && d.keys() == d.seq &&
      !attention_backward_on_tensor_cores(d, max_shared_bytes()) &&
      first_time("attention on the SIMT path"))
    log_info(
        "{}: attention at head_dim {}{} runs the f32 SIMT kernels (the tensor-core ones take "
        "head_dim a multiple of 16 up to 128, and 256, where the GPU's shared memory per block "
        "holds their tiles): slower per FLOP",
        name_, d.head_dim, d.plain_scores() ? "" : " with scaled or capped scores");
  const cudaStream_t stream = device_.enter(s);
  launch_attention_forward(out.data, lse, q.data, k.data, v.data, q.dtype, d, max_shared_bytes(),
                           stream);
}

void CudaKernels::attention_backward(const TensorView& dq, const TensorView& dk,
                                     const TensorView& dv, const TensorView& dout,
                                     const TensorView& q, const TensorView& k, const TensorView& v,
                                     const TensorView& out, const TensorView& lse_stats,
                                     AttentionMask mask, Stream& s) {
  const char* op = "attention_backward";
  const AttentionDims d =
      host::check_attention_backward(dq, dk, dv, dout, q, k, v, out, lse_stats, mask);
  check_attention_limits(op, d, {&q, &k, &v, &out, &dq, &dk, &dv, &dout});
  operands(op, {{"dq", &dq},
                {"dk", &dk},
                {"dv", &dv},
                {"dout", &dout},
                {"q", &q},
                {"k", &k},
                {"v", &v},
                {"out", &out}});
  const float* lse = stats(op, "lse_stats", lse_stats);
  if (d.doc_start != nullptr) ids(op, "doc_start", d.doc_start, d.batch * d.seq);
  const cudaStream_t stream = device_.enter(s);
  launch_attention_backward(dq.data, dk.data, dv.data, dout.data, q.data, k.data, v.data, out.data,
                            lse, q.dtype, d, max_shared_bytes(), stream);
}

void CudaKernels::glu_forward(const TensorView& h, const TensorView& gate, const TensorView& up,
                              Activation act, Stream& s) {
  const int64_t n = check_same_shape("glu_forward", {&h, &gate, &up});
  operands("glu_forward", {{"h", &h}, {"gate", &gate}, {"up", &up}});
  const cudaStream_t stream = device_.enter(s);
  launch_glu_forward(h.data, h.dtype, gate.data, gate.dtype, up.data, up.dtype, n, act, stream);
}

void CudaKernels::glu_backward(const TensorView& dgate, const TensorView& dup, const TensorView& dh,
                               const TensorView& gate, const TensorView& up, Activation act,
                               Stream& s) {
  const char* op = "glu_backward";
  const int64_t n = host::check_glu_backward(dgate, dup, dh, gate, up);
  operands(op, {{"dgate", &dgate}, {"dup", &dup}, {"dh", &dh}, {"gate", &gate}, {"up", &up}});
  const cudaStream_t stream = device_.enter(s);
  launch_glu_backward(dgate.data, dgate.dtype, dup.data, dup.dtype, dh.data, dh.dtype, gate.data,
                      gate.dtype, up.data, up.dtype, n, act, stream);
}

void CudaKernels::add(const TensorView& out, const TensorView& a, const TensorView& b, Stream& s) {
  const int64_t n = check_same_shape("add", {&out, &a, &b});
  operands("add", {{"out", &out}, {"a", &a}, {"b", &b}});
  const cudaStream_t stream = device_.enter(s);
  launch_add(out.data, out.dtype, a.data, a.dtype, b.data, b.dtype, n, stream);
}

void CudaKernels::fill(const TensorView& x, float value, Stream& s) {
  operands("fill", {{"x", &x}});
  const cudaStream_t stream = device_.enter(s);
  launch_fill(x.data, x.dtype, value, x.numel(), stream);
}

void CudaKernels::softcap(const TensorView& x, float cap, Stream& s) {
  check_same_shape("softcap", {&x});
  check_softcap("softcap", cap, false);
  operands("softcap", {{"x", &x}});
  const cudaStream_t stream = device_.enter(s);
  launch_softcap(x.data, x.dtype, cap, x.numel(), stream);
}

void CudaKernels::broadcast_rows(const TensorView& y, const TensorView& b, Stream& s) {
  const RowDims d = check_bias("broadcast_rows", y, b);
  operands("broadcast_rows", {{"y", &y}, {"b", &b}});
  const cudaStream_t stream = device_.enter(s);
  launch_broadcast_rows(y.data, y.dtype, b.data, d.rows, d.cols, stream);
}

void CudaKernels::bias_backward(const TensorView& db, const TensorView& dy, Stream& s) {
  const RowDims d = check_bias("bias_backward", dy, db);
  operands("bias_backward", {{"db", &db}, {"dy", &dy}});
  const cudaStream_t stream = device_.enter(s);
  launch_bias_backward(db.data, db.dtype, dy.data, dy.dtype, d.rows, d.cols, stream);
}

void CudaKernels::xent_forward_chunk(const TensorView& logits, int64_t v0, const int32_t* targets,
                                     const TensorView& row_max, const TensorView& row_sum,
                                     const TensorView& target_logit, Stream& s) {
  const char* op = "xent_forward_chunk";
  const XentDims d = check_xent(op, logits, {&row_max, &row_sum, &target_logit});
  check_chunk_start(op, v0);
  operands(op, {{"logits", &logits}});
  float* max = stats(op, "row_max", row_max);
  float* sum = stats(op, "row_sum", row_sum);
  float* target = stats(op, "target_logit", target_logit);
  ids(op, "targets", targets, d.rows);
  const cudaStream_t stream = device_.enter(s);
  launch_xent_forward_chunk(logits.data, logits.dtype, d.rows, d.chunk, v0, targets, max, sum,
                            target, stream);
}

void CudaKernels::xent_finish(const TensorView& losses, const TensorView& lse,
                              const TensorView& row_max, const TensorView& row_sum,
                              const TensorView& target_logit, const int32_t* targets, Stream& s) {
  const char* op = "xent_finish";
  const int64_t rows = host::check_xent_finish(losses, lse, row_max, row_sum, target_logit).rows;
  float* loss = stats(op, "losses", losses);
  float* l = stats(op, "lse", lse);
  const float* max = stats(op, "row_max", row_max);
  const float* sum = stats(op, "row_sum", row_sum);
  const float* target = stats(op, "target_logit", target_logit);
  ids(op, "targets", targets, rows);
  const cudaStream_t stream = device_.enter(s);
  launch_xent_finish(loss, l, max, sum, target, targets, rows, stream);
}

void CudaKernels::xent_backward_chunk(const TensorView& logits, int64_t v0, const int32_t* targets,
                                      const TensorView& lse, float scale, float softcap,
                                      Stream& s) {
  const char* op = "xent_backward_chunk";
  const XentDims d = check_xent(op, logits, {&lse});
  check_chunk_start(op, v0);
  check_softcap(op, softcap, true);
  operands(op, {{"logits", &logits}});
  const float* l = stats(op, "lse", lse);
  ids(op, "targets", targets, d.rows);
  const cudaStream_t stream = device_.enter(s);
  launch_xent_backward_chunk(logits.data, logits.dtype, d.rows, d.chunk, v0, targets, l, scale,
                             softcap, stream);
}

void CudaKernels::adam_update(const TensorView& master, const TensorView& m, const TensorView& v,
                              const TensorView& grad, const TensorView& param_copy,
                              const cpu_adam::StepConstants& k, Stream& s) {
  const char* op = "adam_update";
  const int64_t n = check_adam_update(master, m, v, grad, param_copy, k.type);
  in_arena(op, {{"master", &master}, {"grad", &grad}});
  if (optimizer_keeps_m(k.type)) in_arena(op, {{"m", &m}});
  if (optimizer_keeps_v(k.type)) in_arena(op, {{"v", &v}});
  const bool copy = param_copy.data != nullptr;
  if (copy) in_arena(op, {{"param_copy", &param_copy}});
  const cudaStream_t stream = device_.enter(s);
  launch_adam_update(static_cast<float*>(master.data), static_cast<float*>(m.data),
                     static_cast<float*>(v.data), grad.data, grad.dtype,
                     copy ? param_copy.data : nullptr, param_copy.dtype, k, n, stream);
}

void CudaKernels::grad_chunk_sums(const TensorView& grad, double* chunk_sums, Stream& s) {
  const char* op = "grad_chunk_sums";
  const int64_t chunks = check_grad_chunk_sums(grad, chunk_sums);
  in_arena(op, {{"grad", &grad}});
  if (reinterpret_cast<uintptr_t>(chunk_sums) % alignof(double) != 0)
    fail(
        "{}: chunk_sums {} is not aligned to {} bytes; pass memory from the device's arena as "
        "allocated (every allocation is aligned)",
        op, static_cast<const void*>(chunk_sums), alignof(double));
  if (chunks > 0)
    device_.check_in_arena(op, "chunk_sums", chunk_sums,
                           static_cast<uint64_t>(chunks) * sizeof(double));
  const cudaStream_t stream = device_.enter(s);
  launch_grad_chunk_sums(grad.data, grad.dtype, grad.numel(), chunk_sums, stream);
}

}  // namespace

std::unique_ptr<Kernels> make_cuda_kernels(const CudaDeviceAccess& device) {
  return std::make_unique<CudaKernels>(device);
}

}  // namespace strata
