"""Decoder-only families on paged KV: Llama/Mistral, Qwen2, Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE.

All six are one pre-norm decoder; the config chooses the variations (see config.py)::

    h = embed(ids)
    per layer l:  h = h + o_proj(attn(rope(q_norm?(q)), rope(k_norm?(k)), v))     q/k/v bias: Qwen2
                  h = h + mlp(h)          dense MLP, or SparseMoE for l in cfg.moe_layer_ids
                  (each residual add is fused into the norm after it: model/fused.py)
    hidden = norm(h);  logits = lm_head(hidden)      (lm_head tied to embed when tie_word_embeddings)

Multi-token prediction (DeepSeek-V3's MTP block, built when the engine drafts: ModelConfig.with_mtp):
the block at position i reads the target's ``hidden`` at i and the token at i+1 and predicts the
token at i+2, with a decoder layer of its own (its own KV, layer ``num_layers`` of every block)::

    x = eh_proj(cat(enorm(embed(token[i+1])), hnorm(hidden[i])));  m = layer(x)
    draft logits = lm_head(shared_head.norm(m))     (embed and lm_head shared with the target)

Drafting k > 1 tokens feeds ``m`` back as the next position's hidden state, as vLLM and SGLang do.

Parameter names equal the Hugging Face names of the Llama/Qwen layout, so the loader only renames
Mixtral's ``block_sparse_moe.experts.E.w1/w2/w3``. A layer the config makes sliding
(``cfg.layer_types``: Mistral-7B-v0.1's 4,096-token window, Qwen's use_sliding_window) attends to
its window only (model/attention.py). gpt-oss (model/gpt_oss.py) is this decoder with its own
layer class (``CausalLM.layer_cls``) and MoE (``DecoderLayer.moe_cls``).
"""

from __future__ import annotations

from typing import Callable, cast

import torch
from torch import nn

from kvtier.model.attention import AttentionMetadata
from kvtier.model.backends import get_backend
from kvtier.model.config import ModelConfig
from kvtier.model.layers import MLP, RMSNorm, RotaryEmbedding, SelfAttention
from kvtier.model.moe import SparseMoE
from kvtier.model.shard import TPShard, all_reduce, shard_config


class DecoderLayer(nn.Module):
    moe_cls: type[SparseMoE] = SparseMoE  # the MoE block of the layers in cfg.moe_layer_ids

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = SelfAttention(cfg, layer_idx)
        self.mlp: SparseMoE | MLP
        if layer_idx in cfg.moe_layer_ids:
            self.mlp = self.moe_cls(cfg, moe_index=cfg.moe_layer_ids.index(layer_idx))
        elif layer_idx >= cfg.num_layers and cfg.is_moe:  # an MTP block of a MoE model: MoE (DeepSeek-V3)
            self.mlp = self.moe_cls(cfg, moe_index=-1)  # (its routing is neither captured nor replayed)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, bias=cfg.mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.tp_group = None  # tensor parallel: the partial sums of o_proj and the MLP are all-reduced

    def forward(self, h, residual, positions, rotary, kv_cache, meta, attn_fn, layer_hook, routing_out, routing_in):
        """(out, residual): the layer's input is ``h + residual`` (the previous layer's residual
        add is fused into this layer's first norm, model/fused.py); the first layer has none."""
        if residual is None:
            x, residual = self.input_layernorm(h), h
        else:
            x, residual = self.input_layernorm(h, residual)
        attn = self.self_attn(x, positions, rotary, kv_cache, meta, attn_fn, layer_hook)
        if self.tp_group is not None:
            all_reduce(attn, self.tp_group)
        x, residual = self.post_attention_layernorm(attn, residual)
        out = self.mlp(x, routing_out, routing_in) if isinstance(self.mlp, SparseMoE) else self.mlp(x)
        if self.tp_group is not None:
            all_reduce(out, self.tp_group)
        return out, residual


class SharedHead(nn.Module):
    """An MTP block's final norm (its head is the target's ``lm_head``)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(size, eps)


class MTPLayer(DecoderLayer):
    """A multi-token-prediction block (module docstring): a decoder layer (same parameter names,
    so DeepSeek-V3's ``model.layers.{num_layers}.*`` load into it) with ``enorm``, ``hnorm``,
    ``eh_proj`` and ``shared_head.norm``."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        h = cfg.hidden_size
        self.enorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.shared_head = SharedHead(h, cfg.rms_norm_eps)

    def draft(self, embeds, hidden, positions, rope, kv_cache, meta, attn_fn, layer_hook):
        """The block's output ``m`` (before ``shared_head.norm``) at each row: ``embeds`` of the
        next tokens, ``hidden`` the target's (or the previous draft's) state at these positions."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        out, residual = self(x, None, positions, rope, kv_cache, meta, attn_fn, layer_hook, None, None)
        return out + residual


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_cls: type[DecoderLayer] = DecoderLayer):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layer_cls(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    layer_cls: type[DecoderLayer] = DecoderLayer  # a family's decoder layer (gpt-oss: its own MoE)

    def __init__(self, cfg: ModelConfig, attention_backend: str = "torch", tp: TPShard | None = None):
        """``cfg``: the model's config; ``tp``: the slice this process holds (model/shard.py),
        whose sizes :attr:`config` then has (``num_kv_heads / tp`` heads: this rank's KV shape)."""
        super().__init__()
        self.tp = tp
        if tp is not None and tp.size > 1:
            cfg = shard_config(cfg, tp.size)
        self.config = cfg
        self.attn_fn = get_backend(attention_backend)
        self.model = Decoder(cfg, self.layer_cls)
        self.rotary = RotaryEmbedding(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.mtp = nn.ModuleList(MTPLayer(cfg, cfg.num_layers + i) for i in range(cfg.num_mtp_layers))
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
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
        mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm for the step's flattened tokens.

        input_ids, positions: [T]; kv_caches[l]: [2, num_blocks, block_size, num_kv_heads, head_dim];
        routing_out / routing_in: [T, num_moe_layers, top_k] (see moe.py); ``mm_embeds``: (rows [R],
        embeddings [R, hidden]) that replace the token embeddings of those rows (image features,
        model/llava.py).
        """
        if len(kv_caches) != self.config.num_kv_layers:
            raise ValueError(f"expected {self.config.num_kv_layers} kv caches, got {len(kv_caches)}")
        h = self.model.embed_tokens(input_ids)
        if mm_embeds is not None:
            rows, embeds = mm_embeds
            h = h.index_copy(0, rows, embeds.to(h.dtype))
        rope = self.rotary.cos_sin(positions, h.dtype)  # once per step, shared by all layers
        residual = None
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches)):  # (the MTP blocks' KV follows)
            h, residual = layer(
                h, residual, positions, rope, kv_cache, meta.for_layer(i), self.attn_fn, layer_hook, routing_out, routing_in
            )
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
        """The MTP block over the step's rows (module docstring): ``next_ids[r]`` is the token
        after row ``r``'s, ``hidden`` [T, hidden] the target's states (or the last draft's); its KV
        goes to ``kv_caches[num_layers]`` at ``meta``'s slots. Returns the block's output (for
        :meth:`draft_logits`, and as the next draft position's ``hidden``)."""
        block = cast(MTPLayer, self.mtp[0])
        rope = self.rotary.cos_sin(positions, hidden.dtype)
        kv = kv_caches[self.config.num_layers]
        return block.draft(self.model.embed_tokens(next_ids), hidden, positions, rope, kv, meta, self.attn_fn, layer_hook)

    @torch.inference_mode()
    def draft_logits(self, m: torch.Tensor) -> torch.Tensor:
        return self.lm_head(cast(MTPLayer, self.mtp[0]).shared_head.norm(m)).float()

    def fuse_projections(self) -> None:
        """After loading: q/k/v and gate/up projections become one GEMM each."""
        # only the modules that fuse: a list of every module would keep each unfused q/k/v and
        # gate/up Linear alive until the end (an 8B model peaked at 1.5x its size)
        dense = [m for m in self.modules() if isinstance(m, (MLP, SelfAttention))]
        moe = [m for m in self.modules() if isinstance(m, SparseMoE)]
        for m in dense:
            m.fuse()
        for block in moe:
            block.fuse()  # stacks the (already fused) experts for dense dispatch

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
