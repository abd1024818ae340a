"""Tune the staged path (kernels.HostRuns) on the GPU: GB/s of a copy of every layer through the
staging buffer, against a contiguous pinned copy of the same bytes, for a few kernel settings and
staging sizes (Llama-3-8B KV shape, 256 blocks, consecutive and random host/device blocks).

    python scripts/gpu_staged_sweep.py
"""
import itertools
import random

import torch

from kvtier.bench.transfer_bench import _time
from kvtier.transfer import kernels as fast
from kvtier.transfer.host_pool import HostKV

L, H, D, bs, n = 32, 8, 128, 16, 256
buf = torch.randn((L, 2, n + 8, bs, H, D), device="cuda").to(torch.bfloat16)
kv = list(buf.unbind(0))
host = HostKV((n + 8, L, 2, bs, H, D), torch.bfloat16, torch.device("cuda"))
nbytes = n * L * 2 * bs * H * D * 2
cdev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
chost = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def t(fn):  # type: ignore[no-untyped-def]
    return nbytes / _time(fn, 7) / 1e9


h2d_c = t(lambda: cdev.copy_(chost, non_blocking=True))
d2h_c = t(lambda: chost.copy_(cdev, non_blocking=True))
print(f"contiguous: h2d {h2d_c:.1f} GB/s, d2h {d2h_c:.1f} GB/s", flush=True)
rng = random.Random(0)
for pattern in ("consecutive", "random"):
    if pattern == "consecutive":
        dev, hst = list(range(3, 3 + n)), list(range(5, 5 + n))
    else:
        dev, hst = rng.sample(range(n + 8), n), rng.sample(range(n + 8), n)
    pairs = fast.host_runs(host.tensor, kv, hst, dev)
    for progs, warps, staging in itertools.product((264, 1056, 4224), (1, 4, 8), (32 << 20, 64 << 20, 256 << 20)):
        fast.TUNING.update(staged_programs=progs, staged_warps=warps, staging_bytes=staging)
        h2d = t(lambda: fast.host_to_device(host.tensor, kv, pairs, None))
        d2h = t(lambda: fast.device_to_host(kv, host.tensor, pairs, None))
        print(f"{pattern:11s} programs={progs:5d} warps={warps} staging={staging >> 20:4d} MiB: "
              f"h2d {h2d:6.1f} GB/s ({h2d / h2d_c:.2f}) d2h {d2h:6.1f} GB/s ({d2h / d2h_c:.2f})", flush=True)
host.release()
