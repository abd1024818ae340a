"""Fetch-vs-recompute: is bringing a run of blocks from storage faster than recomputing them?

SGLang users report storage hits slower than recompute (an 8K prompt: 2.45 s fetched vs 1.73 s
recomputed) because nothing weighs one against the other. Here both sides are measured online:

* fetch: every storage read call reports ``(bytes, seconds)``; a least-squares fit with
  exponential forgetting gives the latency of a call (``seconds = latency + bytes / bandwidth``).
  Calls run on several worker threads at once, but they share one pool and one link: what a run
  of ``n`` objects costs is set by the *aggregate* rate, measured over the periods in which reads
  were in flight (``bytes / busy seconds``). A run costs ``latency + n * object_bytes / rate``;
* recompute: the engine reports ``(tokens, seconds)`` of its prefill steps: a prefill rate.

Until a side has been measured it uses the backend's prior (below) or, for the prefill rate,
"fetching pays" — a first request should not be refused its hits on a guess.

A decision picks the number of leading storage blocks to fetch, ``k`` in ``{n, n/2, n/4, …, 0}``,
maximising the time saved ``recompute(k) - fetch(k)``: all, a leading part (a partial run), or
nothing. A "nothing" measures nothing, so a pool that was slow once would be refused forever:
after ``explore_every`` refusals in a row, one run is fetched anyway (counted as ``explore``) to
measure the pool again. ``storage_fetch="always"`` (``always=True``) fetches every hit; the estimates still serve
the ``best_effort`` prefetch policy (how long a fetch should take).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

# latency (s), bandwidth (bytes/s) of one call before anything is measured
PRIORS = {
    "memory": (20e-6, 4e9),
    "file": (200e-6, 1.5e9),
    "redis": (500e-6, 1e9),
    "rediss": (800e-6, 0.6e9),
    "redis+cluster": (600e-6, 1e9),
    "mooncake": (1e-3, 1e9),
}


@dataclass(slots=True)
class _Fit:
    """Weighted least squares of y = a + b x with forgetting factor ``decay``."""

    decay: float = 0.95
    w: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def add(self, x: float, y: float) -> None:
        d = self.decay
        self.w = self.w * d + 1
        self.sx = self.sx * d + x
        self.sy = self.sy * d + y
        self.sxx = self.sxx * d + x * x
        self.sxy = self.sxy * d + x * y

    def line(self) -> tuple[float, float] | None:
        """(a, b), or None with too little data."""
        if self.w < 1:
            return None
        mx, my = self.sx / self.w, self.sy / self.w
        var = self.sxx / self.w - mx * mx
        if var <= (1e-3 * mx) ** 2 or var <= 0:  # all one size: no slope from the data
            return None
        b = (self.sxy / self.w - mx * my) / var
        return my - b * mx, b


@dataclass
class FetchCostModel:
    scheme: str = "memory"
    workers: int = 4
    batch: int = 16
    block_nbytes: int = 0  # one stored object
    block_size: int = 16
    prior: tuple[float, float] | None = None  # (latency s, bandwidth bytes/s); None: PRIORS[scheme]
    always: bool = False  # fetch every hit (no decision)
    explore_every: int = 16  # refusals in a row before one fetch re-measures the pool
    _refused_in_a_row: int = 0
    _fit: _Fit = field(default_factory=_Fit)
    _mean_bytes_per_s: float = 0.0  # bytes / s through one call, when sizes do not vary
    _busy_bytes: float = 0.0  # decayed sums over busy periods (reads in flight): a big fetch
    _busy_seconds: float = 0.0  # weighs more than a small one (bytes-weighted rate)
    _prefill_tokens: float = 0.0  # decayed sums over prefill steps (token-weighted rate)
    _prefill_seconds: float = 0.0
    _prefill_tokens_per_s: float = 0.0
    decisions: dict[str, int] = field(default_factory=lambda: {"fetch": 0, "partial": 0, "recompute": 0, "explore": 0})
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    # ------------------------------------------------------------------ measurements
    def observe_fetch(self, nbytes: int, seconds: float) -> None:
        """One storage read call moved ``nbytes`` in ``seconds`` (worker threads call this)."""
        if nbytes <= 0 or seconds <= 0:
            return
        with self._lock:
            self._fit.add(float(nbytes), seconds)
            rate = nbytes / seconds
            self._mean_bytes_per_s = rate if not self._mean_bytes_per_s else 0.8 * self._mean_bytes_per_s + 0.2 * rate

    def observe_busy(self, nbytes: int, seconds: float) -> None:
        """Reads in flight for ``seconds`` (wall clock, any number of calls at once) moved ``nbytes``."""
        if nbytes <= 0 or seconds <= 0:
            return
        with self._lock:
            self._busy_bytes = self._busy_bytes * 0.8 + nbytes
            self._busy_seconds = self._busy_seconds * 0.8 + seconds

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """A forward computed ``num_tokens`` prompt tokens in ``seconds``."""
        if num_tokens <= 0 or seconds <= 0:
            return
        self._prefill_tokens = self._prefill_tokens * 0.8 + num_tokens
        self._prefill_seconds = self._prefill_seconds * 0.8 + seconds
        self._prefill_tokens_per_s = self._prefill_tokens / self._prefill_seconds

    # ------------------------------------------------------------------ estimates
    def call_model(self) -> tuple[float, float]:
        """(latency s, bandwidth bytes/s) of one read call."""
        with self._lock:
            line = self._fit.line()
            mean_rate = self._mean_bytes_per_s
        lat0, bw0 = self.prior or PRIORS.get(self.scheme, (1e-3, 1e9))
        if line is not None and line[1] > 0:
            return max(0.0, line[0]), 1.0 / line[1]
        if mean_rate > 0:
            return 0.0, mean_rate  # sizes never varied: the mean rate includes latency
        return lat0, bw0

    @property
    def aggregate_bytes_per_s(self) -> float:
        with self._lock:
            return self._busy_bytes / self._busy_seconds if self._busy_seconds > 0 else 0.0

    def fetch_seconds(self, num_blocks: int) -> float:
        """Expected wall time to fetch ``num_blocks`` objects."""
        if num_blocks <= 0:
            return 0.0
        lat, bw = self.call_model()
        aggregate = self.aggregate_bytes_per_s
        if aggregate > 0:
            return lat + num_blocks * self.block_nbytes / aggregate
        # nothing measured in flight yet: calls in parallel, each at the per-call rate
        per_call = min(num_blocks, self.batch)
        rounds = math.ceil(num_blocks / (self.batch * self.workers))
        return rounds * (lat + per_call * self.block_nbytes / bw)

    def recompute_seconds(self, num_blocks: int) -> float | None:
        """None until a prefill rate has been measured."""
        rate = self._prefill_tokens_per_s
        return num_blocks * self.block_size / rate if rate > 0 else None

    def blocks_to_fetch(self, num_blocks: int) -> int:
        """How many of ``num_blocks`` leading storage hits to fetch (counted as a decision)."""
        if num_blocks <= 0:
            return 0
        best_k, best_gain = num_blocks, None
        if not self.always and self.recompute_seconds(1) is not None:
            best_k, best_gain = 0, 0.0
            k = num_blocks
            while k >= 1:
                recompute = self.recompute_seconds(k)
                assert recompute is not None  # a prefill rate is known (above)
                gain = recompute - self.fetch_seconds(k)
                if gain > best_gain:
                    best_k, best_gain = k, gain
                k //= 2
        kind = "fetch" if best_k == num_blocks else "partial" if best_k else "recompute"
        if kind == "recompute":
            self._refused_in_a_row += 1
            if self._refused_in_a_row > self.explore_every:
                self._refused_in_a_row = 0
                best_k, kind = num_blocks, "explore"
        else:
            self._refused_in_a_row = 0
        self.decisions[kind] += 1
        return best_k

    def as_dict(self) -> dict:
        lat, bw = self.call_model()
        return {
            "decisions": dict(self.decisions),
            "call_latency_s": lat,
            "call_bandwidth_gbps": bw / 1e9,
            "aggregate_gbps": self.aggregate_bytes_per_s / 1e9,
            "prefill_tokens_per_s": self._prefill_tokens_per_s,
        }
