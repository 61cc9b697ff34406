// attention.cu: causal grouped-query attention, forward and backward, tiled so that the T x T
// score matrix never exists (the flash-attention algorithm, in plain f32 SIMT code). bf16 calls
// with head_dim a multiple of 16 up to 128 and Llama's plain scores go to the tensor-core kernels
// first (attention_mma.cu, then attention_tc.cu).
//
// Layouts (core/kernels.h): q, out [B,T,H,hd]; k, v [B,Tk,Hkv,hd]; lse [B,H,T] f32; query head h
// reads kv head h / (H / Hkv). Scores are scale * q.k with scale = 1/sqrt(hd) or the mask's, and
// with a softcap c then c * tanh(score / c), whose slope 1 - (score / c)^2 the backward's dS
// takes (Gemma 2's). Query t sits at
// position t + Tk - T; only the forward takes Tk > T (decoding against cached keys), the
// backward has Tk = T.
//
// Every kernel runs 8 warps and works on tiles of 32 keys, one key per lane, staged in shared
// memory as f32 with a row stride of hd + 1 (odd), so the 32 lanes reading 32 different key rows
// at the same column hit 32 different banks.
// - forward: a block owns Br query rows of one (batch, head); each warp owns R of them and
//   keeps their online-softmax state (max m, sum l, output accumulator, lane d = lane + 32 r)
//   in registers while it walks the key tiles up to the diagonal; lse = m + log(l).
// - backward, two kernels, no atomics (deterministic):
//   dq: like the forward, per query row: P = exp(S - lse), dP = dout.v,
//       dS = P * (dP - D) with D = dout.out, dq = scale * sum_j dS_j k_j.
//   dk/dv: a block owns 32 keys of one (batch, kv head) and walks every query row at or after
//       them, for each query head of the group. Per query tile it first computes P and dS
//       (lane = key) into shared memory, then each warp accumulates 4 keys' dk and dv rows in
//       registers: dv_j += P_ij dout_i, dk_j += scale * dS_ij q_i.
// A masked (future) key is skipped, not multiplied by zero, so an Inf in a value the query
// cannot see does not turn its output into NaN (0 * Inf).
// Documents packed into sequences (AttentionDims::doc_start): query t also skips the keys before
// its document's first position. The forward and dq kernels start at the key tile holding the
// block's first row's document start (the least, as starts never decrease along a sequence);
// the dk/dv kernel stops at the first query tile whose document starts after its keys.
#include "gpu/kernel_common.cuh"
#include "gpu/ops.h"

#include <atomic>

namespace strata {
namespace {

using gpu::from_f32;
using gpu::kFullMask;
using gpu::to_f32;
using gpu::warp_max;
using gpu::warp_sum;

constexpr int kWarps = 8;
constexpr int kBlockThreads = kWarps * 32;
constexpr int kKeys = 32;                     // keys per tile: one per lane
constexpr int kKeysPerWarp = kKeys / kWarps;  // dk/dv rows each warp accumulates

// Query rows per warp in the forward and dq kernels: fewer for wide heads, whose accumulators
// (R x NR registers) and shared tiles are larger.
__host__ __device__ constexpr int rows_per_warp(int nr) {
  return nr <= 4 ? 4 : 2;
}
// NR = head_dim / 32 rounded up to a power of two: the accumulator slots each lane holds.
constexpr int slots_for(int64_t head_dim) {
  return head_dim <= 32 ? 1 : head_dim <= 64 ? 2 : head_dim <= 128 ? 4 : 8;
}

struct Geometry {
  int64_t seq, heads, kv_heads;
  int hd;
  float scale;
  int64_t kv_seq;  // Tk >= seq: the keys' positions (the forward's); the backward's equal seq
  const int32_t* doc_start;  // AttentionDims::doc_start: [batch * seq], or null
  int64_t window;            // AttentionDims::window: 0, or a sliding window
  float softcap;             // AttentionDims::softcap: 0, or the scores' cap
};

// A scaled score through the cap (none where it is 0), and the cap's slope at it.
__device__ __forceinline__ float capped(float s, float cap) {
  return cap > 0.0f ? cap * tanhf(s / cap) : s;
}
__device__ __forceinline__ float cap_slope(float capped_s, float cap) {
  return cap > 0.0f ? 1.0f - (capped_s / cap) * (capped_s / cap) : 1.0f;
}

uint64_t forward_bytes(int64_t hd) {
  const int64_t br = kWarps * rows_per_warp(slots_for(hd));
  return static_cast<uint64_t>(br * hd + 2 * kKeys * (hd + 1)) * sizeof(float);
}
uint64_t dq_bytes(int64_t hd) {
  const int64_t br = kWarps * rows_per_warp(slots_for(hd));
  return static_cast<uint64_t>(2 * br * hd + 2 * kKeys * (hd + 1)) * sizeof(float);
}
uint64_t dkdv_bytes(int64_t hd, int64_t brq) {
  return static_cast<uint64_t>(2 * kKeys * (hd + 1) + 2 * brq * hd + 2 * brq * kKeys) *
         sizeof(float);
}

// Rows [t0, t0 + rows) of one head into shared memory as f32 with row stride `ld`; rows at or
// past `seq` are zero. `src` points at the head's first element of token 0.
template <typename T>
__device__ void load_tile(float* dst, int ld, const T* __restrict__ src, int64_t token_stride,
                          int64_t t0, int rows, int64_t seq, int hd) {
  for (int e = threadIdx.x; e < rows * hd; e += blockDim.x) {
    const int r = e / hd, d = e - r * hd;
    const int64_t t = t0 + r;
    dst[r * ld + d] = t < seq ? to_f32(src[t * token_stride + d]) : 0.0f;
  }
}

// Dot products over hd elements of shared memory: s = a.b and, in the same loop, dp = c.e.
__device__ __forceinline__ float dot(const float* a, const float* b, int hd) {
  float s = 0.0f;
  for (int d = 0; d < hd; ++d) s += a[d] * b[d];
  return s;
}
__device__ __forceinline__ void dot2(const float* a, const float* b, const float* c, const float* e,
                                     int hd, float& s, float& dp) {
  s = 0.0f;
  dp = 0.0f;
  for (int d = 0; d < hd; ++d) {
    s += a[d] * b[d];
    dp += c[d] * e[d];
  }
}

// D = dout . out of one query row (dout staged in shared memory, out in global), on every lane.
template <typename T>
__device__ __forceinline__ float row_d(const float* dout_row, const T* out_row, int lane, int hd) {
  float sum = 0.0f;
  for (int d = lane; d < hd; d += 32) sum += dout_row[d] * to_f32(out_row[d]);
  return warp_sum(sum);
}

// acc[r] += sum over j0 <= j < n of w_j * tile[j][lane + 32 r], where lane j holds w_j.
template <int NR>
__device__ __forceinline__ void accumulate(float (&acc)[NR], float w, const float* tile, int ks,
                                           int j0, int n, int lane, int hd) {
  for (int j = j0; j < n; ++j) {
    const float wj = __shfl_sync(kFullMask, w, j);
    const float* row = tile + j * ks;
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      const int d = lane + 32 * r;
      if (d < hd) acc[r] += wj * row[d];
    }
  }
}

// dst[lane + 32 r] = factor * acc[r], for the row's hd elements.
template <typename T, int NR>
__device__ __forceinline__ void store_row(T* dst, const float (&acc)[NR], float factor, int lane,
                                          int hd) {
#pragma unroll
  for (int r = 0; r < NR; ++r) {
    const int d = lane + 32 * r;
    if (d < hd) dst[d] = from_f32<T>(factor * acc[r]);
  }
}

template <typename T, int NR>
__global__ void __launch_bounds__(kBlockThreads)
    attention_forward_kernel(T* __restrict__ out, float* __restrict__ lse, const T* __restrict__ q,
                             const T* __restrict__ k, const T* __restrict__ v, Geometry g) {
  constexpr int R = rows_per_warp(NR), Br = kWarps * R;
  extern __shared__ float smem[];
  const int hd = g.hd, ks = hd + 1;
  float* sq = smem;             // [Br][hd]
  float* sk = sq + Br * hd;     // [kKeys][ks]
  float* sv = sk + kKeys * ks;  // [kKeys][ks]
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t b = blockIdx.z, h = blockIdx.y, hk = h / (g.heads / g.kv_heads);
  const int64_t q0 = int64_t{blockIdx.x} * Br;
  const int64_t qs = g.heads * hd, kvs = g.kv_heads * hd;  // token strides
  const T* qh = q + b * g.seq * qs + h * hd;
  const T* kh = k + b * g.kv_seq * kvs + hk * hd;
  const T* vh = v + b * g.kv_seq * kvs + hk * hd;
  const int64_t shift = g.kv_seq - g.seq;  // query t sits at position t + shift
  load_tile(sq, hd, qh, qs, q0, Br, g.seq, hd);

  float m[R], l[R], acc[R][NR];
#pragma unroll
  for (int rr = 0; rr < R; ++rr) {
    m[rr] = -INFINITY;
    l[rr] = 0.0f;
#pragma unroll
    for (int r = 0; r < NR; ++r) acc[rr][r] = 0.0f;
  }

  int64_t first[R];  // each row's first key: its document's start or its window's
#pragma unroll
  for (int rr = 0; rr < R; ++rr) {
    const int64_t t = q0 + warp * R + rr;
    first[rr] = t < g.seq ? gpu::doc_first(g.doc_start, g.window, b, g.seq, t, shift) : 0;
  }
  const int64_t q_end = gpu::min64(q0 + Br, g.seq);
  const int64_t k_begin =
      gpu::doc_first(g.doc_start, g.window, b, g.seq, q0, shift) / kKeys * kKeys;
  for (int64_t k0 = k_begin; k0 < q_end + shift; k0 += kKeys) {
    __syncthreads();  // the previous tile is consumed (and the first time: sq is written)
    load_tile(sk, ks, kh, kvs, k0, kKeys, g.kv_seq, hd);
    load_tile(sv, ks, vh, kvs, k0, kKeys, g.kv_seq, hd);
    __syncthreads();
#pragma unroll
    for (int rr = 0; rr < R; ++rr) {
      const int row = warp * R + rr;
      const int64_t t = q0 + row, last = t + shift;  // the last key row t sees
      if (t >= g.seq) continue;                      // the same for the whole warp
      // A tile past `last` (with shift > 0, the block's later rows see further), or before the
      // row's document, changes nothing: its scores are -inf, corr is 1, nothing accumulates.
      if (k0 > last || k0 + kKeys <= first[rr]) continue;
      float s = dot(sq + row * hd, sk + lane * ks, hd);
      // Every tile that gets here holds a key in [first, last], so m_new is finite for finite
      // input.
      const bool visible = k0 + lane <= last && k0 + lane >= first[rr];
      s = visible ? capped(s * g.scale, g.softcap) : -INFINITY;
      const float m_new = fmaxf(m[rr], warp_max(s));
      const float corr = m[rr] == -INFINITY ? 0.0f : expf(m[rr] - m_new);
      const float p = visible ? expf(s - m_new) : 0.0f;
      l[rr] = l[rr] * corr + warp_sum(p);
      m[rr] = m_new;
#pragma unroll
      for (int r = 0; r < NR; ++r) acc[rr][r] *= corr;
      const int visible_keys = static_cast<int>(gpu::min64(kKeys, last - k0 + 1));
      const int j0 = first[rr] > k0 ? static_cast<int>(first[rr] - k0) : 0;
      accumulate(acc[rr], p, sv, ks, j0, visible_keys, lane, hd);
    }
  }

#pragma unroll
  for (int rr = 0; rr < R; ++rr) {
    const int64_t t = q0 + warp * R + rr;
    if (t >= g.seq) continue;
    store_row(out + (b * g.seq + t) * qs + h * hd, acc[rr], 1.0f / l[rr], lane, hd);
    if (lane == 0) lse[(b * g.heads + h) * g.seq + t] = m[rr] + logf(l[rr]);
  }
}

template <typename T, int NR>
__global__ void __launch_bounds__(kBlockThreads)
    attention_dq_kernel(T* __restrict__ dq, const T* __restrict__ dout, const T* __restrict__ q,
                        const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ out,
                        const float* __restrict__ lse, Geometry g) {
  constexpr int R = rows_per_warp(NR), Br = kWarps * R;
  extern __shared__ float smem[];
  const int hd = g.hd, ks = hd + 1;
  float* sq = smem;             // [Br][hd]
  float* sdo = sq + Br * hd;    // [Br][hd]
  float* sk = sdo + Br * hd;    // [kKeys][ks]
  float* sv = sk + kKeys * ks;  // [kKeys][ks]
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t b = blockIdx.z, h = blockIdx.y, hk = h / (g.heads / g.kv_heads);
  const int64_t q0 = int64_t{blockIdx.x} * Br;
  const int64_t qs = g.heads * hd, kvs = g.kv_heads * hd;
  const int64_t q_base = b * g.seq * qs + h * hd;
  const T* kh = k + b * g.seq * kvs + hk * hd;
  const T* vh = v + b * g.seq * kvs + hk * hd;
  load_tile(sq, hd, q + q_base, qs, q0, Br, g.seq, hd);
  load_tile(sdo, hd, dout + q_base, qs, q0, Br, g.seq, hd);
  __syncthreads();

  float row_lse[R], row_dd[R], acc[R][NR];
  int64_t first[R];  // each row's first key: its document's start
#pragma unroll
  for (int rr = 0; rr < R; ++rr) {
    const int row = warp * R + rr;
    const int64_t t = q0 + row;
    row_lse[rr] = 0.0f;
    row_dd[rr] = 0.0f;
    first[rr] = 0;
#pragma unroll
    for (int r = 0; r < NR; ++r) acc[rr][r] = 0.0f;
    if (t >= g.seq) continue;
    row_lse[rr] = lse[(b * g.heads + h) * g.seq + t];
    row_dd[rr] = row_d(sdo + row * hd, out + q_base + t * qs, lane, hd);
    first[rr] = gpu::doc_first(g.doc_start, g.window, b, g.seq, t);
  }

  const int64_t q_end = gpu::min64(q0 + Br, g.seq);
  const int64_t k_begin = gpu::doc_first(g.doc_start, g.window, b, g.seq, q0) / kKeys * kKeys;
  for (int64_t k0 = k_begin; k0 < q_end; k0 += kKeys) {
    __syncthreads();
    load_tile(sk, ks, kh, kvs, k0, kKeys, g.seq, hd);
    load_tile(sv, ks, vh, kvs, k0, kKeys, g.seq, hd);
    __syncthreads();
#pragma unroll
    for (int rr = 0; rr < R; ++rr) {
      const int row = warp * R + rr;
      const int64_t t = q0 + row;
      if (t >= g.seq || k0 > t || k0 + kKeys <= first[rr]) continue;  // the same for the warp
      float s, dp;
      dot2(sq + row * hd, sk + lane * ks, sdo + row * hd, sv + lane * ks, hd, s, dp);
      float ds = 0.0f;
      if (k0 + lane <= t && k0 + lane >= first[rr]) {
        const float sc = capped(s * g.scale, g.softcap);
        ds = expf(sc - row_lse[rr]) * (dp - row_dd[rr]) * cap_slope(sc, g.softcap);
      }
      const int visible_keys = static_cast<int>(gpu::min64(kKeys, t - k0 + 1));
      const int j0 = first[rr] > k0 ? static_cast<int>(first[rr] - k0) : 0;
      accumulate(acc[rr], ds, sk, ks, j0, visible_keys, lane, hd);
    }
  }

#pragma unroll
  for (int rr = 0; rr < R; ++rr) {
    const int64_t t = q0 + warp * R + rr;
    if (t >= g.seq) continue;
    store_row(dq + q_base + t * qs, acc[rr], g.scale, lane, hd);
  }
}

template <typename T, int NR>
__global__ void __launch_bounds__(kBlockThreads)
    attention_dkdv_kernel(T* __restrict__ dk, T* __restrict__ dv, const T* __restrict__ dout,
                          const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                          const T* __restrict__ out, const float* __restrict__ lse, Geometry g,
                          int brq) {
  extern __shared__ float smem[];
  const int hd = g.hd, ks = hd + 1;
  float* sk = smem;               // [kKeys][ks]
  float* sv = sk + kKeys * ks;    // [kKeys][ks]
  float* sq = sv + kKeys * ks;    // [brq][hd]
  float* sdo = sq + brq * hd;     // [brq][hd]
  float* sp = sdo + brq * hd;     // [brq][kKeys]
  float* sds = sp + brq * kKeys;  // [brq][kKeys]
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t b = blockIdx.z, hk = blockIdx.y;
  const int64_t k0 = int64_t{blockIdx.x} * kKeys;
  const int64_t qs = g.heads * hd, kvs = g.kv_heads * hd;
  const int64_t kv_base = b * g.seq * kvs + hk * hd;
  load_tile(sk, ks, k + kv_base, kvs, k0, kKeys, g.seq, hd);
  load_tile(sv, ks, v + kv_base, kvs, k0, kKeys, g.seq, hd);

  float dk_acc[kKeysPerWarp][NR], dv_acc[kKeysPerWarp][NR];
#pragma unroll
  for (int c = 0; c < kKeysPerWarp; ++c) {
#pragma unroll
    for (int r = 0; r < NR; ++r) dk_acc[c][r] = dv_acc[c][r] = 0.0f;
  }

  const int64_t group = g.heads / g.kv_heads;
  const int rows_each = brq / kWarps;  // phase-1 query rows per warp
  for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
    const int64_t q_base = b * g.seq * qs + h * hd;
    const float* row_lse = lse + (b * g.heads + h) * g.seq;
    // k0 is a multiple of 32 and brq divides 32: query tiles start at k0, the first row that
    // can see these keys.
    for (int64_t i0 = k0; i0 < g.seq; i0 += brq) {
      // Queries from i0 on belong to documents that start after these keys: none sees them.
      if (gpu::doc_first(g.doc_start, g.window, b, g.seq, i0) >= k0 + kKeys)
        break;          // the whole block
      __syncthreads();  // phase 2 of the previous tile is done with sq, sdo, sp, sds
      load_tile(sq, hd, q + q_base, qs, i0, brq, g.seq, hd);
      load_tile(sdo, hd, dout + q_base, qs, i0, brq, g.seq, hd);
      __syncthreads();
      // Phase 1: P and dS for (query row, key = lane).
      for (int rr = 0; rr < rows_each; ++rr) {
        const int row = warp * rows_each + rr;
        const int64_t t = i0 + row;
        float p = 0.0f, ds = 0.0f;
        if (t < g.seq) {  // the same for the whole warp
          const float dd = row_d(sdo + row * hd, out + q_base + t * qs, lane, hd);
          float s, dp;
          dot2(sq + row * hd, sk + lane * ks, sdo + row * hd, sv + lane * ks, hd, s, dp);
          const int64_t key = k0 + lane;  // < seq where key <= t, as t is
          if (key <= t && key >= gpu::doc_first(g.doc_start, g.window, b, g.seq, t)) {
            const float sc = capped(s * g.scale, g.softcap);
            p = expf(sc - row_lse[t]);
            ds = p * (dp - dd) * cap_slope(sc, g.softcap);
          }
        }
        sp[row * kKeys + lane] = p;
        sds[row * kKeys + lane] = ds;
      }
      __syncthreads();
      // Phase 2: this warp's keys j accumulate sum_i P_ij dout_i and dS_ij q_i.
      const int rows = static_cast<int>(gpu::min64(brq, g.seq - i0));
      for (int i = 0; i < rows; ++i) {
        const int64_t t = i0 + i, first = gpu::doc_first(g.doc_start, g.window, b, g.seq, t);
        float qv[NR], dov[NR];
#pragma unroll
        for (int r = 0; r < NR; ++r) {
          const int d = lane + 32 * r;
          qv[r] = d < hd ? sq[i * hd + d] : 0.0f;
          dov[r] = d < hd ? sdo[i * hd + d] : 0.0f;
        }
#pragma unroll
        for (int c = 0; c < kKeysPerWarp; ++c) {
          const int j = warp * kKeysPerWarp + c;
          if (k0 + j > t || k0 + j < first) continue;  // masked: skipped, not multiplied by 0
          const float p = sp[i * kKeys + j], ds = sds[i * kKeys + j];
#pragma unroll
          for (int r = 0; r < NR; ++r) {
            dv_acc[c][r] += p * dov[r];
            dk_acc[c][r] += ds * qv[r];
          }
        }
      }
    }
  }

#pragma unroll
  for (int c = 0; c < kKeysPerWarp; ++c) {
    const int64_t key = k0 + warp * kKeysPerWarp + c;
    if (key >= g.seq) continue;
    store_row(dk + kv_base + key * kvs, dk_acc[c], g.scale, lane, hd);
    store_row(dv + kv_base + key * kvs, dv_acc[c], 1.0f, lane, hd);
  }
}

Geometry geometry(const AttentionDims& dims) {
  return Geometry{dims.seq,
                  dims.heads,
                  dims.kv_heads,
                  static_cast<int>(dims.head_dim),
                  dims.scale > 0.0f ? dims.scale : 1.0f / sqrtf(static_cast<float>(dims.head_dim)),
                  dims.keys(),
                  dims.doc_start,
                  dims.window,
                  dims.softcap};
}

// Calls f.template operator()<NR>() with NR = slots_for(head_dim).
template <typename F>
void dispatch_slots(int64_t head_dim, F&& f) {
  switch (slots_for(head_dim)) {
    case 1:
      f.template operator()<1>();
      break;
    case 2:
      f.template operator()<2>();
      break;
    case 4:
      f.template operator()<4>();
      break;
    default:
      f.template operator()<8>();
      break;
  }
}

}  // namespace

namespace {
std::atomic<AttentionKernels> g_kernels{AttentionKernels::kMma};
std::atomic<uint64_t> g_calls[3];

void count(AttentionKernels k) {
  g_calls[static_cast<int>(k)].fetch_add(1, std::memory_order_relaxed);
}
}  // namespace

uint64_t attention_calls(AttentionKernels k) {
  return g_calls[static_cast<int>(k)].load(std::memory_order_relaxed);
}

void attention_kernels(AttentionKernels k) {
  g_kernels.store(k, std::memory_order_relaxed);
}
AttentionKernels attention_kernels() {
  return g_kernels.load(std::memory_order_relaxed);
}

uint64_t attention_shared_bytes_min(int64_t head_dim) {
  return std::max({forward_bytes(head_dim), dq_bytes(head_dim), dkdv_bytes(head_dim, kWarps)});
}

uint64_t attention_backward_shared_bytes(int64_t head_dim, int64_t query_rows) {
  return dkdv_bytes(head_dim, query_rows);
}

bool attention_backward_on_tensor_cores(const AttentionDims& dims, uint64_t max_shared_bytes) {
  const int64_t hd = dims.head_dim;
  if (mma_attention_head_dim(hd) && attention_mma_backward_shared_bytes(hd) <= max_shared_bytes)
    return true;
  return dims.plain_scores() && wmma_attention_head_dim(hd) &&
         attention_tc_backward_shared_bytes(hd) <= max_shared_bytes;
}

void launch_attention_forward(void* out, float* lse, const void* q, const void* k, const void* v,
                              DType t, const AttentionDims& dims, uint64_t max_shared_bytes,
                              cudaStream_t stream) {
  if (dims.batch * dims.seq * dims.heads == 0) return;
  // The wmma path computes Llama's plain scores only.
  if (attention_mma_forward(out, lse, q, k, v, t, dims, max_shared_bytes, stream))
    return count(AttentionKernels::kMma);
  if (dims.plain_scores() &&
      attention_tc_forward(out, lse, q, k, v, t, dims, max_shared_bytes, stream))
    return count(AttentionKernels::kWmma);
  count(AttentionKernels::kSimt);
  const Geometry g = geometry(dims);
  gpu::dispatch(t, [&]<typename T>() {
    dispatch_slots(dims.head_dim, [&]<int NR>() {
      constexpr int64_t br = kWarps * rows_per_warp(NR);
      const uint64_t bytes = forward_bytes(dims.head_dim);
      auto* kernel = attention_forward_kernel<T, NR>;
      gpu::allow_dynamic_shared(kernel, bytes);
      const dim3 grid(static_cast<unsigned>((dims.seq + br - 1) / br),
                      static_cast<unsigned>(dims.heads), static_cast<unsigned>(dims.batch));
      kernel<<<grid, kBlockThreads, bytes, stream>>>(
          static_cast<T*>(out), lse, static_cast<const T*>(q), static_cast<const T*>(k),
          static_cast<const T*>(v), g);
      CUDA_CHECK_LAUNCH();
    });
  });
}

void launch_attention_backward(void* dq, void* dk, void* dv, const void* dout, const void* q,
                               const void* k, const void* v, const void* out, const float* lse,
                               DType t, const AttentionDims& dims, uint64_t max_shared_bytes,
                               cudaStream_t stream) {
  if (dims.batch * dims.seq * dims.heads == 0) return;
  if (attention_mma_backward(dq, dk, dv, dout, q, k, v, out, lse, t, dims, max_shared_bytes,
                             stream))
    return count(AttentionKernels::kMma);
  if (dims.plain_scores() &&
      attention_tc_backward(dq, dk, dv, dout, q, k, v, out, lse, t, dims, max_shared_bytes, stream))
    return count(AttentionKernels::kWmma);
  count(AttentionKernels::kSimt);
  const Geometry g = geometry(dims);
  // The largest query tile whose shared memory fits (32 rows: 8 warps x 4 in phase 1).
  int brq = 32;
  while (brq > kWarps && dkdv_bytes(dims.head_dim, brq) > max_shared_bytes) brq /= 2;
  gpu::dispatch(t, [&]<typename T>() {
    dispatch_slots(dims.head_dim, [&]<int NR>() {
      constexpr int64_t br = kWarps * rows_per_warp(NR);
      const uint64_t bytes = dq_bytes(dims.head_dim);
      auto* dq_kernel = attention_dq_kernel<T, NR>;
      gpu::allow_dynamic_shared(dq_kernel, bytes);
      const dim3 dq_grid(static_cast<unsigned>((dims.seq + br - 1) / br),
                         static_cast<unsigned>(dims.heads), static_cast<unsigned>(dims.batch));
      dq_kernel<<<dq_grid, kBlockThreads, bytes, stream>>>(
          static_cast<T*>(dq), static_cast<const T*>(dout), static_cast<const T*>(q),
          static_cast<const T*>(k), static_cast<const T*>(v), static_cast<const T*>(out), lse, g);
      CUDA_CHECK_LAUNCH();

      const uint64_t kv_bytes = dkdv_bytes(dims.head_dim, brq);
      auto* kv_kernel = attention_dkdv_kernel<T, NR>;
      gpu::allow_dynamic_shared(kv_kernel, kv_bytes);
      const dim3 kv_grid(static_cast<unsigned>((dims.seq + kKeys - 1) / kKeys),
                         static_cast<unsigned>(dims.kv_heads), static_cast<unsigned>(dims.batch));
      kv_kernel<<<kv_grid, kBlockThreads, kv_bytes, stream>>>(
          static_cast<T*>(dk), static_cast<T*>(dv), static_cast<const T*>(dout),
          static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v),
          static_cast<const T*>(out), lse, g, brq);
      CUDA_CHECK_LAUNCH();
    });
  });
}

}  // namespace strata
