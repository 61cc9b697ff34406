// kernels_neon.cpp: the AArch64 Advanced SIMD (NEON) path, four floats a register (see
// kernel_impl.h). Built only for aarch64/arm64, where NEON and its f16 conversions are part of the
// base instruction set, so it needs no -m flag and is always available there.
//
// xsimd 8.1 computes float division and square root on NEON as Newton-Raphson estimates, which
// are not correctly rounded: Exact<> below uses the FDIV and FSQRT instructions instead, so this
// path computes the same IEEE operations as the scalar one. Not yet compiled or run on an ARM
// machine: test_cpu_adam's bit-identity tests are what will prove it there.
#include "cpu_adam/kernel_impl.h"

namespace strata::cpu_adam {
namespace {

using Neon = xsimd::neon64;

template <>
struct Exact<FloatBatch<Neon>> {
  using B = FloatBatch<Neon>;
  static B div(B a, B b) { return vdivq_f32(a, b); }
  static B sqrt(B a) { return vsqrtq_f32(a); }
};

template <>
struct Io<Neon> {
  using B = FloatBatch<Neon>;
  using D = DoubleBatch<Neon>;
  using U = xsimd::batch<uint32_t, Neon>;
  static U widen_u16(const uint16_t* p) { return vmovl_u16(vld1_u16(p)); }
  // Values are below 2^16 here (bf16 bits): narrowing keeps them whole.
  static void narrow_u32(U x, uint16_t* p) { vst1_u16(p, vmovn_u32(x)); }
  static B load_f16(const uint16_t* p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }
  // FCVTN rounds to nearest even (the FPCR default) and keeps a NaN's sign and top payload bits,
  // made quiet: what core/dtype.h's f32_to_f16 does.
  static void store_f16(B x, uint16_t* p) { vst1_u16(p, vreinterpret_u16_f16(vcvt_f16_f32(x))); }
  static void to_double(B x, D& lo, D& hi) {
    const float32x4_t r = x;
    lo = vcvt_f64_f32(vget_low_f32(r));
    hi = vcvt_high_f64_f32(r);
  }
};

}  // namespace

extern const SimdKernels kNeon64Kernels = make_kernels<Neon>("neon64");

}  // namespace strata::cpu_adam
