"""Pure ASGI layers in front of the server's and the router's apps: health checks, API key,
body size cap.

::

    uvicorn ─► FastGet ─► ApiKeyAuth ─► BodyLimit ─► FastAPI app           (kvtier serve)
               /health      401          413
    uvicorn ─► CheapPath ─► ApiKeyAuth ─► BodyLimit ─► FastAPI app         (kvtier router)
               /health counted

The cheap answers (``/health``, 401) are counted against the client's rate of them
(:func:`kvtier.serve.guard.charge`): under a server run with a guard (serve/guard.py), a client
address over ``--cheap-request-rate`` has its connections left unread until it is back under.

Both are plain ``async __call__(scope, receive, send)`` classes, not Starlette's
``BaseHTTPMiddleware``: that one runs the endpoint in a task of its own behind a wrapped
``receive``, so the endpoint never sees ``http.disconnect`` and a client that hangs up on a
non-streaming request is never noticed (its request generates to the end). These layers hand
``receive`` through untouched (ApiKeyAuth) or only count the bytes it carries (BodyLimit).
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Any, Callable

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvtier.serve.errors import error_response
from kvtier.serve.guard import charge

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
# An oversized body is read and thrown away (never buffered, never parsed) up to this many bytes
# before the 413 goes out: a client still sending when the server answers and closes gets a
# connection reset instead of the 413 (uvicorn stops reading once the response is complete).
# Beyond it (or after DRAIN_MAX_S) the connection is simply closed after the 413. A client that
# sent `Expect: 100-continue` (curl does for large bodies) has sent nothing yet: it gets the 413
# at once and never sends the body.
DRAIN_MAX_BYTES = 256 * 1024 * 1024
DRAIN_MAX_S = 10.0


class ApiKeyAuth:
    """401 for HTTP requests under ``prefixes`` without ``Authorization: Bearer KEY``."""

    def __init__(self, app: ASGIApp, key: str, prefixes: tuple[str, ...]) -> None:
        if not key:
            raise ValueError("the API key is empty: give a key, or none for no authentication")
        self.app, self.prefixes = app, prefixes
        self._expected = f"Bearer {key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(self.prefixes):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self._expected):
                charge(scope, "unauthorized")
                response = error_response(401, "invalid or missing API key (Authorization: Bearer KEY)")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyTooLarge(HTTPException):
    """Raised from ``receive`` once a streamed body passes the cap: the app's body parsing lets
    HTTPExceptions through, so its exception handler answers 413 in the OpenAI shape."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, body_too_large_message(max_bytes))


def body_too_large_message(max_bytes: int) -> str:
    return f"the request body is over the server's limit of {max_bytes} bytes (--max-body-bytes)"


class BodyLimit:
    """413 for request bodies over ``max_bytes``: at once when Content-Length says so, else (a
    chunked body) as soon as the bytes received pass the cap — before the app parses any JSON."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {max_bytes}")
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            if int(length) <= DRAIN_MAX_BYTES and headers.get(b"expect", b"").lower() != b"100-continue":
                await _drain(receive, DRAIN_MAX_BYTES)
            await self._refuse(scope, receive, send)
            return
        received = 0
        started = False

        async def counted_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    if message.get("more_body"):
                        await _drain(receive, DRAIN_MAX_BYTES - received)
                    raise BodyTooLarge(self.max_bytes)
            return message

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except BodyTooLarge:  # an app without a handler for it (or one that re-raised)
            if started:
                raise
            await self._refuse(scope, receive, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Connection: close, because the rest of the body is never read from the socket
        response = error_response(413, body_too_large_message(self.max_bytes), headers={"Connection": "close"})
        await response(scope, receive, send)


async def _drain(receive: Receive, max_bytes: int) -> None:
    """Read and discard the rest of a request body (at most ``max_bytes``, ``DRAIN_MAX_S``)."""

    async def drain() -> None:
        nonlocal max_bytes
        while max_bytes > 0:
            message = await receive()
            if message["type"] != "http.request":
                return
            max_bytes -= len(message.get("body", b""))
            if not message.get("more_body"):
                return

    try:
        await asyncio.wait_for(drain(), DRAIN_MAX_S)
    except asyncio.TimeoutError:
        pass


class FastGet:
    """``GET path`` answered by ``handler()`` (a Starlette response) before the app's routing and
    middleware: a load balancer's health checks, or a flood of them, cost the interpreter that
    streams every client's tokens as little as an answer can. Each is counted as a cheap request
    (``reason``) against its client's rate."""

    def __init__(self, app: ASGIApp, path: str, handler: Callable[[], Any], reason: str = "health") -> None:
        self.app, self.path, self.handler, self.reason = app, path, handler, reason

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == self.path and scope["method"] in ("GET", "HEAD"):
            charge(scope, self.reason)
            await self.handler()(scope, receive, send)
            return
        await self.app(scope, receive, send)


class CheapPath:
    """``GET path`` passed on to the app, counted as a cheap request (``reason``) against its
    client's rate: the router's ``/health``."""

    def __init__(self, app: ASGIApp, path: str, reason: str = "health") -> None:
        self.app, self.path, self.reason = app, path, reason

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == self.path and scope["method"] in ("GET", "HEAD"):
            charge(scope, self.reason)
        await self.app(scope, receive, send)


def wrap(app: ASGIApp, api_key: str | None, key_prefixes: tuple[str, ...], max_body_bytes: int | None) -> ASGIApp:
    """The app behind the layers that are configured (``None``: that layer is off)."""
    if max_body_bytes is not None:
        app = BodyLimit(app, max_body_bytes)
    if api_key is not None:
        app = ApiKeyAuth(app, api_key, key_prefixes)
    return app
