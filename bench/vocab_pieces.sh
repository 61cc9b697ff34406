#!/bin/bash
# The embedding and the head whole (--vocab-pieces 1) and cut as strata chooses (0), side by
# side, alternating, three rounds, on one host device: the device memory the executor holds
# (and the plan's figure for it) and the step time, each run verified bit for bit against the
# all-device run of its own cut before it reports; untied, then tied (the one table, which the
# head's pieces read). Then `strata plan`'s GPU figures for real models on assumed hardware,
# both ways.
# usage: bench/vocab_pieces.sh [path/to/strata]
S=${1:-strata}
TIED=$(mktemp -d)
trap 'rm -rf "$TIED"' EXIT
# The tiny preset's config with tied embeddings; the flags below set its sizes.
cat > "$TIED/config.json" <<'JSON'
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
 "intermediate_size": 172, "num_hidden_layers": 2, "num_attention_heads": 4,
 "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 256,
 "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "tie_word_embeddings": true,
 "torch_dtype": "float32"}
JSON
for model in tiny "$TIED"; do
 what=untied; [ "$model" = tiny ] || what=tied
 for round in 1 2 3; do
  for vp in 1 0; do
   $S bench step --model "$model" --devices host:1 --hidden 1024 --intermediate 2816 --layers 4 \
     --vocab 32000 --seq-len 64 --micro-batch 2 --offload-param cpu --offload-optimizer cpu \
     --offload-gradients cpu --steps 5 --threads 1 --vocab-pieces $vp --json 2>/dev/null |
    python3 -c "
import json,sys; j=json.load(sys.stdin)
print('$what round $round pieces %d: verified %s held %.2f MiB plan %.2f MiB step %.1f ms' % (j['vocab_pieces'], j['verified'], j['device_bytes']/2**20, j['planned_device_bytes']/2**20, j['step_s']*1e3))"
  done
 done
done
row() {  # model gpus offload-param offload-optimizer
 for vp in 1 0; do
  $S plan --model $1 --gpus $2 --gpu-memory 80GiB --cpu-memory 2TiB --nvme 4x3.5TB \
    --offload-param $3 --offload-optimizer $4 --offload-gradients cpu --vocab-pieces $vp --json |
   python3 -c "
import json,sys
d=json.load(sys.stdin); g=d['memory']['gpu']; G=2**30
print('plan $1 on $2 GPU(s), P $3 O $4, pieces %d: GPU %.2f GiB (working %.2f), pinned buffers %d x %.2f GiB, step %.3f s' % (d['vocab_pieces'], g['total']/G, g['working']/G, d['pinned_buffers'], d['pinned_buffer_bytes']/G, d['step_s']))"
 done
}
row llama3-8b 1 none cpu
row llama3-8b 1 cpu cpu
row qwen2.5-7b 1 cpu cpu
row qwen3-8b 1 cpu cpu
row phi4 1 cpu cpu
row llama3-70b 4 cpu cpu
row llama3-70b 4 nvme nvme
row gemma2-9b 1 none cpu
row gemma2-9b 1 cpu cpu
row gemma3-12b 1 cpu cpu
row gemma3-27b 1 cpu cpu
row llama3.2-3b 1 cpu cpu
row gemma3-27b 4 nvme nvme
