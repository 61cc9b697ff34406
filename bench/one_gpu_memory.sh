#!/bin/bash
# One host device: the device memory the executor holds and the step time, the binary before
# the one-rank in-place change (OLD) and this one (NEW), alternating, three rounds. Each run is
# verified bit for bit against the all-device run before it reports.
# usage: OLD=/path/to/old/strata NEW=/path/to/new/strata bench/one_gpu_memory.sh
: "${OLD:?set OLD to the old binary}" "${NEW:?set NEW to the new binary}"
for round in 1 2 3; do
 for which in old new; do
  B=$OLD; [ $which = new ] && B=$NEW
  for p in none cpu; do
   $B bench step --devices host:1 --hidden 512 --layers 4 --vocab 32000 --seq-len 64 --micro-batch 2 --grad-accum 2 --offload-param $p --offload-optimizer cpu --offload-gradients cpu --steps 5 --threads 1 --json 2>/dev/null | python3 -c "
import json,sys; j=json.load(sys.stdin); print('round $round $which P $p: verified %s held %.2f MiB plan %.2f MiB step %.1f ms predicted %.1f ms (%+.1f%%)' % (j['verified'], j['device_bytes']/2**20, j['planned_device_bytes']/2**20, j['step_s']*1e3, j['predicted_step_s']*1e3, 100*j['prediction_error']))"
  done
 done
done
