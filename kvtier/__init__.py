"""kvtier: a tiered KV cache (device -> host -> storage pool) with the engine that uses it.

``kvtier.cache`` is pure Python; the engine parts (``LLM``, ``SamplingParams``) import torch
lazily, on first use.
"""
from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "LLM": "kvtier.engine.llm",
    "SamplingParams": "kvtier.engine.sampling",
    "RequestOutput": "kvtier.engine.llm",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvtier' has no attribute {name!r}")
