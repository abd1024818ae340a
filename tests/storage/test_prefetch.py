"""Prefetch policies and the fetch-vs-recompute decision, end to end on a file pool slowed on
purpose (``throttle=``): what lands is used, what does not is recomputed, outputs never change."""

from __future__ import annotations

import numpy as np
import pytest

import kvtier

ONE = kvtier.SamplingParams(max_tokens=4, ignore_eos=True)
KW = dict(num_host_blocks=64, block_size=8, write_policy="write_through")
PROMPT = np.random.default_rng(0).integers(0, 300, 440).tolist()  # 54 full blocks + 8 tokens


@pytest.fixture(scope="module")
def stored(checkpoint, tmp_path_factory):
    """(model, pool dir, cold output): the prompt's blocks written by a first engine."""
    model = checkpoint("llama-tiny")
    pool = tmp_path_factory.mktemp("pool")
    with kvtier.LLM(model, storage=f"file://{pool}", **KW) as w:
        cold = w.generate([PROMPT], ONE, cache_salt="s")[0]
    with kvtier.LLM(model, block_size=8) as plain:
        assert plain.generate([PROMPT], ONE)[0].token_ids == cold.token_ids
    return model, pool, cold


def serve(stored, url_suffix: str = "", **kw):
    model, pool, cold = stored
    with kvtier.LLM(model, storage=f"file://{pool}{url_suffix}", **KW, **kw) as llm:
        out = llm.generate([PROMPT], ONE, cache_salt="s")[0]
        llm.cache.assert_invariants()
    stats = llm.cache_stats()  # after close(): every fetch in flight has been drained
    llm.cache.assert_invariants()
    assert out.token_ids == cold.token_ids
    return out, stats


def test_wait_complete_uses_every_stored_block(stored):
    out, _ = serve(stored, "?throttle=1MB", storage_fetch="always", prefetch_policy="wait_complete")
    assert out.cached_tokens_by_tier == {"device": 0, "host": 0, "storage": 54 * 8}


def test_timeout_admits_with_the_chunks_that_landed(stored):
    # 4224-byte objects at 500 KB/s: the first chunk (32 blocks) lands at ~0.27 s, the rest at ~0.46 s
    out, stats = serve(stored, "?throttle=500KB", storage_fetch="always", prefetch_policy="timeout", prefetch_timeout=(0.36, 0.0))
    assert out.cached_tokens_by_tier["storage"] == 32 * 8  # the rest was recomputed
    assert stats["storage"]["hits"] == 54  # ... and still landed, later


def test_best_effort_waits_as_long_as_the_fetch_should_take(stored):
    out, stats = serve(stored, "?throttle=500KB", storage_fetch="always", prefetch_policy="best_effort")
    assert out.cached_tokens_by_tier["storage"] == 54 * 8
    assert stats["storage"]["fetch_cost"]["aggregate_gbps"] == pytest.approx(500e3 / 1e9, rel=0.3)


def test_the_cost_model_recomputes_when_the_pool_is_slower_than_prefill(stored):
    model, pool, cold = stored
    with kvtier.LLM(model, storage=f"file://{pool}?throttle=50KB", **KW) as llm:
        llm.generate([PROMPT[:200]], ONE, cache_salt="warm")  # a prefill: the recompute rate
        out = llm.generate([PROMPT], ONE, cache_salt="s")[0]
        decisions = llm.cache_stats()["storage"]["fetch_cost"]["decisions"]
    assert out.token_ids == cold.token_ids and out.cached_tokens_by_tier["storage"] == 0
    assert decisions["recompute"] == 1 and decisions["fetch"] == 0


def test_the_cost_model_fetches_from_a_fast_pool(stored):
    out, stats = serve(stored)
    assert out.cached_tokens_by_tier["storage"] == 54 * 8
    assert stats["storage"]["fetch_cost"]["decisions"]["fetch"] == 1


def test_bad_prefetch_settings_are_named(stored):
    model, pool, _ = stored
    with pytest.raises(ValueError, match="prefetch_policy 'soon'"):
        kvtier.LLM(model, storage=f"file://{pool}", prefetch_policy="soon", **KW)
    with pytest.raises(ValueError, match="prefetch_timeout"):
        kvtier.LLM(model, storage=f"file://{pool}", prefetch_timeout=(-1, 0), **KW)
    with pytest.raises(ValueError, match="needs a host tier"):
        kvtier.LLM(model, storage=f"file://{pool}", num_host_blocks=0)
    with pytest.raises(ValueError, match="unknown storage URL scheme 's3'"):
        kvtier.LLM(model, storage="s3://bucket", num_host_blocks=8)


def test_write_through_stores_every_block_even_when_puts_pin_the_host_tier(checkpoint, tmp_path):
    """A host tier full of blocks whose puts are in flight (slow pool): backups wait for room
    instead of being dropped, so every block reaches the pool (close() drains the last ones)."""
    prompts = [np.random.default_rng(s).integers(0, 300, 440).tolist() for s in range(4)]
    with kvtier.LLM(
        checkpoint("llama-tiny"),
        storage=f"file://{tmp_path}?throttle=400KB",
        num_host_blocks=60,
        block_size=8,
        write_policy="write_through",
    ) as llm:
        for p in prompts:
            llm.generate([p], ONE)
        llm.cache.assert_invariants()
    stored = list(tmp_path.rglob("kvt:*"))
    assert len(stored) == 4 * ((440 + 4) // 8), len(stored)


def test_requests_sharing_a_stored_prefix_fetch_it_once(stored):
    model, pool, cold = stored
    longer = PROMPT + [7, 8, 9]
    with kvtier.LLM(model, storage=f"file://{pool}", storage_fetch="always", prefetch_policy="wait_complete", **KW) as llm:
        outs = llm.generate([PROMPT, PROMPT, longer], ONE, cache_salt="s")
        llm.cache.assert_invariants()
        stats = llm.cache_stats()["storage"]
    assert outs[0].token_ids == outs[1].token_ids == cold.token_ids
    # 54 blocks shared by all three (fetched once) + the 55th only the longer prompt can use
    assert stats["hits"] == 55
    assert [o.num_cached_tokens for o in outs] == [54 * 8, 54 * 8, 55 * 8]


def test_the_pool_is_asked_at_arrival_off_the_engine_thread(stored, monkeypatch):
    """A request's storage lookup runs on a storage thread from its arrival; the engine thread
    only takes the answer (it asks itself only when the request's hits moved since)."""
    import threading

    model, pool, cold = stored
    with kvtier.LLM(model, storage=f"file://{pool}", storage_fetch="always", **KW) as llm:
        threads = []
        real = llm.storage.lookup_prefix

        def lookup(keys):
            threads.append(threading.current_thread().name)
            return real(keys)

        monkeypatch.setattr(llm.storage, "lookup_prefix", lookup)
        out = llm.generate([PROMPT], ONE, cache_salt="s")[0]
        assert out.token_ids == cold.token_ids
        assert out.cached_tokens_by_tier["storage"] == 54 * 8
        assert threads and all(t.startswith("kvtier-lookup-arrival") for t in threads), threads
        # the same prompt again: device hits now; a longer one asks only past them, at arrival
        threads.clear()
        longer = PROMPT + [5] * 16
        out2 = llm.generate([longer], ONE, cache_salt="s")[0]
        assert out2.cached_tokens_by_tier["device"] == 55 * 8
        assert all(t.startswith("kvtier-lookup-arrival") for t in threads), threads
        llm.cache.assert_invariants()


def test_a_stale_arrival_lookup_is_asked_again(stored, monkeypatch):
    import kvtier.cache.probe as probe

    model, pool, cold = stored
    monkeypatch.setattr(probe, "PROBE_TTL_S", 0.0)  # every arrival answer is stale at once
    with kvtier.LLM(model, storage=f"file://{pool}", storage_fetch="always", **KW) as llm:
        before = llm.storage.counters["lookups"]
        out = llm.generate([PROMPT], ONE, cache_salt="s")[0]
        assert out.token_ids == cold.token_ids and out.cached_tokens_by_tier["storage"] == 54 * 8
        assert llm.storage.counters["lookups"] - before == 2  # at arrival, then again
