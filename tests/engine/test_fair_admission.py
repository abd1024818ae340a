"""Fair admission (engine/scheduler.py): an owner (one HTTP call: every prompt and sample of it)
runs at most ``max_num_seqs_per_request`` sequences; waiting requests are admitted by (priority,
running sequences of their owner, queue position); an owner's prefill takes at most half of a
step's budget while another owner has prefill work; preemption takes the lowest priority first.
Every check counts steps, never time, and the outputs are those of a run without the rule (a
turn taken or a cache hit never changes a token)."""

from __future__ import annotations

from collections import Counter

import pytest

import kvtier
from kvtier.engine.outputs import RequestOutput
from kvtier.engine.request import Status

BS = 8
PROMPTS = [[(7 * i + 3 * k + 1) % 250 for i in range(29)] for k in range(4)]  # 3 full blocks + 5 tokens


def drive(llm, late=(), check=None):
    """Step ``llm`` until idle. ``late``: (step, fn) pairs, ``fn(llm)`` called before that step
    (0-based). Returns (outputs by request id, the step each request first ran in, the step it
    finished in, the sequences each owner ran per step)."""
    real = llm.runner.execute
    per_step: list[Counter[str]] = []  # sequences run per owner, a Counter per step

    def spy(out, start_loads=None):
        assert all(s.request.status is Status.RUNNING for s in out.scheduled)  # never a preempted one
        per_step[-1] += Counter(s.request.owner for s in out.scheduled)
        for s in out.scheduled:
            first_ran.setdefault(s.request.request_id, len(per_step) - 1)
        return real(out, start_loads)

    late = dict(late)
    outs: dict[str, RequestOutput] = {}
    first_ran: dict[str, int] = {}  # request id -> the step it first ran in
    done_at: dict[str, int] = {}  # request id -> the step it finished in
    llm.runner.execute = spy
    try:
        step = 0
        while llm.has_unfinished() or step in late:
            if step in late:
                late.pop(step)(llm)
            per_step.append(Counter())
            for o in llm.step():
                outs[o.request_id] = o
                done_at[o.request_id] = step
            if check is not None:
                check(llm)
            step += 1
    finally:
        llm.runner.execute = real
    return outs, first_ran, done_at, per_step


def samples(out) -> list[list[int]]:
    return [c.token_ids for c in out.outputs]


def test_a_call_of_many_samples_runs_at_most_its_share_and_a_later_caller_goes_next(checkpoint):
    """4 prompts x n=16 of one call (one owner), 16 slots: the call runs at most 4 sequences a
    step (a quarter of max_num_seqs, the default); a 4-token request of another caller, added at
    step 3, runs in the next step and is answered long before the call; and the call's 64 samples
    are those of a run where it may fill every slot."""
    path = checkpoint("llama-tiny")
    big = kvtier.SamplingParams(n=16, seed=3, temperature=0.8, max_tokens=6, ignore_eos=True)
    small = kvtier.SamplingParams(max_tokens=4, ignore_eos=True)

    def add_call(llm):
        for k, p in enumerate(PROMPTS):
            llm.add_request(p, big, request_id=f"call-{k}", owner="cmpl-big")

    def cap_held(llm):  # the call's sequences between steps, too (admitted, not yet finished)
        assert sum(r.owner == "cmpl-big" for r in llm.scheduler.running) <= 4

    with kvtier.LLM(path, block_size=BS, num_device_blocks=128, max_num_seqs=16) as llm:
        assert llm.scheduler.max_num_seqs_per_request == 4
        outs, first_ran, done_at, per_step = drive(
            llm, [(0, add_call), (3, lambda llm: llm.add_request([5, 6, 7, 8], small, request_id="small"))], check=cap_held
        )
        llm.cache.assert_invariants()
    with kvtier.LLM(path, block_size=BS, num_device_blocks=128, max_num_seqs=16, max_num_seqs_per_request=16) as llm:
        free, _, _, free_steps = drive(llm, [(0, add_call)])
    assert max(c["cmpl-big"] for c in per_step) == 4  # capped, and the cap is used
    assert max(c["cmpl-big"] for c in free_steps) == 16  # (what it ran without the cap)
    assert first_ran["small"] <= 4  # the step after it came
    last_of_call = max(done_at[f"call-{k}"] for k in range(4))
    assert done_at["small"] <= 3 + 1 + 4 and last_of_call > done_at["small"] + 20
    assert outs["small"].token_ids and len(outs["small"].token_ids) == 4
    for k in range(4):
        got, want = samples(outs[f"call-{k}"]), samples(free[f"call-{k}"])
        assert got == want and len({tuple(t) for t in got}) > 1  # seeded: distinct, and the same


def test_a_freed_slot_goes_to_the_owner_running_fewest(checkpoint):
    """Two slots, no cap: a1 and a2 (owner A) run, a3 (A) waits, then b (its own owner) comes.
    When a1 ends, its slot goes to b (A runs one, b's owner none), not to a3 (first in the queue)."""
    short, long = (kvtier.SamplingParams(max_tokens=m, ignore_eos=True) for m in (3, 30))

    def add_b(llm):
        llm.add_request([9, 9, 9], long, request_id="b")

    with kvtier.LLM(
        checkpoint("llama-tiny"), block_size=BS, num_device_blocks=64, max_num_seqs=2, max_num_seqs_per_request=2
    ) as llm:
        llm.add_request([1, 2, 3], short, request_id="a1", owner="A")
        llm.add_request([4, 5, 6], long, request_id="a2", owner="A")
        llm.add_request([7, 8, 9], long, request_id="a3", owner="A")
        _, first_ran, done_at, _ = drive(llm, [(1, add_b)])
    assert first_ran["a1"] == first_ran["a2"] == 0
    assert first_ran["b"] == done_at["a1"] + 1 < first_ran["a3"]


def test_the_lower_priority_number_is_admitted_first(checkpoint):
    """One slot; "low" (priority 5) queued before "high" (priority -1): high runs first."""
    params = kvtier.SamplingParams(max_tokens=5, ignore_eos=True)
    with kvtier.LLM(checkpoint("llama-tiny"), block_size=BS, num_device_blocks=64, max_num_seqs=1) as llm:
        llm.add_request([1, 2, 3], params, request_id="low", priority=5)
        llm.add_request([4, 5, 6], params, request_id="high", priority=-1)
        outs, first_ran, done_at, _ = drive(llm)
        alone = llm.generate([[1, 2, 3], [4, 5, 6]], params)
    assert first_ran["high"] == 0 and done_at["high"] < first_ran["low"]
    assert [outs["low"].token_ids, outs["high"].token_ids] == [o.token_ids for o in alone]


def test_priorities_per_prompt_in_generate(checkpoint):
    params = kvtier.SamplingParams(max_tokens=3, ignore_eos=True)
    with kvtier.LLM(checkpoint("llama-tiny"), block_size=BS, num_device_blocks=64, max_num_seqs=1) as llm:
        outs = llm.generate([[1, 2, 3], [4, 5, 6]], params, priority=[1, 0])
        assert outs[1].metrics["admitted"] < outs[0].metrics["admitted"]  # (its order, not its time)
        with pytest.raises(ValueError, match="priority must be an int in"):
            llm.generate([1, 2, 3], params, priority=2**40)
        with pytest.raises(ValueError, match="2 priorities for 1 prompts"):
            llm.generate([[1, 2, 3]], params, priority=[0, 1])


def test_preemption_takes_the_lowest_priority_even_if_it_is_older_and_ran_in_the_step(checkpoint):
    """8 device blocks for two requests that grow to 9: "old" (priority 1, admitted first) and
    "new" (priority 0, a step later). new needs a block after old was scheduled in the same step:
    old is the victim (its chunk taken back from the step), not new, the newest; both answer as
    alone."""
    path = checkpoint("llama-tiny")
    params = kvtier.SamplingParams(max_tokens=30, ignore_eos=True)
    old, new = list(range(1, 17)), list(range(40, 60))  # 16 and 20 tokens
    added = []

    def add_new(llm):
        added.append(llm.add_request(new, params, request_id="new", priority=0))

    with kvtier.LLM(path, block_size=BS, num_device_blocks=8, preemption_mode="recompute") as llm:
        a = llm.add_request(old, params, request_id="old", priority=1)
        outs, _, _, _ = drive(
            llm,
            [(1, add_new)],
            check=lambda llm: llm.cache.assert_invariants([r.cache for r in (*llm.scheduler.running, *llm.scheduler.waiting)]),
        )
        assert a.num_preemptions >= 1 and added[0].num_preemptions == 0
    with kvtier.LLM(path, block_size=BS, num_device_blocks=64) as llm:
        want = llm.generate([old, new], params)
    assert [outs["old"].token_ids, outs["new"].token_ids] == [w.token_ids for w in want]


def test_owners_share_the_prefill_budget(checkpoint):
    """A 32-token budget; owner A prefills two 120-token prompts. b (another owner) comes after
    step 0: in the next step it is admitted and A's chunks take at most half the budget."""
    params = kvtier.SamplingParams(max_tokens=2, ignore_eos=True)
    with kvtier.LLM(checkpoint("llama-tiny"), block_size=BS, num_device_blocks=128, max_num_batched_tokens=32) as llm:
        for k in range(2):
            llm.add_request([(k + 3 * i) % 200 + 1 for i in range(120)], params, request_id=f"a{k}", owner="A")
        real = llm.runner.execute
        tokens: list[Counter[str]] = []  # tokens run per owner, a Counter per step

        def spy(out, start_loads=None):
            tokens.append(Counter())
            for s in out.scheduled:
                tokens[-1][s.request.owner] += s.num_tokens
            return real(out, start_loads)

        llm.runner.execute = spy
        llm.step()
        llm.add_request([5, 6, 7, 8, 9], params, request_id="b")
        llm.step()
        while llm.has_unfinished():
            llm.step()
    assert tokens[0] == {"A": 32}  # alone: the whole budget
    assert tokens[1] == {"A": 16, "b": 5}  # b admitted; A's share is half
