"""``kvtier sim TRACE --instances N --route POLICY``: a fleet of N instances behind a router.

Each instance is a real CacheManager of the given tier sizes (as ``kvtier sim`` replays one);
the router is the one ``kvtier router --workers`` runs: the same policy (``serve/route.py``), one
:class:`~kvtier.serve.route.PrefixIndex` per instance fed by that instance's KV events
(``cache/events.py``), and the request's chained keys. Before each request the router polls every
instance's new events; with ``drop_events`` = p each event is lost with probability p, the
reader sees the gap in the numbering, skips the rest of that poll and takes a snapshot at the
next one (one request later), as the router does.

Load: the tokens an instance has yet to prefill when the request arrives, on the modelled
timeline below (the router's load: the uncached tokens of the requests in flight). Modelled TTFT: an instance prefills one
request at a time at ``prefill_tokens_per_s`` (default 20,000 when 0 is given), its uncached
tokens only, starting at the request's trace time
or when the instance is free; TTFT = the wait + the prefill. The same run also replays one
instance with N times its device and host tiers (the hit rate a perfect router over the
fleet's total cache could reach: the goal's reference) unless ``baseline`` is False.

With ``storage_blocks``, the fleet shares one pool of that many blocks (every instance writes
its blocks there and fetches hits from there, as instances on one Redis or Mooncake pool do):
the router counts the pool's leading blocks for every instance, past what each holds
(``kvtier router --storage``), and the big instance has that same pool. A storage hit counts as
cached in the modelled TTFT (its fetch time is not modelled).
"""

from __future__ import annotations

import math
import random
import time
from collections import deque
from itertools import takewhile

from kvtier.bench.replay import TIERS, SimConfig, fetch_cost, make_manager, progress_bar, run_copies, serve_one, simulate
from kvtier.bench.traces import TraceRequest
from kvtier.cache.keys import BlockHasher, namespace_seed
from kvtier.cache.storage_index import SimulatedStorage
from kvtier.serve.route import Picker, PrefixIndex

DEFAULT_PREFILL_TOKENS_PER_S = 20_000.0


def simulate_fleet(
    trace: list[TraceRequest],
    cfg: SimConfig,
    instances: int,
    route: str,
    drop_events: float = 0.0,
    seed: int = 0,
    baseline: bool = True,
    warm: int = 0,
    progress: bool = False,
) -> dict:
    """The fleet's run of ``trace`` (module docstring); its first ``warm`` requests fill the
    caches, as a bench's warm-up does, and are left out of every figure. ``progress``: a bar on
    stderr (the fleet's requests, then the one-instance baseline's)."""
    if instances < 1:
        raise ValueError(f"instances must be >= 1, got {instances}")
    if not 0 <= drop_events < 1:
        raise ValueError(f"drop_events must be a probability in [0, 1), got {drop_events}")
    if warm and baseline:
        raise ValueError("warm-up requests are left out of the fleet's figures only: give baseline=False with warm")
    picker = Picker(route)
    # one pool that every instance writes and reads; the router asks it, as kvtier router --storage does
    pool = SimulatedStorage(cfg.storage_blocks) if cfg.storage_blocks else None
    cost = fetch_cost(cfg) if pool is not None else None
    mgrs = [make_manager(trace, cfg, pool, cost, shared=True) for _ in range(instances)]
    for m in mgrs:
        m.events.enable()
    indexes = [PrefixIndex() for _ in range(instances)]
    seqs: list[int | None] = [None] * instances  # None: take a snapshot at the next poll
    running: list[deque] = [deque() for _ in range(instances)]
    hits = [dict.fromkeys(TIERS, 0) for _ in range(instances)]
    served = [0] * instances
    tokens_in = [0] * instances
    free_at = [0.0] * instances
    rate = cfg.prefill_tokens_per_s or DEFAULT_PREFILL_TOKENS_PER_S
    rng = random.Random(seed)
    key_seed = namespace_seed(None, None, cfg.hash_name)
    ttfts: list[float] = []
    resyncs = dropped = skipped = 0
    t0 = time.perf_counter()
    bar = progress_bar(len(trace), f"{instances} instances") if progress else None
    for rid, tr in enumerate(trace):
        if bar is not None:
            bar.update(1)
        for j, m in enumerate(mgrs):  # the router's poll of every instance
            ev, last = m.events, seqs[j]
            if last is None:
                snap = ev.snapshot(m.tree)
                indexes[j].reset((bytes.fromhex(k) for k in snap["device"]), (bytes.fromhex(k) for k in snap["host"]))
                seqs[j] = snap["seq"]
                resyncs += rid > 0
                continue
            got = ev.since(last, limit=1 << 30)
            if got is None:
                seqs[j] = None
                continue
            for s, kind, tier, key in got:
                if drop_events and rng.random() < drop_events:
                    dropped += 1
                    seqs[j] = None  # the next event's number shows the gap: snapshot next time
                    break
                indexes[j].apply(kind, tier, bytes.fromhex(key))
                seqs[j] = s
        tokens = tr.input_ids
        keys = BlockHasher(cfg.block_size, key_seed, cfg.hash_name).extend(tokens)
        arrival = tr.timestamp / 1e3  # trace times are ms
        load = [int(max(0.0, f - arrival) * rate) for f in free_at]  # tokens queued, as modelled
        pooled = sum(1 for _ in takewhile(pool.contains, keys)) if pool is not None else 0  # (no LRU touch)
        j = picker.pick([ix.candidate(keys, cfg.block_size, load[k], pooled=pooled) for k, ix in enumerate(indexes)], len(tokens))
        before = dict(hits[j])
        ok = serve_one(mgrs[j], running[j], rid, tokens, cfg, hits[j], tr.output_ids)
        cached = sum(hits[j].values()) - sum(before.values())
        start = max(arrival, free_at[j])
        free_at[j] = start + (len(tokens) - cached) / rate
        if rid < warm:  # (a warm-up request: its hits are not the run's)
            hits[j] = before
            continue
        skipped += not ok
        served[j] += 1
        tokens_in[j] += len(tokens)
        ttfts.append(free_at[j] - arrival)
    if bar is not None:
        bar.close()
    for m, q in zip(mgrs, running):
        while q:
            m.free(q.popleft())
        run_copies(m)
    prompt_tokens = sum(tokens_in)
    total = {t: sum(h[t] for h in hits) for t in TIERS}
    mean_load = prompt_tokens / instances
    ttfts.sort()
    res: dict = {
        "instances": instances,
        "route": route,
        "requests": len(trace) - warm,
        "prompt_tokens": prompt_tokens,
        "hit_tokens": total,
        "hit_rate": sum(total.values()) / prompt_tokens if prompt_tokens else 0.0,
        "per_instance": [{"requests": served[k], "prompt_tokens": tokens_in[k], "hit_tokens": hits[k]} for k in range(instances)],
        "max_load_vs_mean": max(tokens_in) / mean_load if mean_load else 0.0,
        "ttft_model_s": {
            "mean": sum(ttfts) / len(ttfts) if ttfts else 0.0,
            "p90": ttfts[int(0.9 * (len(ttfts) - 1))] if ttfts else 0.0,
        },
        "prefill_tokens_per_s": rate,
        "events_dropped": dropped,
        "resyncs": resyncs,
        "skipped_requests": skipped,
        "wall_s": round(time.perf_counter() - t0, 3),
    }
    if baseline:
        big = SimConfig(
            **{k: v for k, v in vars(cfg).items() if k != "write_policy_is_default"}
            | {
                "device_blocks": _times(cfg.device_blocks, instances),
                "host_blocks": _times(cfg.host_blocks, instances),
                "max_running": cfg.max_running * instances,
            }
        )
        one = simulate(trace, big, progress=progress)
        one_rate = sum(one["hit_tokens"].values()) / one["prompt_tokens"] if one["prompt_tokens"] else 0.0
        res["one_big_instance_hit_rate"] = one_rate
        res["hit_rate_vs_one_big_instance"] = res["hit_rate"] / one_rate if one_rate else None
    return res


def _times(size: int | float, n: int) -> int | float:
    return size if size == math.inf else size * n


def format_fleet(res: dict) -> str:
    lines = [
        f"{res['instances']} instances, route {res['route']}: {res['requests']} requests, "
        f"{res['prompt_tokens']:,} prompt tokens; hit rate {res['hit_rate']:.3f} "
        f"(hit tokens: device {res['hit_tokens']['device']:,}, host {res['hit_tokens']['host']:,}, "
        f"storage {res['hit_tokens']['storage']:,})"
    ]
    if res.get("one_big_instance_hit_rate") is not None:
        ratio = res["hit_rate_vs_one_big_instance"]
        lines.append(
            f"one instance with {res['instances']}x the cache: hit rate {res['one_big_instance_hit_rate']:.3f}; "
            f"the fleet reaches {ratio:.2f} of it"
            if ratio is not None
            else "one instance with the fleet's cache: no hits"
        )
    lines.append(
        f"load: busiest instance {res['max_load_vs_mean']:.2f}x the mean (prompt tokens per instance: "
        + ", ".join(f"{p['prompt_tokens']:,}" for p in res["per_instance"])
        + ")"
    )
    lines.append(
        f"modelled TTFT (prefill {res['prefill_tokens_per_s']:,.0f} tok/s per instance, one at a time): "
        f"mean {res['ttft_model_s']['mean'] * 1e3:.0f} ms, p90 {res['ttft_model_s']['p90'] * 1e3:.0f} ms"
    )
    if res["events_dropped"]:
        lines.append(f"KV events dropped {res['events_dropped']}, index resyncs {res['resyncs']}")
    return "\n".join(lines)
