#!/usr/bin/env bash
# device-check.sh: one lent-GPU pass, in order of what only a GPU can prove, each stage capped
# so the whole fits one device call (STRATA_DEADLINE seconds, default 570): build, the gpu
# tests, the GPU benchmarks, then the rest of the suite and the CPU/disk benchmarks.
# Logs land in $OUT (at most 8 files come back): device.txt build.log ctest-gpu.log
# bench.log ctest-rest.log.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp}
deadline=${STRATA_DEADLINE:-570}
scripts/device-build.sh --no-test || exit 1
source scripts/device-env.sh
left() { echo $((deadline - SECONDS)); }
stage() {  # stage LOG CAP CMD...: runs CMD for at most min(CAP, time left - 10) seconds
  local log=$1 cap=$2; shift 2
  local t; t=$(left); t=$((t - 10 < cap ? t - 10 : cap))
  if [ "$t" -lt 15 ]; then echo "SKIPPED (no time left): $*" | tee -a "$out/$log"; return; fi
  echo "\$ $*" | tee -a "$out/$log"
  local s=$SECONDS
  timeout "$t" "$@" >>"$out/$log" 2>&1
  echo "[rc=$? in $((SECONDS - s)) s]" | tee -a "$out/$log"
}
export PATH="$PWD/build/bin:$PATH"
stage ctest-gpu.log 200 ctest --test-dir build -L gpu --output-on-failure --timeout 180
# One benchmark command per line of $STRATA_BENCHES (default bench/device-benches.txt).
while IFS= read -r cmd; do
  case "$cmd" in ''|'#'*) continue ;; esac
  stage bench.log 330 bash -c "$cmd"
done <"${STRATA_BENCHES:-bench/device-benches.txt}"
stage ctest-rest.log 300 ctest --test-dir build -LE gpu -j"$(nproc)" --output-on-failure --timeout 240
echo "done at $SECONDS s"
