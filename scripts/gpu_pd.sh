#!/usr/bin/env bash
# One GPU: the PD tests, then `kvtier bench pd` on the 8B shape (dummy bf16 weights) with a file
# pool on /dev/shm, P and D on the same GPU. Results under $OUT.
# Environment: REQS (48), RATE (3), REPEAT (1), SETUPS (colocated,pd), PT (1024,6144 prompt tokens),
# OT (32,128 output tokens), PPW (P's put threads; unset: the prefill role's default), SKIP_TESTS=1.
set -uo pipefail
OUT=${OUT:-/tmp/kvtier-pd}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
. scripts/gpu_webdeps.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
[ -n "${SKIP_TESTS:-}" ] || python -m pytest -q -x tests/engine/test_gpu.py -k "pd_handoff or storage_hits" 2>&1 | tail -5 | tee "$OUT/gpu_tests.txt"
[ -n "${SKIP_TESTS:-}" ] || python -m pytest -q tests/serve/test_async_engine.py tests/engine/test_handoff.py 2>&1 | tail -3 | tee -a "$OUT/gpu_tests.txt"
S=${SETUPS:-colocated,pd}
mkdir -p /dev/shm/kvtpd && python -m kvtier.cli bench pd --preset llama3-8b-shape --load-format dummy --device cuda \
  --storage file:///dev/shm/kvtpd --num-device-blocks 2048 --num-host-blocks 1024 --max-model-len 8192 \
  --requests ${REQS:-48} --rate ${RATE:-3} --repeat ${REPEAT:-1} --setups "$S" \
  --prompt-tokens ${PT:-1024,6144} --output-tokens ${OT:-32,128} ${PPW:+--prefill-put-workers $PPW} \
  --json "$OUT/bench_pd_${S/,/_}.json" 2>&1 | grep -v "runs done" | tail -12 | tee "$OUT/bench_pd_${S/,/_}.txt"
rm -rf /dev/shm/kvtpd
