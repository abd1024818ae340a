"""A ``kvtier serve`` / ``kvtier router`` process on a free 127.0.0.1 port (``kvtier bench pd``,
the HTTP tests): started in its own process group, waited for (``GET /health``, with a deadline),
stopped by SIGTERM then SIGKILL; it dies with its launcher (``storage/procs.py``).

The child imports the launcher's own kvtier whatever the working directory: ``python -m
kvtier.cli`` would put the cwd first on ``sys.path``, so a ``kvtier/`` folder there (a checkout,
a decoy) would be imported instead. ``_BOOT`` puts the directory holding this kvtier in front of
it (works on Python 3.10, which has no ``-P``) and leaves the cwd as it is, so relative paths in
the arguments keep their meaning."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

import kvtier
from kvtier.storage import procs

_KVTIER_ROOT = str(Path(kvtier.__file__).resolve().parent.parent)
_BOOT = f"import sys; sys.path.insert(0, {_KVTIER_ROOT!r}); from kvtier.cli import main; sys.exit(main())"


def kvtier_command(*args: object) -> list[str]:
    """argv running ``kvtier ARGS...`` in a child process, with this process's kvtier."""
    return [sys.executable, "-c", _BOOT, *map(str, args)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(
        self, args: Sequence[object], log: Path, env: dict | None = None, log_level: str = "warning", cwd: Path | None = None
    ) -> None:
        """``cwd``: the directory it runs in (relative paths in ``args`` are read from there)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = kvtier_command(*args, "--port", self.port, "--log-level", log_level)
        self.log = Path(log)
        with open(self.log, "ab") as f:
            self.popen = procs.spawn(
                self.args, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=cwd
            )

    def wait_ready(self, timeout: float = 600.0) -> "ServerProcess":
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.args[3:5]} exited with {self.popen.returncode}; {self.log}:\n{self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.args[3:5]} not ready after {timeout} s; {self.log}:\n{self.tail()}")

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def kill(self) -> None:
        procs.signal_and_wait(self.popen, signal.SIGKILL, 10, group=True)

    def stop(self, grace: float = 15.0) -> None:
        procs.stop(self.popen, grace, group=True)
