// optimizer.cpp: the host backend's optimizer ops (adam_update, grad_chunk_sums; see
// core/kernels.h), the oracle the CUDA optimizer is tested against.
//
// Before editing, know: this file does no float arithmetic of its own. Every operation is
// cpu_adam::kScalarKernels' (built with -ffp-contract=off), over the very spans and chunks
// CpuAdam cuts a shard into, so an optimizer whose home is a host device gives CpuAdam's bits.
// Arithmetic added here would need that flag too (src/CMakeLists.txt). The scalar path is used,
// not the best SIMD one, because it is the reference every path is proven against; the update is
// elementwise and the sums are per chunk, so spreading chunks over threads changes no bit.
#include "core/kernels.h"
#include "cpu_adam/cpu_adam.h"
#include "cpu_adam/kernels.h"
#include "host/ops.h"

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <optional>

namespace strata::host {
namespace {

// Runs f(c) for every chunk c < chunks, chunks spread over oneTBB's threads.
template <typename F>
void for_chunks(size_t chunks, const F& f) {
  tbb::parallel_for(tbb::blocked_range<size_t>(0, chunks),
                    [&](const tbb::blocked_range<size_t>& r) {
                      for (size_t c = r.begin(); c != r.end(); ++c) f(c);
                    });
}

}  // namespace

void adam_update(const TensorView& master, const TensorView& m, const TensorView& v,
                 const TensorView& grad, const TensorView& param_copy,
                 const cpu_adam::StepConstants& k) {
  const auto n = static_cast<size_t>(check_adam_update(master, m, v, grad, param_copy, k.type));
  const AdamShard shard{static_cast<float*>(master.data), static_cast<float*>(m.data),
                        static_cast<float*>(v.data), n};
  const GradShard g{grad.data, grad.dtype, n};
  std::optional<ParamCopy> copy;
  if (param_copy.data != nullptr) copy = ParamCopy{param_copy.data, param_copy.dtype};
  for_chunks(cpu_adam::chunk_count(n, CpuAdam::kUpdateChunk), [&](size_t c) {
    cpu_adam::kScalarKernels.update(cpu_adam::update_span(shard, g, copy, c), k);
  });
}

void grad_chunk_sums(const TensorView& grad, double* chunk_sums) {
  const auto chunks = static_cast<size_t>(check_grad_chunk_sums(grad, chunk_sums));
  const auto n = static_cast<size_t>(grad.numel());
  const size_t size = dtype_size(grad.dtype);
  const auto* base = static_cast<const unsigned char*>(grad.data);
  for_chunks(chunks, [&](size_t c) {
    const cpu_adam::ChunkRange r = cpu_adam::chunk_range(n, CpuAdam::kStatsChunk, c);
    chunk_sums[c] = cpu_adam::kScalarKernels.sum_squares(base + r.begin * size, grad.dtype, r.n);
  });
}

}  // namespace strata::host
