"""``kvtier router``: one OpenAI endpoint in front of prefill (P) and decode (D) servers.

::

    client ─► router ─► P /kvtier/prefill/...   prefill; the prompt's blocks written to the pool;
                │                               answers the first token's chunks + manifest
                └─────► D /v1/...  + kvtier_handoff   D loads the blocks from the pool and decodes;
                                                      its stream continues after P's chunks

P and D never talk to each other: the pool carries the KV. Backends are picked round robin among
the healthy ones (``GET /health`` every ``health_interval`` seconds; a backend that fails a
request is marked down at once). A P that is down, answers an error, or could not write every
block -> the request runs colocated on a D. A D that fails before answering -> the next D (the
hand-off is in the pool, any D can read it). Every call has a timeout.

A stream starts with P's first token as soon as P answers when every healthy D recomputes what
it misses (``pd_on_miss`` in its /health is ``recompute``): such a D cannot fail the hand-off for
the pool's sake, so its answer only continues the stream (an error of D's then ends the stream
as an error event). Otherwise P's chunks wait for D's headers, so that D's 502 can be the answer.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from kvtier.serve import asgi
from kvtier.serve.errors import (APIError, add_error_handlers, error_response, invalid_json_message, sse_error,
                                 until_disconnect)

log = logging.getLogger(__name__)
_PATHS = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}
_PREFILL = {"completion": "/kvtier/prefill/completions", "chat": "/kvtier/prefill/chat"}


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
    def __init__(self, prefill: list[str], decode: list[str], api_key: str | None = None,
                 backend_api_key: str | None = None, timeout: float = 600.0, connect_timeout: float = 3.0,
                 health_interval: float = 2.0, max_body_bytes: int | None = asgi.DEFAULT_MAX_BODY_BYTES) -> None:
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
        self.routes = Counter("kvtier_router_requests", "requests by route: pd (P then D), colocated (D alone)",
                              ["route"], registry=r)
        self.fallbacks = Counter("kvtier_router_fallbacks", "requests served colocated on D instead of PD, by reason",
                                 ["reason"], registry=r)
        self.prefill_seconds = Histogram("kvtier_router_prefill_seconds", "P's answer time (prefill + pool writes)",
                                         registry=r)
        for route in ("pd", "colocated"):
            self.routes.labels(route)
        self.api = self._build()
        self.app = asgi.wrap(self.api, api_key, ("/v1/",), max_body_bytes)

    # ------------------------------------------------------------------ backends
    def _pick(self, role: str, exclude: set[str] = frozenset()) -> Backend | None:  # type: ignore[assignment]
        pool = self.prefill if role == "prefill" else self.decode
        cands = [b for b in pool if b.healthy and b.url not in exclude]
        if not cands:
            return None
        i = self._rr[role] % len(cands)
        self._rr[role] += 1
        return cands[i]

    async def _check(self, b: Backend) -> None:
        try:
            r = await self.client.get(b.url + "/health", timeout=httpx.Timeout(2.0))   # type: ignore[union-attr]
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
        app = FastAPI(title="kvtier router", version=__import__("kvtier").__version__,
                      description="OpenAI-compatible front of kvtier prefill and decode servers.")
        router = self

        @app.on_event("startup")
        async def _start() -> None:
            router.client = httpx.AsyncClient(timeout=router.timeout, headers=router.headers,
                                              limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256))
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
            return JSONResponse({"status": "ok", "role": "router", "decode_up": up,
                                 "prefill_up": [b.url for b in router.prefill if b.healthy]})

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(generate_latest(router.registry), media_type="text/plain; version=0.0.4; charset=utf-8")

        @app.get("/v1/models")
        async def models() -> Response:
            d = router._pick("decode")
            if d is None:
                return error_response(503, "no decode server is up")
            try:
                r = await router.client.get(d.url + "/v1/models")           # type: ignore[union-attr]
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
        except ValueError as e:                         # not UTF-8
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
        handoff, reason = await self._prefill(kind, body)
        if isinstance(handoff, Response):
            return handoff                                  # the client's error (4xx), from P
        if handoff is None:
            self.fallbacks.labels(reason).inc()
            self.routes.labels("colocated").inc()
            return await self._decode(kind, body, stream, None)
        self.routes.labels("pd").inc()
        body = dict(body, kvtier_handoff=handoff["handoff"])
        if stream and self._decode_recomputes():
            return StreamingResponse(self._relay_early(kind, body, handoff["chunks"]), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._decode(kind, body, stream, handoff["chunks"])

    def _decode_recomputes(self) -> bool:
        """Does every healthy D recompute what it misses (``pd_on_miss=recompute``, in its
        /health)? Then a hand-off cannot fail on D for the pool's sake, and a stream may start
        with P's first token before D answers."""
        up = [b for b in self.decode if b.healthy]
        return bool(up) and all(b.info.get("pd_on_miss") == "recompute" for b in up)

    async def _relay_early(self, kind: str, body: dict, first_chunks: list) -> AsyncIterator[bytes]:
        """P's first-token chunks at once, then D's stream; D's error, if it has one, as the
        stream's last event."""
        for c in first_chunks:
            yield f"data: {json.dumps(c, separators=(',', ':'))}\n\n".encode()
        r = await self._open_decode(kind, body)
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
            yield (sse_error(APIError(502, f"decode server answered {r.status_code}: {detail}"))
                   + "data: [DONE]\n\n").encode()
            return
        async for b in _relay(None, r):
            yield b

    async def _prefill(self, kind: str, body: dict) -> tuple[Any, str]:
        """P's half: (hand-off, "") or (None, why the request runs colocated) or (the client's
        error from P, "")."""
        tried: set[str] = set()
        reason = "no_prefill_server"
        while True:
            p = self._pick("prefill", tried)
            if p is None:
                return None, reason
            tried.add(p.url)
            t0 = time.monotonic()
            try:
                r = await self.client.post(p.url + _PREFILL[kind], json=dict(body, stream=False))   # type: ignore[union-attr]
            except httpx.HTTPError as e:
                log.warning("prefill server %s failed (%s); trying the next one", p.url, e)
                p.healthy = False
                reason = "prefill_down"
                continue
            if _clients_fault(r):
                return Response(r.content, status_code=r.status_code, media_type="application/json"), ""
            if r.status_code == 501:          # what a hand-off cannot carry (n > 1, logprobs, several
                return None, "not_handed_off"  # prompts): any P would say so; nothing is wrong with P
            if r.status_code != 200:
                log.warning("prefill server %s answered %d: %s", p.url, r.status_code, r.text[:200])
                reason = "prefill_error"
                continue
            self.prefill_seconds.observe(time.monotonic() - t0)
            res = r.json()
            m = res.get("manifest") or {}
            if not m.get("complete"):
                log.warning("prefill server %s could not write every block (%s failed): colocated on D",
                            p.url, m.get("failed_blocks"))
                return None, "prefill_write_failed"
            return {"chunks": res["chunks"], "handoff": {
                "namespace": m["namespace"], "keys": m["keys"], "num_tokens": m["num_tokens"],
                "first_token": res["first_token"], "prompt_token_ids": res["prompt_token_ids"],
                "prefill_cached_tokens": res.get("cached_tokens", 0), "response_id": res["id"],
                "created": res["created"]}}, ""

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
            req = self.client.build_request("POST", d.url + _PATHS[kind], json=body)   # type: ignore[union-attr]
            try:
                r = await self.client.send(req, stream=True)                         # type: ignore[union-attr]
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
            return Response(content, status_code=r.status_code,
                            media_type=r.headers.get("content-type", "application/json"))
        return StreamingResponse(_relay(first_chunks, r), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _relay(first_chunks: list | None, r: httpx.Response) -> AsyncIterator[bytes]:
    """P's first-token chunks, then D's stream as it comes."""
    try:
        for c in first_chunks or ():
            yield f"data: {json.dumps(c, separators=(',', ':'))}\n\n".encode()
        async for b in r.aiter_raw():
            yield b
    except httpx.HTTPError as e:       # D died mid-stream: say so, end the stream
        err = APIError(502, f"decode server failed mid-stream: {_describe(e)}")
        yield (sse_error(err) + "data: [DONE]\n\n").encode()
    finally:
        await r.aclose()


def _clients_fault(r: httpx.Response) -> bool:
    """P's answer is an error of the client's request (D would answer the same), not of P."""
    if r.status_code in (400, 413):
        return True
    if r.status_code == 404:                   # unknown model: named in the error's param
        try:
            return r.json()["error"]["param"] == "model"
        except (ValueError, KeyError, TypeError):
            return False
    return False


def _describe(e: Exception) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
