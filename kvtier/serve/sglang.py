"""SGLang's native API, for SGLang's own clients (``bench_serving --backend sglang``, the HiCache
benches, the ``cache_hit_kit`` multi-turn test) and anything else written against it::

    GET  /model_info, /get_model_info      {"model_path", "tokenizer_path", "is_generation", ...}
    POST /generate (PUT too)               {"text" | "input_ids", "sampling_params", "stream", "rid",
                                            "return_logprob", "logprob_start_len", "top_logprobs_num", ...}
                                            -> {"text", "output_ids", "meta_info"} (a list for a batch
                                            or n > 1); stream: "data: {...}" lines, each with the text
                                            and ids so far, then "data: [DONE]"
    GET  /server_info, /get_server_info    the served model and the engine's configuration (tokenize.py),
                                            with SGLang's page_size, internal_states, ...

``/generate`` runs on the server's one generation path (``Server._start`` / ``_events``: the same
tokenization, bounds, owner and priority, metrics and errors as the OpenAI routes); only the
request's field names and the answer's shape are SGLang's. ``sampling_params`` are SGLang's
(``max_new_tokens``, default 128; ``min_new_tokens``; ``sampling_seed``; ``top_k`` -1 = all; ...).
``meta_info.finish_reason`` is ``{"type": "stop", "matched": token id | stop string}`` or
``{"type": "length", "length": N}``, null until the output ends; ``cached_tokens`` are the prompt
tokens this engine did not compute, known from the first token on. Logprobs are SGLang's tuples
``[logprob, token_id, text | null]`` (``return_text_in_logprobs``), the top ones per position a
list of them (null where there are none). Fields SGLang takes and kvtier does not implement are
accepted at their neutral value and refused by name otherwise, as on the OpenAI routes.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from typing import Any, AsyncGenerator, AsyncIterator, ClassVar, Optional, Union, cast

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import Field, StrictBool, StrictInt, field_validator, model_validator

from kvtier.cache.manager import TIERS
from kvtier.engine.checks import MAX_PRIORITY
from kvtier.engine.params import MAX_LOGPROBS, MAX_N, MAX_STOP_TOKEN_IDS, SamplingParams
from kvtier.serve import tokenize
from kvtier.serve.body import body_schema
from kvtier.serve.errors import APIError, sse_error, until_disconnect
from kvtier.serve.logprobs import FLOOR
from kvtier.serve.protocol import MAX_PROMPTS, MAX_STOP_STRINGS, Body, FieldError, StreamOptions, given
from kvtier.serve.streams import next_or_end, prepend

# the server answering (typed Any: kvtier.serve.api imports this module)
Server = Any

KEY_PATHS = ("/generate", "/model_info", "/get_model_info", "/get_server_info")
MAX_RID_CHARS = 256
MAX_TOKENS_DEFAULT = 128  # SGLang's max_new_tokens when a request leaves it out

# SGLang's fields kvtier does not implement: accepted at their neutral value (what SGLang's clients
# send when they do not use them), a 400 naming them otherwise
_NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {
    "lora_path": ((None, ""), "LoRA adapters"),
    "lora_id": ((None, ""), "LoRA adapters"),
    "token_ids_logprob": ((None, []), "token_ids_logprob (logprobs of chosen token ids)"),
    "image_data": ((None, []), "image inputs"),
    "video_data": ((None, []), "video inputs"),
    "audio_data": ((None, []), "audio inputs"),
    "input_embeds": ((None,), "input_embeds"),
    "modalities": ((None, []), "multimodal inputs"),
    "return_hidden_states": ((False,), "return_hidden_states"),
    "custom_logit_processor": ((None,), "custom logit processors"),
    "session_params": ((None,), "sessions"),
    "bootstrap_host": ((None,), "SGLang's PD bootstrap (kvtier router does PD)"),
    "bootstrap_port": ((None,), "SGLang's PD bootstrap (kvtier router does PD)"),
    "bootstrap_room": ((None,), "SGLang's PD bootstrap (kvtier router does PD)"),
    "data_parallel_rank": ((None,), "data parallel ranks"),
    "routed_dp_rank": ((None,), "data parallel ranks"),
    "return_entropy": ((False,), "return_entropy"),
    "return_bytes": ((False,), "return_bytes"),
    "background": ((False,), "background requests"),
    "require_reasoning": ((False,), "require_reasoning"),
    "extra_key": ((None, ""), "extra_key (kvtier's cache_salt keeps prefixes apart)"),
}
_NEUTRAL_SAMPLING: dict[str, tuple[tuple[Any, ...], str]] = {
    "spaces_between_special_tokens": ((True,), "detokenizing without spaces between special tokens"),
    "no_stop_trim": ((False,), "keeping the stop string in the output"),
    "json_schema": ((None,), "structured output"),
    "regex": ((None,), "structured output"),
    "ebnf": ((None,), "structured output"),
    "structural_tag": ((None,), "structured output"),
    "custom_params": ((None,), "custom logit processors' parameters"),
    "logit_bias": ((None, {}), "logit_bias"),
}


def _drop_neutral(data: Any, fields: dict[str, tuple[tuple[Any, ...], str]], where: str = "") -> Any:
    if not isinstance(data, dict) or not fields.keys() & data.keys():
        return data
    data = dict(data)
    for name in fields.keys() & data.keys():
        neutral, what = fields[name]
        value = data.pop(name)
        if not any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in neutral):
            raise FieldError(where + name, f"{name}={value!r}: {what} is not supported by kvtier")
    return data


class GenerateSampling(Body):
    """SGLang's ``sampling_params`` (its names and defaults)."""

    NULL_KEPT: ClassVar[frozenset[str]] = frozenset({"max_new_tokens"})  # null: the rest of the context

    max_new_tokens: Optional[int] = Field(
        MAX_TOKENS_DEFAULT, ge=0, description="null: the rest of the context; 0: the prompt alone (its logprobs)"
    )
    min_new_tokens: Optional[int] = Field(0, ge=0, description="no EOS or stop token before this many tokens")
    temperature: Optional[float] = Field(1.0, ge=0.0, le=100.0, allow_inf_nan=False)
    top_p: Optional[float] = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: Optional[int] = Field(-1, ge=-1, description="-1 (or 0): every token")
    min_p: Optional[float] = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    frequency_penalty: Optional[float] = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    presence_penalty: Optional[float] = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: Optional[float] = Field(1.0, gt=0.0, allow_inf_nan=False)
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[StrictInt]] = Field(default_factory=list, max_length=MAX_STOP_TOKEN_IDS, fail_fast=True)
    ignore_eos: Optional[StrictBool] = False
    skip_special_tokens: Optional[StrictBool] = True
    n: Optional[int] = Field(1, ge=1, le=MAX_N, description="samples per prompt")
    sampling_seed: Optional[int] = Field(None, ge=-(2**63), le=2**63 - 1)
    stream_interval: Optional[int] = Field(None, ge=1, description="accepted; kvtier streams every token")

    @model_validator(mode="before")
    @classmethod
    def _neutral(cls, data: Any) -> Any:
        return _drop_neutral(data, _NEUTRAL_SAMPLING, "sampling_params.")

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: Any) -> Any:
        if isinstance(v, list) and len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"{len(v)} stop strings: at most {MAX_STOP_STRINGS}")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v: list[int]) -> list[int]:
        if any(t < 0 for t in v):
            raise ValueError("token ids are >= 0")
        return v

    @model_validator(mode="after")
    def _min_new_tokens(self) -> "GenerateSampling":
        if self.max_new_tokens is not None and given(self.min_new_tokens) > self.max_new_tokens:
            raise FieldError(
                "sampling_params.min_new_tokens",
                f"min_new_tokens={self.min_new_tokens} is more than max_new_tokens={self.max_new_tokens}",
            )
        return self


_DEFAULT_SAMPLING = GenerateSampling.model_validate({})


class GenerateRequest(Body):
    """SGLang's ``GenerateReqInput`` (the fields kvtier serves; see the module docstring), shaped
    for the server's generation path as a completions request is (``prompts``, ``n``,
    ``sampling_params(max_tokens)``, ...)."""

    model: Optional[str] = Field(None, description="kvtier's: the served name or an alias (default: the served model)")
    text: Optional[Union[str, list[str]]] = None
    input_ids: Optional[Union[list[StrictInt], list[list[StrictInt]]]] = None
    sampling: Optional[GenerateSampling] = Field(None, alias="sampling_params")
    stream: Optional[StrictBool] = False
    stream_options: Optional[StreamOptions] = None  # accepted: every chunk's meta_info has the counts
    rid: Optional[Union[str, list[str]]] = None
    return_logprob: Optional[StrictBool] = False
    logprob_start_len: Optional[int] = Field(-1, ge=-1, description="-1: the generated tokens' logprobs only")
    top_logprobs_num: Optional[int] = Field(0, ge=0, le=MAX_LOGPROBS)
    return_text_in_logprobs: Optional[StrictBool] = False
    return_routed_experts: Optional[StrictBool] = False
    cache_salt: Optional[str] = Field(None, max_length=1024)
    priority: Optional[StrictInt] = Field(0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)
    log_metrics: Optional[StrictBool] = True  # (accepted: every request is counted)
    no_logs: Optional[StrictBool] = False  # (accepted: kvtier logs no request's content)

    # what the server's generation path reads of a request (api.py), fixed for this one
    kvtier_handoff: ClassVar[None] = None
    echo: ClassVar[bool] = False
    return_token_ids: ClassVar[bool] = False
    max_tokens_name: ClassVar[str] = "sampling_params.max_new_tokens"
    add_special_tokens: ClassVar[bool] = True  # a text prompt gets the tokenizer's (a BOS), as SGLang encodes it

    @model_validator(mode="before")
    @classmethod
    def _neutral(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("sampling_params"), list):
            # one object per prompt: kvtier takes one set for every prompt of a request
            each = data["sampling_params"]
            if not each or any(p != each[0] for p in each):
                raise FieldError(
                    "sampling_params",
                    "a list of different sampling_params (one per prompt) is not supported: send one object, "
                    "which every prompt of the request uses (or one request per set)",
                )
            data = dict(data, sampling_params=each[0])
        return _drop_neutral(data, _NEUTRAL)

    @model_validator(mode="after")
    def _one_input(self) -> "GenerateRequest":
        if (self.text is None) == (self.input_ids is None):
            raise FieldError("text", "give the prompt as text (a string or a list of them) or as input_ids, one of the two")
        prompts = self.prompts
        if not prompts:
            raise FieldError(self.prompt_name, f"{self.prompt_name} is empty: give a prompt")
        if len(prompts) > MAX_PROMPTS:
            raise FieldError(self.prompt_name, f"{len(prompts)} prompts in one request: at most {MAX_PROMPTS}")
        for i, p in enumerate(prompts):
            where = f"prompt {i}" if len(prompts) > 1 else "the prompt"
            if not p:
                raise FieldError(self.prompt_name, f"{where} is empty")
            if isinstance(p, list) and any(t < 0 for t in p):
                raise FieldError(self.prompt_name, f"{where}: token ids are >= 0")
        rid = self.rid
        if isinstance(rid, list) and len(rid) != len(prompts):
            raise FieldError("rid", f"{len(rid)} rids for {len(prompts)} prompts: give one per prompt (or one string)")
        for r in [rid] if isinstance(rid, str) else rid or []:
            if not 0 < len(r) <= MAX_RID_CHARS:
                raise FieldError("rid", f"a rid is 1 to {MAX_RID_CHARS} characters, got {len(r)}")
        if self.top_logprobs_num and not self.return_logprob:
            raise FieldError("top_logprobs_num", "top_logprobs_num needs return_logprob=true")
        return self

    # ------------------------------------------------------------------ as the server reads it
    @property
    def params(self) -> GenerateSampling:
        return self.sampling or _DEFAULT_SAMPLING

    @property
    def prompt_name(self) -> str:
        return "text" if self.text is not None else "input_ids"

    @property
    def prompts(self) -> list[Union[str, list[int]]]:
        p = self.text if self.text is not None else self.input_ids
        if isinstance(p, str) or (isinstance(p, list) and p and isinstance(p[0], int)):
            return [p]
        return list(cast("list[Union[str, list[int]]]", p or []))

    @property
    def batch(self) -> bool:
        """Several prompts, or a list given: the answer is a list (as SGLang's)."""
        p = self.text if self.text is not None else self.input_ids
        return isinstance(p, list) and bool(p) and not isinstance(p[0], int)

    @property
    def n(self) -> int:
        return given(self.params.n)

    @property
    def max_tokens_asked(self) -> int | None:
        """The max_new_tokens given (None: not given, or null: the rest of the context; left out,
        at most SGLang's default of 128 of it, ``sampling_params``)."""
        p = self.params
        return p.max_new_tokens if "max_new_tokens" in p.model_fields_set else None

    @property
    def stop_strings(self) -> list[str]:
        stop = self.params.stop
        if stop is None:
            return []
        return [s for s in ([stop] if isinstance(stop, str) else stop) if s]

    @property
    def skip_special_tokens(self) -> bool:
        return given(self.params.skip_special_tokens)

    @property
    def min_tokens(self) -> int:
        return given(self.params.min_new_tokens)

    @property
    def engine_logprobs(self) -> int | None:
        return given(self.top_logprobs_num) if self.return_logprob else None

    @property
    def engine_prompt_logprobs(self) -> int | None:
        return given(self.top_logprobs_num) if self.return_logprob and given(self.logprob_start_len) >= 0 else None

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        p = self.params
        if "max_new_tokens" not in p.model_fields_set:  # SGLang's default, within the context
            max_tokens = min(max_tokens, MAX_TOKENS_DEFAULT)
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=given(p.temperature),
            top_p=given(p.top_p),
            top_k=max(given(p.top_k), 0),
            min_p=given(p.min_p),
            seed=p.sampling_seed,
            stop_token_ids=tuple(given(p.stop_token_ids)),
            ignore_eos=given(p.ignore_eos),
            return_routed_experts=given(self.return_routed_experts),
            skip_special_tokens=given(p.skip_special_tokens),
            n=given(p.n),
            logprobs=self.engine_logprobs,
            prompt_logprobs=self.engine_prompt_logprobs,
            presence_penalty=given(p.presence_penalty),
            frequency_penalty=given(p.frequency_penalty),
            repetition_penalty=given(p.repetition_penalty),
            min_tokens=min(given(p.min_new_tokens), max_tokens),
            stop=tuple(self.stop_strings),
        )

    def rids(self) -> list[str]:
        """Each prompt's id (``meta_info.id``): the client's ``rid`` (a string for one prompt is
        its id, for several their prefix), else a fresh one."""
        n = len(self.prompts)
        if isinstance(self.rid, list):
            return list(self.rid)
        base = self.rid or secrets.token_hex(16)
        return [base] if n == 1 else [f"{base}_{i}" for i in range(n)]


# ---------------------------------------------------------------------------- routes
def add_routes(app: FastAPI, server: Server) -> None:
    """SGLang's routes on ``app`` (api.py's), answered by ``server``."""
    generate_body = server._body(GenerateRequest)

    @app.api_route("/generate", methods=["POST", "PUT"], openapi_extra=body_schema(GenerateRequest))
    async def generate_(request: Request, body: GenerateRequest = Depends(generate_body)) -> Response:
        return await generate(server, body, request)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info_() -> dict:
        return model_info(server)

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info_() -> dict:
        return await server_info(server)


def model_info(server: Server) -> dict:
    """SGLang's ``/model_info``: where the model and its tokenizer are (absolute paths: a client
    such as ``bench_serving`` loads the tokenizer from ``tokenizer_path`` when not given one)."""
    return {
        "model_path": server.model_path,
        "tokenizer_path": server.model_path if server.tokenizer is not None else None,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": _model_type(server),
        "architectures": [server.engine.limits.architecture],
        "served_model_name": server.model_name,
    }


def _model_type(server: Server) -> str | None:
    """``config.json``'s ``model_type`` (read once)."""
    if not hasattr(server, "_sglang_model_type"):
        try:
            with open(os.path.join(server.model_path, "config.json"), encoding="utf-8") as f:
                value = json.load(f).get("model_type")
        except (OSError, ValueError, AttributeError):
            value = None
        server._sglang_model_type = value if isinstance(value, str) else None
    return server._sglang_model_type


async def server_info(server: Server) -> dict:
    """``/server_info`` (tokenize.py's: the model and the engine's configuration) with the fields
    SGLang's clients read: ``page_size`` (the KV block size: ``cache_hit_kit`` expects hits in
    whole pages of it), ``internal_states`` (``bench_serving`` reads ``avg_spec_accept_length``
    from its first entry), and SGLang's names for the sizes."""
    info = tokenize.server_info(server)
    limits, config = server.engine.limits, server.engine.config
    stats = await server.engine.call("cache_stats")
    spec = stats.get("speculative") if isinstance(stats, dict) else None
    state: dict[str, Any] = {"last_gen_throughput": _generation_rate(server)}
    if spec and spec.get("verified_steps"):
        # tokens a verify step yields: the target's own, and the drafts it accepted (SGLang's
        # figure; absent without drafts, where bench_serving reads none)
        state["avg_spec_accept_length"] = 1 + spec["accepted"] / spec["verified_steps"]
    block_size = limits.block_size
    info.update(
        page_size=block_size,
        model_path=server.model_path,
        tokenizer_path=server.model_path if server.tokenizer is not None else None,
        served_model_name=server.model_name,
        context_length=server.max_model_len,
        max_total_num_tokens=limits.num_device_blocks * block_size,
        max_running_requests=config.max_num_seqs,
        max_prefill_tokens=config.max_num_batched_tokens,
        disable_radix_cache=not config.enable_prefix_caching,
        internal_states=[state],
    )
    return info


def _generation_rate(server: Server) -> float:
    """Tokens generated per second since the last ``/server_info`` (the first: since the server
    started serving), from the server's own count of answers' tokens."""
    total = next(
        (s.value for m in server.metrics.generation_tokens.collect() for s in m.samples if s.name.endswith("_total")), 0.0
    )
    now = time.monotonic()
    last = getattr(server, "_sglang_rate", None) or (now - max(1e-3, time.time() - server.created), 0.0)
    server._sglang_rate = (now, total)
    return round((total - last[1]) / max(now - last[0], 1e-3), 3)


# ---------------------------------------------------------------------------- /generate
async def generate(server: Server, body: GenerateRequest, request: Request) -> Response:
    started = time.monotonic()
    if body.model is None:
        body.model = server.model_name
    if body.stream and body.engine_prompt_logprobs is not None:
        raise APIError(
            400,
            "logprob_start_len >= 0 (the prompt's logprobs) is not supported when streaming: they come with the "
            "end of the request; use stream=false, or logprob_start_len=-1",
            "logprob_start_len",
        )
    call = await server._start("completion", body)
    start = given(body.logprob_start_len)
    for gen in call.gens:
        if body.engine_prompt_logprobs is not None and start >= len(gen.req.prompt_token_ids):
            raise APIError(
                400,
                f"logprob_start_len={start} is past the prompt's {len(gen.req.prompt_token_ids)} tokens: give at most "
                f"{len(gen.req.prompt_token_ids) - 1} (or -1: the generated tokens' logprobs only)",
                "logprob_start_len",
            )
    shape = _Shape(server, call, body, started)
    events = server._events(call)
    if body.stream:
        try:  # errors before the first token are a status code
            first = await until_disconnect(request, next_or_end(events))
        except BaseException:
            await events.aclose()
            raise
        return StreamingResponse(
            shape.stream(first, events),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def collect() -> None:
        async for _ in events:
            pass

    await until_disconnect(request, collect())
    answers = [shape.choice(c, final=True) for c in call.choices]
    return JSONResponse(answers if body.batch or len(answers) > 1 else answers[0])


class _Shape:
    """The SGLang shape of a call's choices, streamed (the text and ids so far) or whole."""

    def __init__(self, server: Server, call: Any, body: GenerateRequest, started: float) -> None:
        self.server, self.call, self.body, self.started = server, call, body, started
        rids = body.rids()
        n = body.n
        self.ids = {c.index: rids[c.index // n] if n == 1 else f"{rids[c.index // n]}_{c.sample}" for c in call.choices}
        self.indexed = body.batch or len(call.choices) > 1

    async def stream(self, first: Any, events: AsyncGenerator[Any, None]) -> AsyncIterator[str]:
        try:
            async for piece in prepend(first, events):
                # a chunk per token (the text and ids so far, as SGLang streams them); the last
                # one of a choice carries its finish_reason
                if piece is not None and (piece.token_ids or piece.end):
                    data = _data(self.choice(piece.choice, final=piece.end))
                    if piece.token_ids:
                        self.server._first_written(self.call, piece.choice)  # TTFT
                    yield data
        except APIError as e:
            yield sse_error(e)
        finally:
            await events.aclose()  # a client that went away: its engine requests are aborted
        yield "data: [DONE]\n\n"

    def choice(self, choice: Any, final: bool) -> dict:
        call, body = self.call, self.body
        gen = call.gen_of(choice)
        out = gen.output
        if out is not None:
            cached, by_tier = out.num_cached_tokens, out.cached_tokens_by_tier
        elif gen.cached is not None:
            cached, by_tier = gen.cached.num_tokens, gen.cached.by_tier
        else:
            cached, by_tier = 0, {}
        meta: dict[str, Any] = {
            "id": self.ids[choice.index],
            "finish_reason": _finish(choice) if final else None,
            "prompt_tokens": len(gen.req.prompt_token_ids),
            "completion_tokens": len(choice.token_ids),
            "cached_tokens": cached,
            "cached_tokens_details": {t: by_tier.get(t, 0) for t in TIERS},
        }
        if body.return_logprob:
            meta.update(self._logprobs(gen, choice))
        if final:
            meta["e2e_latency"] = time.monotonic() - self.started
            routed = self._routed(gen, choice)
            if routed is not None:
                meta["routed_experts"] = routed
        shape: dict[str, Any] = {"text": choice.stream.text, "output_ids": list(choice.token_ids), "meta_info": meta}
        if self.indexed:
            shape["index"] = choice.index
        return shape

    def _logprobs(self, gen: Any, choice: Any) -> dict:
        body, strings = self.body, self.server.strings
        top = given(body.top_logprobs_num)
        text = bool(body.return_text_in_logprobs)

        def entry(tid: int, lp: float | None) -> list:
            return [None if lp is None else _finite(lp), tid, strings.get(tid)[0] if text else None]

        def tops(lps: dict[int, float] | None) -> list | None:
            if not lps:
                return None
            return [entry(t, lp) for t, lp in sorted(lps.items(), key=lambda kv: -kv[1])[:top]]

        out: dict[str, Any] = {
            "output_token_logprobs": [entry(t, lps[t] if lps else None) for t, lps in zip(choice.token_ids, choice.logprobs)],
            "input_token_logprobs": [],
        }
        if top:
            out["output_top_logprobs"] = [tops(lps) for lps in choice.logprobs]
            out["input_top_logprobs"] = []
        prompt_lps = gen.output.prompt_logprobs if gen.output is not None else None
        if body.engine_prompt_logprobs is not None and prompt_lps is not None:
            start = given(body.logprob_start_len)
            ids = gen.req.prompt_token_ids
            out["input_token_logprobs"] = [entry(t, lps[t] if lps else None) for t, lps in zip(ids[start:], prompt_lps[start:])]
            if top:
                out["input_top_logprobs"] = [tops(lps) for lps in prompt_lps[start:]]
        return out

    def _routed(self, gen: Any, choice: Any) -> dict | None:
        out = gen.output
        if out is None or not self.body.return_routed_experts:
            return None
        shape: dict[str, Any] = {}
        self.server._extras(self.call, gen, choice, shape)
        return shape.get("routed_experts")


def _finish(choice: Any) -> dict | None:
    """SGLang's finish_reason of an ended choice."""
    reason = choice.finish_reason
    if reason == "stop":
        matched = choice.stream.matched
        if matched is None:  # an EOS or stop token: the output's last
            matched = choice.token_ids[-1] if choice.token_ids else None
        return {"type": "stop", "matched": matched}
    if reason == "length":
        return {"type": "length", "length": len(choice.token_ids)}
    if reason is None:
        return None
    return {"type": "abort", "message": reason}


def _finite(lp: float) -> float:
    lp = float(lp)
    return lp if lp > FLOOR else FLOOR


def _data(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"
