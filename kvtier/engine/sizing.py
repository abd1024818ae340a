"""How big the engine's tiers are when the options leave it open: the dtype ``auto`` picks, the
device tier from free GPU memory (or RAM on CPU), the host tier a storage pool gets."""

from __future__ import annotations

import logging
import math
import os

import torch

from kvtier.model import ModelConfig

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """``auto``: the checkpoint's dtype on CUDA, float32 on CPU."""
    if dtype == "auto":
        return cfg.torch_dtype if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose auto, float32, bfloat16 or float16")
    return DTYPES[dtype]


def block_nbytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block over every layer with KV (the MTP blocks' too) of ``cfg.kv_layout``: K and V of
    ``cfg``'s KV heads (under tensor parallelism, a rank's config: its share), or one latent per token
    (576 numbers per token and layer for DeepSeek-V3)."""
    return math.prod(cfg.kv_layout) * block_size * cfg.num_kv_layers * dtype.itemsize


def blocks_per_sequence(max_model_len: int, block_size: int) -> int:
    return -(-max_model_len // block_size)


def sliding_slots(window: int, block_size: int, num_device_blocks: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """Blocks of a sliding group's own (cache/sliding.py): every running request's window (the
    blocks it straddles, and the one a decode step writes) plus a step's new tokens, at most one
    per device block. A request of any length needs no more: a 32K-token request on gpt-oss-20b
    (window 128, block 16) holds 2,048 blocks in its full layers and 10 in its sliding ones."""
    per_request = -(-window // block_size) + 2
    return min(num_device_blocks, max_num_seqs * per_request + -(-max_num_batched_tokens // block_size))


ACTIVATION_RESERVE = 1 << 30  # bytes left to a step's activations, CUDA graphs and kernel workspaces


def device_budget(free: int, total: int, gpu_memory_utilization: float | None) -> int:
    """Bytes the device tier may take on a GPU with ``free`` of ``total`` bytes free, measured
    after the weights loaded: 90% of the free memory, or with ``gpu_memory_utilization`` that
    fraction of the total less what is in use (weights, other processes); less the activation
    reserve either way."""
    if gpu_memory_utilization is None:
        return int(free * 0.9) - ACTIVATION_RESERVE
    return int(total * gpu_memory_utilization) - (total - free) - ACTIVATION_RESERVE


# how the device tier is sized on a CPU (what a gpu_memory_utilization given there is ignored for)
CPU_SIZING = (
    "on cpu the device tier is 20% of the available memory, at most max_num_seqs full-length "
    "sequences (--num-device-blocks sets it)"
)


def size_device_blocks(
    device: torch.device,
    bytes_per_block: int,
    block_size: int,
    max_num_seqs: int,
    max_model_len: int,
    gpu_memory_utilization: float | None = None,
) -> int:
    """Blocks that fit in free memory (:func:`device_budget` on a GPU; 20% of available RAM on
    CPU), capped at what max_num_seqs full-length sequences could use unless
    ``gpu_memory_utilization`` says how much to take."""
    need = blocks_per_sequence(max_model_len, block_size)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = device_budget(free, total, gpu_memory_utilization)
        where = (
            f"{gpu_memory_utilization} of the GPU's {total / 2**30:.1f} GiB, of which "
            f"{(total - free) / 2**30:.1f} GiB are in use (weights, other processes),"
            if gpu_memory_utilization is not None
            else "free memory"
        )
    else:
        budget, where = int(available_ram() * 0.2), "free memory"
        gpu_memory_utilization = None  # (a GPU's option: CPU_SIZING below; the engine warns)
    n = max(0, budget // bytes_per_block)
    if gpu_memory_utilization is None:
        n = min(n, max_num_seqs * need)
    if n < need:
        raise ValueError(
            f"only {n} KV blocks fit in {where} less {ACTIVATION_RESERVE >> 30} GiB for activations, but one "
            f"{max_model_len}-token sequence needs {need}; lower max_model_len, raise gpu_memory_utilization or free memory"
        )
    return int(n)


def size_host_blocks(bytes_per_block: int, block_size: int, num_device_blocks: int, max_model_len: int) -> int:
    """The host tier a storage pool gets when num_host_blocks is not given: twice the device
    tier (room for its backups and for fetches) and at least two full-length sequences,
    capped at a quarter of the available RAM."""
    need = blocks_per_sequence(max_model_len, block_size)
    budget = int(available_ram() * 0.25) // bytes_per_block
    n = min(max(2 * num_device_blocks, 2 * need), budget)
    if n < 1:
        raise ValueError(
            f"no room for a host tier in free memory ({available_ram()} bytes, {bytes_per_block} per block); set num_host_blocks"
        )
    log.info("host tier: %d blocks (%.2f GiB; num_host_blocks not set, a storage pool is)", n, n * bytes_per_block / 2**30)
    return int(n)


def check_host_blocks(num_host_blocks: int, bytes_per_block: int) -> None:
    """ValueError if ``num_host_blocks`` would not fit in the memory available now."""
    need, have = num_host_blocks * bytes_per_block, available_ram()
    if need > have:
        raise ValueError(
            f"num_host_blocks={num_host_blocks} needs {need / 2**30:.1f} GiB of host memory "
            f"({bytes_per_block} bytes per block), more than the {have / 2**30:.1f} GiB available"
        )


def available_ram() -> int:
    """Bytes of memory available to allocate now (MemAvailable: free + reclaimable cache)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
