"""TransferEngine's load modes on the CPU twin (copies run synchronously): the gated protocol
(kvtier.transfer.gates) — loads deferred until the forward takes them, layer-major, each layer's
gate opened after its copies, every gate open at the end whatever failed, nothing reported
before it was queued."""

from __future__ import annotations

import pytest
import torch

from kvtier.cache.plan import TransferOp
from kvtier.transfer import copy as reference
from kvtier.transfer import kernels
from kvtier.transfer.engine import TransferEngine
from kvtier.transfer.gates import LayerGates

L, BS, H, D = 3, 4, 2, 8


def make():
    kv = list(torch.zeros(L, 2, 8, BS, H, D).unbind(0))
    host = torch.arange(8 * L * 2 * BS * H * D, dtype=torch.float32).reshape(8, L, 2, BS, H, D)
    return TransferEngine(kv, host), kv, host


def load(op_id: int, host_blocks, device_blocks) -> TransferOp:
    return TransferOp(
        op_id, "load", tuple(host_blocks), tuple(device_blocks), tuple(bytes([op_id, i]) for i in range(len(host_blocks)))
    )


class Recorder:
    """The reference ops, logging each load copy with the gate states it saw."""

    def __init__(self, eng: TransferEngine, fail_at_layer: int | None = None) -> None:
        self.eng, self.fail_at_layer = eng, fail_at_layer
        self.log: list[tuple[int | None, tuple[int, ...], list[int]]] = []

    def host_to_device(self, host, kv, src, dst, layer=None):
        if layer == self.fail_at_layer:
            raise RuntimeError("injected copy failure")
        assert self.eng.gates is not None
        self.log.append((layer, tuple(dst), self.eng.gates.flags.tolist()))
        reference.host_to_device(host, kv, src, dst, layer=layer)

    def __getattr__(self, name):
        return getattr(reference, name)


def test_gated_loads_wait_for_the_forward_then_go_layer_major_behind_closed_gates():
    eng, kv, host = make()
    eng.ops = rec = Recorder(eng)
    eng.load_mode = "gated"
    eng.submit(load(1, (2, 5), (0, 3)))
    eng.submit(load(2, (6,), (7,)))
    eng.load_mode = "whole"
    assert rec.log == [] and eng.poll() == [] and eng.num_in_flight == 2  # not landed: not reported
    with pytest.raises(RuntimeError, match="layer gate 0 is closed"):
        eng.gates.wait(0)  # a graph replayed now would wait: its bytes are not there
    hook = eng.layer_hook()  # the forward takes them: queued
    assert hook is not None and hook.gated and not hook.sets
    # layer-major across the step's ops; a layer's copies run while its gate is still closed
    assert [(layer, dst) for layer, dst, _ in rec.log] == [(0, (0, 3)), (0, (7,)), (1, (0, 3)), (1, (7,)), (2, (0, 3)), (2, (7,))]
    for layer, _, flags in rec.log:
        assert layer is not None and flags[layer] == 0 and all(flags[:layer]), flags
    for layer in range(L):
        eng.gates.wait(layer)
        for h, d in ((2, 0), (5, 3), (6, 7)):
            assert torch.equal(kv[layer][:, d], host[h, layer])
    assert sorted(eng.poll()) == [(1, []), (2, [])]
    assert eng.gates.closes == 1


def test_a_failed_gated_copy_fails_the_step_loads_and_opens_every_gate():
    eng, kv, host = make()
    eng.ops = Recorder(eng, fail_at_layer=1)
    eng.load_mode = "gated"
    eng.submit(load(1, (2, 5), (0, 3)))
    eng.submit(load(2, (6,), (7,)))
    eng.load_mode = "whole"
    eng.layer_hook()
    assert eng.gates.flags.tolist() == [1] * L  # no forward waits forever
    assert sorted(eng.poll()) == [(1, [0, 1]), (2, [0])]  # the manager recomputes them


def test_drain_and_wait_loads_queue_gated_loads_nobody_took():
    for finish in ("drain", "wait_loads"):
        eng, kv, host = make()
        eng.load_mode = "gated"
        eng.submit(load(4, (1,), (2,)))
        eng.load_mode = "whole"
        assert getattr(eng, finish)() == [(4, [])]
        assert torch.equal(kv[2][:, 2], host[1, 2]) and eng.gates.flags.tolist() == [1] * L


def test_an_eager_forward_of_a_gated_step_waits_on_each_gate():
    """A batch retried request by request runs eagerly with the step's hook (taken by the
    step's graph, which queued the gated copies): every layer waits on its gate."""
    eng, kv, host = make()
    eng.load_mode = "gated"
    eng.submit(load(1, (2,), (5,)))
    eng.load_mode = "whole"
    hook = eng.layer_hook()
    waited: list[int] = []
    eng.gates.wait = waited.append  # what the GPU would wait on
    for layer in range(L):
        hook(layer)
        assert torch.equal(kv[layer][:, 5], host[2, layer])
    assert waited == list(range(L)) and eng.poll() == [(1, [])]
    assert eng.layer_hook() is None  # nothing left for the next forward


def test_a_gated_load_that_cannot_be_split_leaves_the_gates_open(monkeypatch):
    """Splitting an op may raise (pinned memory, device memory): it fails alone, before any close.
    The engine runs the Triton kernels' path here (however small the load, gated), whose split
    (``BlockPairs.split``, the pinned block ids) runs out of pinned memory."""
    eng, kv, host = make()

    def no_pinned_memory(*args: object) -> kernels.BlockPairs:
        raise MemoryError("pinned memory")

    eng.ops = kernels
    monkeypatch.setitem(kernels.TUNING, "min_gated_bytes", 0)
    monkeypatch.setattr(kernels.BlockPairs, "split", staticmethod(no_pinned_memory))
    eng.load_mode = "gated"
    eng.submit(load(1, (2,), (5,)))
    eng.load_mode = "whole"
    assert eng.gates.flags.tolist() == [1] * L and eng.gates.closes == 0
    assert eng.layer_hook() is None and eng.poll() == [(1, [0])]


def test_other_modes_leave_the_gates_alone_and_bad_modes_are_named():
    eng, kv, host = make()
    for mode in ("whole", "layers"):
        eng.load_mode = mode
        eng.submit(load(1, (3,), (4,)))
        assert eng.poll() == [(1, [])] and eng.gates.closes == 0
    eng.load_mode = "sideways"
    eng.submit(load(2, (3,), (4,)))  # a failed submit: reported failed, never raised
    assert eng.poll() == [(2, [0])]
    with pytest.raises(ValueError, match="num_layers must be >= 1, got 0"):
        LayerGates(0, torch.device("cpu"))


def test_a_load_failing_part_way_is_reported_failed_and_the_rest_goes_on():
    """CPU twin of the fence: a load whose copy raises after layer 0 landed is reported failed
    (every block), never raised; the next load goes through."""
    eng, kv, host = make()

    def half_copy(host_kv, kv_caches, src, dst, layer=None):
        reference.host_to_device(host_kv, kv_caches, src, dst, layer=0)
        raise RuntimeError("injected copy failure after layer 0")

    eng.ops = type("HalfOps", (), {"host_to_device": staticmethod(half_copy)})()
    eng.submit(load(1, (2, 3), (5, 6)))
    assert eng.poll() == [(1, [0, 1])]
    eng.ops = reference
    eng.submit(load(2, (2,), (5,)))
    assert eng.poll() == [(2, [])] and torch.equal(kv[1][:, 5], host[2, 1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU only: on CPU the copies run synchronously")
def test_a_load_failing_part_way_is_reported_only_after_its_queued_copies_ran():
    """Layer 0's copy is queued (behind a slow kernel on the load stream), layer 1's raises: the
    op must not be reported before that queued copy ran (its block would be reused under it),
    and what the compute stream writes next into the block lands after the copy, never under it."""
    dev = torch.device("cuda")
    kv = list(torch.zeros(L, 2, 8, BS, H, D, device=dev).unbind(0))
    host = torch.arange(8 * L * 2 * BS * H * D, dtype=torch.float32).reshape(8, L, 2, BS, H, D).pin_memory()
    eng = TransferEngine(kv, host, use_kernels=False)

    # layer 0's K of the block, by one async copy into a contiguous slice (the reference ops, and
    # a copy into a strided slice, block the CPU until the stream got there)
    staged = host[2, 0, 0].clone().pin_memory()

    def copy_layer_0_only(host_kv, kv_caches, src, dst, layer=None):
        if layer:
            raise RuntimeError("injected copy failure at layer 1")
        kv_caches[0][0, dst[0]].copy_(staged, non_blocking=True)

    eng.ops = type("FailingOps", (), {"host_to_device": staticmethod(copy_layer_0_only)})()
    eng.load_mode = "layers"
    with torch.cuda.stream(eng.load_stream):
        torch.cuda._sleep(200_000_000)  # ~0.1 s: layer 0's copy waits behind it
    eng.submit(load(1, (2,), (5,)))
    assert eng.poll() == [], "a failed op reported while its queued copy has not run"
    kv[0][0, 5].fill_(-1.0)  # the compute stream's next write (a recompute)
    torch.cuda.synchronize()
    assert bool((kv[0][0, 5] == -1.0).all()), "the failed op's late copy overwrote a later write"
    assert eng.poll() == [(1, [0])]


def preload(op_id: int, host_blocks, device_blocks) -> TransferOp:
    return TransferOp(
        op_id, "preload", tuple(host_blocks), tuple(device_blocks), tuple(bytes([op_id, i]) for i in range(len(host_blocks)))
    )


def test_a_preload_copies_every_layer_and_no_forward_waits_for_it():
    eng, kv, host = make()
    eng.load_mode = "gated"  # (a step's mode does not apply to preloads)
    eng.submit(preload(1, (2, 6), (5, 0)))
    assert eng.layer_hook() is None  # not one of the step's loads
    assert eng.poll() == [(1, [])]
    for layer in range(L):
        assert torch.equal(kv[layer][:, 5], host[2, layer]) and torch.equal(kv[layer][:, 0], host[6, layer])


def test_a_failed_preload_is_reported_failed_not_raised():
    eng, kv, host = make()

    def broken(*args, **kwargs):
        raise RuntimeError("injected copy failure")

    eng.ops = type("Broken", (), {"host_to_device": staticmethod(broken)})()
    eng.submit(preload(1, (2, 3), (5, 6)))
    assert eng.poll() == [(1, [0, 1])]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU only: on CPU the copies run synchronously")
def test_preloads_run_beside_step_loads_and_are_reported_in_order_once_landed():
    """A preload stuck behind a slow kernel on its stream holds up neither a step's load nor the
    forward; it is reported only once its bytes landed, and preloads in submission order."""
    dev = torch.device("cuda")
    kv = list(torch.zeros(L, 2, 8, BS, H, D, device=dev).unbind(0))
    host = torch.arange(8 * L * 2 * BS * H * D, dtype=torch.float32).reshape(8, L, 2, BS, H, D).pin_memory()
    eng = TransferEngine(kv, host, use_kernels=False)

    def async_copy(host_kv, kv_caches, src, dst, layer=None):
        for s, d in zip(src, dst):  # contiguous slices: never blocks the CPU
            for layer_kv, h in zip(kv_caches, host_kv[s]):
                for i in range(2):
                    layer_kv[i, d].copy_(h[i], non_blocking=True)

    eng.ops = type("AsyncOps", (), {"host_to_device": staticmethod(async_copy)})()
    # once without the wait first: a kernel's first launch (CUDA lazy loading) syncs the context
    eng.submit(preload(1, (2,), (5,)))
    eng.submit(load(3, (4,), (7,)))
    eng.layer_hook()
    eng.drain()
    torch.equal(kv[0][:, 7].cpu(), host[4, 0])
    for layer_kv in kv:
        layer_kv.zero_()
    torch.cuda.synchronize()
    with torch.cuda.stream(eng.preload_stream):
        torch.cuda._sleep(400_000_000)  # ~0.2 s
    eng.submit(preload(1, (2,), (5,)))
    eng.submit(preload(2, (3,), (6,)))
    eng.submit(load(3, (4,), (7,)))  # a step's load, in whole mode
    hook = eng.layer_hook()
    assert hook is not None and len(hook.sets) == 1  # the forward waits on the load only
    landed = eng.wait_loads()
    assert landed == [(3, [])], landed  # the preloads are still queued
    assert torch.equal(kv[0][:, 7].cpu(), host[4, 0])
    assert eng.poll() == []
    eng.preload_stream.synchronize()
    assert eng.poll() == [(1, []), (2, [])]
    for layer in range(L):
        assert torch.equal(kv[layer][:, 5].cpu(), host[2, layer]) and torch.equal(kv[layer][:, 6].cpu(), host[3, layer])
