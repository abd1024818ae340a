"""GPU: the MLA decode kernel (model/triton_mla.py) against the torch reference and the HBM limit.
DeepSeek-V3's latent (512 + 64) and its 128 heads, bf16, shuffled paged blocks of 16. For each
(batch, context): the kernel's time (CUDA events, median of 20 after 3 warm-ups), the latent bytes
it must read (batch x context x 576 x 2) over a device copy's bandwidth measured in the same run,
and the torch reference's time. Prints and writes ``$OUT/mla_decode.json``.

    python scripts/gpu_mla_decode.py [--heads 128] [--shapes 64x4096 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

import torch

from kvtier.bench.throughput import hbm_bandwidth
from kvtier.model import triton_mla
from kvtier.model.attention import AttentionMetadata
from kvtier.model.mla import reference_mla_absorbed
from kvtier.model.triton_mla import triton_mla_decode

SWEEP = [
    dict(block_h=h, block_n=n, num_warps=w, num_stages=st)
    for h in (16, 32, 64)
    for n in (16, 32, 64)
    for w in (4, 8)
    for st in (1, 2)
]


def timed(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--shapes", nargs="*", default=["1x4096", "16x4096", "64x1024", "64x4096", "128x4096", "256x2048"])
    ap.add_argument("--sweep", action="store_true", help="time every launch configuration of SWEEP per shape")
    args = ap.parse_args()
    rank, rope, bs = 512, 64, 16
    bw = hbm_bandwidth("cuda")
    rows = []
    for shape in args.shapes:
        batch, context = map(int, shape.split("x"))
        per = -(-context // bs)
        ids = list(range(batch * per))
        random.Random(0).shuffle(ids)
        tables = [ids[i * per : (i + 1) * per] for i in range(batch)]
        meta = AttentionMetadata.build([1] * batch, [context] * batch, tables, bs, "cuda")
        cache = torch.randn(batch * per, bs, rank + rope, device="cuda", dtype=torch.bfloat16)
        q = torch.randn(batch, args.heads, rank + rope, device="cuda", dtype=torch.bfloat16)
        scale = (128 + 64) ** -0.5
        got = triton_mla_decode(q, cache, meta, scale, rank)
        ref = reference_mla_absorbed(q, cache, meta, scale, rank)
        err = float((got.float() - ref.float()).abs().max())
        kernel = timed(lambda: triton_mla_decode(q, cache, meta, scale, rank))
        if args.sweep:
            for config in SWEEP:
                triton_mla.CONFIG_OVERRIDE.clear()
                triton_mla.CONFIG_OVERRIDE.update(config)
                try:
                    t = timed(lambda: triton_mla_decode(q, cache, meta, scale, rank))
                    e = float((triton_mla_decode(q, cache, meta, scale, rank).float() - ref.float()).abs().max())
                    print(f"  {config}: {t * 1e6:8.1f} us ({batch * context * 1152 / t / 1e12:.2f} TB/s) err {e:.3g}")
                except Exception as exc:  # (a configuration out of registers or shared memory)
                    print(f"  {config}: failed ({type(exc).__name__})")
            triton_mla.CONFIG_OVERRIDE.clear()
        reference = timed(lambda: reference_mla_absorbed(q, cache, meta, scale, rank), reps=5)
        nbytes = batch * context * (rank + rope) * 2
        row = dict(
            batch=batch,
            context=context,
            heads=args.heads,
            kernel_us=kernel * 1e6,
            reference_us=reference * 1e6,
            speedup=reference / kernel,
            latent_tb_s=nbytes / kernel / 1e12,
            of_copy_bandwidth=nbytes / kernel / bw,
            max_abs_err=err,
        )
        rows.append(row)
        print(
            f"batch {batch:4d} x {context:5d}: kernel {kernel * 1e6:8.1f} us ({row['latent_tb_s']:.2f} TB/s, "
            f"{row['of_copy_bandwidth']:.2f} of copy), reference {reference * 1e6:9.1f} us, x{row['speedup']:.1f}, "
            f"max |err| {err:.3g}",
            flush=True,
        )
    out = Path(os.environ.get("OUT", "."))
    (out / "mla_decode.json").write_text(
        json.dumps(dict(device=torch.cuda.get_device_name(), copy_tb_s=bw / 1e12, rows=rows), indent=1)
    )


if __name__ == "__main__":
    main()
