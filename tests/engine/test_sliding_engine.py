"""gpt-oss, Gemma 2 and Gemma 3 (hybrid sliding-window / full attention) served by kvtier's engine:
greedy tokens of kvtier.LLM == transformers `generate` on the same checkpoint, with prompts several
windows long (the tiny presets slide over 8 tokens), cold and through every tier (a device prefix
hit, chunked prefill, batching, a host hit, a storage hit), under swap preemption and across a PD
hand-off; gpt-oss's routed experts equal transformers' router. fp32 on CPU."""

from __future__ import annotations

import numpy as np
import pytest

import kvtier
from kvtier.engine.config import EngineConfig
from kvtier.engine.core import EngineCore
from kvtier.model import ModelConfig
from tests.engine.hf_reference import GREEDY, prompts_for
from tests.engine.test_routed_experts import hf_router_topk

SLIDING_PRESETS = ["gpt-oss-tiny", "gemma2-tiny", "gemma3-tiny"]
LONG = (60, 61)  # 7 windows and more; one prompt ends on a block boundary's far side


def test_tiny_presets_slide_over_fewer_tokens_than_the_prompts(checkpoint):
    for preset in SLIDING_PRESETS:
        cfg = ModelConfig.from_hf_dir(checkpoint(preset))
        kinds = {g.kind for g in cfg.attention_groups}
        assert kinds == {"full_attention", "sliding_attention"}, preset
        assert cfg.sliding_window is not None and cfg.sliding_window * 4 < min(LONG)


@pytest.mark.parametrize("preset", SLIDING_PRESETS)
def test_cold_then_device_prefix_hit_match_transformers(preset, checkpoint, reference):
    prompts = prompts_for(31, lengths=LONG)
    want = reference(preset, prompts)
    with kvtier.LLM(checkpoint(preset), num_device_blocks=64, block_size=8) as llm:
        cold = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in cold] == want
        assert all(o.num_cached_tokens == 0 for o in cold)
        warm = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in warm] == want
        # every full block of the prompt but the one holding the last token is a device hit
        assert [o.num_cached_tokens for o in warm] == [(len(p) - 1) // 8 * 8 for p in prompts]
        assert all(o.cached_tokens_by_tier["device"] == o.num_cached_tokens for o in warm)
        llm.cache.assert_invariants()


@pytest.mark.parametrize("preset", SLIDING_PRESETS)
def test_chunked_prefill_and_batching_match(preset, checkpoint, reference):
    prompts = prompts_for(32, lengths=(3, 17, 40, 66))
    want = reference(preset, prompts)
    # prompts of up to 66 tokens in chunks of 7 (chunks shorter than the window), all four in one batch
    with kvtier.LLM(checkpoint(preset), num_device_blocks=64, max_num_batched_tokens=7) as llm:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
        llm.cache.assert_invariants()


@pytest.mark.parametrize("preset", SLIDING_PRESETS)
def test_host_hit_returns_identical_tokens(preset, checkpoint, reference):
    a, b = prompts_for(33, lengths=(60, 60))
    want = reference(preset, [a])
    with kvtier.LLM(
        checkpoint(preset), num_device_blocks=12, block_size=8, num_host_blocks=64, write_policy="write_through"
    ) as llm:
        assert llm.generate([a], GREEDY)[0].token_ids == want[0]
        llm.generate([b], GREEDY)  # pushes a's blocks out of the device tier
        again = llm.generate([a], GREEDY)[0]
        assert again.cached_tokens_by_tier["host"] > 0, again.cached_tokens_by_tier
        assert again.token_ids == want[0]
        llm.cache.assert_invariants()


@pytest.mark.parametrize("preset", SLIDING_PRESETS)
def test_storage_hit_returns_identical_tokens(preset, checkpoint, reference, tmp_path):
    a, b, c = prompts_for(34, lengths=(60, 60, 60))
    want = reference(preset, [a])
    kw = dict(num_device_blocks=10, block_size=8, num_host_blocks=8, storage=f"file://{tmp_path}/pool")
    with kvtier.LLM(checkpoint(preset), write_policy="write_through", **kw) as llm:
        assert llm.generate([a], GREEDY)[0].token_ids == want[0]
        llm.generate([b], GREEDY)
        llm.generate([c], GREEDY)  # a is now only in storage
        again = llm.generate([a], GREEDY)[0]
        assert again.cached_tokens_by_tier["storage"] > 0, again.cached_tokens_by_tier
        assert again.token_ids == want[0]
    with kvtier.LLM(checkpoint(preset), **kw) as llm:  # a new engine on the same pool
        fresh = llm.generate([a], GREEDY)[0]
        assert fresh.cached_tokens_by_tier["storage"] > 0
        assert fresh.token_ids == want[0]


@pytest.mark.parametrize("preset", SLIDING_PRESETS)
def test_swap_preemption_loads_back_and_matches_transformers(preset, checkpoint, reference):
    prompts = prompts_for(35, lengths=(30, 41, 52, 63))
    want = reference(preset, prompts)
    with kvtier.LLM(
        checkpoint(preset),
        num_device_blocks=20,
        block_size=8,
        preemption_mode="swap",
        num_host_blocks=64,
        write_policy="write_through_selective",
        write_through_threshold=4,
    ) as llm:
        got = llm.generate(prompts, GREEDY)
        assert llm.scheduler.num_preemptions > 0
        assert llm.cache.stats.swapped_out_blocks > 0
        assert [o.token_ids for o in got] == want
        pool = llm.cache.device_pool
        assert pool.num_free + llm.cache.tree.num_device_copies == pool.num_blocks
        llm.cache.assert_invariants()


def _run(core: EngineCore, **add) -> kvtier.RequestOutput:
    req = core.add_request(**add)
    for _ in range(10_000):
        for out in core.step():
            if out.request_id == req.request_id:
                core.cache.assert_invariants()
                return out
    raise AssertionError("request never finished")


@pytest.mark.parametrize("preset", SLIDING_PRESETS)
def test_pd_handoff_decodes_transformers_tokens(preset, checkpoint, reference, tmp_path):
    (prompt,) = prompts_for(36, lengths=(61,))
    want = reference(preset, [prompt])[0]
    url, config = f"file://{tmp_path}", EngineConfig(num_host_blocks=64, block_size=8)
    path = checkpoint(preset)
    with EngineCore(path, config, storage=url) as p, EngineCore(path, config, storage=url) as d:
        first = _run(p, prompt=prompt, params=kvtier.SamplingParams(max_tokens=1), export=True)
        assert first.handoff["complete"] and first.token_ids == want[:1]
        out = _run(d, prompt=prompt, params=GREEDY, handoff=first.handoff)
        assert out.token_ids == want
        assert out.cached_tokens_by_tier == {"device": 0, "host": 0, "storage": len(prompt)}


@pytest.mark.parametrize("preset", SLIDING_PRESETS)
def test_speculative_decoding_and_tensor_parallelism_are_refused_by_name(preset, checkpoint):
    path = checkpoint(preset)
    arch = ModelConfig.from_hf_dir(path).architecture
    with pytest.raises(ValueError, match=f"num_speculative_tokens > 0 is not supported for {arch}"):
        kvtier.LLM(path, num_device_blocks=16, num_speculative_tokens=1)
    with pytest.raises(ValueError, match=f"tensor_parallel_size=2 is not supported for {arch}"):
        kvtier.LLM(path, num_device_blocks=16, tensor_parallel_size=2)


def test_gpt_oss_routed_experts_equal_transformers_router_topk(checkpoint, hf_model):
    path = checkpoint("gpt-oss-tiny")
    prompts = prompts_for(37, lengths=(5, 41, 60))
    sp = kvtier.SamplingParams(max_tokens=8, ignore_eos=True, return_routed_experts=True)
    with kvtier.LLM(path, num_device_blocks=64, block_size=8, max_num_batched_tokens=16) as llm:
        outs = llm.generate(prompts, sp)
        warm = llm.generate(prompts, sp)  # through device hits
        top_k = llm.config.top_k
    for p, o, w in zip(prompts, outs, warm):
        seq = p + o.token_ids
        assert o.routed_experts.shape == (len(seq) - 1, 3, top_k)
        want = hf_router_topk(hf_model(path), seq[:-1], top_k)
        assert np.array_equal(np.sort(o.routed_experts, -1), np.sort(want, -1))
        assert w.token_ids == o.token_ids and np.array_equal(w.routed_experts, o.routed_experts)
