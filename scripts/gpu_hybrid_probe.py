"""Scattered host<->device copies split between the Triton kernel (SM-issued PCIe reads/writes)
and the driver's batched DMA (copy engines) running at once on two streams: does the sum pass
either path alone? GB/s against a contiguous pinned copy of the same bytes, medians of 9.

    python scripts/gpu_hybrid_probe.py [--blocks 16,64,256] [--shares 0,0.2,0.3,0.4,0.5]
"""
from __future__ import annotations

import argparse
import json
import random

import torch

from kvtier.bench.transfer_bench import _time
from kvtier.transfer import batch
from kvtier.transfer import kernels as fast
from kvtier.transfer.host_pool import HostKV


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", default="16,64,256")
    ap.add_argument("--shares", default="0,0.15,0.25,0.35,0.5")
    ap.add_argument("--flags", type=int, default=1, help="CUmemcpyAttributes flags (1: prefer overlap with compute)")
    args = ap.parse_args()
    batch.FLAGS["flags"] = args.flags
    dev = torch.device("cuda")
    L, bs, H, D = 32, 16, 8, 128
    n_max = max(int(x) for x in args.blocks.split(","))
    nd = nh = n_max + 8
    buf = torch.randn((L, 2, nd, bs, H, D), device=dev).to(torch.bfloat16)
    kv = list(buf.unbind(0))
    host = HostKV((nh, L, 2, bs, H, D), torch.bfloat16, dev)
    block_bytes = L * 2 * bs * H * D * 2
    cd = torch.empty(n_max * block_bytes, dtype=torch.uint8, device=dev)
    ch = torch.empty(n_max * block_bytes, dtype=torch.uint8, pin_memory=True)
    cur = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    rng = random.Random(0)
    out = []
    for n in (int(x) for x in args.blocks.split(",")):
        d_ids, h_ids = rng.sample(range(nd), n), rng.sample(range(nh), n)
        nbytes = n * block_bytes
        row = {"blocks": n,
               "contig_h2d": nbytes / _time(lambda: cd[:nbytes].copy_(ch[:nbytes], non_blocking=True), 9) / 1e9,
               "contig_d2h": nbytes / _time(lambda: ch[:nbytes].copy_(cd[:nbytes], non_blocking=True), 9) / 1e9}
        for share in (float(x) for x in args.shares.split(",")):
            k = int(round(n * share))
            bh = torch.tensor(h_ids[:k], dtype=torch.int32)
            bd = torch.tensor(d_ids[:k], dtype=torch.int32)
            h2d_rest = fast.BlockPairs.split(h_ids[k:], d_ids[k:], True, 0)
            d2h_rest = fast.BlockPairs.split(d_ids[k:], h_ids[k:], True, 0)

            def h2d(per_layer: bool):  # type: ignore[no-untyped-def]
                side.wait_stream(cur)
                if not per_layer:                  # all layers by one batch beside the kernels
                    with torch.cuda.stream(side):
                        batch.copy_chunks(host.tensor, kv, bh, bd, load=True)
                for l in range(L):                 # per layer, as gated loads queue them
                    if per_layer:
                        with torch.cuda.stream(side):
                            batch.copy_chunks(host.tensor, kv, bh, bd, load=True, layers=(l,))
                    fast.host_to_device(host.tensor, kv, h2d_rest, None, layer=l)
                cur.wait_stream(side)

            def d2h():
                side.wait_stream(cur)
                with torch.cuda.stream(side):
                    batch.copy_chunks(host.tensor, kv, bh, bd, load=False)
                fast.device_to_host(kv, host.tensor, d2h_rest, None)
                cur.wait_stream(side)
            for name, fn in (("h2d_layers", lambda: h2d(True)), ("h2d_all", lambda: h2d(False)), ("d2h", d2h)):
                gbps = nbytes / _time(fn, 9) / 1e9
                row[f"{name}@{share}"] = round(gbps, 1)
                row[f"{name}@{share}_ratio"] = round(gbps / row["contig_" + name[:3]], 3)
        print(json.dumps(row), flush=True)
        out.append(row)
    host.release()


if __name__ == "__main__":
    main()
