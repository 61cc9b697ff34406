// ops.h: launchers for the model's CUDA kernels; core/kernels.h gives each op's semantics.
//
// Each launcher takes raw device pointers, sizes and dtypes, and queues its kernels on
// `stream` with the stream's device current. The caller (cuda_kernels.cpp) has already run
// the shared shape checks, checked that every pointer lies in the device's arena, and
// rejected f16: every dtype here is f32 or bf16, but for optimizer.cu's gradients and copies,
// which may be f16 too. Stats tensors are f32. A launch error throws
// strata::Error (CUDA_CHECK_LAUNCH). Included by .cu files: no fmt here.
#pragma once

#include "core/dtype.h"
#include "core/kernels.h"
#include "gpu/attention_kernels.h"

#include <cuda_runtime_api.h>

#include <cstdint>

namespace strata {

// ---- embedding.cu ----
// scale: Kernels::embedding_forward's (Gemma's sqrt(hidden_size); 1 copies the rows). The table
// holds the ids [first, first + table_rows) (TableRows).
void launch_embedding_forward(void* out, DType out_t, const void* table, DType table_t,
                              const int32_t* ids, int64_t rows, int64_t dim, float scale,
                              int64_t first, int64_t table_rows, bool zero_others,
                              cudaStream_t stream);
// Deterministic: rows sharing an id add in token order, the host's bits exactly. `scratch`
// (device memory of embedding_backward_scratch_bytes(rows)) holds each row's link to the next
// row with its id.
uint64_t embedding_backward_scratch_bytes(int64_t rows);
void launch_embedding_backward(void* dtable, DType dtable_t, const void* dout, DType dout_t,
                               const int32_t* ids, int64_t rows, int64_t dim, float scale,
                               int64_t first, int64_t table_rows, void* scratch,
                               cudaStream_t stream);

// ---- rmsnorm.cu ----
void launch_rmsnorm_forward(void* y, DType y_t, float* rstd, const void* x, DType x_t,
                            const void* w, DType w_t, int64_t rows, int64_t dim, float eps,
                            float weight_offset, cudaStream_t stream);
// The scratch the backward needs for its per-block dw partials: at least rmsnorm_scratch_min
// bytes (one partial row); more allows more blocks, up to rmsnorm_scratch_max.
uint64_t rmsnorm_scratch_min(int64_t dim);
uint64_t rmsnorm_scratch_max(int64_t rows, int64_t dim);
// dx += ..., dw += ... (deterministic: dw sums the per-block partials in a fixed order).
// `scratch` is device memory of `scratch_bytes` >= rmsnorm_scratch_min(dim), used only by
// work queued on `stream`.
void launch_rmsnorm_backward(void* dx, DType dx_t, void* dw, DType dw_t, const void* dy, DType dy_t,
                             const void* x, DType x_t, const void* w, DType w_t,
                             float weight_offset, const float* rstd, int64_t rows, int64_t dim,
                             float* scratch, uint64_t scratch_bytes, cudaStream_t stream);

// ---- rope.cu ----
void launch_rope(void* x, DType x_t, const float* cos_sin, int64_t tokens, int64_t heads,
                 int64_t head_dim, int64_t rotary, int64_t seq_len, bool inverse,
                 cudaStream_t stream);

// ---- attention.cu: tiled (flash-style) causal GQA attention, f32 arithmetic ----
// head_dim up to kAttentionMaxHeadDim (even); batch and heads up to kAttentionMaxGrid.
inline constexpr int64_t kAttentionMaxHeadDim = 256;
inline constexpr int64_t kAttentionMaxGrid = 65535;
// The most dynamic shared memory any attention kernel needs for `head_dim` in its smallest
// configuration; the device must allow that much per block (every sm_80+ GPU does for 256).
uint64_t attention_shared_bytes_min(int64_t head_dim);
// The dynamic shared memory of the backward's dk/dv kernel for `head_dim` with query tiles of
// `query_rows` (32, 16 or 8): what a device must allow for the backward to pick that tile.
uint64_t attention_backward_shared_bytes(int64_t head_dim, int64_t query_rows);
// q, k, v, out (and the gradients) all of dtype t. `max_shared_bytes` is the device's
// cudaDevAttrMaxSharedMemoryPerBlockOptin (>= attention_shared_bytes_min): the backward picks
// the largest query tile that fits.
void launch_attention_forward(void* out, float* lse, const void* q, const void* k, const void* v,
                              DType t, const AttentionDims& dims, uint64_t max_shared_bytes,
                              cudaStream_t stream);
void launch_attention_backward(void* dq, void* dk, void* dv, const void* dout, const void* q,
                               const void* k, const void* v, const void* out, const float* lse,
                               DType t, const AttentionDims& dims, uint64_t max_shared_bytes,
                               cudaStream_t stream);

// ---- attention_mma.cu and attention_tc.cu: the same on tensor cores, for bf16 with head_dim a
// multiple of 16 up to 128 (and 256 for attention_mma.cu), where the device's shared memory
// allows and every pointer is 16-byte aligned. attention_mma.cu keeps the scores in registers
// (mma.sync, sm_80+) and takes any AttentionDims::scale and softcap; attention_tc.cu passes them
// through shared memory (wmma) and computes plain scores only. The launchers above call the mma
// kernels first, then the wmma ones; each launches nothing and returns false where it does not
// apply.
bool attention_mma_forward(void* out, float* lse, const void* q, const void* k, const void* v,
                           DType t, const AttentionDims& dims, uint64_t max_shared_bytes,
                           cudaStream_t stream);
bool attention_mma_backward(void* dq, void* dk, void* dv, const void* dout, const void* q,
                            const void* k, const void* v, const void* out, const float* lse,
                            DType t, const AttentionDims& dims, uint64_t max_shared_bytes,
                            cudaStream_t stream);
bool attention_tc_forward(void* out, float* lse, const void* q, const void* k, const void* v,
                          DType t, const AttentionDims& dims, uint64_t max_shared_bytes,
                          cudaStream_t stream);
bool attention_tc_backward(void* dq, void* dk, void* dv, const void* dout, const void* q,
                           const void* k, const void* v, const void* out, const float* lse, DType t,
                           const AttentionDims& dims, uint64_t max_shared_bytes,
                           cudaStream_t stream);
// The dynamic shared memory each tensor-core kernel needs per block at `head_dim` (a GPU
// allowing less takes the next path; every forward up to head_dim 128 needs less than every
// sm_80+ GPU allows, and attention_mma.cu's at 256 needs 99 KiB, what sm_86 and sm_89 allow).
uint64_t attention_mma_forward_shared_bytes(int64_t head_dim);
// Whether a bf16 backward of `dims` (as many queries as keys) runs on one of the tensor-core
// paths of a GPU allowing `max_shared_bytes` per block (the forward then does too).
bool attention_backward_on_tensor_cores(const AttentionDims& dims, uint64_t max_shared_bytes);
uint64_t attention_mma_backward_shared_bytes(int64_t head_dim);
uint64_t attention_tc_backward_shared_bytes(int64_t head_dim);
// Which attention kernels take the calls they apply to: attention_kernels.h.

// ---- glu.cu ----
void launch_glu_forward(void* h, DType h_t, const void* gate, DType gate_t, const void* up,
                        DType up_t, int64_t n, Activation act, cudaStream_t stream);
void launch_glu_backward(void* dgate, DType dgate_t, void* dup, DType dup_t, const void* dh,
                         DType dh_t, const void* gate, DType gate_t, const void* up, DType up_t,
                         int64_t n, Activation act, cudaStream_t stream);

// ---- elementwise.cu ----
void launch_add(void* out, DType out_t, const void* a, DType a_t, const void* b, DType b_t,
                int64_t n, cudaStream_t stream);
void launch_fill(void* x, DType x_t, float value, int64_t n, cudaStream_t stream);
// y [rows, cols] = b [cols] in every row; db [cols] += the column sums of dy [rows, cols].
void launch_broadcast_rows(void* y, DType t, const void* b, int64_t rows, int64_t cols,
                           cudaStream_t stream);
void launch_bias_backward(void* db, DType db_t, const void* dy, DType dy_t, int64_t rows,
                          int64_t cols, cudaStream_t stream);
// x = beta * x, with beta == 0 writing zeros whatever x holds (a matmul with k == 0).
void launch_scale(void* x, DType x_t, float beta, int64_t n, cudaStream_t stream);
// x = cap * tanh(x / cap), in place (Kernels::softcap).
void launch_softcap(void* x, DType x_t, float cap, int64_t n, cudaStream_t stream);

// ---- xent.cu: chunked softmax cross-entropy, one block per row ----
void launch_xent_forward_chunk(const void* logits, DType logits_t, int64_t rows, int64_t chunk,
                               int64_t v0, const int32_t* targets, float* row_max, float* row_sum,
                               float* target_logit, cudaStream_t stream);
void launch_xent_finish(float* losses, float* lse, const float* row_max, const float* row_sum,
                        const float* target_logit, const int32_t* targets, int64_t rows,
                        cudaStream_t stream);
void launch_xent_backward_chunk(void* logits, DType logits_t, int64_t rows, int64_t chunk,
                                int64_t v0, const int32_t* targets, const float* lse, float scale,
                                float softcap, cudaStream_t stream);

// ---- optimizer.cu: the optimizer, where its home is the GPU (exactly CpuAdam's bits) ----
// master, m, v: n floats updated in place; grad: n elements of grad_t; copy: n elements of
// copy_t receiving the updated master, or null.
void launch_adam_update(float* master, float* m, float* v, const void* grad, DType grad_t,
                        void* copy, DType copy_t, const cpu_adam::StepConstants& k, int64_t n,
                        cudaStream_t stream);
// chunk_sums: cpu_adam::chunk_count(n, CpuAdam::kStatsChunk) doubles.
void launch_grad_chunk_sums(const void* grad, DType grad_t, int64_t n, double* chunk_sums,
                            cudaStream_t stream);

}  // namespace strata
