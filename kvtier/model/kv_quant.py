"""fp8 KV: the cache's dtype, its scales, and the quantization every writer and reader shares.

With ``kv_cache_dtype`` fp8 every tier holds K and V (or a latent) in one byte per number. A
layer's numbers are stored divided by a scale per plane and KV head and read back multiplied
by it::

    stored = fp8(clamp(x / scale, -fp8_max, fp8_max))        x' = float(stored) * scale

    scales[layer] : kv_layout[:-1]   full attention [2, num_kv_heads] (K, V per head)
                                     a latent (MLA)  [1]              (one vector, one scale)

Scales are fixed before any block is written into any tier and never change while the engine
runs: a stored block's bytes mean the same thing to every engine whose fingerprint has the same
scales (:func:`scales_digest` enters the model's namespace). They come from the checkpoint where
it has them (``k_scale``/``v_scale``, as vLLM and compressed-tensors checkpoints name them), else
from calibration (model/kv_scales.py): one forward of a fixed built-in input at engine build (never user
traffic, which would make two engines on one checkpoint disagree), each scale the power of two
at or above twice the largest value seen over fp8's largest. A power of two divides exactly, so
quantizing is one rounding, the same in every backend and in the reference tests.
"""

from __future__ import annotations

import hashlib

import torch

KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
HEADROOM = 2.0  # room above the largest calibrated value before a number saturates


def kv_cache_torch_dtype(kv_cache_dtype: str, compute_dtype: torch.dtype) -> torch.dtype:
    """The cache's torch dtype: ``auto`` the compute dtype, else an fp8 dtype (ValueError naming
    an unknown value)."""
    if kv_cache_dtype == "auto":
        return compute_dtype
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}; choose auto, {', '.join(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[kv_cache_dtype]


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether a cache of ``dtype`` is quantized (needs scales)."""
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` [T, heads, D] (or [T, D] with one scale) as ``dtype``: divided by ``scale`` [heads]
    (or [1]), clamped to the dtype's range, rounded once."""
    limit = torch.finfo(dtype).max
    s = scale.float().reshape(-1, *([1] * (x.dim() - 2))) if x.dim() > 2 else scale.float().reshape(1)
    return (x.float() / s).clamp(-limit, limit).to(dtype)


def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The power of two at or above ``HEADROOM * amax / fp8_max`` for each entry (1.0 where
    nothing was seen)."""
    ratio = amax.double().cpu() * HEADROOM / torch.finfo(dtype).max
    out = torch.ones_like(ratio)
    seen = ratio > 0
    out[seen] = torch.exp2(torch.ceil(torch.log2(ratio[seen])))
    return out.float()


def scales_digest(scales: list[torch.Tensor]) -> str:
    """16 hex digits naming ``scales`` exactly (their fp32 bytes, layer by layer)."""
    h = hashlib.sha256()
    for s in scales:
        h.update(str(tuple(s.shape)).encode())
        h.update(s.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]
