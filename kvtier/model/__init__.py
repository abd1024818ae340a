"""Transformer families on paged KV and their Hugging Face checkpoint loader.

cfg = ModelConfig.from_hf_dir(path)
model = load_model(path, device="cuda", dtype=torch.bfloat16, attention_backend="triton")
kv_caches = allocate_kv_caches(cfg, num_blocks, block_size, device, dtype)   # by cfg.kv_layout
hidden = model(input_ids, positions, kv_caches, meta)      # meta: AttentionMetadata
logits = model.compute_logits(hidden)

The names above are imported on first use: ``kvtier.model.hub`` and ``kvtier.model.tokenizer``
(what the serving process reads: a checkpoint's directory, its tokenizer) import no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from kvtier.model.attention import AttentionMetadata
    from kvtier.model.config import SUPPORTED_ARCHITECTURES, ModelConfig
    from kvtier.model.families import CausalLM
    from kvtier.model.loader import load_model, weights_digest
    from kvtier.model.presets import PRESETS, init_model

__all__ = [
    "AttentionMetadata",
    "CausalLM",
    "ModelConfig",
    "PRESETS",
    "SUPPORTED_ARCHITECTURES",
    "allocate_kv_caches",
    "host_kv_shape",
    "init_model",
    "load_model",
    "weights_digest",
]

# attribute -> the submodule defining it (imported on first use)
_LAZY = {
    "AttentionMetadata": "kvtier.model.attention",
    "SUPPORTED_ARCHITECTURES": "kvtier.model.config",
    "ModelConfig": "kvtier.model.config",
    "CausalLM": "kvtier.model.families",
    "load_model": "kvtier.model.loader",
    "weights_digest": "kvtier.model.loader",
    "PRESETS": "kvtier.model.presets",
    "init_model": "kvtier.model.presets",
}


def __getattr__(name: str) -> Any:
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvtier.model' has no attribute {name!r}")


def allocate_kv_caches(
    cfg: ModelConfig, num_blocks: int, block_size: int, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> list[torch.Tensor]:
    """One zeroed tensor per layer with KV (the decoder's, then any MTP block's, ModelConfig.num_kv_layers):
    [planes, num_blocks, block_size, *plane] for ``cfg.kv_layout`` (DESIGN §4): full attention
    [2, num_blocks, block_size, num_kv_heads, head_dim], a latent (MLA) [1, num_blocks, block_size,
    kv_width]; ``dtype`` None: float32.

    The layers are views of one buffer, so a copy of all layers of a block (a backup to the host
    tier) is one kernel launch: layer l starts at a fixed stride from layer 0."""
    import torch

    planes, *plane = cfg.kv_layout
    shape = (cfg.num_kv_layers, planes, num_blocks, block_size, *plane)
    return list(torch.zeros(shape, device=device, dtype=dtype or torch.float32).unbind(0))


def host_kv_shape(cfg: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """The host tier's shape for ``cfg.kv_layout``: [num_blocks, num_kv_layers, planes, block_size,
    *plane], every layer of a block contiguous (one storage object per block, DESIGN §4)."""
    planes, *plane = cfg.kv_layout
    return (num_blocks, cfg.num_kv_layers, planes, block_size, *plane)
