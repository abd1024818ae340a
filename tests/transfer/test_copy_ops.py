"""Fast copy ops (Triton, zero-copy) vs the torch reference, on fresh random data.

Destinations are poisoned first (every byte 0xA5), so a dropped tail byte or a stray write shows
up as a mismatch; blocks not named in the copy must keep their poison. On a machine without CUDA
the kernel runs in Triton's interpreter on CPU tensors (same kernel code).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

pytest.importorskip("triton", reason="triton is not installed: the fast copy path is untested")

from kvtier.transfer import copy as ref  # noqa: E402
from kvtier.transfer import kernels as fast  # noqa: E402
from kvtier.transfer.copy import allocate_host_kv  # noqa: E402
from tests.transfer.copy_helpers import poison, random_, same_bytes  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
if not CUDA and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    pytest.skip("no CUDA and TRITON_INTERPRET is off: triton kernels cannot run", allow_module_level=True)

# (layers, device blocks, host blocks, block_size, kv_heads, head_dim, dtype)
SHAPES = [
    (2, 9, 7, 16, 2, 32, torch.float32),
    (3, 6, 8, 1, 1, 3, torch.bfloat16),  # 6-byte chunks: 2-byte words
    (2, 5, 5, 2, 3, 5, torch.float16),  # 60-byte chunks: 4-byte words
    (1, 4, 6, 4, 1, 1, torch.uint8),  # 4-byte chunks of single bytes
    (4, 12, 10, 8, 2, 64, torch.bfloat16),
    (2, 9, 7, 16, 2, 32, torch.float8_e4m3fn),  # an fp8 cache: moved as bytes
    (3, 6, 8, 1, 1, 3, torch.float8_e5m2),  # 3-byte chunks: single bytes
]


def _kv(layers, blocks, bs, heads, dim, dtype, shared: bool, gen):
    shape = (2, blocks, bs, heads, dim)
    if shared:  # views of one buffer, as allocate_kv_caches makes them
        buf = torch.empty((layers, *shape), dtype=dtype, device=DEVICE)
        kv = list(buf.unbind(0))
    else:
        kv = [torch.empty(shape, dtype=dtype, device=DEVICE) for _ in range(layers)]
    for t in kv:
        random_(t, gen)
    return kv


def _pairs(rng, n_src, n_dst, k, consecutive):
    if consecutive:
        s, d = rng.randrange(n_src - k + 1), rng.randrange(n_dst - k + 1)
        return list(range(s, s + k)), list(range(d, d + k))
    return rng.sample(range(n_src), k), rng.sample(range(n_dst), k)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"L{s[0]}-bs{s[3]}-h{s[4]}-d{s[5]}-{s[6]}".replace("torch.", ""))
@pytest.mark.parametrize("shared", [True, False], ids=["one-buffer", "per-layer"])
@pytest.mark.parametrize("consecutive", [True, False], ids=["runs", "scattered"])
def test_backup_matches_reference_and_touches_nothing_else(shape, shared, consecutive):
    layers, nd, nh, bs, heads, dim, dtype = shape
    rng, gen = random.Random(hash(shape) & 0xFFFF), torch.Generator().manual_seed(1)
    kv = _kv(layers, nd, bs, heads, dim, dtype, shared, gen)
    k = min(nd, nh) - 1
    dev, host_ids = _pairs(rng, nd, nh, k, consecutive)
    want = poison(allocate_host_kv(nh, layers, bs, heads, dim, dtype, pin=CUDA))
    got = poison(allocate_host_kv(nh, layers, bs, heads, dim, dtype, pin=CUDA))
    ref.device_to_host(kv, want, dev, host_ids)
    fast.device_to_host(kv, got, dev, host_ids)
    if CUDA:
        torch.cuda.synchronize()
    assert same_bytes(got, want)
    untouched = [b for b in range(nh) if b not in host_ids]
    assert all((got[b].view(torch.uint8) == 0xA5).all() for b in untouched)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"L{s[0]}-bs{s[3]}-h{s[4]}-d{s[5]}-{s[6]}".replace("torch.", ""))
@pytest.mark.parametrize("consecutive", [True, False], ids=["runs", "scattered"])
def test_load_per_layer_matches_reference(shape, consecutive):
    layers, nd, nh, bs, heads, dim, dtype = shape
    rng, gen = random.Random(hash(shape) & 0xFFF), torch.Generator().manual_seed(2)
    host = random_(allocate_host_kv(nh, layers, bs, heads, dim, dtype, pin=CUDA), gen)
    want = [poison(t) for t in _kv(layers, nd, bs, heads, dim, dtype, True, gen)]
    got = [poison(t) for t in _kv(layers, nd, bs, heads, dim, dtype, True, gen)]
    k = min(nd, nh) - 1
    host_ids, dev = _pairs(rng, nh, nd, k, consecutive)
    for layer in range(layers):  # per layer, as loads run
        ref.host_to_device(host, want, host_ids, dev, layer=layer)
        fast.host_to_device(host, got, host_ids, dev, layer=layer)
        if CUDA:
            torch.cuda.synchronize()
        for layer_i in range(layers):  # later layers still untouched
            assert same_bytes(got[layer_i], want[layer_i]), f"layer {layer_i} after loading layer {layer}"
    untouched = [b for b in range(nd) if b not in dev]
    assert all((t[:, b].view(torch.uint8) == 0xA5).all() for t in got for b in untouched)


def test_empty_copies_are_no_ops():
    gen = torch.Generator().manual_seed(3)
    kv = _kv(2, 4, 4, 1, 8, torch.float32, True, gen)
    host = poison(allocate_host_kv(4, 2, 4, 1, 8, torch.float32, pin=CUDA))
    fast.device_to_host(kv, host, [], [])
    fast.host_to_device(host, kv, [], [], layer=0)
    assert (host.view(torch.uint8) == 0xA5).all()


def test_mismatched_layouts_are_refused():
    gen = torch.Generator().manual_seed(4)
    kv = _kv(2, 4, 4, 1, 8, torch.float32, True, gen)
    host = allocate_host_kv(4, 2, 4, 2, 8, torch.float32)  # 2 kv heads vs 1
    with pytest.raises(ValueError, match="layouts disagree"):
        fast.device_to_host(kv, host, [0], [0])


@pytest.mark.parametrize("tuning", [dict(max_programs=2, block=16, part=32), dict(max_programs=5, block=64, part=64)])
def test_persistent_grid_with_few_programs_copies_everything(tuning, monkeypatch):
    """The grid is capped (to leave SMs to the forward): each program loops over many chunks."""
    monkeypatch.setattr(fast, "TUNING", dict(fast.TUNING, **tuning))
    layers, nd, nh, bs, heads, dim, dtype = 3, 10, 9, 4, 2, 12, torch.float16
    rng, gen = random.Random(7), torch.Generator().manual_seed(7)
    kv = _kv(layers, nd, bs, heads, dim, dtype, True, gen)
    dev, host_ids = _pairs(rng, nd, nh, 8, False)
    want = poison(allocate_host_kv(nh, layers, bs, heads, dim, dtype, pin=CUDA))
    got = poison(allocate_host_kv(nh, layers, bs, heads, dim, dtype, pin=CUDA))
    ref.device_to_host(kv, want, dev, host_ids)
    fast.device_to_host(kv, got, dev, host_ids)
    back = [poison(t) for t in _kv(layers, nd, bs, heads, dim, dtype, True, gen)]
    for layer in range(layers):
        fast.host_to_device(got, back, host_ids, dev, layer=layer)
    if CUDA:
        torch.cuda.synchronize()
    assert same_bytes(got, want)
    for layer in range(layers):
        assert same_bytes(back[layer][:, dev], kv[layer][:, dev])


@pytest.mark.parametrize("min_run", [0, 2, 3])
def test_runs_by_dma_and_scattered_rest_by_kernel_together(min_run, monkeypatch):
    """Pairs mixing consecutive runs (DMA rows) and scattered blocks (kernel) land exactly."""
    monkeypatch.setattr(fast, "TUNING", dict(fast.TUNING, min_dma_run_h2d=min_run, min_dma_run_d2h=min_run))
    layers, nd, nh, bs, heads, dim, dtype = 3, 16, 16, 4, 2, 8, torch.bfloat16
    gen = torch.Generator().manual_seed(9)
    kv = _kv(layers, nd, bs, heads, dim, dtype, True, gen)
    dev = [2, 3, 4, 9, 0, 11, 12, 13, 14, 6]  # runs 2-4 and 11-14 (both sides), scattered rest
    hst = [5, 6, 7, 1, 15, 8, 9, 10, 11, 3]
    pairs = fast.BlockPairs.split(dev, hst, CUDA, min_run)
    assert sum(r.n for r in pairs.runs) + pairs.src_ids.numel() == len(dev)
    if min_run:
        assert pairs.runs and all(r.n >= min_run for r in pairs.runs)
    want = poison(allocate_host_kv(nh, layers, bs, heads, dim, dtype, pin=CUDA))
    got = poison(allocate_host_kv(nh, layers, bs, heads, dim, dtype, pin=CUDA))
    ref.device_to_host(kv, want, dev, hst)
    fast.device_to_host(kv, got, pairs, None)
    back = [poison(t) for t in _kv(layers, nd, bs, heads, dim, dtype, True, gen)]
    want_back = [poison(t) for t in _kv(layers, nd, bs, heads, dim, dtype, True, gen)]
    back_pairs = fast.BlockPairs.split(hst, dev, CUDA, min_run, scatter_device=torch.device(DEVICE))
    for layer in range(layers):
        fast.host_to_device(got, back, back_pairs, None, layer=layer)
        ref.host_to_device(want, want_back, hst, dev, layer=layer)
    if CUDA:
        torch.cuda.synchronize()
    assert same_bytes(got, want)
    for layer in range(layers):
        assert same_bytes(back[layer], want_back[layer])


def test_mismatched_pair_counts_are_refused():
    with pytest.raises(ValueError, match="3 source blocks for 2 destination"):
        fast.BlockPairs.split([0, 1, 2], [0, 1], CUDA, 0)


def test_load_run_with_scattered_device_blocks_goes_through_staging(monkeypatch):
    """Consecutive host blocks into scattered device blocks: one DMA per layer + a scatter."""
    monkeypatch.setattr(fast, "TUNING", dict(fast.TUNING, min_dma_run_h2d=4))
    layers, nd, nh, bs, heads, dim, dtype = 2, 12, 10, 2, 1, 6, torch.float16
    gen = torch.Generator().manual_seed(11)
    host = random_(allocate_host_kv(nh, layers, bs, heads, dim, dtype, pin=CUDA), gen)
    hst, dev = [2, 3, 4, 5, 6, 8], [9, 1, 7, 0, 3, 5]
    pairs = fast.BlockPairs.split(hst, dev, CUDA, 4, scatter_device=torch.device(DEVICE))
    assert len(pairs.runs) == 1 and pairs.runs[0].dst0 is None and pairs.src_ids.numel() == 1
    got = [poison(t) for t in _kv(layers, nd, bs, heads, dim, dtype, True, gen)]
    want = [poison(t) for t in _kv(layers, nd, bs, heads, dim, dtype, True, gen)]
    for layer in range(layers):
        fast.host_to_device(host, got, pairs, None, layer=layer)
        ref.host_to_device(host, want, hst, dev, layer=layer)
    if CUDA:
        torch.cuda.synchronize()
    for layer in range(layers):
        assert same_bytes(got[layer], want[layer])
    # deferred (gated loads): the DMA into staging now, the scatter when the caller queues it
    late = [poison(t) for t in _kv(layers, nd, bs, heads, dim, dtype, True, gen)]
    for layer in range(layers):
        deferred: list = []
        fast.host_to_device(host, late, pairs, None, layer=layer, deferred=deferred)
        assert len(deferred) == 1 and deferred[0][0] is late[layer]
        if CUDA:
            torch.cuda.synchronize()
        assert (late[layer][:, dev[:5]].view(torch.uint8) == 0xA5).all()  # the run: not yet there
        fast.scatter_staged(*deferred[0])
    if CUDA:
        torch.cuda.synchronize()
    for layer in range(layers):
        assert same_bytes(late[layer], want[layer])


@pytest.mark.parametrize("staging_blocks", [1, 3, 64], ids=lambda n: f"staging{n}")
def test_staged_copies_match_reference(staging_blocks, monkeypatch):
    """Every layer at once through the staging buffer (backups; loads of a replayed step): runs
    of 3+ host blocks go by DMA piece by piece, to and from scattered and consecutive device
    blocks; the scattered rest by one kernel for all layers. Both directions equal the reference
    and touch no other block."""
    layers, nd, nh, bs, heads, dim, dtype = 3, 24, 20, 2, 2, 4, torch.bfloat16
    block_bytes = layers * 2 * bs * heads * dim * 2
    monkeypatch.setattr(
        fast, "TUNING", dict(fast.TUNING, min_dma_bytes_staged=3 * block_bytes, staging_bytes=staging_blocks * block_bytes)
    )
    gen = torch.Generator().manual_seed(13)
    host = random_(allocate_host_kv(nh, layers, bs, heads, dim, dtype, pin=CUDA), gen)
    # host runs 2-6 (<-> scattered device blocks) and 10-13 (<-> consecutive 16-19), the rest scattered
    hst = [2, 3, 4, 5, 6, 0, 10, 11, 12, 13, 18, 8]
    dev = [9, 1, 7, 0, 3, 22, 16, 17, 18, 19, 5, 11]
    got = [poison(t) for t in _kv(layers, nd, bs, heads, dim, dtype, True, gen)]
    want = [poison(t) for t in _kv(layers, nd, bs, heads, dim, dtype, True, gen)]
    pairs = fast.host_runs(host, got, hst, dev)
    assert pairs is not None  # (runs long enough to stage)
    assert pairs.runs == ((2, 5), (10, 4)) and pairs.host_ids.tolist() == [0, 18, 8]
    with pytest.raises(ValueError, match="cannot load layer 0 alone"):
        fast.host_to_device(host, got, pairs, None, layer=0)
    fast.host_to_device(host, got, pairs, None)
    ref.host_to_device(host, want, hst, dev)
    back = poison(allocate_host_kv(nh, layers, bs, heads, dim, dtype, pin=CUDA))
    want_back = poison(allocate_host_kv(nh, layers, bs, heads, dim, dtype, pin=CUDA))
    fast.device_to_host(got, back, fast.host_runs(back, got, hst, dev), None)
    ref.device_to_host(want, want_back, dev, hst)
    if CUDA:
        torch.cuda.synchronize()
    for layer in range(layers):
        assert same_bytes(got[layer], want[layer]), f"layer {layer}"
    untouched = [b for b in range(nd) if b not in dev]
    assert all((t[:, b].view(torch.uint8) == 0xA5).all() for t in got for b in untouched)
    assert same_bytes(back, want_back)
    assert all((back[b].view(torch.uint8) == 0xA5).all() for b in range(nh) if b not in hst)


def test_staged_path_sends_single_blocks_by_dma_and_needs_one_buffer(monkeypatch):
    """Blocks of min_dma_bytes_staged or more go by DMA one by one even when scattered on the
    host (every layer of a block is contiguous there); layers in separate buffers, or
    staging_bytes=0, have no staged path."""
    layers, nd, nh, bs, heads, dim, dtype = 2, 10, 10, 4, 1, 8, torch.float16
    monkeypatch.setattr(fast, "TUNING", dict(fast.TUNING, min_dma_bytes_staged=1))
    gen = torch.Generator().manual_seed(14)
    host = random_(allocate_host_kv(nh, layers, bs, heads, dim, dtype, pin=CUDA), gen)
    hst, dev = [7, 2, 9, 4], [1, 8, 3, 6]
    got = [poison(t) for t in _kv(layers, nd, bs, heads, dim, dtype, True, gen)]
    want = [poison(t) for t in _kv(layers, nd, bs, heads, dim, dtype, True, gen)]
    pairs = fast.host_runs(host, got, hst, dev)
    assert pairs is not None
    assert len(pairs.runs) == 4 and pairs.host_ids.numel() == 0
    fast.host_to_device(host, got, pairs, None)
    ref.host_to_device(host, want, hst, dev)
    if CUDA:
        torch.cuda.synchronize()
    for layer in range(layers):
        assert same_bytes(got[layer], want[layer]), f"layer {layer}"
    assert fast.host_runs(host, _kv(layers, nd, bs, heads, dim, dtype, False, gen), hst, dev) is None
    monkeypatch.setattr(fast, "TUNING", dict(fast.TUNING, staging_bytes=0))
    assert fast.host_runs(host, got, hst, dev) is None
