"""The engine's copy pump: the cache manager's staged copies go out to the transfer engine
(loads, backups, preloads: CUDA streams, or at once on CPU) and the storage client (fetches,
puts: worker threads), and the copies that landed come back to the manager, which counts bytes
as landed only then. A failed load's rewind (recompute its request from the last good block)
waits in :attr:`CopyPump.rewinds` for the step that loaded, which applies it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.cache import CacheManager
from kvtier.storage.client import StorageClient
from kvtier.transfer.engine import TransferEngine

if TYPE_CHECKING:
    from kvtier.engine.tp.transfer import TPTransfer


class CopyPump:
    def __init__(self, cache: CacheManager, transfer: TransferEngine | TPTransfer, storage: StorageClient | None) -> None:
        self.cache = cache
        self.transfer = transfer
        self.storage = storage
        self.num_done = 0  # copies completed so far (a step's progress: write_back frees blocks late)
        self.num_loads = 0  # load ops submitted so far (did a step load?)
        self.rewinds: dict[object, int] = {}  # failed loads: request id -> tokens still valid

    def pump(self) -> None:
        """Submit the manager's staged copies and hand back those that landed, until quiet (on
        CPU every copy lands at once, and a landed copy may stage the next: backup -> put)."""
        while True:
            plan = self.cache.take_plan()
            for op in plan:
                if op.kind in ("fetch", "put"):
                    assert self.storage is not None  # the manager stages storage ops only with a pool
                    self.storage.submit(op)
                else:
                    self.num_loads += op.kind == "load"
                    self.transfer.submit(op)
            landed = self.transfer.poll()
            if self.storage is not None:
                landed += self.storage.poll()
            self.complete(landed)
            if not plan and not landed:
                return

    def complete(self, landed: list[tuple[int, list[int]]]) -> None:
        """Hand landed copies (op id, failed items) to the manager."""
        for op_id, failed in landed:
            self.rewinds.update(self.cache.complete(op_id, failed))
        self.num_done += len(landed)

    def wait_loads(self) -> None:
        """Wait for the loads queued so far (a forward waited on them on the device)."""
        self.complete(self.transfer.wait_loads())

    def wait_some(self) -> None:
        """Nothing can run until copies land: wait for the transfer engine's, else for a storage
        op (up to 50 ms: prefetches and puts land on their own time)."""
        if self.transfer.num_in_flight:
            self.complete(self.transfer.drain())
        elif self.storage is not None and self.storage.num_in_flight:
            self.complete(self.storage.wait(timeout=0.05))

    @property
    def in_flight(self) -> bool:
        return bool(self.transfer.num_in_flight or (self.storage is not None and self.storage.num_in_flight))

    def drain(self) -> None:
        """Wait for every copy in flight, and those they stage, and hand them to the manager."""
        self.pump()
        while self.in_flight:
            self.complete(self.transfer.drain())
            if self.storage is not None:
                self.complete(self.storage.drain())
            self.pump()

    def take_rewinds(self, request_ids: list[str]) -> dict[object, int]:
        """The rewinds of ``request_ids`` (those the step that loaded applies now)."""
        return {rid: self.rewinds.pop(rid) for rid in request_ids if rid in self.rewinds}
