"""Servers for the HTTP tests: `kvtier serve` / `kvtier router` processes on free 127.0.0.1 ports,
each waited for (GET /health, with a deadline) and killed at teardown; the pool servers of the
storage tests (Valkey, Mooncake)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "storage"))
from mooncake_servers import make_mooncake_pool, mooncake_pool  # noqa: E402,F401
from redis_servers import make_valkey, valkey_server  # noqa: E402,F401

START_TIMEOUT = 180.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """One `kvtier serve|router` process."""

    def __init__(self, args: list[str], log: Path, env: dict | None = None) -> None:
        self.port = free_port()
        self.args = [sys.executable, "-m", "kvtier.cli", *args, "--port", str(self.port), "--log-level", "warning"]
        self.log = log
        self.env = env
        self.popen: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "Proc":
        self.popen = subprocess.Popen(self.args, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT,
                                      env={**os.environ, **(self.env or {})}, start_new_session=True)
        return self

    def wait_ready(self, timeout: float = START_TIMEOUT) -> "Proc":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:     # type: ignore[union-attr]
                raise RuntimeError(f"{self.args[3:5]} exited with {self.popen.returncode}:\n{self.tail()}")  # type: ignore[union-attr]
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.args[3:5]} not ready after {timeout} s:\n{self.tail()}")

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def kill(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(10)

    def stop(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture(scope="module")
def procs(tmp_path_factory):
    """procs(args, name) -> started Proc (not waited for); every one is stopped at module end."""
    started: list[Proc] = []
    logs = tmp_path_factory.mktemp("logs")

    def start(args: list[str], name: str, env: dict | None = None) -> Proc:
        p = Proc([str(a) for a in args], logs / f"{name}.log", env).start()
        started.append(p)
        return p

    yield start
    for p in started:
        p.stop()


@pytest.fixture(scope="session")
def moe_model(checkpoint):
    return checkpoint("qwen3-moe-tiny")
