"""AsyncEngine: the step loop on its thread, callers on asyncio."""
from __future__ import annotations

import asyncio

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
    assert max(running) > 1                        # they ran in one batch


def test_a_caller_that_leaves_aborts_and_frees_its_blocks(engine):
    async def main():
        req = engine.make_request([1, 2, 3, 4, 5], kvtier.SamplingParams(max_tokens=500, ignore_eos=True))
        async for d in engine.generate(req):
            break                                   # the client went away after one delta
        for _ in range(200):
            used = await engine.call(lambda core: (core.scheduler.has_unfinished(), core.cache.device_pool.num_used
                                                   - core.cache.tree.num_device_copies))
            if used == (False, 0):
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"request still holds blocks: {used}")
    asyncio.run(main())


def test_a_full_queue_says_so_and_bad_input_never_reaches_the_engine(engine):
    with pytest.raises(ValueError, match="token id"):
        engine.make_request([10 ** 9], LONG)

    async def main():
        # a step loop that cannot admit: more waiting than max_queue
        reqs = [engine.make_request([1] * 300, kvtier.SamplingParams(max_tokens=200, ignore_eos=True))
                for _ in range(12)]
        gens = [engine.generate(r) for r in reqs]
        tasks = [asyncio.ensure_future(g.__anext__()) for g in gens]
        done = await asyncio.gather(*tasks, return_exceptions=True)
        for g in gens:
            await g.aclose()
        return done
    results = asyncio.run(main())
    assert any(isinstance(r, QueueFull) for r in results)
    assert not any(isinstance(r, Exception) and not isinstance(r, QueueFull) for r in results)


def test_a_failing_step_fails_every_caller_and_the_engine_says_dead(engine):
    def boom():
        raise RuntimeError("kernel exploded")
    engine.core.step = boom

    async def main():
        with pytest.raises(EngineDead, match="kernel exploded"):
            await collect(engine, engine.make_request([1, 2, 3], LONG))
    asyncio.run(main())
    with pytest.raises(EngineDead):
        engine.make_request([1, 2, 3], LONG)
