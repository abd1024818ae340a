#!/usr/bin/env bash
# One GPU: the GPU tests, then the engine benchmarks; logs and JSON under $OUT.
#   tests       tests/engine/test_gpu.py, test_gpu_memory.py and test_overlap.py
#   throughput  kvtier bench throughput, overlap scheduling on and off, with the HBM roofline
#   hf          kvtier bench throughput against HF transformers generate (needs transformers)
#   decode      steady decode under torch.profiler: ms/step, GPU busy, kernels/step vs the roofline
#   experts     kvtier bench experts: R3 expert capture on vs off
#   attention   kvtier bench attention: Triton paged attention vs SDPA
#   rollout     kvtier bench rollout: n=8 samples vs 8 requests, logprobs on vs off (8B and 0.6B shapes)
#   vlm         kvtier bench vlm-chat: a chat resending its image vs without it (llava-1.5-7b-shape), and the LLaVA tests on cuda
#   demo        kvtier demo --device cuda
#   soak        kvtier bench soak --device cuda (SOAK_REQUESTS, default 2000)
# Usage: OUT=dir bash scripts/gpu_suite.sh [step ...]   (default: tests throughput experts attention)
set -uo pipefail
OUT=${OUT:-/tmp/kvtier-gpu}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
. scripts/gpu_webdeps.sh
f() { grep -v "Loading weights\|Writing model\|hashing weights"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
for step in "${@:-tests throughput experts attention}"; do for s in $step; do
  case $s in
    tests) python -m pytest -q -x -p no:cacheprovider tests/engine/test_gpu.py tests/engine/test_gpu_memory.py tests/engine/test_overlap.py 2>&1 \
             | tail -5 | tee "$OUT/gpu_tests.log" ;;
    throughput) python -m kvtier.bench.throughput --compare-overlap --hf-requests 0 --json "$OUT/throughput.json" 2>&1 \
             | f | tee "$OUT/throughput.log" ;;
    hf) python -m kvtier.bench.throughput --json "$OUT/throughput_hf.json" 2>&1 | f | tee "$OUT/throughput_hf.log" ;;
    decode) python scripts/gpu_decode_profile.py --overlap both 2>&1 | f | tee "$OUT/decode_profile.log" ;;
    experts) python -m kvtier.bench.experts_bench --json "$OUT/experts.json" 2>&1 | f | tee "$OUT/experts.log" ;;
    attention) python -m kvtier.bench.attention_bench --json "$OUT/attention.json" 2>&1 | tee "$OUT/attention.log" ;;
    rollout) python -m kvtier.bench.rollout_bench --json "$OUT/rollout_8b.json" 2>&1 | f | tee "$OUT/rollout_8b.log"
             python -m kvtier.bench.rollout_bench --preset qwen3-0.6b-shape --skip samples --json "$OUT/rollout_06b.json" 2>&1 \
             | f | tee "$OUT/rollout_06b.log" ;;
    vlm) python -m pytest -q -x -p no:cacheprovider tests/engine/test_llava_engine.py -k cuda 2>&1 | tail -5 | tee "$OUT/llava_tests.log"
         python -m kvtier.bench.vlm_chat --json "$OUT/vlm_chat.json" 2>&1 | f | tee "$OUT/vlm_chat.log" ;;
    demo) python -m kvtier.cli demo --device cuda 2>&1 | f | tee "$OUT/demo.log" ;;
    soak) python -m kvtier.cli bench soak --device cuda --requests ${SOAK_REQUESTS:-2000} --concurrency 16 --no-progress \
            --json "$OUT/soak_cuda.json" 2>&1 | tail -12 | tee "$OUT/soak_cuda.log" ;;
    *) echo "unknown step: $s"; exit 2 ;;
  esac
done; done
