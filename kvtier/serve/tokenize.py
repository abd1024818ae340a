"""The endpoints vLLM's and SGLang's clients call besides the OpenAI API, in vLLM's shapes:

    POST /tokenize            {"prompt": text} | {"messages": [...]} -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize          {"tokens": [ids]}                      -> {"prompt": text}
    GET  /tokenizer_info      the tokenizer's class, config and chat template (lm-eval reads it)
    POST /reset_prefix_cache  (vLLM) and /flush_cache (SGLang, GET or POST): drop every cached
                              block no request holds from the device and host tiers; the pool stays
    GET  /server_info         the served model and the engine's configuration

``/tokenize`` gives the ids the completions and chat endpoints feed the engine for the same
prompt (kvtier adds no special tokens to a completion prompt; ``add_special_tokens: true`` asks
for the tokenizer's, e.g. a BOS). The server checks ``--api-key`` on all of them.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, model_validator

from kvtier.redact import redact
from kvtier.serve.errors import APIError
from kvtier.serve.media import IMAGE_MARK
from kvtier.serve.protocol import ChatMessage

# ``server`` below: the kvtier.serve.api.Server answering (typed Any: that module imports this one)
Server = Any

KEY_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info", "/reset_prefix_cache", "/flush_cache", "/server_info")


class TokenizeRequest(BaseModel):
    """vLLM's ``TokenizeCompletionRequest`` or ``TokenizeChatRequest``: one of ``prompt``, ``messages``."""

    model_config = ConfigDict(extra="forbid")
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = Field(None, min_length=1)
    add_special_tokens: Optional[StrictBool] = False
    add_generation_prompt: Optional[StrictBool] = True
    return_token_strs: Optional[StrictBool] = False

    @model_validator(mode="after")
    def _one_prompt(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give one of prompt (text) or messages (a chat)")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: Optional[str] = None
    tokens: list[StrictInt] = Field(fail_fast=True)


def _check_model(server: Server, name: str | None) -> None:
    if name is not None and not server.serves(name):
        raise APIError(404, f"model {name!r} is not served here (this server serves {server.model_name!r})", "model")


def _tokenizer(server: Server) -> Any:
    if server.tokenizer is None:
        raise APIError(400, "this model has no tokenizer (the checkpoint ships none): prompts are token ids")
    return server.tokenizer


async def tokenize(server: Server, body: TokenizeRequest) -> dict:
    _check_model(server, body.model)
    tok = _tokenizer(server)
    # bounded by the context, as a prompt is: a text far past it is refused before it is tokenized
    # (a count up to the context is an answer here, the context itself included)
    if body.prompt is not None:
        ids = await server.prompts.completion_ids(
            body.prompt, server.max_model_len, bool(body.add_special_tokens), owner=id(body)
        )
    else:
        assert body.messages is not None  # (one of the two: checked)
        images = server.images  # a vision-language model: each image counts as its placeholder tokens
        if images is None and any(m.image_urls() for m in body.messages):
            raise APIError(400, "this model takes no images", "messages")
        messages = [{"role": m.role, "content": m.text(IMAGE_MARK if images else "")} for m in body.messages]
        ids = await server.prompts.chat_ids(messages, bool(body.add_generation_prompt), server.max_model_len, owner=id(body))
        if images is not None:
            ids = images.expanded(ids)
    return {
        "count": len(ids),
        "max_model_len": server.max_model_len,
        "tokens": ids,
        "token_strs": tok.convert_ids_to_tokens(ids) if body.return_token_strs else None,
    }


async def detokenize(server: Server, body: DetokenizeRequest) -> dict:
    _check_model(server, body.model)
    tok = _tokenizer(server)
    # (at most the context's ids: body.py refuses more before they are parsed)
    bad = next((t for t in body.tokens if not 0 <= t < server.vocab_size), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is not in 0..{server.vocab_size - 1}", "tokens")
    return {"prompt": await server.prompts.run(id(body), tok.decode, body.tokens)}


def tokenizer_info(server: Server) -> dict:
    """The tokenizer's class and its config (``tokenizer_config.json``'s values that are JSON),
    with its chat template: what a client needs to tokenize as the server does."""
    tok = _tokenizer(server)
    info: dict[str, Any] = {}
    for k, v in (getattr(tok, "init_kwargs", None) or {}).items():
        if isinstance(v, dict) and "content" in v:  # an AddedToken written out
            v = v["content"]
        v = getattr(v, "content", v)  # an AddedToken
        try:
            json.dumps(v)
        except (TypeError, ValueError):
            continue
        info[k] = v
    info.update(
        tokenizer_class=type(tok).__name__,
        chat_template=getattr(tok, "chat_template", None),
        vocab_size=len(tok),
        model_max_length=server.max_model_len,
    )
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        info[name] = getattr(tok, name, None)
    return info


async def reset_prefix_cache(server: Server) -> dict:
    dropped = await server.engine.call("reset_prefix_cache")
    return {"status": "ok", "dropped_blocks": dropped}


def server_info(server: Server) -> dict:
    config = dataclasses.asdict(server.engine.config)
    return {
        "version": __import__("kvtier").__version__,
        "model": server.model_name,
        "model_path": server.model_path,
        "served_model_names": sorted(server.model_names),
        "role": server.role,
        "max_model_len": server.max_model_len,
        "vocab_size": server.vocab_size,
        "engine_config": redact(config),
        # an fp8 cache: its dtype, whether its scales are the checkpoint's or calibrated, their digest
        "kv_cache": getattr(getattr(server.engine, "startup", None), "kv_cache", None),
    }
