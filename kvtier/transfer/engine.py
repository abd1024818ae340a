"""TransferEngine: runs the manager's TransferOps on streams, reports completions (DESIGN §7).

::

    compute stream:  ─ mark ─ forward N: layer0 ─ layer1 ─ layer2 ─ … ─ mark ─ forward N+1 …
                       │                 ▲wait e0  ▲wait e1  ▲wait e2     │
    load stream:       └wait─ H2D l0 ─ rec e0 ─ H2D l1 ─ rec e1 ─ … ─ rec done
    offload stream:                                      (backups) └wait─ D2H all layers ─ rec done ─►

``mark`` is an event recorded on the compute stream when an op is submitted: a copy starts only
after everything the compute stream had queued before it (the forward that wrote a backup's
blocks; the last reader of a load's freshly allocated blocks). Loads run layer by layer; the
forward's per-layer hook makes the compute stream wait for layer *l*'s event before attention of
layer *l* (a GPU-side wait, the CPU never blocks), so loading and computing overlap.

Invariants (tests/transfer/test_engine.py checks them):

1. a copy is queued after a ``mark`` of the compute stream taken at submit time;
2. attention of layer *l* is queued after a wait on every event *l* of the step's loads;
3. :meth:`poll` reports an op only once its ``done`` event has completed (``query()``, never a
   block), backups in submission order; only then does the manager count its bytes as landed;
4. every tensor a queued copy reads (block ids, staging) stays referenced until it is reported;
5. the per-layer event sets come from a ring and go back to it only when their op is reported, so
   an event is never re-recorded while a wait on it may still be queued behind.

On CPU the same interface runs every copy synchronously on the calling thread with the torch
reference ops (the CPU twin CI tests). Storage ops (fetch/put) are not its job: the storage
client runs them on worker threads (kvtier.storage.client). A copy that raises is reported with all its items failed: the manager
turns them into misses / recompute (DESIGN §5.6).
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

import torch

from kvtier.cache.plan import TransferOp
from kvtier.transfer import copy as reference
from kvtier.transfer import kernels

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _InFlight:
    op: TransferOp
    failed: list[int]
    done: torch.cuda.Event | None = None
    layer_events: list | None = None         # loads: one event per layer, from the ring
    keep: tuple = field(default=())          # tensors the queued copy reads


class TransferEngine:
    def __init__(self, kv_caches: list[torch.Tensor], host_kv: torch.Tensor | None, routing=None,  # type: ignore[no-untyped-def]
                 use_kernels: bool | None = None) -> None:
        self.kv_caches = kv_caches
        self.host_kv = host_kv
        self.routing = routing                # RoutingCapture: routed experts travel with their KV block
        self.num_layers = len(kv_caches)
        self.cuda = kv_caches[0].is_cuda
        if use_kernels is None:
            use_kernels = self.cuda and kernels.available()
        self.ops = kernels if use_kernels else reference
        self._inflight: deque[_InFlight] = deque()
        self._step_loads: list[list] = []        # layer events this step's forward must wait on
        self._free_sets: list[list] = []         # the ring of per-layer event sets
        if self.cuda:
            device = kv_caches[0].device
            # loads gate the forward layer by layer: their kernels get SMs first as the
            # forward's blocks retire (high priority); backups can wait (default priority)
            self.load_stream = torch.cuda.Stream(device, priority=-1)
            self.offload_stream = torch.cuda.Stream(device)

    # ------------------------------------------------------------------ submit
    def submit(self, op: TransferOp) -> None:
        """Queue ``op`` (never blocks on a GPU copy); its completion comes from :meth:`poll`."""
        try:
            if op.kind == "load":
                entry = self._load(op)
            elif op.kind == "backup":
                entry = self._backup(op)
            else:
                raise ValueError(f"unknown op kind {op.kind!r}")
        except Exception as e:   # a failed copy costs a recompute, never a wrong answer
            log.warning("%s op %d failed: %s", op.kind, op.op_id, e)
            entry = _InFlight(op, list(range(op.num_blocks)))
        self._inflight.append(entry)

    def _pairs(self, op: TransferOp):  # type: ignore[no-untyped-def]
        """Split once per op: DMA runs and the kernel's pinned block ids (alive until landed)."""
        if self.ops is kernels:
            if op.kind == "load":
                return kernels.BlockPairs.split(op.src_blocks, op.dst_blocks, self.cuda,
                                                kernels.TUNING["min_dma_run_h2d"], self.kv_caches[0].device), None
            return kernels.BlockPairs.split(op.src_blocks, op.dst_blocks, self.cuda,
                                            kernels.TUNING["min_dma_run_d2h"]), None
        return op.src_blocks, op.dst_blocks

    def _load(self, op: TransferOp) -> _InFlight:
        if self.routing is not None:
            self.routing.host_to_device(op.src_blocks, op.dst_blocks)
        if not self.cuda:
            self.ops.host_to_device(self.host_kv, self.kv_caches, op.src_blocks, op.dst_blocks)
            return _InFlight(op, [])
        src, dst = self._pairs(op)
        events = self._free_sets.pop() if self._free_sets else [torch.cuda.Event() for _ in range(self.num_layers)]
        stream = self.load_stream
        stream.wait_event(self._mark())
        with torch.cuda.stream(stream):
            for layer in range(self.num_layers):
                self.ops.host_to_device(self.host_kv, self.kv_caches, src, dst, layer=layer)
                events[layer].record(stream)
            done = torch.cuda.Event()
            done.record(stream)
        self._step_loads.append(events)
        return _InFlight(op, [], done, events, (src, dst))

    def _backup(self, op: TransferOp) -> _InFlight:
        if self.routing is not None:
            self.routing.device_to_host(op.src_blocks, op.dst_blocks)
        if not self.cuda:
            self.ops.device_to_host(self.kv_caches, self.host_kv, op.src_blocks, op.dst_blocks)
            return _InFlight(op, [])
        src, dst = self._pairs(op)
        stream = self.offload_stream
        stream.wait_event(self._mark())
        with torch.cuda.stream(stream):
            self.ops.device_to_host(self.kv_caches, self.host_kv, src, dst)
            done = torch.cuda.Event()
            done.record(stream)
        return _InFlight(op, [], done, None, (src, dst))

    def _mark(self) -> torch.cuda.Event:
        mark = torch.cuda.Event()
        mark.record(torch.cuda.current_stream(self.kv_caches[0].device))
        return mark

    # ------------------------------------------------------------------ the forward's side
    def layer_hook(self):  # type: ignore[no-untyped-def]
        """The hook the model calls before attention of each layer, or None if this step loads
        nothing. Taking it hands the step's loads to the forward about to be queued."""
        if not self._step_loads:
            return None
        sets, self._step_loads = self._step_loads, []
        stream = torch.cuda.current_stream(self.kv_caches[0].device)

        def wait_layer(layer: int) -> None:
            for events in sets:
                stream.wait_event(events[layer])
        return wait_layer

    def wait_all_layers(self) -> None:
        """For a forward with no per-layer hook (a replayed CUDA graph): the compute stream waits
        for every layer of this step's loads (still a GPU-side wait)."""
        hook = self.layer_hook()
        if hook is not None:
            hook(self.num_layers - 1)   # events of one op complete in layer order

    # ------------------------------------------------------------------ completions
    def poll(self) -> list[tuple[int, list[int]]]:
        """Ops whose bytes have landed, as (op_id, failed item indices); never blocks."""
        out = []
        backup_blocked = False
        for entry in list(self._inflight):
            is_backup = entry.op.kind == "backup"
            if is_backup and backup_blocked:
                continue                          # backups are reported in submission order
            if entry.done is not None and not entry.done.query():
                backup_blocked |= is_backup
                continue
            self._inflight.remove(entry)
            self._retire(entry)
            out.append((entry.op.op_id, entry.failed))
        return out

    def wait_loads(self) -> list[tuple[int, list[int]]]:
        """Block until every queued load landed, then poll. The engine calls this after queuing
        a forward that did not sample (a sampling step has synchronized with the loads already,
        since its forward waited on them)."""
        for entry in self._inflight:
            if entry.op.kind == "load" and entry.done is not None:
                entry.done.synchronize()
        return self.poll()

    def drain(self) -> list[tuple[int, list[int]]]:
        """Block until every queued op landed (close, errors); returns their completions."""
        for entry in self._inflight:
            if entry.done is not None:
                entry.done.synchronize()
        return self.poll()

    @property
    def num_in_flight(self) -> int:
        return len(self._inflight)

    def _retire(self, entry: _InFlight) -> None:
        if entry.layer_events is not None:
            self._free_sets.append(entry.layer_events)
        entry.keep = ()
