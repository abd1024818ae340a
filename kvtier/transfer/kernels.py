"""Fast copy ops between the device and host KV layouts: one Triton kernel, zero-copy.

Over 600 lines: the kernel, its launch plans for every layout it copies (GQA, latent, fp8 as bytes)
and their warm-up (``compile_variants``), which must stay in step with the plans.

Same signatures and results as the torch reference in :mod:`kvtier.transfer.copy`::

    device (layer l):  kv[l]  [planes, num_device_blocks, block_size, *plane]
    host (page first): host   [num_host_blocks, num_layers, planes, block_size, *plane]

(ModelConfig.kv_layout: 2 planes K and V of ``[kv_heads, head_dim]``, or 1 plane, a latent of
``[kv_width]``.) The unit of work is a *chunk*: one plane (the K, the V or the latent) of one block
in one layer, ``block_size * prod(plane)`` elements, contiguous on both sides. One program copies (a part of) one chunk, so any
list of block pairs — consecutive or scattered — is one launch per layer (loads) or one launch for
all layers (backups, when the layers are views of one buffer as ``allocate_kv_caches`` makes them).

The kernel reads or writes the pinned host pool *through its mapped device address* (CUDA unified
addressing: a page-locked host pointer is valid on the GPU), so there is no staging buffer and no
extra HBM round trip. SM-issued PCIe reads top out below the copy engines (H100: ~48 vs 55 GB/s),
so for loads a *run* of at least ``TUNING["min_dma_run_h2d"]`` consecutive host blocks goes by
DMA instead: per layer one ``cudaMemcpy2DAsync`` (rows = blocks, the two pitches = the two
layouts' block strides) straight into the device blocks when they are consecutive too, else into
a staging buffer and one scatter kernel (HBM speed), as the seeds' ``swap_cache_layout`` does; the
scattered rest is one kernel launch.

A copy of every layer at once can take the *staged* path when the layers are views of one
buffer (:class:`HostRuns`): every layer of a host block is one contiguous span, so each run of
consecutive host blocks (even one block, from ``min_dma_bytes_staged``) is one contiguous DMA
to or from a device staging buffer in the host layout, and one kernel scatters it to, or gathers
it from, the device blocks at HBM speed: a few calls whatever the number of layers, DMA speed for
scattered blocks, and no SMs held across the PCIe transfer. The engine loads a decode graph's
step this way (it waits for the whole load anyway); backups go by the zero-copy kernel, which
the H100 runs faster than the staged gather from 16 blocks up (``kvtier bench transfer``).

Loads of a step graph behind layer gates go per layer with ``deferred``: the DMA of a run into
staging on the load stream, its scatter (:func:`scatter_staged`) queued by the caller on a second
stream, so the copy engine moves the next layer while the SMs scatter this one. Bytes are moved as
the widest integer word that divides a chunk (8, 4, 2 or 1 bytes), so no dtype, block size or
head_dim drops tail bytes. Written by hand because no library op converts between these two paged
layouts for a scattered list of blocks in one launch.

Triton's interpreter (``TRITON_INTERPRET=1``) runs the same kernel on CPU tensors: that is how CI
tests it against the reference.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from typing import Sequence

import torch

from kvtier import index_checks

log = logging.getLogger(__name__)

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the torch reference is used instead
    triton = None

_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))
# block: words per inner iteration; part: words per program (many programs keep many PCIe
# requests in flight); num_warps per program. Tuned on the H100 (docs/BENCHMARKS.md).
# max_programs: the grid (a persistent kernel leaves the other SMs to the forward it overlaps).
# min_dma_run_*: consecutive blocks that go by DMA rather than by the kernel (0 = never): below
# ~32 blocks the per-call cost of 2 x layers DMA calls outweighs their speed (H100 sweep).
# Copies of every layer at once by the staged path (loads of a decode graph step) go through a device
# staging buffer of staging_bytes (0: never): a run of host blocks of min_dma_bytes_staged or more is
# one DMA (every layer of a block is contiguous on the host: one block of an 8B model is 2 MiB).
# min_gated_bytes: a load for a step graph behind layer gates smaller than this goes staged, all
# layers at once, instead (TransferEngine): 2 x layers launches from Python cost more than
# waiting for a small load (a one-block 8B host hit: +3.4 ms gated over a device hit, H100).
# (The scattered rest by one batched DMA, cuMemcpyBatchAsync, was measured and dropped: the H100's
# copy engines move 32 KiB chunks at 0.34-0.55 of the link, the kernel at 0.81-0.94;
# docs/BENCHMARKS.md, 2026-11-25.)
TUNING = {
    "block": 1024,
    "part": 8192,
    "num_warps": 1,
    "max_programs": 264,
    "min_dma_run_h2d": 32,
    "min_dma_run_d2h": 0,
    "min_dma_bytes_staged": 256 << 10,
    "staging_bytes": 64 << 20,
    "staged_programs": 1056,
    "staged_warps": 4,
    "min_gated_bytes": 64 << 20,
}


def available() -> bool:
    return triton is not None


if triton is not None:
    from kvtier.triton_jit import jit

    # one kernel whatever the copy: how many blocks, which layer, where the ids start (triton_jit.py)
    @jit(vary=["src_layer0", "dst_layer0", "num_work", "num_lk", "num_parts"], unaligned=["src_ids", "dst_ids"])
    def copy_chunks(
        src,
        dst,
        src_ids,
        dst_ids,
        src_layer0,
        dst_layer0,
        src_block_stride,
        src_layer_stride,
        src_kv_stride,
        dst_block_stride,
        dst_layer_stride,
        dst_kv_stride,
        num_work,
        num_lk,
        num_parts,
        PLANES: tl.constexpr,
        CHUNK: tl.constexpr,
        PART: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """Persistent grid: program p copies work items p, p + P, ... where a work item is words
        [part*PART, (part+1)*PART) of the chunk (item, layer, plane); PLANES planes per layer
        (2: K and V; 1: a latent). Strides are in words; offsets are int64."""
        num_programs = tl.num_programs(0)
        for w in range(tl.program_id(0), num_work, num_programs):
            part = w % num_parts
            lk = (w // num_parts) % num_lk
            item = w // (num_parts * num_lk)
            layer = (lk // PLANES).to(tl.int64)
            kv = (lk % PLANES).to(tl.int64)
            s = tl.load(src_ids + item).to(tl.int64)
            d = tl.load(dst_ids + item).to(tl.int64)
            src_base = src + s * src_block_stride + (src_layer0 + layer) * src_layer_stride + kv * src_kv_stride
            dst_base = dst + d * dst_block_stride + (dst_layer0 + layer) * dst_layer_stride + kv * dst_kv_stride
            lo = part * PART
            for start in range(0, PART, BLOCK):
                offs = lo + start + tl.arange(0, BLOCK)
                mask = offs < CHUNK
                tl.store(dst_base + offs, tl.load(src_base + offs, mask=mask), mask=mask)


def _word(chunk_bytes: int, *tensors: torch.Tensor) -> tuple[torch.dtype, int]:
    """The widest integer word that divides a chunk and every tensor's address: (dtype, bytes)."""
    for size, dtype in _WORDS:
        if chunk_bytes % size == 0 and all(t.data_ptr() % size == 0 for t in tensors):
            return dtype, size
    raise AssertionError("unreachable: 1-byte words always fit")


def _flat(t: torch.Tensor, word: torch.dtype) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError(f"copy ops need contiguous tensors, got strides {t.stride()}")
    return t.view(-1).view(torch.uint8).view(word)


@dataclass(frozen=True, slots=True)
class Run:
    """Blocks ``src0 .. src0+n-1`` go by DMA, to ``dst0 ..`` (consecutive too) or, for a load,
    to the scattered device blocks ``dst_ids`` (a device tensor) through a staging buffer."""

    src0: int
    n: int
    dst0: int | None
    dst_ids: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class BlockPairs:
    """The (src, dst) block pairs of one copy, split once (a load reuses it for every layer):
    ``runs`` of consecutive source blocks go by DMA; the scattered rest goes by the kernel, which
    reads its ids from ``src_ids``/``dst_ids`` (pinned host memory on the GPU)."""

    runs: tuple[Run, ...]
    src_ids: torch.Tensor
    dst_ids: torch.Tensor

    @staticmethod
    def split(
        src_blocks: Sequence[int], dst_blocks: Sequence[int], cuda: bool, min_run: int, scatter_device: torch.device | None = None
    ) -> "BlockPairs":
        """``min_run``: the shortest run that goes by DMA (0: every block by the kernel).
        ``scatter_device`` (loads): a run needs consecutive sources only; its scattered
        destinations are written by a scatter from staging on that device."""
        src, dst = list(src_blocks), list(dst_blocks)
        if len(src) != len(dst):
            raise ValueError(f"{len(src)} source blocks for {len(dst)} destination blocks")
        if cuda and _cudart() is None:
            min_run = 0
        runs, rest_src, rest_dst = [], [], []
        i = 0
        while i < len(src):
            j = i + 1
            if scatter_device is None:
                while j < len(src) and src[j] == src[j - 1] + 1 and dst[j] == dst[j - 1] + 1:
                    j += 1
            else:
                while j < len(src) and src[j] == src[j - 1] + 1:
                    j += 1
            if min_run and j - i >= min_run:
                if all(dst[k] == dst[i] + k - i for k in range(i, j)):
                    runs.append(Run(src[i], j - i, dst[i]))
                else:
                    dst_ids = torch.tensor(dst[i:j], dtype=torch.long, pin_memory=cuda)
                    runs.append(Run(src[i], j - i, None, dst_ids.to(scatter_device, non_blocking=True)))
            else:
                rest_src += src[i:j]
                rest_dst += dst[i:j]
            i = j
        ids = [torch.tensor(x, dtype=torch.int32, pin_memory=cuda) for x in (rest_src, rest_dst)]
        return BlockPairs(tuple(runs), *ids)


@dataclass(frozen=True, slots=True)
class HostRuns:
    """The pairs of a copy of every layer by the staged path: each run of consecutive host blocks
    (one span of host memory) is one DMA between the host and a device staging buffer, which one
    kernel scatters to (loads) or gathers from (backups) the device blocks, for all layers and
    runs at once; the rest (runs too short to pay for a DMA) goes by the zero-copy kernel."""

    runs: tuple[tuple[int, int], ...]  # (first host block, number of blocks)
    run_device_ids: torch.Tensor  # the runs' device blocks, in order (int32)
    host_ids: torch.Tensor  # the rest: host blocks (int32) ...
    device_ids: torch.Tensor  # ... and their device blocks

    @staticmethod
    def split(host_blocks: Sequence[int], device_blocks: Sequence[int], min_run: int, cuda: bool) -> "HostRuns":
        hst, dev = list(host_blocks), list(device_blocks)
        if len(hst) != len(dev):
            raise ValueError(f"{len(hst)} host blocks for {len(dev)} device blocks")
        runs, run_dev, rest_h, rest_d = [], [], [], []
        i = 0
        while i < len(hst):
            j = i + 1
            while j < len(hst) and hst[j] == hst[j - 1] + 1:
                j += 1
            if j - i >= min_run:
                runs.append((hst[i], j - i))
                run_dev += dev[i:j]
            else:
                rest_h += hst[i:j]
                rest_d += dev[i:j]
            i = j
        ids = [torch.tensor(x, dtype=torch.int32, pin_memory=cuda) for x in (run_dev, rest_h, rest_d)]
        return HostRuns(tuple(runs), *ids)


def host_runs(
    host: torch.Tensor, kv_caches: list[torch.Tensor], host_blocks: Sequence[int], device_blocks: Sequence[int]
) -> HostRuns | None:
    """The staged split of a copy of every layer (:class:`HostRuns`), or None where the staged
    path does not apply (layers in separate buffers, or ``TUNING["staging_bytes"]`` is 0)."""
    if not TUNING["staging_bytes"] or _shared_base(kv_caches) is None:
        return None
    block_bytes = host[0].numel() * host.element_size()
    min_run = max(1, -(-TUNING["min_dma_bytes_staged"] // block_bytes))
    return HostRuns.split(host_blocks, device_blocks, min_run, kv_caches[0].is_cuda)


def _pairs(src_blocks, dst_blocks, like: torch.Tensor, min_run: int) -> BlockPairs:
    if isinstance(src_blocks, BlockPairs):
        return src_blocks
    return BlockPairs.split(src_blocks, dst_blocks, like.is_cuda, min_run)


_CUDART: ctypes.CDLL | None = None
_CUDART_LOOKED_UP = False


def _cudart() -> ctypes.CDLL | None:
    """The CUDA runtime torch loaded (for cudaMemcpy2DAsync, which torch does not expose)."""
    global _CUDART, _CUDART_LOOKED_UP
    if not _CUDART_LOOKED_UP:
        _CUDART_LOOKED_UP = True
        try:
            with open("/proc/self/maps") as maps:
                paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
            for path in sorted(paths):
                lib = ctypes.CDLL(path)
                f = lib.cudaMemcpy2DAsync
                f.argtypes = [
                    ctypes.c_void_p,
                    ctypes.c_size_t,
                    ctypes.c_void_p,
                    ctypes.c_size_t,
                    ctypes.c_size_t,
                    ctypes.c_size_t,
                    ctypes.c_int,
                    ctypes.c_void_p,
                ]
                f.restype = ctypes.c_int
                _CUDART = lib
                break
        except (OSError, AttributeError) as e:
            log.info("no cudaMemcpy2DAsync (%s): consecutive runs go by the kernel too", e)
        if _CUDART is None:
            log.info("CUDA runtime library not found in this process: consecutive runs go by the kernel")
    return _CUDART


def _copy_rows(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[i] = src[i] for two [n, ...] views whose rows are contiguous (strided between rows):
    one 2D DMA on the current stream on the GPU, a strided torch copy elsewhere."""
    if not (dst.is_cuda or src.is_cuda):
        dst.copy_(src)
        return
    width = src[0].numel() * src.element_size()
    stream = torch.cuda.current_stream(dst.device if dst.is_cuda else src.device).cuda_stream
    cudart = _cudart()
    assert cudart is not None  # runs go by this copy only where it was found
    err = cudart.cudaMemcpy2DAsync(
        dst.data_ptr(),
        dst.stride(0) * dst.element_size(),
        src.data_ptr(),
        src.stride(0) * src.element_size(),
        width,
        src.shape[0],
        4,
        stream,
    )
    if err:
        raise RuntimeError(f"cudaMemcpy2DAsync failed with CUDA error {err}")


def _shared_base(kv_caches: list[torch.Tensor]) -> tuple[torch.Tensor, int] | None:
    """If every layer is a view of one buffer at a fixed stride, (first layer, stride in bytes)."""
    first = kv_caches[0]
    if len(kv_caches) == 1:
        return first, 0
    step = kv_caches[1].data_ptr() - first.data_ptr()
    nbytes = first.numel() * first.element_size()
    if step < nbytes:
        return None
    for i, kv in enumerate(kv_caches):
        if kv.data_ptr() != first.data_ptr() + i * step or kv.shape != first.shape or not kv.is_contiguous():
            return None
    if first.untyped_storage().data_ptr() != kv_caches[-1].untyped_storage().data_ptr():
        return None
    return first, step


def _launch(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_ids: torch.Tensor,
    dst_ids: torch.Tensor,
    num_layers: int,
    src_layer0: int,
    dst_layer0: int,
    src_strides: tuple[int, int, int],
    dst_strides: tuple[int, int, int],
    chunk_words: int,
    planes: int,
    on_device: bool = False,
) -> None:
    """``on_device``: both sides in device memory (a staging scatter or gather), which wants more
    programs and warps in flight than a PCIe copy does (``TUNING["staged_*"]``)."""
    n = src_ids.numel()
    if n == 0 or num_layers == 0:
        return
    if index_checks.ENABLED:  # each side's blocks: its tensor's size over its block stride
        index_checks.check("copy src_ids", src_ids, src.numel() // src_strides[0])
        index_checks.check("copy dst_ids", dst_ids, dst.numel() // dst_strides[0])
    block = min(TUNING["block"], triton.next_power_of_2(chunk_words))
    part = -(-min(chunk_words, max(block, TUNING["part"])) // block) * block
    parts = -(-chunk_words // part)
    work = n * num_layers * planes * parts
    programs, warps = (
        (TUNING["staged_programs"], TUNING["staged_warps"]) if on_device else (TUNING["max_programs"], TUNING["num_warps"])
    )
    copy_chunks[(min(work, programs),)](
        src,
        dst,
        src_ids,
        dst_ids,
        src_layer0,
        dst_layer0,
        *src_strides,
        *dst_strides,
        work,
        num_layers * planes,
        parts,
        PLANES=planes,
        CHUNK=chunk_words,
        PART=part,
        BLOCK=block,
        num_warps=warps,
    )


def _geometry(kv: torch.Tensor, host: torch.Tensor) -> tuple[int, int, int, int]:
    """(chunk bytes, num_device_blocks, num_layers, planes) after checking the two layouts agree."""
    planes, num_device_blocks, *block = kv.shape
    if planes not in (1, 2) or tuple(host.shape[2:]) != (planes, *block) or host.dtype != kv.dtype:
        raise ValueError(f"layouts disagree: device layer {tuple(kv.shape)} {kv.dtype}, host {tuple(host.shape)} {host.dtype}")
    return kv[0, 0].numel() * kv.element_size(), num_device_blocks, host.shape[1], planes


def device_to_host(kv_caches: list[torch.Tensor], host: torch.Tensor, device_blocks, host_blocks) -> None:
    """host[host_blocks[i]] = all layers of device block device_blocks[i] (queued on the current
    stream). ``device_blocks`` may be a :class:`BlockPairs` or :class:`HostRuns` (then
    ``host_blocks`` is ignored)."""
    chunk_bytes, num_device_blocks, num_layers, planes = _geometry(kv_caches[0], host)
    if isinstance(device_blocks, HostRuns):
        _staged(host, kv_caches, device_blocks, False, chunk_bytes, num_device_blocks)
        return
    pairs = _pairs(device_blocks, host_blocks, kv_caches[0], TUNING["min_dma_run_d2h"])
    for run in pairs.runs:
        assert run.dst0 is not None, "backups go by DMA only between consecutive blocks"
        d0, h0, n = run.src0, run.dst0, run.n
        for layer, kv in enumerate(kv_caches):
            for kvi in range(planes):
                _copy_rows(host[h0 : h0 + n, layer, kvi], kv[kvi, d0 : d0 + n])
    src_ids, dst_ids = pairs.src_ids, pairs.dst_ids
    if not src_ids.numel():
        return
    shared = _shared_base(kv_caches)
    if shared is not None:
        base, step = shared
        word, w = _word(chunk_bytes, host, base)
        if step % w == 0:
            chunk = chunk_bytes // w
            src = base.view(-1).view(torch.uint8).view(word)  # layer l starts `step` bytes further each
            _launch(
                src,
                _flat(host, word),
                src_ids,
                dst_ids,
                len(kv_caches),
                0,
                0,
                (chunk, step // w, num_device_blocks * chunk),
                (num_layers * planes * chunk, planes * chunk, chunk),
                chunk,
                planes,
            )
            return
    for layer, kv in enumerate(kv_caches):  # layers in separate buffers: a launch each
        word, w = _word(chunk_bytes, host, kv)
        chunk = chunk_bytes // w
        _launch(
            _flat(kv, word),
            _flat(host, word),
            src_ids,
            dst_ids,
            1,
            0,
            layer,
            (chunk, 0, num_device_blocks * chunk),
            (num_layers * planes * chunk, planes * chunk, chunk),
            chunk,
            planes,
        )


def host_to_device(
    host: torch.Tensor,
    kv_caches: list[torch.Tensor],
    host_blocks,
    device_blocks,
    layer: int | None = None,
    deferred: list | None = None,
) -> None:
    """Device block device_blocks[i] = host block host_blocks[i] (one layer, or all), queued on
    the current stream. ``host_blocks`` may be a :class:`BlockPairs` (split once for all layers),
    or for all layers a :class:`HostRuns` (the staged path, a few calls whatever the layers).

    ``deferred`` (a list; this module only): the scatters from staging of runs to scattered
    device blocks are appended to it as ``(kv, dst_ids, staging)`` instead of queued, for the
    caller to queue with :func:`scatter_staged` on another stream once the DMA is done (so the
    next layer's DMA overlaps this layer's scatter)."""
    chunk_bytes, num_device_blocks, num_layers, planes = _geometry(kv_caches[0], host)
    if isinstance(host_blocks, HostRuns):
        if layer is not None:
            raise ValueError(f"a staged copy moves every layer; it cannot load layer {layer} alone")
        _staged(host, kv_caches, host_blocks, True, chunk_bytes, num_device_blocks)
        return
    if isinstance(host_blocks, BlockPairs):
        pairs = host_blocks
    else:
        pairs = BlockPairs.split(
            host_blocks, device_blocks, kv_caches[0].is_cuda, TUNING["min_dma_run_h2d"], scatter_device=kv_caches[0].device
        )
    for index in range(len(kv_caches)) if layer is None else (layer,):
        kv = kv_caches[index]
        for run in pairs.runs:
            h0, d0, n = run.src0, run.dst0, run.n
            if d0 is not None:
                for kvi in range(planes):
                    _copy_rows(kv[kvi, d0 : d0 + n], host[h0 : h0 + n, index, kvi])
            else:  # one DMA of the planes (K and V: adjacent on host) into staging, then a scatter
                assert run.dst_ids is not None
                staging = torch.empty((n, *host.shape[2:]), dtype=kv.dtype, device=kv.device)
                _copy_rows(staging, host[h0 : h0 + n, index])
                if deferred is None:
                    scatter_staged(kv, run.dst_ids, staging)
                else:
                    deferred.append((kv, run.dst_ids, staging))
        if pairs.src_ids.numel():
            word, w = _word(chunk_bytes, host, kv)
            chunk = chunk_bytes // w
            _launch(
                _flat(host, word),
                _flat(kv, word),
                pairs.src_ids,
                pairs.dst_ids,
                1,
                index,
                0,
                (num_layers * planes * chunk, planes * chunk, chunk),
                (chunk, 0, num_device_blocks * chunk),
                chunk,
                planes,
            )


def scatter_staged(kv: torch.Tensor, dst_ids: torch.Tensor, staging: torch.Tensor) -> None:
    """One layer's blocks from staging ([n, planes, ...], host layout) to device blocks ``dst_ids``."""
    index_checks.check("scatter dst_ids", dst_ids, kv.shape[1])
    if kv.element_size() == 1:  # fp8: moved as the same bytes (indexed writes of fp8 are not on every device)
        kv, staging = kv.view(torch.uint8), staging.view(torch.uint8)
    kv[:, dst_ids] = staging.transpose(0, 1)


def _staged(
    host: torch.Tensor, kv_caches: list[torch.Tensor], pairs: HostRuns, load: bool, chunk_bytes: int, num_device_blocks: int
) -> None:
    """Every layer of ``pairs`` between host and device (:class:`HostRuns`), queued on the current
    stream. The staging buffer (host layout) holds at most ``TUNING["staging_bytes"]``: longer
    copies go through it piece by piece; the stream orders a piece's DMA after the kernel that
    last used the buffer."""
    shared = _shared_base(kv_caches)
    if shared is None:
        raise ValueError("a staged copy needs the layers to be views of one buffer")
    base, step = shared
    word, w = _word(chunk_bytes, host, base)
    while step % w:  # the layer stride must be whole words too
        word, w = next((t, n) for n, t in _WORDS if n < w)
    chunk, num_layers, planes = chunk_bytes // w, host.shape[1], host.shape[2]
    dev = base.view(-1).view(torch.uint8).view(word)  # layer l starts `step` bytes further each
    dev_strides = (chunk, step // w, num_device_blocks * chunk)
    host_strides = (num_layers * planes * chunk, planes * chunk, chunk)

    def every_layer(src, dst, src_ids, dst_ids, src_strides, dst_strides, on_device=False) -> None:
        _launch(src, dst, src_ids, dst_ids, num_layers, 0, 0, src_strides, dst_strides, chunk, planes, on_device)

    total = sum(n for _, n in pairs.runs)
    if total:
        piece = max(1, min(total, TUNING["staging_bytes"] // (num_layers * planes * chunk_bytes)))
        staging = torch.empty((piece, *host.shape[1:]), dtype=host.dtype, device=base.device)
        flat = _flat(staging, word)
        rows = torch.arange(piece, dtype=torch.int32, device=base.device)
        done = filled = 0  # run blocks copied so far / rows of this piece
        backs: list[tuple[int, int, int]] = []  # a backup's DMAs of this piece, after its gather
        for h0, n in pairs.runs:
            at = 0
            while at < n:
                m = min(n - at, piece - filled)
                if load:
                    staging[filled : filled + m].copy_(host[h0 + at : h0 + at + m], non_blocking=True)
                else:
                    backs.append((h0 + at, filled, m))
                filled += m
                at += m
                if filled == piece or done + filled == total:
                    ids = pairs.run_device_ids[done : done + filled]
                    if load:
                        every_layer(flat, dev, rows[:filled], ids, host_strides, dev_strides, on_device=True)
                    else:
                        every_layer(dev, flat, ids, rows[:filled], dev_strides, host_strides, on_device=True)
                        for h, r, k in backs:
                            host[h : h + k].copy_(staging[r : r + k], non_blocking=True)
                        backs = []
                    done += filled
                    filled = 0
    if pairs.host_ids.numel():
        if load:
            every_layer(_flat(host, word), dev, pairs.host_ids, pairs.device_ids, host_strides, dev_strides)
        else:
            every_layer(dev, _flat(host, word), pairs.device_ids, pairs.host_ids, dev_strides, host_strides)


def compile_variants(host: torch.Tensor, kv_caches: list[torch.Tensor], device_block: int, host_block: int) -> int:
    """Run every copy path once between ``device_block`` and ``host_block`` (blocks that hold
    nothing anyone reads: the engine's scratch block and a free host block), so each kernel
    variant they launch is compiled now, not under the first request that needs it: a backup
    by the zero-copy kernel, a load of one layer by it, a staged load and backup of every layer
    (a run through the staging buffer, and the zero-copy rest), the scatter of a staged run.
    Returns the paths run."""
    cuda = kv_caches[0].is_cuda
    device = kv_caches[0].device
    one_d, one_h = [device_block], [host_block]
    paths = 0
    device_to_host(kv_caches, host, one_d, one_h)
    host_to_device(host, kv_caches, BlockPairs.split(one_h, one_d, cuda, 0), None, layer=0)
    paths += 2
    if host_runs(host, kv_caches, one_h, one_d) is not None:
        for min_run in (1, 2):  # the block as a run (staging), then as the rest
            staged = HostRuns.split(one_h, one_d, min_run, cuda)
            host_to_device(host, kv_caches, staged, None)
            device_to_host(kv_caches, host, staged, None)
            paths += 2
    staging = torch.empty((1, *host.shape[2:]), dtype=host.dtype, device=device)
    scatter_staged(kv_caches[0], torch.tensor(one_d, dtype=torch.long, device=device), staging)
    return paths + 1
