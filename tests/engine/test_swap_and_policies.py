"""Host tier through the async transfer engine (CPU twin): every family under every write policy
with a device tier small enough to evict, and swap preemption — greedy tokens equal HF
`transformers` (the `reference` fixture), routed experts equal a run without preemption."""

from __future__ import annotations

import numpy as np
import pytest

import kvtier
from tests.engine.hf_reference import FAMILIES, GREEDY, prompts_for

POLICIES = [("write_through", 2), ("write_through_selective", 1), ("write_back", 2)]


@pytest.mark.parametrize("policy,threshold", POLICIES, ids=[p for p, _ in POLICIES])
@pytest.mark.parametrize("preset", FAMILIES)
def test_host_hits_equal_transformers_under_each_write_policy(preset, policy, threshold, checkpoint, reference):
    a, b = prompts_for(21, lengths=(48, 48))
    want = reference(preset, [a])
    with kvtier.LLM(
        checkpoint(preset),
        num_device_blocks=9,
        block_size=8,
        num_host_blocks=48,
        write_policy=policy,
        write_through_threshold=threshold,
    ) as llm:
        assert llm.generate([a], GREEDY)[0].token_ids == want[0]
        llm.generate([b], GREEDY)  # pushes a's blocks off the device tier
        if policy == "write_through_selective":
            llm.generate([a], GREEDY)
            llm.generate([b], GREEDY)
        again = llm.generate([a], GREEDY)[0]
        assert again.token_ids == want[0]
        assert again.cached_tokens_by_tier["host"] > 0, again.cached_tokens_by_tier
        assert llm.transfer.num_in_flight == 0
        llm.cache.assert_invariants()


@pytest.mark.parametrize("preset", ["llama-tiny", "qwen3-moe-tiny"])
def test_swap_preemption_loads_back_and_matches_recompute_and_transformers(preset, checkpoint, reference):
    prompts = prompts_for(22, lengths=(30, 41, 52, 63))
    want = reference(preset, prompts)
    sp = kvtier.SamplingParams(max_tokens=GREEDY.max_tokens, ignore_eos=True, return_routed_experts=preset.endswith("moe-tiny"))
    outs = {}
    for mode in ("swap", "recompute", None):
        kwargs = dict(
            num_device_blocks=20,
            block_size=8,
            preemption_mode=mode,
            num_host_blocks=64 if mode == "swap" else 0,
            write_policy="write_through_selective",
            write_through_threshold=4,
        )
        if mode is None:  # plenty of room: no preemption at all
            kwargs.update(num_device_blocks=128, preemption_mode="recompute")
        with kvtier.LLM(checkpoint(preset), **kwargs) as llm:
            outs[mode] = llm.generate(prompts, sp)
            if mode is not None:
                assert llm.scheduler.num_preemptions > 0
            if mode == "swap":
                assert llm.cache.stats.swapped_out_blocks > 0
                hits = llm.cache.stats.hit_tokens  # came back from cache (device, or host by a load)
                assert hits["device"] + hits["host"] > 0
            pool = llm.cache.device_pool
            assert pool.num_free + llm.cache.tree.num_device_copies == pool.num_blocks
            assert all(n.lock_ref == 0 for n in llm.cache.tree.nodes.values())
    for mode, got in outs.items():
        assert [o.token_ids for o in got] == want, mode
        if got[0].routed_experts is not None:
            for o, base in zip(got, outs[None]):
                assert np.array_equal(o.routed_experts, base.routed_experts), mode


def test_preemption_mode_errors_name_the_problem(checkpoint):
    with pytest.raises(ValueError, match="needs a host tier"):
        kvtier.LLM(checkpoint("llama-tiny"), num_device_blocks=16, preemption_mode="swap")
    with pytest.raises(ValueError, match="'pause'"):
        kvtier.LLM(checkpoint("llama-tiny"), num_device_blocks=16, num_host_blocks=8, preemption_mode="pause")
