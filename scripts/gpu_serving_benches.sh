#!/usr/bin/env bash
# The serving benches on one GPU: multiturn at a working set 4x the device tier (recompute,
# device, +host, +storage), storage at 16x (host vs +storage), longdoc, a trace replay; the other
# steps below are named variants of the same recipes. JSON + PNG plots under $OUT. Each server:
# qwen3-0.6b-shape (or llama3-8b-shape: multiturn8b*), dummy bf16 weights.
# Usage: OUT=dir bash scripts/gpu_serving_benches.sh [step ...]   (default: multiturn storage16 longdoc trace)
set -uo pipefail
OUT=${OUT:-/tmp/kvtier-gpu}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
. scripts/gpu_webdeps.sh
M="--model qwen3-0.6b-shape --device cuda --max-model-len 16384 --max-num-batched-tokens 8192 --no-progress"
b() { python -m kvtier.cli bench "$@" 2>&1 | grep -v "Loading weights\|Writing model\|hashing"; }
for s in "${@:-multiturn storage16 longdoc trace}"; do for step in $s; do case $step in
  # 16 clients x 6 rounds x (1024 + 64): histories to ~6.5K tokens, working set ~104K tokens =
  # 6.5K blocks; device tier 1,640 blocks = 1/4 of it
  multiturn) b multiturn $M --clients 16 --rounds 6 --request-length 1024 --output-length 64 --max-parallel 16 \
      --num-device-blocks 1640 --num-host-blocks 8192 --compare recompute,device,host,storage \
      --storage "file:///dev/shm/kvt-pool-mt" --json "$OUT/multiturn.json" --plot "$OUT/multiturn.png" | tee "$OUT/multiturn.log" ;;
  # working set 16x the device tier (410 blocks); host tier 1/4 of the working set: the pool holds the rest
  storage16) b multiturn $M --clients 16 --rounds 6 --request-length 1024 --output-length 64 --max-parallel 16 \
      --num-device-blocks 410 --num-host-blocks 1640 --compare host,storage --storage "file:///dev/shm/kvt-pool-16" \
      --json "$OUT/multiturn16.json" --plot "$OUT/multiturn16.png" | tee "$OUT/multiturn16.log" ;;
  # the host tier's default preemption is swap: the same runs with recompute preemption
  multiturn_rc) b multiturn $M --clients 16 --rounds 6 --request-length 1024 --output-length 64 --max-parallel 16 \
      --num-device-blocks 1640 --num-host-blocks 8192 --compare device,host,storage --server-args "--preemption-mode recompute" \
      --storage "file:///dev/shm/kvt-pool-mtrc" --json "$OUT/multiturn_rc.json" --plot "$OUT/multiturn_rc.png" | tee "$OUT/multiturn_rc.log" ;;
  storage16_rc) b multiturn $M --clients 16 --rounds 6 --request-length 1024 --output-length 64 --max-parallel 16 \
      --num-device-blocks 410 --num-host-blocks 1640 --compare host,storage --storage "file:///dev/shm/kvt-pool-16rc" \
      --server-args "--preemption-mode recompute" --json "$OUT/multiturn16_rc.json" | tee "$OUT/multiturn16_rc.log" ;;
  # put threads of the pool's client: the default (1) against 8
  multiturn_putw) b multiturn $M --clients 16 --rounds 6 --request-length 1024 --output-length 64 --max-parallel 16 \
      --num-device-blocks 1640 --num-host-blocks 8192 --compare host,storage --storage "file:///dev/shm/kvt-pool-pw1" \
      --json "$OUT/multiturn_put1.json" | tee "$OUT/multiturn_put1.log"
    b multiturn $M --clients 16 --rounds 6 --request-length 1024 --output-length 64 --max-parallel 16 \
      --num-device-blocks 1640 --num-host-blocks 8192 --compare storage --storage "file:///dev/shm/kvt-pool-pw8" \
      --server-args "--storage-put-workers 8" --json "$OUT/multiturn_put8.json" | tee "$OUT/multiturn_put8.log" ;;
  # the same recipe on the 8B shape, where a prefill costs what a cache hit saves
  multiturn8b) b multiturn ${M/qwen3-0.6b-shape/llama3-8b-shape} --clients 16 --rounds 6 --request-length 1024 \
      --output-length 64 --max-parallel 16 --num-device-blocks 1640 --num-host-blocks 8192 --compare recompute,device,host,storage \
      --storage "file:///dev/shm/kvt-pool-8b" --json "$OUT/multiturn8b.json" --plot "$OUT/multiturn8b.png" | tee "$OUT/multiturn8b.log" ;;
  # the 8B recipe, device only vs + host (the two ratios: TTFT and throughput against device only)
  multiturn8b_dh) b multiturn ${M/qwen3-0.6b-shape/llama3-8b-shape} --clients 16 --rounds 6 --request-length 1024 \
      --output-length 64 --max-parallel 16 --num-device-blocks 1640 --num-host-blocks 8192 --compare device,host \
      --json "$OUT/multiturn8b_dh.json" --plot "$OUT/multiturn8b_dh.png" | tee "$OUT/multiturn8b_dh.log" ;;
  # the 4x recipe through PD (P + D behind the router, each in the storage configuration) vs colocated
  multiturn_pd) b multiturn $M --clients 16 --rounds 6 --request-length 1024 --output-length 64 --max-parallel 16 \
      --num-device-blocks 1640 --num-host-blocks 8192 --compare storage,pd --storage "file:///dev/shm/kvt-pool-pd" \
      --log-dir "$OUT/logs_pd" --server-args "--log-stats-interval 1" \
      --json "$OUT/multiturn_pd.json" --plot "$OUT/multiturn_pd.png" | tee "$OUT/multiturn_pd.log" ;;
  longdoc) b longdoc $M --documents 24 --document-length 4096 --questions 3 --max-inflight 4 --num-device-blocks 2048 \
      --num-host-blocks 8192 --compare device,host --json "$OUT/longdoc.json" --plot "$OUT/longdoc.png" | tee "$OUT/longdoc.log" ;;
  trace) b trace traces/mooncake_conversation_1k.jsonl $M --requests 300 --block-tokens 128 --time-scale 0.05 \
      --max-output-tokens 32 --max-input-tokens 12000 --num-device-blocks 2048 --num-host-blocks 8192 --compare device,host \
      --json "$OUT/trace.json" --plot "$OUT/trace.png" | tee "$OUT/trace.log" ;;
esac; done; done
rm -rf /dev/shm/kvt-pool-*
