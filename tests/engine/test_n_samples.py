"""n > 1 samples per prompt (engine/group.py): sample i of ``n, seed=s`` is the request ``n=1,
seed=s+i``; the prompt is prefilled once and its blocks shared; hits on every tier; abort and
failure of a group return every block."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest

import kvtier
from kvtier.cli import main

BS = 8
PROMPT = [(7 * i + 3) % 250 for i in range(29)]  # 3 full blocks of 8 and a partial one of 5
FULL, PARTIAL = divmod(len(PROMPT), BS)


def sampled(n: int, seed: int | None = 11, max_tokens: int = 10, **kw) -> kvtier.SamplingParams:
    return kvtier.SamplingParams(n=n, seed=seed, temperature=0.8, max_tokens=max_tokens, ignore_eos=True, **kw)


def one_by_one(path, prompt, params: kvtier.SamplingParams, **engine_kw) -> list[kvtier.RequestOutput]:
    """The n=1 requests seeded seed+i, cold (no prefix caching): what sample i must equal."""
    singles = [replace(params, n=1, seed=params.sample_seed(i)) for i in range(params.n)]
    with kvtier.LLM(path, block_size=BS, num_device_blocks=128, enable_prefix_caching=False, **engine_kw) as llm:
        return llm.generate([prompt] * params.n, singles)


def held_by_requests(llm) -> int:
    """Device blocks in use that no tree node owns: held by requests (or leaked)."""
    return llm.cache.device_pool.num_used - sum(n.device_block is not None for n in llm.cache.tree.nodes.values())


def run(llm, prompt, params, request_id=None):
    """Step ``llm`` until it is idle: (outputs, peak device blocks in use, tokens computed)."""
    real, computed = llm.runner.execute, []

    def counting(out, start_loads=None):
        computed.append(out.num_tokens)
        return real(out, start_loads)

    llm.runner.execute = counting
    try:
        llm.add_request(prompt, params, request_id=request_id)
        outs, peak = [], 0
        while llm.has_unfinished():
            outs += llm.step()
            peak = max(peak, llm.cache.device_pool.num_used)
            sched = llm.scheduler  # every block: the tree's or a live sample's
            llm.cache.assert_invariants([r.cache for r in (*sched.running, *sched.waiting)])
    finally:
        llm.runner.execute = real
    return outs, peak, sum(computed)


def test_sample_i_of_n_equals_the_request_seeded_seed_plus_i_and_runs_alike_run_to_run(checkpoint):
    path = checkpoint("llama-tiny")
    params = sampled(8)
    want = [o.token_ids for o in one_by_one(path, PROMPT, params)]
    assert len({tuple(t) for t in want}) > 1  # the seeds differ: so do the samples
    with kvtier.LLM(path, block_size=BS, num_device_blocks=128) as llm:
        first = llm.generate(PROMPT, params)
        again = llm.generate(PROMPT, params)  # sample 0 now hits the prompt too
        short = llm.generate(PROMPT, sampled(3, max_tokens=1))[0]  # sample 0 ends as it forks
        llm.cache.assert_invariants()
        assert held_by_requests(llm) == 0
    with kvtier.LLM(path, block_size=BS, num_device_blocks=128, enable_prefix_caching=False) as llm:
        unshared = llm.generate(PROMPT, params)[0]  # documented: n plain requests
    assert len(first) == 1
    out = first[0]
    assert [c.index for c in out.outputs] == list(range(8))
    assert [c.token_ids for c in out.outputs] == want
    assert [c.token_ids for c in again[0].outputs] == want
    assert [c.token_ids for c in unshared.outputs] == want
    assert [c.token_ids for c in short.outputs] == [w[:1] for w in want[:3]]
    assert all(c.finish_reason == "length" and len(c.token_ids) == 10 for c in out.outputs)
    assert (out.token_ids, out.text, out.finish_reason) == (out.outputs[0].token_ids, out.outputs[0].text, "length")
    assert [c.text for c in out.outputs] == [c.text for c in unshared.outputs]
    assert out.num_cached_tokens == 0 and again[0].num_cached_tokens == FULL * BS  # sample 0's: the prompt's


def test_greedy_samples_are_identical_and_equal_greedy_n1(checkpoint):
    greedy = kvtier.SamplingParams(max_tokens=12, ignore_eos=True)
    with kvtier.LLM(checkpoint("llama-tiny"), block_size=BS, num_device_blocks=128) as llm:
        want = llm.generate(PROMPT, greedy)[0].token_ids
        llm.generate([list(range(100, 140))], greedy)  # (another prompt between them)
        got = llm.generate(PROMPT, kvtier.SamplingParams(max_tokens=12, ignore_eos=True, n=4))[0]
    assert [c.token_ids for c in got.outputs] == [want] * 4


def test_moe_routed_experts_of_sample_i_equal_those_of_the_request_seeded_seed_plus_i(checkpoint):
    path = checkpoint("qwen3-moe-tiny")
    params = sampled(4, seed=3, max_tokens=6, return_routed_experts=True)
    want = one_by_one(path, PROMPT, params)
    with kvtier.LLM(path, block_size=BS, num_device_blocks=128) as llm:
        out = llm.generate(PROMPT, params)[0]
    for c, w in zip(out.outputs, want):
        assert c.token_ids == w.token_ids
        assert c.routed_experts.shape == (len(PROMPT) + len(c.token_ids) - 1, *w.routed_experts.shape[1:])
        assert np.array_equal(c.routed_experts, w.routed_experts)
    assert out.routed_experts is out.outputs[0].routed_experts


def test_the_prompt_is_prefilled_once_and_its_blocks_are_shared_by_the_samples(checkpoint):
    n, gen = 8, 12
    with kvtier.LLM(checkpoint("llama-tiny"), block_size=BS, num_device_blocks=128) as llm:
        (out,), peak, computed = run(llm, PROMPT, sampled(n, max_tokens=gen))
        assert held_by_requests(llm) == 0
    # sample 0: the whole prompt; samples 1..7: the partial block only; then one token per decode
    assert computed == len(PROMPT) + (n - 1) * PARTIAL + n * (gen - 1)
    bound = (FULL + n * math.ceil((gen + PARTIAL) / BS)) * 1.05
    assert peak <= bound, (peak, bound)
    assert peak < n * math.ceil((len(PROMPT) + gen) / BS)  # what n unshared copies would hold
    assert len(out.outputs) == n


def test_a_prompt_only_on_the_host_tier_gives_the_samples_of_a_cold_run(checkpoint):
    path = checkpoint("llama-tiny")
    params = sampled(4, seed=5, max_tokens=6)
    want = [o.token_ids for o in one_by_one(path, PROMPT, params)]
    with kvtier.LLM(path, block_size=BS, num_device_blocks=16, num_host_blocks=64, write_policy="write_through") as llm:
        llm.generate(PROMPT, kvtier.SamplingParams(max_tokens=2))  # computed, copied to host
        llm.generate([list(range(100, 220))], kvtier.SamplingParams(max_tokens=2))  # evicts it from device
        out = llm.generate(PROMPT, params)[0]
        stats = llm.cache.stats.hit_tokens
        llm.cache.assert_invariants()
        assert held_by_requests(llm) == 0
    assert out.cached_tokens_by_tier == {"device": 0, "host": FULL * BS, "storage": 0}
    assert [c.token_ids for c in out.outputs] == want
    assert stats["host"] == FULL * BS  # loaded once, by sample 0
    assert stats["device"] == 3 * FULL * BS  # the others found it on device


def test_a_prompt_in_a_file_pool_is_fetched_once_by_a_fresh_engine_for_all_samples(checkpoint, tmp_path):
    path = checkpoint("llama-tiny")
    params = sampled(4, seed=9, max_tokens=6)
    kw = dict(
        block_size=BS,
        num_device_blocks=64,
        num_host_blocks=32,
        storage=f"file://{tmp_path}/pool",
        storage_fetch="always",
        prefetch_policy="wait_complete",
    )
    with kvtier.LLM(path, **kw) as llm:
        cold = llm.generate(PROMPT, params)[0]
    with kvtier.LLM(path, **kw) as llm:  # a fresh engine: the prompt is in the pool only
        warm = llm.generate(PROMPT, params)[0]
        stats = llm.cache_stats()
        llm.cache.assert_invariants()
        assert held_by_requests(llm) == 0
    assert cold.cached_tokens_by_tier["storage"] == 0
    assert warm.cached_tokens_by_tier == {"device": 0, "host": 0, "storage": FULL * BS}
    assert [c.token_ids for c in warm.outputs] == [c.token_ids for c in cold.outputs]
    assert stats["storage"]["hit_tokens"] == FULL * BS and stats["device"]["hit_tokens"] == 3 * FULL * BS


@pytest.mark.parametrize("steps", [0, 1, 3])  # sample 0 queued / the others queued / some running
def test_abort_drops_every_sample_queued_or_running_and_returns_every_block(checkpoint, steps):
    # (every slot open to the one request: three of its samples running, three queued)
    with kvtier.LLM(
        checkpoint("llama-tiny"), block_size=BS, num_device_blocks=64, max_num_seqs=3, max_num_seqs_per_request=3
    ) as llm:
        llm.add_request(PROMPT, sampled(6, max_tokens=40), request_id="grp")
        for _ in range(steps):
            assert llm.step() == []
        if steps == 3:
            assert len(llm.scheduler.running) == 3 and len(llm.scheduler.waiting) == 3
        assert llm.abort("grp")
        assert not llm.has_unfinished() and not llm.abort("grp")
        llm.cache.assert_invariants()
        assert held_by_requests(llm) == 0
        again = llm.generate(PROMPT, sampled(2, max_tokens=3))  # the engine serves on
        assert len(again[0].outputs) == 2
        (out,), _, _ = run(llm, PROMPT, sampled(2, max_tokens=3), request_id="grp")  # the id is free again
        assert out.request_id == "grp"


def test_a_failing_sample_fails_its_request_aborts_the_others_and_the_engine_serves_on(checkpoint):
    with kvtier.LLM(checkpoint("llama-tiny"), block_size=BS, num_device_blocks=64) as llm:
        real = llm.runner.execute

        def poisoned(out, start_loads=None):  # sample 2 of any group fails in every forward
            if any(s.request.request_id.endswith("#2") for s in out.scheduled):
                raise RuntimeError("injected: kernel exploded")
            return real(out, start_loads)

        llm.runner.execute = poisoned
        other = llm.add_request([5, 6, 7], kvtier.SamplingParams(max_tokens=30, ignore_eos=True))
        llm.add_request(PROMPT, sampled(4, max_tokens=30), request_id="grp")
        outs = []
        while llm.has_unfinished():
            outs += llm.step()
        by_id = {o.request_id: o for o in outs}
        assert sorted(by_id) == sorted(["grp", other.request_id]) and len(outs) == 2
        failed = by_id["grp"]
        assert failed.finish_reason == "error" and failed.error_kind == "internal"
        assert "sample 2 of 4" in failed.error and "kernel exploded" in failed.error
        assert [(c.index, c.finish_reason) for c in failed.outputs] == [(i, "error") for i in range(4)]
        assert by_id[other.request_id].finish_reason == "length"
        assert llm.num_failed_requests == 1
        llm.cache.assert_invariants()
        assert held_by_requests(llm) == 0
        with pytest.raises(RuntimeError, match="sample 2 of 3"):
            llm.generate(PROMPT, sampled(3))
        assert held_by_requests(llm) == 0
        llm.runner.execute = real
        assert len(llm.generate(PROMPT, sampled(3))[0].outputs) == 3


def test_a_request_keeps_its_id_until_its_last_sample_finished(checkpoint):
    with kvtier.LLM(checkpoint("llama-tiny"), block_size=BS, num_device_blocks=64) as llm:
        llm.add_request(PROMPT, sampled(2, max_tokens=3), request_id="grp")
        while not llm.scheduler.running or llm.scheduler.running[0].request_id == "grp":
            assert llm.step() == []  # until sample 0 finished (sample 1 runs on)
        with pytest.raises(ValueError, match="request_id 'grp' is already in use"):
            llm.add_request([1, 2, 3], kvtier.SamplingParams(), request_id="grp")
        outs = []
        while llm.has_unfinished():
            outs += llm.step()
        assert [o.request_id for o in outs] == ["grp"] and len(outs[0].outputs) == 2


def test_n_samples_through_a_pd_hand_off_are_refused_naming_n(checkpoint):
    with kvtier.LLM(checkpoint("llama-tiny"), block_size=BS, num_device_blocks=64, storage="memory://?capacity=16MiB") as llm:
        with pytest.raises(ValueError, match="n=2 samples cannot be served through a PD hand-off"):
            llm.add_request(PROMPT, sampled(2), export=True)
        assert not llm.has_unfinished()


def test_cli_generate_prints_the_samples(checkpoint, capsys):
    args = [
        "generate",
        str(checkpoint("llama-tiny")),
        "--prompt-ids",
        ",".join(map(str, PROMPT)),
        "--n",
        "3",
        "--temperature",
        "0.8",
        "--sampling-seed",
        "1",
        "--max-tokens",
        "5",
        "--ignore-eos",
        "--block-size",
        str(BS),
        "--num-device-blocks",
        "64",
    ]
    assert main([*args, "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    want = one_by_one(checkpoint("llama-tiny"), PROMPT, sampled(3, seed=1, max_tokens=5))
    assert [s["index"] for s in res["samples"]] == [0, 1, 2]
    assert [s["token_ids"] for s in res["samples"]] == [w.token_ids for w in want]
    assert res["token_ids"] == want[0].token_ids
    assert main(args) == 0
    assert "sample 2: token_ids=" in capsys.readouterr().out


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_samples_preempted_for_want_of_device_blocks_give_the_same_samples(checkpoint, mode):
    path = checkpoint("llama-tiny")
    params = sampled(4, seed=2, max_tokens=30)
    want = [o.token_ids for o in one_by_one(path, PROMPT, params)]
    # each sample needs ceil(59/8) = 8 blocks (3 of them shared): 4 of them cannot all fit in 14
    with kvtier.LLM(
        path, block_size=BS, num_device_blocks=14, preemption_mode=mode, num_host_blocks=64 if mode == "swap" else 0
    ) as llm:
        (out,), _, _ = run(llm, PROMPT, params)
        assert llm.scheduler.num_preemptions > 0
        assert held_by_requests(llm) == 0
    assert [c.token_ids for c in out.outputs] == want
