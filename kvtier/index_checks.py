"""``KVTIER_CHECK_INDICES=1``: every index tensor a step's kernels read is checked against its
bounds right before the op that reads it, in stream order, on the device, with a message that
names it. Off by default (no cost then): a debugging switch for a device-side "index out of
bounds" assert or for KV that lands in the wrong blocks, where torch's own assert (or none, for a
Triton kernel) does not say which tensor was wrong. A failed check is a device-side assert: the
engine reports it and stops (engine/fatal.py)::

    KVTIER_CHECK_INDICES=1 kvtier serve ...   ->   "KVTIER_CHECK_INDICES: scatter dst_ids out of [0, 1641)"

The checks read the tensors *when the stream reaches them*, so a race (a tensor read before its
upload landed, or after its memory was reused) is caught where it happens, not at the upload.
"""

from __future__ import annotations

import os

import torch

ENABLED = os.environ.get("KVTIER_CHECK_INDICES", "0") == "1"


def check(name: str, ids: torch.Tensor, size: int) -> None:
    """Assert (on ``ids``' device, in stream order) that every value of ``ids`` is in [0, size)."""
    if not ENABLED or ids.numel() == 0:
        return
    if ids.device.type == "cpu" and ids.is_pinned():
        ok = bool(((ids >= 0) & (ids < size)).all())  # read by a kernel through its mapped address
        if not ok:
            raise IndexError(f"KVTIER_CHECK_INDICES: {name} out of [0, {size}): {ids.tolist()[:16]}")
        return
    torch._assert_async(((ids >= 0) & (ids < size)).all(), f"KVTIER_CHECK_INDICES: {name} out of [0, {size})")
