"""Every copy the TransferEngine queues runs after what the compute stream queued before it,
whatever mode it goes in, while the compute stream is still busy with the step before (overlap
scheduling: the usual case on the GPU).

This is the test that catches a decode server's "index out of bounds" device assert under PD
(IndexKernel.cu, in the scatter of a gated load): the gated loads' mark was recorded on the
load stream itself, so they waited for nothing; their scatter read its device block ids before
the compute stream, still busy, had uploaded them, and, when the stale bytes were in range,
wrote KV into the wrong blocks silently. Here the compute stream is held busy
(``torch.cuda._sleep``) and then writes a sentinel into the destination blocks: a load ordered
after it finds its bytes there at the end; one that is not gets overwritten (or asserts). The
allocator's pool on the compute stream is first filled with huge stale integers, as a step's
freed tensors leave it.

GPU only: the CPU twin runs every copy synchronously, in program order, so there is nothing to
order (tests/transfer/test_engine.py tests the gated protocol there)."""

from __future__ import annotations

import pytest
import torch

from kvtier.cache.plan import TransferOp
from kvtier.transfer import kernels
from kvtier.transfer.engine import TransferEngine

CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(
    not CUDA, reason="needs a CUDA GPU (one H100 80GB runs it): the CPU twin copies synchronously, in program order"
)

L, NB, BS, H, D = 4, 64, 16, 8, 128
BUSY = 200_000_000  # cycles the compute stream spins first (~0.1 s on an H100)


def _warm_up(eng: TransferEngine, kv: list[torch.Tensor]) -> None:
    """Every kernel the tests launch, run once: loading a CUDA module on first use (lazy
    loading, Triton's first launch) synchronizes the context, which would end the busy period."""
    ids = torch.tensor(DEV, device="cuda")
    torch.cuda._sleep(1)
    for layer_kv in kv:
        layer_kv.index_fill_(1, ids, 0.0)
    for op_id, (kind, mode) in enumerate(
        (("load", "gated"), ("load", "layers"), ("load", "whole"), ("preload", "whole"), ("backup", "whole"))
    ):
        eng.load_mode = mode
        src, dst = (DEV, HOST) if kind == "backup" else (HOST, DEV)
        eng.submit(_load(100 + op_id, kind, src, dst))
        eng.load_mode = "whole"
        hook = eng.layer_hook()
        if hook is not None:
            for layer in range(L):
                hook(layer)
        torch.cuda.synchronize()
    eng.drain()
    for layer_kv in kv:
        layer_kv.zero_()
    torch.cuda.synchronize()


@pytest.fixture
def engine(monkeypatch):
    # small copies take the paths big ones take in serving: gated, DMA runs + scatters
    monkeypatch.setitem(kernels.TUNING, "min_gated_bytes", 0)
    monkeypatch.setitem(kernels.TUNING, "min_dma_run_h2d", 4)
    monkeypatch.setitem(kernels.TUNING, "min_dma_bytes_staged", 1)
    kv = list(torch.zeros(L, 2, NB + 1, BS, H, D, dtype=torch.bfloat16, device="cuda").unbind(0))
    host = torch.empty(32, L, 2, BS, H, D, dtype=torch.bfloat16, pin_memory=True)
    host.copy_(torch.randn(host.shape).to(torch.bfloat16))
    eng = TransferEngine(kv, host)
    assert eng.ops is kernels, "the Triton copy kernels (pip install triton)"
    _warm_up(eng, kv)
    return eng, kv, host


def _poison_compute_pool() -> None:
    """Freed tensors on the compute stream hold huge ints: what a stale read of ids would see."""
    junk = [torch.full((4096,), 2**40, dtype=torch.long, device="cuda") for _ in range(64)]
    del junk


def _busy_then_sentinel(kv: list[torch.Tensor], blocks: list[int]) -> None:
    """The compute stream: a long step, then a write to ``blocks`` that any copy into them must
    follow. Nothing here may wait for the stream (a copy from pageable memory would: the ids go
    up first, and index_fill_ takes a Python number)."""
    ids = torch.tensor(blocks, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(BUSY)
    for layer in kv:
        layer.index_fill_(1, ids, -7.0)
    assert not torch.cuda.current_stream().query(), "the compute stream must still be busy"


def _load(op_id: int, kind: str, host_blocks: list[int], device_blocks: list[int]) -> TransferOp:
    return TransferOp(
        op_id, kind, tuple(host_blocks), tuple(device_blocks), tuple(bytes([op_id, i]) for i in range(len(host_blocks)))
    )


def _sync_or_fail(eng: TransferEngine, timeout: float = 30.0) -> None:
    """Synchronize, but fail (and unblock the GPU) if the compute stream waits forever on a gate."""
    import time

    done = torch.cuda.Event()
    done.record()
    deadline = time.monotonic() + timeout
    while not done.query():
        if time.monotonic() > deadline:
            side = torch.cuda.Stream()
            assert eng.gates is not None  # (a gated load waited on them)
            with torch.cuda.stream(side):
                eng.gates.open_all(side)
            torch.cuda.synchronize()
            pytest.fail("the compute stream waited on a gate that stayed closed (its close landed after its opens)")
        time.sleep(0.01)
    torch.cuda.synchronize()


# consecutive host blocks (a DMA run) into scattered device blocks: the scatter path
HOST = list(range(8, 20))
DEV = [50, 3, 41, 7, 12, 33, 60, 1, 22, 18, 45, 9]


@pytest.mark.parametrize("mode", ["gated", "layers", "whole"])
def test_a_load_lands_after_what_the_compute_stream_queued_before_it(engine, mode):
    eng, kv, host = engine
    _poison_compute_pool()
    _busy_then_sentinel(kv, DEV)
    eng.load_mode = mode
    eng.submit(_load(1, "load", HOST, DEV))
    eng.load_mode = "whole"
    hook = eng.layer_hook()
    assert not torch.cuda.current_stream().query(), "the step before must still run while the loads are queued"
    for layer in range(L):  # the forward's waits, as an eager forward makes them
        hook(layer)
    _sync_or_fail(eng)
    for layer in range(L):
        for h, d in zip(HOST, DEV):
            assert torch.equal(kv[layer][:, d].cpu(), host[h, layer]), (mode, layer, h, d)
    assert eng.gates is None or eng.gates.flags.tolist() == [1] * L  # no graph waits forever
    assert eng.poll() == [(1, [])]


def test_a_preload_lands_after_what_the_compute_stream_queued_before_it(engine):
    eng, kv, host = engine
    _poison_compute_pool()
    _busy_then_sentinel(kv, DEV)
    eng.submit(_load(2, "preload", HOST, DEV))
    torch.cuda.synchronize()
    for layer in range(L):
        for h, d in zip(HOST, DEV):
            assert torch.equal(kv[layer][:, d].cpu(), host[h, layer]), (layer, h, d)


def test_a_backup_copies_what_the_compute_stream_wrote_before_it(engine):
    eng, kv, host = engine
    _busy_then_sentinel(kv, DEV)  # the forward that writes the blocks backed up
    eng.submit(TransferOp(3, "backup", tuple(DEV), tuple(HOST), tuple(bytes([3, i]) for i in range(len(DEV)))))
    torch.cuda.synchronize()
    for layer in range(L):
        for h in HOST:
            assert (host[h, layer].float() == -7.0).all(), (layer, h)


def test_a_submit_from_a_copy_stream_is_refused(engine, caplog):
    """A copy submitted while one of the engine's own streams is current would be ordered after
    nothing (its mark taken on that stream): the op fails (a recompute), the log says why. An
    engine that took the mark anyway reports the op landed."""
    eng, _, _ = engine
    with torch.cuda.stream(eng.load_stream):
        eng.submit(_load(1, "load", HOST, DEV))
    torch.cuda.synchronize()
    assert eng.drain() == [(1, list(range(len(HOST))))]
    assert "own stream" in caplog.text
