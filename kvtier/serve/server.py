"""``kvtier serve`` and ``kvtier router``: build the app, run it under uvicorn.

API keys come from the flag or, so that they need not be on the command line (where ``ps``
shows them), from the environment: ``KVTIER_API_KEY`` (clients' key, server and router) and
``KVTIER_BACKEND_API_KEY`` (the key the router sends to its servers). The flag wins; an empty key
is an error, never "no authentication".
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from dataclasses import replace
from typing import Any, Iterator

from kvtier.engine.config import EngineConfig
from kvtier.log_setup import setup_logging
from kvtier.model.hub import default_served_name, model_aliases
from kvtier.serve.guard import FD_MARGIN, ConnectionLimits, Guard, open_file_limit

API_KEY_ENV = "KVTIER_API_KEY"
BACKEND_API_KEY_ENV = "KVTIER_BACKEND_API_KEY"


def resolve_key(flag_value: str | None, env_name: str, flag_name: str) -> str | None:
    """The key from ``flag_value``, else from the environment; None: no key. ValueError if empty."""
    if flag_value is not None:
        if not flag_value:
            raise ValueError(f"{flag_name} is empty: give a key (or leave the flag out for no authentication)")
        return flag_value
    value = os.environ.get(env_name)
    if value is None:
        return None
    if not value:
        raise ValueError(f"{env_name} is set but empty: give a key (or unset it for no authentication)")
    return value


def role_defaults(role: str, config: EngineConfig) -> EngineConfig:
    """The engine's options for a server of ``role``: a PD prefill server, whose writes to the
    pool are its product, gets half its fetch threads as put threads unless told (an engine that
    serves requests itself gets one: put threads slow its engine thread)."""
    from kvtier.storage.client import default_storage_workers

    if role == "prefill" and config.storage_put_workers is None:
        return replace(config, storage_put_workers=max(1, (config.storage_workers or default_storage_workers()) // 2))
    return config


def serve(
    model: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    role: str = "colocated",
    api_key: str | None = None,
    served_model_name: str | None = None,
    max_queue: int = 1024,
    log_level: str = "info",
    max_body_bytes: int | None = None,
    require_cache_salt: bool = False,
    log_stats_interval: float = 10.0,
    config: EngineConfig | None = None,
    expose_config: bool = False,
    limits: ConnectionLimits | None = None,
    allowed_media_domains: str | None = None,
    **options: Any,
) -> int:
    """Serve until stopped; returns the process's exit status: 0 after a clean stop, 1 if the
    engine failed to start or died (serve/lifecycle.py: the port answers ``/health`` with 503
    ``starting`` while the engine starts, ``dead`` before such an exit)."""
    import threading

    import uvicorn

    from kvtier.engine.startup import Startup
    from kvtier.serve.api import check_role
    from kvtier.serve.lifecycle import DEAD_GRACE_S, StartingApp

    api_key = resolve_key(api_key, API_KEY_ENV, "--api-key")
    config = replace(config, **options) if config is not None else EngineConfig(**options)
    check_role(role, config.storage is not None)  # before loading the model
    setup_logging(log_level)
    log = logging.getLogger("kvtier")
    startup = Startup()
    front = StartingApp(startup, role)
    guard = connection_guard(limits)
    userver = _uvicorn_server(
        uvicorn.Config(front, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5, **guard.uvicorn_options())
    )
    built: dict[str, Any] = {}
    died: list[BaseException] = []

    def exit_soon(error: BaseException) -> None:
        died.append(error)
        log.critical("the engine stopped (%s): /health says dead, the server exits in %.0f s", error, DEAD_GRACE_S)
        threading.Timer(DEAD_GRACE_S, lambda: setattr(userver, "should_exit", True)).start()

    def build() -> None:
        try:
            _build_server(
                model,
                role,
                api_key,
                served_model_name,
                max_queue,
                max_body_bytes,
                require_cache_salt,
                log_stats_interval,
                startup,
                exit_soon,
                config,
                built,
                log_level,
                expose_config,
                allowed_media_domains,
            )
            built["server"].metrics.watch_connections(guard)
            front.app = built["server"].app
            log.info(
                "serving %s as %r (role %s) on http://%s:%d, ready after %.1f s",
                model,
                built["server"].model_name,
                role,
                host,
                port,
                startup.total_s,
            )
        except BaseException as e:  # the server says so, then exits non-zero
            if startup.phase == "starting":  # bad arguments, before any phase: the caller raises it
                built["error"] = e
                return
            log.critical("the server failed to start: %s", e, exc_info=e)
            front.failed = f"{type(e).__name__}: {e}"
            exit_soon(e)

    thread = threading.Thread(target=build, name="kvtier-startup", daemon=True)
    thread.start()
    # the engine checks its arguments before its first phase: a bad one is the command's error
    # (exit status 2, nothing bound), not a server that starts and dies
    while startup.phase == "starting" and thread.is_alive():
        thread.join(0.01)
    if "error" in built:
        raise built["error"]
    try:
        userver.run()
    finally:
        if userver.signals:
            log.info("%s: stopping the engine", " ".join(signal.Signals(s).name for s in userver.signals))
        if "server" in built:
            built["server"].close()
        if "engine" in built:
            try:
                built["engine"].shutdown()
            except Exception as e:  # a dead GPU may fail its own cleanup
                log.warning("engine shutdown failed: %s", e)
            else:
                log.info("the engine stopped")
    return 1 if died else 0


def _uvicorn_server(config: Any) -> Any:
    """uvicorn's server, but a signal that stopped it (SIGTERM, SIGINT) is kept in ``signals``
    instead of being raised again as ``run()`` returns: raised, SIGTERM's default action would end
    this process before it stopped its engine, which would then find its parent gone. serve()
    stops the engine, then returns (a clean stop: exit status 0)."""
    import uvicorn

    class Server(uvicorn.Server):
        signals: list[int] = []

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            with super().capture_signals():
                try:
                    yield
                finally:
                    self.signals = list(self._captured_signals)
                    self._captured_signals.clear()

    return Server(config)


def _build_server(
    model: str,
    role: str,
    api_key: str | None,
    served_model_name: str | None,
    max_queue: int,
    max_body_bytes: int | None,
    require_cache_salt: bool,
    log_stats_interval: float,
    startup: Any,
    on_dead: Any,
    config: EngineConfig,
    built: dict[str, Any],
    log_level: str = "info",
    expose_config: bool = False,
    allowed_media_domains: str | None = None,
) -> None:
    """The engine (in a process of its own: engine/client.py) and the HTTP app (into ``built`` as
    they come, for the cleanup)."""
    from kvtier.engine.client import EngineClient
    from kvtier.serve.api import Server
    from kvtier.serve.asgi import DEFAULT_MAX_BODY_BYTES
    from kvtier.serve.media import MediaPolicy, parse_domains

    built["engine"] = EngineClient(
        model,
        role_defaults(role, config),
        max_queue=max_queue,
        stats_interval=log_stats_interval,
        on_dead=on_dead,
        startup=startup,
        log_level=log_level,
    )
    built["server"] = Server(
        built["engine"],
        served_model_name or default_served_name(model),
        role,
        api_key,
        max_body_bytes=max_body_bytes or DEFAULT_MAX_BODY_BYTES,
        require_cache_salt=require_cache_salt,
        expose_config=expose_config,
        aliases=model_aliases(model, built["engine"].path),
        media=MediaPolicy(parse_domains(allowed_media_domains)),
    )


def connection_guard(limits: ConnectionLimits | None) -> Guard:
    """The bounds of the HTTP process's connections (serve/guard.py), its open-file limit first
    raised toward what they need (up to the hard limit)."""
    limits = limits or ConnectionLimits()
    return Guard(limits, open_files=open_file_limit(limits.max_connections + FD_MARGIN))


def route(
    prefill: list[str],
    decode: list[str],
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    api_key: str | None = None,
    backend_api_key: str | None = None,
    max_body_bytes: int | None = None,
    limits: ConnectionLimits | None = None,
    **kwargs: Any,
) -> None:
    import uvicorn

    from kvtier.serve.asgi import DEFAULT_MAX_BODY_BYTES
    from kvtier.serve.metrics import ConnectionCollector
    from kvtier.serve.router import Router

    setup_logging(log_level)
    router = Router(
        prefill,
        decode,
        api_key=resolve_key(api_key, API_KEY_ENV, "--api-key"),
        backend_api_key=resolve_key(backend_api_key, BACKEND_API_KEY_ENV, "--backend-api-key"),
        max_body_bytes=max_body_bytes or DEFAULT_MAX_BODY_BYTES,
        **kwargs,
    )
    guard = connection_guard(limits)
    router.registry.register(ConnectionCollector(guard))
    uvicorn.run(router.app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5, **guard.uvicorn_options())
