"""DeepSeek-V2/V3 (and Kimi K2, a DeepSeek-V3) on a paged latent cache.

One pre-norm decoder, as model/families.py's, with two different parts::

    h = embed(ids)
    per layer l:  h = h + o_proj(MLA(h))                    model/mla.py: one latent per token cached
                  h = h + MLP(h)                            l < first_k_dense_replace (moe_layer_ids)
                  h = h + routed(h) + shared_experts(h)     the others: DeepseekMoE
    hidden = norm(h);  logits = lm_head(hidden)

Routing (:class:`DeepseekMoE`), as transformers' DeepseekV3TopkRouter / DeepseekV2TopkRouter::

    scores  = sigmoid(gate(x)) (V3) | softmax(gate(x)) (V2)                       in fp32
    choice  = scores + e_score_correction_bias (V3: the bias steers the choice only)
    groups  = the topk_group best of n_group groups, a group scored by the sum of its top-2
              choices (V3) or its best score (V2 group_limited_greedy); V2 greedy: all groups
    experts = top_k of choice within those groups
    weights = scores of those experts (no bias), / their sum if norm_topk_prob, * routed_scaling_factor

RoPE is YaRN as the checkpoint configures it (DeepSeek-V3: factor 40, mscale = mscale_all_dim = 1),
the softmax scale carries yarn_mscale(factor, mscale_all_dim)^2 (mla.softmax_scale). The MTP block
(``num_nextn_predict_layers``, DeepSeek-V3's ``model.layers.{num_layers}``) is built when the engine
drafts (ModelConfig.with_mtp): a decoder layer of its own, with MLA over its own latent cache and a
MoE (:class:`DeepseekMTPLayer`), fed as model/families.py's MTP block is. The engine serves these
models (model/loader.py ``load_model``) on its
caches (``model.allocate_kv_caches``, one latent plane per layer); alone they load with
``load_mla_model`` on ``mla.allocate_latent_caches``.
"""

from __future__ import annotations

from typing import Callable, cast

import torch
import torch.nn.functional as F
from torch import nn

from kvtier.model.attention import AttentionMetadata
from kvtier.model.config import ModelConfig
from kvtier.model.families import SharedHead
from kvtier.model.layers import MLP, RMSNorm, RotaryEmbedding
from kvtier.model.mla import LatentAttention
from kvtier.model.moe import SparseMoE
from kvtier.model.shard import TPShard, all_reduce, shard_config


class Router(nn.Linear):
    """The gate: ``weight`` [E, hidden] (kept in fp32 when loading, as transformers keeps it), and
    for V3's noaux_tc routing ``e_score_correction_bias`` [E] (fp32 too)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg.hidden_size, cfg.num_experts, bias=False)
        self.e_score_correction_bias: nn.Parameter | None = None
        if cfg.topk_method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.num_experts), requires_grad=False)


class DeepseekMoE(SparseMoE):
    """moe.py's expert dispatch (and routing capture / replay) with DeepSeek's routing (module
    docstring) and ungated shared experts (``mlp.shared_experts``)."""

    gate: Router

    def __init__(self, cfg: ModelConfig, moe_index: int):
        super().__init__(cfg, moe_index)
        self.gate = Router(cfg)
        self.scoring_func, self.topk_method = cfg.scoring_func, cfg.topk_method
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.routed_scaling_factor = cfg.routed_scaling_factor
        shared = cfg.n_shared_experts * cfg.moe_intermediate_size
        self.shared_experts = MLP(cfg.hidden_size, shared, cfg.hidden_act, bias=cfg.mlp_bias) if shared else None

    def route(self, x: torch.Tensor, routing_in: torch.Tensor | None = None):
        """(expert ids [T, top_k] int64, gate weights [T, top_k] fp32); ``routing_in`` forces the
        ids, whose weights still come from the live scores."""
        logits = F.linear(x.float(), self.gate.weight.float())
        scores = logits.sigmoid() if self.scoring_func == "sigmoid" else logits.softmax(dim=-1)
        if routing_in is None:
            ids = self._choose(scores)
        else:
            ids = routing_in[:, self.moe_index].long()
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * self.routed_scaling_factor

    def _choose(self, scores: torch.Tensor) -> torch.Tensor:
        bias = self.gate.e_score_correction_bias
        choice = scores if bias is None else scores + bias.float()
        if self.topk_method != "greedy":
            grouped = choice.view(choice.shape[0], self.n_group, -1)
            if self.topk_method == "noaux_tc":
                group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            else:  # group_limited_greedy
                group_scores = grouped.amax(dim=-1)
            best = group_scores.topk(self.topk_group, dim=-1).indices
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).flatten(1)
        return choice.topk(self.top_k, dim=-1).indices

    def forward(
        self, x: torch.Tensor, routing_out: torch.Tensor | None = None, routing_in: torch.Tensor | None = None
    ) -> torch.Tensor:
        out = super().forward(x, routing_out, routing_in)
        return out if self.shared_experts is None else out + self.shared_experts(x)


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, backend: str = "torch"):
        super().__init__()
        self.self_attn = LatentAttention(cfg, layer_idx, backend)
        self.mlp: DeepseekMoE | MLP
        if layer_idx in cfg.moe_layer_ids:
            self.mlp = DeepseekMoE(cfg, moe_index=cfg.moe_layer_ids.index(layer_idx))
        elif layer_idx >= cfg.num_layers and cfg.is_moe:  # the MTP block of a MoE model: MoE (DeepSeek-V3)
            self.mlp = DeepseekMoE(cfg, moe_index=-1)  # (its routing is neither captured nor replayed)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, bias=cfg.mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.tp_group = None  # tensor parallel: the partial sums of o_proj and the MLP are all-reduced

    def forward(self, h, residual, rope, latent_cache, meta, layer_hook, routing_out, routing_in):
        """(out, residual): the layer's input is ``h + residual``, the add fused into the first
        norm (model/fused.py); the first layer has no residual."""
        if residual is None:
            x, residual = self.input_layernorm(h), h
        else:
            x, residual = self.input_layernorm(h, residual)
        attn = self.self_attn(x, rope, latent_cache, meta, layer_hook)
        if self.tp_group is not None:
            all_reduce(attn, self.tp_group)
        x, residual = self.post_attention_layernorm(attn, residual)
        out = self.mlp(x, routing_out, routing_in) if isinstance(self.mlp, DeepseekMoE) else self.mlp(x)
        if self.tp_group is not None:
            all_reduce(out, self.tp_group)
        return out, residual


class DeepseekMTPLayer(DeepseekDecoderLayer):
    """DeepSeek-V3's multi-token-prediction block: a decoder layer (MLA, MoE) with ``enorm``,
    ``hnorm``, ``eh_proj`` and ``shared_head.norm``; model/families.py ``MTPLayer`` on a latent cache."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, backend: str = "torch"):
        super().__init__(cfg, layer_idx, backend)
        h = cfg.hidden_size
        self.enorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.shared_head = SharedHead(h, cfg.rms_norm_eps)

    def draft(self, embeds, hidden, rope, latent_cache, meta, layer_hook):
        """The block's output ``m`` (before ``shared_head.norm``) at each row."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        out, residual = self(x, None, rope, latent_cache, meta, layer_hook, None, None)
        return out + residual


class DeepseekDecoder(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: str = "torch"):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(cfg, i, backend) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekForCausalLM(nn.Module):
    """DeepSeek-V2/V3 on a latent cache; called as CausalLM is (model/families.py)."""

    # kept in fp32 whatever the load dtype (transformers' _keep_in_fp32_modules_strict): the
    # correction bias separates experts by less than bf16 resolves at its magnitude
    FP32_PARAMETERS = (".mlp.gate.weight", ".mlp.gate.e_score_correction_bias")

    def __init__(self, cfg: ModelConfig, attention_backend: str = "torch", tp: TPShard | None = None):
        """``attention_backend``: "triton" runs decode rows on model/triton_mla.py's kernel; prefill
        chunks and "torch" on model/mla.py's torch reference. ``tp``: this rank's heads and expert
        slices (model/shard.py); the latent cache is whole on every rank."""
        super().__init__()
        if cfg.kv_kind != "latent":
            raise ValueError(f"{cfg.architecture} has no latent attention; build it with model/families.py CausalLM")
        if attention_backend not in ("torch", "triton"):
            raise ValueError(f"unknown attention backend {attention_backend!r}; choose from ['torch', 'triton']")
        self.tp = tp
        if tp is not None and tp.size > 1:
            cfg = shard_config(cfg, tp.size)
        self.config = cfg
        self.model = DeepseekDecoder(cfg, attention_backend)
        self.rotary = RotaryEmbedding(cfg)  # over qk_rope_head_dim (cfg.head_dim)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.mtp = nn.ModuleList(DeepseekMTPLayer(cfg, cfg.num_layers + i, attention_backend) for i in range(cfg.num_mtp_layers))
        if tp is not None and tp.size > 1:
            for layer in [*self.model.layers, *self.mtp]:
                layer.tp_group = tp.group

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        layer_hook: Callable[[int], None] | None = None,
        routing_out: torch.Tensor | None = None,
        routing_in: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm for the step's flattened tokens.

        input_ids, positions: [T]; kv_caches[l]: [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]
        (mla.allocate_latent_caches) or the engine's [1, num_blocks, block_size, kv_width] of the same
        numbers (model.allocate_kv_caches: one plane, ModelConfig.kv_layout); routing_out / routing_in:
        [T, num_moe_layers, top_k] (moe.py).
        """
        if len(kv_caches) != self.config.num_kv_layers:
            raise ValueError(f"expected {self.config.num_kv_layers} latent caches, got {len(kv_caches)}")
        kv_caches = [kv[0] if kv.dim() == 4 else kv for kv in kv_caches]
        h = self.model.embed_tokens(input_ids)
        rope = self.rotary.cos_sin(positions, h.dtype)
        residual = None
        for layer, latent_cache in zip(self.model.layers, kv_caches):
            h, residual = layer(h, residual, rope, latent_cache, meta, layer_hook, routing_out, routing_in)
        return self.model.norm(h, residual)[0]

    @torch.inference_mode()
    def draft(
        self,
        next_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        layer_hook: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """The MTP block over the step's rows, as CausalLM.draft: ``next_ids[r]`` is the token after
        row ``r``'s, ``hidden`` the target's states (or the last draft's); its latents go to
        ``kv_caches[num_layers]``. Returns the block's output."""
        block = cast(DeepseekMTPLayer, self.mtp[0])
        kv = kv_caches[self.config.num_layers]
        rope = self.rotary.cos_sin(positions, hidden.dtype)
        embeds = self.model.embed_tokens(next_ids)
        return block.draft(embeds, hidden, rope, kv[0] if kv.dim() == 4 else kv, meta, layer_hook)

    @torch.inference_mode()
    def draft_logits(self, m: torch.Tensor) -> torch.Tensor:
        return self.lm_head(cast(DeepseekMTPLayer, self.mtp[0]).shared_head.norm(m)).float()

    def fuse_projections(self) -> None:
        """After loading: gate/up of every MLP (dense, experts, shared) one GEMM; experts stacked."""
        for m in [m for m in self.modules() if isinstance(m, MLP)]:
            m.fuse()
        for block in [m for m in self.modules() if isinstance(m, DeepseekMoE)]:
            block.fuse()

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
