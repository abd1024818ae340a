"""Every family's logits equal transformers' on the same random checkpoint (fp32, CPU).

Reference: ``AutoModelForCausalLM.from_pretrained(dir)(ids).logits`` over the whole sequence; kvtier
computes the same positions in paged steps (prefill, chunked prefill, decode, varlen batches) over
shuffled, non-contiguous block tables.
"""

from __future__ import annotations

import pytest
import torch

from tests.model.paged_helpers import TINY_PRESETS, PagedSequences, hf_logits, random_tokens

ATOL = 1e-4


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_prefill_logits_match_transformers(preset, checkpoint, hf_model, our_model):
    path = checkpoint(preset)
    tokens = random_tokens(17, seed=1)
    expected = hf_logits(hf_model(path), tokens)

    got = PagedSequences(our_model(path)).step({0: tokens})[0]

    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_chunked_prefill_then_decode_matches_transformers(preset, checkpoint, hf_model, our_model):
    path = checkpoint(preset)
    tokens = random_tokens(19, seed=2)  # 7 prefix + 6 rest + 6 decode steps
    expected = hf_logits(hf_model(path), tokens)
    seqs = PagedSequences(our_model(path), seed=3)

    got = [seqs.step({0: tokens[:7]})[0], seqs.step({0: tokens[7:13]})[0]]
    for pos in range(13, len(tokens)):
        got.append(seqs.step({0: [tokens[pos]]})[0])

    torch.testing.assert_close(torch.cat(got), expected, atol=ATOL, rtol=0)
    assert len(seqs.tables[0]) == 5 and seqs.tables[0] != sorted(seqs.tables[0])


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_varlen_batch_equals_each_sequence_alone(preset, checkpoint, hf_model, our_model):
    model = our_model(checkpoint(preset))
    seqs = {0: random_tokens(6, seed=4), 1: random_tokens(11, seed=5), 2: random_tokens(8, seed=6)}
    first = {0: 5, 1: 8, 2: 7}  # step 2: a decode, a prefill chunk, a decode

    batched = PagedSequences(model, seed=7)
    step1 = batched.step({i: s[: first[i]] for i, s in seqs.items()})
    step2 = batched.step({i: s[first[i] :] for i, s in seqs.items()})

    for i, tokens in seqs.items():
        alone = PagedSequences(model, seed=8 + i)
        torch.testing.assert_close(step1[i], alone.step({0: tokens[: first[i]]})[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(step2[i], alone.step({0: tokens[first[i] :]})[0], atol=1e-5, rtol=0)
        expected = hf_logits(hf_model(checkpoint(preset)), tokens)
        torch.testing.assert_close(torch.cat([step1[i], step2[i]]), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_layer_hook_runs_before_each_layer_writes_its_kv(preset, checkpoint, our_model):
    model = our_model(checkpoint(preset))
    seqs = PagedSequences(model)
    calls = []

    def hook(layer: int) -> None:
        written = [bool(kv.any()) for kv in seqs.kv_caches]
        calls.append((layer, written))

    seqs.step({0: random_tokens(5, seed=9)}, layer_hook=hook)

    n = model.config.num_layers
    assert [layer for layer, _ in calls] == list(range(n))
    for layer, written in calls:
        assert written == [i < layer for i in range(n)]
