"""Prefill/decode disaggregation through a real pool (Valkey, Mooncake): `kvtier serve --role
prefill`, `--role decode` and `kvtier router` as processes on 127.0.0.1. Outputs and routed experts
equal a colocated run; a dead pool or a dead P costs a recompute, never a wrong answer."""

from __future__ import annotations

import base64
import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

import kvtier

ENGINE = ["--num-host-blocks", 64, "--max-model-len", 1024, "--served-model-name", "moe"]
D_ONLY = ["--storage-fetch", "always", "--prefetch-policy", "wait_complete"]  # exact hand-off counts
PROMPTS = [f"Customer {i} asks: how do tiered KV caches move blocks between GPU, host and pool? " * (1 + i % 3) for i in range(8)]


@pytest.fixture(scope="module")
def offline(moe_model):
    llm = kvtier.LLM(moe_model, max_model_len=1024)
    yield llm
    llm.close()


def ref(offline, prompt, n=10):
    return offline.generate([prompt], kvtier.SamplingParams(max_tokens=n, return_routed_experts=True))[0]


# Valkey in the default run; Mooncake (its master and a node start in ~30 s on 2 cores) with -m slow
@pytest.fixture(scope="module", params=["valkey", pytest.param("mooncake", marks=pytest.mark.slow)])
def pd(request, procs, moe_model):
    """(pool handle, P, D, D under --pd-on-miss error, router)."""
    pool = request.getfixturevalue("valkey_server" if request.param == "valkey" else "mooncake_launch")
    url = pool.url
    tag = request.param
    p = procs(["serve", moe_model, "--role", "prefill", "--storage", url, *ENGINE], f"{tag}-p")
    d = procs(["serve", moe_model, "--role", "decode", "--storage", url, *ENGINE, *D_ONLY], f"{tag}-d")
    d_err = procs(
        ["serve", moe_model, "--role", "decode", "--storage", url, *ENGINE, *D_ONLY, "--pd-on-miss", "error"], f"{tag}-derr"
    )
    for x in (p, d, d_err):
        x.wait_ready()
    router = procs(["router", "--prefill", p.url, "--decode", d.url, "--health-interval", 0.5], f"{tag}-router").wait_ready()
    return pool, p, d, d_err, router


def metric(proc, name: str, labels: str = "") -> float:
    text = httpx.get(proc.url + "/metrics").text
    m = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def completion(url: str, prompt: str, stream: bool, n: int = 10, on_first=None, **extra) -> dict:
    """``on_first``: called when a stream's first chunk arrives."""
    body = {
        "model": "moe",
        "prompt": prompt,
        "max_tokens": n,
        "temperature": 0,
        "return_routed_experts": True,
        "stream": stream,
        **extra,
    }
    if not stream:
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0] | {"usage": r.json()["usage"]}
    text, last = "", None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                c = json.loads(line[6:])
                assert "error" not in c, c
                if last is None and on_first is not None:
                    on_first()
                text += c["choices"][0]["text"]
                last = c["choices"][0]
    assert last is not None, "the stream had no chunk"
    return last | {"text": text}


def experts(choice: dict) -> np.ndarray:
    r = choice["routed_experts"]
    return np.frombuffer(base64.b64decode(r["data"]), dtype=r["dtype"]).reshape(r["shape"])


def test_pd_outputs_and_routed_experts_equal_colocated(pd, offline):
    pool, p, d, d_err, router = pd
    ok0 = metric(d, "kvtier_pd_handoffs_total", '{result="ok"}')
    for i, prompt in enumerate(PROMPTS[:4]):
        want = ref(offline, prompt)
        got = completion(router.url, prompt, stream=bool(i % 2))
        assert got["text"] == want.text and got["finish_reason"] == "length"
        np.testing.assert_array_equal(experts(got), want.routed_experts)
        if "usage" in got:  # D's: it computed none of the prompt, P's hits are apart
            u = got["usage"]
            assert u["prompt_tokens_details"]["cached_tokens"] == u["prompt_tokens"] == len(want.prompt_token_ids)
            assert sum(u["kvtier"]["cached_tokens_by_tier"].values()) == u["prompt_tokens"]
            assert set(u["kvtier"]["prefill"]) == {"cached_tokens", "cached_tokens_by_tier"}
    assert metric(d, "kvtier_pd_handoffs_total", '{result="ok"}') - ok0 == 4  # every prompt token loaded
    assert metric(p, "kvtier_pd_export_seconds_count", "") >= 4  # P's wait for the pool, per prompt
    assert metric(router, "kvtier_router_requests_total", '{route="pd"}') >= 4
    # chat through the openai client, streamed across the hand-off
    c = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=120)
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": PROMPTS[1]}]
    tok = offline.tokenizer
    ids = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
    want = ref(offline, ids, 8).text
    streamed = c.chat.completions.create(model="moe", messages=messages, max_tokens=8, temperature=0, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed) == want
    assert (
        c.chat.completions.create(model="moe", messages=messages, max_tokens=8, temperature=0).choices[0].message.content == want
    )


def test_pd_miss_is_recomputed_or_502_under_error(pd, offline):
    pool, p, d, d_err, router = pd
    prompt = PROMPTS[5] + " (a fresh one)"
    r = httpx.post(
        p.url + "/kvtier/prefill/completions",
        timeout=60,
        json={"model": "moe", "prompt": prompt, "max_tokens": 6, "temperature": 0},
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson"), r.text
    res, ack = (json.loads(line) for line in r.text.splitlines())
    m = res["manifest"]  # P's first line: the names, before the pool's ack ...
    assert ack["manifest"]["complete"] and {k: ack["manifest"][k] for k in m} == m  # ... the same names
    handoff = {
        "namespace": m["namespace"],
        "keys": m["keys"],
        "num_tokens": m["num_tokens"],
        "first_token": res["first_token"],
        "prompt_token_ids": res["prompt_token_ids"],
    }
    pool.clear() if hasattr(pool, "clear") else pool.flushall()  # the pool lost them
    want = ref(offline, prompt, 6).text
    r = httpx.post(
        d_err.url + "/v1/completions",
        timeout=60,
        json={"model": "moe", "prompt": prompt, "max_tokens": 6, "temperature": 0, "kvtier_handoff": handoff},
    )
    assert r.status_code == 502 and "missing" in r.json()["error"]["message"], r.text
    assert metric(d_err, "kvtier_pd_handoffs_total", '{result="error"}') == 1
    before = metric(d, "kvtier_pd_handoffs_total", '{result="recomputed"}')
    r = httpx.post(
        d.url + "/v1/completions",
        timeout=60,
        json={"model": "moe", "prompt": prompt, "max_tokens": 6, "temperature": 0, "kvtier_handoff": handoff},
    )
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
    assert metric(d, "kvtier_pd_handoffs_total", '{result="recomputed"}') == before + 1


# what a dead pool costs a request: P could not write (or the router took P down for it, or P
# failed), or D recomputed what P's export left out
POOL_FALLBACKS = ("prefill_write_failed", "prefill_down", "prefill_error", "prefill_timeout")


def test_the_pool_killed_mid_run_costs_a_recompute_not_an_answer(pd, offline):
    """The pool dies while requests are in flight (once one has streamed its first token: an
    event, not a time); they and every later one answer as colocated runs do. Requests are sent
    after the kill until one has paid for the dead pool (each does: it cannot reach it)."""
    pool, p, d, d_err, router = pd
    want = {pr: ref(offline, pr, 12).text for pr in PROMPTS}

    def degraded() -> float:
        return (
            sum(metric(router, "kvtier_router_fallbacks_total", f'{{reason="{r}"}}') for r in POOL_FALLBACKS)
            + metric(router, "kvtier_router_incomplete_exports_total")
            + metric(d, "kvtier_pd_handoffs_total", '{result="recomputed"}')
        )

    def one(i, on_first=None):
        pr = PROMPTS[i % len(PROMPTS)]
        return pr, completion(router.url, pr, stream=bool(i % 2), n=12, on_first=on_first)["text"]

    before = degraded()
    streaming = threading.Event()
    with ThreadPoolExecutor(8) as ex:
        in_flight = [ex.submit(one, i, streaming.set) for i in range(8)]
        assert streaming.wait(300), "no stream started"
        pool.kill() if hasattr(pool, "flushall") else pool.kill_node()  # mid-run: a stream has begun
        results = [f.result() for f in in_flight]
    i = len(results)
    while degraded() == before and i < 32:  # each of these meets the dead pool: the first one does
        results.append(one(i))
        i += 1
    for pr, text in results:
        assert text == want[pr]
    assert degraded() > before, "no request paid for the dead pool"
    # and with the pool still down
    assert completion(router.url, PROMPTS[0] + " later", stream=False)["text"] == ref(offline, PROMPTS[0] + " later").text
    if hasattr(pool, "flushall"):
        pool.start()
    else:
        pool.restart()


def test_a_dead_prefill_server_sends_requests_colocated_to_decode(pd, offline):
    pool, p, d, d_err, router = pd
    p.kill()
    before = metric(router, "kvtier_router_requests_total", '{route="colocated"}')
    for i, prompt in enumerate(PROMPTS[:3]):
        want = ref(offline, prompt)
        got = completion(router.url, prompt, stream=bool(i % 2))
        assert got["text"] == want.text
        np.testing.assert_array_equal(experts(got), want.routed_experts)
    assert metric(router, "kvtier_router_requests_total", '{route="colocated"}') == before + 3


def test_a_prefill_server_writes_with_more_put_threads_than_a_colocated_one(monkeypatch):
    """P's product is its writes to the pool: half its fetch threads put (unless told); any other
    role keeps the engine's default of one put thread, which slows its engine thread least."""
    from kvtier.engine.config import EngineConfig
    from kvtier.serve.server import role_defaults

    monkeypatch.setattr("kvtier.storage.client.default_storage_workers", lambda: 16)

    def puts(role: str, **options) -> int | None:
        return role_defaults(role, EngineConfig(**options)).storage_put_workers

    assert puts("prefill", storage="file:///p") == 8
    assert puts("prefill", storage_workers=4) == 2
    assert puts("prefill", storage_workers=1) == 1
    assert puts("prefill", storage_put_workers=3) == 3
    for role in ("colocated", "decode"):
        assert puts(role, storage="file:///p") is None
