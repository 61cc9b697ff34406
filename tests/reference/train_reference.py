#!/usr/bin/env python3
"""train_reference.py: the PyTorch side of strata's end-to-end training parity test
(tests/test_train_reference.cpp, issue 8).

usage: train_reference.py DIR [--tied] [--arch llama|qwen2|qwen3] --ranks R --steps N --seq-len T --micro-batch B
                          --grad-accum K --lr LR --weight-decay WD --clip C --eps E --seed S
                          [--warmup-steps W | --one-cycle MIN,MAX,FIRST,SECOND,MIN_MOM,MAX_MOM]
                          [--decay-all]

First it writes the run's inputs: DIR/model/config.json + DIR/model/model.safetensors (F32), a
tiny Llama (hidden 32, 2 layers, 4 heads, 2 kv heads, intermediate 64, vocab 97) with weights
drawn from a numpy seed (norm weights away from 1, so that decaying them by mistake shows; with
--arch qwen2 biases on q, k and v, drawn like the matrices; with --arch qwen3 q and k norms of
head_dim, drawn like the other norms), and
DIR/tokens.bin, an llm.c token file (256 int32 header: magic 20240520, version 1, count; then
uint16 tokens) of 11 sequences and a few tokens over, so that every run crosses an epoch.

Then it replays `strata train` on them:
  - the same batches: data_loader.cpp's epoch permutation, ported below with explicit 64-bit
    masking; the trainer takes, for each micro-batch m in order and within it each rank r in
    order, B sequences from the loader;
  - each step's loss, the mean cross-entropy over every target of every micro-batch and rank,
    and its gradient in float64 through llama_reference.py's equations, from the fp32 weights;
  - the gradient in fp32 as strata holds it; the global norm from its sum of squares in double;
    clipping as cpu_adam.cpp's combined_grad_scale (coefficient max / (norm + 1e-6), only when
    norm > max, rounded to float and multiplied into the fp32 gradient);
  - torch.optim.AdamW (foreach=False, fp32 parameters) with weight decay on the 2-D weights
    only (Hugging Face Trainer's convention: the 1-D norm weights and biases take none), or
    with --decay-all on every parameter, in one group (DeepSpeed's optimizer, made from a
    config's optimizer section);
  - the rate of update k: LR, or with --warmup-steps DeepSpeed's WarmupLR (log warmup from 0 to
    LR over max(2, W) steps) at last_batch_iteration k - 1, as src/train/lr_schedule.cpp; or
    with --one-cycle DeepSpeed's OneCycle (no decay), which also sets Adam's betas to
    (momentum, 0.99) before each update, the momentum falling from MAX_MOM to MIN_MOM as the
    rate rises from MIN to MAX over FIRST updates, and back over SECOND; the first update runs
    at MIN and MIN_MOM, which the scheduler sets when it is made;
  - with --optimizer adagrad, torch.optim.Adagrad (foreach=False, lr_decay 0, no initial
    accumulator) in place of AdamW, the weight decay of each group its L2 term.
Every rate and hyperparameter is rounded to float first, as strata holds it. The result is
DIR/reference.safetensors: the final weights under their Hugging Face names, and "loss" [N],
each step's mean loss.

Exits 77 when torch or numpy is not importable (the C++ test then reports a skip).
"""
import argparse
import json
import math
import os
import struct
import sys

try:
    import numpy as np
    import torch
except ImportError as e:  # the C++ test reports a skip, naming python3-torch
    print(f"train_reference.py: {e}; install python3-torch and python3-numpy", file=sys.stderr)
    sys.exit(77)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_reference  # noqa: E402  (the forward, and the safetensors reader and writer)

MASK = (1 << 64) - 1
LLMC_MAGIC_U16 = 20240520


def f32(x):
    return float(np.float32(x))


# ---- the data order of src/train/data_loader.cpp ----


def splitmix64_mix(z):
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


class SplitMix64:
    def __init__(self, state):
        self.state = state & MASK

    def next(self):
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK
        return splitmix64_mix(self.state)


def rotl(x, k):
    return ((x << k) | (x >> (64 - k))) & MASK


class Xoshiro256:
    def __init__(self, seed):
        sm = SplitMix64(seed)
        self.s = [sm.next() for _ in range(4)]

    def next(self):
        s = self.s
        result = (rotl((s[1] * 5) & MASK, 7) * 9) & MASK
        t = (s[1] << 17) & MASK
        s[2] ^= s[0]
        s[3] ^= s[1]
        s[1] ^= s[2]
        s[0] ^= s[3]
        s[2] ^= t
        s[3] = rotl(s[3], 45)
        return result

    def below(self, n):
        threshold = ((1 << 64) - n) % n  # 2^64 mod n
        while True:
            r = self.next()
            if r >= threshold:
                return r % n


def epoch_order(seed, epoch, n):
    order = list(range(n))
    rng = Xoshiro256((splitmix64_mix(seed & MASK) + epoch) & MASK)
    for i in range(n - 1, 0, -1):
        j = rng.below(i + 1)
        order[i], order[j] = order[j], order[i]
    return order


class Loader:
    """DataLoader over one llm.c uint16 file: sequence i is tokens [i*T, i*T + T]."""

    def __init__(self, tokens, seq_len, seed):
        self.tokens, self.T, self.seed = tokens, seq_len, seed
        self.n = (len(tokens) - 1) // seq_len
        self.epoch, self.position = 0, 0
        self.order = epoch_order(seed, 0, self.n)

    def next(self, batch):
        rows = []
        for _ in range(batch):
            g = self.order[self.position]
            rows.append(self.tokens[g * self.T : g * self.T + self.T + 1])
            self.position += 1
            if self.position == self.n:
                self.position, self.epoch = 0, self.epoch + 1
                self.order = epoch_order(self.seed, self.epoch, self.n)
        return rows


def read_llmc_u16(path):
    with open(path, "rb") as f:
        blob = f.read()
    header = struct.unpack("<256i", blob[:1024])
    if header[0] != LLMC_MAGIC_U16 or header[1] != 1:
        sys.exit(f"{path}: not an llm.c uint16 token file (magic {header[0]}, version {header[1]})")
    return list(struct.unpack(f"<{header[2]}H", blob[1024 : 1024 + 2 * header[2]]))


# ---- DeepSpeed's WarmupLR and OneCycle (src/train/lr_schedule.cpp) ----


def warmup_lr(max_lr, warmup_steps, last_batch_iteration):
    W = max(2, warmup_steps)
    i = last_batch_iteration
    if i < 0:
        return 0.0  # warmup_min_lr
    gamma = (1.0 / math.log(W)) * math.log(i + 1) if i < W else 1.0
    return 0.0 + (max_lr - 0.0) * gamma


def one_cycle(spec, last_batch_iteration):
    """(lr, beta1) of DeepSpeed's OneCycle without decay at last_batch_iteration."""
    lo, hi, first, second, lo_mom, hi_mom = spec
    if last_batch_iteration < 0:
        return lo, lo_mom  # what the scheduler sets when it is made
    total = float(first) + float(second)
    if last_batch_iteration >= total:
        return lo, hi_mom
    rise = float(first) / total
    x = (last_batch_iteration + 1) / total
    x -= math.floor(x)  # position within the cycle, in [0, 1)
    up = x / rise if x <= rise else (1 - x) / (1 - rise)
    return lo + (hi - lo) * up, hi_mom - (hi_mom - lo_mom) * up


# ---- commands ----


def make(args):
    classes = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
    cfg = {
        "architectures": [classes[args.arch]],
        "model_type": args.arch,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 97,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": bool(args.tied),
        "torch_dtype": "float32",
        "hidden_act": "silu",
    }
    D, F, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = D // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": [V, D]}
    for l in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{l}."
        shapes[pre + "input_layernorm.weight"] = [D]
        shapes[pre + "self_attn.q_proj.weight"] = [D, D]
        shapes[pre + "self_attn.k_proj.weight"] = [kv, D]
        shapes[pre + "self_attn.v_proj.weight"] = [kv, D]
        shapes[pre + "self_attn.o_proj.weight"] = [D, D]
        if args.arch == "qwen2":
            shapes[pre + "self_attn.q_proj.bias"] = [D]
            shapes[pre + "self_attn.k_proj.bias"] = [kv]
            shapes[pre + "self_attn.v_proj.bias"] = [kv]
        if args.arch == "qwen3":
            shapes[pre + "self_attn.q_norm.weight"] = [hd]
            shapes[pre + "self_attn.k_norm.weight"] = [hd]
        shapes[pre + "post_attention_layernorm.weight"] = [D]
        shapes[pre + "mlp.gate_proj.weight"] = [F, D]
        shapes[pre + "mlp.up_proj.weight"] = [F, D]
        shapes[pre + "mlp.down_proj.weight"] = [D, F]
    shapes["model.norm.weight"] = [D]
    if not args.tied:
        shapes["lm_head.weight"] = [V, D]
    rng = np.random.default_rng(args.seed)
    weights = {}
    for name, shape in shapes.items():
        if name.endswith(".bias"):
            w = rng.standard_normal(shape) * 0.05
        elif len(shape) == 1:
            w = rng.uniform(0.7, 1.3, shape)
        else:
            w = rng.standard_normal(shape) * 0.05
        weights[name] = torch.from_numpy(w.astype(np.float32))
    os.makedirs(f"{args.dir}/model", exist_ok=True)
    with open(f"{args.dir}/model/config.json", "w") as f:
        json.dump(cfg, f, indent=2)
    llama_reference.write_safetensors(f"{args.dir}/model/model.safetensors", weights)
    # 11 sequences and a few tokens over: every run of the test crosses an epoch boundary.
    tokens = rng.integers(0, V, size=11 * args.seq_len + 5).astype("<u2")
    header = np.zeros(256, dtype="<i4")
    header[0], header[1], header[2] = LLMC_MAGIC_U16, 1, len(tokens)
    with open(f"{args.dir}/tokens.bin", "wb") as f:
        f.write(header.tobytes() + tokens.tobytes())


def train(args):
    with open(f"{args.dir}/model/config.json") as f:
        cfg = json.load(f)
    params = {
        n: torch.nn.Parameter(t.to(torch.float32))
        for n, t in llama_reference.read_safetensors(f"{args.dir}/model/model.safetensors").items()
    }
    if args.decay_all:  # DeepSpeed's optimizer from a config's optimizer section: one group
        decay, no_decay = list(params.values()), []
    else:  # Hugging Face Trainer's groups
        decay = [p for p in params.values() if p.dim() == 2]
        no_decay = [p for p in params.values() if p.dim() != 2]
    lr, wd = f32(args.lr), f32(args.weight_decay)
    groups = [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]
    if args.optimizer == "adagrad":
        opt = torch.optim.Adagrad(
            groups, lr=lr, lr_decay=0, initial_accumulator_value=0, eps=f32(args.eps),
            foreach=False,
        )
    else:
        opt = torch.optim.AdamW(
            groups, lr=lr, betas=(f32(0.9), f32(0.999)), eps=f32(args.eps), foreach=False
        )
    loader = Loader(read_llmc_u16(f"{args.dir}/tokens.bin"), args.seq_len, args.seed)
    losses = []
    for k in range(args.steps):
        rows = []
        for _m in range(args.grad_accum):
            for _r in range(args.ranks):
                rows += loader.next(args.micro_batch)
        seqs = torch.tensor(rows, dtype=torch.int64)
        ids, targets = seqs[:, :-1], seqs[:, 1:]
        # The loss and its gradient in float64 from the fp32 weights.
        p64 = {n: p.detach().to(torch.float64).requires_grad_(True) for n, p in params.items()}
        logits = llama_reference.forward(cfg, p64, ids, torch.float64)
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
        )
        loss.backward()
        losses.append(loss.item())
        grads = {n: p64[n].grad.to(torch.float32) for n in params}
        sum_squares = sum(float((g.to(torch.float64) ** 2).sum()) for g in grads.values())
        norm = math.sqrt(sum_squares)
        clip = 1.0
        if args.clip > 0 and norm > f32(args.clip):
            clip = f32(args.clip) / (norm + 1e-6)
        scale = torch.tensor(f32(clip), dtype=torch.float32)
        for n, p in params.items():
            p.grad = grads[n] * scale
        rate = lr if args.warmup_steps is None else warmup_lr(lr, args.warmup_steps, k - 1)
        if args.one_cycle:
            rate, beta1 = one_cycle(args.one_cycle, k - 1)
            for group in opt.param_groups:
                group["betas"] = (f32(beta1), f32(0.99))
        for group in opt.param_groups:
            group["lr"] = f32(rate)
        opt.step()
        print(f"step {k + 1}: loss {loss.item():.9g} grad-norm {norm:.6g} lr {f32(rate):.6g}")
    out = {n: p.detach() for n, p in params.items()}
    out["loss"] = torch.tensor(losses, dtype=torch.float64)
    llama_reference.write_safetensors(f"{args.dir}/reference.safetensors", out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--tied", action="store_true")
    ap.add_argument("--arch", default="llama", choices=["llama", "qwen2", "qwen3"])
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--grad-accum", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--eps", type=float, default=1e-8)
    ap.add_argument("--warmup-steps", type=int, default=None)
    ap.add_argument("--one-cycle", type=lambda s: [float(x) for x in s.split(",")], default=None)
    ap.add_argument("--decay-all", action="store_true")
    ap.add_argument("--optimizer", default="adamw", choices=["adamw", "adagrad"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    make(args)
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
