"""TransferEngine: runs the manager's TransferOps on streams, reports completions (DESIGN §7).

::

    compute stream:  ─ mark ─ forward N: layer0 ─ layer1 ─ layer2 ─ … ─ mark ─ forward N+1 …
                       │                 ▲wait e0  ▲wait e1  ▲wait e2     │
    load stream:       └wait─ H2D l0 ─ rec e0 ─ H2D l1 ─ rec e1 ─ … ─ rec done
    offload stream:                                      (backups) └wait─ D2H all layers ─ rec done ─►
    preload stream:    └wait─ H2D all layers ─ rec done ─►  (a waiting request's blocks; nobody waits)

``mark`` is an event recorded on the compute stream when an op is submitted: a copy starts only
after everything the compute stream had queued before it (the forward that wrote a backup's
blocks; the last reader of a load's freshly allocated blocks). Loads run in one of three modes
(:attr:`TransferEngine.load_mode`, set by the engine for the forward about to be queued):

- ``layers`` (an eager forward): layer by layer, with an event per layer; the forward's
  per-layer hook makes the compute stream wait for layer *l*'s event before attention of layer
  *l* (a GPU-side wait, the CPU never blocks), so loading and computing overlap;
- ``gated`` (a step replayed from a step graph captured with layer gates,
  :mod:`kvtier.transfer.gates`): the step's loads are queued together when the forward takes
  them (:meth:`layer_hook`), layer-major across its ops, each layer followed by the write that
  opens its gate; the graph waits on the gates, so one launch overlaps loads and layers;
  a load under ``kernels.TUNING["min_gated_bytes"]`` goes ``whole`` instead (fewer launches);
- ``whole`` (a decode graph, or no gates): all layers at once in a few calls
  (``kernels.host_to_device``, staged DMA); the forward waits for their ``done`` event.

Invariants (tests/transfer/test_engine.py checks them):

1. a copy is queued after a ``mark`` of the compute stream taken at submit time;
2. attention of layer *l* is queued after a wait on every event *l* of the step's loads (or,
   gated, on a gate opened after every copy of layer *l* of the step);
3. :meth:`poll` reports an op only once its ``done`` event has completed (``query()``, never a
   block), backups (and preloads) in submission order; only then does the manager count its
   bytes as landed;
4. every tensor a queued copy reads (block ids, staging) stays referenced until it is reported;
5. the per-layer event sets come from a ring and go back to it only when their op is reported, so
   an event is never re-recorded while a wait on it may still be queued behind.

On CPU the same interface runs every copy synchronously on the calling thread with the torch
reference ops (the CPU twin CI tests). Storage ops (fetch/put) are not its job: the storage
client runs them on worker threads (kvtier.storage.client). A copy that raises is reported with all its items failed: the manager
turns them into misses / recompute (DESIGN §5.6).
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from dataclasses import dataclass, field

import torch

from kvtier.cache.plan import TransferOp
from kvtier.transfer import copy as reference
from kvtier.transfer import kernels
from kvtier.transfer.gates import LayerGates

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _InFlight:
    op: TransferOp
    failed: list[int]
    done: torch.cuda.Event | None = None
    layer_events: list | None = None  # loads: one event per layer, from the ring
    keep: tuple = field(default=())  # tensors the queued copy reads
    queued: bool = True  # gated loads: False until the forward takes them


class TransferEngine:
    def __init__(
        self, kv_caches: list[torch.Tensor], host_kv: torch.Tensor | None, routing=None, use_kernels: bool | None = None
    ) -> None:
        self.kv_caches = kv_caches
        self.host_kv = host_kv
        self.routing = routing  # ExpertCapture: routed experts travel with their KV block
        self.num_layers = len(kv_caches)
        self.cuda = kv_caches[0].is_cuda
        if use_kernels is None:
            use_kernels = self.cuda and kernels.available()
        self.ops = kernels if use_kernels else reference
        self._inflight: deque[_InFlight] = deque()
        self._step_loads: list[list] = []  # layer events this step's forward must wait on
        self._free_sets: list[list] = []  # the ring of per-layer event sets
        self._built: tuple = ()  # the block pairs of the op being submitted
        # how loads submitted now are queued (module docstring): "whole", "layers" or "gated"
        self.load_mode = "whole"
        self._gated: list[_InFlight] = []  # gated loads of this step, not yet queued
        self._gated_done: torch.cuda.Event | None = None  # the last gated step's open_all
        self.gates: LayerGates | None = None
        self.gates = LayerGates.create(self.num_layers, kv_caches[0].device)
        if self.cuda:
            device = kv_caches[0].device
            # loads gate the forward layer by layer: their kernels get SMs first as the
            # forward's blocks retire (high priority); backups can wait (default priority)
            self.load_stream = torch.cuda.Stream(device, priority=-1)
            self.scatter_stream = torch.cuda.Stream(device, priority=-1)  # gated loads' scatters
            self.offload_stream = torch.cuda.Stream(device)
            # preloads (a waiting request's blocks, as they land from storage) run beside the
            # steps' loads, not in front of them: no forward waits for a preload
            self.preload_stream = torch.cuda.Stream(device)
            self._own_streams = (self.load_stream, self.scatter_stream, self.offload_stream, self.preload_stream)

    # ------------------------------------------------------------------ submit
    def submit(self, op: TransferOp) -> None:
        """Queue ``op`` (never blocks on a GPU copy); its completion comes from :meth:`poll`."""
        self._built = ()  # its block pairs once split: kept if it fails part-way (below)
        try:
            if op.kind == "load":
                entry = self._load(op)
            elif op.kind == "preload":
                entry = self._preload(op)
            elif op.kind == "backup":
                entry = self._backup(op)
            else:
                raise ValueError(f"unknown op kind {op.kind!r}")
        except Exception as e:  # a failed copy costs a recompute, never a wrong answer
            log.warning("%s op %d failed: %s", op.kind, op.op_id, e)
            # the pairs' pinned ids stay alive until the fence passed: a copy queued before the
            # failure reads them through their mapped address, which the host allocator does
            # not know of (freed now, the next split could take and rewrite them)
            entry = _InFlight(op, list(range(op.num_blocks)), self._fence(op.kind), keep=self._built)
        self._inflight.append(entry)

    def _fence(self, kind: str) -> torch.cuda.Event | None:
        """After a submit that raised part-way: an event behind every copy it may have queued,
        which the compute stream waits for too. The failed op is reported only once that event
        passed, so its blocks are not reused (nor its KV recomputed) while a copy of it still runs."""
        if not self.cuda:
            return None
        device = self.kv_caches[0].device
        try:
            stream = {"load": self.load_stream, "preload": self.preload_stream}.get(kind, self.offload_stream)
            if kind == "load":
                stream.wait_stream(self.scatter_stream)
            fence = torch.cuda.Event()
            fence.record(stream)
            torch.cuda.current_stream(device).wait_event(fence)
            return fence
        except Exception:  # CUDA itself failing: wait here for whatever was queued
            torch.cuda.synchronize(device)
            return None

    def _pairs(self, op: TransferOp, mode: str = "whole"):
        """Split once per op: DMA runs and the kernel's pinned block ids (alive until landed)."""
        self._built = pairs = self._split(op, mode)
        return pairs

    def _split(self, op: TransferOp, mode: str):
        if self.ops is kernels:
            load = op.kind != "backup"
            # loads of every layer at once: staged if they can be. Backups go by the zero-copy
            # kernel, faster than staged from 16 blocks up (docs/BENCHMARKS.md, bench transfer)
            if load and mode == "whole":
                assert self.host_kv is not None  # loads come from the host tier
                staged = kernels.host_runs(self.host_kv, self.kv_caches, op.src_blocks, op.dst_blocks)
                if staged is not None:
                    return staged, None
            if load:
                return kernels.BlockPairs.split(
                    op.src_blocks, op.dst_blocks, self.cuda, kernels.TUNING["min_dma_run_h2d"], self.kv_caches[0].device
                ), None
            return kernels.BlockPairs.split(op.src_blocks, op.dst_blocks, self.cuda, kernels.TUNING["min_dma_run_d2h"]), None
        return op.src_blocks, op.dst_blocks

    def _load(self, op: TransferOp) -> _InFlight:
        assert self.host_kv is not None  # loads come from the host tier
        if self.routing is not None:
            self.routing.host_to_device(op.src_blocks, op.dst_blocks)
        mode = self.load_mode if self.load_mode != "gated" or self.gates is not None else "whole"
        if mode not in ("whole", "layers", "gated"):
            raise ValueError(f"unknown load mode {self.load_mode!r}")
        if mode == "gated" and self.ops is kernels and op.num_blocks * self.host_kv[0].nbytes < kernels.TUNING["min_gated_bytes"]:
            mode = "whole"  # a small load: a few calls for every layer (staged) cost less CPU than
            #                     per-layer launches, and waiting for all of it costs the GPU ~nothing
        if mode == "gated":  # queued with the step's others (queue_gated)
            entry = _InFlight(op, [], None, None, self._pairs(op, mode), queued=False)  # may raise: before the close
            if not self._gated:  # compute stream, before the mark: the step's
                if self._gated_done is not None:  # graph must not pass a gate until it opens, and
                    torch.cuda.current_stream(self.kv_caches[0].device).wait_event(self._gated_done)
                assert self.gates is not None  # (gated mode is chosen only with gates)
                self.gates.close()  # no open of an earlier step may land after the close
            self._gated.append(entry)
            return entry
        if not self.cuda:
            self.ops.host_to_device(self.host_kv, self.kv_caches, op.src_blocks, op.dst_blocks)
            return _InFlight(op, [])
        src, dst = self._pairs(op, mode)
        stream = self.load_stream
        stream.wait_event(self._mark())
        events = None
        with torch.cuda.stream(stream):
            if mode == "layers":
                events = self._free_sets.pop() if self._free_sets else [torch.cuda.Event() for _ in range(self.num_layers)]
                for layer in range(self.num_layers):
                    self.ops.host_to_device(self.host_kv, self.kv_caches, src, dst, layer=layer)
                    events[layer].record(stream)
            else:
                self.ops.host_to_device(self.host_kv, self.kv_caches, src, dst)
            done = torch.cuda.Event()
            done.record(stream)
        self._step_loads.append(events if events is not None else [done] * self.num_layers)
        return _InFlight(op, [], done, events, (src, dst))

    def _preload(self, op: TransferOp) -> _InFlight:
        """Host -> device into blocks no forward reads until the op is reported (they become tree
        nodes' device copies then): every layer at once, on its own stream, waited on by nobody."""
        if self.routing is not None:
            self.routing.host_to_device(op.src_blocks, op.dst_blocks)
        return self._all_layers(op, "host_to_device", self.host_kv, self.kv_caches, "preload_stream")

    def _backup(self, op: TransferOp) -> _InFlight:
        if self.routing is not None:
            self.routing.device_to_host(op.src_blocks, op.dst_blocks)
        return self._all_layers(op, "device_to_host", self.kv_caches, self.host_kv, "offload_stream")

    def _all_layers(self, op: TransferOp, copy: str, src_kv, dst_kv, stream_name: str) -> _InFlight:
        """Every layer of ``op`` in a few calls on one stream, after the compute stream's mark."""
        if not self.cuda:
            getattr(self.ops, copy)(src_kv, dst_kv, op.src_blocks, op.dst_blocks)
            return _InFlight(op, [])
        src, dst = self._pairs(op)
        stream = getattr(self, stream_name)
        stream.wait_event(self._mark())
        with torch.cuda.stream(stream):
            getattr(self.ops, copy)(src_kv, dst_kv, src, dst)
            done = torch.cuda.Event()
            done.record(stream)
        return _InFlight(op, [], done, None, (src, dst))

    def queue_gated(self) -> None:
        """Queue this step's gated loads (module docstring; the protocol is gates.py's): the
        gates were closed on the compute stream at the step's first gated load; after a mark
        taken behind the close: every op's copy of layer 0, open gate 0, layer 1, open gate 1,
        ... and open all gates last. Queued before the graph is launched: queued behind it, a
        copy that needs a kernel not yet loaded (CUDA lazy loading synchronizes the context)
        would wait for a graph that waits for the copy. A layer's DMA into staging goes on the load stream, its
        scatter from staging to scattered device blocks on the scatter stream (which then opens
        the layer's gate), so the copy engine moves layer l+1 while the SMs scatter layer l."""
        if not self._gated:
            return
        entries, self._gated = self._gated, []
        gates, stream = self.gates, self.load_stream if self.cuda else None
        assert gates is not None and self.host_kv is not None  # gated loads were queued
        pipelined = stream is not None and self.ops is kernels
        scattered = False
        # the mark on the compute stream, taken *before* the load stream becomes current: taken
        # inside, it recorded on the load stream itself and the loads waited for nothing. With
        # the compute stream still running the step before, the scatter then read its device
        # block ids before their upload (queued on the compute stream) had run — an index put
        # of stale bytes: "index out of bounds" device asserts, or KV written into the wrong
        # blocks when the stale bytes were in range — the close of the gates could land after
        # their opens (a graph waiting forever), and a load could land before the compute
        # stream's earlier writes to its blocks (tests/transfer/test_stream_order.py)
        mark = self._mark() if stream is not None else None
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            try:
                if stream is not None:
                    assert mark is not None
                    stream.wait_event(mark)
                for layer in range(self.num_layers):
                    deferred: list | None = [] if pipelined else None
                    for entry in entries:
                        src, dst = entry.keep
                        if deferred is None:
                            self.ops.host_to_device(self.host_kv, self.kv_caches, src, dst, layer=layer)
                        else:
                            kernels.host_to_device(self.host_kv, self.kv_caches, src, dst, layer=layer, deferred=deferred)
                    if deferred:
                        assert stream is not None  # deferred scatters are pipelined on the load stream
                        scattered = True  # (before: a scatter that raised may have run in part)
                        self._scatter(deferred, stream)
                        gates.open(layer, self.scatter_stream)
                    else:
                        gates.open(layer, stream)
            except Exception as e:  # a failed copy costs a recompute, never a wrong answer
                log.warning("gated loads %s failed: %s", [e.op.op_id for e in entries], e)
                for entry in entries:
                    entry.failed = list(range(entry.op.num_blocks))
            finally:  # no graph waits forever on a gate
                done = None
                if stream is not None:
                    if scattered:  # landed = scattered too
                        stream.wait_stream(self.scatter_stream)
                    gates.open_all(stream)
                    done = torch.cuda.Event()
                    done.record(stream)
                    self._gated_done = done  # the next close waits for it
                else:
                    gates.open_all(stream)
                for entry in entries:
                    entry.done, entry.queued = done, True

    def _scatter(self, deferred: list, stream: torch.cuda.Stream) -> None:
        """The scatter stream waits for the DMA just queued on ``stream``, then scatters; the
        staging buffers (allocated on ``stream``) stay unreused until the scatters ran."""
        scatter = self.scatter_stream
        scatter.wait_stream(stream)
        with torch.cuda.stream(scatter):
            for kv, ids, staging in deferred:
                kernels.scatter_staged(kv, ids, staging)
                staging.record_stream(scatter)

    def _mark(self) -> torch.cuda.Event:
        """An event behind everything queued so far on the compute stream (the current one)."""
        current = torch.cuda.current_stream(self.kv_caches[0].device)
        if current in self._own_streams:
            raise AssertionError(
                f"a mark taken on the transfer engine's own stream {current}: it would order the copies after nothing"
            )
        mark = torch.cuda.Event()
        mark.record(current)
        return mark

    # ------------------------------------------------------------------ the forward's side
    def layer_hook(self) -> "LoadWaits | None":
        """What the forward about to be queued waits on for this step's loads (:class:`LoadWaits`),
        or None if it loads nothing. Taking it hands the step's loads to that forward (and
        queues the gated ones)."""
        gated = bool(self._gated)
        self.queue_gated()
        if not self._step_loads and not gated:
            return None
        sets, self._step_loads = self._step_loads, []
        return LoadWaits(self, sets, gated)

    # ------------------------------------------------------------------ completions
    def poll(self) -> list[tuple[int, list[int]]]:
        """Ops whose bytes have landed, as (op_id, failed item indices); never blocks."""
        out = []
        blocked: set[str] = set()
        for entry in list(self._inflight):
            if not entry.queued:  # gated, until the forward takes them
                continue
            kind = entry.op.kind
            if kind in blocked:
                continue  # backups, preloads: reported in submission order
            if entry.done is not None and not entry.done.query():
                if kind in ("backup", "preload"):
                    blocked.add(kind)
                continue
            self._inflight.remove(entry)
            self._retire(entry)
            out.append((entry.op.op_id, entry.failed))
        return out

    def wait_loads(self) -> list[tuple[int, list[int]]]:
        """Block until every queued load landed, then poll. The engine calls this after queuing
        a forward that did not sample (a sampling step has synchronized with the loads already,
        since its forward waited on them)."""
        self.queue_gated()
        for entry in self._inflight:
            if entry.op.kind == "load" and entry.done is not None:
                entry.done.synchronize()
        return self.poll()

    def drain(self) -> list[tuple[int, list[int]]]:
        """Block until every queued op landed (close, errors); returns their completions."""
        self.queue_gated()
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


class LoadWaits:
    """A step's loads as its forward waits on them: called before attention of each layer (an
    eager forward), a GPU-side wait on that layer's events and, for gated loads, its gate (a
    batch retried request by request runs eagerly after its step took gated loads). A forward
    with no per-layer hook waits on the last layer: events of one op complete in layer order,
    gates open in layer order. A step graph captured with gates waits on them itself: before its
    replay it calls :meth:`before_graph` (the events of loads queued in another mode, if any)."""

    __slots__ = ("engine", "sets", "gated")

    def __init__(self, engine: TransferEngine, sets: list[list], gated: bool) -> None:
        self.engine, self.sets, self.gated = engine, sets, gated

    def __call__(self, layer: int) -> None:
        self._wait_events(layer)
        if self.gated:
            gates = self.engine.gates
            assert gates is not None
            gates.wait(layer)

    def before_graph(self) -> None:
        self._wait_events(self.engine.num_layers - 1)

    def _wait_events(self, layer: int) -> None:
        if self.sets:
            stream = torch.cuda.current_stream(self.engine.kv_caches[0].device)
            for events in self.sets:
                stream.wait_event(events[layer])
