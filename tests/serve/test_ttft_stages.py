"""TTFT as clients see it: ``kvtier_time_to_first_token_seconds`` counts from a request's arrival
at the server to its first token written, and ``kvtier_request_stage_seconds{stage}`` says where
that time went. A delay injected before the engine (a slow tokenizer) shows in TTFT and in
``parse_and_tokenize``, not in the engine's stages; the stages add up to TTFT (in process:
Starlette's TestClient over the app, one real engine on a thread)."""

from __future__ import annotations

import asyncio
import json
import re
import time

import pytest
from starlette.testclient import TestClient

import kvtier
from kvtier.bench.serving import server_ttft
from kvtier.engine.client import EngineClient
from kvtier.engine.core import EngineCore
from kvtier.engine.wire import EngineOutputs, FirstTokenStages, RequestDelta, decode_message, encode, first_token_stages
from kvtier.serve.api import Server
from kvtier.serve.metrics import STAGES

CTX = 256
DELAY = 0.5  # seconds the tokenizer sleeps: many steps of the tiny model
TTFT = "kvtier_time_to_first_token_seconds"
STAGE = "kvtier_request_stage_seconds"


@pytest.fixture(scope="module")
def server(moe_model):
    engine = EngineClient.in_thread(EngineCore(moe_model, max_model_len=CTX), max_queue=16)
    server = Server(engine, "moe")
    yield server
    server.close()
    engine.shutdown()


@pytest.fixture(scope="module")
def client(server):
    with TestClient(server.app) as c:
        yield c


@pytest.fixture
def slow_tokenizer(server, monkeypatch):
    """Every prompt's tokenization takes DELAY seconds longer."""
    prompts = server.prompts
    completion_ids, chat_ids = prompts.completion_ids, prompts.chat_ids

    async def slow_completion(*args, **kw):
        await asyncio.sleep(DELAY)
        return await completion_ids(*args, **kw)

    async def slow_chat(*args, **kw):
        await asyncio.sleep(DELAY)
        return await chat_ids(*args, **kw)

    monkeypatch.setattr(prompts, "completion_ids", slow_completion)
    monkeypatch.setattr(prompts, "chat_ids", slow_chat)


def scrape(client) -> dict[str, tuple[float, float]]:
    """(sum, count) of TTFT ("ttft") and of each stage (by its name) in /metrics."""
    text = client.get("/metrics").text

    def value(series: str) -> float:
        m = re.search(rf"^{re.escape(series)} (\S+)$", text, re.M)
        assert m, f"no {series} in /metrics"
        return float(m.group(1))

    out = {"ttft": (value(TTFT + "_sum"), value(TTFT + "_count"))}
    for s in STAGES:
        label = f'{{stage="{s}"}}'
        out[s] = (value(f"{STAGE}_sum{label}"), value(f"{STAGE}_count{label}"))
    return out


def grew(before: dict, after: dict) -> dict[str, tuple[float, float]]:
    return {k: (after[k][0] - before[k][0], after[k][1] - before[k][1]) for k in after}


def post(client, path: str, body: dict):
    r = client.post(path, content=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    assert r.status_code == 200, r.text[:500]
    return r


def check_attribution(d: dict) -> None:
    assert d["ttft"][1] == 1 and d["parse_and_tokenize"][1] == 1 and d["prefill"][1] == 1
    assert d["ttft"][0] >= DELAY, "TTFT leaves out the time before the engine"
    assert d["parse_and_tokenize"][0] >= DELAY, "the tokenizer's delay is not in parse_and_tokenize"
    for engine_stage in ("queue", "prefetch", "prefill"):
        assert d[engine_stage][0] < DELAY, f"the tokenizer's delay shows in {engine_stage}"
    assert sum(d[s][0] for s in STAGES) == pytest.approx(d["ttft"][0], abs=0.01)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_slow_tokenizer_is_in_ttft_and_in_parse_and_tokenize_not_in_the_engine(client, slow_tokenizer, stream):
    before = scrape(client)
    r = post(client, "/v1/completions", {"model": "moe", "prompt": "tell me about caches", "max_tokens": 4, "stream": stream})
    assert ("data: [DONE]" in r.text) if stream else r.json()["usage"]["completion_tokens"] == 4
    check_attribution(grew(before, scrape(client)))


def test_a_slow_body_parse_counts_too_ttft_starts_when_the_request_arrives(client, monkeypatch):
    from kvtier.serve import api

    parse = api.parse

    def slow_parse(*args, **kw):
        time.sleep(DELAY)
        return parse(*args, **kw)

    monkeypatch.setattr(api, "parse", slow_parse)
    before = scrape(client)
    post(client, "/v1/completions", {"model": "moe", "prompt": "tell me about caches", "max_tokens": 3, "stream": True})
    check_attribution(grew(before, scrape(client)))


def test_chat_and_sglang_generate_attribute_the_delay_the_same_way(client, slow_tokenizer):
    messages = [{"role": "user", "content": "what is a KV cache?"}]
    before = scrape(client)
    post(client, "/v1/chat/completions", {"model": "moe", "messages": messages, "max_tokens": 3, "stream": True})
    check_attribution(grew(before, scrape(client)))
    before = scrape(client)
    post(client, "/generate", {"text": "tell me about caches", "sampling_params": {"max_new_tokens": 3}, "stream": True})
    check_attribution(grew(before, scrape(client)))


def test_every_stage_is_listed_in_metrics_before_any_request(server):
    text = server.metrics.render({"tier_blocks": {}, "bytes_moved": {}, "evictions": {}, "failures": {}}, 0, 0).decode()
    for stage in STAGES:
        assert f'{STAGE}_count{{stage="{stage}"}}' in text
    assert "arrival at the server" in text


def test_the_engine_stages_are_durations_of_its_own_times():
    assert first_token_stages({"arrival": 10.0, "admitted": 10.5, "first_token": 11.25}) == FirstTokenStages(0.5, 0.75)
    with_prefetch = {"arrival": 10.0, "prefetch_start": 10.25, "admitted": 11.0, "first_token": 11.5}
    assert first_token_stages(with_prefetch) == FirstTokenStages(0.25, 0.5, 0.75)
    # D of a hand-off: its first token is P's, from before its admission
    assert first_token_stages({"arrival": 10.0, "admitted": 10.5, "first_token": 10.0}) is None
    assert first_token_stages({"arrival": 10.0}) is None


def test_the_first_token_s_delta_carries_the_stages_across_the_wire(checkpoint):
    delta = RequestDelta("r", stages=FirstTokenStages(0.5, 0.75, 0.25))
    back = decode_message(encode(EngineOutputs(deltas=[delta])))
    assert isinstance(back, EngineOutputs) and back.deltas[0].stages == FirstTokenStages(0.5, 0.75, 0.25)

    engine = EngineClient.in_thread(EngineCore(checkpoint("llama-tiny"), block_size=8, num_device_blocks=64), max_queue=4)

    async def deltas():
        params = kvtier.SamplingParams(max_tokens=3, ignore_eos=True)
        return [d async for d in engine.generate(engine.make_request([5, 6, 7, 8], params))]

    try:
        got = asyncio.run(deltas())
    finally:
        engine.shutdown()
    first = next(d for d in got if any(s.token_ids for s in d.samples))
    assert first.stages is not None and first.stages.prefill >= 0 and first.stages.queue >= 0
    assert all(d.stages is None for d in got if d is not first)


def test_the_bench_reports_the_server_s_mean_ttft_and_stages_of_its_run_only_for_kvtier():
    before = {"ttft": (1.0, 2.0), "queue": (0.5, 2.0), "prefetch": (0.0, 0.0)}
    after = {"ttft": (4.0, 5.0), "queue": (1.1, 5.0), "prefetch": (0.0, 0.0)}
    got = server_ttft(before, after)
    assert got is not None and got["count"] == 3 and got["ttft_mean_s"] == pytest.approx(1.0)
    assert got["stages_mean_s"]["queue"] == pytest.approx(0.2) and got["stages_mean_s"]["prefetch"] is None
    assert server_ttft({}, {}) is None  # another server: no /metrics of kvtier's
