"""The usage of PD answers: ``cached_tokens`` is D's (the prompt tokens D did not compute: its own
tiers' hits and what it read from the pool), ``usage.kvtier.cached_tokens_by_tier`` splits it
per tier, and ``usage.kvtier.prefill`` is what P found cached, apart (never added to D's).

P, D and the router run in this process (the router's calls reach P's and D's apps through
``httpx.ASGITransport``) over a file pool. References: block arithmetic (block size 16: hits are
whole blocks; D reads a hand-off's partial last block from the pool) and each server's own
``kvtier_cached_tokens_total{tier}`` in /metrics."""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import replace
from types import SimpleNamespace

import httpx
import numpy as np
import openai
import pytest
from starlette.testclient import TestClient

from kvtier.engine.client import EngineClient
from kvtier.engine.config import EngineConfig
from kvtier.engine.core import EngineCore
from kvtier.serve.api import Server
from kvtier.serve.router import Router

BS = 16
ENGINE = EngineConfig(num_host_blocks=64, max_model_len=256, block_size=BS)
D_ENGINE = replace(ENGINE, storage_fetch="always", prefetch_policy="wait_complete")  # D loads every block P wrote
TIERS = ("device", "host", "storage")
NONE = dict.fromkeys(TIERS, 0)


class Apps(httpx.AsyncBaseTransport):
    """The router's calls, to the app of their host (P's or D's) in this process."""

    def __init__(self, apps: dict) -> None:
        self.transports = {host: httpx.ASGITransport(app=app) for host, app in apps.items()}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self.transports[request.url.host].handle_async_request(request)


@pytest.fixture(scope="module")
def pd(moe_model, tmp_path_factory):
    """Test clients of the router, P and D."""
    url = f"file://{tmp_path_factory.mktemp('pool')}"
    p = Server(EngineClient.in_thread(EngineCore(moe_model, ENGINE, storage=url)), "moe", role="prefill")
    d = Server(EngineClient.in_thread(EngineCore(moe_model, D_ENGINE, storage=url)), "moe", role="decode")
    apps = Apps({"p.test": p.app, "d.test": d.app})
    real = httpx.AsyncClient
    router = Router(["http://p.test"], ["http://d.test"], health_interval=60)
    try:
        with contextlib.ExitStack() as stack:
            with pytest.MonkeyPatch.context() as mp:  # the client the router makes as it starts
                mp.setattr(httpx, "AsyncClient", lambda **kw: real(transport=apps, **kw))
                rc = stack.enter_context(TestClient(router.app))
            pc, dc = stack.enter_context(TestClient(p.app)), stack.enter_context(TestClient(d.app))
            yield SimpleNamespace(router=rc, p=pc, d=dc)
    finally:
        for s in (p, d):
            s.engine.shutdown()
            s.close()


def prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 250, n).tolist()


def cached_by_tier(server: TestClient) -> dict[str, int]:
    """The server's kvtier_cached_tokens_total per tier (its engine's hits since it started)."""
    text = server.get("/metrics").text
    by_tier = {}
    for t in TIERS:
        m = re.search(rf'^kvtier_cached_tokens_total{{tier="{t}"}} (\S+)$', text, re.M)
        assert m is not None, f"no kvtier_cached_tokens_total for tier {t}"
        by_tier[t] = int(float(m.group(1)))
    return by_tier


def counted(server: TestClient, before: dict[str, int]) -> dict[str, int]:
    now = cached_by_tier(server)
    return {t: now[t] - before[t] for t in TIERS}


def usage(router: TestClient, ids: list[int] | list[list[int]], **kw) -> dict:
    r = router.post("/v1/completions", json={"model": "moe", "prompt": ids, "max_tokens": 3, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def test_a_pd_answer_reports_what_d_did_not_compute_and_ps_hits_apart(pd):
    ids = prompt(1, 37)  # two whole blocks and a partial one
    p0, d0 = cached_by_tier(pd.p), cached_by_tier(pd.d)
    cold = usage(pd.router, ids)
    # P's prompt was cold; D computed none of it: every token came from the pool
    assert cold["prompt_tokens"] == 37 and cold["prompt_tokens_details"]["cached_tokens"] == 37
    assert cold["kvtier"]["cached_tokens_by_tier"] == counted(pd.d, d0) == NONE | {"storage": 37}
    assert cold["kvtier"]["prefill"] == {"cached_tokens": 0, "cached_tokens_by_tier": NONE} and counted(pd.p, p0) == NONE

    p0, d0 = cached_by_tier(pd.p), cached_by_tier(pd.d)
    warm = usage(pd.router, ids)
    # P hits its two whole blocks on device and computes the last 5 tokens (its first token needs
    # them); D has the same two blocks on device from the first answer, reads the partial one
    assert warm["prompt_tokens_details"]["cached_tokens"] == 37
    assert warm["kvtier"]["cached_tokens_by_tier"] == counted(pd.d, d0) == {"device": 32, "host": 0, "storage": 5}
    assert warm["kvtier"]["prefill"] == {"cached_tokens": 32, "cached_tokens_by_tier": counted(pd.p, p0)}
    assert counted(pd.p, p0) == NONE | {"device": 32}


def test_a_streamed_pd_answer_carries_the_same_usage_in_its_last_chunk(pd):
    ids = prompt(2, 40)
    usage(pd.router, ids)
    whole = usage(pd.router, ids)  # P and D warm: the same hits from now on
    body = {
        "model": "moe",
        "prompt": ids,
        "max_tokens": 3,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with pd.router.stream("POST", "/v1/completions", json=body) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole
    assert whole["prompt_tokens_details"]["cached_tokens"] == 40 and whole["kvtier"]["prefill"]["cached_tokens"] == 32
    # OpenAI's client parses it: the standard fields as such, kvtier's as an extra field
    client = openai.OpenAI(base_url="http://router/v1", api_key="none", http_client=pd.router, max_retries=0)
    last = list(
        client.completions.create(
            model="moe", prompt=ids, max_tokens=3, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )[-1]
    assert last.usage is not None and last.usage.prompt_tokens_details is not None and last.usage.model_extra is not None
    assert last.usage.prompt_tokens_details.cached_tokens == 40 and last.usage.model_extra["kvtier"] == whole["kvtier"]


def test_a_request_the_router_runs_colocated_reports_ds_colocated_usage(pd):
    """n > 1 is no hand-off: D answers alone. Its usage has no ``prefill``; each prompt counts
    once, however many samples share it."""
    ids = [prompt(3, 37), prompt(4, 20)]
    usage(pd.router, ids, n=2)
    d0 = cached_by_tier(pd.d)
    again = usage(pd.router, ids, n=2)
    full = (37 - 1) // BS * BS + (20 - 1) // BS * BS  # whole blocks; the last token is computed
    assert again["prompt_tokens"] == 57 and again["prompt_tokens_details"]["cached_tokens"] == full
    assert again["kvtier"] == {"cached_tokens_by_tier": NONE | {"device": full}}
    assert counted(pd.d, d0) == NONE | {"device": full}
