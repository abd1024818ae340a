"""The sampler draws from the right distribution and the penalties change the logits by the right
amount: tests that fail on a plausible wrong implementation (a sampler that always takes the
argmax, one that ignores the temperature or top-k/top-p or gets their order wrong, a penalty that
does nothing or counts the wrong tokens). Each test also shows its power: the wrong
implementation's outcome is fed to the same check and must be rejected.

References:

- Sampling frequencies (``draw``): a chi-square goodness-of-fit test (p = 0.001, cells with an
  expected count under 5 pooled) of the counts of many draws against the distribution computed
  here by hand in float64 -- softmax(logits / T), then top-k (the k largest, renormalized), then
  top-p (kvtier's rule, the vLLM / HF one: walking down by logit, a token is kept while the
  probability before it is < top_p; renormalized). Tokens outside that support must never be
  drawn. scipy is not in the venv: the critical values are hard-coded from the NIST/SEMATECH
  table, and a test checks them against the chi-square survival function
  (``torch.special.gammaincc``).
- That hand-written reference, and kvtier's reported ``processed`` log-distribution on random
  rows, against transformers' ``TemperatureLogitsWarper`` -> ``TopKLogitsWarper`` ->
  ``TopPLogitsWarper`` (the order ``generate`` applies them in).
- ``repetition_penalty``: transformers' ``RepetitionPenaltyLogitsProcessor`` on prompt + output
  ids (kvtier penalizes the tokens of both, as HF does with its whole ``input_ids``).
- ``presence_penalty`` / ``frequency_penalty``: the OpenAI formula written here,
  ``logits - presence * (count > 0) - frequency * count``, counts over the output only (HF has
  no processor for them).
- All three together: repetition first, then presence/frequency (vLLM's order, and kvtier's).
- ``min_tokens``: transformers' ``MinNewTokensLengthLogitsProcessor`` and
  ``MinLengthLogitsProcessor`` with EOS and the stop token ids as their eos ids; ``ignore_eos``
  (no HF equivalent): the same with the stop token ids only.

Every penalty test compares the penalized logits with the reference (``assert_close``) and
asserts that they differ from the unpenalized ones, so a no-op penalty fails.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import (
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from kvtier.engine.params import SamplingParams
from kvtier.engine.request import Request, Status
from kvtier.engine.sampling import Penalties, draw

# ---------------------------------------------------------------------------------------------
# sampling frequencies

# shuffled in vocabulary order (a sampler that forgets to map sorted positions back to token
# ids draws the wrong ids); by logit: 1, 6, 3, 9, 0, 5, 7, 2, 8, 4
LOGITS = torch.tensor([0.5, 2.0, -1.0, 1.2, -3.0, 0.0, 1.5, -0.5, -2.0, 0.8])
VOCAB = len(LOGITS)
ARGMAX = 1
N = 5_000  # draws per test: one ``draw`` call of N copies of the row

# Upper-tail critical values of the chi-square distribution at alpha = 0.001, by degrees of
# freedom: NIST/SEMATECH e-Handbook of Statistical Methods, section 1.3.6.7.4, "Critical Values
# of the Chi-Square Distribution" (checked below against the survival function).
CHI2_CRITICAL_0001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322, 8: 26.124, 9: 27.877}


def reference(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """The distribution to draw from, by hand, in float64: temperature, then top-k, then min-p
    (a token at least min_p x as likely as the likeliest), then top-p (over what is left,
    renormalized), token by token in order of logit."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    order = sorted(range(len(logits)), key=lambda i: -float(logits[i]))
    kept = order[:top_k] if top_k else order
    kept = [i for i in kept if float(probs[i]) >= min_p * float(probs.max())]
    mass = sum(float(probs[i]) for i in kept)
    if top_p < 1.0:
        nucleus, before = [], 0.0
        for i in kept:
            if before < top_p * mass:  # probability before it, renormalized, < top_p
                nucleus.append(i)
            before += float(probs[i])
        kept = nucleus
    out = torch.zeros_like(probs)
    out[kept] = probs[kept] / probs[kept].sum()
    return out


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of ``counts`` against ``probs`` over its support, and the degrees of
    freedom; cells expecting fewer than 5 draws are pooled (with the smallest other cell, if the
    pool itself expects fewer than 5)."""
    n = float(counts.sum())
    support = [i for i in range(len(probs)) if probs[i] > 0]
    expected = {i: n * float(probs[i]) for i in support}
    small = [i for i in support if expected[i] < 5]
    cells = [[i] for i in support if expected[i] >= 5]
    if small:
        if sum(expected[i] for i in small) < 5 and cells:
            smallest = min(cells, key=lambda c: sum(expected[i] for i in c))
            cells.remove(smallest)
            small += smallest
        cells.append(small)
    stat = 0.0
    for c in cells:
        e = sum(expected[i] for i in c)
        o = float(sum(counts[i] for i in c))
        stat += (o - e) ** 2 / e
    return stat, len(cells) - 1


def rejection(counts: torch.Tensor, probs: torch.Tensor) -> str | None:
    """Why ``counts`` are not draws from ``probs`` (None: they may be)."""
    outside = [i for i in range(len(probs)) if probs[i] == 0 and counts[i] > 0]
    if outside:
        return f"drew tokens outside the support: {outside}"
    stat, df = chi_square(counts, probs)
    if stat > CHI2_CRITICAL_0001[df]:
        return f"chi-square {stat:.1f} > {CHI2_CRITICAL_0001[df]} (df={df}, p < 0.001)"
    return None


def drawn_counts(params: SamplingParams, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts of N draws (one call, N rows, one seeded generator shared by the rows), and the
    log-distribution ``draw`` reports for the first row."""
    g = torch.Generator().manual_seed(seed)
    tokens, processed = draw(LOGITS.repeat(N, 1), [params] * N, [g] * N, processed_rows=[0])
    assert processed is not None  # (asked for row 0)
    return torch.bincount(tokens, minlength=VOCAB), processed[0]


def argmax_counts() -> torch.Tensor:
    counts = torch.zeros(VOCAB, dtype=torch.long)
    counts[ARGMAX] = N
    return counts


def expected_counts(probs: torch.Tensor) -> torch.Tensor:
    """What a sampler drawing from ``probs`` gives on average (its chi-square against another
    distribution is the smallest it would typically score)."""
    return (N * probs).round().long()


def check(params: SamplingParams, want: torch.Tensor, support: set[int], wrong: dict[str, torch.Tensor]) -> None:
    """kvtier's draws pass against ``want`` (whose support is ``support``, written out by hand),
    the distribution it reports is ``want``, and each wrong sampler's counts are rejected."""
    assert {i for i in range(VOCAB) if want[i] > 0} == support
    counts, processed = drawn_counts(params)
    assert rejection(counts, want) is None, (rejection(counts, want), counts.tolist(), want.tolist())
    torch.testing.assert_close(processed, want.log().float())
    wrong = {"argmax": argmax_counts(), **{name: expected_counts(q) for name, q in wrong.items()}}
    for name, c in wrong.items():
        assert rejection(c, want) is not None, f"a sampler with {name} would pass"


def test_the_critical_values_are_the_chi_square_quantiles():
    for df, c in CHI2_CRITICAL_0001.items():
        sf = torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(c / 2, dtype=torch.float64))
        assert abs(float(sf) - 0.001) < 1e-6, df


def test_the_chi_square_check_accepts_draws_from_the_distribution_itself():
    """The check's false-rejection side: torch.multinomial's own draws from the reference pass
    (for several seeds), so a failure below is kvtier's, not the check's."""
    want = reference(LOGITS, 0.7)
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        counts = torch.bincount(torch.multinomial(want, N, replacement=True, generator=g), minlength=VOCAB)
        assert rejection(counts, want) is None


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_tokens_follow_the_softmax_at_temperature(temperature):
    want = reference(LOGITS, temperature)
    wrong = {
        "no temperature": reference(LOGITS, 1.0) if temperature != 1.0 else reference(LOGITS, 0.7),
        "temperature multiplied": reference(LOGITS, 1 / temperature) if temperature != 1.0 else reference(LOGITS, 1.3),
        "uniform": torch.full((VOCAB,), 1 / VOCAB, dtype=torch.float64),
    }
    check(SamplingParams(temperature=temperature), want, set(range(VOCAB)), wrong)


def test_top_k_samples_the_k_most_likely_tokens_in_their_softmax_proportions():
    want = reference(LOGITS, 0.7, top_k=3)
    wrong = {
        "top-k ignored": reference(LOGITS, 0.7),
        "uniform over the top k": (reference(LOGITS, 0.7, top_k=3) > 0) / 3.0,
        "no temperature": reference(LOGITS, 1.0, top_k=3),
        "top-k of the smallest": reference(-LOGITS, 0.7, top_k=3),
    }
    check(SamplingParams(temperature=0.7, top_k=3), want, {1, 6, 3}, wrong)


def test_min_p_drops_tokens_less_likely_than_min_p_times_the_likeliest_after_temperature():
    """At T=0.7 the tokens by logit are exp((l - 2) / 0.7) = 1, .49, .32, .18 ... as likely as
    the first: min_p=0.4 keeps two. Applied before the temperature (T=1: 1, .61, .45, .30) it
    would keep three; as an absolute probability floor (p >= 0.4) one."""
    want = reference(LOGITS, 0.7, min_p=0.4)
    absolute = torch.zeros(VOCAB, dtype=torch.float64)
    absolute[ARGMAX] = 1.0
    wrong = {
        "min-p ignored": reference(LOGITS, 0.7),
        "min-p before temperature": reference(LOGITS, 0.7, top_k=3),
        "min-p as an absolute floor": absolute,
    }
    check(SamplingParams(temperature=0.7, min_p=0.4), want, {1, 6}, wrong)
    # top-p after it, over what min-p kept, renormalized: min_p=0.25 keeps 1, .49, .32 (.55, .27,
    # .18 of their sum), so top_p=0.8 drops the third (.82 before it); top-p first would keep it
    # (.67 of the whole distribution before it)
    both = reference(LOGITS, 0.7, min_p=0.25, top_p=0.8)
    check(
        SamplingParams(temperature=0.7, min_p=0.25, top_p=0.8),
        both,
        {1, 6},
        {"top-p before min-p": reference(LOGITS, 0.7, top_p=0.8), "top-p ignored": reference(LOGITS, 0.7, min_p=0.25)},
    )


@pytest.mark.parametrize("temperature,support", [(1.0, {1, 6, 3, 9}), (0.7, {1, 6, 3})])
def test_top_p_samples_the_smallest_nucleus_reaching_p_renormalized(temperature, support):
    """At T=1 the probabilities by logit are .348 .211 .156 .105 .078 ..., so the probability
    before the 4th token is .716 < .8 (kept) and before the 5th .821 (dropped); at T=0.7 the
    3rd token starts at .674 and the 4th at .819."""
    want = reference(LOGITS, temperature, top_p=0.8)
    inclusive = reference(LOGITS, temperature, top_k=len(support) - 1)  # kept while the sum *with* it <= p
    in_vocab_order = torch.zeros(VOCAB, dtype=torch.float64)  # cumulated without sorting
    probs, before = torch.softmax(LOGITS.double() / temperature, -1), 0.0
    for i in range(VOCAB):
        if before < 0.8:
            in_vocab_order[i] = probs[i]
        before += float(probs[i])
    nucleus_at_t1 = reference(LOGITS, 1.0, top_p=0.8) > 0  # temperature after top-p
    after = torch.softmax(LOGITS.double() / temperature, -1) * nucleus_at_t1
    wrong = {
        "top-p ignored": reference(LOGITS, temperature),
        "the inclusive rule": inclusive,
        "an unsorted cumulative sum": in_vocab_order / in_vocab_order.sum(),
    }
    if temperature != 1.0:
        wrong["temperature after top-p"] = after / after.sum()
    check(SamplingParams(temperature=temperature, top_p=0.8), want, support, wrong)


def test_top_k_then_top_p_takes_the_nucleus_of_the_top_k_distribution():
    """top_k=3 leaves .348 .211 .156 of mass .716, renormalized .487 .295 .218: top_p=0.6 then
    keeps two tokens. Top-p first, over the whole vocabulary, would keep three (.559 < .6)."""
    want = reference(LOGITS, 1.0, top_k=3, top_p=0.6)
    top_p_first = reference(LOGITS, 1.0, top_p=0.6) * (reference(LOGITS, 1.0, top_k=3) > 0)
    wrong = {
        "top-p before top-k": top_p_first / top_p_first.sum(),
        "top-k only": reference(LOGITS, 1.0, top_k=3),
        "top-p only": reference(LOGITS, 1.0, top_p=0.6),
    }
    check(SamplingParams(temperature=1.0, top_k=3, top_p=0.6), want, {1, 6}, wrong)


def hf_distribution(row: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    scores = row[None].double()
    for warper in (
        [TemperatureLogitsWarper(temperature)]
        + ([TopKLogitsWarper(top_k)] if top_k else [])
        + ([TopPLogitsWarper(top_p)] if top_p < 1.0 else [])
    ):
        scores = warper(None, scores)
    return torch.softmax(scores, dim=-1)[0]


def test_the_hand_written_reference_equals_transformers_warpers():
    for temperature in (1.0, 0.7):
        for top_k in (0, 3, 5):
            for top_p in (1.0, 0.8, 0.6, 0.3):
                torch.testing.assert_close(
                    reference(LOGITS, temperature, top_k, top_p), hf_distribution(LOGITS, temperature, top_k, top_p)
                )


@pytest.mark.parametrize("vocab", [50, 8192])
def test_the_distribution_drawn_from_equals_transformers_warpers_on_random_rows(vocab):
    """One batch of rows with their own temperature / top-k / top-p (8192: the two-pass top-k
    of long rows, k <= 64, and the one-pass one, k > 64); the log-distribution ``draw`` reports
    for each equals HF's, and each drawn token lies in HF's support."""
    g = torch.Generator().manual_seed(vocab)
    rows = 32
    logits = torch.randn(rows, vocab, generator=g) * 3
    params = []
    for r in range(rows):
        temperature = [0.3, 0.7, 1.0, 1.5][r % 4]
        top_k = [0, 1, 2, 7, 40, 100][r % 6]
        top_p = [1.0, 0.9, 0.5, 0.05, 0.95][r % 5]
        params.append(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=r))
    gens = [torch.Generator().manual_seed(r) for r in range(rows)]
    tokens, processed = draw(logits, params, gens, processed_rows=list(range(rows)))
    assert processed is not None  # (asked for every row)
    for r, p in enumerate(params):
        want = hf_distribution(logits[r], p.temperature, p.top_k, p.top_p)
        assert want[tokens[r]] > 0, r
        if p.greedy:  # top_k=1: the argmax; kvtier reports the plain log_softmax
            assert tokens[r] == logits[r].argmax()
            continue
        torch.testing.assert_close(processed[r], want.log().float(), msg=lambda m: f"row {r} {p}: {m}")


# ---------------------------------------------------------------------------------------------
# penalties

PV = 24  # the penalties' vocabulary
EOS = 2


def penalty_logits(rows: int = 1, seed: int = 0) -> torch.Tensor:
    """Random logits of both signs, with exact zeros and a large magnitude or two."""
    x = torch.randn(rows, PV, generator=torch.Generator().manual_seed(seed)) * 3
    x[:, 5] = 0.0
    x[:, 7] = 25.0
    x[:, 8] = -25.0
    return x


def make(prompt: list[int], output: list[int], **kw) -> Request:
    return Request(f"r{id(prompt)}", list(prompt), SamplingParams(max_tokens=64, **kw), output_token_ids=list(output))


def penalized(
    logits: torch.Tensor, reqs: list[Request], rows: list[int] | None = None, penalties: Penalties | None = None
) -> torch.Tensor:
    out = logits.clone()
    penalties = penalties or Penalties(PV, [EOS], torch.device("cpu"))
    penalties.apply(out, list(range(len(reqs))) if rows is None else rows, reqs)
    return out


def hf_repetition(logits_row: torch.Tensor, ids: list[int], penalty: float) -> torch.Tensor:
    return RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([ids]), logits_row[None].clone())[0]


def openai(logits_row: torch.Tensor, output: list[int], presence: float, frequency: float) -> torch.Tensor:
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=PV).to(logits_row.dtype)
    return logits_row - presence * (counts > 0) - frequency * counts


# prompt-only tokens {3, 10, 11, 7}, output-only {4, 12, 8, 13}, both {1, 5}; 4 three times
PROMPT = [3, 10, 1, 11, 5, 10, 7]
OUTPUT = [4, 12, 1, 4, 8, 5, 4, 13]


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_equals_transformers_over_prompt_and_output(penalty):
    x = penalty_logits()
    got = penalized(x, [make(PROMPT, OUTPUT, repetition_penalty=penalty)])[0]
    torch.testing.assert_close(got, hf_repetition(x[0], PROMPT + OUTPUT, penalty))
    changed = {i for i in range(PV) if got[i] != x[0, i]}
    assert changed == set(PROMPT + OUTPUT) - {5}  # every seen token but the zero logit
    torch.testing.assert_close(got[[7, 8]], torch.tensor([25.0 / penalty, -25.0 * penalty]))  # both signs


@pytest.mark.parametrize("presence,frequency", [(1.5, 0.0), (0.0, 0.7), (0.4, 1.2), (-0.5, 0.3)])
def test_presence_and_frequency_penalties_equal_the_openai_formula_over_the_output(presence, frequency):
    x = penalty_logits()
    got = penalized(x, [make(PROMPT, OUTPUT, presence_penalty=presence, frequency_penalty=frequency)])[0]
    torch.testing.assert_close(got, openai(x[0], OUTPUT, presence, frequency))
    changed = {i for i in range(PV) if got[i] != x[0, i]}
    assert changed == set(OUTPUT)  # the prompt's tokens are not counted
    torch.testing.assert_close(got[4], x[0, 4] - presence - 3 * frequency)


def test_all_penalties_together_apply_repetition_first_then_presence_and_frequency():
    x = penalty_logits(seed=1)
    req = make(PROMPT, OUTPUT, repetition_penalty=1.5, presence_penalty=0.8, frequency_penalty=0.6)
    got = penalized(x, [req])[0]
    want = openai(hf_repetition(x[0], PROMPT + OUTPUT, 1.5), OUTPUT, 0.8, 0.6)
    torch.testing.assert_close(got, want)
    other_order = hf_repetition(openai(x[0], OUTPUT, 0.8, 0.6), PROMPT + OUTPUT, 1.5)
    assert not torch.allclose(want, other_order)  # the test pins the order
    assert not torch.allclose(got, x[0])


def test_penalties_touch_only_their_rows_each_with_its_own_params():
    """Rows 0 and 2 of three have penalties (different ones); row 1 is left as it was."""
    x = penalty_logits(rows=3, seed=2)
    a = make(PROMPT, OUTPUT, repetition_penalty=1.3)
    b = make([0, 9, 9], [9, 14, 14, 14], frequency_penalty=0.5, presence_penalty=0.25)
    got = penalized(x, [a, b], rows=[0, 2])
    torch.testing.assert_close(got[0], hf_repetition(x[0], PROMPT + OUTPUT, 1.3))
    torch.testing.assert_close(got[2], openai(x[2], b.output_token_ids, 0.25, 0.5))
    assert torch.equal(got[1], x[1])
    assert not torch.allclose(got[0], x[0]) and not torch.allclose(got[2], x[2])


@pytest.mark.parametrize("min_tokens", [1, 4])
def test_min_tokens_masks_eos_and_stop_tokens_like_transformers_min_new_tokens(min_tokens):
    x = penalty_logits(seed=3)
    stops = [6, 17]
    prompt = [3, 4, 9]
    for n in range(min_tokens + 2):
        output = [11, 12, 13, 14, 15, 16][:n]
        got = penalized(x, [make(prompt, output, min_tokens=min_tokens, stop_token_ids=tuple(stops))])[0]
        ids = torch.tensor([prompt + output])
        want = MinNewTokensLengthLogitsProcessor(len(prompt), min_tokens, [EOS] + stops)(ids, x.clone())[0]
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(got, MinLengthLogitsProcessor(len(prompt) + min_tokens, [EOS] + stops)(ids, x.clone())[0])
        masked = {i for i in range(PV) if got[i] == -math.inf}
        assert masked == ({EOS, *stops} if n < min_tokens else set()), n


def test_ignore_eos_leaves_eos_unmasked_but_still_masks_stop_tokens():
    x = penalty_logits(seed=4)
    got = penalized(x, [make([3], [], min_tokens=2, stop_token_ids=(6,), ignore_eos=True)])[0]
    want = MinNewTokensLengthLogitsProcessor(1, 2, [6])(torch.tensor([[3]]), x.clone())[0]
    torch.testing.assert_close(got, want)
    assert got[6] == -math.inf and got[EOS] == x[0, EOS]


def test_penalties_follow_a_growing_output_step_by_step():
    """The engine's use: one Penalties object, apply once per step while the output grows (a
    slot counts only the tokens new since it last looked: counting the whole output again each
    step would be wrong from the second step), a second request joining, the first finishing
    and a third taking its slot (its prompt and counts start afresh)."""
    pen = Penalties(PV, [EOS], torch.device("cpu"))
    kw = dict(repetition_penalty=1.4, presence_penalty=0.3, frequency_penalty=0.45, min_tokens=3)
    a = make([1, 2, 3, 20], [], **kw)
    b = make([21, 22], [], **kw)
    stream_a = [4, 4, 9, 1, 4, 9, 4]
    stream_b = [9, 9, 9, 22, 5]

    def want(req: Request, row: torch.Tensor) -> torch.Tensor:
        p = req.params
        row = row.clone()
        if len(req.output_token_ids) < p.min_tokens:
            row[EOS] = -math.inf
        row = hf_repetition(row, req.prompt_token_ids + req.output_token_ids, p.repetition_penalty)
        return openai(row, req.output_token_ids, p.presence_penalty, p.frequency_penalty)

    for step in range(len(stream_a)):
        reqs = [a] + ([b] if step >= 2 else [])
        x = penalty_logits(rows=len(reqs), seed=10 + step)
        got = penalized(x, reqs, penalties=pen)
        for n, r in enumerate(reqs):
            torch.testing.assert_close(got[n], want(r, x[n]), msg=lambda m: f"step {step} {r.request_id}: {m}")
            assert not torch.allclose(got[n], x[n])
        a.output_token_ids.append(stream_a[step])
        if step >= 2:
            b.output_token_ids.append(stream_b[step - 2])
    a.status = Status.FINISHED
    # takes a's slot; its output is longer than a's counted one (a slot that kept a's counter
    # would skip c's first tokens)
    c = make([15], [16, 16, 17, 16, 18, 19, 16, 20], **kw)
    x = penalty_logits(rows=2, seed=99)
    got = penalized(x, [c, b], penalties=pen)
    assert pen.slot_of[c] == 0
    torch.testing.assert_close(got[0], want(c, x[0]))
    torch.testing.assert_close(got[1], want(b, x[1]))
