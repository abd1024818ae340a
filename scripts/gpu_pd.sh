#!/usr/bin/env bash
# One device call: GPU tests, then `kvtier bench pd` on an 8B-shape model (dummy weights) with a
# file pool on /dev/shm. Results under $OUT.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
# the device image has no web stack: wheels carried in .gpuwheels (pip download, see BENCHMARKS.md)
[ -d .gpuwheels ] && python -m pip install -q --no-index --find-links .gpuwheels --target /tmp/webdeps fastapi uvicorn prometheus-client httpx 2>&1 | grep -v WARNING | tail -3
export PYTHONPATH=$PWD:/tmp/webdeps
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt
[ -n "${SKIP_TESTS:-}" ] || python -m pytest -q -x tests/engine/test_gpu.py -k "pd_handoff or storage_hits" 2>&1 | tail -5 | tee $OUT/gpu_tests.txt
[ -n "${SKIP_TESTS:-}" ] || python -m pytest -q tests/serve/test_async_engine.py tests/engine/test_handoff.py 2>&1 | tail -3 | tee -a $OUT/gpu_tests.txt
mkdir -p /dev/shm/kvtpd && python -m kvtier.cli bench pd --preset llama3-8b-shape --load-format dummy --device cuda \
  --storage file:///dev/shm/kvtpd --num-device-blocks 2048 --num-host-blocks 1024 --max-model-len 8192 \
  --requests ${REQS:-128} --rate ${RATE:-1.5,3} --repeat ${REPEAT:-2} --setups ${SETUPS:-colocated,pd} \
  --prompt-tokens ${PT:-1024,6144} --output-tokens ${OT:-32,128} \
  --out $OUT/bench_pd_${SETUPS:-both}.json 2>&1 | grep -v "runs done" | tail -12 | tee $OUT/bench_pd_${SETUPS:-both}.txt
rm -rf /dev/shm/kvtpd
