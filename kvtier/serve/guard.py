"""Bounds on what a connection may hold and cost, for ``kvtier serve`` and ``kvtier router``.

uvicorn closes idle kept-alive connections (``timeout_keep_alive``) but has no deadline on a
request's headers or body, no cap per client and none in all: a client that sends one header line
every few seconds, or a body one byte at a time, holds a connection (a file descriptor) as long as
it likes, and enough of them exhaust the process's descriptors. And every request it parses costs
the interpreter that streams every client's tokens, however cheap its answer. :class:`Guard` is one
server's bounds and counters; :meth:`Guard.protocol_class` is the uvicorn HTTP protocol that
enforces them (uvicorn's httptools protocol, or its h11 one where httptools is missing, with hooks
on the connection's events)::

    connection opens    per-client cap, total cap    429 / 503 (Retry-After) and closed at once
    headers             within header_timeout        408 and closed
                        (of the connection opening, or of a kept-alive request's first byte)
    body                body_min_rate bytes/s        408 (or closed, once the answer started);
                        per header_timeout window    the app sees a disconnect
    idle kept alive     keep_alive_timeout           closed (uvicorn's timeout_keep_alive)
    cheap answers       cheap_request_rate per       the address's connections are not read
    (/health, 401)      address, bursts of 2x        until its debt is paid (the kernel holds
                                                     its requests; no CPU is spent on them)

The cheap answers are counted by the ASGI layers that give them (serve/asgi.py: ``FastGet`` and
``CheapPath`` for ``/health``, ``ApiKeyAuth`` for 401) through :func:`charge`, against the address
of the connection they came on (never a header's claim: ``X-Forwarded-For`` would let a client
pick its bucket); the protocol looks at the address's bucket when a connection opens, when bytes
arrive and when a response completes, and stops reading while the address is in debt. Windows in
which the server itself was not reading (a body the app has not asked for yet, a throttled
connection) are not held against a body's rate. The counters (refusals and timeouts by reason,
throttles by reason, connections open) are in ``/metrics`` (serve/metrics.py:
:class:`~kvtier.serve.metrics.ConnectionCollector`).
"""

from __future__ import annotations

import functools
import logging
import math
import resource
import time
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # (asyncio is not imported at run time: `kvtier --help` reads DEFAULTS)
    import asyncio

    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _ProtocolBase
else:
    _ProtocolBase = object

log = logging.getLogger(__name__)

# file descriptors kept for the process's own use (engine pipes, model and tokenizer files, the
# storage pool's sockets, logs) when --max-connections is set against RLIMIT_NOFILE
FD_MARGIN = 256
RETRY_AFTER_S = 1
# where a request's scope carries the function that counts a cheap answer (scope["state"][...])
CHEAP_KEY = "kvtier.cheap_request"
REFUSALS = ("client_limit", "server_limit", "header_timeout", "body_timeout")
THROTTLES = ("health", "unauthorized")
_PRUNE_AT = 4096  # buckets held before the full ones are dropped
_MIN_WAIT_S = 0.001  # a debt paid to within this is paid (a timer may fire that early)


@dataclass(frozen=True)
class ConnectionLimits:
    """One server's (or router's) bounds on its connections; the flags of the same names."""

    header_timeout: float = 10.0  # s: a request's headers, from the connection's opening or its first byte
    body_min_rate: float = 1024.0  # bytes/s over windows of header_timeout (0: no minimum)
    keep_alive_timeout: float = 5.0  # s: an idle kept-alive connection (uvicorn's timeout_keep_alive)
    max_connections_per_client: int = 1024  # open connections of one client address (the router's pool to a server)
    max_connections: int = 2048  # open connections in all (less where RLIMIT_NOFILE is lower)
    cheap_request_rate: float = 50.0  # /health and 401 answers per s per address, bursts of 2x (0: no limit)

    def __post_init__(self) -> None:
        for name in ("header_timeout", "keep_alive_timeout"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
        for name in ("body_min_rate", "cheap_request_rate"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0 (0: off), got {value!r}")
        for name in ("max_connections_per_client", "max_connections"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")

    @property
    def cheap_request_burst(self) -> float:
        return 2.0 * self.cheap_request_rate


DEFAULTS = {f.name: f.default for f in fields(ConnectionLimits)}


class CheapLimiter:
    """A token bucket per client address: ``burst`` tokens, refilled at ``rate`` per second; each
    cheap answer takes one, and may take the bucket below zero (the answer is already given). An
    address with a negative bucket is in debt for ``-tokens / rate`` seconds: :meth:`wait`."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not rate > 0 or not burst >= 1:
            raise ValueError(f"a cheap-request limiter needs rate > 0 and burst >= 1, got {rate}, {burst}")
        self.rate, self.burst, self.clock = rate, burst, clock
        self._buckets: dict[str, list[Any]] = {}  # address -> [tokens, at, reason of the last charge]
        self._prune_at = _PRUNE_AT

    def charge(self, addr: str, reason: str) -> None:
        now = self.clock()
        bucket = self._buckets.get(addr)
        if bucket is None:
            if len(self._buckets) >= self._prune_at:
                self._prune(now)
            self._buckets[addr] = [self.burst - 1.0, now, reason]
            return
        bucket[0] = min(self.burst, bucket[0] + (now - bucket[1]) * self.rate) - 1.0
        bucket[1], bucket[2] = now, reason

    def wait(self, addr: str) -> tuple[float, str]:
        """Seconds until ``addr`` is out of debt (0: it is not in debt), and the reason of its last
        charge."""
        bucket = self._buckets.get(addr)
        if bucket is None:
            return 0.0, ""
        tokens = bucket[0] + (self.clock() - bucket[1]) * self.rate
        return (-tokens / self.rate if tokens < 0 else 0.0), bucket[2]

    def _prune(self, now: float) -> None:
        """Drop the buckets that are full again (an address that comes back starts full anyway)."""
        full = [a for a, b in self._buckets.items() if b[0] + (now - b[1]) * self.rate >= self.burst]
        for addr in full:
            del self._buckets[addr]
        self._prune_at = max(_PRUNE_AT, 2 * len(self._buckets))

    def __len__(self) -> int:
        return len(self._buckets)


def charge(scope: Any, reason: str) -> None:
    """Count one cheap answer (``reason``: ``health``, ``unauthorized``) against the address of the
    connection ``scope`` came on; nothing under a server without a :class:`Guard`."""
    state = scope.get("state")
    count = state.get(CHEAP_KEY) if state else None
    if count is not None:
        count(reason)


def open_file_limit(wanted: int | None = None) -> int:
    """The process's soft RLIMIT_NOFILE, first raised toward ``wanted`` (at most to the hard
    limit) when it is lower and ``wanted`` is given."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if wanted is not None and soft != resource.RLIM_INFINITY and soft < wanted:
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:  # pragma: no cover - a platform that refuses it
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, target, e)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def connection_budget(open_files: int) -> int:
    """Connections a process with ``open_files`` descriptors may hold: FD_MARGIN fewer (half, when
    the limit is that low)."""
    return max(1, open_files - FD_MARGIN if open_files > 2 * FD_MARGIN else open_files // 2)


def _answer(status: int, message: str, type_: str | None = None, retry_after: bool = False) -> bytes:
    """A whole HTTP/1.1 response in OpenAI's error shape, with ``Connection: close``."""
    import http
    import json

    from kvtier.serve.errors import error_body

    body = json.dumps(error_body(status, message, type_=type_), separators=(",", ":")).encode()
    head = [
        f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: close",
    ]
    if retry_after:
        head.append(f"retry-after: {RETRY_AFTER_S}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class Guard:
    """One server's connection bounds, its connections by client address, and its counters."""

    def __init__(self, limits: ConnectionLimits | None = None, open_files: int | None = None) -> None:
        """``open_files``: the process's descriptor limit (default: its soft RLIMIT_NOFILE as it
        is; ``serve()`` raises it first: :func:`open_file_limit`)."""
        self.limits = limits = limits or ConnectionLimits()
        budget = connection_budget(open_files if open_files is not None else open_file_limit())
        self.max_connections = min(limits.max_connections, budget)
        if self.max_connections < limits.max_connections:
            log.warning(
                "at most %d connections (--max-connections %d): the open-file limit leaves no more (raise `ulimit -n` for more)",
                self.max_connections,
                limits.max_connections,
            )
        self.limiter = (
            CheapLimiter(limits.cheap_request_rate, limits.cheap_request_burst) if limits.cheap_request_rate > 0 else None
        )
        self.connections = 0  # open and admitted
        self.per_client: dict[str, int] = {}
        self.refused = dict.fromkeys(REFUSALS, 0)
        self.throttled = dict.fromkeys(THROTTLES, 0)
        self.answers = {
            "client_limit": _answer(
                429,
                f"too many connections from your address (--max-connections-per-client "
                f"{limits.max_connections_per_client}): close some, then retry",
                "rate_limit_error",
                retry_after=True,
            ),
            "server_limit": _answer(
                503,
                f"the server holds {self.max_connections} connections, its limit (--max-connections): retry later",
                retry_after=True,
            ),
            "header_timeout": _answer(
                408, f"the request's headers did not arrive within {limits.header_timeout:g} s (--header-timeout)", "timeout"
            ),
            "body_timeout": _answer(
                408,
                f"the request body arrived slower than {limits.body_min_rate:g} bytes/s (--body-min-rate)",
                "timeout",
            ),
        }

    def admit(self, addr: str) -> str | None:
        """Count a new connection from ``addr`` in; or the reason it is refused (not counted)."""
        n = self.per_client.get(addr, 0)
        if n >= self.limits.max_connections_per_client:
            reason = "client_limit"
        elif self.connections >= self.max_connections:
            reason = "server_limit"
        else:
            self.per_client[addr] = n + 1
            self.connections += 1
            return None
        self.refused[reason] += 1
        return reason

    def release(self, addr: str) -> None:
        """An admitted connection from ``addr`` closed."""
        n = self.per_client[addr] - 1
        if n:
            self.per_client[addr] = n
        else:
            del self.per_client[addr]
        self.connections -= 1

    def protocol_class(self, impl: str = "auto") -> type[asyncio.Protocol]:
        """The uvicorn HTTP protocol (``uvicorn.Config(http=...)``) enforcing this guard: on
        uvicorn's httptools protocol (``impl="auto"``, its h11 one when httptools is missing) or on
        the one named (``"httptools"``, ``"h11"``)."""
        base, flow = _bases(impl)
        attrs = {"guard": self, "_flow_class": flow, "_h11": base.__name__ == "H11Protocol"}
        return type(f"Guarded{base.__name__}", (_GuardedProtocol, base), attrs)

    def uvicorn_options(self, impl: str = "auto") -> dict[str, Any]:
        """``uvicorn.Config`` / ``uvicorn.run`` keywords: the protocol and the keep-alive timeout
        (no WebSocket protocol: an upgraded connection would leave the guard's count)."""
        return {"http": self.protocol_class(impl), "timeout_keep_alive": self.limits.keep_alive_timeout, "ws": "none"}


@functools.lru_cache(maxsize=None)
def _bases(impl: str) -> tuple[type, type]:
    """uvicorn's protocol class to build on, and a FlowControl that reports its read pauses."""
    from uvicorn.protocols.http.flow_control import FlowControl

    base: type
    if impl not in ("auto", "httptools", "h11"):
        raise ValueError(f"impl must be auto, httptools or h11, got {impl!r}")
    try:
        if impl == "h11":
            raise ImportError
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        base = HttpToolsProtocol
    except ImportError:
        if impl == "httptools":
            raise
        from uvicorn.protocols.http.h11_impl import H11Protocol

        base = H11Protocol

    class Flow(FlowControl):
        def __init__(self, transport: asyncio.Transport, on_pause: Callable[[], None]) -> None:
            super().__init__(transport)
            self._on_pause = on_pause

        def pause_reading(self) -> None:
            super().pause_reading()
            self._on_pause()

    return base, Flow


class _GuardedProtocol(_ProtocolBase):
    """The guard's hooks, put in front of uvicorn's protocol by :meth:`Guard.protocol_class`.

    State of a connection, as its parser sees it: headers awaited (``_header_timer`` armed, or
    ``_headers_pending`` while a response is still going out), body open (``_body_open``: headers
    complete, message not; ``_body_timer`` judges each window), or neither (the app answers; then
    idle under uvicorn's keep-alive timer)."""

    guard: Guard
    _flow_class: Any
    _h11: bool

    _addr = ""
    _admitted = False
    _header_timer: asyncio.TimerHandle | None = None
    _headers_pending = False
    _body_open = False
    _body_bytes = 0
    _paused_in_window = False
    _body_timer: asyncio.TimerHandle | None = None
    _throttle_timer: asyncio.TimerHandle | None = None
    _after_throttle: list[Callable[[], None]] = []  # (an instance's own list once throttled)
    _held = b""  # read while throttled: fed to the parser once the debt is paid

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.guard.limiter is not None:  # every request's scope["state"] gets it (a copy of app_state)
            self.app_state = {**self.app_state, CHEAP_KEY: self._charge}

    # ------------------------------------------------------------------ connection
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._addr = self.client[0] if self.client else ""
        refused = self.guard.admit(self._addr)
        if refused is not None:
            transport.write(self.guard.answers[refused])
            transport.close()
            return
        self._admitted = True
        self.flow = self._flow_class(transport, self._note_pause)
        if not self._throttle(self._resume_new):
            self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._header_timer, self._body_timer, self._throttle_timer):
            if timer is not None:
                timer.cancel()
        self._header_timer = self._body_timer = self._throttle_timer = None
        if self._admitted:
            self._admitted = False
            self.guard.release(self._addr)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self._admitted:  # refused: closing
            return
        if self._throttle_timer is not None or self._throttle(self.flow.resume_reading):
            # the address is in debt: keep what came for when it is paid, and read no more
            # (uvloop also starts reading after connection_made, whatever that asked)
            self._held += data
            self.flow.pause_reading()
            self.transport.pause_reading()
            return
        if self._h11 and self._header_timer is None and not self._body_open:
            self._message_begun()  # (h11 tells nothing before a request's headers are complete)
        super().data_received(data)
        if self._body_open:
            self._body_bytes += len(data)
            if self._body_timer is None and self.guard.limits.body_min_rate > 0 and not self.transport.is_closing():
                self._body_timer = self.loop.call_later(self.guard.limits.header_timeout, self._body_window_over)

    def _should_upgrade_to_ws(self) -> bool:
        return False  # an upgraded connection would change protocols behind the guard's back

    # ------------------------------------------------------------------ parser events
    def on_message_begin(self) -> None:  # httptools: a request's first byte
        super().on_message_begin()
        self._message_begun()

    def on_headers_complete(self) -> None:  # httptools
        super().on_headers_complete()
        self._headers_done()

    def on_message_complete(self) -> None:  # httptools (also after its response went out)
        super().on_message_complete()
        self._message_done()

    def handle_events(self) -> None:  # h11: what the events did to the request's state
        import h11

        cycle = self.cycle
        super().handle_events()  # type: ignore[misc]
        if self.cycle is not cycle:
            self._headers_done()
        if self._body_open and getattr(self, "conn").their_state is not h11.SEND_BODY:
            self._message_done()

    def _message_begun(self) -> None:
        if self._header_timer is not None:
            return
        if self.throttled or (self.cycle is not None and not self.cycle.response_complete):
            self._headers_pending = True  # pipelined: timed from the end of the response going out
        else:
            self._arm_header_timer()

    def _headers_done(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        self._headers_pending = False
        self._body_open = True
        self._body_bytes = 0
        self._paused_in_window = self.flow.read_paused
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _message_done(self) -> None:
        self._body_open = False
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def on_response_complete(self) -> None:
        if self._admitted and not self.transport.is_closing() and self._throttle(self.on_response_complete):
            return  # (then again, once the address's debt is paid)
        super().on_response_complete()
        if self._headers_pending and self._header_timer is None and not self.transport.is_closing():
            self._headers_pending = False
            self._arm_header_timer()

    # ------------------------------------------------------------------ timeouts
    def _arm_header_timer(self) -> None:
        self._header_timer = self.loop.call_later(self.guard.limits.header_timeout, self._header_timeout)

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self._headers_pending = True  # a response is going out: time the next headers from its end
            return
        self._time_out("header_timeout")

    def _note_pause(self) -> None:
        self._paused_in_window = True

    def _body_window_over(self) -> None:
        self._body_timer = None
        if not self._body_open or self.transport.is_closing():
            return
        limits = self.guard.limits
        cycle = self.cycle
        # a window in which the server did not read (flow control, a throttle, a client waiting
        # for "100 Continue") is not the client's doing
        not_reading = self._paused_in_window or (cycle is not None and cycle.waiting_for_100_continue)
        if not not_reading and self._body_bytes < limits.body_min_rate * limits.header_timeout:
            self._time_out("body_timeout")
            return
        self._body_bytes = 0
        self._paused_in_window = self.flow.read_paused
        self._body_timer = self.loop.call_later(limits.header_timeout, self._body_window_over)

    def _time_out(self, reason: str) -> None:
        """408 (where no response has started: else the connection just closes) and close; the
        request's app sees a disconnect."""
        self.guard.refused[reason] += 1
        cycle = self.cycle
        in_flight = cycle is not None and not cycle.response_complete
        if reason == "body_timeout":  # the body's request is self.cycle's: answered yet?
            # (httptools: a queued request waits for the answer going out to an earlier one)
            answer = cycle is not None and not cycle.response_started and not getattr(self, "pipeline", None)
        else:  # the next request's headers: nothing is going out (else the timer waits for it)
            answer = not in_flight
        if answer:
            self.transport.write(self.guard.answers[reason])
        if in_flight:
            cycle.disconnected = True  # its sends are dropped from now on, its receive says disconnect
            cycle.message_event.set()
        log.debug("%s from %s: closing the connection", reason, self._addr)
        self.transport.close()

    # ------------------------------------------------------------------ cheap requests
    def _charge(self, reason: str) -> None:
        limiter = self.guard.limiter
        if limiter is not None:
            limiter.charge(self._addr, reason)

    @property
    def throttled(self) -> bool:
        return self._throttle_timer is not None

    def _throttle(self, then: Callable[[], None]) -> bool:
        """If this connection's address is in debt: stop reading, and call ``then`` once the debt
        is paid (after what was waiting for it already)."""
        if self._throttle_timer is not None:
            self._after_throttle.append(then)
            return True
        limiter = self.guard.limiter
        if limiter is None:
            return False
        wait, reason = limiter.wait(self._addr)
        if wait < _MIN_WAIT_S:
            return False
        if reason in self.guard.throttled:
            self.guard.throttled[reason] += 1
        if self._header_timer is not None:  # its requests wait in the kernel: not the client's delay
            self._header_timer.cancel()
            self._header_timer = None
            self._headers_pending = True
        self.flow.pause_reading()
        self._after_throttle = [then]
        self._throttle_timer = self.loop.call_later(wait, self._unthrottle)
        return True

    def _unthrottle(self) -> None:
        self._throttle_timer = None
        if self.transport.is_closing():
            return
        wait, _ = self.guard.limiter.wait(self._addr) if self.guard.limiter is not None else (0.0, "")
        if wait >= _MIN_WAIT_S:  # more debt meanwhile (the address's other connections)
            self._throttle_timer = self.loop.call_later(wait, self._unthrottle)
            return
        todo, self._after_throttle = self._after_throttle, []
        for then in todo:
            then()
        held, self._held = self._held, b""
        if held and not self.transport.is_closing():
            self.data_received(held)

    def _resume_new(self) -> None:
        """A connection opened while its address was in debt: read it, now that the debt is paid."""
        self.flow.resume_reading()
        self._headers_pending = False
        self._arm_header_timer()
