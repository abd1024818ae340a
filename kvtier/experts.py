"""Routing replay for trainers on Hugging Face ``transformers`` (R3).

    with kvtier.experts.replay(hf_model, out.routed_experts):
        logits = hf_model(input_ids).logits          # routers use the recorded expert ids

Inside the context every MoE router of a Mixtral / Qwen2-MoE / Qwen3-MoE model (transformers 5
``*TopKRouter`` modules, one per MoE layer, in layer order) keeps computing its live logits, but
takes the expert ids from ``routed_experts``; the gate weights are the live softmax probabilities
of those experts, normalized exactly as the family does (Mixtral always renormalizes over the
top-k, Qwen only with ``norm_topk_prob``), so gradients flow into the router as in training.

``routed_experts``: ``[S, num_moe_layers, top_k]`` for a batch of one sequence, or
``[B, S, num_moe_layers, top_k]``; ``S`` may be the sequence length or one less (kvtier returns
``len(tokens) - 1`` rows: the last token never went through the model). Positions past ``S`` use
the live top-k.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import numpy as np
import torch
import torch.nn.functional as F


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's MoE routers in layer order."""
    routers = [
        m for m in model.modules() if type(m).__name__.endswith("TopKRouter") and hasattr(m, "top_k") and hasattr(m, "weight")
    ]
    if not routers:
        raise ValueError(
            f"{type(model).__name__} has no MoE routers (transformers *TopKRouter modules); "
            f"routing replay supports Mixtral, Qwen2-MoE and Qwen3-MoE on transformers >= 5"
        )
    return routers


def _weight(router: torch.nn.Module) -> torch.Tensor:
    """The router's weight [num_experts, hidden]."""
    weight = router.weight
    assert isinstance(weight, torch.Tensor), type(weight)
    return weight


def _renormalizes(router: torch.nn.Module) -> bool:
    if type(router).__name__.startswith("Mixtral"):
        return True
    return bool(getattr(router, "norm_topk_prob", False))


@contextlib.contextmanager
def replay(model: torch.nn.Module, routed_experts: np.ndarray | torch.Tensor) -> Iterator[None]:
    routers = moe_routers(model)
    forced = torch.as_tensor(
        np.asarray(routed_experts) if not isinstance(routed_experts, torch.Tensor) else routed_experts
    ).long()
    if forced.dim() == 3:
        forced = forced[None]
    if forced.dim() != 4 or forced.shape[2] != len(routers) or forced.shape[3] != routers[0].top_k:
        raise ValueError(
            f"routed_experts has shape {tuple(forced.shape)}, expected [batch?, seq, "
            f"{len(routers)} moe layers, top_k {routers[0].top_k}]"
        )
    num_experts = _weight(routers[0]).shape[0]
    if forced.numel() and (forced.min() < 0 or forced.max() >= num_experts):
        raise ValueError(f"routed_experts holds ids outside 0..{num_experts - 1}")
    originals = []
    for layer, router in enumerate(routers):
        originals.append(router.forward)
        router.forward = _forced_forward(router, forced[:, :, layer], _renormalizes(router))
    try:
        yield
    finally:
        for router, fwd in zip(routers, originals):
            router.forward = fwd


def _forced_forward(router: torch.nn.Module, forced: torch.Tensor, renormalize: bool):
    batch, seq_given, top_k = forced.shape

    def forward(hidden_states: torch.Tensor):
        weight = _weight(router)
        hidden = hidden_states.reshape(-1, weight.shape[1])
        logits = F.linear(hidden, weight)
        probs = F.softmax(logits, dtype=torch.float, dim=-1)
        live = torch.topk(probs, top_k, dim=-1).indices
        tokens = hidden.shape[0]
        if tokens % batch:
            raise ValueError(f"router saw {tokens} tokens, not a multiple of the replay batch {batch}")
        seq = tokens // batch
        if seq_given > seq:
            raise ValueError(f"routed_experts covers {seq_given} positions, the forward has {seq}")
        idx = live.view(batch, seq, top_k).clone()
        idx[:, :seq_given] = forced.to(idx.device)
        idx = idx.view(-1, top_k)
        weights = probs.gather(1, idx)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not type(router).__name__.startswith("Mixtral"):
            weights = weights.to(logits.dtype)  # the Qwen routers cast back; Mixtral keeps fp32
        return logits, weights, idx

    return forward
