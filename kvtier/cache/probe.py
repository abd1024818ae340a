"""The storage pool's lookups of one request's blocks (its storage hits): started at arrival on
the storage client's lookup thread (:func:`lookup_async`), so that the engine thread does not wait
for the pool when the request is matched; answered from there while fresh, else asked again
(:func:`storage_hits`). The last lookup is kept on the request (``CacheRequest.storage_probe``)."""

from __future__ import annotations

import time

from kvtier.cache.records import CacheRequest
from kvtier.cache.storage_index import StorageIndex

PROBE_TTL_S = 2.0  # a request's storage lookup older than this is asked again when it is matched


def lookup_async(storage: StorageIndex | None, req: CacheRequest, first: int, end: int) -> None:
    """Ask the pool, on its lookup thread, which of ``req``'s blocks ``first..end`` it holds
    (nothing when the pool has no lookup thread)."""
    lookup = getattr(storage, "lookup_prefix_async", None)
    if lookup is not None and first < end:
        keys = req.hasher.ensure_keys(end)
        req.storage_probe = (first, end, lookup(keys[first:end]), time.monotonic())


def storage_hits(storage: StorageIndex, req: CacheRequest, nh: int, max_blocks: int) -> int:
    """How many blocks from ``nh`` on the pool holds: from the lookup started at arrival (or
    an earlier step) when it covers ``nh`` and is fresh, else asked now."""
    probe = req.storage_probe  # one lookup per range, not one per step
    if probe is not None and probe[1] == max_blocks and time.monotonic() - probe[3] < PROBE_TTL_S:
        first, _, hits, at = probe
        if not isinstance(hits, int):  # started at arrival: usually answered by now
            try:
                hits = int(hits.result())
            except Exception:  # a failed or cancelled lookup is a miss
                hits = 0
            req.storage_probe = (first, max_blocks, hits, at)
        if first <= nh <= first + hits:  # the block after the hits is absent (or the end)
            return first + hits - nh
    keys = req.hasher.ensure_keys(max_blocks)
    ns = storage.lookup_prefix(keys[nh:max_blocks])
    req.storage_probe = (nh, max_blocks, ns, time.monotonic())
    return ns
