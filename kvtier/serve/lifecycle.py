"""A server's life as load balancers see it: ``starting`` → ``ready`` → (``dead``).

``kvtier serve`` binds its port at once and builds the engine on a thread meanwhile (loading
weights, compiling every kernel, capturing CUDA graphs: engine/startup.py). Until the engine is
ready, :class:`StartingApp` answers ``GET /health`` with 503 and the phase it is in, and every
other request with 503, so routers and load balancers wait for it rather than send traffic to
a server that would compile kernels under its first requests::

    GET /health  503 {"status": "starting", "phase": "compiling kernels", "elapsed_s": 12.4, ...}
                 200 {"status": "ok", ..., "startup_s": 31.2}                (the engine's app)
                 503 {"status": "dead", "engine": "dead", ...}   then the process exits with 1

An engine that stops on an error never serves again (a GPU error poisons its context:
engine/fatal.py): the server says ``dead`` for ``DEAD_GRACE_S``, then exits non-zero so that a
supervisor starts a fresh one. A start that fails exits the same way, with the error in the log.
"""

from __future__ import annotations

from typing import Any

from kvtier.engine.startup import Startup
from kvtier.serve.asgi import ASGIApp, Receive, Scope, Send
from kvtier.serve.errors import error_body, error_response

DEAD_GRACE_S = 2.0  # how long /health says "dead" before the process exits


class StartingApp:
    """The ASGI app uvicorn runs: 503 while starting (or after a failed start), then ``app``."""

    def __init__(self, startup: Startup, role: str) -> None:
        self.startup, self.role = startup, role
        self.app: ASGIApp | None = None
        self.failed: str | None = None  # why the start failed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        app = self.app
        if app is not None:
            await app(scope, receive, send)
            return
        if scope["type"] == "lifespan":  # nothing to start or stop before the engine is built
            while True:
                message = await receive()
                kind = message["type"].rsplit(".", 1)[-1]
                await send({"type": f"lifespan.{kind}.complete"})
                if kind == "shutdown":
                    return
        if scope["type"] != "http":
            return
        from fastapi.responses import JSONResponse

        if self.failed is not None:
            body: dict[str, Any] = error_body(503, f"the server failed to start: {self.failed}")
            response = JSONResponse(body | {"status": "dead", "role": self.role, "engine": "dead"}, status_code=503)
        elif scope["path"] == "/health":
            body = error_body(503, f"the server is starting ({self.startup.phase})")
            response = JSONResponse(
                body | {"status": "starting", "role": self.role, "engine": "starting", **self.startup.as_dict()},
                status_code=503,
                headers={"Retry-After": "1"},
            )
        else:
            response = error_response(
                503,
                f"the server is starting ({self.startup.phase}); retry once GET /health answers 200",
                headers={"Retry-After": "1"},
            )
        await response(scope, receive, send)
