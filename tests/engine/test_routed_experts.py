"""R3 through the engine: routed experts returned by generate() equal transformers' own router
top-k on prompt + generated tokens, survive every cache path unchanged, and replay in HF."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvtier
from kvtier.experts import replay

MOE = ["mixtral-tiny", "qwen2-moe-tiny", "qwen3-moe-tiny"]
SP = kvtier.SamplingParams(max_tokens=8, ignore_eos=True, return_routed_experts=True)


def prompts_for(seed: int, lengths=(5, 23, 41)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


def hf_router_topk(hf, tokens: list[int], top_k: int) -> np.ndarray:
    """[len(tokens), num_moe_layers, top_k] from transformers' router logits (sorted per token)."""
    with torch.no_grad():
        logits = hf(torch.tensor([tokens]), output_router_logits=True).router_logits
    ids = torch.stack([torch.topk(torch.softmax(x.float(), -1), top_k, dim=-1).indices for x in logits], dim=1)
    return ids.numpy()


def hf_logprobs(hf, tokens: list[int]) -> np.ndarray:
    logits = hf(torch.tensor([tokens])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens[1:])[:, None]).squeeze(1).detach().numpy()


@pytest.mark.parametrize("preset", MOE)
def test_routed_experts_equal_transformers_router_topk(preset, checkpoint, hf_model):
    path = checkpoint(preset)
    hf = hf_model(path)
    prompts = prompts_for(1)
    with kvtier.LLM(path, num_device_blocks=64, block_size=8) as llm:
        batched = llm.generate(prompts, SP)
        top_k = llm.config.top_k
        for p, o in zip(prompts, batched):
            seq = p + o.token_ids
            got = o.routed_experts
            assert got.shape == (len(seq) - 1, llm.config.num_moe_layers, top_k)
            assert got.dtype == np.uint8
            want = hf_router_topk(hf, seq[:-1], top_k)
            assert np.array_equal(np.sort(got, -1), np.sort(want, -1))
    with kvtier.LLM(path, num_device_blocks=64, block_size=8) as llm:
        alone = [llm.generate([p], SP)[0] for p in prompts]
    with kvtier.LLM(path, num_device_blocks=64, block_size=8, max_num_batched_tokens=6) as llm:
        chunked = llm.generate(prompts, SP)  # prefill in chunks of <= 6 tokens
    for other in (alone, chunked):
        for a, b in zip(other, batched):
            assert a.token_ids == b.token_ids and np.array_equal(a.routed_experts, b.routed_experts)


@pytest.mark.parametrize("preset", ["qwen3-moe-tiny", "mixtral-tiny"])
def test_prefix_hits_return_the_routing_of_a_cold_run(preset, checkpoint):
    path = checkpoint(preset)
    prompts = prompts_for(2, lengths=(60, 60, 60))
    with kvtier.LLM(path, num_device_blocks=256, block_size=8, enable_prefix_caching=False) as llm:
        cold = llm.generate(prompts, SP)
    # device hit
    with kvtier.LLM(path, num_device_blocks=256, block_size=8) as llm:
        llm.generate(prompts, SP)
        warm = llm.generate(prompts, SP)
        assert all(o.cached_tokens_by_tier["device"] > 0 for o in warm)
    # preemption: two running 68-token sequences need 18 blocks of 8 tokens, the tier has 17
    with kvtier.LLM(path, num_device_blocks=17, block_size=8) as llm:
        tight = llm.generate(prompts, SP)
        assert llm.scheduler.num_preemptions > 0
    # host hit: the device tier holds one prompt, the host tier the rest
    with kvtier.LLM(path, num_device_blocks=12, block_size=8, num_host_blocks=64, write_policy="write_through") as llm:
        llm.generate(prompts, SP)
        host = [llm.generate([p], SP)[0] for p in prompts]
        assert any(o.cached_tokens_by_tier["host"] > 0 for o in host)
    # storage hit: routing travels inside the storage object with its KV
    with kvtier.LLM(
        path,
        num_device_blocks=10,
        block_size=8,
        num_host_blocks=8,
        write_policy="write_through",
        storage="memory://?capacity=16MiB",
    ) as llm:
        llm.generate(prompts, SP)
        stored = [llm.generate([p], SP)[0] for p in prompts]
        assert any(o.cached_tokens_by_tier["storage"] > 0 for o in stored)
    for other in (warm, tight, host, stored):
        for c, o in zip(cold, other):
            assert o.token_ids == c.token_ids
            assert np.array_equal(o.routed_experts, c.routed_experts)


@pytest.mark.parametrize("preset", MOE)
def test_hf_replay_of_captured_routing_gives_engine_logprobs(preset, checkpoint, hf_model):
    path = checkpoint(preset)
    hf = hf_model(path)
    with kvtier.LLM(path, num_device_blocks=64) as llm:
        o = llm.generate(prompts_for(3, lengths=(19,)), SP)[0]
        seq = o.prompt_token_ids + o.token_ids
        engine = llm.score(seq, routed_experts=o.routed_experts)
        assert np.allclose(engine, llm.score(seq), atol=1e-5)  # the routing the engine chose itself
    with replay(hf, o.routed_experts):
        replayed = hf_logprobs(hf, seq)
    assert np.allclose(replayed, engine, atol=1e-4)


def test_replay_changes_routing_and_keeps_gradients(checkpoint, hf_model):
    path = checkpoint("qwen3-moe-tiny")
    hf = hf_model(path)
    seq = prompts_for(4, lengths=(12,))[0]
    top_k, layers = 2, 2
    other = np.zeros((len(seq) - 1, layers, top_k), dtype=np.int64)
    other[..., 1] = 1  # experts 0 and 1 for every token
    base = hf_logprobs(hf, seq)
    with kvtier.LLM(path, num_device_blocks=64) as llm:
        engine_forced = llm.score(seq, routed_experts=other)
    with replay(hf, other):
        forced = hf_logprobs(hf, seq)
        loss = -torch.log_softmax(hf(torch.tensor([seq])).logits[0, :-1], -1).mean()
        loss.backward()
    assert not np.allclose(forced, base, atol=1e-3)
    assert np.allclose(forced, engine_forced, atol=1e-4)
    router = next(m for m in hf.modules() if type(m).__name__.endswith("TopKRouter"))
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    hf.zero_grad(set_to_none=True)


def test_bad_routed_experts_are_rejected(checkpoint, hf_model):
    path = checkpoint("qwen3-moe-tiny")
    seq = list(range(1, 11))
    good = np.zeros((9, 2, 2), dtype=np.uint8)
    with kvtier.LLM(path, num_device_blocks=64) as llm:
        with pytest.raises(ValueError, match=r"shape \(8, 2, 2\), expected \(9, 2, 2\)"):
            llm.score(seq, routed_experts=good[:8])
        with pytest.raises(ValueError, match="integer dtype"):
            llm.score(seq, routed_experts=good.astype(np.float32))
        with pytest.raises(ValueError, match="expert id 8"):
            llm.score(seq, routed_experts=good + 8)
        with pytest.raises(ValueError, match="numpy array"):
            llm.score(seq, routed_experts=[[0, 1]])
    with pytest.raises(ValueError, match="outside 0..7"):
        with replay(hf_model(path), good + 9):
            pass
    with pytest.raises(ValueError, match="expected"):
        with replay(hf_model(path), good[:, :1]):
            pass
