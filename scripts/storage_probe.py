"""Where does a file-pool read spend its time on this host? (kept for re-running on new hosts)

python scripts/storage_probe.py [DIR]: 256 objects of 2 MiB read by 8 and 16 threads, in batches
of 16 objects per task (as the storage client reads them), GB/s of each step added in turn:

  whole        open, readinto one buffer, close (the raw baseline of ``kvtier bench storage``)
  whole+xxh3   the same, then xxh3-64 over the buffer
  readv3       os.open, one readv into (header, payload, 1-byte sentinel), os.close (the backend's calls)
  readv3+xxh3  the same, then xxh3-64 over the payload
  chunkN       the header, then the payload in reads of N bytes, each hashed right after it
  backend      FileBackend.get_into_parts (paths, views, readv, LRU bookkeeping), one call per batch
  backend+chk  the same, then BlobLayout.check_parts of each object (header fields + xxh3)
  client       StorageClient fetch ops (slots, breaker, counters, busy-period bookkeeping)
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import xxhash

from kvtier.cache.plan import TransferOp
from kvtier.storage import StorageClient
from kvtier.storage.blob import HEADER_NBYTES, BlobLayout, BlobStatus, namespace_digest
from kvtier.storage.client import start_pool_threads
from kvtier.storage.file import FileBackend

root = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
N, SIZE, BATCH = 256, 2 << 20, 16
KV = SIZE - HEADER_NBYTES
layout = BlobLayout(namespace_digest("probe", b"x"), "uint8", (KV,), 16, KV)
src = np.random.default_rng(0).integers(0, 256, (N, KV), dtype=np.uint8)
keys = [os.urandom(32) for _ in range(N)]
backend = FileBackend(root)
writer = StorageClient(backend, "probe", workers=4)
writer.bind(layout, src.__getitem__)
writer.submit(TransferOp(0, "put", tuple(range(N)), (), tuple(keys)))
assert not writer.drain()[0][1]
names = [writer.name(k) for k in keys]
paths = [backend._path(n) for n in names]
dst = np.ones((N, KV), np.uint8)
whole_buf = np.ones((N, SIZE), np.uint8)
hdr = np.ones((N, HEADER_NBYTES), np.uint8)
batches = [range(s, s + BATCH) for s in range(0, N, BATCH)]


def whole(b, hash_it=False):
    for i in b:
        with open(paths[i], "rb", buffering=0) as f:
            f.readinto(memoryview(whole_buf[i]))
        if hash_it:
            xxhash.xxh3_64_intdigest(memoryview(whole_buf[i]))


def readv3(b, hash_it=False):
    for i in b:
        fd = os.open(paths[i], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        os.readv(fd, [memoryview(hdr[i]), memoryview(dst[i]), memoryview(bytearray(1))])
        os.close(fd)
        if hash_it:
            xxhash.xxh3_64_intdigest(memoryview(dst[i]))


def chunked(b, chunk):
    """readv the header, then the payload chunk by chunk, each hashed right after its read (while
    it is in the core's cache)."""
    for i in b:
        fd = os.open(paths[i], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        os.readv(fd, [memoryview(hdr[i])])
        h, view = xxhash.xxh3_64(), memoryview(dst[i])
        for off in range(0, KV, chunk):
            part = view[off:off + chunk]
            os.readv(fd, [part])
            h.update(part)
        os.close(fd)
        h.intdigest()


def via_backend(b, check=False):
    sizes = backend.get_into_parts([names[i] for i in b], [[memoryview(hdr[i]), memoryview(dst[i])] for i in b])
    if check:
        for i, size in zip(b, sizes):
            assert layout.check_parts(hdr[i], size, keys[i], dst[i], None) is BlobStatus.OK


variants = [("whole", lambda b: whole(b)), ("whole+xxh3", lambda b: whole(b, True)),
            ("readv3", lambda b: readv3(b)), ("readv3+xxh3", lambda b: readv3(b, True)),
            ("chunk256K", lambda b: chunked(b, 256 << 10)), ("chunk1M", lambda b: chunked(b, 1 << 20)),
            ("backend", lambda b: via_backend(b)), ("backend+chk", lambda b: via_backend(b, True))]
for threads in (8, 16):
    client = StorageClient(backend, "probe", workers=threads, batch=BATCH)
    client.bind(layout, dst.__getitem__)
    client.start_threads()
    with ThreadPoolExecutor(threads) as pool:
        start_pool_threads(pool, threads)
        best = {}
        for rep in range(3):                    # rounds of every variant, so drift hits all alike
            for name, fn in variants:
                t0 = time.perf_counter()
                list(pool.map(fn, batches))
                best[name] = max(best.get(name, 0.0), N * SIZE / (time.perf_counter() - t0) / 1e9)
            t0 = time.perf_counter()
            client.submit(TransferOp(rep + 1, "fetch", (), tuple(range(N)), tuple(keys)))
            assert not client.drain()[0][1]
            best["client"] = max(best.get("client", 0.0), N * SIZE / (time.perf_counter() - t0) / 1e9)
    client.close()
    for name, gbps in best.items():
        print(f"threads {threads:>2} {name:<12} {gbps:6.2f} GB/s", flush=True)
assert np.array_equal(dst, src)
writer.close()
