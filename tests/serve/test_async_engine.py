"""AsyncEngine: the step loop on its thread, callers on asyncio."""

from __future__ import annotations

import asyncio
import time

import pytest

import kvtier
from kvtier.engine.async_engine import AsyncEngine, EngineDead, QueueFull
from kvtier.engine.core import EngineCore

LONG = kvtier.SamplingParams(max_tokens=60, ignore_eos=True)


@pytest.fixture
def engine(checkpoint):
    eng = AsyncEngine(EngineCore(checkpoint("llama-tiny"), block_size=8, num_device_blocks=64), max_queue=4)
    yield eng
    eng.shutdown()


async def collect(eng, req):
    toks = []
    async for d in eng.generate(req):
        toks += d.token_ids
        if d.output is not None:
            assert toks == d.output.token_ids
            return d.output


def test_requests_joining_mid_run_are_batched_and_answered_as_offline(engine, checkpoint):
    prompts = [[i + 1] * (5 + i) for i in range(6)]
    with kvtier.LLM(checkpoint("llama-tiny"), block_size=8) as llm:
        want = [o.token_ids for o in llm.generate(prompts, LONG)]
    seen = []

    async def main():
        async def late(i):
            await asyncio.sleep(0.01 * i)
            out = await collect(engine, engine.make_request(prompts[i], LONG))
            seen.append(await engine.call(lambda core: 0))
            return out.token_ids

        return await asyncio.gather(*(late(i) for i in range(6)))

    running = []

    async def watch():
        while len(running) < 200:
            running.append(engine.num_running)
            await asyncio.sleep(0.002)

    async def both():
        w = asyncio.create_task(watch())
        got = await main()
        w.cancel()
        return got

    assert asyncio.run(both()) == want
    assert max(running) > 1  # they ran in one batch


def test_a_caller_that_leaves_aborts_and_frees_its_blocks(engine):
    async def main():
        req = engine.make_request([1, 2, 3, 4, 5], kvtier.SamplingParams(max_tokens=500, ignore_eos=True))
        async for d in engine.generate(req):
            break  # the client went away after one delta
        for _ in range(200):
            used = await engine.call(
                lambda core: (
                    core.scheduler.has_unfinished(),
                    core.cache.device_pool.num_used - core.cache.tree.num_device_copies,
                )
            )
            if used == (False, 0):
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"request still holds blocks: {used}")

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


def test_steps_that_keep_failing_with_no_request_to_blame_fail_every_caller_and_kill_the_engine(engine):
    def boom():
        raise RuntimeError("kernel exploded")

    engine.core.step = boom

    async def main():
        with pytest.raises(EngineDead, match="kernel exploded"):
            await collect(engine, engine.make_request([1, 2, 3], LONG))

    asyncio.run(main())
    with pytest.raises(EngineDead):
        engine.make_request([1, 2, 3], LONG)


def held_by_requests(core) -> tuple[int, int]:
    """(device, host) blocks in use that no tree node owns: held by requests (or leaked)."""
    nodes = core.cache.tree.nodes.values()
    return (
        core.cache.device_pool.num_used - sum(n.device_block is not None for n in nodes),
        core.cache.host_pool.num_used - sum(n.host_block is not None for n in nodes),
    )


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
    engine = AsyncEngine(core, max_queue=16)
    try:

        async def main():
            reqs = [engine.make_request(p, LONG) for p in prompts]
            victim = engine.make_request([7] * 9, LONG, request_id="victim")
            outs = await asyncio.gather(*(collect(engine, r) for r in [*reqs, victim]))
            engine.check_alive()
            after = await collect(engine, engine.make_request(prompts[0], LONG))
            state = await engine.call(
                lambda c: (c.cache.assert_invariants(), held_by_requests(c), c.cache_stats()["failed_requests"])
            )
            return outs, after, state

        outs, after, (_, held, failed) = asyncio.run(main())
    finally:
        engine.shutdown()
    *others, victim = outs
    assert victim.finish_reason == "error" and victim.error_kind == "internal"
    assert "kernel exploded" in victim.error and victim.handoff is None
    assert [o.token_ids for o in others] == want
    assert all(o.finish_reason == "length" and o.error is None for o in others)
    assert after.token_ids == want[0]
    assert held == (0, 0) and failed == 1


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


def test_steps_failing_with_no_request_to_blame_kill_the_engine_only_when_repeated(engine, monkeypatch):
    real, calls = engine.core.step, {"n": 0}

    def flaky():
        calls["n"] += 1
        if calls["n"] <= engine.max_step_failures - 1:
            raise RuntimeError("scheduler hiccup")
        return real()

    monkeypatch.setattr(engine.core, "step", flaky)

    async def main():
        return await collect(engine, engine.make_request([1, 2, 3], LONG))

    assert asyncio.run(main()).finish_reason == "length"  # one failure short of dead
    engine.check_alive()


def test_n_samples_stream_per_index_deltas_that_add_up_to_each_samples_output(engine):
    params = kvtier.SamplingParams(max_tokens=12, temperature=0.8, seed=4, n=3, ignore_eos=True)

    async def main():
        return [d async for d in engine.generate(engine.make_request(list(range(1, 20)), params))]

    deltas = asyncio.run(main())
    out = deltas[-1].output
    assert out is not None and all(d.output is None for d in deltas[:-1])
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for c in out.outputs:
        mine = [d for d in deltas if d.index == c.index]
        assert len(mine) > 1  # streamed, not sent at the end
        assert [t for d in mine for t in d.token_ids] == c.token_ids and len(c.token_ids) == 12
        assert [d.finish_reason for d in mine] == [None] * (len(mine) - 1) + ["length"]
        assert all(d.logprobs is None for d in mine)  # not asked for
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3  # seeds 4, 5, 6


def test_a_caller_that_leaves_aborts_every_sample(engine):
    async def main():
        req = engine.make_request([1, 2, 3, 4, 5], kvtier.SamplingParams(max_tokens=500, ignore_eos=True, n=4))
        async for d in engine.generate(req):
            if d.index == 3:
                break  # every sample runs; the client goes away
        for _ in range(200):
            state = await engine.call(lambda core: (core.has_unfinished(), held_by_requests(core)))
            if state == (False, (0, 0)):
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"samples still hold blocks: {state}")

    asyncio.run(main())


def test_sample_deltas_carry_their_tokens_logprobs_in_step(engine):
    params = kvtier.SamplingParams(max_tokens=9, temperature=0.8, seed=1, n=2, ignore_eos=True, logprobs=2)

    async def main():
        return [d async for d in engine.generate(engine.make_request(list(range(1, 20)), params))]

    deltas = asyncio.run(main())
    for c in deltas[-1].output.outputs:
        mine = [d for d in deltas if d.index == c.index]
        assert all(len(d.logprobs) == len(d.token_ids) for d in mine)
        streamed = [lp for d in mine for lp in d.logprobs]
        assert streamed == c.logprobs and len(streamed) == len(c.token_ids) == 9
        # each entry: the sampled token (first) and the top 2
        assert all(next(iter(lp)) == t and 2 <= len(lp) <= 3 for lp, t in zip(streamed, c.token_ids))


def test_an_idle_engine_lands_its_copies_and_starts_the_puts_they_stage(checkpoint):
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
    backend = core.storage.backend
    real_put = backend.put_from_parts if backend.supports_parts else backend.put_from

    def slow_put(*args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(0.2)  # still in flight when the request's last step ends
        return real_put(*args, **kwargs)

    if backend.supports_parts:
        backend.put_from_parts = slow_put
    else:
        backend.put_from = slow_put
    engine = AsyncEngine(core, max_queue=4)
    try:

        async def main():
            await collect(engine, engine.make_request(list(range(1, 42)), LONG))
            pending_at_end = await engine.call(lambda c: c.cache.num_pending_ops)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                if not await engine.call(lambda c: c.cache.num_pending_ops):
                    break
                await asyncio.sleep(0.05)
            return pending_at_end, await engine.call(lambda c: (c.cache.num_pending_ops, c.cache.stats.as_dict()))

        pending_at_end, (pending, stats) = asyncio.run(main())
    finally:
        engine.shutdown()
    assert pending_at_end > 0, "the test needs puts in flight when the request ends"
    assert pending == 0, f"{pending} copies still pending on an idle engine"
    assert stats["bytes_moved"]["host_to_storage"] > 0


def test_a_failure_landing_copies_while_idle_is_counted_not_fatal(checkpoint, monkeypatch):
    """An idle pump that raises once is logged and retried, like a failed step; the engine serves on."""
    core = EngineCore(checkpoint("llama-tiny"), block_size=8, num_device_blocks=64)
    real, calls = core.pump_idle, []

    def flaky():  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected: idle pump failed")
        return real()

    monkeypatch.setattr(core, "pump_idle", flaky)
    engine = AsyncEngine(core, max_queue=4)
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
