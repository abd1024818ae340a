"""Prometheus metrics of one server (DESIGN §6 names), in a registry of its own.

TTFT (from a request's arrival at the server) and its stages (``kvtier_request_stage_seconds``)
are counted as a request's first token is written; the other per-request figures (tokens, cached
tokens by tier, inter-token latency, PD hand-off results) as requests end, however they end:
``kvtier_requests_total{finish_reason}`` has ``stop`` / ``length`` / ``abort`` (the client went
away; its tokens so far are counted) / ``error`` / ``prefill`` (P's half of a hand-off). The
cache's own counters (bytes moved, evictions, storage failures), the blocks of each tier
(``kvtier_tier_blocks{tier,state}``), the copies not landed yet (``kvtier_copies_pending``) and
the queue gauges are read from a snapshot the engine thread takes at scrape time. The HTTP side's
bounds (serve/guard.py: refusals, timeouts, throttles, connections open) come from
:class:`ConnectionCollector`, in the server's registry and in the router's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from kvtier.engine.wire import FirstTokenStages
    from kvtier.serve.guard import Guard

# kvtier_request_stage_seconds' stages, in a request's order: they add up to its TTFT
STAGES = ("parse_and_tokenize", "queue", "prefetch", "prefill", "first_token_out")

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class _CacheCollector:
    """Cache counters from the last ``cache_stats()`` snapshot (taken on the engine thread)."""

    def __init__(self) -> None:
        self.stats: dict | None = None

    def collect(self):
        s = self.stats
        moved = CounterMetricFamily("kvtier_bytes_moved", "KV bytes moved between tiers", labels=["direction"])
        evict = CounterMetricFamily("kvtier_evictions", "KV blocks evicted per tier", labels=["tier"])
        fail = CounterMetricFamily("kvtier_storage_failures", "failed block copies per operation", labels=["op"])
        blocks = GaugeMetricFamily(
            "kvtier_tier_blocks", "KV blocks of each tier: used (held by requests or cached) | free", labels=["tier", "state"]
        )
        pending = GaugeMetricFamily(
            "kvtier_copies_pending", "copies between tiers planned and not landed yet (loads, backups, fetches, puts)"
        )
        if s is not None:
            pending.add_metric([], s.get("pending_ops", 0))
            for tier, n in s["tier_blocks"].items():
                blocks.add_metric([tier, "used"], n["used"])
                blocks.add_metric([tier, "free"], n["total"] - n["used"])
            for direction, v in s["bytes_moved"].items():
                moved.add_metric([direction], v)
            for tier in ("device", "host", "storage"):
                evict.add_metric([tier], s["evictions"].get(tier, 0))
            for op, v in s["failures"].items():
                fail.add_metric([op], v)
        yield moved
        yield evict
        yield fail
        yield blocks
        yield pending


class ConnectionCollector:
    """A guard's counters (serve/guard.py), read at scrape time::

    kvtier_http_refused_total{reason}    client_limit (429) | server_limit (503) | header_timeout
                                         | body_timeout (408, or closed once its answer started)
    kvtier_http_throttled_total{reason}  a connection left unread while its address was over
                                         --cheap-request-rate, by its last cheap answer: health | unauthorized
    kvtier_http_connections              connections open (admitted)
    kvtier_http_connections_limit        --max-connections as the open-file limit leaves it
    """

    def __init__(self, guard: Guard) -> None:
        self.guard = guard

    def collect(self):
        g = self.guard
        refused = CounterMetricFamily(
            "kvtier_http_refused",
            "connections refused (client_limit 429, server_limit 503) or closed on a timeout (header_timeout, body_timeout)",
            labels=["reason"],
        )
        for reason, n in g.refused.items():
            refused.add_metric([reason], n)
        throttled = CounterMetricFamily(
            "kvtier_http_throttled",
            "connections not read for a while: their address was over --cheap-request-rate (by its last cheap answer)",
            labels=["reason"],
        )
        for reason, n in g.throttled.items():
            throttled.add_metric([reason], n)
        yield refused
        yield throttled
        yield GaugeMetricFamily("kvtier_http_connections", "HTTP connections open", value=g.connections)
        yield GaugeMetricFamily(
            "kvtier_http_connections_limit", "the most HTTP connections open at once (--max-connections)", value=g.max_connections
        )


class ServerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.prompt_tokens = Counter("kvtier_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("kvtier_generation_tokens", "tokens generated", registry=r)
        self.cached_tokens = Counter("kvtier_cached_tokens", "prompt tokens served from cache, per tier", ["tier"], registry=r)
        self.running = Gauge("kvtier_requests_running", "requests in the running batch", registry=r)
        self.waiting = Gauge("kvtier_requests_waiting", "requests waiting for admission", registry=r)
        self.ttft = Histogram(
            "kvtier_time_to_first_token_seconds",
            "a request's arrival at the server (its HTTP request received) to its first token written to the "
            "response (streaming: the first chunk with a token; else the first token back from the engine): "
            "parsing, tokenization, the hops to the engine and back and the engine's time, as clients see it",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.stages = Histogram(
            "kvtier_request_stage_seconds",
            "where a request's time to first token went, by stage: parse_and_tokenize (arrival to the request "
            "sent to the engine) | queue (the engine taking it to its admission, or to its storage prefetch) | "
            "prefetch (its storage prefetch's start to its admission) | prefill (admission to its first token "
            "sampled) | first_token_out (the rest: the hops to the engine and back, detokenization, the write)",
            ["stage"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "kvtier_inter_token_latency_seconds", "time between tokens of a request", buckets=_ITL_BUCKETS, registry=r
        )
        self.handoffs = Counter(
            "kvtier_pd_handoffs", "PD hand-offs served (decode side): ok | recomputed | error", ["result"], registry=r
        )
        self.export = Histogram(
            "kvtier_pd_export_seconds",
            "P of a PD hand-off: first token to the pool's "
            "ack of every block of the prompt, or to the export's timeout (P answers "
            "then)",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.requests = Counter("kvtier_requests", "finished requests by finish reason", ["finish_reason"], registry=r)
        for tier in ("device", "host", "storage"):
            self.cached_tokens.labels(tier)
        for result in ("ok", "recomputed", "error"):
            self.handoffs.labels(result)
        for stage in STAGES:
            self.stages.labels(stage)
        self._cache = _CacheCollector()
        r.register(self._cache)

    def watch_connections(self, guard: Guard) -> None:
        """Scrapes show ``guard``'s counters too (the HTTP process's connections)."""
        self.registry.register(ConnectionCollector(guard))

    def first_token(self, arrival: float, sent: float, written: float, stages: FirstTokenStages | None) -> None:
        """A request's first token written: TTFT and its stages. ``arrival``, ``sent`` (the request
        handed to the engine) and ``written``: this process's monotonic times; ``stages``: the
        engine's durations (its own clock), None if it sent none. ``first_token_out`` is what is
        left of TTFT once the others are taken (so the stages add up to it): the hop to the engine
        (and its wait for the step in progress, as it takes requests between steps), the first
        token's way back, its detokenization and its write."""
        self.ttft.observe(written - arrival)
        self.stages.labels("parse_and_tokenize").observe(max(0.0, sent - arrival))
        if stages is None:
            return
        self.stages.labels("queue").observe(stages.queue)
        if stages.prefetch is not None:
            self.stages.labels("prefetch").observe(stages.prefetch)
        self.stages.labels("prefill").observe(stages.prefill)
        engine = stages.queue + (stages.prefetch or 0.0) + stages.prefill
        self.stages.labels("first_token_out").observe(max(0.0, written - sent - engine))

    def finished(self, finish_reason: str, num_prompt_tokens: int, num_generated_tokens: int, output=None) -> None:
        """One request ended; ``output``: the engine's final output, None if it had none (aborted,
        or cut by a stop string)."""
        self.requests.labels(finish_reason).inc()
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(num_generated_tokens)
        if output is None:
            return
        for tier, n in output.cached_tokens_by_tier.items():
            self.cached_tokens.labels(tier).inc(n)
        if output.handoff is not None and "result" in output.handoff:
            self.handoffs.labels(output.handoff["result"]).inc()

    def render(self, cache_stats: dict, running: int, waiting: int) -> bytes:
        self._cache.stats = cache_stats
        self.running.set(running)
        self.waiting.set(waiting)
        return generate_latest(self.registry)
