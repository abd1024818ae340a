"""PD hand-off at the engine core: P exports a prompt's blocks (full + partial) to a file pool,
D starts from P's first token and loads them; tokens and routed experts equal a colocated run."""

from __future__ import annotations

import numpy as np
import pytest

import kvtier
from kvtier.engine.config import EngineConfig
from kvtier.engine.core import EngineCore

CONFIG = EngineConfig(num_host_blocks=64, block_size=8)
PARAMS = kvtier.SamplingParams(max_tokens=6, ignore_eos=True, return_routed_experts=True)


def run(core: EngineCore, **add) -> kvtier.RequestOutput:
    req = core.add_request(**add)
    for _ in range(10_000):
        for out in core.step():
            if out.request_id == req.request_id:
                core.cache.assert_invariants()
                return out
    raise AssertionError("request never finished")


@pytest.fixture(scope="module")
def model(checkpoint):
    return checkpoint("qwen3-moe-tiny")


@pytest.mark.parametrize("n_prompt", [37, 40])  # a partial last block, and none
def test_decode_side_loads_every_prompt_token_from_the_pool(model, tmp_path, n_prompt):
    prompt = np.random.default_rng(n_prompt).integers(0, 250, n_prompt).tolist()
    with kvtier.LLM(model, block_size=8) as colo:
        ref = colo.generate([prompt], PARAMS)[0]
    url = f"file://{tmp_path}"
    with EngineCore(model, CONFIG, storage=url) as p, EngineCore(model, CONFIG, storage=url) as d:
        first = run(p, prompt=prompt, params=kvtier.SamplingParams(max_tokens=1, return_routed_experts=True), export=True)
        h = first.handoff
        assert h["complete"] and h["failed_blocks"] == 0 and h["num_tokens"] == n_prompt
        assert len(h["keys"]) == -(-n_prompt // 8) and (":partial:5" in h["keys"][-1]) == (n_prompt == 37)
        assert first.token_ids == ref.token_ids[:1]
        out = run(d, prompt=prompt, params=PARAMS, handoff=h)
        assert out.token_ids == ref.token_ids
        np.testing.assert_array_equal(out.routed_experts, ref.routed_experts)
        assert out.cached_tokens_by_tier == {"device": 0, "host": 0, "storage": n_prompt}
        assert out.handoff["result"] == "ok"
        # D's own cache serves a repeat: device hits, the tail fetched again
        again = run(d, prompt=prompt, params=PARAMS, handoff=h)
        assert again.token_ids == ref.token_ids
        assert again.cached_tokens_by_tier["device"] == n_prompt // 8 * 8


def test_missing_blocks_are_recomputed_or_fail_under_error(model, tmp_path):
    prompt = np.random.default_rng(1).integers(0, 250, 29).tolist()
    with kvtier.LLM(model, block_size=8) as colo:
        ref = colo.generate([prompt], PARAMS)[0]
    url = f"file://{tmp_path}"
    with EngineCore(model, CONFIG, storage=url) as p:
        h = run(p, prompt=prompt, params=kvtier.SamplingParams(max_tokens=1), export=True).handoff
    for f in tmp_path.rglob("*"):  # the pool lost the prompt's objects
        if f.is_file() and "partial" in f.name or f.suffix == ".kvt":
            f.unlink()
    with EngineCore(model, CONFIG, storage=url) as d:
        out = run(d, prompt=prompt, params=PARAMS, handoff=h)
        assert out.token_ids == ref.token_ids
        assert out.handoff["result"] == "recomputed" and out.handoff["missing_tokens"] > 0
    with EngineCore(model, CONFIG, storage=url, pd_on_miss="error") as d:
        out = run(d, prompt=prompt, params=PARAMS, handoff=h)
        assert out.finish_reason == "error" and "missing" in out.error
        d.cache.assert_invariants()
        assert d.cache.device_pool.num_used == d.cache.tree.num_device_copies


def test_first_token_that_ends_the_request(model, tmp_path):
    prompt = [5, 6, 7, 8, 9, 10, 11]
    url = f"file://{tmp_path}"
    with EngineCore(model, CONFIG, storage=url) as p, EngineCore(model, CONFIG, storage=url) as d:
        h = run(p, prompt=prompt, params=kvtier.SamplingParams(max_tokens=1), export=True).handoff
        one = kvtier.SamplingParams(max_tokens=1, return_routed_experts=True)
        out = run(d, prompt=prompt, params=one, handoff=h)
        assert out.token_ids == [h["first_token"]] and out.finish_reason == "length"
        assert out.routed_experts.shape[0] == len(prompt)


def test_a_manifest_from_another_model_is_refused(model, checkpoint, tmp_path):
    prompt = list(range(20))
    url = f"file://{tmp_path}"
    with EngineCore(model, CONFIG, storage=url) as p:
        h = run(p, prompt=prompt, params=kvtier.SamplingParams(max_tokens=1), export=True).handoff
    with EngineCore(checkpoint("llama-tiny"), CONFIG, storage=url) as d:
        with pytest.raises(ValueError, match="handoff.keys do not match"):
            d.add_request(prompt, kvtier.SamplingParams(), handoff=h)
        with pytest.raises(ValueError, match="num_tokens"):
            d.add_request(prompt[:-1], kvtier.SamplingParams(), handoff=h)


def test_ps_first_token_streams_before_the_pool_acked_its_blocks(model, tmp_path):
    """The serving loop gives P's first token (with the manifest's names) as soon as it is
    sampled, while the prompt's blocks are still on their way to the pool; the output, with
    ``complete``, comes only after the pool acked them."""
    import asyncio
    import threading

    from kvtier.engine.client import EngineClient

    prompt = np.random.default_rng(3).integers(0, 250, 37).tolist()
    core = EngineCore(model, CONFIG, storage=f"file://{tmp_path}")
    assert core.storage is not None
    backend = core.storage.backend
    gate, held = threading.Event(), threading.Event()
    for name in ("put_from", "put_from_parts"):  # the pool holds every write until the gate opens
        real = getattr(backend, name)

        def slow(names, bufs, _real=real):
            held.set()
            assert gate.wait(30), "the test never opened the gate"
            return _real(names, bufs)

        setattr(backend, name, slow)
    engine = EngineClient.in_thread(core)

    async def go() -> None:
        req = engine.make_request(prompt, kvtier.SamplingParams(max_tokens=1), export=True)
        it = engine.generate(req)
        first = await asyncio.wait_for(it.__anext__(), 30)
        assert not gate.is_set()  # the pool cannot have acked a block
        (sample,) = first.samples
        assert first.output is None and len(sample.token_ids) == 1
        names = first.export
        assert names is not None
        assert names["num_tokens"] == 37 and len(names["keys"]) == 5 and names["cached_tokens"] == 0
        assert await asyncio.to_thread(held.wait, 30)  # the writes reached the pool, which holds them
        rest = asyncio.ensure_future(it.__anext__())
        done, _ = await asyncio.wait({rest}, timeout=0.5)
        assert not done, "the output came before the pool acked the blocks"
        gate.set()
        last = await asyncio.wait_for(rest, 30)
        assert last.output is not None and last.output.handoff is not None
        assert [t for s in last.samples for t in s.token_ids] == [] and last.output.token_ids == sample.token_ids
        h = last.output.handoff
        assert h["complete"] and h["keys"] == names["keys"] and h["namespace"] == names["namespace"]

    try:
        asyncio.run(go())
    finally:
        gate.set()
        engine.shutdown()


def test_an_engine_that_stops_after_ps_first_line_is_an_error_line_not_a_cut_answer(model, tmp_path):
    """P's answer has started (first token out, blocks held by the pool) when its engine stops:
    the second line says so in OpenAI's error shape (the router then treats the export as
    failed), rather than the connection dropping mid-answer."""
    import json
    import threading

    from starlette.testclient import TestClient

    from kvtier.engine.client import EngineClient
    from kvtier.serve.api import Server

    core = EngineCore(model, CONFIG, storage=f"file://{tmp_path}")
    assert core.storage is not None
    backend = core.storage.backend
    gate = threading.Event()
    for name in ("put_from", "put_from_parts"):
        real = getattr(backend, name)

        def slow(names, bufs, _real=real):
            gate.wait(30)
            return _real(names, bufs)

        setattr(backend, name, slow)
    engine = EngineClient.in_thread(core)
    server = Server(engine, "m", role="prefill")
    prompt = np.random.default_rng(4).integers(0, 250, 37).tolist()
    stopper = threading.Thread(target=engine.shutdown, kwargs={"timeout": 10})
    try:
        with (
            TestClient(server.app) as c,
            c.stream("POST", "/kvtier/prefill/completions", json={"model": "m", "prompt": prompt, "max_tokens": 4}) as r,
        ):
            assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
            lines = r.iter_lines()
            head = json.loads(next(lines))
            assert len(head["manifest"]["keys"]) == 5 and isinstance(head["first_token"], int)
            stopper.start()  # the engine stops while the pool holds the blocks
            stopper.join(0.5)
            gate.set()
            err = json.loads(next(lines))["error"]
            assert err["code"] == 503 and "shutting down" in err["message"] and set(err) >= {"message", "type"}
            assert list(lines) == []
    finally:
        gate.set()
        if not stopper.is_alive() and stopper.ident is None:
            engine.shutdown()
        stopper.join(30)
