"""OpenAI's error shape, shared by the server and the router.

::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": 400}}

``APIError`` is raised anywhere in a request's handling and answered in this shape by the apps'
exception handlers; ``error_body`` / ``error_response`` build it where there is no exception (the
ASGI layers of ``asgi.py``, the router's own answers, an in-stream error event).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvtier.redact import redact_text

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "request_too_large",
    502: "bad_gateway",
    503: "overloaded_error",
    504: "timeout",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type_: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type = type_ or error_type(status)


def error_type(status: int) -> str:
    """The error's ``type`` by its status: a 4xx is the client's (``invalid_request_error`` unless
    a narrower type fits: 401, 404, 413), any other status without a type of its own a
    ``server_error``."""
    return _TYPES.get(status) or ("invalid_request_error" if 400 <= status < 500 else "server_error")


def error_body(status: int, message: str, param: str | None = None, type_: str | None = None) -> dict[str, Any]:
    e = APIError(status, message, param, type_)
    # (an engine's or a pool's error may quote a URL with its password: kvtier/redact.py)
    return {"error": {"message": redact_text(e.message), "type": e.type, "param": e.param, "code": status}}


def error_response(
    status: int, message: str, param: str | None = None, type_: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, type_), status_code=status, headers=headers)


def sse_error(e: APIError) -> str:
    """An error said inside an SSE stream (the status line went out already)."""
    return f"data: {json.dumps(error_body(e.status, e.message, e.param, e.type), separators=(',', ':'))}\n\n"


def invalid_json_message(error: str, doc: Any = None, position: Any = None, what: str = "the request body") -> str:
    """``the request body is not valid JSON: Expecting value at line 1, column 28`` (server, router)."""
    where = ""
    if isinstance(position, int) and isinstance(doc, (str, bytes)):
        before = doc[:position]
        if isinstance(before, str):
            newlines, last = before.count("\n"), before.rfind("\n")
        else:
            newlines, last = before.count(b"\n"), before.rfind(b"\n")
        where = f" at line {newlines + 1}, column {position - (last + 1) + 1}"
    return f"{what} is not valid JSON: {error}{where}"


def add_error_handlers(app: FastAPI) -> None:
    """OpenAI-shaped answers for every error of ``app`` (the server's and the router's)."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        first = errs[0] if errs else {}
        ctx = first.get("ctx") or {}
        loc = list(first.get("loc", ()))
        if first.get("type") == "json_invalid":
            return error_response(400, invalid_json_message(ctx.get("error", "JSON decode error"), exc.body, loc[-1]))
        param = getattr(ctx.get("error"), "param", None)  # protocol.FieldError: a whole-body check
        if isinstance(param, str):
            return error_response(400, str(ctx["error"]), param=param)
        where = ".".join(str(p) for p in loc if p != "body") or "body"
        return error_response(400, f"{where}: {first.get('msg', 'invalid request')}", param=where)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(APIError)
    async def _api(_request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.type)

    @app.exception_handler(Exception)
    async def _bug(_request: Request, exc: Exception) -> JSONResponse:
        # a bug of ours, not the client's: logged with its traceback (Starlette re-raises it)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")


async def until_disconnect(request: Request, coro: Any) -> Any:
    """Await ``coro``; if the client goes away first, cancel it (which aborts its request, or
    closes the router's call to the server that runs it) and raise APIError(499).

    The task is awaited after its cancel: until it has unwound, a generator it was iterating is
    still running, and closing that generator then fails ("aclose(): asynchronous generator is
    already running")."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise APIError(499, "client disconnected")
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
