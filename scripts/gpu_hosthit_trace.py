"""GPU timeline of one host hit (``kvtier bench overlap``'s case: 8B shape, 8K prefix, 48 new
tokens): torch.profiler trace to $OUT, and per stream the busy time, span and gaps of its copies
and kernels — where does a host hit lose time against max(device hit, KV / link)?"""
from __future__ import annotations

import json
import os
import random
import sys
import tempfile
from collections import defaultdict
from pathlib import Path


import kvtier
from kvtier.bench.overlap_bench import _ttft
from kvtier.model.presets import init_model

OUT = Path(os.environ.get("OUT", "/tmp"))
model = sys.argv[1] if len(sys.argv) > 1 else "llama3-8b-shape"
prefix_len, new_len, bs = 8192, 48, 16
path = init_model(model, Path(tempfile.mkdtemp()) / model, config_only=True)
cfg = kvtier.model.ModelConfig.from_hf_dir(path)
rng = random.Random(0)
tok = lambda n: [rng.randrange(cfg.vocab_size) for _ in range(n)]  # noqa: E731
need = -(-(prefix_len + new_len + 1) // bs)
llm = kvtier.LLM(path, device="cuda", dtype="bfloat16", load_format="dummy", block_size=bs,
                 num_device_blocks=need + 16, num_host_blocks=3 * need, write_policy="write_through",
                 max_num_batched_tokens=prefix_len + new_len + 64, max_model_len=prefix_len + new_len + 64)
prefix = tok(prefix_len)
for _ in range(2):
    _ttft(llm, prefix + tok(new_len))
    _ttft(llm, tok(prefix_len + new_len))
    _ttft(llm, prefix + tok(new_len))
_ttft(llm, tok(prefix_len + new_len))          # evict the prefix
from torch.profiler import ProfilerActivity, profile  # noqa: E402
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    dt, out = _ttft(llm, prefix + tok(new_len))
print("host hit", dt * 1e3, "ms", out.cached_tokens_by_tier)
prof.export_chrome_trace(str(OUT / f"trace_{model}.json"))
events = json.load(open(OUT / f"trace_{model}.json"))["traceEvents"]
by_stream = defaultdict(list)
for e in events:
    if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
        by_stream[e["args"].get("stream")].append(e)
t0 = min(e["ts"] for es in by_stream.values() for e in es)
res = {}
for s, es in sorted(by_stream.items(), key=lambda kv: str(kv[0])):
    es.sort(key=lambda e: e["ts"])
    busy = sum(e["dur"] for e in es)
    span = es[-1]["ts"] + es[-1]["dur"] - es[0]["ts"]
    gaps = sorted(((es[i + 1]["ts"] - (es[i]["ts"] + es[i]["dur"]), es[i]["name"][:60], es[i + 1]["name"][:60])
                   for i in range(len(es) - 1)), reverse=True)[:6]
    kinds = defaultdict(float)
    for e in es:
        kinds[(e["cat"], e["name"][:70])] += e["dur"]
    top = sorted(kinds.items(), key=lambda kv: -kv[1])[:8]
    res[str(s)] = {"n": len(es), "start_us": es[0]["ts"] - t0, "end_us": es[-1]["ts"] + es[-1]["dur"] - t0,
                   "busy_us": busy, "span_us": span, "top": [(k[0], k[1], round(v)) for k, v in top],
                   "largest_gaps_us": [(round(g), a, b) for g, a, b in gaps]}
print(json.dumps(res, indent=1))
(OUT / f"streams_{model}.json").write_text(json.dumps(res, indent=1))
llm.close()
