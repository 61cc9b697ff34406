#!/usr/bin/env bash
# fuzz/run.sh: the long fuzzing run, outside CI (fuzz/README.md).
#
# Installs what is missing (STRATA_PACKAGES and STRATA_FUZZ_PACKAGES: Debian's clang, libFuzzer,
# llvm-symbolizer), builds the libFuzzer targets with ASan+UBSan in build-fuzz, runs each target
# for RUNS executions starting from its committed corpus and the seeds (fuzz/seeds.py), then
# rebuilds fuzz/corpus/<target>/ as the seeds, the kept crash-* regression inputs, and whatever
# the run found that adds coverage (libFuzzer -merge=1). Exits non-zero when a target crashed,
# hung, leaked or tripped a sanitizer; the input is kept under build-fuzz/fuzz-artifacts/.
#
# Settings (environment): RUNS=1000000 executions per target; TARGETS="safetensors ds_config
# tokens chat_template"; MAX_LEN=4096 bytes per generated input; TIMEOUT=10 seconds per input; NICE=10;
# BUILD_DIR=build-fuzz; JOBS (build parallelism, default: all cores).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/common.sh
install_packages "${STRATA_PACKAGES[@]}" "${STRATA_FUZZ_PACKAGES[@]}"

RUNS=${RUNS:-1000000}
MAX_LEN=${MAX_LEN:-4096}
TIMEOUT=${TIMEOUT:-10}
NICE=${NICE:-10}
BUILD_DIR=${BUILD_DIR:-build-fuzz}
read -r -a targets <<<"${TARGETS:-safetensors ds_config tokens chat_template}"

echo "== build ($BUILD_DIR: clang, libFuzzer, ASan+UBSan)"
CC=clang CXX=clang++ cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DSTRATA_CUDA=OFF -DSTRATA_FUZZ=ON -DSTRATA_TESTS=OFF
nice -n "$NICE" cmake --build "$BUILD_DIR" -j"$JOBS" --target "${targets[@]/#/fuzz_}"

seeds="$BUILD_DIR/fuzz-seeds"
rm -rf "$seeds"
python3 fuzz/seeds.py "$seeds"

summary=()
failed=0
for t in "${targets[@]}"; do
  work="$BUILD_DIR/fuzz-work/$t"
  artifacts="$BUILD_DIR/fuzz-artifacts/$t"
  merged="$BUILD_DIR/fuzz-merged/$t"
  log="$BUILD_DIR/fuzz-logs/$t.log"
  rm -rf "$work" "$merged"
  mkdir -p "$work" "$artifacts" "$merged" "$(dirname "$log")"
  cp "$seeds/$t"/* "$work"/
  if [ -d "fuzz/corpus/$t" ]; then cp fuzz/corpus/"$t"/* "$work"/; fi
  dict=()
  if [ -f "fuzz/$t.dict" ]; then dict=(-dict="fuzz/$t.dict"); fi

  echo "== fuzz_$t: $RUNS executions from $(ls "$work" | wc -l) inputs (log: $log)"
  start=$(date +%s)
  rc=0
  nice -n "$NICE" "$BUILD_DIR/bin/fuzz_$t" -runs="$RUNS" -max_len="$MAX_LEN" \
    -timeout="$TIMEOUT" -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="$artifacts/" "${dict[@]}" "$work" >"$log" 2>&1 || rc=$?
  seconds=$(($(date +%s) - start))
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log")
  if [ "$rc" -ne 0 ]; then
    failed=1
    echo "fuzz_$t FAILED (exit $rc): see $log; the input is in $artifacts/" >&2
    grep -E "ERROR|SUMMARY|runtime error|Test unit written" "$log" | head -20 >&2 || true
    summary+=("$t: FAILED after ${execs:-?} executions in ${seconds}s (exit $rc)")
    continue
  fi

  # The new corpus: seeds, the crash-* regression inputs already committed, then what the run
  # found that adds coverage beyond them. -use_counters=0 counts an edge once however often it
  # runs, which keeps the committed corpus to a few hundred small files per target.
  cp "$seeds/$t"/* "$merged"/
  if compgen -G "fuzz/corpus/$t/crash-*" >/dev/null; then cp fuzz/corpus/"$t"/crash-* "$merged"/; fi
  nice -n "$NICE" "$BUILD_DIR/bin/fuzz_$t" -merge=1 -use_counters=0 -timeout="$TIMEOUT" \
    -rss_limit_mb=2048 \
    "$merged" "$work" >>"$log" 2>&1
  rm -rf "fuzz/corpus/$t"
  mkdir -p "fuzz/corpus/$t"
  cp "$merged"/* "fuzz/corpus/$t"/
  files=$(ls "fuzz/corpus/$t" | wc -l)
  bytes=$(cat "fuzz/corpus/$t"/* | wc -c)
  summary+=("$t: $execs executions in ${seconds}s ($rate exec/s), no crash; corpus $files files, $bytes bytes")
done

echo "== summary (RUNS=$RUNS MAX_LEN=$MAX_LEN TIMEOUT=${TIMEOUT}s)"
printf '%s\n' "${summary[@]}"
exit "$failed"
