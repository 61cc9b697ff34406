#!/usr/bin/env python3
"""Writes the seed inputs of the fuzz targets: valid files of each format and damaged variants.

Usage: fuzz/seeds.py OUT_DIR   (writes OUT_DIR/<target>/seed-*; fuzz/run.sh merges them into
fuzz/corpus/<target>/). The DeepSpeed seeds are the configs tests/test_ds_config.cpp uses,
taken from its raw string literals, so the corpus follows the tests.
"""
import json
import pathlib
import re
import struct
import sys

HERE = pathlib.Path(__file__).resolve().parent


def safetensors(header, data=b"", pad=True, length=None):
    text = json.dumps(header, separators=(",", ":")).encode()
    if pad:
        text += b" " * (-len(text) % 8)
    n = len(text) if length is None else length
    return struct.pack("<Q", n) + text + data


def safetensors_seeds():
    f32 = struct.pack("<4f", 1.0, -2.0, 0.5, 3.25)
    bf16 = struct.pack("<3H", 0x3F80, 0xC000, 0x7FC0)  # 1, -2, NaN
    f16 = struct.pack("<2H", 0x3C00, 0x7C00)  # 1, inf
    good = {
        "__metadata__": {"format": "pt"},
        "a.weight": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
        "b.weight": {"dtype": "BF16", "shape": [3], "data_offsets": [16, 22]},
        "c.bias": {"dtype": "F16", "shape": [1, 2], "data_offsets": [22, 26]},
        "empty": {"dtype": "F32", "shape": [0, 4], "data_offsets": [26, 26]},
    }
    data = f32 + bf16 + f16
    yield "valid", safetensors(good, data)
    yield "valid-unaligned", safetensors(good, data, pad=False)
    yield "valid-empty-header", safetensors({})
    yield "valid-scalar", safetensors({"s": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]}},
                                      f32[:4])

    def damaged(name, change):
        h = json.loads(json.dumps(good))
        change(h)
        yield name, safetensors(h, data)

    yield from damaged("bad-dtype", lambda h: h["a.weight"].update(dtype="I64"))
    yield from damaged("bad-shape", lambda h: h["a.weight"].update(shape=[2, -2]))
    yield from damaged("huge-shape", lambda h: h["a.weight"].update(shape=[2**40, 2**40]))
    yield from damaged("overlap", lambda h: h["b.weight"].update(data_offsets=[14, 20]))
    yield from damaged("past-end", lambda h: h["c.bias"].update(data_offsets=[22, 4096]))
    yield from damaged("reversed", lambda h: h["c.bias"].update(data_offsets=[26, 22]))
    yield from damaged("wrong-size", lambda h: h["a.weight"].update(data_offsets=[0, 12]))
    yield from damaged("extra-key", lambda h: h["a.weight"].update(extra=1))
    yield from damaged("metadata-not-string", lambda h: h["__metadata__"].update(format=1))
    yield "header-too-long", safetensors(good, data, length=1 << 40)
    yield "header-past-end", safetensors(good, data, length=len(json.dumps(good)) + 4096)
    yield "not-json", struct.pack("<Q", 8) + b"{garbage"
    yield "header-array", safetensors([1, 2])
    yield "truncated", b"\x10\x00\x00"
    # A shape nested 100,000 deep: its error message used to dump() it recursively and
    # overflow the stack; now refused at 64 levels by the JSON reader.
    deep = b'{"t":{"dtype":"F32","shape":' + b"[" * 100000 + b"]" * 100000 + b',"data_offsets":[0,0]}}'
    yield "deep-shape", struct.pack("<Q", len(deep)) + deep
    # A number past a double's range: nlohmann's out_of_range used to escape the reader.
    big = b'{"t":{"dtype":"F32","shape":[1E400],"data_offsets":[0,4]}}'
    yield "number-overflow", struct.pack("<Q", len(big)) + big + f32[:4]
    dup = b'{"a":{},"a":{}}'
    yield "duplicate-key", struct.pack("<Q", len(dup)) + dup + data


def ds_config_seeds():
    test = (HERE.parent / "tests" / "test_ds_config.cpp").read_text()
    literals = re.findall(r'R"\((.*?)\)"', test, re.S)
    for i, text in enumerate(literals):
        yield f"test-{i:02d}", text.encode()
    yield "not-json", b'{"train_batch_size": '
    yield "duplicate-key", b'{"train_batch_size": 8, "train_batch_size": 16}'
    # Nested 100,000 deep: the error message used to dump() the value recursively and overflow
    # the stack; now refused at 64 levels by the JSON reader.
    yield "deep", b'{"train_batch_size": ' + b"[" * 100000 + b"]" * 100000 + b"}"
    yield "number-overflow", b'{"optimizer": {"params": {"lr": 1e400}}}'
    yield "overflow-batch", json.dumps({"train_batch_size": 2**62,
                                        "train_micro_batch_size_per_gpu": 2**62,
                                        "gradient_accumulation_steps": 4}).encode()


def llmc(tokens, magic, version, width, count=None):
    header = [0] * 256
    header[0], header[1] = magic, version
    header[2] = len(tokens) if count is None else count
    fmt = "<%d%s" % (len(tokens), "H" if width == 2 else "I")
    return struct.pack("<256i", *header) + struct.pack(fmt, *tokens)


def tokens_seeds():
    # Prefix: mode (0 llm.c, 1 raw uint16, 2 raw uint32), sequence length byte, vocabulary byte.
    ids = [72, 101, 108, 108, 111, 256, 33, 10, 0, 255]
    yield "llmc-u16", bytes([0, 3, 0]) + llmc(ids, 20240520, 1, 2)
    yield "llmc-u32", bytes([0, 2, 1]) + llmc(ids + [70000], 20240801, 7, 4)
    yield "llmc-u16-empty", bytes([0, 0, 0]) + llmc([], 20240520, 1, 2)
    yield "raw-u16", bytes([1, 4, 0]) + struct.pack("<10H", *ids)
    yield "raw-u32", bytes([2, 1, 1]) + struct.pack("<10I", *ids)
    yield "raw-odd-size", bytes([1, 4, 0]) + b"\x01\x02\x03"
    yield "id-over-vocab", bytes([0, 3, 0]) + llmc(ids + [300], 20240520, 1, 2)
    yield "bad-magic", bytes([0, 3, 0]) + llmc(ids, 20240521, 1, 2)
    yield "bad-version", bytes([0, 3, 0]) + llmc(ids, 20240520, 7, 2)
    yield "negative-count", bytes([0, 3, 0]) + llmc(ids, 20240520, 1, 2, count=-5)
    yield "count-past-end", bytes([0, 3, 0]) + llmc(ids, 20240520, 1, 2, count=2**31 - 1)
    yield "short-header", bytes([0, 3, 0]) + llmc(ids, 20240520, 1, 2)[:100]
    yield "one-token", bytes([0, 0, 0]) + llmc([5], 20240520, 1, 2)
    # With a loss mask beside the file (bit 2): flags from each byte's low bit, the bytes as
    # they are (bit 3, mostly not 0 or 1), or a header spoilt by the file's first bytes (bit 4).
    yield "mask-llmc-u16", bytes([4, 3, 0]) + llmc(ids, 20240520, 1, 2)
    yield "mask-raw-u16", bytes([5, 2, 0]) + struct.pack("<10H", *ids)
    yield "mask-raw-flags", bytes([4 | 8, 3, 0]) + llmc(ids, 20240520, 1, 2)
    yield "mask-spoilt-header", bytes([4 | 16, 3, 0]) + llmc(ids, 20240520, 1, 2)
    yield "mask-all-zero", bytes([5, 1, 0]) + struct.pack("<10H", *([0] * 10))
    # With a document index beside the file (bit 5): starts spaced by the file's bytes, with
    # and without a mask, or the file's bytes as the starts (bit 6).
    yield "docs-llmc-u16", bytes([32, 3, 0]) + llmc(ids, 20240520, 1, 2)
    yield "docs-mask-raw-u16", bytes([32 | 5, 2, 0]) + struct.pack("<10H", *ids)
    yield "docs-long-raw-u16", bytes([32 | 1, 5, 0]) + struct.pack("<40H", *(ids * 4))
    yield "docs-garbage-starts", bytes([32 | 64 | 1, 3, 0]) + struct.pack("<16H", *range(16))


def chat_template_seeds():
    # Every template of the chat template test corpus, and a few cut short.
    corpus = HERE.parent / "tests" / "data" / "chat_templates"
    for path in sorted(corpus.rglob("*.jinja")):
        name = path.relative_to(corpus).with_suffix("").as_posix().replace("/", "-")
        data = path.read_bytes()
        yield name, data
        if name.startswith("families-"):
            yield name + "-cut", data[: len(data) // 2]


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    out = pathlib.Path(sys.argv[1])
    for target, seeds in (("safetensors", safetensors_seeds()),
                          ("ds_config", ds_config_seeds()),
                          ("tokens", tokens_seeds()),
                          ("chat_template", chat_template_seeds())):
        d = out / target
        d.mkdir(parents=True, exist_ok=True)
        for name, data in seeds:
            (d / f"seed-{name}").write_bytes(data)


if __name__ == "__main__":
    main()
