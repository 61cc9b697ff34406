#!/usr/bin/env python3
"""An independent safetensors reader and writer (json + struct + torch), to check strata's files.

Debian 12 has no python3-safetensors, so this script reads the format as its specification
describes it, stricter than strata's own reader where strata's writer promises more:
  - 8-byte little-endian header length n, n % 8 == 0 (so the data is 8-byte aligned);
  - the header is UTF-8 JSON starting with '{', padded at the end with spaces only, no key twice;
  - "__metadata__" maps strings to strings;
  - every tensor has dtype F32/BF16/F16, a shape of non-negative ints, and data_offsets; the
    offsets tile the data section exactly (contiguous from 0 to its end, no gap, no overlap),
    each begin aligned to the element size.
The tensor values are compared bit for bit with values computed here by torch, including its
own float32 -> bfloat16/float16 rounding.

usage:
  safetensors_check.py verify FILE          check one file strata wrote
  safetensors_check.py verify-dir DIR       check a sharded checkpoint (index + shards)
  safetensors_check.py write FILE           write the same tensors, for strata to read
Exit status: 0 when everything matches, 1 with a message otherwise, 77 without torch.
"""
import json
import os
import struct
import sys

try:
    import torch
except ImportError:  # the C++ test reports a skip, naming python3-torch
    sys.exit(77)

DTYPES = {"F32": (torch.float32, torch.int32), "BF16": (torch.bfloat16, torch.int16),
          "F16": (torch.float16, torch.int16)}
SIZES = {"F32": 4, "BF16": 2, "F16": 2}

# name -> (dtype, shape); the C++ test writes the same list.
SPEC = {
    "t0": ("F32", [3, 5]),
    "t1": ("BF16", [17]),
    "t2": ("F16", [2, 3, 4]),
    "t3": ("F32", []),
    "t4": ("BF16", [0, 3]),
    "t5": ("F16", [1000]),
    "t6": ("BF16", [33, 7]),
    "special.bf16": ("BF16", [6]),
    "special.f16": ("F16", [6]),
}
# Overflow to inf in f16, an f16 subnormal, negative zero, near float max, an f32 subnormal,
# and a tie that rounds to even.
SPECIAL = [65520.0, 1e-7, -0.0, 3.0e38, 1.0e-40, 1.0 + 2.0**-8]


class Bad(Exception):
    pass


def expected(name):
    dtype, shape = SPEC[name]
    numel = 1
    for d in shape:
        numel *= d
    if name.startswith("special"):
        values = SPECIAL
    else:
        k = int(name[1:])
        # Integers over 1024: exact in float32, and rounded by bf16 and f16.
        values = [((i * 7919 + k * 104729) % 20011 - 10005) / 1024.0 for i in range(numel)]
    t = torch.tensor(values, dtype=torch.float32).reshape(shape)
    return t.to(DTYPES[dtype][0])


def no_duplicates(pairs):
    keys = [k for k, _ in pairs]
    for k in keys:
        if keys.count(k) > 1:
            raise Bad(f"key {k!r} appears twice in the header")
    return dict(pairs)


def verify_file(path):
    """Checks one file; returns {name: bytes} of its tensors."""
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        raise Bad(f"{path}: {len(blob)} bytes, shorter than the header length")
    (n,) = struct.unpack("<Q", blob[:8])
    if n % 8 != 0:
        raise Bad(f"{path}: header length {n} is not a multiple of 8")
    if 8 + n > len(blob):
        raise Bad(f"{path}: header length {n} runs past the end")
    text = blob[8 : 8 + n].decode("utf-8")
    if not text.startswith("{"):
        raise Bad(f"{path}: header does not start with '{{'")
    body = text.rstrip(" ")
    if not body.endswith("}") or len(text) - len(body) >= 8:
        raise Bad(f"{path}: header padding is not 0-7 spaces after the JSON")
    header = json.loads(body, object_pairs_hook=no_duplicates)
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise Bad(f"{path}: __metadata__ is not a map of strings")
    data = blob[8 + n :]
    spans = []
    for name, info in header.items():
        if set(info) != {"dtype", "shape", "data_offsets"}:
            raise Bad(f"{path}: tensor {name}: keys {sorted(info)}")
        dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        if dtype not in SIZES:
            raise Bad(f"{path}: tensor {name}: dtype {dtype}")
        if not all(isinstance(d, int) and d >= 0 for d in shape):
            raise Bad(f"{path}: tensor {name}: shape {shape}")
        numel = 1
        for d in shape:
            numel *= d
        if end - begin != numel * SIZES[dtype]:
            raise Bad(f"{path}: tensor {name}: {end - begin} bytes for {dtype}{shape}")
        if begin % SIZES[dtype] != 0:
            raise Bad(f"{path}: tensor {name}: offset {begin} not aligned to its element size")
        spans.append((begin, end, name))
    at = 0
    for begin, end, name in sorted(spans):
        if begin != at:
            raise Bad(f"{path}: tensor {name} starts at {begin}, expected {at} (gap or overlap)")
        at = end
    if at != len(data):
        raise Bad(f"{path}: tensors end at {at} but the data section is {len(data)} bytes")
    return {name: (header[name], data[header[name]["data_offsets"][0] : header[name]["data_offsets"][1]])
            for name in header}, meta


def compare(path, name, info, raw):
    if name not in SPEC:
        raise Bad(f"{path}: unexpected tensor {name}")
    dtype, shape = SPEC[name]
    if info["dtype"] != dtype or info["shape"] != shape:
        raise Bad(f"{path}: tensor {name} is {info['dtype']}{info['shape']}, expected {dtype}{shape}")
    want = expected(name)
    if want.numel() == 0:
        return
    got = torch.frombuffer(bytearray(raw), dtype=DTYPES[dtype][0]).reshape(shape)
    bits = DTYPES[dtype][1]
    if not torch.equal(got.view(bits), want.view(bits)):
        diff = (got.view(bits) != want.view(bits)).flatten().nonzero()[:5].flatten().tolist()
        raise Bad(f"{path}: tensor {name} differs at elements {diff}: "
                  f"{[got.flatten()[i].item() for i in diff]} vs {[want.flatten()[i].item() for i in diff]}")


def verify(path):
    tensors, meta = verify_file(path)
    if meta.get("format") != "pt":
        raise Bad(f"{path}: __metadata__ {meta} has no format 'pt' (Hugging Face requires it)")
    for name, (info, raw) in tensors.items():
        compare(path, name, info, raw)
    if set(tensors) != set(SPEC):
        raise Bad(f"{path}: tensors {sorted(tensors)} instead of {sorted(SPEC)}")


def verify_dir(directory):
    with open(os.path.join(directory, "model.safetensors.index.json")) as f:
        index = json.load(f)
    weight_map = index["weight_map"]
    seen, total = {}, 0
    for shard in sorted(set(weight_map.values())):
        tensors, _ = verify_file(os.path.join(directory, shard))
        for name, (info, raw) in tensors.items():
            if weight_map.get(name) != shard:
                raise Bad(f"{shard} holds {name}, mapped to {weight_map.get(name)}")
            if name in seen:
                raise Bad(f"{name} in {seen[name]} and {shard}")
            seen[name] = shard
            total += len(raw)
            compare(shard, name, info, raw)
    if set(seen) != set(weight_map) or set(seen) != set(SPEC):
        raise Bad(f"shards hold {sorted(seen)}, index maps {sorted(weight_map)}")
    if index["metadata"]["total_size"] != total:
        raise Bad(f"metadata.total_size {index['metadata']['total_size']}, tensors hold {total}")


def write(path):
    # Our own layout choices, unlike strata's: data in reverse name order, default separators.
    header, blobs, offset = {"__metadata__": {"format": "pt", "writer": "safetensors_check.py"}}, [], 0
    for name in sorted(SPEC, reverse=True):
        t = expected(name)
        raw = t.contiguous().view(DTYPES[SPEC[name][0]][1]).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": SPEC[name][0], "shape": SPEC[name][1],
                        "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        blobs.append(raw)
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for raw in blobs:
            f.write(raw)


def main():
    if len(sys.argv) != 3 or sys.argv[1] not in ("verify", "verify-dir", "write"):
        print(__doc__, file=sys.stderr)
        return 2
    mode, path = sys.argv[1], sys.argv[2]
    try:
        {"verify": verify, "verify-dir": verify_dir, "write": write}[mode](path)
    except Bad as e:
        print(f"safetensors_check: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
