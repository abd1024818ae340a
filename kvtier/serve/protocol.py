"""Request bodies of the OpenAI-compatible API (DESIGN §6), validated by pydantic (after
serve/body.py decoded them: lists stop at their first bad entry).

OpenAI's fields as OpenAI defines them: ``n`` (1..128 samples per prompt), ``logprobs``
(completions: an int 0..20, the top-k per token; chat: ``true`` + ``top_logprobs`` 0..20),
``echo`` (completions: the prompt before each choice's text; with logprobs its tokens' logprobs
too; ``max_tokens: 0`` then scores the prompt alone), ``prompt`` as a string, a token list or a
list of either (one engine request per prompt), ``stop``, ``seed``, ``presence_penalty`` /
``frequency_penalty`` (-2..2), ``best_of`` (null or ``n``). kvtier's own: ``min_tokens``,
``repetition_penalty``, ``logprobs_mode`` and those of ``_Sampling`` below. What they mean for
the engine: ``kvtier/engine/sampling.py``. vLLM's ``priority`` (an int, |priority| < 2**31, lower
first) orders the admission of waiting requests (``kvtier/engine/scheduler.py``).

Fields OpenAI defines that kvtier does not implement are accepted only at their neutral value
(``suffix`` empty, ``logit_bias`` ``{}``, ``response_format`` text): anything else is a 400 naming
the field, never a silently different answer. Unknown fields (``tools``, ...) are refused the same way.

``null`` is accepted wherever OpenAI marks a field nullable (and for kvtier's own optional
fields) and means the field's default; ``max_tokens: null`` means the rest of the context. Text
with a lone surrogate (``"\ud800"`` in JSON: no UTF-8 exists for it) is a 400 naming its field.
Booleans are JSON ``true``/``false`` only (``"yes"`` or ``1`` for ``stream`` is a 400, not a guess).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Optional, TypeVar, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationInfo, field_validator, model_validator

from kvtier.engine.checks import MAX_PRIORITY
from kvtier.engine.params import MAX_LOGPROBS, MAX_N, MAX_STOP_TOKEN_IDS, SamplingParams

MAX_PROMPTS = 1024  # prompts in one completions request
MAX_STOP_STRINGS = 16
# logprob entries one answer may hold (each a token with its top-k; ~70 bytes of JSON each)
MAX_LOGPROB_ENTRIES = 2**21


class FieldError(ValueError):
    """A bad value found by a whole-body check, with the field it is in (the 400's ``param``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


class _Body(BaseModel):
    """Unknown fields refused; ``null`` for an optional field means its default."""

    model_config = ConfigDict(extra="forbid")
    NULL_KEPT: ClassVar[frozenset[str]] = frozenset()  # fields whose null is not their default

    @model_validator(mode="before")
    @classmethod
    def _nulls_mean_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            k: v for k, v in data.items() if v is not None or k not in fields or fields[k].is_required() or k in cls.NULL_KEPT
        }


_T = TypeVar("_T")


def _given(value: _T | None) -> _T:
    """A field whose null means its default: never None once validated (``_Body`` drops the nulls)."""
    assert value is not None
    return value


class StreamOptions(_Body):
    include_usage: Optional[StrictBool] = False


class PrefillCached(BaseModel):
    """What P found cached of the prompt: D reports it as ``usage.kvtier.prefill``."""

    model_config = ConfigDict(extra="forbid")
    cached_tokens: StrictInt = Field(default=0, ge=0)
    cached_tokens_by_tier: dict[str, Annotated[StrictInt, Field(ge=0)]] = Field(default_factory=dict)


class Handoff(BaseModel):
    """D's half of a PD hand-off (sent by the router): P's manifest and first token."""

    model_config = ConfigDict(extra="forbid")
    namespace: str
    keys: list[str] = Field(fail_fast=True)
    num_tokens: int = Field(ge=1)
    first_token: int = Field(ge=0)
    prompt_token_ids: list[StrictInt] = Field(min_length=1, fail_fast=True)
    prefill: PrefillCached = Field(default_factory=PrefillCached)
    response_id: Optional[str] = None
    created: Optional[int] = None


# Fields vLLM's or SGLang's servers take that kvtier does not implement. Their clients send some
# with their no-op value (``"use_beam_search": false``): that value is accepted (and dropped); any
# other is a 400 naming the field, never a silently different answer.
_STRUCTURED = "structured output (JSON schema, regex, grammar, choice)"
PEER_FIELDS: dict[str, tuple[tuple[Any, ...], str]] = {
    "use_beam_search": ((False,), "beam search"),
    "length_penalty": ((1.0,), "beam search's length penalty"),
    "include_stop_str_in_output": ((False,), "keeping the stop string in the output"),
    "no_stop_trim": ((False,), "keeping the stop string in the output"),
    "spaces_between_special_tokens": ((True,), "detokenizing without spaces between special tokens"),
    "truncate_prompt_tokens": ((None,), "truncating the prompt"),
    "allowed_token_ids": ((None, []), "allowed_token_ids"),
    "bad_words": ((None, []), "bad_words"),
    "prompt_logprobs": ((None,), "prompt_logprobs (completions: echo=true with logprobs gives the prompt's)"),
    "typical_p": ((None, 1.0), "typical sampling"),
    "lora_path": ((None,), "LoRA adapters"),
    "lora_request": ((None,), "LoRA adapters"),
    "custom_logit_processor": ((None,), "custom logit processors"),
    "guided_json": ((None,), _STRUCTURED),
    "guided_regex": ((None,), _STRUCTURED),
    "guided_choice": ((None,), _STRUCTURED),
    "guided_grammar": ((None,), _STRUCTURED),
    "structured_outputs": ((None,), _STRUCTURED),
    "regex": ((None,), _STRUCTURED),
    "json_schema": ((None,), _STRUCTURED),
    "ebnf": ((None,), _STRUCTURED),
}


class _Sampling(_Body):
    NULL_KEPT: ClassVar[frozenset[str]] = frozenset({"max_tokens"})  # null: the rest of the context

    model: str
    max_tokens: Optional[int] = Field(None, ge=1, description="null: the rest of the context")
    temperature: Optional[float] = Field(1.0, ge=0.0, le=100.0, allow_inf_nan=False)
    top_p: Optional[float] = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: Optional[int] = Field(0, ge=-1)
    min_p: Optional[float] = Field(
        0.0, ge=0.0, le=1.0, allow_inf_nan=False, description="drop tokens less likely than min_p x the likeliest; 0: off"
    )
    seed: Optional[int] = Field(None, ge=-(2**63), le=2**63 - 1)
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[StrictInt]] = Field(default_factory=list, max_length=MAX_STOP_TOKEN_IDS, fail_fast=True)
    ignore_eos: Optional[StrictBool] = False
    return_routed_experts: Optional[StrictBool] = False
    cache_salt: Optional[str] = Field(None, max_length=1024)
    stream: Optional[StrictBool] = False
    stream_options: Optional[StreamOptions] = None
    n: Optional[int] = Field(1, ge=1, le=MAX_N, description="samples per prompt")
    presence_penalty: Optional[float] = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: Optional[float] = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: Optional[float] = Field(
        1.0, gt=0.0, allow_inf_nan=False, description="> 1 discourages every token of the prompt and output"
    )
    min_tokens: Optional[int] = Field(0, ge=0, description="no EOS or stop token before this many tokens")
    logprobs_mode: Optional[Literal["raw", "processed"]] = Field(
        "raw", description="raw: the model's distribution; processed: the one sampled from"
    )
    logit_bias: Optional[dict[str, Any]] = Field(None, max_length=0, description="not supported: {} only")
    user: Optional[str] = None
    skip_special_tokens: Optional[StrictBool] = Field(True, description="leave special tokens out of the text")
    return_token_ids: Optional[StrictBool] = Field(
        False, description="each choice (each stream chunk) also carries its token ids"
    )
    priority: Optional[StrictInt] = Field(
        0,
        ge=-MAX_PRIORITY,
        le=MAX_PRIORITY,
        description="vLLM's: lower runs first when requests wait for a running slot (default 0)",
    )
    kvtier_handoff: Optional[Handoff] = None

    @model_validator(mode="before")
    @classmethod
    def _peer_fields(cls, data: Any) -> Any:
        """vLLM's and SGLang's fields kvtier does not implement (:data:`PEER_FIELDS`): dropped at
        their no-op value, else a 400 that names them as unsupported."""
        if not isinstance(data, dict) or not PEER_FIELDS.keys() & data.keys():
            return data
        data = dict(data)
        for name in PEER_FIELDS.keys() & data.keys():
            noop, what = PEER_FIELDS[name]
            value = data.pop(name)
            # (a bool is not a number here: length_penalty=true is refused, length_penalty=1 is not)
            if not any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in noop):
                raise FieldError(name, f"{name}={value!r}: {what} is not supported by kvtier")
        return data

    @model_validator(mode="before")
    @classmethod
    def _utf8_text(cls, data: Any, info: ValidationInfo) -> Any:
        """A lone surrogate has no UTF-8 form: the tokenizer would fail on it (a 500), so refuse it
        here. Not again for a body msgspec decoded (``context={"utf8": True}``, serve/body.py): it
        refuses lone surrogates itself, and this walk costs ~7 ms on a 4K-token prompt."""
        if info.context and info.context.get("utf8"):
            return data
        bad = _lone_surrogate(data, "")
        if bad is not None:
            raise FieldError(bad, "text with a lone surrogate (e.g. \\ud800), which is not valid Unicode")
        return data

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: Any) -> Any:
        if isinstance(v, list) and len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"{len(v)} stop strings: at most {MAX_STOP_STRINGS}")
        return v

    @model_validator(mode="after")
    def _min_tokens(self) -> "_Sampling":
        cap = self.max_tokens_asked
        if cap is not None and _given(self.min_tokens) > cap:
            raise FieldError("min_tokens", f"min_tokens={self.min_tokens} is more than max_tokens={cap}")
        return self

    @property
    def max_tokens_asked(self) -> int | None:
        return self.max_tokens

    @property
    def max_tokens_name(self) -> str:
        """The field ``max_tokens_asked`` came in (errors name it)."""
        return "max_tokens"

    prompt_name: ClassVar[str] = "prompt"  # the field a text prompt comes in (errors name it)

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v: list[int]) -> list[int]:
        if any(t < 0 for t in v):
            raise ValueError("token ids are >= 0")
        return v

    @property
    def stop_strings(self) -> list[str]:
        """The non-empty stop strings ("" stops nothing)."""
        if self.stop is None:
            return []
        return [s for s in ([self.stop] if isinstance(self.stop, str) else self.stop) if s]

    @property
    def engine_logprobs(self) -> int | None:
        """``SamplingParams.logprobs``: top-k per generated token, None for none."""
        return None

    @property
    def engine_prompt_logprobs(self) -> int | None:
        return None

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """The engine's params (ValueError names the bad field first: ``sampling_param`` finds it)."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=_given(self.temperature),
            top_p=_given(self.top_p),
            top_k=max(_given(self.top_k), 0),
            min_p=_given(self.min_p),
            seed=self.seed,
            stop_token_ids=tuple(_given(self.stop_token_ids)),
            ignore_eos=_given(self.ignore_eos),
            return_routed_experts=_given(self.return_routed_experts),
            skip_special_tokens=_given(self.skip_special_tokens),
            n=_given(self.n),
            logprobs=self.engine_logprobs,
            prompt_logprobs=self.engine_prompt_logprobs,
            presence_penalty=_given(self.presence_penalty),
            frequency_penalty=_given(self.frequency_penalty),
            repetition_penalty=_given(self.repetition_penalty),
            min_tokens=_given(self.min_tokens),
            stop=tuple(self.stop_strings),
            logprobs_mode=_given(self.logprobs_mode),
        )


def sampling_param(message: str) -> str | None:
    """The field a SamplingParams ValueError is about (its messages start with the field's name)."""
    name = message.split(" ", 1)[0]
    return name if name in _SAMPLING_FIELDS else None


class CompletionRequest(_Sampling):
    prompt: Union[str, list[StrictInt], list[str], list[list[StrictInt]]]
    max_tokens: Optional[int] = Field(
        16, ge=0, description="null: the rest of the context; 0: with echo only (the prompt's logprobs, nothing generated)"
    )
    echo: Optional[StrictBool] = Field(False, description="the prompt before each choice's text (and its logprobs)")
    logprobs: Optional[StrictInt] = Field(
        None, ge=0, le=MAX_LOGPROBS, description="top-k logprobs per token (an int: chat's is the bool)"
    )
    suffix: Optional[str] = Field(None, max_length=0, description="not supported")
    best_of: Optional[int] = Field(None, ge=1, le=MAX_N, description="null or n only")

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v: Any) -> Any:
        batch = v if isinstance(v, list) and v and isinstance(v[0], (str, list)) else [v]
        if len(batch) > MAX_PROMPTS:
            raise ValueError(f"{len(batch)} prompts in one request: at most {MAX_PROMPTS}")
        for i, p in enumerate(batch):
            where = f"prompt {i}" if len(batch) > 1 else "the prompt"
            if isinstance(p, list) and not p or p == "":
                raise ValueError(f"{where} is empty")
            if isinstance(p, list) and any(t < 0 for t in p):
                raise ValueError(f"{where}: token ids are >= 0")
        return v

    @model_validator(mode="after")
    def _echo_and_best_of(self) -> "CompletionRequest":
        if self.max_tokens == 0 and not self.echo:
            raise FieldError("max_tokens", "max_tokens=0 generates nothing: it needs echo=true (the prompt, with its logprobs)")
        if self.best_of is not None and self.best_of != self.n:
            raise FieldError(
                "best_of",
                f"best_of={self.best_of} with n={self.n}: only best_of = n (or null) is supported; every sample is returned",
            )
        return self

    @property
    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompts of the request (one engine request each)."""
        p = self.prompt
        return list(p) if isinstance(p, list) and isinstance(p[0], (str, list)) else [p]

    @property
    def engine_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def engine_prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, ...: the template may use them
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Optional[Union[str, list[dict[str, Any]]]] = None

    @model_validator(mode="after")
    def _text_and_images(self) -> "ChatMessage":
        if isinstance(self.content, list):
            for part in self.content:
                kind = part.get("type")
                if kind == "image_url":
                    image = part.get("image_url")
                    if not isinstance(image, dict) or not isinstance(image.get("url"), str):
                        raise ValueError('an image_url content part is {"type": "image_url", "image_url": {"url": "data:..."}}')
                elif kind != "text" or not isinstance(part.get("text"), str):
                    raise ValueError("content parts are text or image_url")
        return self

    def text(self, image_mark: str = "") -> str:
        """The content's text, ``image_mark`` where each image stood."""
        if isinstance(self.content, list):
            return "".join(p["text"] if p["type"] == "text" else image_mark for p in self.content)
        return self.content or ""

    def image_urls(self) -> list[str]:
        if isinstance(self.content, list):
            return [p["image_url"]["url"] for p in self.content if p["type"] == "image_url"]
        return []


class ResponseFormat(_Body):
    type: Literal["text"] = Field(description="only text is supported")


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, fail_fast=True)
    max_completion_tokens: Optional[int] = Field(None, ge=1, description="null: max_tokens")
    logprobs: Optional[StrictBool] = Field(False, description="the logprob of each generated token")
    top_logprobs: Optional[StrictInt] = Field(
        None, ge=0, le=MAX_LOGPROBS, description="with logprobs: the k most likely tokens at each position"
    )
    response_format: Optional[ResponseFormat] = None
    add_generation_prompt: Optional[StrictBool] = True

    @model_validator(mode="after")
    def _top_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs needs logprobs=true")
        return self

    @property
    def prompts(self) -> list[list[ChatMessage]]:
        """One prompt: the messages."""
        return [self.messages]

    @property
    def max_tokens_asked(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def max_tokens_name(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


_SAMPLING_FIELDS = set(getattr(SamplingParams, "__dataclass_fields__", {}))


def _lone_surrogate(value: Any, where: str) -> str | None:
    """The dotted path of the first string in ``value`` with a lone surrogate, or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where or "body"
        return None
    if isinstance(value, dict):
        items: Any = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return None
    for k, v in items:
        if isinstance(k, str) and _lone_surrogate(k, "") is not None:
            return where or "body"
        found = _lone_surrogate(v, f"{where}.{k}" if where else str(k))
        if found is not None:
            return found
    return None


# for the bodies of other endpoints (serve/sglang.py): the base and its null-means-default reader
Body = _Body
given = _given
