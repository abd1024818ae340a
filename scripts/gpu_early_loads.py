"""A/B of how a storage hit reaches the device, in one reader engine (H100): early loads on/off
and objects per storage call, alternating per round. storage_fetch="always" and prefetch_policy="wait_complete": every block
comes from the pool (the cost model's decisions are not what is measured). Usage: python scripts/gpu_early_loads.py
[prompt_tokens] [rounds]; prints one JSON line per variant (TTFT, fetch wait, admission->token)."""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

import kvtier
from kvtier.model import init_model

# name -> (early_loads, objects per storage call); the client's default batch is 16
VARIANTS = {"early": (True, 16), "early/b8": (True, 8), "early/b4": (True, 4), "late": (False, 16)}


def main() -> None:
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 6144
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    tmp = tempfile.mkdtemp(dir="/dev/shm")
    device = os.environ.get("DEVICE", "cuda")       # (DEVICE=cpu: a smoke run on llama-tiny)
    init_model("llama3-8b-shape" if device == "cuda" else "llama-tiny", f"{tmp}/model", config_only=device == "cuda")
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 250, tokens).tolist()
    warm = rng.integers(0, 250, min(tokens, 2048)).tolist()
    kw = dict(device=device, load_format="dummy" if device == "cuda" else "auto", num_host_blocks=tokens // 16 + 64, max_model_len=tokens + 64,
              max_num_seqs=8, max_num_batched_tokens=4096, storage=f"file://{tmp}/pool")
    one = kvtier.SamplingParams(max_tokens=1, ignore_eos=True)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    out: dict = {v: [] for v in VARIANTS}
    cold = []
    # both engines at once (fixed device tiers): the writer stores each round's copies just before
    # the round, so the pool's LRU (half of /dev/shm by default) never drops a copy not yet read
    kw["num_device_blocks"] = 2 * tokens // 16 + 256
    with kvtier.LLM(f"{tmp}/model", write_policy="write_through", **kw) as writer, \
            kvtier.LLM(f"{tmp}/model", write_policy="write_through_selective", storage_fetch="always",
                       prefetch_policy="wait_complete", **kw) as llm:
        def store(r) -> None:  # type: ignore[no-untyped-def]
            for v in VARIANTS:
                writer.generate([prompt], one, cache_salt=f"{v}-{r}")
            while writer.pump_idle():       # every put acknowledged
                time.sleep(0.01)
        llm.generate([warm], one, cache_salt="w")
        llm.generate([prompt], one, cache_salt="cold-w")
        store("warm")
        for v, (early, batch) in VARIANTS.items():
            llm.cache.early_loads, llm.storage.batch = early, batch   # (the slots hold 16 objects)
            llm.generate([prompt], one, cache_salt=f"{v}-warm")
        for r in range(rounds):
            store(r)
            sync()
            t0 = time.perf_counter()
            llm.generate([prompt], one, cache_salt=f"cold-{r}")
            cold.append(time.perf_counter() - t0)
            n = len(VARIANTS)
            for v in list(VARIANTS)[r % n:] + list(VARIANTS)[:r % n]:
                llm.cache.early_loads, llm.storage.batch = VARIANTS[v]
                sync()
                t0 = time.perf_counter()
                o = llm.generate([prompt], one, cache_salt=f"{v}-{r}")[0]
                sync()
                m = o.metrics
                out[v].append({"ttft": time.perf_counter() - t0, "storage": o.cached_tokens_by_tier["storage"],
                               "wait": m["admitted"] - m.get("prefetch_start", m["admitted"]),
                               "after": m["first_token"] - m["admitted"]})
    print(json.dumps({"prompt_tokens": tokens, "recompute_ms": 1e3 * statistics.median(cold)}))
    for v, runs in out.items():
        med = {k: statistics.median(x[k] for x in runs) for k in ("ttft", "wait", "after")}
        print(json.dumps({"variant": v, **{f"{k}_ms": round(1e3 * x, 1) for k, x in med.items()},
                          "storage_tokens": [x["storage"] for x in runs],
                          "ttft_all_ms": [round(1e3 * x["ttft"], 1) for x in runs]}))


if __name__ == "__main__":
    main()
