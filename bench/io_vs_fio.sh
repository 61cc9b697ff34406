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

printf '%-10s %12s %12s %8s %12s %12s\n' rw "strata GB/s" "fio GB/s" ratio "strata IOPS" "fio IOPS"
for rw in "${modes[@]}"; do
  fio_json=$(fio --name=strata-vs-fio --filename="$fio_file" --ioengine=io_uring --direct=1 \
    --rw="$rw" --bs="$block_b" --iodepth="$qd" --size=$((size_b / threads)) \
    --numjobs="$threads" --group_reporting --output-format=json)
  rm -f "$fio_file"
  strata_json=$("$strata" bench io --path "$dir" --size "$size_b" --block "$block_b" --qd "$qd" \
    --threads "$threads" --rw "$rw" ${STORE:+--store} --json)
  python3 - "$rw" "$fio_json" "$strata_json" <<'PY'
import json, sys
rw, f, s = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
side = "write" if "write" in rw else "read"
job = f["jobs"][0][side]
fio_bw, fio_iops = job["bw_bytes"], job["iops"]
print(f"{rw:<10} {s['bytes_per_s']/1e9:12.3f} {fio_bw/1e9:12.3f} {s['bytes_per_s']/fio_bw:8.3f} "
      f"{s['iops']:12.0f} {fio_iops:12.0f}")
PY
done
