"""Transformer families on paged KV and their Hugging Face checkpoint loader.

cfg = ModelConfig.from_hf_dir(path)
model = load_model(path, device="cuda", dtype=torch.bfloat16, attention_backend="triton")
kv_caches = allocate_kv_caches(cfg, num_blocks, block_size, device, dtype)
hidden = model(input_ids, positions, kv_caches, meta)      # meta: AttentionMetadata
logits = model.compute_logits(hidden)
"""

from __future__ import annotations

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
    "init_model",
    "load_model",
    "weights_digest",
]


def allocate_kv_caches(
    cfg: ModelConfig, num_blocks: int, block_size: int, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> list[torch.Tensor]:
    """One zeroed tensor per layer with KV (the decoder's, then any MTP block's, ModelConfig.num_kv_layers):
    [2, num_blocks, block_size, num_kv_heads, head_dim] (DESIGN §4).

    The layers are views of one buffer, so a copy of all layers of a block (a backup to the host
    tier) is one kernel launch: layer l starts at a fixed stride from layer 0."""
    shape = (cfg.num_kv_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    return list(torch.zeros(shape, device=device, dtype=dtype).unbind(0))
