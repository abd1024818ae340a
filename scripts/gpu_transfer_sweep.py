"""Tune kernels.TUNING on the GPU: GB/s of the fast copy ops for a few settings (256 random blocks)."""
import itertools
import random
import statistics

import torch

from kvtier.transfer import kernels as fast
from kvtier.transfer.host_pool import HostKV

L, H, D, bs, n = 32, 8, 128, 16, 256
buf = torch.randn((L, 2, n + 8, bs, H, D), device="cuda").to(torch.bfloat16)
kv = list(buf.unbind(0))
host = HostKV((n + 8, L, 2, bs, H, D), torch.bfloat16, torch.device("cuda"))
rng = random.Random(0)
dev, hst = rng.sample(range(n + 8), n), rng.sample(range(n + 8), n)
dev, hst = (torch.tensor(x, dtype=torch.int32, pin_memory=True) for x in (dev, hst))
nbytes = n * L * 2 * bs * H * D * 2


def t(fn):
    fn(); torch.cuda.synchronize()
    ts = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b) / 1e3)
    return nbytes / statistics.median(ts) / 1e9


for block, part, warps, progs in itertools.product((1024, 2048), (4096, 8192), (1, 4), (16, 32, 64, 132, 264, 1 << 20)):
    if part < block:
        continue
    fast.TUNING.update(block=block, part=part, num_warps=warps, max_programs=progs)
    d2h = t(lambda: fast.device_to_host(kv, host.tensor, dev, hst))
    h2d = t(lambda: [fast.host_to_device(host.tensor, kv, hst, dev, layer=l) for l in range(L)])
    print(f"block={block:5d} part={part:5d} warps={warps} programs={progs:7d}: d2h {d2h:6.1f} GB/s  h2d {h2d:6.1f} GB/s", flush=True)
