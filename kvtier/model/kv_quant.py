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
from :func:`calibrate`: one forward of a fixed built-in input at engine build (never user
traffic, which would make two engines on one checkpoint disagree), each scale the power of two
at or above twice the largest value seen over fp8's largest. A power of two divides exactly, so
quantizing is one rounding, the same in every backend and in the reference tests.
"""

from __future__ import annotations

import hashlib
import math
import re
from pathlib import Path

import torch

from kvtier.model.attention import AttentionMetadata

KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
CALIBRATION_TOKENS = 512  # the built-in input's length
CALIBRATION_SEED = 0
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
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` [T, heads, D] (or [T, D] with one scale) as ``dtype``: divided by ``scale`` [heads]
    (or [1]), clamped to the dtype's range, rounded once."""
    limit = torch.finfo(dtype).max
    s = scale.float().reshape(-1, *([1] * (x.dim() - 2))) if x.dim() > 2 else scale.float().reshape(1)
    return (x.float() / s).clamp(-limit, limit).to(dtype)


def dequantize(stored: torch.Tensor, scale: torch.Tensor, head_dim: int = -2) -> torch.Tensor:
    """fp32 of ``stored`` [..., heads, D] times ``scale`` [heads] (or [1]) along ``head_dim``."""
    x = stored.float()
    if scale.numel() == 1:
        return x * scale.float().reshape(())
    shape = [1] * x.dim()
    shape[head_dim] = scale.numel()
    return x * scale.float().reshape(shape)


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


_SCALE_NAME = re.compile(r"model\.layers\.(\d+)\.self_attn\.(?:[kv]_proj\.|attn\.|kv_a_proj_with_mqa\.)?([kv])_scale$")


def checkpoint_kv_scales(files: list[Path], kv_layout: tuple[int, ...], num_layers: int, num_kv_layers: int) -> list[torch.Tensor] | None:
    """Scales per layer of a checkpoint that carries them (``model.layers.N.self_attn.k_scale`` /
    ``v_scale``, also under ``k_proj.``/``attn.``; one number or one per KV head), shaped
    ``kv_layout[:-1]``; a latent takes ``k_scale``. None when it has none; ValueError naming a
    decoder layer without them when some have them. Layers past the decoder's (an MTP block)
    take the largest of the decoder's."""
    from safetensors import safe_open

    found: dict[tuple[int, str], torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                m = _SCALE_NAME.match(key)
                if m:
                    found[int(m[1]), m[2]] = f.get_tensor(key).float().reshape(-1)
    if not found:
        return None
    planes, *plane = kv_layout
    heads = math.prod(plane[:-1])
    wanted = ("k",) if planes == 1 else ("k", "v")
    out = []
    for layer in range(num_layers):
        rows = []
        for which in wanted:
            if (layer, which) not in found:
                raise ValueError(f"the checkpoint has KV scales, but none named {which}_scale for layer {layer}")
            s = found[layer, which]
            if s.numel() not in (1, heads) or not bool((s > 0).all()):
                raise ValueError(f"layer {layer}'s {which}_scale must be one positive number or {heads} (one per KV head), got {s.tolist()}")
            rows.append(s.expand(heads).clone())
        out.append(torch.stack(rows).reshape(planes, *plane[:-1]))
    top = torch.stack(out).amax(dim=0)
    out += [top.clone() for _ in range(num_kv_layers - num_layers)]
    return out


def calibration_ids(vocab_size: int) -> list[int]:
    """The fixed built-in calibration input: ``CALIBRATION_TOKENS`` token ids drawn with a fixed
    seed on the CPU (the same ids on every machine for a given vocabulary)."""
    g = torch.Generator().manual_seed(CALIBRATION_SEED)
    return torch.randint(0, vocab_size, (CALIBRATION_TOKENS,), generator=g).tolist()


@torch.inference_mode()
def calibrate(model: torch.nn.Module, dtype: torch.dtype, block_size: int = 16) -> list[torch.Tensor]:
    """Scales per layer for ``dtype`` from one forward of :func:`calibration_ids` through
    ``model`` (a CausalLM with no scales set yet) into a scratch cache in the compute dtype: the
    largest magnitude each layer wrote per plane and KV head, through :func:`scale_from_amax`.
    A layer the forward does not write (an MTP block) takes the largest of the others'."""
    from kvtier.model import allocate_kv_caches

    cfg = model.config  # type: ignore[attr-defined]  # (a CausalLM's)
    device = next(model.parameters()).device
    compute = next(p.dtype for p in model.parameters() if p.is_floating_point())
    ids = calibration_ids(cfg.vocab_size)
    n = len(ids)
    num_blocks = -(-n // block_size)
    caches = allocate_kv_caches(cfg, num_blocks, block_size, device, compute)
    meta = AttentionMetadata.build([n], [n], [list(range(num_blocks))], block_size, device)
    model(torch.tensor(ids, device=device), torch.arange(n, device=device), caches, meta)  # type: ignore[operator]
    planes, *plane = cfg.kv_layout
    amax = []
    for kv in caches:
        written = kv.reshape(planes, num_blocks * block_size, *plane)[:, :n].abs().float()
        amax.append(written.amax(dim=(1, written.dim() - 1)).cpu())  # [planes, *heads]
    seen = torch.stack(amax)
    top = seen.amax(dim=0)
    return [scale_from_amax(a if bool((a > 0).any()) else top, dtype) for a in amax]


def set_kv_scales(model: torch.nn.Module, scales: list[torch.Tensor] | None, device: torch.device | str) -> None:
    """Give every attention module with a ``kv_scale`` (its ``layer_idx``'s) its scales on
    ``device``; None: no quantization."""
    for m in model.modules():
        if hasattr(m, "kv_scale") and hasattr(m, "layer_idx"):
            m.kv_scale = None if scales is None else scales[m.layer_idx].to(device)


def kv_scales_for(path: Path, model: torch.nn.Module, dtype: torch.dtype, load_format: str = "auto") -> tuple[list[torch.Tensor], str]:
    """``model``'s scales for a ``dtype`` cache and where they came from: ``"checkpoint"`` (its
    k_scale/v_scale, :func:`checkpoint_kv_scales`) or ``"calibrated"`` (:func:`calibrate`)."""
    cfg = model.config  # type: ignore[attr-defined]  # (a CausalLM's)
    if load_format != "dummy":
        from kvtier.model.loader import safetensors_files

        scales = checkpoint_kv_scales(safetensors_files(path), cfg.kv_layout, cfg.num_layers, cfg.num_kv_layers)
        if scales is not None:
            return scales, "checkpoint"
    return calibrate(model, dtype), "calibrated"
