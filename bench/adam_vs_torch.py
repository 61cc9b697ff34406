#!/usr/bin/env python3
"""adam_vs_torch.py: strata's fused CPU Adam step side by side with torch.optim.AdamW.

Runs `strata bench adam --json` (which verifies its output first and measures the memory bound
in the same run), then torch.optim.AdamW (Debian's python3-torch) on the same number of fp32
parameters, with foreach off and on, and prints the seconds per step of each and the ratio of
strata's speed to torch's best. Both use the same thread count. With --optimizer adagrad, the
Adagrad step against torch.optim.Adagrad (torch has no Lion to compare with).

    bench/adam_vs_torch.py --params 67108864 [--threads T] [--optimizer adamw|adagrad]
                           [--strata build/bin/strata]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

try:
    import torch
except ImportError as e:
    sys.exit(f"adam_vs_torch.py: {e}; install python3-torch (and run with /usr/bin/python3)")


def torch_step_seconds(n, foreach, threads, steps, tensors, optimizer):
    torch.manual_seed(0)
    sizes = [n // tensors + (1 if i < n % tensors else 0) for i in range(tensors)]
    params = [torch.nn.Parameter(torch.randn(s) * 0.5) for s in sizes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-2
    if optimizer == "adagrad":  # L2 decay, as strata's Adagrad
        opt = torch.optim.Adagrad(params, lr=1e-3, weight_decay=0.01, foreach=foreach)
    else:
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, foreach=foreach)
    opt.step()  # creates the state: not timed
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--params", type=int, default=64 << 20)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--tensors", type=int, default=1, help="split torch's parameters into this many tensors")
    ap.add_argument("--optimizer", default="adamw", choices=["adamw", "adagrad"])
    ap.add_argument("--strata", default=os.path.join(here, "..", "build", "bin", "strata"))
    args = ap.parse_args()

    cmd = [args.strata, "bench", "adam", "--params", str(args.params), "--threads",
           str(args.threads), "--steps", str(args.steps), "--optimizer", args.optimizer, "--json"]
    strata = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    torch.set_num_threads(args.threads)
    off = torch_step_seconds(args.params, False, args.threads, args.steps, args.tensors,
                             args.optimizer)
    on = torch_step_seconds(args.params, True, args.threads, args.steps, args.tensors,
                            args.optimizer)
    best = min(off, on)
    name = "Adagrad" if args.optimizer == "adagrad" else "AdamW"
    result = {
        "optimizer": args.optimizer,
        "params": args.params,
        "threads": args.threads,
        "strata_s": strata["update_s"],
        "strata_bound_fraction": strata["bound_fraction"],
        "strata_simd": strata["simd"],
        "torch_foreach_off_s": off,
        "torch_foreach_on_s": on,
        "speedup_vs_torch_best": best / strata["update_s"],
    }
    print(f"{args.params} fp32 params, {args.threads} threads, torch {torch.__version__}")
    print(f"  strata fused ({strata['simd']}) {strata['update_s'] * 1e3:9.1f} ms/step "
          f"({strata['bound_fraction']:.2f} of the memory bound)")
    print(f"  torch {name:7} foreach=False {off * 1e3:9.1f} ms/step")
    print(f"  torch {name:7} foreach=True  {on * 1e3:9.1f} ms/step")
    print(f"  strata is {result['speedup_vs_torch_best']:.2f}x torch's best")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
