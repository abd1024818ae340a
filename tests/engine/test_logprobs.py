"""Logprobs and prompt logprobs equal what transformers computes on the same weights and token ids
(fp32 on CPU): ``log_softmax`` of HF's logits for raw mode, the distribution built by hand from
HF's logits for processed mode; prefix hits on any tier, chunked prefill and batching never
change them."""

from __future__ import annotations

import math

import pytest
import torch

import kvtier

TOL = 1e-4


def prompts_for(seed: int, lengths=(5, 21, 37)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def hf_logits(checkpoint, hf_model):
    """hf_logits(preset, token_ids) -> HF's float32 logits [len, vocab] (position j scores j+1)."""

    def get(preset, ids):
        with torch.no_grad():
            return hf_model(checkpoint(preset))(torch.tensor([ids])).logits[0].float()

    return get


def assert_entry(entry: dict, token: int, ref_row: torch.Tensor, k: int) -> None:
    """``entry`` is {token: logprob} + the top-k of ``ref_row`` (log-probabilities), all to TOL."""
    top = torch.topk(ref_row, k).indices.tolist() if k else []
    assert set(entry) == {token, *top}
    assert list(entry)[0] == token  # the sampled (or prompt) token first
    for t, v in entry.items():
        want = ref_row[t].item()
        assert (v == want == -math.inf) or abs(v - want) <= TOL, (t, v, want)


def check_raw(out, preset, hf_logits, k: int, prompt_k: int | None) -> None:
    """out's logprobs (raw) and prompt logprobs against HF on prompt + generated tokens."""
    ids = out.prompt_token_ids + out.token_ids
    ref = torch.log_softmax(hf_logits(preset, ids), dim=-1)
    p = len(out.prompt_token_ids)
    assert len(out.outputs[0].logprobs) == len(out.token_ids)
    for i, (tok, entry) in enumerate(zip(out.token_ids, out.outputs[0].logprobs)):
        assert_entry(entry, tok, ref[p - 1 + i], k)
    if prompt_k is None:
        assert out.prompt_logprobs is None
        return
    assert len(out.prompt_logprobs) == p and out.prompt_logprobs[0] is None
    for j in range(1, p):
        assert_entry(out.prompt_logprobs[j], out.prompt_token_ids[j], ref[j - 1], prompt_k)


PARAMS = [
    kvtier.SamplingParams(max_tokens=8, ignore_eos=True, logprobs=5, prompt_logprobs=3),
    kvtier.SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0, seed=3, logprobs=0, prompt_logprobs=0),
    kvtier.SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.8, top_p=0.9, logprobs=20),
]


@pytest.mark.parametrize("preset", ["llama-tiny", "qwen3-moe-tiny"])
@pytest.mark.parametrize("chunk", [2048, 7])
def test_raw_logprobs_and_prompt_logprobs_equal_transformers(preset, chunk, checkpoint, hf_logits):
    prompts = prompts_for(1)
    with kvtier.LLM(checkpoint(preset), num_device_blocks=128, block_size=8, max_num_batched_tokens=chunk) as llm:
        # a batch mixing greedy / sampled rows, k = 5, 0 and 20, with and without prompt logprobs,
        # plus a request asking for nothing (its output carries none)
        outs = llm.generate(prompts, list(PARAMS))
        plain = llm.generate(prompts[:1], kvtier.SamplingParams(max_tokens=4, ignore_eos=True))[0]
    for out, sp in zip(outs, PARAMS):
        check_raw(out, preset, hf_logits, sp.logprobs, sp.prompt_logprobs)
    assert plain.outputs[0].logprobs is None and plain.prompt_logprobs is None


@pytest.mark.parametrize("preset", ["llama-tiny", "qwen3-moe-tiny"])
def test_device_and_host_hits_do_not_change_logprobs(preset, checkpoint, hf_logits):
    a, b = prompts_for(2, lengths=(60, 60))
    gen = kvtier.SamplingParams(max_tokens=6, ignore_eos=True, logprobs=4)
    both = kvtier.SamplingParams(max_tokens=6, ignore_eos=True, logprobs=4, prompt_logprobs=2)
    with kvtier.LLM(
        checkpoint(preset), num_device_blocks=12, block_size=8, num_host_blocks=64, write_policy="write_through"
    ) as llm:
        cold = llm.generate([a], gen)[0]
        check_raw(cold, preset, hf_logits, 4, None)
        warm = llm.generate([a], gen)[0]  # device hits
        assert warm.cached_tokens_by_tier["device"] > 0
        check_raw(warm, preset, hf_logits, 4, None)
        # prompt logprobs need every prompt position's logits: no hits for that request
        scored = llm.generate([a], both)[0]
        assert scored.num_cached_tokens == 0
        check_raw(scored, preset, hf_logits, 4, 2)
        llm.generate([b], gen)  # pushes a's blocks to the host tier
        host = llm.generate([a], gen)[0]
        assert host.cached_tokens_by_tier["host"] > 0
        check_raw(host, preset, hf_logits, 4, None)
        llm.generate([b], gen)
        scored = llm.generate([a], both)[0]
        assert scored.num_cached_tokens == 0
        check_raw(scored, preset, hf_logits, 4, 2)
        again = llm.generate([a], gen)[0]  # its blocks were still committed
        assert again.cached_tokens_by_tier["device"] > 0
        check_raw(again, preset, hf_logits, 4, None)


def test_storage_hits_do_not_change_logprobs(checkpoint, hf_logits, tmp_path):
    preset = "llama-tiny"
    a = prompts_for(3, lengths=(60,))[0]
    gen = kvtier.SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3)
    both = kvtier.SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=3)
    url = f"file://{tmp_path}/pool"
    kw = dict(num_device_blocks=16, block_size=8, num_host_blocks=16, storage=url, write_policy="write_through")
    with kvtier.LLM(checkpoint(preset), **kw) as llm:
        check_raw(llm.generate([a], gen)[0], preset, hf_logits, 3, None)
    with kvtier.LLM(checkpoint(preset), **kw) as llm:  # a second engine: only the pool has a
        hit = llm.generate([a], gen)[0]
        assert hit.cached_tokens_by_tier["storage"] > 0
        check_raw(hit, preset, hf_logits, 3, None)
    with kvtier.LLM(checkpoint(preset), **kw) as llm:
        scored = llm.generate([a], both)[0]
        assert scored.num_cached_tokens == 0
        check_raw(scored, preset, hf_logits, 3, 3)


def by_hand(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Log of the distribution a token is drawn from: softmax(logits / T), the top-k kept, then
    the smallest set of most likely tokens whose mass reaches top_p kept, renormalized."""
    p = torch.softmax(logits.double() / temperature, dim=-1)
    if top_k:
        p[p < torch.topk(p, top_k).values[-1]] = 0
        p /= p.sum()
    if top_p < 1:
        sp, order = p.sort(descending=True)
        keep = sp.cumsum(0) - sp < top_p
        p = torch.zeros_like(p).scatter(0, order, sp * keep)
        p /= p.sum()
    return p.log()


@pytest.mark.parametrize("preset", ["llama-tiny", "qwen3-moe-tiny"])
@pytest.mark.parametrize("top_k,top_p", [(12, 1.0), (0, 0.8), (30, 0.9)])
def test_processed_logprobs_are_the_distribution_drawn_from(preset, top_k, top_p, checkpoint, hf_logits):
    prompt = prompts_for(4, lengths=(13,))[0]
    sp = kvtier.SamplingParams(
        max_tokens=10, ignore_eos=True, temperature=0.7, top_k=top_k, top_p=top_p, seed=11, logprobs=5, logprobs_mode="processed"
    )
    greedy = kvtier.SamplingParams(max_tokens=10, ignore_eos=True, logprobs=5, logprobs_mode="processed")
    with kvtier.LLM(checkpoint(preset), num_device_blocks=64) as llm:
        out, g = llm.generate([prompt, prompt], [sp, greedy])
    ref = hf_logits(preset, out.prompt_token_ids + out.token_ids)
    for i, (tok, entry) in enumerate(zip(out.token_ids, out.outputs[0].logprobs)):
        want = by_hand(ref[len(prompt) - 1 + i], 0.7, top_k, top_p).float()
        assert want[tok] > -math.inf  # drawn from the kept set
        assert_entry(entry, tok, want, 5)
    # greedy rows: log_softmax of the logits (no penalties here)
    ref = torch.log_softmax(hf_logits(preset, g.prompt_token_ids + g.token_ids), dim=-1)
    for i, (tok, entry) in enumerate(zip(g.token_ids, g.outputs[0].logprobs)):
        assert tok == int(ref[len(prompt) - 1 + i].argmax())
        assert_entry(entry, tok, ref[len(prompt) - 1 + i], 5)


def test_processed_logprobs_of_a_greedy_row_are_after_penalties(checkpoint, hf_logits):
    preset = "llama-tiny"
    prompt = prompts_for(5, lengths=(9,))[0]
    sp = kvtier.SamplingParams(
        max_tokens=6,
        ignore_eos=True,
        logprobs=3,
        logprobs_mode="processed",
        repetition_penalty=1.5,
        presence_penalty=0.5,
        frequency_penalty=0.25,
    )
    with kvtier.LLM(checkpoint(preset), num_device_blocks=64) as llm:
        out = llm.generate([prompt], sp)[0]
    ids = out.prompt_token_ids + out.token_ids
    logits = hf_logits(preset, ids)
    for i, (tok, entry) in enumerate(zip(out.token_ids, out.outputs[0].logprobs)):
        row = logits[len(prompt) - 1 + i].clone()
        seen = torch.tensor(sorted(set(ids[: len(prompt) + i])))
        row[seen] = torch.where(row[seen] > 0, row[seen] / 1.5, row[seen] * 1.5)
        counts = torch.bincount(torch.tensor(out.token_ids[:i], dtype=torch.long), minlength=row.numel())
        row = row - 0.25 * counts - 0.5 * (counts > 0)
        want = torch.log_softmax(row, dim=-1)
        assert tok == int(want.argmax())
        assert_entry(entry, tok, want, 3)
