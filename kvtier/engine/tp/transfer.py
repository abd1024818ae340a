"""Rank 0's transfer engine under tensor parallelism: its own copies, and the same ops sent to
every other rank, each of which copies its own shard of the blocks. An op is reported landed
only once every rank's copy has landed; an item that failed on any rank failed on all (its
blocks are a miss everywhere, never a block some ranks hold and others do not).

The engine talks to it as to a :class:`~kvtier.transfer.engine.TransferEngine` (the copy pump
submits and polls; the step sets ``load_mode`` and takes ``layer_hook``).
"""

from __future__ import annotations

from kvtier.cache.plan import TransferOp
from kvtier.engine.tp.ranks import Ranks
from kvtier.transfer.engine import LoadWaits, TransferEngine

_ORDERED = ("backup", "preload")


class _Pending:
    __slots__ = ("waiting", "failed", "op")

    def __init__(self, op: TransferOp, ranks: int) -> None:
        self.op = op
        self.waiting = ranks  # ranks whose copy has not landed (rank 0 included)
        self.failed: set[int] = set()


class TPTransfer:
    def __init__(self, local: TransferEngine, ranks: Ranks) -> None:
        self.local = local
        self.ranks = ranks
        self.gates = local.gates
        self._pending: dict[int, _Pending] = {}
        self._landed: list[tuple[tuple[int, list[int]], str]] = []  # on every rank, not yet reported
        ranks.on_landed = self._rank_landed

    @property
    def load_mode(self) -> str:
        return self.local.load_mode

    @load_mode.setter
    def load_mode(self, mode: str) -> None:
        self.local.load_mode = mode

    def submit(self, op: TransferOp) -> None:
        self._pending[op.op_id] = _Pending(op, self.ranks.size)
        self.ranks.send(("ops", [(op, self.local.load_mode)]))
        self.local.submit(op)

    def layer_hook(self) -> LoadWaits | None:
        return self.local.layer_hook()

    def poll(self) -> list[tuple[int, list[int]]]:
        self._take(self.local.poll())
        self.ranks.poll()
        return self._report()

    def wait_loads(self) -> list[tuple[int, list[int]]]:
        self._take(self.local.wait_loads())
        self.ranks.wait_all("wait_loads")
        return self._report()

    def drain(self) -> list[tuple[int, list[int]]]:
        self._take(self.local.drain())
        self.ranks.wait_all("drain")
        return self._report()

    @property
    def num_in_flight(self) -> int:
        return len(self._pending)

    def _take(self, landed: list[tuple[int, list[int]]]) -> None:
        self._rank_landed(0, landed)

    def _rank_landed(self, rank: int, landed: list[tuple[int, list[int]]]) -> None:
        for op_id, failed in landed:
            p = self._pending.get(op_id)
            if p is None:
                raise self.ranks.lost(f"tensor-parallel rank {rank} reported copy {op_id}, which is not in flight")
            p.failed.update(failed)
            p.waiting -= 1
            if p.waiting == 0:
                del self._pending[op_id]
                self._landed.append(((op_id, sorted(p.failed)), p.op.kind))

    def _report(self) -> list[tuple[int, list[int]]]:
        """The ops landed on every rank; backups and preloads in submission order, as one
        transfer engine reports them (an op waits for the earlier ones of its kind)."""
        if not self._landed:
            return []
        first_pending: dict[str, int] = {}
        for op_id, p in self._pending.items():
            kind = p.op.kind
            if kind in _ORDERED and op_id < first_pending.get(kind, op_id + 1):
                first_pending[kind] = op_id
        out: list = []
        keep: list = []
        for entry, kind in sorted(self._landed):
            (keep if kind in first_pending and entry[0] > first_pending[kind] else out).append((entry, kind))
        self._landed = keep
        return [entry for entry, _ in out]
