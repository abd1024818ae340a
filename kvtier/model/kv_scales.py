"""Where an fp8 cache's scales come from (model/kv_quant.py says what they mean): the checkpoint's
``k_scale``/``v_scale``, else one calibration forward of a fixed built-in input, run when the
engine is built and before any block is written into any tier::

    checkpoint has model.layers.N.self_attn.{k,v}_scale?  ─yes─►  those (one or one per KV head)
            │ no
            ▼
    calibration_ids(vocab)  (512 ids, seed 0, drawn on the CPU: the same on every machine)
      ─► forward into a scratch cache in the compute dtype ─► largest |K|, |V| per layer and head
      ─► scale_from_amax (a power of two, twice the headroom)  ─►  set_kv_scales(model)
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import cast

import torch

from kvtier.model.attention import AttentionMetadata
from kvtier.model.config import ModelConfig
from kvtier.model.kv_quant import scale_from_amax

CALIBRATION_TOKENS = 512  # the built-in input's length
CALIBRATION_SEED = 0


_SCALE_NAME = re.compile(r"model\.layers\.(\d+)\.self_attn\.(?:[kv]_proj\.|attn\.|kv_a_proj_with_mqa\.)?([kv])_scale$")


def checkpoint_kv_scales(
    files: list[Path], kv_layout: tuple[int, ...], num_layers: int, num_kv_layers: int
) -> list[torch.Tensor] | None:
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
                raise ValueError(
                    f"layer {layer}'s {which}_scale must be one positive number or {heads} (one per KV head), got {s.tolist()}"
                )
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

    cfg = cast(ModelConfig, model.config)  # (a CausalLM's)
    device = next(model.parameters()).device
    compute = next(p.dtype for p in model.parameters() if p.is_floating_point())
    ids = calibration_ids(cfg.vocab_size)
    n = len(ids)
    num_blocks = -(-n // block_size)
    caches = allocate_kv_caches(cfg, num_blocks, block_size, device, compute)
    meta = AttentionMetadata.build([n], [n], [list(range(num_blocks))], block_size, device)
    model(torch.tensor(ids, device=device), torch.arange(n, device=device), caches, meta)
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
    ``device`` (``scales``: every KV head's; under tensor parallelism a rank takes its heads, as
    its K/V projections were sliced); None: no quantization."""
    tp = getattr(model, "tp", None)
    for m in model.modules():
        if hasattr(m, "kv_scale") and hasattr(m, "layer_idx"):
            s = None if scales is None else scales[cast(int, m.layer_idx)]
            if s is not None and tp is not None and tp.size > 1 and s.dim() == 2:
                step = s.shape[1] // tp.size
                s = s[:, tp.rank * step : (tp.rank + 1) * step]
            setattr(m, "kv_scale", None if s is None else s.contiguous().to(device))


def kv_scales_for(
    path: Path, model: torch.nn.Module, dtype: torch.dtype, load_format: str = "auto"
) -> tuple[list[torch.Tensor], str]:
    """The scales of every KV head of the model (under tensor parallelism too: every rank calls
    this at once, and the calibration forward's collectives join them) for a ``dtype`` cache, and
    where they came from: ``"checkpoint"`` (its k_scale/v_scale, :func:`checkpoint_kv_scales`) or
    ``"calibrated"`` (:func:`calibrate`, each rank its KV heads, gathered; a latent, whole on
    every rank, takes the largest of the ranks' scales, so that every rank holds the same)."""
    cfg = cast(ModelConfig, model.config)  # (a CausalLM's: a rank's share of the KV heads)
    tp = getattr(model, "tp", None)
    size = tp.size if tp is not None else 1
    planes, *plane = cfg.kv_layout
    layout = (planes, plane[0] * size, *plane[1:]) if planes == 2 else cfg.kv_layout  # every rank's KV heads
    if load_format != "dummy":
        from kvtier.model.loader import safetensors_files

        scales = checkpoint_kv_scales(safetensors_files(path), layout, cfg.num_layers, cfg.num_kv_layers)
        if scales is not None:
            return scales, "checkpoint"
    local = calibrate(model, dtype)
    if size == 1:
        return local, "calibrated"
    import torch.distributed as dist

    assert tp is not None  # (size > 1)
    device = next(model.parameters()).device
    mine = torch.stack(local).to(device)  # [layers, 2, this rank's KV heads] or a latent's [layers, 1]
    if planes == 1:  # a latent is whole on every rank: one scale each, the same on every rank
        dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=tp.group)
        return list(mine.cpu().unbind(0)), "calibrated"
    every = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(every, mine, group=tp.group)
    return list(torch.cat(every, dim=2).cpu().unbind(0)), "calibrated"
