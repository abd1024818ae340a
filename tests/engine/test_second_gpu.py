"""An engine on a GPU other than the process's first (``--device cuda:1``, as a PD decode server
on its own GPU is started): every stream, event, capture and kernel launch must be on that GPU,
also from a thread whose current device is still cuda:0 (the server's engine thread, a new
thread's default). Its fp32 greedy tokens, cold and from every cache tier, equal the same
engine's on cuda:0, and the forwards leave cuda:0 untouched.

Needs two GPUs (an H100 x2 host runs it); on fewer it is skipped with that reason."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

import kvtier

pytestmark = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (2x H100 80GB run it): the engine goes on cuda:1"
)
SP = kvtier.SamplingParams(max_tokens=16, ignore_eos=True)


def _prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, 256, (70,), generator=g).tolist()
    return [base + torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 33, 80)]


def _run(path, device: str) -> list[list[int]]:
    """Cold, then the same prompts again (device hits), from a thread whose current device is cuda:0."""
    out: list = []

    def go() -> None:
        torch.cuda.set_device(0)
        with kvtier.LLM(path, device=device, dtype="float32", num_device_blocks=64, num_host_blocks=128, block_size=16) as llm:
            prompts = _prompts(3)
            out.append([o.token_ids for o in llm.generate(prompts, SP)])
            out.append([o.token_ids for o in llm.generate(prompts, SP)])
            llm.generate(_prompts(4) * 2, SP)  # evicts to the host tier
            out.append([o.token_ids for o in llm.generate(prompts, SP)])

    t = threading.Thread(target=go)
    t.start()
    t.join()
    assert len(out) == 3
    return out


@pytest.mark.parametrize("preset", ["qwen3-tiny", "qwen3-moe-tiny"])
def test_an_engine_on_the_second_gpu_answers_as_on_the_first(preset, checkpoint):
    path = checkpoint(preset)
    want = _run(path, "cuda:0")
    torch.cuda.synchronize(0)
    used0 = torch.cuda.memory_allocated(0)
    got = _run(path, "cuda:1")
    assert got == want
    assert got[0] == got[1] == got[2]  # cold == device hit == host hit
    assert torch.cuda.memory_allocated(0) == used0  # nothing of the cuda:1 engine on cuda:0


def test_a_served_engine_on_the_second_gpu_answers_as_on_the_first(checkpoint):
    """Through an engine served on a thread of this process, which starts with cuda:0 current."""
    from kvtier.engine.client import EngineClient
    from kvtier.engine.core import EngineCore

    path = checkpoint("qwen3-tiny")

    def serve(device: str) -> list[list[int]]:
        engine = EngineClient.in_thread(EngineCore(path, device=device, dtype="float32", num_device_blocks=64, block_size=16))
        try:

            async def one(p):
                ids: list[int] = []
                async for d in engine.generate(engine.make_request(p, SP)):
                    ids += [t for s in d.samples for t in s.token_ids]
                return ids

            async def go():
                return await asyncio.gather(*(one(p) for p in _prompts(5)))

            return asyncio.run(go())
        finally:
            engine.shutdown()

    assert serve("cuda:1") == serve("cuda:0")
