// ops.h: the host backend's reference ops, one per op of the kernel table (core/kernels.h,
// which gives each op's exact semantics).
//
// These are the oracle every CUDA kernel is tested against, so they favour being plainly
// right over being fast: arithmetic in f32, long sums (means of squares, softmax sums,
// attention outputs and gradients) in double, 64-bit indexing. Each function is synchronous,
// takes views of ordinary host memory (a view's `device` is ignored), runs the op's shape
// checks first and throws Error on a mismatch or on an id out of range. Rows are spread over
// oneTBB threads, but every sum runs in a fixed order: results do not depend on thread count.
// Matmuls go through OpenBLAS's cblas_sgemm, one call per fixed block of C's columns, spread
// over oneTBB like the rest (OpenBLAS's own threads are off); 16-bit operands are converted to
// f32 first.
#pragma once

#include "core/kernels.h"
#include "core/tensor.h"

#include <cstdint>

namespace strata::host {

void matmul(const TensorView& c, const TensorView& a, bool trans_a, const TensorView& b,
            bool trans_b, float alpha, float beta);

// ids: out.shape[0] (or dout.shape[0]) int32 ids, each in [0, table rows).
// scale and weight_offset: the kernel table's (Gemma's), 1 and 0 for every other model.
// piece: the ids the table holds (Kernels::TableRows); ids lie in [0, its vocabulary).
void embedding_forward(const TensorView& out, const TensorView& table, const int32_t* ids,
                       float scale = 1.0f, const TableRows& piece = {});
void embedding_backward(const TensorView& dtable, const TensorView& dout, const int32_t* ids,
                        float scale = 1.0f, const TableRows& piece = {});

void rmsnorm_forward(const TensorView& y, const TensorView& rstd_stats, const TensorView& x,
                     const TensorView& w, float eps, float weight_offset = 0.0f);
void rmsnorm_backward(const TensorView& dx, const TensorView& dw, const TensorView& dy,
                      const TensorView& x, const TensorView& w, const TensorView& rstd_stats,
                      float weight_offset = 0.0f);

void rope(const TensorView& x, const TensorView& cos_sin, int64_t seq_len, bool inverse);

// mask: Kernels::attention_forward's (its doc_start in host memory), or none.
void attention_forward(const TensorView& out, const TensorView& lse_stats, const TensorView& q,
                       const TensorView& k, const TensorView& v, AttentionMask mask = {});
void attention_backward(const TensorView& dq, const TensorView& dk, const TensorView& dv,
                        const TensorView& dout, const TensorView& q, const TensorView& k,
                        const TensorView& v, const TensorView& out, const TensorView& lse_stats,
                        AttentionMask mask = {});

void glu_forward(const TensorView& h, const TensorView& gate, const TensorView& up,
                 Activation act = Activation::silu);
void glu_backward(const TensorView& dgate, const TensorView& dup, const TensorView& dh,
                  const TensorView& gate, const TensorView& up, Activation act = Activation::silu);

void add(const TensorView& out, const TensorView& a, const TensorView& b);
void fill(const TensorView& x, float value);
void softcap(const TensorView& x, float cap);

void broadcast_rows(const TensorView& y, const TensorView& b);
void bias_backward(const TensorView& db, const TensorView& dy);

// targets: logits.shape[0] int32 ids, each >= 0 or kIgnoreIndex.
void xent_forward_chunk(const TensorView& logits, int64_t v0, const int32_t* targets,
                        const TensorView& row_max, const TensorView& row_sum,
                        const TensorView& target_logit);
void xent_finish(const TensorView& losses, const TensorView& lse, const TensorView& row_max,
                 const TensorView& row_sum, const TensorView& target_logit, const int32_t* targets);
void xent_backward_chunk(const TensorView& logits, int64_t v0, const int32_t* targets,
                         const TensorView& lse, float scale, float softcap = 0.0f);

// The optimizer's ops (host/optimizer.cpp): CpuAdam's scalar path (cpu_adam/kernels_scalar.cpp)
// over the same spans and chunks, so the bits are CpuAdam::update's and grad_stats' own.
// chunk_sums: check_grad_chunk_sums(grad, chunk_sums) doubles.
void adam_update(const TensorView& master, const TensorView& m, const TensorView& v,
                 const TensorView& grad, const TensorView& param_copy,
                 const cpu_adam::StepConstants& k);
void grad_chunk_sums(const TensorView& grad, double* chunk_sums);

// The full shape checks of the ops that take more than one check_* call (core/kernels.h),
// shared with the host kernel table, which runs them when an op is queued.
RowDims check_rmsnorm_backward(const TensorView& dx, const TensorView& dw, const TensorView& dy,
                               const TensorView& x, const TensorView& w,
                               const TensorView& rstd_stats);
AttentionDims check_attention_backward(const TensorView& dq, const TensorView& dk,
                                       const TensorView& dv, const TensorView& dout,
                                       const TensorView& q, const TensorView& k,
                                       const TensorView& v, const TensorView& out,
                                       const TensorView& lse_stats, AttentionMask mask = {});
int64_t check_glu_backward(const TensorView& dgate, const TensorView& dup, const TensorView& dh,
                           const TensorView& gate, const TensorView& up);
XentDims check_xent_finish(const TensorView& losses, const TensorView& lse,
                           const TensorView& row_max, const TensorView& row_sum,
                           const TensorView& target_logit);

}  // namespace strata::host
