"""DeepSeek (multi-head latent attention) under tensor parallelism on CPU (gloo, one process per
rank): the heads are split and every rank caches the whole latent, so a block is the same bytes on
every rank and the pool holds it once (no ``:tp<rank>of<size>`` shards), written by rank 0 and read
by every rank, by an engine of another size, and by a PD decode engine of another size."""

from __future__ import annotations

import pytest

import kvtier
from tests.engine import test_tensor_parallel as gqa
from tests.engine.hf_reference import GREEDY, prompts_for

PRESET = "deepseek-v3-tiny"


def test_two_ranks_give_what_one_gives_and_transformers_gives(checkpoint, reference):
    prompts = prompts_for(8)
    want = reference(PRESET, prompts)
    with kvtier.LLM(checkpoint(PRESET), tensor_parallel_size=2, num_device_blocks=64, block_size=8) as llm:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want


@pytest.mark.slow  # two engines of two ranks through every tier (~30 s on 2 cores): CI runs it with -m slow
def test_two_ranks_give_what_one_gives_through_every_tier(checkpoint):
    """Device hits, host hits, swap preemption, routed experts (group-limited routing), logprobs."""
    runs = {}
    for tp in (1, 2):
        with kvtier.LLM(checkpoint(PRESET), tensor_parallel_size=tp, **gqa.TIERS) as llm:
            runs[tp] = gqa.workload(llm, moe=True)
            stats = llm.cache_stats()
            assert llm.scheduler.num_preemptions > 0 and stats["host"]["hit_tokens"] > 0
            llm.cache.assert_invariants()
    for a, b in zip(runs[1], runs[2]):
        assert a[:4] == b[:4]  # tokens, routed experts, hits per tier, top-k ids


def test_the_pool_holds_a_block_once_and_any_size_reads_it(checkpoint, tmp_path):
    path = checkpoint(PRESET)
    prompts = prompts_for(9, lengths=(48, 64))
    url = f"file://{tmp_path / 'pool'}"
    one = gqa.pool_run(path, f"file://{tmp_path / 'one'}", 1, prompts, True)
    two = gqa.pool_run(path, url, 2, prompts, True)  # two ranks write, two ranks read
    assert two == one and all(hits["storage"] >= 40 for _, _, hits in two)
    stored = sorted(p.name for p in (tmp_path / "pool").rglob("*") if p.is_file())
    single = sorted(p.name for p in (tmp_path / "one").rglob("*") if p.is_file())
    assert stored == single  # the same objects one rank writes: no shard per rank
    assert stored and not any("tp" in name.rsplit(":", 1)[-1] for name in stored)
    # a single-rank engine reads what two ranks wrote, and two ranks what one wrote
    assert gqa.pool_run(path, url, 1, prompts, True, write=False) == one
    assert gqa.pool_run(path, f"file://{tmp_path / 'one'}", 2, prompts, True, write=False) == one


@pytest.mark.slow  # three engines, two of two ranks: CI runs it with -m slow
def test_a_pd_hand_off_from_two_ranks_to_one(checkpoint, tmp_path):
    """P (two ranks) exports a prompt; D of one rank reads every block of it from the pool."""
    from tests.engine.test_handoff import run

    path = checkpoint(PRESET)
    prompt = prompts_for(10, lengths=(37,))[0]
    params = kvtier.SamplingParams(max_tokens=6, ignore_eos=True, return_routed_experts=True)
    with kvtier.LLM(path, block_size=8) as colo:
        ref = colo.generate([prompt], params)[0]
    kw = dict(storage=f"file://{tmp_path}", num_host_blocks=64, block_size=8)
    with kvtier.LLM(path, tensor_parallel_size=2, **kw) as p:
        first = run(p, prompt=prompt, params=kvtier.SamplingParams(max_tokens=1), export=True)
    h = first.handoff
    assert h["complete"] and h["failed_blocks"] == 0 and h["tensor_parallel_size"] == 1  # (one object a block)
    with kvtier.LLM(path, **kw) as d:
        out = run(d, prompt=prompt, params=params, handoff=h)
    assert out.token_ids == ref.token_ids and out.routed_experts.tolist() == ref.routed_experts.tolist()
    assert out.cached_tokens_by_tier == {"device": 0, "host": 0, "storage": 37}


@pytest.mark.slow  # three engines, one of two ranks: CI runs it with -m slow
def test_two_ranks_draft_with_the_mtp_block_as_one_does(checkpoint):
    gqa.test_two_ranks_draft_and_verify_as_one_does("deepseek-v3-mtp-tiny", 2, checkpoint)
