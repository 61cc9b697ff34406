#!/bin/bash
# Activation checkpoints kept on the device (--offload-activations none) and in host RAM (cpu),
# side by side, alternating, three rounds, on one host device: the device memory the executor
# holds beside the plan's figure, the host RAM the checkpoints take, and the step time, each run
# verified bit for bit against the all-device run (checkpoints kept) before it reports. Then
# `strata plan`'s figures for real models on assumed hardware, both ways.
# usage: bench/activation_offload.sh [path/to/strata]
S=${1:-strata}
for round in 1 2 3; do
 for act in none cpu; do
  $S bench step --model tiny --devices host:1 --hidden 512 --intermediate 1376 --layers 8 \
    --vocab 4096 --seq-len 256 --micro-batch 4 --grad-accum 2 --offload-param cpu \
    --offload-optimizer cpu --offload-gradients cpu --steps 5 --threads 1 \
    --offload-activations $act --json 2>/dev/null |
   python3 -c "
import json,sys; j=json.load(sys.stdin)
print('round $round activations $act: verified %s held %.2f MiB plan %.2f MiB step %.1f ms (predicted %.1f)' % (j['verified'], j['device_bytes']/2**20, j['planned_device_bytes']/2**20, j['step_s']*1e3, j['predicted_step_s']*1e3))"
 done
done
row() {  # model gpus gpu-memory seq-len offload-param offload-optimizer
 for act in none cpu; do
  $S plan --model $1 --gpus $2 --gpu-memory $3 --cpu-memory 2TiB --nvme 4x3.5TB --seq-len $4 \
    --offload-param $5 --offload-optimizer $6 --offload-activations $act --json 2>&1 |
   python3 -c "
import json,sys
t=sys.stdin.read()
try: d=json.loads(t)
except ValueError: print('plan $1 on $2 x $3 at $4 tokens, P $5 O $6, activations $act: refused:', t.splitlines()[2].strip()); sys.exit()
g=d['memory']['gpu']; c=d['memory']['cpu']; G=2**30
print('plan $1 on $2 x $3 at $4 tokens, P $5 O $6, activations $act: GPU %.2f GiB (activations %.2f), host activations %.2f GiB, step %.3f s' % (g['total']/G, g['activations']/G, c['activations']/G, d['step_s']))"
 done
}
row llama3-8b 1 24GiB 8192 cpu cpu
row llama2-13b 1 24GiB 4096 cpu cpu
row llama3-70b 4 24GiB 8192 cpu nvme
row llama3-70b 4 24GiB 4096 nvme nvme
row qwen2.5-72b 8 24GiB 8192 cpu nvme
