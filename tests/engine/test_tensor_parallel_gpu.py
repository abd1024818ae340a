"""Tensor parallelism on two GPUs (NCCL, CUDA graphs, overlap scheduling, the host tier's copy
kernels): fp32 ``qwen3-0.6b-shape`` and ``qwen3-moe-small`` with real random weights give at
TP=2 the greedy tokens, routed experts and cache hits of TP=1, through device hits, host hits and
swap preemption. The CPU twin is tests/engine/test_tensor_parallel.py (same workload, gloo)."""
from __future__ import annotations

import pytest
import torch

import kvtier
from kvtier.model import init_model
from tests.engine.test_tensor_parallel import TIERS, workload

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs two CUDA GPUs (2x H100 80GB run it: python -m pytest tests/engine/test_tensor_parallel_gpu.py)",
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
        assert a[:4] == b[:4]                     # tokens, routed experts, hits per tier, top-k ids
    assert graphs[2] > 0                          # decode steps replayed CUDA graphs holding NCCL all-reduces
