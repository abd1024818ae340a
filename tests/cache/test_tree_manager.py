"""Radix tree + CacheManager behaviours, one per test (DESIGN §1, §5)."""

from __future__ import annotations

import pytest

from kvtier.cache import CacheManager, SimulatedStorage
from kvtier.cache.tree import Node

BS = 4


def blocks(start, n, extra=1):
    """Tokens of ``n`` full blocks (+ ``extra`` tokens) unique to ``start``."""
    return list(range(start, start + n * BS + extra))


def node(mgr: CacheManager, key: bytes) -> Node:
    """The tree's node of ``key``, which the test expects there."""
    found = mgr.tree.get(key)
    assert found is not None, f"no node for key {key.hex()}"
    return found


def run_plans(mgr, failed=None):
    rewinds = {}
    while plan := mgr.take_plan():
        rewinds.update(mgr.complete_plan(plan, failed))
    return rewinds


def serve(mgr, rid, tokens):
    """A whole request: match, admit, prefill, commit, copies, finish."""
    req = mgr.new_request(rid, tokens)
    mgr.match_prefix(req)
    assert mgr.allocate(req, len(tokens))
    run_plans(mgr)
    mgr.commit(req, len(tokens))
    run_plans(mgr)
    mgr.free(req)
    run_plans(mgr)
    mgr.assert_invariants()
    return req


# ------------------------------------------------------------------ matching
def test_match_is_device_then_host_then_storage_hits():
    storage = SimulatedStorage()
    mgr = CacheManager(block_size=BS, num_device_blocks=8, num_host_blocks=4, storage=storage, write_policy="write_through")
    a = blocks(100, 4)
    serve(mgr, "a", a)  # 4 blocks on device, host and storage
    req = mgr.new_request("b", blocks(200, 5))  # needs 6 device blocks: evicts a's 2 deepest
    assert mgr.allocate(req, len(req.token_ids))
    mgr.free(req)
    run_plans(mgr)
    serve(mgr, "c", blocks(300, 1))  # backing c up evicts a's last host copy
    m = mgr.match_prefix(mgr.new_request("a2", a))
    assert (m.num_device_blocks, m.num_host_blocks, m.num_storage_blocks) == (2, 1, 1)
    assert m.tokens_by_tier() == {"device": 8, "host": 4, "storage": 4}
    req = mgr.new_request("a3", a)
    mgr.match_prefix(req)
    nodes = [node(mgr, k) for k in req.keys[:3]]
    assert [n.device_block is not None for n in nodes] == [True, True, False]
    assert nodes[2].host_ready and mgr.tree.get(req.keys[3]) is None and storage.contains(req.keys[3])


def test_match_leaves_at_least_one_token_to_compute():
    mgr = CacheManager(block_size=BS, num_device_blocks=8)
    tokens = blocks(0, 2, extra=0)  # exactly two full blocks
    serve(mgr, "a", tokens)
    m = mgr.match_prefix(mgr.new_request("b", tokens))
    assert m.num_device_blocks == 1  # the last token's block is recomputed


def test_shared_prefix_is_matched_across_requests():
    mgr = CacheManager(block_size=BS, num_device_blocks=16)
    serve(mgr, "a", blocks(0, 3))
    m = mgr.match_prefix(mgr.new_request("b", blocks(0, 2, extra=0) + [999] * 6))
    assert m.num_device_blocks == 2


def test_cache_salt_isolates_requests():
    mgr = CacheManager(block_size=BS, num_device_blocks=16)
    tokens = blocks(0, 3)
    req = mgr.new_request("a", tokens, cache_salt="x")
    mgr.allocate(req, len(tokens))
    mgr.commit(req, len(tokens))
    mgr.free(req)
    assert mgr.match_prefix(mgr.new_request("b", tokens)).num_blocks == 0
    assert mgr.match_prefix(mgr.new_request("c", tokens, cache_salt="x")).num_blocks == 3


# ------------------------------------------------------------------ eviction
def test_eviction_removes_leaves_only():
    mgr = CacheManager(block_size=BS, num_device_blocks=4)
    a = serve(mgr, "a", blocks(0, 3, extra=0))  # 3 nodes in a chain
    chain = [node(mgr, k) for k in a.keys]
    req = mgr.new_request("b", blocks(100, 1, extra=1))  # 2 blocks: 1 free + 1 evicted
    assert mgr.allocate(req, len(req.token_ids))
    assert mgr.tree.get(a.keys[2]) is None  # the leaf went
    assert chain[0].device_block is not None and chain[1].device_block is not None
    mgr.free(req)
    mgr.assert_invariants()


def test_locked_blocks_are_never_evicted():
    mgr = CacheManager(block_size=BS, num_device_blocks=4)
    a = mgr.new_request("a", blocks(0, 3, extra=0))
    assert mgr.allocate(a, 12)
    mgr.commit(a, 12)  # tree-owned but locked by a
    b = mgr.new_request("b", blocks(100, 2))
    assert not mgr.can_allocate(b, 9)
    assert not mgr.allocate(b, 9)
    assert [node(mgr, k).device_block for k in a.keys] == a.block_table
    mgr.assert_invariants([a, b])


@pytest.mark.parametrize("eviction, survivor", [("lru", "a"), ("lfu", "b")])
def test_eviction_order_lru_vs_lfu(eviction, survivor):
    mgr = CacheManager(block_size=BS, num_device_blocks=3, eviction=eviction)
    a, b = blocks(0, 1), blocks(100, 1)
    serve(mgr, "b", b)
    serve(mgr, "b2", b)  # b: hit twice, but least recently
    serve(mgr, "a", a)  # a: once, most recently
    req = mgr.new_request("c", blocks(200, 0, extra=8))  # 2 blocks, 1 free: one of a, b must go
    assert mgr.allocate(req, len(req.token_ids))
    mgr.free(req)
    kept = {name for name, toks in (("a", a), ("b", b)) if mgr.match_prefix(mgr.new_request(name, toks)).num_blocks}
    assert kept == {survivor}


# ------------------------------------------------------------------ write policies
def commit_one(mgr, rid, tokens):
    req = mgr.new_request(rid, tokens)
    mgr.match_prefix(req)
    assert mgr.allocate(req, len(tokens))
    mgr.commit(req, len(tokens))
    return req


def test_write_through_backs_up_on_commit():
    mgr = CacheManager(block_size=BS, num_device_blocks=8, num_host_blocks=8, write_policy="write_through")
    req = commit_one(mgr, "a", blocks(0, 2))
    plan = mgr.take_plan()
    assert plan.backups is not None and plan.backups.keys == tuple(req.keys)
    assert plan.backups.src_blocks == tuple(req.block_table[:2])


def test_write_through_selective_backs_up_at_threshold():
    mgr = CacheManager(
        block_size=BS, num_device_blocks=8, num_host_blocks=8, write_policy="write_through_selective", write_through_threshold=2
    )
    tokens = blocks(0, 2)
    first = commit_one(mgr, "a", tokens)
    assert mgr.take_plan().backups is None  # hit count 1 < 2
    mgr.free(first)
    commit_one(mgr, "b", tokens)  # the second use reaches the threshold
    plan = mgr.take_plan()
    assert plan.backups is not None and plan.backups.keys == tuple(first.keys)


def test_write_back_copies_on_eviction_ancestors_first():
    mgr = CacheManager(block_size=BS, num_device_blocks=3, num_host_blocks=8, write_policy="write_back")
    a = commit_one(mgr, "a", blocks(0, 3, extra=0))
    assert not mgr.take_plan()  # nothing copied on commit
    mgr.free(a)
    b = mgr.new_request("b", blocks(100, 0, extra=3))  # one block: the leaf of a must go
    assert not mgr.allocate(b, 3)  # not yet: its copy is in flight
    plan = mgr.take_plan()
    assert plan.backups is not None and plan.backups.keys == tuple(a.keys)  # root -> leaf: ancestors first
    mgr.complete_plan(plan)
    assert mgr.allocate(b, 3)  # the copy landed: the leaf was freed
    m = mgr.match_prefix(mgr.new_request("a2", blocks(0, 3, extra=1)))
    assert (m.num_device_blocks, m.num_host_blocks) == (2, 1)
    mgr.assert_invariants([b])


# ------------------------------------------------------------------ failures
def host_hit_setup():
    mgr = CacheManager(block_size=BS, num_device_blocks=4, num_host_blocks=8, write_policy="write_through")
    tokens = blocks(0, 3)
    serve(mgr, "a", tokens)
    req = mgr.new_request("evict", blocks(100, 3, extra=0))  # pushes a's blocks down to host
    assert mgr.allocate(req, 12)
    mgr.free(req)
    run_plans(mgr)
    return mgr, tokens


def test_load_failure_rewinds_to_the_last_good_block():
    mgr, tokens = host_hit_setup()
    req = mgr.new_request("b", tokens)
    m = mgr.match_prefix(req)
    assert m.num_host_blocks >= 2
    assert mgr.allocate(req, len(tokens))
    plan = mgr.take_plan()
    rewinds = mgr.complete_plan(plan, {"load": [1]})
    assert rewinds == {"b": (m.num_device_blocks + 1) * BS}
    assert mgr.stats.failures["load"] == 1
    mgr.assert_invariants([req])
    mgr.free(req)
    run_plans(mgr)
    mgr.assert_invariants()
    assert mgr.device_pool.num_free + mgr.tree.num_device_copies == mgr.device_pool.num_blocks


def test_fetch_failure_degrades_to_a_miss():
    storage = SimulatedStorage()
    writer = CacheManager(block_size=BS, num_device_blocks=8, num_host_blocks=8, storage=storage, write_policy="write_through")
    tokens = blocks(0, 3)
    serve(writer, "a", tokens)  # another engine filled the shared pool
    mgr = CacheManager(block_size=BS, num_device_blocks=8, num_host_blocks=8, storage=storage)
    req = mgr.new_request("b", tokens)
    assert mgr.match_prefix(req).num_storage_blocks == 3
    assert mgr.prefetch(req) == 3
    plan = mgr.take_plan()
    mgr.complete_plan(plan, {"fetch": [0, 1, 2]})
    assert mgr.stats.failures["fetch"] == 3
    assert mgr.host_pool.num_free == 8  # every fetch target returned
    m = mgr.match_prefix(req)
    assert (m.num_device_blocks, m.num_host_blocks) == (0, 0)
    assert mgr.allocate(req, len(tokens))  # recomputed: admitted as a miss
    mgr.assert_invariants([req])


def test_fetched_blocks_become_host_hits():
    storage = SimulatedStorage()
    serve(
        CacheManager(block_size=BS, num_device_blocks=8, num_host_blocks=8, storage=storage, write_policy="write_through"),
        "a",
        blocks(0, 3),
    )
    mgr = CacheManager(block_size=BS, num_device_blocks=8, num_host_blocks=8, storage=storage, early_loads=False)
    req = mgr.new_request("b", blocks(0, 3))
    mgr.match_prefix(req)
    mgr.prefetch(req)
    run_plans(mgr)
    assert mgr.match_prefix(req).num_host_blocks == 3
    mgr.assert_invariants([req])


def test_early_loads_bring_fetched_chunks_and_host_hits_to_the_device_before_admission():
    """Each chunk goes on to the device as it lands (and the host hits at once): the request is
    admitted with device hits and loads nothing; its hits still count by the tier they came from."""
    storage = SimulatedStorage()
    tokens = blocks(0, 5)
    serve(
        CacheManager(block_size=BS, num_device_blocks=8, num_host_blocks=8, storage=storage, write_policy="write_through"),
        "a",
        tokens,
    )
    mgr = CacheManager(
        block_size=BS,
        num_device_blocks=12,
        num_host_blocks=12,
        storage=SimulatedStorage(),
        write_policy="write_through",
        fetch_chunk_blocks=2,
    )
    serve(mgr, "h", tokens[: 2 * BS] + [99])  # blocks 0-1 on this engine ...
    run_plans(mgr)
    mgr.table.evict_device(12)  # ... then on its host tier only
    mgr.storage = storage
    req = mgr.new_request("b", tokens)
    m = mgr.match_prefix(req)
    assert (m.num_device_blocks, m.num_host_blocks, m.num_storage_blocks) == (0, 2, 3)
    assert mgr.prefetch(req) == 3
    plan = mgr.take_plan()
    assert plan.preloads is not None and plan.preloads.num_blocks == 2  # the host hits, now
    assert [op.num_blocks for op in plan.fetches] == [2, 1]
    mgr.complete(plan.fetches[0].op_id)  # chunk 1 lands: its blocks follow
    assert mgr.prefetch_pending(req) == 1 + 2 + 2  # chunk 2, preloads of the host hits and chunk 1
    chunk1 = mgr.take_plan().preloads
    assert chunk1 is not None and chunk1.keys == tuple(req.keys[2:4])
    mgr.complete(plan.preloads.op_id)
    mgr.complete(chunk1.op_id)
    mgr.complete(plan.fetches[1].op_id)
    last = mgr.take_plan().preloads
    assert last is not None and last.keys == (req.keys[4],)
    mgr.assert_invariants([req])
    assert mgr.prefetch_pending(req) == 1
    mgr.complete(last.op_id)
    assert mgr.prefetch_pending(req) == 0
    m = mgr.match_prefix(req)
    assert (m.num_device_blocks, m.num_host_blocks) == (5, 0)
    before = dict(mgr.stats.hit_tokens)
    assert mgr.allocate(req, len(tokens))
    assert mgr.take_plan().loads is None  # nothing left to load
    gained = {t: mgr.stats.hit_tokens[t] - before[t] for t in before}
    assert gained == {"device": 0, "host": 2 * BS, "storage": 3 * BS}
    mgr.assert_invariants([req])


def test_a_preload_counts_as_a_host_hit_only_for_the_request_it_was_made_for():
    """A preload that lands after its request was admitted (its deadline passed; it loaded the
    blocks itself) leaves the device copies behind: for any later request they are device hits,
    whether or not that request waits for a fetch of its own."""
    for d_has_prefetch in (False, True):
        storage = SimulatedStorage()
        w = CacheManager(block_size=BS, num_device_blocks=32, num_host_blocks=32, storage=storage, write_policy="write_through")
        serve(w, "w", blocks(0, 4))  # 4 blocks in the pool
        mgr = CacheManager(block_size=BS, num_device_blocks=32, num_host_blocks=32, storage=storage)
        a = mgr.new_request("a", blocks(0, 2))
        mgr.match_prefix(a)
        assert mgr.prefetch(a) == 2
        mgr.complete_plan(mgr.take_plan())  # the fetch lands; its preload is planned ...
        pre = mgr.take_plan().preloads  # ... and in flight when a's deadline passes
        assert pre is not None
        m = mgr.match_prefix(a)
        assert (m.num_device_blocks, m.num_host_blocks) == (0, 2)
        assert mgr.allocate(a, len(a.token_ids))  # admitted: loads its 2 host hits itself
        mgr.complete(pre.op_id)  # the preload lands after admission
        run_plans(mgr)
        mgr.commit(a, len(a.token_ids))
        run_plans(mgr)
        mgr.free(a)
        run_plans(mgr)
        tokens = blocks(0, 4) if d_has_prefetch else blocks(0, 2, extra=0) + [7] * 9
        d = mgr.new_request("d", tokens)
        assert mgr.match_prefix(d).num_device_blocks == 2
        if d_has_prefetch:
            assert mgr.prefetch(d) == 2
            run_plans(mgr)
        before = dict(mgr.stats.hit_tokens)
        mgr.match_prefix(d)
        assert mgr.allocate(d, len(d.token_ids))
        gained = {t: mgr.stats.hit_tokens[t] - before[t] for t in before}
        assert gained == {"device": 2 * BS, "host": 0, "storage": 2 * BS if d_has_prefetch else 0}, gained
        mgr.assert_invariants([d])


def test_device_blocks_held_by_preloads_count_as_freeing():
    """Early loads in flight hold device blocks that become evictable when they land: a running
    request that finds no room meanwhile must be told to wait for them (the scheduler then
    stalls a step), not to preempt someone."""
    storage = SimulatedStorage()
    serve(
        CacheManager(block_size=BS, num_device_blocks=8, num_host_blocks=8, storage=storage, write_policy="write_through"),
        "w",
        blocks(100, 2),
    )
    mgr = CacheManager(block_size=BS, num_device_blocks=5, num_host_blocks=8, storage=storage)
    r = mgr.new_request("r", blocks(0, 1, extra=2))
    mgr.match_prefix(r)
    assert mgr.allocate(r, len(r.token_ids))  # running: 2 blocks, one of them partial
    b = mgr.new_request("b", blocks(100, 2))
    mgr.match_prefix(b)
    assert mgr.prefetch(b) == 2
    mgr.complete_plan(mgr.take_plan())  # the fetch lands: its 2 preloads staged
    assert mgr.device_pool.num_free == 1
    assert mgr.num_device_blocks_freeing == 2  # staged preloads ...
    pre = mgr.take_plan().preloads
    assert pre is not None and pre.num_blocks == 2
    assert not mgr.allocate(r, 4 * BS)  # r grows by 2 blocks: no room ...
    assert mgr.num_device_blocks_freeing == 2  # ... but the preloads in flight will make some
    assert mgr.wait_would_fit(r, 4 * BS)  # enough: the scheduler waits for them
    assert not mgr.wait_would_fit(r, 7 * BS)  # 5 more blocks: 1 free + 2 coming is not enough,
    #                                                   waiting cannot help: it preempts at once
    mgr.complete(pre.op_id)
    assert mgr.num_device_blocks_freeing == 0
    assert mgr.allocate(r, 4 * BS)  # an evicted preload made room
    mgr.assert_invariants([r, b])


def test_a_preload_below_a_failed_one_is_dropped():
    """Device copies stay prefix-closed: a preload that lands below a node whose own preload
    failed returns its block, and the request loads the rest at admission."""
    storage = SimulatedStorage()
    tokens = blocks(0, 4)
    serve(
        CacheManager(block_size=BS, num_device_blocks=8, num_host_blocks=8, storage=storage, write_policy="write_through"),
        "a",
        tokens,
    )
    mgr = CacheManager(block_size=BS, num_device_blocks=8, num_host_blocks=8, storage=storage, fetch_chunk_blocks=2)
    req = mgr.new_request("b", tokens)
    mgr.match_prefix(req)
    assert mgr.prefetch(req) == 4
    fetches = mgr.take_plan().fetches
    mgr.complete(fetches[0].op_id)
    first = mgr.take_plan().preloads
    mgr.complete(fetches[1].op_id)
    second = mgr.take_plan().preloads
    assert first is not None and second is not None
    mgr.complete(second.op_id)  # lands before its parent's: dropped
    mgr.complete(first.op_id, [1])  # block 1 failed: block 0 only
    assert mgr.stats.failures["load"] == 1
    mgr.assert_invariants([req])
    m = mgr.match_prefix(req)
    assert (m.num_device_blocks, m.num_host_blocks) == (1, 3)
    assert mgr.allocate(req, len(tokens))
    loads = mgr.take_plan().loads
    assert loads is not None and loads.num_blocks == 3
    assert mgr.device_pool.num_free == 8 - 5


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("bs", [0, 3, 12, -4, 2.0, True])
def test_block_size_must_be_a_power_of_two(bs):
    with pytest.raises(ValueError, match=repr(bs)):
        CacheManager(block_size=bs)


def test_unknown_write_policy_is_named():
    with pytest.raises(ValueError, match="'write_sometimes'"):
        CacheManager(write_policy="write_sometimes")


def test_unknown_eviction_policy_is_named():
    with pytest.raises(ValueError, match="'mru'"):
        CacheManager(eviction="mru")


def test_unknown_hash_is_named():
    with pytest.raises(ValueError, match="'md5'"):
        CacheManager(hash_name="md5")


def test_free_twice_is_refused():
    mgr = CacheManager(block_size=BS, num_device_blocks=4)
    req = commit_one(mgr, "a", blocks(0, 1))
    mgr.free(req)
    with pytest.raises(ValueError, match="freed twice"):
        mgr.free(req)


# ---------------------------------------------------------------- regressions found in review


def test_write_back_evicts_only_what_the_allocation_needs():
    mgr = CacheManager(block_size=BS, num_device_blocks=12, num_host_blocks=40, write_policy="write_back")
    for k in range(4):
        serve(mgr, f"p{k}", blocks(100 * k, 2, extra=1))
    run_plans(mgr)
    b = mgr.new_request("b", blocks(1000, 0, extra=3))
    need = mgr.device_pool.num_free + 1
    assert not mgr.allocate(b, need * BS)  # the one block it needs is being copied first
    plan = mgr.take_plan()
    # one victim (a chain's tail) and its ancestor, copied first: not all 8 cached blocks
    assert plan.backups is not None and plan.backups.num_blocks == 2
    mgr.complete_plan(plan)
    assert mgr.allocate(b, need * BS)
    mgr.assert_invariants([b])


def test_a_backup_does_not_evict_the_host_copy_it_hangs_from():
    mgr = CacheManager(block_size=BS, num_device_blocks=10, num_host_blocks=2, write_policy="write_through")
    serve(mgr, "a", blocks(0, 1, extra=1))
    serve(mgr, "x", blocks(100, 1, extra=1))
    ra = mgr.new_request("ra", blocks(0, 2, extra=1))
    mgr.match_prefix(ra)
    assert mgr.allocate(ra, 9)
    rx = mgr.new_request("rx", blocks(100, 1, extra=2))
    mgr.match_prefix(rx)
    assert mgr.allocate(rx, 6)
    run_plans(mgr)
    mgr.commit(ra, 9)  # a1 lands; backing it up must keep a0's host copy
    run_plans(mgr)
    assert mgr.stats.failures["backup"] == 0
    assert ra.nodes[0].host_ready
    mgr.assert_invariants([ra, rx])


def test_a_prefetch_does_not_evict_its_own_anchor():
    mgr = CacheManager(
        block_size=BS, num_device_blocks=10, num_host_blocks=3, write_policy="write_through", storage=SimulatedStorage(None)
    )
    a = blocks(0, 3, extra=1)
    serve(mgr, "a", a)
    serve(mgr, "b", blocks(100, 2, extra=1))
    c = mgr.new_request("c", blocks(500, 7, extra=0))
    mgr.match_prefix(c)
    assert mgr.allocate(c, 7 * BS)
    mgr.free(c)
    run_plans(mgr)
    d = mgr.new_request("d", a)
    m = mgr.match_prefix(d)
    assert m.num_storage_blocks > 0
    planned = mgr.prefetch(d)
    assert planned > 0
    run_plans(mgr)
    after = mgr.match_prefix(d)
    assert after.num_storage_blocks == 0  # the fetched blocks hang below the anchor: hits
    assert after.num_device_blocks + after.num_host_blocks == m.num_device_blocks + m.num_host_blocks + planned
    mgr.assert_invariants([d])


def hits(m) -> int:
    return m.num_device_blocks + m.num_host_blocks


def _stored(n_blocks: int, chunk: int = 2):
    storage = SimulatedStorage()
    serve(
        CacheManager(block_size=BS, num_device_blocks=16, num_host_blocks=16, storage=storage, write_policy="write_through"),
        "w",
        blocks(0, n_blocks),
    )
    return CacheManager(block_size=BS, num_device_blocks=16, num_host_blocks=16, storage=storage, fetch_chunk_blocks=chunk)


def test_a_prefix_being_fetched_is_not_fetched_again():
    mgr = _stored(8)
    a, b = mgr.new_request("a", blocks(0, 6)), mgr.new_request("b", blocks(0, 8))
    mgr.match_prefix(a)
    assert mgr.prefetch(a) == 6
    mgr.match_prefix(b)
    assert mgr.prefetch(b) == 8  # 6 on their way for a, 2 of its own
    plan = mgr.take_plan()
    items = sorted((op for op in plan.fetches), key=lambda op: -op.op_id)  # complete newest first
    assert sum(op.num_blocks for op in items) == 8  # not 6 + 8
    assert mgr.host_pool.num_used == 8
    for op in items:  # b's chunk first: it waits (parked) for a's
        mgr.complete(op.op_id)
        mgr.assert_invariants([a, b])
    run_plans(mgr)  # (their preloads to the device)
    assert mgr.prefetch_pending(a) == mgr.prefetch_pending(b) == 0
    assert hits(mgr.match_prefix(b)) == 8
    mgr.assert_invariants([a, b])


def test_a_request_whose_prefix_is_all_on_its_way_waits_for_it():
    mgr = _stored(6)
    a, b = mgr.new_request("a", blocks(0, 6)), mgr.new_request("b", blocks(0, 6))
    mgr.match_prefix(a), mgr.prefetch(a)
    mgr.match_prefix(b)
    assert mgr.prefetch(b) == 6 and mgr.prefetch_pending(b) == 6  # nothing of its own
    plan = mgr.take_plan()
    assert sum(op.num_blocks for op in plan.fetches) == 6
    mgr.complete_plan(plan)
    run_plans(mgr)
    assert mgr.prefetch_pending(b) == 0 and hits(mgr.match_prefix(b)) == 6
    mgr.assert_invariants([a, b])


def test_when_the_shared_fetch_fails_the_follower_is_dropped_not_misplaced():
    mgr = _stored(8)
    a, b = mgr.new_request("a", blocks(0, 6)), mgr.new_request("b", blocks(0, 8))
    mgr.match_prefix(a), mgr.prefetch(a)
    mgr.match_prefix(b), mgr.prefetch(b)
    plan = mgr.take_plan()
    for op in plan.fetches:  # a's last chunk fails
        mgr.complete(op.op_id, [1] if op.keys[-1] == a.keys[5] else [])
    run_plans(mgr)
    assert hits(mgr.match_prefix(b)) == 5  # up to the failed block; b's 2 were freed
    assert mgr.host_pool.num_used == 5
    mgr.assert_invariants([a, b])


# ------------------------------------------------------------------ the invariant checker
def test_the_invariant_checker_catches_a_leaked_block_and_a_lock_with_no_holder():
    """cache/invariants.py must fail on a broken state, or every test that calls it proves nothing."""
    mgr = CacheManager(block_size=BS, num_device_blocks=8)
    serve(mgr, "a", blocks(0, 2))
    mgr.assert_invariants()
    leaked = mgr.device_pool.allocate(1)  # taken from the pool, owned by nobody
    with pytest.raises(AssertionError, match=f"device block {leaked[0]} leaked"):
        mgr.assert_invariants()
    mgr.device_pool.free(leaked)
    mgr.assert_invariants()
    node = next(iter(mgr.tree.nodes.values()))
    node.lock_ref += 1  # a lock nobody holds
    with pytest.raises(AssertionError, match="lock_ref 1 != holders"):
        mgr.assert_invariants()


# ------------------------------------------------------------------ reset (POST /reset_prefix_cache)
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_reset_drops_every_block_no_request_holds_and_leaves_the_pool(policy):
    storage = SimulatedStorage()
    mgr = CacheManager(block_size=BS, num_device_blocks=16, num_host_blocks=16, storage=storage, write_policy=policy)
    a, b = blocks(100, 3), blocks(200, 2)
    serve(mgr, "a", a)
    held = mgr.new_request("b", b)  # running: its blocks must stay
    mgr.match_prefix(held)
    assert mgr.allocate(held, len(b))
    run_plans(mgr)
    mgr.commit(held, len(b))
    run_plans(mgr)
    moved = dict(mgr.stats.bytes_moved)
    dropped = mgr.reset_prefix_cache()
    assert not mgr.take_plan()  # nothing copied down on the way out
    assert dict(mgr.stats.bytes_moved) == moved
    # write_through: a's host copies and b's (b needs its device blocks only); write_back: none made
    assert dropped == {"device": 3, "host": 5 if policy == "write_through" else 0}
    mgr.assert_invariants([held])
    m = mgr.match_prefix(mgr.new_request("a2", a))  # a: gone from device and host, still in the pool
    assert (m.num_device_blocks, m.num_host_blocks, m.num_storage_blocks) == (0, 0, 3 if policy == "write_through" else 0)
    m = mgr.match_prefix(mgr.new_request("b2", b))  # b: held, so still on the device
    assert m.num_device_blocks == 2
    mgr.free(held)
    run_plans(mgr)
    assert mgr.reset_prefix_cache()["device"] == 2
    assert mgr.device_pool.num_used == 0 and mgr.host_pool.num_used == 0
    mgr.assert_invariants()
