"""kvtier/serve/guard.py: header and body deadlines, caps on connections, and the rate of cheap
answers, on real sockets against a real uvicorn (in a thread of this process) running a small app
behind the server's ASGI layers. Timeouts are about a second; no assertion is on how long
something took beyond "it was over before the attacker was done" (with margins of seconds) or which
of two answers came first."""

from __future__ import annotations

import asyncio
import json
import re
import select
import socket
import struct
import threading
import time

import pytest
import uvicorn
from prometheus_client import generate_latest
from starlette.responses import PlainTextResponse

from kvtier.serve import asgi
from kvtier.serve.guard import CHEAP_KEY, DEFAULTS, CheapLimiter, ConnectionLimits, Guard, connection_budget
from kvtier.serve.metrics import ServerMetrics

KEY = "guard-test-key"
IMPLS = ("httptools", "h11")
WAIT_S = 10.0  # the most any test waits for something that should come at once


class App:
    """The app behind the layers: ``/echo`` reads the body and answers its length (``?sleep=S``:
    after S seconds), ``/stream`` sends a chunk every 20 ms until the client goes away; every
    request's last receive() message type goes to ``ends``."""

    def __init__(self) -> None:
        self.ends: list[str] = []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        query = scope["query_string"].decode()
        if scope["path"] == "/stream":
            await receive()  # the request (no body); the next message is the client going away
            gone = asyncio.ensure_future(receive())
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
            while not gone.done():
                await send({"type": "http.response.body", "body": b"tok\n", "more_body": True})
                await asyncio.sleep(0.02)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        if query.startswith("sleep="):
            await asyncio.sleep(float(query[6:]))
        n, last = 0, "http.request"
        while True:
            message = await receive()
            last = message["type"]
            if last != "http.request":
                break
            n += len(message.get("body", b""))
            if not message.get("more_body"):
                break
        self.ends.append(last)
        if last == "http.disconnect":
            return
        await PlainTextResponse(str(n))(scope, receive, send)


class Served:
    """uvicorn on 127.0.0.1 (a free port) in a thread, running ``App`` behind FastGet (/health),
    ApiKeyAuth (/v1/) and BodyLimit, with the guard's protocol."""

    def __init__(self, limits: ConnectionLimits, impl: str = "httptools") -> None:
        self.app = App()
        self.guard = Guard(limits, open_files=1 << 16)
        layered = asgi.FastGet(asgi.wrap(self.app, KEY, ("/v1/",), 4 << 20), "/health", lambda: PlainTextResponse("ok"))
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            layered, log_level="warning", lifespan="off", timeout_graceful_shutdown=2, **self.guard.uvicorn_options(impl)
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started, "the server to start")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(WAIT_S)

    def connect(self, source: str = "127.0.0.1") -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=WAIT_S, source_address=(source, 0))

    def open_count(self, addr: str = "127.0.0.1") -> int:
        return dict(self.guard.per_client).get(addr, 0)


@pytest.fixture
def served():
    started: list[Served] = []

    def start(impl: str = "httptools", **limits) -> Served:
        s = Served(ConnectionLimits(**limits), impl)
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


def wait_for(cond, what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def request(path: str = "/health", method: str = "GET", body: bytes = b"", headers: str = "") -> bytes:
    length = f"Content-Length: {len(body)}\r\n" if (body or method == "POST") and "Content-Length" not in headers else ""
    return f"{method} {path} HTTP/1.1\r\nHost: test\r\n{length}{headers}\r\n".encode() + body


def read_response(s: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One response (with a Content-Length) from ``s``."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before a whole response head: {data!r}")
        data += chunk
    head, rest = data.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    length = int(headers.get("content-length", 0))
    while len(rest) < length:
        chunk = s.recv(65536)
        if not chunk:
            raise ConnectionError("closed in the middle of a response body")
        rest += chunk
    return int(lines[0].split()[1]), headers, rest[:length]


def closed(s: socket.socket) -> bool:
    """The peer closed ``s`` (EOF or reset) within WAIT_S."""
    try:
        return s.recv(65536) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True


def get(served: Served, path: str = "/health", source: str = "127.0.0.1") -> int:
    with served.connect(source) as s:
        s.sendall(request(path))
        return read_response(s)[0]


def reset(s: socket.socket) -> None:
    """Close abruptly: RST, not FIN."""
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


def trickle_until_answered(s: socket.socket, piece: bytes, every: float = 0.05, pieces: int = 100) -> bool:
    """Send ``piece`` every ``every`` s, up to ``pieces`` times (the attacker); True if the server
    answered or closed before the attacker was done."""
    for _ in range(pieces):
        if select.select([s], [], [], every)[0]:
            return True
        try:
            s.sendall(piece)
        except (BrokenPipeError, ConnectionResetError):
            return True
    return bool(select.select([s], [], [], 0)[0])


def openai_408(status: int, headers: dict[str, str], body: bytes) -> dict:
    assert status == 408, body
    assert headers["connection"] == "close"
    err = json.loads(body)["error"]
    assert err["code"] == 408 and err["type"] and err["message"]
    return err


# ---------------------------------------------------------------------------------------- headers
@pytest.mark.parametrize("impl", IMPLS)
def test_partial_headers_get_408_and_close_while_health_answers(served, impl):
    srv = served(impl, header_timeout=1.0)
    s = srv.connect()
    s.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\nX-Slow: ")  # ...and nothing more
    assert get(srv) == 200  # another connection meanwhile
    err = openai_408(*read_response(s))
    assert "--header-timeout" in err["message"]
    assert closed(s)
    assert srv.guard.refused["header_timeout"] == 1
    wait_for(lambda: srv.guard.connections == 0, "the count to drop")


@pytest.mark.parametrize("impl", IMPLS)
def test_headers_trickled_a_byte_at_a_time_are_cut_off(served, impl):
    """Every byte resets uvicorn's own keep-alive timer; the header deadline runs from the
    connection's opening whatever arrives."""
    srv = served(impl, header_timeout=0.3)
    s = srv.connect()
    s.sendall(b"GET /health HTTP/1.1\r\n")
    assert trickle_until_answered(s, b"X", every=0.05, pieces=100)  # 5 s of trickling
    openai_408(*read_response(s))
    assert closed(s)


def test_a_silent_connection_gets_408(served):
    srv = served(header_timeout=0.3)
    s = srv.connect()
    openai_408(*read_response(s))
    assert closed(s)


# ---------------------------------------------------------------------------------------- bodies
@pytest.mark.parametrize("impl", IMPLS)
def test_a_body_below_the_min_rate_gets_408_and_the_app_sees_a_disconnect(served, impl):
    srv = served(impl, header_timeout=1.0, body_min_rate=1000)  # 1000 bytes per 1 s window
    s = srv.connect()
    s.sendall(request("/echo", "POST", b"a" * 10, headers="Content-Length: 5000\r\n"))
    assert trickle_until_answered(s, b"a", every=0.05, pieces=100)  # 20 bytes/s for 5 s
    err = openai_408(*read_response(s))
    assert "--body-min-rate" in err["message"]
    assert closed(s)
    assert srv.guard.refused["body_timeout"] == 1
    wait_for(lambda: srv.app.ends == ["http.disconnect"], "the app to see the disconnect")


@pytest.mark.parametrize("impl", IMPLS)
def test_a_full_speed_body_and_an_app_slow_to_read_it_are_not_timed_out(served, impl):
    srv = served(impl, header_timeout=1.0, body_min_rate=1000)
    with srv.connect() as s:
        s.sendall(request("/echo", "POST", b"x" * 200_000))
        assert read_response(s)[:3:2] == (200, b"200000")
        # the app sleeps for several windows before it reads: uvicorn stops reading the socket
        # (flow control) meanwhile, which is not the client's doing
        body = b"y" * (3 << 20)
        sender = threading.Thread(target=s.sendall, args=(request("/echo?sleep=2.5", "POST", body),), daemon=True)
        sender.start()
        assert read_response(s)[:3:2] == (200, str(len(body)).encode())
        sender.join(WAIT_S)
    assert srv.guard.refused["body_timeout"] == 0


@pytest.mark.parametrize("impl", IMPLS)
def test_a_kept_alive_connection_serves_a_request_after_a_pause_then_closes_when_idle(served, impl):
    srv = served(impl, header_timeout=1.0, keep_alive_timeout=3.0)
    s = srv.connect()
    s.sendall(request())
    assert read_response(s)[0] == 200
    time.sleep(1.5)  # longer than the header timeout, well within the keep-alive timeout
    s.sendall(request("/echo", "POST", b"abc"))
    assert read_response(s)[:3:2] == (200, b"3")
    assert s.recv(65536) == b""  # idle: closed by the keep-alive timeout, with nothing said
    assert srv.guard.refused["header_timeout"] == 0


# ------------------------------------------------------------------------------------ connections
@pytest.mark.parametrize("impl", IMPLS)
def test_connections_over_the_per_client_cap_get_429_and_the_count_comes_back(served, impl):
    srv = served(impl, max_connections_per_client=3, max_connections=5)
    held = [srv.connect() for _ in range(3)]
    for s in held:
        s.sendall(request())
        assert read_response(s)[0] == 200
    extra = srv.connect()
    status, headers, body = read_response(extra)
    assert status == 429 and headers["retry-after"] == "1" and json.loads(body)["error"]["code"] == 429
    assert closed(extra)
    assert srv.guard.refused["client_limit"] == 1 and srv.open_count() == 3

    other = srv.connect("127.0.0.2")  # another address has its own cap
    other.sendall(request())
    assert read_response(other)[0] == 200

    reset(held.pop(0))  # a client that vanishes: RST
    wait_for(lambda: srv.open_count() == 2, "the reset connection to be counted out")
    held.append(srv.connect())
    held[-1].sendall(request())
    assert read_response(held[-1])[0] == 200

    fifth = srv.connect("127.0.0.2")  # 3 + 2 = 5 open: the total cap
    sixth = srv.connect("127.0.0.2")
    status, headers, body = read_response(sixth)
    assert status == 503 and headers["retry-after"] == "1" and json.loads(body)["error"]["code"] == 503
    assert closed(sixth)
    assert srv.guard.refused["server_limit"] == 1

    for s in (*held, other, fifth):
        s.close()
    wait_for(lambda: srv.guard.connections == 0, "every connection to be counted out")
    assert srv.guard.per_client == {}


@pytest.mark.parametrize("impl", IMPLS)
def test_the_per_client_count_does_not_leak_however_connections_end(served, impl):
    """Round after round, the cap's worth of connections end every way a connection ends (reset
    mid-headers, mid-body, mid-stream, after an answer; timed out by the server; refused): each
    round is admitted whole, and the count is back to 0 at the end, not below."""
    srv = served(impl, max_connections_per_client=4, header_timeout=1.0)
    for _ in range(3):
        conns = [srv.connect() for _ in range(4)]
        refused = [srv.connect() for _ in range(2)]
        for s in refused:
            assert read_response(s)[0] == 429
        conns[0].sendall(b"GET /health HTTP/1.1\r\nHo")
        conns[1].sendall(request("/echo", "POST", b"abc", headers="Content-Length: 100\r\n"))
        conns[2].sendall(request("/stream"))
        assert conns[2].recv(100).startswith(b"HTTP/1.1 200")
        conns[3].sendall(request())
        assert read_response(conns[3])[0] == 200
        time.sleep(0.05)
        for s in conns[1:]:
            reset(s)
        openai_408(*read_response(conns[0]))  # the server times this one out
        conns[0].close()
        for s in refused:
            s.close()
        wait_for(lambda: srv.guard.connections == 0, "the round's connections to be counted out")
    assert srv.guard.per_client == {} and srv.guard.connections == 0
    assert srv.guard.refused["client_limit"] == 6


# --------------------------------------------------------------------------------- cheap requests
def test_a_health_flood_is_answered_at_the_rate_however_many_connections(served):
    """Four connections loop GET /health for a window: the answers are at most rate x window +
    burst + one in flight per connection (+ slack); an unthrottled server gives hundreds."""
    rate, window, conns = 2.0, 1.5, 4
    srv = served(cheap_request_rate=rate, header_timeout=5)
    answers: list[int] = []
    end = time.monotonic() + window

    def flood() -> None:
        with srv.connect() as s:
            s.settimeout(0.1)
            while time.monotonic() < end:
                s.sendall(request())
                while time.monotonic() < end:
                    try:
                        if read_response(s)[0] == 200:
                            answers.append(1)
                        break
                    except socket.timeout:
                        continue

    threads = [threading.Thread(target=flood, daemon=True) for _ in range(conns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S + window)
    assert 0 < len(answers) <= rate * window + 2 * rate + conns + 2
    assert srv.guard.throttled["health"] > 0


def test_an_address_over_its_rate_waits_while_another_is_answered_at_once(served):
    rate, n = 2.0, 12  # burst 4: 12 answers at once leave the address 4 s in debt
    srv = served(cheap_request_rate=rate, header_timeout=5)
    conns = [srv.connect() for _ in range(n)]
    for s in conns:  # open (and read) before the debt: each answered
        s.sendall(request())
    for s in conns:
        assert read_response(s)[0] == 200
    throttled = srv.guard.throttled["health"]
    assert throttled > 0
    for s in conns:  # now in debt: these wait in the kernel...
        s.sendall(request())
    late = srv.connect()  # ...as does a new connection's request
    late.sendall(request())
    assert get(srv, source="127.0.0.2") == 200  # another address: answered at once
    waiting = select.select([*conns, late], [], [], 0)[0]
    assert not waiting, "an address in debt was answered before the other address"
    # delayed, not dropped: the first of them is answered once the debt is paid
    assert select.select([*conns, late], [], [], 4 * WAIT_S)[0]
    assert srv.guard.throttled["health"] > throttled
    for s in (*conns, late):
        s.close()


def test_401s_count_against_the_rate_too(served):
    srv = served(cheap_request_rate=1.0, header_timeout=5)
    conns = [srv.connect() for _ in range(6)]
    bad = request("/v1/completions", "POST", b"{}", headers="Authorization: Bearer wrong\r\n")
    for s in conns:
        s.sendall(bad)
    for s in conns:
        assert read_response(s)[0] == 401
    assert srv.guard.throttled["unauthorized"] > 0 and srv.guard.throttled["health"] == 0
    good = request("/v1/echo", "POST", b"ok", headers=f"Authorization: Bearer {KEY}\r\n")
    assert get(srv, "/echo", source="127.0.0.2") == 200
    with srv.connect("127.0.0.2") as s:
        s.sendall(good)
        assert read_response(s)[:3:2] == (200, b"2")
    for s in conns:
        s.close()


def test_the_cheap_layers_charge_the_connections_address():
    calls: list[str] = []
    scope = {"type": "http", "path": "/health", "method": "GET", "headers": [], "state": {CHEAP_KEY: calls.append}}

    async def app(scope, receive, send) -> None:
        await PlainTextResponse("inner")(scope, receive, send)

    async def run(layer, scope) -> None:
        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message):
            pass

        await layer(scope, receive, send)

    asyncio.run(run(asgi.CheapPath(app, "/health"), scope))
    asyncio.run(run(asgi.FastGet(app, "/health", lambda: PlainTextResponse("ok")), scope))
    asyncio.run(run(asgi.ApiKeyAuth(app, KEY, ("/v1/",)), scope | {"path": "/v1/models"}))
    asyncio.run(run(asgi.ApiKeyAuth(app, KEY, ("/v1/",)), scope | {"path": "/other"}))
    asyncio.run(run(asgi.CheapPath(app, "/health"), {k: v for k, v in scope.items() if k != "state"}))  # no guard
    assert calls == ["health", "health", "unauthorized"]


def test_the_limiter_is_a_token_bucket_per_address():
    now = [0.0]
    lim = CheapLimiter(rate=10.0, burst=20.0, clock=lambda: now[0])
    for _ in range(20):
        lim.charge("a", "health")
    assert lim.wait("a") == (0.0, "health") and lim.wait("b") == (0.0, "")
    for _ in range(5):
        lim.charge("a", "unauthorized")
    assert lim.wait("a") == (pytest.approx(0.5), "unauthorized")
    now[0] = 0.5
    assert lim.wait("a")[0] == 0.0
    for i in range(5000):  # a bucket is full again 0.1 s after its charge: dropped once there are many
        now[0] += 0.01
        lim.charge(f"10.0.{i // 256}.{i % 256}", "health")
    assert len(lim) < 4200


# ---------------------------------------------------------------------------------- configuration
def test_limits_refuse_meaningless_values():
    for bad in (
        {"header_timeout": 0},
        {"header_timeout": float("inf")},
        {"keep_alive_timeout": -1},
        {"body_min_rate": -1},
        {"cheap_request_rate": float("nan")},
        {"max_connections": 0},
        {"max_connections_per_client": 1.5},
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ConnectionLimits(**bad)
    assert ConnectionLimits(body_min_rate=0, cheap_request_rate=0).cheap_request_burst == 0
    assert Guard(ConnectionLimits(cheap_request_rate=0), open_files=1 << 16).limiter is None


def test_max_connections_stays_under_the_open_file_limit():
    assert Guard(ConnectionLimits(max_connections=2048), open_files=1024).max_connections == 1024 - 256
    assert Guard(ConnectionLimits(max_connections=100), open_files=1024).max_connections == 100
    assert connection_budget(300) == 150 and connection_budget(1) == 1


def test_the_counters_are_in_the_servers_metrics():
    guard = Guard(ConnectionLimits(max_connections_per_client=1), open_files=1 << 16)
    assert guard.admit("a") is None and guard.admit("a") == "client_limit"
    guard.throttled["unauthorized"] += 2
    metrics = ServerMetrics()
    metrics.watch_connections(guard)
    text = generate_latest(metrics.registry).decode()
    assert 'kvtier_http_refused_total{reason="client_limit"} 1.0' in text
    assert 'kvtier_http_refused_total{reason="header_timeout"} 0.0' in text
    assert 'kvtier_http_throttled_total{reason="unauthorized"} 2.0' in text
    assert re.search(r"^kvtier_http_connections 1\.0$", text, re.M)
    assert re.search(r"^kvtier_http_connections_limit 2048\.0$", text, re.M)


def test_the_router_runs_under_the_guard_with_its_counters_in_metrics(monkeypatch):
    import httpx
    from starlette.testclient import TestClient

    from kvtier.serve import server

    real = httpx.AsyncClient
    stand_in = httpx.MockTransport(lambda req: httpx.Response(200, json={"status": "ok", "engine": "ok"}))
    monkeypatch.setattr(httpx, "AsyncClient", lambda **kw: real(transport=stand_in, **kw))
    ran: dict = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: ran.update(kw, app=app))
    limits = ConnectionLimits(header_timeout=3, keep_alive_timeout=7, max_connections_per_client=9)
    server.route([], ["http://d.test"], limits=limits, health_interval=60)
    assert ran["http"].guard.limits == limits and ran["timeout_keep_alive"] == 7
    with TestClient(ran["app"]) as c:
        text = c.get("/metrics").text
    assert 'kvtier_http_refused_total{reason="client_limit"} 0.0' in text
    assert "kvtier_http_throttled_total" in text


def test_cli_flags_reach_both_commands_with_their_defaults(capsys):
    from kvtier.cli import build_parser, connection_limits

    ap = build_parser()
    for argv in (["serve", "m"], ["router", "--workers", "http://x"]):
        assert connection_limits(ap.parse_args(argv)) == ConnectionLimits()
        args = ap.parse_args(
            [*argv, "--header-timeout", "2", "--body-min-rate", "0", "--timeout-keep-alive", "3",
             "--max-connections-per-client", "4", "--max-connections", "50", "--cheap-request-rate", "7.5"]
        )  # fmt: skip
        assert connection_limits(args) == ConnectionLimits(2, 0, 3, 4, 50, 7.5)
        for flag, bad in (("--header-timeout", "0"), ("--max-connections", "-2"), ("--cheap-request-rate", "-1"),
                          ("--max-connections-per-client", "x"), ("--timeout-keep-alive", "inf")):  # fmt: skip
            with pytest.raises(SystemExit):
                ap.parse_args([*argv, flag, bad])
            assert flag in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ap.parse_args(["router", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for flag, default in (("--header-timeout", "10"), ("--max-connections", "2048"), ("--cheap-request-rate", "50")):
        assert flag in help_text and f"default {default})" in help_text
    assert DEFAULTS["keep_alive_timeout"] == 5.0
