#!/usr/bin/env bash
# packing.sh: fine-tuning rows trained one per sequence (--packing none, TRL without packing)
# and packed whole with attention kept to each (--packing bfd, TRL's bfd packing), side by side
# in one run on the same rows, model, seed and sequence length.
#
# It writes ROWS prompt/completion rows whose lengths spread as chat data's do (a few long, most
# short: completion words drawn from a log-normal), tokenizes them with the byte tokenizer, and
# first checks that the two packings give the same loss under `strata eval` (relative 1e-5:
# each document attends to itself alone either way). Only then does it time one epoch of
# `strata train` with each, alternating which runs first over ROUNDS rounds, and prints the
# sequences, the padding, the seconds per epoch and the counted (completion) tokens per second,
# with bfd / none.
#
# Usage: bench/packing.sh [WORKDIR]  (default: a temporary directory)
#   STRATA=path/to/strata (default build/bin/strata), ROWS=2000, SEQ_LEN=256 (the tiny model's context), MICRO_BATCH=4,
#   MODEL=tiny, DEVICES=host, ROUNDS=2.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
strata=${STRATA:-$root/build/bin/strata}
[ -x "$strata" ] || { echo "packing: no strata binary at $strata; build first or set STRATA" >&2; exit 1; }
work=${1:-$(mktemp -d)}
mkdir -p "$work"
rows=${ROWS:-2000}
seq_len=${SEQ_LEN:-256}
micro=${MICRO_BATCH:-4}
model=${MODEL:-tiny}
devices=${DEVICES:-host}
rounds=${ROUNDS:-2}

python3 - "$work/rows.jsonl" "$rows" <<'PY'
import json, math, random, sys
path, n = sys.argv[1], int(sys.argv[2])
rng = random.Random(20261127)
words = ["alpha", "beta", "gamma", "delta", "theta", "kappa", "sigma", "omega"]
with open(path, "w") as f:
    for i in range(n):
        prompt = " ".join(rng.choice(words) for _ in range(rng.randint(3, 20))) + "? "
        k = max(1, int(math.exp(rng.gauss(2.3, 0.8))))  # median ~10 words, a long tail
        f.write(json.dumps({"prompt": prompt,
                            "completion": " ".join(rng.choice(words) for _ in range(k))}) + "\n")
PY
"$strata" tokenize --input "$work/rows.jsonl" --output "$work/rows.bin" --append-eos >/dev/null

common=(--model "$model" --init random --seed 7 --seq-len "$seq_len" --devices "$devices")
evaluate() {
  "$strata" eval "${common[@]}" --data "$work/rows.bin" --batch "$micro" --packing "$1" --json |
    tail -n 1
}
none=$(evaluate none)
bfd=$(evaluate bfd)
python3 - "$none" "$bfd" <<'PY'
import json, sys
a, b = (json.loads(x) for x in sys.argv[1:3])
if a["tokens"] != b["tokens"] or abs(a["loss"] - b["loss"]) > 1e-5 * abs(a["loss"]):
    sys.exit(f"packing: none and bfd disagree: loss {a['loss']} vs {b['loss']}, "
             f"tokens {a['tokens']} vs {b['tokens']}; not timing")
print(f"verified: loss {a['loss']:.6f} (none) and {b['loss']:.6f} (bfd) over {a['tokens']} "
      f"counted tokens; sequences {a['sequences']} (none) and {b['sequences']} (bfd)")
PY

# One epoch of training with each packing, alternating which goes first; seconds per epoch.
declare -A seconds
for ((r = 0; r < rounds; r++)); do
  order=(none bfd)
  ((r % 2 == 1)) && order=(bfd none)
  for p in "${order[@]}"; do
    rm -rf "$work/run-$p"
    t0=$(date +%s.%N)
    "$strata" train "${common[@]}" --data "$work/rows.bin" --epochs 1 --micro-batch "$micro" \
      --packing "$p" --save-every 0 --run-dir "$work/run-$p" >"$work/train-$p.log" 2>&1
    t1=$(date +%s.%N)
    seconds[$p]="${seconds[$p]:-} $(python3 -c "print($t1 - $t0)")"
  done
done
python3 - "$none" "$bfd" "${seconds[none]}" "${seconds[bfd]}" "$work" <<'PY'
import json, statistics, sys
a, b = (json.loads(x) for x in sys.argv[1:3])
s = {"none": [float(x) for x in sys.argv[3].split()], "bfd": [float(x) for x in sys.argv[4].split()]}
work = sys.argv[5]
for name, e in (("none", a), ("bfd", b)):
    lines = [l for l in open(f"{work}/train-{name}.log") if "one per sequence" in l or "packed into" in l]
    med = statistics.median(s[name])
    print(f"{name:5s} {e['sequences']:6d} sequences  {med:8.2f} s/epoch (rounds: "
          f"{', '.join(f'{x:.2f}' for x in s[name])})  {e['tokens'] / med:10.0f} counted tokens/s")
    if lines: print("      " + lines[0].strip())
print(f"bfd / none: {statistics.median(s['none']) / statistics.median(s['bfd']):.2f}x the counted tokens per second")
PY
