"""The engine in a process of its own (what `kvtier serve` runs): the same tokens as the engine on
a thread of the test's process (the same client and messages), aborts that return blocks,
refusals that keep the queue count right, and a killed engine process that fails its requests
instead of hanging them."""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import replace

import pytest

import kvtier
from kvtier.engine.client import EngineClient, check_samples
from kvtier.engine.config import EngineConfig
from kvtier.engine.core import EngineCore
from kvtier.engine.wire import EngineDead, EngineRequest, QueueFull

CONFIG = EngineConfig(block_size=8, num_device_blocks=64, max_model_len=128, enable_prefix_caching=False)  # used = held
GREEDY = kvtier.SamplingParams(max_tokens=12, ignore_eos=True)
LONG = kvtier.SamplingParams(max_tokens=100, ignore_eos=True)


@pytest.fixture(scope="module")
def client(moe_model):
    c = EngineClient(str(moe_model), CONFIG, max_queue=8)
    yield c
    c.shutdown()


async def collect(engine, req):
    deltas = [d async for d in engine.generate(req)]
    return deltas, deltas[-1].output


def test_the_same_tokens_as_the_engine_on_a_thread(client, moe_model):
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], [5] * 20]
    sampled = kvtier.SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, seed=7, n=3, logprobs=2)

    async def run(engine):
        outs = []
        for p in prompts:
            for params in (GREEDY, sampled):
                deltas, out = await collect(engine, engine.make_request(p, params))
                streamed: dict[int, list[int]] = {}
                for d in deltas:
                    for s in d.samples:
                        streamed.setdefault(s.index, []).extend(s.token_ids)
                assert streamed == {c.index: c.token_ids for c in out.outputs}  # the stream is the output
                outs.append([(c.token_ids, c.finish_reason, c.logprobs) for c in out.outputs])
        return outs

    got = asyncio.run(run(client))
    local = EngineClient.in_thread(EngineCore(moe_model, CONFIG))
    try:
        want = asyncio.run(run(local))
    finally:
        local.shutdown()
    # the same tokens; logprobs to float rounding (the engine process may run the model on fewer
    # CPU threads than this one: it leaves a core to the server, so sums reduce in another order)
    assert [[(t, f) for t, f, _ in o] for o in got] == [[(t, f) for t, f, _ in o] for o in want]
    for o_got, o_want in zip(got, want):
        for (_, _, lp_got), (_, _, lp_want) in zip(o_got, o_want):
            assert (lp_got is None) == (lp_want is None)
            for a, b in zip(lp_got or (), lp_want or ()):
                assert a.keys() == b.keys() and all(abs(a[k] - b[k]) < 1e-4 for k in a)
    assert any(len(o) == 3 for o in got) and all(t for o in got for t, _, _ in o)


def test_a_request_left_early_returns_its_blocks(client):
    async def main():
        agen = client.generate(client.make_request([1, 2, 3], LONG))
        async for d in agen:
            if any(s.token_ids for s in d.samples):
                break
        await agen.aclose()
        for _ in range(200):  # the abort reaches the engine between steps
            stats = await client.call("metrics")
            if stats["tier_blocks"]["device"]["used"] == 0 and client.num_running == 0:
                return stats
            await asyncio.sleep(0.02)
        return stats

    stats = asyncio.run(main())
    assert stats["tier_blocks"]["device"]["used"] == 0 and client.num_streams == 0


@pytest.mark.slow  # an engine process of its own (~10 s on a 2-core x86 VM)
def test_a_request_the_engine_refuses_is_a_value_error_and_leaves_the_queue_count_alone(moe_model):
    """A hand-off whose manifest names other blocks passes the server's checks (it cannot know
    the engine's block names) and is refused by the engine: the caller gets a ValueError, and
    the refused samples are not counted as waiting."""
    c = EngineClient(str(moe_model), replace(CONFIG, storage="memory://?capacity=64MiB"), max_queue=4)
    try:

        async def main():
            for _ in range(6):  # more than max_queue: a leak in the count would turn into QueueFull
                req = c.make_request(
                    [1, 2, 3], GREEDY, handoff={"first_token": 1, "num_tokens": 3, "keys": ["nope"], "namespace": "nope"}
                )
                with pytest.raises(ValueError, match="handoff.namespace"):
                    await collect(c, req)
            return await collect(c, c.make_request([1, 2, 3], GREEDY))

        _, out = asyncio.run(main())
        assert len(out.token_ids) == GREEDY.max_tokens
        with pytest.raises(ValueError, match=r"200 samples in one request.*--max-queue 4"):
            check_samples(200, 4)
        with pytest.raises(ValueError, match="n=5 .*|5 samples"):
            c.make_request([1, 2, 3], kvtier.SamplingParams(max_tokens=2, n=5))
    finally:
        c.shutdown()


def test_owner_and_priority_travel_to_the_engine_process(client):
    """What the server's make_request set arrives in the message the engine turns into its own
    request (engine/wire.py, engine/loop.py), and reaches the engine's make_request."""
    from types import SimpleNamespace

    from kvtier.engine.loop import make_request
    from kvtier.engine.wire import decode_command, encode

    req = client.make_request([1, 2, 3], GREEDY, "salt", "r-7", owner="cmpl-abc", priority=-4)
    assert (req.owner, req.priority) == ("cmpl-abc", -4)
    arrived = decode_command(encode(req))
    assert arrived == req and isinstance(arrived, EngineRequest)
    got: list[tuple[tuple, dict]] = []
    # (a text model: its config has no vision tower)
    stand_in = SimpleNamespace(make_request=lambda *a, **kw: got.append((a, kw)), config=SimpleNamespace(vision=None))
    make_request(stand_in, arrived)  # type: ignore[arg-type]  # a stand-in for the core: it records the call
    ((args, kw),) = got
    assert args == ([1, 2, 3], GREEDY, "salt", "r-7") and (kw["owner"], kw["priority"]) == ("cmpl-abc", -4)
    mine = client.make_request([1, 2, 3], GREEDY)  # no owner: its own
    assert mine.owner == mine.request_id and mine.priority == 0
    with pytest.raises(ValueError, match="priority must be an int in"):
        client.make_request([1, 2, 3], GREEDY, priority=2**31)


def test_the_queue_bound_counts_samples(client):
    async def main():
        first = client.generate(client.make_request([1, 2, 3], kvtier.SamplingParams(max_tokens=100, n=6, ignore_eos=True)))
        task = asyncio.ensure_future(first.__anext__())
        await asyncio.sleep(0)
        with pytest.raises(QueueFull, match="samples are waiting"):
            await collect(client, client.make_request([4, 5, 6], kvtier.SamplingParams(max_tokens=4, n=3)))
        await task
        await first.aclose()

    asyncio.run(main())


@pytest.mark.slow  # an engine process of its own (~10 s on a 2-core x86 VM)
def test_a_killed_engine_process_fails_its_requests(moe_model):
    dead: list[BaseException] = []
    c = EngineClient(str(moe_model), CONFIG, on_dead=dead.append)
    try:

        async def main():
            agen = c.generate(c.make_request([1, 2, 3], kvtier.SamplingParams(max_tokens=120, ignore_eos=True)))
            await agen.__anext__()
            assert c.engine_pid is not None  # (a process of its own)
            os.kill(c.engine_pid, signal.SIGKILL)
            with pytest.raises(EngineDead, match="exited"):
                async for _ in agen:
                    pass

        asyncio.run(asyncio.wait_for(main(), 60))
        assert dead and isinstance(c.error, EngineDead)
        with pytest.raises(EngineDead):
            c.make_request([1, 2, 3], GREEDY)
    finally:
        c.shutdown(timeout=5)


def test_bad_options_are_the_start_s_value_error(moe_model):
    with pytest.raises(ValueError, match="block_size"):
        EngineClient(str(moe_model), replace(CONFIG, block_size=7))


@pytest.mark.slow  # an engine process of its own (~10 s on a 2-core x86 VM)
def test_an_engine_process_does_not_outlive_its_server(moe_model, tmp_path):
    """A server killed with SIGKILL runs no cleanup: its engine process sees it gone and exits
    (else it would hold its GPU memory until someone found it)."""
    import subprocess
    import sys
    import time

    script = tmp_path / "server.py"
    script.write_text(
        "import sys, time\n"
        "from kvtier.engine.client import EngineClient\n"
        "from kvtier.engine.config import EngineConfig\n"
        "if __name__ == '__main__':\n"
        f"    c = EngineClient({str(moe_model)!r}, EngineConfig(block_size=8, num_device_blocks=16, max_model_len=64))\n"
        "    print(c.engine_pid, flush=True)\n"
        "    time.sleep(600)\n"
    )
    server = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        engine_pid = int(server.stdout.readline())
        server.kill()
        server.wait(30)
        for _ in range(600):  # polled: the engine notices within one idle wait
            try:
                os.kill(engine_pid, 0)
            except ProcessLookupError:
                return
            try:  # a zombie (exited, not yet reaped by init) counts as gone
                if open(f"/proc/{engine_pid}/stat").read().split()[2] == "Z":
                    return
            except OSError:
                return
            time.sleep(0.1)
        pytest.fail(f"engine process {engine_pid} still runs 60 s after its server was killed")
    finally:
        server.kill()
