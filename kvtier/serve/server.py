"""``kvtier serve`` and ``kvtier router``: build the app, run it under uvicorn."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any


def serve(model: str, host: str = "127.0.0.1", port: int = 8000, role: str = "colocated",
          api_key: str | None = None, served_model_name: str | None = None, max_queue: int = 1024,
          log_level: str = "info", **llm_kwargs: Any) -> None:
    import uvicorn

    from kvtier.engine.async_engine import AsyncEngine
    from kvtier.engine.core import EngineCore
    from kvtier.serve.api import Server, check_role

    check_role(role, bool(llm_kwargs.get("storage")))     # before loading the model
    core = EngineCore(model, **llm_kwargs)
    engine = AsyncEngine(core, max_queue=max_queue)
    try:
        server = Server(engine, served_model_name or Path(model).name, role, api_key)
        logging.getLogger("kvtier").info("serving %s as %r (role %s) on http://%s:%d", model,
                                         server.model_name, role, host, port)
        uvicorn.run(server.app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    finally:
        engine.shutdown()


def route(prefill: list[str], decode: list[str], host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "info", **kwargs: Any) -> None:
    import uvicorn

    from kvtier.serve.router import Router

    router = Router(prefill, decode, **kwargs)
    uvicorn.run(router.app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
