// host_kernels.cpp: the host kernel table: checks now, the reference op later in stream order.
#include "host/host_kernels.h"

#include "core/error.h"
#include "cpu_adam/kernels.h"
#include "host/ops.h"

#include <initializer_list>
#include <utility>

namespace strata::host {
namespace {

struct Named {
  const char* name;
  const TensorView* view;
};

class HostKernels final : public Kernels {
 public:
  explicit HostKernels(KernelQueue queue) : q_(std::move(queue)) {}

  void matmul(const TensorView& c, const TensorView& a, bool trans_a, const TensorView& b,
              bool trans_b, float alpha, float beta, Stream& s) override {
    check_matmul(c, a, trans_a, b, trans_b);
    in_memory("matmul", {{"c", &c}, {"a", &a}, {"b", &b}});
    q_.enqueue(s, [=] { host::matmul(c, a, trans_a, b, trans_b, alpha, beta); });
  }

  void embedding_forward(const TensorView& out, const TensorView& table, const int32_t* ids,
                         float scale, const TableRows& piece, Stream& s) override {
    const char* op = "embedding_forward";
    const RowDims d = check_embedding(op, out, table, piece);
    in_memory(op, {{"out", &out}, {"table", &table}});
    ids_in_memory(op, "ids", ids, d.rows);
    q_.enqueue(s, [=] { host::embedding_forward(out, table, ids, scale, piece); });
  }

  void embedding_backward(const TensorView& dtable, const TensorView& dout, const int32_t* ids,
                          float scale, const TableRows& piece, Stream& s) override {
    const char* op = "embedding_backward";
    const RowDims d = check_embedding(op, dout, dtable, piece);
    in_memory(op, {{"dtable", &dtable}, {"dout", &dout}});
    ids_in_memory(op, "ids", ids, d.rows);
    q_.enqueue(s, [=] { host::embedding_backward(dtable, dout, ids, scale, piece); });
  }

  void rmsnorm_forward(const TensorView& y, const TensorView& rstd_stats, const TensorView& x,
                       const TensorView& w, float eps, float weight_offset, Stream& s) override {
    const char* op = "rmsnorm_forward";
    check_rmsnorm(op, y, rstd_stats, x, w);
    in_memory(op, {{"y", &y}, {"rstd_stats", &rstd_stats}, {"x", &x}, {"w", &w}});
    q_.enqueue(s, [=] { host::rmsnorm_forward(y, rstd_stats, x, w, eps, weight_offset); });
  }

  void rmsnorm_backward(const TensorView& dx, const TensorView& dw, const TensorView& dy,
                        const TensorView& x, const TensorView& w, const TensorView& rstd_stats,
                        float weight_offset, Stream& s) override {
    check_rmsnorm_backward(dx, dw, dy, x, w, rstd_stats);
    in_memory(
        "rmsnorm_backward",
        {{"dx", &dx}, {"dw", &dw}, {"dy", &dy}, {"x", &x}, {"w", &w}, {"rstd_stats", &rstd_stats}});
    q_.enqueue(s, [=] { host::rmsnorm_backward(dx, dw, dy, x, w, rstd_stats, weight_offset); });
  }

  void rope(const TensorView& x, const TensorView& cos_sin, int64_t seq_len, bool inverse,
            Stream& s) override {
    check_rope(x, cos_sin, seq_len);
    in_memory("rope", {{"x", &x}, {"cos_sin", &cos_sin}});
    q_.enqueue(s, [=] { host::rope(x, cos_sin, seq_len, inverse); });
  }

  void attention_forward(const TensorView& out, const TensorView& lse_stats, const TensorView& q,
                         const TensorView& k, const TensorView& v, AttentionMask mask,
                         Stream& s) override {
    const char* op = "attention_forward";
    const AttentionDims d = check_attention(op, out, lse_stats, q, k, v, mask);
    in_memory(op, {{"out", &out}, {"lse_stats", &lse_stats}, {"q", &q}, {"k", &k}, {"v", &v}});
    if (mask.doc_start != nullptr) ids_in_memory(op, "doc_start", mask.doc_start, d.batch * d.seq);
    q_.enqueue(s, [=] { host::attention_forward(out, lse_stats, q, k, v, mask); });
  }

  void attention_backward(const TensorView& dq, const TensorView& dk, const TensorView& dv,
                          const TensorView& dout, const TensorView& q, const TensorView& k,
                          const TensorView& v, const TensorView& out, const TensorView& lse_stats,
                          AttentionMask mask, Stream& s) override {
    const AttentionDims d =
        check_attention_backward(dq, dk, dv, dout, q, k, v, out, lse_stats, mask);
    if (mask.doc_start != nullptr)
      ids_in_memory("attention_backward", "doc_start", mask.doc_start, d.batch * d.seq);
    in_memory("attention_backward", {{"dq", &dq},
                                     {"dk", &dk},
                                     {"dv", &dv},
                                     {"dout", &dout},
                                     {"q", &q},
                                     {"k", &k},
                                     {"v", &v},
                                     {"out", &out},
                                     {"lse_stats", &lse_stats}});
    q_.enqueue(s,
               [=] { host::attention_backward(dq, dk, dv, dout, q, k, v, out, lse_stats, mask); });
  }

  void glu_forward(const TensorView& h, const TensorView& gate, const TensorView& up,
                   Activation act, Stream& s) override {
    const char* op = "glu_forward";
    check_same_shape(op, {&h, &gate, &up});
    in_memory(op, {{"h", &h}, {"gate", &gate}, {"up", &up}});
    q_.enqueue(s, [=] { host::glu_forward(h, gate, up, act); });
  }

  void glu_backward(const TensorView& dgate, const TensorView& dup, const TensorView& dh,
                    const TensorView& gate, const TensorView& up, Activation act,
                    Stream& s) override {
    check_glu_backward(dgate, dup, dh, gate, up);
    in_memory("glu_backward",
              {{"dgate", &dgate}, {"dup", &dup}, {"dh", &dh}, {"gate", &gate}, {"up", &up}});
    q_.enqueue(s, [=] { host::glu_backward(dgate, dup, dh, gate, up, act); });
  }

  void add(const TensorView& out, const TensorView& a, const TensorView& b, Stream& s) override {
    check_same_shape("add", {&out, &a, &b});
    in_memory("add", {{"out", &out}, {"a", &a}, {"b", &b}});
    q_.enqueue(s, [=] { host::add(out, a, b); });
  }

  void fill(const TensorView& x, float value, Stream& s) override {
    check_same_shape("fill", {&x});
    in_memory("fill", {{"x", &x}});
    q_.enqueue(s, [=] { host::fill(x, value); });
  }

  void softcap(const TensorView& x, float cap, Stream& s) override {
    check_same_shape("softcap", {&x});
    check_softcap("softcap", cap, false);
    in_memory("softcap", {{"x", &x}});
    q_.enqueue(s, [=] { host::softcap(x, cap); });
  }

  void broadcast_rows(const TensorView& y, const TensorView& b, Stream& s) override {
    check_bias("broadcast_rows", y, b);
    in_memory("broadcast_rows", {{"y", &y}, {"b", &b}});
    q_.enqueue(s, [=] { host::broadcast_rows(y, b); });
  }

  void bias_backward(const TensorView& db, const TensorView& dy, Stream& s) override {
    check_bias("bias_backward", dy, db);
    in_memory("bias_backward", {{"db", &db}, {"dy", &dy}});
    q_.enqueue(s, [=] { host::bias_backward(db, dy); });
  }

  void xent_forward_chunk(const TensorView& logits, int64_t v0, const int32_t* targets,
                          const TensorView& row_max, const TensorView& row_sum,
                          const TensorView& target_logit, Stream& s) override {
    const char* op = "xent_forward_chunk";
    const XentDims d = check_xent(op, logits, {&row_max, &row_sum, &target_logit});
    check_chunk_start(op, v0);
    in_memory(op, {{"logits", &logits},
                   {"row_max", &row_max},
                   {"row_sum", &row_sum},
                   {"target_logit", &target_logit}});
    ids_in_memory(op, "targets", targets, d.rows);
    q_.enqueue(
        s, [=] { host::xent_forward_chunk(logits, v0, targets, row_max, row_sum, target_logit); });
  }

  void xent_finish(const TensorView& losses, const TensorView& lse, const TensorView& row_max,
                   const TensorView& row_sum, const TensorView& target_logit,
                   const int32_t* targets, Stream& s) override {
    const char* op = "xent_finish";
    const XentDims d = check_xent_finish(losses, lse, row_max, row_sum, target_logit);
    in_memory(op, {{"losses", &losses},
                   {"lse", &lse},
                   {"row_max", &row_max},
                   {"row_sum", &row_sum},
                   {"target_logit", &target_logit}});
    ids_in_memory(op, "targets", targets, d.rows);
    q_.enqueue(s, [=] { host::xent_finish(losses, lse, row_max, row_sum, target_logit, targets); });
  }

  void xent_backward_chunk(const TensorView& logits, int64_t v0, const int32_t* targets,
                           const TensorView& lse, float scale, float softcap, Stream& s) override {
    const char* op = "xent_backward_chunk";
    const XentDims d = check_xent(op, logits, {&lse});
    check_chunk_start(op, v0);
    check_softcap(op, softcap, true);
    in_memory(op, {{"logits", &logits}, {"lse", &lse}});
    ids_in_memory(op, "targets", targets, d.rows);
    q_.enqueue(s, [=] { host::xent_backward_chunk(logits, v0, targets, lse, scale, softcap); });
  }

  void adam_update(const TensorView& master, const TensorView& m, const TensorView& v,
                   const TensorView& grad, const TensorView& param_copy,
                   const cpu_adam::StepConstants& k, Stream& s) override {
    check_adam_update(master, m, v, grad, param_copy, k.type);
    in_memory("adam_update", {{"master", &master}, {"grad", &grad}});
    if (optimizer_keeps_m(k.type)) in_memory("adam_update", {{"m", &m}});
    if (optimizer_keeps_v(k.type)) in_memory("adam_update", {{"v", &v}});
    if (param_copy.data != nullptr) in_memory("adam_update", {{"param_copy", &param_copy}});
    q_.enqueue(s, [=] { host::adam_update(master, m, v, grad, param_copy, k); });
  }

  void grad_chunk_sums(const TensorView& grad, double* chunk_sums, Stream& s) override {
    const char* op = "grad_chunk_sums";
    const int64_t chunks = check_grad_chunk_sums(grad, chunk_sums);
    in_memory(op, {{"grad", &grad}});
    if (chunks > 0)
      q_.check_memory(chunk_sums, static_cast<uint64_t>(chunks) * sizeof(double),
                      fmt::format("{}: chunk_sums (double[{}]) at", op, chunks));
    q_.enqueue(s, [=] { host::grad_chunk_sums(grad, chunk_sums); });
  }

 private:
  void in_memory(const char* op, std::initializer_list<Named> views) const {
    for (const Named& t : views)
      if (t.view->bytes() > 0)
        q_.check_memory(t.view->data, t.view->bytes(),
                        fmt::format("{}: tensor {} {} at", op, t.name, t.view->str()));
  }
  void ids_in_memory(const char* op, const char* name, const int32_t* ids, int64_t n) const {
    if (n > 0)
      q_.check_memory(ids, static_cast<uint64_t>(n) * sizeof(int32_t),
                      fmt::format("{}: {} (int32[{}]) at", op, name, n));
  }

  KernelQueue q_;
};

}  // namespace

std::unique_ptr<Kernels> make_kernels(KernelQueue queue) {
  return std::make_unique<HostKernels>(std::move(queue));
}

}  // namespace strata::host
