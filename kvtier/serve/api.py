"""The OpenAI-compatible HTTP API over an :class:`~kvtier.engine.async_engine.AsyncEngine`.

::

    POST /v1/completions, /v1/chat/completions   (stream: SSE chunks, then "data: [DONE]")
    GET  /v1/models, /health, /metrics
    POST /kvtier/prefill/{completions|chat}      role=prefill: run the prefill, write the prompt's
                                                 blocks to the pool, answer the first token's
                                                 stream chunks + the hand-off manifest (router)

One generation path serves every endpoint: prompt ids -> engine deltas -> :class:`TextStream`
(detokenization, stop strings) -> chunks; a non-streaming answer is the same chunks joined. A
``kvtier_handoff`` field (role=decode, sent by the router) starts the request from P's first
token: its chunks were already sent by the router, so D's stream continues after them.

Errors (OpenAI's ``{"error": {...}}``): 400 bad field (named) or prompt over the context, 401
wrong ``--api-key``, 404 unknown model or route, 502 PD blocks missing under ``--pd-on-miss
error``, 503 queue full or engine stopped.
"""
from __future__ import annotations

import asyncio
import base64
import json
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvtier.engine.async_engine import AsyncEngine, EngineDead, QueueFull
from kvtier.serve.detok import TextStream
from kvtier.serve.metrics import ServerMetrics, snapshot
from kvtier.serve.protocol import ChatCompletionRequest, CompletionRequest

log = logging.getLogger(__name__)
ROLES = ("colocated", "prefill", "decode")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type_: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type = type_ or {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                              502: "pd_handoff_error", 503: "overloaded_error"}.get(status, "server_error")


def error_response(status: int, message: str, param: str | None = None, type_: str | None = None) -> JSONResponse:
    e = APIError(status, message, param, type_)
    return JSONResponse({"error": {"message": e.message, "type": e.type, "param": e.param, "code": status}},
                        status_code=status)


def check_role(role: str, has_storage: bool) -> None:
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; choose {', '.join(ROLES)}")
    if role != "colocated" and not has_storage:
        raise ValueError(f"--role {role} hands KV over through a storage pool: give --storage URL "
                         "(and --num-host-blocks)")


def require_api_key(app: FastAPI, key: str | None, prefixes: tuple[str, ...]) -> None:
    """401 for requests under ``prefixes`` without ``Authorization: Bearer KEY`` (if a key is set)."""
    if not key:
        return
    expected = f"Bearer {key}".encode()

    @app.middleware("http")
    async def _auth(request: Request, call_next):  # type: ignore[no-untyped-def]
        if request.url.path.startswith(prefixes) and not secrets.compare_digest(
                request.headers.get("authorization", "").encode(), expected):
            return error_response(401, "invalid or missing API key (Authorization: Bearer KEY)")
        return await call_next(request)


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
    finish_reason: str | None = None


class Server:
    def __init__(self, engine: AsyncEngine, model_name: str, role: str = "colocated",
                 api_key: str | None = None) -> None:
        core = engine.core
        check_role(role, core.storage is not None)
        self.engine, self.model_name, self.role, self.api_key = engine, model_name, role, api_key
        self.tokenizer = core.tokenizer
        self.max_model_len = core.max_model_len
        self.metrics = ServerMetrics()
        self.app = self._build()

    # ------------------------------------------------------------------ app
    def _build(self) -> FastAPI:
        app = FastAPI(title="kvtier", version=__import__("kvtier").__version__,
                      description="OpenAI-compatible API of a kvtier engine (DESIGN §6).")
        server = self

        @app.exception_handler(RequestValidationError)
        async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
            errs = exc.errors()
            first = errs[0] if errs else {}
            loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or "body"
            msg = first.get("msg", "invalid request")
            return error_response(400, f"{loc}: {msg}", param=loc)

        @app.exception_handler(StarletteHTTPException)
        async def _http(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
            return error_response(exc.status_code, str(exc.detail))

        @app.exception_handler(APIError)
        async def _api(_request: Request, exc: APIError) -> JSONResponse:
            return error_response(exc.status, exc.message, exc.param, exc.type)

        @app.exception_handler(QueueFull)
        @app.exception_handler(EngineDead)
        async def _busy(_request: Request, exc: Exception) -> JSONResponse:
            return error_response(503, str(exc))

        require_api_key(app, server.api_key, ("/v1/", "/kvtier/"))

        @app.get("/health")
        async def health() -> Response:
            try:
                server.engine._check_alive()
            except EngineDead as e:
                return error_response(503, str(e))
            return JSONResponse({"status": "ok", "role": server.role})

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

    # ------------------------------------------------------------------ requests
    def _prompt_ids(self, kind: str, body: Any) -> list[int]:
        if body.kvtier_handoff is not None:
            return list(body.kvtier_handoff.prompt_token_ids)
        if kind == "completion":
            if isinstance(body.prompt, str):
                if self.tokenizer is None:
                    raise APIError(400, "this model has no tokenizer: send the prompt as token ids", "prompt")
                return self.tokenizer.encode(body.prompt, add_special_tokens=False)
            return list(body.prompt)
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, "this model has no chat template (tokenizer_config.json): use /v1/completions",
                           "messages")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=body.add_generation_prompt)
        except Exception as e:  # noqa: BLE001 - a template that rejects these messages is the client's 400
            raise APIError(400, f"the chat template cannot render these messages: {e}", "messages") from None
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _start(self, kind: str, body: Any, export: bool = False) -> _Gen:
        if body.model != self.model_name:
            raise APIError(404, f"model {body.model!r} is not served here (this server serves "
                                f"{self.model_name!r})", "model")
        handoff = body.kvtier_handoff
        if handoff is not None and self.role != "decode":
            raise APIError(400, f"kvtier_handoff is for servers with --role decode (this one is {self.role})",
                           "kvtier_handoff")
        ids = self._prompt_ids(kind, body)
        if kind == "chat":
            max_tokens = body.max_completion_tokens or body.max_tokens
            if max_tokens is None:
                max_tokens = max(1, self.max_model_len - len(ids))
        else:
            max_tokens = body.max_tokens
        if len(ids) + max_tokens > self.max_model_len:
            raise APIError(400, f"the prompt has {len(ids)} tokens and max_tokens={max_tokens}: together over "
                                f"the model's context of {self.max_model_len} tokens", "max_tokens")
        try:
            params = body.sampling_params(max_tokens)
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
            params = body.sampling_params(1)
        elif handoff is not None:
            extra["handoff"] = {"namespace": handoff.namespace, "keys": handoff.keys,
                                "num_tokens": handoff.num_tokens, "first_token": handoff.first_token}
        try:
            gen.req = self.engine.make_request(ids, params, body.cache_salt,
                                               f"{rid}-{secrets.token_hex(4)}", **extra)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        gen.stream = TextStream(self.tokenizer, body.stop_strings)
        return gen

    async def _deltas(self, gen: _Gen, replay: bool = False,
                      emit_replayed: bool = False) -> AsyncIterator[tuple[str, list[int]] | None]:
        """Text pieces of ``gen`` as they come, after one ``None`` once the engine produced its
        first delta (so that callers can answer errors before it with a status code); sets
        ``gen.output`` and ``gen.finish_reason`` at the end. ``replay``: D of a hand-off; P's
        first token is pushed through the text stream first (emitted only if ``emit_replayed``:
        a streaming client got it from the router already)."""
        stream = gen.stream
        assert stream is not None
        skip = 0
        if replay:
            piece = stream.push(gen.req.output_token_ids[:1])
            skip = 1
            if emit_replayed:
                yield piece, gen.req.output_token_ids[:1]
            if stream.stopped:
                gen.finish_reason = "stop"
                return
        t_prev = None
        started = False
        try:
            agen = self.engine.generate(gen.req)
            async for delta in agen:
                out = delta.output
                if out is not None and out.finish_reason == "error":
                    self.metrics.finished(out, "error")
                    raise APIError(502, out.error or "PD hand-off failed")
                if not started:
                    started = True
                    yield None
                toks = delta.token_ids[skip:]
                skip = max(0, skip - len(delta.token_ids))
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
                    await agen.aclose()          # aborts the engine request
                    return
                if out is not None:
                    gen.output = out
            out = gen.output
            piece = stream.finish()
            if piece:
                yield piece, []
            gen.finish_reason = out.finish_reason
            m = out.metrics or {}
            if "first_token" in m and not replay:
                self.metrics.ttft.observe(m["first_token"] - m["arrival"])
            self.metrics.finished(out, gen.finish_reason)
        except (QueueFull, EngineDead) as e:      # raised as an APIError: said in-stream if streaming
            raise APIError(503, str(e)) from None

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
        n_out = len(out.token_ids) if out is not None else len(gen.req.output_token_ids)
        h = gen.body.kvtier_handoff
        cached = h.prefill_cached_tokens if h is not None else (out.num_cached_tokens if out is not None else 0)
        return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out,
                "prompt_tokens_details": {"cached_tokens": cached}}

    async def _sse(self, gen: _Gen, first: Any, rest: AsyncIterator[str | None], replay: bool) -> AsyncIterator[str]:
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
            yield _data({"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.status}})
        finally:                        # a client that went away: its engine request is aborted
            await rest.aclose()
        yield "data: [DONE]\n\n"

    async def respond(self, kind: str, body: Any, request: Request) -> Response:
        gen = self._start(kind, body)
        replay = body.kvtier_handoff is not None
        pieces = self._deltas(gen, replay, emit_replayed=not body.stream)
        if body.stream:
            # wait for the engine's first delta here: errors before it (queue full, a PD miss
            # under --pd-on-miss error) are a status code, not an in-stream error
            try:
                first = await _until_disconnect(request, _next(pieces))
            except BaseException:
                await pieces.aclose()
                raise
            return StreamingResponse(self._sse(gen, first, pieces, replay), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

        async def collect() -> str:
            return "".join([p[0] async for p in pieces if p])
        text = await _until_disconnect(request, collect())
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
        gen = self._start(kind, body, export=True)
        chunks = []
        if kind == "chat":
            chunks.append(self._chunk(gen, {"role": "assistant", "content": ""}))
        out = None

        async def run() -> Any:
            async for delta in self.engine.generate(gen.req):
                if delta.output is not None:
                    return delta.output
            return None
        out = await _until_disconnect(request, run())
        piece = gen.stream.push(out.token_ids[:1])                # type: ignore[union-attr]
        if piece or body.return_token_ids:
            c = self._chunk(gen, {"content": piece}, piece)
            if body.return_token_ids:
                c["choices"][0]["token_ids"] = out.token_ids[:1]
            chunks.append(c)
        m = out.metrics or {}
        if "first_token" in m:
            self.metrics.ttft.observe(m["first_token"] - m["arrival"])
        self.metrics.finished(out, "prefill")
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


async def _until_disconnect(request: Request, coro: Any) -> Any:
    """Await ``coro``; if the client goes away first, cancel it (which aborts its request)."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise APIError(499, "client disconnected")
    finally:
        if not task.done():
            task.cancel()
