"""Pinned host staging for a step's small transfers: its input upload and its results' download.

A ring of reusable pinned buffers, so a step allocates no host memory: ``torch.empty(...,
pin_memory=True)`` per step goes through the caching host allocator, which hands out a new block
(``cudaHostAlloc``, milliseconds) whenever the last one's copy has not completed yet — under
overlap scheduling it has not, being queued behind the step in flight. A slot is reused only
after the event recorded with its last copy completed (``len(ring)`` transfers later; a wait
there would be long over by then)::

    slot:   0      1      2      3      0 (event of its last copy: complete) ...
    copy:  up N   up N+1 up N+2 up N+3 up N+4

On CPU nothing is staged: the arrays are the tensors.
"""

from __future__ import annotations

import numpy as np
import torch


class PinnedRing:
    def __init__(self, device: torch.device, slots: int = 4) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._buffers: list[torch.Tensor | None] = [None] * slots
        self._events: list[torch.cuda.Event | None] = [None] * slots
        self._next = 0

    def _slot(self, nbytes: int) -> tuple[int, torch.Tensor]:
        i = self._next
        self._next = (i + 1) % len(self._buffers)
        event = self._events[i]
        if event is not None:
            event.synchronize()  # its copy, len(ring) transfers ago
        buf = self._buffers[i]
        if buf is None or buf.numel() < nbytes:
            buf = self._buffers[i] = torch.empty(max(nbytes, 1 << 16), dtype=torch.uint8, pin_memory=True)
        return i, buf

    def _record(self, i: int) -> torch.cuda.Event:
        # on this device's current stream, where the copy just went: ``event.record()`` with no
        # stream records on the *calling thread's* current device, which for an engine on
        # cuda:1 driven from a thread whose current device is cuda:0 is an idle stream of the
        # wrong GPU: the event completes at once, the slot is rewritten while its copy is still
        # queued, and a step reads another step's ids (device-side index asserts, wrong tokens)
        event = self._events[i] = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def upload(self, arr: np.ndarray) -> torch.Tensor:
        """``arr`` on the device, queued on the current stream (no wait)."""
        if not self.cuda:
            return torch.from_numpy(arr)
        i, buf = self._slot(arr.nbytes)
        host = buf[: arr.nbytes].view(torch.from_numpy(arr[:0]).dtype)
        host.numpy()[:] = arr
        dev = host.to(self.device, non_blocking=True)
        self._record(i)
        return dev

    def download(self, vec: torch.Tensor) -> HostCopy:
        """``vec`` on its way to the host; :meth:`HostCopy.wait` gives it as an array."""
        if not vec.is_cuda:
            return HostCopy(vec, None)
        i, buf = self._slot(vec.numel() * vec.element_size())
        host = buf[: vec.numel() * vec.element_size()].view(vec.dtype).view(vec.shape)
        host.copy_(vec, non_blocking=True)
        return HostCopy(host, self._record(i))


class HostCopy:
    """A device tensor's copy in pinned memory, valid once its event completed (until its ring
    slot comes round again: read it before ``len(ring)`` more transfers)."""

    def __init__(self, host: torch.Tensor, event: torch.cuda.Event | None) -> None:
        self.host = host
        self.event = event

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> np.ndarray:
        if self.event is not None:
            self.event.synchronize()
        return self.host.numpy()
