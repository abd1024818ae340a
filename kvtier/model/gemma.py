"""Gemma 2 and Gemma 3 (text, ``Gemma2ForCausalLM`` / ``Gemma3ForCausalLM``) on paged KV.

One decoder for both; the config says where they differ::

    h = embed(ids) * sqrt(hidden)                      (the factor rounded to the weights' dtype)
    per layer l:  a = o_proj(attn(rope_l(q_norm?(q)), rope_l(k_norm?(k)), v))
                  h = h + post_attention_layernorm(a)
                  h = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))   gelu-tanh MLP
    hidden = norm(h);  logits = softcap?(lm_head(hidden))          (lm_head tied to embed)

                     Gemma 2                         Gemma 3
    layers           sliding, full, sliding, ...     5 sliding : 1 full (sliding_window_pattern)
    scores           cap * tanh(s / cap), cap 50     not capped
    final logits     cap 30                          not capped (final_logit_softcapping null)
    q/k norm         none                            per head, before RoPE
    RoPE             one base (10,000)               sliding layers: rope_local_base_freq (10,000);
                                                     full layers: rope_theta (1e6) and its scaling

Every norm is Gemma's RMSNorm: ``rms_norm(x) * (1 + weight)`` in fp32, rounded once (the weight
is stored as an offset from one: a fresh norm's weight is zero). The softmax scale is
``query_pre_attn_scalar ** -0.5``, not head_dim's.

Not served yet (config.SLIDING_ARCHITECTURES): load with model/loader.py ``load_sliding_model``.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from kvtier.model.attention import AttentionMetadata
from kvtier.model.backends import get_backend
from kvtier.model.config import ModelConfig
from kvtier.model.fused import rope_write_kv
from kvtier.model.layers import MLP, RMSNorm, RotaryEmbedding, SelfAttention


class GemmaRMSNorm(RMSNorm):
    """``rms_norm(x) * (1 + weight)`` computed in fp32 and rounded once, as transformers' Gemma2RMSNorm."""

    unit_weight = 0.0

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """As RMSNorm's: with ``residual``, of ``h = x + residual``, returning (normed, h)."""
        h = x if residual is None else x + residual
        y = h.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        out = (y * (1.0 + self.weight.float())).to(h.dtype)
        return out if residual is None else (out, h)


class GemmaAttention(SelfAttention):
    """SelfAttention's projections and attention (window, soft-capping, scale: its config) with
    Gemma 3's q/k norms applied in Gemma's arithmetic before RoPE."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        if cfg.qk_norm:
            self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding | tuple,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        attn_fn,
        layer_hook=None,
    ) -> torch.Tensor:
        """``rotary``: this layer's RoPE (sliding layers: the local one), or the step's (cos, sin) of it."""
        q, k, v = self.project(x)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rotary if isinstance(rotary, tuple) else rotary.cos_sin(positions, q.dtype)
        if layer_hook is not None:
            layer_hook(self.layer_idx)  # e.g. wait until this layer's KV has arrived from the host tier
        q = rope_write_kv(q, k, v, cos, sin, kv_cache, meta.slot_mapping, kv_scale=self.kv_scale)
        return self.attend(q, kv_cache, meta, attn_fn)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = GemmaAttention(cfg, layer_idx)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, h, positions, rope, kv_cache, meta, attn_fn, layer_hook) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(h), positions, rope, kv_cache, meta, attn_fn, layer_hook)
        h = h + self.post_attention_layernorm(attn)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class GemmaDecoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class GemmaForCausalLM(nn.Module):
    """Gemma 2 / Gemma 3 text on paged KV; called as CausalLM is (model/families.py)."""

    def __init__(self, cfg: ModelConfig, attention_backend: str = "torch"):
        super().__init__()
        if cfg.query_pre_attn_scalar is None or cfg.num_mtp_layers:
            raise ValueError(f"{cfg.architecture} is not a Gemma (query_pre_attn_scalar, no MTP blocks)")
        self.config = cfg
        self.attn_fn = get_backend(attention_backend)
        self.model = GemmaDecoder(cfg)
        self.rotary = RotaryEmbedding(cfg)  # full layers (and Gemma 2's sliding ones)
        self.local_rotary = RotaryEmbedding(cfg.sliding_rope_config()) if cfg.local_rope_theta is not None else None
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

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

        input_ids, positions: [T]; kv_caches[l]: [2, num_blocks, block_size, num_kv_heads, head_dim];
        ``routing_out`` / ``routing_in``: unused (a dense model), taken for CausalLM's signature.
        """
        if len(kv_caches) != self.config.num_kv_layers:
            raise ValueError(f"expected {self.config.num_kv_layers} kv caches, got {len(kv_caches)}")
        h = self.model.embed_tokens(input_ids)
        # transformers multiplies by sqrt(hidden) as a tensor of the weights' dtype (bf16: 8.0 -> 8.0, 55.43 -> 55.5)
        h = h * torch.tensor(self.config.hidden_size**0.5, dtype=h.dtype).item()
        rope = self.rotary.cos_sin(positions, h.dtype)
        local_rope = rope if self.local_rotary is None else self.local_rotary.cos_sin(positions, h.dtype)
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches)):
            layer_rope = local_rope if self.config.layer_window(i) is not None else rope
            h = layer(h, positions, layer_rope, kv_cache, meta, self.attn_fn, layer_hook)
        return self.model.norm(h)

    def fuse_projections(self) -> None:
        """After loading: q/k/v and gate/up projections become one GEMM each."""
        for m in [m for m in self.modules() if isinstance(m, (MLP, SelfAttention))]:
            m.fuse()

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in fp32; Gemma 2's soft-capping in the model's dtype, as transformers applies it."""
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
