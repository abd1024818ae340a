"""``kvtier bench storage``: the storage tier against its own backends and against recompute.

1. **Bytes** (any machine): for each pool URL, put then get ``--objects`` objects of one KV block's
   size through kvtier (StorageClient: blobs with header and checksum, staging, worker threads,
   from/into host blocks) and through the backend's raw client (the same library, bytes in and
   out, the same number of threads and objects per call), in the same run. Reported: GB/s of both
   and kvtier / raw (goal >= 0.8).
2. **TTFT** (``--ttft``; the 8B shape on a GPU, a small preset on CPU): a writer engine stores a
   ``--prompt-tokens`` prompt in the pool; a fresh reader engine serves it from storage (storage
   -> host -> device, layer-overlapped), and recomputes it (another cache_salt: no hit on any tier).
   Reported: TTFT from storage / recompute (goal <= 0.5), and against a deliberately slow pool
   (``throttle=``): with the cost model (``storage_fetch=auto``, goal <= 1.0: it recomputes) and
   without (``always``: what happens to a system with no cost model).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np

from kvtier.cache.plan import TransferOp
from kvtier.engine.config import EngineConfig
from kvtier.flags import add_json_flag, write_json
from kvtier.storage import StorageClient, open_backend
from kvtier.storage.blob import HEADER_NBYTES, BlobLayout, namespace_digest
from kvtier.storage.client import default_storage_workers, start_pool_threads


# ---------------------------------------------------------------------- raw clients (the baseline)
class _RawFile:
    def __init__(self, url: str) -> None:
        self.root = Path(urlparse(url).path) / "raw-baseline"
        self.root.mkdir(parents=True, exist_ok=True)

    def put(self, names, values) -> None:
        for n, v in zip(names, values):
            tmp = self.root / f".{n}.tmp"
            with open(tmp, "wb") as f:
                f.write(v)
            os.replace(tmp, self.root / n)

    def get(self, names, bufs) -> None:
        for n, b in zip(names, bufs):
            with open(self.root / n, "rb", buffering=0) as f:
                f.readinto(b)

    def delete(self, names) -> None:
        for n in names:
            (self.root / n).unlink(missing_ok=True)

    def close(self) -> None:
        pass


class _RawRedis:
    def __init__(self, url: str) -> None:
        import redis

        p = urlparse(url)
        if p.scheme == "redis+cluster":
            from redis.cluster import ClusterNode, RedisCluster

            nodes = [ClusterNode(h.rsplit(":", 1)[0], int(h.rsplit(":", 1)[1])) for h in p.netloc.split("@")[-1].split(",")]
            self.r: redis.Redis | RedisCluster = RedisCluster(startup_nodes=nodes, password=p.password)
        else:
            self.r = redis.Redis.from_url(url.split("?")[0])

    def put(self, names, values) -> None:
        pipe = self.r.pipeline(transaction=False)
        for n, v in zip(names, values):
            pipe.set(n, v)
        pipe.execute()

    def get(self, names, bufs) -> None:
        pipe = self.r.pipeline(transaction=False)
        for n in names:
            pipe.get(n)
        for b, v in zip(bufs, pipe.execute()):
            b[: len(v)] = v

    def delete(self, names) -> None:
        pipe = self.r.pipeline(transaction=False)
        for n in names:
            pipe.delete(n)
        pipe.execute()

    def close(self) -> None:
        self.r.close()


class _RawMooncake:
    """MooncakeDistributedStore itself, set up as the backend would (no segment, TCP)."""

    def __init__(self, url: str) -> None:
        from kvtier.storage.mooncake import MooncakeBackend

        self.backend = MooncakeBackend.from_url(url)
        b = self.backend
        self.store = b._Store()
        if self.store.setup(b.local_hostname, b.metadata, 0, 256 << 20, b.protocol, b.rdma_devices, b.master) != 0:
            raise RuntimeError(f"raw Mooncake client setup failed for {url}")

    def put(self, names, values) -> None:
        self.store.put_batch(list(names), [bytes(v) for v in values])

    def get(self, names, bufs) -> None:
        for b, v in zip(bufs, self.store.get_batch(list(names))):
            b[: len(v)] = v

    def delete(self, names) -> None:
        for n in names:
            self.store.remove(n)  # (a lease may keep it a while: the pool evicts it)

    def close(self) -> None:
        self.store.close()
        self.backend.close()


def _raw_client(url: str):
    scheme = urlparse(url).scheme
    if scheme == "file":
        return _RawFile(url)
    if scheme in ("redis", "rediss", "redis+cluster"):
        return _RawRedis(url)
    if scheme == "mooncake":
        return _RawMooncake(url)
    return None


# ---------------------------------------------------------------------- part 1: bytes
def bench_bytes(url: str, objects: int, object_bytes: int, workers: int, batch: int, repeat: int) -> dict:
    kv_nbytes = object_bytes - HEADER_NBYTES
    layout = BlobLayout(namespace_digest("bench", str(time.time_ns()).encode()), "uint8", (kv_nbytes,), 16, kv_nbytes)
    rng = np.random.default_rng(0)
    host = np.zeros((2 * objects, kv_nbytes), np.uint8)  # host blocks: [sources | destinations]
    host[:objects] = rng.integers(0, 256, (objects, kv_nbytes), dtype=np.uint8)
    keys = [os.urandom(32) for _ in range(objects)]

    def kvtier_round(op_base: int) -> tuple[float, float]:
        keys = [os.urandom(32) for _ in range(objects)]  # fresh: never a no-op put of an old name
        client = StorageClient(open_backend(url), "bench", workers=workers, batch=batch, put_workers=workers)
        client.bind(layout, host.__getitem__)
        client.start_threads()  # as a serving engine's are: not timed
        host[objects:] = 0
        t0 = time.perf_counter()
        client.submit(TransferOp(op_base, "put", tuple(range(objects)), (), tuple(keys)))
        (put,) = client.drain()
        t1 = time.perf_counter()
        client.submit(TransferOp(op_base + 1, "fetch", (), tuple(range(objects, 2 * objects)), tuple(keys)))
        (get,) = client.drain()
        t2 = time.perf_counter()
        if put[1] or get[1]:
            raise RuntimeError(f"{url}: {len(put[1])} puts and {len(get[1])} gets failed")
        client.backend.delete([client.name(k) for k in keys])
        client.close()
        return t1 - t0, t2 - t1

    # the raw client's buffers, touched once (like kvtier's host blocks): no page faults timed
    # as many distinct source buffers as kvtier reads host blocks from (no cache-hot advantage)
    source = rng.integers(0, 256, (objects, object_bytes), dtype=np.uint8)
    values = [memoryview(source[i]) for i in range(objects)]
    bufs = [np.ones(object_bytes, np.uint8).data for _ in range(objects)]

    def raw_round(r: int) -> tuple[float, float]:
        raw = _raw_client(url)
        names = [f"kvt:raw{r}:{k.hex()}" for k in keys]  # fresh names: a put of an existing
        # name can be a no-op (Mooncake keeps the first value), which would flatter the baseline
        chunks = [range(s, min(objects, s + batch)) for s in range(0, objects, batch)]
        with ThreadPoolExecutor(workers) as pool:
            start_pool_threads(pool, workers)  # its threads started, like kvtier's
            t0 = time.perf_counter()
            list(pool.map(lambda c: raw.put([names[i] for i in c], [values[i] for i in c]), chunks))
            t1 = time.perf_counter()
            list(pool.map(lambda c: raw.get([names[i] for i in c], [bufs[i] for i in c]), chunks))
            t2 = time.perf_counter()
        raw.delete(names)
        raw.close()
        return t1 - t0, t2 - t1

    kvtier_round(0)  # warm-up (connections, page cache, allocations)
    ours, theirs = [], []
    has_raw = urlparse(url).scheme in ("file", "redis", "rediss", "redis+cluster", "mooncake")
    for r in range(repeat):  # alternate, so drift hits both alike
        ours.append(kvtier_round(2 * r + 2))
        if has_raw:
            theirs.append(raw_round(r))
    if not np.array_equal(host[objects:], host[:objects]):
        raise AssertionError(f"{url}: bytes read back differ from bytes written")
    nbytes = objects * object_bytes
    res: dict[str, Any] = {
        "url": url.split("@")[-1],
        "objects": objects,
        "object_bytes": object_bytes,
        "kvtier_put_gbps": nbytes / statistics.median(t[0] for t in ours) / 1e9,
        "kvtier_get_gbps": nbytes / statistics.median(t[1] for t in ours) / 1e9,
    }
    if theirs:
        res["raw_put_gbps"] = nbytes / statistics.median(t[0] for t in theirs) / 1e9
        res["raw_get_gbps"] = nbytes / statistics.median(t[1] for t in theirs) / 1e9
        res["put_ratio"] = res["kvtier_put_gbps"] / res["raw_put_gbps"]
        res["get_ratio"] = res["kvtier_get_gbps"] / res["raw_get_gbps"]
    return res


# ---------------------------------------------------------------------- part 2: TTFT
def bench_ttft(
    model: str,
    device: str,
    load_format: str,
    pool_url: str,
    slow_throttle: str,
    prompt_tokens: int,
    repeat: int,
    num_host_blocks: int,
    workers: int,
    early_loads: str = "on",
) -> dict:
    import torch

    import kvtier
    from kvtier.model import ModelConfig

    cfg = ModelConfig.from_hf_dir(Path(model))
    vocab = cfg.vocab_size
    if prompt_tokens + 16 > cfg.max_position_embeddings:
        raise ValueError(
            f"--prompt-tokens {prompt_tokens} does not fit the model's context ({cfg.max_position_embeddings} positions)"
        )
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, vocab, prompt_tokens).tolist()
    warm = rng.integers(0, vocab, min(prompt_tokens, 2048)).tolist()
    # the reader copies down only what was hit twice (write_through_selective, not the default
    # write_through with a pool): its recompute runs do not back up or put anything, which would
    # pin host blocks and take the pool's bandwidth from the storage hits being timed
    kw = dict(
        device=device,
        load_format=load_format,
        num_host_blocks=num_host_blocks,
        max_model_len=prompt_tokens + 64,
        max_num_seqs=8,
        max_num_batched_tokens=4096,
        storage_workers=workers,
    )
    one = kvtier.SamplingParams(max_tokens=1, ignore_eos=True)

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    def ttft(llm, salt):
        sync()
        t0 = time.perf_counter()
        o = llm.generate([prompt], one, cache_salt=salt)[0]
        sync()
        return time.perf_counter() - t0, o

    salts = [f"run{r}" for r in range(repeat)]
    res: dict = {"prompt_tokens": prompt_tokens}
    early = early_loads != "off"
    # (row, fetch policy, its variants: (name, early_loads)); "both": the storage row's hits
    # alternate with the same hits loaded only once the whole prompt landed, in one engine
    variants = [("storage", True), ("storage_late_loads", False)] if early_loads == "both" else [("storage", early)]
    rows = [
        ("storage", "auto", variants),
        ("slow_auto", "auto", [("slow_auto", early)]),
        ("slow_always", "always", [("slow_always", early)]),
    ]
    for name, fetch, variants in rows:
        url, rate = pool_url, None
        if name.startswith("slow"):  # the same pool, slowed: "auto" = fetching the prompt takes 4x recompute
            rate = slow_throttle
            if rate == "auto":
                kv_bytes = prompt_tokens * res["kv_bytes_per_token"]
                rate = str(int(kv_bytes / (4 * res["storage"]["recompute_ttft_s"])))
            url = f"{pool_url}{'&' if '?' in pool_url else '?'}throttle={rate}"
        with kvtier.LLM(model, storage=pool_url, write_policy="write_through", **kw) as writer:
            res["kv_bytes_per_token"] = writer.cache.block_nbytes // writer.block_size
            for salt in [*salts, "warm"]:  # one copy of the prompt per repeat (distinct keys)
                for vname, _ in variants:
                    writer.generate([prompt], one, cache_salt=f"{vname}-{salt}")
        with kvtier.LLM(
            model, storage=url, storage_fetch=fetch, early_loads=early, write_policy="write_through_selective", **kw
        ) as llm:
            # warm-up: compile every kernel shape the timed runs use (a full prefill, and a short
            # prefill over a long cached prefix), measure the prefill rate
            llm.generate([warm], one, cache_salt="warm")
            llm.generate([prompt], one, cache_salt=f"warm-cold-{name}")
            for vname, vearly in variants:
                llm.cache.early_loads = vearly
                llm.generate([prompt], one, cache_salt=f"{vname}-warm")
            cold: list[float] = []
            runs: dict[str, dict] = {v: {"hits": [], "tiers": [], "phases": [], "equal": True} for v, _ in variants}
            for salt in salts:
                t_cold, o_cold = ttft(llm, f"cold-{name}-{salt}")  # nothing cached: recompute
                cold.append(t_cold)
                for vname, vearly in variants:
                    llm.cache.early_loads = vearly
                    t_hit, o_hit = ttft(llm, f"{vname}-{salt}")  # its blocks are in storage only
                    run = runs[vname]
                    run["hits"].append(t_hit)
                    run["tiers"].append(o_hit.cached_tokens_by_tier)
                    m = o_hit.metrics
                    run["phases"].append(
                        {
                            "storage_tokens": o_hit.cached_tokens_by_tier["storage"],
                            "to_admission_s": m["admitted"] - m["arrival"],
                            "fetch_wait_s": m["admitted"] - m.get("prefetch_start", m["admitted"]),
                            "admission_to_token_s": m["first_token"] - m["admitted"],
                        }
                    )
                    run["equal"] &= o_hit.token_ids == o_cold.token_ids
            stats = llm.cache_stats()["storage"]
        for vname, vearly in variants:
            run = runs[vname]
            res[vname] = {
                "url": pool_url,
                "throttle": rate,
                "storage_fetch": fetch,
                "early_loads": vearly,
                "ttft_s": statistics.median(run["hits"]),
                "recompute_ttft_s": statistics.median(cold),
                "ratio": statistics.median(run["hits"]) / statistics.median(cold),
                "cached_tokens_by_tier": run["tiers"][-1],
                "outputs_equal": run["equal"],
                "phases": run["phases"],
                "ttft_all_s": run["hits"],
                "recompute_all_s": cold,
                "fetch_cost": stats.get("fetch_cost"),
                "read_gbps": stats.get("read_gbps"),
            }
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="kvtier bench storage", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--url", action="append", default=None, help="pool URL to measure (repeatable; default: file:// in a temporary directory)"
    )
    ap.add_argument("--objects", type=int, default=256, help="objects per round (default 256)")
    ap.add_argument(
        "--object-mib", type=float, default=2.0, help="object size in MiB (default 2: one 16-token block of Llama-3-8B KV)"
    )
    ap.add_argument(
        "--workers",
        type=int,
        default=default_storage_workers(),
        help="I/O threads, both sides (default: one per core, 2 to 16, as the engine)",
    )
    ap.add_argument("--batch", type=int, default=16, help="objects per call, both sides (default 16)")
    ap.add_argument("--repeat", type=int, default=3, help="timed rounds; medians reported (default 3)")
    ap.add_argument("--ttft", action="store_true", help="also measure TTFT from storage vs recompute")
    ap.add_argument(
        "--model",
        default=None,
        help="model directory for --ttft (default: llama3-8b-shape with dummy weights on cuda, llama-tiny on cpu)",
    )
    # the --ttft engines' device: the GPU when there is one
    EngineConfig.add_flags(ap, only=("device",), defaults={"device": None}, shown={"device": "cuda when available"})
    ap.add_argument("--prompt-tokens", type=int, default=None, help="--ttft prompt length (default 8192 cuda, 448 cpu)")
    ap.add_argument(
        "--slow-throttle",
        default="auto",
        help="rate of the deliberately slow pool for --ttft, e.g. 200MB (per second); auto: the "
        "rate at which fetching the prompt takes 4x its recompute time (default auto)",
    )
    ap.add_argument(
        "--early-loads",
        choices=("on", "off", "both"),
        default="on",
        help="--ttft: the reader engine's early_loads (storage hits go on to the device chunk by "
        "chunk as they land); both: also a row with them off, same pool and prompt (default on)",
    )
    add_json_flag(ap, "the result")
    args = ap.parse_args(argv)
    for name in ("objects", "workers", "batch", "repeat"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.object_mib <= 0:
        ap.error(f"--object-mib must be > 0, got {args.object_mib}")

    tmp = tempfile.TemporaryDirectory(prefix="kvtier-bench-storage-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    urls = args.url or [f"file://{tmp.name}/pool"]
    object_bytes = int(args.object_mib * (1 << 20))
    result: dict = {"bytes": []}
    for url in urls:
        r = bench_bytes(url, args.objects, object_bytes, args.workers, args.batch, args.repeat)
        result["bytes"].append(r)
        if args.json != "-":
            line = f"{r['url']:<40} kvtier put {r['kvtier_put_gbps']:.2f} get {r['kvtier_get_gbps']:.2f} GB/s"
            if "raw_put_gbps" in r:
                line += (
                    f" | raw put {r['raw_put_gbps']:.2f} get {r['raw_get_gbps']:.2f} GB/s"
                    f" | ratio put {r['put_ratio']:.2f} get {r['get_ratio']:.2f}"
                )
            print(line, flush=True)
    if args.ttft:
        import torch

        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        model, load_format = args.model, "auto"
        if model is None:
            from kvtier.model import init_model

            model = os.path.join(tmp.name, "model")
            if device.startswith("cuda"):
                init_model("llama3-8b-shape", model, config_only=True)
                load_format = "dummy"
            else:
                init_model("llama-tiny", model)
        prompt_tokens = args.prompt_tokens or (8192 if device.startswith("cuda") else 448)
        pool = f"file://{tmp.name}/ttft-pool"
        res = bench_ttft(
            model,
            device,
            load_format,
            pool,
            args.slow_throttle,
            prompt_tokens,
            args.repeat,
            -(-prompt_tokens // 16) + 64,
            args.workers,
            args.early_loads,
        )
        result["ttft"] = res
        if args.json != "-":
            for name in ("storage", "storage_late_loads", "slow_auto", "slow_always"):
                run = res.get(name)
                if run is None:
                    continue
                wait = statistics.median(p["fetch_wait_s"] for p in run["phases"])
                after = statistics.median(p["admission_to_token_s"] for p in run["phases"])
                print(
                    f"TTFT {name:<18} ({run['storage_fetch']:>6}): {run['ttft_s'] * 1e3:8.1f} ms vs recompute "
                    f"{run['recompute_ttft_s'] * 1e3:8.1f} ms = {run['ratio']:.2f}  (fetch wait {wait * 1e3:.1f} ms, "
                    f"then {after * 1e3:.1f} ms)  hits {run['cached_tokens_by_tier']}"
                    f"  outputs equal: {run['outputs_equal']}",
                    flush=True,
                )
    write_json(args.json, result)
    tmp.cleanup()
    return 0
