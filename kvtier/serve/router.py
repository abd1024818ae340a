"""``kvtier router``: one OpenAI endpoint in front of prefill (P) and decode (D) servers.

::

    client ─► router ─► P /kvtier/prefill/...   prefill; answers the first token's chunks and the
                │                               manifest's names at once, then (same answer, a
                │                               second line) the pool's ack of the prompt's blocks
                └─────► D /v1/...  + kvtier_handoff   D loads the blocks from the pool and decodes;
                                                      its stream continues after P's chunks

P and D never talk to each other: the pool carries the KV. D's answer goes to the client as D
sent it: its usage reports D's cached tokens, and P's (``usage.kvtier.prefill``) from what P's
first line said, which the hand-off carries to D. Backends are picked round robin among
the healthy ones (``GET /health`` every ``health_interval`` seconds; a backend that fails a
request is marked down at once; a /health that is not a JSON object, or over
``MAX_HEALTH_BYTES``, or late past ``HEALTH_TIMEOUT_S``, marks it down; a field of it that makes
no sense is replaced by its default, with a warning). A P that is down, answers an error, could
not write every block, or answers something else than its two lines -> the request runs
colocated on a D. A D that fails before answering -> the next D (the hand-off is in the pool, any
D can read it).

Every call has a timeout, and a P has deadlines that no trickle of bytes can stretch (httpx's
timeouts are per read): its first line by ``timeout`` seconds after the call went out (else the
request runs colocated, the P is marked down), its ack by the same ``timeout`` and by its
``export_timeout`` (its /health) + ``ACK_MARGIN_S`` after the first line. What the router reads
is capped: a line of P's at ``MAX_PREFILL_LINE_BYTES`` (never read further), JSON from P, a
/health or a client at ``MAX_JSON_DEPTH`` levels (counted before it is parsed); NaN, Infinity and
lone surrogates in P's answer or a client's body are refused too. From P that is a malformed
answer, from a client a 400 that names the problem.

A stream starts with P's first token as soon as P has sampled it, before P's blocks are in the
pool, when every healthy D recomputes what it misses (``pd_on_miss`` in its /health is
``recompute``): such a D cannot fail the hand-off for the pool's sake, so D is called once P's
ack came (or P broke off: a block P did not write costs D a recompute, never the request, whose
first token the client has), and D's answer only continues the stream (an error of D's then ends
the stream as an error event). Otherwise P's chunks wait for P's ack and D's headers, so that a
failed export can still run the request colocated and D's 502 can be the answer.

Over 600 lines: the PD relay (P's two lines, D's stream, their fallbacks) and the strict reading
of what P, D and clients send are one state machine; the cache-aware view is apart (workers.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import time
from itertools import accumulate
from typing import AbstractSet, Any, AsyncIterator

import httpx
import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from starlette.background import BackgroundTask
from starlette.requests import ClientDisconnect

from kvtier.serve import asgi
from kvtier.serve.backend import Backend
from kvtier.serve.errors import APIError, add_error_handlers, error_response, invalid_json_message, sse_error, until_disconnect
from kvtier.serve.route import Candidate, Picker
from kvtier.serve.workers import CacheView

log = logging.getLogger(__name__)
_PATHS = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}
_PREFILL = {"completion": "/kvtier/prefill/completions", "chat": "/kvtier/prefill/chat"}
DEFAULT_EXPORT_TIMEOUT_S = 30.0  # P's --export-timeout default, for a P whose /health lacks it
ACK_MARGIN_S = 10.0  # a P's ack is late past its export_timeout and this, after its first line
# A line of P's answer longer than this is malformed (the request runs colocated). P's first line
# carries the prompt's token ids and block names, about 12 bytes per prompt token: 32 MiB holds
# a prompt of over two million tokens.
MAX_PREFILL_LINE_BYTES = 32 * 1024 * 1024
MAX_PREFILL_ERROR_BYTES = 1024 * 1024  # P's error answer (a client's error is passed on to it)
MAX_HEALTH_BYTES = 1024 * 1024  # a /health answer
HEALTH_TIMEOUT_S = 2.0  # a /health check, from the call to its last byte
MAX_JSON_DEPTH = 64  # levels of arrays and objects in any JSON the router parses
INLINE_BYTES = 64 * 1024  # a client body up to this size is parsed on the event loop
EXACT_MAX_BYTES = 1 << 20  # ... up to this one by parse_json (every error named by its field)
MAX_LIST_NUMBERS = 1 << 20  # entries of a list of numbers (token ids) in a client body: a million-token context
_FIELDS = msgspec.json.Decoder(dict[str, msgspec.Raw])
_NUMBER_START = frozenset(bytes([c]) for c in b"-0123456789")
PD_ON_MISS = ("recompute", "error")  # what a D's /health may say in pd_on_miss


class Router:
    def __init__(
        self,
        prefill: list[str],
        decode: list[str],
        api_key: str | None = None,
        backend_api_key: str | None = None,
        timeout: float = 600.0,
        connect_timeout: float = 3.0,
        health_interval: float = 2.0,
        max_body_bytes: int | None = asgi.DEFAULT_MAX_BODY_BYTES,
        workers: list[str] = (),  # type: ignore[assignment]
        policy: str = "round_robin",
        tokenizer: str | None = None,
        events_interval: float = 0.1,
        storage: str | None = None,
        expose_config: bool = False,
    ) -> None:
        """``expose_config``: ``/health`` and ``/metrics`` (no key needed) name the servers by
        URL; else by role and number (``decode0``, ``worker1``)."""
        if workers and (prefill or decode):
            raise ValueError("give --workers (colocated instances) or --prefill/--decode (PD), not both")
        if not decode and not workers:
            raise ValueError("the router needs at least one --decode server or --workers instance")
        self.picker = Picker(policy)  # how a D (or a worker) is chosen (serve/route.py)
        self.prefill_picker = Picker(policy)  # ... and a P
        self.policy = policy
        self.prefill = [Backend(u, "prefill") for u in prefill]
        self.decode = [Backend(u, "decode") for u in decode] or [Backend(u, "worker") for u in workers]
        self.expose_config = expose_config
        if not expose_config:
            for group in (self.prefill, self.decode):
                for i, b in enumerate(group):
                    b.label = f"{b.role}{i}"
        if storage is not None and policy != "cache_aware":
            raise ValueError(f"--storage is read by --policy cache_aware only, not {policy}")
        self.cache_view = CacheView(events_interval, tokenizer, storage) if policy == "cache_aware" else None
        self._events_task: asyncio.Task | None = None
        if backend_api_key == "":
            raise ValueError("the backend API key is empty: give a key, or none if the servers need none")
        self.headers = {"Authorization": f"Bearer {backend_api_key}"} if backend_api_key else {}
        self.timeout = httpx.Timeout(timeout, connect=connect_timeout)
        self.timeout_s = timeout  # P's first line, and its whole answer through the ack
        self.health_interval = health_interval
        self.client: httpx.AsyncClient | None = None
        self._health_task: asyncio.Task | None = None
        r = self.registry = CollectorRegistry()
        self.routes = Counter(
            "kvtier_router_requests", "requests by route: pd (P then D), colocated (D alone)", ["route"], registry=r
        )
        self.fallbacks = Counter(
            "kvtier_router_fallbacks", "requests served colocated on D instead of PD, by reason", ["reason"], registry=r
        )
        self.incomplete = Counter(
            "kvtier_router_incomplete_exports",
            "hand-offs whose P did not write every block (or broke off, or did not ack in "
            "time) after its first token went out: D recomputed what was missing",
            registry=r,
        )
        self.prefill_seconds = Histogram("kvtier_router_prefill_seconds", "P's answer time (prefill + pool writes)", registry=r)
        self.routed = Counter("kvtier_router_routed", "requests sent, by instance", ["instance"], registry=r)
        self.predicted_hits = Counter(
            "kvtier_router_predicted_hit_tokens",
            "prompt tokens the chosen server held when it was chosen (cache_aware), by its role "
            "(worker; under PD prefill and decode) and tier",
            ["role", "tier"],
            registry=r,
        )
        for route in ("pd", "colocated"):
            self.routes.labels(route)
        self.api = self._build()
        self.app = asgi.CheapPath(asgi.wrap(self.api, api_key, ("/v1/",), max_body_bytes), "/health")

    @property
    def _http(self) -> httpx.AsyncClient:
        """The client to P and D (made when the app starts)."""
        assert self.client is not None, "the router's app has not started"
        return self.client

    # ------------------------------------------------------------------ backends
    async def choose(self, kind: str, body: dict, exclude: AbstractSet[str], role: str = "decode") -> tuple[Backend, int] | None:
        """The D (or worker), or with ``role="prefill"`` the P, for a request, by ``--policy``
        (serve/route.py): under cache_aware a P is chosen for the prefix its tiers hold (what it
        holds it does not prefill), a D for what it holds (what it holds it does not load).
        With it the prompt tokens the chosen one is predicted to hold (0 without
        ``cache_aware``): they are not its work (:func:`request_load`)."""
        pool, picker = (self.prefill, self.prefill_picker) if role == "prefill" else (self.decode, self.picker)
        # (a stalled one only when every other is down: a stall is not a death)
        cands = [b for b in pool if b.up and b.url not in exclude] or [b for b in pool if b.healthy and b.url not in exclude]
        if not cands:
            return None
        if self.cache_view is None:
            return cands[picker.pick([Candidate(load=b.inflight) for b in cands])], 0
        scored, keys, n = await self.cache_view.candidates(cands, kind, body)
        i = picker.pick(scored, n)
        chosen = cands[i]
        self.predicted_hits.labels(chosen.role, "device").inc(scored[i].device_hit)
        self.predicted_hits.labels(chosen.role, "host").inc(scored[i].host_hit)
        self.predicted_hits.labels(chosen.role, "storage").inc(scored[i].storage_hit)
        self.cache_view.sent(cands[i], keys)
        c = scored[i]
        return chosen, c.device_hit + c.host_hit + c.storage_hit

    async def _events_loop(self) -> None:
        view = self.cache_view
        assert view is not None
        while True:
            await asyncio.gather(*(view.poll(self._http, b) for b in [*self.prefill, *self.decode]))
            await asyncio.sleep(view.interval)

    async def _check(self, b: Backend) -> None:
        try:
            status, raw = await asyncio.wait_for(self._get_health(b), HEALTH_TIMEOUT_S)
            info = parse_json(raw, f"{b.role} server {b.url}'s /health", finite=False)
            if not isinstance(info, dict):
                raise BadJSON(f"{b.role} server {b.url}'s /health is not a JSON object")
        except (httpx.HTTPError, asyncio.TimeoutError):
            b.healthy = False
            return
        except ValueError as e:  # BadJSON: not a kvtier server's /health
            b.warn_once(f"{e}: the router takes it for down")
            b.healthy = False
            return
        b.info = _health_info(b, info)
        # a D without its pool cannot take hand-offs, but its engine still serves colocated
        b.healthy = status == 200 or (b.role == "decode" and b.info.get("engine") == "ok")

    async def _get_health(self, b: Backend) -> tuple[int, bytes]:
        async with self._http.stream("GET", b.url + "/health", timeout=httpx.Timeout(HEALTH_TIMEOUT_S)) as r:
            return r.status_code, await _read_at_most(r, MAX_HEALTH_BYTES, f"{b.role} server {b.url}'s /health")

    async def _health_loop(self) -> None:
        while True:  # (the app's startup made the first round)
            await asyncio.sleep(self.health_interval)
            await asyncio.gather(*(self._check(b) for b in self.prefill + self.decode))

    # ------------------------------------------------------------------ app
    def _build(self) -> FastAPI:
        router = self

        @contextlib.asynccontextmanager
        async def lifespan(app: FastAPI) -> AsyncIterator[None]:
            router.client = httpx.AsyncClient(
                timeout=router.timeout,
                headers=router.headers,
                limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256),
            )
            await asyncio.gather(*(router._check(b) for b in router.prefill + router.decode))
            router._health_task = asyncio.create_task(router._health_loop())
            if router.cache_view is not None:
                router._events_task = asyncio.create_task(router._events_loop())
            try:
                yield
            finally:
                for task in (router._health_task, router._events_task):
                    if task is not None:
                        task.cancel()
                await router.client.aclose()
                if router.cache_view is not None:
                    router.cache_view.close()

        app = FastAPI(
            title="kvtier router",
            version=__import__("kvtier").__version__,
            description="OpenAI-compatible front of kvtier prefill and decode servers.",
            lifespan=lifespan,
        )

        add_error_handlers(app)

        @app.get("/health")
        async def health() -> Response:
            up = [b.label for b in router.decode if b.healthy]
            workers = any(b.role == "worker" for b in router.decode)  # --workers: colocated instances, no P or D
            if not up:
                return error_response(503, "no worker is up" if workers else "no decode server is up")
            stalled = [b.label for b in router.prefill + router.decode if b.healthy and b.stalled]
            if workers:
                return JSONResponse({"status": "ok", "role": "router", "workers_up": up, "stalled": stalled})
            prefill_up = [b.label for b in router.prefill if b.healthy]
            return JSONResponse({"status": "ok", "role": "router", "decode_up": up, "prefill_up": prefill_up, "stalled": stalled})

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(generate_latest(router.registry), media_type="text/plain; version=0.0.4; charset=utf-8")

        @app.get("/v1/models")
        async def models() -> Response:
            # every D serves the same model: the first healthy one answers
            d = next((b for b in router.decode if b.healthy), None)
            if d is None:
                return error_response(503, "no decode server is up")
            try:
                r = await router._http.get(d.url + "/v1/models")
            except httpx.HTTPError as e:
                d.healthy = False
                return error_response(502, f"decode server {d.url} failed: {_describe(e)}")
            return Response(r.content, status_code=r.status_code, media_type="application/json")

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await router.handle("completion", request)

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            return await router.handle("chat", request)

        return app

    # ------------------------------------------------------------------ requests
    async def handle(self, kind: str, request: Request) -> Response:
        try:
            raw = await request.body()
        except ClientDisconnect:
            return error_response(499, "client disconnected")
        try:
            # a large body is checked on a worker thread (the event loop streams every other
            # client's tokens): in C, at a cost bounded by its size (parse_client_body)
            body = parse_client_body(raw) if len(raw) <= INLINE_BYTES else await asyncio.to_thread(parse_client_body, raw)
        except BadJSON as e:
            return error_response(400, str(e), e.param)
        if not isinstance(body, dict):
            return error_response(400, "the request body must be a JSON object")
        if "kvtier_handoff" in body:
            return error_response(400, "kvtier_handoff is set by the router, not by clients", "kvtier_handoff")
        # a client that hangs up cancels the calls to P and D: their connections close, and the
        # servers abort the request (a stream is closed by Starlette when its client leaves)
        return await until_disconnect(request, self._route(kind, body))

    async def _route(self, kind: str, body: dict) -> Response:
        stream = body.get("stream") is True
        if not self.prefill and self.decode and self.decode[0].role == "worker":  # --workers: colocated
            self.routes.labels("colocated").inc()
            return await self._decode(kind, body, stream, None)
        pre, reason = await self._prefill(kind, body)
        if isinstance(pre, Response):
            return pre  # the client's error (4xx), from P
        if pre is None:
            return await self._colocated(kind, body, stream, reason)
        if stream and self._decode_recomputes():
            self.routes.labels("pd").inc()
            return StreamingResponse(
                self._relay_early(kind, body, pre),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        if not await pre.acked("colocated on D"):
            return await self._colocated(kind, body, stream, "prefill_write_failed")
        self.routes.labels("pd").inc()
        return await self._decode(kind, dict(body, kvtier_handoff=pre.handoff()), stream, pre.chunks)

    async def _colocated(self, kind: str, body: dict, stream: bool, reason: str) -> Response:
        self.fallbacks.labels(reason).inc()
        self.routes.labels("colocated").inc()
        return await self._decode(kind, body, stream, None)

    def _decode_recomputes(self) -> bool:
        """Does every healthy D recompute what it misses (``pd_on_miss=recompute``, in its
        /health)? Then a hand-off cannot fail on D for the pool's sake, and a stream may start
        with P's first token before P's blocks are in the pool and before D answers."""
        up = [b for b in self.decode if b.healthy]
        return bool(up) and all(b.info.get("pd_on_miss") == "recompute" for b in up)

    async def _relay_early(self, kind: str, body: dict, pre: "_Prefill") -> AsyncIterator[bytes]:
        """P's first-token chunks at once; then, once P's blocks are in the pool, D's stream (a
        block P could not write, or P breaking off, costs D a recompute, never the request);
        D's error, if it has one, as the stream's last event."""
        try:
            for c in pre.chunks:
                yield f"data: {json.dumps(c, separators=(',', ':'))}\n\n".encode()
        except BaseException:  # the client left: P's answer is closed too
            await pre.close()
            raise
        if not await pre.acked("D recomputes what is missing"):
            self.incomplete.inc()
        opened = await self._open_decode(kind, dict(body, kvtier_handoff=pre.handoff()))
        if isinstance(opened, APIError):
            yield (sse_error(opened) + "data: [DONE]\n\n").encode()
            return
        r, d, cached = opened
        if r.status_code != 200:
            try:
                detail = (await r.aread()).decode(errors="replace")[:300]
            except httpx.HTTPError as e:
                detail = _describe(e)
            finally:
                await r.aclose()
            yield (sse_error(APIError(502, f"decode server answered {r.status_code}: {detail}")) + "data: [DONE]\n\n").encode()
            return
        cost = request_load(body, cached)
        d.inflight += cost  # D's load until its stream ends (serve/route.py)
        try:
            async for b in _relay(None, r):
                yield b
        finally:
            d.inflight -= cost

    async def _prefill(self, kind: str, body: dict) -> tuple[Any, str]:
        """P's half: (its answer's first part, "") or (None, why the request runs colocated) or
        (the client's error from P, "")."""
        tried: set[str] = set()
        reason = "no_prefill_server"
        while True:
            chosen = await self.choose(kind, body, tried, "prefill")
            if chosen is None:
                return None, reason
            p, cached = chosen
            tried.add(p.url)
            # one deadline for P's first line, however slowly its bytes come (httpx's timeouts
            # are per read); the same one bounds P's ack (_Prefill.ack)
            deadline = asyncio.get_running_loop().time() + self.timeout_s
            cost = request_load(body, cached)
            p.inflight += cost  # its load until its first line (the prefill)
            try:
                pre, reason = await asyncio.wait_for(self._prefill_on(p, kind, body, deadline), self.timeout_s)
            except asyncio.TimeoutError:
                log.warning(
                    "prefill server %s sent no first token within %g s (--timeout); trying the next one", p.url, self.timeout_s
                )
                p.healthy = False
                reason = "prefill_timeout"
                continue
            finally:
                p.inflight -= cost
            if pre is not None:
                self.routed.labels(p.label).inc()
                return pre, ""

    async def _prefill_on(self, p: Backend, kind: str, body: dict, deadline: float) -> tuple[Any, str]:
        """One P's first line: (P's answer, "") or (the client's error from P, "") or (None, what
        went wrong with this P)."""
        t0 = time.monotonic()
        req = self._http.build_request("POST", p.url + _PREFILL[kind], json=dict(body, stream=False))
        try:
            r = await self._http.send(req, stream=True)
        except httpx.HTTPError as e:
            log.warning("prefill server %s failed (%s); trying the next one", p.url, e)
            p.healthy = False
            return None, "prefill_down"
        if r.status_code != 200:
            try:
                content = await _read_at_most(r, MAX_PREFILL_ERROR_BYTES, f"prefill server {p.url}'s error answer")
            except (httpx.HTTPError, ValueError) as e:
                log.warning("prefill server %s answered %d, then failed (%s); trying the next one", p.url, r.status_code, e)
                return None, "prefill_error"
            finally:
                await r.aclose()
            if _clients_fault(r.status_code, content):
                return Response(content, status_code=r.status_code, media_type="application/json"), ""
            if r.status_code == 501:  # what a hand-off cannot carry (n > 1, logprobs, several
                return None, "not_handed_off"  # prompts): any P would say so; nothing is wrong with P
            log.warning("prefill server %s answered %d: %s", p.url, r.status_code, content[:200].decode(errors="replace"))
            return None, "prefill_error"
        # P acks (or gives up) within its export_timeout (in its /health): a P silent past that
        # and a margin is hung; the request goes on as if P had broken off
        ack_timeout = p.info.get("export_timeout", DEFAULT_EXPORT_TIMEOUT_S) + ACK_MARGIN_S
        pre = _Prefill(p.url, r, t0, self.prefill_seconds, ack_timeout, deadline)
        try:
            await pre.start()
        except (httpx.HTTPError, ValueError, KeyError, TypeError, EOFError) as e:
            await pre.close()
            log.warning("prefill server %s broke off or answered no first line (%s); trying the next one", p.url, _describe(e))
            return None, "prefill_error"
        except BaseException:  # the deadline passed, or the client left
            await pre.close()
            raise
        return pre, ""

    async def _open_decode(self, kind: str, body: dict) -> tuple[httpx.Response, Backend, int] | APIError:
        """D's response, headers read and body streaming (a D that fails to connect or is busy:
        the next one), that D and the prompt tokens it was predicted to hold; or the router's
        error when none answers."""
        tried: set[str] = set()
        last_error = "no decode server is up"
        while True:
            chosen = await self.choose(kind, body, tried)
            if chosen is None:
                return APIError(503, last_error)
            d, cached = chosen
            tried.add(d.url)
            req = self._http.build_request("POST", d.url + _PATHS[kind], json=body)
            try:
                r = await self._http.send(req, stream=True)
            except httpx.TimeoutException as e:
                # not retried on the next D: the request may still be running on this one
                return APIError(504, f"{d.role} server {d.url} did not answer in time: {_describe(e)}")
            except httpx.HTTPError as e:
                # nothing was sent back yet: the next one takes the request
                log.warning("%s server %s failed (%s); trying the next one", d.role, d.url, e)
                d.healthy = False
                if self.cache_view is not None:
                    self.cache_view.drop(d)
                last_error = f"{d.role} server {d.url} failed: {_describe(e)}"
                continue
            if r.status_code == 503 and len(tried) < len(self.decode):
                await r.aclose()
                continue
            self.routed.labels(d.label).inc()
            return r, d, cached

    async def _decode(self, kind: str, body: dict, stream: bool, first_chunks: list | None) -> Response:
        opened = await self._open_decode(kind, body)
        if isinstance(opened, APIError):
            return error_response(opened.status, opened.message)
        r, d, cached = opened
        cost = request_load(body, cached)
        if r.status_code != 200 or not stream:
            d.inflight += cost  # its load until the answer ends (serve/route.py)
            try:
                content = await r.aread()
            except httpx.HTTPError as e:
                return error_response(502, f"{d.role} server failed while answering: {_describe(e)}")
            finally:
                d.inflight -= cost
                await r.aclose()
            return Response(content, status_code=r.status_code, media_type=r.headers.get("content-type", "application/json"))

        async def relay() -> AsyncIterator[bytes]:
            # counted from the stream's start: a client gone before it starts never runs this
            # body (nor its finally), so nothing is counted that would stay
            d.inflight += cost
            try:
                async for chunk in _relay(first_chunks, r):
                    yield chunk
            finally:
                d.inflight -= cost

        return StreamingResponse(
            relay(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            background=BackgroundTask(r.aclose),  # (D's stream closed if the body never ran)
        )


# the kvtier_handoff D gets from P's first line: each field's type
_HEAD_TYPES = {
    "namespace": str,
    "keys": list,
    "num_tokens": int,
    "first_token": int,
    "prompt_token_ids": list,
    "response_id": str,
    "created": int,
}


class _Prefill:
    """P's answer, two JSON lines (``serve/api.py``): the first token's chunks and the manifest's
    names as soon as P sampled it (:meth:`start`), then the pool's ack of the prompt's blocks
    (:meth:`ack`). The response stays open in between; :meth:`close` on every path.

    The ack is awaited until ``ack_timeout`` seconds after the first line, and never past
    ``deadline`` (the event loop's clock: the whole hand-off's)."""

    def __init__(
        self, url: str, response: httpx.Response, t0: float, seconds: Histogram, ack_timeout: float, deadline: float
    ) -> None:
        self.url, self.response, self.t0, self.seconds = url, response, t0, seconds
        self.ack_timeout, self.deadline = ack_timeout, deadline
        self._lines = _Lines(response, MAX_PREFILL_LINE_BYTES)
        self.head: dict = {}
        self.chunks: list = []

    async def start(self) -> None:
        head = parse_json(await self._lines.next(), f"prefill server {self.url}'s first line")
        if not isinstance(head, dict):
            raise BadJSON(f"prefill server {self.url}'s first line is not a JSON object")
        names, chunks = head["manifest"], head["chunks"]
        if not isinstance(names, dict) or not isinstance(chunks, list) or not all(isinstance(c, dict) for c in chunks):
            raise BadJSON(f"prefill server {self.url}'s first line has no manifest object or chunk objects")
        self.head = {
            "namespace": names["namespace"],
            "keys": names["keys"],
            "num_tokens": names["num_tokens"],
            "first_token": head["first_token"],
            "prompt_token_ids": head["prompt_token_ids"],
            "response_id": head["id"],
            "created": head["created"],
        }
        wrong = [k for k, t in _HEAD_TYPES.items() if not isinstance(self.head[k], t) or isinstance(self.head[k], bool)]
        # what P found cached of the prompt: D reports it in its usage (``usage.kvtier.prefill``)
        cached, by_tier = head.get("cached_tokens", 0), head.get("cached_tokens_by_tier", {})
        if not _is_count(cached):
            wrong.append("cached_tokens")
        if not isinstance(by_tier, dict) or not all(map(_is_count, by_tier.values())):
            wrong.append("cached_tokens_by_tier")
        if wrong:
            raise BadJSON(f"prefill server {self.url}'s first line has a {', '.join(wrong)} of the wrong type")
        self.head["prefill"] = {"cached_tokens": cached, "cached_tokens_by_tier": by_tier}
        self.chunks = chunks
        loop = asyncio.get_running_loop()
        self.deadline = min(self.deadline, loop.time() + self.ack_timeout)

    async def ack(self) -> dict | None:
        """P's final manifest (``complete``, ``failed_blocks``), or None if P answered an error,
        something else than a manifest, broke off, or did not answer in time."""
        left = self.deadline - asyncio.get_running_loop().time()
        try:
            last = parse_json(await asyncio.wait_for(self._lines.next(), max(left, 0.0)), f"prefill server {self.url}'s ack line")
        except asyncio.TimeoutError:
            log.warning(
                "prefill server %s did not ack its blocks in time (--timeout, or its export_timeout + %g s)",
                self.url,
                ACK_MARGIN_S,
            )
            return None
        except (httpx.HTTPError, ValueError, EOFError) as e:
            log.warning("prefill server %s broke off after its first token (%s)", self.url, _describe(e))
            return None
        manifest = last.get("manifest") if isinstance(last, dict) else None
        if not isinstance(manifest, dict):
            log.warning("prefill server %s answered no manifest after its first token: %.200s", self.url, last)
            return None
        self.seconds.observe(time.monotonic() - self.t0)
        return manifest

    async def acked(self, then: str) -> bool:
        """Whether P's ack says every block reached the pool (P's answer is closed after it); a
        failure is logged with ``then``, what the router does about it."""
        try:
            manifest = await self.ack()
        finally:
            await self.close()
        if manifest is not None and manifest.get("complete"):
            return True
        log.warning(
            "prefill server %s could not write every block (%s): %s",
            self.url,
            "its answer broke off" if manifest is None else f"{manifest.get('failed_blocks')} failed",
            then,
        )
        return False

    def handoff(self) -> dict:
        """The ``kvtier_handoff`` D gets (the names are P's first line's: a block P did not write
        is a miss that D recomputes, or refuses under ``--pd-on-miss error``)."""
        return dict(self.head)

    async def close(self) -> None:
        await self.response.aclose()


def request_load(body: dict, cached: int) -> int:
    """A request's weight in an instance's load, the work it brings: its prompt's tokens
    (characters / 4 for text) but the ``cached`` ones the instance holds, plus its max_tokens
    (default 16). ``kvtier sim`` counts an instance's load the same way: the uncached tokens it
    has yet to compute. (A cached prompt is not work: counted in full, a long conversation that
    is mostly a hit would weigh as if recomputed, and the balance rule would move it away from
    its blocks.)"""
    prompt, output = _request_tokens(body)
    return max(0, prompt - cached) + output


def _request_tokens(body: dict) -> tuple[int, int]:
    """A request's prompt tokens (characters / 4 for text) and its max_tokens (default 16)."""
    prompt = body.get("prompt", body.get("messages"))
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        n = len(prompt)
    else:
        n = _size(prompt) // 4
    m = body.get("max_tokens", body.get("max_completion_tokens"))
    return n, (m if isinstance(m, int) and not isinstance(m, bool) and m > 0 else 16)


def _size(value: Any) -> int:
    """About the characters of ``value`` as JSON (its text's, 4 a number): without writing it out
    (a 15 MB prompt held the event loop for its json.dumps), a list of numbers at once."""
    total, todo = 0, [value]
    while todo:
        v = todo.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, list):
            if v and isinstance(v[0], (int, float)):
                total += 4 * len(v)
            else:
                todo.extend(v)
        elif isinstance(v, dict):
            todo.extend(v.values())
        elif v is not None:
            total += 4
    return total


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


async def _relay(first_chunks: list | None, r: httpx.Response) -> AsyncIterator[bytes]:
    """P's first-token chunks, then D's stream as it comes."""
    try:
        for c in first_chunks or ():
            yield f"data: {json.dumps(c, separators=(',', ':'))}\n\n".encode()
        async for b in r.aiter_raw():
            yield b
    except httpx.HTTPError as e:  # D died mid-stream: say so, end the stream
        err = APIError(502, f"decode server failed mid-stream: {_describe(e)}")
        yield (sse_error(err) + "data: [DONE]\n\n").encode()
    finally:
        await r.aclose()


def _clients_fault(status: int, content: bytes) -> bool:
    """P's answer is an error of the client's request (D would answer the same), not of P."""
    if status in (400, 413):
        return True
    if status == 404:  # unknown model: named in the error's param
        try:
            return parse_json(content, "prefill server's error")["error"]["param"] == "model"
        except (ValueError, KeyError, TypeError):
            return False
    return False


def _describe(e: Exception) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


# ---------------------------------------------------------------------- what P, D and clients send
class BadJSON(ValueError):
    """JSON the router refuses: not JSON, too large, nested too deep, or with a number that is not
    finite or text that is not Unicode. ``param`` names the field at fault (None: the whole)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


# a JSON string (or an unterminated one, to the end: every quote starts a match that succeeds, so
# the scan never starts over), whatever is no bracket, and the escape of a UTF-16 surrogate
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?', re.S)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_NESTING = {"[": 1, "{": 1, "]": -1, "}": -1}
_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")


def parse_client_body(raw: bytes) -> Any:
    """A client's request body parsed, or BadJSON. Up to EXACT_MAX_BYTES by :func:`parse_json`
    (whose errors name the field at fault); a larger one by msgspec, a C decoder whose cost is
    bounded by the body's size: a list of numbers of more than MAX_LIST_NUMBERS entries is refused
    by counting its commas before it is decoded, and NaN, Infinity, a number too large for a
    double or a lone surrogate are a decode error (none is JSON that a strict client reads).
    (Python's json with a hook per float and a walk of every value took 24 s of the event loop
    for a 12 MB body of three million floats and one NaN.)"""
    if len(raw) <= EXACT_MAX_BYTES:
        return parse_json(raw, "the request body")
    try:
        fields = _FIELDS.decode(raw)
    except msgspec.ValidationError:
        raise BadJSON("the request body must be a JSON object") from None
    except RecursionError:
        raise BadJSON("the request body is nested too deep") from None
    except msgspec.DecodeError as e:
        raise BadJSON(invalid_json_message(str(e).removeprefix("JSON is malformed: "), what="the request body")) from None
    body = {}
    for name, value in fields.items():
        b = bytes(value)
        if b[:1] == b"[" and b[1:].lstrip()[:1] in _NUMBER_START and b.count(b",") >= MAX_LIST_NUMBERS:
            raise BadJSON(f"{name} is a list of over {MAX_LIST_NUMBERS} numbers: more than any request may hold", name)
        try:
            body[name] = msgspec.json.decode(b)
        except RecursionError:
            raise BadJSON(f"{name} is nested too deep", name) from None
        except (msgspec.DecodeError, msgspec.ValidationError) as e:  # (e.g. 1e999: out of range)
            raise BadJSON(f"{name}: {e}", name) from None
    return body


def parse_json(raw: bytes | str, what: str, finite: bool = True) -> Any:
    """``raw`` parsed, or BadJSON saying what is wrong with ``what``: nested deeper than
    MAX_JSON_DEPTH (found by counting brackets outside strings, before the parser's recursion
    gets there), not JSON, or (``finite``) holding NaN, Infinity, a number too large for a double
    or a lone surrogate, which no strict client could read (``param``: where)."""
    if isinstance(raw, (bytes, bytearray)):
        try:
            text = bytes(raw).decode(json.detect_encoding(raw))
        except UnicodeDecodeError as e:
            raise BadJSON(invalid_json_message(str(e), what=what)) from None
    else:
        text = raw
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH:  # (else it cannot be deeper)
        steps = accumulate(map(_NESTING.__getitem__, _NOT_BRACKET.sub("", _STRING.sub("", text))))
        if next(filter(MAX_JSON_DEPTH.__lt__, steps), None) is not None:
            raise BadJSON(f"{what} is nested too deep: more than {MAX_JSON_DEPTH} levels of arrays and objects")
    suspect: list[str] = []

    def constant(name: str) -> float:  # NaN, Infinity, -Infinity
        suspect.append(name)
        return float(name)

    def number(s: str) -> float:
        f = float(s)
        if math.isinf(f):  # 1e999
            suspect.append(s)
        return f

    try:
        value = json.loads(text, parse_constant=constant, parse_float=number) if finite else json.loads(text)
    except json.JSONDecodeError as e:
        raise BadJSON(invalid_json_message(e.msg, e.doc, e.pos, what)) from None
    except (ValueError, RecursionError) as e:  # e.g. an integer of over 4300 digits
        raise BadJSON(invalid_json_message(str(e), what=what)) from None
    if finite and (suspect or _SURROGATE.search(text)):
        bad = _first_bad_value(value)
        if bad is not None:
            path, problem = bad
            raise BadJSON(f"{path or what} {problem}", path or None)
    return value


def _first_bad_value(value: Any) -> tuple[str, str] | None:
    """(dotted path, what is wrong) of the first number that is not finite or text that is not
    Unicode (a lone surrogate) in ``value``, if any."""
    todo: list[tuple[Any, str]] = [(value, "")]
    while todo:
        v, path = todo.pop()
        if isinstance(v, float) and not math.isfinite(v):
            return path, f"must be a finite number, got {json.dumps(v)}"
        if isinstance(v, str) and not v.isascii():
            try:
                v.encode()
            except UnicodeEncodeError as e:
                return path, f"is not valid Unicode: it holds a lone surrogate (U+{ord(v[e.start]):04X})"
        elif isinstance(v, dict):
            for k, x in reversed(list(v.items())):
                todo.append((x, f"{path}.{k}" if path else k))
                todo.append((k, path))
        elif isinstance(v, list):
            todo.extend((x, f"{path}.{i}" if path else str(i)) for i, x in reversed(list(enumerate(v))))
    return None


class _Lines:
    """The lines of a streamed answer (the last may lack its newline), each read whole and at most
    ``max_bytes`` long: a longer one is a BadJSON once that many bytes came, never read further.
    EOFError when the answer ends."""

    def __init__(self, response: httpx.Response, max_bytes: int) -> None:
        self._chunks = response.aiter_bytes()
        self._max = max_bytes
        self._buf = bytearray()
        self._searched = 0  # no newline in _buf before this
        self._ended = False

    async def next(self) -> bytes:
        while True:
            i = self._buf.find(b"\n", self._searched)
            if i < 0 and len(self._buf) > self._max or i > self._max:
                raise BadJSON(f"a line of the answer is over {self._max} bytes")
            if i >= 0:
                line = bytes(self._buf[:i])
                del self._buf[: i + 1]
                self._searched = 0
                return line.removesuffix(b"\r")
            self._searched = len(self._buf)
            if self._ended:
                if not self._buf:
                    raise EOFError("the answer ended")
                line = bytes(self._buf)
                self._buf.clear()
                return line
            try:
                self._buf += await anext(self._chunks)
            except StopAsyncIteration:
                self._ended = True


async def _read_at_most(r: httpx.Response, max_bytes: int, what: str) -> bytes:
    """``r``'s body, or BadJSON once it passes ``max_bytes`` (nothing more is read)."""
    buf = bytearray()
    async for chunk in r.aiter_bytes():
        buf += chunk
        if len(buf) > max_bytes:
            raise BadJSON(f"{what} is over {max_bytes} bytes")
    return bytes(buf)


def _positive_number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        f = float(v)
    except OverflowError:
        return None
    return f if math.isfinite(f) and f > 0 else None


def _health_info(b: Backend, info: dict) -> dict:
    """A /health object with the fields the router reads made sound: an ``export_timeout`` that
    is no finite positive number is DEFAULT_EXPORT_TIMEOUT_S, a ``pd_on_miss`` that is none of
    PD_ON_MISS is dropped (the D is not taken to recompute); each with a warning."""
    info = dict(info)
    if "export_timeout" in info:
        t = _positive_number(info["export_timeout"])
        if t is None:
            b.warn_once(
                f"{b.role} server {b.url}'s /health says export_timeout={info['export_timeout']!r:.100}, not a finite "
                f"positive number: the router waits for its acks as for one of {DEFAULT_EXPORT_TIMEOUT_S} s"
            )
            t = DEFAULT_EXPORT_TIMEOUT_S
        info["export_timeout"] = t
    if "pd_on_miss" in info and info["pd_on_miss"] not in PD_ON_MISS:
        b.warn_once(
            f"{b.role} server {b.url}'s /health says pd_on_miss={info['pd_on_miss']!r:.100}, none of "
            f"{', '.join(PD_ON_MISS)}: it is not taken to recompute what it misses"
        )
        del info["pd_on_miss"]
    return info
