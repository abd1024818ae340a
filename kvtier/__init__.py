"""kvtier: a tiered KV cache (device -> host -> storage pool) with the engine that uses it.

``kvtier.cache`` is pure Python; the engine parts (``LLM``, ``SamplingParams``) and the torch
submodules (``kvtier.experts``) import torch lazily, on first use: ``import kvtier`` stays cheap.
"""

from __future__ import annotations

__version__ = "0.1.0"

# attribute -> module defining it
_LAZY = {
    "LLM": "kvtier.engine.llm",
    "SamplingParams": "kvtier.engine.params",
    "EngineConfig": "kvtier.engine.config",
    "RequestOutput": "kvtier.engine.llm",
    "CompletionOutput": "kvtier.engine.llm",
}
# submodules reachable as attributes after a bare ``import kvtier`` (``kvtier.experts.replay``)
_LAZY_MODULES = ("experts",)


def __getattr__(name: str):
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _LAZY_MODULES:
        return importlib.import_module(f"kvtier.{name}")
    raise AttributeError(f"module 'kvtier' has no attribute {name!r}")
