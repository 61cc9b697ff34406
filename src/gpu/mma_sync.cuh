// mma_sync.cuh: the tensor-core instructions whose register layouts the PTX ISA documents,
// for kernels that keep a product's result in registers and work on it there (attention's
// softmax): mma.sync m16n8k16 in bf16 with f32 accumulators, and ldmatrix, which loads its
// operands from shared memory in that layout. sm_80 and later. On the CUDA emulator they are
// tests/cuda_emu/include/cuda_emu_ptx.h, which documents the layouts.
//
// A warp's fragments, with g = lane / 4 and t = lane % 4:
// - A (16 x 16, row-major): 4 registers of two bf16 each; a[0] row g, cols 2t and 2t + 1;
//   a[1] row g + 8; a[2] cols + 8; a[3] both.
// - B (16 x 8, k x n): 2 registers; b[0] col n = g, rows k = 2t, 2t + 1; b[1] rows + 8.
// - C (16 x 8, f32): c[0], c[1] row g, cols 2t, 2t + 1; c[2], c[3] row g + 8.
// So the C fragments of two adjacent n-tiles, packed to bf16, are the A fragment of the 16 x 16
// block they form: a product's result feeds the next product without leaving registers.
#pragma once

#include "gpu/kernel_common.cuh"

#include <cstdint>
#include <cstring>

#if defined(STRATA_CUDA_EMU)
#include <cuda_emu_ptx.h>
#endif

namespace strata::gpu {

// d += a . b for one 16 x 8 x 16 tile.
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1) {
#if defined(STRATA_CUDA_EMU)
  cuda_emu::ptx::mma_m16n8k16_bf16(d, a, b0, b1);
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// Four 8 x 8 matrices of bf16 from shared memory: `row` is this lane's row (lanes 8m to 8m + 7
// give matrix m's rows, 16-byte aligned); r[m] gets row lane / 4, elements 2 (lane % 4) and the
// next of matrix m, or with `Trans` the same of its transpose.
template <bool Trans>
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
#if defined(STRATA_CUDA_EMU)
  cuda_emu::ptx::ldmatrix_x4(r, row, Trans);
#else
  const auto addr = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  if constexpr (Trans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
#endif
}

// Fragments from a row-major bf16 tile in shared memory with row stride `ld` elements (a
// multiple of 8), lane = threadIdx.x % 32. The A operand: rows [r0, r0 + 16), columns [c0, c0 + 16)
// of a row-major tile.
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const bf16* tile, int ld, int r0, int c0,
                                       int lane) {
  ldmatrix_x4<false>(a, tile + (r0 + lane % 16) * ld + c0 + (lane / 16) * 8);
}
// B operands of two adjacent n-tiles for B = X^T, X row-major with n along its rows: rows
// [n0, n0 + 16) and columns [k0, k0 + 16) of X. b[0], b[1] are n-tile n0's; b[2], b[3] n0 + 8's.
__device__ __forceinline__ void load_b_transposed(uint32_t (&b)[4], const bf16* tile, int ld,
                                                  int n0, int k0, int lane) {
  ldmatrix_x4<false>(b, tile + (n0 + lane % 8 + (lane / 16) * 8) * ld + k0 + ((lane / 8) % 2) * 8);
}
// B operands of two adjacent n-tiles for B = X, X row-major with k along its rows: rows
// [k0, k0 + 16) and columns [n0, n0 + 16). Same order as load_b_transposed.
__device__ __forceinline__ void load_b(uint32_t (&b)[4], const bf16* tile, int ld, int k0, int n0,
                                       int lane) {
  ldmatrix_x4<true>(b, tile + (k0 + lane % 8 + ((lane / 8) % 2) * 8) * ld + n0 + (lane / 16) * 8);
}

// Two floats as bf16 in one register, `lo` (the lower column) in the low half.
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const bf16 l = from_f32<bf16>(lo), h = from_f32<bf16>(hi);
  uint16_t lb, hb;
  std::memcpy(&lb, &l, 2);
  std::memcpy(&hb, &h, 2);
  return uint32_t{lb} | uint32_t{hb} << 16;
}

}  // namespace strata::gpu
