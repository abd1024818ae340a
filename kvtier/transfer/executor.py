"""Runs the manager's TransferOps on real tensors (torch reference path, synchronous).

Returns, per op, the indices of the items that failed: a storage object that is missing, has the
wrong size, or a backend error. The manager turns those into misses (DESIGN §5.6).
"""
from __future__ import annotations

import logging

import torch

from kvtier.cache.plan import TransferOp
from kvtier.transfer.copy import device_to_host, host_to_device

log = logging.getLogger(__name__)


class TransferExecutor:
    def __init__(self, kv_caches: list[torch.Tensor], host_kv: torch.Tensor | None, storage=None,  # type: ignore[no-untyped-def]
                 routing=None) -> None:
        self.kv_caches = kv_caches
        self.host_kv = host_kv
        self.storage = storage
        self.routing = routing     # RoutingCapture: routed experts travel with their KV block

    def run(self, op: TransferOp) -> list[int]:
        if op.kind == "load":
            host_to_device(self.host_kv, self.kv_caches, op.src_blocks, op.dst_blocks)
            if self.routing is not None:
                self.routing.host_to_device(op.src_blocks, op.dst_blocks)
            return []
        if op.kind == "backup":
            device_to_host(self.kv_caches, self.host_kv, op.src_blocks, op.dst_blocks)
            if self.routing is not None:
                self.routing.device_to_host(op.src_blocks, op.dst_blocks)
            return []
        if op.kind == "put":
            return [i for i, (key, hb) in enumerate(zip(op.keys, op.src_blocks))
                    if not self.storage.put(key, self._block_bytes(hb))]
        if op.kind == "fetch":
            failed = []
            for i, (key, hb) in enumerate(zip(op.keys, op.dst_blocks)):
                data = self.storage.get(key)
                if data is None or not self._load_block_bytes(hb, data):
                    failed.append(i)
            return failed
        raise ValueError(f"unknown op kind {op.kind!r}")

    def _block_bytes(self, host_block: int) -> bytes:
        """One storage object: the host block's KV bytes, then its routing bytes (if MoE)."""
        data = self.host_kv[host_block].contiguous().view(torch.uint8).numpy().tobytes()
        if self.routing is not None:
            data += self.routing.host_block_bytes(host_block)
        return data

    def _load_block_bytes(self, host_block: int, data: bytes) -> bool:
        dst = self.host_kv[host_block]
        nbytes = dst.numel() * dst.element_size()
        extra = self.routing.block_nbytes if self.routing is not None else 0
        if len(data) != nbytes + extra:
            log.warning("storage object for host block %d has %d bytes, expected %d",
                        host_block, len(data), nbytes + extra)
            return False
        if self.routing is not None and not self.routing.load_host_block_bytes(host_block, data[nbytes:]):
            return False
        src = torch.frombuffer(bytearray(data[:nbytes]), dtype=torch.uint8).view(dst.dtype).view(dst.shape)
        dst.copy_(src)
        return True
