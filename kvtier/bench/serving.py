"""What the serving benchmarks share (``kvtier bench multiturn|longdoc|trace``): a server to send
to, streaming requests with their timings, statistics, and one driver for ``--compare``.

::

    --url URL (any OpenAI-compatible server: kvtier, vLLM, SGLang)    or   a kvtier server this
                                                                          bench starts (its own
    workload (the bench's): requests, each at its time, ───────────►      process, 127.0.0.1),
      at most --max-parallel in flight, streamed                          once per --compare config
    per request: TTFT (first content chunk), inter-token gaps, output tokens, cached prompt
      tokens (``usage.prompt_tokens_details.cached_tokens``); per tier from kvtier's /metrics,
      and the server's own TTFT with its stages (``server_ttft``: kvtier servers only)
    ─► table (ratios to the first config), --json PATH, --plot PATH.png

Prompts are token ids (``"prompt": [ids]`` on ``/v1/completions``, which kvtier, vLLM and SGLang
take), so no tokenizer is needed and prompts share exactly the prefixes the workload says. Greedy,
``ignore_eos``: every request generates its ``max_tokens``.

Checks, per configuration: every answer's token ids against the first configuration's answer to
the same request ((group, round) names one; a workload's prompts depend on nothing but its seed
and earlier answers, so equal answers make equal prompts): ``identical``, ``mismatches`` and the
first few, ``unknown`` (a failed request, or a server that returns no token ids: never counted as
identical); ``http_5xx`` apart from the other failures; ``deaths``, each started process that
exited by the end of the workload, with its log's tail. ``--expect-identical`` makes any of these
an exit with the first one named. The PD configuration's prefill and decode servers run on
``--prefill-device`` and ``--decode-device`` (each default ``--device``).

Never a misleading figure: before anything is sent, the workload's longest request must fit the
served model's ``max_model_len`` (``GET /v1/models``; a started server's: ``--max-model-len`` or
the model's config), and token ids are drawn below the served vocabulary (``vocab_size`` in
``/v1/models``, else ``--tokenizer``'s length, else ``--vocab``: never a guess). A failed request
counts in no mean, and a round without an answer is a gap in the plot, not 0 ms. A configuration
with failed requests (timed or warm-up) or a server that died prints its first errors to stderr
and makes the bench exit 1 (``--allow-failures``: exit 0, the errors still printed).

Over 600 lines: it is the one driver the three benches share: the started servers
(:class:`Server`), the HTTP client, the statistics, the checks, the table and the plot.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator

from kvtier.serve.route import POLICIES

# kvtier serve flags per --compare configuration (the device and host sizes come from the bench);
# pd: a prefill and a decode server (each the storage configuration) behind `kvtier router`
# cache_aware, least_load, round_robin: --instances servers (each the host configuration) behind
# `kvtier router --workers --policy` of that name
POLICY_CONFIGS = POLICIES
CONFIGS = ("recompute", "device", "host", "storage", "pd", *POLICY_CONFIGS)


@dataclass
class Record:
    """One request as the client saw it."""

    group: int  # the client (multiturn), the document (longdoc), the request (trace)
    round: int  # (group, round) names one request of a workload
    prompt_tokens: int
    max_tokens: int
    start: float = 0.0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    end: float = 0.0
    output_tokens: int = 0
    output_ids: list[int] | None = None
    cached_tokens: int | None = None
    prompt_ids: list[int] | None = None  # what was sent (a fleet's prediction replays it)
    status: int | None = None  # the HTTP status (an error inside the stream: its code); None: no answer
    error: str | None = None


def devices(args: Any) -> dict[str, str]:
    """The started servers' ``--device`` by role: a colocated configuration's ``server`` runs on
    --device; PD's ``prefill`` and ``decode`` on --prefill-device and --decode-device (default --device)."""
    return {"server": args.device, "prefill": args.prefill_device or args.device, "decode": args.decode_device or args.device}


def base_url(url: str) -> str:
    """The server's root, where ``/v1/...``, ``/metrics`` and ``/health`` go: ``url`` without a
    trailing ``/`` or ``/v1`` (the base URL the ``openai`` client takes)."""
    root = url.strip().rstrip("/")
    if root.endswith("/v1"):
        root = root[: -len("/v1")].rstrip("/")
    if not re.fullmatch(r"https?://[^/\s]+(/\S*)?", root):
        raise SystemExit(f"--url {url!r}: give the server's http:// or https:// URL, e.g. http://127.0.0.1:8000/v1")
    return root


def model_entry(url: str) -> dict:
    """The first model of ``url``'s ``GET /v1/models`` (its ``id``, and where the server says
    them its ``max_model_len`` and ``vocab_size``); an error naming the URL and what came back
    if it is not an OpenAI model list."""
    import httpx

    where = f"{url}/v1/models"
    try:
        r = httpx.get(where, timeout=30)
    except httpx.HTTPError as e:
        raise SystemExit(f"{where}: no answer ({e!r}); is an OpenAI-compatible server running there?") from None
    try:
        body = r.json()
    except ValueError:
        body = None
    data = body.get("data") if isinstance(body, dict) else None
    if r.status_code != 200 or not isinstance(data, list) or not data or not isinstance(data[0], dict) or "id" not in data[0]:
        raise SystemExit(
            f"{where} answered HTTP {r.status_code} with {r.text[:300]!r}, not an OpenAI model list (a "
            f"'data' list of models, each with its 'id'); give --url the server's base URL, e.g. http://127.0.0.1:8000/v1"
        )
    return data[0]


def said_int(entry: dict, key: str) -> int | None:
    """``entry[key]`` if it is a positive int (what a server says of its model), else None."""
    value = entry.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


class Server:
    """Where the requests go: ``url`` as given, or a kvtier server started with ``flags``, or
    with ``pd`` a prefill and a decode server started with ``flags`` (which name their pool)
    behind a router (the requests go to the router; cached tokens are the prefill server's, and
    the warm-up settles on both servers). Each server gets ``--device devices[role]`` (role
    ``server``, ``prefill`` or ``decode``; none: the server's default) and runs with ``env``
    (None: this process's)."""

    def __init__(
        self,
        url: str | None,
        model: str | None,
        flags: list[str],
        log_dir: Path,
        pd: bool = False,
        name: str = "server",
        log_level: str = "warning",
        devices: dict[str, str] | None = None,
        env: dict[str, str] | None = None,
        instances: int = 0,
        policy: str | None = None,
    ) -> None:
        self.model, self.flags, self.log_dir, self.pd = model, flags, log_dir, pd
        # a fleet: ``instances`` servers behind `kvtier router --workers --policy policy`
        self.instances, self.policy = instances, policy
        self.config, self.log_level, self.devices, self.env = name, log_level, devices or {}, env
        self.url = base_url(url) if url is not None else None
        self.procs: dict[str, Any] = {}  # role (server, prefill, decode, router) -> ServerProcess
        self.metric_urls: list[str] = []  # kvtier servers whose /metrics count (the first: cached tokens)
        self.token_ids = True  # does it take return_token_ids (kvtier, recent vLLM)?
        # what its /v1/models says (None: not said)
        self.name = ""
        self.max_model_len: int | None = None
        self.vocab_size: int | None = None

    def __enter__(self) -> "Server":
        try:
            if self.url is None:
                self.start()
            else:
                self.metric_urls = [self.url]
            assert self.url is not None  # (started above)
            entry = model_entry(self.url)
            self.name = entry["id"]
            self.max_model_len, self.vocab_size = said_int(entry, "max_model_len"), said_int(entry, "vocab_size")
        except BaseException:
            self.__exit__()
            raise
        return self

    def command(self, role: str, instance: int = 0) -> list[str]:
        """The ``kvtier`` arguments of the ``server``, ``prefill`` or ``decode`` server (of a
        fleet: the ``instance``-th server, on GPU N+instance when --device is cuda[:N])."""
        if self.model is None:
            raise ValueError("give --model (a checkpoint or preset to serve) or --url (a running server)")
        device = ["--device", self.devices[role]] if role in self.devices else []
        if self.policy is not None and device and device[1].startswith("cuda"):
            first = int(device[1].partition(":")[2] or 0)
            device = ["--device", f"cuda:{first + instance}"]
        # D loads what P handed off whatever its cost model says (as `kvtier bench pd`'s D does)
        extra = {"server": [], "prefill": ["--role", "prefill"], "decode": ["--role", "decode", "--storage-fetch", "always"]}[
            role
        ]
        return ["serve", self.model, *device, *self.flags, *extra]

    def start(self) -> None:
        """Start the servers of ``model`` (PD: P, D and their router; a fleet: its servers and
        their router) and wait until each is ready; :attr:`url` is then where requests go.
        Entering the ``with`` block does it when no ``url`` was given."""
        from kvtier.serve.launch import ServerProcess

        def launch(args: list[str], role: str) -> Any:
            what = "" if role == "server" else f"-{role}"
            log, k = self.log_dir / f"{self.config}{what}.log", 1
            while log.exists():  # a kept --log-dir used again: a file per server
                k += 1
                log = self.log_dir / f"{self.config}{what}-{k}.log"
            proc = ServerProcess(args, log, env=self.env, log_level=self.log_level)
            self.procs[role] = proc
            return proc

        if self.policy is not None:
            servers = [launch(self.command("server", i), f"server{i}") for i in range(self.instances)]
            for s in servers:
                s.wait_ready()
            self.metric_urls = [s.url for s in servers]
            workers = ",".join(self.metric_urls)
            self.url = launch(["router", "--workers", workers, "--policy", self.policy], "router").wait_ready().url
            return
        if not self.pd:
            self.url = launch(self.command("server"), "server").wait_ready().url
            self.metric_urls = [self.url]
            return
        p = launch(self.command("prefill"), "prefill")
        d = launch(self.command("decode"), "decode")
        p.wait_ready(), d.wait_ready()
        self.url = launch(["router", "--prefill", p.url, "--decode", d.url], "router").wait_ready().url
        self.metric_urls = [p.url, d.url]

    def __exit__(self, *exc: object) -> None:
        for proc in reversed(self.procs.values()):
            proc.stop()
        if self.procs:
            self.procs, self.url = {}, None

    def deaths(self) -> list[dict]:
        """Each started process that has exited (an engine death, or the router's): its role,
        exit code, log and the log's last lines."""
        return [
            {"role": role, "returncode": proc.popen.returncode, "log": str(proc.log), "tail": proc.tail()}
            for role, proc in self.procs.items()
            if proc.popen.poll() is not None
        ]

    def metrics(self) -> dict[str, float]:
        """kvtier's cached prompt tokens per tier so far (empty for other servers): the server's,
        PD's prefill server's, or a fleet's sum."""
        urls = self.metric_urls if self.policy is not None else self.metric_urls[:1]
        return {k: v for k, v in self._scrape(urls).items() if k != "pending"}

    def ttft_stages(self) -> dict[str, tuple[float, float]]:
        """The server's TTFT histogram (``ttft``) and each stage of it (``kvtier_request_stage_seconds``)
        so far, as (sum, count) summed over the servers :meth:`metrics` reads (PD: the prefill
        server's, whose first token the router streams); empty if not kvtier."""
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        urls = self.metric_urls if self.policy is not None else self.metric_urls[:1]
        out: dict[str, tuple[float, float]] = {}
        for url in urls:
            try:
                text = httpx.get(url.rstrip("/") + "/metrics", timeout=10).text
                fams = list(text_string_to_metric_families(text))
            except Exception:  # not kvtier, or no metrics
                continue
            for fam in fams:
                if fam.name not in ("kvtier_time_to_first_token_seconds", "kvtier_request_stage_seconds"):
                    continue
                for smp in fam.samples:
                    kind = smp.name.rsplit("_", 1)[-1]
                    if kind not in ("sum", "count"):
                        continue
                    key = smp.labels.get("stage", "ttft")
                    total, n = out.get(key, (0.0, 0.0))
                    out[key] = (total + smp.value, n) if kind == "sum" else (total, n + smp.value)
        return out

    def _scrape(self, urls: list[str]) -> dict[str, float]:
        """Cached tokens per tier and ``pending`` (copies not landed), summed over ``urls``;
        empty if not kvtier. ``pending`` only if every server answered with it (a failed
        scrape of one must not read as its copies having landed)."""
        out: dict[str, float] = {}
        answered = 0
        for url in urls:
            got = self._scrape_one(url)
            answered += "pending" in got
            for k, v in got.items():
                out[k] = out.get(k, 0.0) + v
        if answered < len(urls):
            out.pop("pending", None)
        return out

    @staticmethod
    def _scrape_one(url: str) -> dict[str, float]:
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        try:
            text = httpx.get(url.rstrip("/") + "/metrics", timeout=10).text
            out = {}
            for fam in text_string_to_metric_families(text):
                if fam.name == "kvtier_cached_tokens":
                    for s in fam.samples:
                        if s.name.endswith("_total"):
                            out[s.labels["tier"]] = s.value
                elif fam.name == "kvtier_copies_pending" and fam.samples:
                    out["pending"] = fam.samples[0].value
            return out
        except Exception:  # not kvtier, or no metrics: per-tier counts are left out
            return {}

    def cache_stats(self) -> dict[str, dict]:
        """Each started kvtier server's ``/kvtier/stats`` (tiers, storage client, cost model), by
        role: ``server``, or ``prefill`` and ``decode``; empty for --url. A server that does not
        answer is left out."""
        import httpx

        if self.url is None or not self.procs:
            return {}
        roles = ["prefill", "decode"] if self.pd else [f"server{i}" for i in range(self.instances)] if self.policy else ["server"]
        out = {}
        for role, url in zip(roles, self.metric_urls):
            try:
                r = httpx.get(url.rstrip("/") + "/kvtier/stats", timeout=10)
                r.raise_for_status()
                out[role] = r.json()
            except (httpx.HTTPError, ValueError):
                pass
        return out

    def settle(self, timeout: float = 60.0) -> dict | None:
        """Wait until a kvtier server has no copy in flight (the warm-up's backups and puts to
        the pool must not run into the timed requests), at most ``timeout`` seconds: {"s":
        seconds waited, "settled": whether it got there}; None if not kvtier (no gauge)."""
        t0 = time.perf_counter()
        seen = False
        while True:
            pending = self._scrape(self.metric_urls).get("pending")
            if pending is None and not seen:
                return None
            seen = True
            waited = time.perf_counter() - t0
            if pending == 0 or waited > timeout:
                return {"s": waited, "settled": pending == 0}
            time.sleep(0.05)


async def send(client: Any, server: Server, rec: Record, prompt: list[int]) -> Record:
    """Stream one completion; fills ``rec``'s timings, tokens and cached tokens."""
    body = {
        "model": server.name,
        "prompt": prompt,
        "max_tokens": rec.max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    if server.token_ids:
        body["return_token_ids"] = True
    assert server.url is not None  # (a server entered)
    rec.prompt_ids = prompt
    rec.start = last = time.perf_counter()
    ids: list[int] = []
    try:
        async with client.stream("POST", server.url.rstrip("/") + "/v1/completions", json=body) as r:
            if r.status_code == 400 and server.token_ids:  # a server without return_token_ids
                await r.aread()
                server.token_ids = False
                return await send(client, server, rec, prompt)
            rec.status = r.status_code
            if r.status_code != 200:
                rec.error = f"HTTP {r.status_code}: {error_message(await r.aread())}"
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                err = chunk.get("error")
                if isinstance(err, dict):  # an error after the status line went out
                    rec.status = err["code"] if isinstance(err.get("code"), int) else 500
                    rec.error = f"HTTP {rec.status} in the stream: {str(err.get('message'))[:200]!r}"
                    break
                if usage := chunk.get("usage"):
                    rec.cached_tokens = cached_prompt_tokens(usage)
                for choice in chunk.get("choices") or ():
                    got = choice.get("token_ids") or []
                    if not (choice.get("text") or got):
                        continue
                    now = time.perf_counter()
                    if rec.ttft is None:
                        rec.ttft = now - rec.start
                    else:
                        rec.itl.append(now - last)
                    last = now
                    ids += got
                    rec.output_tokens += max(1, len(got))
    except Exception as e:  # counted as a failed request, the run goes on
        rec.error = repr(e)
    if rec.error is None and rec.ttft is None:
        rec.error = f"HTTP {rec.status}: the answer ended without a token"
    rec.end = time.perf_counter()
    rec.output_ids = ids if server.token_ids and len(ids) == rec.output_tokens else None
    return rec


def cached_prompt_tokens(usage: dict) -> int | None:
    """The prompt tokens a server found cached: ``usage.prompt_tokens_details.cached_tokens``;
    through kvtier's router, P's (``usage.kvtier.prefill``): D's count every handed-off token."""
    prefill = (usage.get("kvtier") or {}).get("prefill")
    if isinstance(prefill, dict) and "cached_tokens" in prefill:
        return prefill["cached_tokens"]
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens")


def error_message(body: bytes) -> str:
    """An error answer's message (OpenAI's ``{"error": {"message": ...}}``, or FastAPI's
    ``{"detail": ...}``), else its first bytes."""
    try:
        got = json.loads(body)
    except ValueError:
        return repr(body[:200])
    if isinstance(got, dict):
        err = got.get("error")
        msg = err.get("message") if isinstance(err, dict) else err if err is not None else got.get("detail")
        if msg is not None:
            return str(msg)[:200]
    return repr(body[:200])


def answer_ids(rec: Record, rng: random.Random, vocab: int) -> list[int]:
    """The answer's token ids as the server generated them (``return_token_ids``), or, from a
    server without them, as many stand-in ids (its cached answer then goes unused)."""
    if rec.output_ids is not None:
        return rec.output_ids
    return [rng.randrange(vocab) for _ in range(rec.output_tokens)]


class Arrivals:
    """Poisson arrivals at ``rate`` requests/s (``inf``: no wait), at most ``max_parallel`` in flight."""

    def __init__(self, rate: float, max_parallel: int, seed: int) -> None:
        if not rate > 0:
            raise ValueError(f"--request-rate must be > 0 (inf: no pacing), got {rate}")
        if max_parallel < 1:
            raise ValueError(f"--max-parallel must be >= 1, got {max_parallel}")
        self.rate, self.rng = rate, random.Random(seed)
        self.slots = asyncio.Semaphore(max_parallel)
        self._next = 0.0

    async def admit(self) -> None:
        """Wait for this request's arrival time and a free slot (release with ``slots``)."""
        if math.isfinite(self.rate):
            now = time.perf_counter()
            self._next = max(self._next, now) + self.rng.expovariate(self.rate)
            await asyncio.sleep(max(0.0, self._next - now))
        await self.slots.acquire()


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]


def http_5xx(records: list[Record]) -> int:
    return sum(1 for r in records if r.status is not None and r.status >= 500)


def summarize(records: list[Record], wall: float) -> dict:
    """The run's figures, of its answered requests only (a failed request is counted in
    ``failed``, never as a 0 in a mean)."""
    ok = [r for r in records if r.error is None and r.ttft is not None]
    ttft = [r.ttft for r in ok if r.ttft is not None]  # (every one of ok)
    itl = [g for r in ok for g in r.itl]
    rounds = sorted({r.round for r in records})
    by_round = {k: [r for r in ok if r.round == k] for k in rounds}

    def mean(xs: list[float]) -> float | None:
        return statistics.fmean(xs) if xs else None

    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    return {
        "requests": len(records),
        "failed": len(records) - len(ok),
        "http_5xx": http_5xx(records),
        "seconds": wall,
        "ttft_mean": mean(ttft),
        "ttft_p50": pct(ttft, 50),
        "ttft_p90": pct(ttft, 90),
        "ttft_p99": pct(ttft, 99),
        "itl_mean": mean(itl),
        "itl_p50": pct(itl, 50),
        "itl_p90": pct(itl, 90),
        "itl_p99": pct(itl, 99),
        "output_tokens_per_s": sum(r.output_tokens for r in ok) / wall if wall else None,
        "requests_per_s": len(ok) / wall if wall else None,
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "cached_tokens": sum(cached) if cached else None,
        # per round, of its answered requests (None: none answered, never a 0 that reads as a hit or a miss)
        "ttft_by_round": [mean([r.ttft for r in by_round[k] if r.ttft is not None]) for k in rounds],
        "cached_by_round": [sum(r.cached_tokens or 0 for r in by_round[k]) if by_round[k] else None for k in rounds],
        "prompt_by_round": [sum(r.prompt_tokens for r in by_round[k]) if by_round[k] else None for k in rounds],
        "failed_by_round": [sum(1 for r in records if r.round == k) - len(by_round[k]) for k in rounds],
        "ttfts": ttft,
    }


@contextlib.contextmanager
def progress(total: int, label: str, enabled: bool) -> Iterator[Callable[[], None]]:
    """A rich progress bar of ``total`` requests; yields the function to advance it by one."""
    if not enabled:
        yield lambda: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), transient=True
    ) as bar:
        task = bar.add_task(label, total=total)
        yield lambda: bar.advance(task)


def server_flags(config: str, args: Any, tmp: Path) -> list[str]:
    """kvtier serve flags of a --compare configuration: the bench's engine options
    (:data:`ENGINE_OPTIONS`) as an :class:`~kvtier.engine.config.EngineConfig` (checked now,
    before any server starts: a bad value is named here) with the configuration's tiers, then
    ``--server-args``; but the device: :class:`Server` gives each server its own (:func:`devices`)."""
    if config not in CONFIGS:
        raise ValueError(f"unknown configuration {config!r}; choose from {', '.join(CONFIGS)}")
    from dataclasses import replace

    from kvtier.engine.config import EngineConfig

    # the device is each server's own, the pool the storage configurations'; a preset's weights
    # are dummy (resolve_model said so), the rest auto
    base = EngineConfig.from_args(args, only=[n for n in ENGINE_OPTIONS if n not in ("device", "storage", "load_format")])
    base = replace(base, load_format=args.load_format or "auto")
    if config == "recompute":
        base = replace(base, enable_prefix_caching=False, num_host_blocks=0)
    elif config == "device":
        base = replace(base, num_host_blocks=0)
    elif config in ("storage", "pd"):  # (one pool each: no hit across)
        base = replace(base, storage=args.storage or f"file://{tmp}/pool-{config}")
    # (host, and each instance of a routed configuration: the host configuration)
    import shlex

    return base.to_flags() + shlex.split(args.server_args or "")


# The engine options of the servers a bench starts, as `kvtier serve` takes them (EngineConfig.add_flags)
ENGINE_OPTIONS = (
    "device",
    "tensor_parallel_size",
    "dtype",
    "kv_cache_dtype",
    "load_format",
    "block_size",
    "num_device_blocks",
    "num_host_blocks",
    "storage",
    "max_model_len",
    "max_num_batched_tokens",
)


def add_common_flags(ap: Any, compare: bool = True) -> None:
    """The flags of every serving bench; ``compare=False`` leaves out those of the --compare
    driver (--url, --compare, --plot, --expect-identical) for a bench that picks its own."""
    from kvtier.flags import non_negative_int, positive_int

    if compare:
        ap.add_argument(
            "--url",
            default=None,
            help="an OpenAI-compatible server to measure, its base URL with or without /v1, e.g. "
            "http://127.0.0.1:8000/v1 (default: start kvtier servers, one per --compare configuration)",
        )
        ap.add_argument(
            "--tokenizer",
            default=None,
            metavar="NAME_OR_PATH",
            help="with --url: the served model's Hugging Face tokenizer (hub id or directory); token ids "
            "are drawn below its length, for a server whose /v1/models does not say vocab_size (vLLM, SGLang)",
        )
        ap.add_argument(
            "--allow-failures",
            action="store_true",
            help="exit 0 even if requests failed or a started server died (they are still printed to "
            "stderr, and left out of every figure); default: exit 1, naming the configuration",
        )
        ap.add_argument(
            "--compare",
            default="host",
            help="comma-separated configurations of the started server, "
            "the first the baseline of the ratios and of the answers: recompute, device (prefix cache "
            "on the GPU only), host (+ host tier), storage (+ file:// pool, or --storage URL), pd (a "
            "prefill and a decode server, each the storage configuration, behind kvtier router), "
            "cache_aware, least_load, round_robin (--instances servers, each the host configuration, "
            "behind kvtier router --workers --policy of that name) (default host)",
        )
        ap.add_argument(
            "--instances",
            type=positive_int,
            default=2,
            help="servers of a cache_aware, least_load or round_robin configuration; with --device "
            "cuda[:N], one per GPU from N (default 2)",
        )
        ap.add_argument(
            "--expect-identical",
            action="store_true",
            help="exit non-zero, naming the first, if any configuration's answer (token ids) differs "
            "from the first configuration's, has no token ids, or any request failed or server died",
        )
        ap.add_argument("--plot", default=None, metavar="PATH.png", help="plot TTFT per round and its CDF here")
    ap.add_argument(
        "--model",
        default=None,
        help="what the started kvtier server serves: a checkpoint directory, a Hugging Face hub id, or a "
        "preset name (written to a temporary folder)",
    )
    from kvtier.engine.config import EngineConfig

    EngineConfig.add_flags(
        ap.add_argument_group("the started servers' engine options (as kvtier serve's)"),
        only=ENGINE_OPTIONS,
        # a host tier large enough for the workloads' histories in the host, storage and pd
        # configurations (recompute and device have none); a preset has no weights to load,
        # and each storage configuration gets a pool of its own
        defaults={"num_host_blocks": 4096, "load_format": None},
        shown={"load_format": "auto; presets: dummy", "storage": "a temporary file:// pool per configuration"},
    )
    ap.add_argument(
        "--prefill-device",
        default=None,
        metavar="DEV",
        help="the pd configuration's prefill server's device, e.g. cuda:0 (default --device)",
    )
    ap.add_argument(
        "--decode-device",
        default=None,
        metavar="DEV",
        help="the pd configuration's decode server's device, e.g. cuda:1 (default --device)",
    )
    ap.add_argument(
        "--server-args",
        default=None,
        metavar="'FLAGS'",
        help="more `kvtier serve` flags for every started server, e.g. '--preemption-mode recompute'",
    )
    ap.add_argument(
        "--vocab",
        type=positive_int,
        default=None,
        help="token ids are drawn below this (default: the served model's vocab_size; with --url, "
        "as its /v1/models says it, else give --vocab or --tokenizer)",
    )
    ap.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    ap.add_argument("--json", default=None, metavar="PATH", help="write every result here")
    ap.add_argument(
        "--log-dir",
        default=None,
        metavar="DIR",
        help="keep the started servers' logs here, at info level: CONFIG.log (PD: "
        "pd-prefill.log, pd-decode.log, pd-router.log; a name already there gets -2, -3, ...), "
        "with each engine's stats line every "
        "10 s (--server-args '--log-stats-interval S' to change); default: a temporary "
        "directory, removed, warnings only",
    )
    ap.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    ap.add_argument(
        "--warmup",
        type=non_negative_int,
        default=None,
        metavar="N",
        help="untimed requests sent to each server first, in two waves of N at once (default: "
        "the bench's requests in flight at its start; 0: none)",
    )
    ap.add_argument(
        "--warmup-tokens",
        type=positive_int,
        default=None,
        metavar="N",
        help="prompt tokens of the first wave, twice that in the second (default: the bench's "
        "first prompts' length; at most half of --max-model-len)",
    )


def resolve_model(args: Any, tmp: Path) -> tuple[str, int]:
    """(the started server's model directory, the vocabulary token ids are drawn from: the
    model's, or --vocab if lower). For --url, :func:`resolve_url` asks the server."""
    if args.model is None:
        raise SystemExit("give --model (a checkpoint or preset to serve) or --url (a running server)")
    from kvtier.model import ModelConfig, init_model
    from kvtier.model.hub import is_hub_id
    from kvtier.model.hub import resolve_model as resolve_hub_model
    from kvtier.model.presets import PRESETS

    path = Path(args.model)
    if not path.exists() and args.model in PRESETS:
        args.load_format = args.load_format or "dummy"  # a preset: random weights from its config
        path = init_model(args.model, tmp / "model", config_only=args.load_format == "dummy")
    elif not path.exists() and is_hub_id(args.model):  # fetched once here; the servers get the directory
        try:
            path = resolve_hub_model(args.model, load_format=args.load_format or "auto")
        except FileNotFoundError as e:
            raise SystemExit(f"--model: {e} (presets: {', '.join(PRESETS)})") from None
    elif not path.exists():
        raise SystemExit(f"--model {args.model!r}: no such directory, preset ({', '.join(PRESETS)}) or hub id")
    vocab = ModelConfig.from_hf_dir(path).vocab_size
    return str(path), min(args.vocab or vocab, vocab)


def served_max_model_len(args: Any, model: str) -> int:
    """The started servers' context: --max-model-len, at most the model's (as the engine takes it)."""
    from kvtier.model import ModelConfig

    longest = ModelConfig.from_hf_dir(model).max_position_embeddings
    return min(args.max_model_len or longest, longest)


def resolve_url(args: Any) -> tuple[int, int | None]:
    """(the vocabulary token ids are drawn from, the model's max_model_len or None) of the
    --url server, as its ``/v1/models`` says them; the vocabulary from ``--tokenizer`` or
    ``--vocab`` where it does not say it (the lowest of those given), else an error."""
    url = base_url(args.url)
    entry = model_entry(url)
    bounds: dict[str, int] = {}
    if (said := said_int(entry, "vocab_size")) is not None:
        bounds[f"the vocab_size {url}/v1/models says"] = said
    if args.tokenizer:
        bounds[f"--tokenizer {args.tokenizer}"] = tokenizer_vocab(args.tokenizer)
    if not bounds and not args.vocab:
        raise SystemExit(
            f"{url}/v1/models does not say its model's vocabulary (vocab_size): pass --vocab N (token ids "
            f"are drawn below N) or --tokenizer NAME_OR_PATH (the served model's Hugging Face tokenizer)"
        )
    if args.vocab:
        for what, vocab in bounds.items():
            if args.vocab > vocab:
                print(f"--vocab {args.vocab} is over {what} ({vocab}): token ids are drawn below {vocab}", file=sys.stderr)
        bounds["--vocab"] = args.vocab
    max_model_len = said_int(entry, "max_model_len")
    if max_model_len is None:
        print(
            f"{url}/v1/models does not say its model's max_model_len: prompts are not checked against its context",
            file=sys.stderr,
        )
    return min(bounds.values()), max_model_len


def tokenizer_vocab(name: str) -> int:
    """len() of the Hugging Face tokenizer ``name`` (a hub id or a directory): every id below
    it is one of the model's."""
    try:
        from transformers import AutoTokenizer

        return len(AutoTokenizer.from_pretrained(name))
    except Exception as e:  # counted as a failed request, the run goes on
        raise SystemExit(f"--tokenizer {name!r}: cannot load it as a Hugging Face tokenizer ({e})") from None


@dataclass(frozen=True)
class Plan:
    """What a bench will send, its prompts known to fit the served context: its number of
    requests (the progress bar's total) and (requests in flight, prompt tokens) at its start
    (the warm-up's default shape)."""

    requests: int
    start: tuple[int, int]


Workload = Callable[[Server, Any, Callable[[], None]], Awaitable[list[Record]]]


def run(args: Any, name: str, workload: Workload, plan: Callable[[int | None], Plan]) -> dict:
    """Run ``workload`` once per configuration (or once against --url), each after a warm-up
    (:func:`_warmup`); compare every configuration's answers with the first's; print the table;
    write --json and --plot; print what failed to stderr and exit 1 (unless --allow-failures);
    with --expect-identical exit naming the first problem. ``plan(max_model_len)``, called
    before any server starts with the served context (None: the server does not say it), checks
    that the workload fits it (an error naming the sizes if not) and says its shape.

    Sets ``args.vocab`` (token ids are drawn below it) and ``args.served_max_model_len``."""
    started = time.perf_counter()
    configs = ["url"] if args.url else [c.strip() for c in args.compare.split(",") if c.strip()]
    if args.expect_identical and len(configs) < 2:
        raise SystemExit("--expect-identical compares configurations: give two or more in --compare")
    results: dict[str, dict] = {}
    records: dict[str, list[Record]] = {}
    with tempfile.TemporaryDirectory(prefix=f"kvtier-bench-{name}-") as tmp_name:
        tmp = Path(tmp_name)
        model: str | None = None
        if args.url is not None:
            args.vocab, args.served_max_model_len = resolve_url(args)
        else:
            model, args.vocab = resolve_model(args, tmp)
            args.served_max_model_len = served_max_model_len(args, model)
        shape = plan(args.served_max_model_len)
        log_dir = tmp
        if args.log_dir:  # kept: each server's log at info (its stats lines)
            log_dir = Path(args.log_dir)
            log_dir.mkdir(parents=True, exist_ok=True)
        for config in configs:
            flags = [] if args.url else server_flags(config, args, tmp)
            with contextlib.ExitStack() as stack:
                try:
                    server = stack.enter_context(
                        Server(
                            args.url,
                            model,
                            flags,
                            log_dir,
                            pd=config == "pd",
                            name=config,
                            log_level="info" if args.log_dir else "warning",
                            devices=devices(args),
                            instances=args.instances,
                            policy=config if config in POLICY_CONFIGS else None,
                        )
                    )
                except RuntimeError as e:  # ServerProcess.wait_ready: it exited, or is not ready
                    raise SystemExit(f"kvtier bench {name} [{config}]: the server did not start: {e}") from None
                res, records[config] = measure(args, server, f"{name} [{config}]", workload, shape.requests, shape.start)
                died = server.deaths()
            res["deaths"], res["died"] = len(died), died
            results[config] = res
    for config in configs[1:]:
        results[config].update(compare_outputs(records[configs[0]], records[config]))
    out = {"bench": name, "args": {k: v for k, v in vars(args).items() if k != "func"}, "results": results}
    print(table(results))
    for config, r in results.items():
        if r.get("predicted"):
            print(
                f"{config}: hit rate {r['hit_rate']:.3f} measured, {r['predicted']['hit_rate']:.3f} predicted by "
                f"kvtier sim --instances {args.instances} --route {config} on the same requests"
            )
    print(f"({time.perf_counter() - started:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    if args.plot:
        plot(results, args.plot, name)
    if report := failures(name, results):
        print("\n".join(report), file=sys.stderr)
    if args.expect_identical and (problem := first_problem(results)):
        raise SystemExit(f"--expect-identical: {problem}")
    if report and not args.allow_failures:
        bad = [c for c, r in results.items() if r["failed"] or r["warmup"]["failed"] or r.get("deaths")]
        raise SystemExit(
            f"kvtier bench {name}: {', '.join(bad)}: failed requests or a server that died (above); "
            f"the figures leave them out (--allow-failures: exit 0 all the same)"
        )
    return out


def failures(name: str, results: dict[str, dict]) -> list[str]:
    """What went wrong, per configuration: its failed requests (timed run and warm-up) with the
    first distinct errors, and each started server that died with its log's tail."""
    lines = []
    for config, r in results.items():
        label, warm = f"{name} [{config}]", r["warmup"]
        failed = [
            f"{n} of {total} {what}requests failed ({fivexx} with a 5xx)"
            for n, total, fivexx, what in (
                (r["failed"], r["requests"], r["http_5xx"], ""),
                (warm["failed"], warm["requests"], warm["http_5xx"], "warm-up "),
            )
            if n
        ]
        if failed:
            lines.append(f"{label}: {'; '.join(failed)}; the first errors:")
            lines += [f"  {e}" for e in r["errors"]] or ["  (none said)"]
        for d in r.get("died", []):
            lines.append(f"{label}: the {d['role']} server exited with {d['returncode']} ({d['log']}):\n{d['tail']}")
    return lines


def measure(
    args: Any, server: Server, label: str, workload: Workload, count: int, start: tuple[int, int]
) -> tuple[dict, list[Record]]:
    """``workload`` once on a started ``server`` after a warm-up (:func:`_warmup`, its copies
    settled): its summary (:func:`summarize`, the tiers' hits, the servers' stats, the errors,
    the warm-up's) and its records. ``label``: the progress bar's."""
    token_ids = server.token_ids  # a warm-up that fails must not flip the probe
    warm = asyncio.run(_with_client(_warmup(args, start), server, args, lambda: None))
    if any(r.error for r in warm):
        server.token_ids = token_ids
    settled = server.settle()
    before = server.metrics()
    stages_before = server.ttft_stages()
    with progress(count, label, args.progress) as tick:
        t0 = time.perf_counter()
        records = asyncio.run(_with_client(workload, server, args, tick))
        wall = time.perf_counter() - t0
    after = server.metrics()
    res = summarize(records, wall)
    res["server_stats"] = server.cache_stats()  # each kvtier server's /kvtier/stats at the end
    res["cached_tokens_by_tier"] = {t: after[t] - before.get(t, 0) for t in after}
    res["server_ttft"] = server_ttft(stages_before, server.ttft_stages())
    sent = sorted(warm + records, key=lambda r: r.start)
    res["errors"] = list(dict.fromkeys(r.error for r in sent if r.error))[:5]  # distinct, the first sent first
    if server.policy is not None and res["prompt_tokens"]:
        res["hit_rate"] = (res["cached_tokens"] or 0) / res["prompt_tokens"]
        res["predicted"] = predict_fleet(args, server, warm, records, res["server_stats"])
    res["warmup"] = {
        "requests": len(warm),
        "failed": sum(1 for r in warm if r.error),
        "http_5xx": http_5xx(warm),
        "settle": settled,
    }
    return res, records


def server_ttft(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict | None:
    """What a kvtier server measured of the requests between two :meth:`Server.ttft_stages`
    scrapes: its mean TTFT (from each request's arrival at the server) and the mean of each of
    its stages (``parse_and_tokenize``, ``queue``, ``prefetch``, ``prefill``, ``first_token_out``:
    docs/SERVING.md; None: no request went through it), in seconds, and how many requests had a
    first token (``count``); None for another server."""
    if "ttft" not in after:
        return None

    def mean(key: str) -> float | None:
        (total, n), (total0, n0) = after.get(key, (0.0, 0.0)), before.get(key, (0.0, 0.0))
        return (total - total0) / (n - n0) if n > n0 else None

    count = after["ttft"][1] - before.get("ttft", (0.0, 0.0))[1]
    stages = {k: mean(k) for k in after if k != "ttft"}
    return {"count": int(count), "ttft_mean_s": mean("ttft"), "stages_mean_s": stages}


def predict_fleet(args: Any, server: Server, warm: list[Record], records: list[Record], stats: dict) -> dict | None:
    """What ``kvtier sim --instances N --route POLICY`` predicts for the requests this fleet was
    just sent (the warm-up's, then the run's, in the order sent, with their answers), each
    instance with the tiers its /kvtier/stats says; None if no instance said them. The sim
    serves one request at a time; each instance holds the blocks of as many running requests
    as were in flight here at most, shared out over the instances."""
    from kvtier.bench.fleet import simulate_fleet
    from kvtier.bench.replay import SimConfig
    from kvtier.bench.traces import TraceRequest

    tiers = next(iter(stats.values()), None)
    if tiers is None or "blocks" not in tiers.get("device", {}):
        return None
    warm_ok = sorted((r for r in warm if r.error is None and r.prompt_ids), key=lambda r: r.start)
    run_ok = sorted((r for r in records if r.error is None and r.prompt_ids), key=lambda r: r.start)
    sent = warm_ok + run_ok
    if not run_ok:
        return None
    edges = sorted([(r.start, 1) for r in sent] + [(r.end, -1) for r in sent])
    inflight = most = 0
    for _, d in edges:
        inflight += d
        most = max(most, inflight)
    t0 = sent[0].start
    trace = [
        TraceRequest((r.start - t0) * 1e3, list(r.prompt_ids or ()), r.output_tokens, i, output_ids=r.output_ids)
        for i, r in enumerate(sent)
    ]
    cfg = SimConfig(
        block_size=args.block_size,
        device_blocks=tiers["device"]["blocks"],
        host_blocks=tiers["host"]["blocks"],
        max_running=max(1, -(-most // server.instances)),  # (per instance: the peak shared out)
    )
    sim = simulate_fleet(trace, cfg, server.instances, server.policy or "round_robin", baseline=False, warm=len(warm_ok))
    return {k: sim[k] for k in ("hit_rate", "hit_tokens", "max_load_vs_mean", "requests", "per_instance")}


def compare_outputs(base: list[Record], other: list[Record], keep: int = 5) -> dict:
    """``other``'s answers against ``base``'s, request by request ((group, round) names one):
    ``mismatches`` (token ids differ; the first ``keep`` with the first differing position),
    ``unknown`` (either failed, or has no token ids, or the request is missing on either side),
    ``identical`` (every answer compared, none differs) and ``compared``."""
    want = {(r.group, r.round): r for r in base}
    seen, compared, unknown, mismatches = set(), 0, 0, []
    for r in sorted(other, key=lambda r: (r.group, r.round)):
        key = (r.group, r.round)
        seen.add(key)
        b = want.get(key)
        if b is None or b.error or r.error or b.output_ids is None or r.output_ids is None:
            unknown += 1
            continue
        compared += 1
        if r.output_ids != b.output_ids:
            pos = next(
                (i for i, (x, y) in enumerate(zip(b.output_ids, r.output_ids)) if x != y),
                min(len(b.output_ids), len(r.output_ids)),
            )
            mismatches.append(
                {
                    "group": r.group,
                    "round": r.round,
                    "position": pos,
                    "expected": b.output_ids[pos : pos + 4],
                    "got": r.output_ids[pos : pos + 4],
                }
            )
    unknown += len(set(want) - seen)
    return {
        "identical": not mismatches and not unknown,
        "compared": compared,
        "mismatches": len(mismatches),
        "unknown": unknown,
        "first_mismatches": mismatches[:keep],
    }


def first_problem(results: dict[str, dict]) -> str | None:
    """What makes --expect-identical fail, the first configuration's first: a server that died,
    an answer that differs from the first configuration's, a failed request, an unknown answer."""
    base = next(iter(results))
    for config, r in results.items():
        if r.get("deaths"):
            d = r["died"][0]
            return f"{config}: the {d['role']} server exited with {d['returncode']} ({d['log']}):\n{d['tail']}"
        if r.get("mismatches"):
            m = r["first_mismatches"][0]
            return (
                f"{config}: {r['mismatches']} of {r['compared']} answers differ from {base}'s; the first: "
                f"group {m['group']} round {m['round']} at token {m['position']} "
                f"({m['got']} instead of {m['expected']})"
            )
        if r["failed"]:
            return (
                f"{config}: {r['failed']} of {r['requests']} requests failed ({r['http_5xx']} 5xx), e.g. "
                f"{(r['errors'] or ['?'])[0]}"
            )
        if r.get("unknown"):
            return f"{config}: {r['unknown']} answers could not be compared with {base}'s (no token ids, or failed)"
    return None


def warmup_shape(args: Any, start: tuple[int, int]) -> tuple[int, int]:
    """(requests per warm-up wave, their prompt tokens): --warmup / --warmup-tokens, else
    ``start``, what the bench starts with (requests in flight, prompt tokens)."""
    n, tokens = start
    return (n if args.warmup is None else args.warmup, tokens if args.warmup_tokens is None else args.warmup_tokens)


def _warmup(args: Any, start: tuple[int, int]) -> Workload:
    """Untimed requests before the timed run, in two waves of ``--warmup`` at once on random
    prompts: the bench's first requests' shape (``--warmup-tokens`` each), then twice as long
    (lengths a token apart, so kernels specialized on a length's divisibility are compiled too),
    at most half the served ``max_model_len``. A server's first requests pay one-time costs (Triton
    compiles kernels on first use and caches them on disk for the next server) that would
    otherwise land on the first configuration alone."""

    async def go(server: Server, client: Any, tick: Callable[[], None]) -> list[Record]:
        rng = random.Random(args.seed + 7919)
        context = server.max_model_len or args.max_model_len
        cap = max(1, context // 2) if context else None  # a 400 is no warm-up
        n, tokens = warmup_shape(args, start)
        recs = []
        for wave in ([tokens] * n, [2 * tokens + i for i in range(n)]):
            batch = [Record(-1, -1, min(k, cap) if cap else k, 4) for k in wave]
            recs += await asyncio.gather(
                *(send(client, server, r, [rng.randrange(args.vocab) for _ in range(r.prompt_tokens)]) for r in batch)
            )
        return recs

    return go


async def _with_client(workload: Workload, server: Server, args: Any, tick: Callable[[], None]) -> list[Record]:
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        return await workload(server, client, tick)


def table(results: dict[str, dict]) -> str:
    """One row per configuration; TTFT and throughput also as ratios to the first row; ``same``:
    its answers against the first row's (yes, N diff, N ? for unknown)."""
    base = next(iter(results.values()))

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1e3:.1f}"

    def ratio(x: float | None, b: float | None) -> str:
        return "-" if x is None or not b else f"{x / b:.2f}"

    def same(r: dict) -> str:  # the answers against the first configuration's
        if "identical" not in r:
            return "base"
        return "yes" if r["identical"] else f"{r['mismatches']} diff" if r["mismatches"] else f"{r['unknown']} ?"

    rows = [
        f"{'config':<10} {'reqs':>5} {'fail':>4} {'5xx':>4} {'dead':>4} {'TTFT mean':>9} {'p50':>7} {'p90':>7} "
        f"{'p99':>7} {'ITL mean':>8} {'p90':>6} {'tok/s':>8} {'cached %':>8} {'TTFT x':>7} {'tok/s x':>7} "
        f"{'same':>7}"
    ]
    for config, r in results.items():
        cached = (
            "-"
            if r["cached_tokens"] is None or not r["prompt_tokens"]
            else f"{100 * r['cached_tokens'] / r['prompt_tokens']:.0f}"
        )
        rows.append(
            f"{config:<10} {r['requests']:>5} {r['failed']:>4} {r['http_5xx']:>4} {r.get('deaths', 0):>4} "
            f"{ms(r['ttft_mean']):>9} {ms(r['ttft_p50']):>7} "
            f"{ms(r['ttft_p90']):>7} {ms(r['ttft_p99']):>7} {ms(r['itl_mean']):>8} {ms(r['itl_p90']):>6} "
            f"{r['output_tokens_per_s'] or 0:>8.0f} {cached:>8} {ratio(r['ttft_mean'], base['ttft_mean']):>7} "
            f"{ratio(r['output_tokens_per_s'], base['output_tokens_per_s']):>7} {same(r):>7}"
        )
        if r["cached_tokens_by_tier"]:
            rows.append(
                " " * 11 + "cached by tier: " + ", ".join(f"{t} {int(n)}" for t, n in sorted(r["cached_tokens_by_tier"].items()))
            )
    return "\n".join(rows)


def plot(results: dict[str, dict], path: str, name: str) -> None:
    """Mean TTFT per round (left) and the TTFT CDF (right), one line per configuration, of its
    answered requests (a round with none is a gap; the legend says how many failed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for config, r in results.items():
        label = f"{config} ({r['failed']} of {r['requests']} failed)" if r["failed"] else config
        # a round without an answer is a gap (NaN), not 0 ms
        ys = [math.nan if x is None else 1e3 * x for x in r["ttft_by_round"]]
        a.plot(range(len(ys)), ys, marker="o", label=label)
        xs = sorted(r["ttfts"])  # (the answered requests')
        b.plot([1e3 * x for x in xs], [(i + 1) / len(xs) for i in range(len(xs))], label=label)
    a.set(xlabel="round", ylabel="mean TTFT (ms)", title=f"{name}: TTFT per round")
    a.xaxis.get_major_locator().set_params(integer=True)
    b.set(xlabel="TTFT (ms)", ylabel="fraction of requests", title="TTFT CDF")
    a.legend()
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
