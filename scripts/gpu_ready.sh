#!/usr/bin/env bash
# A fresh `kvtier serve` on the GPU, measured as a new user and an autoscaler meet it:
#   startup  - launch to /health 200 on an empty and on a warm Triton cache (llama3-8b-shape, dummy bf16)
#   first    - a freshly started server (0.6B shape, empty Triton cache) sent 16 multi-turn clients of
#              512-token turns with no warm-up, then the same load again 60 s later: TTFT p99 of the
#              first vs the later run, the slowest engine step of each (stats line every second), and
#              the kernels compiled after ready (/kvtier/stats: 0 when the start compiled everything)
# Usage: OUT=dir bash scripts/gpu_ready.sh [startup|first|all]
set -uo pipefail
OUT=${OUT:-/tmp/kvtier-ready}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
. scripts/gpu_webdeps.sh
W=$(mktemp -d)
PORT=18431

wait_ready() {   # prints seconds from $1 (epoch s) to /health 200 of the server $2
  local t0=$1 pid=$2
  for _ in $(seq 1 1200); do
    kill -0 "$pid" 2>/dev/null || { echo "exited"; return 1; }
    if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; then
      python -c "import time; print(f'{time.time() - $t0:.1f}')"; return 0
    fi
    sleep 0.1
  done
  echo "never ready"; return 1
}

startup() {
  python -m kvtier.cli init-model llama3-8b-shape "$W/8b" --config-only >/dev/null
  export TRITON_CACHE_DIR="$W/triton-8b"
  rm -rf "$TRITON_CACHE_DIR"
  for cache in empty warm; do
    t0=$(date +%s.%N)
    python -m kvtier.cli serve "$W/8b" --device cuda --load-format dummy --num-device-blocks 1640 \
      --num-host-blocks 8192 --max-model-len 16384 --port $PORT --log-level info > "$OUT/startup-$cache.log" 2>&1 &
    pid=$!
    echo "startup 8b ($cache Triton cache): $(wait_ready "$t0" $pid) s to ready"
    grep "startup: " "$OUT/startup-$cache.log" | sed 's/^.*startup: /    /'
    kill $pid; wait $pid 2>/dev/null
  done
}

first() {
  python -m kvtier.cli init-model qwen3-0.6b-shape "$W/06b" --config-only >/dev/null
  export TRITON_CACHE_DIR="$W/triton-06b"
  rm -rf "$TRITON_CACHE_DIR"
  t0=$(date +%s.%N)
  python -m kvtier.cli serve "$W/06b" --device cuda --load-format dummy --num-device-blocks 1640 \
    --num-host-blocks 8192 --max-model-len 16384 --port $PORT --log-level info --log-stats-interval 1 \
    > "$OUT/first-server.log" 2>&1 &
  pid=$!
  echo "0.6b server ready after $(wait_ready "$t0" $pid) s"
  B="python -m kvtier.cli bench multiturn --url http://127.0.0.1:$PORT --clients 16 --rounds 7 --request-length 512 --output-length 32 --warmup 0 --no-progress"
  $B --seed 1 --json "$OUT/first.json" > "$OUT/first-bench.txt" 2>&1
  mark=$(wc -l < "$OUT/first-server.log")
  sleep 60
  $B --seed 2 --json "$OUT/later.json" > "$OUT/later-bench.txt" 2>&1
  curl -s "http://127.0.0.1:$PORT/kvtier/stats" > "$OUT/stats.json"
  kill $pid; wait $pid 2>/dev/null
  python - "$OUT" "$mark" <<'EOF'
import json, re, sys
out, mark = sys.argv[1], int(sys.argv[2])
def p99(path):
    recs = json.load(open(f"{out}/{path}"))["results"]["url"]
    return recs
lines = open(f"{out}/first-server.log").read().splitlines()
def slowest(ls):
    v = [int(m.group(1).replace(",", "")) for l in ls if (m := re.search(r"slowest step ([\d,]+) ms", l))]
    return max(v) if v else None
for name, ls in (("first", lines[:mark]), ("later", lines[mark:])):
    r = p99(f"{name}.json")
    ms = {k: round(r[k] * 1e3, 1) if r.get(k) is not None else None for k in ("ttft_mean", "ttft_p50", "ttft_p90", "ttft_p99")}
    print(f"{name}: requests {r['requests']} failed {r['failed']} TTFT ms {ms}; slowest step {slowest(ls)} ms")
s = json.load(open(f"{out}/stats.json"))["startup"]
print("startup:", s)
EOF
}

case "${1:-all}" in
  startup) startup ;;
  first) first ;;
  all) startup; first ;;
esac
