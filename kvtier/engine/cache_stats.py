"""``EngineCore.cache_stats()``: what ``/metrics``, ``kvtier generate`` and the benches report
of the tiers (hits, evictions, bytes moved, blocks used), the pool's own counters and the fetch
cost model, failures, and the start's phases."""

from __future__ import annotations

from typing import Any

from kvtier.cache import CacheManager
from kvtier.cache.cost import FetchCostModel
from kvtier.engine.startup import Startup
from kvtier.storage.client import StorageClient


def cache_stats(
    cache: CacheManager,
    storage: StorageClient | None,
    fetch_cost: FetchCostModel | None,
    failed_requests: int,
    startup: Startup,
) -> dict:
    s = cache.stats
    moved = s.bytes_moved
    hits = sum(s.hit_tokens.values())
    return {
        "device": {
            "hit_tokens": s.hit_tokens["device"],
            "evictions": s.evictions["device"],
            "bytes_in": moved["host_to_device"],
            "blocks_used": cache.device_pool.num_used,
            "blocks": cache.device_pool.num_blocks,
        },
        "host": {
            "hit_tokens": s.hit_tokens["host"],
            "evictions": s.evictions["host"],
            "bytes_in": moved["device_to_host"] + moved["storage_to_host"],
            "blocks_used": cache.host_pool.num_used,
            "blocks": cache.host_pool.num_blocks,
        },
        "storage": storage_stats(cache, storage, fetch_cost),
        "query_tokens": s.query_tokens,
        "miss_tokens": max(0, s.query_tokens - hits),
        "failures": dict(s.failures),
        "failed_requests": failed_requests,
        "startup": startup.as_dict(),
    }


def storage_stats(cache: CacheManager, storage: StorageClient | None, fetch_cost: FetchCostModel | None) -> dict:
    s = cache.stats
    out: dict[str, Any] = {
        "hit_tokens": s.hit_tokens["storage"],
        "bytes_in": s.bytes_moved["host_to_storage"],
        "bytes_out": s.bytes_moved["storage_to_host"],
    }
    if storage is not None:
        out.update(storage.stats())
        out["evictions"] = out.get("server", {}).get("evictions", 0)
    if fetch_cost is not None:
        out["fetch_cost"] = fetch_cost.as_dict()
    return out
