"""Mooncake Store backend (``mooncake://``): a KV-cache-native memory pool over TCP (or RDMA).

Over 600 lines: the client library's return codes and time bounds are documented below as
measured (what each means here), and the backend itself sets up, probes and re-creates the
client around a master or pool node that may be dead, keeps the registered regions and a bounce
buffer, and carries the throughput check.

URL (DESIGN §6)::

    mooncake://MASTER_HOST:PORT?protocol=tcp[&segment=4GiB][&local_buffer=64MiB]
               [&metadata=P2PHANDSHAKE][&timeout=5][&local_hostname=IP][&rdma_devices=mlx5_0]

* ``protocol``  ``tcp`` (default) or ``rdma``.
* ``segment``   memory this process *contributes* to the pool (default 0: the engine only uses the
  pool; memory comes from pool nodes, e.g. ``kvtier pool mooncake --size 4GiB``).
* ``local_buffer`` size of the backend's own registered bounce buffer, allocated on first use by a
  buffer that was not registered with :meth:`register_buffer` (default 64MiB; grows to fit one
  object). The client library's own staging buffer is not used (set up with size 0).
* ``metadata``  transfer-engine metadata service (default ``P2PHANDSHAKE``: none needed).
* ``timeout``   seconds (default 5): the bound on every wait inside the client library (see below).
* ``local_hostname`` the address this client advertises to pool nodes (default: 127.0.0.1 when
  the master is on loopback, else the local address that routes to the master).

Data path. The storage client registers its staging arena once (:meth:`register_buffer`, which
calls Mooncake's ``register_buffer(ptr, size)``); ``get_into``/``put_from`` of buffers inside a
registered region are zero-copy: one ``batch_get_into``/``batch_put_from`` (one master round trip
plus the transfers). Other buffers go through the backend's own registered bounce buffer (same
calls, plus one memcpy per object, serialised by a lock). The bytes-based ``get``/``get_batch``
are deliberately not used: they return ``b''`` for a missing key *and* for a transfer failure or a
full client buffer, so errors could not be told from misses.

Return codes of the Mooncake client (wheel ``mooncake-transfer-engine-non-cuda`` 0.3.13.post1,
master + pool node on 127.0.0.1, TCP). Seen in experiments (*) or taken from Mooncake's
``types.h`` / error-code docs for states that are hard to provoke::

     n >= 0  bytes read (batch_get_into) / 0 stored (batch_put_from)                    *
     -704    OBJECT_NOT_FOUND: never written, evicted, removed, or its pool node was     *
             dropped by the master (client_ttl = 10 s after the node died)     -> MISSING
     -703    REPLICA_IS_NOT_READY (being written), -707 LEASE_EXPIRED,
     -702    INVALID_REPLICA, -706 OBJECT_HAS_LEASE, -101 SEGMENT_NOT_FOUND    -> MISSING
     -600    INVALID_PARAMS: on a read, "Buffer too small" (object > buffer);           *
             resolved with get_size: bigger than the buffer -> TOO_LARGE, gone -> MISSING
     -200    NO_AVAILABLE_HANDLE: pool full on put (the master evicts ~5% in the        *
             background above 90% full; later puts succeed)                    -> put False
     0       put of an existing key (the old value is kept; -705 OBJECT_ALREADY_EXISTS  *
             is treated the same)                                              -> put True
     -800    TRANSFER_FAIL: the pool node holding the object died (connection           *
             reset/refused) or stopped answering (after the TCP timeouts below) -> StorageError
     -900    RPC_FAIL: master unreachable (killed)                             *  -> StorageError
     -901    RPC timeout: master stopped, no answer within MC_RPC_TIMEOUT_MS   *  -> StorageError
    batch_is_exist: 1 / 0 / -900, -901 (not -1 as documented)                  *  -> StorageError
    batch_remove: 0, -704 (fine), -706 for ``lease_ttl`` after a read *or an exists()* of  *
             the key (ignored: deletion is best effort)

Any other negative code raises :class:`StorageError` for the whole batch (items are never
half-reported). A ``put`` on an existing key keeps the old value (objects are immutable).

Time bounds. Every call returns within a bounded time because the backend sets these process-wide
environment variables (unless the user set them) *before* the client is created::

    MC_RPC_TIMEOUT_MS, MC_RPC_CONNECT_TIMEOUT_MS = timeout       master RPCs (library default 30 s)
    MC_TCP_STATUS_TIMEOUT_SEC, MC_TCP_PROGRESS_TIMEOUT_SEC = timeout   a pool node that accepts
                                       the connection but never answers (library default 30 s)
    MC_STORE_CLIENT_SETUP_RETRIES = 3  setup against a dead master (library default: 20 x ~4.4 s)
    MC_TCP_BIND_ADDRESS = local_hostname   (otherwise it advertises the NIC address)
    MC_LOG_LEVEL = WARNING             the client library's INFO logging is silenced

Measured on 127.0.0.1: a SIGKILLed pool node -> -800 at once to ~1 s (reconnect with backoff);
a SIGSTOPped node -> -800 after ~timeout for reads, up to ~2 x timeout for a batch of puts; a
stopped master -> -901 after timeout; a killed master -> -900 at once or after ~4.3 s (the RPC
pool's own connect retries, not configurable). So after a -900/-901 the backend probes the
master's TCP port before each call (connect timeout min(timeout, 1 s)) until it answers again: a
dead master then costs milliseconds per call. Likewise ``setup`` is preceded by a probe, so a dead
master fails fast instead of after the set-up retries (a master that accepts connections but
never answers can still hold ``setup`` for ~3 x 4.4 s). After a pool node dies the master drops it
(and its objects, which then read as misses) after its ``client_ttl`` (10 s). These variables are
per process: the last backend created sets them (a value the user set is never overwritten).

Thread safety: the Mooncake client object is thread-safe (it releases the GIL; 4 threads sharing
one client, each putting/getting/removing its own and shared keys, gave byte-exact results), so
calls are not serialised. Only the bounce buffer (unregistered buffers) is behind a lock.
:meth:`close` waits for calls in flight (each bounded) before tearing the client down.

Connection: the client is set up in the constructor; if the master cannot be reached then, the
backend is still created (the engine starts; storage is a miss) and every call retries the set-up
at most once per ``timeout`` seconds, raising :class:`StorageError` meanwhile. A bad URL raises
``ValueError``; a missing ``mooncake`` package raises ``ImportError`` saying what to install.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import os
import socket
import threading
import time
from typing import Any, Sequence
from urllib.parse import parse_qsl, urlsplit

import numpy as np

from kvtier.redact import redact_url
from kvtier.storage.base import MISSING, TOO_LARGE, Backend, StorageError
from kvtier.storage.memory import parse_size
from kvtier.storage.mooncake_launch import import_store, start_pool

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 5.0
DEFAULT_LOCAL_BUFFER = 64 << 20
PROTOCOLS = ("tcp", "rdma")
URL_PARAMS = ("protocol", "segment", "local_buffer", "metadata", "timeout", "local_hostname", "rdma_devices")

# Mooncake Store error codes (mooncake-store/include/types.h); see the module docstring.
OBJECT_NOT_FOUND = -704
INVALID_PARAMS = -600
BUFFER_OVERFLOW = -10
NO_AVAILABLE_HANDLE = -200
OBJECT_ALREADY_EXISTS = -705
OBJECT_HAS_LEASE = -706
# per item: the object is not (or no longer, or not yet) readable -> a miss
_GET_MISS = frozenset({OBJECT_NOT_FOUND, -703, -707, -702, OBJECT_HAS_LEASE, -101})
# per item: the pool refused to store it (full, or someone else is writing it) -> False
_PUT_REFUSED = frozenset({NO_AVAILABLE_HANDLE, BUFFER_OVERFLOW, -101, -703, OBJECT_HAS_LEASE, INVALID_PARAMS})
_PUT_EXISTS = frozenset({OBJECT_ALREADY_EXISTS})
_REMOVE_OK = frozenset({OBJECT_NOT_FOUND, OBJECT_HAS_LEASE, -703})
_MASTER_FAILURES = frozenset({-900, -901})  # RPC_FAIL, RPC_TIMEOUT
_ENV_SET_BY_US: dict[str, str] = {}  # environment variables this module set (not the user)
_CODE_NAMES = {
    -1: "INTERNAL_ERROR",
    -10: "BUFFER_OVERFLOW",
    -101: "SEGMENT_NOT_FOUND",
    -200: "NO_AVAILABLE_HANDLE",
    -600: "INVALID_PARAMS",
    -702: "INVALID_REPLICA",
    -703: "REPLICA_IS_NOT_READY",
    -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED",
    -800: "TRANSFER_FAIL",
    -900: "RPC_FAIL",
    -901: "RPC_TIMEOUT",
}


def code_name(code: int) -> str:
    return f"{code} {_CODE_NAMES.get(code, 'error')}"


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
        except OSError:
            return False


def local_hostname_for(master_host: str, master_port: int) -> str:
    """The address this machine uses to reach the master (127.0.0.1 for a loopback master)."""
    if _is_loopback(master_host):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master_host, master_port))  # no packet is sent
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def parse_mooncake_url(url: str) -> dict[str, Any]:
    """``mooncake://host:port?...`` -> keyword arguments of :class:`MooncakeBackend`."""
    if not isinstance(url, str):
        raise ValueError(f"mooncake URL must be a string, got {type(url).__name__}")
    shown = redact_url(url)  # what messages show (a password, if any, hidden)
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise ValueError(f"bad mooncake URL {shown!r}: {redact_url(e)} (expected mooncake://host:port?protocol=tcp)") from None
    if parts.scheme != "mooncake":
        raise ValueError(f"not a mooncake:// URL: {shown!r}")
    if parts.username is not None or parts.password is not None:
        raise ValueError(f"mooncake URL takes no user/password: {shown!r}")
    if not parts.hostname:
        raise ValueError(
            f"mooncake URL needs the master's host:port, e.g. mooncake://127.0.0.1:50051?protocol=tcp; got {shown!r}"
        )
    if port is None or port == 0:
        raise ValueError(f"mooncake URL needs the master's port (e.g. :50051), got {shown!r}")
    if parts.path not in ("", "/"):
        raise ValueError(f"mooncake URL takes no path: {shown!r}")
    if parts.fragment:
        raise ValueError(f"mooncake URL takes no #fragment: {shown!r}")
    query: dict[str, str] = {}
    for k, v in parse_qsl(parts.query, keep_blank_values=True, strict_parsing=False):
        if k not in URL_PARAMS:
            raise ValueError(f"unknown mooncake URL parameter {k!r} in {shown!r}; known: {', '.join(URL_PARAMS)}")
        if k in query:
            raise ValueError(f"mooncake URL parameter {k!r} given twice in {shown!r}")
        if v == "" and k != "rdma_devices":
            raise ValueError(f"mooncake URL parameter {k!r} is empty in {shown!r}")
        query[k] = v
    if parts.query and not query:
        raise ValueError(f"bad mooncake URL query in {shown!r}")
    kw: dict[str, Any] = {"host": parts.hostname, "port": port}
    if "protocol" in query:
        kw["protocol"] = query["protocol"]
    if "segment" in query:
        kw["segment"] = 0 if query["segment"].strip() == "0" else _size(query, "segment", shown)
    if "local_buffer" in query:
        kw["local_buffer"] = _size(query, "local_buffer", shown)
    if "metadata" in query:
        kw["metadata"] = query["metadata"]
    if "timeout" in query:
        try:
            kw["timeout"] = float(query["timeout"])
        except ValueError:
            raise ValueError(f"mooncake URL parameter 'timeout' must be seconds, got {query['timeout']!r} in {shown!r}") from None
    if "local_hostname" in query:
        kw["local_hostname"] = query["local_hostname"]
    if "rdma_devices" in query:
        kw["rdma_devices"] = query["rdma_devices"]
    return kw


def _size(query: dict[str, str], key: str, shown: str) -> int:
    try:
        return parse_size(query[key])
    except ValueError as e:
        raise ValueError(f"mooncake URL parameter {key!r}: {e} (in {shown!r})") from None


def _address(buf: memoryview) -> tuple[int, int]:
    """(address, nbytes) of a C-contiguous buffer (read-only ones too)."""
    mv = buf if isinstance(buf, memoryview) else memoryview(buf)
    n = mv.nbytes
    if n == 0:
        return 0, 0
    if not mv.c_contiguous:
        raise ValueError("mooncake backend needs C-contiguous buffers")
    return int(np.frombuffer(mv, dtype=np.uint8).__array_interface__["data"][0]), n


class MooncakeBackend(Backend):
    scheme = "mooncake"

    def __init__(
        self,
        host: str,
        port: int,
        *,
        protocol: str = "tcp",
        segment: int = 0,
        local_buffer: int = DEFAULT_LOCAL_BUFFER,
        metadata: str = "P2PHANDSHAKE",
        timeout: float = DEFAULT_TIMEOUT,
        local_hostname: str | None = None,
        rdma_devices: str = "",
    ) -> None:
        if protocol not in PROTOCOLS:
            raise ValueError(f"mooncake protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
        if not (0 < int(port) < 65536):
            raise ValueError(f"mooncake master port must be 1..65535, got {port!r}")
        if segment < 0 or local_buffer <= 0:
            raise ValueError(
                f"mooncake segment must be >= 0 and local_buffer > 0, got segment={segment!r} local_buffer={local_buffer!r}"
            )
        if not (math.isfinite(timeout) and timeout > 0):
            raise ValueError(f"mooncake timeout must be a positive number of seconds, got {timeout!r}")
        if not metadata:
            raise ValueError("mooncake metadata must not be empty (default P2PHANDSHAKE)")
        self._Store = import_store()  # ImportError with the install hint
        self.host, self.port = str(host), int(port)
        self.master = f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
        self.protocol = protocol
        self.segment = int(segment)
        self.local_buffer = int(local_buffer)
        self.metadata = metadata
        self.timeout = float(timeout)
        self.rdma_devices = rdma_devices
        self.local_hostname = local_hostname or local_hostname_for(self.host, self.port)
        self._set_env()

        self._store: Any = None
        self._state = threading.Condition()  # guards _store, _active, _closed
        self._active = 0
        self._closed = False
        self._connect_lock = threading.Lock()
        self._master_suspect = False  # set by RPC_FAIL / RPC_TIMEOUT codes
        self._next_connect = 0.0
        self._last_connect_error = ""
        self._regions: list[tuple[int, int, memoryview]] = []  # (start, end, keep-alive ref)
        self._registered: tuple[tuple[int, int], ...] = ()  # registered with the current client
        self._bounce: np.ndarray | None = None
        self._bounce_lock = threading.Lock()
        self._counter_lock = threading.Lock()
        self._c = dict(
            round_trips=0,
            bytes_read=0,
            bytes_written=0,
            gets=0,
            hits=0,
            misses=0,
            too_large=0,
            puts=0,
            refused=0,
            exists=0,
            deletes=0,
            errors=0,
            zero_copy_items=0,
            bounce_items=0,
            connects=0,
            connect_failures=0,
            resets=0,
        )
        try:
            self._connect()
        except StorageError as e:  # the engine may start while the pool is down: calls retry
            log.warning("%s", e)

    @classmethod
    def from_url(cls, url: str) -> "MooncakeBackend":
        return cls(**parse_mooncake_url(url))

    def describe(self) -> str:
        q = [f"protocol={self.protocol}"]
        if self.segment:
            q.append(f"segment={self.segment}")
        if self.metadata != "P2PHANDSHAKE":
            q.append(f"metadata={self.metadata}")
        q.append(f"timeout={self.timeout:g}")
        return redact_url(f"mooncake://{self.master}?{'&'.join(q)}")  # metadata may be a URL with a password

    def __repr__(self) -> str:
        return f"MooncakeBackend({self.describe()})"

    # ------------------------------------------------------------------ plumbing
    def _set_env(self) -> None:
        t = self.timeout
        defaults = {
            "MC_RPC_TIMEOUT_MS": str(max(1, int(t * 1000))),
            "MC_RPC_CONNECT_TIMEOUT_MS": str(max(1, int(t * 1000))),
            "MC_TCP_STATUS_TIMEOUT_SEC": str(max(1, math.ceil(t))),
            "MC_TCP_PROGRESS_TIMEOUT_SEC": str(max(1, math.ceil(t))),
            "MC_STORE_CLIENT_SETUP_RETRIES": "3",
        }
        if self.protocol == "tcp":
            defaults["MC_TCP_BIND_ADDRESS"] = self.local_hostname
        for k, v in defaults.items():
            if k not in os.environ or _ENV_SET_BY_US.get(k) == os.environ[k]:
                os.environ[k] = v  # not the user's: the last backend's
                _ENV_SET_BY_US[k] = v

    def _connect(self) -> None:
        """Set the client up (once; again after a failure, at most once per ``timeout``)."""
        with self._connect_lock:
            if self._store is not None:
                return
            if self._closed:
                raise StorageError(f"mooncake {self.master}: backend is closed")
            now = time.monotonic()
            if now < self._next_connect:
                raise StorageError(f"mooncake {self.master}: not connected ({self._last_connect_error}); retrying shortly")
            self._next_connect = now + self.timeout
            self._count(connects=1)
            try:
                with socket.create_connection((self.host, self.port), timeout=self.timeout):
                    pass
            except OSError as e:
                self._last_connect_error = f"master unreachable: {e}"
                self._count(connect_failures=1)
                raise StorageError(f"mooncake master {self.master} unreachable: {e}") from None
            store = self._Store()
            rc = store.setup(self.local_hostname, self.metadata, self.segment, 0, self.protocol, self.rdma_devices, self.master)
            if rc != 0:
                self._last_connect_error = f"setup returned {rc}"
                self._count(connect_failures=1)
                try:
                    store.close()
                except Exception:
                    pass
                raise StorageError(f"mooncake setup against master {self.master} failed ({rc}); see the client log above")
            self._registered = ()
            for start, end, _ in self._regions:
                self._register_region(store, start, end)
            with self._state:
                if self._closed:
                    store.close()
                    raise StorageError(f"mooncake {self.master}: backend is closed")
                self._store = store

    def _register_region(self, store: Any, start: int, end: int) -> bool:
        rc = store.register_buffer(start, end - start)
        if rc != 0:
            log.warning(
                "mooncake register_buffer(%#x, %d) failed (%s): that memory takes the bounce-buffer path", start, end - start, rc
            )
            return False
        self._registered = self._registered + ((start, end),)
        return True

    def _probe_master(self) -> None:
        """After a master RPC failure: fail fast while the master's port refuses connections
        (the library would spend ~4.3 s per call on its own reconnect retries)."""
        try:
            with socket.create_connection((self.host, self.port), timeout=min(self.timeout, 1.0)):
                pass
        except OSError as e:
            self._count(errors=1)
            raise StorageError(f"mooncake master {self.master} unreachable: {e}") from None
        self._master_suspect = False

    def _reset(self) -> None:
        """The master answers again after RPC failures: it may be a new master process, which
        knows nothing of this client (calls on the old client keep failing with -900): set a new
        client up. Calls still running on the old one are waited for (bounded), then it closes."""
        with self._connect_lock:
            with self._state:
                old, self._store = self._store, None
                deadline = time.monotonic() + self.timeout
                while self._active and time.monotonic() < deadline:
                    self._state.wait(0.05)
                busy = self._active
            if old is not None and not busy:
                try:
                    old.close()
                except Exception as e:  # pragma: no cover
                    log.warning("mooncake: closing the old client failed: %s", e)
            self._next_connect = 0.0
        self._count(resets=1)
        self._connect()

    def _enter(self) -> Any:
        """The client, with this call counted in flight (close waits for it)."""
        if self._store is None:
            self._connect()
        elif self._master_suspect:
            self._probe_master()  # raises while the master's port refuses connections
            self._reset()
        with self._state:
            if self._closed or self._store is None:
                raise StorageError(f"mooncake {self.master}: backend is closed")
            self._active += 1
            return self._store

    def _exit(self) -> None:
        with self._state:
            self._active -= 1
            if self._active == 0:
                self._state.notify_all()

    def _count(self, **kw: int) -> None:
        with self._counter_lock:
            for k, v in kw.items():
                self._c[k] += v

    def _fail(self, op: str, codes: Sequence[int], names: Sequence[str], total: int) -> StorageError:
        """The StorageError for a batch in which ``names`` failed with ``codes``."""
        self._count(errors=1)
        if any(c in _MASTER_FAILURES for c in codes):
            self._master_suspect = True
        return StorageError(
            f"mooncake {self.master}: {op} failed: {code_name(codes[0])} for {names[0]!r} ({len(codes)} of {total} items failed)"
        )

    def _in_region(self, addr: int, n: int) -> bool:
        end = addr + n
        for start, stop in self._registered:  # a tuple, replaced (never mutated)
            if start <= addr and end <= stop:
                return True
        return False

    def _batch(self, fn_name: str, names: list[str], addrs: list[int], sizes: list[int]) -> list[int]:
        store = self._enter()
        try:
            codes = getattr(store, fn_name)(names, addrs, sizes)
        finally:
            self._exit()
        self._count(round_trips=1)
        if len(codes) != len(names):
            raise StorageError(f"mooncake {self.master}: {fn_name} returned {len(codes)} results for {len(names)} keys")
        return [int(c) for c in codes]

    def _bounce_buffer(self, need: int) -> tuple[np.ndarray, int]:
        """The registered bounce buffer (caller holds _bounce_lock), at least ``need`` bytes."""
        if self._bounce is None or self._bounce.nbytes < need:
            size = max(self.local_buffer, need)
            old = self._bounce
            buf = np.empty(size, dtype=np.uint8)
            store = self._enter()
            try:
                if old is not None:
                    store.unregister_buffer(int(old.ctypes.data))
                rc = store.register_buffer(int(buf.ctypes.data), size)
            finally:
                self._exit()
            if rc != 0:
                self._bounce = None
                raise StorageError(f"mooncake {self.master}: cannot register a {size}-byte bounce buffer ({rc})")
            self._bounce = buf
        return self._bounce, int(self._bounce.ctypes.data)

    def _chunks(self, sizes: list[int], idx: list[int]) -> list[list[int]]:
        """Split item indices into runs whose slots (size, at least 1) fit the bounce capacity."""
        cap = max(self.local_buffer, max((max(sizes[i], 1) for i in idx), default=1))
        out: list[list[int]] = []
        cur: list[int] = []
        used = 0
        for i in idx:
            if cur and used + max(sizes[i], 1) > cap:
                out.append(cur)
                cur, used = [], 0
            cur.append(i)
            used += max(sizes[i], 1)
        if cur:
            out.append(cur)
        return out

    # ------------------------------------------------------------------ interface
    def register_buffer(self, buf: memoryview) -> None:
        start, n = _address(buf)
        if n == 0:
            return
        end = start + n
        for s, e, _ in self._regions:
            if s <= start and end <= e:
                return  # already covered
        self._regions.append((start, end, memoryview(buf)))  # keeps the memory alive
        store = self._store
        if store is not None:
            with self._state:
                if self._closed:
                    return
                self._active += 1
            try:
                self._register_region(store, start, end)
            finally:
                self._exit()

    def exists(self, names: Sequence[str]) -> list[bool]:
        names = list(names)
        if not names:
            return []
        store = self._enter()
        try:
            codes = [int(c) for c in store.batch_is_exist(names)]
        finally:
            self._exit()
        self._count(round_trips=1, exists=len(names))
        if len(codes) != len(names) or any(c < 0 for c in codes):
            bad = [(n, c) for n, c in zip(names, codes) if c < 0] or [(names[0], -1)]
            raise self._fail("exists", [c for _, c in bad], [n for n, _ in bad], len(names))
        return [c == 1 for c in codes]

    def get_into(self, names: Sequence[str], bufs: Sequence[memoryview]) -> list[int]:
        names = list(names)
        if len(names) != len(bufs):
            raise ValueError(f"get_into: {len(names)} names but {len(bufs)} buffers")
        if not names:
            return []
        addrs, sizes = [], []
        for b in bufs:
            if memoryview(b).readonly:
                raise ValueError("get_into needs writable buffers")
            a, n = _address(b)
            addrs.append(a)
            sizes.append(n)
        codes = [0] * len(names)
        direct = [i for i in range(len(names)) if sizes[i] and self._in_region(addrs[i], sizes[i])]
        bounce = [i for i in range(len(names)) if not (sizes[i] and self._in_region(addrs[i], sizes[i]))]
        if direct:
            got = self._batch(
                "batch_get_into", [names[i] for i in direct], [addrs[i] for i in direct], [sizes[i] for i in direct]
            )
            for i, c in zip(direct, got):
                codes[i] = c
        if bounce:
            with self._bounce_lock:
                for chunk in self._chunks(sizes, bounce):
                    buf, base = self._bounce_buffer(sum(max(sizes[i], 1) for i in chunk))
                    offs, off = [], 0
                    for i in chunk:
                        offs.append(off)
                        off += max(sizes[i], 1)  # a 0-byte buffer still gets a distinct slot
                    got = self._batch(
                        "batch_get_into", [names[i] for i in chunk], [base + o for o in offs], [sizes[i] for i in chunk]
                    )
                    for i, o, c in zip(chunk, offs, got):
                        codes[i] = c
                        if c > 0:
                            np.frombuffer(bufs[i], dtype=np.uint8)[:c] = buf[o : o + c]
        self._count(zero_copy_items=len(direct), bounce_items=len(bounce))
        return self._get_results(names, sizes, codes)

    def _get_results(self, names: list[str], sizes: list[int], codes: list[int]) -> list[int]:
        out: list[int] = []
        check: list[int] = []
        fatal = [i for i, c in enumerate(codes) if c < 0 and c not in _GET_MISS and c not in (INVALID_PARAMS, BUFFER_OVERFLOW)]
        if fatal:
            raise self._fail("get", [codes[i] for i in fatal], [names[i] for i in fatal], len(names))
        for i, c in enumerate(codes):
            if c in (INVALID_PARAMS, BUFFER_OVERFLOW):
                check.append(i)
            out.append(c if c >= 0 else MISSING)
        if check:  # "buffer too small"? ask the object's size
            store = self._enter()
            try:
                real = [int(store.get_size(names[i])) for i in check]
            finally:
                self._exit()
            self._count(round_trips=len(check))
            for i, size in zip(check, real):
                if size > sizes[i]:
                    out[i] = TOO_LARGE
                elif size < 0 and size in _GET_MISS:
                    out[i] = MISSING
                else:
                    raise self._fail("get", [codes[i]], [names[i]], len(names))
        hits = [c for c in out if c >= 0]
        self._count(
            gets=len(out), hits=len(hits), misses=out.count(MISSING), too_large=out.count(TOO_LARGE), bytes_read=sum(hits)
        )
        return out

    def put_from(self, names: Sequence[str], bufs: Sequence[memoryview]) -> list[bool]:
        names = list(names)
        if len(names) != len(bufs):
            raise ValueError(f"put_from: {len(names)} names but {len(bufs)} buffers")
        if not names:
            return []
        addrs, sizes = [], []
        for b in bufs:
            a, n = _address(b)
            addrs.append(a)
            sizes.append(n)
        codes = [INVALID_PARAMS] * len(names)  # an empty object is refused
        nonempty = [i for i in range(len(names)) if sizes[i]]
        direct = [i for i in nonempty if self._in_region(addrs[i], sizes[i])]
        bounce = [i for i in nonempty if not self._in_region(addrs[i], sizes[i])]
        if direct:
            got = self._batch(
                "batch_put_from", [names[i] for i in direct], [addrs[i] for i in direct], [sizes[i] for i in direct]
            )
            for i, c in zip(direct, got):
                codes[i] = c
        if bounce:
            with self._bounce_lock:
                for chunk in self._chunks(sizes, bounce):
                    buf, base = self._bounce_buffer(sum(sizes[i] for i in chunk))
                    offs, off = [], 0
                    for i in chunk:
                        buf[off : off + sizes[i]] = np.frombuffer(memoryview(bufs[i]), dtype=np.uint8)
                        offs.append(off)
                        off += sizes[i]
                    got = self._batch(
                        "batch_put_from", [names[i] for i in chunk], [base + o for o in offs], [sizes[i] for i in chunk]
                    )
                    for i, c in zip(chunk, got):
                        codes[i] = c
        self._count(zero_copy_items=len(direct), bounce_items=len(bounce))
        fatal = [i for i, c in enumerate(codes) if c != 0 and c not in _PUT_EXISTS and c not in _PUT_REFUSED]
        if fatal:
            raise self._fail("put", [codes[i] for i in fatal], [names[i] for i in fatal], len(names))
        ok = [c == 0 or c in _PUT_EXISTS for c in codes]
        self._count(puts=len(ok), refused=ok.count(False), bytes_written=sum(s for s, c in zip(sizes, codes) if c == 0))
        return ok

    def delete(self, names: Sequence[str]) -> None:
        names = list(names)
        if not names:
            return
        store = self._enter()
        try:
            codes = [int(c) for c in store.batch_remove(names, False)]
        finally:
            self._exit()
        self._count(round_trips=1, deletes=len(names))
        bad = [(n, c) for n, c in zip(names, codes) if c != 0 and c not in _REMOVE_OK]
        if bad:
            raise self._fail("delete", [c for _, c in bad], [n for n, _ in bad], len(names))

    def stats(self) -> dict:
        with self._counter_lock:
            out: dict[str, Any] = dict(self._c)
        out.update(
            connected=self._store is not None,
            registered_bytes=sum(e - s for s, e in self._registered),
            bounce_bytes=0 if self._bounce is None else int(self._bounce.nbytes),
        )
        return out

    def close(self) -> None:
        with self._state:
            if self._closed:
                return
            self._closed = True
            deadline = time.monotonic() + 3 * self.timeout + 5
            while self._active and time.monotonic() < deadline:
                self._state.wait(0.1)
            store, self._store = self._store, None
            busy = self._active
        if store is None:
            return
        if busy:  # a call is still inside the library: tearing down under it could crash
            log.warning("mooncake close: %d call(s) still running; leaving the client to exit", busy)
            return
        try:
            store.close()
        except Exception as e:  # pragma: no cover
            log.warning("mooncake close failed: %s", e)
        self._bounce = None
        self._regions = []  # the client is gone: the memory may be freed
        self._registered = ()


# ------------------------------------------------------------------------------------------------
# throughput check: python -m kvtier.storage.mooncake [URL] (starts a local pool when no URL)


def _throughput_check(
    url: str, sizes: Sequence[int] = (1 << 20, 2 << 20), batch: int = 8, rounds: int = 12, repeats: int = 2
) -> list[dict]:
    """MB/s of the raw client's bytes API against this backend, on ``batch`` objects per call:

    raw      ``put_batch``/``get_batch`` (bytes in, bytes out)
    raw1     ``put``/``get`` one key at a time
    backend  ``put_from``/``get_into`` on a registered staging arena (zero-copy)
    bounce   ``put_from``/``get_into`` on unregistered buffers (bounce buffer + one memcpy)

    Each is run ``repeats`` times, interleaved; the best run counts."""
    kw = parse_mooncake_url(url)
    backend = MooncakeBackend(**kw)
    raw = backend._Store()
    rc = raw.setup(backend.local_hostname, backend.metadata, 0, 256 << 20, backend.protocol, backend.rdma_devices, backend.master)
    if rc != 0:
        raise StorageError(f"raw client setup failed ({rc})")
    results = []
    try:
        for size in sizes:
            arena = np.empty((batch, size), dtype=np.uint8)
            backend.register_buffer(arena.reshape(-1).data)
            arena[:] = np.random.default_rng(size).integers(0, 256, arena.shape, dtype=np.uint8)
            values = [arena[j].tobytes() for j in range(batch)]
            loose = [bytearray(v) for v in values]  # not registered
            zc = [memoryview(arena[j]) for j in range(batch)]
            lv = [memoryview(b) for b in loose]

            def put(tag: str, keys: list[str]) -> None:
                if tag == "raw":
                    assert raw.put_batch(keys, values) == 0
                elif tag == "raw1":
                    for k, v in zip(keys, values):
                        assert raw.put(k, v) == 0
                else:
                    assert all(backend.put_from(keys, zc if tag == "backend" else lv))

            def get(tag: str, keys: list[str]) -> None:
                if tag == "raw":
                    assert all(len(g) == size for g in raw.get_batch(keys))
                elif tag == "raw1":
                    for k in keys:
                        assert len(raw.get(k)) == size
                else:
                    assert backend.get_into(keys, zc if tag == "backend" else lv) == [size] * batch

            best: dict[str, float] = {}
            for rep in range(repeats):
                for tag in ("raw", "raw1", "backend", "bounce"):
                    keys = [[f"tp:{tag}:{rep}:{size}:{r}:{j}" for j in range(batch)] for r in range(rounds)]
                    mb = rounds * batch * size / 1e6
                    for op, fn in (("put", put), ("get", get)):
                        t0 = time.perf_counter()
                        for r in range(rounds):
                            fn(tag, keys[r])
                        rate = mb / (time.perf_counter() - t0)
                        best[f"{tag}_{op}"] = max(best.get(f"{tag}_{op}", 0.0), rate)
                    for r in range(rounds):
                        raw.batch_remove(keys[r], True)
            row: dict[str, Any] = {"size": size, "batch": batch}
            row.update({f"{k}_MBps": round(v) for k, v in best.items()})
            for op in ("put", "get"):
                row[f"{op}_ratio_vs_raw_batch"] = round(best[f"backend_{op}"] / best[f"raw_{op}"], 2)
                row[f"{op}_ratio_vs_raw_single"] = round(best[f"backend_{op}"] / best[f"raw1_{op}"], 2)
                row[f"{op}_ratio_bounce_vs_raw_batch"] = round(best[f"bounce_{op}"] / best[f"raw_{op}"], 2)
            results.append(row)
    finally:
        raw.close()
        backend.close()
    return results


if __name__ == "__main__":  # pragma: no cover - manual measurement
    import json
    import sys

    if len(sys.argv) > 1:
        for row in _throughput_check(sys.argv[1]):
            print(json.dumps(row))
    else:
        with start_pool(size="1GiB") as pool:
            print(f"# local pool {pool.url}")
            for row in _throughput_check(pool.url):
                print(json.dumps(row))
