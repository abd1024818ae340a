"""Sparse MoE block: router (softmax -> top-k [-> renormalize]), experts, optional shared expert.

One class covers the three MoE families; they differ only in config::

    Mixtral      top-k of softmax(router logits), always renormalized
    Qwen2-MoE    renormalized iff norm_topk_prob; + sigmoid(shared_expert_gate(x)) * shared_expert(x)
    Qwen3-MoE    renormalized iff norm_topk_prob

Other families subclass it with their own router and experts (``router_bias``, ``make_expert``,
``route``): DeepSeek (model/deepseek.py), gpt-oss (model/gpt_oss.py).

Routing capture / replay (R3): ``routing_out[:, moe_index]`` receives the experts used (a device copy,
no host sync); ``routing_in[:, moe_index]`` forces the experts, while their gate weights are still
taken from the live router probabilities and normalized as the family does.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from kvtier.model.config import ModelConfig
from kvtier.model.layers import MLP


class SparseMoE(nn.Module):
    router_bias = False  # the gate (router) has a bias: gpt-oss (model/gpt_oss.py)

    def __init__(self, cfg: ModelConfig, moe_index: int):
        super().__init__()
        self.moe_index = moe_index  # column of routing_out / routing_in
        self.num_experts, self.top_k, self.norm_topk_prob = cfg.num_experts, cfg.top_k, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=self.router_bias)
        self.experts = nn.ModuleList(self.make_expert(cfg) for _ in range(cfg.num_experts))
        self._stacked: tuple[torch.Tensor, torch.Tensor] | None = None  # set by fuse()
        self.shared_expert: MLP | None
        self.shared_expert_gate: nn.Linear | None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, cfg.hidden_act)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def make_expert(self, cfg: ModelConfig) -> nn.Module:
        """One expert: a gated MLP (a family with other experts overrides this)."""
        return MLP(cfg.hidden_size, cfg.moe_intermediate_size, cfg.hidden_act)

    def route(self, x: torch.Tensor, routing_in: torch.Tensor | None = None):
        """(expert ids [T, top_k] int64, gate weights [T, top_k] fp32)."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        if routing_in is None:
            weights, ids = torch.topk(probs, self.top_k, dim=-1)
        else:
            ids = routing_in[:, self.moe_index].long()
            weights = probs.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights

    # Steps of at most this many tokens run every expert on every token (dense dispatch): no host
    # sync, so decode steps can be captured in CUDA graphs; at decode sizes nearly every expert is
    # hit anyway, and reading the expert weights, not the extra FLOPs, is what costs.
    DENSE_MAX_TOKENS = 256

    def forward(
        self, x: torch.Tensor, routing_out: torch.Tensor | None = None, routing_in: torch.Tensor | None = None
    ) -> torch.Tensor:
        ids, weights = self.route(x, routing_in)
        if routing_out is not None:
            routing_out[:, self.moe_index].copy_(ids)
        if x.shape[0] <= self.DENSE_MAX_TOKENS and self._stacked is not None:
            out = self._experts_dense(x, ids, weights.to(x.dtype))
        else:
            out = self._experts(x, ids, weights.to(x.dtype))
        if self.shared_expert is not None:
            assert self.shared_expert_gate is not None  # (the two come together)
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def fuse(self) -> None:
        """After the experts' own fuse(): stack their weights ([E, 2I, H] gate/up, [E, H, I] down)
        and make each expert's Linear a view of its slice, so no weight is stored twice."""
        experts = cast("list[MLP]", list(self.experts))
        projs = [e.gate_up_proj for e in experts]
        if any(p is None for p in projs) or any(e.down_proj.bias is not None for e in experts):
            return
        fused = [p for p in projs if p is not None]
        gate_up = torch.stack([p.weight.detach() for p in fused])
        down = torch.stack([e.down_proj.weight.detach() for e in experts])
        for i, (e, p) in enumerate(zip(experts, fused)):
            p.weight = nn.Parameter(gate_up[i], requires_grad=False)
            e.down_proj.weight = nn.Parameter(down[i], requires_grad=False)
        self._stacked = (gate_up, down)
        self._act = experts[0].act

    def _experts_dense(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        assert self._stacked is not None  # (forward checks it)
        gate_up, down = self._stacked
        h = torch.matmul(x.unsqueeze(0), gate_up.transpose(1, 2))  # [E, T, 2I]
        gate, up = h.chunk(2, dim=-1)
        y = torch.matmul(self._act(gate) * up, down.transpose(1, 2))  # [E, T, H]
        combine = torch.zeros((x.shape[0], self.num_experts), dtype=x.dtype, device=x.device)
        combine.scatter_(1, ids, weights)  # [T, E]: 0 for unused experts
        return torch.einsum("te,eth->th", combine, y)

    def _experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Sum of weight * expert(x) over each token's experts: tokens grouped by expert, one loop."""
        flat_ids = ids.flatten()  # [T * top_k], token-major
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()  # one host sync
        tokens = order // ids.shape[1]
        flat_weights = weights.flatten()[order]
        out = torch.zeros_like(x)
        start = 0
        for expert, n in zip(self.experts, counts):
            if n:
                tok = tokens[start : start + n]
                y = expert(x[tok]) * flat_weights[start : start + n, None]
                out.index_add_(0, tok, y)
                start += n
        return out
