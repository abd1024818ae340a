"""Tensor parallelism on two GPUs (NCCL, CUDA graphs, overlap scheduling, the host tier's copy
kernels): fp32 ``qwen3-0.6b-shape`` and ``qwen3-moe-small`` with real random weights give at
TP=2 the greedy tokens, routed experts and cache hits of TP=1, through device hits, host hits,
swap preemption, storage hits and a PD hand-off. The CPU twin is tests/engine/test_tensor_parallel.py
(same workloads, gloo)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import kvtier
from kvtier.model import init_model
from tests.engine.test_tensor_parallel import TIERS, workload

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs two CUDA GPUs (2x H200 run it: python -m pytest tests/engine/test_tensor_parallel_gpu.py)",
)


@pytest.mark.parametrize("preset", ["qwen3-0.6b-shape", "qwen3-moe-small"])
def test_two_gpus_give_what_one_gives_through_every_tier(preset, tmp_path):
    path = init_model(preset, tmp_path / preset, seed=0, dtype=torch.float32)
    moe = preset.endswith("small")
    runs, graphs = {}, {}
    for tp in (1, 2):
        with kvtier.LLM(path, device="cuda", dtype="float32", tensor_parallel_size=tp, max_model_len=512, **TIERS) as llm:
            runs[tp] = workload(llm, moe)
            assert llm.scheduler.num_preemptions > 0 and llm.cache.stats.swapped_out_blocks > 0, tp
            stats = llm.cache_stats()
            assert stats["host"]["hit_tokens"] > 0 and stats["device"]["hit_tokens"] > 0, stats
            assert llm.transfer.num_in_flight == 0
            graphs[tp] = llm.runner.decode_graphs.runs if llm.runner.decode_graphs is not None else 0
    for a, b in zip(runs[1], runs[2]):
        assert a[:4] == b[:4]  # tokens, routed experts, hits per tier, top-k ids
    assert graphs[2] > 0  # decode steps replayed CUDA graphs holding NCCL all-reduces


def test_two_gpus_read_the_pool_and_take_a_pd_hand_off_as_one_gpu(tmp_path):
    """fp32 ``qwen3-moe-small``: blocks each rank wrote to a file pool come back as storage hits
    with the tokens and experts of one GPU; a decode engine of two ranks started from a prefill
    engine's hand-off (every rank's shard through the pool) continues as one GPU does."""
    from tests.engine.test_handoff import run
    from tests.engine.test_tensor_parallel import pool_run

    path = init_model("qwen3-moe-small", tmp_path / "m", seed=0, dtype=torch.float32)
    gpu: dict[str, Any] = dict(device="cuda", dtype="float32", max_model_len=512)
    prompts = [p[:56] for p in (list(range(3, 400, 7)), list(range(5, 600, 9)))]
    one = pool_run(path, f"file://{tmp_path / 'one'}", 1, prompts, True, **gpu)
    two = pool_run(path, f"file://{tmp_path / 'two'}", 2, prompts, True, **gpu)
    assert one == two
    assert all(hits["storage"] >= 48 for _, _, hits in two), two
    kw = dict(storage=f"file://{tmp_path / 'pd'}", num_host_blocks=64, block_size=8, tensor_parallel_size=2, **gpu)
    with kvtier.LLM(path, **kw) as p:
        first = run(p, prompt=prompts[0], params=kvtier.SamplingParams(max_tokens=1), export=True)
    h = first.handoff
    assert h["complete"] and h["failed_blocks"] == 0 and h["tensor_parallel_size"] == 2
    with kvtier.LLM(path, **kw) as d:
        out = run(
            d,
            prompt=prompts[0],
            params=kvtier.SamplingParams(max_tokens=10, ignore_eos=True, return_routed_experts=True),
            handoff=h,
        )
    assert out.cached_tokens_by_tier == {"device": 0, "host": 0, "storage": 56}
    assert out.token_ids == one[0][0] and out.routed_experts.tolist() == one[0][1]
