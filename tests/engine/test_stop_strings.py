"""Stop strings in the engine: the text ends right before the first occurrence of the stop string
in the text a run without ``stop`` produces (the tiny presets' byte-level tokenizer, decoded by
transformers' tokenizer as the reference), the tokens end with the one that completed it, and
finish_reason is "stop"."""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

import kvtier

MAX_TOKENS = 40


def prompts_for(seed: int, lengths=(6, 15, 27)) -> list[list[int]]:
    # printable ASCII bytes: the model's text then has stretches of plain characters
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(32, 127, (n,), generator=g).tolist() for n in lengths]


def decoded(tok: PreTrainedTokenizerBase, token_ids: list[int]) -> str:
    """The text of one sequence of ids (transformers types ``decode`` as str or a list of them)."""
    text = tok.decode(token_ids)
    assert isinstance(text, str)
    return text


def expected(tok, tokens: list[int], stop: str) -> tuple[str, list[int]]:
    """The reference cut: text before the first occurrence; tokens up to the first prefix whose
    text contains it."""
    text = tok.decode(tokens, skip_special_tokens=True)
    cut = text[: text.index(stop)]
    n = next(n for n in range(1, len(tokens) + 1) if stop in tok.decode(tokens[:n], skip_special_tokens=True))
    return cut, tokens[:n]


def stop_from(text: str, at: int, width: int) -> str:
    """A stop string of whole characters taken from ``text`` at ``at`` or after (else before),
    ``width`` characters long or, failing that, shorter (down to 2 when width >= 2)."""
    for w in range(width, min(width, 2) - 1, -1):
        for i in [*range(at, len(text) - w), *range(at)]:
            if "\ufffd" not in text[i : i + w]:
                return text[i : i + w]
    pytest.skip("no substring of whole characters")


@pytest.mark.parametrize("preset", ["llama-tiny", "qwen3-moe-tiny"])
def test_stop_strings_cut_the_text_before_the_first_occurrence(preset, checkpoint):
    path = checkpoint(preset)
    tok = AutoTokenizer.from_pretrained(path)
    prompts = prompts_for(1)
    free_params = kvtier.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    with kvtier.LLM(path, num_device_blocks=128) as llm:
        free = llm.generate(prompts, free_params)
        cases = []
        for out, at, width in zip(free, (3, 10, 20), (1, 2, 3)):
            stop = stop_from(out.text, at, width)
            cases.append((out, ("\x00never", stop)))
        params = [kvtier.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, stop=s) for _, s in cases]
        # with a request without stop strings in the same batch: it runs to the end
        got = llm.generate(prompts + prompts[:1], params + [free_params])
    for (ref, stops), out in zip(cases, got):
        assert ref.text == tok.decode(ref.token_ids, skip_special_tokens=True)
        text, tokens = expected(tok, ref.token_ids, stops[1])
        assert out.text == text
        assert out.token_ids == tokens
        assert out.finish_reason == "stop"
    assert got[-1].token_ids == free[0].token_ids and got[-1].finish_reason == "length"


def test_a_stop_string_spanning_tokens_and_at_the_very_end(checkpoint):
    path = checkpoint("llama-tiny")
    tok = AutoTokenizer.from_pretrained(path)
    prompt = prompts_for(2, lengths=(11,))[0]
    with kvtier.LLM(path, num_device_blocks=64) as llm:
        ref = llm.generate([prompt], kvtier.SamplingParams(max_tokens=12, ignore_eos=True))[0]
        stop = stop_from(ref.text, 0, 4)  # spans several byte tokens
        out = llm.generate([prompt], kvtier.SamplingParams(max_tokens=12, ignore_eos=True, stop=[stop]))[0]
        last = ref.text[-2:]  # completed by the last token allowed
        end = llm.generate([prompt], kvtier.SamplingParams(max_tokens=12, ignore_eos=True, stop=last))[0]
    text, tokens = expected(tok, ref.token_ids, stop)
    assert (out.text, out.token_ids, out.finish_reason) == (text, tokens, "stop")
    text, tokens = expected(tok, ref.token_ids, last)
    assert (end.text, end.token_ids, end.finish_reason) == (text, tokens, "stop")


def test_stop_strings_wait_for_min_tokens(checkpoint):
    """A match completed before min_tokens tokens does not count (vLLM's rule); a later one does."""
    path = checkpoint("llama-tiny")
    tok = AutoTokenizer.from_pretrained(path)
    prompt = prompts_for(3, lengths=(8,))[0]
    with kvtier.LLM(path, num_device_blocks=64) as llm:
        ref = llm.generate([prompt], kvtier.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))[0]
        stop = decoded(tok, ref.token_ids[:1])
        out = llm.generate([prompt], kvtier.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, stop=stop, min_tokens=3))[0]
    rest = decoded(tok, ref.token_ids)
    later = rest.find(stop, len(decoded(tok, ref.token_ids[:3])) - len(stop) + 1)
    if later == -1:
        assert out.token_ids == ref.token_ids and out.finish_reason == "length"
    else:
        assert out.text == rest[:later] and out.finish_reason == "stop"
        assert len(out.token_ids) >= 3


def test_stop_strings_need_a_tokenizer(checkpoint, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(checkpoint("llama-tiny"), bare)
    (bare / "tokenizer.json").unlink()
    (bare / "tokenizer_config.json").unlink()
    with kvtier.LLM(bare, num_device_blocks=16) as llm:
        with pytest.raises(ValueError, match="stop=\\['ab'\\].*no tokenizer"):
            llm.generate([[1, 2, 3]], kvtier.SamplingParams(stop="ab"))
        assert llm.generate([[1, 2, 3]], kvtier.SamplingParams(max_tokens=2, ignore_eos=True))[0].text is None
