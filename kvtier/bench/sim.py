"""``kvtier sim TRACE``: replay a request trace through the real CacheManager (no model).

Each request, in timestamp order: match its prefix (hits are counted per tier from this first
match), fetch storage hits into host blocks, admit (loads host hits), "prefill" the rest,
commit, and run the step's copies to completion. At most ``max_running`` requests hold their
blocks at once; the oldest finishes first, and a request that does not fit finishes older ones.
Decode tokens are not simulated (prompt KV only): a trace's next turn carries the previous
answer inside its own prompt.

Every tier size may be ``inf`` (unbounded: sized to the trace's total blocks). Storage hits are
fetched only when the fetch-vs-recompute cost model says they pay, with a pool of
``storage_gbps`` / ``storage_latency_ms`` per call against a prefill rate of
``prefill_tokens_per_s`` (0: fetch every hit); the decisions are reported.

The cyclic garbage collector is paused during the replay: the manager frees its objects by
reference counting (removed nodes form no cycles), and a full collection over a tree whose
nodes churn by the million cost a third of the wall time.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from collections import deque
from dataclasses import dataclass

from kvtier import flags
from kvtier.bench.traces import TraceRequest, read_trace
from kvtier.cache import CacheManager, SimulatedStorage
from kvtier.cache.cost import FetchCostModel
from kvtier.cache.policy import EVICTION_POLICIES, WRITE_POLICIES

TIERS = ("device", "host", "storage")


@dataclass
class SimConfig:
    block_size: int = 16
    device_blocks: int | float = 8192
    host_blocks: int | float = 32768
    storage_blocks: int | float = 0
    write_policy: str = "write_through_selective"
    write_through_threshold: int = 2
    eviction: str = "lru"
    hash_name: str = "sha256"
    kv_bytes_per_token: int = 131072  # 128 KiB: e.g. 32 layers x 8 KV heads x 128 dims x 2 (K,V) x bf16
    max_running: int = 16
    storage_gbps: float = 2.0  # storage read bandwidth of one call (GB/s)
    storage_latency_ms: float = 0.5  # per call
    prefill_tokens_per_s: float = 0.0  # recompute rate; 0: fetch every storage hit


def _tier_size(size: int | float, trace: list[TraceRequest], block_size: int) -> int:
    """``inf`` -> every block the trace could ever hold (each request's blocks, all distinct)."""
    if size != math.inf:
        return int(size)
    return max(1, sum(-(-len(tr.input_ids) // block_size) for tr in trace))


def simulate(trace: list[TraceRequest], cfg: SimConfig, progress: bool = False) -> dict:
    storage = None if cfg.storage_blocks == 0 else SimulatedStorage(cfg.storage_blocks)
    block_nbytes = cfg.kv_bytes_per_token * cfg.block_size
    cost = None
    if storage is not None and cfg.prefill_tokens_per_s > 0:
        cost = FetchCostModel(
            "sim",
            workers=1,
            batch=1 << 30,
            block_nbytes=block_nbytes,
            block_size=cfg.block_size,
            prior=(cfg.storage_latency_ms / 1e3, cfg.storage_gbps * 1e9),
        )
        cost.observe_prefill(int(cfg.prefill_tokens_per_s), 1.0)
    mgr = CacheManager(
        block_size=cfg.block_size,
        num_device_blocks=_tier_size(cfg.device_blocks, trace, cfg.block_size),
        num_host_blocks=_tier_size(cfg.host_blocks, trace, cfg.block_size),
        storage=storage,
        write_policy=cfg.write_policy,
        write_through_threshold=cfg.write_through_threshold,
        eviction=cfg.eviction,
        hash_name=cfg.hash_name,
        block_nbytes=block_nbytes,
        fetch_cost=cost,
    )
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(trace), unit="req", file=sys.stderr, mininterval=0.5)
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _replay(trace, cfg, mgr, storage, bar)
    finally:
        if gc_was_enabled:
            gc.enable()


def _replay(trace: list[TraceRequest], cfg: SimConfig, mgr: CacheManager, storage: SimulatedStorage | None, bar) -> dict:
    hits = dict.fromkeys(TIERS, 0)
    prompt_tokens = skipped = 0
    running: deque = deque()

    def step() -> None:
        while plan := mgr.take_plan():
            mgr.complete_plan(plan)

    t0 = time.perf_counter()
    for i, tr in enumerate(trace):
        if bar is not None:
            bar.update(1)
        tokens = tr.input_ids
        prompt_tokens += len(tokens)
        while len(running) >= cfg.max_running:
            mgr.free(running.popleft())
        req = mgr.new_request(i, tokens)
        m = mgr.match_prefix(req)
        hits["device"] += m.num_device_blocks * cfg.block_size
        hits["host"] += m.num_host_blocks * cfg.block_size
        if m.num_storage_blocks:
            fetched = mgr.prefetch(req)  # as many as pay (all without a cost model) and fit
            hits["storage"] += fetched * cfg.block_size
            if fetched:
                step()
                m = mgr.match_prefix(req)
        while not mgr.allocate(req, len(tokens)):
            if not running:
                break
            mgr.free(running.popleft())
            step()
        else:
            step()  # loads land, then the prefill ran
            mgr.commit(req, len(tokens))
            step()  # backups / puts of the new blocks
            running.append(req)
            continue
        skipped += 1  # larger than the whole device tier
        mgr.free(req)
    while running:
        mgr.free(running.popleft())
    step()
    if bar is not None:
        bar.close()
    evictions = dict(mgr.stats.evictions)
    evictions["storage"] = storage.evictions if storage is not None else 0
    return {
        "requests": len(trace),
        "prompt_tokens": prompt_tokens,
        "hit_tokens": hits,
        "hit_rate": {t: (hits[t] / prompt_tokens if prompt_tokens else 0.0) for t in TIERS},
        "evictions": evictions,
        "bytes_moved": dict(mgr.stats.bytes_moved),
        "skipped_requests": skipped,
        "failures": dict(mgr.stats.failures),
        "fetch_decisions": dict(mgr.fetch_cost.decisions) if mgr.fetch_cost is not None else None,
        "wall_s": round(time.perf_counter() - t0, 3),
        "config": {k: (str(v) if isinstance(v, float) and math.isinf(v) else v) for k, v in vars(cfg).items()},
    }


def format_report(res: dict) -> str:
    lines = [
        f"requests {res['requests']}  prompt tokens {res['prompt_tokens']:,}  "
        f"skipped {res['skipped_requests']}  wall {res['wall_s']:.1f}s"
    ]
    lines.append(f"{'tier':<8} {'hit tokens':>14} {'hit rate':>9} {'evictions':>11}")
    for t in TIERS:
        lines.append(f"{t:<8} {res['hit_tokens'][t]:>14,} {res['hit_rate'][t]:>9.3f} {res['evictions'][t]:>11,}")
    total = sum(res["hit_tokens"].values())
    lines.append(f"{'all':<8} {total:>14,} {total / max(1, res['prompt_tokens']):>9.3f}")
    lines.append("bytes moved: " + ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in res["bytes_moved"].items()))
    if res.get("fetch_decisions"):
        lines.append("storage fetch decisions: " + ", ".join(f"{k} {v:,}" for k, v in res["fetch_decisions"].items()))
    return "\n".join(lines)


def add_cache_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--block-size", type=flags.block_size, default=16, help="tokens per KV block (power of two; default 16)")
    p.add_argument(
        "--write-policy",
        choices=WRITE_POLICIES,
        default="write_through_selective",
        help="when blocks are copied down a tier (default write_through_selective)",
    )
    p.add_argument(
        "--write-through-threshold",
        type=flags.positive_int,
        default=2,
        help="hits before write_through_selective copies a block down (default 2)",
    )
    p.add_argument("--eviction", choices=sorted(EVICTION_POLICIES), default="lru", help="eviction order (default lru)")
    p.add_argument("--hash", choices=("sha256", "xxh3_128"), default="sha256", help="block key digest (default sha256)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvtier sim",
        description="Replay a JSONL trace through the real CacheManager and print hits, evictions and bytes moved per tier.",
    )
    p.add_argument(
        "trace",
        help="JSONL trace: {timestamp, input_ids, output_length} or the Mooncake "
        "format {timestamp, input_length, output_length, hash_ids}",
    )
    add_cache_flags(p)
    p.add_argument(
        "--device-blocks", type=flags.tier_blocks, default=8192, help="device tier size in blocks; inf = unbounded (default 8192)"
    )
    p.add_argument(
        "--host-blocks",
        type=flags.capacity,
        default=32768,
        help="host tier size in blocks; 0 = no host tier, inf = unbounded (default 32768)",
    )
    p.add_argument(
        "--storage-blocks",
        type=flags.capacity,
        default=0,
        help="storage tier size in blocks; 0 = none, inf = unbounded (default 0)",
    )
    p.add_argument(
        "--trace-block-tokens",
        type=flags.positive_int,
        default=512,
        help="tokens per hash id in Mooncake-format traces (default 512)",
    )
    p.add_argument(
        "--kv-bytes-per-token",
        type=flags.positive_int,
        default=131072,
        help="KV bytes per token, all layers, for bytes moved (default 131072)",
    )
    p.add_argument("--max-running", type=flags.positive_int, default=16, help="requests holding blocks at once (default 16)")
    p.add_argument(
        "--storage-gbps",
        type=flags.positive_float,
        default=2.0,
        help="storage read bandwidth per call, GB/s, for the fetch-vs-recompute decision (default 2.0)",
    )
    p.add_argument(
        "--storage-latency-ms", type=flags.non_negative_float, default=0.5, help="storage latency per call, ms (default 0.5)"
    )
    p.add_argument(
        "--prefill-tokens-per-s",
        type=flags.non_negative_float,
        default=0.0,
        help="recompute rate; storage hits are fetched only when that is faster than "
        "recomputing them at this rate; 0 = fetch every hit (default 0)",
    )
    p.add_argument("--limit", type=flags.positive_int, default=None, help="replay only the first N requests")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--progress", action="store_true", help="show a progress bar even when stderr is not a terminal")

    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    trace = read_trace(args.trace, block_tokens=args.trace_block_tokens, limit=args.limit)
    cfg = SimConfig(
        block_size=args.block_size,
        device_blocks=args.device_blocks,
        host_blocks=args.host_blocks,
        storage_blocks=args.storage_blocks,
        write_policy=args.write_policy,
        write_through_threshold=args.write_through_threshold,
        eviction=args.eviction,
        hash_name=args.hash,
        kv_bytes_per_token=args.kv_bytes_per_token,
        max_running=args.max_running,
        storage_gbps=args.storage_gbps,
        storage_latency_ms=args.storage_latency_ms,
        prefill_tokens_per_s=args.prefill_tokens_per_s,
    )
    res = simulate(trace, cfg, progress=not args.json and sys.stderr.isatty() or args.progress)
    print(json.dumps(res) if args.json else format_report(res))
    return 0
