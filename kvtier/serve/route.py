"""Which instance a request goes to: the policies of ``kvtier router --policy`` and of
``kvtier sim --instances --route``, one implementation for both (pure Python, no torch).

Each candidate instance is described by what the router knows of it (:class:`Candidate`): how
many of the request's leading tokens its device tier and its host tier hold (a
:class:`PrefixIndex` fed by the instance's KV events, cache/events.py), how many more after
those the shared pool holds (asked of the pool itself: it is the same for every instance, so it
counts for everyone, after what each holds), and its load, the work of the requests in flight
on it: their tokens but those it was predicted to hold when each was sent (a cached prompt costs
it little; ``kvtier sim`` models the same, the uncached tokens it has yet to compute).

- ``round_robin``: in turn, whatever they hold.
- ``least_load``: the least load.
- ``cache_aware``: the longest prefix, device hits counting in full, host hits at
  :data:`HOST_WEIGHT` (a host hit is a load over PCIe, not free) and pool hits at
  :data:`STORAGE_WEIGHT` (a fetch over the network, then that load), among the instances whose load
  is within :data:`BALANCE_REL` x the least loaded one's plus :data:`BALANCE_ABS` tokens (a busy
  instance that holds the prefix loses to an idle one that must recompute it: the recompute
  costs less than the queue); when the best overlap is under :data:`CACHE_THRESHOLD` of the
  prompt, the least loaded (a new conversation goes where there is room, and a system prompt
  that every request shares does not draw them all to one instance). Sticky sessions are not
  the mechanism: the overlap is, so a conversation follows its blocks.

The constants were chosen with ``kvtier sim --instances 4|8`` on the shipped Mooncake traces
(docs/BENCHMARKS.md, "Several instances"): a smaller BALANCE_ABS (4,096) left 0.65-0.74 of the
hit rate of one instance with the fleet's whole cache; no threshold sent every request of the
conversation trace to one instance (its requests share their first block).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

POLICIES = ("cache_aware", "least_load", "round_robin")
HOST_WEIGHT = 0.5
STORAGE_WEIGHT = 0.25
BALANCE_REL = 1.5
BALANCE_ABS = 65536
CACHE_THRESHOLD = 0.2
PREDICTED_S = 10.0  # a routed prompt's blocks count as held this long before their events
PREDICTED_MAX = 100_000  # predicted keys kept before the expired ones are swept


@dataclass(slots=True)
class Candidate:
    device_hit: int = 0  # leading tokens of the request in its device tier
    host_hit: int = 0  # ... then in its host tier
    load: int = 0  # the uncached tokens of the requests in flight on it (module docstring)
    storage_hit: int = 0  # ... then in the shared pool

    @property
    def score(self) -> float:
        return self.device_hit + HOST_WEIGHT * self.host_hit + STORAGE_WEIGHT * self.storage_hit


class Picker:
    """One policy's choices, in order (round robin and ties rotate)."""

    def __init__(self, policy: str) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}; choose {', '.join(POLICIES)}")
        self.policy = policy
        self._turn = 0

    def pick(self, cands: Sequence[Candidate], prompt_tokens: int = 0) -> int:
        """The index of the chosen candidate (``cands`` not empty) for a prompt of
        ``prompt_tokens`` tokens."""
        n = len(cands)
        if not n:
            raise ValueError("no candidate to route to")
        turn = self._turn
        self._turn += 1
        if self.policy == "round_robin":
            return turn % n

        def rotation(i: int) -> int:  # ties go round, not always to the first
            return (i - turn) % n

        least = min(range(n), key=lambda i: (cands[i].load, rotation(i)))
        if self.policy == "least_load":
            return least
        limit = max(cands[least].load * BALANCE_REL, cands[least].load + BALANCE_ABS)
        best = max(
            (i for i in range(n) if cands[i].load <= limit),
            key=lambda i: (cands[i].score, -cands[i].load, -rotation(i)),
        )
        return best if cands[best].score > max(0.0, CACHE_THRESHOLD * prompt_tokens) else least


class PrefixIndex:
    """The blocks one instance holds, per tier, as its KV events say (keys as bytes); and the
    blocks of prompts just sent to it, taken as on its device until :data:`PREDICTED_S` passed
    (their events come once they are computed: a conversation's next turn, sent at once, must
    not miss the blocks of the turn before for want of a poll)."""

    __slots__ = ("device", "host", "predicted")

    def __init__(self) -> None:
        self.device: set[bytes] = set()
        self.host: set[bytes] = set()
        self.predicted: dict[bytes, float] = {}

    def reset(self, device: Iterable[bytes] = (), host: Iterable[bytes] = ()) -> None:
        self.device, self.host = set(device), set(host)
        self.predicted = {}

    def predict(self, keys: Iterable[bytes], now: float) -> None:
        """``keys`` were sent to this instance at ``now`` (monotonic seconds)."""
        if len(self.predicted) > PREDICTED_MAX:
            self.predicted = {k: t for k, t in self.predicted.items() if now - t < PREDICTED_S}
        for k in keys:
            self.predicted[k] = now

    def apply(self, kind: str, tier: str, key: bytes) -> None:
        s = self.device if tier == "device" else self.host
        if kind == "stored":
            s.add(key)
        else:
            s.discard(key)

    def overlap(self, keys: Sequence[bytes], now: float = 0.0) -> tuple[int, int]:
        """(blocks, blocks of them not on the device) of the longest run of ``keys`` held (or
        predicted at most PREDICTED_S before ``now``)."""
        held = on_host = 0
        predicted = self.predicted
        for k in keys:
            if k in self.device:
                held += 1
            elif k in self.host:
                held += 1
                on_host += 1
            elif now - predicted.get(k, -PREDICTED_S) < PREDICTED_S:
                held += 1
            else:
                break
        return held, on_host

    def candidate(self, keys: Sequence[bytes], block_size: int, load: int, now: float = 0.0, pooled: int = 0) -> Candidate:
        """``pooled``: how many leading ``keys`` the shared pool holds (those past what this
        instance holds count as its storage hits)."""
        held, on_host = self.overlap(keys, now)
        return Candidate((held - on_host) * block_size, on_host * block_size, load, max(0, pooled - held) * block_size)
