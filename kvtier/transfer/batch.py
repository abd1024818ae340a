"""Scattered KV copies by DMA in one driver call: ``cuMemcpyBatchAsync`` (CUDA driver >= 12.8).

The unit is the same *chunk* as :mod:`kvtier.transfer.kernels`: the K (or V) of one block in one
layer, contiguous on both sides::

    device (layer l):  kv[l]  [2, num_device_blocks, block_size, kv_heads, head_dim]
    host (page first): host   [num_host_blocks, num_layers, 2, block_size, kv_heads, head_dim]

A copy of n block pairs over m layers is 2 * n * m chunk copies. The kernel path moves scattered
chunks with SM-issued PCIe reads and writes (~48 GB/s on the H100); ``cudaMemcpyAsync`` per chunk
reaches the copy engines (55 GB/s) but costs a driver call per 32-64 KiB. The batched call hands
the driver every (dst, src, size) of a copy at once, so scattered chunks go by the copy engines
for one call: no SMs are taken from a forward it overlaps, and no staging buffer is needed.

The pointer arithmetic is the whole of this module; it is shared by the GPU path and its CPU twin
(the same pointer arrays executed by ``ctypes.memmove``), which CI tests against the torch
reference in :mod:`kvtier.transfer.copy`. The call goes through ctypes because neither torch nor
cupy exposes the batched copy (``cuda-python`` does, but it is not a dependency of this project).

Ordering: the batch runs in stream order as a whole (``CU_MEMCPY_SRC_ACCESS_ORDER_STREAM``); the
copies inside a batch have no order among themselves, and none of ours overlap. The driver refuses
the legacy NULL stream (CUDA error 1); queued there, the batch goes on a side stream that waits
for the current one, and the current one waits for it.
"""
from __future__ import annotations

import ctypes
import logging
from typing import Sequence

import torch

log = logging.getLogger(__name__)

_ORDER_STREAM = 1        # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
# CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE (1): the driver keeps the copies off the SMs, which
# the forward a load overlaps needs; 0 lets it choose (kvtier bench transfer times both).
FLAGS = {"flags": 1}


class _Location(ctypes.Structure):                # CUmemLocation
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Attributes(ctypes.Structure):              # CUmemcpyAttributes
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _Location),
                ("dstLocHint", _Location), ("flags", ctypes.c_uint)]


_CALL: tuple | None | bool = False     # (function, takes a failIdx argument) once probed


def _batch_fn() -> tuple | None:
    """libcuda's batched copy: ``cuMemcpyBatchAsync_v2`` (CUDA 13: no failIdx) or the 12.8
    ``cuMemcpyBatchAsync`` (with failIdx), or None where the driver has neither."""
    global _CALL
    if _CALL is False:
        _CALL = None
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            log.info("no CUDA driver library (%s): scattered copies go by the kernel", e)
            return None
        common = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                  ctypes.POINTER(_Attributes), ctypes.c_void_p, ctypes.c_size_t]
        for name, fail_idx in (("cuMemcpyBatchAsync_v2", False), ("cuMemcpyBatchAsync", True)):
            f = getattr(lib, name, None)
            if f is None:
                continue
            f.argtypes = common + ([ctypes.c_void_p] if fail_idx else []) + [ctypes.c_void_p]
            f.restype = ctypes.c_int
            _CALL = (f, fail_idx)
            break
        else:
            log.info("the CUDA driver has no cuMemcpyBatchAsync (needs >= 12.8): scattered copies go by the kernel")
    return _CALL


_SIDE: dict = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _SIDE:
        _SIDE[device] = torch.cuda.Stream(device)
    return _SIDE[device]


def available() -> bool:
    """Whether batched DMA can run here (a CUDA device and a driver that has the call)."""
    return torch.cuda.is_available() and _batch_fn() is not None


def chunk_pointers(host: torch.Tensor, kv_caches: list[torch.Tensor], host_ids: torch.Tensor,
                   device_ids: torch.Tensor, layers: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(host addresses, device addresses, chunk bytes): one int64 address per chunk, in
    (layer, k|v, pair) order, for block pairs ``host_ids[i] <-> device_ids[i]`` in ``layers``."""
    kv0 = kv_caches[0]
    if host.dtype != kv0.dtype or tuple(host.shape[2:]) != tuple(kv0.shape[:1]) + tuple(kv0.shape[2:]):
        raise ValueError(f"layouts disagree: device layer {tuple(kv0.shape)} {kv0.dtype}, "
                         f"host {tuple(host.shape)} {host.dtype}")
    if host_ids.numel() != device_ids.numel():
        raise ValueError(f"{host_ids.numel()} host blocks for {device_ids.numel()} device blocks")
    if not host.is_contiguous() or not all(kv_caches[l].is_contiguous() for l in layers):
        raise ValueError("batched copies need contiguous host and device layouts")
    es = host.element_size()
    chunk = kv0[0, 0].numel() * es
    h = host_ids.to("cpu", torch.int64)
    d = device_ids.to("cpu", torch.int64)
    for ids, limit, what in ((h, host.shape[0], "host"), (d, kv0.shape[1], "device")):
        if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < limit):   # a raw copy has no bounds
            bad = next(int(x) for x in ids.tolist() if not 0 <= x < limit)
            raise ValueError(f"{what} block {bad} is out of range 0..{limit - 1}")
    lay = torch.tensor(list(layers), dtype=torch.int64)
    kvi = torch.arange(2, dtype=torch.int64)
    host_addr = (host.data_ptr() + h[None, None, :] * (host.stride(0) * es)
                 + lay[:, None, None] * (host.stride(1) * es) + kvi[None, :, None] * (host.stride(2) * es))
    bases = torch.tensor([kv_caches[l].data_ptr() for l in layers], dtype=torch.int64)
    dev_addr = bases[:, None, None] + kvi[None, :, None] * (kv0.stride(0) * es) + d[None, None, :] * (kv0.stride(1) * es)
    return host_addr.reshape(-1).contiguous(), dev_addr.reshape(-1).contiguous(), chunk


def copy_chunks(host: torch.Tensor, kv_caches: list[torch.Tensor], host_ids: torch.Tensor,
                device_ids: torch.Tensor, load: bool, layers: Sequence[int] | None = None) -> None:
    """Device block ``device_ids[i]`` = host block ``host_ids[i]`` (``load``), or the reverse, for
    ``layers`` (default: all), queued on the current stream as one batched DMA on the GPU; on CPU
    tensors the same chunk addresses are copied one by one (the CPU twin)."""
    layers = range(len(kv_caches)) if layers is None else layers
    if not host_ids.numel() or not len(layers):
        return
    host_addr, dev_addr, chunk = chunk_pointers(host, kv_caches, host_ids, device_ids, layers)
    dsts, srcs = (dev_addr, host_addr) if load else (host_addr, dev_addr)
    if not kv_caches[0].is_cuda:
        for dst, src in zip(dsts.tolist(), srcs.tolist()):
            ctypes.memmove(dst, src, chunk)
        return
    call = _batch_fn()
    if call is None:
        raise RuntimeError("cuMemcpyBatchAsync is not available (CUDA driver < 12.8)")
    fn, fail_idx = call
    count = dsts.numel()
    sizes = torch.full((count,), chunk, dtype=torch.int64)
    attrs = _Attributes(srcAccessOrder=_ORDER_STREAM, flags=FLAGS["flags"])
    first = ctypes.c_size_t(0)
    args = [dsts.data_ptr(), srcs.data_ptr(), sizes.data_ptr(), count, ctypes.byref(attrs),
            ctypes.addressof(first), 1]
    failed = ctypes.c_size_t(2 ** 64 - 1)     # SIZE_MAX: no copy to blame
    if fail_idx:
        args.append(ctypes.addressof(failed))
    current = torch.cuda.current_stream(kv_caches[0].device)
    if current.cuda_stream:
        err = fn(*args, current.cuda_stream)
    else:       # the driver refuses the legacy NULL stream: a side stream, ordered both ways
        side = _side_stream(kv_caches[0].device)
        side.wait_stream(current)
        err = fn(*args, side.cuda_stream)
        current.wait_stream(side)
    if err:
        at = (f" at copy {failed.value} of {count}" if fail_idx and failed.value < count
              else f" ({count} copies)")
        raise RuntimeError(f"cuMemcpyBatchAsync failed with CUDA error {err}{at}")
