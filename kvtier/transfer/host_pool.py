"""The host tier's memory: one page-locked buffer, on the GPU's NUMA node.

    host KV  [num_host_blocks, num_layers, planes, block_size, *plane]   (DESIGN §4)

(``model.host_kv_shape``: K and V planes of [kv_heads, head_dim], or one latent plane of [kv_width].)

Why not ``torch.empty(..., pin_memory=True)``: torch's caching host allocator rounds every
allocation up to a power of two (a 40 GiB pool would pin 64 GiB) and keeps it cached after use.
Instead the buffer is an ordinary allocation that is

1. bound to the GPU's NUMA node with ``mbind`` before any page is touched (machines with several
   nodes; elsewhere a no-op, logged once) — a host→device copy from the far node crosses the
   inter-socket link and loses a large part of the PCIe bandwidth;
2. page-locked and mapped into the GPU's address space with ``cudaHostRegister`` (portable +
   mapped), so DMA engines and the zero-copy kernels of :mod:`kvtier.transfer.kernels` reach it;
3. unregistered by :meth:`HostKV.release` (``LLM.close``), before its memory goes back.
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)
_logged_numa = False
_CUDA_HOST_REGISTER_PORTABLE_MAPPED = 0x01 | 0x02
_MPOL_BIND = 2
_SYS_MBIND = {"x86_64": 237, "aarch64": 235}.get(os.uname().machine)


def gpu_numa_node(device: torch.device) -> int | None:
    """The NUMA node of ``device``'s PCI slot, or None (single node, unknown, or not a GPU)."""
    if device.type != "cuda":
        return None
    nodes = [p for p in Path("/sys/devices/system/node").glob("node[0-9]*")] if Path("/sys/devices/system/node").is_dir() else []
    if len(nodes) < 2:
        return None
    p = torch.cuda.get_device_properties(device)
    bus = f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"  # type: ignore[attr-defined]  # not in torch stubs
    try:
        node = int(Path(f"/sys/bus/pci/devices/{bus}/numa_node").read_text())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def _bind_to_node(t: torch.Tensor, node: int) -> bool:
    """mbind the whole pages of ``t`` to ``node`` (before they are touched). False on failure."""
    if _SYS_MBIND is None:
        return False
    page = os.sysconf("SC_PAGE_SIZE")
    start = -(-t.data_ptr() // page) * page
    end = (t.data_ptr() + t.numel() * t.element_size()) // page * page
    if end <= start:
        return False
    mask = (ctypes.c_ulong * (node // 64 + 1))()
    mask[node // 64] = 1 << (node % 64)
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.syscall(
        _SYS_MBIND, ctypes.c_void_p(start), ctypes.c_ulong(end - start), _MPOL_BIND, mask, ctypes.c_ulong(64 * len(mask) + 1), 0
    )
    return rc == 0


class HostKV:
    """The host KV buffer and how it was placed; ``tensor`` is what the copy ops use."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        global _logged_numa
        self.tensor = torch.empty(shape, dtype=dtype)
        self.numa_node = None
        self.registered = False
        if device.type == "cuda":
            node = gpu_numa_node(device)
            if node is not None and _bind_to_node(self.tensor, node):
                self.numa_node = node
            if not _logged_numa:
                _logged_numa = True
                log.info(
                    "host KV pool: %s",
                    f"bound to NUMA node {node} (the GPU's)"
                    if self.numa_node is not None
                    else "one NUMA node (or none known): no binding needed",
                )
        self.tensor.zero_()  # first touch: pages land on the bound node
        if device.type == "cuda" and self.tensor.numel():
            nbytes = self.tensor.numel() * self.tensor.element_size()
            err = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), nbytes, _CUDA_HOST_REGISTER_PORTABLE_MAPPED)
            if int(err) != 0:
                raise RuntimeError(
                    f"cudaHostRegister of the {nbytes / 2**30:.1f} GiB host KV pool failed "
                    f"(error {int(err)}); lower num_host_blocks or raise the locked-memory limit"
                )
            self.registered = True

    def release(self) -> None:
        """Unpin (after every copy touching it has finished) and drop the buffer."""
        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.registered = False
        self.tensor = torch.empty(0)

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # interpreter shutdown: nothing left to unpin
            pass
