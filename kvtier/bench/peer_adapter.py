"""kvtier's CacheManager behind the peer interface of ``/work/shared/peers/peer_bench.py``.

    peer_bench.py --ours kvtier.bench.peer_adapter:make_peer

The same life cycle as the peers (prompt KV only, device tier only)::

    admit(i)    new_request + match_prefix (keys included) -> allocate(all tokens)
    publish(i)  commit(all tokens): the prompt's full blocks become matchable
    finish(i)   free: unpin the request's nodes, return its own blocks

``make_peer(n, bs)`` uses the manager's default key digest (SHA-256, like the vLLM peer's
default); ``make_peer_xxh3`` the same with ``xxh3_128``.
"""
from __future__ import annotations

import time

from kvtier.cache import CacheManager, CacheRequest


class KvtierPeer:
    def __init__(self, num_blocks: int, block_size: int, hash_name: str = "sha256") -> None:
        self.mgr = CacheManager(block_size=block_size, num_device_blocks=num_blocks, hash_name=hash_name)
        self.name = f"kvtier[{hash_name}]"
        self._waiting: dict[int, CacheRequest] = {}   # refused admits, retried with their keys

    def admit(self, rid: int, tokens: list[int]):  # type: ignore[no-untyped-def]
        mgr = self.mgr
        t0 = time.perf_counter_ns()
        req = self._waiting.pop(rid, None) or mgr.new_request(rid, tokens)
        m = mgr.match_prefix(req)
        t1 = time.perf_counter_ns()
        ok = mgr.allocate(req, len(tokens))
        t2 = time.perf_counter_ns()
        if not ok:
            self._waiting[rid] = req
            return None
        return req, m.num_cached_tokens, {"match": t1 - t0, "alloc": t2 - t1}

    def publish(self, req: CacheRequest) -> dict[str, int]:
        t0 = time.perf_counter_ns()
        self.mgr.commit(req, len(req.token_ids))
        return {"commit": time.perf_counter_ns() - t0}

    def finish(self, req: CacheRequest) -> dict[str, int]:
        t0 = time.perf_counter_ns()
        self.mgr.free(req)
        return {"free": time.perf_counter_ns() - t0}

    def check(self) -> None:
        """No leak: every block free or held by the tree, nothing pinned."""
        mgr = self.mgr
        mgr.assert_invariants()
        assert not self._waiting
        assert mgr.device_pool.num_free + mgr.tree.num_device_copies == mgr.device_pool.num_blocks
        assert mgr.tree.num_device_unlocked == mgr.tree.num_device_copies


def make_peer(num_blocks: int, block_size: int) -> KvtierPeer:
    return KvtierPeer(num_blocks, block_size, "sha256")


def make_peer_xxh3(num_blocks: int, block_size: int) -> KvtierPeer:
    return KvtierPeer(num_blocks, block_size, "xxh3_128")
