// attention_tc.cu: causal grouped-query attention on tensor cores (wmma: bf16 operands, f32
// accumulators), forward and backward, for bf16 tensors whose head_dim is a multiple of 16 up
// to 128 (Llama's 64 and 128). attention.cu's f32 SIMT kernels take every other case, and this
// one's when a GPU lacks the shared memory or a pointer is not 16-byte aligned.
//
// Layouts and equations are attention.cu's. Each block runs 4 warps over tiles of 64 query rows
// and 64 keys, staged in shared memory as bf16 with a row stride of head_dim + 8 elements (16
// bytes more than a row: rows start on different banks, and every 16-row fragment stays 32-byte
// aligned as wmma needs). Each warp owns 16 rows of the block's tile.
// - forward: a block owns 64 query rows of one (batch, head). Per key tile, each warp computes
//   its 16 x 64 scores S = Q K^T into shared memory, updates the online softmax there (two
//   lanes per row), writes P in bf16, rescales its output accumulators row by row and adds P V.
// - dq: the same walk; per key tile S and dP = dO V^T, then dS = P * (dP - D) in bf16, and
//   dq += dS K. D = rowsum(dO * O) is computed once per row.
// - dk/dv: a block owns 64 keys of one (batch, kv head) and walks every query tile at or after
//   them, for each query head of the group; each warp computes S^T = K Q^T and dP^T = V dO^T
//   for its 16 keys, then dv += P^T dO and dk += dS^T Q. No atomics: deterministic.
// A fragment's element-to-row mapping is unspecified, so a warp finds the row of each of its
// accumulator elements from a fragment loaded from a matrix of row numbers (row_of below).
//
// Differences from the SIMT kernels: P and dS are rounded to bf16 before their products (as
// flash-attention's kernels do); the softmax denominator and lse sum P in f32. A masked (future)
// key is multiplied by zero, not skipped: an Inf or NaN in a key or value row reaches the earlier
// query rows of its tile as NaN. Sub-tiles of 16 keys that a warp's rows cannot see are skipped.
// Documents packed into sequences (AttentionDims::doc_start) mask the keys before each query's
// document as well; the forward and dq walks start at the key tile of the block's first row's
// document, and the dk/dv walk stops at the first query tile whose document starts after the
// block's keys.
#include "gpu/attention_tiles.cuh"
#include "gpu/kernel_common.cuh"
#include "gpu/ops.h"

#include <mma.h>

namespace strata {
namespace {

using namespace nvcuda;
using gpu::bf16;
using gpu::from_f32;
using gpu::kFullMask;
using gpu::to_f32;
using namespace gpu::attention_tiles;

constexpr int kSub = 16;             // wmma's edge: the rows (or keys) each warp owns
constexpr int kSubs = kTile / kSub;  // sub-tiles of 16 in a tile
constexpr int kScoreLd = kTile + 4;  // f32 scratch [16][kScoreLd]
constexpr int kProbLd = kTile + 8;   // bf16 scratch [16][kProbLd]

using FragA = wmma::fragment<wmma::matrix_a, kSub, kSub, kSub, bf16, wmma::row_major>;
using FragBRow = wmma::fragment<wmma::matrix_b, kSub, kSub, kSub, bf16, wmma::row_major>;
using FragBCol = wmma::fragment<wmma::matrix_b, kSub, kSub, kSub, bf16, wmma::col_major>;
using FragC = wmma::fragment<wmma::accumulator, kSub, kSub, kSub, float>;

// head_dim is each kernel's template parameter (16 NS), not a field.
struct Geometry {
  int64_t seq, heads, kv_heads;
  float scale;
  const int32_t* doc_start;  // AttentionDims::doc_start: [batch * seq], or null
  int64_t window;            // AttentionDims::window: 0, or a sliding window
};

__host__ __device__ constexpr int tile_ld(int hd) {
  return hd + 8;
}
constexpr uint64_t kTileScoreBytes = uint64_t{kSub} * kScoreLd * sizeof(float);   // 4352
constexpr uint64_t kTileProbBytes = uint64_t{kSub} * kProbLd * sizeof(uint16_t);  // 2304
constexpr uint64_t kRowStatBytes = 128;  // 16 floats, rounded to keep 32-byte alignment
__host__ __device__ constexpr uint64_t tiles_bytes(int hd, int tiles) {
  return static_cast<uint64_t>(tiles) * kTile * tile_ld(hd) * 2;
}
// Per warp: forward scores + P + one row statistic; dq scores + dP + dS (its row statistics
// stay in registers); dk/dv S^T + dP^T + P^T + dS^T (its row statistics are the block's, 2 x 64
// floats).
constexpr uint64_t kForwardWarpBytes = kTileScoreBytes + kTileProbBytes + kRowStatBytes;
constexpr uint64_t kDqWarpBytes = 2 * kTileScoreBytes + kTileProbBytes;
constexpr uint64_t kDkdvWarpBytes = 2 * kTileScoreBytes + 2 * kTileProbBytes;
constexpr uint64_t kDkdvBlockStatBytes = 2 * kTile * sizeof(float);

uint64_t forward_bytes(int hd) {
  return tiles_bytes(hd, 3) + kWarps * kForwardWarpBytes;
}
uint64_t dq_bytes(int hd) {
  return tiles_bytes(hd, 4) + kWarps * kDqWarpBytes;
}
uint64_t dkdv_bytes(int hd) {
  return tiles_bytes(hd, 4) + kWarps * kDkdvWarpBytes + kDkdvBlockStatBytes;
}

// An accumulator whose every element holds its own row number (0-15), from `scratch` (16 x 16
// floats with stride kScoreLd, this warp's).
__device__ void load_row_numbers(FragC& row_of, float* scratch, int lane) {
  for (int e = lane; e < kSub * kSub; e += 32)
    scratch[(e / kSub) * kScoreLd + e % kSub] = static_cast<float>(e / kSub);
  __syncwarp();
  wmma::load_matrix_sync(row_of, scratch, kScoreLd, wmma::mem_row_major);
  __syncwarp();
}

// acc[j] *= factor[row] for every element, `factor` 16 floats of shared memory.
template <int NS>
__device__ __forceinline__ void scale_rows(FragC (&acc)[NS], const FragC& row_of,
                                           const float* factor) {
#pragma unroll
  for (int j = 0; j < NS; ++j)
#pragma unroll
    for (int i = 0; i < acc[j].num_elements; ++i)
      acc[j].x[i] *= factor[static_cast<int>(row_of.x[i])];
}

// Writes a warp's 16 x hd accumulators, times `factor`, as bf16 rows: row r to dst + r *
// row_stride, only rows r < rows. Staged through `scratch` (16 x kScoreLd floats).
template <int NS>
__device__ void store_rows(bf16* dst, int64_t row_stride, int rows, FragC (&acc)[NS], float factor,
                           float* scratch, int lane) {
  const int r = lane / 2, c0 = (lane % 2) * 8;
#pragma unroll
  for (int j = 0; j < NS; ++j) {
    wmma::store_matrix_sync(scratch, acc[j], kScoreLd, wmma::mem_row_major);
    __syncwarp();
    if (r < rows)
      for (int c = 0; c < 8; ++c)
        dst[r * row_stride + j * kSub + c0 + c] =
            from_f32<bf16>(factor * scratch[r * kScoreLd + c0 + c]);
    __syncwarp();
  }
}

// out (16 x 16n) = a_rows (16 x hd, row-major) . b_rows^T for the key (or query) sub-tiles n in
// [n0, n1) of a 64-row tile `b_rows` (row-major, so b_rows^T is column-major), stored to
// `scratch` at column 16 n.
template <int NS>
__device__ __forceinline__ void product_to_scratch(float* scratch, const bf16* a_rows,
                                                   const bf16* b_rows, int ld, int n0, int n1) {
  for (int n = n0; n < n1; ++n) {
    FragC s;
    wmma::fill_fragment(s, 0.0f);
#pragma unroll
    for (int kk = 0; kk < NS * kSub; kk += kSub) {
      FragA a;
      FragBCol b;
      wmma::load_matrix_sync(a, a_rows + kk, ld);
      wmma::load_matrix_sync(b, b_rows + n * kSub * ld + kk, ld);
      wmma::mma_sync(s, a, b, s);
    }
    wmma::store_matrix_sync(scratch + n * kSub, s, kScoreLd, wmma::mem_row_major);
  }
}

// The same with the 16 x hd A operand already in registers (the forward's and dq's query rows,
// the same for every key tile): one shared-memory load per product instead of two.
template <int NS>
__device__ __forceinline__ void product_to_scratch(float* scratch, const FragA (&a)[NS],
                                                   const bf16* b_rows, int ld, int n0, int n1) {
  for (int n = n0; n < n1; ++n) {
    FragC s;
    wmma::fill_fragment(s, 0.0f);
#pragma unroll
    for (int j = 0; j < NS; ++j) {
      FragBCol b;
      wmma::load_matrix_sync(b, b_rows + n * kSub * ld + j * kSub, ld);
      wmma::mma_sync(s, a[j], b, s);
    }
    wmma::store_matrix_sync(scratch + n * kSub, s, kScoreLd, wmma::mem_row_major);
  }
}

// acc[j] += p (16 x 16 n1, bf16 in shared memory, columns [16 n0, 16 n1)) . rows [16 n0, 16 n1)
// of the tile `b_rows` (64 x hd, row-major).
template <int NS>
__device__ __forceinline__ void accumulate(FragC (&acc)[NS], const bf16* p, const bf16* b_rows,
                                           int ld, int n0, int n1) {
  for (int n = n0; n < n1; ++n) {
    FragA a;
    wmma::load_matrix_sync(a, p + n * kSub, kProbLd);
#pragma unroll
    for (int j = 0; j < NS; ++j) {
      FragBRow b;
      wmma::load_matrix_sync(b, b_rows + n * kSub * ld + j * kSub, ld);
      wmma::mma_sync(acc[j], a, b, acc[j]);
    }
  }
}

// The sub-tiles of 16 keys at k0 that any of the 16 query rows from `row0` can see.
__device__ __forceinline__ int visible_subs(int64_t row0, int64_t k0) {
  const int64_t n = (row0 + kSub - 1 - k0) / kSub + 1;
  return static_cast<int>(n < kSubs ? n : kSubs);
}

template <int NS>
__global__ void __launch_bounds__(kThreads)
    attention_tc_forward_kernel(bf16* __restrict__ out, float* __restrict__ lse,
                                const bf16* __restrict__ q, const bf16* __restrict__ k,
                                const bf16* __restrict__ v, Geometry g) {
  extern __shared__ __align__(128) unsigned char tc_smem[];
  constexpr int hd = NS * kSub, ld = tile_ld(hd);
  bf16* sq = reinterpret_cast<bf16*>(tc_smem);
  bf16* sk = sq + kTile * ld;
  bf16* sv = sk + kTile * ld;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  unsigned char* mine = tc_smem + tiles_bytes(hd, 3) + warp * kForwardWarpBytes;
  float* scores = reinterpret_cast<float*>(mine);
  bf16* probs = reinterpret_cast<bf16*>(mine + kTileScoreBytes);
  float* row_factor = reinterpret_cast<float*>(mine + kTileScoreBytes + kTileProbBytes);

  const int64_t b = blockIdx.z, h = blockIdx.y, hk = h / (g.heads / g.kv_heads);
  const int64_t q0 = int64_t{blockIdx.x} * kTile, row0 = q0 + warp * kSub;
  const int64_t qs = g.heads * hd, kvs = g.kv_heads * hd;  // token strides
  const bf16* kh = k + b * g.seq * kvs + hk * hd;
  const bf16* vh = v + b * g.seq * kvs + hk * hd;
  load_tile(sq, ld, q + b * g.seq * qs + h * hd, qs, q0, g.seq, hd);
  __syncthreads();
  FragA qa[NS];  // this warp's 16 query rows, for every key tile
#pragma unroll
  for (int j = 0; j < NS; ++j) wmma::load_matrix_sync(qa[j], sq + warp * kSub * ld + j * kSub, ld);

  FragC row_of, o[NS];
  load_row_numbers(row_of, scores, lane);
#pragma unroll
  for (int j = 0; j < NS; ++j) wmma::fill_fragment(o[j], 0.0f);
  // Row r of the warp's 16 is lanes 2r (keys 0-31 of a tile) and 2r + 1 (keys 32-63).
  const int r = lane / 2, half = lane % 2;
  const int64_t t = row0 + r;
  const int64_t first = t < g.seq ? gpu::doc_first(g.doc_start, g.window, b, g.seq, t) : 0;
  float m = -INFINITY, l = 0.0f;

  const int64_t q_end = gpu::min64(q0 + kTile, g.seq);
  const int64_t k_begin = gpu::doc_first(g.doc_start, g.window, b, g.seq, q0) / kTile * kTile;
  for (int64_t k0 = k_begin; k0 < q_end; k0 += kTile) {
    __syncthreads();  // the previous tile is consumed
    load_tile(sk, ld, kh, kvs, k0, g.seq, hd);
    load_tile(sv, ld, vh, kvs, k0, g.seq, hd);
    __syncthreads();
    const int subs = visible_subs(row0, k0);
    product_to_scratch<NS>(scores, qa, sk, ld, 0, subs);
    __syncwarp();

    const float* srow = scores + r * kScoreLd + half * 32;
    bf16* prow = probs + r * kProbLd + half * 32;
    const int64_t key0 = k0 + half * 32;
    float tile_max = -INFINITY;
    for (int c = 0; c < 32; ++c)
      if (t < g.seq && key0 + c <= t && key0 + c >= first)
        tile_max = fmaxf(tile_max, srow[c] * g.scale);
    tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, 1));
    const float m_new = fmaxf(m, tile_max);
    // Nothing seen yet (m_new = -Inf): the accumulators are 0 and stay so.
    const float corr = m_new == -INFINITY ? 1.0f : expf(m - m_new);
    float sum = 0.0f;
    for (int c = 0; c < 32; ++c) {
      float p = 0.0f;
      if (t < g.seq && key0 + c <= t && key0 + c >= first) p = expf(srow[c] * g.scale - m_new);
      prow[c] = from_f32<bf16>(p);
      sum += p;
    }
    sum += __shfl_xor_sync(kFullMask, sum, 1);
    l = l * corr + sum;
    m = m_new;
    if (half == 0) row_factor[r] = corr;
    __syncwarp();
    scale_rows(o, row_of, row_factor);
    accumulate(o, probs, sv, ld, 0, subs);
    __syncwarp();  // row_factor and probs are read before the next tile writes them
  }

  if (half == 0) row_factor[r] = l > 0.0f ? 1.0f / l : 0.0f;
  __syncwarp();
  scale_rows(o, row_of, row_factor);
  const int rows = static_cast<int>(gpu::min64(kSub, g.seq - gpu::min64(row0, g.seq)));
  store_rows(out + (b * g.seq + row0) * qs + h * hd, qs, rows, o, 1.0f, scores, lane);
  if (half == 0 && t < g.seq) lse[(b * g.heads + h) * g.seq + t] = m + logf(l);
}

// D = dout . out for one row, split between two lanes (half 0 and 1) and summed over the pair;
// 0 where the row is not `valid` (past the sequence). Every lane of the warp must call it.
__device__ __forceinline__ float row_d(const bf16* dout_row, const bf16* out_row, bool valid,
                                       int half, int hd) {
  float sum = 0.0f;
  if (valid)
    for (int d = half * (hd / 2); d < (half + 1) * (hd / 2); ++d)
      sum += to_f32(dout_row[d]) * to_f32(out_row[d]);
  return sum + __shfl_xor_sync(kFullMask, sum, 1);
}

template <int NS>
__global__ void __launch_bounds__(kThreads)
    attention_tc_dq_kernel(bf16* __restrict__ dq, const bf16* __restrict__ dout,
                           const bf16* __restrict__ q, const bf16* __restrict__ k,
                           const bf16* __restrict__ v, const bf16* __restrict__ out,
                           const float* __restrict__ lse, Geometry g) {
  extern __shared__ __align__(128) unsigned char tc_smem[];
  constexpr int hd = NS * kSub, ld = tile_ld(hd);
  bf16* sq = reinterpret_cast<bf16*>(tc_smem);
  bf16* sdo = sq + kTile * ld;
  bf16* sk = sdo + kTile * ld;
  bf16* sv = sk + kTile * ld;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  unsigned char* mine = tc_smem + tiles_bytes(hd, 4) + warp * kDqWarpBytes;
  float* scores = reinterpret_cast<float*>(mine);
  float* dps = reinterpret_cast<float*>(mine + kTileScoreBytes);
  bf16* dss = reinterpret_cast<bf16*>(mine + 2 * kTileScoreBytes);

  const int64_t b = blockIdx.z, h = blockIdx.y, hk = h / (g.heads / g.kv_heads);
  const int64_t q0 = int64_t{blockIdx.x} * kTile, row0 = q0 + warp * kSub;
  const int64_t qs = g.heads * hd, kvs = g.kv_heads * hd;
  const int64_t q_base = b * g.seq * qs + h * hd;
  const bf16* kh = k + b * g.seq * kvs + hk * hd;
  const bf16* vh = v + b * g.seq * kvs + hk * hd;
  load_tile(sq, ld, q + q_base, qs, q0, g.seq, hd);
  load_tile(sdo, ld, dout + q_base, qs, q0, g.seq, hd);
  __syncthreads();
  FragA qa[NS], doa[NS];  // this warp's 16 rows of q and dout, for every key tile
#pragma unroll
  for (int j = 0; j < NS; ++j) {
    wmma::load_matrix_sync(qa[j], sq + warp * kSub * ld + j * kSub, ld);
    wmma::load_matrix_sync(doa[j], sdo + warp * kSub * ld + j * kSub, ld);
  }

  const int r = lane / 2, half = lane % 2;
  const int64_t t = row0 + r;
  const float row_lse = t < g.seq ? lse[(b * g.heads + h) * g.seq + t] : 0.0f;
  const int64_t first = t < g.seq ? gpu::doc_first(g.doc_start, g.window, b, g.seq, t) : 0;
  const float dd = row_d(sdo + (warp * kSub + r) * ld, out + q_base + t * qs, t < g.seq, half, hd);
  FragC acc[NS];
#pragma unroll
  for (int j = 0; j < NS; ++j) wmma::fill_fragment(acc[j], 0.0f);

  const int64_t q_end = gpu::min64(q0 + kTile, g.seq);
  const int64_t k_begin = gpu::doc_first(g.doc_start, g.window, b, g.seq, q0) / kTile * kTile;
  for (int64_t k0 = k_begin; k0 < q_end; k0 += kTile) {
    __syncthreads();
    load_tile(sk, ld, kh, kvs, k0, g.seq, hd);
    load_tile(sv, ld, vh, kvs, k0, g.seq, hd);
    __syncthreads();
    const int subs = visible_subs(row0, k0);
    product_to_scratch<NS>(scores, qa, sk, ld, 0, subs);
    product_to_scratch<NS>(dps, doa, sv, ld, 0, subs);
    __syncwarp();
    const int64_t key0 = k0 + half * 32;
    for (int c = 0; c < 32; ++c) {
      float ds = 0.0f;
      if (t < g.seq && key0 + c <= t && key0 + c >= first) {
        const int col = half * 32 + c;
        ds = expf(scores[r * kScoreLd + col] * g.scale - row_lse) * (dps[r * kScoreLd + col] - dd);
      }
      dss[r * kProbLd + half * 32 + c] = from_f32<bf16>(ds);
    }
    __syncwarp();
    accumulate(acc, dss, sk, ld, 0, subs);
    __syncwarp();
  }
  const int rows = static_cast<int>(gpu::min64(kSub, g.seq - gpu::min64(row0, g.seq)));
  store_rows(dq + q_base + row0 * qs, qs, rows, acc, g.scale, scores, lane);
}

template <int NS>
__global__ void __launch_bounds__(kThreads)
    attention_tc_dkdv_kernel(bf16* __restrict__ dk, bf16* __restrict__ dv,
                             const bf16* __restrict__ dout, const bf16* __restrict__ q,
                             const bf16* __restrict__ k, const bf16* __restrict__ v,
                             const bf16* __restrict__ out, const float* __restrict__ lse,
                             Geometry g) {
  extern __shared__ __align__(128) unsigned char tc_smem[];
  constexpr int hd = NS * kSub, ld = tile_ld(hd);
  bf16* sk = reinterpret_cast<bf16*>(tc_smem);
  bf16* sv = sk + kTile * ld;
  bf16* sq = sv + kTile * ld;
  bf16* sdo = sq + kTile * ld;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  unsigned char* mine = tc_smem + tiles_bytes(hd, 4) + warp * kDkdvWarpBytes;
  float* st = reinterpret_cast<float*>(mine);                      // S^T [16 keys][64 queries]
  float* dpt = reinterpret_cast<float*>(mine + kTileScoreBytes);   // dP^T
  bf16* pt = reinterpret_cast<bf16*>(mine + 2 * kTileScoreBytes);  // P^T in bf16
  bf16* dst = reinterpret_cast<bf16*>(mine + 2 * kTileScoreBytes + kTileProbBytes);  // dS^T
  float* tile_lse =
      reinterpret_cast<float*>(tc_smem + tiles_bytes(hd, 4) + kWarps * kDkdvWarpBytes);
  float* tile_d = tile_lse + kTile;

  const int64_t b = blockIdx.z, hk = blockIdx.y;
  const int64_t k0 = int64_t{blockIdx.x} * kTile, key_row0 = k0 + warp * kSub;
  const int64_t qs = g.heads * hd, kvs = g.kv_heads * hd;
  const int64_t kv_base = b * g.seq * kvs + hk * hd;
  load_tile(sk, ld, k + kv_base, kvs, k0, g.seq, hd);
  load_tile(sv, ld, v + kv_base, kvs, k0, g.seq, hd);

  FragC dk_acc[NS], dv_acc[NS];
#pragma unroll
  for (int j = 0; j < NS; ++j) {
    wmma::fill_fragment(dk_acc[j], 0.0f);
    wmma::fill_fragment(dv_acc[j], 0.0f);
  }
  // Key r of the warp's 16 is lanes 2r (queries 0-31 of a tile) and 2r + 1 (queries 32-63).
  const int r = lane / 2, half = lane % 2;
  const int64_t key = key_row0 + r;
  const int64_t group = g.heads / g.kv_heads;
  for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
    const int64_t q_base = b * g.seq * qs + h * hd;
    const float* head_lse = lse + (b * g.heads + h) * g.seq;
    // k0 is a multiple of 64: query tiles start at k0, the first row that can see these keys.
    for (int64_t i0 = k0; i0 < g.seq; i0 += kTile) {
      // Queries from i0 on belong to documents that start after these keys: none sees them.
      if (gpu::doc_first(g.doc_start, g.window, b, g.seq, i0) >= k0 + kTile)
        break;          // the whole block
      __syncthreads();  // the previous tile's sq, sdo, tile_lse and tile_d are consumed
      load_tile(sq, ld, q + q_base, qs, i0, g.seq, hd);
      load_tile(sdo, ld, dout + q_base, qs, i0, g.seq, hd);
      __syncthreads();
      {  // lse and D of the tile's 64 query rows: warp w the rows 16 w + r
        const int row = warp * kSub + r;
        const int64_t t = i0 + row;
        const float dd = row_d(sdo + row * ld, out + q_base + t * qs, t < g.seq, half, hd);
        if (half == 0) {
          tile_lse[row] = t < g.seq ? head_lse[t] : 0.0f;
          tile_d[row] = dd;
        }
      }
      __syncthreads();
      // The query sub-tiles that can see any of this warp's keys: on the diagonal tile those
      // from the warp's own; every one after it.
      const int n0 = i0 == k0 ? warp : 0;
      product_to_scratch<NS>(st, sk + warp * kSub * ld, sq, ld, n0, kSubs);
      product_to_scratch<NS>(dpt, sv + warp * kSub * ld, sdo, ld, n0, kSubs);
      __syncwarp();
      for (int c = 0; c < 32; ++c) {
        const int col = half * 32 + c;
        const int64_t t = i0 + col;
        float p = 0.0f, ds = 0.0f;
        if (t < g.seq && key <= t && key >= gpu::doc_first(g.doc_start, g.window, b, g.seq, t)) {
          p = expf(st[r * kScoreLd + col] * g.scale - tile_lse[col]);
          ds = p * (dpt[r * kScoreLd + col] - tile_d[col]);
        }
        pt[r * kProbLd + col] = from_f32<bf16>(p);
        dst[r * kProbLd + col] = from_f32<bf16>(ds);
      }
      __syncwarp();
      accumulate(dv_acc, pt, sdo, ld, n0, kSubs);
      accumulate(dk_acc, dst, sq, ld, n0, kSubs);
    }
  }
  __syncwarp();
  const int rows = static_cast<int>(gpu::min64(kSub, g.seq - gpu::min64(key_row0, g.seq)));
  store_rows(dk + kv_base + key_row0 * kvs, kvs, rows, dk_acc, g.scale, st, lane);
  store_rows(dv + kv_base + key_row0 * kvs, kvs, rows, dv_acc, 1.0f, st, lane);
}

Geometry geometry(const AttentionDims& d) {
  return Geometry{d.seq,       d.heads, d.kv_heads, 1.0f / sqrtf(static_cast<float>(d.head_dim)),
                  d.doc_start, d.window};
}

}  // namespace

uint64_t attention_tc_backward_shared_bytes(int64_t head_dim) {
  return std::max(dq_bytes(static_cast<int>(head_dim)), dkdv_bytes(static_cast<int>(head_dim)));
}

bool attention_tc_forward(void* out, float* lse, const void* q, const void* k, const void* v,
                          DType t, const AttentionDims& dims, uint64_t max_shared_bytes,
                          cudaStream_t stream) {
  const uint64_t bytes = dims.head_dim > 0 ? forward_bytes(static_cast<int>(dims.head_dim)) : 0;
  if (!applies(attention_kernels() != AttentionKernels::kSimt,
               wmma_attention_head_dim(dims.head_dim), t, dims, bytes, max_shared_bytes,
               {out, q, k, v}))
    return false;
  dispatch_slices(dims.head_dim, [&]<int NS>() {
    auto* kernel = attention_tc_forward_kernel<NS>;
    gpu::allow_dynamic_shared(kernel, bytes);
    kernel<<<grid_of(dims.seq, dims.heads, dims.batch), kThreads, bytes, stream>>>(
        static_cast<bf16*>(out), lse, static_cast<const bf16*>(q), static_cast<const bf16*>(k),
        static_cast<const bf16*>(v), geometry(dims));
    CUDA_CHECK_LAUNCH();
  });
  return true;
}

bool attention_tc_backward(void* dq, void* dk, void* dv, const void* dout, const void* q,
                           const void* k, const void* v, const void* out, const float* lse, DType t,
                           const AttentionDims& dims, uint64_t max_shared_bytes,
                           cudaStream_t stream) {
  const int hd = static_cast<int>(dims.head_dim);
  const uint64_t bytes = hd > 0 ? attention_tc_backward_shared_bytes(hd) : 0;
  if (!applies(attention_kernels() != AttentionKernels::kSimt,
               wmma_attention_head_dim(dims.head_dim), t, dims, bytes, max_shared_bytes,
               {dq, dk, dv, dout, q, k, v, out}))
    return false;
  const Geometry g = geometry(dims);
  dispatch_slices(dims.head_dim, [&]<int NS>() {
    auto* dq_kernel = attention_tc_dq_kernel<NS>;
    gpu::allow_dynamic_shared(dq_kernel, dq_bytes(hd));
    dq_kernel<<<grid_of(dims.seq, dims.heads, dims.batch), kThreads, dq_bytes(hd), stream>>>(
        static_cast<bf16*>(dq), static_cast<const bf16*>(dout), static_cast<const bf16*>(q),
        static_cast<const bf16*>(k), static_cast<const bf16*>(v), static_cast<const bf16*>(out),
        lse, g);
    CUDA_CHECK_LAUNCH();
    auto* kv_kernel = attention_tc_dkdv_kernel<NS>;
    gpu::allow_dynamic_shared(kv_kernel, dkdv_bytes(hd));
    kv_kernel<<<grid_of(dims.seq, dims.kv_heads, dims.batch), kThreads, dkdv_bytes(hd), stream>>>(
        static_cast<bf16*>(dk), static_cast<bf16*>(dv), static_cast<const bf16*>(dout),
        static_cast<const bf16*>(q), static_cast<const bf16*>(k), static_cast<const bf16*>(v),
        static_cast<const bf16*>(out), lse, g);
    CUDA_CHECK_LAUNCH();
  });
  return true;
}

}  // namespace strata
