"""Servers for the HTTP tests: `kvtier serve` / `kvtier router` processes on free 127.0.0.1 ports,
each waited for (GET /health, with a deadline) and killed at teardown; the pool servers of the
storage tests (Valkey, Mooncake)."""

from __future__ import annotations

import pytest

from kvtier.serve.launch import ServerProcess
from tests.storage.mooncake_servers import mooncake_launch  # noqa: F401
from tests.storage.redis_servers import valkey_server  # noqa: F401


@pytest.fixture(scope="module")
def procs(tmp_path_factory):
    """procs(args, name, env=None) -> started ServerProcess (not waited for); each stopped at module end."""
    started: list[ServerProcess] = []
    logs = tmp_path_factory.mktemp("logs")

    def start(args: list, name: str, env: dict | None = None) -> ServerProcess:
        p = ServerProcess(args, logs / f"{name}.log", env=env)
        started.append(p)
        return p

    yield start
    for p in started:
        p.stop()


@pytest.fixture(scope="session")
def moe_model(checkpoint):
    return checkpoint("qwen3-moe-tiny")


@pytest.fixture(scope="module")
def offline(moe_model, request):
    """The offline API on the engine settings of the module's server (``max_model_len`` = its ``CTX``)."""
    import kvtier

    llm = kvtier.LLM(moe_model, max_model_len=request.module.CTX)
    yield llm
    llm.close()
