"""The compressed radix tree (cache/tree.py): segments split on divergence, merge after evictions,
and a match by segment always equals the reference match by chained key (``hasher.keys[i] in
tree.nodes``: every block's key names its whole prefix), for plain, LoRA and multimodal requests
sharing one tree."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.cache import CacheManager, MMItem

BS = 4


def serve(mgr: CacheManager, rid, tokens, **kw):
    req = mgr.new_request(rid, tokens, **kw)
    mgr.match_prefix(req)
    if not mgr.allocate(req, len(tokens)):
        mgr.free(req)
        return None
    mgr.commit(req, len(tokens))
    mgr.free(req)
    return req


def key_match(mgr: CacheManager, req) -> int:
    """Reference: leading blocks whose chained key the tree holds (no segment involved)."""
    max_blocks = (len(req.token_ids) - 1) // BS
    keys = mgr.sync_keys(req)
    n = 0
    while n < max_blocks and keys[n] in mgr.tree.nodes:
        n += 1
    return n


def segment_lengths(mgr: CacheManager) -> list[int]:
    out, stack = [], [mgr.tree.root_seg]
    while stack:
        seg = stack.pop()
        if seg is not mgr.tree.root_seg:
            out.append(len(seg.nodes))
        stack.extend(seg.children.values())
    return sorted(out)


def test_one_prompt_is_one_segment_and_a_divergence_splits_it():
    mgr = CacheManager(block_size=BS, num_device_blocks=64)
    a = list(range(10 * BS + 1))
    serve(mgr, "a", a)
    assert segment_lengths(mgr) == [10]  # one run, not ten nodes to walk
    b = a[: 6 * BS] + [999] * (3 * BS + 1)  # shares 6 blocks, then differs
    req = serve(mgr, "b", b)
    assert req.match.num_device_blocks == 6
    assert segment_lengths(mgr) == [3, 4, 6]  # split after block 6: a's 4, b's 3
    mgr.assert_invariants()
    m = mgr.match_prefix(mgr.new_request("c", a[: 8 * BS] + [5] * 9))  # diverges inside a's tail
    assert m.num_device_blocks == 8


def test_evicting_a_branch_merges_its_sibling_back():
    mgr = CacheManager(block_size=BS, num_device_blocks=14)
    a = list(range(10 * BS + 1))
    serve(mgr, "a", a)
    serve(mgr, "b", a[: 6 * BS] + [999] * (3 * BS + 1))
    assert segment_lengths(mgr) == [3, 4, 6]
    # 1 block free; a request of 5 blocks evicts 4 LRU leaves: a's branch (older), block by block
    serve(mgr, "x", [7000 + i for i in range(5 * BS)])
    mgr.assert_invariants()
    assert segment_lengths(mgr) == [5, 9]  # b's branch joined the shared run
    m = mgr.match_prefix(mgr.new_request("b2", a[: 6 * BS] + [999] * (3 * BS + 1)))
    assert m.num_device_blocks == 9
    # evicted labels were cut lazily: the merged segment still compares exactly
    assert mgr.match_prefix(mgr.new_request("a2", a)).num_device_blocks == 6


def test_lora_and_multimodal_blocks_never_match_plain_ones():
    mgr = CacheManager(block_size=BS, num_device_blocks=256)
    toks = list(range(8 * BS + 1))
    serve(mgr, "plain", toks)
    img = MMItem("img-a", offset=2 * BS, length=BS)
    lora = mgr.match_prefix(mgr.new_request("l", toks, lora_name="ad1"))
    mm = mgr.match_prefix(mgr.new_request("m", toks, mm_items=[img]))
    assert lora.num_device_blocks == 0
    assert mm.num_device_blocks == 2  # blocks before the image are plain
    serve(mgr, "m", toks, mm_items=[img])
    other = MMItem("img-b", offset=2 * BS, length=BS)
    assert mgr.match_prefix(mgr.new_request("m2", toks, mm_items=[other])).num_device_blocks == 2
    assert mgr.match_prefix(mgr.new_request("m3", toks, mm_items=[img])).num_device_blocks == 8
    mgr.assert_invariants()


_prompt = st.tuples(st.integers(0, 3), st.integers(0, 40), st.integers(0, 3), st.integers(0, 2))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_prompt, min_size=1, max_size=40), st.integers(8, 48))
def test_segment_match_equals_key_match(prompts, num_blocks):
    """Prompts from 4 stems with shared prefixes of any length, some with a LoRA or an image,
    through a small cache (evictions, splits, merges): the tree's match is the key reference."""
    mgr = CacheManager(block_size=BS, num_device_blocks=num_blocks)
    for i, (stem, cut, tail, kind) in enumerate(prompts):
        tokens = [stem * 1000 + j for j in range(cut)] + [50_000 + tail * 97 + j for j in range(tail * BS + 1)]
        kw = {} if kind == 0 else {"lora_name": "a"} if kind == 1 else {"mm_items": [MMItem(f"img{stem}", offset=BS, length=2)]}
        req = mgr.new_request(i, tokens, **kw)
        m = mgr.match_prefix(req)
        ref = mgr.new_request(-1, tokens, **kw)
        assert m.num_device_blocks + m.num_host_blocks == key_match(mgr, ref)
        assert mgr.sync_keys(req) == ref.keys  # the keys a match adopts from the segments = hashed
        if mgr.allocate(req, len(tokens)):
            mgr.commit(req, len(tokens))
        mgr.free(req)
        mgr.assert_invariants()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_prompt, min_size=1, max_size=40), st.integers(8, 48), st.sampled_from(["lru", "lfu"]))
def test_run_eviction_equals_block_by_block_eviction(prompts, num_blocks, policy):
    """Evicting a run of a segment in one cut (``evict_device_run``) takes the same blocks in the
    same order as evicting them one by one: after every request both trees hold the same keys
    on the same device blocks, and the same blocks are free."""
    mgrs = [CacheManager(block_size=BS, num_device_blocks=num_blocks, eviction=policy) for _ in range(2)]
    one_by_one = mgrs[1].tree
    run = one_by_one.evict_device_run
    one_by_one.evict_device_run = lambda node, limit: run(node, 1)  # type: ignore[method-assign]  # one block per cut
    for i, (stem, cut, tail, kind) in enumerate(prompts):
        tokens = [stem * 1000 + j for j in range(cut)] + [50_000 + tail * 97 + j for j in range(tail * BS + 1)]
        kw = {} if kind == 0 else {"lora_name": "a"}
        for mgr in mgrs:
            serve(mgr, i, tokens, **kw)
            mgr.assert_invariants()
        a, b = ({k: n.device_block for k, n in m.tree.nodes.items()} for m in mgrs)
        assert a == b
        assert mgrs[0].device_pool.free_blocks() == mgrs[1].device_pool.free_blocks()
        assert mgrs[0].stats.evictions == mgrs[1].stats.evictions


def test_label_ends_agree_with_block_ends():
    """``label_ends(i, n)``: where blocks i..n-1's labels end, from the start of block i's (block
    0's label starts with the seed), with and without per-block extras."""
    mgr = CacheManager(block_size=BS, num_device_blocks=8)
    for kw in ({}, {"lora_name": "a"}, {"mm_items": [MMItem("img", offset=BS, length=2)]}):
        h = mgr.new_request(0, list(range(7 * BS + 2)), **kw).hasher
        h.add_tokens(list(range(7 * BS + 2)))
        for i in range(7):
            for n in range(i + 1, 8):
                assert list(h.label_ends(i, n)) == [h.end(j) - h.end(i - 1) for j in range(i, n)], (kw, i, n)
