// embedding.cu: the token embedding's forward (a row gather) and backward (a row scatter-add),
// each row times a scale (1, or Gemma's sqrt(hidden_size)). A vocabulary piece holds the ids
// [first, first + its rows): the others' rows are zeroed (zero_others) or left, and add nothing.
//
// The backward is deterministic and equals the host's bit for bit: rows sharing an id add in
// token order, a 16-bit dtable rounding after every add. A first pass links each row to the
// next row with its id (in the stream's workspace); then one thread per column of each id's
// first row walks that chain, so no two threads ever add into the same element.
#include "gpu/kernel_common.cuh"
#include "gpu/ops.h"

#include <algorithm>

namespace strata {
namespace {

using gpu::bf16;
using gpu::from_f32;
using gpu::to_f32;

template <typename O, typename Tb>
__global__ void embedding_forward_kernel(O* __restrict__ out, const Tb* __restrict__ table,
                                         const int32_t* __restrict__ ids, int64_t rows, int64_t dim,
                                         float scale, int64_t first, int64_t end,
                                         bool zero_others) {
  const int64_t n = rows * dim;
  gpu::grid_stride(n, [&](int64_t i) {
    const int64_t row = i / dim, d = i - row * dim;
    const int64_t id = ids[row];
    if (id < first || id >= end) {  // another piece's row
      if (zero_others) out[i] = from_f32<O>(0.0f);
      return;
    }
    out[i] = from_f32<O>(to_f32(table[(id - first) * dim + d]) * scale);
  });
}

// Row r's place in its id's chain: next[r] is the next row with the same id (-1: none) and
// head[r] is 1 where no earlier row has it. Each thread compares its row's id with every row's,
// the ids passing through shared memory a chunk at a time: rows^2 comparisons, read from shared
// memory by every thread of a warp at once.
constexpr int kChainChunk = 1024;

__global__ void embedding_chain_kernel(int32_t* __restrict__ next, int32_t* __restrict__ head,
                                       const int32_t* __restrict__ ids, int64_t rows) {
  __shared__ int32_t chunk[kChainChunk];
  const int64_t r = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  const int32_t id = r < rows ? ids[r] : -1;
  int64_t after = -1;
  bool first = true;
  for (int64_t c0 = 0; c0 < rows; c0 += kChainChunk) {
    const int n = static_cast<int>(gpu::min64(kChainChunk, rows - c0));
    __syncthreads();  // the previous chunk has been read
    for (int k = threadIdx.x; k < n; k += blockDim.x) chunk[k] = ids[c0 + k];
    __syncthreads();
    if (r >= rows) continue;
    for (int k = 0; k < n; ++k) {
      if (chunk[k] != id) continue;
      const int64_t j = c0 + k;
      if (j < r) first = false;
      if (j > r && after < 0) after = j;
    }
  }
  if (r < rows) {
    next[r] = static_cast<int32_t>(after);
    head[r] = first ? 1 : 0;
  }
}

// One block per (head row, tile of blockDim.x columns): each thread adds its column of every row
// in the chain, in token order, rounding to G after each add as the host does. Each row's value
// is dout * scale rounded to D first, as the host (and torch) round it.
template <typename G, typename D>
__global__ void embedding_backward_kernel(G* dtable, const D* __restrict__ dout,
                                          const int32_t* __restrict__ ids,
                                          const int32_t* __restrict__ next,
                                          const int32_t* __restrict__ head, int64_t rows,
                                          int64_t dim, float scale, int64_t first, int64_t end) {
  const int64_t tiles = (dim + blockDim.x - 1) / blockDim.x;
  for (int64_t b = blockIdx.x; b < rows * tiles; b += gridDim.x) {
    const int64_t r = b / tiles, d = (b - r * tiles) * blockDim.x + threadIdx.x;
    // A chain holds one id: its head row decides for every row of it.
    if (!head[r] || d >= dim || ids[r] < first || ids[r] >= end) continue;
    G* p = dtable + (int64_t{ids[r]} - first) * dim + d;
    float acc = to_f32(*p);
    for (int64_t j = r; j >= 0; j = next[j])
      acc = to_f32(from_f32<G>(acc + to_f32(from_f32<D>(to_f32(dout[j * dim + d]) * scale))));
    *p = from_f32<G>(acc);
  }
}

}  // namespace

void launch_embedding_forward(void* out, DType out_t, const void* table, DType table_t,
                              const int32_t* ids, int64_t rows, int64_t dim, float scale,
                              int64_t first, int64_t table_rows, bool zero_others,
                              cudaStream_t stream) {
  if (rows * dim == 0) return;
  gpu::dispatch(out_t, [&]<typename O>() {
    gpu::dispatch(table_t, [&]<typename Tb>() {
      embedding_forward_kernel<O, Tb>
          <<<gpu::grid_for(static_cast<uint64_t>(rows * dim)), gpu::kThreads, 0, stream>>>(
              static_cast<O*>(out), static_cast<const Tb*>(table), ids, rows, dim, scale, first,
              first + table_rows, zero_others);
      CUDA_CHECK_LAUNCH();
    });
  });
}

uint64_t embedding_backward_scratch_bytes(int64_t rows) {
  return 2 * sizeof(int32_t) * static_cast<uint64_t>(rows);
}

void launch_embedding_backward(void* dtable, DType dtable_t, const void* dout, DType dout_t,
                               const int32_t* ids, int64_t rows, int64_t dim, float scale,
                               int64_t first, int64_t table_rows, void* scratch,
                               cudaStream_t stream) {
  if (rows * dim == 0) return;
  int32_t* next = static_cast<int32_t*>(scratch);
  int32_t* head = next + rows;
  // One thread per row, no grid-stride loop: the caller's workspace bounds rows far below
  // the 2^31 - 1 blocks a grid may have.
  const auto row_blocks = static_cast<unsigned>((rows + gpu::kThreads - 1) / gpu::kThreads);
  embedding_chain_kernel<<<row_blocks, gpu::kThreads, 0, stream>>>(next, head, ids, rows);
  CUDA_CHECK_LAUNCH();
  const int64_t blocks = rows * ((dim + gpu::kThreads - 1) / gpu::kThreads);
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(blocks, int64_t{1} << 20));
  gpu::dispatch(dtable_t, [&]<typename G>() {
    gpu::dispatch(dout_t, [&]<typename D>() {
      embedding_backward_kernel<G, D><<<grid, gpu::kThreads, 0, stream>>>(
          static_cast<G*>(dtable), static_cast<const D*>(dout), ids, next, head, rows, dim, scale,
          first, first + table_rows);
      CUDA_CHECK_LAUNCH();
    });
  });
}

}  // namespace strata
