"""Batched DMA (``cuMemcpyBatchAsync``) vs the torch reference, on fresh random data.

On the GPU the driver's batched copy runs; on CPU its twin copies the same chunk addresses one
by one, so the address arithmetic (the whole of :mod:`kvtier.transfer.batch`) is what CI tests.
Destinations are poisoned (0xA5) so a stray or missing chunk shows; blocks and layers not named
in a copy must keep their poison.
"""
from __future__ import annotations

import random

import pytest
import torch

from kvtier.transfer import batch
from kvtier.transfer import copy as ref
from kvtier.transfer import kernels
from kvtier.transfer.copy import allocate_host_kv
from copy_helpers import poison, random_, same_bytes

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
if CUDA and not batch.available():
    pytest.skip("this CUDA driver has no cuMemcpyBatchAsync (needs >= 12.8)", allow_module_level=True)

# (layers, device blocks, host blocks, block_size, kv_heads, head_dim, dtype)
SHAPES = [
    (2, 9, 7, 16, 2, 32, torch.float32),
    (3, 6, 8, 1, 1, 3, torch.bfloat16),      # 6-byte chunks
    (1, 4, 6, 4, 1, 1, torch.uint8),
    (4, 12, 10, 8, 2, 64, torch.bfloat16),
]
IDS = [f"L{s[0]}-bs{s[3]}-h{s[4]}-d{s[5]}-{s[6]}".replace("torch.", "") for s in SHAPES]




def _kv(layers, blocks, bs, heads, dim, dtype, shared: bool):
    shape = (2, blocks, bs, heads, dim)
    if shared:
        return list(torch.empty((layers, *shape), dtype=dtype, device=DEVICE).unbind(0))
    return [torch.empty(shape, dtype=dtype, device=DEVICE) for _ in range(layers)]


def _ids(xs: list[int]) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int32, pin_memory=CUDA)



def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
@pytest.mark.parametrize("shared", [True, False], ids=["one-buffer", "per-layer"])
def test_batched_backup_matches_reference(shape, shared):
    layers, nd, nh, bs, heads, dim, dtype = shape
    rng, gen = random.Random(7), torch.Generator().manual_seed(3)
    kv = [random_(t, gen) for t in _kv(layers, nd, bs, heads, dim, dtype, shared)]
    k = min(nd, nh) - 1
    dev, hst = rng.sample(range(nd), k), rng.sample(range(nh), k)
    want = poison(allocate_host_kv(nh, layers, bs, heads, dim, dtype, pin=CUDA))
    got = poison(allocate_host_kv(nh, layers, bs, heads, dim, dtype, pin=CUDA))
    ref.device_to_host(kv, want, dev, hst)
    batch.copy_chunks(got, kv, _ids(hst), _ids(dev), load=False)
    _sync()
    assert same_bytes(got, want)
    assert all((got[b].view(torch.uint8) == 0xA5).all() for b in range(nh) if b not in hst)


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_batched_load_of_some_layers_matches_reference_and_leaves_the_rest(shape):
    layers, nd, nh, bs, heads, dim, dtype = shape
    rng, gen = random.Random(11), torch.Generator().manual_seed(4)
    host = random_(allocate_host_kv(nh, layers, bs, heads, dim, dtype, pin=CUDA), gen)
    k = min(nd, nh) - 1
    hst, dev = rng.sample(range(nh), k), rng.sample(range(nd), k)
    want = [poison(t) for t in _kv(layers, nd, bs, heads, dim, dtype, True)]
    got = [poison(t) for t in _kv(layers, nd, bs, heads, dim, dtype, True)]
    chosen = list(range(0, layers, 2))            # every other layer, in one call
    for l in chosen:
        ref.host_to_device(host, want, hst, dev, layer=l)
    batch.copy_chunks(host, got, _ids(hst), _ids(dev), load=True, layers=chosen)
    _sync()
    for l in range(layers):
        assert same_bytes(got[l], want[l]), f"layer {l}"
        if l not in chosen:
            assert (got[l].view(torch.uint8) == 0xA5).all(), f"layer {l} was not asked for"


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_kernels_take_the_batched_path_for_the_scattered_rest(direction, monkeypatch):
    """With TUNING batch_* on, the copy ops the engine calls give the reference's bytes (runs by
    DMA and the scattered rest by batch in one copy)."""
    monkeypatch.setitem(kernels.TUNING, f"batch_{direction}", True)
    monkeypatch.setitem(kernels.TUNING, "min_dma_run_h2d", 3)
    calls = []
    real = batch.copy_chunks
    monkeypatch.setattr(batch, "copy_chunks", lambda *a, **k: (calls.append(a[2].numel()), real(*a, **k)))
    layers, nd, nh, bs, heads, dim, dtype = 3, 14, 12, 4, 2, 8, torch.bfloat16
    gen = torch.Generator().manual_seed(5)
    hst = [0, 1, 2, 3, 9, 5, 7]                    # a run of 4 (DMA on loads), then scattered
    dev = [10, 2, 7, 4, 0, 13, 1]
    if direction == "h2d":
        host = random_(allocate_host_kv(nh, layers, bs, heads, dim, dtype, pin=CUDA), gen)
        want = [poison(t) for t in _kv(layers, nd, bs, heads, dim, dtype, True)]
        got = [poison(t) for t in _kv(layers, nd, bs, heads, dim, dtype, True)]
        for l in range(layers):
            ref.host_to_device(host, want, hst, dev, layer=l)
            kernels.host_to_device(host, got, hst, dev, layer=l)
        _sync()
        assert all(same_bytes(g, w) for g, w in zip(got, want))
        assert calls == [3] * layers               # the 3 scattered pairs, once per layer
    else:
        kv = [random_(t, gen) for t in _kv(layers, nd, bs, heads, dim, dtype, True)]
        want = poison(allocate_host_kv(nh, layers, bs, heads, dim, dtype, pin=CUDA))
        got = poison(allocate_host_kv(nh, layers, bs, heads, dim, dtype, pin=CUDA))
        ref.device_to_host(kv, want, dev, hst)
        kernels.device_to_host(kv, got, dev, hst)
        _sync()
        assert same_bytes(got, want)
        assert calls == [len(dev)]                 # backups: every pair, all layers, one call


def test_bad_copies_are_refused_with_the_values():
    kv = _kv(2, 4, 2, 1, 4, torch.float16, True)
    host = allocate_host_kv(4, 2, 2, 1, 4, torch.float16, pin=CUDA)
    with pytest.raises(ValueError, match="2 host blocks for 1 device blocks"):
        batch.copy_chunks(host, kv, _ids([0, 1]), _ids([0]), load=True)
    wrong = allocate_host_kv(4, 2, 2, 1, 8, torch.float16, pin=CUDA)
    with pytest.raises(ValueError, match=r"layouts disagree: device layer \(2, 4, 2, 1, 4\)"):
        batch.copy_chunks(wrong, kv, _ids([0]), _ids([0]), load=True)
    with pytest.raises(ValueError, match="host block 4 is out of range 0..3"):
        batch.copy_chunks(host, kv, _ids([0, 4]), _ids([0, 1]), load=True)
    with pytest.raises(ValueError, match="device block -1 is out of range 0..3"):
        batch.copy_chunks(host, kv, _ids([0]), _ids([-1]), load=False)
    batch.copy_chunks(host, kv, _ids([]), _ids([]), load=True)        # nothing to copy: no call


@pytest.mark.skipif(not CUDA, reason="stream order of the driver's batched copy needs a GPU")
@pytest.mark.parametrize("stream", ["legacy-default", "own"])
def test_a_batch_reads_its_source_in_stream_order(stream):
    """A backup queued before a write to its device blocks must copy the old bytes, and a load
    queued behind a busy stream must land before what follows it: the batch runs in stream order
    (CU_MEMCPY_SRC_ACCESS_ORDER_STREAM), never at the call; on the legacy NULL stream (which the
    driver refuses) through the side stream, ordered both ways."""
    if stream == "own":
        with torch.cuda.stream(torch.cuda.Stream()):
            return test_a_batch_reads_its_source_in_stream_order("legacy-default")
    layers, n = 8, 256
    kv = _kv(layers, n, 16, 8, 128, torch.bfloat16, True)
    for t in kv:
        t.fill_(1.0)
    host = allocate_host_kv(n, layers, 16, 8, 128, torch.bfloat16, pin=True)
    ids = _ids(list(range(n)))
    torch.cuda._sleep(50_000_000)                  # the stream is busy when the batch is queued
    batch.copy_chunks(host, kv, ids, ids, load=False)
    for t in kv:
        t.fill_(2.0)                               # queued after the backup
    torch.cuda.synchronize()
    assert bool((host == 1.0).all()), "the backup read device blocks written after it"
    for t in kv:
        t.fill_(0.0)
    torch.cuda._sleep(50_000_000)
    batch.copy_chunks(host, kv, ids, ids, load=True)
    torch.cuda.synchronize()
    assert all(bool((t == 1.0).all()) for t in kv), "the load did not land"
