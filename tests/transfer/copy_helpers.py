"""Byte helpers shared by the copy-op tests: poisoned destinations, random sources."""

from __future__ import annotations

import torch


def poison(t: torch.Tensor) -> torch.Tensor:
    """Every byte 0xA5: a chunk a copy should not touch keeps it, a dropped tail byte shows."""
    t.view(torch.uint8).fill_(0xA5)
    return t


def random_(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Fresh random bytes (any dtype: NaN patterns included), drawn on CPU for reproducibility."""
    raw = torch.randint(0, 256, (t.numel() * t.element_size(),), dtype=torch.uint8, generator=gen)
    t.view(-1).view(torch.uint8).copy_(raw.to(t.device))
    return t


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8))
