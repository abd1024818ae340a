#!/usr/bin/env bash
# What we run on the lent GPU (device tool): GPU tests, then the GPU benchmarks; logs under $OUT.
# Usage: bash scripts/gpu_suite.sh [tests|throughput|routing|attention|demo|soak ...]   (default: the first four)
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/kvtier-gpu}; mkdir -p "$OUT"
# the device image has no web stack (serve, soak): wheels carried in .gpuwheels (docs/BENCHMARKS.md)
if [ -d .gpuwheels ]; then
  python -m pip install -q --no-index --find-links .gpuwheels --target /tmp/webdeps fastapi uvicorn prometheus-client httpx 2>&1 | grep -v WARNING | tail -3
  export PYTHONPATH=$PWD:/tmp/webdeps
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
for step in "${@:-tests throughput routing attention}"; do for s in $step; do
  case $s in
    tests) python -m pytest -q -x tests/engine/test_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" ;;
    throughput) python -m kvtier.bench.throughput --json "$OUT/throughput.json" 2>&1 | grep -v "Loading weights\|Writing model" | tee "$OUT/throughput.log" ;;
    routing) python -m kvtier.bench.routing_bench --json "$OUT/routing.json" 2>&1 | grep -v "Loading weights\|Writing model" | tee "$OUT/routing.log" ;;
    attention) python -m kvtier.bench.attention_bench --json "$OUT/attention.json" 2>&1 | tee "$OUT/attention.log" ;;
    demo) python -m kvtier.cli demo --device cuda 2>&1 | grep -v "Loading weights\|Writing model" | tee "$OUT/demo.log" ;;
    soak) python -m kvtier.cli bench soak --device cuda --requests ${SOAK_REQUESTS:-2000} --concurrency 16 --no-progress \
            --json "$OUT/soak_cuda.json" 2>&1 | tail -12 | tee "$OUT/soak_cuda.log" ;;
  esac
done; done
