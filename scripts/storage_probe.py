"""Where does a file-pool read spend its time on this host? (kept for re-running on new hosts)

python scripts/storage_probe.py [DIR]: 256 objects of 2 MiB; GB/s of whole-object reads, readv into
(header, payload), pread of the header then the payload, and whole reads + xxh3, at 8 and 16 threads."""
from __future__ import annotations

import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import xxhash

root = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
N, SIZE = 256, 2 << 20
data = np.random.default_rng(0).integers(0, 256, SIZE, dtype=np.uint8)
paths = [os.path.join(root, f"o{i}") for i in range(N)]
for p in paths:
    with open(p, "wb") as f:
        f.write(data)
dst = np.ones((N, SIZE), np.uint8)
hdr = np.ones((N, 128), np.uint8)


def whole(i):
    with open(paths[i], "rb", buffering=0) as f:
        f.readinto(memoryview(dst[i]))


def readv2(i):
    fd = os.open(paths[i], os.O_RDONLY)
    os.readv(fd, [memoryview(hdr[i]), memoryview(dst[i])[128:]])
    os.close(fd)


def pread2(i):
    fd = os.open(paths[i], os.O_RDONLY)
    os.preadv(fd, [memoryview(hdr[i])], 0)
    os.preadv(fd, [memoryview(dst[i])[128:]], 128)
    os.close(fd)


def whole_hash(i):
    whole(i)
    xxhash.xxh3_64_intdigest(memoryview(dst[i]))


for threads in (8, 16):
    with ThreadPoolExecutor(threads) as pool:
        for name, fn in (("whole", whole), ("readv2", readv2), ("pread2", pread2), ("whole+xxh3", whole_hash)):
            best = 0.0
            for _ in range(3):
                t0 = time.perf_counter()
                list(pool.map(fn, range(N)))
                best = max(best, N * SIZE / (time.perf_counter() - t0) / 1e9)
            print(f"threads {threads:>2} {name:<11} {best:6.2f} GB/s", flush=True)
