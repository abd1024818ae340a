"""The OpenAI-compatible HTTP API over an :class:`~kvtier.engine.async_engine.AsyncEngine`.

::

    POST /v1/completions, /v1/chat/completions   (stream: SSE chunks, then "data: [DONE]")
    GET  /v1/models, /metrics, /kvtier/stats
    GET  /health                                 engine alive + the storage pool's state (no engine call)
    POST /kvtier/prefill/{completions|chat}      role=prefill: run the prefill, write the prompt's
                                                 blocks to the pool, answer the first token's
                                                 stream chunks + the hand-off manifest (router)

The app runs behind the pure ASGI layers of ``asgi.py`` (API key, body cap). One generation path
serves every endpoint: prompt ids (tokenized off the event loop, ``prompts.py``) -> engine deltas
-> :class:`TextStream` (detokenization, stop strings) -> chunks; a non-streaming answer is the same chunks joined. A
``kvtier_handoff`` field (role=decode, sent by the router) starts the request from P's first
token: its chunks were already sent by the router, so D's stream continues after them.

Errors (OpenAI's ``{"error": {...}}``, ``errors.py``): 400 bad field (named), prompt over the
context, invalid JSON or an engine ValueError; 401 wrong ``--api-key``; 404 unknown model or route;
413 body over ``--max-body-bytes``; 500 a request that failed inside the engine (that request
only: the engine goes on); 502 PD blocks missing under ``--pd-on-miss error``; 503 queue full or
engine stopped. Once a stream has started, an error is an in-stream ``{"error": ...}`` event.
A client that goes away (before or during its answer) has its engine request aborted.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Iterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvtier.engine.async_engine import AsyncEngine, EngineDead, QueueFull
from kvtier.serve import asgi
from kvtier.engine.detok import TextStream
from kvtier.serve.errors import APIError, add_error_handlers, error_body, error_response, sse_error, until_disconnect
from kvtier.serve.metrics import ServerMetrics, snapshot
from kvtier.serve.prompts import PromptTokenizer
from kvtier.serve.protocol import ChatCompletionRequest, CompletionRequest

log = logging.getLogger(__name__)
ROLES = ("colocated", "prefill", "decode")


def check_role(role: str, has_storage: bool) -> None:
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; choose {', '.join(ROLES)}")
    if role != "colocated" and not has_storage:
        raise ValueError(f"--role {role} hands KV over through a storage pool: give --storage URL "
                         "(and --num-host-blocks)")


@dataclass
class _Gen:
    """One request through the generation path."""
    kind: str                          # "completion" | "chat"
    body: Any
    rid: str
    created: int
    model: str
    req: Any = None
    stream: TextStream | None = None
    output: Any = None
    finish_reason: str | None = None   # None at the end: aborted (the client went away)
    num_generated: int = 0             # tokens received so far (an aborted request's count)


class Server:
    """The FastAPI app of one engine; ``app`` is it behind the ASGI layers (what uvicorn runs)."""

    def __init__(self, engine: AsyncEngine, model_name: str, role: str = "colocated",
                 api_key: str | None = None, max_body_bytes: int | None = asgi.DEFAULT_MAX_BODY_BYTES,
                 require_cache_salt: bool = False) -> None:
        core = engine.core
        check_role(role, core.storage is not None)
        self.engine, self.model_name, self.role = engine, model_name, role
        self.require_cache_salt = require_cache_salt
        self.tokenizer = core.tokenizer
        self.max_model_len = core.max_model_len
        self.prompts = PromptTokenizer(core.tokenizer, core.max_model_len)
        self.metrics = ServerMetrics()
        self.api = self._build()
        self.app = asgi.wrap(self.api, api_key, ("/v1/", "/kvtier/"), max_body_bytes)

    def close(self) -> None:
        self.prompts.close()

    # ------------------------------------------------------------------ app
    def _build(self) -> FastAPI:
        app = FastAPI(title="kvtier", version=__import__("kvtier").__version__,
                      description="OpenAI-compatible API of a kvtier engine (DESIGN §6).")
        server = self
        add_error_handlers(app)

        @app.exception_handler(QueueFull)
        @app.exception_handler(EngineDead)
        async def _busy(_request: Request, exc: Exception) -> JSONResponse:
            return error_response(503, str(exc))

        @app.get("/health")
        async def health() -> Response:
            return server.health()

        @app.get("/v1/models")
        async def models() -> dict:
            return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": 0,
                                                "owned_by": "kvtier", "max_model_len": server.max_model_len,
                                                "kvtier_role": server.role}]}

        @app.get("/metrics")
        async def metrics() -> Response:
            stats = await server.engine.call(snapshot)
            body = server.metrics.render(stats, server.engine.num_running, server.engine.num_waiting)
            return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

        @app.get("/kvtier/stats")
        async def stats() -> Response:
            """The engine's cache_stats() (every tier, storage client, cost model) as JSON."""
            s = await server.engine.call(lambda core: core.cache_stats())
            return Response(json.dumps(s, default=str), media_type="application/json")

        @app.post("/v1/completions")
        async def completions(body: CompletionRequest, request: Request) -> Response:
            return await server.respond("completion", body, request)

        @app.post("/v1/chat/completions")
        async def chat(body: ChatCompletionRequest, request: Request) -> Response:
            return await server.respond("chat", body, request)

        @app.post("/kvtier/prefill/completions")
        async def prefill_completions(body: CompletionRequest, request: Request) -> Response:
            return await server.prefill("completion", body, request)

        @app.post("/kvtier/prefill/chat")
        async def prefill_chat(body: ChatCompletionRequest, request: Request) -> Response:
            return await server.prefill("chat", body, request)

        return app

    # ------------------------------------------------------------------ health
    def pool_health(self) -> dict | None:
        """The storage client's own view (breaker state + its background probe): no I/O here, no
        call into the engine thread, so /health answers in milliseconds. None without a pool."""
        storage = getattr(self.engine.core, "storage", None)
        if storage is None:
            return None
        probe = getattr(storage, "health", None)
        if not callable(probe):
            return {"ok": True, "reason": "this storage client does not report its health"}
        try:
            return dict(probe())
        except Exception as e:  # noqa: BLE001 - a health probe that fails says the pool is not ok
            return {"ok": False, "reason": f"{type(e).__name__}: {e}"}

    def health(self) -> JSONResponse:
        """200 ok; 200 "degraded" (colocated without its pool: it recomputes); 503 engine stopped,
        or prefill/decode without its pool (no hand-off works). ``engine`` says whether requests
        can still run here: the router keeps sending a decode server colocated requests then."""
        try:
            self.engine._check_alive()
        except EngineDead as e:
            return JSONResponse(error_body(503, str(e)) | {"status": "unavailable", "role": self.role,
                                                           "engine": "stopped"}, status_code=503)
        pool = self.pool_health()
        body = {"status": "ok", "role": self.role, "engine": "ok", "pool": pool}
        if pool is None or pool.get("ok", True):
            return JSONResponse(body)
        reason = f"the storage pool is unreachable: {pool.get('reason') or 'no reason given'}"
        if self.role == "colocated":
            return JSONResponse(body | {"status": "degraded", "reason": reason})
        return JSONResponse(error_body(503, f"{reason} (--role {self.role} needs it)") | body
                            | {"status": "unavailable", "reason": reason}, status_code=503)

    # ------------------------------------------------------------------ requests
    async def _prompt_ids(self, kind: str, body: Any, budget: int) -> list[int]:
        if body.kvtier_handoff is not None:
            return list(body.kvtier_handoff.prompt_token_ids)
        if kind == "completion":
            return await self.prompts.completion_ids(body.prompt, budget)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        return await self.prompts.chat_ids(messages, body.add_generation_prompt, budget)

    async def _start(self, kind: str, body: Any, export: bool = False) -> _Gen:
        if body.model != self.model_name:
            raise APIError(404, f"model {body.model!r} is not served here (this server serves "
                                f"{self.model_name!r})", "model")
        handoff = body.kvtier_handoff
        if handoff is not None and self.role != "decode":
            raise APIError(400, f"kvtier_handoff is for servers with --role decode (this one is {self.role})",
                           "kvtier_handoff")
        if self.require_cache_salt and not body.cache_salt:
            raise APIError(400, "this server requires a cache_salt on every request (--require-cache-salt): "
                                "prefix-cache hits are shared only between requests with the same salt",
                           "cache_salt")
        asked = body.max_tokens
        if kind == "chat" and body.max_completion_tokens is not None:
            asked = body.max_completion_tokens
        ids = await self._prompt_ids(kind, body, self.max_model_len - (asked or 1))
        max_tokens = asked if asked is not None else max(1, self.max_model_len - len(ids))   # null: the rest
        if len(ids) + max_tokens > self.max_model_len:
            raise APIError(400, f"the prompt has {len(ids)} tokens and max_tokens={max_tokens}: together over "
                                f"the model's context of {self.max_model_len} tokens", "max_tokens")
        try:
            params = body.sampling_params(1 if export else max_tokens)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
        rid = (handoff.response_id if handoff is not None and handoff.response_id else
               prefix + secrets.token_hex(12))
        created = handoff.created if handoff is not None and handoff.created else int(time.time())
        gen = _Gen(kind, body, rid, created, self.model_name)
        extra: dict[str, Any] = {}
        if export:
            extra["export"] = True
        elif handoff is not None:
            extra["handoff"] = {"namespace": handoff.namespace, "keys": handoff.keys,
                                "num_tokens": handoff.num_tokens, "first_token": handoff.first_token}
        try:
            # validates every id against the vocabulary: O(prompt), so off the event loop too
            gen.req = await asyncio.to_thread(self.engine.make_request, ids, params, body.cache_salt,
                                              f"{rid}-{secrets.token_hex(4)}", **extra)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        gen.stream = TextStream(self.tokenizer, body.stop_strings, skip_special_tokens=body.skip_special_tokens)
        return gen

    def _failure(self, out: Any) -> APIError:
        """The error of a failed output: a PD hand-off that could not be served (502), or a step
        that raised inside the engine (500: this request only, the engine goes on)."""
        if getattr(out, "error_kind", None) == "handoff":
            return APIError(502, out.error or "PD hand-off failed")
        log.error("request %s failed inside the engine: %s", out.request_id, out.error)
        return APIError(500, f"the request failed inside the engine: {out.error or 'unknown error'}")

    def _account(self, gen: _Gen) -> None:
        """Count a request that reached the engine, however it ended (finish reason None: aborted)."""
        out = gen.output
        n_out = len(out.token_ids) if out is not None else gen.num_generated
        self.metrics.finished(gen.finish_reason or "abort", len(gen.req.prompt_token_ids), n_out, out)

    @contextlib.contextmanager
    def _engine_errors(self, gen: _Gen) -> Iterator[None]:
        """Around a request's time in the engine: its errors as API errors, and the request counted
        once however it ends (an abort included), unless the engine never admitted it."""
        refused = False
        try:
            yield
        except QueueFull as e:
            refused = True
            raise APIError(503, str(e)) from None
        except ValueError as e:                  # the engine refused it (e.g. a duplicate request id)
            refused = True
            raise APIError(400, str(e)) from None
        except EngineDead as e:                  # an APIError: said in-stream if streaming
            gen.finish_reason = "error"
            raise APIError(503, str(e)) from None
        finally:
            if not refused:
                self._account(gen)

    async def _deltas(self, gen: _Gen, replay: bool = False,
                      emit_replayed: bool = False) -> AsyncIterator[tuple[str, list[int]] | None]:
        """Text pieces of ``gen`` as they come, after one ``None`` once the engine produced its
        first delta (so that callers can answer errors before it with a status code); sets
        ``gen.output`` and ``gen.finish_reason`` at the end. ``replay``: D of a hand-off; P's
        first token is pushed through the text stream first (emitted only if ``emit_replayed``:
        a streaming client got it from the router already). Closing it early (a client that went
        away) aborts the engine request; every request that reached the engine is counted once."""
        stream = gen.stream
        assert stream is not None
        skip = 0
        with self._engine_errors(gen):
            if replay:
                first = gen.req.output_token_ids[:1]
                gen.num_generated = skip = 1
                piece = stream.push(first)
                if emit_replayed:
                    yield piece, first
                if stream.stopped:
                    gen.finish_reason = "stop"
                    return
            t_prev = None
            started = False
            agen = self.engine.generate(gen.req)
            try:
                async for delta in agen:
                    out = delta.output
                    if out is not None and out.finish_reason == "error":
                        gen.output, gen.finish_reason = out, "error"
                        raise self._failure(out)
                    if not started:
                        started = True
                        yield None
                    toks = delta.token_ids[skip:]
                    skip = max(0, skip - len(delta.token_ids))
                    gen.num_generated += len(toks)
                    now = time.monotonic()
                    if toks and t_prev is not None:
                        self.metrics.itl.observe((now - t_prev) / len(toks))
                    if toks:
                        t_prev = now
                    piece = stream.push(toks)
                    if piece or toks:
                        yield piece, toks
                    if stream.stopped:
                        gen.finish_reason = "stop"
                        return                   # the finally below aborts the engine request
                    if out is not None:
                        gen.output = out
            finally:
                await agen.aclose()
            out = gen.output
            gen.finish_reason = out.finish_reason
            m = out.metrics or {}
            if "first_token" in m and not replay:
                self.metrics.ttft.observe(m["first_token"] - m["arrival"])
            piece = stream.finish()
            if piece:
                yield piece, []

    # ------------------------------------------------------------------ response shapes
    def _chunk(self, gen: _Gen, delta: dict | None = None, text: str | None = None,
               finish: str | None = None) -> dict:
        if gen.kind == "chat":
            choice: dict[str, Any] = {"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            obj = "text_completion"
        return {"id": gen.rid, "object": obj, "created": gen.created, "model": gen.model, "choices": [choice]}

    def _extras(self, gen: _Gen, choice: dict) -> None:
        out = gen.output
        if out is not None and out.routed_experts is not None:
            r = out.routed_experts
            choice["routed_experts"] = {"dtype": str(r.dtype), "shape": list(r.shape),
                                        "data": base64.b64encode(r.tobytes()).decode()}

    def _usage(self, gen: _Gen) -> dict:
        out = gen.output
        n_prompt = len(gen.req.prompt_token_ids)
        n_out = len(out.token_ids) if out is not None else gen.num_generated
        h = gen.body.kvtier_handoff
        cached = h.prefill_cached_tokens if h is not None else (out.num_cached_tokens if out is not None else 0)
        return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out,
                "prompt_tokens_details": {"cached_tokens": cached}}

    async def _sse(self, gen: _Gen, first: Any, rest: AsyncIterator[Any], replay: bool) -> AsyncIterator[str]:
        try:
            if gen.kind == "chat" and not replay:
                yield _data(self._chunk(gen, {"role": "assistant", "content": ""}))
            ids = gen.body.return_token_ids
            async for item in _prepend(first, rest):
                if item is None:
                    continue
                piece, toks = item
                if piece or (ids and toks):
                    c = self._chunk(gen, {"content": piece}, piece)
                    if ids:
                        c["choices"][0]["token_ids"] = toks
                    yield _data(c)
            last = self._chunk(gen, {}, "", gen.finish_reason)
            self._extras(gen, last["choices"][0])
            yield _data(last)
            so = gen.body.stream_options
            if so is not None and so.include_usage:
                usage = self._chunk(gen)
                usage["choices"] = []
                usage["usage"] = self._usage(gen)
                yield _data(usage)
        except APIError as e:           # mid-stream: the status is sent; say it in the stream
            yield sse_error(e)
        finally:                        # a client that went away: its engine request is aborted
            await rest.aclose()
        yield "data: [DONE]\n\n"

    async def respond(self, kind: str, body: Any, request: Request) -> Response:
        gen = await self._start(kind, body)
        replay = body.kvtier_handoff is not None
        pieces = self._deltas(gen, replay, emit_replayed=not body.stream)
        if body.stream:
            # wait for the engine's first delta here: errors before it (queue full, a PD miss
            # under --pd-on-miss error) are a status code, not an in-stream error
            try:
                first = await until_disconnect(request, _next(pieces))
            except BaseException:
                await pieces.aclose()
                raise
            return StreamingResponse(self._sse(gen, first, pieces, replay), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

        async def collect() -> str:
            return "".join([p[0] async for p in pieces if p])
        text = await until_disconnect(request, collect())
        if kind == "chat":
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                      "logprobs": None, "finish_reason": gen.finish_reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": gen.finish_reason}
            obj = "text_completion"
        self._extras(gen, choice)
        if body.return_token_ids:
            choice["token_ids"] = list(gen.output.token_ids) if gen.output is not None else []
        return JSONResponse({"id": gen.rid, "object": obj, "created": gen.created, "model": gen.model,
                             "choices": [choice], "usage": self._usage(gen)})

    async def prefill(self, kind: str, body: Any, request: Request) -> Response:
        """P of a PD hand-off: the prefill, its blocks written to the pool, the first token's chunks."""
        if self.role != "prefill":
            raise APIError(404, f"/kvtier/prefill is served by --role prefill (this server is {self.role})")
        if body.kvtier_handoff is not None:
            raise APIError(400, "a prefill request cannot carry kvtier_handoff", "kvtier_handoff")
        gen = await self._start(kind, body, export=True)
        chunks = []
        if kind == "chat":
            chunks.append(self._chunk(gen, {"role": "assistant", "content": ""}))

        async def run() -> Any:
            with self._engine_errors(gen):
                async for delta in self.engine.generate(gen.req):
                    if delta.output is not None:
                        gen.output = delta.output
                        gen.finish_reason = "error" if delta.output.finish_reason == "error" else "prefill"
                        return delta.output
            return None
        out = await until_disconnect(request, run())
        if out is None or out.finish_reason == "error" or not out.token_ids:
            raise self._failure(out) if out is not None else APIError(500, "the prefill produced no output")
        piece = gen.stream.push(out.token_ids[:1])                # type: ignore[union-attr]
        if piece or body.return_token_ids:
            c = self._chunk(gen, {"content": piece}, piece)
            if body.return_token_ids:
                c["choices"][0]["token_ids"] = out.token_ids[:1]
            chunks.append(c)
        m = out.metrics or {}
        if "first_token" in m:
            self.metrics.ttft.observe(m["first_token"] - m["arrival"])
        return JSONResponse({"id": gen.rid, "created": gen.created, "chunks": chunks,
                             "prompt_token_ids": out.prompt_token_ids, "first_token": out.token_ids[0],
                             "cached_tokens": out.num_cached_tokens, "manifest": out.handoff})


def _data(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


_END = object()


async def _next(it: AsyncIterator[Any]) -> Any:
    try:
        return await it.__anext__()
    except StopAsyncIteration:
        return _END


async def _prepend(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    if first is _END:
        return
    yield first
    async for e in rest:
        yield e
