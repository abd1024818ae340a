"""``kvtier router``: one OpenAI endpoint in front of prefill (P) and decode (D) servers.

::

    client ─► router ─► P /kvtier/prefill/...   prefill; answers the first token's chunks and the
                │                               manifest's names at once, then (same answer, a
                │                               second line) the pool's ack of the prompt's blocks
                └─────► D /v1/...  + kvtier_handoff   D loads the blocks from the pool and decodes;
                                                      its stream continues after P's chunks

P and D never talk to each other: the pool carries the KV. Backends are picked round robin among
the healthy ones (``GET /health`` every ``health_interval`` seconds; a backend that fails a
request is marked down at once). A P that is down, answers an error, or could not write every
block -> the request runs colocated on a D. A D that fails before answering -> the next D (the
hand-off is in the pool, any D can read it). Every call has a timeout.

A stream starts with P's first token as soon as P has sampled it, before P's blocks are in the
pool, when every healthy D recomputes what it misses (``pd_on_miss`` in its /health is
``recompute``): such a D cannot fail the hand-off for the pool's sake, so D is called once P's
ack came (or P broke off: a block P did not write costs D a recompute, never the request, whose
first token the client has), and D's answer only continues the stream (an error of D's then ends
the stream as an error event). Otherwise P's chunks wait for P's ack and D's headers, so that a
failed export can still run the request colocated and D's 502 can be the answer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import AbstractSet, Any, AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from kvtier.serve import asgi
from kvtier.serve.errors import APIError, add_error_handlers, error_response, invalid_json_message, sse_error, until_disconnect

log = logging.getLogger(__name__)
_PATHS = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}
_PREFILL = {"completion": "/kvtier/prefill/completions", "chat": "/kvtier/prefill/chat"}
DEFAULT_EXPORT_TIMEOUT_S = 30.0  # P's --export-timeout default, for a P whose /health lacks it
ACK_MARGIN_S = 10.0


class Backend:
    def __init__(self, url: str, role: str) -> None:
        url = url.rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"backend URL must start with http:// or https://, got {url!r}")
        self.url, self.role = url, role
        self.healthy = True
        self.info: dict = {}

    def __repr__(self) -> str:
        return f"{self.role}:{self.url}{'' if self.healthy else ' (down)'}"


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
    ) -> None:
        if not decode:
            raise ValueError("the router needs at least one --decode server")
        self.prefill = [Backend(u, "prefill") for u in prefill]
        self.decode = [Backend(u, "decode") for u in decode]
        if backend_api_key == "":
            raise ValueError("the backend API key is empty: give a key, or none if the servers need none")
        self.headers = {"Authorization": f"Bearer {backend_api_key}"} if backend_api_key else {}
        self.timeout = httpx.Timeout(timeout, connect=connect_timeout)
        self.health_interval = health_interval
        self._rr = {"prefill": 0, "decode": 0}
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
        for route in ("pd", "colocated"):
            self.routes.labels(route)
        self.api = self._build()
        self.app = asgi.wrap(self.api, api_key, ("/v1/",), max_body_bytes)

    @property
    def _http(self) -> httpx.AsyncClient:
        """The client to P and D (made when the app starts)."""
        assert self.client is not None, "the router's app has not started"
        return self.client

    # ------------------------------------------------------------------ backends
    def _pick(self, role: str, exclude: AbstractSet[str] = frozenset()) -> Backend | None:
        pool = self.prefill if role == "prefill" else self.decode
        cands = [b for b in pool if b.healthy and b.url not in exclude]
        if not cands:
            return None
        i = self._rr[role] % len(cands)
        self._rr[role] += 1
        return cands[i]

    async def _check(self, b: Backend) -> None:
        try:
            r = await self._http.get(b.url + "/health", timeout=httpx.Timeout(2.0))
            b.info = r.json()
            # a D without its pool cannot take hand-offs, but its engine still serves colocated
            b.healthy = r.status_code == 200 or (b.role == "decode" and b.info.get("engine") == "ok")
        except (httpx.HTTPError, ValueError, AttributeError):
            b.healthy = False

    async def _health_loop(self) -> None:
        while True:
            await asyncio.gather(*(self._check(b) for b in self.prefill + self.decode))
            await asyncio.sleep(self.health_interval)

    # ------------------------------------------------------------------ app
    def _build(self) -> FastAPI:
        app = FastAPI(
            title="kvtier router",
            version=__import__("kvtier").__version__,
            description="OpenAI-compatible front of kvtier prefill and decode servers.",
        )
        router = self

        @app.on_event("startup")
        async def _start() -> None:
            router.client = httpx.AsyncClient(
                timeout=router.timeout,
                headers=router.headers,
                limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256),
            )
            await asyncio.gather(*(router._check(b) for b in router.prefill + router.decode))
            router._health_task = asyncio.create_task(router._health_loop())

        @app.on_event("shutdown")
        async def _stop() -> None:
            if router._health_task is not None:
                router._health_task.cancel()
            if router.client is not None:
                await router.client.aclose()

        add_error_handlers(app)

        @app.get("/health")
        async def health() -> Response:
            up = [b.url for b in router.decode if b.healthy]
            if not up:
                return error_response(503, "no decode server is up")
            return JSONResponse(
                {"status": "ok", "role": "router", "decode_up": up, "prefill_up": [b.url for b in router.prefill if b.healthy]}
            )

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(generate_latest(router.registry), media_type="text/plain; version=0.0.4; charset=utf-8")

        @app.get("/v1/models")
        async def models() -> Response:
            d = router._pick("decode")
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
            body = json.loads(await request.body())
        except json.JSONDecodeError as e:
            return error_response(400, invalid_json_message(e.msg, e.doc, e.pos))
        except ValueError as e:  # not UTF-8
            return error_response(400, invalid_json_message(str(e)))
        if not isinstance(body, dict):
            return error_response(400, "the request body must be a JSON object")
        if "kvtier_handoff" in body:
            return error_response(400, "kvtier_handoff is set by the router, not by clients", "kvtier_handoff")
        # a client that hangs up cancels the calls to P and D: their connections close, and the
        # servers abort the request (a stream is closed by Starlette when its client leaves)
        return await until_disconnect(request, self._route(kind, body))

    async def _route(self, kind: str, body: dict) -> Response:
        stream = body.get("stream") is True
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
        r = await self._open_decode(kind, dict(body, kvtier_handoff=pre.handoff()))
        if isinstance(r, APIError):
            yield (sse_error(r) + "data: [DONE]\n\n").encode()
            return
        if r.status_code != 200:
            try:
                detail = (await r.aread()).decode(errors="replace")[:300]
            except httpx.HTTPError as e:
                detail = _describe(e)
            finally:
                await r.aclose()
            yield (sse_error(APIError(502, f"decode server answered {r.status_code}: {detail}")) + "data: [DONE]\n\n").encode()
            return
        async for b in _relay(None, r):
            yield b

    async def _prefill(self, kind: str, body: dict) -> tuple[Any, str]:
        """P's half: (its answer's first part, "") or (None, why the request runs colocated) or
        (the client's error from P, "")."""
        tried: set[str] = set()
        reason = "no_prefill_server"
        while True:
            p = self._pick("prefill", tried)
            if p is None:
                return None, reason
            tried.add(p.url)
            t0 = time.monotonic()
            req = self._http.build_request("POST", p.url + _PREFILL[kind], json=dict(body, stream=False))
            try:
                r = await self._http.send(req, stream=True)
                if r.status_code != 200:
                    await r.aread()
                    await r.aclose()
            except httpx.HTTPError as e:
                log.warning("prefill server %s failed (%s); trying the next one", p.url, e)
                p.healthy = False
                reason = "prefill_down"
                continue
            if _clients_fault(r):
                return Response(r.content, status_code=r.status_code, media_type="application/json"), ""
            if r.status_code == 501:  # what a hand-off cannot carry (n > 1, logprobs, several
                return None, "not_handed_off"  # prompts): any P would say so; nothing is wrong with P
            if r.status_code != 200:
                log.warning("prefill server %s answered %d: %s", p.url, r.status_code, r.text[:200])
                reason = "prefill_error"
                continue
            # P acks (or gives up) within its export_timeout (in its /health): a P silent past that
            # and a margin is hung; the request goes on as if P had broken off
            ack_timeout = float(p.info.get("export_timeout") or DEFAULT_EXPORT_TIMEOUT_S) + ACK_MARGIN_S
            pre = _Prefill(p.url, r, t0, self.prefill_seconds, ack_timeout)
            try:
                await pre.start()
            except (httpx.HTTPError, ValueError, KeyError, TypeError, StopAsyncIteration) as e:
                await pre.close()
                log.warning("prefill server %s broke off before its first token (%r); trying the next one", p.url, e)
                reason = "prefill_error"
                continue
            return pre, ""

    async def _open_decode(self, kind: str, body: dict) -> httpx.Response | APIError:
        """D's response, headers read and body streaming (a D that fails to connect or is busy:
        the next one), or the router's error when none answers."""
        tried: set[str] = set()
        last_error = "no decode server is up"
        while True:
            d = self._pick("decode", tried)
            if d is None:
                return APIError(503, last_error)
            tried.add(d.url)
            req = self._http.build_request("POST", d.url + _PATHS[kind], json=body)
            try:
                r = await self._http.send(req, stream=True)
            except httpx.TimeoutException as e:
                # not retried on the next D: the request may still be running on this one
                return APIError(504, f"decode server {d.url} did not answer in time: {_describe(e)}")
            except httpx.HTTPError as e:
                log.warning("decode server %s failed (%s); trying the next one", d.url, e)
                d.healthy = False
                last_error = f"decode server {d.url} failed: {_describe(e)}"
                continue
            if r.status_code == 503 and len(tried) < len(self.decode):
                await r.aclose()
                continue
            return r

    async def _decode(self, kind: str, body: dict, stream: bool, first_chunks: list | None) -> Response:
        r = await self._open_decode(kind, body)
        if isinstance(r, APIError):
            return error_response(r.status, r.message)
        if r.status_code != 200 or not stream:
            try:
                content = await r.aread()
            except httpx.HTTPError as e:
                return error_response(502, f"decode server failed while answering: {_describe(e)}")
            finally:
                await r.aclose()
            return Response(content, status_code=r.status_code, media_type=r.headers.get("content-type", "application/json"))
        return StreamingResponse(
            _relay(first_chunks, r),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )


class _Prefill:
    """P's answer, two JSON lines (``serve/api.py``): the first token's chunks and the manifest's
    names as soon as P sampled it (:meth:`start`), then the pool's ack of the prompt's blocks
    (:meth:`ack`). The response stays open in between; :meth:`close` on every path."""

    def __init__(self, url: str, response: httpx.Response, t0: float, seconds: Histogram, ack_timeout: float) -> None:
        self.url, self.response, self.t0, self.seconds = url, response, t0, seconds
        self.ack_timeout = ack_timeout
        self._lines = response.aiter_lines()
        self.head: dict = {}
        self.chunks: list = []

    async def start(self) -> None:
        head = json.loads(await anext(self._lines))
        names = head["manifest"]
        self.head = {
            "namespace": names["namespace"],
            "keys": names["keys"],
            "num_tokens": names["num_tokens"],
            "first_token": head["first_token"],
            "prompt_token_ids": head["prompt_token_ids"],
            "prefill_cached_tokens": head.get("cached_tokens", 0),
            "response_id": head["id"],
            "created": head["created"],
        }
        self.chunks = head["chunks"]

    async def ack(self) -> dict | None:
        """P's final manifest (``complete``, ``failed_blocks``), or None if P answered an error,
        something else than a manifest, broke off, or did not answer within ``ack_timeout``."""
        try:
            last = json.loads(await asyncio.wait_for(anext(self._lines), self.ack_timeout))
        except asyncio.TimeoutError:
            log.warning("prefill server %s did not ack its blocks within %.0f s", self.url, self.ack_timeout)
            return None
        except (httpx.HTTPError, ValueError, StopAsyncIteration) as e:
            log.warning("prefill server %s broke off after its first token (%r)", self.url, e)
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


def _clients_fault(r: httpx.Response) -> bool:
    """P's answer is an error of the client's request (D would answer the same), not of P."""
    if r.status_code in (400, 413):
        return True
    if r.status_code == 404:  # unknown model: named in the error's param
        try:
            return r.json()["error"]["param"] == "model"
        except (ValueError, KeyError, TypeError):
            return False
    return False


def _describe(e: Exception) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
