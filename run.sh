#!/usr/bin/env bash
# run.sh: the main job, a demo of strata training on this machine. Installs what is missing,
# builds strata (Release, CUDA backend when a toolkit is present), then:
#   1. prints the machine as strata sees it (strata info);
#   2. makes an English corpus from Debian's fortunes database with the byte tokenizer;
#   3. trains the tiny Llama on the host backend with its optimizer state homed on NVMe (a swap
#      directory under the run directory), checkpointing as it goes; the loss falls from ~5.5;
#   4. samples a few lines from the trained model.
# Settings: RUN (run directory, default runs/demo-<time>), STEPS (default 1500), DEVICES
# (default host:1; e.g. cuda:0 on a GPU machine).
cd "$(dirname "$0")"
source scripts/common.sh
install_packages "${STRATA_PACKAGES[@]}" fortunes
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build build -j"$JOBS"
strata=build/bin/strata

"$strata" info

RUN=${RUN:-runs/demo-$(date +%Y%m%d-%H%M%S)}
STEPS=${STEPS:-1500}
DEVICES=${DEVICES:-host:1}
mkdir -p "$RUN"

# Every fortune file (not the .dat indexes or .u8 links): documents separated by lines of "%".
corpus=()
for f in /usr/share/games/fortunes/*; do
  case "$f" in *.dat | *.u8) continue ;; esac
  [ -f "$f" ] && corpus+=("$f")
done
"$strata" tokenize --tokenizer byte --input "${corpus[@]}" --output "$RUN/fortunes.bin"

train=(train --model tiny --init random --seed 1 --data "$RUN/fortunes.bin"
  --devices "$DEVICES" --seq-len 128 --micro-batch 8
  --lr 3e-3 --lr-schedule WarmupCosineLR --warmup-steps 50 --clip 1.0 --weight-decay 0.01
  --offload-optimizer nvme --nvme-path "$RUN/swap"
  --run-dir "$RUN" --save-every 500 --steps-per-print 100)
"$strata" "${train[@]}" --steps "$STEPS"

echo
echo "== a sample from the trained model"
"$strata" generate --model "$RUN" --prompt "The " --max-new-tokens 200 --temperature 0.8 \
  --top-k 40 --seed 1
echo
echo "run directory: $RUN (metrics.jsonl, checkpoints/)"
echo "resume (after a stop, or to train on; the cosine schedule then spans the new --steps):"
echo "         $strata ${train[*]} --steps $((STEPS + 500)) --resume"
echo "plan:    $strata plan --model llama3-8b --gpu-memory 80GiB --offload-optimizer cpu"
echo "export:  $strata export $RUN --out $RUN/hf --dtype f32"
