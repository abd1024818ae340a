"""Rank 0's copies under tensor parallelism: its own, and the same ops sent to every other rank,
each of which moves its own shard of the blocks (between its device and host tiers, and between
its host tier and the pool, under ``:tp<rank>of<size>`` names). An op is reported landed only
once every rank's part has landed; an item that failed on any rank failed on all (its block is a
miss everywhere, never a block some ranks hold and others do not).

The engine talks to :class:`TPTransfer` as to a :class:`~kvtier.transfer.engine.TransferEngine`
(the copy pump submits and polls; the step sets ``load_mode`` and takes ``layer_hook``), and to
:class:`TPStorage` as to a :class:`~kvtier.storage.client.StorageClient`.
"""

from __future__ import annotations

from typing import Any

from kvtier.cache.plan import TransferOp
from kvtier.engine.tp.ranks import Ranks
from kvtier.storage.client import StorageClient
from kvtier.transfer.engine import LoadWaits, TransferEngine

_ORDERED = ("backup", "preload")  # reported in submission order, as one transfer engine does


class _Pending:
    __slots__ = ("waiting", "failed", "op")

    def __init__(self, op: TransferOp, ranks: int) -> None:
        self.op = op
        self.waiting = ranks  # ranks whose part has not landed (rank 0 included)
        self.failed: set[int] = set()


class RankOps:
    """The ops in flight on the ranks, each until every rank reported it."""

    def __init__(self, ranks: Ranks) -> None:
        self.ranks = ranks
        self.pending: dict[int, _Pending] = {}
        self.landed: list[tuple[tuple[int, list[int]], TransferOp]] = []  # on every rank, not yet reported
        ranks.on_landed = self.rank_landed

    def add(self, op: TransferOp) -> None:
        self.pending[op.op_id] = _Pending(op, self.ranks.size)

    def rank_landed(self, rank: int, landed: list[tuple[int, list[int]]]) -> None:
        for op_id, failed in landed:
            p = self.pending.get(op_id)
            if p is None:
                raise self.ranks.lost(f"tensor-parallel rank {rank} reported copy {op_id}, which is not in flight")
            p.failed.update(failed)
            p.waiting -= 1
            if p.waiting == 0:
                del self.pending[op_id]
                self.landed.append(((op_id, sorted(p.failed)), p.op))

    def take(self, kinds: tuple[str, ...]) -> list[tuple[tuple[int, list[int]], TransferOp]]:
        """The landed ops of ``kinds`` ((op id, failed items), op); backups and preloads in
        submission order (an op waits for the earlier ones of its kind)."""
        first_pending: dict[str, int] = {}
        for op_id, p in self.pending.items():
            kind = p.op.kind
            if kind in _ORDERED and op_id < first_pending.get(kind, op_id + 1):
                first_pending[kind] = op_id
        out: list = []
        keep: list = []
        for entry, op in sorted(self.landed, key=lambda landed: landed[0][0]):
            kind = op.kind
            mine = kind in kinds and not (kind in first_pending and entry[0] > first_pending[kind])
            (out if mine else keep).append((entry, op))
        self.landed = keep
        return out

    def count(self, kinds: tuple[str, ...]) -> int:
        return sum(1 for p in self.pending.values() if p.op.kind in kinds)


class _OnEveryRank:
    """What both sides share: an op goes to every other rank, then runs here; completions are
    this rank's merged with theirs (:class:`RankOps`)."""

    KINDS: tuple[str, ...] = ()
    DRAIN = ""  # the rank message that drains the ops of these kinds

    def __init__(self, local: Any, ops: RankOps) -> None:
        self.local = local
        self.ops = ops
        self.ranks = ops.ranks

    def _submit(self, op: TransferOp, mode: str) -> None:
        self.ops.add(op)
        self.ranks.send(("ops", [(op, mode)]))
        self.local.submit(op)

    def _merged(self, landed_here: list[tuple[int, list[int]]], wait: str | None = None) -> list[tuple[int, list[int]]]:
        """The ops landed on every rank, after this rank's ``landed_here`` and what the others
        sent (``wait``: after every rank ran that message and acked)."""
        self.ops.rank_landed(0, landed_here)
        if wait is None:
            self.ranks.poll()
        else:
            self.ranks.wait_all(wait)
        return self._report()

    def poll(self) -> list[tuple[int, list[int]]]:
        return self._merged(self.local.poll())

    def drain(self) -> list[tuple[int, list[int]]]:
        return self._merged(self.local.drain(), self.DRAIN)

    @property
    def num_in_flight(self) -> int:
        return self.ops.count(self.KINDS)

    def _report(self) -> list[tuple[int, list[int]]]:
        return [entry for entry, _ in self.ops.take(self.KINDS)]


class TPTransfer(_OnEveryRank):
    KINDS = ("load", "preload", "backup")
    DRAIN = "drain"

    def __init__(self, local: TransferEngine, ops: RankOps) -> None:
        super().__init__(local, ops)
        self.gates = local.gates

    @property
    def load_mode(self) -> str:
        return self.local.load_mode

    @load_mode.setter
    def load_mode(self, mode: str) -> None:
        self.local.load_mode = mode

    def submit(self, op: TransferOp) -> None:
        self._submit(op, self.local.load_mode)

    def layer_hook(self) -> LoadWaits | None:
        return self.local.layer_hook()

    def wait_loads(self) -> list[tuple[int, list[int]]]:
        return self._merged(self.local.wait_loads(), "wait_loads")


class TPStorage(_OnEveryRank):
    """Rank 0's pool client: fetches and puts of rank 0's shards here, the same ops on every
    other rank; lookups ask for every rank's shard (StorageClient.shard). Everything else is the
    local client's."""

    KINDS = ("fetch", "put")
    DRAIN = "storage_drain"
    local: StorageClient

    def __getattr__(self, name: str) -> Any:
        return getattr(self.local, name)

    def submit(self, op: TransferOp) -> None:
        self._submit(op, "whole")

    def wait(self, timeout: float | None = None) -> list[tuple[int, list[int]]]:
        """Until an op can be reported or ``timeout`` (this rank's part, then the others')."""
        if self.local.num_in_flight:
            return self._merged(self.local.wait(timeout))
        self.ranks.poll(0.05 if timeout is None else timeout)
        return self._report()

    def _report(self) -> list[tuple[int, list[int]]]:
        out = []
        for (op_id, failed), op in self.ops.take(self.KINDS):
            if op.kind == "put" and failed:  # stored on some ranks only: put again next time
                self.local.forget([op.keys[i] for i in failed])
            out.append((op_id, failed))
        return out
