"""The options an :class:`~kvtier.engine.config.EngineConfig` leaves to the model and the machine,
decided once, in two steps (engine/build.py calls both; every part then takes the result)::

    EngineConfig as given
      ─► resolve(config, model)       before the weights load: device (cuda -> cuda:N), dtype,
                                      attention_backend, max_model_len, cuda_graphs,
                                      overlap_schedule, max_num_seqs_per_request
      ─► size_tiers(config, ...)      after they loaded (free memory is known, and under tensor
                                      parallelism what fits every rank): num_device_blocks,
                                      num_host_blocks, preemption_mode, write_policy

A multi-head latent attention model (DeepSeek-V2/V3) resolves like the others (triton on CUDA: its
decode rows on model/triton_mla.py's kernel) but with no CUDA graphs (model/mla.py splits a step
into decode and prefill rows on the host, which a captured graph would freeze), and is refused with
tensor parallelism.

The result is an EngineConfig like any other (its checks ran again; a tensor-parallel rank gets
it as it is), with none of these left ``None``: a part reads ``config.max_model_len``, never the
model's. ``gpu_memory_utilization`` is spent by the sizing: the resolved config says
``num_device_blocks`` instead. What each default is: engine/config.py's docstring.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Sequence

import torch

from kvtier.cache.policy import default_write_policy
from kvtier.engine.config import EngineConfig
from kvtier.engine.sizing import (
    CPU_SIZING,
    block_nbytes,
    check_host_blocks,
    resolve_dtype,
    size_device_blocks,
    size_host_blocks,
)
from kvtier.model import ModelConfig
from kvtier.model.shard import check_divisible

log = logging.getLogger(__name__)


def default_seqs_per_request(max_num_seqs: int) -> int:
    """``max_num_seqs_per_request``'s default: a quarter of the running slots, at least one."""
    return max(1, max_num_seqs // 4)


def resolve_device(device: str) -> torch.device:
    """``device`` as the engine runs on it: ``cuda`` becomes the current GPU, ``cuda:N``.
    ValueError when CUDA is asked for and torch sees none."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} asked for, but torch sees no CUDA device")
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def resolve(config: EngineConfig, model: ModelConfig) -> EngineConfig:
    """Every open option that the model and the machine decide before the weights load.
    ValueError naming the value when the model or the machine cannot take ``config``: heads
    that ``tensor_parallel_size`` does not divide, too few GPUs, a host tier larger than the
    memory available."""
    c = config
    device = resolve_device(c.device)
    dtype = resolve_dtype(c.dtype, model, device)
    tp = c.tensor_parallel_size
    latent = model.kv_kind == "latent"  # multi-head latent attention: eagerly (no CUDA graphs)
    if latent:
        _check_latent(c, model)
    if tp > 1 and model.vision is not None:
        raise ValueError(
            f"tensor_parallel_size={tp} is not supported for {model.vision.architecture}: "
            "vision-language models are served on one device"
        )
    if tp > 1:
        check_divisible(model, tp)
        if device.type == "cuda" and device.index + tp > torch.cuda.device_count():
            raise ValueError(
                f"tensor_parallel_size={tp} from {device} needs GPUs {device.index}..{device.index + tp - 1}; "
                f"torch sees {torch.cuda.device_count()}"
            )
    if c.num_host_blocks is not None:
        from kvtier.model.kv_quant import kv_cache_torch_dtype

        check_host_blocks(c.num_host_blocks, block_nbytes(model, c.block_size, kv_cache_torch_dtype(c.kv_cache_dtype, dtype)))
    backend = c.attention_backend or ("triton" if device.type == "cuda" else "torch")
    cuda_graphs = device.type == "cuda" and not latent if c.cuda_graphs is None else c.cuda_graphs
    if cuda_graphs and device.type == "cuda" and backend != "triton":
        # a captured graph keeps the host lengths the torch reference read at capture
        log.warning("CUDA graphs need the triton attention backend (got %r): running eagerly", backend)
        cuda_graphs = False
    return replace(
        c,
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        attention_backend=backend,
        max_model_len=min(c.max_model_len or model.max_position_embeddings, model.max_position_embeddings),
        cuda_graphs=cuda_graphs,
        overlap_schedule=device.type == "cuda" if c.overlap_schedule is None else c.overlap_schedule,
        max_num_seqs_per_request=c.max_num_seqs_per_request or default_seqs_per_request(c.max_num_seqs),
    )


def _check_latent(config: EngineConfig, model: ModelConfig) -> None:
    """ValueError naming what a multi-head latent attention model is not served with: CUDA graphs
    (its prefill chunks and the split of a step into decode and prefill rows run on the host;
    decode rows run on the Triton MLA kernel with the triton backend, model/triton_mla.py).
    (Tensor parallelism: model/shard.py check_divisible.)"""
    if config.cuda_graphs:
        raise ValueError(
            f"cuda_graphs=True is not supported for {model.architecture}: multi-head latent attention runs "
            "eagerly; leave it unset (or --enforce-eager)"
        )


def size_tiers(config: EngineConfig, bytes_per_block: int, rank_fits: Sequence[int] = ()) -> EngineConfig:
    """The tiers' sizes of a config :func:`resolve` returned, once the weights are in memory, and
    what depends on them. ``bytes_per_block``: one block of the whole model's KV (each of the
    ``tensor_parallel_size`` ranks holds its share); ``rank_fits``: the device blocks that fit
    each other rank (every rank holds as many as the tightest one fits)."""
    c = config
    assert c.max_model_len is not None, "size_tiers takes a resolved config (resolve)"
    device = torch.device(c.device)
    if c.gpu_memory_utilization is not None and device.type != "cuda":
        log.warning(
            "gpu_memory_utilization=%s is for cuda devices and is ignored: %s",
            c.gpu_memory_utilization,
            f"num_device_blocks={c.num_device_blocks} sizes it here" if c.num_device_blocks is not None else CPU_SIZING,
        )
    num_device_blocks = c.num_device_blocks
    if num_device_blocks is None:
        num_device_blocks = size_device_blocks(
            device,
            bytes_per_block // c.tensor_parallel_size,
            c.block_size,
            c.max_num_seqs,
            c.max_model_len,
            c.gpu_memory_utilization,
        )
    num_device_blocks = min([num_device_blocks, *rank_fits])
    num_host_blocks = c.num_host_blocks
    if num_host_blocks is None:  # a pool's I/O goes through a host tier: it gets one
        has_pool = c.storage is not None
        num_host_blocks = size_host_blocks(bytes_per_block, c.block_size, num_device_blocks, c.max_model_len) if has_pool else 0
    return replace(
        c,
        num_device_blocks=num_device_blocks,
        num_host_blocks=num_host_blocks,
        gpu_memory_utilization=None,  # (spent: num_device_blocks says it now)
        preemption_mode=c.preemption_mode or ("swap" if num_host_blocks else "recompute"),
        write_policy=c.write_policy or default_write_policy(bool(num_host_blocks), c.storage is not None),
    )
