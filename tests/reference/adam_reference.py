#!/usr/bin/env python3
"""adam_reference.py: the PyTorch side of strata's CPU Adam parity test (tests/test_torch_parity.cpp).

Runs torch.optim.AdamW and torch.optim.Adam (single-tensor path, foreach=False) for STEPS steps
in fp32 with weight decay, from inputs drawn with a fixed numpy seed, and writes for each mode one
file OUT_DIR/<mode>.bin holding, as little-endian raw arrays:
    int64 n, int64 steps, float64 lr, beta1, beta2, eps, weight_decay,
    float32 p0[n], grads[steps][n], p[steps][n] (after each step), m[n], v[n] (after the last).
Hyperparameters are float32 values (as the C++ side holds them) passed to torch as Python floats.
Exits 77 with a message when torch is not importable (the test then reports a skip).
"""
import sys

try:
    import numpy as np
    import torch
except ImportError as e:  # pragma: no cover
    print(f"adam_reference.py: {e}; install python3-torch and python3-numpy", file=sys.stderr)
    sys.exit(77)

N = 1031  # a prime: not a multiple of any SIMD width
STEPS = 100


def f32(x):
    return float(np.float32(x))


def run(mode, out_dir):
    lr, beta1, beta2, eps, wd = f32(1e-2), f32(0.9), f32(0.999), f32(1e-8), f32(0.1)
    rng = np.random.default_rng(1234)
    p0 = rng.standard_normal(N).astype(np.float32)
    grads = (rng.standard_normal((STEPS, N)) * 0.1).astype(np.float32)
    param = torch.nn.Parameter(torch.from_numpy(p0.copy()))
    opt_class = torch.optim.AdamW if mode == "adamw" else torch.optim.Adam
    opt = opt_class([param], lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=wd, foreach=False)
    trajectory = np.empty((STEPS, N), dtype=np.float32)
    for s in range(STEPS):
        param.grad = torch.from_numpy(grads[s].copy())
        opt.step()
        trajectory[s] = param.detach().numpy()
    state = opt.state[param]
    with open(f"{out_dir}/{mode}.bin", "wb") as f:
        f.write(np.array([N, STEPS], dtype="<i8").tobytes())
        f.write(np.array([lr, beta1, beta2, eps, wd], dtype="<f8").tobytes())
        for a in (p0, grads, trajectory, state["exp_avg"].numpy(), state["exp_avg_sq"].numpy()):
            f.write(np.ascontiguousarray(a, dtype="<f4").tobytes())


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: adam_reference.py OUT_DIR")
    torch.set_num_threads(1)
    for mode in ("adamw", "adam"):
        run(mode, sys.argv[1])
