// formula.h: the optimizers' per-element updates, written once for the scalar path and every
// SIMD path.
//
// V is float (the scalar reference) or xsimd::batch<float, A>. The operations and their order
// follow torch.optim.Adam/AdamW and torch.optim.Adagrad (single-tensor, PyTorch 1.13), and for
// Lion, which torch lacks, the paper's update as lion-pytorch writes it: that is what makes the
// fp32 trajectory match PyTorch and the output bits match across paths. The files that include this
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

// sign(x): -1, 0 or 1 (0 for +-0 and NaN), as torch.sign. DeepSpeed's CPU Lion steps by
// copysign(lr, x), which moves an element whose momentum and gradient are both zero (a padding
// row, an unused token's embedding) by a full step every update; the paper's sign does not.
// This is the scalar one; kernel_impl.h specialises it for xsimd's registers.
template <class V>
struct Sign {
  static V of(V x) { return x > V(0) ? V(1) : x < V(0) ? V(-1) : V(0); }
};

// Lion: decoupled decay, a step of lr against the sign of the momentum interpolated with the
// gradient, then the momentum's own average (beta2).
template <class V>
inline void lion_element(V& p, V g, V& m, const StepConstants& k) {
  g = g * V(k.grad_scale);
  p = p * V(k.param_decay);
  const V c = m * V(k.beta1) + V(k.one_minus_beta1) * g;
  p = p + V(k.neg_step_size) * Sign<V>::of(c);
  m = m * V(k.beta2) + V(k.one_minus_beta2) * g;
}

// Adagrad: L2 decay on the gradient, the squares summed in v, a step of lr over the root plus eps
// (torch's addcmul_(g, g) then addcdiv_(g, sqrt(v) + eps, value=-lr)).
template <class V>
inline void adagrad_element(V& p, V g, V& v, const StepConstants& k) {
  g = g * V(k.grad_scale);
  g = g + V(k.l2_decay) * p;
  v = v + g * g;
  const V denom = Exact<V>::sqrt(v) + V(k.eps);
  p = p + V(k.neg_step_size) * Exact<V>::div(g, denom);
}

// One element of `type`'s update: m and v are those the type keeps (the others are not touched).
template <class V>
inline void optimizer_element(OptimizerType type, V& p, V g, V& m, V& v, const StepConstants& k) {
  switch (type) {
    case OptimizerType::adam:
      adam_element(p, g, m, v, k);
      return;
    case OptimizerType::lion:
      lion_element(p, g, m, k);
      return;
    case OptimizerType::adagrad:
      adagrad_element(p, g, v, k);
      return;
  }
}

}  // namespace
}  // namespace strata::cpu_adam
