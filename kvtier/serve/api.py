"""The OpenAI-compatible HTTP API over an engine's :class:`~kvtier.engine.client.EngineClient`.

::

    POST /v1/completions, /v1/chat/completions   (stream: SSE chunks, then "data: [DONE]")
    GET  /v1/models, /metrics, /kvtier/stats
    GET  /health                                 engine alive + the storage pool's state (no engine call)
    POST /kvtier/prefill/{completions|chat}      role=prefill: run the prefill, write the prompt's
                                                 blocks to the pool, answer the first token's
                                                 stream chunks + the hand-off manifest (router)

The app runs behind the pure ASGI layers of ``asgi.py`` (API key, body cap). One generation path
serves every endpoint::

    a call (one HTTP request) ─ prompts (tokenized off the event loop, ``prompts.py``) ─► one engine
    request per prompt, run concurrently, each with n samples ─► choices, index = prompt * n + sample
    engine deltas (per sample) ─► the choice's text (``choice_text.py``: the engine's stop-string
              matcher, what may begin a stop string held back) ─► pieces
    pieces ─► SSE chunks ({"index": i, ...} of whichever choice has new text; each choice's last
              chunk carries its finish_reason) | the whole answer, built from the choices at the end

The engine matches stop strings itself (``SamplingParams.stop``); the server runs the same
matcher on the same tokens (its text is the engine's) and holds back text that may begin a stop
string, so no stop-string text is ever sent. Logprobs are shaped by
``logprobs.py``; completions' ``echo`` puts the prompt's text (and with logprobs, its tokens'
logprobs from ``prompt_logprobs``) before each choice's. ``usage`` counts each prompt once and the
tokens of every choice; its ``cached_tokens`` are the prompt tokens this engine did not compute,
and ``usage.kvtier`` has them per tier (on D of a hand-off, P's too). A ``kvtier_handoff`` field
(role=decode, sent by the router) starts the request from P's first token: its chunks were
already sent by the router, so D's stream continues after them; a hand-off carries one prompt
and one sample without logprobs (P answers 501 to others, and the router runs them colocated).

Errors (OpenAI's ``{"error": {...}}``, ``errors.py``): 400 bad field (named), prompt over the
context, invalid JSON or an engine ValueError; 401 wrong ``--api-key``; 404 unknown model or route;
413 body over ``--max-body-bytes``; 500 a request that failed inside the engine (that request
only: the engine goes on); 502 PD blocks missing under ``--pd-on-miss error``; 503 queue full or
engine stopped. Once a stream has started, an error is an in-stream ``{"error": ...}`` event.
A client that goes away (before or during its answer) has every engine request of its call
aborted; so has a call one of whose requests failed.

Over 600 lines: the one generation path every route shares (prompts, engine requests, choices,
SSE chunks, whole answers, PD prefill) is kept in one place; SGLang's routes (sglang.py), the
tokenizer routes (tokenize.py), bodies (body.py) and logprobs (logprobs.py) are apart.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import logging
import os
import secrets
import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, AsyncGenerator, AsyncIterator, Iterable, Iterator

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvtier.cache.manager import TIERS
from kvtier.engine.client import EngineClient
from kvtier.engine.params import SamplingParams
from kvtier.engine.wire import (
    CachedTokens,
    EngineDead,
    EngineRequest,
    FirstTokenStages,
    QueueFull,
    RequestDelta,
    first_token_stages,
)
from kvtier.model.hub import name_form, same_name
from kvtier.redact import redact
from kvtier.serve import asgi, sglang, tokenize
from kvtier.serve.body import body_schema, parse, with_schemas
from kvtier.serve.choice_text import ChoiceText
from kvtier.serve.errors import APIError, add_error_handlers, error_body, error_response, sse_error, until_disconnect
from kvtier.serve.logprobs import TokenStrings, chat_logprobs, completion_logprobs
from kvtier.serve.media import IMAGE_MARK, Images, MediaPolicy, message_images
from kvtier.serve.metrics import ServerMetrics
from kvtier.serve.prompts import PromptTokenizer
from kvtier.serve.protocol import MAX_LOGPROB_ENTRIES, ChatCompletionRequest, CompletionRequest, sampling_param
from kvtier.serve.streams import END, next_or_end, prepend

log = logging.getLogger(__name__)
# Work smaller than this runs on the event loop; larger goes to a worker thread, so that it never
# holds the loop (every other client's stream) for long. Small work stays: each hop to a thread and
# back waits for the GIL, up to the 5 ms switch interval when the loop is busy, twice a request
# (a 4K-token device hit answered in 16 ms instead of 5 on a 2-core x86 VM).
INLINE_BYTES = 64 * 1024  # request body: msgspec + pydantic, well under a millisecond
INLINE_TOKENS = 16 * 1024  # prompt ids checked against the vocabulary
INLINE_ENTRIES = 16 * 1024  # values of a whole answer (tokens x logprobs): built on the loop below this
WRITE_BYTES = 256 * 1024  # a large answer is written in parts of about this size
ROLES = ("colocated", "prefill", "decode")
# what /health shows of the pool without --expose-config: its state, never its address or errors
PUBLIC_POOL_FIELDS = ("ok", "breaker_open", "failures_in_a_row", "last_error_s_ago", "last_ok_s_ago")


# the moment the server's ASGI app received the HTTP request being served (time.monotonic(), this
# process's clock): where its TTFT starts
_ARRIVAL: ContextVar[float | None] = ContextVar("kvtier_arrival", default=None)


class _Arrival:
    """The outermost ASGI layer of a server: notes when each HTTP request arrived (``_ARRIVAL``,
    which the request's handler and its response's body see: they run in its context)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            _ARRIVAL.set(time.monotonic())
        await self.app(scope, receive, send)


def check_role(role: str, has_storage: bool) -> None:
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; choose {', '.join(ROLES)}")
    if role != "colocated" and not has_storage:
        raise ValueError(f"--role {role} hands KV over through a storage pool: give --storage URL (and --num-host-blocks)")


@dataclass(eq=False)
class _Choice:
    """One choice of an answer: sample ``sample`` of its prompt (``index`` = prompt * n + sample)."""

    index: int
    sample: int
    stream: ChoiceText
    echo: str = ""  # completions' echo: the prompt's text, before the choice's
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # per token of token_ids (logprobs asked)
    finish_reason: str | None = None
    offset: int = 0  # text offset of the next token (completions' logprobs)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclass(eq=False)
class _Gen:
    """One engine request of a call: one prompt, its n samples."""

    req: EngineRequest
    choices: list[_Choice]
    output: Any = None
    finish_reason: str | None = None  # None at the end: aborted (the client went away)
    num_generated: int = 0  # tokens received so far, every sample (an aborted request's count)
    cached: CachedTokens | None = None  # prompt tokens not computed (and by tier), from the first delta on
    sent: float = 0.0  # monotonic: handed to the engine
    stages: FirstTokenStages | None = None  # the engine's, with its first token
    unwritten: bool = False  # a stream's first token came, its chunk is not written yet (TTFT then)


@dataclass(eq=False)
class _Call:
    """One HTTP request: one engine request per prompt."""

    kind: str  # "completion" | "chat"
    body: Any
    rid: str
    created: int
    model: str
    gens: list[_Gen]
    echo_only: bool = False  # echo with max_tokens=0: nothing generated is shown
    arrival: float = 0.0  # monotonic: the HTTP request received (TTFT starts here)

    @property
    def choices(self) -> list[_Choice]:
        return [c for g in self.gens for c in g.choices]

    @property
    def logprobs(self) -> bool:
        return self.body.engine_logprobs is not None

    def gen_of(self, choice: _Choice) -> _Gen:
        return self.gens[choice.index // self.body.n]


@dataclass(eq=False, slots=True)
class _Piece:
    """New text and tokens of one choice; ``end``: the choice's last (its finish_reason is set)."""

    choice: _Choice
    text: str
    token_ids: list[int]
    logprobs: list | None
    end: bool = False


class Server:
    """The FastAPI app of one engine; ``app`` is it behind the ASGI layers (what uvicorn runs)."""

    def __init__(
        self,
        engine: EngineClient,
        model_name: str,
        role: str = "colocated",
        api_key: str | None = None,
        max_body_bytes: int | None = asgi.DEFAULT_MAX_BODY_BYTES,
        require_cache_salt: bool = False,
        aliases: tuple[str, ...] = (),
        expose_config: bool = False,
        media: MediaPolicy | None = None,
    ) -> None:
        """``model_name``: the name /v1/models lists; requests may also name the model by one of
        ``aliases`` (the path or hub id it was started with, its directory), as vLLM users do.
        ``expose_config``: ``/health`` (which needs no key) shows the model's path and the pool's
        address and errors too; else only states and counts. ``media``: where image URLs may
        point (vision-language models; default: data: URLs only)."""
        limits = engine.limits
        check_role(role, limits.has_pool)
        self.engine, self.model_name, self.role = engine, model_name, role
        self.model_names = frozenset((model_name, *aliases))
        self._name_forms = frozenset(map(name_form, self.model_names))
        self.require_cache_salt = require_cache_salt
        self.expose_config = expose_config
        self.tokenizer = engine.tokenizer
        self.max_model_len = limits.max_model_len
        self.vocab_size = limits.vocab_size  # prompt ids must be below it
        self.model_path = os.path.abspath(engine.path)  # (a client elsewhere loads the tokenizer from it)
        self.prompts = PromptTokenizer(engine.tokenizer, limits.max_model_len)
        self.images = Images(engine.path, limits, media or MediaPolicy()) if limits.image_tokens else None
        if self.images is not None:
            self.prompts.image_token_id = limits.image_token_id
        self.strings = TokenStrings(engine.tokenizer)
        self.metrics = ServerMetrics()
        self.created = int(time.time())  # /v1/models' created: when this server started serving
        self.api = self._build()
        self.app = _Arrival(
            asgi.FastGet(
                asgi.wrap(self.api, api_key, ("/v1/", "/kvtier/", *tokenize.KEY_PATHS, *sglang.KEY_PATHS), max_body_bytes),
                "/health",
                self.health,
            )
        )

    def close(self) -> None:
        self.prompts.close()

    def serves(self, name: str) -> bool:
        """Whether a request naming the model ``name`` is for this server (its served name or an
        alias, a path spelled with a trailing slash or ``./`` included: model/hub.py)."""
        return same_name(name, self.model_names, self._name_forms)

    # ------------------------------------------------------------------ app
    def _build(self) -> FastAPI:
        app = FastAPI(
            title="kvtier",
            version=__import__("kvtier").__version__,
            description="OpenAI-compatible API of a kvtier engine (DESIGN §6).",
        )
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
            return {
                "object": "list",
                "data": [
                    {
                        "id": server.model_name,
                        "object": "model",
                        "created": server.created,
                        "owned_by": "kvtier",
                        "root": server.model_path,
                        "parent": None,
                        "permission": [],
                        "max_model_len": server.max_model_len,
                        "vocab_size": server.vocab_size,
                        "kvtier_role": server.role,
                    }
                ],
            }

        @app.get("/metrics")
        async def metrics() -> Response:
            stats = await server.engine.call("metrics")
            body = server.metrics.render(stats, server.engine.num_running, server.engine.num_waiting)
            return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

        @app.get("/kvtier/stats")
        async def stats() -> Response:
            """The engine's cache_stats() (every tier, storage client, cost model) as JSON."""
            s = await server.engine.call("cache_stats")
            return Response(json.dumps(redact(s), default=str), media_type="application/json")

        @app.get("/kvtier/kv_events")
        async def kv_events(since: int = 0) -> Response:
            """KV events after number ``since`` (cache/events.py; docs/SERVING.md, "KV events")."""
            if not 0 <= since < 2**62:
                return error_response(400, f"since must be an event number >= 0, got {since}", "since")
            return JSONResponse(await server.engine.call("kv_events", since))

        @app.get("/kvtier/kv_events/snapshot")
        async def kv_snapshot() -> Response:
            """Every block held per tier, the last event number it includes, and the keying."""
            return JSONResponse(await server.engine.call("kv_snapshot"))

        completion_body, chat_body = server._body(CompletionRequest), server._body(ChatCompletionRequest)

        @app.post("/v1/completions", openapi_extra=body_schema(CompletionRequest))
        async def completions(request: Request, body: CompletionRequest = Depends(completion_body)) -> Response:
            return await server.respond("completion", body, request)

        @app.post("/v1/chat/completions", openapi_extra=body_schema(ChatCompletionRequest))
        async def chat(request: Request, body: ChatCompletionRequest = Depends(chat_body)) -> Response:
            return await server.respond("chat", body, request)

        @app.post("/kvtier/prefill/completions", openapi_extra=body_schema(CompletionRequest))
        async def prefill_completions(request: Request, body: CompletionRequest = Depends(completion_body)) -> Response:
            return await server.prefill("completion", body, request)

        @app.post("/kvtier/prefill/chat", openapi_extra=body_schema(ChatCompletionRequest))
        async def prefill_chat(request: Request, body: ChatCompletionRequest = Depends(chat_body)) -> Response:
            return await server.prefill("chat", body, request)

        tokenize_body, detokenize_body = server._body(tokenize.TokenizeRequest), server._body(tokenize.DetokenizeRequest)

        @app.post("/tokenize", openapi_extra=body_schema(tokenize.TokenizeRequest))
        async def tokenize_(body: tokenize.TokenizeRequest = Depends(tokenize_body)) -> dict:
            return await tokenize.tokenize(server, body)

        @app.post("/detokenize", openapi_extra=body_schema(tokenize.DetokenizeRequest))
        async def detokenize_(body: tokenize.DetokenizeRequest = Depends(detokenize_body)) -> dict:
            return await tokenize.detokenize(server, body)

        @app.get("/tokenizer_info")
        async def tokenizer_info() -> dict:
            return tokenize.tokenizer_info(server)

        @app.post("/reset_prefix_cache")
        @app.api_route("/flush_cache", methods=["GET", "POST"])
        async def reset_prefix_cache() -> dict:
            return await tokenize.reset_prefix_cache(server)

        sglang.add_routes(app, server)  # /generate, /model_info, /server_info (SGLang's native API)
        with_schemas(
            app,
            CompletionRequest,
            ChatCompletionRequest,
            tokenize.TokenizeRequest,
            tokenize.DetokenizeRequest,
            sglang.GenerateRequest,
        )
        return app

    def _body(self, model: Any) -> Any:
        """A dependency that reads and checks a body of ``model`` off the event loop (serve/body.py)."""

        async def read(request: Request) -> Any:
            raw = await request.body()
            if len(raw) <= INLINE_BYTES:
                return parse(model, raw, self.max_model_len)
            return await asyncio.to_thread(parse, model, raw, self.max_model_len)

        return read

    # ------------------------------------------------------------------ health
    def pool_health(self) -> dict | None:
        """The storage client's own view (breaker state + its background probe), as the engine
        last said it: no I/O here, no call into the engine, so /health answers in milliseconds.
        None without a pool."""
        pool = self.engine.pool_health()
        if pool is None:
            return None
        if self.expose_config:
            return redact(pool)
        # no key guards /health: the pool's state and counts, not where it is or what it said
        public = {k: pool[k] for k in PUBLIC_POOL_FIELDS if k in pool}
        if not pool.get("ok", True):
            public["reason"] = "it does not answer (the server's log says why; --expose-config shows it here)"
        return public

    def health(self) -> JSONResponse:
        """200 ok; 200 "degraded" (colocated without its pool: it recomputes); 503 engine stopped,
        or prefill/decode without its pool (no hand-off works). ``engine`` says whether requests
        can still run here: the router keeps sending a decode server colocated requests then."""
        error = self.engine.error
        if error is not None:  # it never serves again: `kvtier serve` exits (non-zero)
            return JSONResponse(
                error_body(503, f"the engine stopped: {error}") | {"status": "dead", "role": self.role, "engine": "dead"},
                status_code=503,
            )
        try:
            self.engine.check_alive()
        except EngineDead as e:
            return JSONResponse(
                error_body(503, str(e)) | {"status": "unavailable", "role": self.role, "engine": "stopped"}, status_code=503
            )
        pool = self.pool_health()
        engine = self.engine
        body = {
            "status": "ok",
            "role": self.role,
            "engine": "ok",
            "pool": pool,
            "pd_on_miss": engine.info.pd_on_miss,
            "export_timeout": engine.config.export_timeout,
            "startup_s": engine.startup.total_s,
            "running": self.engine.num_running,
            "waiting": self.engine.num_waiting,
        }
        if self.expose_config:
            body["model_root"] = self.model_path
        if pool is None or pool.get("ok", True):
            return JSONResponse(body)
        reason = f"the storage pool is unreachable: {pool.get('reason') or 'no reason given'}"
        if self.role == "colocated":
            return JSONResponse(body | {"status": "degraded", "reason": reason})
        return JSONResponse(
            error_body(503, f"{reason} (--role {self.role} needs it)") | body | {"status": "unavailable", "reason": reason},
            status_code=503,
        )

    # ------------------------------------------------------------------ requests
    async def _prompt_ids(self, kind: str, body: Any, prompt: Any, budget: int, after: str = "") -> list[int]:
        """``after``: what the rest of the context is kept for (the error's words)."""
        if body.kvtier_handoff is not None:
            return list(body.kvtier_handoff.prompt_token_ids)
        if kind == "completion":
            special = getattr(body, "add_special_tokens", False)  # (SGLang's /generate: its text gets them)
            return await self.prompts.completion_ids(prompt, budget, special, owner=id(body), after=after, param=body.prompt_name)
        mark = IMAGE_MARK if self.images is not None else ""
        messages = [{"role": m.role, "content": m.text(mark)} for m in prompt]
        return await self.prompts.chat_ids(messages, body.add_generation_prompt, budget, owner=id(body), after=after)

    def _too_long(self, index: int | None, n: int, asked: int | None, field: str, kind: str) -> APIError:
        """A prompt of ``n`` tokens that does not fit the context beside what is asked: the
        prompt's error when it alone leaves no room, else the asked tokens'."""
        which = "the messages have" if kind == "chat" else "the prompt has" if index is None else f"prompt {index} has"
        prompt = "messages" if kind == "chat" else "prompt"
        ctx = self.max_model_len
        if asked is None:
            return APIError(
                400,
                f"{which} {n} tokens: the model's context of {ctx} tokens leaves none to generate; "
                f"shorten it to at most {ctx - 1} tokens",
                prompt,
            )
        together = f"{which} {n} tokens and {field}={asked}: together over the model's context of {ctx} tokens"
        if n >= ctx:
            return APIError(400, f"{together}; shorten the prompt to at most {ctx - asked} tokens", prompt)
        return APIError(400, f"{together}; ask for at most {ctx - n} tokens, or shorten the prompt", field)

    def _echo_text(self, prompt: Any, ids: list[int]) -> str:
        if isinstance(prompt, str):
            return prompt
        return self.tokenizer.decode(ids, skip_special_tokens=False) if self.tokenizer is not None else ""

    async def _start(self, kind: str, body: Any, export: bool = False) -> _Call:
        arrival = _ARRIVAL.get() or time.monotonic()
        if not self.serves(body.model):
            raise APIError(404, f"model {body.model!r} is not served here (this server serves {self.model_name!r})", "model")
        handoff = body.kvtier_handoff
        prompts = body.prompts
        if handoff is not None:
            if self.role != "decode":
                raise APIError(
                    400, f"kvtier_handoff is for servers with --role decode (this one is {self.role})", "kvtier_handoff"
                )
            if why := _beyond_handoff(body):
                raise APIError(400, f"a PD hand-off carries one prompt and one sample without logprobs: {why}", "kvtier_handoff")
        if self.require_cache_salt and not body.cache_salt:
            raise APIError(
                400,
                "this server requires a cache_salt on every request (--require-cache-salt): "
                "prefix-cache hits are shared only between requests with the same salt",
                "cache_salt",
            )
        samples = len(prompts) * body.n
        if samples > self.engine.max_queue:
            raise APIError(
                400,
                f"{len(prompts)} prompt(s) x n={body.n} = {samples} samples in one request: more than this "
                f"server queues (--max-queue {self.engine.max_queue})",
                "n",
            )
        asked = body.max_tokens_asked
        field = body.max_tokens_name
        if asked is not None and asked >= self.max_model_len:  # before any prompt is tokenized against it
            raise APIError(
                400,
                f"{field}={asked} leaves no room for a prompt in the model's context of {self.max_model_len} "
                f"tokens: ask for at most {self.max_model_len - 1} (or leave it out: the rest of the context)",
                field,
            )
        echo_only = asked == 0  # echo, max_tokens=0: the prompt (and its logprobs) alone
        after = f"after {field}={asked}" if asked else "with one token to generate"
        urls_of: list[list] = [message_images(p) if kind == "chat" else [] for p in prompts]
        if any(urls_of):  # refused by count before any image is read
            if self.images is None:
                raise APIError(400, f"this model ({self.engine.limits.architecture}) takes no images", "messages")
            for urls in urls_of:
                self.images.check_count(urls)
        mm_of: dict[int, list] = {}  # vision-language models: each prompt's images, placed

        async def prompt_ids(i: int, prompt: Any) -> list[int]:
            ids = await self._prompt_ids(kind, body, prompt, self.max_model_len - (asked or 1), after)
            if self.images is not None and any(u.startswith(("http://", "https://")) for u in urls_of[i]):
                urls_of[i] = await asyncio.to_thread(self.images.fetch_remote, urls_of[i])  # (not a tokenizer thread)
            if self.images is not None:  # decoded, preprocessed and placed off the event loop (D of PD too: its keys)
                ids, mm_of[i] = await self.prompts.run(id(body), self.images.place, ids, urls_of[i])
            max_tokens = 1 if echo_only else asked if asked is not None else max(1, self.max_model_len - len(ids))
            if len(ids) + max_tokens > self.max_model_len:  # refused now: the call's other prompts are not tokenized
                raise self._too_long(i if len(prompts) > 1 else None, len(ids), asked, field, kind)
            return ids

        ids_of = await _all_or_none([prompt_ids(i, p) for i, p in enumerate(prompts)])
        params_of = []
        for i, ids in enumerate(ids_of):
            max_tokens = 1 if echo_only else asked if asked is not None else max(1, self.max_model_len - len(ids))
            if len(ids) + max_tokens > self.max_model_len:
                raise self._too_long(i if len(prompts) > 1 else None, len(ids), asked, field, kind)
            try:
                params = body.sampling_params(max_tokens)
                if export:  # P of PD: the first token only
                    params = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
            except ValueError as e:
                raise APIError(400, str(e), sampling_param(str(e))) from None
            params_of.append(params)
        check_response_size(ids_of, params_of)
        prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
        rid = handoff.response_id if handoff is not None and handoff.response_id else prefix + secrets.token_hex(12)
        created = handoff.created if handoff is not None and handoff.created else int(time.time())
        extra: dict[str, Any] = {}
        if export:
            extra["export"] = True
        elif handoff is not None:
            extra["handoff"] = {
                "namespace": handoff.namespace,
                "keys": handoff.keys,
                "num_tokens": handoff.num_tokens,
                "first_token": handoff.first_token,
            }

        def make() -> list[EngineRequest]:  # validates every id against the vocabulary: O(prompt), off the event loop
            return [
                # the call owns every prompt of it: together they run at most
                # --max-num-seqs-per-request sequences, however many prompts and samples it has
                self.engine.make_request(
                    ids,
                    params,
                    body.cache_salt,
                    f"{rid}-{i}-{secrets.token_hex(4)}",
                    owner=rid,
                    priority=body.priority or 0,
                    images=mm_of.get(i, ()),
                    **extra,
                )
                for i, (ids, params) in enumerate(zip(ids_of, params_of))
            ]

        try:
            reqs = make() if sum(map(len, ids_of)) <= INLINE_TOKENS else await asyncio.to_thread(make)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        n, echo = body.n, kind == "completion" and body.echo
        gens = [
            _Gen(
                req,
                [
                    _Choice(
                        i * n + j,
                        j,
                        ChoiceText(self.tokenizer, body.stop_strings, body.skip_special_tokens, body.min_tokens),
                        self._echo_text(p, ids) if echo else "",
                    )
                    for j in range(n)
                ],
            )
            for i, (req, p, ids) in enumerate(zip(reqs, prompts, ids_of))
        ]
        return _Call(kind, body, rid, created, self.model_name, gens, echo_only, arrival)

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
        n_out = gen.num_generated if out is None else sum(len(c.token_ids) for c in out.outputs) or len(out.token_ids)
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
        except ValueError as e:  # the engine refused it (e.g. a duplicate request id)
            refused = True
            raise APIError(400, str(e)) from None
        except EngineDead as e:  # an APIError: said in-stream if streaming
            gen.finish_reason = "error"
            raise APIError(503, str(e)) from None
        finally:
            if not refused:
                self._account(gen)

    def _push(self, call: _Call, choice: _Choice, toks: list[int], lps: list | None) -> _Piece:
        """New tokens of ``choice`` through its text stream: the text that can go out now, and the
        tokens (and their logprobs) up to the one that completed a stop string, if one did."""
        if call.echo_only or not toks:
            return _Piece(choice, "", [], None)
        if call.logprobs and (lps is None or len(lps) != len(toks)):
            raise APIError(500, "the engine returned no logprobs for tokens of a request that asked for them")
        stream = choice.stream
        text, n = stream.push(toks)
        toks = toks[:n]
        lps = lps[:n] if call.logprobs and lps is not None else None
        choice.token_ids += toks
        if lps is not None:
            choice.logprobs += lps
        if stream.stopped:
            choice.finish_reason = "stop"
        return _Piece(choice, text, toks, lps)

    def _push_each(self, call: _Call, choice: _Choice, toks: list[int], lps: list | None) -> list[_Piece]:
        """:meth:`_push` token by token: a piece per token (a stream's chunk per token, as vLLM
        and SGLang send them, whatever number of tokens one engine delta carried), up to the
        token that ends the choice."""
        if len(toks) <= 1:
            return [self._push(call, choice, toks, lps)]
        pieces = []
        for i, t in enumerate(toks):
            pieces.append(self._push(call, choice, [t], lps[i : i + 1] if lps is not None else None))
            if choice.done:
                break
        return pieces

    @staticmethod
    def _end(call: _Call, choice: _Choice, reason: str) -> str:
        """``choice`` ended with ``reason``: the text its stream held back."""
        choice.finish_reason = "length" if call.echo_only else reason
        return choice.stream.finish()

    async def _deltas(
        self, call: _Call, gen: _Gen, replay: bool = False, emit_replayed: bool = False
    ) -> AsyncGenerator[_Piece | None, None]:
        """Pieces of ``gen``'s choices as they come, after one ``None`` once the engine produced its
        first delta (so that callers can answer errors before it with a status code); a piece with
        ``end`` closes its choice (``finish_reason`` set). Sets ``gen.output`` and
        ``gen.finish_reason`` at the end. ``replay``: D of a hand-off; P's first token is pushed
        through the text stream first (emitted only if ``emit_replayed``: a streaming client got
        it from the router already). The request ends early (aborted in the engine) once every
        choice has met a stop string, and when this is closed early (a client that went away);
        every request that reached the engine is counted once."""
        defer = call.body.return_routed_experts  # choices' ends wait for the output (their routing)
        per_token = bool(call.body.stream)  # a stream's chunk per token
        held: list[_Choice] = []

        def ended(p: _Piece) -> _Piece:
            if p.choice.done:
                if defer and gen.output is None:
                    held.append(p.choice)
                else:
                    p.end = True
            return p

        def release() -> list[_Piece]:
            pieces = [_Piece(c, "", [], None, True) for c in held]
            held.clear()
            return pieces

        skip = 0
        with self._engine_errors(gen):
            if replay:
                first = [call.body.kvtier_handoff.first_token]
                gen.num_generated = skip = 1
                piece = ended(self._push(call, gen.choices[0], first, None))
                if emit_replayed:
                    yield piece
                elif piece.end:
                    yield _Piece(piece.choice, "", [], None, True)
                if piece.choice.done:
                    gen.finish_reason = "stop"
                    for p in release():  # no output comes: announce them as they are
                        yield p
                    return
            t_prev = None
            started = False
            stream = bool(call.body.stream)
            gen.sent = time.monotonic()  # parse_and_tokenize ends here (TTFT counts from the call's arrival)
            agen = self.engine.generate(gen.req)
            try:
                async for delta in agen:
                    out = delta.output
                    if delta.cached is not None:
                        gen.cached = delta.cached
                    if out is not None and out.finish_reason == "error":
                        gen.output, gen.finish_reason = out, "error"
                        raise self._failure(out)
                    if not started:
                        started = True
                        yield None
                    gen.output = out
                    pieces: list[_Piece] = []  # each choice's end comes after its text
                    for sample in delta.samples:
                        toks = sample.token_ids[skip:]
                        lps = sample.logprobs[len(sample.token_ids) - len(toks) :] if sample.logprobs is not None else None
                        skip = max(0, skip - len(sample.token_ids))
                        gen.num_generated += len(toks)
                        now = time.monotonic()
                        if toks and t_prev is not None:
                            self.metrics.itl.observe((now - t_prev) / len(toks))
                        elif toks and not replay:  # (D of a hand-off: its first token was P's)
                            gen.stages = delta.stages
                            if stream:  # TTFT once its chunk is written (_first_written)
                                gen.unwritten = True
                            else:
                                self.metrics.first_token(call.arrival, gen.sent, now, gen.stages)
                        if toks:
                            t_prev = now
                        choice = gen.choices[sample.index]
                        if choice.done:
                            continue
                        got = self._push_each(call, choice, toks, lps) if per_token else [self._push(call, choice, toks, lps)]
                        reason = sample.finish_reason or (_reason(out, choice) if out is not None else None)
                        if not choice.done and reason is not None:
                            got[-1].text += self._end(call, choice, reason)
                        pieces += got
                    if out is not None:  # the request's end: every choice ends
                        pieces += [_Piece(c, self._end(call, c, _reason(out, c)), [], None) for c in gen.choices if not c.done]
                    for piece in pieces:
                        if piece.text or piece.token_ids or piece.choice.done:
                            yield ended(piece)
                    if out is not None or all(c.done for c in gen.choices):
                        for p in release():  # with the output (their routing), or none comes
                            yield p
                    if out is not None:
                        break
                    if all(c.done for c in gen.choices):
                        gen.finish_reason = "stop"
                        return  # the finally below aborts the engine request
            finally:
                await agen.aclose()
            out = gen.output
            gen.finish_reason = out.finish_reason

    def _first_written(self, call: _Call, choice: _Choice) -> None:
        """A stream's chunk with tokens of ``choice`` is written: its request's TTFT if it is its first."""
        gen = call.gen_of(choice)
        if gen.unwritten:
            gen.unwritten = False
            self.metrics.first_token(call.arrival, gen.sent, time.monotonic(), gen.stages)

    async def _events(
        self, call: _Call, replay: bool = False, emit_replayed: bool = False
    ) -> AsyncGenerator[_Piece | None, None]:
        """The pieces of every request of ``call`` as they come (``_deltas``), after one ``None``
        once each has had its first delta (or ended). Closing it aborts every request."""
        if len(call.gens) == 1:
            inner = self._deltas(call, call.gens[0], replay, emit_replayed)
            try:
                async for piece in inner:
                    yield piece
            finally:
                await inner.aclose()
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, gen: _Gen) -> None:
            try:
                async for piece in self._deltas(call, gen):
                    queue.put_nowait((i, piece))
            except Exception as e:  # the consumer raises it
                queue.put_nowait((i, e))
            queue.put_nowait((i, END))

        tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(call.gens)]
        try:
            unstarted, live, backlog, ready = set(range(len(tasks))), len(tasks), [], False
            while live:
                i, item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                if item is None or item is END:
                    unstarted.discard(i)
                    live -= item is END
                else:
                    backlog.append(item)
                if not unstarted:
                    if not ready:
                        ready = True
                        yield None
                    for piece in backlog:
                        yield piece
                    backlog.clear()
        finally:  # the others' engine requests are aborted
            for t in tasks:
                t.cancel()

    # ------------------------------------------------------------------ response shapes
    def _chunk(
        self, call: _Call, choice: _Choice, delta: dict | None = None, text: str | None = None, finish: str | None = None
    ) -> dict:
        if call.kind == "chat":
            c: dict[str, Any] = {"index": choice.index, "delta": delta or {}, "logprobs": None, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            c = {"index": choice.index, "text": text or "", "logprobs": None, "finish_reason": finish}
            obj = "text_completion"
        return {"id": call.rid, "object": obj, "created": call.created, "model": call.model, "choices": [c]}

    def _logprobs(self, call: _Call, token_ids: list[int], logprobs: list, choice: _Choice) -> dict:
        """``logprobs`` of a choice (or a chunk of it) in the endpoint's shape."""
        if call.kind == "chat":
            return chat_logprobs(self.strings, token_ids, logprobs, call.body.top_logprobs or 0)
        shaped, choice.offset = completion_logprobs(self.strings, token_ids, logprobs, choice.offset)
        return shaped

    def _extras(self, call: _Call, gen: _Gen, choice: _Choice, shape: dict) -> None:
        out = gen.output
        if out is None:
            return
        samples = out.outputs
        r = (
            samples[choice.sample].routed_experts
            if choice.sample < len(samples)
            else out.routed_experts
            if choice.sample == 0
            else None
        )
        if r is not None:
            shape["routed_experts"] = {
                "dtype": str(r.dtype),
                "shape": list(r.shape),
                "data": base64.b64encode(r.tobytes()).decode(),
            }

    def _usage(self, call: _Call) -> dict:
        """OpenAI's ``usage``, each prompt counted once (not per sample): ``cached_tokens`` are the
        prompt tokens this engine did not compute (hits in its device or host tier, or read from
        the pool: a hand-off's included). kvtier's own part, ``usage.kvtier``: those per tier, and
        on D of a hand-off P's (``prefill``, as the router got them from P)."""
        n_prompt = sum(len(g.req.prompt_token_ids) for g in call.gens)  # once per prompt, not per sample
        n_out = sum(len(c.token_ids) for g in call.gens for c in g.choices)
        outs = [g.output for g in call.gens if g.output is not None]
        kvtier: dict[str, Any] = {"cached_tokens_by_tier": _by_tier(o.cached_tokens_by_tier for o in outs)}
        h = call.body.kvtier_handoff
        if h is not None:
            kvtier["prefill"] = {
                "cached_tokens": h.prefill.cached_tokens,
                "cached_tokens_by_tier": _by_tier([h.prefill.cached_tokens_by_tier]),
            }
        return {
            "prompt_tokens": n_prompt,
            "completion_tokens": n_out,
            "total_tokens": n_prompt + n_out,
            "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in outs)},
            "kvtier": kvtier,
        }

    def _first_chunks(self, call: _Call) -> list[dict]:
        """What a stream starts with, per choice: chat's role, completions' echoed prompt."""
        if call.kind == "chat":
            return [self._chunk(call, c, {"role": "assistant", "content": ""}) for c in call.choices]
        return [self._chunk(call, c, text=c.echo) for c in call.choices if c.echo]

    async def _sse(self, call: _Call, first: Any, rest: AsyncGenerator[Any, None], replay: bool) -> AsyncIterator[str]:
        body = call.body
        try:
            if not replay:
                for c in self._first_chunks(call):
                    yield _data(c)
            async for piece in prepend(first, rest):
                if piece is None:
                    continue
                choice = piece.choice
                # a chunk per token (its text "" if it adds none yet), as vLLM and SGLang send
                # them; the last one carries the finish_reason
                if piece.text or piece.token_ids or piece.end:
                    delta = {"content": piece.text} if piece.text or piece.token_ids else {}
                    c = self._chunk(call, choice, delta, piece.text, choice.finish_reason if piece.end else None)
                    shape = c["choices"][0]
                    if body.return_token_ids and piece.token_ids:
                        shape["token_ids"] = piece.token_ids
                    if call.logprobs and piece.token_ids:
                        shape["logprobs"] = self._logprobs(call, piece.token_ids, piece.logprobs or [], choice)
                    if piece.end:
                        self._extras(call, call.gen_of(choice), choice, shape)
                    data = _data(c)
                    if piece.token_ids:
                        self._first_written(call, choice)
                    yield data
            so = body.stream_options
            if so is not None and so.include_usage:
                yield _data(
                    {
                        "id": call.rid,
                        "object": "chat.completion.chunk" if call.kind == "chat" else "text_completion",
                        "created": call.created,
                        "model": call.model,
                        "choices": [],
                        "usage": self._usage(call),
                    }
                )
        except APIError as e:  # mid-stream: the status is sent; say it in the stream
            yield sse_error(e)
        finally:  # a client that went away: its engine requests are aborted
            await rest.aclose()
        yield "data: [DONE]\n\n"

    def _choice(self, call: _Call, gen: _Gen, choice: _Choice) -> dict:
        """A choice of a whole (non-streaming) answer."""
        body, text = call.body, choice.stream.text
        if call.kind == "chat":
            shape: dict[str, Any] = {
                "index": choice.index,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": choice.finish_reason,
            }
        else:
            shape = {"index": choice.index, "text": choice.echo + text, "logprobs": None, "finish_reason": choice.finish_reason}
        if call.logprobs:
            ids, lps = choice.token_ids, choice.logprobs
            if body.engine_prompt_logprobs is not None:  # echo: the prompt's tokens first
                prompt_lps = gen.output.prompt_logprobs if gen.output is not None else None
                if prompt_lps is None:
                    raise APIError(500, "the engine returned no prompt logprobs for a request that asked for them")
                ids, lps = gen.req.prompt_token_ids + ids, list(prompt_lps) + lps
            shape["logprobs"] = self._logprobs(call, ids, lps, choice)
        self._extras(call, gen, choice, shape)
        if body.return_token_ids:
            shape["token_ids"] = list(choice.token_ids)
            shape["prompt_token_ids"] = list(gen.req.prompt_token_ids)
        return shape

    async def respond(self, kind: str, body: Any, request: Request) -> Response:
        if body.stream and body.engine_prompt_logprobs is not None:
            raise APIError(
                400,
                "echo with logprobs is not supported when streaming (the prompt's logprobs come "
                "with the end of the request): use stream=false",
                "echo",
            )
        call = await self._start(kind, body)
        replay = body.kvtier_handoff is not None
        events = self._events(call, replay, emit_replayed=not body.stream)
        if body.stream:
            # wait for the engine's first delta here: errors before it (queue full, a PD miss
            # under --pd-on-miss error) are a status code, not an in-stream error
            try:
                first = await until_disconnect(request, next_or_end(events))
            except BaseException:
                await events.aclose()
                raise
            return StreamingResponse(
                self._sse(call, first, events, replay),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )

        async def collect() -> None:
            async for _ in events:
                pass

        await until_disconnect(request, collect())
        pieces = self.answer_parts(call)
        if _answer_entries(call) <= INLINE_ENTRIES:
            return Response(b"".join(pieces), media_type="application/json")
        # a large answer (n=64 x logprobs=20 x echo is tens of MB) is built and serialized on a
        # worker thread, a choice at a time, and written in parts as the client reads them: the
        # event loop (every other client's stream, /health) never waits for it
        first = await asyncio.to_thread(_next_part, pieces)
        return StreamingResponse(_parts_off_loop(first, pieces), media_type="application/json")

    def answer_parts(self, call: _Call) -> Iterator[bytes]:
        """A whole (non-streaming) answer's JSON, in pieces: its head, each choice, its usage."""
        head = {
            "id": call.rid,
            "object": "chat.completion" if call.kind == "chat" else "text_completion",
            "created": call.created,
            "model": call.model,
        }
        yield _json(head)[:-1] + b',"choices":['
        for i, (g, c) in enumerate((g, c) for g in call.gens for c in g.choices):
            yield (b"," if i else b"") + _json(self._choice(call, g, c))
        yield b'],"usage":' + _json(self._usage(call)) + b"}"

    async def prefill(self, kind: str, body: Any, request: Request) -> Response:
        """P of a PD hand-off: the prefill, its blocks written to the pool. The answer is two JSON
        lines (``application/x-ndjson``): the first as soon as the first token is sampled (its
        chunks, the prompt's token ids and the manifest's names), the second once the pool acked
        the prompt's blocks (``{"manifest": ...}`` with ``complete``; or ``{"error": ...}``), so
        the router can stream the first token while the blocks are still being written. An error
        before the first token is an ordinary error answer. A request a hand-off cannot carry
        (several prompts or samples, logprobs) is a 501: the router then runs it colocated on a D."""
        if self.role != "prefill":
            raise APIError(404, f"/kvtier/prefill is served by --role prefill (this server is {self.role})")
        if body.kvtier_handoff is not None:
            raise APIError(400, "a prefill request cannot carry kvtier_handoff", "kvtier_handoff")
        if why := _beyond_handoff(body):
            raise APIError(501, f"a PD hand-off carries one prompt and one sample without logprobs: {why}")
        call = await self._start(kind, body, export=True)
        gen, choice = call.gens[0], call.gens[0].choices[0]
        chunks = self._first_chunks(call)

        async def events() -> AsyncGenerator[RequestDelta, None]:
            """The first token's delta, then the output (the request's whole time in the engine)."""
            with self._engine_errors(gen):
                gen.sent = time.monotonic()
                async for delta in self.engine.generate(gen.req):
                    if delta.output is not None:
                        gen.output = delta.output
                        gen.finish_reason = "error" if delta.output.finish_reason == "error" else "prefill"
                        yield delta
                        return
                    if _sample0(delta):
                        gen.num_generated += len(_sample0(delta))
                        gen.stages = gen.stages or delta.stages
                        yield delta

        it = events()
        try:
            first = await until_disconnect(request, next_or_end(it))
        except BaseException:
            await it.aclose()
            raise
        out = None if first is END else first.output
        if first is END or (out is not None and (out.finish_reason == "error" or not out.token_ids)):
            await it.aclose()
            raise self._failure(out) if out is not None else APIError(500, "the prefill produced no output")
        if _sample0(first):
            token = _sample0(first)[0]
        else:  # events() yields tokens, or the output
            assert out is not None
            token = out.token_ids[0]
        names = first.export or {}
        piece = self._push(call, choice, [token], None)
        c = self._chunk(call, choice, {"content": piece.text}, piece.text)  # the first token's chunk, "" or not
        if body.return_token_ids:
            c["choices"][0]["token_ids"] = [token]
        chunks.append(c)
        # what P found cached of the prompt (with the export's names, else the output's): the
        # router hands it to D, whose usage reports it as P's part
        cached = names.pop("cached_tokens", out.num_cached_tokens if out is not None else 0)
        by_tier = names.pop("cached_tokens_by_tier", out.cached_tokens_by_tier if out is not None else {})
        if not names:  # no export's names on the first delta: the output's
            assert out is not None
            names = _names(out.handoff)
        head = {
            "id": call.rid,
            "created": call.created,
            "chunks": chunks,
            "prompt_token_ids": list(gen.req.prompt_token_ids),
            "first_token": token,
            "cached_tokens": cached,
            "cached_tokens_by_tier": _by_tier([by_tier]),
            "manifest": names,
        }

        async def lines() -> AsyncIterator[str]:
            try:
                line = json.dumps(head, separators=(",", ":")) + "\n"
                # P's TTFT: the first token's line written (its stages: the first delta's, or the output's)
                stages = gen.stages or first.stages
                if stages is None and out is not None and out.metrics:
                    stages = first_token_stages(out.metrics)
                self.metrics.first_token(call.arrival, gen.sent, time.monotonic(), stages)
                yield line
                last, err = out, None
                if last is None:
                    try:
                        e = await next_or_end(it)
                        last = None if e is END else e.output
                    except APIError as failed:  # e.g. the engine stopped: said in the answer
                        err = failed
                if err is None and (last is None or last.finish_reason == "error" or last.handoff is None):
                    err = self._failure(last) if last is not None else APIError(500, "the export produced no output")
                if err is not None:
                    yield json.dumps(error_body(err.status, err.message)) + "\n"
                    return
                assert last is not None  # (else err is set above)
                if last.handoff.get("seconds") is not None:
                    self.metrics.export.observe(last.handoff["seconds"])
                yield json.dumps({"manifest": last.handoff}, separators=(",", ":")) + "\n"
            finally:
                await it.aclose()

        return StreamingResponse(lines(), media_type="application/x-ndjson")


def _sample0(delta: RequestDelta) -> list[int]:
    """The new tokens of sample 0 (the only one of a PD hand-off) in ``delta``."""
    return next((s.token_ids for s in delta.samples if s.index == 0), [])


def _names(handoff: dict | None) -> dict:
    """The manifest's names (what D checks) of a finished export's hand-off."""
    h = handoff or {}
    return {k: h[k] for k in ("namespace", "keys", "num_tokens") if k in h}


def _by_tier(tiers: Iterable[dict[str, int]]) -> dict[str, int]:
    """Cached tokens per tier (``device``, ``host``, ``storage``), summed over ``tiers``."""
    tiers = list(tiers)
    return {t: sum(d.get(t, 0) for d in tiers) for t in TIERS}


def _reason(out: Any, choice: _Choice) -> str:
    """The finish reason of ``choice`` in its request's final output."""
    samples = out.outputs
    return samples[choice.sample].finish_reason if choice.sample < len(samples) else out.finish_reason


def check_response_size(ids_of: list[list[int]], params_of: list[SamplingParams]) -> None:
    """APIError(400) if the answer would hold more than MAX_LOGPROB_ENTRIES logprob entries
    (each choice: its echoed prompt's and its tokens', each with its top-k): a 17 KB request
    with echo, logprobs=20 and n=128 over 32 prompts would build a 600 MB response."""
    total = 0
    for ids, p in zip(ids_of, params_of):
        per_sample = 0
        if p.logprobs is not None:
            per_sample += p.max_tokens * (1 + p.logprobs)
        if p.prompt_logprobs is not None:
            per_sample += len(ids) * (1 + p.prompt_logprobs)
        total += p.n * per_sample
    if total > MAX_LOGPROB_ENTRIES:
        raise APIError(
            400,
            f"this request asks for up to {total} logprob entries (prompts x n x (echoed prompt + max_tokens) x "
            f"(1 + top logprobs)): at most {MAX_LOGPROB_ENTRIES} per request; lower n, max_tokens or logprobs, or leave out echo",
            "logprobs",
        )


def _beyond_handoff(body: Any) -> str:
    """What in ``body`` a PD hand-off cannot carry ('' if nothing)."""
    if len(body.prompts) > 1:
        return f"{len(body.prompts)} prompts"
    if body.n > 1:
        return f"n={body.n}"
    if body.engine_logprobs is not None or body.engine_prompt_logprobs is not None:
        return "logprobs"
    return ""


async def _all_or_none(aws: list) -> list:
    """Every result in order, or the first error with the others cancelled (a prompt not yet
    tokenized never is: 1,024 prompts of which the first is refused cost one tokenization)."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        raise


def _json(obj: Any) -> bytes:
    """As Starlette's JSONResponse writes it."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode()


def _answer_entries(call: _Call) -> int:
    """About how many JSON values a whole answer holds: each choice's tokens (and echoed prompt's
    with logprobs), times 1 + the top logprobs of each."""
    body, total = call.body, 0
    per_token = 1 + (body.engine_logprobs or 0) if call.logprobs else 1
    for g in call.gens:
        echoed = len(g.req.prompt_token_ids) if body.engine_prompt_logprobs is not None else 0
        total += sum(len(c.token_ids) + echoed for c in g.choices) * per_token
    return total


def _next_part(pieces: Iterator[bytes]) -> bytes:
    """The next WRITE_BYTES or so of ``pieces`` (b"" at their end)."""
    part: list[bytes] = []
    size = 0
    for p in pieces:
        part.append(p)
        size += len(p)
        if size >= WRITE_BYTES:
            break
    return b"".join(part)


async def _parts_off_loop(first: bytes, pieces: Iterator[bytes]) -> AsyncIterator[bytes]:
    part = first
    while part:
        yield part
        part = await asyncio.to_thread(_next_part, pieces)


def _data(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
