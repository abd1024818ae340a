"""Request bodies of the OpenAI-compatible API (DESIGN §6), validated by pydantic.

Fields OpenAI defines that kvtier does not implement are accepted only at their neutral value
(``n=1``, ``echo=false``, penalties 0, no logprobs, no logit_bias): anything else is a 400 naming
the field, never a silently different answer. Unknown fields are refused the same way.

``null`` is accepted wherever OpenAI marks a field nullable (and for kvtier's own optional
fields) and means the field's default; ``max_tokens: null`` means the rest of the context. Text
with a lone surrogate (``"\ud800"`` in JSON: no UTF-8 exists for it) is a 400 naming its field.
Booleans are JSON ``true``/``false`` only (``"yes"`` or ``1`` for ``stream`` is a 400, not a guess).
"""
from __future__ import annotations

from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, StrictBool, ConfigDict, Field, field_validator, model_validator

from kvtier.engine.sampling import SamplingParams


class FieldError(ValueError):
    """A bad value found by a whole-body check, with the field it is in (the 400's ``param``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


class _Body(BaseModel):
    """Unknown fields refused; ``null`` for an optional field means its default."""
    model_config = ConfigDict(extra="forbid")
    NULL_KEPT: ClassVar[frozenset[str]] = frozenset()   # fields whose null is not their default

    @model_validator(mode="before")
    @classmethod
    def _nulls_mean_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items()
                if v is not None or k not in fields or fields[k].is_required() or k in cls.NULL_KEPT}


class StreamOptions(_Body):
    include_usage: Optional[StrictBool] = False


class Handoff(BaseModel):
    """D's half of a PD hand-off (sent by the router): P's manifest and first token."""
    model_config = ConfigDict(extra="forbid")
    namespace: str
    keys: list[str]
    num_tokens: int = Field(ge=1)
    first_token: int = Field(ge=0)
    prompt_token_ids: list[int] = Field(min_length=1)
    prefill_cached_tokens: int = Field(0, ge=0)
    response_id: Optional[str] = None
    created: Optional[int] = None


class _Sampling(_Body):
    NULL_KEPT: ClassVar[frozenset[str]] = frozenset({"max_tokens"})   # null: the rest of the context

    model: str
    max_tokens: Optional[int] = Field(None, ge=1, description="null: the rest of the context")
    temperature: Optional[float] = Field(1.0, ge=0.0, le=100.0)
    top_p: Optional[float] = Field(1.0, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(0, ge=-1)
    seed: Optional[int] = Field(None, ge=-(2 ** 63), le=2 ** 63 - 1)
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = Field(default_factory=list)
    ignore_eos: Optional[StrictBool] = False
    return_routed_experts: Optional[StrictBool] = False
    cache_salt: Optional[str] = Field(None, max_length=1024)
    stream: Optional[StrictBool] = False
    stream_options: Optional[StreamOptions] = None
    n: Optional[int] = Field(1, ge=1, le=1, description="only 1 is supported")
    presence_penalty: Optional[float] = Field(0.0, ge=0.0, le=0.0, description="not supported: 0 only")
    frequency_penalty: Optional[float] = Field(0.0, ge=0.0, le=0.0, description="not supported: 0 only")
    logit_bias: Optional[dict[str, float]] = Field(None, max_length=0, description="not supported: {} only")
    user: Optional[str] = None
    skip_special_tokens: Optional[StrictBool] = Field(True, description="leave special tokens out of the text")
    return_token_ids: Optional[StrictBool] = Field(False, description="each choice (each stream chunk) also carries "
                                                                "its token ids")
    kvtier_handoff: Optional[Handoff] = None

    @model_validator(mode="before")
    @classmethod
    def _utf8_text(cls, data: Any) -> Any:
        """A lone surrogate has no UTF-8 form: the tokenizer would fail on it (a 500), so refuse it here."""
        bad = _lone_surrogate(data, "")
        if bad is not None:
            raise FieldError(bad, "text with a lone surrogate (e.g. \\ud800), which is not valid Unicode")
        return data

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: Any) -> Any:
        if isinstance(v, list) and len(v) > 16:
            raise ValueError("at most 16 stop strings")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v: list[int]) -> list[int]:
        if any(t < 0 for t in v):
            raise ValueError("token ids are >= 0")
        return v

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        kw: dict[str, Any] = {}
        if "skip_special_tokens" in _SAMPLING_FIELDS:     # engines that decode text themselves
            kw["skip_special_tokens"] = self.skip_special_tokens
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=max(self.top_k, 0), seed=self.seed, stop_token_ids=tuple(self.stop_token_ids),
                              ignore_eos=self.ignore_eos, return_routed_experts=self.return_routed_experts, **kw)


class CompletionRequest(_Sampling):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: Optional[int] = Field(16, ge=1, description="null: the rest of the context")
    echo: Optional[StrictBool] = Field(False, description="not supported: false only")
    logprobs: Optional[int] = Field(None, ge=0, le=0, description="not supported")
    suffix: Optional[str] = Field(None, max_length=0, description="not supported")
    best_of: Optional[int] = Field(None, ge=1, le=1)

    @field_validator("echo")
    @classmethod
    def _echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError(f"{len(v)} prompts in one request; send one request per prompt")
            v = v[0]
        if isinstance(v, list) and not v or v == "":
            raise ValueError("the prompt is empty")
        if isinstance(v, list) and any(t < 0 for t in v):
            raise ValueError("token ids are >= 0")
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")     # name, tool_calls, ...: the template may use them
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Optional[Union[str, list[dict[str, Any]]]] = None

    @model_validator(mode="after")
    def _text_only(self) -> "ChatMessage":
        if isinstance(self.content, list):
            for part in self.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError("only text content parts are supported")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p["text"] for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1, description="null: max_tokens")
    logprobs: Optional[StrictBool] = Field(False, description="not supported")
    top_logprobs: Optional[int] = Field(None, ge=0, le=0)
    add_generation_prompt: Optional[StrictBool] = True

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: bool) -> bool:
        if v:
            raise ValueError("logprobs are not supported")
        return v


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
