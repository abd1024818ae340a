"""The engine on CUDA with the Triton attention backend: fp32 tokens equal transformers', bf16
logprobs within tolerance, cache hits (device, host) and routing identical to a cold run."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import kvtier

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (one H100 80GB runs it: PYTHONPATH=$PWD pytest tests/engine)"
)
FAMILIES = ["llama-tiny", "mistral-tiny", "qwen2-tiny", "qwen3-tiny", "mixtral-tiny", "qwen2-moe-tiny", "qwen3-moe-tiny"]
SP = kvtier.SamplingParams(max_tokens=12, ignore_eos=True)


def prompts_for(seed, lengths=(3, 17, 40, 66)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(hf, p, n=12):
    ids = torch.tensor([p], device="cuda")
    with torch.no_grad():
        out = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
        )
    return out[0, len(p) :].tolist()


@pytest.mark.parametrize("preset", FAMILIES)
def test_fp32_cuda_triton_matches_transformers(preset, checkpoint, hf_model):
    path = checkpoint(preset)
    hf = hf_model(path).to("cuda")
    prompts = prompts_for(1)
    want = [hf_greedy(hf, p) for p in prompts]
    hf.to("cpu")
    with kvtier.LLM(path, device="cuda", dtype="float32", num_device_blocks=128, block_size=16) as llm:
        assert [o.token_ids for o in llm.generate(prompts, SP)] == want
        warm = llm.generate(prompts, SP)
        assert [o.token_ids for o in warm] == want and warm[-1].num_cached_tokens > 0


@pytest.mark.parametrize("preset", ["qwen3-tiny", "qwen3-moe-tiny"])
def test_bf16_logprobs_close_to_fp32_reference(preset, checkpoint, hf_model):
    path = checkpoint(preset)
    hf = hf_model(path)
    seq = prompts_for(2, lengths=(80,))[0]
    with torch.no_grad():
        logits = hf(torch.tensor([seq])).logits[0, :-1].float()
    ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(seq[1:])[:, None]).squeeze(1).numpy()
    with kvtier.LLM(path, device="cuda", dtype="bfloat16", num_device_blocks=64) as llm:
        got = llm.score(seq)
    err = np.abs(got - ref)
    if preset.endswith("moe-tiny"):
        # bf16 can flip a near-tie between two experts: a few tokens then differ more
        assert np.median(err) < 0.05 and np.mean(err < 0.15) > 0.9, err
    else:
        assert err.max() < 0.15, err.max()


@pytest.mark.parametrize("preset", ["llama-tiny", "qwen3-moe-tiny"])
def test_bf16_cache_hits_on_every_tier_equal_cold(preset, checkpoint):
    path = checkpoint(preset)
    prompts = prompts_for(3, lengths=(60, 60, 60))
    sp = kvtier.SamplingParams(max_tokens=12, ignore_eos=True, return_routed_experts=preset.endswith("moe-tiny"))
    with kvtier.LLM(
        path, device="cuda", dtype="bfloat16", num_device_blocks=256, block_size=8, enable_prefix_caching=False
    ) as llm:
        cold = [llm.generate([p], sp)[0] for p in prompts]
    with kvtier.LLM(
        path,
        device="cuda",
        dtype="bfloat16",
        num_device_blocks=12,
        block_size=8,
        num_host_blocks=64,
        write_policy="write_through",
    ) as llm:
        llm.generate(prompts, sp)
        warm = [llm.generate([p], sp)[0] for p in prompts]
        assert any(o.cached_tokens_by_tier["host"] > 0 for o in warm)
        # the host hits' steps were replayed from step graphs, after waiting for their loads
        assert llm.runner.graph_steps_after_loads > 0
    for c, w in zip(cold, warm):
        assert w.token_ids == c.token_ids
        if c.routed_experts is not None:
            assert np.array_equal(w.routed_experts, c.routed_experts)


@pytest.mark.parametrize("preset", ["qwen3-tiny", "llama-tiny", "qwen3-moe-tiny", "mixtral-tiny"])
def test_cuda_graph_decode_equals_eager(preset, checkpoint):
    path = checkpoint(preset)
    prompts = prompts_for(4, lengths=(5, 19, 33, 47, 61))  # 5 sequences: bucket 8
    sp = kvtier.SamplingParams(max_tokens=12, ignore_eos=True, return_routed_experts="moe" in preset)
    outs: dict[bool, list[kvtier.RequestOutput]] = {}  # by graphs on / off
    hits: dict[bool, kvtier.RequestOutput] = {}  # a device hit's short extend over the cached prompt
    for graphs in (True, False):
        with kvtier.LLM(path, device="cuda", dtype="float32", num_device_blocks=128, cuda_graphs=graphs) as llm:
            assert (llm.runner.decode_graphs is not None) == graphs
            outs[graphs] = llm.generate(prompts, sp)
            if graphs:
                assert llm.runner.decode_graphs.runs, "no decode step was replayed from a graph"
                assert llm.runner.step_graphs.runs, "no prefill step was replayed from a graph"
                before = llm.runner.step_graphs.runs
                hits[graphs] = llm.generate([prompts[-1] + [3, 4, 5]], sp)[0]
                assert llm.runner.step_graphs.runs > before  # the hit's extend, replayed too
            else:
                hits[graphs] = llm.generate([prompts[-1] + [3, 4, 5]], sp)[0]
    assert hits[True].token_ids == hits[False].token_ids
    for a, b in zip(outs[True], outs[False]):
        assert a.token_ids == b.token_ids
        if a.routed_experts is not None:
            assert np.array_equal(a.routed_experts, b.routed_experts)


@pytest.mark.parametrize("preset", ["llama-tiny", "qwen3-moe-tiny"])
@pytest.mark.parametrize("prefetch_policy", ["best_effort", "wait_complete"])
def test_bf16_storage_hits_in_a_fresh_engine_equal_cold(preset, prefetch_policy, checkpoint, tmp_path):
    """Worker threads fetch into pinned host blocks, then layer-overlapped loads to the GPU."""
    path = checkpoint(preset)
    prompts = prompts_for(5, lengths=(300, 200, 260))
    sp = kvtier.SamplingParams(max_tokens=12, ignore_eos=True, return_routed_experts=preset.endswith("moe-tiny"))
    kw = dict(
        device="cuda",
        dtype="bfloat16",
        block_size=8,
        num_host_blocks=128,
        storage=f"file://{tmp_path}/pool",
        write_policy="write_through",
        storage_fetch="always",
        prefetch_policy=prefetch_policy,
    )
    with kvtier.LLM(
        path, num_device_blocks=256, enable_prefix_caching=False, device="cuda", dtype="bfloat16", block_size=8
    ) as llm:
        cold = [llm.generate([p], sp)[0] for p in prompts]
    with kvtier.LLM(path, num_device_blocks=128, **kw) as llm:
        for p in prompts:
            llm.generate([p], sp)
    with kvtier.LLM(path, num_device_blocks=128, **kw) as llm:  # fresh: device and host are cold
        warm = [llm.generate([p], sp)[0] for p in prompts]
        llm.cache.assert_invariants()
        stats = llm.cache_stats()["storage"]
    assert all(o.cached_tokens_by_tier["storage"] > 0 for o in warm) or prefetch_policy == "best_effort"
    assert sum(o.cached_tokens_by_tier["storage"] for o in warm) > 0 and stats["corrupt"] == 0
    for c, w in zip(cold, warm):
        assert w.token_ids == c.token_ids
        if c.routed_experts is not None:
            assert np.array_equal(w.routed_experts, c.routed_experts)


@pytest.mark.parametrize("n_prompt", [77, 96])
def test_bf16_pd_handoff_on_cuda_equals_colocated(n_prompt, checkpoint, tmp_path):
    """P exports (full blocks + the partial one) through a file pool; D, a second engine on the
    GPU, loads them through its host tier (layer-overlapped H2D) and decodes: tokens and routed
    experts equal a colocated run."""
    from kvtier.engine.core import EngineCore

    path = checkpoint("qwen3-moe-tiny")
    prompt = prompts_for(7, (n_prompt,))[0]
    sp = kvtier.SamplingParams(max_tokens=12, ignore_eos=True, return_routed_experts=True)
    kw: dict[str, Any] = dict(device="cuda", dtype="bfloat16", num_device_blocks=128, num_host_blocks=64, block_size=16)
    with kvtier.LLM(path, **{k: v for k, v in kw.items() if k != "num_host_blocks"}) as colo:
        want = colo.generate([prompt], sp)[0]
    url = f"file://{tmp_path}"
    with EngineCore(path, storage=url, **kw) as p, EngineCore(path, storage=url, storage_fetch="always", **kw) as d:

        def run(core, **add):
            req = core.add_request(**add)
            while True:
                for out in core.step():
                    if out.request_id == req.request_id:
                        return out

        h = run(p, prompt=prompt, params=kvtier.SamplingParams(max_tokens=1), export=True).handoff
        assert h["complete"]
        out = run(d, prompt=prompt, params=sp, handoff=h)
    assert out.token_ids == want.token_ids
    np.testing.assert_array_equal(out.routed_experts, want.routed_experts)
    assert out.cached_tokens_by_tier["storage"] == n_prompt and out.handoff["result"] == "ok"


@pytest.mark.parametrize("preset, dtype", [("qwen3-tiny", "bfloat16"), ("qwen3-moe-tiny", "float32")])
def test_nothing_is_compiled_after_the_engine_started(preset, dtype, checkpoint, tmp_path, monkeypatch):
    """Every Triton kernel variant a step can launch is compiled at start (engine/warmup.py):
    batches of every size, prompts of every length, chunked prefill, device, host and storage
    hits, n > 1, sampling and logprobs afterwards compile nothing more (a compile mid-serving
    is a step of seconds). Run on an empty Triton cache, so a variant the start missed cannot
    hide in the disk cache."""
    from kvtier.triton_jit import num_compiled

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    path = checkpoint(preset)
    with kvtier.LLM(
        path,
        device="cuda",
        dtype=dtype,
        num_device_blocks=96,
        num_host_blocks=256,
        block_size=16,
        max_model_len=512,
        max_num_batched_tokens=256,
        storage=f"file://{tmp_path}/pool",
    ) as llm:
        assert llm.startup.total_s is not None and "compiling kernels" in llm.startup.phases_s
        at_start = num_compiled()
        g = torch.Generator().manual_seed(11)
        for batch in (1, 2, 3, 5, 8, 13, 21):
            prompts = [
                torch.randint(0, 256, (int(n),), generator=g).tolist() for n in torch.randint(1, 480, (batch,), generator=g)
            ]
            llm.generate(prompts, kvtier.SamplingParams(max_tokens=int(torch.randint(1, 24, (1,), generator=g)), ignore_eos=True))
            llm.generate(prompts[:2], kvtier.SamplingParams(max_tokens=5, ignore_eos=True))  # device hits
        llm.generate(
            [prompts[0]],
            kvtier.SamplingParams(
                max_tokens=6,
                n=3,
                temperature=0.8,
                top_k=20,
                top_p=0.9,
                logprobs=3,
                prompt_logprobs=2,
                seed=1,
                repetition_penalty=1.1,
            ),
        )
        assert num_compiled() == at_start, "a Triton kernel was compiled after the start"
        assert llm.startup.kernels_compiled_since_ready == 0
