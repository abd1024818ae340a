#!/usr/bin/env bash
# GPU host: what the pool objects' checksum costs (xxh3-64 holds the GIL, CRC32C does not), A/B in
# one run, then the issue-16 goal figures. Needs the crc32c wheel carried in .gpuwheels (the device
# image has none): pip download crc32c --python-version 3.12 --only-binary=:all: -d .gpuwheels
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -d .gpuwheels ]; then
  python -m pip install -q --no-deps --no-index --find-links .gpuwheels --target /tmp/ckdeps crc32c 2>&1 | grep -v WARNING | tail -2
fi
export PYTHONPATH=$PWD:/tmp/ckdeps
POOL=/dev/shm/kvtier-ab
for algo in 1 2 1 2; do     # file pool get/put vs the raw client, each checksum twice, alternating
  rm -rf $POOL; mkdir -p $POOL
  python -c "import sys, kvtier.storage.blob as b; b.WRITE_ALGO = $algo; from kvtier.bench.storage_bench import main; sys.exit(main(sys.argv[1:]))" \
    --url file://$POOL --objects 256 --workers 16 --repeat 3 --json > "$OUT/storage_algo$algo.$RANDOM.json" 2>>"$OUT/err.txt"
done
rm -rf $POOL
for algo in 1 2; do         # a pool's effect on TTFT: hits and cold prompts, puts idle or in flight
  PROBE_ALGO=$algo PROBE_CONFIGS=host,pool PROBE_SWITCH=0.0005 python scripts/gpu_ttft_probe.py > /dev/null 2>>"$OUT/err.txt"
  mv "$OUT/ttft_probe.json" "$OUT/ttft_probe_algo$algo.json"
done
python scripts/gpu_ttft_costs.py > /dev/null 2>>"$OUT/err.txt"
cat "$OUT/ttft_costs.json"
for f in "$OUT"/storage_algo*.json; do echo "$f"; python -c "import json; r = json.load(open('$f'))['bytes'][0]; print({k: round(v, 3) for k, v in r.items() if 'gbps' in k or 'ratio' in k})"; done
python - <<'PY'
import json, os
out = os.environ.get("OUT", "/tmp/out")
for a in (1, 2):
    d = json.load(open(f"{out}/ttft_probe_algo{a}.json"))
    print("algo", a, {k: v.get("total") for k, v in d.items() if isinstance(v, dict) and "total" in v})
PY
tail -5 "$OUT/err.txt"
