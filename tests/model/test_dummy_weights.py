"""load_format="dummy": random weights from config.json alone; init_model(config_only=True) writes one."""

from __future__ import annotations

import pytest
import torch
import transformers

from kvtier.model import ModelConfig, allocate_kv_caches, init_model, load_model
from kvtier.model.layers import RMSNorm
from tests.model.paged_helpers import BLOCK_SIZE, PagedSequences, random_tokens


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory):
    """config_dir(preset) -> directory written by init_model(config_only=True) (cached)."""
    written = {}

    def get(preset: str):
        if preset not in written:
            written[preset] = init_model(preset, tmp_path_factory.mktemp(preset), config_only=True)
        return written[preset]

    return get


@pytest.mark.parametrize("preset", ["llama-tiny", "qwen3-moe-tiny"])
def test_dummy_load_from_config_alone_runs_a_finite_bf16_forward(preset, config_dir):
    path = config_dir(preset)
    assert (path / "config.json").is_file() and not list(path.glob("*.safetensors"))

    model = load_model(path, dtype=torch.bfloat16, load_format="dummy")

    assert {(p.device.type, p.dtype) for p in model.parameters()} == {("cpu", torch.bfloat16)}
    seqs = PagedSequences(model)
    seqs.kv_caches = allocate_kv_caches(model.config, 64, BLOCK_SIZE, dtype=torch.bfloat16)
    logits = seqs.step({0: random_tokens(20, seed=1)})[0]
    assert logits.shape == (20, model.config.vocab_size) and torch.isfinite(logits).all()
    assert len(set(logits.argmax(-1).tolist())) > 1


def test_dummy_weights_are_deterministic(config_dir):
    path = config_dir("qwen3-moe-tiny")
    first, second = (load_model(path, load_format="dummy").state_dict() for _ in range(2))
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_dummy_weights_follow_the_hf_init(config_dir):
    """N(0, initializer_range) for Linear/Embedding (experts, router, bias-carrying q/k/v too), norms 1,
    biases 0, tied lm_head shared with the embedding."""
    for preset in ("qwen2-moe-tiny", "qwen2-tiny"):  # shared expert + q/k/v bias; tied embeddings
        model = load_model(config_dir(preset), load_format="dummy", fuse=False)
        norms = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, RMSNorm)}
        for name, p in model.named_parameters():
            if name in norms:
                assert torch.all(p == 1), name
            elif name.endswith(".bias"):
                assert torch.all(p == 0), name
            elif p.numel() >= 1024:
                assert abs(p.std().item() - 0.15) < 0.02, name  # the tiny presets' initializer_range
        if model.config.tie_word_embeddings:
            assert model.lm_head.weight is model.model.embed_tokens.weight
        else:
            assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_auto_on_a_config_only_directory_names_the_missing_weights(config_dir):
    with pytest.raises(FileNotFoundError, match=r"safetensors.*load_format='dummy'"):
        load_model(config_dir("llama-tiny"))


def test_bad_load_format_is_named(config_dir):
    with pytest.raises(ValueError, match="'safetensors'"):
        load_model(config_dir("llama-tiny"), load_format="safetensors")


def test_llama3_8b_shape_config_only_writes_no_weights_and_builds_no_model(tmp_path, monkeypatch):
    def no_model(*args, **kwargs):
        raise AssertionError("config_only must not build the model")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", no_model)
    init_model("llama3-8b-shape", tmp_path, config_only=True)
    assert not list(tmp_path.glob("*.safetensors"))

    cfg = ModelConfig.from_hf_dir(tmp_path)
    assert not list(tmp_path.glob("*.safetensors")) and (tmp_path / "tokenizer.json").is_file()
    assert (
        cfg.architecture,
        cfg.num_layers,
        cfg.hidden_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.intermediate_size,
        cfg.vocab_size,
        cfg.torch_dtype,
        cfg.tie_word_embeddings,
    ) == ("LlamaForCausalLM", 32, 4096, 32, 8, 128, 14336, 128256, torch.bfloat16, False)
    assert cfg.rope_scaling == dict(
        rope_type="llama3",
        rope_theta=500000.0,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )
    assert cfg.max_position_embeddings >= 16384 and cfg.rms_norm_eps == 1e-5


def test_config_only_writes_the_config_a_full_checkpoint_has(checkpoint, config_dir):
    full, bare = checkpoint("qwen3-moe-tiny"), config_dir("qwen3-moe-tiny")
    for name in ("config.json", "generation_config.json", "tokenizer.json"):
        assert (bare / name).read_text() == (full / name).read_text(), name
