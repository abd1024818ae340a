"""Request bodies of the OpenAI-compatible API (DESIGN §6), validated by pydantic.

Fields OpenAI defines that kvtier does not implement are accepted only at their neutral value
(``n=1``, ``echo=false``, penalties 0, no logprobs): anything else is a 400 naming the field,
never a silently different answer. Unknown fields are refused the same way.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvtier.engine.sampling import SamplingParams


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


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


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    seed: Optional[int] = Field(None, ge=-(2 ** 63), le=2 ** 63 - 1)
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    return_routed_experts: bool = False
    cache_salt: Optional[str] = Field(None, max_length=1024)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: int = Field(1, ge=1, le=1, description="only 1 is supported")
    presence_penalty: float = Field(0.0, ge=0.0, le=0.0, description="not supported: 0 only")
    frequency_penalty: float = Field(0.0, ge=0.0, le=0.0, description="not supported: 0 only")
    user: Optional[str] = None
    return_token_ids: bool = Field(False, description="each choice (each stream chunk) also carries its token ids")
    kvtier_handoff: Optional[Handoff] = None

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
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=max(self.top_k, 0), seed=self.seed, stop_token_ids=tuple(self.stop_token_ids),
                              ignore_eos=self.ignore_eos, return_routed_experts=self.return_routed_experts)


class CompletionRequest(_Sampling):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: Optional[int] = Field(16, ge=1)
    echo: bool = Field(False, description="not supported: false only")
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
    model_config = ConfigDict(extra="allow")
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
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = Field(False, description="not supported")
    top_logprobs: Optional[int] = Field(None, ge=0, le=0)
    add_generation_prompt: bool = True

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: bool) -> bool:
        if v:
            raise ValueError("logprobs are not supported")
        return v
