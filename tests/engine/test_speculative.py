"""Speculative decoding with the model's MTP block (``num_speculative_tokens``), fp32 on CPU.

Over 600 lines: the checks every drafting model must pass (the latent-attention model's file runs
them too: tests/engine/test_mla_speculative.py), with the controlled drafter they share.

The references: the same engine without drafts (greedy tokens, routed experts and hits per tier
must not change, whatever the drafts), and for sampling the target's distribution itself (the
verification rule draws every emitted token from it: a chi-square test, which a verifier that
always keeps the draft, or that resamples without removing it, fails).

Random MTP weights draft almost nothing the target accepts, so most tests use a controlled
drafter (``Speculator.drafter``): the target's own greedy continuation with probability alpha,
else a wrong token, which exercises every number of accepted drafts.
"""

from __future__ import annotations

import random

import pytest
import torch

import kvtier
from kvtier.engine.params import SamplingParams
from kvtier.engine.request import Request
from kvtier.engine.sampling import draw
from kvtier.engine.spec import REST_STEPS
from kvtier.engine.verify import accept
from kvtier.model import AttentionMetadata, ModelConfig, allocate_kv_caches, load_model
from tests.engine.hf_reference import prompts_for
from tests.engine.test_sampling_distribution import LOGITS, reference, rejection

TIERS = dict(num_device_blocks=24, block_size=8, num_host_blocks=96, max_num_seqs=4)
VOCAB = 320  # the tiny presets'


@pytest.fixture(scope="module")
def mtp_model(checkpoint):
    return checkpoint("qwen3-mtp-tiny")


def oracle_drafter(reference_outputs: dict[tuple[int, ...], list[int]], alpha: float, seed: int = 0):
    """Propose the token the target gives without drafts with probability ``alpha``, else another."""
    rng = random.Random(seed)

    def drafter(req: Request, position: int, proposal: int) -> int:
        out = reference_outputs.get(tuple(req.prompt_token_ids), [])
        i = position - req.num_prompt_tokens
        right = out[i] if 0 <= i < len(out) else proposal
        return right if rng.random() < alpha else (right + 1 + rng.randrange(VOCAB - 1)) % VOCAB

    return drafter


def workload() -> tuple[list[list[int]], list[list[int]]]:
    shared = prompts_for(41, lengths=(40,))[0]
    first = [shared + p for p in prompts_for(42, lengths=(9, 17, 23, 30))]
    return first, prompts_for(43, lengths=(90, 70))


def run(llm: kvtier.LLM, params: kvtier.SamplingParams) -> list:
    """Four at once on a small device tier (preemption), then others (evictions to the host
    tier), then the first two again (device and host hits)."""
    first, other = workload()
    outs = llm.generate(first, params) + llm.generate(other, params) + llm.generate(first[:2], params)
    return [
        (
            o.token_ids,
            o.finish_reason,
            dict(o.cached_tokens_by_tier),
            None if o.routed_experts is None else o.routed_experts.tolist(),
        )
        for o in outs
    ]


@pytest.mark.parametrize(
    "k, alpha",
    [(1, 0.7), (3, 0.7), pytest.param(3, 0.0, marks=pytest.mark.slow), pytest.param(2, None, marks=pytest.mark.slow)],
)  # (the slow pass: CI runs it)
def test_greedy_tokens_with_drafts_equal_those_without(mtp_model, k, alpha):
    """Through device hits, host hits and swap preemption, stop tokens and max_tokens that end a
    step's accepted drafts midway; alpha None: the MTP block's own drafts."""
    params = kvtier.SamplingParams(max_tokens=23, ignore_eos=True)
    first, other = workload()
    with kvtier.LLM(mtp_model, **TIERS) as llm:
        ref = run(llm, params)
        out = ref[3][0]  # a stop token first seen past the 5th output token: a step ends midway
        token = next(t for i, t in enumerate(out) if i >= 5 and t not in out[:i])
        stop = kvtier.SamplingParams(max_tokens=23, ignore_eos=True, stop_token_ids=[token])
        ref_stopped = llm.generate([first[3]], stop)[0]
    outputs = {tuple(p): r[0] for p, r in zip(first + other, ref)}
    with kvtier.LLM(mtp_model, num_speculative_tokens=k, **TIERS) as llm:
        if alpha is not None:
            llm.spec.drafter = oracle_drafter(outputs, alpha)
        got = run(llm, params)
        stopped = llm.generate([first[3]], stop)[0]
        stats = llm.cache_stats()
        spec = stats["speculative"]
        assert llm.scheduler.num_preemptions > 0 and stats["host"]["hit_tokens"] > 0
        llm.cache.assert_invariants()  # (no live request: every block free or the tree's, no pin left)
    assert got == ref
    assert stopped.token_ids == ref_stopped.token_ids and stopped.finish_reason == ref_stopped.finish_reason == "stop"
    assert len(stopped.token_ids) < 23
    assert spec["drafted"] > 0
    if alpha:
        assert spec["accepted"] > 0 and spec["accepted_at"][-1] > 0  # every place accepted at times
    if alpha == 0.0:
        assert spec["accepted"] == 0


def test_routed_experts_are_those_of_the_accepted_tokens(checkpoint):
    """MoE (R3): the experts returned for each position are the target's for the tokens kept."""
    path = checkpoint("qwen3-moe-mtp-tiny")
    params = kvtier.SamplingParams(max_tokens=17, ignore_eos=True, return_routed_experts=True)
    prompts = prompts_for(44, lengths=(21, 33))
    with kvtier.LLM(path, num_device_blocks=64, block_size=8) as llm:
        ref = llm.generate(prompts, params)
    outputs = {tuple(p): o.token_ids for p, o in zip(prompts, ref)}
    with kvtier.LLM(path, num_device_blocks=64, block_size=8, num_speculative_tokens=3) as llm:
        llm.spec.drafter = oracle_drafter(outputs, 0.6)
        got = llm.generate(prompts, params)
        assert llm.cache_stats()["speculative"]["accepted"] > 0
    for a, b in zip(ref, got):
        assert a.token_ids == b.token_ids
        assert a.routed_experts.tolist() == b.routed_experts.tolist()


def test_a_prefix_hit_runs_no_mtp_row_over_the_cached_prompt(mtp_model):
    prompt = prompts_for(45, lengths=(64,))[0]
    params = kvtier.SamplingParams(max_tokens=4, ignore_eos=True)
    with kvtier.LLM(mtp_model, num_device_blocks=64, block_size=8, num_speculative_tokens=2) as llm:
        llm.generate([prompt], params)
        before = llm.cache_stats()["speculative"]["mtp_prompt_rows"]
        assert before == 64  # cold: every prompt position once
        out = llm.generate([prompt], params)[0]
        rows = llm.cache_stats()["speculative"]["mtp_prompt_rows"] - before
    assert out.cached_tokens_by_tier["device"] == 56
    assert rows == 64 - 56  # only the positions the target computed


def test_the_mtp_kv_travels_through_the_pool_and_its_namespace_says_so(mtp_model, tmp_path):
    """A block stored by a drafting engine carries the MTP layer's KV: a second drafting engine
    with empty tiers drafts from the pool's bytes exactly what a cold engine drafts; an engine
    that does not draft (no MTP KV in its blocks) never reads those objects."""
    prompts = prompts_for(46, lengths=(48, 40))
    params = kvtier.SamplingParams(max_tokens=8, ignore_eos=True)
    pool = dict(
        storage=f"file://{tmp_path}",
        num_host_blocks=64,
        block_size=8,
        num_device_blocks=64,
        prefetch_policy="wait_complete",
        storage_fetch="always",
    )

    def drafts_of(llm) -> list[tuple[int, int, int]]:
        seen: list[tuple[int, int, int]] = []  # (prompt length, position, draft)

        def recording(req: Request, pos: int, t: int) -> int:  # the MTP block's own draft, kept
            seen.append((req.num_prompt_tokens, pos, t))
            return t

        llm.spec.drafter = recording
        llm.generate(prompts, params)
        llm.spec.drafter = None
        return sorted(seen)

    with kvtier.LLM(mtp_model, num_speculative_tokens=2, num_device_blocks=64, block_size=8) as llm:
        cold = drafts_of(llm)
    with kvtier.LLM(mtp_model, num_speculative_tokens=2, **pool) as llm:
        llm.generate(prompts, params)  # writes every full block (with its MTP KV) to the pool
    with kvtier.LLM(mtp_model, num_speculative_tokens=2, **pool) as llm:
        warm = drafts_of(llm)
        assert llm.cache_stats()["speculative"]["mtp_prompt_rows"] == 8 + 8  # the tails only
        storage = llm.generate(prompts, params)
    assert warm == cold
    with kvtier.LLM(mtp_model, **pool) as llm:
        plain = llm.generate(prompts, params)
    assert all(o.cached_tokens_by_tier["storage"] == 0 for o in plain)
    assert [o.token_ids for o in plain] == [o.token_ids for o in storage]


def test_the_host_tier_and_blocks_are_sized_with_the_mtp_layer(mtp_model):
    cfg = ModelConfig.from_hf_dir(mtp_model)
    with kvtier.LLM(mtp_model, num_device_blocks=16, block_size=8, num_host_blocks=8, num_speculative_tokens=1) as llm:
        assert len(llm.kv_caches) == cfg.num_layers + 1
        assert llm.host_kv.shape[1] == cfg.num_layers + 1
    with kvtier.LLM(mtp_model, num_device_blocks=16, block_size=8, num_host_blocks=8) as llm:
        assert len(llm.kv_caches) == cfg.num_layers  # no drafts: no MTP KV, no MTP weights
        assert len(llm.model.mtp) == 0


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(num_speculative_tokens=9), "at most 8, got 9"),
        (dict(num_speculative_tokens=-1), "num_speculative_tokens"),
    ],
)
def test_options_it_cannot_run_with_are_refused_by_name(mtp_model, options, match):
    with pytest.raises(ValueError, match=match):
        kvtier.LLM(mtp_model, **options)


def test_a_model_without_mtp_layers_is_refused(checkpoint):
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        kvtier.LLM(checkpoint("qwen3-tiny"), num_speculative_tokens=1)


# ---------------------------------------------------------------------------------------------
# the verification rule, sampled: every emitted token follows the target's distribution


def verify_counts(params: SamplingParams, draft: int, trials: int = 4000, wrong: str | None = None):
    """Counts of the first token the verification emits after a one-token draft ``draft``, the
    target's rows being LOGITS and LOGITS reversed; and of the bonus token when it was accepted."""
    gen = torch.Generator().manual_seed(1)
    req = Request("r", [1, 2, 3], params)
    req.generator = gen
    rows = torch.stack([LOGITS, LOGITS.flip(0)]).repeat(trials, 1)  # trial i: rows 2i, 2i + 1
    drawn, processed = draw(rows, [params] * len(rows), [gen] * len(rows), processed_rows=list(range(len(rows))))
    assert processed is not None  # (asked for every row)
    tokens: list[int] = drawn.tolist()
    first = torch.zeros(len(LOGITS))
    bonus = torch.zeros(len(LOGITS))
    for i in range(trials):
        pair = tokens[2 * i : 2 * i + 2]
        if wrong == "keep":  # a verifier that always keeps the draft
            a, token = 1, pair[1]
        else:
            a, token = accept(req, [draft], pair, processed[2 * i : 2 * i + 2])
            if a == 0 and wrong == "resample":  # one that redraws from p on a rejection, draft and all
                token = pair[0]
        if a == 1:
            first[draft] += 1
            bonus[token] += 1
        else:
            first[token] += 1
    return first, bonus


@pytest.mark.parametrize("draft", [1, 3, 4])  # the likeliest, a middling token, one outside the top-k
def test_sampled_tokens_follow_the_target_distribution_whatever_the_draft(draft):
    params = SamplingParams(temperature=0.8, top_k=8)
    want = reference(LOGITS, 0.8, top_k=8)
    first, bonus = verify_counts(params, draft)
    assert rejection(first, want) is None
    if want[draft] > 0:  # the bonus after a kept draft: drawn from the next row
        assert rejection(bonus, reference(LOGITS.flip(0), 0.8, top_k=8)) is None
    # the check's power: the wrong verifiers' counts are rejected
    if want[draft] == 0:  # a draft outside the top-k is never kept, but the wrong one keeps it
        assert first[draft] == 0
        assert verify_counts(params, draft, wrong="keep")[0][draft] > 0
    else:
        assert rejection(verify_counts(params, draft, wrong="keep")[0], want) is not None
        assert rejection(verify_counts(params, draft, wrong="resample")[0], want) is not None


def test_greedy_verification_keeps_drafts_while_they_are_the_argmax():
    req = Request("r", [1], SamplingParams())
    assert accept(req, [5, 6, 7], [5, 6, 9, 4], None) == (2, 9)
    assert accept(req, [5, 6, 7], [5, 6, 7, 4], None) == (3, 4)
    assert accept(req, [5, 6, 7], [8, 6, 7, 4], None) == (0, 8)


def mtp_reference(model, seq: list[int], q: int, k: int) -> list[tuple[int, float]]:
    """The MTP block's k drafts after ``seq[: q + 2]``, from scratch with one request's own
    KV: the target over every position, the MTP block over positions 0..q (row j fed the
    target's state at j and token j+1), then k-1 single-row passes each fed its own last draft
    and output. Each draft with its logit margin over the runner-up (a near tie may go either
    way between two numerically different but correct computations)."""
    cfg, bs = model.config, 8
    n = q + 2
    blocks = -(-(n + k) // bs)
    kv = allocate_kv_caches(cfg, blocks, bs, torch.device("cpu"))
    table = list(range(blocks))
    ids = torch.tensor(seq[:n])
    pos = torch.arange(n - 1)
    meta = AttentionMetadata.build([n], [n], [table], bs, "cpu")
    hidden = model(ids, torch.arange(n), kv, meta)
    meta = AttentionMetadata.build([n - 1], [n - 1], [table], bs, "cpu")
    m = model.draft(ids[1:], pos, hidden[:-1], kv, meta)[-1:]
    out = []
    for t in range(k):
        top = model.draft_logits(m)[0].topk(2)
        tok = int(top.indices[0])
        out.append((tok, float(top.values[0] - top.values[1])))
        if t + 1 < k:
            p = q + 1 + t
            meta = AttentionMetadata.build([1], [p + 1], [table], bs, "cpu")
            m = model.draft(torch.tensor([tok]), torch.tensor([p]), m, kv, meta)
    return out


@pytest.mark.parametrize("sampled, alpha, overlap", [(False, 0.7, False), (True, 0.7, False), (True, 0.0, True)])
def test_the_drafts_are_the_mtp_blocks_over_the_whole_sequence(mtp_model, sampled, alpha, overlap):
    """Every draft the engine proposes (the MTP block's own, before a controlled drafter
    replaces some so that drafts are accepted) equals a from-scratch run of the MTP block over
    the request's tokens so far. Verification keeps outputs exact whatever the drafts, so only
    this catches an MTP row fed the wrong token or state, or a chain started at the wrong
    position. All greedy: verification runs on the device; with a sampled request in the
    batch: on the host. Alpha 0 with overlap scheduling: requests rest from drafting, their
    steps run overlapped with the MTP block over their rows only, and the drafts of each try
    after a rest read the MTP KV those steps wrote."""
    k = 3
    prompts = prompts_for(53, lengths=(13, 22, 31))
    n_out = 18 if alpha else 44  # (at alpha 0: four drafting steps, a rest, a try, a rest, a try)
    greedy = kvtier.SamplingParams(max_tokens=n_out, ignore_eos=True)
    with kvtier.LLM(mtp_model, num_device_blocks=64, block_size=8, enable_prefix_caching=False) as llm:
        ref = llm.generate(prompts, greedy)
    oracle = oracle_drafter({tuple(p): o.token_ids for p, o in zip(prompts, ref)}, alpha)
    proposals: list[tuple[tuple[int, ...], int, int]] = []  # (prompt, position, the MTP block's draft)

    def drafter(req: Request, position: int, proposal: int) -> int:
        proposals.append((tuple(req.prompt_token_ids), position, proposal))
        return oracle(req, position, proposal)

    params = [greedy] * len(prompts)
    if sampled:
        params[1] = kvtier.SamplingParams(max_tokens=n_out, ignore_eos=True, temperature=0.9, seed=5)
    with kvtier.LLM(
        mtp_model,
        num_device_blocks=64,
        block_size=8,
        enable_prefix_caching=False,
        num_speculative_tokens=k,
        overlap_schedule=overlap,
    ) as llm:
        llm.spec.drafter = drafter
        outs = llm.generate(prompts, params)
        spec = llm.cache_stats()["speculative"]
    if alpha:
        assert spec["accepted"] > 0 and spec["accepted_at"][-1] > 0
    else:
        assert spec["rested_steps"] > 2 * REST_STEPS  # (two greedy requests rest; the sampled one may not)
    for p, o, r in zip(params, outs, ref):
        if p.greedy:
            assert o.token_ids == r.token_ids
    seqs = {tuple(p): list(p) + o.token_ids for p, o in zip(prompts, outs)}
    model = load_model(mtp_model, mtp=True)
    checked = 0
    i = 0
    while i < len(proposals):  # a request's drafts of one step: consecutive positions
        key, start, _ = proposals[i]
        group = [proposals[i]]
        while i + len(group) < len(proposals) and proposals[i + len(group)][:2] == (key, start + len(group)):
            group.append(proposals[i + len(group)])
        i += len(group)
        q = start - 2  # the last accepted position: the step emitted the token at q + 1
        if q + 1 >= len(seqs[key]):  # (past max_tokens: the output was cut there)
            continue
        for (_, _, got), (want, margin) in zip(group, mtp_reference(model, seqs[key], q, len(group))):
            if margin < 1e-4:
                break  # (a near tie; the chain past it is fed either token)
            assert got == want, (key[:3], start, group)
            checked += 1
    assert checked > (40 if alpha else 20)


def test_a_request_whose_drafts_are_never_accepted_rests_from_drafting(mtp_model):
    """At acceptance 0 a request stops drafting after a few steps (its running acceptance
    halves each step: under 0.1 after four) and drafts again once every REST_STEPS steps to see
    whether it should go on; at acceptance 1 it never rests; its tokens are the same either way
    and with always drafting (``speculative_min_acceptance=0``)."""
    prompts = prompts_for(59, lengths=(12, 20))
    params = kvtier.SamplingParams(max_tokens=60, ignore_eos=True)
    with kvtier.LLM(mtp_model, num_device_blocks=64, block_size=8) as llm:
        ref = llm.generate(prompts, params)
    outputs = {tuple(p): o.token_ids for p, o in zip(prompts, ref)}
    stats = {}
    for alpha, minimum in [(0.0, 0.1), (0.0, 0.0), (1.0, 0.1)]:
        with kvtier.LLM(
            mtp_model, num_device_blocks=64, block_size=8, num_speculative_tokens=3, speculative_min_acceptance=minimum
        ) as llm:
            llm.spec.drafter = oracle_drafter(outputs, alpha)
            outs = llm.generate(prompts, params)
            stats[alpha, minimum] = llm.cache_stats()["speculative"]
        assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    rested, always, kept = stats[0.0, 0.1], stats[0.0, 0.0], stats[1.0, 0.1]
    assert always["rested_steps"] == 0 and always["drafted"] >= 2 * 3 * 55  # every decode step drafts
    # 59 decode steps per request: four drafting, then rests of REST_STEPS, each followed by one
    # try (three fit); the last steps' drafts are cut to max_tokens
    assert 2 * 3 * (4 + 2) <= rested["drafted"] <= always["drafted"] / 5
    assert rested["rested_steps"] >= 2 * 3 * REST_STEPS
    assert kept["rested_steps"] == 0 and kept["acceptance_rate"] == 1.0


def test_sampled_requests_and_n_samples_decode_with_drafts(mtp_model):
    """Temperature, top-p, seeds and n > 1 with drafts: every sample reaches max_tokens, a seeded
    request repeats itself, and drafts are verified and accepted."""
    prompts = prompts_for(47, lengths=(12, 30))
    params = kvtier.SamplingParams(max_tokens=15, ignore_eos=True, temperature=0.8, top_p=0.95, seed=3, n=3)
    with kvtier.LLM(mtp_model, num_device_blocks=64, block_size=8) as llm:
        ref = llm.generate(prompts, kvtier.SamplingParams(max_tokens=15, ignore_eos=True))
    outputs = {tuple(p): o.token_ids for p, o in zip(prompts, ref)}
    # (every step drafts: sampled tokens part from the greedy ones the drafter proposes, and
    # with few drafts accepted a request would rest from drafting)
    with kvtier.LLM(mtp_model, num_device_blocks=64, block_size=8, num_speculative_tokens=3, speculative_min_acceptance=0) as llm:
        llm.spec.drafter = oracle_drafter(outputs, 0.8)
        one = llm.generate(prompts, params)
        two = llm.generate(prompts, params)
        spec = llm.cache_stats()["speculative"]
        llm.cache.assert_invariants()
    assert all(len(c.token_ids) == 15 for o in one for c in o.outputs)
    assert [[c.token_ids for c in o.outputs] for o in one] == [[c.token_ids for c in o.outputs] for o in two]
    assert spec["drafted"] > 0 and spec["accepted"] > 0


def test_the_benchmark_measures_the_acceptance_it_controls(tmp_path):
    """``kvtier bench speculative --device cpu``: alpha 1 drafts are all accepted, alpha 0 ones
    never, and the tokens are those of the run without drafts."""
    import json

    from kvtier.bench.spec_bench import main

    out = tmp_path / "spec.json"
    assert (
        main(
            [
                "--device",
                "cpu",
                "--batch-sizes",
                "2",
                "--alphas",
                "0,1",
                "--input",
                "12",
                "--output",
                "10",
                "--repeat",
                "1",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    runs = {r["alpha"]: r for r in json.loads(out.read_text())["runs"]}
    assert runs[0.0]["acceptance"] == 0.0 and runs[1.0]["acceptance"] == 1.0
    assert all(r["same_tokens"] == "2 of 2" and r["tokens_per_s"] > 0 for r in runs.values())


def test_a_pd_hand_off_carries_the_mtp_kv(mtp_model, tmp_path):
    """P (drafting) exports a prompt to a file pool; D (drafting) starts from P's first token
    with every prompt position from the pool, the MTP layer's KV with it: no MTP row over the
    prompt, the tokens of a colocated engine without drafts."""
    from tests.engine.test_handoff import run as run_one

    prompt = prompts_for(48, lengths=(37,))[0]
    params = kvtier.SamplingParams(max_tokens=12, ignore_eos=True)
    with kvtier.LLM(mtp_model, block_size=8) as colo:
        ref = colo.generate([prompt], params)[0]
    kw = dict(storage=f"file://{tmp_path}", num_host_blocks=64, block_size=8, num_speculative_tokens=2)
    with kvtier.LLM(mtp_model, **kw) as p:
        first = run_one(p, prompt=prompt, params=kvtier.SamplingParams(max_tokens=1), export=True)
    h = first.handoff
    assert h["complete"] and h["failed_blocks"] == 0
    with kvtier.LLM(mtp_model, **kw) as d:
        d.spec.drafter = oracle_drafter({tuple(prompt): ref.token_ids}, 0.7)
        out = run_one(d, prompt=prompt, params=params, handoff=h)
        spec = d.cache_stats()["speculative"]
    assert out.token_ids == ref.token_ids
    assert out.cached_tokens_by_tier == {"device": 0, "host": 0, "storage": 37}
    assert spec["mtp_prompt_rows"] == 0 and spec["accepted"] > 0


@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_logprobs_of_drafted_tokens_are_the_targets(mtp_model, mode):
    """Each emitted token's logprob and top-k come from its verify row: the entries of plain
    decoding (the same ids; values within float32 noise of another batch shape)."""
    prompts = prompts_for(49, lengths=(14, 27))
    params = kvtier.SamplingParams(max_tokens=16, ignore_eos=True, logprobs=3, logprobs_mode=mode)
    ref, got, spec = plain_and_drafted(mtp_model, prompts, params, 0.8)
    assert spec["accepted"] > 0
    assert_same_outputs(ref, got)
    assert all(len(o.outputs[0].logprobs) == 16 for o in got)


def test_logprobs_and_prompt_logprobs_with_drafts_under_overlap_scheduling(mtp_model):
    """At alpha 0 requests rest from drafting: their steps run overlapped, and a step where they
    try again is launched while the overlapped step before it is still in flight. Each step's
    logprobs must reach its own tokens (a drafted step's results are taken after the step before
    it is finished), and prompt logprobs come from drafted steps too."""
    prompts = prompts_for(61, lengths=(13, 21))
    params = kvtier.SamplingParams(max_tokens=44, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    ref, got, spec = plain_and_drafted(mtp_model, prompts, params, 0.0, overlap_schedule=True)
    assert spec["rested_steps"] > 0 and spec["drafted"] > 0
    assert all(o.finish_reason == "length" for o in got)
    assert_same_outputs(ref, got)
    assert all(len(o.outputs[0].logprobs) == 44 for o in got)
    for a, b in zip(ref, got):
        assert len(b.prompt_logprobs) == len(a.prompt_logprobs) == len(a.prompt_token_ids)
        assert [sorted(d) if d else d for d in a.prompt_logprobs] == [sorted(d) if d else d for d in b.prompt_logprobs]


def plain_and_drafted(model, prompts, params, alpha: float, **options):
    """The outputs without drafts, with k = 3 drafts of the controlled drafter at ``alpha``
    (proposing the outputs without drafts), and the drafted engine's speculative counters."""
    with kvtier.LLM(model, num_device_blocks=64, block_size=8) as llm:
        ref = llm.generate(prompts, params)
    outputs = {tuple(p): o.token_ids for p, o in zip(prompts, ref)}
    with kvtier.LLM(model, num_device_blocks=64, block_size=8, num_speculative_tokens=3, **options) as llm:
        llm.spec.drafter = oracle_drafter(outputs, alpha)
        got = llm.generate(prompts, params)
        return ref, got, llm.cache_stats()["speculative"]


def assert_same_outputs(ref, got) -> None:
    """The same tokens, finish reasons and top-k ids; logprobs within float32 noise of another
    batch shape."""
    import numpy as np

    for a, b in zip(ref, got):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        la, lb = a.outputs[0].logprobs, b.outputs[0].logprobs
        assert [sorted(d) for d in la] == [sorted(d) for d in lb]
        np.testing.assert_allclose([d[t] for d, t in zip(la, a.token_ids)], [d[t] for d, t in zip(lb, b.token_ids)], atol=2e-5)


@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_penalties_and_min_tokens_see_the_drafts_before_each_verify_row(mtp_model, mode):
    """Repetition, frequency and presence penalties and min_tokens with drafts: verify row j is
    penalized as if the drafts before it had been generated, so greedy tokens (EOS allowed, held
    back by min_tokens), raw and processed logprobs equal plain decoding's. Without the drafts
    counted, a repeated draft goes unpenalized at the rows after it and the tokens part."""
    prompts = prompts_for(50, lengths=(14, 27, 9))
    params = kvtier.SamplingParams(
        max_tokens=20,
        min_tokens=12,
        repetition_penalty=1.3,
        frequency_penalty=0.9,
        presence_penalty=0.4,
        logprobs=2,
        logprobs_mode=mode,
    )
    ref, got, spec = plain_and_drafted(mtp_model, prompts, params, 0.85)
    assert spec["accepted"] > 0 and spec["accepted_at"][-1] > 0
    assert_same_outputs(ref, got)


def test_chunked_prefill_and_a_tight_token_budget_trim_the_drafts_not_the_tokens(mtp_model):
    """A budget of 10 tokens a step: prompts prefill in chunks beside drafted decodes, and a
    decode gets only the drafts the budget has room for."""
    prompts = prompts_for(50, lengths=(37, 45, 29))
    params = kvtier.SamplingParams(max_tokens=14, ignore_eos=True)
    kw = dict(num_device_blocks=64, block_size=8, max_num_batched_tokens=10)
    with kvtier.LLM(mtp_model, **kw) as llm:
        ref = llm.generate(prompts, params)
    outputs = {tuple(p): o.token_ids for p, o in zip(prompts, ref)}
    with kvtier.LLM(mtp_model, num_speculative_tokens=3, **kw) as llm:
        llm.spec.drafter = oracle_drafter(outputs, 1.0)
        got = llm.generate(prompts, params)
        spec = llm.cache_stats()["speculative"]
        llm.cache.assert_invariants()
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert spec["accepted"] == spec["drafted"] > 0  # alpha 1: every draft kept


@pytest.mark.slow  # (CI runs it with -m slow)
def test_a_soak_of_drafted_requests_leaks_no_block_and_keeps_greedy_exact(mtp_model):
    """40 requests over a small device tier with a host tier (evictions, swap preemption): greedy
    ones with stop tokens, sampled ones, n = 2, aborts mid-run, each step's drafts kept at a
    random rate; the cache's invariants (no block leaked, double-owned or pinned by a dead
    request) after every step, and every greedy request's tokens equal to plain decoding."""
    rng = random.Random(5)
    prompts = [prompts_for(60 + i, lengths=(rng.randrange(3, 50),))[0] for i in range(40)]
    greedy = [
        kvtier.SamplingParams(max_tokens=rng.randrange(1, 20), ignore_eos=True, stop_token_ids=[rng.randrange(VOCAB)])
        for _ in prompts
    ]
    kw = dict(num_device_blocks=20, block_size=8, num_host_blocks=64, max_num_seqs=8)
    with kvtier.LLM(mtp_model, **kw) as llm:
        ref = llm.generate(prompts, greedy)
    outputs = {tuple(p): o.token_ids for p, o in zip(prompts, ref)}
    with kvtier.LLM(mtp_model, num_speculative_tokens=3, **kw) as llm:
        drafter = oracle_drafter(outputs, 0.5, seed=6)
        llm.spec.drafter = drafter
        reqs, aborted, done = {}, set(), {}
        for i, p in enumerate(prompts):
            kind = i % 4
            params = (
                greedy[i]
                if kind < 2
                else (kvtier.SamplingParams(max_tokens=12, temperature=0.9, seed=i, ignore_eos=True, n=2 if kind == 3 else 1))
            )
            reqs[llm.add_request(p, params).request_id] = i
        steps = 0
        while llm.has_unfinished():
            for o in llm.step():
                done[o.request_id] = o
            steps += 1
            if steps % 7 == 0:
                live = [r for r in reqs if r not in done and r not in aborted]
                if live:
                    victim = rng.choice(live)
                    if llm.abort(victim):
                        aborted.add(victim)
            llm.cache.assert_invariants([r.cache_req for r in llm.scheduler.running])
        spec = llm.cache_stats()["speculative"]
        llm.cache.assert_invariants()
    assert aborted and spec["accepted"] > 0 and llm.scheduler.num_preemptions > 0
    for rid, i in reqs.items():
        if rid in aborted or i % 4 >= 2:
            continue
        assert done[rid].token_ids == ref[i].token_ids, i
