// cpu_adam.h: the CPU optimizer step of ZeRO-Offload, one fused pass over a shard in host RAM.
//
// A step for the trainer is two calls:
//   1. grad_stats() over every gradient shard, summed with GradStats::operator+= in a fixed
//      shard order: the global sum of squares (for the norm and clipping) and whether any
//      gradient is NaN or infinite (an overflowed fp16 step);
//   2. update() on each shard with the combined gradient scale (1/loss-scale x clip
//      coefficient, see combined_grad_scale) and the global stats. update() refuses to touch
//      anything when the stats say non-finite: the trainer skips that step (and lowers its loss
//      scale). It returns whether it applied the step.
// update() reads gradient, master, m, v once and writes master, m, v (and optionally the bf16 or
// f16 parameter copy that goes back to the GPU) in the same pass.
//
// Determinism: the update is elementwise and every SIMD path computes the same IEEE operations
// in the same order as the scalar path (no FMA contraction), so the output bits are the same for
// any thread count and any path. grad_stats() sums fixed chunks of kStatsChunk elements, each in
// 16 double lanes in a fixed order, and adds the chunk sums in chunk order: the same bits for any
// thread count and any path too. (Summing shards in a different order may change the last bit.)
//
// Threads and NUMA: with CpuAdamOptions::numa (the default), CpuAdam keeps one oneTBB arena per
// NUMA node that has CPUs this process may use, splits its thread budget across them in
// proportion to their CPUs (split_threads), and pins every thread that enters a node's arena to
// that node's CPUs (the calling thread too, for the duration of the call: its own binding is put
// back afterwards). Each call runs on the arena of the node that holds the shard's memory (the
// master for update and memory_bound_pass, the gradient for grad_stats); memory whose node is
// unknown, untouched, spread over several nodes, or on a node without an arena goes to the arena
// with the most threads. One call keeps one node busy: to use every node's memory bandwidth at
// once, call CpuAdam from one thread per node with that node's shards (calls on different shards
// may run concurrently). Which arena runs a chunk never changes what it computes, so the output
// bits do not depend on the arenas either. Pinning is best effort: pinning_error() says why it
// failed, if it ever did (the work then runs unpinned).
//
// Indexing is 64-bit throughout: sizes, chunk bounds and offsets are size_t (shards past 2^31
// elements are normal for 70B models).
#pragma once

#include "core/dtype.h"
#include "core/optimizer.h"

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace strata {
namespace cpu_adam {
struct UpdateSpan;     // kernels.h
struct StepConstants;  // kernels.h
}  // namespace cpu_adam

// The optimizer's settings. Despite the name (the module began as Adam's), `type` picks the update:
// Adam/AdamW (torch.optim.AdamW's operations), Lion (the paper's, as lion-pytorch writes it:
// decoupled decay, sign of the interpolated momentum; betas as Adam's, eps unused) or Adagrad
// (torch.optim.Adagrad's with lr_decay 0 and no initial accumulator: L2 decay added to the
// gradient, eps added to the root; betas, adamw and bias_correction unused).
struct AdamParams {
  OptimizerType type = OptimizerType::adam;
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  bool adamw = true;  // decoupled weight decay (AdamW); false: L2 decay added to the gradient
  bool bias_correction = true;
};

// One shard of the optimizer state O[u][r]: fp32 master weights and the moments its type keeps
// (core/optimizer.h): m and v for Adam, m for Lion, v (the sum of squares) for Adagrad; the
// pointer of a moment the type does not keep is ignored and may be null.
struct AdamShard {
  float* master = nullptr;
  float* m = nullptr;
  float* v = nullptr;
  size_t n = 0;
};

// A gradient shard G[u][r]: n elements of f32, bf16 or f16.
struct GradShard {
  const void* data = nullptr;
  DType dtype = DType::f32;
  size_t n = 0;
};

// The 16-bit parameter copy P[u][r] an update writes besides the master (bf16 or f16).
struct ParamCopy {
  void* data = nullptr;
  DType dtype = DType::bf16;
};

struct GradStats {
  double sum_squares = 0.0;
  bool non_finite = false;  // some element is NaN or +-Inf (sum_squares is then meaningless)
  GradStats& operator+=(const GradStats& o) {
    sum_squares += o.sum_squares;
    non_finite = non_finite || o.non_finite;
    return *this;
  }
};

// The scale update() multiplies raw gradients by: 1/loss_scale, times the clip coefficient
// max_norm / norm when the unscaled global norm exceeds max_norm (max_norm <= 0: no clipping).
float combined_grad_scale(const GradStats& global, float loss_scale, float max_norm);

struct CpuAdamOptions {
  int threads = 0;            // threads of all arenas together; 0: every CPU of this process
  std::string simd = "best";  // "best", or a path name: avx512f, avx2, neon64, sse4.2, scalar
  bool numa = true;           // one pinned arena per NUMA node; false: one unpinned arena
};

namespace cpu_adam {

// Splits a budget of `total` (>= 1) threads across NUMA nodes with cpus_per_node[i] CPUs each, in
// proportion to their CPUs (largest remainder). Nodes without CPUs get none. When the budget
// covers every node with CPUs, each gets at least one; when it does not (total < such nodes), the
// `total` nodes with the most CPUs (the lowest index among equals) get one each and the rest
// none: the budget is what the trainer leaves for the optimizer, and it is never exceeded.
std::vector<int> split_threads(int total, const std::vector<int>& cpus_per_node);

// The elements [begin, begin + n) of chunk c when `total` elements are cut into chunks of `chunk`.
struct ChunkRange {
  size_t begin = 0;
  size_t n = 0;
};
size_t chunk_count(size_t total, size_t chunk);
ChunkRange chunk_range(size_t total, size_t chunk, size_t c);

// The span of update chunk c (CpuAdam::kUpdateChunk elements) of a shard: every pointer offset
// to the chunk's first element. Pure arithmetic: nothing is read.
UpdateSpan update_span(const AdamShard& shard, const GradShard& grad,
                       const std::optional<ParamCopy>& copy, size_t c);

// The per-step scalars of step `step` (counting from 1), in double and rounded to float once, as
// CpuAdam::update uses them: what the kernel table's adam_update (core/kernels.h) takes, so an
// optimizer whose home is a device gets CpuAdam's bits. Throws Error naming the value when the
// step, a parameter or grad_scale is not valid (the checks update runs).
StepConstants step_constants(int64_t step, const AdamParams& params, float grad_scale);

}  // namespace cpu_adam

class CpuAdam {
 public:
  // Fixed chunk sizes: work is split on these boundaries whatever the thread count.
  static constexpr size_t kUpdateChunk = size_t{1} << 14;
  static constexpr size_t kStatsChunk = size_t{1} << 16;

  explicit CpuAdam(const CpuAdamOptions& options = {});
  ~CpuAdam();
  CpuAdam(const CpuAdam&) = delete;
  CpuAdam& operator=(const CpuAdam&) = delete;

  const char* simd_path() const;
  int threads() const;  // of all arenas together

  // Threads of each arena, and the os index of the NUMA node each serves (-1: not pinned, with
  // numa off or when the machine's NUMA nodes could not be read).
  std::vector<int> arena_threads() const;
  std::vector<int> arena_nodes() const;
  // The index (into arena_threads()) of the arena that runs work on [memory, memory + bytes).
  int arena_for(const void* memory, uint64_t bytes) const;
  // "" while every thread was pinned to its node's CPUs; else why the first pinning failed.
  std::string pinning_error() const;

  // Runs f(c) for c in [0, chunks) on the arena that serves `memory` (see arena_for): what update
  // and grad_stats do with their chunks, for other per-shard passes (and tests).
  void for_each_chunk(const void* memory, uint64_t bytes, size_t chunks,
                      const std::function<void(size_t)>& f);

  GradStats grad_stats(const GradShard& grad);

  // One step of params.type (step counts from 1) on `shard` with gradient `grad` (same n). Returns
  // false, leaving every buffer untouched, when `global` is non-finite. `copy`, when given,
  // receives the updated master rounded to its dtype (nearest even).
  bool update(const AdamShard& shard, const GradShard& grad, int64_t step, const AdamParams& params,
              float grad_scale, const GradStats& global, std::optional<ParamCopy> copy = {});

  // `type`'s memory traffic over the shard with trivial arithmetic (reads the master, the
  // moments the type keeps and the gradient, writes the master, those moments and the copy, each
  // x = max(x, g): values stay finite and normal, so a following update runs at its usual speed,
  // but the state is no longer the optimizer's): the memory bound `strata bench adam` measures the
  // update against, on the same arena and chunks.
  void memory_bound_pass(const AdamShard& shard, const GradShard& grad,
                         std::optional<ParamCopy> copy = {},
                         OptimizerType type = OptimizerType::adam);

  // The names of the SIMD paths this CPU can run, best first ("scalar" is always last).
  static std::vector<std::string> available_paths();

 private:
  // Cuts the shard into kUpdateChunk spans and runs f on each, on the arena of its master.
  void for_spans(const AdamShard& shard, const GradShard& grad,
                 const std::optional<ParamCopy>& copy,
                 const std::function<void(const cpu_adam::UpdateSpan&)>& f);

  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata
