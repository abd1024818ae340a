"""``kvtier bench transfer``: host<->device KV copy bandwidth, against a contiguous pinned copy.

Llama-3-8B KV shape by default (32 layers, 8 KV heads, head_dim 128, bf16, 16-token blocks: 2 MiB
per block over all layers). For each block count and id pattern (consecutive / random) it times

    fast       kvtier's fast path as the engine runs it. Backups: the Triton zero-copy kernel,
               all layers in one launch. Loads, per layer (an eager forward, or a graph step
               behind layer gates, overlaps them): runs of 32+ consecutive blocks by 2D DMA, the
               scattered rest by the zero-copy kernel
    staged     every layer at once: one DMA per run of host blocks to or from a device staging
               buffer, one scatter (loads) or gather (backups) kernel; loads of a decode graph
               step take this path
    kernel     the Triton zero-copy kernel alone, for every block
    reference  the torch reference ops (index + copy through the host)
    loop       a per-block, per-layer ``copy_`` loop (non_blocking, pinned)
    contiguous one ``copy_`` of the same number of bytes between contiguous buffers (the link limit),
               from torch's pinned memory (``pin_memory=True``)
    registered the same copy from memory pinned the way the host pool is (``cudaHostRegister``)

and reports GB/s plus ``fast / contiguous`` and ``fast / loop``. Goals: fast >= 0.90 x
contiguous from 64 blocks up, both directions; fast >= 10 x loop.

    kvtier bench transfer [--blocks 1,4,16,64,256,1024,4096] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from typing import Callable

import torch

from kvtier.engine.config import EngineConfig
from kvtier.transfer import copy as ref
from kvtier.transfer import kernels as fast
from kvtier.transfer.host_pool import HostKV


def _time(fn, reps: int) -> float:
    """Median seconds of ``fn`` (queued on the current stream), after a warm-up."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _per_layer(copy: Callable[[int], None], num_layers: int) -> Callable[[], None]:
    """One timed call of ``copy(layer)`` for every layer."""

    def run() -> None:
        for layer in range(num_layers):
            copy(layer)

    return run


def _loop_d2h(kv, host, dev, hst):
    for d, h in zip(dev, hst):
        for layer, t in enumerate(kv):
            host[h, layer, 0].copy_(t[0, d], non_blocking=True)
            host[h, layer, 1].copy_(t[1, d], non_blocking=True)


def _loop_h2d(host, kv, hst, dev):
    for h, d in zip(hst, dev):
        for layer, t in enumerate(kv):
            t[0, d].copy_(host[h, layer, 0], non_blocking=True)
            t[1, d].copy_(host[h, layer, 1], non_blocking=True)


def run(args: argparse.Namespace) -> dict:
    if not torch.cuda.is_available():
        raise SystemExit("kvtier bench transfer needs a CUDA GPU (torch sees none)")
    device = torch.device("cuda")
    counts = [int(x) for x in args.blocks.split(",")]
    n_max = max(counts)
    L, H, D, bs, dtype = args.layers, args.kv_heads, args.head_dim, args.block_size, getattr(torch, args.dtype)
    n_dev = n_host = n_max + 8
    buf = torch.randn((L, 2, n_dev, bs, H, D), device=device).to(dtype)
    kv = list(buf.unbind(0))
    host = HostKV((n_host, L, 2, bs, H, D), dtype, device)
    block_bytes = L * 2 * bs * H * D * dtype.itemsize
    contiguous_dev = torch.empty(n_max * block_bytes, dtype=torch.uint8, device=device)
    contiguous_host = torch.empty(n_max * block_bytes, dtype=torch.uint8, pin_memory=True)
    registered_host = HostKV((n_max * block_bytes,), torch.uint8, device)  # how the host pool is pinned
    rng = random.Random(0)
    rows = []
    for n in counts:
        for pattern in ("consecutive", "random"):
            if pattern == "consecutive":
                dev, hst = list(range(3, 3 + n)), list(range(5, 5 + n))
            else:
                dev, hst = rng.sample(range(n_dev), n), rng.sample(range(n_host), n)
            nbytes = n * block_bytes
            d2h_pairs = fast.BlockPairs.split(dev, hst, True, fast.TUNING["min_dma_run_d2h"])
            h2d_pairs = fast.BlockPairs.split(hst, dev, True, fast.TUNING["min_dma_run_h2d"], device)
            d2h_kernel, h2d_kernel = fast.BlockPairs.split(dev, hst, True, 0), fast.BlockPairs.split(hst, dev, True, 0)
            staged = fast.host_runs(host.tensor, kv, hst, dev)  # the same pairs serve both directions
            row = {"blocks": n, "pattern": pattern, "bytes": nbytes}
            for direction in ("d2h", "h2d"):
                if direction == "d2h":
                    variants = {
                        "fast": lambda: fast.device_to_host(kv, host.tensor, d2h_pairs, None),
                        "staged": lambda: fast.device_to_host(kv, host.tensor, staged, None),
                        "kernel": lambda: fast.device_to_host(kv, host.tensor, d2h_kernel, None),
                        "reference": lambda: ref.device_to_host(kv, host.tensor, dev, hst),
                        "loop": lambda: _loop_d2h(kv, host.tensor, dev, hst),
                        "contiguous": lambda: contiguous_host[:nbytes].copy_(contiguous_dev[:nbytes], non_blocking=True),
                        "registered": lambda: registered_host.tensor[:nbytes].copy_(contiguous_dev[:nbytes], non_blocking=True),
                    }
                else:
                    variants = {
                        "fast": _per_layer(lambda i: fast.host_to_device(host.tensor, kv, h2d_pairs, None, layer=i), L),
                        "staged": lambda: fast.host_to_device(host.tensor, kv, staged, None),
                        "kernel": _per_layer(lambda i: fast.host_to_device(host.tensor, kv, h2d_kernel, None, layer=i), L),
                        "reference": _per_layer(lambda i: ref.host_to_device(host.tensor, kv, hst, dev, layer=i), L),
                        "loop": lambda: _loop_h2d(host.tensor, kv, hst, dev),
                        "contiguous": lambda: contiguous_dev[:nbytes].copy_(contiguous_host[:nbytes], non_blocking=True),
                        "registered": lambda: contiguous_dev[:nbytes].copy_(registered_host.tensor[:nbytes], non_blocking=True),
                    }
                for name, fn in variants.items():
                    if (
                        name == "loop"
                        and n > args.max_loop_blocks
                        or name == "reference"
                        and n > args.max_ref_blocks
                        or name == "staged"
                        and staged is None
                    ):  # layers not views of one buffer
                        continue
                    row[f"{direction}_{name}_GBps"] = nbytes / _time(fn, args.repeat) / 1e9
                c = row[f"{direction}_contiguous_GBps"]
                row[f"{direction}_fast_vs_contiguous"] = row[f"{direction}_fast_GBps"] / c
                for name in ("staged", "kernel"):
                    if f"{direction}_{name}_GBps" in row:
                        row[f"{direction}_{name}_vs_contiguous"] = row[f"{direction}_{name}_GBps"] / c
                if f"{direction}_loop_GBps" in row:
                    row[f"{direction}_fast_vs_loop"] = row[f"{direction}_fast_GBps"] / row[f"{direction}_loop_GBps"]
            rows.append(row)
            print(_line(row), flush=True)
    goal_rows = [r for r in rows if r["blocks"] >= 64]
    summary = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shape": dict(layers=L, kv_heads=H, head_dim=D, block_size=bs, dtype=args.dtype, block_bytes=block_bytes),
        "rows": rows,
        "min_fast_vs_contiguous_from_64": {d: min(r[f"{d}_fast_vs_contiguous"] for r in goal_rows) for d in ("d2h", "h2d")}
        if goal_rows
        else None,
        "min_staged_vs_contiguous_from_64": {
            d: min((r[f"{d}_staged_vs_contiguous"] for r in goal_rows if f"{d}_staged_vs_contiguous" in r), default=None)
            for d in ("d2h", "h2d")
        }
        if goal_rows
        else None,
        "min_fast_vs_loop": {
            d: min((r[f"{d}_fast_vs_loop"] for r in rows if f"{d}_fast_vs_loop" in r), default=None) for d in ("d2h", "h2d")
        },
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}), flush=True)
    host.release()
    registered_host.release()
    return summary


def _line(r: dict) -> str:
    parts = [f"{r['blocks']:5d} {r['pattern']:11s}"]
    for d in ("d2h", "h2d"):
        vals = " ".join(
            f"{name}={r[f'{d}_{name}_GBps']:6.1f}"
            for name in ("fast", "staged", "kernel", "reference", "loop", "contiguous", "registered")
            if f"{d}_{name}_GBps" in r
        )
        parts.append(f"{d}: {vals} GB/s  fast/contig={r[f'{d}_fast_vs_contiguous']:.2f}")
    return " | ".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="kvtier bench transfer", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--blocks", default="1,4,16,64,256,1024,4096", help="block counts, comma separated")
    ap.add_argument("--layers", type=int, default=32, help="layers (default 32: Llama-3-8B)")
    ap.add_argument("--kv-heads", type=int, default=8, help="KV heads (default 8)")
    ap.add_argument("--head-dim", type=int, default=128, help="head dim (default 128)")
    ap.add_argument("--repeat", type=int, default=5, help="timed runs per point; the median is reported (default 5)")
    ap.add_argument("--max-loop-blocks", type=int, default=256, help="skip the per-block loop above this (slow)")
    ap.add_argument("--max-ref-blocks", type=int, default=1024, help="skip the torch reference above this")
    ap.add_argument("--json", default=None, help="write the results to this file")
    # the KV's block size and dtype; bf16, the dtype of the shape's checkpoint (Llama-3-8B), on a GPU
    EngineConfig.add_flags(ap, only=("block_size", "dtype"), defaults={"dtype": "bfloat16"})
    args = ap.parse_args(argv)
    if args.dtype == "auto":  # (the checkpoint's: Llama-3-8B's)
        args.dtype = "bfloat16"
    summary = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
