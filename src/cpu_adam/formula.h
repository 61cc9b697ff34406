// formula.h: Adam's per-element update, written once for the scalar path and every SIMD path.
//
// V is float (the scalar reference) or xsimd::batch<float, A>. The operations and their order
// follow torch.optim.Adam/AdamW (single-tensor, PyTorch 1.13): that is what makes the fp32
// trajectory match PyTorch and the output bits match across paths. The files that include this
// are compiled with -ffp-contract=off: a fused multiply-add in one path and not in another would
// change the bits. It lives in an anonymous namespace on purpose: each translation unit is
// compiled for a different instruction set and must keep its own copy.
#pragma once

#include "cpu_adam/kernels.h"

#include <cmath>

namespace strata::cpu_adam {
namespace {

// Division and square root, correctly rounded as IEEE 754 requires: V's own operators by
// default. A path whose library rounds them differently specialises this (xsimd 8.1's NEON float
// division and square root are Newton-Raphson estimates; kernels_neon.cpp uses the instructions).
template <class V>
struct Exact {
  static V div(V a, V b) { return a / b; }
  static V sqrt(V a) {
    using std::sqrt;
    return sqrt(a);
  }
};

template <class V>
inline void adam_element(V& p, V g, V& m, V& v, const StepConstants& k) {
  g = g * V(k.grad_scale);
  g = g + V(k.l2_decay) * p;  // Adam's L2 term (l2_decay is 0 for AdamW): g + wd * p
  p = p * V(k.param_decay);   // AdamW's decoupled decay (param_decay is 1 for Adam)
  m = m * V(k.beta1) + V(k.one_minus_beta1) * g;
  v = v * V(k.beta2) + (V(k.one_minus_beta2) * g) * g;
  const V denom = Exact<V>::div(Exact<V>::sqrt(v), V(k.bias_correction2_sqrt)) + V(k.eps);
  p = p + Exact<V>::div(V(k.neg_step_size) * m, denom);
}

}  // namespace
}  // namespace strata::cpu_adam
