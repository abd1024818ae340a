"""`kvtier router` on its own: which answers of P go back to the client and which send the request
colocated to D, and the router's own errors in OpenAI's shape. P and D are stand-ins (an
``httpx.MockTransport``) so that each failure can be staged; `test_pd.py` runs real servers."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import threading
import time
from typing import Awaitable, Callable

import httpx
import pytest
from starlette.testclient import TestClient

from kvtier.serve.router import Router

P, D = "http://p.test", "http://d.test"


def openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    return err


class Backends:
    """P and D as the router sees them; ``prefill`` / ``decode`` say how each answers."""

    def __init__(self) -> None:
        self.prefill = lambda req: httpx.Response(500, json={"error": {"message": "unset"}})
        self.decode = lambda req: httpx.Response(200, json={"choices": [{"text": "from D"}]})
        self.calls: list[str] = []
        self.health = {"status": "ok", "engine": "ok"}

    def __call__(self, req: httpx.Request) -> httpx.Response:
        self.calls.append(f"{req.url.host}{req.url.path}")
        if req.url.path == "/health":
            return httpx.Response(200, json=self.health)
        return self.prefill(req) if req.url.host == "p.test" else self.decode(req)


@pytest.fixture
def routed(monkeypatch):
    backends = Backends()
    real = httpx.AsyncClient
    # the router's client (made at startup) talks to the stand-ins instead of the network
    monkeypatch.setattr(httpx, "AsyncClient", lambda **kw: real(transport=httpx.MockTransport(backends), **kw))
    router = Router([P], [D], health_interval=60)
    with TestClient(router.app) as c:
        yield c, router, backends


def fallbacks(c: TestClient) -> float:
    return sum(float(v) for v in re.findall(r"^kvtier_router_fallbacks_total\{.*\} (\S+)$", c.get("/metrics").text, re.M))


BODY = {"model": "moe", "prompt": "hi", "max_tokens": 2}


def test_a_wrong_model_goes_back_to_the_client_not_to_d(routed):
    c, router, backends = routed
    backends.prefill = lambda req: httpx.Response(
        404,
        json={"error": {"message": "model 'nope' is not served here", "type": "not_found_error", "param": "model", "code": 404}},
    )
    err = openai_error(c.post("/v1/completions", json=BODY | {"model": "nope"}), 404)
    assert err["param"] == "model"
    assert fallbacks(c) == 0 and not any(call.startswith("d.test/v1") for call in backends.calls)


@pytest.mark.parametrize("status", [400, 413])
def test_a_validation_error_from_p_goes_back_to_the_client(routed, status):
    c, router, backends = routed
    backends.prefill = lambda req: httpx.Response(
        status,
        json={"error": {"message": "max_tokens: bad", "type": "invalid_request_error", "param": "max_tokens", "code": status}},
    )
    assert openai_error(c.post("/v1/completions", json=BODY), status)["param"] == "max_tokens"
    assert fallbacks(c) == 0


@pytest.mark.parametrize(
    "status,body",
    [
        (404, {"error": {"message": "Not Found", "type": "not_found_error", "param": None, "code": 404}}),
        (401, {"error": {"message": "invalid or missing API key", "type": "authentication_error", "param": None, "code": 401}}),
        (500, {"error": {"message": "internal error", "type": "server_error", "param": None, "code": 500}}),
    ],
)
def test_a_p_problem_runs_the_request_colocated_on_d(routed, status, body):
    c, router, backends = routed
    backends.prefill = lambda req: httpx.Response(status, json=body)
    r = c.post("/v1/completions", json=BODY)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "from D"
    assert fallbacks(c) == 1


def test_invalid_json_is_an_openai_error(routed):
    c, _, _ = routed
    r = c.post("/v1/completions", content=b'{"model": "moe",', headers={"Content-Type": "application/json"})
    err = openai_error(r, 400)
    assert err["param"] is None and err["message"].startswith("the request body is not valid JSON")


def test_the_model_list_comes_from_a_healthy_decode_server(routed):
    c, _, backends = routed
    backends.decode = lambda req: httpx.Response(200, json={"object": "list", "data": [{"id": "moe"}]})
    r = c.get("/v1/models")
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "moe"
    assert "d.test/v1/models" in backends.calls


def test_no_decode_server_up_is_an_openai_503(routed):
    c, router, _ = routed
    router.decode[0].healthy = False
    assert "no decode server" in openai_error(c.post("/v1/completions", json=BODY), 503)["message"]
    assert "no decode server" in openai_error(c.get("/v1/models"), 503)["message"]


def test_a_decode_timeout_is_an_openai_504(routed):
    c, _, backends = routed

    def slow(req):
        raise httpx.ReadTimeout("timed out", request=req)

    backends.decode = slow
    assert "did not answer in time" in openai_error(c.post("/v1/completions", json=BODY), 504)["message"]


def test_a_decode_server_failing_mid_stream_ends_the_stream_with_an_openai_error(routed):
    c, router, backends = routed

    class Dying(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield b'data: {"choices":[{"text":"a"}]}\n\n'
            raise httpx.ReadError("connection reset")

    backends.decode = lambda req: httpx.Response(200, stream=Dying(), headers={"content-type": "text/event-stream"})
    r = c.post("/v1/completions", json=BODY | {"stream": True})
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == 502
    assert [b.inflight for b in router.prefill + router.decode] == [0, 0]  # (the load it counted, given back)


def test_the_load_a_request_puts_on_its_servers_is_given_back_on_every_ending(routed):
    """The tokens in flight the policies read (cache/route.py): counted while P prefills and D
    answers, back to 0 after a streamed answer, a whole one, a P error and a D error."""
    c, router, backends = routed

    class Events(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield b'data: {"choices":[{"text":"a"}]}\n\ndata: [DONE]\n\n'

    assert c.post("/v1/completions", json=BODY).status_code == 200
    backends.decode = lambda req: httpx.Response(200, stream=Events(), headers={"content-type": "text/event-stream"})
    assert c.post("/v1/completions", json=BODY | {"stream": True}).text.endswith("data: [DONE]\n\n")
    backends.decode = lambda req: httpx.Response(500, json={"error": {"message": "boom"}})
    assert c.post("/v1/completions", json=BODY).status_code == 500
    assert c.post("/v1/completions", json=BODY | {"stream": True}).status_code == 500
    assert [b.inflight for b in router.prefill + router.decode] == [0, 0]


def test_an_unknown_route_is_an_openai_404(routed):
    c, _, _ = routed
    openai_error(c.get("/v1/nothing"), 404)


def test_the_router_key_comes_from_the_environment(procs):
    """KVTIER_API_KEY keeps the key off the command line; the router checks it before routing."""
    router = procs(["router", "--decode", "http://127.0.0.1:9"], "router-env", env=dict(os.environ, KVTIER_API_KEY="from-env"))
    deadline = time.monotonic() + 60
    while True:  # no D is up, so /health is 503: wait for the port
        try:
            httpx.get(router.url + "/health", timeout=1)
            break
        except httpx.HTTPError:
            assert time.monotonic() < deadline and router.popen.poll() is None, router.tail()
            time.sleep(0.2)
    openai_error(httpx.post(router.url + "/v1/completions", json=BODY), 401)
    r = httpx.post(router.url + "/v1/completions", json=BODY, headers={"Authorization": "Bearer from-env"})
    openai_error(r, 503)  # past the key: no decode server is up


@pytest.mark.slow  # (a server or processes of its own: CI runs it with -m slow)
@pytest.mark.parametrize(
    "args,env,message",
    [
        (["router", "--decode", "http://127.0.0.1:9", "--port", "99999"], {}, "a port is 1..65535"),
        (["serve", "no-model", "--port", "0"], {}, "a port is 1..65535"),
        (["serve", "no-model", "--api-key", ""], {}, "--api-key is empty"),
        (["router", "--decode", "http://127.0.0.1:9"], {"KVTIER_API_KEY": ""}, "KVTIER_API_KEY is set but empty"),
        (["router", "--decode", "http://127.0.0.1:9", "--backend-api-key", ""], {}, "--backend-api-key is empty"),
    ],
)
def test_bad_ports_and_empty_keys_stop_the_command_with_a_message(args, env, message):
    r = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", *args], capture_output=True, text=True, timeout=60, env=dict(os.environ, **env)
    )
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


HEAD = {
    "chunks": [{"choices": [{"index": 0, "text": "P"}]}],
    "first_token": 5,
    "prompt_token_ids": [1, 2],
    "manifest": {"namespace": "ns", "keys": ["k"], "num_tokens": 2},
    "cached_tokens": 0,
    "cached_tokens_by_tier": {"device": 0, "host": 0, "storage": 0},
    "id": "cmpl-1",
    "created": 1,
}
ACK = {"manifest": {"complete": True, "namespace": "ns", "keys": ["k"], "num_tokens": 2, "failed_blocks": 0}}


HANG_S = 60.0  # what a stand-in waits at most for the test's go-ahead: only a router that hangs runs into it


async def until(go: threading.Event, who: str, log: list[str]) -> None:
    """Wait (without blocking the router's event loop) until ``go`` is set. A stand-in still
    waiting after HANG_S goes on, and ``log`` says so: the order the test checks is then wrong,
    so a router that waits for the wrong thing fails the test instead of hanging it."""
    end = time.monotonic() + HANG_S
    while not go.is_set():
        if time.monotonic() > end:
            log.append(f"{who} gave up waiting")
            return
        await asyncio.sleep(0.01)


def p_answer(ack: dict | None = ACK, head: dict | None = HEAD, before_ack: Callable[[], Awaitable[None]] | None = None):
    """P's two JSON lines (serve/api.py): the first token's at once, the pool's ack once
    ``before_ack`` (awaited) returned (``ack`` None: P breaks off after its first line; ``head``
    None: before it)."""

    class Lines(httpx.AsyncByteStream):
        async def __aiter__(self):
            if head is None:
                raise httpx.ReadError("connection reset")
            yield (json.dumps(head) + "\n").encode()
            if before_ack is not None:
                await before_ack()
            if ack is None:
                raise httpx.ReadError("connection reset")
            yield (json.dumps(ack) + "\n").encode()

    return lambda req: httpx.Response(200, stream=Lines(), headers={"content-type": "application/x-ndjson"})


class DStream(httpx.AsyncByteStream):
    async def __aiter__(self):
        yield b'data: {"choices":[{"index":0,"text":"D"}]}\n\ndata: [DONE]\n\n'


class Events(httpx.AsyncByteStream):
    """An SSE stream of ``events``, then ``[DONE]``."""

    def __init__(self, *events: dict) -> None:
        self.events = events

    async def __aiter__(self):
        for e in self.events:
            yield f"data: {json.dumps(e)}\n\n".encode()
        yield b"data: [DONE]\n\n"


def d_recording(seen: list, stream: bool = True, before: Callable[[], Awaitable[None]] | None = None):
    """D answering (a stream, or a whole answer "from D") once ``before`` (awaited) returned,
    keeping each request body it got."""

    async def d(req):
        seen.append(json.loads(req.content))
        if before is not None:
            await before()
        if not stream:
            return httpx.Response(200, json={"choices": [{"text": "from D"}]})
        return httpx.Response(200, stream=DStream(), headers={"content-type": "text/event-stream"})

    return d


def through(routed, ack, stream: bool, d_mode: str) -> tuple[httpx.Response, list]:
    """A completion through P answering ``ack`` after its first line and a D of ``d_mode``: the
    answer and the request bodies D got."""
    c, router, backends = routed
    backends.prefill = p_answer(ack=ack)
    seen: list = []
    backends.decode = d_recording(seen, stream=stream)
    router.decode[0].info = {"status": "ok", "engine": "ok", "pd_on_miss": d_mode}
    return c.post("/v1/completions", json=BODY | {"stream": stream}), seen


class Timeline:
    """What the client and the stand-ins did, in order (``log``); ``token`` is set once the
    client has P's token."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.token = threading.Event()


def stream_events(c: TestClient, timeline: Timeline | None = None) -> tuple[dict, list]:
    """(first event, the other events) of a streamed completion, noted in ``timeline`` as soon
    as the first event came."""
    with c.stream("POST", "/v1/completions", json=BODY | {"stream": True}) as r:
        events = (line[6:] for line in r.iter_lines() if line.startswith("data: "))
        first = json.loads(next(events))
        if timeline is not None:
            timeline.log.append("client has P's token")
            timeline.token.set()
        rest = list(events)
    return first, rest


def test_a_stream_starts_with_ps_token_before_d_answers_when_d_recomputes(routed):
    """D (which recomputes what it misses) answers only once the client has P's token: the
    stream must not wait for D. A router that waits for D's answer before sending P's token
    holds D until HANG_S, and the log shows D answering first."""
    c, router, backends = routed
    t = Timeline()
    backends.prefill = p_answer()
    seen: list = []

    async def once_the_client_has_the_token() -> None:
        await until(t.token, "D", t.log)
        t.log.append("D answers")

    backends.decode = d_recording(seen, before=once_the_client_has_the_token)
    router.decode[0].info = {"status": "ok", "engine": "ok", "pd_on_miss": "recompute"}  # (its /health)
    first, rest = stream_events(c, t)
    assert first["choices"][0]["text"] == "P" and rest == ['{"choices":[{"index":0,"text":"D"}]}', "[DONE]"]
    assert t.log == ["client has P's token", "D answers"]
    assert seen[0]["kvtier_handoff"]["keys"] == ["k"] and seen[0]["kvtier_handoff"]["first_token"] == 5


def test_a_stream_waits_for_d_before_ps_token_when_d_may_refuse(routed):
    """A D that errors on what it misses may refuse the hand-off (then the request runs
    colocated, and P's token must not have gone out): the client gets P's token only after D
    answered. D takes a moment (0.5 s) so that a router that sent the token first would be
    seen doing so; the order is the observable, not the time."""
    c, router, backends = routed
    t = Timeline()
    backends.prefill = p_answer()
    seen: list = []

    async def after_a_moment() -> None:
        await asyncio.sleep(0.5)
        t.log.append("D answers")

    backends.decode = d_recording(seen, before=after_a_moment)
    router.decode[0].info = {"status": "ok", "engine": "ok", "pd_on_miss": "error"}
    first, rest = stream_events(c, t)
    assert first["choices"][0]["text"] == "P" and rest == ['{"choices":[{"index":0,"text":"D"}]}', "[DONE]"]
    assert t.log == ["D answers", "client has P's token"]
    assert seen[0]["kvtier_handoff"]["keys"] == ["k"] and seen[0]["kvtier_handoff"]["first_token"] == 5


def test_the_first_token_does_not_wait_for_the_pools_ack_and_d_waits_for_it(routed):
    """P acks its blocks only once the client has its first token: the client has the token
    without the ack, and D is called only after the ack (so that D finds the blocks in the pool).
    A router that held the token for the ack makes P wait until HANG_S; one that called D at once
    logs D before the ack."""
    c, router, backends = routed
    t = Timeline()

    async def ack_once_the_client_has_the_token() -> None:
        await until(t.token, "P", t.log)
        t.log.append("P acks")

    backends.prefill = p_answer(before_ack=ack_once_the_client_has_the_token)
    seen: list = []

    async def log_the_call() -> None:
        t.log.append("D called")

    backends.decode = d_recording(seen, before=log_the_call)
    router.decode[0].info = {"status": "ok", "engine": "ok", "pd_on_miss": "recompute"}
    first, rest = stream_events(c, t)
    assert first["choices"][0]["text"] == "P" and rest[-1] == "[DONE]"
    assert t.log == ["client has P's token", "P acks", "D called"]
    assert fallbacks(c) == 0 and incomplete(c) == 0


@pytest.mark.parametrize(
    "ack",
    [
        None,
        {"manifest": dict(ACK["manifest"], complete=False, failed_blocks=1)},
        {"error": {"message": "the export produced no output", "code": 500}},
    ],
    ids=["p-breaks-off", "incomplete", "p-error"],
)
def test_after_an_early_token_a_failed_export_costs_d_a_recompute_not_the_request(routed, ack):
    """The client has P's token already: the request goes on as a hand-off whatever P's export
    did (D, which recomputes what it misses, finds less in the pool), never colocated from scratch
    (which would send the first token twice)."""
    c, router, backends = routed
    backends.prefill = p_answer(ack=ack)
    seen: list = []
    backends.decode = d_recording(seen)
    router.decode[0].info = {"status": "ok", "engine": "ok", "pd_on_miss": "recompute"}
    first, rest = stream_events(c)
    assert first["choices"][0]["text"] == "P" and rest == ['{"choices":[{"index":0,"text":"D"}]}', "[DONE]"]
    assert len(seen) == 1 and seen[0]["kvtier_handoff"]["keys"] == ["k"]
    assert fallbacks(c) == 0 and incomplete(c) == 1


@pytest.mark.parametrize(
    "ack", [None, {"manifest": dict(ACK["manifest"], complete=False, failed_blocks=1)}], ids=["p-breaks-off", "incomplete"]
)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream-d-errors"])
def test_before_any_answer_a_failed_export_runs_the_request_colocated(routed, ack, stream):
    """Nothing went to the client yet (a whole answer, or a stream whose D may refuse): a P that
    could not write every block sends the request colocated to D, without a hand-off."""
    c, _, _ = routed
    r, seen = through(routed, ack, stream, "error")
    assert r.status_code == 200 and ("from D" in r.text if not stream else '"D"' in r.text)
    assert len(seen) == 1 and "kvtier_handoff" not in seen[0]
    assert fallbacks(c) == 1


def test_a_p_that_breaks_off_before_its_first_token_runs_the_request_colocated(routed):
    c, router, backends = routed
    backends.prefill = p_answer(head=None)
    r = c.post("/v1/completions", json=BODY)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "from D"
    assert fallbacks(c) == 1


def test_a_d_error_after_ps_early_token_ends_the_stream_with_an_openai_error(routed):
    c, router, backends = routed
    backends.prefill = p_answer()
    backends.decode = lambda req: httpx.Response(500, json={"error": {"message": "boom"}})
    router.decode[0].info = {"status": "ok", "engine": "ok", "pd_on_miss": "recompute"}
    r = c.post("/v1/completions", json=BODY | {"stream": True})
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[0])["choices"][0]["text"] == "P" and events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == 502 and "answered 500" in err["message"] and "boom" in err["message"]


def incomplete(c: TestClient) -> float:
    m = re.search(r"^kvtier_router_incomplete_exports_total (\S+)$", c.get("/metrics").text, re.M)
    assert m, "no kvtier_router_incomplete_exports_total in /metrics"
    return float(m.group(1))


@pytest.mark.parametrize(
    "ack", [[1, 2], "done", {"manifest": "x"}, {"status": "ok"}], ids=["list", "string", "manifest-not-an-object", "no-manifest"]
)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_second_line_that_is_no_manifest_counts_as_a_failed_export(routed, ack, stream):
    """JSON that is not P's ack: not streamed, the request runs colocated; streamed after P's
    token, D takes the hand-off (and recomputes), the stream ends properly, the metric counts it."""
    c, _, _ = routed
    r, seen = through(routed, ack, stream, "recompute")
    assert r.status_code == 200, r.text
    if stream:
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events == ['{"choices":[{"index":0,"text":"P"}]}', '{"choices":[{"index":0,"text":"D"}]}', "[DONE]"]
        assert "kvtier_handoff" in seen[0] and incomplete(c) == 1 and fallbacks(c) == 0
    else:
        assert r.json()["choices"][0]["text"] == "from D" and "kvtier_handoff" not in seen[0]
        assert fallbacks(c) == 1


def test_a_p_silent_after_its_first_token_is_given_up_after_its_export_timeout(routed, monkeypatch, caplog):
    """P acks within its --export-timeout (its /health says which); one silent past that and
    the margin is hung: the stream goes on through D instead of waiting for the router's timeout.
    This P never acks (until HANG_S): D is called while P is still silent, and the router says
    it gave up on the ack. A router that waits for the ack whatever P's export_timeout (the
    default one is set past HANG_S here) logs P's ack before D; one that never waits for an ack
    does not give up on one."""
    import kvtier.serve.router as router_mod

    monkeypatch.setattr(router_mod, "ACK_MARGIN_S", 0.5)
    monkeypatch.setattr(router_mod, "DEFAULT_EXPORT_TIMEOUT_S", 10 * HANG_S)
    c, router, backends = routed
    t = Timeline()
    never = threading.Event()

    async def never_ack() -> None:
        await until(never, "P", t.log)
        t.log.append("P acks")

    backends.prefill = p_answer(before_ack=never_ack)
    seen: list = []

    async def log_the_call() -> None:
        t.log.append("D called")

    backends.decode = d_recording(seen, before=log_the_call)
    router.prefill[0].info = {"status": "ok", "export_timeout": 0.5}
    router.decode[0].info = {"status": "ok", "engine": "ok", "pd_on_miss": "recompute"}
    first, rest = stream_events(c)
    never.set()  # (P's stand-in ends)
    assert first["choices"][0]["text"] == "P" and rest[-1] == "[DONE]"
    assert t.log == ["D called"]
    assert "did not ack its blocks in time" in caplog.text
    assert "kvtier_handoff" in seen[0] and incomplete(c) == 1


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_d_gets_what_p_found_cached_with_the_hand_off_and_its_answer_goes_back_as_it_is(routed, stream):
    """P's hits travel in the hand-off (D reports them as ``usage.kvtier.prefill``); D's usage,
    its own cached tokens, reaches the client unchanged: the router adds nothing up."""
    c, router, backends = routed
    by_tier = {"device": 16, "host": 0, "storage": 32}
    backends.prefill = p_answer(head=HEAD | {"cached_tokens": 48, "cached_tokens_by_tier": by_tier})
    seen: list = []
    d_usage = {
        "prompt_tokens": 50,
        "prompt_tokens_details": {"cached_tokens": 50},
        "kvtier": {
            "cached_tokens_by_tier": {"device": 0, "host": 0, "storage": 50},
            "prefill": {"cached_tokens": 48, "cached_tokens_by_tier": by_tier},
        },
    }

    async def d(req):
        seen.append(json.loads(req.content))
        if not stream:
            return httpx.Response(200, json={"choices": [{"text": "from D"}], "usage": d_usage})
        return httpx.Response(
            200, stream=Events({"choices": [], "usage": d_usage}), headers={"content-type": "text/event-stream"}
        )

    backends.decode = d
    router.decode[0].info = {"status": "ok", "engine": "ok", "pd_on_miss": "recompute"}
    r = c.post("/v1/completions", json=BODY | {"stream": stream})
    assert seen[0]["kvtier_handoff"]["prefill"] == {"cached_tokens": 48, "cached_tokens_by_tier": by_tier}
    if stream:
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert json.loads(events[-2])["usage"] == d_usage and events[-1] == "[DONE]"
    else:
        assert r.json()["usage"] == d_usage


@pytest.mark.parametrize(
    "cached",
    [
        {"cached_tokens": -1},
        {"cached_tokens": "3"},
        {"cached_tokens": True},
        {"cached_tokens_by_tier": [1]},
        {"cached_tokens_by_tier": {"device": -16}},
        {"cached_tokens_by_tier": {"device": 1.5}},
    ],
    ids=["negative", "string", "bool", "not-a-dict", "negative-tier", "float-tier"],
)
def test_a_first_line_whose_cached_tokens_are_no_counts_is_a_failed_p(routed, cached):
    """D would refuse such a hand-off (a 400 the client did not cause): the request runs colocated."""
    c, router, backends = routed
    backends.prefill = p_answer(head=HEAD | cached)
    seen: list = []
    backends.decode = d_recording(seen, stream=False)
    r = c.post("/v1/completions", json=BODY)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "from D"
    assert len(seen) == 1 and "kvtier_handoff" not in seen[0] and fallbacks(c) == 1


def test_a_pool_given_to_a_router_that_does_not_read_it_is_refused():
    with pytest.raises(ValueError, match="--storage is read by --policy cache_aware only, not round_robin"):
        Router([], [], workers=["http://w.test"], policy="round_robin", storage="memory://")
    Router([], [], workers=["http://w.test"], policy="cache_aware", storage="memory://")  # (accepted)


def test_health_speaks_of_workers_with_workers_and_of_p_and_d_under_pd(monkeypatch):
    backends = Backends()
    real = httpx.AsyncClient
    monkeypatch.setattr(httpx, "AsyncClient", lambda **kw: real(transport=httpx.MockTransport(backends), **kw))
    workers = Router([], [], workers=["http://w.test", "http://v.test"], policy="round_robin", health_interval=60)
    with TestClient(workers.app) as c:
        health = c.get("/health").json()
        assert health == {"status": "ok", "role": "router", "workers_up": ["worker0", "worker1"], "stalled": []}
        for b in workers.decode:
            b.healthy = False
        err = openai_error(c.get("/health"), 503)
        assert err["message"] == "no worker is up"
    with TestClient(Router([P], [D], health_interval=60).app) as c:
        health = c.get("/health").json()
        assert health["decode_up"] == ["decode0"] and health["prefill_up"] == ["prefill0"] and "workers_up" not in health
