// attention_mma.cu: causal grouped-query attention on tensor cores with every score kept in
// registers (mma.sync and ldmatrix, whose layouts mma_sync.cuh documents), forward and
// backward, for bf16 tensors whose head_dim is a multiple of 16 up to 128, or 256 (Gemma's). The
// launchers in attention.cu call these first; attention_tc.cu's wmma kernels take a call these
// refuse.
//
// Why a second tensor-core path: a wmma fragment's layout is unspecified, so attention_tc.cu
// stores every 16 x 16 block of scores to shared memory, works on it there and loads it back.
// On an H100 that kernel's backward ran at 17.9 TFLOP/s (bench/results/2026-11-24-h100.md), 40%
// of llama3-8b's forward and backward time. Here a product's f32 result is the next product's
// bf16 operand in registers (flash-attention 2's scheme), and shared memory holds only the
// tiles of q, k, v and dout.
//
// Layouts and equations are attention.cu's. Each block runs 4 warps over tiles of 64 rows,
// staged in shared memory as bf16 with a row stride of head_dim + 8 elements (rows start 16
// bytes apart in the banks, so ldmatrix's eight rows of a matrix hit distinct banks).
// - forward: a block owns 64 query rows of one (batch, head), a warp 16 of them. Per tile of
//   64 keys: S = Q K^T in registers, the online softmax row by row (each row's values are on
//   the 4 lanes of a quad), O += P V with P packed to bf16 from S's registers.
// - dq: the same walk; dP = dO V^T beside S, dS = P (dP - D) with D = rowsum(dO . O), and
//   dq += dS K.
// - dk/dv: a block owns 64 keys of one (batch, kv head), a warp 16 of them, and walks every
//   query tile at or after them for each query head of the group, 32 queries at a time:
//   S^T = K Q^T, dP^T = V dO^T, dv += P^T dO, dk += dS^T Q. No atomics: deterministic.
// Blocks are numbered so that the tiles with the most work start first (causal attention's
// last query tiles, the first key tiles).
//
// At head_dim 256 a warp's 16 x 256 f32 accumulator alone takes 128 registers of the 255 a
// thread has, so the kernels there work in smaller pieces: the forward reads its query
// fragments from shared memory for each key tile instead of keeping them in registers, dq walks
// each key tile in two halves of 32 keys, and dk/dv splits head_dim in two, one block per half
// (each block computes the whole of S^T and dP^T, whose dot products span head_dim, and
// accumulates its half of dk and dv: half as much tensor-core work again in that kernel, in
// exchange for keeping every accumulator in registers).
//
// Scores are attention.cu's: q.k times AttentionDims::scale (1/sqrt(hd) by default), then with
// a softcap c, c tanh(s / c) (Gemma 2's), whose slope 1 - (s / c)^2 multiplies dS.
//
// As attention_tc.cu: P and dS are rounded to bf16 before their products; the softmax
// denominator sums P in f32. Scores are kept in log2 units (times 1 / ln 2) and exponentiated
// with exp2.
// A masked key is skipped or multiplied by zero, never read as a score. Documents packed into
// sequences (AttentionDims::doc_start) mask the keys before each query's document too; the
// forward and dq walks start at the key tile of the block's first row's document, and the
// dk/dv walk stops at the first query tile whose document starts after the block's keys.
#include "gpu/attention_tiles.cuh"
#include "gpu/kernel_common.cuh"
#include "gpu/mma_sync.cuh"
#include "gpu/ops.h"

#include <cstring>

namespace strata {
namespace {

using gpu::bf16;
using gpu::kFullMask;
using gpu::load_a;
using gpu::load_b;
using gpu::load_b_transposed;
using gpu::mma_16816;
using gpu::pack_bf16;
using namespace gpu::attention_tiles;

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

struct Geometry {
  int64_t seq, heads, kv_heads;
  float scale, scale_log2;   // the scores' scale (AttentionDims::scale or 1/sqrt(hd)); over ln 2
  float cap_log2, cap_in;    // a softcap c: c / ln 2 and scale / c; 0 and 0 for none
  const int32_t* doc_start;  // AttentionDims::doc_start: [batch * seq], or null
  int64_t window;            // AttentionDims::window: 0, or a sliding window
};

// A score q.k in log2 units: q.k scale / ln 2, or with the cap (Cap: the kernels are compiled
// apart for capped scores, so that Llama's keep their registers) c tanh(q.k scale / c) / ln 2.
template <bool Cap>
__device__ __forceinline__ float score_log2(float dot, const Geometry& g) {
  if constexpr (Cap)
    return g.cap_log2 * tanhf(dot * g.cap_in);
  else
    return dot * g.scale_log2;
}
// d score / d (q.k scale) at a score in log2 units: the cap's slope 1 - (s / c)^2, or 1.
template <bool Cap>
__device__ __forceinline__ float cap_slope(float s_log2, const Geometry& g) {
  if constexpr (Cap) {
    const float th = s_log2 / g.cap_log2;
    return 1.0f - th * th;
  } else {
    return 1.0f;
  }
}

// Whether a kernel of NS slices keeps fewer things in registers at once (head_dim 256).
template <int NS>
constexpr bool kWide = NS > 8;

__host__ __device__ constexpr int row_ld(int hd) {
  return hd + 8;
}
__host__ __device__ constexpr uint64_t tiles_bytes(int hd, int tiles) {
  return static_cast<uint64_t>(tiles) * kTile * row_ld(hd) * 2;
}
uint64_t forward_bytes(int hd) {
  return tiles_bytes(hd, 3);
}
uint64_t dq_bytes(int hd) {
  return tiles_bytes(hd, 4);
}
// + the query tile's lse and D, 64 floats each.
uint64_t dkdv_bytes(int hd) {
  return tiles_bytes(hd, 4) + 2 * kTile * sizeof(float);
}

// Two bf16 (a packed pair) to global memory, 4-byte aligned.
__device__ __forceinline__ void store_pair(bf16* dst, uint32_t pair) {
#if defined(STRATA_CUDA_EMU)
  std::memcpy(dst, &pair, 4);
#else
  *reinterpret_cast<uint32_t*>(dst) = pair;
#endif
}

// s[j] (j < 2 * NT2) = A . X^T over head_dim for 16 rows of A and the n-tiles of 8 rows of X
// from x_row0; A rows a_row0.. of tile `a`. Only the pairs of n-tiles p < pairs are computed.
template <int NS, int NT2>
__device__ __forceinline__ void scores(float (&s)[2 * NT2][4], const bf16* a, int a_row0,
                                       const bf16* x, int x_row0, int ld, int pairs, int lane) {
#pragma unroll
  for (int j = 0; j < 2 * NT2; ++j)
#pragma unroll
    for (int r = 0; r < 4; ++r) s[j][r] = 0.0f;
#pragma unroll
  for (int kk = 0; kk < NS; ++kk) {
    uint32_t af[4];
    load_a(af, a, row_ld(NS * 16), a_row0, kk * 16, lane);
#pragma unroll
    for (int p = 0; p < NT2; ++p) {
      if (p < pairs) {
        uint32_t bf[4];
        load_b_transposed(bf, x, ld, x_row0 + p * 16, kk * 16, lane);
        mma_16816(s[2 * p], af, bf[0], bf[1]);
        mma_16816(s[2 * p + 1], af, bf[2], bf[3]);
      }
    }
  }
}

// acc (16 x hd) += P . Y for the pairs of n-tiles p < pairs of P (p's are P's columns
// [16 p, 16 p + 16), packed from f32 registers) and rows y_row0 + 16 p.. of the row-major tile Y.
template <int NS, int NT2>
__device__ __forceinline__ void accumulate(float (&acc)[2 * NS][4], const float (&p)[2 * NT2][4],
                                           const bf16* y, int y_row0, int ld, int pairs, int lane) {
#pragma unroll
  for (int kp = 0; kp < NT2; ++kp) {
    if (kp < pairs) {
      const uint32_t pa[4] = {pack_bf16(p[2 * kp][0], p[2 * kp][1]),
                              pack_bf16(p[2 * kp][2], p[2 * kp][3]),
                              pack_bf16(p[2 * kp + 1][0], p[2 * kp + 1][1]),
                              pack_bf16(p[2 * kp + 1][2], p[2 * kp + 1][3])};
#pragma unroll
      for (int dn = 0; dn < NS; ++dn) {
        uint32_t bf[4];
        load_b(bf, y, ld, y_row0 + kp * 16, dn * 16, lane);
        mma_16816(acc[2 * dn], pa, bf[0], bf[1]);
        mma_16816(acc[2 * dn + 1], pa, bf[2], bf[3]);
      }
    }
  }
}

// Writes a warp's 16 x hd accumulators times `factor[half]` (half 0: row g, 1: row g + 8) as
// bf16 rows: row r to dst + r * row_stride, only rows r < rows.
template <int NS>
__device__ __forceinline__ void store_rows(bf16* dst, int64_t row_stride, int rows,
                                           const float (&acc)[2 * NS][4], const float (&factor)[2],
                                           int lane) {
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = g + 8 * half;
    if (r >= rows) continue;
#pragma unroll
    for (int j = 0; j < 2 * NS; ++j)
      store_pair(dst + r * row_stride + 8 * j + 2 * t,
                 pack_bf16(acc[j][2 * half] * factor[half], acc[j][2 * half + 1] * factor[half]));
  }
}

__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(kFullMask, v, 1));
  return fmaxf(v, __shfl_xor_sync(kFullMask, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(kFullMask, v, 1);
  return v + __shfl_xor_sync(kFullMask, v, 2);
}

// The pairs of n-tiles (16 keys each) of the key tile at k0 that any of the 16 query rows from
// row0 can see.
__device__ __forceinline__ int visible_pairs(int64_t row0, int64_t k0) {
  const int64_t n = (row0 + 15 - k0) / 16 + 1;
  return static_cast<int>(n < kTile / 16 ? n : kTile / 16);
}

// The tile a block owns: the last first (the most work under a causal mask).
__device__ __forceinline__ int64_t heavy_first(bool last_is_heaviest) {
  return last_is_heaviest ? int64_t{gridDim.x} - 1 - blockIdx.x : int64_t{blockIdx.x};
}

template <int NS, bool Cap>
__global__ void __launch_bounds__(kThreads)
    attention_mma_forward_kernel(bf16* __restrict__ out, float* __restrict__ lse,
                                 const bf16* __restrict__ q, const bf16* __restrict__ k,
                                 const bf16* __restrict__ v, Geometry geo) {
  extern __shared__ __align__(128) unsigned char mma_smem[];
  constexpr int hd = NS * 16, ld = row_ld(hd);
  bf16* sq = reinterpret_cast<bf16*>(mma_smem);
  bf16* sk = sq + kTile * ld;
  bf16* sv = sk + kTile * ld;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int g = lane / 4, t = lane % 4;

  const int64_t b = blockIdx.z, h = blockIdx.y, hk = h / (geo.heads / geo.kv_heads);
  const int64_t q0 = heavy_first(true) * kTile, row0 = q0 + warp * 16;
  const int64_t qs = geo.heads * hd, kvs = geo.kv_heads * hd;  // token strides
  const bf16* kh = k + b * geo.seq * kvs + hk * hd;
  const bf16* vh = v + b * geo.seq * kvs + hk * hd;
  load_tile(sq, ld, q + b * geo.seq * qs + h * hd, qs, q0, geo.seq, hd);
  __syncthreads();
  // This warp's 16 query rows as A fragments, kept for every key tile; at head_dim 256 read
  // again from sq for each (64 more registers would not fit beside the accumulators).
  uint32_t qa[kWide<NS> ? 1 : NS][4];
  if constexpr (!kWide<NS>) {
#pragma unroll
    for (int kk = 0; kk < NS; ++kk) load_a(qa[kk], sq, ld, warp * 16, kk * 16, lane);
  }

  float o[2 * NS][4];
#pragma unroll
  for (int j = 0; j < 2 * NS; ++j)
#pragma unroll
    for (int r = 0; r < 4; ++r) o[j][r] = 0.0f;
  // This lane's two rows (g and g + 8 of the warp's 16): running max (log2 units) and sum.
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  const int64_t rows[2] = {row0 + g, row0 + g + 8};
  int64_t first[2];  // each row's first key: its document's start
#pragma unroll
  for (int half = 0; half < 2; ++half)
    first[half] = rows[half] < geo.seq
                      ? gpu::doc_first(geo.doc_start, geo.window, b, geo.seq, rows[half])
                      : 0;

  const int64_t q_end = gpu::min64(q0 + kTile, geo.seq);
  const int64_t k_begin = gpu::doc_first(geo.doc_start, geo.window, b, geo.seq, q0) / kTile * kTile;
  for (int64_t k0 = k_begin; k0 < q_end; k0 += kTile) {
    __syncthreads();  // the previous tile is consumed
    load_tile(sk, ld, kh, kvs, k0, geo.seq, hd);
    load_tile(sv, ld, vh, kvs, k0, geo.seq, hd);
    __syncthreads();
    const int pairs = visible_pairs(row0, k0);
    float s[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) s[j][r] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < NS; ++kk) {
      if constexpr (kWide<NS>) load_a(qa[0], sq, ld, warp * 16, kk * 16, lane);
      const uint32_t(&a)[4] = qa[kWide<NS> ? 0 : kk];
#pragma unroll
      for (int p = 0; p < 4; ++p)
        if (p < pairs) {
          uint32_t bf[4];
          load_b_transposed(bf, sk, ld, p * 16, kk * 16, lane);
          mma_16816(s[2 * p], a, bf[0], bf[1]);
          mma_16816(s[2 * p + 1], a, bf[2], bf[3]);
        }
    }

    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int half = r / 2;
        const int64_t key = k0 + 8 * j + 2 * t + r % 2;
        const bool valid =
            j / 2 < pairs && rows[half] < geo.seq && key <= rows[half] && key >= first[half];
        s[j][r] = valid ? score_log2<Cap>(s[j][r], geo) : -INFINITY;
        tile_max[half] = fmaxf(tile_max[half], s[j][r]);
      }
    float corr[2], base[2], sum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float m_new = fmaxf(m[half], quad_max(tile_max[half]));
      // Nothing seen yet (m_new = -Inf): every p is 0 and the accumulators stay 0.
      base[half] = m_new == -INFINITY ? 0.0f : m_new;
      corr[half] = exp2f(m[half] - base[half]);
      m[half] = m_new;
    }
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        s[j][r] = exp2f(s[j][r] - base[r / 2]);
        sum[r / 2] += s[j][r];
      }
#pragma unroll
    for (int half = 0; half < 2; ++half) l[half] = l[half] * corr[half] + sum[half];
#pragma unroll
    for (int j = 0; j < 2 * NS; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) o[j][r] *= corr[r / 2];
    accumulate<NS, 4>(o, s, sv, 0, ld, pairs, lane);
  }

  float inv[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    l[half] = quad_sum(l[half]);
    inv[half] = l[half] > 0.0f ? 1.0f / l[half] : 0.0f;
  }
  const int n_rows = static_cast<int>(gpu::min64(16, geo.seq - gpu::min64(row0, geo.seq)));
  store_rows<NS>(out + (b * geo.seq + row0) * qs + h * hd, qs, n_rows, o, inv, lane);
  if (t == 0)
#pragma unroll
    for (int half = 0; half < 2; ++half)
      if (rows[half] < geo.seq)
        lse[(b * geo.heads + h) * geo.seq + rows[half]] = (m[half] + log2f(l[half])) * kLn2;
}

// D = dout . out for `row` (0 past the sequence), over the quad's 4 lanes (each a quarter of
// head_dim); every lane of the warp calls it. `dout_row` is in shared memory.
__device__ __forceinline__ float row_d(const bf16* dout_row, const bf16* out_row, bool valid, int t,
                                       int hd) {
  float sum = 0.0f;
  if (valid)
    for (int d = t * (hd / 4); d < (t + 1) * (hd / 4); ++d)
      sum += gpu::to_f32(dout_row[d]) * gpu::to_f32(out_row[d]);
  return quad_sum(sum);
}

template <int NS, bool Cap>
__global__ void __launch_bounds__(kThreads)
    attention_mma_dq_kernel(bf16* __restrict__ dq, const bf16* __restrict__ dout,
                            const bf16* __restrict__ q, const bf16* __restrict__ k,
                            const bf16* __restrict__ v, const bf16* __restrict__ out,
                            const float* __restrict__ lse, Geometry geo) {
  extern __shared__ __align__(128) unsigned char mma_smem[];
  constexpr int hd = NS * 16, ld = row_ld(hd);
  bf16* sq = reinterpret_cast<bf16*>(mma_smem);
  bf16* sdo = sq + kTile * ld;
  bf16* sk = sdo + kTile * ld;
  bf16* sv = sk + kTile * ld;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int g = lane / 4, t = lane % 4;

  const int64_t b = blockIdx.z, h = blockIdx.y, hk = h / (geo.heads / geo.kv_heads);
  const int64_t q0 = heavy_first(true) * kTile, row0 = q0 + warp * 16;
  const int64_t qs = geo.heads * hd, kvs = geo.kv_heads * hd;
  const int64_t q_base = b * geo.seq * qs + h * hd;
  const bf16* kh = k + b * geo.seq * kvs + hk * hd;
  const bf16* vh = v + b * geo.seq * kvs + hk * hd;
  load_tile(sq, ld, q + q_base, qs, q0, geo.seq, hd);
  load_tile(sdo, ld, dout + q_base, qs, q0, geo.seq, hd);
  __syncthreads();

  const int64_t rows[2] = {row0 + g, row0 + g + 8};
  float row_lse[2], dd[2];
  int64_t first[2];  // each row's first key: its document's start
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const bool valid = rows[half] < geo.seq;
    first[half] = valid ? gpu::doc_first(geo.doc_start, geo.window, b, geo.seq, rows[half]) : 0;
    row_lse[half] = valid ? lse[(b * geo.heads + h) * geo.seq + rows[half]] * kLog2e : 0.0f;
    dd[half] =
        row_d(sdo + (warp * 16 + g + 8 * half) * ld, out + q_base + rows[half] * qs, valid, t, hd);
  }
  float acc[2 * NS][4];
#pragma unroll
  for (int j = 0; j < 2 * NS; ++j)
#pragma unroll
    for (int r = 0; r < 4; ++r) acc[j][r] = 0.0f;

  const int64_t q_end = gpu::min64(q0 + kTile, geo.seq);
  const int64_t k_begin = gpu::doc_first(geo.doc_start, geo.window, b, geo.seq, q0) / kTile * kTile;
  for (int64_t k0 = k_begin; k0 < q_end; k0 += kTile) {
    __syncthreads();
    load_tile(sk, ld, kh, kvs, k0, geo.seq, hd);
    load_tile(sv, ld, vh, kvs, k0, geo.seq, hd);
    __syncthreads();
    // The tile in parts of KP pairs of n-tiles (16 keys each): one part of 64 keys, or at
    // head_dim 256 two of 32, so that S and dP of a part fit beside the accumulators.
    constexpr int KP = kWide<NS> ? 2 : 4;
    const int visible = visible_pairs(row0, k0);
#pragma unroll
    for (int part = 0; part < 4 / KP; ++part) {
      const int pairs = visible - part * KP < KP ? visible - part * KP : KP;
      if (pairs <= 0) break;
      const int key0 = part * KP * 16;  // the part's first key in the tile
      float s[2 * KP][4], dp[2 * KP][4];
      scores<NS, KP>(s, sq, warp * 16, sk, key0, ld, pairs, lane);
      scores<NS, KP>(dp, sdo, warp * 16, sv, key0, ld, pairs, lane);
#pragma unroll
      for (int j = 0; j < 2 * KP; ++j)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int half = r / 2;
          const int64_t key = k0 + key0 + 8 * j + 2 * t + r % 2;
          const bool valid =
              j / 2 < pairs && rows[half] < geo.seq && key <= rows[half] && key >= first[half];
          const float sl = valid ? score_log2<Cap>(s[j][r], geo) : 0.0f;
          const float p = valid ? exp2f(sl - row_lse[half]) : 0.0f;
          s[j][r] = valid ? p * (dp[j][r] - dd[half]) * cap_slope<Cap>(sl, geo) : 0.0f;  // dS
        }
      accumulate<NS, KP>(acc, s, sk, key0, ld, pairs, lane);
    }
  }
  const int n_rows = static_cast<int>(gpu::min64(16, geo.seq - gpu::min64(row0, geo.seq)));
  const float factor[2] = {geo.scale, geo.scale};
  store_rows<NS>(dq + q_base + row0 * qs, qs, n_rows, acc, factor, lane);
}

template <int NS, bool Cap>
__global__ void __launch_bounds__(kThreads)
    attention_mma_dkdv_kernel(bf16* __restrict__ dk, bf16* __restrict__ dv,
                              const bf16* __restrict__ dout, const bf16* __restrict__ q,
                              const bf16* __restrict__ k, const bf16* __restrict__ v,
                              const bf16* __restrict__ out, const float* __restrict__ lse,
                              Geometry geo) {
  extern __shared__ __align__(128) unsigned char mma_smem[];
  constexpr int hd = NS * 16, ld = row_ld(hd);
  // The slices of dk and dv this block accumulates: all, or at head_dim 256 one half of them
  // (blockIdx.y's lowest bit says which).
  constexpr int NA = kWide<NS> ? NS / 2 : NS, split = NS / NA;
  bf16* sk = reinterpret_cast<bf16*>(mma_smem);
  bf16* sv = sk + kTile * ld;
  bf16* sq = sv + kTile * ld;
  bf16* sdo = sq + kTile * ld;
  float* tile_lse = reinterpret_cast<float*>(mma_smem + tiles_bytes(hd, 4));  // log2 units
  float* tile_d = tile_lse + kTile;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int g = lane / 4, t = lane % 4;

  const int64_t b = blockIdx.z, hk = blockIdx.y / split;
  const int col0 = static_cast<int>(blockIdx.y % split) * NA * 16;  // this block's dk, dv columns
  const int64_t k0 = heavy_first(false) * kTile, key_row0 = k0 + warp * 16;
  const int64_t qs = geo.heads * hd, kvs = geo.kv_heads * hd;
  const int64_t kv_base = b * geo.seq * kvs + hk * hd;
  load_tile(sk, ld, k + kv_base, kvs, k0, geo.seq, hd);
  load_tile(sv, ld, v + kv_base, kvs, k0, geo.seq, hd);

  float dk_acc[2 * NA][4], dv_acc[2 * NA][4];
#pragma unroll
  for (int j = 0; j < 2 * NA; ++j)
#pragma unroll
    for (int r = 0; r < 4; ++r) dk_acc[j][r] = dv_acc[j][r] = 0.0f;
  const int64_t keys[2] = {key_row0 + g, key_row0 + g + 8};
  const int64_t group = geo.heads / geo.kv_heads;
  for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
    const int64_t q_base = b * geo.seq * qs + h * hd;
    const float* head_lse = lse + (b * geo.heads + h) * geo.seq;
    // k0 is a multiple of 64: query tiles start at k0, the first row that can see these keys.
    for (int64_t i0 = k0; i0 < geo.seq; i0 += kTile) {
      // Queries from i0 on belong to documents that start after these keys: none sees them.
      if (gpu::doc_first(geo.doc_start, geo.window, b, geo.seq, i0) >= k0 + kTile)
        break;          // the whole block
      __syncthreads();  // the previous tile's sq, sdo, tile_lse and tile_d are consumed
      load_tile(sq, ld, q + q_base, qs, i0, geo.seq, hd);
      load_tile(sdo, ld, dout + q_base, qs, i0, geo.seq, hd);
      __syncthreads();
      {  // lse and D of the tile's 64 query rows: each quad two rows
        const int quad = static_cast<int>(threadIdx.x) / 4;  // 0-31
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int row = quad + 32 * half;
          const int64_t tq = i0 + row;
          const float dd = row_d(sdo + row * ld, out + q_base + tq * qs, tq < geo.seq, t, hd);
          if (t == 0) {
            tile_lse[row] = tq < geo.seq ? head_lse[tq] * kLog2e : 0.0f;
            tile_d[row] = dd;
          }
        }
      }
      __syncthreads();
#pragma unroll
      for (int c = 0; c < 2; ++c) {  // queries [i0 + 32 c, i0 + 32 c + 32)
        const int c0 = 32 * c;
        // The pairs of n-tiles (16 queries) that can see any of this warp's keys.
        const int64_t first_visible = key_row0 - (i0 + c0);  // queries before it see none
        if (first_visible >= 32) continue;
        const int skip = first_visible > 0 ? static_cast<int>(first_visible / 16) : 0;
        const int pairs = 2 - skip;
        float st[4][4], dpt[4][4];
        // Computed for the last `pairs` pairs, stored from index 0: pair p is queries
        // c0 + 16 (skip + p).
        scores<NS, 2>(st, sk, warp * 16, sq, c0 + 16 * skip, ld, pairs, lane);
        scores<NS, 2>(dpt, sv, warp * 16, sdo, c0 + 16 * skip, ld, pairs, lane);
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            const int col = c0 + 16 * skip + 8 * j + 2 * t + r % 2;
            const int64_t tq = i0 + col;
            const bool valid =
                j / 2 < pairs && tq < geo.seq && keys[r / 2] <= tq &&
                keys[r / 2] >= gpu::doc_first(geo.doc_start, geo.window, b, geo.seq, tq);
            // col may pass 63 only where j / 2 >= pairs: read nothing then.
            const int c_safe = valid ? col : 0;
            const float sl = valid ? score_log2<Cap>(st[j][r], geo) : 0.0f;
            const float p = valid ? exp2f(sl - tile_lse[c_safe]) : 0.0f;
            st[j][r] = p;
            dpt[j][r] = valid ? p * (dpt[j][r] - tile_d[c_safe]) * cap_slope<Cap>(sl, geo) : 0.0f;
          }
        accumulate<NA, 2>(dv_acc, st, sdo + col0, c0 + 16 * skip, ld, pairs, lane);
        accumulate<NA, 2>(dk_acc, dpt, sq + col0, c0 + 16 * skip, ld, pairs, lane);
      }
    }
  }
  const int n_rows = static_cast<int>(gpu::min64(16, geo.seq - gpu::min64(key_row0, geo.seq)));
  const float dk_factor[2] = {geo.scale, geo.scale}, dv_factor[2] = {1.0f, 1.0f};
  store_rows<NA>(dk + kv_base + key_row0 * kvs + col0, kvs, n_rows, dk_acc, dk_factor, lane);
  store_rows<NA>(dv + kv_base + key_row0 * kvs + col0, kvs, n_rows, dv_acc, dv_factor, lane);
}

Geometry geometry(const AttentionDims& d) {
  const float scale = d.scale > 0.0f ? d.scale : 1.0f / sqrtf(static_cast<float>(d.head_dim));
  const float cap = d.softcap;
  return Geometry{d.seq,
                  d.heads,
                  d.kv_heads,
                  scale,
                  scale * kLog2e,
                  cap > 0.0f ? cap * kLog2e : 0.0f,
                  cap > 0.0f ? scale / cap : 0.0f,
                  d.doc_start,
                  d.window};
}

// Calls f.template operator()<NS, Cap>() with NS = head_dim / 16, for the head_dims
// mma_attention_head_dim takes, and Cap whether the scores are capped.
template <typename F>
void dispatch_mma(const AttentionDims& d, F&& f) {
  const auto with_cap = [&]<int NS>() {
    if (d.softcap > 0.0f)
      f.template operator()<NS, true>();
    else
      f.template operator()<NS, false>();
  };
  if (d.head_dim == 256)
    with_cap.template operator()<16>();
  else
    dispatch_slices(d.head_dim, with_cap);
}

}  // namespace

uint64_t attention_mma_forward_shared_bytes(int64_t head_dim) {
  return forward_bytes(static_cast<int>(head_dim));
}

uint64_t attention_mma_backward_shared_bytes(int64_t head_dim) {
  return std::max(dq_bytes(static_cast<int>(head_dim)), dkdv_bytes(static_cast<int>(head_dim)));
}

bool attention_mma_forward(void* out, float* lse, const void* q, const void* k, const void* v,
                           DType t, const AttentionDims& dims, uint64_t max_shared_bytes,
                           cudaStream_t stream) {
  const uint64_t bytes = dims.head_dim > 0 ? forward_bytes(static_cast<int>(dims.head_dim)) : 0;
  if (!applies(attention_kernels() == AttentionKernels::kMma, mma_attention_head_dim(dims.head_dim),
               t, dims, bytes, max_shared_bytes, {out, q, k, v}))
    return false;
  dispatch_mma(dims, [&]<int NS, bool Cap>() {
    auto* kernel = attention_mma_forward_kernel<NS, Cap>;
    gpu::allow_dynamic_shared(kernel, bytes);
    kernel<<<grid_of(dims.seq, dims.heads, dims.batch), kThreads, bytes, stream>>>(
        static_cast<bf16*>(out), lse, static_cast<const bf16*>(q), static_cast<const bf16*>(k),
        static_cast<const bf16*>(v), geometry(dims));
    CUDA_CHECK_LAUNCH();
  });
  return true;
}

bool attention_mma_backward(void* dq, void* dk, void* dv, const void* dout, const void* q,
                            const void* k, const void* v, const void* out, const float* lse,
                            DType t, const AttentionDims& dims, uint64_t max_shared_bytes,
                            cudaStream_t stream) {
  const int hd = static_cast<int>(dims.head_dim);
  const uint64_t bytes = hd > 0 ? attention_mma_backward_shared_bytes(hd) : 0;
  if (!applies(attention_kernels() == AttentionKernels::kMma, mma_attention_head_dim(dims.head_dim),
               t, dims, bytes, max_shared_bytes, {dq, dk, dv, dout, q, k, v, out}))
    return false;
  const Geometry g = geometry(dims);
  dispatch_mma(dims, [&]<int NS, bool Cap>() {
    auto* dq_kernel = attention_mma_dq_kernel<NS, Cap>;
    gpu::allow_dynamic_shared(dq_kernel, dq_bytes(hd));
    dq_kernel<<<grid_of(dims.seq, dims.heads, dims.batch), kThreads, dq_bytes(hd), stream>>>(
        static_cast<bf16*>(dq), static_cast<const bf16*>(dout), static_cast<const bf16*>(q),
        static_cast<const bf16*>(k), static_cast<const bf16*>(v), static_cast<const bf16*>(out),
        lse, g);
    CUDA_CHECK_LAUNCH();
    auto* kv_kernel = attention_mma_dkdv_kernel<NS, Cap>;
    gpu::allow_dynamic_shared(kv_kernel, dkdv_bytes(hd));
    // At head_dim 256 two blocks per tile of keys, each accumulating half of dk and dv.
    const int64_t split = kWide<NS> ? 2 : 1;
    kv_kernel<<<grid_of(dims.seq, dims.kv_heads * split, dims.batch), kThreads, dkdv_bytes(hd),
                stream>>>(static_cast<bf16*>(dk), static_cast<bf16*>(dv),
                          static_cast<const bf16*>(dout), static_cast<const bf16*>(q),
                          static_cast<const bf16*>(k), static_cast<const bf16*>(v),
                          static_cast<const bf16*>(out), lse, g);
    CUDA_CHECK_LAUNCH();
  });
  return true;
}

}  // namespace strata
