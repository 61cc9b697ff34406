#!/bin/bash
# Gradient accumulators in host RAM (--offload-gradients cpu, DeepSpeed's offload) against on
# NVMe (--offload-gradients nvme, as ZeRO-Infinity swaps them), P and O on NVMe too, one host
# device, 1 and 4 micro-batches a step, alternating, three rounds. Each run is verified bit for
# bit against the all-device run before it reports; the host RAM and NVMe figures are the plan's
# (strata plan's table), the times measured, beside the simulator's prediction.
# usage: STRATA=build/bin/strata bench/gradients_on_nvme.sh [SWAP_DIR]
: "${STRATA:=build/bin/strata}"
swap=${1:-$(mktemp -d)}
mkdir -p "$swap"
for round in 1 2 3; do
 for accum in 1 4; do
  for g in cpu nvme; do
   "$STRATA" bench step --devices host:1 --hidden 512 --layers 4 --vocab 32000 --seq-len 64 \
     --micro-batch 2 --grad-accum $accum --offload-param nvme --offload-optimizer nvme \
     --offload-gradients $g --nvme-path "$swap" --steps 5 --threads 1 --json 2>/dev/null |
   python3 -c "
import json, sys
j = json.load(sys.stdin)
assert j['verified'], 'not verified'
print('round $round accum $accum G $g: G on NVMe for %d units; host RAM %.1f MiB, NVMe %.1f MiB (plan); '
      'step %.0f ms (predicted %.0f, %+.1f%%), NVMe busy %.0f ms' % (
      j['gradients_on_nvme'], j['planned_host_bytes'] / 2**20, j['planned_nvme_bytes'] / 2**20,
      j['step_s'] * 1e3, j['predicted_step_s'] * 1e3, 100 * j['prediction_error'], j['nvme_busy_s'] * 1e3))"
  done
 done
done
