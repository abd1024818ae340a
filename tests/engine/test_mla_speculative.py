"""Speculative decoding on multi-head latent attention: DeepSeek-V3's MTP block (MLA over its own
latent cache, a MoE) drafts for a DeepSeek-V3 target, fp32 on CPU. The checks are those the
full-attention MTP model passes (tests/engine/test_speculative.py), run on ``deepseek-v3-mtp-tiny``:
greedy tokens equal those without drafts through device hits, host hits and swap preemption; every
draft is the MTP block's over the whole sequence (from scratch on its own latent cache); the MTP
layer's latents travel through the pool and a PD hand-off."""

from __future__ import annotations

import pytest

import kvtier
from kvtier.model import ModelConfig
from tests.engine import test_speculative as gqa
from tests.engine.hf_reference import GREEDY, prompts_for

PRESET = "deepseek-v3-mtp-tiny"


@pytest.fixture(scope="module")
def mla_mtp_model(checkpoint):
    return checkpoint(PRESET)


def test_drafted_greedy_tokens_equal_transformers(mla_mtp_model, reference):
    """The MTP block's own drafts (random weights: mostly rejected) and drafts the target accepts
    at 0.7 both leave transformers' greedy tokens unchanged."""
    prompts = prompts_for(3)
    want = reference(PRESET, prompts)
    with kvtier.LLM(mla_mtp_model, num_device_blocks=64, block_size=8, num_speculative_tokens=2) as llm:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
        assert llm.cache_stats()["speculative"]["drafted"] > 0
    with kvtier.LLM(mla_mtp_model, num_device_blocks=64, block_size=8, num_speculative_tokens=3) as llm:
        llm.spec.drafter = gqa.oracle_drafter({tuple(p): w for p, w in zip(prompts, want)}, 0.7)
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
        assert llm.cache_stats()["speculative"]["accepted"] > 0


def test_greedy_tokens_with_drafts_equal_those_without_through_the_tiers(mla_mtp_model):
    gqa.test_greedy_tokens_with_drafts_equal_those_without(mla_mtp_model, 3, 0.7)


def test_the_drafts_are_the_mtp_blocks_over_the_whole_sequence(mla_mtp_model):
    gqa.test_the_drafts_are_the_mtp_blocks_over_the_whole_sequence(mla_mtp_model, False, 0.7, False)


def test_the_mtp_latents_travel_through_the_pool(mla_mtp_model, tmp_path):
    gqa.test_the_mtp_kv_travels_through_the_pool_and_its_namespace_says_so(mla_mtp_model, tmp_path)


def test_a_pd_hand_off_carries_the_mtp_latents(mla_mtp_model, tmp_path):
    gqa.test_a_pd_hand_off_carries_the_mtp_kv(mla_mtp_model, tmp_path)


def test_the_tiers_hold_one_latent_plane_more_for_the_mtp_block(mla_mtp_model):
    cfg = ModelConfig.from_hf_dir(mla_mtp_model)
    gqa.test_the_host_tier_and_blocks_are_sized_with_the_mtp_layer(mla_mtp_model)
    with kvtier.LLM(mla_mtp_model, num_device_blocks=16, block_size=8, num_host_blocks=8, num_speculative_tokens=1) as llm:
        assert all(tuple(kv.shape) == (1, 17, 8, cfg.kv_width) for kv in llm.kv_caches)
        assert tuple(llm.host_kv.shape) == (8, cfg.num_layers + 1, 1, 8, cfg.kv_width)
