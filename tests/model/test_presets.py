"""init_model presets: transformers loads what they write; config and tokenizer agree."""

from __future__ import annotations

import pytest
import torch
import transformers

from kvtier.model import PRESETS, ModelConfig, init_model
from kvtier.model.presets import preset_architecture
from kvtier.model.shard import shard_config
from kvtier.model.tokenizer import EOS_TOKEN_ID, VOCAB_SIZE
from tests.model.paged_helpers import TINY_PRESETS


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_tiny_preset_config_and_tokenizer_agree(preset, checkpoint):
    path = checkpoint(preset)
    cfg = ModelConfig.from_hf_dir(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)

    assert cfg.vocab_size >= len(tokenizer) == VOCAB_SIZE
    assert cfg.eos_token_ids == (EOS_TOKEN_ID,) and tokenizer.eos_token_id == EOS_TOKEN_ID
    assert tokenizer.decode(tokenizer("héllo, wörld")["input_ids"]) == "héllo, wörld"
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert cfg.is_moe == (cfg.num_moe_layers > 0) == ("moe" in preset or "mixtral" in preset)


def test_tiny_presets_exercise_rope_scalings_and_tied_embeddings(checkpoint):
    configs = [ModelConfig.from_hf_dir(checkpoint(p)) for p in TINY_PRESETS]
    assert {"default", "llama3", "yarn"} <= {c.rope_type for c in configs}
    assert any(c.tie_word_embeddings for c in configs) and any(c.num_kv_heads < c.num_heads for c in configs)


def test_greedy_tokens_of_random_checkpoint_are_not_constant(checkpoint, hf_model):
    hf = hf_model(checkpoint("qwen3-moe-tiny"))
    with torch.no_grad():
        greedy = hf(torch.arange(40)[None]).logits[0].argmax(-1)
    assert len(set(greedy.tolist())) > 5


BENCH_PRESETS = ["qwen3-0.6b-shape", "qwen3-moe-small", "llama3-70b-shape", "deepseek-v3-shape"]


@pytest.mark.parametrize("preset", [*BENCH_PRESETS, "gpt-oss-20b-shape", "gemma3-12b-shape"])
def test_benchmark_preset_shapes(preset):
    spec = PRESETS[preset]
    hf_config = getattr(transformers, spec["config_class"])(**spec["kwargs"])
    arch = preset_architecture(preset)
    cfg = ModelConfig.from_hf_dict({**hf_config.to_dict(), "architectures": [arch]})
    assert spec["dtype"] == "bfloat16" and cfg.vocab_size >= VOCAB_SIZE
    if preset == "qwen3-0.6b-shape":
        assert (
            cfg.hidden_size,
            cfg.num_layers,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.intermediate_size,
            cfg.vocab_size,
            cfg.tie_word_embeddings,
        ) == (1024, 28, 16, 8, 128, 3072, 151936, True)
    elif preset == "llama3-70b-shape":  # Llama-3.1-70B; split over 2, 4 or 8 ranks
        assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size) == (
            80,
            8192,
            64,
            8,
            28672,
        )
        assert shard_config(cfg, 8).num_kv_heads == 1
    elif preset == "gpt-oss-20b-shape":  # openai/gpt-oss-20b's config.json
        assert cfg.architecture == "GptOssForCausalLM" and cfg.attention_sinks
        assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (24, 2880, 64, 8, 64)
        assert (cfg.num_experts, cfg.top_k, cfg.moe_intermediate_size, cfg.vocab_size) == (32, 4, 2880, 201088)
        groups = [(g.kind, g.window, len(g.layer_ids)) for g in cfg.attention_groups]
        assert groups == [("sliding_attention", 128, 12), ("full_attention", None, 12)]
    elif preset == "gemma3-12b-shape":  # google/gemma-3-12b's text config
        assert cfg.architecture == "Gemma3ForCausalLM" and cfg.qk_norm
        assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (48, 3840, 16, 8, 256)
        assert (cfg.intermediate_size, cfg.vocab_size, cfg.local_rope_theta) == (15360, 262208, 10000.0)
        groups = [(g.kind, g.window, len(g.layer_ids)) for g in cfg.attention_groups]
        assert groups == [("sliding_attention", 1024, 40), ("full_attention", None, 8)]
    elif preset == "deepseek-v3-shape":  # DeepSeek-V3's widths: a latent of 512 + 64 per token and layer
        assert cfg.kv_kind == "latent" and cfg.kv_layout == (1, 576)
        assert (cfg.hidden_size, cfg.num_heads, cfg.num_experts, cfg.top_k, cfg.num_moe_layers) == (7168, 128, 256, 8, 2)
    else:
        assert cfg.is_moe and (cfg.num_experts, cfg.top_k, cfg.num_moe_layers) == (32, 4, 8)


def test_unknown_preset_lists_the_presets(tmp_path):
    with pytest.raises(ValueError, match="qwen3-tiny"):
        init_model("gpt-tiny", tmp_path)
