"""Sliding-window groups with blocks of their own (cache/sliding.py) under the CacheManager: a
running request holds only its window's slots, the slots it lets go stay retained for hits until
a request needs them, and a hit is cut back to the longest prefix whose windows every group still
has."""

from __future__ import annotations

import pytest

from kvtier.cache import CacheManager
from kvtier.cache.sliding import SlidingGroup

BS, WINDOW = 8, 16


def manager(num_device_blocks=400, num_slots=12, windows=(WINDOW,)) -> CacheManager:
    return CacheManager(block_size=BS, num_device_blocks=num_device_blocks, sliding=[(w, num_slots) for w in windows])


def held(req, group: int = 0) -> int:
    """Slots ``req`` holds in a group: its device blocks from the first one it still reads."""
    return len(req.block_table) - req.sliding_first[group]


def decode(mgr: CacheManager, rid, prompt: list[int], num_new: int, chunk: int, seen: list[int] | None = None):
    """A request through the manager as the scheduler drives it: the prompt in chunks, then one
    token per step; ``seen`` collects the slots held at each step."""
    tokens, total = list(prompt), len(prompt) + num_new
    req = mgr.new_request(rid, tokens)
    done = mgr.match_prefix(req).num_device_blocks * BS
    while done < total:
        end = min(done + chunk, len(prompt)) if done < len(prompt) else done + 1
        while len(tokens) < end:
            tokens.append(len(tokens) % 251)
        assert mgr.allocate(req, end)
        if seen is not None:
            seen.append(held(req))
        mgr.commit(req, end)
        mgr.assert_invariants([req])
        done = end
    return req


def test_a_long_request_holds_one_window_of_slots_at_every_decode_step():
    mgr = manager()
    g = mgr.sliding_groups[0]
    seen: list[int] = []
    req = decode(mgr, "long", list(range(40)), 1960, chunk=8, seen=seen)  # 2,000 tokens
    assert len(req.block_table) == 250  # the full layers keep every block
    assert g.blocks_per_window == WINDOW // BS + 1 == 3
    assert max(seen[5:]) == 3  # decode: the blocks a 16-token window straddles
    assert max(seen[:5]) <= -(-(WINDOW + 8 - 1) // BS) + 1  # a chunk of 8 reads its own window
    assert g.pool.num_used == held(req) + len(g.retained) <= 12  # the rest: retained, the latest ones
    assert all(b in g.retained for b in req.block_table[240:248])
    last_window = req.block_table[req.sliding_first[0] : 250]
    mgr.free(req)
    assert g.pool.num_used == len(g.retained) and all(b in g.retained for b in last_window[:-1])
    mgr.assert_invariants()


def test_the_next_turn_hits_the_last_window_and_reads_its_slots():
    mgr = manager()
    first = decode(mgr, "t1", list(range(100)), 1, chunk=16)
    history = list(first.token_ids)
    mgr.free(first)
    turn2 = mgr.new_request("t2", history + [7] * 20)
    m = mgr.match_prefix(turn2)
    assert m.num_device_blocks == len(history) // BS  # every committed block, its window kept
    assert mgr.allocate(turn2, len(turn2.token_ids))
    (table,) = mgr.sliding_tables(turn2, len(turn2.block_table))
    first_read = mgr.sliding_groups[0].first_needed(m.num_device_blocks * BS)
    assert all(s == 0 for s in table[:first_read]) and all(s >= 0 for s in table[first_read:])
    mgr.free(turn2)
    mgr.assert_invariants()


def test_a_hit_whose_window_slots_are_gone_falls_back_to_a_prefix_with_its_window():
    mgr = manager(num_slots=5)
    a = decode(mgr, "a", list(range(64)), 1, chunk=8)  # 8 blocks; the pool retains the last 5 it let go
    g = mgr.sliding_groups[0]
    mgr.free(a)
    assert [a.block_table.index(b) for b in g.retained] == [4, 5, 6, 7]
    # a longer prompt over a's 8 blocks: a hit of all 8 reads blocks 6 and 7's slots, there
    again = mgr.new_request("a2", list(range(64)) + [1, 2, 3])
    assert mgr.match_prefix(again).num_device_blocks == 8
    # another request needs every slot: a's retained ones go, their device blocks stay
    b = mgr.new_request("b", list(range(1000, 1040)))
    mgr.match_prefix(b)
    assert mgr.allocate(b, 40) and not g.retained
    again = mgr.new_request("a3", list(range(64)) + [1, 2, 3])
    m = mgr.match_prefix(again)
    assert mgr.tree.num_device_copies >= 8  # the full layers' blocks are all there ...
    assert m.num_device_blocks == 0  # ... but no prefix of them has its window: recompute it all
    mgr.free(b)
    mgr.assert_invariants()


def test_a_hit_is_the_longest_prefix_every_group_has_its_window_for():
    short, long_ = SlidingGroup(8, BS, 40, 16), SlidingGroup(24, BS, 40, 16)
    blocks = list(range(10))
    for g, with_slot in ((short, [2, 3, 9]), (long_, [0, 1, 2, 3, 7, 8, 9])):
        assert g.hold(with_slot)
    # a hit of k blocks reads [first_needed(8k), k): short needs 1 block there, long 3
    assert [short.longest_hit(blocks, k) for k in (10, 9, 4)] == [10, 4, 4]
    assert [long_.longest_hit(blocks, k) for k in (10, 9, 4)] == [10, 4, 4]
    assert short.longest_hit(blocks, 2) == 0 and long_.longest_hit(blocks, 2) == 2
    long_.release([8])  # block 8 has no slot now: the long window ending at 10 misses it
    assert long_.longest_hit(blocks, 10) == 4 and short.longest_hit(blocks, 10) == 10
    short.assert_invariants()
    long_.assert_invariants()


def test_a_request_without_slots_is_not_admitted_and_changes_nothing():
    mgr = manager(num_slots=3)
    a = mgr.new_request("a", list(range(40)))
    mgr.match_prefix(a)
    free_before = mgr.device_pool.num_free
    assert not mgr.allocate(a, 40)  # a 40-token prefill writes 5 blocks' slots
    assert mgr.device_pool.num_free == free_before and mgr.sliding_groups[0].pool.num_used == 0
    assert mgr.allocate(a, 16)  # in chunks it fits
    mgr.commit(a, 16)
    mgr.free(a)
    mgr.assert_invariants()


def test_sliding_groups_refuse_lower_tiers_by_name():
    with pytest.raises(ValueError, match="num_host_blocks=4"):
        CacheManager(block_size=BS, num_device_blocks=16, num_host_blocks=4, sliding=[(WINDOW, 4)])


def test_a_32k_request_of_gpt_oss_20b_geometry_holds_its_full_blocks_and_one_window():
    """gpt-oss-20b: 12 full and 12 sliding layers (window 128), block 16. A 32K-token request's
    device blocks, counted per layer, are those of its full layers plus one window per sliding
    layer: half of what keeping every block for every layer costs."""
    mgr = CacheManager(block_size=16, num_device_blocks=2100, sliding=[(128, 2100)])
    seen: list[int] = []
    req = decode(mgr, "32k", [t % 251 for t in range(32_704)], 64, chunk=2048, seen=seen)
    g = mgr.sliding_groups[0]
    assert len(req.block_table) == 2048 and g.blocks_per_window == 9
    assert max(seen[-64:]) == 9  # decode: 128 / 16 + 1
    full_layers, sliding_layers = 12, 12
    held = full_layers * len(req.block_table) + sliding_layers * max(seen[-64:])
    assert held == 24_684 and held / (full_layers + sliding_layers) / 2048 < 0.503  # vs 49,152 every block kept
