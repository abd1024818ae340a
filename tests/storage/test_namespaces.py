"""A shared pool never hands one model's KV to another: storage keys carry the weights and what a
stored block contains (R3 routing), so different engines simply miss each other's objects."""

from __future__ import annotations

import shutil

import numpy as np
import torch
from safetensors.torch import load_file, save_file

import kvtier
from kvtier.model import init_model, weights_digest

PROMPT = np.random.default_rng(0).integers(0, 250, 100).tolist()
ONE = kvtier.SamplingParams(max_tokens=2, ignore_eos=True)
KW = dict(num_host_blocks=32, block_size=8, write_policy="write_through", prefetch_policy="wait_complete", storage_fetch="always")


def storage_hits(model, url: str, **kw) -> int:
    with kvtier.LLM(model, storage=url, **KW, **kw) as llm:
        return llm.generate([PROMPT], ONE)[0].cached_tokens_by_tier["storage"]


def test_same_shape_other_weights_do_not_share_kv(tmp_path):
    a = init_model("llama-tiny", tmp_path / "a", seed=0)
    b = init_model("llama-tiny", tmp_path / "b", seed=1)  # a "fine-tune": same config, other weights
    assert weights_digest(a) != weights_digest(b)
    assert weights_digest(a) == weights_digest(init_model("llama-tiny", tmp_path / "a2", seed=0))
    url = f"file://{tmp_path}/pool"
    storage_hits(a, url)
    assert storage_hits(b, url) == 0  # b's keys are its own
    assert storage_hits(a, url) == 96  # a still hits its objects


def test_routing_capture_on_and_off_use_different_objects(checkpoint, tmp_path):
    moe = checkpoint("qwen3-moe-tiny")
    url = f"file://{tmp_path}/pool"
    storage_hits(moe, url, capture_routing=True)
    assert storage_hits(moe, url, capture_routing=False) == 0  # no routing payload: another object
    assert storage_hits(moe, url, capture_routing=True) == 96
    names = list((tmp_path / "pool").rglob("kvt:*"))
    assert len(names) == 2 * ((100 + 2) // 8)  # both kinds kept, none deleted


def test_a_partial_fine_tune_never_reads_the_base_models_kv(checkpoint, tmp_path):
    base = checkpoint("llama-tiny")
    tuned = shutil.copytree(base, tmp_path / "tuned")
    tensors = load_file(base / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"  # one late tensor, deep in the shard
    tensors[name] = tensors[name] + 0.5 * torch.randn(tensors[name].shape, generator=torch.Generator().manual_seed(0))
    save_file(tensors, tuned / "model.safetensors", metadata={"format": "pt"})
    url = f"file://{tmp_path}/pool"
    params = kvtier.SamplingParams(max_tokens=8, ignore_eos=True)
    with kvtier.LLM(base, storage=url, **KW) as llm:
        llm.generate([PROMPT], params)  # the base model's blocks, written through

    with kvtier.LLM(tuned, storage=url, **KW) as llm:
        warm = llm.generate([PROMPT], params)[0]
    with kvtier.LLM(tuned, num_host_blocks=32, block_size=8) as llm:
        cold = llm.generate([PROMPT], params)[0]

    assert warm.cached_tokens_by_tier["storage"] == 0
    assert warm.token_ids == cold.token_ids


def test_a_sliding_window_keeps_its_blocks_apart_from_full_attention(tmp_path):
    """The same weights with Mistral's ``sliding_window`` on and off compute other KV past the
    window's first layer: a pool never hands one's blocks to the other."""
    import json

    full = init_model("mistral-tiny", tmp_path / "full", seed=0)
    windowed = tmp_path / "windowed"
    shutil.copytree(full, windowed)
    cfg = json.loads((windowed / "config.json").read_text())
    cfg["sliding_window"] = 16
    (windowed / "config.json").write_text(json.dumps(cfg))
    url = f"file://{tmp_path}/pool"
    storage_hits(full, url)
    assert storage_hits(windowed, url) == 0
    assert storage_hits(windowed, url) == 96
