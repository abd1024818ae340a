"""A local Mooncake Store pool: ``kvtier pool mooncake --port P --size 4GiB``; and loading the Mooncake
Store client (:func:`import_store`), which the mooncake:// backend and the pool node share.

Runs two processes and supervises them:

* ``mooncake_master`` (the binary shipped in the ``mooncake`` wheel: ``<site-packages>/mooncake/
  mooncake_master``) on ``--host:--port``: the control plane (key index, allocation, eviction,
  leases); its HTTP metrics/health endpoint on a free port of the same host;
* one *pool node*, ``python -m kvtier.storage.mooncake_launch node ...``: a Mooncake client that
  contributes ``--size`` bytes of memory (its global segment) and sleeps until signalled. Engines
  connect with ``mooncake://HOST:PORT?protocol=tcp`` and contribute no memory themselves.

It waits (with a deadline) until the master reports the node's capacity, prints the URL, and on
Ctrl-C / SIGTERM stops the node, then the master (SIGTERM, SIGKILL after a grace period); if either
child dies the other is stopped and the command exits 1. Children are started with
``PR_SET_PDEATHSIG`` (Linux), so they die with the supervisor even if it is SIGKILLed (verified:
``kill -9`` of the command leaves no master or node behind).

Python API (tests)::

    h = start_pool(port=None, size="256MiB")   # free port; returns when ready
    h.url; h.kill_node(); h.kill_master(); h.pause_node(); h.resume_node(); h.kill(); h.stop()
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Sequence

from kvtier.storage import procs
from kvtier.storage.memory import parse_size

DEFAULT_PORT = 50051
DEFAULT_LEASE_TTL_MS = 2000
READY_TIMEOUT = 30.0
STOP_GRACE = 5.0


INSTALL_HINT = (
    "the mooncake:// storage backend needs the Mooncake Store client: "
    "pip install 'kvtier[mooncake]' (wheel mooncake-transfer-engine-non-cuda>=0.3.13.post1; "
    "on a CUDA machine mooncake-transfer-engine works too) and, on Debian/Ubuntu, "
    "apt-get install -y libibverbs1 libnuma1 libcurl4"
)


def import_store() -> Any:
    """The Mooncake Store client class (ImportError with the install hint without it)."""
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")  # its INFO lines are per connection
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({type(e).__name__}: {e})") from e
    return MooncakeDistributedStore


class PoolError(RuntimeError):
    """The pool could not be started (binary missing, a process died, not ready in time)."""


# ------------------------------------------------------------------------------------------------
# helpers


def find_master_binary() -> str:
    """Path of ``mooncake_master``: ``$KVTIER_MOONCAKE_MASTER``, else the one in the ``mooncake``
    package (the wheel's ``bin/mooncake_master`` is a Python wrapper that execs it), else PATH."""
    env = os.environ.get("KVTIER_MOONCAKE_MASTER")
    if env:
        if not (os.path.isfile(env) and os.access(env, os.X_OK)):
            raise PoolError(f"KVTIER_MOONCAKE_MASTER={env} is not an executable file")
        return env
    try:
        import importlib.util

        spec = importlib.util.find_spec("mooncake")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        for d in spec.submodule_search_locations:
            path = os.path.join(d, "mooncake_master")
            if os.path.isfile(path):
                if not os.access(path, os.X_OK):
                    os.chmod(path, os.stat(path).st_mode | 0o111)
                return path
    found = shutil.which("mooncake_master")
    if found:
        return found
    raise PoolError(f"mooncake_master not found: {INSTALL_HINT}")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _port_in_use(host: str, port: int) -> bool:
    """Someone listens there (TIME_WAIT leftovers do not count: the master binds with
    SO_REUSEADDR, as this check does)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def _spawn(cmd: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    with open(log_path, "ab") as logf:
        return procs.spawn(cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT, env=env)


def _stop_and_wait(p: subprocess.Popen | None, timeout: float = 5.0) -> None:
    """SIGSTOP ``p`` and wait until all its threads are in state T (stopped)."""
    if p is None or p.poll() is not None:
        return
    os.kill(p.pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            states = []
            for tid in os.listdir(f"/proc/{p.pid}/task"):
                with open(f"/proc/{p.pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
        except OSError:  # not Linux, or a thread ended meanwhile
            if not os.path.isdir(f"/proc/{p.pid}"):
                return
            states = []
        if states and all(st in "tT" for st in states):
            return
        time.sleep(0.005)


def _tail(path: Path, n: int = 15) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])


def read_metrics(host: str, metrics_port: int, timeout: float = 1.0) -> dict[str, float]:
    """The master's Prometheus gauges (``master_total_capacity_bytes``, ``master_key_count``...)."""
    with urllib.request.urlopen(f"http://{host}:{metrics_port}/metrics", timeout=timeout) as r:
        text = r.read().decode("utf-8", "replace")
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)\s+([-+0-9.eE]+|NaN|[+-]Inf)\s*$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


# ------------------------------------------------------------------------------------------------
# the pool


class PoolHandle:
    """A running master + pool node. ``url`` is what engines use."""

    def __init__(
        self,
        host: str,
        port: int,
        metrics_port: int,
        size: int,
        lease_ttl_ms: int,
        workdir: Path,
        own_workdir: bool,
        master_binary: str,
    ) -> None:
        self.host, self.port, self.metrics_port = host, port, metrics_port
        self.size, self.lease_ttl_ms = size, lease_ttl_ms
        self.workdir, self._own_workdir = workdir, own_workdir
        self.master_binary = master_binary
        self.master: subprocess.Popen | None = None
        self.node: subprocess.Popen | None = None

    # ---- addresses
    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"mooncake://{self.address}?protocol=tcp"

    @property
    def master_log(self) -> Path:
        return self.workdir / "master.log"

    @property
    def node_log(self) -> Path:
        return self.workdir / "node.log"

    @property
    def alive(self) -> bool:
        return all(p is not None and p.poll() is None for p in (self.master, self.node))

    def __repr__(self) -> str:
        pids = (getattr(self.master, "pid", None), getattr(self.node, "pid", None))
        return f"PoolHandle({self.url} master={pids[0]} node={pids[1]} size={self.size})"

    def log_tail(self, n: int = 15) -> str:
        return (
            f"--- master log ({self.master_log}):\n{_tail(self.master_log, n)}\n"
            f"--- node log ({self.node_log}):\n{_tail(self.node_log, n)}"
        )

    def metrics(self, timeout: float = 1.0) -> dict[str, float]:
        return read_metrics(self.host, self.metrics_port, timeout)

    # ---- processes
    def master_command(self) -> list[str]:
        return [
            self.master_binary,
            f"--rpc_address={self.host}",
            f"--rpc_port={self.port}",
            f"--metrics_host={self.host}",
            f"--metrics_port={self.metrics_port}",
            f"--default_kv_lease_ttl={self.lease_ttl_ms}",
            "--enable_metric_reporting=false",
        ]

    def node_command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "kvtier.storage.mooncake_launch",
            "node",
            "--master",
            self.address,
            "--size",
            str(self.size),
            "--host",
            self.host,
            "--parent-pid",
            str(os.getpid()),
        ]

    def start_master(self) -> None:
        if _port_in_use(self.host, self.port):
            raise PoolError(f"port {self.address} is already in use")
        self.master = _spawn(self.master_command(), self.master_log)

    def start_node(self) -> None:
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])  # so that -m kvtier... imports
        env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
        env.setdefault("MC_TCP_BIND_ADDRESS", self.host)
        env.setdefault("MC_RPC_TIMEOUT_MS", "2000")  # a quick exit if the master is gone
        env.setdefault("MC_RPC_CONNECT_TIMEOUT_MS", "2000")
        env.setdefault("MC_LOG_LEVEL", "WARNING")
        self.node = _spawn(self.node_command(), self.node_log, env)

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        """Until the master answers and reports at least the node's capacity."""
        deadline = time.monotonic() + timeout
        last = "no answer yet"
        while time.monotonic() < deadline:
            for name, p in (("master", self.master), ("pool node", self.node)):
                if p is not None and p.poll() is not None:
                    raise PoolError(f"mooncake {name} exited with {p.returncode} while starting:\n{self.log_tail()}")
            try:
                m = self.metrics(timeout=1.0)
                cap = m.get("master_total_capacity_bytes", 0)
                if self.node is None or cap >= self.size:
                    return
                last = f"capacity {cap:.0f} of {self.size} bytes"
            except OSError as e:
                last = f"metrics endpoint: {e}"
            time.sleep(0.05)
        raise PoolError(f"mooncake pool {self.url} not ready after {timeout:g}s ({last}):\n{self.log_tail()}")

    def kill_node(self) -> None:
        """SIGKILL the pool node (its memory and objects are gone: reads fail with TRANSFER_FAIL,
        then miss once the master drops the node, ~10 s later)."""
        procs.signal_and_wait(self.node, signal.SIGKILL, 10)

    def kill_master(self) -> None:
        procs.signal_and_wait(self.master, signal.SIGKILL, 10)

    def kill(self) -> None:
        """A crash of the whole pool (node and master, SIGKILL)."""
        self.kill_node()
        self.kill_master()

    def pause_node(self) -> None:
        """SIGSTOP the node: connections are accepted (kernel backlog) but never answered.
        Returns once every thread of it is stopped (on a loaded machine that takes a moment)."""
        _stop_and_wait(self.node)

    def resume_node(self) -> None:
        if self.node is not None and self.node.poll() is None:
            os.kill(self.node.pid, signal.SIGCONT)

    def pause_master(self) -> None:
        _stop_and_wait(self.master)

    def resume_master(self) -> None:
        if self.master is not None and self.master.poll() is None:
            os.kill(self.master.pid, signal.SIGCONT)

    def restart(self, timeout: float = READY_TIMEOUT) -> None:
        """Stop whatever runs, start a fresh (empty) master and node on the same ports."""
        self._stop_children()
        self.start_master()
        self.start_node()
        self.wait_ready(timeout)

    def clear(self) -> None:
        """Remove every object (a short-lived client; leases are ignored)."""
        code = (
            "import os,sys\nos.environ.setdefault('MC_LOG_LEVEL','WARNING')\n"
            "from mooncake.store import MooncakeDistributedStore as S\n"
            "s=S()\nrc=s.setup(sys.argv[1],'P2PHANDSHAKE',0,0,'tcp','',sys.argv[2])\n"
            "assert rc==0, rc\nr=s.remove_all(True)\ns.close()\nsys.exit(0 if r>=0 else 1)\n"
        )
        env = dict(
            os.environ,
            MC_TCP_BIND_ADDRESS=os.environ.get("MC_TCP_BIND_ADDRESS", self.host),
            MC_RPC_TIMEOUT_MS="5000",
            MC_STORE_CLIENT_SETUP_RETRIES="1",
        )
        r = subprocess.run([sys.executable, "-c", code, self.host, self.address], env=env, capture_output=True, timeout=60)
        if r.returncode != 0:
            raise PoolError(f"clearing {self.url} failed: {r.stderr.decode(errors='replace')[-2000:]}")

    def _stop_children(self) -> None:
        procs.stop(self.node, STOP_GRACE)  # first: it unmounts its segment from the live master
        procs.stop(self.master, STOP_GRACE)

    def stop(self) -> None:
        """SIGTERM node then master (SIGKILL after 5 s each); removes an own temp workdir."""
        self._stop_children()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "PoolHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_pool(
    port: int | None = None,
    size: int | str = "256MiB",
    workdir: str | Path | None = None,
    *,
    host: str = "127.0.0.1",
    lease_ttl_ms: int = DEFAULT_LEASE_TTL_MS,
    metrics_port: int | None = None,
    timeout: float = READY_TIMEOUT,
) -> PoolHandle:
    """Start a master and one pool node of ``size`` bytes; return when the pool is usable.

        ``port=None`` picks a free port. Logs go to ``workdir`` (a temp dir, removed by ``stop()``,
        when None). Raises :class:`PoolError` (with the logs' tails) if it cannot start; nothing is
        left running then. Started from the main thread, the children die with this process even if it
    is SIGKILLed (``PR_SET_PDEATHSIG``; the node also watches its parent PID); otherwise at exit.
    """
    nbytes = parse_size(size) if isinstance(size, str) else int(size)
    if nbytes <= 0:
        raise ValueError(f"pool size must be positive, got {size!r}")
    if lease_ttl_ms <= 0:
        raise ValueError(f"lease TTL must be positive, got {lease_ttl_ms!r}")
    binary = find_master_binary()
    own = workdir is None
    wd = Path(tempfile.mkdtemp(prefix="kvtier-mooncake-")) if workdir is None else Path(workdir)
    wd.mkdir(parents=True, exist_ok=True)
    attempts = 3 if port is None or metrics_port is None else 1  # free-port races: try again
    err: BaseException | None = None
    for _ in range(attempts):
        h = PoolHandle(host, port or free_port(host), metrics_port or free_port(host), nbytes, lease_ttl_ms, wd, own, binary)
        try:
            h.start_master()
            h.start_node()
            h.wait_ready(timeout)
            return h
        except BaseException as e:
            h._stop_children()
            err = e
            if not isinstance(e, PoolError) or port is not None and "in use" in str(e):
                break
    if own:
        shutil.rmtree(wd, ignore_errors=True)
    assert err is not None
    raise err


# ------------------------------------------------------------------------------------------------
# the pool node process


def node_main(argv: Sequence[str]) -> int:
    """``python -m kvtier.storage.mooncake_launch node``: contribute memory until signalled."""
    ap = argparse.ArgumentParser(
        prog="python -m kvtier.storage.mooncake_launch node",
        description="A Mooncake pool node: contributes --size bytes of memory to the master's pool until SIGTERM/SIGINT.",
    )
    ap.add_argument("--master", required=True, help="master host:port")
    ap.add_argument("--size", required=True, help="memory to contribute (e.g. 4GiB)")
    ap.add_argument("--host", default="127.0.0.1", help="address this node advertises")
    ap.add_argument("--protocol", default="tcp", help="transfer protocol (tcp or rdma)")
    ap.add_argument("--rdma-devices", default="", help="RDMA devices (protocol rdma)")
    ap.add_argument("--parent-pid", type=int, default=0, help="exit when this process is gone (the supervisor)")
    args = ap.parse_args(list(argv))
    size = parse_size(args.size)
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", args.host)
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    store = import_store()()
    t0 = time.monotonic()
    rc = store.setup(args.host, "P2PHANDSHAKE", size, 0, args.protocol, args.rdma_devices, args.master)
    if rc != 0:
        print(f"kvtier mooncake node: setup against {args.master} failed ({rc})", flush=True)
        return 1
    print(
        f"kvtier mooncake node: contributing {size} bytes to {args.master} (set up in {time.monotonic() - t0:.2f}s)", flush=True
    )
    while not stop.wait(0.5):
        if args.parent_pid and (os.getppid() != args.parent_pid):
            print("kvtier mooncake node: supervisor gone; exiting", flush=True)
            break
    store.close()
    print("kvtier mooncake node: stopped", flush=True)
    return 0


# ------------------------------------------------------------------------------------------------
# CLI


def build_parser(prog: str = "kvtier pool mooncake") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=prog,
        description="Run a local Mooncake Store pool: a mooncake_master plus one pool node that "
        "contributes --size bytes of memory. Prints the storage URL for engines "
        "(--storage mooncake://HOST:PORT?protocol=tcp) and runs until Ctrl-C/SIGTERM.",
        epilog="Needs: pip install 'kvtier[mooncake]' and apt-get install -y libibverbs1.",
    )
    ap.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"master RPC port engines connect to (default {DEFAULT_PORT})")
    ap.add_argument("--size", default="1GiB", help="memory the pool node contributes, e.g. 4GiB or 512MB (default 1GiB)")
    ap.add_argument(
        "--host",
        default="127.0.0.1",
        help="address the master and node listen on and advertise; use the machine's "
        "IP to serve other machines (default 127.0.0.1)",
    )
    ap.add_argument(
        "--lease-ttl-ms",
        type=int,
        default=DEFAULT_LEASE_TTL_MS,
        help="how long a read protects an object from eviction/removal, in ms "
        f"(master --default_kv_lease_ttl; default {DEFAULT_LEASE_TTL_MS})",
    )
    ap.add_argument(
        "--metrics-port", type=int, default=None, help="port of the master's HTTP /metrics and /health (default: a free port)"
    )
    ap.add_argument("--workdir", default=None, help="directory for master.log and node.log (default: a temporary directory)")
    ap.add_argument(
        "--ready-timeout",
        type=float,
        default=READY_TIMEOUT,
        help=f"seconds to wait for the pool to come up (default {READY_TIMEOUT:g})",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["node"]:
        return node_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.host in ("0.0.0.0", "::", ""):
        print(
            "kvtier pool mooncake: --host must be an address clients can reach (the pool advertises it), not a wildcard",
            file=sys.stderr,
        )
        return 2
    try:
        size = parse_size(args.size)
    except ValueError as e:
        print(f"kvtier pool mooncake: --size: {e}", file=sys.stderr)
        return 2
    if not (0 < args.port < 65536):
        print(f"kvtier pool mooncake: --port must be 1..65535, got {args.port}", file=sys.stderr)
        return 2
    stop = threading.Event()
    received: list[int] = []

    def on_signal(signum: int, frame: object) -> None:
        received.append(signum)
        stop.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    handle = None
    try:
        try:
            handle = start_pool(
                args.port,
                size,
                args.workdir,
                host=args.host,
                lease_ttl_ms=args.lease_ttl_ms,
                metrics_port=args.metrics_port,
                timeout=args.ready_timeout,
            )
        except (PoolError, ImportError, ValueError) as e:
            print(f"kvtier pool mooncake: {e}", file=sys.stderr)
            return 1
        assert handle.master is not None and handle.node is not None  # started by start_pool
        print(
            f"Mooncake pool ready: {size} bytes, master pid {handle.master.pid}, node pid "
            f"{handle.node.pid}, metrics http://{handle.host}:{handle.metrics_port}/metrics, "
            f"logs in {handle.workdir}",
            flush=True,
        )
        print(handle.url, flush=True)
        while not stop.wait(0.5):
            if not handle.alive:
                which = "master" if handle.master.poll() is not None else "pool node"
                print(f"kvtier pool mooncake: the {which} exited; stopping\n{handle.log_tail()}", file=sys.stderr, flush=True)
                return 1
        print("kvtier pool mooncake: stopping", flush=True)
        return 0
    finally:
        if handle is not None:
            handle.stop()
        for s, h in old.items():
            signal.signal(s, h)


if __name__ == "__main__":
    sys.exit(main())
