#!/usr/bin/env python3
"""bpe_reference.py: Hugging Face tokenizer.json files for strata's tokenizer tests, and an
independent encoder and decoder of them (the `tokenizers` library is not a Debian package).

    bpe_reference.py make DIR STYLE        writes DIR/tokenizer.json (and tokenizer_config.json)
    bpe_reference.py encode DIR IN OUT     encodes every text of IN (a JSON list of strings)

STYLE is the layout of a real model's file, with a vocabulary learned here from the corpus
below by plain BPE training:
  llama3     Llama 3's: its Split regex, byte-level alphabet, ignore_merges, <|begin_of_text|>
             prefix, 256 special tokens after the vocabulary, eos from tokenizer_config.json;
  llama2     Llama 2's "fast" tokenizer: Prepend/Replace normalizers, no pre-tokenizer (the
             whole text is one word), byte fallback for characters outside the vocabulary, <s>
             prefix, Replace/ByteFallback/Fuse/Strip decoder;
  gpt2       GPT-2's: ByteLevel with its own regex, <|endoftext|> as the only added token;
  gpt2_nfkc  the same with an NFKC normalizer (compatibility characters folded: ① is 1);
  qwen2      Qwen2's: an NFC normalizer, Llama 3's regex with single digits, byte-level
             alphabet, no prefix, ChatML's <|im_start|>/<|im_end|>, eos <|im_end|>;
  metaspace  Mistral's newer layout: a Metaspace pre-tokenizer with prepend_scheme "first";
  metaspace_split  the older Metaspace layout (add_prefix_space, split at every ▁).

`encode` writes {"ids", "decoded", "prefix", "suffix", "eos", "vocab_size"}: ids as the library's
encode(text, add_special_tokens=False), decoded as decode(ids, skip_special_tokens=True). The
regexes run on the `regex` module (Debian's python3-regex); exit status 77 when it is missing.
BPE here merges the lowest-ranked adjacent pair, leftmost first, until none is left, over
strings: a different algorithm from strata's priority queue over ids, with the same result.
"""
import json
import os
import sys
import unicodedata

try:
    import regex
except ImportError:
    print("the regex module is missing: install Debian's python3-regex", file=sys.stderr)
    sys.exit(77)

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
QWEN2_PATTERN = LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")
SPACE = "\u2581"  # ▁

CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog didn't care; it's THAT lazy.",
    "We've trained 7B and 13B models, and they'll train 70B ones: I'm sure we'd do it.",
    "Numbers: 1234567890, 3.14159, 2026-11-27, 0x7fff, 1e-5 and 100000 tokens per second.",
    "for (int i = 0; i < n; ++i) {\n    sum += a[i] * b[i];\n}\n",
    "def forward(self, x):\n\treturn self.norm(x) + x  # residual\n",
    "Les élèves étudient à l'école ; la forêt est très belle en été.",
    "Über die Brücke gehen wir, größer und schöner als je zuvor.",
    "Η γρήγορη καφέ αλεπού πηδάει πάνω από τον τεμπέλη σκύλο.",
    "Быстрая коричневая лиса прыгает через ленивую собаку.",
    "strata trains language models whose state does not fit on the gpu",
    "every transfer is scheduled ahead of its use, and overlapped with compute",
    "  two leading spaces, trailing spaces   \nand a CRLF line\r\nthen tabs\t\tand more",
    "!!! ??? ... --- *** ((( ))) [[ ]] {{ }} <<< >>> ### @@@ $$$ %%% ^^^ &&& ~~~",
    "https://huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/tokenizer.json",
    # Whitespace outside ASCII, so that merges learn it and a regex that does not count it as
    # \s splits differently.
    "x\u2003\u2003y\u00a0\u00a0 z\u3000\u3000w " * 3,
]
# Text the vocabulary is not trained on, for the comparisons (besides the corpus itself).
EXTRA = [
    "",
    " ",
    "a",
    "Hello world",
    " Hello world",
    "Hello  world   again    and\tagain\n\n\nnew paragraph",
    "東京は日本の首都です。中文也可以。",
    "emoji 😀👍🏽 and a family 👨‍👩‍👧 in text",
    "I'LL SHOUT, YOU'D WHISPER, they'Ve mixed",
    "1 12 123 1234 12345 123456 1234567",
    "tab\tnewline\ncarriage\rcrlf\r\nform\fvertical\v",
    "ends with spaces   ",
    "\n\nstarts with newlines",
    "unicode spaces:\u00a0nbsp\u2003em\u3000ideographic",
    "runs of them: a\u2003\u2003b\u00a0\u00a0 c\u3000\u3000\u3000d \u2028\u0085 e\x1c\x1f f",
    "<|begin_of_text|>special in the middle<|end_of_text|> and after <|eot_id|>!",
    "<s>llama two's markers</s> <unk> inside",
    "a<|endoftext|>b",
    "combining e\u0301 and precomposed \u00e9, zero\u200bwidth",
    "long aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa run",
    "ǅ ǈ ǋ Ⅻ ⅷ ① ½ ²³ ٣ ४ ๕",
]


def bytes_to_unicode():
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


BYTE_ENC = bytes_to_unicode()
BYTE_DEC = {c: b for b, c in BYTE_ENC.items()}


# ---- training (only to have realistic files) -------------------------------------------------

def train_merges(words, alphabet, count):
    """Plain BPE: `count` times, merge the most frequent adjacent pair (ties: smallest pair)."""
    freq = {}
    for w in words:
        syms = tuple(w)
        if all(s in alphabet for s in syms):
            freq[syms] = freq.get(syms, 0) + 1
    merges = []
    for _ in range(count):
        pairs = {}
        for syms, f in freq.items():
            for a, b in zip(syms, syms[1:]):
                pairs[(a, b)] = pairs.get((a, b), 0) + f
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        new = {}
        for syms, f in freq.items():
            out, i = [], 0
            while i < len(syms):
                if i + 1 < len(syms) and (syms[i], syms[i + 1]) == best:
                    out.append(syms[i] + syms[i + 1])
                    i += 2
                else:
                    out.append(syms[i])
                    i += 1
            new[tuple(out)] = new.get(tuple(out), 0) + f
        freq = new
    return merges


def byte_level_words(pattern):
    words = []
    for text in CORPUS:
        for m in regex.finditer(pattern, text):
            words.append("".join(BYTE_ENC[b] for b in m.group().encode("utf-8")))
    return words


def add_merges(vocab, merges):
    for a, b in merges:
        if a + b not in vocab:
            vocab[a + b] = len(vocab)


def make(directory, style):
    os.makedirs(directory, exist_ok=True)
    config = None
    if style == "qwen2":
        vocab = {BYTE_ENC[b]: i for i, b in enumerate(sorted(BYTE_ENC))}
        merges = train_merges(byte_level_words(QWEN2_PATTERN), set(vocab), 400)
        add_merges(vocab, merges)
        base = len(vocab)
        added = [{"id": base + i, "content": n, "single_word": False, "lstrip": False,
                  "rstrip": False, "normalized": False, "special": True}
                 for i, n in enumerate(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])]
        tok = {
            "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
            "normalizer": {"type": "NFC"},
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": QWEN2_PATTERN}, "behavior": "Isolated",
                 "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                 "use_regex": False}]},
            "post_processor": {"type": "ByteLevel", "add_prefix_space": False,
                               "trim_offsets": False, "use_regex": False},
            "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                        "use_regex": False},
            "model": {"type": "BPE", "dropout": None, "unk_token": None,
                      "continuing_subword_prefix": "", "end_of_word_suffix": "",
                      "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": vocab, "merges": ["%s %s" % m for m in merges]},
        }
        config = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                  "model_max_length": 131072, "tokenizer_class": "Qwen2Tokenizer"}
    elif style in ("llama3", "gpt2", "gpt2_nfkc"):
        pattern = LLAMA3_PATTERN if style == "llama3" else GPT2_PATTERN
        vocab = {BYTE_ENC[b]: i for i, b in enumerate(sorted(BYTE_ENC))}
        merges = train_merges(byte_level_words(pattern), set(vocab), 400)
        add_merges(vocab, merges)
        if style == "llama3":
            # Whole words no merge reaches: ignore_merges takes them as they are.
            for w in ["Ġunreachable", "Ġstrata", "Hello"]:
                vocab.setdefault(w, len(vocab))
            base = len(vocab)
            names = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                     "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>",
                     "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>",
                     "<|python_tag|>"]
            names += ["<|reserved_special_token_%d|>" % i for i in range(2, 248)]
            added = [{"id": base + i, "content": n, "single_word": False, "lstrip": False,
                      "rstrip": False, "normalized": False, "special": True}
                     for i, n in enumerate(names)]
            bos = base
            tok = {
                "version": "1.0", "truncation": None, "padding": None,
                "added_tokens": added,
                "normalizer": None,
                "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                    {"type": "Split", "pattern": {"Regex": LLAMA3_PATTERN},
                     "behavior": "Isolated", "invert": False},
                    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                     "use_regex": False}]},
                "post_processor": {"type": "Sequence", "processors": [
                    {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False,
                     "use_regex": True},
                    {"type": "TemplateProcessing",
                     "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                                {"Sequence": {"id": "A", "type_id": 0}}],
                     "pair": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                              {"Sequence": {"id": "A", "type_id": 0}},
                              {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 1}},
                              {"Sequence": {"id": "B", "type_id": 1}}],
                     "special_tokens": {"<|begin_of_text|>": {
                         "id": "<|begin_of_text|>", "ids": [bos],
                         "tokens": ["<|begin_of_text|>"]}}}]},
                "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                            "use_regex": True},
                "model": {"type": "BPE", "dropout": None, "unk_token": None,
                          "continuing_subword_prefix": None, "end_of_word_suffix": None,
                          "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                          "vocab": vocab, "merges": [[a, b] for a, b in merges]},
            }
            config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
                      "model_max_length": 131072, "tokenizer_class": "PreTrainedTokenizerFast"}
        else:
            eot = len(vocab)
            tok = {
                "version": "1.0", "truncation": None, "padding": None,
                "added_tokens": [{"id": eot, "content": "<|endoftext|>", "single_word": False,
                                  "lstrip": False, "rstrip": False, "normalized": True,
                                  "special": True}],
                "normalizer": {"type": "NFKC"} if style == "gpt2_nfkc" else None,
                "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False,
                                  "trim_offsets": True, "use_regex": True},
                "post_processor": {"type": "ByteLevel", "add_prefix_space": True,
                                   "trim_offsets": False, "use_regex": True},
                "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                            "use_regex": True},
                "model": {"type": "BPE", "dropout": None, "unk_token": None,
                          "continuing_subword_prefix": "", "end_of_word_suffix": "",
                          "fuse_unk": False, "vocab": vocab,
                          "merges": ["%s %s" % m for m in merges]},
            }
    elif style in ("llama2", "metaspace", "metaspace_split"):
        vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
        for b in range(256):
            vocab["<0x%02X>" % b] = len(vocab)
        text = " ".join(CORPUS)
        counts = {}
        for ch in text.replace(" ", SPACE):
            counts[ch] = counts.get(ch, 0) + 1
        # Characters seen twice or more; the rarer ones (and everything in EXTRA) fall back to
        # bytes.
        for ch in sorted(counts, key=lambda c: (-counts[c], c)):
            if counts[ch] >= 2:
                vocab[ch] = len(vocab)
        alphabet = set(vocab)
        words = []
        for t in CORPUS:
            norm = SPACE + t.replace(" ", SPACE)
            words += [w for w in regex.split("(?=%s)" % SPACE, norm) if w]
        merges = train_merges(words, alphabet, 400)
        # Runs of spaces: a merge the training (split at every ▁) cannot learn, so that a
        # pre-tokenizer keeping "▁▁" in one word and one splitting it give different ids.
        merges.append((SPACE, SPACE))
        add_merges(vocab, merges)
        added = [{"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
                  "normalized": False, "special": True}
                 for i, c in enumerate(["<unk>", "<s>", "</s>"])]
        model = {"type": "BPE", "dropout": None, "unk_token": "<unk>",
                 "continuing_subword_prefix": None, "end_of_word_suffix": None,
                 "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                 "vocab": vocab, "merges": ["%s %s" % m for m in merges]}
        post = {"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                           {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [], "special_tokens": {"<s>": {"id": "<s>", "ids": [1],
                                                       "tokens": ["<s>"]}}}
        # The two differ in how spaces become ▁: normalizers (llama2) or a pre-tokenizer.
        tok = {
            "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
            "normalizer": None, "pre_tokenizer": None,
            "post_processor": post,
            "decoder": {"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": SPACE}, "content": " "},
                {"type": "ByteFallback"}, {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
            "model": model,
        }
        if style == "llama2":
            tok["normalizer"] = {"type": "Sequence", "normalizers": [
                {"type": "Prepend", "prepend": SPACE},
                {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}]}
            config = {"bos_token": {"content": "<s>", "lstrip": False},
                      "eos_token": {"content": "</s>", "lstrip": False},
                      "add_bos_token": True, "add_eos_token": False}
        elif style == "metaspace":
            tok["pre_tokenizer"] = {"type": "Metaspace", "replacement": SPACE,
                                    "prepend_scheme": "first", "split": False}
        else:  # the older layout: a word per ▁, runs of spaces one ▁ word each
            tok["pre_tokenizer"] = {"type": "Metaspace", "replacement": SPACE,
                                    "add_prefix_space": True}
    else:
        raise SystemExit("unknown style %r" % style)
    with open(os.path.join(directory, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tok, f, ensure_ascii=False, indent=1)
    if config is not None:
        with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, ensure_ascii=False, indent=1)


# ---- encoding and decoding -------------------------------------------------------------------

class Reference:
    def __init__(self, directory):
        with open(os.path.join(directory, "tokenizer.json"), encoding="utf-8") as f:
            tok = json.load(f)
        model = tok["model"]
        assert model["type"] == "BPE"
        self.vocab = model["vocab"]
        self.ranks = {}
        for r, m in enumerate(model["merges"]):
            a, b = m.split(" ") if isinstance(m, str) else m
            self.ranks[(a, b)] = r
        self.unk = model.get("unk_token")
        self.byte_fallback = bool(model.get("byte_fallback"))
        self.fuse_unk = bool(model.get("fuse_unk"))
        self.ignore_merges = bool(model.get("ignore_merges"))
        self.added = sorted(tok.get("added_tokens") or [], key=lambda t: -len(t["content"]))
        self.special = {t["id"] for t in self.added if t["special"]}
        self.piece = {i: p for p, i in self.vocab.items()}
        for t in self.added:
            self.piece[t["id"]] = t["content"]
        self.normalizer = tok.get("normalizer")
        self.pre = tok.get("pre_tokenizer")
        self.decoder = tok.get("decoder")
        self.prefix, self.suffix = [], []
        self.post(tok.get("post_processor"))
        self.eos = None
        config_path = os.path.join(directory, "tokenizer_config.json")
        eos_name = None
        if os.path.exists(config_path):
            with open(config_path, encoding="utf-8") as f:
                e = json.load(f).get("eos_token")
            eos_name = e["content"] if isinstance(e, dict) else e
        for name in ([eos_name] if eos_name else
                     ["<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>"]):
            ids = [t["id"] for t in self.added if t["content"] == name]
            if ids or name in self.vocab:
                self.eos = ids[0] if ids else self.vocab[name]
                break

    def post(self, p):
        if p is None:
            return
        if p["type"] == "Sequence":
            for q in p["processors"]:
                self.post(q)
        elif p["type"] == "TemplateProcessing":
            after = False
            for item in p["single"]:
                if "Sequence" in item:
                    after = True
                else:
                    ids = p["special_tokens"][item["SpecialToken"]["id"]]["ids"]
                    (self.suffix if after else self.prefix).extend(ids)

    def apply(self, value, d, key, step):
        """`step(value, d)`, or each element of a Sequence's `key` list in turn."""
        if d is None:
            return value
        if d["type"] == "Sequence":
            for e in d[key]:
                value = self.apply(value, e, key, step)
            return value
        return step(value, d)

    def normalize(self, s, n):
        return self.apply(s, n, "normalizers", self.normalize_one)

    def normalize_one(self, s, n):
        t = n["type"]
        if t == "Prepend":
            return n["prepend"] + s if s else s
        if t == "Replace":
            pat = n["pattern"]
            if "String" in pat:
                return s.replace(pat["String"], n["content"])
            return regex.sub(pat["Regex"], n["content"], s)
        if t in ("NFC", "NFD", "NFKC", "NFKD"):
            return unicodedata.normalize(t, s)
        raise SystemExit("normalizer %s" % t)

    def pretokenize(self, words, p, start):
        return self.apply(words, p, "pretokenizers", lambda w, q: self.pretokenize_one(w, q, start))

    def pretokenize_one(self, words, p, start):
        t = p["type"]
        if t == "Split":
            assert p["behavior"] == "Isolated" and not p["invert"]
            out = []
            for w in words:
                last = 0
                for m in regex.finditer(p["pattern"]["Regex"], w):
                    if m.start() > last:
                        out.append(w[last:m.start()])
                    if m.end() > m.start():
                        out.append(m.group())
                    last = m.end()
                if last < len(w):
                    out.append(w[last:])
            return out
        if t == "ByteLevel":
            out = []
            for w in words:
                if p.get("add_prefix_space", True) and not w.startswith(" "):
                    w = " " + w
                parts = [m.group() for m in regex.finditer(GPT2_PATTERN, w)] \
                    if p.get("use_regex", True) else [w]
                # The GPT-2 pattern covers every character (its last branch is \s+, and the
                # others take the rest), so no gap is left between matches.
                assert "".join(parts) == w
                out += ["".join(BYTE_ENC[b] for b in x.encode("utf-8")) for x in parts]
            return out
        if t == "Metaspace":
            rep = p["replacement"]
            out = []
            for i, w in enumerate(words):
                w = w.replace(" ", rep)
                scheme = p.get("prepend_scheme", "always")
                if (scheme == "always" or (scheme == "first" and i == 0 and start)) \
                        and not w.startswith(rep):
                    w = rep + w
                if p.get("split", True):
                    out += [x for x in regex.split("(?=%s)" % regex.escape(rep), w) if x]
                else:
                    out.append(w)
            return out
        raise SystemExit("pre_tokenizer %s" % t)

    def bpe(self, word):
        if self.ignore_merges and word in self.vocab:
            return [self.vocab[word]]
        syms, unk_last = [], False
        for ch in word:
            if ch in self.vocab:
                syms.append(ch)
                unk_last = False
            elif self.byte_fallback:
                syms += ["<0x%02X>" % b for b in ch.encode("utf-8")]
                unk_last = False
            else:
                if not (self.fuse_unk and unk_last):
                    syms.append(self.unk)
                unk_last = True
        while True:
            best = None
            for k in range(len(syms) - 1):
                r = self.ranks.get((syms[k], syms[k + 1]))
                if r is not None and (best is None or r < best[0]):
                    best = (r, k)
            if best is None:
                break
            k = best[1]
            syms[k:k + 2] = [syms[k] + syms[k + 1]]
        return [self.vocab[s] for s in syms]

    def encode_text(self, s, start):
        if not s:
            return []
        words = self.pretokenize([self.normalize(s, self.normalizer)], self.pre, start)
        ids = []
        for w in words:
            if w:
                ids += self.bpe(w)
        return ids

    def encode(self, text):
        ids, begin, i = [], 0, 0
        while i < len(text):
            hit = next((t for t in self.added if text.startswith(t["content"], i)), None)
            if hit is None:
                i += 1
                continue
            b, e = i, i + len(hit["content"])
            if hit.get("lstrip"):
                while b > begin and text[b - 1] in " \t\n\r\f\v":
                    b -= 1
            if hit.get("rstrip"):
                while e < len(text) and text[e] in " \t\n\r\f\v":
                    e += 1
            ids += self.encode_text(text[begin:b], begin == 0)
            ids.append(hit["id"])
            begin = i = e
        return ids + self.encode_text(text[begin:], begin == 0)

    def decode_chain(self, tokens, d):
        return self.apply(tokens, d, "decoders", self.decode_one)

    def decode_one(self, tokens, d):
        t = d["type"]
        if t == "ByteLevel":
            data = b""
            for tok in tokens:
                if all(c in BYTE_DEC for c in tok):
                    data += bytes(BYTE_DEC[c] for c in tok)
                else:
                    data += tok.encode("utf-8")
            return [data.decode("utf-8")]
        if t == "Replace":
            return [x.replace(d["pattern"]["String"], d["content"]) for x in tokens]
        if t == "ByteFallback":
            out, run = [], b""
            count = 0
            for tok in tokens + [None]:
                m = regex.fullmatch(r"<0x([0-9A-Fa-f]{2})>", tok) if tok is not None else None
                if m:
                    run += bytes([int(m.group(1), 16)])
                    count += 1
                    continue
                if count:
                    try:
                        out.append(run.decode("utf-8"))
                    except UnicodeDecodeError:
                        out += ["\ufffd"] * count
                    run, count = b"", 0
                if tok is not None:
                    out.append(tok)
            return out
        if t == "Fuse":
            return ["".join(tokens)]
        if t == "Strip":
            c = d["content"]
            out = []
            for x in tokens:
                for _ in range(d["start"]):
                    if x.startswith(c):
                        x = x[len(c):]
                for _ in range(d["stop"]):
                    if x.endswith(c):
                        x = x[:-len(c)]
                out.append(x)
            return out
        raise SystemExit("decoder %s" % t)

    def decode(self, ids):
        tokens = [self.piece[i] for i in ids if i not in self.special]
        return "".join(self.decode_chain(tokens, self.decoder))


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "make":
        make(sys.argv[2], sys.argv[3])
        return
    if len(sys.argv) == 5 and sys.argv[1] == "encode":
        ref = Reference(sys.argv[2])
        with open(sys.argv[3], encoding="utf-8") as f:
            texts = json.load(f)
        ids = [ref.encode(t) for t in texts]
        out = {"ids": ids, "decoded": [ref.decode(x) for x in ids], "prefix": ref.prefix,
               "suffix": ref.suffix, "eos": ref.eos,
               "vocab_size": max(ref.piece) + 1}
        with open(sys.argv[4], "w", encoding="utf-8") as f:
            json.dump(out, f, ensure_ascii=False)
        return
    if len(sys.argv) == 3 and sys.argv[1] == "texts":
        with open(sys.argv[2], "w", encoding="utf-8") as f:
            json.dump(CORPUS + EXTRA, f, ensure_ascii=False)
        return
    raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
