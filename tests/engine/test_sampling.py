"""The sampler never fails: any valid SamplingParams and any logits row (NaN, +-inf, huge values)
give a token id in range; temperature -> 0+ and top_p -> 0+ give the argmax."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.engine.params import SamplingParams
from kvtier.engine.sampling import sample

VOCAB = 12
FLOAT32_MAX = float(torch.finfo(torch.float32).max)
logit = st.one_of(
    st.floats(width=32, allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, FLOAT32_MAX, -FLOAT32_MAX, 1e30, -1e30, math.inf, -math.inf, math.nan]),
)
rows = st.lists(logit, min_size=1, max_size=VOCAB)
tiny = st.floats(min_value=1e-300, max_value=1e-100)
params = st.builds(
    SamplingParams,
    temperature=st.one_of(st.just(0.0), tiny, st.floats(min_value=1e-300, max_value=1e6)),
    top_p=st.one_of(st.just(1.0), tiny, st.floats(min_value=1e-300, max_value=1.0)),
    top_k=st.integers(min_value=0, max_value=2 * VOCAB),
    seed=st.integers(min_value=0, max_value=2**31),
)


def cleaned(row: list[float]) -> list[float]:
    """The reference logits: NaN is the lowest logit, +-inf the largest/lowest finite one."""
    return [-FLOAT32_MAX if math.isnan(x) else max(-FLOAT32_MAX, min(FLOAT32_MAX, x)) for x in row]


def is_argmax(row: list[float], token: int) -> bool:
    return cleaned(row)[token] == max(cleaned(row))


def one(row: list[float], p: SamplingParams) -> int:
    g = torch.Generator().manual_seed(p.seed or 0)
    return sample(torch.tensor([row], dtype=torch.float32), [p], [g])[0]


@settings(max_examples=400, deadline=None)
@given(rows, params)
def test_any_valid_params_and_logits_give_a_token_in_range(row, p):
    assert 0 <= one(row, p) < len(row)


@settings(max_examples=200, deadline=None)
@given(rows, tiny, st.integers(min_value=0, max_value=2 * VOCAB))
def test_temperature_towards_zero_gives_the_argmax(row, temperature, top_k):
    t = one(row, SamplingParams(temperature=temperature, top_k=top_k))
    assert is_argmax(row, t)


@settings(max_examples=200, deadline=None)
@given(rows, tiny, st.floats(min_value=1e-3, max_value=1e3))
def test_top_p_towards_zero_gives_the_argmax(row, top_p, temperature):
    t = one(row, SamplingParams(temperature=temperature, top_p=top_p))
    assert is_argmax(row, t)


def test_rows_of_a_batch_are_sampled_independently_and_bf16_logits_are_accepted():
    logits = torch.tensor([[0.0, 5.0, 1.0], [math.nan, math.nan, math.nan], [1.0, math.inf, math.nan]], dtype=torch.bfloat16)
    ps = [SamplingParams(temperature=1e-300), SamplingParams(temperature=1.0), SamplingParams()]
    assert sample(logits, ps, [torch.Generator()] * 3) == [1, 0, 1]


@pytest.mark.parametrize("flag", ["ignore_eos", "skip_special_tokens", "return_routed_experts"])
def test_flags_must_be_bools(flag):
    as_given: dict[str, Any] = {flag: "yes"}  # as a JSON body may give it: not a bool
    with pytest.raises(ValueError, match=f"{flag} must be a bool, got 'yes'"):
        SamplingParams(**as_given)


@pytest.mark.parametrize("vocab", [262, 5_000, 32_000, 128_256, 151_936])
def test_two_pass_topk_equals_torch_topk(vocab):
    """The vocabulary-long top-k of the logprobs path (two passes over chunks) against torch.topk
    on random rows (distinct values: same indices too), and -inf rows never name a padded id."""
    from kvtier.engine.sampling import topk

    x = torch.randn(9, vocab, generator=torch.Generator().manual_seed(vocab))
    for k in (0, 1, 5, 20):
        got, want = topk(x, k), torch.topk(x, k, dim=-1)
        assert torch.equal(got.values, want.values) and torch.equal(got.indices, want.indices)
    x[0] = float("-inf")
    x[1, 3:] = float("-inf")
    got = topk(x, 5)
    assert torch.equal(got.values, torch.topk(x, 5, dim=-1).values) and bool((got.indices < vocab).all())
    assert set(got.indices[1, :3].tolist()) == {0, 1, 2}


def test_a_masked_token_s_processed_logprob_is_minus_inf():
    """A token whose logit is -inf (min_tokens masks EOS and stop ids so) has the processed
    logprob -inf, not the dtype's lowest finite value (-3.4e38 in float32)."""
    from kvtier.engine.sampling import draw

    logits = torch.tensor([[2.0, 1.0, float("-inf"), 0.5]])
    params = [SamplingParams(temperature=1.5, logprobs=2, logprobs_mode="processed")]
    tokens, processed = draw(logits, params, [torch.Generator().manual_seed(0)], processed_rows=[0])
    assert processed is not None and processed[0, 2].item() == float("-inf")
    assert torch.isfinite(processed[0, [0, 1, 3]]).all() and tokens[0].item() != 2


def test_one_sampling_step_gives_each_row_the_logprobs_of_its_own_mode():
    """engine/sample_step.py over four rows, against torch's log_softmax and the penalties'
    published formulas: a raw row gets log_softmax of the model's logits, before its repetition
    penalty (HF/CTRL); a processed row that of its logits less the presence penalty (OpenAI: every
    token in the output, and on a verify row the drafts before it) over its temperature; a greedy
    processed row its log_softmax; a row the verifier names gets its processed distribution too."""
    from kvtier.engine.request import Request
    from kvtier.engine.sample_step import sample_rows
    from kvtier.engine.sampling import Penalties

    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    reqs = [
        Request("raw", [1, 2], SamplingParams(temperature=0.7, logprobs=2, repetition_penalty=2.0)),
        Request("processed", [3], SamplingParams(temperature=0.5, logprobs=1, logprobs_mode="processed", presence_penalty=1.5)),
        Request("verified", [4], SamplingParams(temperature=0.9)),
        Request("greedy", [5], SamplingParams(logprobs=0, logprobs_mode="processed")),
    ]
    for r in reqs:
        r.generator = torch.Generator().manual_seed(1)
    reqs[1].output_token_ids = [7]
    ahead = [[], [9], [], []]  # row 1 verifies the token after the draft 9
    got = sample_rows(logits.clone(), reqs, Penalties(VOCAB, [0], torch.device("cpu")), ahead, processed_rows=[2])
    penalized = logits[1].clone()
    penalized[[7, 9]] -= 1.5
    assert got.logprob_rows == [0, 1, 3] and got.processed_rows == [1, 2, 3]
    assert got.logprobs is not None
    torch.testing.assert_close(got.logprobs[0], torch.log_softmax(logits[0], -1))
    torch.testing.assert_close(got.logprobs[1], torch.log_softmax(penalized / 0.5, -1))
    torch.testing.assert_close(got.logprobs[2], torch.log_softmax(logits[3], -1))
    torch.testing.assert_close(got.processed_of(2, 1)[0], torch.log_softmax(logits[2] / 0.9, -1))
    assert got.tokens[3] == logits[3].argmax()
