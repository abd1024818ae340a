"""`kvtier serve` through the `openai` client: completions and chat, streaming or not, equal the
offline API on the same engine settings; 16 parallel clients; cached tokens; errors; disconnects
(streaming or not, behind the API key); the body size cap."""

from __future__ import annotations

import base64
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest

import kvtier

KEY = "sekrit"
CTX = 512
PROMPTS = [f"Request {i}: tell me about block {i * 7} of the cache, please." for i in range(16)]


@pytest.fixture(scope="module")
def server(procs, moe_model):
    return procs(
        ["serve", moe_model, "--api-key", KEY, "--max-model-len", CTX, "--served-model-name", "moe"], "serve"
    ).wait_ready()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def ref(offline, prompt, max_tokens=12, **kw):
    return offline.generate([prompt], kvtier.SamplingParams(max_tokens=max_tokens, **kw))[0]


def chat_ids(offline, messages):
    tok = offline.tokenizer
    return tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False)


def test_completion_equals_offline_streamed_or_not(client, offline):
    want = ref(offline, PROMPTS[0])
    r = client.completions.create(model="moe", prompt=PROMPTS[0], max_tokens=12, temperature=0)
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(want.prompt_token_ids) and r.usage.completion_tokens == 12
    pieces = [
        c.choices[0].text
        for c in client.completions.create(model="moe", prompt=PROMPTS[0], max_tokens=12, temperature=0, stream=True)
    ]
    assert "".join(pieces) == want.text and len(pieces) > 2
    ids = client.completions.create(model="moe", prompt=want.prompt_token_ids, max_tokens=12, temperature=0)
    assert ids.choices[0].text == want.text


def test_chat_equals_offline_streamed_or_not(client, offline):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is a KV cache?"}]
    want = ref(offline, chat_ids(offline, messages), max_tokens=10)
    r = client.chat.completions.create(model="moe", messages=messages, max_tokens=10, temperature=0)
    assert r.choices[0].message.content == want.text and r.choices[0].message.role == "assistant"
    chunks = list(
        client.chat.completions.create(
            model="moe", messages=messages, max_tokens=10, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-2].choices[0].finish_reason == "length"


def test_sixteen_parallel_clients_are_answered_as_offline(client, offline, server):
    want = [ref(offline, p, max_tokens=16).text for p in PROMPTS]

    def one(i):
        c = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        if i % 2:
            return "".join(
                ch.choices[0].text
                for ch in c.completions.create(model="moe", prompt=PROMPTS[i], max_tokens=16, temperature=0, stream=True)
            )
        return c.completions.create(model="moe", prompt=PROMPTS[i], max_tokens=16, temperature=0).choices[0].text

    with ThreadPoolExecutor(16) as ex:
        got = list(ex.map(one, range(16)))
    assert got == want


def test_a_repeat_reports_cached_tokens(client):
    prompt = "A long shared system prompt that fills several KV blocks. " * 4
    first = client.completions.create(model="moe", prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model="moe", prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    n = first.usage.prompt_tokens
    assert again.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16 > 0
    assert again.choices[0].text == first.choices[0].text


def test_routed_experts_equal_offline(client, offline):
    want = ref(offline, PROMPTS[3], max_tokens=5, return_routed_experts=True)
    r = client.completions.create(
        model="moe", prompt=PROMPTS[3], max_tokens=5, temperature=0, extra_body={"return_routed_experts": True}
    )
    re_ = r.choices[0].model_extra["routed_experts"]
    got = np.frombuffer(base64.b64decode(re_["data"]), dtype=re_["dtype"]).reshape(re_["shape"])
    np.testing.assert_array_equal(got, want.routed_experts)


def test_stop_strings_and_extra_fields(client, offline):
    want = ref(offline, PROMPTS[5], max_tokens=20, ignore_eos=True).text
    stop = want[5:7]
    r = client.completions.create(
        model="moe",
        prompt=PROMPTS[5],
        max_tokens=20,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True, "top_k": 1, "cache_salt": "tenant-a"},
    )
    assert r.choices[0].text == want[: want.index(stop)] and r.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(model="moe", prompt=PROMPTS[5], max_tokens=20, temperature=0, stop=stop, stream=True)
    )
    assert streamed == want[: want.index(stop)]


@pytest.mark.parametrize(
    "kw,status,param",
    [
        ({"max_tokens": 0}, 400, "max_tokens"),
        ({"temperature": -1}, 400, "temperature"),
        ({"n": 129}, 400, "n"),
        ({"logprobs": 21}, 400, "logprobs"),
        ({"best_of": 3}, 400, "best_of"),
        ({"prompt": "x" * (CTX + 10)}, 400, "max_tokens"),
        ({"prompt": [10**9]}, 400, None),
        ({"model": "nope"}, 404, "model"),
        ({"bogus_field": 1}, 400, "bogus_field"),
    ],
)
def test_bad_requests_get_a_4xx_naming_the_problem(server, kw, status, param):
    body = {"model": "moe", "prompt": "hi", "max_tokens": 4, **kw}
    r = httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    if param is not None:
        assert param in err["message"]
    else:
        assert "token id" in err["message"]


def test_api_key_and_chat_without_template(server, procs, checkpoint):
    r = httpx.post(server.url + "/v1/completions", json={"model": "moe", "prompt": "hi"})
    assert r.status_code == 401
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert httpx.get(server.url + "/health").status_code == 200  # health needs no key


def generated(server) -> float:
    m = re.search(r"^kvtier_generation_tokens_total (\S+)", httpx.get(server.url + "/metrics").text, re.M)
    assert m, "no kvtier_generation_tokens_total in /metrics"
    return float(m.group(1))


def test_a_client_that_disconnects_frees_its_request(server, client):
    before = generated(server)
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"model": "moe", "prompt": "go on", "max_tokens": 400, "ignore_eos": True, "temperature": 0, "stream": True},
        timeout=60,
    ) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
    deadline = time.monotonic() + 60  # (only a request that is never aborted runs into it)
    while time.monotonic() < deadline:
        m = httpx.get(server.url + "/metrics").text
        if re.search(r"^kvtier_requests_running 0\.0$", m, re.M):
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the disconnected request is still running")
    assert generated(server) - before < 400  # aborted: it never finished its 400 tokens
    assert client.completions.create(model="moe", prompt="still alive?", max_tokens=2).usage.completion_tokens == 2


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == ["moe"]
    m = httpx.get(server.url + "/metrics").text
    for name in (
        "kvtier_prompt_tokens_total",
        "kvtier_generation_tokens_total",
        "kvtier_cached_tokens_total",
        "kvtier_bytes_moved_total",
        "kvtier_evictions_total",
        "kvtier_storage_failures_total",
        "kvtier_requests_running",
        "kvtier_requests_waiting",
        "kvtier_time_to_first_token_seconds_bucket",
        "kvtier_inter_token_latency_seconds_bucket",
        "kvtier_pd_handoffs_total",
    ):
        assert re.search(rf"^{name}", m, re.M), name
    assert generated(server) > 0


def metric(server, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", httpx.get(server.url + "/metrics").text, re.M)
    return float(m.group(1)) if m else 0.0


def wait_idle(server, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while metric(server, "kvtier_requests_running") or metric(server, "kvtier_requests_waiting"):
        if time.monotonic() > deadline:
            raise AssertionError("a request is still in the engine")
        time.sleep(0.1)


def test_a_non_streaming_client_that_disconnects_behind_the_api_key_is_aborted(server):
    """The key check is a pure ASGI layer: the endpoint still sees the client hang up."""
    aborted = 'kvtier_requests_total{finish_reason="abort"}'
    before, gen_before = metric(server, aborted), generated(server)
    n = CTX - 8
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            server.url + "/v1/completions",
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=0.3,
            json={"model": "moe", "prompt": "go", "max_tokens": n, "ignore_eos": True, "temperature": 0},
        )
    wait_idle(server)
    assert metric(server, aborted) == before + 1
    assert 0 < generated(server) - gen_before < n  # its tokens so far are counted, and it never finished


def test_a_client_that_hangs_up_on_the_router_is_aborted_on_the_server(server, procs):
    """Behind `kvtier router` (with keys of its own and for its backend) the hang-up reaches the
    server: the router's call is cancelled, its connection closed, the request aborted."""
    router = procs(
        ["router", "--decode", server.url, "--api-key", "router-key", "--backend-api-key", KEY], "router-hangup"
    ).wait_ready(60)
    aborted = 'kvtier_requests_total{finish_reason="abort"}'
    before = metric(server, aborted)
    n = CTX - 8
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            router.url + "/v1/completions",
            headers={"Authorization": "Bearer router-key"},
            timeout=0.5,
            json={"model": "moe", "prompt": "go", "max_tokens": n, "ignore_eos": True, "temperature": 0},
        )
    wait_idle(server)
    assert metric(server, aborted) == before + 1


def raw_post(server, head: list[str], chunks: list[bytes]) -> bytes:
    """POST /v1/completions over a bare socket: what an HTTP client library would not send."""
    import socket

    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        lines = [
            "POST /v1/completions HTTP/1.1",
            "Host: x",
            f"Authorization: Bearer {KEY}",
            "Content-Type: application/json",
            *head,
        ]
        s.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        try:
            for c in chunks:
                s.sendall(c)
        except (BrokenPipeError, ConnectionResetError):  # the server answered before reading it all
            pass
        out = b""
        while not out.endswith(b"}") and (b := s.recv(65536)):
            out += b
        return out


CAP = 16 * 1024 * 1024  # the default --max-body-bytes


def test_a_content_length_over_the_cap_is_413_before_the_body_with_expect_continue(server):
    """The client announces a body over the cap and waits for "100 Continue" before sending any
    of it: the server answers 413 at once. One that waited for the body (or sent "100 Continue")
    would leave the socket silent: its 30 s timeout fails the test as a hang."""
    try:
        answer = raw_post(server, [f"Content-Length: {CAP + 1}", "Expect: 100-continue"], [])
    except TimeoutError:
        pytest.fail("no answer without the body: the server waits for a body the client never sends")
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b'"param":null' in answer and b"--max-body-bytes" in answer


def test_a_client_that_sends_an_oversized_body_reads_the_413(server):
    """httpx (like the openai client) sends the whole body before it reads: the server reads and
    drops it, unparsed, so the client sees the 413 instead of a connection reset."""
    body = b'{"model": "moe", "prompt": "' + b"a" * (CAP + 10) + b'"}'
    r = httpx.post(
        server.url + "/v1/completions",
        content=body,
        timeout=60,
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    assert r.status_code == 413 and "--max-body-bytes" in r.json()["error"]["message"]


@pytest.mark.slow  # (a server or processes of its own: CI runs it with -m slow)
def test_a_chunked_body_is_413_once_it_passes_the_cap(server):
    mib = 1024 * 1024
    chunks = [b'{"model": "moe", "prompt": "']
    chunks += [b"x" * mib] * (CAP // mib + 1)
    encoded = [f"{len(c):x}\r\n".encode() + c + b"\r\n" for c in chunks]
    answer = raw_post(server, ["Transfer-Encoding: chunked"], encoded)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert httpx.get(server.url + "/health").status_code == 200


def test_stream_clients_that_leave_before_the_first_chunk_are_aborted_cleanly(server):
    """No "aclose(): asynchronous generator is already running" in the log, every request aborted."""
    import socket

    aborted = 'kvtier_requests_total{finish_reason="abort"}'
    before = metric(server, aborted)
    body = json.dumps(
        {"model": "moe", "prompt": "a long prompt to prefill " * 18, "max_tokens": 50, "ignore_eos": True, "stream": True}
    ).encode()
    for _ in range(4):
        with socket.create_connection(("127.0.0.1", server.port)) as s:  # send, then hang up at once
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                + KEY.encode()
                + b"\r\nContent-Type: application/json\r\nContent-Length: "
                + str(len(body)).encode()
                + b"\r\n\r\n"
                + body
            )
        time.sleep(0.5)
    wait_idle(server)
    assert metric(server, aborted) == before + 4
    log = server.log.read_text(errors="replace")
    assert "already running" not in log and "Traceback" not in log, server.tail()
