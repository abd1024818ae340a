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
import time

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
    return sum(float(v) for v in re.findall(r"^kvtier_router_fallbacks_total\{.*\} (\S+)$",
                                            c.get("/metrics").text, re.M))


BODY = {"model": "moe", "prompt": "hi", "max_tokens": 2}


def test_a_wrong_model_goes_back_to_the_client_not_to_d(routed):
    c, router, backends = routed
    backends.prefill = lambda req: httpx.Response(404, json={"error": {
        "message": "model 'nope' is not served here", "type": "not_found_error", "param": "model", "code": 404}})
    err = openai_error(c.post("/v1/completions", json=BODY | {"model": "nope"}), 404)
    assert err["param"] == "model"
    assert fallbacks(c) == 0 and not any(call.startswith("d.test/v1") for call in backends.calls)


@pytest.mark.parametrize("status", [400, 413])
def test_a_validation_error_from_p_goes_back_to_the_client(routed, status):
    c, router, backends = routed
    backends.prefill = lambda req: httpx.Response(status, json={"error": {
        "message": "max_tokens: bad", "type": "invalid_request_error", "param": "max_tokens", "code": status}})
    assert openai_error(c.post("/v1/completions", json=BODY), status)["param"] == "max_tokens"
    assert fallbacks(c) == 0


@pytest.mark.parametrize("status,body", [
    (404, {"error": {"message": "Not Found", "type": "not_found_error", "param": None, "code": 404}}),
    (401, {"error": {"message": "invalid or missing API key", "type": "authentication_error", "param": None,
                     "code": 401}}),
    (500, {"error": {"message": "internal error", "type": "server_error", "param": None, "code": 500}}),
])
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
    c, _, backends = routed

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


def test_an_unknown_route_is_an_openai_404(routed):
    c, _, _ = routed
    openai_error(c.get("/v1/nothing"), 404)


def test_the_router_key_comes_from_the_environment(procs):
    """KVTIER_API_KEY keeps the key off the command line; the router checks it before routing."""
    router = procs(["router", "--decode", "http://127.0.0.1:9"], "router-env",
                   env=dict(os.environ, KVTIER_API_KEY="from-env"))
    deadline = time.monotonic() + 60
    while True:                                # no D is up, so /health is 503: wait for the port
        try:
            httpx.get(router.url + "/health", timeout=1)
            break
        except httpx.HTTPError:
            assert time.monotonic() < deadline and router.popen.poll() is None, router.tail()
            time.sleep(0.2)
    openai_error(httpx.post(router.url + "/v1/completions", json=BODY), 401)
    r = httpx.post(router.url + "/v1/completions", json=BODY, headers={"Authorization": "Bearer from-env"})
    openai_error(r, 503)                       # past the key: no decode server is up


@pytest.mark.parametrize("args,env,message", [
    (["router", "--decode", "http://127.0.0.1:9", "--port", "99999"], {}, "a port is 1..65535"),
    (["serve", "no-model", "--port", "0"], {}, "a port is 1..65535"),
    (["serve", "no-model", "--api-key", ""], {}, "--api-key is empty"),
    (["router", "--decode", "http://127.0.0.1:9"], {"KVTIER_API_KEY": ""}, "KVTIER_API_KEY is set but empty"),
    (["router", "--decode", "http://127.0.0.1:9", "--backend-api-key", ""], {}, "--backend-api-key is empty"),
])
def test_bad_ports_and_empty_keys_stop_the_command_with_a_message(args, env, message):
    r = subprocess.run([sys.executable, "-m", "kvtier.cli", *args], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, **env))
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


HANDOFF = {"chunks": [{"choices": [{"index": 0, "text": "P"}]}], "first_token": 5, "prompt_token_ids": [1, 2],
           "manifest": {"complete": True, "namespace": "ns", "keys": ["k"], "num_tokens": 2},
           "cached_tokens": 0, "id": "cmpl-1", "created": 1}


@pytest.mark.parametrize("d_mode", ["recompute", "error"])
def test_a_stream_starts_with_ps_token_before_d_answers_only_when_d_recomputes(routed, d_mode):
    c, router, backends = routed
    backends.prefill = lambda req: httpx.Response(200, json=HANDOFF)

    class Stream(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield b'data: {"choices":[{"index":0,"text":"D"}]}\n\ndata: [DONE]\n\n'

    async def slow_d(req):                      # D answers after 1.5 s
        await asyncio.sleep(1.5)
        return httpx.Response(200, stream=Stream(), headers={"content-type": "text/event-stream"})
    backends.decode = slow_d
    router.decode[0].info = {"status": "ok", "engine": "ok", "pd_on_miss": d_mode}   # (its /health)
    t0 = time.monotonic()
    with c.stream("POST", "/v1/completions", json=BODY | {"stream": True}) as r:
        events = (line[6:] for line in r.iter_lines() if line.startswith("data: "))
        first = json.loads(next(events))
        waited = time.monotonic() - t0
        rest = list(events)
    assert first["choices"][0]["text"] == "P" and rest == ['{"choices":[{"index":0,"text":"D"}]}', "[DONE]"]
    assert (waited < 1.0) if d_mode == "recompute" else (waited >= 1.5), waited


def test_a_d_error_after_ps_early_token_ends_the_stream_with_an_openai_error(routed):
    c, router, backends = routed
    backends.prefill = lambda req: httpx.Response(200, json=HANDOFF)
    backends.decode = lambda req: httpx.Response(500, json={"error": {"message": "boom"}})
    router.decode[0].info = {"status": "ok", "engine": "ok", "pd_on_miss": "recompute"}
    r = c.post("/v1/completions", json=BODY | {"stream": True})
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[0])["choices"][0]["text"] == "P" and events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == 502 and "answered 500" in err["message"] and "boom" in err["message"]
