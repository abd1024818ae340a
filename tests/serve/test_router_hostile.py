"""`kvtier router` against a bad prefill server (P), a bad /health, and bad client bodies: it must
neither hang nor grow without bound nor answer 500. A P that trickles its answer, sends an endless
line, or JSON nested too deep is a failed P (the request runs colocated on D); a /health that is
not a kvtier server's makes its server unhealthy (or its odd fields default); a client body nested
too deep, with NaN / Infinity or text that is not Unicode is the client's 400.

Each test runs the router's app in-process (``httpx.ASGITransport``, its startup and shutdown run
by hand) under an ``asyncio.wait_for`` far longer than any deadline it sets, so that a router that
hangs fails the test instead of hanging it. P and D are ``httpx.MockTransport`` stand-ins, or for
timing a real socket (httpx's own timeouts apply only there) a small HTTP/1.1 server on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from typing import Any, AsyncIterator, Awaitable, Callable

import httpx
import pytest

import kvtier.serve.router as router_mod
from kvtier.serve.errors import APIError, error_body
from kvtier.serve.router import Router

P, D = "http://p.test", "http://d.test"
BODY = {"model": "moe", "prompt": "hi", "max_tokens": 2}
HEAD: dict[str, Any] = {
    "chunks": [{"choices": [{"index": 0, "text": "P"}]}],
    "first_token": 5,
    "prompt_token_ids": [1, 2],
    "manifest": {"namespace": "ns", "keys": ["k"], "num_tokens": 2},
    "cached_tokens": 0,
    "id": "cmpl-1",
    "created": 1,
}
ACK = {"manifest": {"complete": True, "namespace": "ns", "keys": ["k"], "num_tokens": 2, "failed_blocks": 0}}
HEALTHY = {"status": "ok", "engine": "ok"}
BOUND_S = 60.0  # what a test may take at most; every deadline a test sets is far below it


def line(obj: Any) -> bytes:
    return (json.dumps(obj) + "\n").encode()


def strict(text: str) -> Any:
    """JSON as a strict client reads it: NaN and Infinity are not JSON."""

    def refuse(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


class Stream(httpx.AsyncByteStream):
    def __init__(self, gen: Callable[[], AsyncIterator[bytes]]) -> None:
        self.gen = gen

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for b in self.gen():
            yield b


class Fakes:
    """P and D as ``MockTransport`` handlers. ``p_answer`` makes P's prefill answer; ``p_health``
    and ``d_health`` are what /health answers (an object, or the raw bytes of the body). D answers
    "from D" (an SSE stream when asked to stream) and keeps the bodies it got."""

    def __init__(self) -> None:
        self.p_health: Any = HEALTHY
        self.d_health: Any = HEALTHY | {"pd_on_miss": "recompute"}
        self.p_answer: Callable[[httpx.Request], httpx.Response] = lambda req: ndjson(line(HEAD), line(ACK))
        self.p_calls = 0
        self.d_bodies: list[dict] = []

    @staticmethod
    def _health(h: Any) -> httpx.Response:
        return httpx.Response(200, content=h if isinstance(h, bytes) else json.dumps(h).encode())

    def p(self, req: httpx.Request) -> httpx.Response:
        if req.url.path == "/health":
            return self._health(self.p_health)
        self.p_calls += 1
        return self.p_answer(req)

    def d(self, req: httpx.Request) -> httpx.Response:
        if req.url.path == "/health":
            return self._health(self.d_health)
        body = json.loads(req.content)
        self.d_bodies.append(body)
        if body.get("stream"):
            r = ndjson(b'data: {"choices":[{"index":0,"text":"D"}]}\n\ndata: [DONE]\n\n')
            r.headers["content-type"] = "text/event-stream"
            return r
        return httpx.Response(200, json={"choices": [{"text": "from D"}]})


def ndjson(*parts: bytes) -> httpx.Response:
    """A 200 whose body streams ``parts``."""

    async def gen() -> AsyncIterator[bytes]:
        for b in parts:
            yield b

    return httpx.Response(200, stream=Stream(gen), headers={"content-type": "application/x-ndjson"})


class RawP:
    """P as an HTTP/1.1 server on a real 127.0.0.1 socket: /health answers ``health``; a prefill
    gets the 200 status line and headers, then whatever ``answer(writer)`` writes."""

    def __init__(self, answer: Callable[[asyncio.StreamWriter], Awaitable[None]], health: Any = HEALTHY) -> None:
        self.answer, self.health = answer, health
        self.tasks: set[asyncio.Task] = set()
        self.url = ""

    async def __aenter__(self) -> "RawP":
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.server.close()
        for t in list(self.tasks):
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
                path = head[0].split(" ")[1]
                length = next((int(h.split(":", 1)[1]) for h in head[1:] if h.lower().startswith("content-length:")), 0)
                await reader.readexactly(length)
                if path == "/health":
                    body = json.dumps(self.health).encode()
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body))
                    writer.write(body)
                    await writer.drain()
                    continue
                # no length, no chunking: the answer is whatever comes until the connection closes
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\nconnection: close\r\n\r\n")
                await writer.drain()
                await self.answer(writer)
                return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.tasks.discard(task)
            writer.close()


async def trickle(writer: asyncio.StreamWriter, first: bytes = b"") -> None:
    """``first``, then one byte (a space, never a newline) every 0.2 s for two minutes."""
    writer.write(first)
    for _ in range(600):
        writer.write(b" ")
        await writer.drain()
        await asyncio.sleep(0.2)


@contextlib.asynccontextmanager
async def routed(
    monkeypatch: pytest.MonkeyPatch, fakes: Fakes, prefill: list[str] | None = None, **router_kw: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, Router]]:
    """The router's app, started, in front of ``fakes`` (P at ``prefill``, the stand-in's URL
    unless given) and a client to it."""
    real = httpx.AsyncClient
    mounts = {P: httpx.MockTransport(fakes.p), D: httpx.MockTransport(fakes.d)}
    monkeypatch.setattr(httpx, "AsyncClient", lambda **kw: real(mounts=mounts, **kw))
    router = Router([P] if prefill is None else prefill, [D], **({"health_interval": 60} | router_kw))
    async with router.api.router.lifespan_context(router.api):
        async with real(transport=httpx.ASGITransport(app=router.app), base_url="http://router") as c:
            yield c, router


def bounded(coro: Awaitable[Any]) -> Any:
    """Run ``coro``; a router that hangs fails the test after BOUND_S instead of hanging it."""
    return asyncio.run(asyncio.wait_for(coro, BOUND_S))


async def fallbacks(c: httpx.AsyncClient) -> dict[str, float]:
    text = (await c.get("/metrics")).text
    return {k: float(v) for k, v in re.findall(r'^kvtier_router_fallbacks_total\{reason="(\w+)"\} (\S+)$', text, re.M)}


async def incomplete(c: httpx.AsyncClient) -> float:
    m = re.search(r"^kvtier_router_incomplete_exports_total (\S+)$", (await c.get("/metrics")).text, re.M)
    assert m is not None
    return float(m.group(1))


def events(r: httpx.Response) -> list[str]:
    return [x[6:] for x in r.text.splitlines() if x.startswith("data: ")]


def openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = strict(r.text)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    return err


def assert_colocated(r: httpx.Response, fakes: Fakes, stream: bool) -> None:
    """The client got D's own answer to the request, no hand-off in it."""
    assert r.status_code == 200, r.text
    if stream:
        assert [strict(e) if e != "[DONE]" else e for e in events(r)] == [
            {"choices": [{"index": 0, "text": "D"}]},
            "[DONE]",
        ]
    else:
        assert strict(r.text)["choices"][0]["text"] == "from D"
    assert len(fakes.d_bodies) == 1 and "kvtier_handoff" not in fakes.d_bodies[0]


# ---------------------------------------------------------------------------------- deadlines
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_p_that_trickles_its_first_line_is_given_up_at_the_deadline(monkeypatch, stream):
    """A P that answers 200 and then one byte every 0.2 s never trips httpx's per-read timeout
    (1 s here): the router's deadline for P's first line (--timeout) does, and the request runs
    colocated on D. The P is marked down, as a P that times out is."""
    fakes = Fakes()

    async def main() -> None:
        async with RawP(trickle) as p, routed(monkeypatch, fakes, [p.url], timeout=1.0) as (c, router):
            assert router.prefill[0].healthy
            r = await c.post("/v1/completions", json=BODY | {"stream": stream})
            assert_colocated(r, fakes, stream)
            assert await fallbacks(c) == {"prefill_timeout": 1.0}
            assert not router.prefill[0].healthy

    bounded(main())


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_p_that_trickles_its_ack_is_given_up_at_the_hand_offs_deadline(monkeypatch, stream):
    """P's first line comes at once, then its ack line trickles. P's /health gives it 1000 s to
    ack, but the whole hand-off has --timeout (1 s here): past it the export counts as broken off
    (not streamed: the request runs colocated; streamed after P's token: D takes the hand-off and
    recomputes what it misses)."""
    fakes = Fakes()

    async def answer(writer: asyncio.StreamWriter) -> None:
        await trickle(writer, first=line(HEAD))

    async def main() -> None:
        async with RawP(answer, HEALTHY | {"export_timeout": 1000}) as p:
            async with routed(monkeypatch, fakes, [p.url], timeout=1.0) as (c, router):
                r = await c.post("/v1/completions", json=BODY | {"stream": stream})
                assert r.status_code == 200, r.text
                if stream:
                    assert events(r) == ['{"choices":[{"index":0,"text":"P"}]}', '{"choices":[{"index":0,"text":"D"}]}', "[DONE]"]
                    assert fakes.d_bodies[0]["kvtier_handoff"]["keys"] == ["k"]
                    assert await incomplete(c) == 1 and await fallbacks(c) == {}
                else:
                    assert_colocated(r, fakes, stream)
                    assert await fallbacks(c) == {"prefill_write_failed": 1.0}

    bounded(main())


# ---------------------------------------------------------------------------------- line cap
@pytest.mark.parametrize("where", ["first-line", "ack-line"])
def test_an_endless_line_from_p_is_cut_at_the_cap(monkeypatch, where):
    """P streams 16 MiB without a newline: the router reads no more than its line cap (256 KiB
    here) and one chunk past it, and treats the answer as malformed."""
    cap, chunk = 256 * 1024, 64 * 1024
    monkeypatch.setattr(router_mod, "MAX_PREFILL_LINE_BYTES", cap, raising=False)
    fakes = Fakes()
    sent = [0]

    async def endless() -> AsyncIterator[bytes]:
        if where == "ack-line":
            yield line(HEAD)
        for _ in range(16 * 1024 * 1024 // chunk):
            sent[0] += chunk
            yield b"x" * chunk

    fakes.p_answer = lambda req: httpx.Response(200, stream=Stream(endless))

    async def main() -> None:
        async with routed(monkeypatch, fakes) as (c, router):
            r = await c.post("/v1/completions", json=BODY)
            assert_colocated(r, fakes, False)
            assert await fallbacks(c) == {"prefill_error" if where == "first-line" else "prefill_write_failed": 1.0}

    bounded(main())
    assert sent[0] <= cap + 2 * chunk, f"the router read {sent[0]} bytes of one line"


# ---------------------------------------------------------------------------------- P's JSON
DEEP = b"[" * 200_000


def nest(levels: int) -> list:
    x: list = []
    for _ in range(levels - 1):
        x = [x]
    return x


@pytest.mark.parametrize(
    "answer",
    [
        lambda req: ndjson(DEEP + b"\n"),
        lambda req: ndjson(DEEP),
        lambda req: ndjson(line(HEAD | {"chunks": [{"x": nest(70)}]}), line(ACK)),
        lambda req: ndjson(line(HEAD).replace(b'"text": "P"', b'"text": "P", "logprob": NaN'), line(ACK)),
        lambda req: ndjson(line(HEAD).replace(b'"first_token": 5', b'"first_token": 1e999'), line(ACK)),
        lambda req: ndjson(line(HEAD | {"first_token": "5"}), line(ACK)),
        lambda req: ndjson(line(HEAD | {"manifest": HEAD["manifest"] | {"keys": "k"}}), line(ACK)),
        lambda req: httpx.Response(404, content=DEEP),
        lambda req: httpx.Response(500, content=b'{"error": ' * 100_000),
    ],
    ids=[
        "deep-first-line",
        "deep-no-newline",
        "over-64-levels",
        "nan-in-chunks",
        "infinity",
        "token-a-string",
        "keys-a-string",
        "deep-404",
        "deep-500",
    ],
)
def test_malformed_json_from_p_runs_the_request_colocated(monkeypatch, answer):
    """JSON nested deeper than the cap (or NaN / Infinity, which no client could read, or a
    hand-off field of the wrong type) in P's answer is a malformed answer: the request runs
    colocated, never a 500, and nothing of P's answer reaches the client."""
    fakes = Fakes()
    fakes.p_answer = answer

    async def main() -> None:
        async with routed(monkeypatch, fakes) as (c, _):
            for stream in (False, True):
                fakes.d_bodies.clear()
                r = await c.post("/v1/completions", json=BODY | {"stream": stream})
                assert_colocated(r, fakes, stream)
            assert sum((await fallbacks(c)).values()) == 2

    bounded(main())


@pytest.mark.parametrize("ack", [DEEP + b"\n", b'{"manifest": {"complete": true, "seconds": NaN}}\n'], ids=["deep", "nan"])
def test_a_malformed_ack_line_is_a_failed_export(monkeypatch, ack):
    fakes = Fakes()
    fakes.p_answer = lambda req: ndjson(line(HEAD), ack)

    async def main() -> None:
        async with routed(monkeypatch, fakes) as (c, _):
            r = await c.post("/v1/completions", json=BODY)
            assert_colocated(r, fakes, False)
            assert await fallbacks(c) == {"prefill_write_failed": 1.0}

    bounded(main())


# ---------------------------------------------------------------------------------- /health
@pytest.mark.parametrize(
    "health",
    [[], "ok", None, [1, 2], DEEP, b'{"status": "ok", "pad": "' + b"x" * (2 * 1024 * 1024) + b'"}'],
    ids=["list", "string", "null", "list2", "deep", "over-the-size-cap"],
)
def test_a_p_whose_health_is_no_object_is_down(monkeypatch, health):
    fakes = Fakes()
    fakes.p_health = health

    async def main() -> None:
        async with routed(monkeypatch, fakes) as (c, router):
            assert not router.prefill[0].healthy
            for stream in (False, True):
                fakes.d_bodies.clear()
                assert_colocated(await c.post("/v1/completions", json=BODY | {"stream": stream}), fakes, stream)
            assert await fallbacks(c) == {"no_prefill_server": 2.0} and fakes.p_calls == 0

    bounded(main())


@pytest.mark.parametrize(
    "export_timeout",
    ['"abc"', "NaN", "Infinity", "-1", "0", "true", "[]", "{}", "1e999"],
)
def test_a_bad_export_timeout_in_ps_health_gets_the_default_and_a_warning(monkeypatch, caplog, export_timeout):
    """P's export_timeout must be a finite positive number; anything else is replaced by the
    default (with a warning naming it), and the hand-off goes on."""
    fakes = Fakes()
    fakes.p_health = b'{"status": "ok", "engine": "ok", "export_timeout": %s}' % export_timeout.encode()

    async def main() -> None:
        with caplog.at_level(logging.WARNING, logger="kvtier.serve.router"):
            async with routed(monkeypatch, fakes) as (c, router):
                assert router.prefill[0].healthy
                for stream in (False, True):
                    r = await c.post("/v1/completions", json=BODY | {"stream": stream})
                    assert r.status_code == 200, r.text
                assert [b.get("kvtier_handoff", {}).get("keys") for b in fakes.d_bodies] == [["k"], ["k"]]
                assert await fallbacks(c) == {}

    bounded(main())
    warned = [r.getMessage() for r in caplog.records if "export_timeout" in r.getMessage()]
    assert warned and str(router_mod.DEFAULT_EXPORT_TIMEOUT_S) in warned[0], caplog.text


@pytest.mark.parametrize("health", [[], "ok", DEEP], ids=["list", "string", "deep"])
def test_a_d_whose_health_is_no_object_is_down(monkeypatch, health):
    """The router still starts (and its health checks go on); with its only D down, requests are
    a 503 in OpenAI's shape, never a 500."""
    fakes = Fakes()
    fakes.d_health = health

    async def main() -> None:
        async with routed(monkeypatch, fakes, health_interval=0.05) as (c, router):
            assert not router.decode[0].healthy  # (checked again every 0.05 s: still down)
            for stream in (False, True):
                err = openai_error(await c.post("/v1/completions", json=BODY | {"stream": stream}), 503)
                assert "no decode server" in err["message"]
            openai_error(await c.get("/health"), 503)
            fakes.d_health = HEALTHY  # the next check brings it back
            while not router.decode[0].healthy:  # (a router that never checks again: past BOUND_S)
                await asyncio.sleep(0.01)
            assert (await c.post("/v1/completions", json=BODY)).status_code == 200

    bounded(main())


def test_an_unknown_pd_on_miss_in_ds_health_is_not_taken_for_recompute(monkeypatch, caplog):
    """Only ``recompute`` lets a stream start before P's ack; any other value is warned about and
    the stream waits for the ack (a failed export then runs colocated)."""
    fakes = Fakes()
    fakes.d_health = HEALTHY | {"pd_on_miss": 5}
    fakes.p_answer = lambda req: ndjson(line(HEAD), line({"manifest": ACK["manifest"] | {"complete": False}}))

    async def main() -> None:
        with caplog.at_level(logging.WARNING, logger="kvtier.serve.router"):
            async with routed(monkeypatch, fakes) as (c, _):
                assert_colocated(await c.post("/v1/completions", json=BODY | {"stream": True}), fakes, True)

    bounded(main())
    assert any("pd_on_miss" in r.getMessage() for r in caplog.records), caplog.text


# ---------------------------------------------------------------------------------- the client's body
@pytest.mark.parametrize(
    "raw,param,words",
    [
        (b'{"model": "moe", "prompt": "hi", "temperature": NaN}', "temperature", "temperature must be a finite number, got NaN"),
        (b'{"prompt": "hi", "temperature": Infinity}', "temperature", "got Infinity"),
        (b'{"prompt": "hi", "top_p": -Infinity}', "top_p", "got -Infinity"),
        (b'{"prompt": "hi", "temperature": 1e999}', "temperature", "got Infinity"),
        (b'{"prompt": "hi", "logit_bias": {"50": NaN}}', "logit_bias.50", "logit_bias.50 must be a finite number"),
        (b'{"messages": [{"role": "user", "content": [1, NaN]}]}', "messages.0.content.1", "finite number"),
        (b'{"prompt": "\\ud800"}', "prompt", "not valid Unicode"),
        (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None, "nested too deep"),
        (b'{"prompt": ' + b"[" * 100_000, None, "nested too deep"),
        (b"[" * 100_000, None, "nested too deep"),
        (b'{"prompt": ' + b"[" * 65 + b"1" + b"]" * 65 + b"}", None, "nested too deep"),
        (b'{"prompt": 1' + b"0" * 5000 + b"}", None, "not valid JSON"),
    ],
    ids=["nan", "inf", "-inf", "overflow", "nested-nan", "list-nan", "surrogate", "deep", "deep-open", "deep-array", "65", "int"],
)
def test_a_bad_client_body_is_a_400_naming_the_problem(monkeypatch, raw, param, words):
    fakes = Fakes()

    async def main() -> None:
        async with routed(monkeypatch, fakes) as (c, _):
            for path in ("/v1/completions", "/v1/chat/completions"):
                r = await c.post(path, content=raw, headers={"content-type": "application/json"})
                err = openai_error(r, 400)
                assert words in err["message"] and err["param"] == param and err["type"] == "invalid_request_error"
            assert fakes.p_calls == 0 and fakes.d_bodies == []

    bounded(main())


def test_deep_strings_and_64_levels_are_fine(monkeypatch):
    """Brackets inside strings are text, not nesting; 64 levels is within the cap."""
    fakes = Fakes()
    body = BODY | {"prompt": "[" * 100_000 + '\\"{' * 1000, "extra": json.loads("[" * 63 + "]" * 63)}

    async def main() -> None:
        async with routed(monkeypatch, fakes) as (c, _):
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert fakes.d_bodies[0]["prompt"] == body["prompt"] and fakes.d_bodies[0]["kvtier_handoff"]["keys"] == ["k"]

    bounded(main())


# ---------------------------------------------------------------------------------- error types
def test_a_wrong_method_is_an_invalid_request_error(monkeypatch):
    fakes = Fakes()

    async def main() -> None:
        async with routed(monkeypatch, fakes) as (c, _):
            for path in ("/v1/completions", "/v1/chat/completions"):
                assert openai_error(await c.get(path), 405)["type"] == "invalid_request_error"
            assert openai_error(await c.post("/v1/models"), 405)["type"] == "invalid_request_error"

    bounded(main())


@pytest.mark.parametrize(
    "status,type_",
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (404, "not_found_error"),
        (405, "invalid_request_error"),
        (409, "invalid_request_error"),
        (413, "request_too_large"),
        (422, "invalid_request_error"),
        (499, "invalid_request_error"),
        (500, "server_error"),
        (501, "server_error"),
        (502, "bad_gateway"),
        (503, "overloaded_error"),
        (504, "timeout"),
    ],
)
def test_an_errors_type_follows_its_status(status, type_):
    """Every 4xx is the client's (invalid_request_error unless a narrower type fits), every 5xx
    without a type of its own a server_error."""
    assert APIError(status, "x").type == type_
    assert error_body(status, "x")["error"]["type"] == type_
