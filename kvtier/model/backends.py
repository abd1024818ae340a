"""Attention backends by name: ``torch`` (the reference, any device: kvtier.model.attention) or
``triton`` (CUDA: kvtier.model.triton_attention, imported when asked for)."""

from __future__ import annotations

from typing import Protocol

import torch

from kvtier.model.attention import AttentionMetadata, reference_attention


class AttentionFn(Protocol):
    """A backend: :func:`kvtier.model.attention.reference_attention`'s signature."""

    def __call__(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
        softcap: float | None = None,
        kv_scale: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


BACKENDS = ("torch", "triton")


def get_backend(name: str) -> AttentionFn:
    """The attention function of backend ``name`` (ValueError naming it if unknown)."""
    if name == "torch":
        return reference_attention
    if name == "triton":
        from kvtier.model.triton_attention import triton_attention

        return triton_attention
    raise ValueError(f"unknown attention backend {name!r}; choose from {list(BACKENDS)}")
