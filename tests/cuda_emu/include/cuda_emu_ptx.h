// cuda_emu_ptx.h (CUDA emulator): the two warp-wide PTX instructions that strata's kernels
// reach through inline assembly on a GPU (src/gpu/mma_sync.cuh), as C++ on the emulator:
//
// - mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32: D (16 x 8, f32) += A (16 x 16, bf16)
//   . B (16 x 8, bf16). Unlike wmma's, these fragments have a layout the PTX ISA documents, and
//   the kernels rely on it, so the emulator uses exactly that one. With g = lane / 4 and
//   t = lane % 4, a lane holds
//     A: a[0] = (row g, cols 2t, 2t+1), a[1] = (g + 8, 2t..), a[2] = (g, 2t + 8..),
//        a[3] = (g + 8, 2t + 8..), two bf16 per 32-bit register, the lower column in the low half;
//     B: b[0] = (rows k = 2t, 2t + 1, col n = g), b[1] = (k = 2t + 8, 2t + 9, n = g);
//     C and D: c[0], c[1] = (row g, cols 2t, 2t + 1), c[2], c[3] = (row g + 8, the same cols).
// - ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: four 8 x 8 matrices of 16-bit elements,
//   matrix m's eight rows at the addresses lanes 8m to 8m + 7 give (16 bytes each, 16-byte
//   aligned). Lane l receives in r[m] row l / 4, elements 2 (l % 4) and 2 (l % 4) + 1 of matrix
//   m; with .trans, column l / 4, elements of rows 2 (l % 4) and 2 (l % 4) + 1.
//
// Both are warp collectives (kernel.cpp): all 32 lanes meet, and then one call does the warp's
// work. The product sums in f32 in k order, rounding as written; a tensor core's order and
// internal precision differ, so results agree with a GPU to a tolerance.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

namespace cuda_emu::ptx {

namespace detail {

inline float bf16_half(uint32_t reg, int high) {
  return __bfloat162float(__nv_bfloat16{static_cast<uint16_t>(high ? reg >> 16 : reg & 0xffffu)});
}

struct MmaArgs {
  float* d;
  uint32_t a[4];
  uint32_t b[2];
};

inline void run_mma(void* const* args) {
  float a[16][16], b[16][8], c[16][8];
  for (int l = 0; l < 32; ++l) {
    const auto& p = *static_cast<const MmaArgs*>(args[l]);
    const int g = l / 4, t = l % 4;
    for (int r = 0; r < 4; ++r)
      for (int h = 0; h < 2; ++h) {
        a[g + 8 * (r % 2)][2 * t + h + 8 * (r / 2)] = bf16_half(p.a[r], h);
        c[g + 8 * (r / 2)][2 * t + r % 2] = p.d[r];
      }
    for (int r = 0; r < 2; ++r)
      for (int h = 0; h < 2; ++h) b[2 * t + h + 8 * r][g] = bf16_half(p.b[r], h);
  }
  // Every lane's inputs are gathered before any lane's d is written.
  for (int l = 0; l < 32; ++l) {
    const auto& p = *static_cast<const MmaArgs*>(args[l]);
    const int g = l / 4, t = l % 4;
    for (int r = 0; r < 4; ++r) {
      const int row = g + 8 * (r / 2), col = 2 * t + r % 2;
      float sum = c[row][col];
      for (int k = 0; k < 16; ++k) sum += a[row][k] * b[k][col];
      p.d[r] = sum;
    }
  }
}

struct LdmatrixArgs {
  const void* row;
  uint32_t* r;
  bool trans;
};

inline void run_ldmatrix(void* const* args) {
  const bool trans = static_cast<const LdmatrixArgs*>(args[0])->trans;
  uint16_t m[4][8][8];
  for (int l = 0; l < 32; ++l) {
    const auto& p = *static_cast<const LdmatrixArgs*>(args[l]);
    if (p.trans != trans)
      throw std::runtime_error("ldmatrix: lane " + std::to_string(l) +
                               " differs from lane 0 in .trans");
    if (reinterpret_cast<uintptr_t>(p.row) % 16 != 0)
      throw std::runtime_error("ldmatrix: lane " + std::to_string(l) +
                               "'s row address is not 16-byte aligned");
    std::memcpy(m[l / 8][l % 8], p.row, 16);
  }
  for (int l = 0; l < 32; ++l) {
    const auto& p = *static_cast<const LdmatrixArgs*>(args[l]);
    const int g = l / 4, t = l % 4;
    for (int i = 0; i < 4; ++i) {
      const uint16_t lo = trans ? m[i][2 * t][g] : m[i][g][2 * t];
      const uint16_t hi = trans ? m[i][2 * t + 1][g] : m[i][g][2 * t + 1];
      p.r[i] = uint32_t{lo} | uint32_t{hi} << 16;
    }
  }
}

}  // namespace detail

// d += a . b, one lane's registers of an m16n8k16 bf16 product with f32 accumulators.
inline void mma_m16n8k16_bf16(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
  detail::MmaArgs args{d, {a[0], a[1], a[2], a[3]}, {b0, b1}};
  ::cuda_emu::warp_collective("mma.sync.m16n8k16", &detail::run_mma, &args);
}

// r[0..3] from four 8 x 8 matrices; `row` is this lane's row address.
inline void ldmatrix_x4(uint32_t* r, const void* row, bool trans) {
  detail::LdmatrixArgs args{row, r, trans};
  ::cuda_emu::warp_collective(trans ? "ldmatrix.x4.trans" : "ldmatrix.x4", &detail::run_ldmatrix,
                              &args);
}

}  // namespace cuda_emu::ptx
