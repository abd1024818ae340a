"""Speculative decoding on a GPU (CUDA graphs, the Triton attention kernels, the host tier's copy
kernels): fp32 ``qwen3-mtp-tiny`` and ``qwen3-moe-mtp-tiny`` give with drafts the greedy tokens,
routed experts and hits per tier of the engine without drafts, through device and host hits and
swap preemption, with the target forward of drafted steps replayed from step graphs. The CPU twin
is tests/engine/test_speculative.py (same workload)."""

from __future__ import annotations

import pytest
import torch

import kvtier
from kvtier.model import init_model
from tests.engine.test_speculative import TIERS, oracle_drafter, run, workload

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU (one H100 80GB runs it: python -m pytest tests/engine/test_speculative_gpu.py)",
)


@pytest.mark.parametrize("preset", ["qwen3-mtp-tiny", "qwen3-moe-mtp-tiny"])
@pytest.mark.parametrize("alpha", [0.7, None])
def test_drafted_steps_on_a_gpu_give_the_tokens_of_plain_decoding(preset, alpha, tmp_path):
    path = init_model(preset, tmp_path / preset, seed=0)
    moe = "moe" in preset
    params = kvtier.SamplingParams(max_tokens=23, ignore_eos=True, return_routed_experts=moe)
    gpu = dict(device="cuda", dtype="float32", max_model_len=512, **TIERS)
    with kvtier.LLM(path, **gpu) as llm:
        ref = run(llm, params)
    first, other = workload()
    outputs = {tuple(p): r[0] for p, r in zip(first + other, ref)}
    with kvtier.LLM(path, num_speculative_tokens=3, **gpu) as llm:
        if alpha is not None:
            llm.spec.drafter = oracle_drafter(outputs, alpha)
        got = run(llm, params)
        spec = llm.cache_stats()["speculative"]
        steps = llm.runner.step_graphs.runs if llm.runner.step_graphs is not None else 0
        assert llm.scheduler.num_preemptions > 0
        llm.cache.assert_invariants()
    assert got == ref
    assert spec["drafted"] > 0 and steps > 0  # drafted steps replayed step graphs
    if alpha:
        assert spec["accepted"] > 0
