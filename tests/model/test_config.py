"""ModelConfig normalizes the key spellings real checkpoints use."""

from __future__ import annotations

import pytest
import torch

from kvtier.model import ModelConfig
from kvtier.model.layers import rope_inv_freq

LLAMA31 = {  # abridged Llama-3.1-8B config.json (transformers 4.x spelling)
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "torch_dtype": "bfloat16",
    "eos_token_id": [128001, 128008, 128009],
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
}


def test_legacy_rope_keys_and_eos_list_are_normalized():
    cfg = ModelConfig.from_hf_dict(LLAMA31)
    assert cfg.rope_theta == 500000.0 and cfg.rope_type == "llama3"
    assert cfg.head_dim == 128 and cfg.num_kv_heads == 8 and cfg.torch_dtype == torch.bfloat16
    assert cfg.eos_token_ids == (128001, 128008, 128009) and not cfg.is_moe


def test_generation_config_eos_wins_over_config_eos():
    cfg = ModelConfig.from_hf_dict(LLAMA31, {"eos_token_id": 7})
    assert cfg.eos_token_ids == (7,)


def test_old_yarn_spelling_type_key():
    hf = dict(
        LLAMA31,
        architectures=["Qwen2ForCausalLM"],
        max_position_embeddings=32768,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    )
    cfg = ModelConfig.from_hf_dict(hf)
    inv_freq, attention_factor = rope_inv_freq(cfg)
    assert cfg.rope_type == "yarn" and cfg.qkv_bias
    assert inv_freq.shape == (64,) and attention_factor == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)


def test_qwen3_moe_expert_count_under_either_key():
    base = dict(
        LLAMA31,
        architectures=["Qwen3MoeForCausalLM"],
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
    )
    for key in ("num_experts", "num_local_experts"):
        cfg = ModelConfig.from_hf_dict({**base, key: 128})
        assert cfg.num_experts == 128 and cfg.moe_layer_ids == tuple(range(32)) and cfg.qk_norm


def test_unsupported_rope_type_is_named():
    cfg = ModelConfig.from_hf_dict(dict(LLAMA31, rope_scaling={"rope_type": "longrope", "factor": 2.0}))
    with pytest.raises(ValueError, match="longrope"):
        rope_inv_freq(cfg)
