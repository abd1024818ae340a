"""GPU: steady decode, timed and profiled against the HBM roofline. For each (batch, context):
``--steps`` timed engine steps, then ``--prof-steps`` under torch.profiler. Prints and writes to
``$OUT/decode_profile.json``: ms per step, GPU busy (sum of kernel time / wall), kernels per step,
the top kernels, and the step's HBM roofline (weights + KV of every sequence, read once, over the
bandwidth of a device copy measured in the same run) with its ratio.

    python scripts/gpu_decode_profile.py [--preset qwen3-0.6b-shape] [--overlap both|on|off] [--kv-cache-dtypes auto,fp8]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

import torch

import kvtier
from kvtier.bench.throughput import hbm_bandwidth
from kvtier.engine.core import EngineCore
from kvtier.model import init_model


def steady(core: EngineCore, batch: int, context: int, seed: int) -> None:
    rng = random.Random(seed)
    vocab = min(core.config.vocab_size, 32000)
    for _ in range(batch):
        core.add_request([rng.randrange(vocab) for _ in range(context)],
                         kvtier.SamplingParams(max_tokens=4000, ignore_eos=True))
    while core.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running):
        core.step()
    for _ in range(5):
        core.step()


def measure(path: Path, batch: int, context: int, overlap: bool, steps: int, prof_steps: int, bw: float,
            kv_cache_dtype: str = "auto") -> dict:
    blocks = batch * -(-(context + steps + prof_steps + 64) // 16) + 64
    with EngineCore(path, device="cuda", dtype="bfloat16", block_size=16, num_device_blocks=blocks,
                    max_num_seqs=max(batch, 1), max_num_batched_tokens=8192, max_model_len=context + 4096,
                    overlap_schedule=overlap, kv_cache_dtype=kv_cache_dtype) as core:
        steady(core, batch, context, 0)
        torch.cuda.synchronize()
        ctx = sum(r.num_computed_tokens for r in core.scheduler.running) / batch
        t0 = time.perf_counter()
        marks = [t0]
        for _ in range(steps):
            core.step()
            marks.append(time.perf_counter())
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) / steps * 1e3
        windows = [round((marks[min(i + 10, steps)] - marks[i]) / (min(i + 10, steps) - i) * 1e3, 2)
                   for i in range(0, steps, 10)]
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for _ in range(prof_steps):
                core.step()
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        gpu_us = sum(e.self_device_time_total for e in kernels)
        count = sum(e.count for e in kernels)
        top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:12]
        cfg = core.config
        weights = sum(p.numel() * p.element_size() for p in core.model.parameters())
        kv_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * core.kv_caches[0].element_size()
        roof_ms = (weights + kv_token * batch * (ctx + steps)) / bw * 1e3
        return {"batch": batch, "context": round(ctx), "overlap": overlap, "kv_cache_dtype": kv_cache_dtype,
                "tokens_per_s": batch / ms * 1e3, "ms_per_step": ms, "ms_by_10_steps": windows,
                "profiled_ms_per_step": wall / prof_steps * 1e3,
                "gpu_busy_ms_per_step": gpu_us / 1e3 / prof_steps, "gpu_busy_fraction": gpu_us / 1e6 / wall,
                "kernels_per_step": count / prof_steps, "roofline_ms": roof_ms, "roofline_ratio": roof_ms / ms,
                "top_kernels": [(e.key[:80], e.count // prof_steps, e.self_device_time_total / prof_steps / 1e3)
                                for e in top]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-0.6b-shape")
    ap.add_argument("--points", default="64x1100,256x630", help="BATCHxCONTEXT,...")
    ap.add_argument("--overlap", choices=("both", "on", "off"), default="both")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--prof-steps", type=int, default=20)
    ap.add_argument("--kv-cache-dtypes", default="auto", help="comma-separated kv_cache_dtype values, each measured")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU: nothing measured")
        return 0
    out = Path(os.environ.get("OUT", "/tmp"))
    path = init_model(args.preset, tempfile.mkdtemp())
    bw = hbm_bandwidth("cuda")
    print(f"{torch.cuda.get_device_name()}: HBM {bw / 1e12:.2f} TB/s (device copy)", flush=True)
    modes = {"both": (False, True), "on": (True,), "off": (False,)}[args.overlap]
    rows = []
    for point in args.points.split(","):
        batch, context = (int(x) for x in point.split("x"))
        for overlap, kv in [(o, k) for o in modes for k in args.kv_cache_dtypes.split(",")]:
            try:
                r = measure(path, batch, context, overlap, args.steps, args.prof_steps, bw, kv)
            except torch.OutOfMemoryError as e:  # (a bf16 cache of this size may not fit where fp8 does)
                print(f"batch {batch} x {context} kv {kv}: out of memory ({str(e)[:80]})", flush=True)
                torch.cuda.empty_cache()
                continue
            rows.append(r)
            print(f"batch {batch} ctx ~{r['context']} overlap {'on' if overlap else 'off'} kv {kv}: "
                  f"{r['tokens_per_s']:.0f} tok/s, "
                  f"{r['ms_per_step']:.2f} ms/step, "
                  f"GPU busy {r['gpu_busy_ms_per_step']:.2f} ms ({r['gpu_busy_fraction']:.0%}), "
                  f"{r['kernels_per_step']:.0f} kernels/step, roofline {r['roofline_ms']:.2f} ms "
                  f"= {r['roofline_ratio']:.2f}; ms/step by 10 steps {r['ms_by_10_steps']}", flush=True)
            for name, n, t in r["top_kernels"][:8]:
                print(f"    {t:7.3f} ms  x{n:<4d} {name}", flush=True)
    (out / "decode_profile.json").write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                                         "hbm_bytes_per_s": bw, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
