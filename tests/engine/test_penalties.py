"""Penalties and min_tokens: greedy tokens equal transformers ``generate`` on the same weights
(fp32 CPU) with HF's own repetition penalty and min-new-tokens processors, and with a small
LogitsProcessor written here for OpenAI's presence/frequency formula; rows without penalties
in the same batch are untouched."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

import kvtier
from kvtier.model.tokenizer import EOS_TOKEN_ID

MAX_TOKENS = 16


def prompts_for(seed: int, lengths=(4, 19, 33)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


class OpenAIPenalty(LogitsProcessor):
    """logit -= presence * (count > 0) + frequency * count, counts over the generated tokens."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        out = input_ids[:, self.prompt_len :]
        counts = torch.zeros_like(scores).scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - self.presence * (counts > 0) - self.frequency * counts


@pytest.fixture(scope="module")
def hf_generate(checkpoint, hf_model):
    def run(preset, prompt, max_new_tokens=MAX_TOKENS, **kw):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            seq = hf_model(checkpoint(preset)).generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, **kw
            )
        return seq[0, len(prompt) :].tolist()

    return run


def engine_tokens(checkpoint, preset, prompts, params):
    with kvtier.LLM(checkpoint(preset), num_device_blocks=128, block_size=8) as llm:
        return [o.token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("preset", ["llama-tiny", "qwen3-moe-tiny"])
def test_repetition_penalty_equals_transformers(preset, checkpoint, hf_generate):
    prompts = prompts_for(1)
    # min_tokens = max_tokens: EOS masked all along, as HF's min_new_tokens does
    pen = kvtier.SamplingParams(max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, repetition_penalty=1.3)
    plain = kvtier.SamplingParams(max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
    got = engine_tokens(checkpoint, preset, prompts + prompts[:1], [pen] * len(prompts) + [plain])
    for p, tokens in zip(prompts, got):
        assert tokens == hf_generate(preset, p, repetition_penalty=1.3, min_new_tokens=MAX_TOKENS)
    assert got[-1] == hf_generate(preset, prompts[0], min_new_tokens=MAX_TOKENS)  # its batch-mate: none
    assert got[-1] != got[0]  # (the penalty changed something)


@pytest.mark.parametrize("preset", ["llama-tiny", "qwen3-moe-tiny"])
@pytest.mark.parametrize("presence,frequency", [(1.5, 0.0), (0.0, 0.7), (0.4, 1.2), (-0.5, 0.3)])
def test_presence_and_frequency_penalties_equal_the_openai_formula(preset, presence, frequency, checkpoint, hf_generate):
    prompts = prompts_for(2)
    sp = kvtier.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, presence_penalty=presence, frequency_penalty=frequency)
    plain = kvtier.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    got = engine_tokens(checkpoint, preset, prompts + prompts[:1], [sp] * len(prompts) + [plain])
    for p, tokens in zip(prompts, got):
        want = hf_generate(
            preset,
            p,
            logits_processor=LogitsProcessorList([OpenAIPenalty(len(p), presence, frequency)]),
            min_new_tokens=MAX_TOKENS,
        )
        assert tokens == want
    assert got[-1] == hf_generate(preset, prompts[0], min_new_tokens=MAX_TOKENS)


def test_penalized_rows_join_and_leave_batches_and_slots_are_reused(checkpoint, hf_generate):
    """Many requests, few seats: penalized requests come and go between steps (their device
    slots are reused), preempted and recomputed too; each still equals its HF reference."""
    preset = "llama-tiny"
    prompts = prompts_for(3, lengths=(30, 41, 52, 12, 7, 25))
    sp = kvtier.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.5)
    with kvtier.LLM(checkpoint(preset), num_device_blocks=20, block_size=8, max_num_seqs=3, enable_prefix_caching=False) as llm:
        got = [o.token_ids for o in llm.generate(prompts, sp)]
        assert llm.scheduler.num_preemptions > 0
        assert len(llm.runner.penalties.owners) <= 4
    for p, tokens in zip(prompts, got):
        procs = LogitsProcessorList([OpenAIPenalty(len(p), 0.0, 0.5)])
        assert tokens == hf_generate(preset, p, repetition_penalty=1.3, logits_processor=procs, min_new_tokens=MAX_TOKENS)


@pytest.mark.parametrize("preset", ["llama-tiny", "qwen3-moe-tiny"])
def test_min_tokens_holds_stop_tokens_back(preset, checkpoint, hf_generate):
    prompt = prompts_for(4, lengths=(9,))[0]
    free = hf_generate(preset, prompt, min_new_tokens=MAX_TOKENS)
    stop = free[1]  # greedy picks it at once
    with kvtier.LLM(checkpoint(preset), num_device_blocks=64) as llm:
        early = llm.generate([prompt], kvtier.SamplingParams(max_tokens=MAX_TOKENS, stop_token_ids=(stop,)))[0]
        held = llm.generate([prompt], kvtier.SamplingParams(max_tokens=MAX_TOKENS, stop_token_ids=(stop,), min_tokens=6))[0]
    assert early.token_ids == free[:2] and early.finish_reason == "stop"
    # HF: min_new_tokens masks its eos ids (here the stop token and EOS) for the first 6 tokens
    want = hf_generate(preset, prompt, min_new_tokens=6, eos_token_id=[stop, EOS_TOKEN_ID])
    assert held.token_ids == want
    assert stop not in held.token_ids[:6] and EOS_TOKEN_ID not in held.token_ids[:6]
    if held.token_ids[-1] in (stop, EOS_TOKEN_ID):
        assert held.finish_reason == "stop"


@pytest.mark.parametrize("preset", ["llama-tiny", "qwen3-moe-tiny"])
def test_min_tokens_masks_eos(preset, checkpoint, hf_model, hf_generate):
    """A prompt whose greedy next token is EOS (found with HF among two-byte prompts): without
    min_tokens it ends at once; with it, EOS never comes before min_tokens tokens (HF's
    min_new_tokens gives the same tokens)."""
    pairs = torch.cartesian_prod(torch.arange(256), torch.arange(256))
    with torch.no_grad():
        first = hf_model(checkpoint(preset))(pairs).logits[:, -1].argmax(-1)
    prompt = pairs[(first == EOS_TOKEN_ID).nonzero()[0, 0]].tolist()
    with kvtier.LLM(checkpoint(preset), num_device_blocks=64) as llm:
        free = llm.generate([prompt], kvtier.SamplingParams(max_tokens=8))[0]
        held = llm.generate([prompt], kvtier.SamplingParams(max_tokens=8, min_tokens=5))[0]
        ignored = llm.generate([prompt], kvtier.SamplingParams(max_tokens=3, min_tokens=3, ignore_eos=True))[0]
    assert free.token_ids == [EOS_TOKEN_ID] and free.finish_reason == "stop"
    assert held.token_ids == hf_generate(preset, prompt, max_new_tokens=8, min_new_tokens=5)
    assert EOS_TOKEN_ID not in held.token_ids[:5]
    assert ignored.token_ids[0] == EOS_TOKEN_ID  # ignore_eos: EOS ends nothing, so nothing is masked
