"""Sliding groups with blocks of their own (cache/sliding.py) through the engine on CPU: the
sliding layers' caches are a few blocks, a long request holds one window of them at every step,
and greedy tokens still equal transformers' — cold, through device hits, and when a hit's window
blocks were taken (the hit falls back to a prefix whose windows are all there)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import kvtier
from kvtier.engine.config import EngineConfig
from kvtier.engine.core import EngineCore
from kvtier.model import ModelConfig
from tests.engine.hf_reference import GREEDY, prompts_for

SLIDING_PRESETS = ["gpt-oss-tiny", "gemma2-tiny", "gemma3-tiny"]


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def long_gemma2(checkpoint, tmp_path_factory):
    """gemma2-tiny with a 16-token window and a 2,048-token context (the weights do not depend on either)."""
    path = tmp_path_factory.mktemp("gemma2-long")
    shutil.copytree(checkpoint("gemma2-tiny"), path, dirs_exist_ok=True)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "sliding_window": 16, "max_position_embeddings": 2048}))
    return path


def run_holding(path, config: EngineConfig, prompt: list[int], n_new: int, window_blocks: int, chunk_blocks: int):
    """``prompt`` and ``n_new`` greedy tokens through an EngineCore, checking after every step that
    the running request holds at most the blocks its window straddles (and a chunk's while it
    prefills) in every sliding group; (its output, the most it held)."""
    with EngineCore(path, config) as core:
        groups = core.cache.sliding_groups
        req = core.add_request(prompt=prompt, params=kvtier.SamplingParams(max_tokens=n_new, ignore_eos=True))
        most, out = 0, None
        while out is None:
            done = [o for o in core.step() if o.request_id == req.request_id]  # its output, once finished
            for g in groups:
                held = g.pool.num_used - len(g.retained)  # slots a running request reads
                most = max(most, held)
                prefilling = req.num_computed_tokens <= len(prompt)
                assert held <= window_blocks + (chunk_blocks if prefilling else 0), (held, req.num_computed_tokens)
            if done or req.num_computed_tokens % 64 == 0:
                core.cache.assert_invariants([] if done else [req.cache_req])
            out = done[0] if done else None
    return out, most


def test_a_2000_token_request_holds_window_over_block_size_plus_one_sliding_blocks(long_gemma2, hf_model):
    cfg = ModelConfig.from_hf_dir(long_gemma2)
    assert [(g.window, len(g.layer_ids)) for g in cfg.attention_groups] == [(16, 2), (None, 1)]
    (prompt,) = prompts_for(41, lengths=(40,))
    config = EngineConfig(num_device_blocks=260, block_size=8, max_num_seqs=1, max_num_batched_tokens=8)
    with EngineCore(long_gemma2, config) as core:  # the sliding layers' caches: 5 blocks (and the scratch), not 260
        assert core.cache.sliding_groups[0].pool.num_blocks == 1 * (16 // 8 + 2) + 1 == 5
        assert [tuple(kv.shape[:3]) for kv in core.kv_caches] == [(2, 6, 8), (2, 261, 8), (2, 6, 8)]
    out, most = run_holding(long_gemma2, config, prompt, 1960, 16 // 8 + 1, 1)
    assert most == 3  # 16 / 8 + 1, at 2,000 tokens as at 40
    assert out.token_ids[:300] == hf_greedy(hf_model(long_gemma2), prompt, 300)


@pytest.mark.parametrize("preset", SLIDING_PRESETS)
def test_long_requests_hold_one_window_and_equal_every_block_kept(preset, checkpoint, hf_model):
    """460 tokens with window 8 and block 4: the sliding blocks are reused dozens of times; the
    tokens equal those of the same engine keeping every block (a host tier turns the groups off)
    all the way, and transformers' over the first 200 (further on, fp32 rounding differences
    between two exact implementations may flip a near-tie: keeping every block changes nothing)."""
    path = checkpoint(preset)
    (prompt,) = prompts_for(44, lengths=(40,))
    config = EngineConfig(num_device_blocks=130, block_size=4, max_num_seqs=1, max_num_batched_tokens=8)
    out, most = run_holding(path, config, prompt, 460, 8 // 4 + 1, 2)  # window 8, block 4
    assert most == 3
    sp = kvtier.SamplingParams(max_tokens=460, ignore_eos=True)
    with kvtier.LLM(path, num_device_blocks=130, block_size=4, max_num_batched_tokens=8, num_host_blocks=8) as llm:
        assert not llm.cache.sliding_groups
        assert llm.generate([prompt], sp)[0].token_ids == out.token_ids
    assert out.token_ids[:200] == hf_greedy(hf_model(path), prompt, 200)


@pytest.mark.parametrize("preset", SLIDING_PRESETS)
def test_device_hits_read_the_retained_window_and_match_transformers(preset, checkpoint, reference):
    a, b = prompts_for(42, lengths=(60, 61))
    want = reference(preset, [a, b])
    with kvtier.LLM(checkpoint(preset), num_device_blocks=64, block_size=8) as llm:
        assert llm.cache.sliding_groups  # the sliding layers keep blocks of their own
        assert [o.token_ids for o in llm.generate([a], GREEDY)] == want[:1]
        # b shares a's first 40 tokens: a hit there reads a's window before position 40
        shared = a[:40] + b[40:]
        got = llm.generate([a, shared], GREEDY)
        assert got[0].token_ids == want[0] and got[0].cached_tokens_by_tier["device"] == 56
        assert got[1].cached_tokens_by_tier["device"] == 40
        assert got[1].token_ids == reference(preset, [shared])[0]
        llm.cache.assert_invariants()


@pytest.mark.parametrize("preset", SLIDING_PRESETS)
def test_a_hit_whose_window_blocks_were_taken_falls_back_and_matches_transformers(preset, checkpoint, reference):
    a, b = prompts_for(43, lengths=(60, 60))
    want = reference(preset, [a])
    # 6 slots per sliding group: running b takes every slot a's finished window kept
    with kvtier.LLM(checkpoint(preset), num_device_blocks=64, block_size=4, max_num_seqs=1, max_num_batched_tokens=8) as llm:
        assert llm.cache.sliding_groups[0].pool.num_blocks == 6
        assert llm.generate([a], GREEDY)[0].token_ids == want[0]
        llm.generate([b], GREEDY)
        again = llm.generate([a], GREEDY)[0]
        assert llm.cache.tree.num_device_copies >= 2 * 59 // 4  # the full layers' blocks of a and b are all there
        assert again.num_cached_tokens == 0  # but no prefix of a has its window: computed again
        assert again.token_ids == want[0]
        hit = llm.generate([a], GREEDY)[0]  # a's window is back
        assert hit.cached_tokens_by_tier["device"] == 59 // 4 * 4 and hit.token_ids == want[0]
        llm.cache.assert_invariants()
