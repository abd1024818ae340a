"""Errors after which the GPU can run nothing more: the engine stops at once, and a server exits.

A device-side assert, an illegal address or a launch failure poisons the CUDA context: every
later call on it fails the same way, so blaming the step's requests and going on (what the
engine does with any other error) would fail every request after it, forever. Instead the error
becomes :class:`DeviceLost`, which the engine never catches: its serving loop (engine/loop.py)
fails what is in flight and stops, saying why to its client (``EngineClient.error``, ``on_dead``),
``/health`` says ``dead`` and ``kvtier serve`` exits non-zero so that a supervisor starts a fresh
process (docs/SERVING.md).
"""

from __future__ import annotations

import torch


class DeviceLost(RuntimeError):
    """The engine's GPU context is unusable (the error it hit is ``__cause__``)."""


# what torch's messages say when the context is gone (an out-of-memory error is not among them:
# it fails one allocation, and the engine recovers from it like from any other error)
_MARKERS = (
    "device-side assert",
    "illegal memory access",
    "an illegal instruction",
    "misaligned address",
    "unspecified launch failure",
    "launch timed out",
    "uncorrectable ECC",
    "CUDA error: unknown error",
    "CUBLAS_STATUS_EXECUTION_FAILED",
    "CUDA-capable device(s) is/are busy or unavailable",
)


def device_lost(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) says the GPU context is unusable."""
    seen = 0
    cur: BaseException | None = exc
    while cur is not None and seen < 8:
        if isinstance(cur, DeviceLost):
            return True
        if isinstance(cur, (RuntimeError, getattr(torch, "AcceleratorError", RuntimeError))):
            text = str(cur)
            if "out of memory" not in text and any(m in text for m in _MARKERS):
                return True
        cur, seen = cur.__cause__ or cur.__context__, seen + 1
    return False


def raise_if_device_lost(exc: BaseException) -> None:
    """Raise :class:`DeviceLost` (``exc`` itself if it is one) if ``exc`` says the GPU is gone."""
    if isinstance(exc, DeviceLost):
        raise exc
    if device_lost(exc):
        raise DeviceLost(f"the GPU can run nothing more: {exc}") from exc
