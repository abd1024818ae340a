"""Request bodies decoded so that a bad one costs little, whatever its size: the first error
stops the work, and no work is done per element before the shape is known.

FastAPI's own path (``json.loads`` of the whole body, then pydantic) spends seconds on the event
loop for a 15 MB body of three million floats where token ids belong, and builds one error per
element (gigabytes). Here (msgspec is a C decoder; pydantic's ``FailFast`` stops its lists too)::

    body bytes ─ msgspec: top-level object, each field's value kept as raw bytes (one C scan)
       ├─ "prompt": its shape from its first bytes (a string, ids, strings or lists of ids);
       │   a list of ids longer than the context is refused by counting commas (no parse);
       │   else decoded with its type: the first non-int (a float, a bool, ``{}``) stops it
       └─ every other field decoded alone ─► pydantic (the protocol's checks, FailFast lists)

``NaN`` and ``Infinity`` are not JSON (msgspec refuses them: a 400), nor is a number that does
not fit a double. Nesting past the decoder's recursion limit is a 400 too.
:func:`parse` runs on a worker thread (``asyncio.to_thread``), never on the event loop.
"""

from __future__ import annotations

import json
import re
from typing import Any, TypeVar

import msgspec
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from kvtier.engine.params import MAX_STOP_TOKEN_IDS
from kvtier.serve.errors import APIError, invalid_json_message

_M = TypeVar("_M", bound=BaseModel)
_ANY_FIELDS = msgspec.json.Decoder(dict[str, msgspec.Raw])
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_REPARSE_MAX_BYTES = 1 << 20
_BYTE = re.compile(r" \(byte (\d+)\)")
# fields whose valid values are small (the protocol's bounds): a larger one is refused by its size,
# never decoded (1.4 million logit_bias entries took 1.3 s to refuse after decoding)
_MAX_RAW_BYTES = {"logit_bias": 1024, "stop_token_ids": 24 * MAX_STOP_TOKEN_IDS + 64, "cache_salt": 8 * 1024}
_PROMPT_FIELDS = ("prompt", "input_ids")  # completions' prompt, SGLang's /generate input_ids
_PROMPT_TYPES: dict[bytes, Any] = {
    b'"': list[str],  # ["a", "b"]: several text prompts
    b"[": list[list[int]],  # [[1, 2], [3]]: several token-id prompts
}


def parse(model: type[_M], raw: bytes, max_model_len: int) -> _M:
    """``raw`` as ``model``: APIError(400) for what is not JSON or not an object, a
    RequestValidationError (the app's 400 handler) for what the protocol refuses."""
    try:
        fields = _ANY_FIELDS.decode(raw)
    except msgspec.ValidationError:
        raise APIError(400, "the request body must be a JSON object") from None
    except RecursionError:
        raise APIError(400, "the request body is JSON nested too deep") from None
    except msgspec.DecodeError as e:
        if _SURROGATE.search(raw) is None:
            where = _BYTE.search(str(e))
            what = _BYTE.sub("", str(e)).removeprefix("JSON is malformed: ")
            raise APIError(400, invalid_json_message(what, raw, int(where.group(1)) if where else None)) from None
        # msgspec refuses a lone surrogate (\ud800) as malformed JSON; the protocol names the
        # field it is in, from Python's parse of a body small enough to parse twice
        if len(raw) > _REPARSE_MAX_BYTES:
            raise APIError(400, "the request body has text with a lone surrogate (e.g. \\ud800): not valid Unicode") from None
        return _validate(model, json.loads(raw), utf8=False)
    data: dict[str, Any] = {}
    for name, value in fields.items():
        cap = _MAX_RAW_BYTES.get(name)
        if cap is not None and len(value) > cap:
            raise APIError(400, f"{name} is {len(value)} bytes of JSON: more than any value it may take ({cap} bytes)", name)
        try:
            if name in _PROMPT_FIELDS:
                data[name] = _prompt(value, max_model_len, name)
            elif name == "tokens":  # /detokenize: up to a whole context
                data[name] = _ids(
                    bytes(value).lstrip(), max_model_len + 1, "tokens", f"ids: more than the model's context of {max_model_len}"
                )
            else:
                data[name] = msgspec.json.decode(value)
        except RecursionError:
            raise APIError(400, f"{name}: JSON nested too deep", name) from None
        except msgspec.ValidationError as e:
            raise APIError(400, f"{name}: {e}", name) from None
        except msgspec.DecodeError as e:  # (the top-level scan found it whole: not expected)
            raise APIError(400, invalid_json_message(f"{name}: {e}")) from None
    return _validate(model, data, utf8=True)


def _validate(model: type[_M], data: Any, utf8: bool) -> _M:
    """``utf8``: msgspec decoded ``data``, so its text has no lone surrogate (it refuses them)."""
    try:
        return model.model_validate(data, context={"utf8": utf8})
    except ValidationError as e:
        raise RequestValidationError(e.errors(include_url=False)[:1], body=None) from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deep") from None


def _prompt(raw: msgspec.Raw, max_model_len: int, name: str = "prompt") -> Any:
    """A completions ``prompt`` (or /generate's ``input_ids``: ``name``) decoded by the type its
    first bytes announce; a single list of token ids with ``max_model_len`` or more entries is
    refused before it is decoded."""
    # its shape from its first bytes, without copying the rest (a 13 MB batch of text prompts
    # was copied three times on the way)
    head = bytes(memoryview(raw)[:64]).lstrip()
    if not head[1:].lstrip():  # whitespace to the 64th byte: the shape is further on
        head = bytes(raw).lstrip()
    if not head.startswith(b"["):
        return msgspec.json.decode(raw)  # a string (or a wrong type, which pydantic names)
    kind = _PROMPT_TYPES.get(head[1:].lstrip()[:1])
    if kind is None:
        why = (
            f"tokens: the model's context of {max_model_len} (max_model_len) leaves no room to generate; "
            f"send at most {max_model_len - 1}"
        )
        return _ids(bytes(raw).lstrip(), max_model_len, name, why)
    return msgspec.json.decode(raw, type=kind)


def _ids(b: bytes, limit: int, name: str, what: str) -> list[int]:
    """A JSON list of ints with fewer than ``limit`` entries, refused (APIError 400) by counting
    its commas before it is decoded: one fewer than entries, and none inside an int."""
    if b.startswith(b"[") and b[1:].lstrip()[:1] != b"]":
        n = b.count(b",") + 1
        if n >= limit:
            raise APIError(400, f"the {name} has {n} {what}", name)
    return msgspec.json.decode(b, type=list[int])


def body_schema(model: type[BaseModel]) -> dict:
    """The OpenAPI ``requestBody`` of an endpoint whose body :func:`parse` reads (FastAPI
    documents only the bodies it parses itself); its models are in :func:`with_schemas`."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def with_schemas(app: Any, *models: type[BaseModel]) -> None:
    """``app``'s OpenAPI document with ``models`` (and the models they use) in its components."""
    from fastapi.openapi.utils import get_openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for m in models:
                s = m.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(s.pop("$defs", {}))
                schemas[m.__name__] = s
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi
