"""Overlap scheduling (engine/core.py): step N+1 is scheduled and queued before step N's results
are taken. The reference is the same engine with overlap off: every output (tokens, text,
logprobs, routed experts, cached tokens) must be identical, on workloads that reach each of its
paths (a token still in flight feeding the next step, a request finished by a token the host had
not seen, a preemption deferred until the step in flight is done, loads, penalties, n > 1, stop
strings, aborts and a failing step), and no block may be left held."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

import kvtier
from kvtier.engine.core import EngineCore

BS = 8
cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (one H100 80GB runs it: PYTHONPATH=$PWD pytest tests/engine)"
)


def prompts(seed: int, lengths) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    shared = rng.integers(1, 250, 2 * BS).tolist()  # a common prefix: device hits
    return [shared + rng.integers(1, 250, n).tolist() for n in lengths]


def mixed_params(stop_token: int) -> list[kvtier.SamplingParams]:
    sp = kvtier.SamplingParams
    return [
        sp(max_tokens=12, ignore_eos=True),  # greedy, by length
        sp(max_tokens=16, stop_token_ids=[stop_token]),  # stops mid-way (maybe)
        sp(max_tokens=10, temperature=0.9, top_p=0.8, seed=7, logprobs=3),  # seeded sampling
        sp(max_tokens=9, temperature=1.2, top_k=20, seed=3, logprobs=2, logprobs_mode="processed"),
        sp(max_tokens=7, ignore_eos=True, prompt_logprobs=2),
        sp(max_tokens=11, temperature=0.7, seed=11, n=3),  # n > 1 samples
        sp(max_tokens=8, ignore_eos=True, frequency_penalty=0.5, min_tokens=3),  # host-side counts
        sp(max_tokens=1, ignore_eos=True),  # one token: no decode
    ]


def summary(o: kvtier.RequestOutput) -> tuple:
    """Everything a user sees of ``o``. Logprobs to 1e-5: a finished request's extra step changes
    a batch's rows, and with them the float rounding of batched matmuls, not the tokens."""
    return (
        o.request_id,
        o.finish_reason,
        o.num_cached_tokens,
        tuple(sorted(o.cached_tokens_by_tier.items())),
        [
            (c.token_ids, c.finish_reason, _rounded(c.logprobs), None if c.routed_experts is None else c.routed_experts.tolist())
            for c in o.outputs
        ],
        _rounded(o.prompt_logprobs),
    )


def _rounded(entries):
    if entries is None:
        return None
    return [None if e is None else {t: round(v, 4) for t, v in e.items()} for e in entries]


def run_all(core: EngineCore, ps, params, steps_between: int = 2) -> dict[str, tuple]:
    """Add the requests a few at a time (joining running batches), step to the end."""
    outs: dict[str, tuple] = {}
    for i, (p, sp) in enumerate(zip(ps, params)):
        core.add_request(p, sp, request_id=f"r{i}")
        for _ in range(steps_between):
            for o in core.step():
                outs[o.request_id] = summary(o)
    while core.has_unfinished():
        for o in core.step():
            outs[o.request_id] = summary(o)
    return outs


def held_by_requests(core: EngineCore) -> int:
    nodes = core.cache.tree.nodes.values()
    return core.cache.device_pool.num_used - sum(n.device_block is not None for n in nodes)


def check_identity(path, moe: bool, **kw) -> None:
    ps = prompts(5, (3, 9, 14, 5, 20, 7, 11, 4))
    with EngineCore(path, block_size=BS, overlap_schedule=False, **kw) as probe:
        first = probe.add_request(ps[1], kvtier.SamplingParams(max_tokens=6, ignore_eos=True))
        while probe.has_unfinished():
            probe.step()
        stop_token = first.output_token_ids[3]  # request 1 stops by a token, mid-way
    params = [replace(sp, return_routed_experts=moe) for sp in mixed_params(stop_token)]
    runs = {}
    for overlap in (False, True):
        with EngineCore(path, block_size=BS, overlap_schedule=overlap, **kw) as core:
            runs[overlap] = run_all(core, ps, params)
            core.cache.assert_invariants()
            assert held_by_requests(core) == 0 and not core.scheduler.draining
            fed = core.runner.steps_fed_in_flight  # steps whose inputs took a token from the step in flight
            if overlap:
                assert fed > 10, "overlap on, yet no step read a token still in flight"
            else:
                assert fed == 0
    assert runs[True] == runs[False]
    assert runs[False]["r1"][1] == "stop" and len(runs[False]) == len(ps)


@pytest.mark.parametrize("preset", ["llama-tiny", "qwen3-moe-tiny"])
def test_outputs_with_overlap_equal_those_without(preset, checkpoint):
    check_identity(checkpoint(preset), preset.endswith("moe-tiny"))


@cuda
@pytest.mark.parametrize("preset", ["llama-tiny", "qwen3-moe-tiny"])
def test_cuda_outputs_with_overlap_equal_those_without(preset, checkpoint):
    check_identity(checkpoint(preset), preset.endswith("moe-tiny"), device="cuda", dtype="float32")


@cuda
@pytest.mark.parametrize("preset", ["llama-tiny", "qwen3-moe-tiny"])
def test_cuda_steady_decode_schedules_and_launches_without_waiting_for_the_gpu(preset, checkpoint, monkeypatch):
    """No host sync between a step's results and the next launch in steady decode: scheduling and
    launching (the runner queuing forward and sampling, the scheduler advancing the requests) run
    under torch's sync debug mode "error" (a synchronizing call raises, and a step that raises
    fails its requests)."""
    path = checkpoint(preset)
    with EngineCore(path, device="cuda", dtype="bfloat16", block_size=BS, num_device_blocks=256, overlap_schedule=True) as core:
        for i, p in enumerate(prompts(21, (5, 9, 13, 17, 21, 25))):
            core.add_request(p, kvtier.SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.8, seed=i, logprobs=2))
        for _ in range(3):  # prefills, CUDA graphs captured
            core.step()
        assert len(core.scheduler.running) == 6 and not core.scheduler.waiting
        guarded = [0]

        def strict(fn):
            def call(*a, **k):
                torch.cuda.set_sync_debug_mode("error")
                try:
                    return fn(*a, **k)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                    guarded[0] += 1

            return call

        outs = []
        with monkeypatch.context() as strictly:
            for part, name in ((core.scheduler, "schedule"), (core.runner, "execute"), (core.scheduler, "advance")):
                strictly.setattr(part, name, strict(getattr(part, name)))
            for _ in range(20):
                outs += core.step()
        while core.has_unfinished():
            outs += core.step()
        assert guarded[0] >= 3 * 20 and len(outs) == 6
        assert all(o.error is None and len(o.token_ids) == 40 for o in outs), [o.error for o in outs]


def test_overlap_equals_no_overlap_under_preemption_and_host_loads(checkpoint):
    """A device tier too small for the batch: preemptions (deferred until the step in flight is
    done), swaps back through the host tier, host hits loaded layer by layer. (Which tier served
    how many tokens may differ: with overlap a step's blocks join the tree when its results are
    in, a step later.)"""
    path = checkpoint("llama-tiny")
    ps = prompts(9, (30, 41, 52, 63, 25, 37))
    params = [kvtier.SamplingParams(max_tokens=24, ignore_eos=True)] * len(ps)
    runs, stats = {}, {}
    for overlap in (False, True):
        with EngineCore(
            path, block_size=BS, num_device_blocks=16, num_host_blocks=96, preemption_mode="swap", overlap_schedule=overlap
        ) as core:
            first = run_all(core, ps, params, steps_between=1)
            again = run_all(core, ps[:3], params[:3], steps_between=0)  # host hits
            runs[overlap] = [{k: (v[0], v[1], v[4]) for k, v in r.items()} for r in (first, again)]
            stats[overlap] = (core.scheduler.num_preemptions, core.cache_stats()["host"]["hit_tokens"])
            core.cache.assert_invariants()
            assert held_by_requests(core) == 0 and core.transfer.num_in_flight == 0
    assert runs[True] == runs[False]
    assert stats[True][0] > 0 and stats[True][1] > 0, stats


def test_an_abort_while_its_step_is_in_flight_returns_its_blocks_and_spares_the_others(checkpoint):
    path = checkpoint("llama-tiny")
    ps = prompts(13, (10, 12, 14))
    sp = kvtier.SamplingParams(max_tokens=20, ignore_eos=True)
    with EngineCore(path, block_size=BS, overlap_schedule=False) as ref:
        want = run_all(ref, ps[:2], [sp, sp], steps_between=0)
    with EngineCore(path, block_size=BS, overlap_schedule=True) as core:
        for i, p in enumerate(ps):
            core.add_request(p, sp, request_id=f"r{i}" if i < 2 else "victim")
        outs = {}
        for _ in range(5):
            for o in core.step():
                outs[o.request_id] = summary(o)
        in_flight = core.step_in_flight
        assert in_flight is not None and any(s.request.request_id == "victim" for s in in_flight.scheduled)
        assert core.abort("victim")
        while core.has_unfinished():
            for o in core.step():
                outs[o.request_id] = summary(o)
        assert outs == want
        core.cache.assert_invariants()
        assert held_by_requests(core) == 0 and not core.scheduler.draining


def test_a_failing_step_under_overlap_fails_its_request_alone(checkpoint, monkeypatch):
    path = checkpoint("llama-tiny")
    ps = prompts(17, (6, 8, 10))
    sp = kvtier.SamplingParams(max_tokens=12, ignore_eos=True)
    with EngineCore(path, block_size=BS, overlap_schedule=False) as ref:
        want = run_all(ref, ps[:2], [sp, sp], steps_between=0)
    with EngineCore(path, block_size=BS, overlap_schedule=True) as core:
        real = core.runner.execute
        calls = [0]

        def poisoned(out, start_loads=None):  # the victim's 4th step raises
            if any(s.request.request_id == "victim" for s in out.scheduled):
                calls[0] += 1
                if calls[0] >= 4:
                    raise RuntimeError("injected: kernel exploded")
            return real(out, start_loads)

        monkeypatch.setattr(core.runner, "execute", poisoned)
        outs = {}
        for i, p in enumerate(ps):
            core.add_request(p, sp, request_id=f"r{i}" if i < 2 else "victim")
        while core.has_unfinished():
            for o in core.step():
                outs[o.request_id] = o
        assert outs.pop("victim").error_kind == "internal"
        assert {k: summary(v) for k, v in outs.items()} == want
        core.cache.assert_invariants()
        assert held_by_requests(core) == 0 and not core.scheduler.draining
