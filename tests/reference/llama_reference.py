#!/usr/bin/env python3
"""The Llama equations written out in PyTorch, the reference strata's model is tested against.

No transformers library: the forward below is Hugging Face's LlamaForCausalLM spelled out
(RMSNorm, rotary embeddings in the rotate-half layout with optional llama3, linear, YaRN or
LongRoPE frequency scaling (their attention factors scaling cos and sin),
causal grouped-query attention, SwiGLU MLP, optional tied embeddings, mean cross-entropy over
targets that are not -100). MistralForCausalLM is the same equations, each query seeing only
the last sliding_window positions (itself included), Qwen2ForCausalLM adds biases to q, k and
v, and Qwen3ForCausalLM an RMSNorm over each head of q and k (shared by the heads) before the
rotation; with use_sliding_window, their layers from max_window_layers on (or those layer_types
names "sliding_attention") see the window too. Phi3ForCausalLM is Mistral's equations with q, k
and v computed by one projection (self_attn.qkv_proj, its output split in that order) and gate
and up by another (mlp.gate_up_proj, the first half gate), and with partial_rotary_factor
only the first head_dim x it dimensions of each head rotated. GemmaForCausalLM multiplies the
embeddings by sqrt(hidden_size) (a float32 number cast to the working dtype), multiplies each
norm by 1 + its weight, and gates the MLP with GELU's tanh approximation (its
hidden_activation, else hidden_act, whose "gelu" means the tanh form for Gemma); any class's
hidden_act may be silu, gelu or gelu_pytorch_tanh. Gemma2ForCausalLM is Gemma with a norm on
each sublayer's output (post_attention_layernorm on the attention's, post_feedforward_layernorm
on the MLP's; pre_feedforward_layernorm before the MLP), scores times query_pre_attn_scalar^-1/2
then capped as c tanh(s / c) with c = attn_logit_softcapping, logits capped likewise by
final_logit_softcapping, and the sliding window in the layers layer_types names (else every
other layer from the first). Gemma3ForCausalLM (model_type gemma3_text) is Gemma 2 with q and k
norms (1 + w, as Qwen3's), caps only where given, the window in the layers layer_types names
(else all but every sliding_window_pattern-th), and the sliding layers' rotary angles from
rope_local_base_freq without rope_scaling. SmolLM3ForCausalLM is Llama's block whose NoPE layers
(the zeros of no_rope_layers, else every no_rope_layer_interval-th layer) rotate neither q nor k,
with use_sliding_window a window in the layers layer_types names (else the NoPE layers), and
biases as Llama's. GraniteForCausalLM is Llama's block with the embeddings times
embedding_multiplier, each sublayer's output times residual_multiplier before it joins the
residual, scores times attention_multiplier (not 1/sqrt(head_dim); 1 where absent, as
GraniteConfig's default), head_dim always hidden_size / num_attention_heads, and the logits
divided by logits_scaling. Which projections have biases is decided
here from config.json as each Hugging Face class decides it, and the checkpoint must hold
exactly the tensors that implies.

usage: llama_reference.py MODEL_DIR TOKENS OUT [--batch B] [--seq-len T] [--dtype float64]
  MODEL_DIR  config.json + model.safetensors (read here with json + struct, no safetensors lib)
  TOKENS     raw little-endian int32 file: B*T inputs, then B*T targets (-100 = ignored),
             optionally then B*T other targets
  OUT        a safetensors file with F32 tensors: "loss" [1], "logits" [B*T, V], and
             "grad.<hugging face name>" for every parameter (gradient of the mean loss), and
             with other targets "loss_other" [1], the mean loss against them (one run of this
             script, whose start-up, importing torch, takes longer than a tiny model's sums)
"""
import argparse
import itertools
import json
import math
import struct
import sys

try:
    import torch
except ImportError:  # the C++ test reports a skip, naming python3-torch
    sys.exit(77)

DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def read_safetensors(path):
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    data = blob[8 + n :]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        raw = bytearray(data[begin:end])
        t = torch.frombuffer(raw, dtype=DTYPES[info["dtype"]]) if raw else torch.empty(0)
        out[name] = t.reshape(info["shape"]).clone()
    return out


def write_safetensors(path, tensors):
    blobs = [t.detach().to(torch.float32).contiguous().numpy().tobytes() for t in tensors.values()]
    ends = list(itertools.accumulate(len(b) for b in blobs))
    header = {
        name: {"dtype": "F32", "shape": list(t.shape), "data_offsets": [end - len(b), end]}
        for (name, t), b, end in zip(tensors.items(), blobs, ends)
    }
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def yarn(cfg, rs, inv, head_dim, theta):
    """YaRN (Peng et al. 2023) with transformers 5's conventions: (frequencies, cos/sin scale)."""
    longest = cfg["max_position_embeddings"]
    trained = rs.get("original_max_position_embeddings") or longest  # the ramp's context
    stretch = rs.get("factor") or longest / trained

    def temperature(s, k):
        return 1.0 if s <= 1 else 1.0 + 0.1 * k * math.log(s)

    scale = rs.get("attention_factor")
    if scale is None:
        if rs.get("mscale") and rs.get("mscale_all_dim"):
            scale = temperature(stretch, rs["mscale"]) / temperature(stretch, rs["mscale_all_dim"])
        else:
            scale = temperature(stretch, 1.0)

    # Dimension index d turns trained / (2 pi theta^(d / head_dim)) times over the trained
    # context; solved for d at beta_fast and beta_slow rotations, those are the ramp's ends.
    def dimension(rotations):
        return head_dim * math.log(trained / (2 * math.pi * rotations)) / (2 * math.log(theta))

    lo, hi = dimension(rs.get("beta_fast") or 32), dimension(rs.get("beta_slow") or 1)
    if rs.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, head_dim - 1)
    if lo == hi:
        hi += 0.001
    out = []
    for i, f in enumerate(inv.tolist()):
        ramp = min(max((i - lo) / (hi - lo), 0.0), 1.0)  # 0: extrapolate (keep), 1: interpolate
        out.append(f * (1 - ramp) + f / stretch * ramp)
    return torch.tensor(out, dtype=torch.float32), scale


def longrope(cfg, rs, head_dim, theta, positions):
    """LongRoPE (Phi-3): per-dimension divisors, long ones for sequences past the trained context."""
    longest = cfg["max_position_embeddings"]
    trained = cfg.get("original_max_position_embeddings") or rs.get("original_max_position_embeddings")
    trained = trained or longest
    stretch = rs.get("factor") or longest / trained  # a given factor stands (transformers 5)
    scale = rs.get("attention_factor")
    if scale is None:
        scale = 1.0 if stretch <= 1 else math.sqrt(1 + math.log(stretch) / math.log(trained))
    divisors = rs["long_factor"] if positions > trained else rs["short_factor"]
    base = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    return 1.0 / (torch.tensor(divisors, dtype=torch.float32) * base), scale


def inv_frequencies(cfg, head_dim, positions):
    """(inverse frequencies in f32, the factor on cos and sin) for sequences of `positions`."""
    theta = float(cfg.get("rope_theta", 10000.0))
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rs = cfg.get("rope_scaling")
    kind = rs and (rs.get("rope_type") or rs.get("type"))
    if kind == "linear":
        return inv / rs["factor"], 1.0
    if kind == "dynamic":  # changes nothing within max_position_embeddings
        return inv, 1.0
    if kind == "yarn":
        return yarn(cfg, rs, inv, head_dim, theta)
    if kind in ("longrope", "su"):
        return longrope(cfg, rs, head_dim, theta, positions)
    if rs and (rs.get("rope_type") or rs.get("type")) == "llama3":
        factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old = rs["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old / low, old / high
        out = []
        for f in inv.tolist():
            wavelen = 2 * math.pi / f
            if wavelen < high_wavelen:
                out.append(f)
            elif wavelen > low_wavelen:
                out.append(f / factor)
            else:
                smooth = (old / wavelen - low) / (high - low)
                out.append((1 - smooth) * f / factor + smooth * f)
        inv = torch.tensor(out, dtype=torch.float32)
    elif kind not in (None, "default"):
        sys.exit(f"rope scaling {kind} is not written out here")
    return inv, 1.0


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rms_norm(x, w, eps, offset=0.0):
    return (w + offset) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def activation(cfg):
    """The MLP gate's function, as config.json names it."""
    gemma = cfg.get("model_type") == "gemma"
    name = cfg.get("hidden_act", "gelu_pytorch_tanh" if gemma else "silu")
    if gemma and cfg.get("hidden_activation"):
        name = cfg["hidden_activation"]
    elif gemma and name == "gelu":  # Google's first configs: the tanh form the model used
        name = "gelu_pytorch_tanh"
    functions = {
        "silu": torch.nn.functional.silu,
        "gelu": torch.nn.functional.gelu,
        "gelu_pytorch_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
    }
    if name not in functions:
        sys.exit(f"activation {name} is not written out here")
    return functions[name]


def biased(cfg):
    """The projections with a bias, as each Hugging Face class builds them."""
    kind = cfg.get("model_type", "llama")
    if kind == "qwen2":
        return {"q_proj", "k_proj", "v_proj"}
    if kind == "mistral":
        return set()
    out = set()
    if cfg.get("attention_bias"):
        out |= {"q_proj", "k_proj", "v_proj", "o_proj"}
    if cfg.get("mlp_bias") and kind in ("llama", "smollm3", "granite"):
        out |= {"gate_proj", "up_proj", "down_proj"}
    return out


def expected_names(cfg):
    D = cfg["hidden_size"]
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not cfg.get("tie_word_embeddings"):
        names.add("lm_head.weight")
    for l in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{l}."
        names |= {pre + "input_layernorm.weight", pre + "post_attention_layernorm.weight"}
        if cfg.get("model_type") in ("qwen3", "gemma3_text"):
            names |= {pre + "self_attn.q_norm.weight", pre + "self_attn.k_norm.weight"}
        if cfg.get("model_type") in ("gemma2", "gemma3_text"):
            names |= {pre + "pre_feedforward_layernorm.weight", pre + "post_feedforward_layernorm.weight"}
        if cfg.get("model_type") == "phi3":
            names |= {pre + p + ".weight" for p in
                      ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")}
            continue
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            part = "self_attn." if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp."
            names.add(pre + part + proj + ".weight")
            if proj in biased(cfg):
                names.add(pre + part + proj + ".bias")
    return names


def layer_window(cfg, layer):
    """The sliding window of a layer, None where it sees every earlier position."""
    kind = cfg.get("model_type")
    window = cfg.get("sliding_window")
    if kind in ("mistral", "phi3"):
        return window
    if kind in ("gemma2", "gemma3_text"):
        if cfg.get("layer_types") is not None:
            return window if cfg["layer_types"][layer] == "sliding_attention" else None
        if kind == "gemma3_text":
            return window if (layer + 1) % cfg.get("sliding_window_pattern", 6) else None
        return window if layer % 2 == 0 else None
    if kind not in ("qwen2", "qwen3", "smollm3") or not cfg.get("use_sliding_window") or window is None:
        return None
    if cfg.get("layer_types") is not None:
        return window if cfg["layer_types"][layer] == "sliding_attention" else None
    if kind == "smollm3":
        return None if rotates(cfg, layer) else window
    return window if layer >= cfg.get("max_window_layers", 28) else None


def rotates(cfg, layer):
    """Whether a layer's q and k are rotated: all but SmolLM3's NoPE layers."""
    if cfg.get("model_type") != "smollm3":
        return True
    if cfg.get("no_rope_layers") is not None:
        return cfg["no_rope_layers"][layer] == 1
    return (layer + 1) % cfg.get("no_rope_layer_interval", 4) != 0


def linear(cfg, p, name, x):
    """x @ W.T (+ b): Hugging Face's Linear, with a bias where the class builds one."""
    y = x @ p[name + ".weight"].T
    return y + p[name + ".bias"] if name.rsplit(".", 1)[1] in biased(cfg) else y


def forward(cfg, p, ids, dtype):
    B, T = ids.shape
    D = cfg["hidden_size"]
    H, Hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    # GraniteAttention takes hidden_size / num_attention_heads whatever head_dim says.
    hd = D // H if cfg.get("model_type") == "granite" else (cfg.get("head_dim") or D // H)
    eps = cfg["rms_norm_eps"]
    # Angles in f32 as Hugging Face computes them; cos/sin in the working precision.
    rot = int(hd * cfg.get("partial_rotary_factor", 1.0))  # the dimensions rotated
    def cos_sin(c):
        inv, scale = inv_frequencies(c, rot, T)
        angles = torch.arange(T, dtype=torch.float32)[:, None] * inv[None, :]
        angles = torch.cat((angles, angles), dim=-1).to(dtype)
        return angles.cos() * scale, angles.sin() * scale

    rotations = cos_sin(cfg)
    local_rotations = rotations
    if cfg.get("model_type") == "gemma3_text":  # the sliding layers' own base, unscaled
        local_cfg = dict(cfg, rope_theta=cfg.get("rope_local_base_freq", 10000.0), rope_scaling=None)
        local_rotations = cos_sin(local_cfg)
    mask = torch.full((T, T), float("-inf"), dtype=dtype).triu(1)
    gemma3 = cfg.get("model_type") == "gemma3_text"
    gemma2 = cfg.get("model_type") == "gemma2" or gemma3  # norms on each sublayer's output too
    gemma = cfg.get("model_type") == "gemma" or gemma2
    offset = 1.0 if gemma else 0.0  # Gemma's norms store their weight's difference from 1
    granite = cfg.get("model_type") == "granite"
    scaling = cfg["query_pre_attn_scalar"] ** -0.5 if gemma2 else 1 / math.sqrt(hd)
    if granite:
        scaling = cfg.get("attention_multiplier", 1.0)
    residual = cfg.get("residual_multiplier", 1.0) if granite else 1.0
    attn_cap = cfg.get("attn_logit_softcapping", None if gemma3 else 50.0) if gemma2 else None
    final_cap = cfg.get("final_logit_softcapping", None if gemma3 else 30.0) if gemma2 else None
    act = activation(cfg)

    x = p["model.embed_tokens.weight"][ids]
    if gemma:  # transformers' normaliser: a float32 tensor, cast to the working dtype
        x = x * torch.tensor(D**0.5, dtype=torch.float32).to(dtype)
    if granite:  # a Python float
        x = x * cfg.get("embedding_multiplier", 1.0)
    for l in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{l}."
        xn = rms_norm(x, p[pre + "input_layernorm.weight"], eps, offset)
        phi3 = cfg.get("model_type") == "phi3"
        if phi3:  # one projection for q, k and v
            q, k, v = torch.split(linear(cfg, p, pre + "self_attn.qkv_proj", xn),
                                  [H * hd, Hkv * hd, Hkv * hd], dim=-1)
            q, k = q.reshape(B, T, H, hd), k.reshape(B, T, Hkv, hd)
            v = v.reshape(B, T, Hkv, hd).transpose(1, 2)
        else:
            q = linear(cfg, p, pre + "self_attn.q_proj", xn).view(B, T, H, hd)
            k = linear(cfg, p, pre + "self_attn.k_proj", xn).view(B, T, Hkv, hd)
        if cfg.get("model_type") in ("qwen3", "gemma3_text"):  # each head normalised over head_dim
            q = rms_norm(q, p[pre + "self_attn.q_norm.weight"], eps, offset)
            k = rms_norm(k, p[pre + "self_attn.k_norm.weight"], eps, offset)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        if not phi3:
            v = linear(cfg, p, pre + "self_attn.v_proj", xn).view(B, T, Hkv, hd).transpose(1, 2)
        window = layer_window(cfg, l)
        cos, sin = local_rotations if gemma3 and window is not None else rotations
        if rotates(cfg, l):
            q = torch.cat((q[..., :rot] * cos + rotate_half(q[..., :rot]) * sin, q[..., rot:]), dim=-1)
            k = torch.cat((k[..., :rot] * cos + rotate_half(k[..., :rot]) * sin, k[..., rot:]), dim=-1)
        k = k.repeat_interleave(H // Hkv, dim=1)
        v = v.repeat_interleave(H // Hkv, dim=1)
        layer_mask = mask
        if window is not None:  # keys at or before i - window are out of query i's view
            layer_mask = mask + torch.full((T, T), float("-inf"), dtype=dtype).tril(-window)
        scores = q @ k.transpose(-1, -2) * scaling
        if attn_cap:
            scores = torch.tanh(scores / attn_cap) * attn_cap
        scores = scores + layer_mask
        att = torch.softmax(scores, dim=-1) @ v
        att = att.transpose(1, 2).reshape(B, T, H * hd)
        o = linear(cfg, p, pre + "self_attn.o_proj", att)
        if gemma2:  # the attention's output normed, then the MLP's input by its own norm
            h = x + rms_norm(o, p[pre + "post_attention_layernorm.weight"], eps, offset)
            hn = rms_norm(h, p[pre + "pre_feedforward_layernorm.weight"], eps, offset)
        else:
            h = x + o * residual
            hn = rms_norm(h, p[pre + "post_attention_layernorm.weight"], eps, offset)
        if phi3:  # one projection for gate and up, gate first
            gate, up = linear(cfg, p, pre + "mlp.gate_up_proj", hn).chunk(2, dim=-1)
        else:
            gate = linear(cfg, p, pre + "mlp.gate_proj", hn)
            up = linear(cfg, p, pre + "mlp.up_proj", hn)
        m = linear(cfg, p, pre + "mlp.down_proj", act(gate) * up)
        if gemma2:
            m = rms_norm(m, p[pre + "post_feedforward_layernorm.weight"], eps, offset)
        x = h + m * residual
    xf = rms_norm(x, p["model.norm.weight"], eps, offset)
    w = p["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings") else p["lm_head.weight"]
    logits = xf @ w.T
    if final_cap:
        logits = torch.tanh(logits / final_cap) * final_cap
    if granite:
        logits = logits / cfg.get("logits_scaling", 1.0)
    return logits


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("tokens")
    ap.add_argument("out")
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--dtype", default="float64", choices=["float32", "float64"])
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)

    with open(f"{args.model_dir}/config.json") as f:
        cfg = json.load(f)
    params = {n: t.to(dtype).requires_grad_(True) for n, t in read_safetensors(f"{args.model_dir}/model.safetensors").items()}
    names = expected_names(cfg)
    if set(params) != names:
        print(f"checkpoint tensors differ from config.json's model: missing {sorted(names - set(params))}, "
              f"extra {sorted(set(params) - names)}", file=sys.stderr)
        return 1
    B, T = args.batch, args.seq_len
    with open(args.tokens, "rb") as f:
        raw = f.read()
    if len(raw) not in (8 * B * T, 12 * B * T):
        print(f"{args.tokens}: {len(raw)} bytes, not 2 or 3 x {B * T} int32s", file=sys.stderr)
        return 1
    toks = torch.tensor(struct.unpack(f"<{len(raw) // 4}i", raw), dtype=torch.int64)
    ids, targets, other = toks[: B * T].view(B, T), toks[B * T : 2 * B * T], toks[2 * B * T :]

    logits = forward(cfg, params, ids, dtype)
    V = logits.shape[-1]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), targets, ignore_index=-100)
    loss.backward()
    out = {"loss": loss.detach().reshape(1), "logits": logits.detach().reshape(B * T, V)}
    if len(other):
        out["loss_other"] = torch.nn.functional.cross_entropy(
            logits.detach().reshape(-1, V), other, ignore_index=-100).reshape(1)
    for n, t in params.items():
        out["grad." + n] = t.grad if t.grad is not None else torch.zeros_like(t)
    write_safetensors(args.out, out)
    print(f"loss {loss.item():.9g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
