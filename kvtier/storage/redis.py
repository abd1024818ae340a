"""Redis / Valkey storage backend (``redis://``, ``rediss://``, ``redis+cluster://``).

Over 600 lines: three URL forms and their checks, a minimal RESP reader that receives GET replies
straight into the caller's buffers (one copy where redis-py makes three: the table below), the
cluster's per-node pipelines with their slot-map refresh and redirects, and the throughput check
that reproduces the table.

URLs (DESIGN §6)::

    redis://[[user]:password@]host[:port][/db][?timeout=2.0&batch=16]
    rediss://[[user]:password@]host[:port][/db][?ssl_ca_certs=PATH&ssl_cert_reqs=none|optional|required]
    redis+cluster://[[user]:password@]host:port,host:port[,...][?timeout=...&batch=...]

``timeout`` (seconds, default 2.0) is the socket connect *and* read timeout: a dead server fails
a call at once (connection refused), a hung one after about ``timeout`` (plus, in a cluster, one
CLUSTER SLOTS to a live node to re-read the slot map). ``batch`` (default 16) is the number of
items per round trip. Port defaults to 6379, db to 0 (a cluster has only db 0).

Objects are opaque immutable blobs stored with plain ``SET``/``GET`` (no pickle, no encoding). Each
batch is one round trip: the items are grouped by the node serving them (one group standalone;
by hash slot in a cluster), every node's pipeline is written, then every node's replies are read:

* ``exists``   - ``EXISTS name`` per item.
* ``get_into`` - ``GET name`` per item; the replies are parsed here (a minimal RESP reader) and
  each value's bytes are received with ``recv_into`` straight into ``bufs[i]``: one copy, kernel to
  caller (redis-py + hiredis make three: socket buffer, hiredis buffer, ``bytes``). A value
  larger than its buffer is skipped on the wire and reported ``TOO_LARGE``.
* ``put_from`` - ``SET name <memoryview>`` per item. The memoryview is handed to ``sendall`` as
  it is: connections use redis-py's Python RESP packer, which sends large/memoryview arguments as
  separate chunks (redis-py's default with hiredis installed copies every value twice). An item
  the server refuses (``OOM ... maxmemory`` under ``noeviction``) is ``False``, not an error.
* ``delete``   - ``UNLINK name`` per item.

Other replies are parsed by redis-py (hiredis when installed); connections come from redis-py
pools (one for standalone, one per node from ``RedisCluster``), which connect, authenticate,
reconnect a stale connection on checkout, and are thread-safe. Every call checks out its own
connection(s): the backend is safe to call from many threads.

Errors: a connection error, timeout or unexpected server reply raises :class:`StorageError` naming
the server (host:port); the connections involved are closed (their replies may be unread), never
reused. There are no retries inside the backend (the storage client owns the retry policy), so
a dead server costs one failed call, not four. The next call reconnects. In a cluster a failure
also re-reads the slot map (failed node last), so once a replica has taken over, calls go to it;
``MOVED``/``ASK`` replies (resharding, a stale map) are followed through redis-py's cluster
client for those items.

Throughput (1 MiB values, batch 16, one thread, 2-core machine, best of 3; MB/s) against the raw
redis-py 8.1 client (hiredis; pipelines of SET / GET of ``bytes``) on the same server:

    server                   raw SET  put_from        raw GET  get_into
    valkey 9.1.2 standalone    778      1964 (2.5x)     877      2390 (2.7x)
    valkey 9.1.2 cluster x3    767      2477 (3.2x)    1493      2726 (1.8x)
    redis 7.0.15 standalone    942      2913 (3.1x)    1132      1990 (1.8x)
    redis 7.0.15 cluster x3   1711      2391 (1.4x)    1428      2290 (1.6x)
    redis 7.0.15 TLS           403       730 (1.8x)     460       639 (1.4x)

Reproduce on a standalone server: ``python -m kvtier.storage.redis redis://127.0.0.1:PORT``
(with ``-m``: run as a script, ``import redis`` would import this file).
"""

from __future__ import annotations

import inspect
import math
import os
import re
import threading
import time
from typing import Any, Sequence
from urllib.parse import parse_qsl, quote, unquote

from kvtier.redact import redact_url
from kvtier.storage.base import MISSING, TOO_LARGE, Backend, StorageError

try:  # the optional dependency: pip install redis hiredis (kvtier[redis])
    import redis as _redis
    from redis.backoff import NoBackoff as _NoBackoff
    from redis.exceptions import AskError as _AskError
    from redis.exceptions import OutOfMemoryError as _OOM
    from redis.exceptions import RedisError as _RedisError
    from redis.exceptions import ResponseError as _ResponseError
    from redis.retry import Retry as _Retry

    try:
        from redis.exceptions import RedisClusterException as _ClusterException
    except ImportError:  # pragma: no cover
        _ClusterException = _RedisError  # type: ignore[misc, assignment]  # an older redis-py's stand-in
    _ERRORS: tuple = (_RedisError, _ClusterException, OSError)
    _p = inspect.signature(_redis.ConnectionPool.get_connection).parameters.get("command_name")
    _GETCONN_NEEDS_NAME = _p is not None and _p.default is inspect.Parameter.empty
    _IMPORT_ERROR: Exception | None = None
except ImportError as _e:  # pragma: no cover - reported when a redis URL is opened
    _redis = None  # type: ignore[assignment]  # optional: checked where a redis URL is opened
    _IMPORT_ERROR = _e

__all__ = ["RedisBackend", "parse_redis_url"]

DEFAULT_PORT = 6379
DEFAULT_TIMEOUT = 2.0
DEFAULT_BATCH = 16
INFO_MAX_AGE = 5.0  # seconds between INFO calls made by stats()
_QUERY_KEYS = ("timeout", "batch", "ssl_ca_certs", "ssl_cert_reqs")
_TLS_ONLY = ("ssl_ca_certs", "ssl_cert_reqs")
_CERT_REQS = ("none", "optional", "required")


# ------------------------------------------------------------------------------------------------
# URL


def _parse_hostport(part: str, url_for_error: str) -> tuple[str, int]:
    if not part:
        raise ValueError(f"redis URL has no host: {url_for_error!r}")
    if part.startswith("["):  # [ipv6]:port
        end = part.find("]")
        if end < 0:
            raise ValueError(f"redis URL has a bad host {part!r} (unclosed '['): {url_for_error!r}")
        host, rest = part[1:end], part[end + 1 :]
        if rest and not rest.startswith(":"):
            raise ValueError(f"redis URL has a bad host {part!r}: {url_for_error!r}")
        port_text = rest[1:] if rest else None
    else:
        host, sep, port_text = part.partition(":")
        if not sep:
            port_text = None
        if ":" in (port_text or ""):
            raise ValueError(f"redis URL has a bad host:port {part!r}: {url_for_error!r}")
    if not host:
        raise ValueError(f"redis URL has no host in {part!r}: {url_for_error!r}")
    if port_text is None:
        return host, DEFAULT_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"redis URL has a bad port {port_text!r} (expected 1..65535): {url_for_error!r}")
    return host, int(port_text)


def parse_redis_url(url: str) -> dict[str, Any]:
    """Parse a redis/rediss/redis+cluster URL into RedisBackend keyword arguments.
    ValueError names the bad part."""
    if not isinstance(url, str):
        raise ValueError(f"redis URL must be a string, got {type(url).__name__}")
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError(f"not a URL (no '://'): {url!r}")
    scheme = scheme.lower()
    if scheme not in ("redis", "rediss", "redis+cluster"):
        raise ValueError(f"unknown redis URL scheme {scheme!r} (expected redis, rediss or redis+cluster)")
    safe_url = redact_url(url)  # what messages show: never the password
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
    if "@" in rest and "@" not in authority:  # a raw '/', '?' or '#' in a password split it
        raise ValueError(
            f"redis URL has an '@' after the host (percent-encode '/', '?', '#' and '@' "
            f"in a password or a path, e.g. %2F, %40): {safe_url!r}"
        )
    rest, _, fragment = rest.partition("#")
    if fragment:
        raise ValueError(f"redis URL must not have a fragment ('#'; percent-encode it in a password): {safe_url!r}")
    rest, _, query = rest.partition("?")
    netloc, slash, path = rest.partition("/")
    # credentials (may contain '@' or ':' when percent-encoded; the last '@' ends them)
    userinfo, at, hostlist = netloc.rpartition("@")
    username = password = None
    if at:
        if ":" not in userinfo:
            raise ValueError(f"redis URL credentials must be ':password@' or 'user:password@' (got no ':'): {safe_url!r}")
        user_text, _, pw_text = userinfo.partition(":")
        username = unquote(user_text) or None
        password = unquote(pw_text) or None
    # hosts
    parts = hostlist.split(",") if hostlist else []
    if not parts:
        raise ValueError(f"redis URL has no host: {safe_url!r}")
    nodes = [_parse_hostport(p.strip(), safe_url) for p in parts]
    cluster = scheme == "redis+cluster"
    if not cluster and len(nodes) != 1:
        raise ValueError(f"{scheme}:// takes one host:port (use redis+cluster:// for several): {safe_url!r}")
    # db
    db = 0
    if slash and path not in ("",):
        if not path.isdigit():
            raise ValueError(f"redis URL has a bad db {redact_url(path)!r} (expected /N, N >= 0): {safe_url!r}")
        db = int(path)
    if cluster and db != 0:
        raise ValueError(f"redis+cluster:// has only db 0, got /{path}: {safe_url!r}")
    # query
    opts: dict[str, Any] = {}
    seen = set()
    for key, value in parse_qsl(query, keep_blank_values=True):
        if key not in _QUERY_KEYS:
            raise ValueError(f"unknown redis URL parameter {key!r} (known: {', '.join(_QUERY_KEYS)})")
        if key in seen:
            raise ValueError(f"redis URL parameter {key!r} given twice")
        seen.add(key)
        if key in _TLS_ONLY and scheme != "rediss":
            raise ValueError(f"redis URL parameter {key!r} needs rediss:// (TLS), got {scheme}://")
        if key == "timeout":
            try:
                t = float(value)
            except ValueError:
                t = float("nan")
            if not (math.isfinite(t) and 0 < t <= 3600):
                raise ValueError(f"redis URL parameter timeout={value!r} must be seconds in (0, 3600]")
            opts["timeout"] = t
        elif key == "batch":
            if not value.isdigit() or not 1 <= int(value) <= 4096:
                raise ValueError(f"redis URL parameter batch={value!r} must be an integer in 1..4096")
            opts["batch"] = int(value)
        elif key == "ssl_cert_reqs":
            if value.lower() not in _CERT_REQS:
                raise ValueError(f"redis URL parameter ssl_cert_reqs={value!r} must be one of {', '.join(_CERT_REQS)}")
            opts["ssl_cert_reqs"] = value.lower()
        elif key == "ssl_ca_certs":
            if not value or not os.path.isfile(value):
                raise ValueError(f"redis URL parameter ssl_ca_certs={value!r}: no such file")
            opts["ssl_ca_certs"] = value
    return dict(nodes=nodes, db=db, username=username, password=password, tls=scheme == "rediss", cluster=cluster, **opts)


# ------------------------------------------------------------------------------------------------
# connections that send memoryviews without copying


def _zero_copy(cls):
    """A Connection subclass whose command packer is redis-py's Python RESP packer: values above
    6000 bytes and memoryviews go to ``sendall`` as they are (the hiredis packer, redis-py's
    default when hiredis is installed, makes bytes() of every memoryview and then one more copy).
    Replies are still parsed by hiredis."""
    packer_cls: Any = getattr(_redis.connection, "PythonRespSerializer", None)
    if packer_cls is None or not hasattr(cls, "_construct_command_packer"):  # pragma: no cover
        return cls

    class ZeroCopy(cls):  # type: ignore[misc, valid-type]  # a base class chosen at run time
        def _construct_command_packer(self, packer):
            if packer is not None:
                return packer
            return packer_cls(self._buffer_cutoff, self.encoder.encode)

    ZeroCopy.__name__ = ZeroCopy.__qualname__ = f"ZeroCopy{cls.__name__}"
    return ZeroCopy


_CONN_CLASSES: dict[str, type] = {}


def _conn_class(tls: bool) -> type:
    key = "ssl" if tls else "tcp"
    if key not in _CONN_CLASSES:
        base = _redis.connection.SSLConnection if tls else _redis.connection.Connection
        _CONN_CLASSES[key] = _zero_copy(base)
    return _CONN_CLASSES[key]


def _byte_view(buf) -> memoryview:
    mv = buf if isinstance(buf, memoryview) else memoryview(buf)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


_READ_CHUNK = 64 << 10


class _ProtocolError(Exception):
    """The reply stream is not what a GET pipeline returns."""


class _ServerReply(Exception):
    """An error reply (``-ERR ...``, ``-MOVED ...``) to one GET; the stream stays in sync."""


class _RespReader:
    """Just enough RESP to read GET replies (``$<n>\r\n<n bytes>\r\n``, ``$-1``, ``_``, ``-ERR``)
    from a blocking socket (its timeout is the connection's socket_timeout). Headers come through
    a small buffer; the bytes of a value beyond what that buffer already holds are received
    straight into the destination with ``recv_into``: one copy, kernel to caller."""

    __slots__ = ("sock", "buf", "mv", "start", "end")

    def __init__(self, sock, buf: bytearray) -> None:
        self.sock = sock
        self.buf = buf
        self.mv = memoryview(buf)
        self.start = self.end = 0

    @property
    def pending(self) -> int:
        return self.end - self.start

    def _fill(self) -> None:
        if self.start == self.end:
            self.start = self.end = 0
        elif self.end == len(self.buf):
            n = self.end - self.start
            self.buf[:n] = self.mv[self.start : self.end]
            self.start, self.end = 0, n
        k = self.sock.recv_into(self.mv[self.end :])
        if not k:
            raise _redis.ConnectionError("server closed the connection")
        self.end += k

    def _line(self) -> bytes:
        while True:
            i = self.buf.find(b"\r\n", self.start, self.end)
            if i >= 0:
                line = bytes(self.mv[self.start : i])
                self.start = i + 2
                return line
            if self.end - self.start > 8192:
                raise _ProtocolError("reply header longer than 8 KiB")
            self._fill()

    def _into(self, dst: memoryview, n: int) -> None:
        have = min(n, self.end - self.start)
        if have:
            dst[:have] = self.mv[self.start : self.start + have]
            self.start += have
        sock = self.sock
        while have < n:
            k = sock.recv_into(dst[have:n])
            if not k:
                raise _redis.ConnectionError("server closed the connection")
            have += k

    def _skip(self, n: int) -> None:
        while n > 0:
            if self.start == self.end:
                self._fill()
            k = min(n, self.end - self.start)
            self.start += k
            n -= k

    def read_bulk_into(self, dst: memoryview) -> int | _ServerReply:
        """Size of the value (copied into dst), MISSING, TOO_LARGE (value skipped), or the
        server's error reply (returned, not raised)."""
        line = self._line()
        kind = line[:1]
        if kind == b"$":
            try:
                n = int(line[1:])
            except ValueError:
                raise _ProtocolError(f"bad bulk length {line[:40]!r}") from None
            if n < 0:
                return MISSING
            if n > dst.nbytes:
                self._skip(n)
                result = TOO_LARGE
            else:
                self._into(dst, n)
                result = n
            while self.end - self.start < 2:
                self._fill()
            if self.buf[self.start : self.start + 2] != b"\r\n":
                raise _ProtocolError("bulk string not terminated by CRLF")
            self.start += 2
            return result
        if kind == b"_":
            return MISSING
        if kind == b"-":
            return _ServerReply(line[1:].decode("utf-8", "replace"))
        raise _ProtocolError(f"unexpected reply {line[:40]!r} to GET")


def _checkout(pool):
    """A connected connection with nothing pending (the pool checks, and reconnects a stale one)."""
    if _GETCONN_NEEDS_NAME:  # pragma: no cover - redis-py < 5.3
        return pool.get_connection("GET")
    return pool.get_connection()


def _is_redirect(r: BaseException) -> bool:
    if _redis is not None and isinstance(r, _AskError):  # MovedError is an AskError
        return True
    return isinstance(r, _ServerReply) and str(r).startswith(("MOVED ", "ASK "))


def _is_oom(r: BaseException) -> bool:
    if _redis is not None and isinstance(r, _OOM):
        return True
    return isinstance(r, _ServerReply) and str(r).startswith("OOM ")


# ------------------------------------------------------------------------------------------------
# backend


class RedisBackend(Backend):
    scheme = "redis"

    def __init__(
        self,
        nodes: Sequence[tuple[str, int]],
        *,
        db: int = 0,
        username: str | None = None,
        password: str | None = None,
        tls: bool = False,
        ssl_ca_certs: str | None = None,
        ssl_cert_reqs: str = "required",
        cluster: bool = False,
        timeout: float = DEFAULT_TIMEOUT,
        batch: int = DEFAULT_BATCH,
    ) -> None:
        if _redis is None:
            raise ImportError(f"redis:// storage needs the redis client: pip install redis hiredis ({_IMPORT_ERROR})")
        if not nodes:
            raise ValueError("RedisBackend needs at least one host:port")
        if cluster and db != 0:
            raise ValueError("a Redis cluster has only db 0")
        self.nodes = [(str(h), int(p)) for h, p in nodes]
        self.cluster = cluster
        self.db = db
        self.tls = tls
        self.timeout = float(timeout)
        self.batch = max(1, int(batch))
        self._username = username
        self._password = password
        self._ssl_opts = {"ssl_ca_certs": ssl_ca_certs, "ssl_cert_reqs": ssl_cert_reqs}
        self._where = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.nodes)
        self._conn_kwargs: dict[str, Any] = dict(
            username=username,
            password=password,
            socket_timeout=self.timeout,
            socket_connect_timeout=self.timeout,
            socket_keepalive=True,
            protocol=2,
            connection_class=_conn_class(tls),
        )
        if tls:
            self._conn_kwargs.update(
                ssl_ca_certs=ssl_ca_certs, ssl_cert_reqs=ssl_cert_reqs, ssl_check_hostname=ssl_cert_reqs == "required"
            )
        self._tls_scratch = threading.local()  # per-thread header buffer of the GET reader
        self._lock = threading.Lock()  # counters, INFO cache
        self._connect_lock = threading.Lock()  # the lazy cluster client
        self._client: Any = None
        self._closed = False
        if not cluster:
            host, port = self.nodes[0]
            pool = _redis.ConnectionPool(host=host, port=port, db=db, retry=_Retry(_NoBackoff(), 0), **self._conn_kwargs)
            self._client = _redis.Redis(connection_pool=pool)
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
            redirects=0,
            topology_refreshes=0,
        )
        self._info: dict[str, Any] = {}
        self._info_at = -math.inf

    # ---- construction
    @classmethod
    def from_url(cls, url: str) -> "RedisBackend":
        return cls(**parse_redis_url(url))

    def describe(self) -> str:
        scheme = "redis+cluster" if self.cluster else ("rediss" if self.tls else "redis")
        auth = ""
        if self._username or self._password:
            auth = f"{quote(self._username or '', safe='')}:{'***' if self._password else ''}@"
        path = f"/{self.db}" if not self.cluster else ""
        q = [f"timeout={self.timeout:g}", f"batch={self.batch}"]
        if self.tls:
            if self._ssl_opts["ssl_ca_certs"]:
                q.append(f"ssl_ca_certs={self._ssl_opts['ssl_ca_certs']}")
            q.append(f"ssl_cert_reqs={self._ssl_opts['ssl_cert_reqs']}")
        return f"{scheme}://{auth}{self._where}{path}?{'&'.join(q)}"

    def __repr__(self) -> str:
        return f"RedisBackend({self.describe()})"

    # ---- plumbing
    def _get_client(self):
        c = self._client
        if c is not None:
            return c
        if self._closed:
            raise StorageError(f"redis {self._where}: backend is closed")
        with self._connect_lock:  # one discovery at a time; others wait for it
            if self._client is None:
                if self._closed:
                    raise StorageError(f"redis {self._where}: backend is closed")
                from redis.cluster import ClusterNode, RedisCluster

                # url= makes redis-py build every node's pool with ConnectionPool(**kwargs), so
                # our connection_class (zero-copy packer) reaches the nodes; credentials stay in
                # kwargs. The other URL hosts are extra startup nodes.
                h, p = self.nodes[0]
                first = f"redis://{f'[{h}]' if ':' in h else h}:{p}"
                try:
                    self._client = RedisCluster(
                        url=first,
                        startup_nodes=[ClusterNode(h, p) for h, p in self.nodes[1:]],
                        retry=_Retry(_NoBackoff(), 0),
                        **self._conn_kwargs,
                    )
                except _ERRORS as e:
                    raise self._fail("cluster discovery", e) from e
            return self._client

    def _count(self, **deltas: int) -> None:
        with self._lock:
            c = self._c
            for k, v in deltas.items():
                c[k] += v

    def _fail(self, op: str, e: BaseException, where: str | None = None) -> StorageError:
        self._count(errors=1)
        if where is None:
            where = self._where
        kind = "redis cluster" if self.cluster else "redis"
        if isinstance(e, TimeoutError) and not isinstance(e, _RedisError):  # a bare socket.timeout
            detail = f"TimeoutError: no reply within {self.timeout:g}s"
        elif isinstance(e, _ServerReply):
            detail = f"server error: {e}"
        else:
            detail = f"{type(e).__name__}: {e}"
        return StorageError(f"{kind} {where}: {op} failed: {detail}")

    def _scratch(self) -> bytearray:
        buf = getattr(self._tls_scratch, "buf", None)
        if buf is None:
            buf = self._tls_scratch.buf = bytearray(_READ_CHUNK)
        return buf

    def _groups(self, op: str, names: Sequence[str]) -> list[tuple[str, Any, list[int]]]:
        """(node label, connection pool, item indices) per node serving these names."""
        if self._closed:
            raise StorageError(f"redis {self._where}: backend is closed")
        if not self.cluster:
            client = self._client
            if client is None:
                raise StorageError(f"redis {self._where}: backend is closed")
            return [(self._where, client.connection_pool, list(range(len(names))))]
        client = self._get_client()
        nm = client.nodes_manager
        groups: dict[str, tuple[str, Any, list[int]]] = {}
        try:
            for i, name in enumerate(names):
                node = nm.get_node_from_slot(client.keyslot(name))
                g = groups.get(node.name)
                if g is None:
                    g = groups[node.name] = (node.name, client.get_redis_connection(node).connection_pool, [])
                g[2].append(i)
        except _ERRORS as e:  # e.g. SlotNotCoveredError
            self._refresh(None)
            raise self._fail(op, e) from e
        return list(groups.values())

    def _refresh(self, failed_node: str | None) -> None:
        """Re-read the cluster's slot map (CLUSTER SLOTS from a live node, the failed one last):
        after a failover the next call goes to the new primary. Errors are ignored (the caller
        is raising already). Concurrent refreshes collapse into one (redis-py's epoch check)."""
        client = self._client
        if not self.cluster or client is None:
            return
        self._count(topology_refreshes=1)
        try:
            try:
                client.nodes_manager.initialize(last_failed_node_name=failed_node)
            except TypeError:  # pragma: no cover - redis-py without last_failed_node_name
                client.nodes_manager.initialize()
        except Exception:
            pass

    def _round_trip(self, op: str, cmds: list[tuple], views: list[memoryview] | None = None) -> list:
        """Send ``cmds`` (one per item, item name second) to the node(s) serving them -- every
        node's commands are written before any reply is read -- and return one result per item:
        the reply, or the server's error reply as an exception instance. With ``views`` the
        commands are GETs read straight into views[i] (result: size, MISSING or TOO_LARGE).
        Connection errors and timeouts raise StorageError; the connections involved are
        closed (their replies may be unread), a cluster re-reads its slot map."""
        groups = self._groups(op, [c[1] for c in cmds])
        results: list = [None] * len(cmds)
        held: list[list] = []  # [pool, conn, clean]
        at = self._where
        try:
            for label, pool, idxs in groups:
                at = label
                conn = _checkout(pool)
                held.append([pool, conn, False])
                conn.send_packed_command(conn.pack_commands([cmds[i] for i in idxs]), check_health=False)
            for entry, (label, _, idxs) in zip(held, groups):
                at = label
                conn = entry[1]
                if views is not None:
                    sock = conn._sock
                    if sock is None:
                        raise _redis.ConnectionError("connection closed")
                    reader = _RespReader(sock, self._scratch())
                    for i in idxs:
                        results[i] = reader.read_bulk_into(views[i])
                    entry[2] = reader.pending == 0  # bytes past our replies: do not reuse it
                else:
                    for i in idxs:
                        try:
                            results[i] = conn.read_response()
                        except _ResponseError as e:  # one item's error reply; stream in sync
                            results[i] = e
                    entry[2] = True
        except (*_ERRORS, _ProtocolError) as e:
            if self.cluster:
                self._refresh(at)
            raise self._fail(op, e, at) from e
        finally:
            for pool, conn, clean in held:
                if not clean:
                    conn.disconnect()
                pool.release(conn)
        return results

    def _redirected(self, op: str, cmd: tuple):
        """An item answered MOVED/ASK (slot migrating or just failed over): redis-py's cluster
        client follows the redirection and fixes its slot map."""
        self._count(redirects=1)
        try:
            return self._get_client().execute_command(*cmd)
        except _ResponseError as e:
            return e
        except _ERRORS as e:
            raise self._fail(op, e) from e

    # ---- Backend
    def exists(self, names: Sequence[str]) -> list[bool]:
        out: list[bool] = []
        b = self.batch
        for i in range(0, len(names), b):
            cmds = [("EXISTS", n) for n in names[i : i + b]]
            for cmd, r in zip(cmds, self._round_trip("EXISTS", cmds)):
                if isinstance(r, BaseException) and self.cluster and _is_redirect(r):
                    r = self._redirected("EXISTS", cmd)
                if isinstance(r, BaseException):
                    raise self._fail("EXISTS", r)
                out.append(bool(r))
        self._count(round_trips=-(-len(names) // b), exists=len(names))
        return out

    def get_into(self, names: Sequence[str], bufs: Sequence[memoryview]) -> list[int]:
        if len(names) != len(bufs):
            raise ValueError(f"get_into: {len(names)} names but {len(bufs)} buffers")
        out: list[int] = []
        b = self.batch
        nbytes = hits = misses = large = 0
        for i in range(0, len(names), b):
            views = [_byte_view(x) for x in bufs[i : i + b]]
            cmds = [("GET", n) for n in names[i : i + b]]
            for cmd, mv, r in zip(cmds, views, self._round_trip("GET", cmds, views)):
                if isinstance(r, BaseException):
                    if not (self.cluster and _is_redirect(r)):
                        raise self._fail("GET", r)
                    v = self._redirected("GET", cmd)
                    if isinstance(v, BaseException):
                        raise self._fail("GET", v)
                    if v is None:
                        r = MISSING
                    elif len(v) > mv.nbytes:
                        r = TOO_LARGE
                    else:
                        mv[: len(v)] = v
                        r = len(v)
                if r >= 0:
                    nbytes += r
                    hits += 1
                elif r == MISSING:
                    misses += 1
                else:
                    large += 1
                out.append(r)
        self._count(
            round_trips=-(-len(names) // b), gets=len(names), bytes_read=nbytes, hits=hits, misses=misses, too_large=large
        )
        return out

    def put_from(self, names: Sequence[str], bufs: Sequence[memoryview]) -> list[bool]:
        if len(names) != len(bufs):
            raise ValueError(f"put_from: {len(names)} names but {len(bufs)} buffers")
        out: list[bool] = []
        b = self.batch
        written = refused = 0
        for i in range(0, len(names), b):
            cmds = [("SET", n, _byte_view(x)) for n, x in zip(names[i : i + b], bufs[i : i + b])]
            for cmd, r in zip(cmds, self._round_trip("SET", cmds)):
                if isinstance(r, BaseException) and self.cluster and _is_redirect(r):
                    r = self._redirected("SET", cmd)
                if isinstance(r, BaseException):
                    if not _is_oom(r):  # refused at maxmemory (noeviction): not an error
                        raise self._fail("SET", r)
                    out.append(False)
                    refused += 1
                else:
                    out.append(True)
                    written += cmd[2].nbytes
        self._count(round_trips=-(-len(names) // b), puts=len(names), refused=refused, bytes_written=written)
        return out

    def delete(self, names: Sequence[str]) -> None:
        b = self.batch
        for i in range(0, len(names), b):
            cmds = [("UNLINK", n) for n in names[i : i + b]]
            for cmd, r in zip(cmds, self._round_trip("UNLINK", cmds)):
                if isinstance(r, BaseException) and self.cluster and _is_redirect(r):
                    r = self._redirected("UNLINK", cmd)
                if isinstance(r, BaseException):
                    raise self._fail("UNLINK", r)
        self._count(round_trips=-(-len(names) // b), deletes=len(names))

    @property
    def connection_class(self) -> type:
        """The redis-py connection class of this backend's connections (TCP or TLS): its packer
        hands a SET's memoryview to ``sendall`` as it is, where redis-py's own copies it twice."""
        return self._conn_kwargs["connection_class"]

    def stats(self) -> dict:
        """Backend counters (round_trips: batches sent, one round trip each -- to every node
        involved at once in a cluster; bytes_read, bytes_written, gets, hits, misses, too_large,
        puts, refused, exists, deletes, errors, redirects, topology_refreshes) plus, refreshed at
        most every INFO_MAX_AGE s, the server's used_memory, maxmemory, evicted_keys and objects
        (DBSIZE; summed over the primaries of a cluster). A server that cannot answer INFO sets
        ``server_error`` instead; stats() never raises."""
        with self._lock:
            out: dict[str, Any] = dict(self._c)
            fresh = time.monotonic() - self._info_at < INFO_MAX_AGE
            info = dict(self._info)
        if not fresh and not self._closed:
            info = self._server_info()
            with self._lock:
                self._info, self._info_at = info, time.monotonic()
        out.update(info)
        out["url"] = self.describe()
        return out

    def _server_info(self) -> dict[str, Any]:
        try:
            client = self._get_client()
            if self.cluster:
                from redis.cluster import RedisCluster

                per_node = client.info(target_nodes=RedisCluster.PRIMARIES)
                infos = (
                    list(per_node.values())
                    if isinstance(per_node, dict) and all(isinstance(v, dict) for v in per_node.values())
                    else [per_node]
                )
                sizes = client.dbsize(target_nodes=RedisCluster.PRIMARIES)
                objects = sum(sizes.values()) if isinstance(sizes, dict) else int(sizes)
            else:
                infos = [client.info()]
                objects = int(client.dbsize())
            return dict(
                used_memory=sum(int(i.get("used_memory", 0)) for i in infos),
                maxmemory=sum(int(i.get("maxmemory", 0)) for i in infos),
                evicted_keys=sum(int(i.get("evicted_keys", 0)) for i in infos),
                objects=objects,
                server_nodes=len(infos),
            )
        except (StorageError, *_ERRORS) as e:
            return {"server_error": f"{type(e).__name__}: {e}"}

    def close(self) -> None:
        with self._connect_lock:
            self._closed = True
            client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:
                pass
            try:
                pool = getattr(client, "connection_pool", None)
                if pool is not None:
                    pool.disconnect()
            except Exception:
                pass


# ------------------------------------------------------------------------------------------------
# throughput check: python -m kvtier.storage.redis redis://127.0.0.1:PORT [MiB_total]


def _throughput_check(url: str, total_mib: int = 512, size: int = 1 << 20, batch: int = DEFAULT_BATCH) -> dict[str, float]:
    """Raw redis-py (default client: hiredis, pipelines of SET/GET of bytes) against this backend
    (put_from/get_into of memoryviews) on the same server, same sizes, same batch. MB/s."""
    opts = parse_redis_url(url)
    host, port = opts["nodes"][0]
    raw = _redis.Redis(host=host, port=port, db=opts["db"], password=opts["password"])
    be = RedisBackend.from_url(url)
    n = max(batch, total_mib * (1 << 20) // size)
    data = [os.urandom(size) for _ in range(batch)]
    bufs = [memoryview(bytearray(size)) for _ in range(batch)]
    res: dict[str, float] = {}

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return n * size / (time.perf_counter() - t0) / 1e6

    def raw_set():
        for i in range(0, n, batch):
            p = raw.pipeline(transaction=False)
            for j in range(batch):
                p.set(f"tp:raw:{(i + j) % 256}", data[j])
            p.execute()

    def raw_get():
        for i in range(0, n, batch):
            p = raw.pipeline(transaction=False)
            for j in range(batch):
                p.get(f"tp:raw:{(i + j) % 256}")
            p.execute()

    def raw_mget():
        for i in range(0, n, batch):
            raw.mget([f"tp:raw:{(i + j) % 256}" for j in range(batch)])

    def be_put():
        for i in range(0, n, batch):
            be.put_from([f"tp:be:{(i + j) % 256}" for j in range(batch)], [memoryview(d) for d in data])

    def be_get():
        for i in range(0, n, batch):
            be.get_into([f"tp:be:{(i + j) % 256}" for j in range(batch)], bufs)

    for _ in range(2):  # second round is the one reported (warm allocator, warm server)
        res["raw_set"], res["backend_put"] = timed(raw_set), timed(be_put)
        res["raw_get"], res["raw_mget"], res["backend_get"] = (timed(raw_get), timed(raw_mget), timed(be_get))
    res["put_ratio"] = res["backend_put"] / res["raw_set"]
    res["get_ratio"] = res["backend_get"] / max(res["raw_get"], res["raw_mget"])
    raw.delete(*[f"tp:raw:{i}" for i in range(256)], *[f"tp:be:{i}" for i in range(256)])
    raw.close()
    be.close()
    return res


if __name__ == "__main__":  # pragma: no cover
    import sys

    _url = sys.argv[1] if len(sys.argv) > 1 else "redis://127.0.0.1:6379"
    _mib = int(sys.argv[2]) if len(sys.argv) > 2 else 512
    for _k, _v in _throughput_check(_url, _mib).items():
        print(f"{_k:12s} {_v:10.2f}")
