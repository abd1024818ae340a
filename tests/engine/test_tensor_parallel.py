"""Tensor parallelism on CPU (gloo, one process per rank): TP=2 gives the tokens, routed experts,
cache decisions and logprobs of TP=1 on the same checkpoint, through device hits, host hits and
swap preemption; a rank that dies ends the engine with an error naming it, within the timeout."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import torch

import kvtier
from kvtier.engine.tp import RankLost
from kvtier.model import ModelConfig, load_model
from kvtier.model.shard import TPShard, full_shape, shard_config, shard_dim, take_shard
from tests.engine.hf_reference import prompts_for

# a device tier small enough that the workload evicts to the host tier and preempts by swap
TIERS = dict(num_device_blocks=20, block_size=8, num_host_blocks=96, write_policy="write_back", max_num_seqs=4)


def workload(llm: kvtier.LLM, moe: bool) -> list:
    """Prompts sharing a prefix, run twice with other prompts between (device and host hits),
    four at once with long outputs on 20 blocks (swap preemption); greedy and seeded sampling,
    logprobs; every output's tokens, experts, hits per tier and logprobs."""
    shared = prompts_for(31, lengths=(40,))[0]
    prompts = [shared + p for p in prompts_for(32, lengths=(9, 17, 23, 30))]
    greedy = kvtier.SamplingParams(max_tokens=24, ignore_eos=True, return_routed_experts=moe, logprobs=2)
    sampled = kvtier.SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)
    outs = []
    outs += llm.generate(prompts, greedy)  # 4 at once, 20 blocks: preempts
    outs += llm.generate(prompts_for(33, lengths=(90, 70)), greedy)  # pushes the first ones off the device
    outs += llm.generate(prompts[:2], greedy)  # hits: host (and device)
    outs += llm.generate(prompts[2:3], sampled)
    return [
        (
            o.token_ids,
            None if o.routed_experts is None else o.routed_experts.tolist(),
            dict(o.cached_tokens_by_tier),
            [sorted(d) for d in o.outputs[0].logprobs] if o.outputs[0].logprobs else None,
            [d[t] for d, t in zip(o.outputs[0].logprobs, o.token_ids)] if o.outputs[0].logprobs else None,
        )
        for o in outs
    ]


@pytest.mark.parametrize(
    "preset",
    ["llama-tiny", pytest.param("qwen2-moe-tiny", marks=pytest.mark.slow)],  # (the slow pass: CI runs it)
)
def test_two_ranks_give_what_one_gives_through_every_tier(preset, checkpoint):
    """Dense (Llama) and MoE with a shared expert and a dense layer (Qwen2-MoE)."""
    moe = preset.endswith("moe-tiny")
    runs = {}
    for tp in (1, 2):
        with kvtier.LLM(checkpoint(preset), tensor_parallel_size=tp, **TIERS) as llm:
            runs[tp] = workload(llm, moe)
            stats = llm.cache_stats()
            assert llm.scheduler.num_preemptions > 0 and llm.cache.stats.swapped_out_blocks > 0, tp
            assert stats["host"]["hit_tokens"] > 0 and stats["device"]["hit_tokens"] > 0, stats
            assert llm.transfer.num_in_flight == 0
            llm.cache.assert_invariants()
            scored = llm.score(runs[tp][0][0])
            runs[tp].append(scored)
    one, two = runs[1], runs[2]
    for a, b in zip(one[:-1], two[:-1]):
        assert a[0] == b[0]  # tokens
        assert a[1] == b[1]  # routed experts (captured once, on rank 0)
        assert a[2] == b[2]  # hits per tier: the same decisions
        assert a[3] == b[3]  # the same top-k token ids
        if a[4] is not None:
            np.testing.assert_allclose(a[4], b[4], atol=2e-5)  # partial sums add in another order
    np.testing.assert_allclose(one[-1], two[-1], atol=2e-5)
    if moe:
        assert one[0][1] is not None and len(one[0][1]) > 0


def pool_run(path, pool: str, tp: int, prompts: list[list[int]], moe: bool, write: bool = True, **engine) -> list:
    """One engine writes ``prompts``' blocks to the pool (``write``); a second, with empty device
    and host tiers, reads them back. The second engine's outputs (tokens, experts, hits per tier).
    ``engine``: more LLM options (the GPU twin's device and dtype)."""
    sp = kvtier.SamplingParams(max_tokens=10, ignore_eos=True, return_routed_experts=moe)
    kw = dict(
        tensor_parallel_size=tp,
        num_device_blocks=64,
        block_size=8,
        num_host_blocks=128,
        storage=pool,
        prefetch_policy="wait_complete",
        storage_fetch="always",
        **engine,
    )  # (hits that do not depend on timing)
    if write:
        with kvtier.LLM(path, **kw) as llm:
            llm.generate(prompts, sp)
    with kvtier.LLM(path, **kw) as llm:
        outs = llm.generate(prompts, sp)
        assert llm.transfer.num_in_flight == 0
    return [
        (o.token_ids, None if o.routed_experts is None else o.routed_experts.tolist(), dict(o.cached_tokens_by_tier))
        for o in outs
    ]


@pytest.mark.slow  # five engines, three of two ranks (~25 s on 2 cores): CI runs it with -m slow
def test_storage_hits_through_two_ranks_equal_one_and_a_missing_shard_is_a_miss(checkpoint, tmp_path):
    """Each rank writes and reads its own shard of a block (``:tp<rank>of2`` objects); a block
    counts as stored only when every rank's shard is, so one rank's missing shard costs a
    recompute on both, never a block half read."""
    path = checkpoint("qwen3-moe-tiny")
    prompts = prompts_for(37, lengths=(48, 64))
    one = pool_run(path, f"file://{tmp_path / 'one'}", 1, prompts, True)
    two = pool_run(path, f"file://{tmp_path / 'two'}", 2, prompts, True)
    assert one == two
    assert all(hits["storage"] >= 40 for _, _, hits in two), two
    names = sorted(p.name for p in (tmp_path / "two").rglob("*") if p.is_file())
    rank1 = [n for n in names if n.endswith("tp1of2")]
    assert rank1 and len(rank1) == len([n for n in names if n.endswith("tp0of2")])
    # rank 1 loses its shard of every block: both ranks recompute, the outputs stay
    for p in (tmp_path / "two").rglob("*tp1of2"):
        p.unlink()
    again = pool_run(path, f"file://{tmp_path / 'two'}", 2, prompts, True, write=False)
    assert [(t, e) for t, e, _ in again] == [(t, e) for t, e, _ in one]
    assert all(hits["storage"] == 0 for _, _, hits in again), again


@pytest.mark.slow  # four engines, two of two ranks: CI runs it with -m slow
def test_a_pd_hand_off_between_two_engines_of_two_ranks(checkpoint, tmp_path):
    """P (two ranks) exports a prompt (full blocks and the partial last one) to a file pool; D (two
    ranks) starts from P's first token and reads every rank's shard: the tokens and experts of a
    colocated run. A D of another size refuses the manifest by name."""
    from tests.engine.test_handoff import run

    path = checkpoint("qwen3-moe-tiny")
    prompt = prompts_for(38, lengths=(37,))[0]
    params = kvtier.SamplingParams(max_tokens=6, ignore_eos=True, return_routed_experts=True)
    with kvtier.LLM(path, block_size=8) as colo:
        ref = colo.generate([prompt], params)[0]
    kw = dict(storage=f"file://{tmp_path}", num_host_blocks=64, block_size=8, tensor_parallel_size=2)
    with kvtier.LLM(path, **kw) as p:
        first = run(p, prompt=prompt, params=kvtier.SamplingParams(max_tokens=1), export=True)
    h = first.handoff
    assert h["complete"] and h["failed_blocks"] == 0 and h["tensor_parallel_size"] == 2
    with kvtier.LLM(path, **kw) as d:
        out = run(d, prompt=prompt, params=params, handoff=h)
    assert out.token_ids == ref.token_ids
    np.testing.assert_array_equal(out.routed_experts, ref.routed_experts)
    assert out.cached_tokens_by_tier == {"device": 0, "host": 0, "storage": 37}
    with kvtier.LLM(path, **dict(kw, tensor_parallel_size=1)) as d:
        with pytest.raises(ValueError, match="handoff.tensor_parallel_size is 2, but this engine runs 1"):
            d.add_request(prompt, params, handoff=h)


def test_a_rank_killed_mid_run_ends_the_engine_naming_it(checkpoint):
    path = checkpoint("llama-tiny")
    llm = kvtier.LLM(path, tensor_parallel_size=2, num_device_blocks=64, block_size=8, tp_timeout=10)
    try:
        llm.generate(prompts_for(34, lengths=(20,)), kvtier.SamplingParams(max_tokens=4))
        rank1 = llm.ranks.procs[0]
        os.kill(rank1.pid, signal.SIGKILL)
        with pytest.raises(RankLost, match=r"rank 1 (was killed by signal 9|closed its connection)"):
            llm.generate(prompts_for(35, lengths=(20, 30)), kvtier.SamplingParams(max_tokens=50, ignore_eos=True))
    finally:
        llm.close()
    assert rank1.poll() is not None


@pytest.mark.slow
def test_a_rank_that_fails_names_its_error(checkpoint):
    """A rank whose step raises sends its error before it exits; rank 0 stops with it."""
    llm = kvtier.LLM(checkpoint("llama-tiny"), tensor_parallel_size=2, num_device_blocks=64, block_size=8, tp_timeout=10)
    try:
        llm.ranks.send(("no such message",))
        with pytest.raises(RankLost, match="rank 1 (failed: ValueError.*no such message|exited with status 1)"):
            llm.generate(prompts_for(36, lengths=(20,)), kvtier.SamplingParams(max_tokens=8))
    finally:
        llm.close()


@pytest.mark.slow
def test_a_start_that_fails_part_way_ends_the_ranks_and_the_pool_threads_it_started(checkpoint, tmp_path, monkeypatch):
    """engine/build.py: a failure after the other ranks and the pool's I/O threads started (here
    the runner's build, where a CUDA-graph capture can fail) raises it, and leaves no rank process
    and no pool thread behind."""
    import threading

    from kvtier.engine.tp.ranks import Ranks

    def pool_threads() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name.startswith(("kvtier-fetch", "kvtier-put", "kvtier-lookup"))}

    started: list[Ranks] = []
    start = Ranks.start

    def recorded(*args, **kwargs) -> Ranks:
        started.append(start(*args, **kwargs))
        return started[-1]

    during: set[threading.Thread] = set()

    def capture_fails(*args, **kwargs):
        during.update(pool_threads())
        raise RuntimeError("CUDA graph capture failed")

    monkeypatch.setattr(Ranks, "start", recorded)
    monkeypatch.setattr("kvtier.engine.build.build_runner", capture_fails)
    before = pool_threads()
    with pytest.raises(RuntimeError, match="CUDA graph capture failed"):
        kvtier.LLM(checkpoint("llama-tiny"), tensor_parallel_size=2, storage=f"file://{tmp_path}", **TIERS)
    assert len(started) == 1 and all(p.poll() is not None for p in started[0].procs)
    assert during - before and pool_threads() <= before  # (they ran while the start went on)


def test_sizes_the_ranks_cannot_split_are_refused_by_name(checkpoint):
    with pytest.raises(ValueError, match=r"num_key_value_heads \(1\)"):  # mistral-tiny: one KV head
        kvtier.LLM(checkpoint("mistral-tiny"), tensor_parallel_size=2, num_device_blocks=16)
    with pytest.raises(ValueError, match="a memory:// pool lives in one process"):
        kvtier.EngineConfig(tensor_parallel_size=2, storage="memory://")
    with pytest.raises(ValueError, match="tp_timeout"):
        kvtier.EngineConfig(tp_timeout=0)


def test_each_rank_holds_its_slice_of_every_sharded_tensor(checkpoint):
    """The slices of two ranks put together are the whole model's tensors; replicated ones equal."""
    path = checkpoint("qwen2-moe-tiny")  # q/k/v bias, shared expert, a dense layer
    whole = dict(load_model(path, fuse=False).named_parameters())
    parts = [dict(load_model(path, fuse=False, tp=TPShard(r, 2)).named_parameters()) for r in range(2)]
    cfg = ModelConfig.from_hf_dir(path)
    assert shard_config(cfg, 2).num_kv_heads == cfg.num_kv_heads // 2
    kinds = set()
    for name, w in whole.items():
        dim = shard_dim(name)
        kinds.add(dim)
        if isinstance(dim, int):
            assert full_shape(name, tuple(parts[0][name].shape), 2) == tuple(w.shape)
            assert torch.equal(torch.cat([p[name] for p in parts], dim=dim), w), name
        elif dim == "once":
            assert torch.equal(parts[0][name], w) and not parts[1][name].any(), name
        else:
            assert all(torch.equal(p[name], w) for p in parts), name
    assert {0, 1, None} <= kinds
    with pytest.raises(ValueError, match="does not split"):
        take_shard("model.layers.0.mlp.up_proj.weight", torch.zeros(5, 3), TPShard(0, 2))


def test_dummy_weights_are_the_same_model_at_every_size(checkpoint):
    path = checkpoint("llama-tiny")
    whole = dict(load_model(path, fuse=False, load_format="dummy").named_parameters())
    parts = [dict(load_model(path, fuse=False, load_format="dummy", tp=TPShard(r, 2)).named_parameters()) for r in range(2)]
    name = "model.layers.1.self_attn.o_proj.weight"
    assert torch.equal(torch.cat([parts[0][name], parts[1][name]], dim=1), whole[name])


@pytest.mark.slow  # six engines, two of two ranks (~18 s on 2 cores): CI runs it with -m slow
@pytest.mark.parametrize("preset,k", [("qwen3-mtp-tiny", 3), ("qwen3-moe-mtp-tiny", 1)])
def test_two_ranks_draft_and_verify_as_one_does(preset, k, checkpoint):
    """Speculative decoding over two ranks: the MTP block (sharded like a decoder layer) runs
    its passes on every rank, rank 0 verifies; the greedy tokens, experts and hits per tier equal
    one rank's without drafts, and everything (the seeded sampled request, the drafts accepted,
    the MTP rows run) equals one rank's with drafts. The drafts are the controlled drafter's
    (tests/engine/test_speculative.py) so that many are accepted: a random MTP block's rarely are."""
    from tests.engine.test_speculative import oracle_drafter

    moe = "moe" in preset
    runs, spec, seen = {}, {}, {}
    for tp, drafts in ((1, 0), (1, k), (2, k)):
        with kvtier.LLM(checkpoint(preset), tensor_parallel_size=tp, num_speculative_tokens=drafts, **TIERS) as llm:
            generate = llm.generate

            def record(prompts, params, generate=generate):  # the reference continuations
                outs = generate(prompts, params)
                seen.update({tuple(p): o.token_ids for p, o in zip(prompts, outs)} if not drafts else {})
                return outs

            llm.generate = record
            if drafts:
                llm.spec.drafter = oracle_drafter(dict(seen), 0.7)
            runs[tp, drafts] = [r[:3] for r in workload(llm, moe)]
            if drafts:
                spec[tp] = llm.cache_stats()["speculative"]
            assert llm.transfer.num_in_flight == 0
            llm.cache.assert_invariants()
    # the seeded sampled request (the last) draws through the verification's rejection sampling:
    # with drafts it equals itself across ranks, not the run without drafts
    assert runs[1, k][:-1] == runs[1, 0][:-1] and runs[2, k] == runs[1, k]
    assert spec[2]["accepted"] > spec[2]["drafted"] / 5 and spec[2]["accepted_at"][-1] > 0  # (the last place too)
    keys = ("drafted", "accepted", "accepted_at", "mtp_rows")
    assert {n: spec[2][n] for n in keys} == {n: spec[1][n] for n in keys}
