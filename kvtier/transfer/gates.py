"""Layer gates: a forward replayed from a CUDA graph waits, layer by layer, for its host loads.

A captured graph cannot call Python between layers, so the eager forward's per-layer event
waits (:meth:`TransferEngine.layer_hook`) are not available to it. Instead the step graphs are
captured with one *stream memory wait* per layer before attention reads the KV cache — the GPU
front end holds the compute stream until a 32-bit word in device memory is non-zero, no SM
spins — and the copy side (the load stream, or the scatter stream when a layer's DMA is followed
by a scatter) writes that word once the layer's copies are queued ahead of it::

    compute stream:  close (gates := 0) ─ mark ─ [graph: layer0 ▲wait g0 ─ layer1 ▲wait g1 ─ …]
    load stream:                          └wait─ H2D l0 ─ open g0 ─ H2D l1 ─ open g1 ─ … ─ open all

So one graph launch overlaps a host hit's loads with its layers, as the eager forward does, for
a few µs of CPU. The protocol (TransferEngine keeps it):

1. gates are open (1) unless a step with gated loads is in flight; a step without loads replays
   the same graph and its waits pass at once;
2. ``close`` runs on the compute stream *before* the mark the load stream waits on, so an open
   of this step can never be overwritten by the close, and the previous step's graph (queued
   before the close) never sees a gate of this step closed;
3. whatever happens while the loads are queued, the last thing on the load stream is
   ``open_all``: a graph never waits forever on a gate nobody opens (a load that failed is
   reported failed and costs a recompute, as in every other mode).

The waits and writes are ``cuStreamWaitValue32`` / ``cuStreamWriteValue32`` of the CUDA driver
(captured into graphs as memory-op nodes), called through ctypes because torch does not expose
them. On a CPU, or a driver without stream memory operations, the same object is a host array:
``wait`` raises if its gate is closed (the CPU twin runs loads synchronously, so a closed gate at
a wait is a protocol error); on a driver without them ``create`` returns None and the engine
waits for whole loads. Loads under ``kernels.TUNING["min_gated_bytes"]`` are not gated on the
GPU: they go staged, all layers at once, and the graph waits for them before its replay.
"""

from __future__ import annotations

import ctypes
import logging

import torch

log = logging.getLogger(__name__)

_WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ
_WRITE_DEFAULT = 0x0  # CU_STREAM_WRITE_VALUE_DEFAULT
_DRIVER: ctypes.CDLL | None = None
_DRIVER_LOOKED_UP = False


def _driver() -> ctypes.CDLL | None:
    """libcuda's stream memory ops (the _v2 entry points, CUDA >= 11.7), or None."""
    global _DRIVER, _DRIVER_LOOKED_UP
    if not _DRIVER_LOOKED_UP:
        _DRIVER_LOOKED_UP = True
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            for name in ("cuStreamWaitValue32_v2", "cuStreamWriteValue32_v2"):
                f = getattr(lib, name)
                f.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
                f.restype = ctypes.c_int
            _DRIVER = lib
        except (OSError, AttributeError) as e:
            log.info("no CUDA stream memory operations (%s): graph steps wait for whole loads", e)
    return _DRIVER


class LayerGates:
    """One gate per layer (module docstring). ``wait(l)`` is the hook a graph is captured with."""

    def __init__(self, num_layers: int, device: torch.device) -> None:
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        self.num_layers = num_layers
        self.flags = torch.ones(num_layers, dtype=torch.int32, device=device)
        self.cuda = self.flags.is_cuda
        self._lib = _driver() if self.cuda else None
        self._base = self.flags.data_ptr()
        self.closes = 0  # steps whose graph waited on gated loads (tests, metrics)

    @classmethod
    def create(cls, num_layers: int, device: torch.device) -> "LayerGates | None":
        """Gates for ``device``, or None where the driver cannot wait on memory (then graph
        steps wait for their whole loads instead)."""
        gates = cls(num_layers, device)
        if gates.cuda and (gates._lib is None or not gates._probe()):
            return None
        return gates

    def _probe(self) -> bool:
        """A write and a wait on a scratch word: stream memory ops may be disabled by the driver."""
        assert self._lib is not None
        stream = torch.cuda.current_stream(self.flags.device).cuda_stream
        err = self._lib.cuStreamWriteValue32_v2(stream, self._base, 1, _WRITE_DEFAULT)
        err = err or self._lib.cuStreamWaitValue32_v2(stream, self._base, 1, _WAIT_GEQ)
        torch.cuda.synchronize(self.flags.device)
        if err:
            log.info("CUDA stream memory operations unavailable (error %d): graph steps wait for whole loads", err)
        return not err

    def _check(self, err: int, what: str) -> None:
        if err:
            raise RuntimeError(f"{what} failed with CUDA error {err}")

    def close(self) -> None:
        """Compute stream: every gate shut (before the mark the step's loads wait on)."""
        self.flags.zero_()
        self.closes += 1

    def open(self, layer: int, stream: torch.cuda.Stream | None = None) -> None:
        """Gate ``layer`` opens once everything queued before it on ``stream`` ran."""
        if not self.cuda:
            self.flags[layer] = 1
            return
        assert self._lib is not None, "no driver: LayerGates.create() gives none"
        s = (stream or torch.cuda.current_stream(self.flags.device)).cuda_stream
        self._check(self._lib.cuStreamWriteValue32_v2(s, self._base + 4 * layer, 1, _WRITE_DEFAULT), "cuStreamWriteValue32")

    def open_all(self, stream: torch.cuda.Stream | None = None) -> None:
        if not self.cuda:
            self.flags.fill_(1)
            return
        with torch.cuda.stream(stream or torch.cuda.current_stream(self.flags.device)):
            self.flags.fill_(1)

    def wait(self, layer: int) -> None:
        """The current stream holds until gate ``layer`` is open (captured into a graph)."""
        if not self.cuda:
            if not int(self.flags[layer]):
                raise RuntimeError(f"layer gate {layer} is closed at its wait: its loads were never queued")
            return
        assert self._lib is not None, "no driver: LayerGates.create() gives none"
        s = torch.cuda.current_stream(self.flags.device).cuda_stream
        self._check(self._lib.cuStreamWaitValue32_v2(s, self._base + 4 * layer, 1, _WAIT_GEQ), "cuStreamWaitValue32")
