"""DeepSeek-V2/V3 (multi-head latent attention) served by kvtier's engine: greedy tokens of
kvtier.LLM == transformers `generate` on the same checkpoint, cold and through every tier (a device
prefix hit, chunked prefill, batching, a host hit, a storage hit), on caches of one latent per token
(``ModelConfig.kv_layout`` (1, kv_width)). fp32 on CPU."""

from __future__ import annotations

import math

import pytest
import torch

import kvtier
from kvtier.engine.sizing import block_nbytes
from kvtier.model import ModelConfig, load_model
from kvtier.model.deepseek import DeepseekForCausalLM
from tests.engine.hf_reference import GREEDY, prompts_for
from tests.model.test_mla import DEEPSEEK_V3, MLA_PRESETS


def _latent_layout(llm: kvtier.LLM, cfg: ModelConfig, num_blocks: int, block_size: int) -> None:
    """The engine's device tier is one latent plane per layer: [1, blocks + scratch, block_size, kv_width]."""
    caches = llm.kv_caches
    assert len(caches) == cfg.num_layers
    assert all(tuple(kv.shape) == (1, num_blocks + 1, block_size, cfg.kv_width) for kv in caches)


@pytest.mark.parametrize("preset", MLA_PRESETS)
def test_cold_then_prefix_hit_match_transformers(preset, checkpoint, reference):
    prompts = prompts_for(1)
    want = reference(preset, prompts)
    with kvtier.LLM(checkpoint(preset), num_device_blocks=64, block_size=8) as llm:
        _latent_layout(llm, ModelConfig.from_hf_dir(checkpoint(preset)), 64, 8)
        cold = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in cold] == want
        assert all(o.num_cached_tokens == 0 for o in cold)
        warm = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in warm] == want
        # every full block of the prompt but the one holding the last token is a device hit
        assert [o.num_cached_tokens for o in warm] == [(len(p) - 1) // 8 * 8 for p in prompts]
        assert all(o.cached_tokens_by_tier["device"] == o.num_cached_tokens for o in warm)


@pytest.mark.parametrize("preset", MLA_PRESETS)
def test_chunked_prefill_and_batching_match(preset, checkpoint, reference):
    prompts = prompts_for(2)
    want = reference(preset, prompts)
    # prompts of up to 66 tokens in chunks of 7, all four in one batch
    with kvtier.LLM(checkpoint(preset), num_device_blocks=64, max_num_batched_tokens=7) as llm:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
    with kvtier.LLM(checkpoint(preset), num_device_blocks=64) as llm:  # one request at a time
        alone = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]
    assert alone == want


@pytest.mark.parametrize("preset", MLA_PRESETS)
def test_triton_decode_kernel_matches_transformers(preset, checkpoint, reference):
    """attention_backend="triton": decode rows on model/triton_mla.py's kernel (on a GPU, or under
    Triton's interpreter on a CPU), prefill chunks on the torch reference; cold, then a prefix hit."""
    pytest.importorskip("triton", reason="triton is not installed: the Triton MLA kernel is untested")
    prompts = prompts_for(7, lengths=(30, 19))
    want = reference(preset, prompts)
    kw = dict(num_device_blocks=64, block_size=8, attention_backend="triton", dtype="float32")
    with kvtier.LLM(checkpoint(preset), device="cuda" if torch.cuda.is_available() else "cpu", **kw) as llm:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
        warm = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in warm] == want and all(o.num_cached_tokens > 0 for o in warm)


def test_host_hit_returns_identical_tokens(checkpoint, reference):
    preset = "deepseek-v3-tiny"
    a, b = prompts_for(4, lengths=(60, 60))
    want = reference(preset, [a])
    with kvtier.LLM(
        checkpoint(preset), num_device_blocks=12, block_size=8, num_host_blocks=64, write_policy="write_through"
    ) as llm:
        cfg = ModelConfig.from_hf_dir(checkpoint(preset))
        assert tuple(llm.host_kv.shape) == (64, cfg.num_layers, 1, 8, cfg.kv_width)
        assert llm.generate([a], GREEDY)[0].token_ids == want[0]
        llm.generate([b], GREEDY)  # pushes a's blocks out of the device tier
        again = llm.generate([a], GREEDY)[0]
        assert again.cached_tokens_by_tier["host"] > 0
        assert again.token_ids == want[0]


def test_storage_hit_returns_identical_tokens(checkpoint, reference, tmp_path):
    preset = "deepseek-v3-tiny"
    a, b, c = prompts_for(5, lengths=(60, 60, 60))
    want = reference(preset, [a])
    with kvtier.LLM(
        checkpoint(preset),
        num_device_blocks=10,
        block_size=8,
        num_host_blocks=8,
        storage=f"file://{tmp_path}/pool",
        write_policy="write_through",
    ) as llm:
        assert llm.generate([a], GREEDY)[0].token_ids == want[0]
        llm.generate([b], GREEDY)
        llm.generate([c], GREEDY)  # a is now only in storage
        again = llm.generate([a], GREEDY)[0]
        assert again.cached_tokens_by_tier["storage"] > 0
        assert again.token_ids == want[0]
    # a new engine on the same pool reads what the first wrote: the blocks are whole objects
    with kvtier.LLM(
        checkpoint(preset), num_device_blocks=10, block_size=8, num_host_blocks=8, storage=f"file://{tmp_path}/pool"
    ) as llm:
        fresh = llm.generate([a], GREEDY)[0]
        assert fresh.cached_tokens_by_tier["storage"] > 0
        assert fresh.token_ids == want[0]


def test_a_block_holds_one_latent_per_token_and_layer():
    v3 = ModelConfig.from_hf_dict(DEEPSEEK_V3).with_mtp(False)  # 61 layers, a 512 + 64 latent
    assert v3.kv_layout == (1, 576)
    assert block_nbytes(v3, 16, torch.bfloat16) == 576 * 61 * 16 * 2
    # full attention keeps K and V of every KV head: 2 x 8 x 128 per token and layer
    gqa = ModelConfig.from_hf_dict({**DEEPSEEK_V3, "architectures": ["LlamaForCausalLM"], "num_key_value_heads": 8})
    gqa = gqa.with_mtp(False)
    assert gqa.kv_layout == (2, 8, gqa.head_dim)
    assert block_nbytes(gqa, 16, torch.bfloat16) == 2 * 8 * gqa.head_dim * 61 * 16 * 2
    assert block_nbytes(v3, 16, torch.float32) == math.prod(v3.kv_layout) * 61 * 16 * 4


@pytest.mark.parametrize("preset", MLA_PRESETS)
def test_engine_loader_loads_latent_attention(preset, checkpoint):
    assert isinstance(load_model(checkpoint(preset)), DeepseekForCausalLM)


def test_drafts_without_an_mtp_block_and_cuda_graphs_are_refused_by_name(checkpoint):
    path = checkpoint("deepseek-v3-tiny")
    with pytest.raises(ValueError, match="num_nextn_predict_layers is 0 or absent"):
        kvtier.LLM(path, num_device_blocks=16, num_speculative_tokens=1)  # (deepseek-v3-mtp-tiny has one)
    with pytest.raises(ValueError, match="cuda_graphs=True is not supported for DeepseekV3ForCausalLM"):
        kvtier.LLM(path, num_device_blocks=16, cuda_graphs=True)


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (one H200 runs it: pytest tests/engine/test_mla_engine.py)"
)
@pytest.mark.parametrize("preset", MLA_PRESETS)
def test_cuda_latent_cache_through_device_host_and_storage_hits_matches_transformers(preset, checkpoint, reference, tmp_path):
    """On a GPU (fp32, torch attention, the latent copy kernels): cold, a device hit, a host hit and a
    storage hit all give transformers' greedy tokens."""
    a, b, c = prompts_for(6, lengths=(60, 60, 60))
    want = reference(preset, [a])[0]
    kw = dict(device="cuda", dtype="float32", block_size=8, write_policy="write_through")
    with kvtier.LLM(checkpoint(preset), num_device_blocks=10, num_host_blocks=64, **kw) as llm:
        assert llm.generate([a], GREEDY)[0].token_ids == want
        device_hit = llm.generate([a], GREEDY)[0]
        assert device_hit.cached_tokens_by_tier["device"] > 0 and device_hit.token_ids == want
        llm.generate([b], GREEDY)  # a leaves the device tier; the host tier holds both
        host_hit = llm.generate([a], GREEDY)[0]
        assert host_hit.cached_tokens_by_tier["host"] > 0 and host_hit.token_ids == want
    with kvtier.LLM(checkpoint(preset), num_device_blocks=10, num_host_blocks=8, storage=f"file://{tmp_path}/p", **kw) as llm:
        llm.generate([a], GREEDY)
        llm.generate([b], GREEDY)
        llm.generate([c], GREEDY)  # a is now only in storage
        storage_hit = llm.generate([a], GREEDY)[0]
        assert storage_hit.cached_tokens_by_tier["storage"] > 0 and storage_hit.token_ids == want
