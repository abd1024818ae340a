#!/usr/bin/env bash
# Decode on one GPU: overlap tests, decode profile, throughput roofline, R3 overhead, logprobs.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/kvtier-gpu}; mkdir -p "$OUT"
f() { grep -v "Loading weights\|Writing model\|hashing weights"; }
for s in "${@:-tests profile throughput routing rollout}"; do for step in $s; do case $step in
  tests) python -m pytest -q -p no:cacheprovider tests/engine/test_overlap.py tests/engine/test_gpu.py 2>&1 | tail -4 | tee "$OUT/tests16.log" ;;
  profile) python scripts/gpu_decode_profile.py 2>&1 | f | tee "$OUT/profile.log" ;;
  throughput) python -m kvtier.bench.throughput --compare-overlap --hf-requests 0 --json "$OUT/throughput.json" 2>&1 | f | tail -3 | tee "$OUT/throughput.log" ;;
  routing) python -m kvtier.bench.routing_bench --json "$OUT/routing.json" 2>&1 | f | tail -4 | tee "$OUT/routing.log" ;;
  rollout) python -m kvtier.bench.rollout_bench --preset qwen3-0.6b-shape --skip samples --json "$OUT/rollout.json" 2>&1 | f | tail -3 | tee "$OUT/rollout.log" ;;
esac; done; done
