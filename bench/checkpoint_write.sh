#!/usr/bin/env bash
# checkpoint_write.sh: how fast `strata train` writes a checkpoint, beside the drive's bound and
# beside torch.save (what DeepSpeed's checkpoints go through), in one run on one directory.
#
# - strata: one training step of MODEL (random weights; P and O in host RAM, bf16) and its
#   checkpoint (model.safetensors + optimizer.safetensors: fp32 master, m, v), timed by strata
#   on its `checkpoint:` line. `strata export` then reads the checkpoint back against the
#   checksums in its COMPLETE marker, and only a verified checkpoint's rate is reported.
# - fio, the drive's bound: a file of the checkpoint's size written sequentially in 8 MiB
#   blocks, 4 in flight (as strata's writer stages them), ioengine=io_uring, direct=1, fsync at
#   the end; and once the same buffered (direct=0): the page cache's rate, which strata's writer
#   went through before.
# - torch.save: tensors of the same dtypes and bytes (bf16 weights; fp32 master, m and v)
#   saved to one file, then fsync'd: as durable as strata's checkpoint.
# strata and fio alternate ROUNDS times (default 3), each round's ratio printed with their
# median: a virtual disk's speed drifts by a third over minutes.
#
# OPTIMIZER=nvme homes the optimizer state on NVMe (a swap directory in DIR) instead of host
# RAM, as ZeRO-Infinity runs do: each checkpoint then reads the state from the swap files while
# it writes the files, and the drive's bound is fio doing both at once (two jobs, the state's
# bytes read from a file of their own while the checkpoint's are written); a resume writes the
# state into the swap files while it reads the checkpoint, beside fio doing that at once.
#
# Usage: bench/checkpoint_write.sh DIR [MODEL]
#   DIR on the drive to measure (a run directory and scratch files go there, removed at the
#   end); MODEL a preset (default qwen3-0.6b: an 8.3 GB checkpoint, 11 GiB of host RAM).
#   STRATA=path/to/strata (default build/bin/strata); PYTHON (default /usr/bin/python3, with
#   python3-torch). Installs fio (Debian) if missing.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
source "$root/scripts/common.sh"
install_packages fio python3 python3-torch

dir=${1:?usage: bench/checkpoint_write.sh DIR [MODEL]}
model=${2:-qwen3-0.6b}
rounds=${ROUNDS:-3}
optimizer=${OPTIMIZER:-cpu}
case "$optimizer" in
  cpu | nvme) ;;
  *) echo "checkpoint_write: OPTIMIZER=$optimizer; give cpu or nvme" >&2; exit 1 ;;
esac
strata=${STRATA:-$root/build/bin/strata}
python=${PYTHON:-/usr/bin/python3}
[ -x "$strata" ] || { echo "checkpoint_write: no strata binary at $strata; build first or set STRATA" >&2; exit 1; }
mkdir -p "$dir"
work=$(mktemp -d "$dir/strata-ckpt-bench-XXXXXX")
trap 'rm -rf "$work"' EXIT
homes=(--offload-param cpu --offload-optimizer "$optimizer")
[ "$optimizer" = nvme ] && mkdir "$work/swap" && homes+=(--nvme-path "$work/swap")

echo "checkpoint_write: $model, optimizer state in $optimizer, on $(df --output=source,fstype "$dir" | tail -1 | tr -s ' ') ($dir), $rounds round(s)"
printf 'strata writes checkpoints to be measured.\n%%\n' > "$work/text.txt"
for _ in $(seq 200); do echo "the quick brown fox jumps over the lazy dog" >> "$work/text.txt"; done
"$strata" tokenize --tokenizer byte --input "$work/text.txt" --output "$work/tokens.bin" > /dev/null

strata_s() {  # one run's checkpoint, verified -> seconds; its size into $work/bytes
  rm -rf "$work/run" "$work/export"
  "$strata" train --model "$model" --init random --data "$work/tokens.bin" --steps 1 \
    --devices host "${homes[@]}" --dtype bf16 --seq-len 64 \
    --run-dir "$work/run" --save-every 0 > "$work/train.log" 2>&1 ||
    { cat "$work/train.log" >&2; exit 1; }
  local line ckpt
  line=$(grep '^checkpoint: ' "$work/train.log")
  ckpt="$work/run/checkpoints/step-1"
  du -b --apparent-size -s "$ckpt" | cut -f1 > "$work/bytes"
  stat -c %s "$ckpt/optimizer.safetensors" > "$work/state_bytes"
  "$strata" export "$ckpt" --out "$work/export" > "$work/export.log" 2>&1 ||
    { cat "$work/export.log" >&2; echo "checkpoint_write: the checkpoint did not verify" >&2; exit 1; }
  echo "  strata: ${line#checkpoint: }; verified by export" >&2
  rm -rf "$work/run" "$work/export"
  sed -E 's/.* in ([0-9.]+) s.*/\1/' <<< "$line"
}

fio_s() {  # direct(0|1) -> seconds for the checkpoint's bytes (and, OPTIMIZER=nvme, the state's read)
  local bytes state
  bytes=$(cat "$work/bytes")
  state=$(cat "$work/state_bytes")
  local jobs=(--name=ckpt --filename="$work/fio.bin" --rw=write --bs=8M --iodepth=4
    --ioengine=io_uring --direct="$1" --end_fsync=1 --size="$bytes")
  if [ "$optimizer" = nvme ] && [ "$1" = 1 ]; then
    fio_lay "$work/fio-state.bin" "$state"
    jobs+=(--name=state --filename="$work/fio-state.bin" --rw=read --bs=8M --iodepth=4
      --ioengine=io_uring --direct=1 --size="$state")
  fi
  fio --output-format=json "${jobs[@]}" 2> /dev/null | fio_longest
  rm -f "$work/fio.bin" "$work/fio-state.bin"
}

fio_lay() {  # PATH BYTES: a file of BYTES for fio to read
  fio --name=lay --filename="$1" --rw=write --bs=8M --iodepth=4 --ioengine=io_uring --direct=1 \
    --size="$2" > /dev/null 2>&1
}

fio_longest() {  # fio's JSON on stdin (--output-format first, or job lines precede it) -> the
  # seconds of its longest job
  "$python" -c 'import json,sys
jobs = json.load(sys.stdin)["jobs"]
print(max(max(j["read"]["runtime"], j["write"]["runtime"]) for j in jobs) / 1000)'
}

torch_s() {
  "$python" - "$work/torch.pt" "$(cat "$work/bytes")" <<'PY'
import os, sys, time, torch
path, total = sys.argv[1], int(sys.argv[2])
n = total // 14  # 2 bytes of bf16 weights and 12 of fp32 master, m, v per element
state = {"model": torch.ones(n, dtype=torch.bfloat16),
         "optimizer": {k: torch.full((n,), 0.5, dtype=torch.float32) for k in ("master", "m", "v")}}
t = time.perf_counter()
with open(path, "wb") as f:
    torch.save(state, f)
    f.flush()
    os.fsync(f.fileno())
print(time.perf_counter() - t)
os.remove(path)
PY
}

pairs=()
for r in $(seq "$rounds"); do
  if [ $((r % 2)) -eq 1 ]; then s=$(strata_s); d=$(fio_s 1); else d=$(fio_s 1); s=$(strata_s); fi
  pairs+=("$s $d")
  echo "  round $r: strata $s s, fio O_DIRECT $d s" >&2
done
b=$(fio_s 0)
t=$(torch_s)

# Resuming: one more checkpoint, the page cache dropped (as root; else the files may be cached
# and the figures are warm ones), then `--resume`, which verifies every file against COMPLETE
# and restores the state; beside fio reading the same bytes (O_DIRECT) and torch.load of
# torch.save's file (the cache dropped the same way).
cold() { sync; if [ "$(id -u)" = 0 ]; then echo 3 > /proc/sys/vm/drop_caches; fi; }
rm -rf "$work/run"
"$strata" train --model "$model" --init random --data "$work/tokens.bin" --steps 1 \
  --devices host "${homes[@]}" --dtype bf16 --seq-len 64 \
  --run-dir "$work/run" --save-every 0 > "$work/train.log" 2>&1 || { cat "$work/train.log" >&2; exit 1; }
cold
"$strata" train --model "$model" --init random --data "$work/tokens.bin" --steps 2 --resume \
  --devices host "${homes[@]}" --dtype bf16 --seq-len 64 \
  --run-dir "$work/run" --save-every 0 > "$work/resume.log" 2>&1 || { cat "$work/resume.log" >&2; exit 1; }
resumed=$(grep '^resumed from ' "$work/resume.log")
rm -rf "$work/run"
fio_lay "$work/fio.bin" "$(cat "$work/bytes")"
cold
reads=(--name=ckpt --filename="$work/fio.bin" --rw=read --bs=8M --iodepth=4 --ioengine=io_uring
  --direct=1 --size="$(cat "$work/bytes")")
if [ "$optimizer" = nvme ]; then  # and the state written into swap files meanwhile
  reads+=(--name=state --filename="$work/fio-state.bin" --rw=write --bs=8M --iodepth=4
    --ioengine=io_uring --direct=1 --end_fsync=1 --size="$(cat "$work/state_bytes")")
fi
fio_read=$(fio --output-format=json "${reads[@]}" 2> /dev/null | fio_longest)
rm -f "$work/fio.bin" "$work/fio-state.bin"
torch_load=$("$python" - "$work/torch.pt" "$(cat "$work/bytes")" <<'PY'
import os, subprocess, sys, time, torch
path, total = sys.argv[1], int(sys.argv[2])
n = total // 14
state = {"model": torch.ones(n, dtype=torch.bfloat16),
         "optimizer": {k: torch.full((n,), 0.5, dtype=torch.float32) for k in ("master", "m", "v")}}
torch.save(state, path)
del state
os.sync()
if os.geteuid() == 0:
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")
t = time.perf_counter()
back = torch.load(path)
assert back["optimizer"]["v"][-1].item() == 0.5
print(time.perf_counter() - t)
os.remove(path)
PY
)

"$python" - "$(cat "$work/bytes")" "$b" "$t" "$resumed" "$fio_read" "$torch_load" "$optimizer" \
  "${pairs[@]}" <<'PY'
import re, statistics, sys
n, buffered, torch_s = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
resumed, fio_read, torch_load = sys.argv[4], float(sys.argv[5]), float(sys.argv[6])
nvme = sys.argv[7] == "nvme"
pairs = [tuple(map(float, p.split())) for p in sys.argv[8:]]
g = 1e9
print(f"{n/g:.2f} GB a checkpoint" + (", the optimizer state read from NVMe swap files as it is"
      " written; fio writes the checkpoint's bytes while it reads the state's" if nvme else ""))
print(f"{'round':<6} {'strata GB/s':>11} {'fio O_DIRECT GB/s':>17} {'strata/fio':>10}")
for i, (s, d) in enumerate(pairs, 1):
    print(f"{i:<6} {n/s/g:11.2f} {n/d/g:17.2f} {d/s:10.2f}")
print(f"median strata / fio O_DIRECT: {statistics.median(d/s for s, d in pairs):.2f}")
best = statistics.median(s for s, _ in pairs)
print(f"fio buffered (the page cache): {n/buffered/g:.2f} GB/s; torch.save + fsync: {n/torch_s/g:.2f} GB/s"
      f" (strata's median {best/1:.2f} s is {torch_s/best:.2f}x as fast)")
m = re.search(r"verified in ([0-9.]+) s, restored in ([0-9.]+) s", resumed)
v, r = float(m.group(1)), float(m.group(2))
print(f"resume: every file verified in {v:.1f} s ({n/v/g:.2f} GB/s), the optimizer state restored"
      f" in {r:.1f} s ({v + r:.1f} s in all); fio O_DIRECT reads the checkpoint's bytes"
      + (" (writing the state's meanwhile)" if nvme else "") +
      f" in {fio_read:.1f} s ({n/fio_read/g:.2f} GB/s); torch.load of torch.save's file {torch_load:.1f} s")
PY
