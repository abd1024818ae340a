"""An engine served on a thread of the test's process (``EngineClient.in_thread``): the client,
sockets and messages of an engine process, the loop on a thread, callers on asyncio."""

from __future__ import annotations

import asyncio
import time

import pytest

import kvtier
from kvtier.engine.client import EngineClient
from kvtier.engine.core import EngineCore
from kvtier.engine.loop import MAX_STEP_FAILURES
from kvtier.engine.wire import EngineDead, QueueFull

LONG = kvtier.SamplingParams(max_tokens=60, ignore_eos=True)
NOTHING_HELD = {"unfinished": False, "device": 0, "host": 0}


@pytest.fixture
def engine(checkpoint):
    eng = EngineClient.in_thread(EngineCore(checkpoint("llama-tiny"), block_size=8, num_device_blocks=64), max_queue=4)
    yield eng
    eng.shutdown()


async def collect(eng, req):
    toks = []
    async for d in eng.generate(req):
        toks += [t for s in d.samples for t in s.token_ids]
        if d.output is not None:
            assert toks == d.output.token_ids
            return d.output


def test_requests_joining_mid_run_are_batched_and_answered_as_offline(checkpoint):
    # a queue that holds all six: on a loaded machine none may be admitted before the last arrives
    engine = EngineClient.in_thread(EngineCore(checkpoint("llama-tiny"), block_size=8, num_device_blocks=64), max_queue=8)
    prompts = [[i + 1] * (5 + i) for i in range(6)]
    with kvtier.LLM(checkpoint("llama-tiny"), block_size=8) as llm:
        want = [o.token_ids for o in llm.generate(prompts, LONG)]

    async def main():
        async def late(i):
            await asyncio.sleep(0.01 * i)
            out = await collect(engine, engine.make_request(prompts[i], LONG))
            await engine.call("requests")  # a call between steps answers while others run
            return out.token_ids

        return await asyncio.gather(*(late(i) for i in range(6)))

    running: list[int] = []

    async def watch():
        while len(running) < 200:
            running.append(engine.num_running)
            await asyncio.sleep(0.002)

    async def both():
        w = asyncio.create_task(watch())
        got = await main()
        w.cancel()
        return got

    try:
        assert asyncio.run(both()) == want
    finally:
        engine.shutdown()
    assert max(running) > 1  # they ran in one batch


def test_a_caller_that_leaves_aborts_and_frees_its_blocks(engine):
    async def main():
        req = engine.make_request([1, 2, 3, 4, 5], kvtier.SamplingParams(max_tokens=500, ignore_eos=True))
        async for d in engine.generate(req):
            break  # the client went away after one delta
        for _ in range(200):
            held = await engine.call("held_blocks")
            if held == NOTHING_HELD:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"request still holds blocks: {held}")

    asyncio.run(main())


def test_a_full_queue_says_so_and_bad_input_never_reaches_the_engine(engine):
    with pytest.raises(ValueError, match="token id"):
        engine.make_request([10**9], LONG)

    async def main():
        # a step loop that cannot admit: more waiting than max_queue
        reqs = [engine.make_request([1] * 300, kvtier.SamplingParams(max_tokens=200, ignore_eos=True)) for _ in range(12)]
        gens = [engine.generate(r) for r in reqs]
        tasks = [asyncio.ensure_future(g.__anext__()) for g in gens]
        done = await asyncio.gather(*tasks, return_exceptions=True)
        for g in gens:
            await g.aclose()
        return done

    results = asyncio.run(main())
    assert any(isinstance(r, QueueFull) for r in results)
    assert not any(isinstance(r, Exception) and not isinstance(r, QueueFull) for r in results)


def test_steps_that_keep_failing_with_no_request_to_blame_fail_every_caller_and_kill_the_engine(checkpoint, monkeypatch):
    core = EngineCore(checkpoint("llama-tiny"), block_size=8, num_device_blocks=64)

    def boom(updated=None):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(core, "step", boom)
    dead: list[BaseException] = []
    engine = EngineClient.in_thread(core, max_queue=4, on_dead=dead.append)
    try:

        async def main():
            with pytest.raises(EngineDead, match="kernel exploded"):
                await collect(engine, engine.make_request([1, 2, 3], LONG))

        asyncio.run(main())
        with pytest.raises(EngineDead):
            engine.make_request([1, 2, 3], LONG)
        assert dead == [engine.error] and "kernel exploded" in str(engine.error)
    finally:
        engine.shutdown()


def test_a_failing_request_fails_alone_and_the_engine_serves_on(checkpoint, monkeypatch):
    prompts = [[i + 1] * (5 + 3 * i) for i in range(4)]
    with kvtier.LLM(checkpoint("llama-tiny"), block_size=8) as llm:
        want = [o.token_ids for o in llm.generate(prompts, LONG)]
    core = EngineCore(
        checkpoint("llama-tiny"), block_size=8, num_device_blocks=64, num_host_blocks=32, write_policy="write_through"
    )
    real = core.runner.execute

    def poisoned(out, start_loads=None):  # fails whenever the victim is in the batch
        if any(s.request.request_id == "victim" for s in out.scheduled):
            raise RuntimeError("injected: kernel exploded")
        return real(out, start_loads)

    monkeypatch.setattr(core.runner, "execute", poisoned)
    engine = EngineClient.in_thread(core, max_queue=16)
    try:

        async def main():
            reqs = [engine.make_request(p, LONG) for p in prompts]
            victim = engine.make_request([7] * 9, LONG, request_id="victim")
            outs = await asyncio.gather(*(collect(engine, r) for r in [*reqs, victim]))
            engine.check_alive()
            after = await collect(engine, engine.make_request(prompts[0], LONG))
            state = [await engine.call(name) for name in ("leak_check", "held_blocks", "cache_stats")]
            return outs, after, state

        outs, after, (leaks, held, stats) = asyncio.run(main())
    finally:
        engine.shutdown()
    *others, victim = outs
    assert victim.finish_reason == "error" and victim.error_kind == "internal"
    assert "kernel exploded" in victim.error and victim.handoff is None
    assert [o.token_ids for o in others] == want
    assert all(o.finish_reason == "length" and o.error is None for o in others)
    assert after.token_ids == want[0]
    assert leaks["invariants"] == "ok" and held == NOTHING_HELD and stats["failed_requests"] == 1


@pytest.mark.parametrize(
    "params",
    [{"temperature": 1e-300}, {"top_p": 1e-300, "temperature": 1.0}, {"temperature": 1e-300, "top_p": 1e-300, "top_k": 3}],
)
def test_extreme_sampling_params_complete_and_give_the_greedy_tokens(engine, params):
    greedy = kvtier.SamplingParams(max_tokens=8, ignore_eos=True)
    extreme = kvtier.SamplingParams(max_tokens=8, ignore_eos=True, seed=1, **params)

    async def main():
        return [await collect(engine, engine.make_request([3, 1, 4, 1, 5], p)) for p in (greedy, extreme)]

    want, got = asyncio.run(main())
    assert got.finish_reason == "length" and got.token_ids == want.token_ids


def test_a_duplicate_request_id_is_refused_and_the_first_request_finishes(engine):
    async def main():
        first = engine.make_request([1, 2, 3], LONG, request_id="same")
        task = asyncio.ensure_future(collect(engine, first))
        while not engine.num_running:
            await asyncio.sleep(0.001)
        with pytest.raises(ValueError, match="request_id 'same' is already in use"):
            await collect(engine, engine.make_request([4, 5, 6], LONG, request_id="same"))
        return await task

    out = asyncio.run(main())
    assert out.finish_reason == "length" and len(out.token_ids) == LONG.max_tokens
    engine.check_alive()


def test_steps_failing_with_no_request_to_blame_kill_the_engine_only_when_repeated(checkpoint, monkeypatch):
    core = EngineCore(checkpoint("llama-tiny"), block_size=8, num_device_blocks=64)
    real, calls = core.step, {"n": 0}

    def flaky(updated=None):
        calls["n"] += 1
        if calls["n"] <= MAX_STEP_FAILURES - 1:
            raise RuntimeError("scheduler hiccup")
        return real(updated)

    monkeypatch.setattr(core, "step", flaky)
    engine = EngineClient.in_thread(core, max_queue=4)
    try:

        async def main():
            return await collect(engine, engine.make_request([1, 2, 3], LONG))

        assert asyncio.run(main()).finish_reason == "length"  # one failure short of dead
        engine.check_alive()
    finally:
        engine.shutdown()
    assert calls["n"] > MAX_STEP_FAILURES


def test_n_samples_stream_per_index_deltas_that_add_up_to_each_samples_output(engine):
    params = kvtier.SamplingParams(max_tokens=12, temperature=0.8, seed=4, n=3, ignore_eos=True)

    async def main():
        return [d async for d in engine.generate(engine.make_request(list(range(1, 20)), params))]

    deltas = asyncio.run(main())
    out = deltas[-1].output
    assert out is not None and all(d.output is None for d in deltas[:-1])
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for c in out.outputs:
        mine = [s for d in deltas for s in d.samples if s.index == c.index]
        assert len(mine) > 1  # streamed, not sent at the end
        assert [t for s in mine for t in s.token_ids] == c.token_ids and len(c.token_ids) == 12
        assert [s.finish_reason for s in mine] == [None] * (len(mine) - 1) + ["length"]
        assert all(s.logprobs is None for s in mine)  # not asked for
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3  # seeds 4, 5, 6


@pytest.mark.parametrize("overlap", [False, True])
def test_streams_add_up_to_the_offline_outputs_with_and_without_overlap_scheduling(checkpoint, overlap):
    """Under overlap scheduling a step's results are taken during the next step: the requests it
    names then are those of the step before, and every token still streams, once, in order."""
    prompts = [list(range(1, 20)), [5] * 9]
    params = [kvtier.SamplingParams(max_tokens=12, temperature=0.8, seed=4, n=3, ignore_eos=True), LONG]
    with kvtier.LLM(checkpoint("llama-tiny"), block_size=8) as llm:
        want = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]
    core = EngineCore(checkpoint("llama-tiny"), block_size=8, num_device_blocks=64, overlap_schedule=overlap)
    engine = EngineClient.in_thread(core, max_queue=8)
    try:

        async def stream(p, sp):
            return [d async for d in engine.generate(engine.make_request(p, sp))]

        async def main():
            return await asyncio.gather(*(stream(p, sp) for p, sp in zip(prompts, params)))

        got = asyncio.run(main())
    finally:
        engine.shutdown()
    for deltas, samples in zip(got, want):
        streamed = {i: [t for d in deltas for s in d.samples if s.index == i for t in s.token_ids] for i in range(len(samples))}
        assert list(streamed.values()) == samples == [c.token_ids for c in deltas[-1].output.outputs]
        assert all(sum(1 for d in deltas for s in d.samples if s.index == i) > 1 for i in streamed)  # streamed, not at the end


def test_a_caller_that_leaves_aborts_every_sample(engine):
    async def main():
        req = engine.make_request([1, 2, 3, 4, 5], kvtier.SamplingParams(max_tokens=500, ignore_eos=True, n=4))
        async for d in engine.generate(req):
            if any(s.index == 3 for s in d.samples):
                break  # every sample runs; the client goes away
        for _ in range(200):
            held = await engine.call("held_blocks")
            if held == NOTHING_HELD:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"samples still hold blocks: {held}")

    asyncio.run(main())


def test_sample_deltas_carry_their_tokens_logprobs_in_step(engine):
    params = kvtier.SamplingParams(max_tokens=9, temperature=0.8, seed=1, n=2, ignore_eos=True, logprobs=2)

    async def main():
        return [d async for d in engine.generate(engine.make_request(list(range(1, 20)), params))]

    deltas = asyncio.run(main())
    for c in deltas[-1].output.outputs:
        mine = [s for d in deltas for s in d.samples if s.index == c.index]
        assert all(len(s.logprobs) == len(s.token_ids) for s in mine)
        streamed = [lp for s in mine for lp in s.logprobs]
        assert streamed == c.logprobs and len(streamed) == len(c.token_ids) == 9
        # each entry: the sampled token (first) and the top 2
        assert all(next(iter(lp)) == t and 2 <= len(lp) <= 3 for lp, t in zip(streamed, c.token_ids))


def test_the_loop_asks_only_the_requests_a_step_names_for_their_tokens(checkpoint, monkeypatch):
    """Nothing polls: the loop looks at the requests ``step(updated)`` named, never at every open
    stream. With one running slot, a request waiting for it is not asked until it runs, and
    every request asked for its tokens was named by the step just before."""
    core = EngineCore(checkpoint("llama-tiny"), block_size=8, num_device_blocks=64, max_num_seqs=1)
    named: list[set[str]] = []
    asked: list[tuple[str, int]] = []  # (request id, the step it was asked after)
    real_step, real_progress = core.step, core.progress

    def step(updated=None):
        out = real_step(updated)
        named.append(set(updated or ()))
        return out

    def progress(req):
        asked.append((req.request_id, len(named) - 1))
        return real_progress(req)

    monkeypatch.setattr(core, "step", step)
    monkeypatch.setattr(core, "progress", progress)
    engine = EngineClient.in_thread(core, max_queue=4)
    try:

        async def main():
            a = engine.make_request([1, 2, 3], LONG, request_id="a")
            b = engine.make_request([4, 5, 6], LONG, request_id="b")
            return await asyncio.gather(collect(engine, a), collect(engine, b))

        outs = asyncio.run(main())
    finally:
        engine.shutdown()
    assert [len(o.token_ids) for o in outs] == [LONG.max_tokens] * 2
    assert asked and all(rid in named[i] for rid, i in asked)
    first_b = min(i for rid, i in asked if rid == "b")
    assert all(i < first_b for rid, i in asked if rid == "a")  # b waited for a's slot, unasked


def test_an_idle_engine_lands_its_copies_and_starts_the_puts_they_stage(checkpoint, monkeypatch):
    """After the last request, nothing steps the engine: its backups and their puts to the pool
    must still land (and be counted), not wait in flight for the next request."""
    core = EngineCore(
        checkpoint("llama-tiny"),
        block_size=8,
        num_device_blocks=64,
        num_host_blocks=32,
        storage="memory://?capacity=16MiB",
        write_policy="write_through",
    )
    assert core.storage is not None
    backend = core.storage.backend
    real_put = backend.put_from_parts if backend.supports_parts else backend.put_from

    def slow_put(*args, **kwargs):
        time.sleep(0.2)  # still in flight when the request's last step ends
        return real_put(*args, **kwargs)

    monkeypatch.setattr(backend, "put_from_parts" if backend.supports_parts else "put_from", slow_put)
    engine = EngineClient.in_thread(core, max_queue=4)
    try:

        async def main():
            await collect(engine, engine.make_request(list(range(1, 42)), LONG))
            pending_at_end = (await engine.call("metrics"))["pending_ops"]
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                if not (await engine.call("metrics"))["pending_ops"]:
                    break
                await asyncio.sleep(0.05)
            return pending_at_end, await engine.call("metrics")

        pending_at_end, metrics = asyncio.run(main())
    finally:
        engine.shutdown()
    assert pending_at_end > 0, "the test needs puts in flight when the request ends"
    assert metrics["pending_ops"] == 0, f"{metrics['pending_ops']} copies still pending on an idle engine"
    assert metrics["bytes_moved"]["host_to_storage"] > 0


def test_a_failure_landing_copies_while_idle_is_counted_not_fatal(checkpoint, monkeypatch):
    """An idle pump that raises once is logged and retried, like a failed step; the engine serves on."""
    core = EngineCore(checkpoint("llama-tiny"), block_size=8, num_device_blocks=64)
    real, calls = core.pump_idle, []

    def flaky():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected: idle pump failed")
        return real()

    monkeypatch.setattr(core, "pump_idle", flaky)
    engine = EngineClient.in_thread(core, max_queue=4)
    try:

        async def main():
            while len(calls) < 2:
                await asyncio.sleep(0.02)
            return await collect(engine, engine.make_request([1, 2, 3, 4, 5], LONG))

        out = asyncio.run(main())
        engine.check_alive()
    finally:
        engine.shutdown()
    assert out.finish_reason == "length" and len(out.token_ids) == LONG.max_tokens
