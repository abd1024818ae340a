"""Building blocks shared by every family: RMSNorm, rotary embedding, gated MLP, paged self-attention.

Each op follows transformers' arithmetic step for step (which dtype, in which order) so that fp32
logits match to ~1e-5 and bf16 logits stay close.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvtier.model.attention import AttentionMetadata
from kvtier.model.config import ModelConfig
from kvtier.model.fused import add_rms_norm, rope_write_kv, silu_and_mul

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in _ACTIVATIONS:
        raise ValueError(f"unsupported hidden_act {name!r}; choose from {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


class RMSNorm(nn.Module):
    unit_weight = 1.0  # the weight that leaves a normalized input as it is (Gemma's norm: 0, model/gemma.py)

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.full((size,), self.unit_weight))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``weight * rms_norm(x)`` in fp32 as transformers computes it; with ``residual``, of
        ``h = x + residual`` and returns (normed, h) — one fused kernel on CUDA (model/fused.py)."""
        out, h = add_rms_norm(x, residual, self.weight, self.eps)
        return out if residual is None else (out, h)


# ---------------------------------------------------------------------------------------------------
# Rotary embedding. inv_freq per rope_type, as transformers.modeling_rope_utils computes it (on CPU,
# fp32); attention_factor scales cos and sin (yarn).


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3_inv_freq(base: float, dim: int, p: dict) -> torch.Tensor:
    inv_freq = _default_inv_freq(base, dim)
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(base: float, dim: int, p: dict, max_pos: int) -> tuple[torch.Tensor, float]:
    orig = p["original_max_position_embeddings"]
    factor = p.get("factor") or max_pos / orig

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention_factor = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim // 2] fp32, attention_factor) for the config's rope_type."""
    p, base = cfg.rope_scaling, cfg.rope_theta
    dim = int(cfg.head_dim * p.get("partial_rotary_factor", 1.0))
    if dim != cfg.head_dim:
        raise ValueError("partial rotary embeddings are not supported")
    kind = cfg.rope_type
    if kind == "default":
        return _default_inv_freq(base, dim), 1.0
    if kind == "linear":
        return _default_inv_freq(base, dim) / p["factor"], 1.0
    if kind == "llama3":
        return _llama3_inv_freq(base, dim, p), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(base, dim, p, cfg.max_position_embeddings)
    raise ValueError(f"unsupported rope_type {kind!r}; supported: default, linear, llama3, yarn")


class RotaryEmbedding(nn.Module):
    inv_freq: torch.Tensor  # a buffer

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg  # (the loader rebuilds it on the weights' device from this)
        inv_freq, self.attention_factor = rope_inv_freq(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, D] of the step's positions: computed once per forward, used by every layer."""
        freqs = positions[:, None].float() * self.inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_factor).to(dtype)[:, None, :]
        sin = (emb.sin() * self.attention_factor).to(dtype)[:, None, :]
        return cos, sin


# ---------------------------------------------------------------------------------------------------


class MLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)). Also one expert's shape and the Qwen2-MoE shared expert."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act = activation(act)
        self.gate_up_proj: nn.Linear | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate_up = self.gate_up_proj(x)
            if self.act is F.silu:
                return self.down_proj(silu_and_mul(gate_up))
            gate, up = gate_up.chunk(2, dim=-1)
            return self.down_proj(self.act(gate) * up)
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))

    def fuse(self) -> None:
        """One GEMM for gate and up (after loading): fewer kernel launches per step."""
        self.gate_up_proj = _fused_linear(self.gate_proj, self.up_proj)
        del self.gate_proj, self.up_proj


class SelfAttention(nn.Module):
    """q/k/v projections, optional per-head q/k RMSNorm, RoPE, paged KV write + attention, o_proj.

    The layer's attention as its config says (model/attention.py): its sliding ``window`` (None:
    full), ``sinks`` (gpt-oss: a parameter, one logit per head), ``softcap`` (Gemma 2) and softmax
    ``scale`` (Gemma: query_pre_attn_scalar ** -0.5)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        self.window = cfg.layer_window(layer_idx)
        self.softcap = cfg.attn_logit_softcapping
        self.sinks = nn.Parameter(torch.zeros(self.num_heads)) if cfg.attention_sinks else None
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=cfg.o_bias)
        self.q_norm: RMSNorm | None
        self.k_norm: RMSNorm | None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.qkv_proj: nn.Linear | None = None
        self.kv_scale: torch.Tensor | None = None  # an fp8 cache's scales [2, num_kv_heads] (model/kv_quant.py)

    def fuse(self) -> None:
        """One GEMM for q, k and v (after loading)."""
        self.qkv_proj = _fused_linear(self.q_proj, self.k_proj, self.v_proj)
        del self.q_proj, self.k_proj, self.v_proj

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
        """``rotary``: the RotaryEmbedding, or the step's precomputed (cos, sin)."""
        q, k, v = self.project(x)
        cos, sin = rotary if isinstance(rotary, tuple) else rotary.cos_sin(positions, q.dtype)
        if layer_hook is not None:
            layer_hook(self.layer_idx)  # e.g. wait until this layer's KV has arrived from the host tier
        q_norm, k_norm = self.q_norm, self.k_norm
        q_w, k_w, eps = (
            (q_norm.weight, k_norm.weight, q_norm.eps) if q_norm is not None and k_norm is not None else (None, None, 1e-6)
        )
        q = rope_write_kv(
            q, k, v, cos, sin, kv_cache, meta.slot_mapping, q_w, k_w, eps, self.kv_scale
        )  # (q/k norm,) RoPE, KV write
        return self.attend(q, kv_cache, meta, attn_fn)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, num_heads, head_dim], k and v [T, num_kv_heads, head_dim] of ``x`` [T, hidden]."""
        T = x.shape[0]
        if self.qkv_proj is not None:
            q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.reshape(T, self.num_heads, self.head_dim)
        k = k.reshape(T, self.num_kv_heads, self.head_dim)
        v = v.reshape(T, self.num_kv_heads, self.head_dim)
        return q, k, v

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, attn_fn) -> torch.Tensor:
        """o_proj of the attention of (roped) ``q`` over the cache, with this layer's window,
        sinks, soft-capping, scale and (an fp8 cache) KV scales."""
        out = attn_fn(
            q, kv_cache, meta, self.scale, window=self.window, sinks=self.sinks, softcap=self.softcap, kv_scale=self.kv_scale
        )
        return self.o_proj(out.reshape(q.shape[0], self.num_heads * self.head_dim))


def _fused_linear(*parts: nn.Linear) -> nn.Linear:
    """One Linear whose output is the concatenation of ``parts``' outputs."""
    weight = torch.cat([p.weight for p in parts])
    bias = None if parts[0].bias is None else torch.cat([p.bias for p in parts])
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta", dtype=weight.dtype)
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        fused.bias = nn.Parameter(bias, requires_grad=False)
    return fused
