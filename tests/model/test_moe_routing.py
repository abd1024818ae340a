"""MoE routing capture and replay (R3) for Mixtral, Qwen2-MoE and Qwen3-MoE.

Reference: transformers' router logits (``output_router_logits=True``) with the family's own
selection applied: top-k of softmax(logits).
"""

from __future__ import annotations

import pytest
import torch

from kvtier.model import ModelConfig
from tests.model.paged_helpers import MOE_PRESETS, PagedSequences, random_tokens


def routing_buffer(cfg: ModelConfig, num_tokens: int) -> torch.Tensor:
    return torch.full((num_tokens, cfg.num_moe_layers, cfg.top_k), -1, dtype=torch.int32)


def test_moe_layer_ids_follow_mlp_only_layers(checkpoint):
    cfg = ModelConfig.from_hf_dir(checkpoint("qwen2-moe-tiny"))  # 3 layers, mlp_only_layers=[1]
    assert cfg.is_moe and cfg.moe_layer_ids == (0, 2) and cfg.num_moe_layers == 2
    assert (cfg.num_experts, cfg.top_k) == (8, 2)


@pytest.mark.parametrize("preset", MOE_PRESETS)
def test_routing_out_equals_transformers_router_topk(preset, checkpoint, hf_model, our_model):
    path = checkpoint(preset)
    model = our_model(path)
    cfg = model.config
    tokens = random_tokens(15, seed=11)
    with torch.no_grad():
        router_logits = hf_model(path)(torch.tensor([tokens]), output_router_logits=True).router_logits
    expected = torch.stack(
        [torch.topk(torch.softmax(x.float(), -1), cfg.top_k, dim=-1).indices for x in router_logits], dim=1
    )  # [T, num_moe_layers, top_k]

    routing = routing_buffer(cfg, len(tokens))
    seqs = PagedSequences(model)
    seqs.step({0: tokens[:9]}, routing_out=routing[:9])
    seqs.step({0: tokens[9:]}, routing_out=routing[9:])

    assert torch.equal(routing.long(), expected)


@pytest.mark.parametrize("preset", MOE_PRESETS)
def test_routing_in_replays_captured_experts_exactly(preset, checkpoint, our_model):
    model = our_model(checkpoint(preset))
    tokens = random_tokens(12, seed=12)
    routing = routing_buffer(model.config, len(tokens))
    live = PagedSequences(model).step({0: tokens}, routing_out=routing)[0]

    replayed_routing = routing_buffer(model.config, len(tokens))
    replayed = PagedSequences(model, seed=1).step({0: tokens}, routing_in=routing.to(torch.uint8), routing_out=replayed_routing)[
        0
    ]

    assert torch.equal(replayed, live)
    assert torch.equal(replayed_routing, routing)


@pytest.mark.parametrize("preset", MOE_PRESETS)
def test_forcing_other_experts_changes_logits(preset, checkpoint, our_model):
    model = our_model(checkpoint(preset))
    tokens = random_tokens(12, seed=13)
    routing = routing_buffer(model.config, len(tokens))
    live = PagedSequences(model).step({0: tokens}, routing_out=routing)[0]

    other = (routing + 1) % model.config.num_experts  # still distinct experts per token
    forced = PagedSequences(model).step({0: tokens}, routing_in=other)[0]

    assert (forced - live).abs().max() > 1e-3


@pytest.mark.parametrize("preset", MOE_PRESETS)
def test_dense_and_grouped_expert_dispatch_agree(preset, checkpoint, our_model, monkeypatch):
    """Decode-sized steps run every expert densely (graph-capturable); large steps group tokens by
    expert. Both give the same logits and routing (and the dense one is what the HF tests above saw)."""
    from kvtier.model.moe import SparseMoE

    model = our_model(checkpoint(preset))
    tokens = random_tokens(14, seed=13)
    dense_routing = routing_buffer(model.config, len(tokens))
    dense = PagedSequences(model).step({0: tokens}, routing_out=dense_routing)[0]
    monkeypatch.setattr(SparseMoE, "DENSE_MAX_TOKENS", 0)
    grouped_routing = routing_buffer(model.config, len(tokens))
    grouped = PagedSequences(model).step({0: tokens}, routing_out=grouped_routing)[0]
    assert torch.equal(dense_routing, grouped_routing)
    assert torch.allclose(dense, grouped, atol=1e-5)
