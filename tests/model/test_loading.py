"""Checkpoint loading: sharded and fused-expert layouts, and errors that name the problem."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvtier.model import SUPPORTED_ARCHITECTURES, ModelConfig, load_model
from tests.model.paged_helpers import PagedSequences, hf_logits, random_tokens


def test_sharded_checkpoint_loads_like_single_file(checkpoint, hf_model, tmp_path):
    hf = hf_model(checkpoint("qwen2-tiny"))
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    tokens = random_tokens(9, seed=20)

    got = PagedSequences(load_model(tmp_path)).step({0: tokens})[0]

    torch.testing.assert_close(got, hf_logits(hf, tokens), atol=1e-4, rtol=0)


def test_fused_3d_expert_tensors_load_like_per_expert_tensors(checkpoint, our_model, tmp_path):
    src = checkpoint("qwen3-moe-tiny")
    shutil.copytree(src, tmp_path, dirs_exist_ok=True)
    tensors = load_file(src / "model.safetensors")
    cfg = ModelConfig.from_hf_dir(src)
    for layer in cfg.moe_layer_ids:
        prefix = f"model.layers.{layer}.mlp.experts"
        pop = lambda e, name: tensors.pop(f"{prefix}.{e}.{name}.weight")  # noqa: E731
        experts = range(cfg.num_experts)
        tensors[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([pop(e, "gate_proj"), pop(e, "up_proj")]) for e in experts])
        tensors[f"{prefix}.down_proj"] = torch.stack([pop(e, "down_proj") for e in experts])
    save_file(tensors, tmp_path / "model.safetensors")
    tokens = random_tokens(9, seed=21)

    got = PagedSequences(load_model(tmp_path)).step({0: tokens})[0]

    expected = PagedSequences(our_model(src)).step({0: tokens})[0]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)  # same weights; BLAS may differ by 1 ulp


def test_unknown_architecture_is_named_with_supported_list(checkpoint, tmp_path):
    shutil.copytree(checkpoint("llama-tiny"), tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["GPTNeoXForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))

    with pytest.raises(ValueError, match="GPTNeoXForCausalLM") as err:
        load_model(tmp_path)
    assert all(arch in str(err.value) for arch in SUPPORTED_ARCHITECTURES)


def test_missing_tensor_is_named(checkpoint, tmp_path):
    shutil.copytree(checkpoint("mixtral-tiny"), tmp_path, dirs_exist_ok=True)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(tensors, tmp_path / "model.safetensors")

    with pytest.raises(KeyError, match=r"model\.layers\.1\.mlp\.experts\.3\.down_proj\.weight"):
        load_model(tmp_path)


def test_wrong_tensor_shape_is_named(checkpoint, tmp_path):
    shutil.copytree(checkpoint("llama-tiny"), tmp_path, dirs_exist_ok=True)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(3)
    save_file(tensors, tmp_path / "model.safetensors")

    with pytest.raises(ValueError, match=r"model\.norm\.weight"):
        load_model(tmp_path)


def test_missing_config_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)


def test_missing_weights_is_a_clear_error(checkpoint, tmp_path):
    shutil.copy(checkpoint("llama-tiny") / "config.json", tmp_path)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(tmp_path)
