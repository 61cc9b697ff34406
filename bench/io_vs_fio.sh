#!/usr/bin/env bash
# io_vs_fio.sh: `strata bench io` and fio side by side, in one run, on the same directory
# with the same file size, block size, queue depth, thread count and pattern (fio with
# ioengine=io_uring, direct=1), printing both bandwidths, both IOPS and strata/fio.
# The issue's target: >= 0.95 of fio for 1 MiB sequential reads and writes at qd 32 on 4 GiB.
#
# Usage: bench/io_vs_fio.sh DIR [SIZE] [BLOCK] [QD] [THREADS] [RW...]
#   defaults: 4GiB 1MiB 32 1 "read write"; RW from read, write, randread, randwrite.
#   STRATA=path/to/strata (default build/bin/strata). STORE=1 measures strata through the
#   swap store (checksums on; target >= 0.90 of fio; read and write only).
#   ROUNDS=N (default 1) alternates fio and strata N times per pattern, starting with a
#   different one each round, and prints every round's ratio and their median: on a shared or
#   virtual disk whose speed drifts, the median of interleaved pairs is the fair comparison.
#   Installs fio (Debian) if missing.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
source "$root/scripts/common.sh"
install_packages fio python3

dir=${1:?usage: bench/io_vs_fio.sh DIR [SIZE] [BLOCK] [QD] [THREADS] [RW...]}
size=${2:-4GiB}
block=${3:-1MiB}
qd=${4:-32}
threads=${5:-1}
shift $(($# < 5 ? $# : 5))
modes=("$@")
[ ${#modes[@]} -eq 0 ] && modes=(read write)
strata=${STRATA:-$root/build/bin/strata}
[ -x "$strata" ] || { echo "io_vs_fio: no strata binary at $strata; build first or set STRATA" >&2; exit 1; }

# Byte counts through strata's own parser's rules (binary units are powers of 1024).
bytes() {
  python3 - "$1" <<'PY'
import re, sys
m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]i?B?)?\s*", sys.argv[1], re.I)
if not m: sys.exit(f"io_vs_fio: cannot read size {sys.argv[1]!r}")
unit = (m.group(2) or "").upper().rstrip("B")
base = 1024 if unit.endswith("I") or unit == "" else 1000
power = " KMGT".index(unit[:1]) if unit else 0
print(int(float(m.group(1)) * base ** power))
PY
}
size_b=$(bytes "$size")
block_b=$(bytes "$block")
fio_file="$dir/strata-fio.$$.bin"
trap 'rm -f "$fio_file"' EXIT

rounds=${ROUNDS:-1}
printf '%-10s %5s %12s %12s %8s %12s %12s\n' rw round "strata GB/s" "fio GB/s" ratio "strata IOPS" "fio IOPS"
run_fio() {
  fio --name=strata-vs-fio --filename="$fio_file" --ioengine=io_uring --direct=1 \
    --rw="$1" --bs="$block_b" --iodepth="$qd" --size=$((size_b / threads)) \
    --numjobs="$threads" --group_reporting --output-format=json
  rm -f "$fio_file"
}
run_strata() {
  "$strata" bench io --path "$dir" --size "$size_b" --block "$block_b" --qd "$qd" \
    --threads "$threads" --rw "$1" ${STORE:+--store} --json
}
for rw in "${modes[@]}"; do
  ratios=()
  for ((i = 1; i <= rounds; i++)); do
    if ((i % 2)); then
      fio_json=$(run_fio "$rw")
      strata_json=$(run_strata "$rw")
    else
      strata_json=$(run_strata "$rw")
      fio_json=$(run_fio "$rw")
    fi
    ratio=$(python3 - "$rw" "$i" "$fio_json" "$strata_json" <<'PY'
import json, sys
rw, i, f, s = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
side = "write" if "write" in rw else "read"
job = f["jobs"][0][side]
fio_bw, fio_iops = job["bw_bytes"], job["iops"]
print(f"{rw:<10} {i:>5} {s['bytes_per_s']/1e9:12.3f} {fio_bw/1e9:12.3f} "
      f"{s['bytes_per_s']/fio_bw:8.3f} {s['iops']:12.0f} {fio_iops:12.0f}", file=sys.stderr)
print(s['bytes_per_s'] / fio_bw)
PY
)
    ratios+=("$ratio")
  done
  if ((rounds > 1)); then
    python3 - "$rw" "${ratios[@]}" <<'PY'
import statistics, sys
r = [float(x) for x in sys.argv[2:]]
print(f"{sys.argv[1]:<10} median strata/fio over {len(r)} interleaved rounds: "
      f"{statistics.median(r):.3f} (min {min(r):.3f}, max {max(r):.3f})")
PY
  fi
done
