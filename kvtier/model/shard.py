"""Tensor parallelism inside the model (Megatron's split): each rank holds 1/tp of every layer.

::

    q, k, v, gate, up   column-parallel: rank r holds heads / rows r*n/tp .. (r+1)*n/tp - 1
    o_proj, down_proj   row-parallel: the matching input columns; their partial sums are added
                        across ranks by one all-reduce after attention and one after the MLP
    experts             each expert split like a dense MLP (every rank holds every expert's slice;
                        the router and the shared-expert gate are replicated, so routing is the
                        same on every rank: R3 is captured once)
    embed, norms, lm_head, router, q/k norms   replicated
    MLA (DeepSeek)      q_proj / q_b_proj and kv_b_proj column-parallel by head, o_proj row-parallel;
                        q_a_proj and kv_a_proj_with_mqa replicated: every rank computes the same
                        latent and caches all of it (the cache is not split, the heads are)

A rank's model is built from :func:`shard_config` (its heads and intermediate sizes), so its KV
cache holds its own ``num_kv_heads / tp`` heads. The hidden states after each all-reduce are the
same on every rank, which is what lets one rank (rank 0) compute the logits and sample for all.
A bias of a row-parallel layer is added once: rank 0 holds it, the others hold zeros.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from kvtier.model.config import ModelConfig

_COLUMN = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj|q_b_proj|kv_b_proj)\.(weight|bias)$")
_ROW = re.compile(r"\.(o_proj|down_proj)\.weight$")
_ROW_BIAS = re.compile(r"\.(o_proj|down_proj)\.bias$")


@dataclass(frozen=True)
class TPShard:
    """Which slice of the model this process holds, and the group its all-reduces run in
    (a ``torch.distributed`` process group; None for a shard built alone, e.g. to check a slice)."""

    rank: int
    size: int
    group: Any = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank must be in 0..{self.size - 1}, got {self.rank}")


def check_divisible(cfg: ModelConfig, size: int) -> None:
    """ValueError naming the first size that ``size`` ranks cannot split evenly."""
    sizes = {
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads if cfg.kv_kind != "latent" else 0,  # (a latent: whole on every rank)
        "intermediate_size": cfg.intermediate_size,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size,
    }
    for name, n in sizes.items():
        if n % size:
            raise ValueError(
                f"tensor_parallel_size={size} does not divide the model's {name} ({n}): "
                f"choose a size that divides it (KV heads are not replicated across ranks)"
            )


def shard_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The config of one rank's slice: heads and intermediate sizes divided by ``size``."""
    if size == 1:
        return cfg
    check_divisible(cfg, size)
    return replace(
        cfg,
        num_heads=cfg.num_heads // size,
        num_kv_heads=cfg.num_kv_heads // size if cfg.kv_kind != "latent" else cfg.num_kv_heads,
        intermediate_size=cfg.intermediate_size // size,
        moe_intermediate_size=cfg.moe_intermediate_size // size,
        shared_expert_intermediate_size=cfg.shared_expert_intermediate_size // size,
    )


def shard_dim(name: str) -> int | str | None:
    """How parameter ``name`` is split: along dim 0 or 1, ``"once"`` (a row-parallel bias: rank 0
    holds it), or None (replicated)."""
    if _COLUMN.search(name):
        return 0
    if _ROW.search(name):
        return 1
    if _ROW_BIAS.search(name):
        return "once"
    return None


def full_shape(name: str, shape: tuple[int, ...], size: int) -> tuple[int, ...]:
    """The whole tensor's shape, from a rank's slice of it."""
    dim = shard_dim(name)
    if not isinstance(dim, int):
        return shape
    out = list(shape)
    out[dim] *= size
    return tuple(out)


def take_shard(name: str, tensor: torch.Tensor, shard: TPShard | None) -> torch.Tensor:
    """Rank ``shard.rank``'s slice of the whole checkpoint tensor ``name``."""
    if shard is None or shard.size == 1:
        return tensor
    dim = shard_dim(name)
    if dim is None:
        return tensor
    if dim == "once":
        return tensor if shard.rank == 0 else torch.zeros_like(tensor)
    assert isinstance(dim, int)
    return take_slice(tensor, tuple(tensor.shape), dim, shard, name)


def take_slice(part: Any, shape: tuple[int, ...], dim: int, shard: TPShard, name: str) -> torch.Tensor:
    """Rank ``shard.rank``'s slice along ``dim`` of ``part`` (of ``shape``): a tensor, or a
    safetensors slice (``safe_open(...).get_slice``), which then reads those bytes alone."""
    n = shape[dim]
    if n % shard.size:
        raise ValueError(f"tensor {name!r} dim {dim} ({n}) does not split into {shard.size} tensor-parallel slices")
    step = n // shard.size
    index = [slice(None)] * len(shape)
    index[dim] = slice(shard.rank * step, (shard.rank + 1) * step)
    return part[tuple(index)]


def all_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Sum ``x`` over the ranks of ``group`` in place (the row-parallel layers' partial sums)."""
    dist.all_reduce(x, group=group)
    return x


def broadcast_from_first(x: torch.Tensor, shard: TPShard | None) -> torch.Tensor:
    """Rank 0's ``x`` onto every rank of ``shard``'s group, in place (the tokens rank 0 sampled)."""
    assert shard is not None and shard.group is not None
    dist.broadcast(x, group_src=0, group=shard.group)
    return x
