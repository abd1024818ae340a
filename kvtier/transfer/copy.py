"""Moving KV blocks between the device layout and the host layout (DESIGN §4).

    device (per layer l):  kv[l]  [planes, num_device_blocks, block_size, *plane]
    host (page first):     host   [num_host_blocks, num_layers, planes, block_size, *plane]

as ModelConfig.kv_layout gives them: 2 planes (K, V) of [kv_heads, head_dim] for full attention,
1 plane of [kv_width] for a latent (MLA).

One host block holds all layers of one block contiguously, so it is one storage object.
These are the torch reference ops (any device, synchronous on the current stream); a fast path
must keep their signatures and be tested against them.
"""

from __future__ import annotations

import torch


def allocate_host_kv(
    num_blocks: int, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, pin: bool = False
) -> torch.Tensor:
    """A zeroed host tier of full-attention KV (any layout: ``torch.zeros(model.host_kv_shape(cfg, ...))``)."""
    shape = (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
    return torch.zeros(shape, dtype=dtype, pin_memory=pin)


def _index(blocks, device) -> torch.Tensor:
    return torch.as_tensor(list(blocks), dtype=torch.long, device=device)


def device_to_host(kv_caches: list[torch.Tensor], host: torch.Tensor, device_blocks, host_blocks) -> None:
    """host[host_blocks[i]] = all layers of device block device_blocks[i]."""
    src = _index(device_blocks, kv_caches[0].device)
    dst = _index(host_blocks, host.device)
    for layer, kv in enumerate(kv_caches):
        host[dst, layer] = kv[:, src].transpose(0, 1).to(host.device, non_blocking=False)


def host_to_device(
    host: torch.Tensor, kv_caches: list[torch.Tensor], host_blocks, device_blocks, layer: int | None = None
) -> None:
    """Device block device_blocks[i] = host block host_blocks[i] (one layer, or all)."""
    src = _index(host_blocks, host.device)
    dst = _index(device_blocks, kv_caches[0].device)
    layers = range(len(kv_caches)) if layer is None else (layer,)
    for i in layers:
        kv_caches[i][:, dst] = host[src, i].transpose(0, 1).to(kv_caches[i].device)
