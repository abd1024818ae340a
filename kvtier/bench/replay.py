"""The replay of a trace through the real CacheManager, one request at a time (no model): what
``kvtier sim`` runs for one instance (bench/sim.py, whose docstring says how) and ``kvtier sim
--instances`` for each instance of a fleet (bench/fleet.py)."""

from __future__ import annotations

import gc
import math
import sys
import time
from collections import deque
from dataclasses import dataclass, field

from kvtier.bench.traces import TraceRequest
from kvtier.cache import CacheManager, SimulatedStorage
from kvtier.cache.cost import FetchCostModel
from kvtier.cache.policy import default_write_policy

TIERS = ("device", "host", "storage")


@dataclass
class SimConfig:
    block_size: int = 16
    device_blocks: int | float = 8192
    host_blocks: int | float = 32768
    storage_blocks: int | float = 0
    write_policy: str | None = None  # None: default_write_policy (write_through with a host or storage tier)
    write_through_threshold: int = 2
    eviction: str = "lru"
    hash_name: str = "sha256"
    kv_bytes_per_token: int = 131072  # 128 KiB: e.g. 32 layers x 8 KV heads x 128 dims x 2 (K,V) x bf16
    max_running: int = 16
    storage_gbps: float = 2.0  # storage read bandwidth of one call (GB/s)
    storage_latency_ms: float = 0.5  # per call
    prefill_tokens_per_s: float = 0.0  # recompute rate; 0: fetch every storage hit
    write_policy_is_default: bool = field(init=False)  # write_policy was resolved from None

    def __post_init__(self) -> None:
        if self.storage_blocks and not self.host_blocks:
            raise ValueError(
                f"a storage tier needs a host tier (storage I/O goes through it): --storage-blocks "
                f"{self.storage_blocks} with --host-blocks 0; set --host-blocks > 0"
            )
        self.write_policy_is_default = self.write_policy is None
        if self.write_policy is None:
            self.write_policy = default_write_policy(self.host_blocks > 0, self.storage_blocks > 0)


def trace_blocks(trace: list[TraceRequest], block_size: int) -> int:
    """Every block the trace could ever hold: each request's blocks (its prompt's, and its
    answer's positions but the last, which are cached as it decodes), all distinct."""
    return max(1, sum(-(-(len(tr.input_ids) + max(0, len(tr.output_ids or ()) - 1)) // block_size) for tr in trace))


def _tier_size(size: int | float, trace: list[TraceRequest], block_size: int) -> int:
    """``inf`` -> :func:`trace_blocks`."""
    if size != math.inf:
        return int(size)
    return trace_blocks(trace, block_size)


def copies_down_pay(trace: list[TraceRequest], cfg: SimConfig) -> bool:
    """Whether a block one engine copies below its device tier could ever be hit there: only if
    the device tier may evict it, i.e. it cannot hold every block of the trace. When it can, the
    replay copies nothing down (a copy could serve no hit; the report says so). (A fleet's shared
    pool serves the other instances: its copies always pay, ``make_manager(shared=True)``.)"""
    return _tier_size(cfg.device_blocks, trace, cfg.block_size) < trace_blocks(trace, cfg.block_size)


def make_manager(
    trace: list[TraceRequest], cfg: SimConfig, storage: SimulatedStorage | None, cost=None, shared: bool = False
) -> CacheManager:
    """``shared``: ``storage`` is a pool other managers read (a fleet's)."""
    assert cfg.write_policy is not None  # SimConfig.__post_init__ resolves None
    # a device tier that never evicts: write_back (a copy on eviction) is no copy at all, and
    # every hit is the same as under the configured policy, whose copies down no request can use
    pays = copies_down_pay(trace, cfg) or (shared and storage is not None)
    policy = cfg.write_policy if pays else "write_back"
    return CacheManager(
        block_size=cfg.block_size,
        num_device_blocks=_tier_size(cfg.device_blocks, trace, cfg.block_size),
        num_host_blocks=_tier_size(cfg.host_blocks, trace, cfg.block_size),
        storage=storage,
        write_policy=policy,
        write_through_threshold=cfg.write_through_threshold,
        eviction=cfg.eviction,
        hash_name=cfg.hash_name,
        block_nbytes=cfg.kv_bytes_per_token * cfg.block_size,
        fetch_cost=cost,
    )


def fetch_cost(cfg: SimConfig) -> FetchCostModel | None:
    """The storage tier's cost model at the configured speeds (None: fetch every storage hit,
    ``prefill_tokens_per_s`` 0)."""
    if cfg.prefill_tokens_per_s <= 0:
        return None
    cost = FetchCostModel(
        "sim",
        workers=1,
        batch=1 << 30,
        block_nbytes=cfg.kv_bytes_per_token * cfg.block_size,
        block_size=cfg.block_size,
        prior=(cfg.storage_latency_ms / 1e3, cfg.storage_gbps * 1e9),
    )
    cost.observe_prefill(int(cfg.prefill_tokens_per_s), 1.0)
    return cost


def simulate(trace: list[TraceRequest], cfg: SimConfig, progress: bool = False) -> dict:
    assert cfg.write_policy is not None  # SimConfig.__post_init__ resolves None
    storage = None if cfg.storage_blocks == 0 else SimulatedStorage(cfg.storage_blocks)
    mgr = make_manager(trace, cfg, storage, fetch_cost(cfg) if storage is not None else None)
    bar = progress_bar(len(trace), "sim") if progress else None
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _replay(trace, cfg, mgr, storage, bar)
    finally:
        if gc_was_enabled:
            gc.enable()


def progress_bar(total: int, desc: str):
    """A bar of ``total`` requests on stderr."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, mininterval=0.5)


def run_copies(mgr: CacheManager) -> bool:
    """Run the staged copies to completion; False if there were none."""
    ran = False
    while plan := mgr.take_plan():
        mgr.complete_plan(plan)
        ran = True
    return ran


def serve_one(
    mgr: CacheManager, running: deque, rid: int, tokens: list[int], cfg: SimConfig, hits: dict, output: list[int] | None = None
) -> bool:
    """One request through ``mgr`` (module docstring), its hits added to ``hits``; False if it
    is larger than the whole device tier (skipped). ``output``: its answer, whose positions but
    the last the engine computes and caches as it decodes (where the device tier has room)."""
    while len(running) >= cfg.max_running:
        mgr.free(running.popleft())
    req = mgr.new_request(rid, list(tokens) if output else tokens)
    m = mgr.match_prefix(req)
    hits["device"] += m.num_device_blocks * cfg.block_size
    hits["host"] += m.num_host_blocks * cfg.block_size
    if m.num_storage_blocks:
        fetched = mgr.prefetch(req)  # as many as pay (all without a cost model) and fit
        hits["storage"] += fetched * cfg.block_size
        if fetched:
            run_copies(mgr)
            m = mgr.match_prefix(req)
    while not mgr.allocate(req, len(tokens)):
        if running:
            mgr.free(running.popleft())
            run_copies(mgr)
        elif not run_copies(mgr):  # no copy in flight (write_back) whose landing frees blocks
            break
    else:
        run_copies(mgr)  # loads land, then the prefill ran
        mgr.commit(req, len(tokens))
        run_copies(mgr)  # backups / puts of the new blocks
        if output and len(output) > 1:
            req.token_ids.extend(output[:-1])
            if mgr.allocate(req, len(req.token_ids)):
                mgr.commit(req, len(req.token_ids))
                run_copies(mgr)
        running.append(req)
        return True
    mgr.free(req)
    return False


def _replay(trace: list[TraceRequest], cfg: SimConfig, mgr: CacheManager, storage: SimulatedStorage | None, bar) -> dict:
    hits = dict.fromkeys(TIERS, 0)
    prompt_tokens = skipped = 0
    running: deque = deque()
    t0 = time.perf_counter()
    for i, tr in enumerate(trace):
        if bar is not None:
            bar.update(1)
        tokens = tr.input_ids
        prompt_tokens += len(tokens)
        skipped += not serve_one(mgr, running, i, tokens, cfg, hits, tr.output_ids)
    while running:
        mgr.free(running.popleft())
    run_copies(mgr)
    if bar is not None:
        bar.close()
    evictions = dict(mgr.stats.evictions)
    evictions["storage"] = storage.evictions if storage is not None else 0
    res = {
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
    res["notes"] = [write_policy_note(cfg), *copies_note(trace, cfg), *zero_hit_notes(res, cfg)]
    return res


def copies_note(trace: list[TraceRequest], cfg: SimConfig) -> list[str]:
    """A line when the replay copied nothing down although the policy would (``copies_down_pay``)."""
    if copies_down_pay(trace, cfg) or not (cfg.host_blocks or cfg.storage_blocks) or cfg.write_policy == "write_back":
        return []
    device = _tier_size(cfg.device_blocks, trace, cfg.block_size)
    return [
        f"no block was copied down: the device tier ({device:,} blocks) holds every block the trace can use "
        f"({trace_blocks(trace, cfg.block_size):,} at most), so it never evicts and a copy below could serve no hit "
        f"(the engine's {cfg.write_policy} would still copy them: those bytes are not in 'bytes moved')"
    ]


def write_policy_note(cfg: SimConfig) -> str:
    """Which write policy ran, what it does, and why it was the one."""
    does = {
        "write_through": "every computed block is copied down",
        "write_through_selective": f"a block is copied down after {cfg.write_through_threshold} hits",
        "write_back": "a block is copied down when evicted",
    }[cfg.write_policy or ""]
    if not cfg.write_policy_is_default:
        return f"write policy: {cfg.write_policy}, {does} (--write-policy)"
    tiers = "with" if cfg.write_policy == "write_through" else "without"
    return f"write policy: {cfg.write_policy}, {does} (the default {tiers} a host or storage tier; --write-policy to change)"


def zero_hit_notes(res: dict, cfg: SimConfig) -> list[str]:
    """One line for each lower tier without hits, saying why (the first reason that holds)."""
    evicted, moved, hits = res["evictions"], res["bytes_moved"], res["hit_tokens"]
    decisions = res["fetch_decisions"] or {}
    notes = []
    never_copied = f"no block was copied down to it (write policy {cfg.write_policy})"
    if hits["host"] == 0:
        if not cfg.host_blocks:
            why = "no host tier (--host-blocks 0)"
        elif evicted["device"] == 0:
            why = "the device tier never evicted"
        elif moved["device_to_host"] == 0:
            why = never_copied
        else:
            why = "no prompt asked again for a block the device tier evicted while the host tier held it"
        notes.append(f"host: 0 hits — {why}")
    if hits["storage"] == 0:
        if not cfg.storage_blocks:
            why = "no storage tier (--storage-blocks to add one)"
        elif evicted["device"] == 0:
            why = "the device tier never evicted"
        elif moved["host_to_storage"] == 0:
            why = never_copied
        elif evicted["host"] == 0:
            why = "the host tier never evicted"
        elif decisions.get("recompute") and not decisions.get("fetch") and not decisions.get("partial"):
            why = "every storage hit was cheaper to recompute (--prefill-tokens-per-s, --storage-gbps)"
        else:
            why = "no prompt asked again for a block the host tier evicted"
        notes.append(f"storage: 0 hits — {why}")
    return notes
