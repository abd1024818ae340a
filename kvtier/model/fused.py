"""Fused small ops of a decoder layer, each a torch function (the reference, and the CPU path) and
a Triton kernel with the same signature (CUDA), chosen per call by :func:`use_triton`.

A decode step of a 28-layer model launched ~1,100 kernels, ~39 a layer, most of them tiny
(elementwise, casts, cat, index): at 2-3 us each they cost more GPU time than the GEMMs. Three ops
take ~30 of a layer's kernels down to 3::

    add_rms_norm(x, residual, weight, eps)          residual add + RMSNorm       5 kernels -> 1
    rope_write_kv(q, k, v, cos, sin, kv_cache, slot_mapping, q_norm, k_norm, eps, kv_scale)
                                                    q/k RMSNorm + RoPE + KV write 20 kernels -> 1
                                                    (an fp8 cache: quantized with kv_scale)
    silu_and_mul(gate_up)                           act(gate) * up                2 kernels -> 1

Each follows the arithmetic of transformers' layers (which dtype, which rounding, in which order):
sums and products are computed in fp32 and rounded to the model dtype where torch rounds them,
so fp32 results equal the unfused path to float rounding of the reductions and bf16 results to
the last bit but for those.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvtier.model.attention import write_kv


def use_triton(x: torch.Tensor) -> bool:
    """The Triton kernels run for CUDA tensors when triton imports."""
    if not x.is_cuda:
        return False
    from kvtier.model import triton_fused

    return triton_fused.available()


# ------------------------------------------------------------------ torch references
def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual`` (x itself when residual is None), then ``weight * rms_norm(h)`` as
    transformers' RMSNorm computes it (fp32 norm, cast back, times the weight). Returns (normed, h)."""
    h = x if residual is None else x + residual
    y = F.rms_norm(h.float(), (h.shape[-1],), eps=eps)
    return weight * y.to(h.dtype), h


def rope_write_kv_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, Hq, D], k and v [T, Hk, D]; cos, sin [T, 1, D] (rotate-half layout). Optional per-head
    RMSNorm of q and k (Qwen3), RoPE of both, k and v written at their slots (quantized with
    ``kv_scale`` into an fp8 cache). Returns rotated q."""
    if q_norm is not None:
        assert k_norm is not None  # (q and k norms come together)
        q = add_rms_norm_ref(q, None, q_norm, eps)[0]
        k = add_rms_norm_ref(k, None, k_norm, eps)[0]
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    write_kv(kv_cache, k, v, slot_mapping, kv_scale)
    return q


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


# ------------------------------------------------------------------ dispatch
def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(x) and x.is_contiguous() and (residual is None or residual.is_contiguous()):
        from kvtier.model.triton_fused import add_rms_norm as kernel

        return kernel(x, residual, weight, eps)
    return add_rms_norm_ref(x, residual, weight, eps)


def rope_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    if use_triton(q) and (q.dtype == kv_cache.dtype or kv_scale is not None):
        from kvtier.model.triton_fused import rope_write_kv as kernel

        return kernel(q, k, v, cos, sin, kv_cache, slot_mapping, q_norm, k_norm, eps, kv_scale)
    return rope_write_kv_ref(q, k, v, cos, sin, kv_cache, slot_mapping, q_norm, k_norm, eps, kv_scale)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if use_triton(gate_up) and gate_up.is_contiguous():
        from kvtier.model.triton_fused import silu_and_mul as kernel

        return kernel(gate_up)
    return silu_and_mul_ref(gate_up)
