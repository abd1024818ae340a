"""kvtier.LLM greedy tokens == transformers `generate` on the same checkpoint, for every family,
cold and through every cache path (prefix hit on device / host / storage, chunked prefill,
batching, preemption). fp32 on CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvtier
from kvtier.cache.plan import TransferOp
from kvtier.storage.memory import MemoryBackend
from kvtier.transfer import copy as reference_copies
from tests.engine.hf_reference import FAMILIES, GREEDY, MAX_TOKENS, prompts_for


@pytest.mark.parametrize("preset", FAMILIES)
def test_cold_then_prefix_hit_match_transformers(preset, checkpoint, reference):
    prompts = prompts_for(1)
    want = reference(preset, prompts)
    with kvtier.LLM(checkpoint(preset), num_device_blocks=128, block_size=8) as llm:
        cold = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in cold] == want
        assert all(o.num_cached_tokens == 0 for o in cold)
        warm = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in warm] == want
        # every full block of the prompt but the one holding the last token is a device hit
        assert [o.num_cached_tokens for o in warm] == [(len(p) - 1) // 8 * 8 for p in prompts]
        assert all(o.cached_tokens_by_tier["device"] == o.num_cached_tokens for o in warm)


@pytest.mark.parametrize("preset", ["llama-tiny", "qwen3-moe-tiny"])
def test_chunked_prefill_and_batching_match(preset, checkpoint, reference):
    prompts = prompts_for(2)
    want = reference(preset, prompts)
    with kvtier.LLM(checkpoint(preset), num_device_blocks=128, max_num_batched_tokens=7) as llm:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
    with kvtier.LLM(checkpoint(preset), num_device_blocks=128) as llm:  # one request at a time
        alone = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]
    assert alone == want


@pytest.mark.parametrize("preset", ["qwen2-tiny", "mixtral-tiny"])
def test_preemption_recompute_matches(preset, checkpoint, reference):
    prompts = prompts_for(3, lengths=(30, 41, 52, 63))
    want = reference(preset, prompts)
    # 20 blocks of 8 tokens cannot hold four ~60-token sequences: requests get preempted
    with kvtier.LLM(checkpoint(preset), num_device_blocks=20, block_size=8, enable_prefix_caching=False) as llm:
        outs = llm.generate(prompts, GREEDY)
        assert llm.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == want


@pytest.mark.parametrize("preset", ["qwen3-tiny", "qwen2-moe-tiny"])
def test_host_hit_returns_identical_tokens(preset, checkpoint, reference):
    a, b = prompts_for(4, lengths=(60, 60))
    want = reference(preset, [a])
    with kvtier.LLM(
        checkpoint(preset), num_device_blocks=12, block_size=8, num_host_blocks=64, write_policy="write_through"
    ) as llm:
        assert llm.generate([a], GREEDY)[0].token_ids == want[0]
        llm.generate([b], GREEDY)  # pushes a's blocks out of the device tier
        again = llm.generate([a], GREEDY)[0]
        assert again.cached_tokens_by_tier["host"] > 0
        assert again.token_ids == want[0]
        assert llm.cache_stats()["host"]["hit_tokens"] > 0


def _copy_kinds(llm, monkeypatch) -> list[str]:
    """The kind of every op submitted to the transfer engine from now on, in order."""
    kinds: list[str] = []
    submit = llm.transfer.submit

    def recording(op: TransferOp) -> None:
        kinds.append(op.kind)
        submit(op)

    monkeypatch.setattr(llm.transfer, "submit", recording)
    return kinds


class HostToDeviceFails:
    """Stand-in copy ops for the transfer engine (its ``ops``): a host->device copy raises while
    an op of one of ``kinds`` is being submitted; every other copy is the torch reference's."""

    def __init__(self, kinds: set[str]) -> None:
        self.kinds = kinds
        self.submitting: str | None = None  # the kind of the op being submitted, if any

    def host_to_device(
        self, host: torch.Tensor, kv_caches: list[torch.Tensor], host_blocks, device_blocks, layer: int | None = None
    ) -> None:
        if self.submitting in self.kinds:
            raise RuntimeError(f"injected: host->device copy of a {self.submitting} failed")
        reference_copies.host_to_device(host, kv_caches, host_blocks, device_blocks, layer=layer)

    def device_to_host(self, kv_caches: list[torch.Tensor], host: torch.Tensor, device_blocks, host_blocks) -> None:
        reference_copies.device_to_host(kv_caches, host, device_blocks, host_blocks)


def _fail_host_to_device(llm, monkeypatch, kinds: set[str]) -> None:
    """From now on, the host->device copies of the transfer engine's ops of ``kinds`` raise (a
    failed copy, reported by the engine with every block of the op failed)."""
    ops = HostToDeviceFails(kinds)
    submit = llm.transfer.submit

    def submitting(op: TransferOp) -> None:
        ops.submitting = op.kind
        try:
            submit(op)
        finally:
            ops.submitting = None

    monkeypatch.setattr(llm.transfer, "ops", ops)
    monkeypatch.setattr(llm.transfer, "submit", submitting)


@pytest.mark.parametrize("early_loads", [True, False])
def test_storage_hit_returns_identical_tokens(checkpoint, reference, monkeypatch, early_loads):
    """Early loads: the fetched chunks go on to the device as they land (preloads) and the request
    starts with device hits, loading nothing; without them it loads its hits when it starts."""
    preset = "llama-tiny"
    a, b, c = prompts_for(5, lengths=(60, 60, 60))
    want = reference(preset, [a])
    with kvtier.LLM(
        checkpoint(preset),
        num_device_blocks=10,
        block_size=8,
        num_host_blocks=8,
        storage="memory://?capacity=16MiB",
        write_policy="write_through",
        early_loads=early_loads,
    ) as llm:
        assert llm.generate([a], GREEDY)[0].token_ids == want[0]
        llm.generate([b], GREEDY)
        llm.generate([c], GREEDY)  # a is now only in storage
        kinds = _copy_kinds(llm, monkeypatch)
        again = llm.generate([a], GREEDY)[0]
        assert again.cached_tokens_by_tier["storage"] > 0
        assert again.token_ids == want[0]
        assert ("preload" in kinds, "load" in kinds) == (early_loads, not early_loads), kinds
        llm.cache.assert_invariants()


def test_failed_preloads_load_at_admission_instead(checkpoint, reference, monkeypatch):
    preset = "llama-tiny"
    a, b, c = prompts_for(5, lengths=(60, 60, 60))
    want = reference(preset, [a])
    with kvtier.LLM(
        checkpoint(preset),
        num_device_blocks=10,
        block_size=8,
        num_host_blocks=8,
        storage="memory://?capacity=16MiB",
        write_policy="write_through",
    ) as llm:
        for p in (a, b, c):
            llm.generate([p], GREEDY)
        _fail_host_to_device(llm, monkeypatch, {"preload"})
        kinds = _copy_kinds(llm, monkeypatch)
        again = llm.generate([a], GREEDY)[0]
        assert again.token_ids == want[0]
        assert again.cached_tokens_by_tier["storage"] > 0  # fetched, then loaded when it started
        assert "preload" in kinds and "load" in kinds
        assert llm.cache_stats()["failures"]["load"] > 0
        llm.cache.assert_invariants()


def test_a_preload_never_takes_a_block_the_steps_forward_still_reads(checkpoint, reference, monkeypatch):
    """A and B load the same host hits in one step: B's copies are 'loaded twice' and its own
    device blocks go back to the pool while the step is being queued, though the step's block
    tables, built already, still name them. C's fetch lands in that same pump: its preloads take
    device blocks then, and must not be given (or write) those before the forward read them."""
    preset = "llama-tiny"
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(0, 256, (40,), generator=g).tolist()
    c = torch.randint(0, 256, (44,), generator=g).tolist()
    a, b = shared + [1, 2, 3, 4], shared + [5, 6, 7, 8]
    want = reference(preset, [a, b, c])
    with kvtier.LLM(
        checkpoint(preset),
        num_device_blocks=64,
        block_size=8,
        num_host_blocks=64,
        storage="memory://?capacity=16MiB",
        write_policy="write_through",
        storage_fetch="always",
        early_loads=True,
    ) as llm:
        llm.generate([c], GREEDY)
        llm.drain()
        table = llm.cache.table
        table.evict_device(64)
        llm.drain()
        table.evict_host(64)  # c: in the pool only
        llm.drain()
        llm.generate([shared + [9]], GREEDY)
        llm.drain()
        table.evict_device(64)  # the shared prefix: on the host only
        llm.drain()
        storage = llm.storage
        assert storage is not None
        poll = storage.poll

        def landed_poll() -> list[tuple[int, list[int]]]:  # c's fetch has landed whenever the engine polls
            storage.wait_all()
            return poll()

        monkeypatch.setattr(storage, "poll", landed_poll)
        got = llm.generate([c, a, b], GREEDY)
        assert [o.token_ids for o in got] == [want[2], want[0], want[1]]
        assert got[2].cached_tokens_by_tier["host"] > 0 and got[0].cached_tokens_by_tier["storage"] > 0
        llm.cache.assert_invariants()


def test_failed_storage_fetch_degrades_to_recompute(checkpoint, reference):
    preset = "llama-tiny"
    a, b, c = prompts_for(5, lengths=(60, 60, 60))
    want = reference(preset, [a])
    with kvtier.LLM(
        checkpoint(preset),
        num_device_blocks=10,
        block_size=8,
        num_host_blocks=8,
        storage="memory://?capacity=16MiB",
        write_policy="write_through",
    ) as llm:
        llm.generate([a], GREEDY)
        llm.generate([b], GREEDY)
        llm.generate([c], GREEDY)
        assert llm.storage is not None
        backend = llm.storage.backend
        assert isinstance(backend, MemoryBackend)
        for name in backend.names():  # corrupt every stored object: wrong size
            data = backend.raw(name)
            assert data is not None
            backend.set_raw(name, data[:-1])
        again = llm.generate([a], GREEDY)[0]
        assert again.token_ids == want[0]
        assert again.cached_tokens_by_tier["storage"] == 0
        assert llm.cache_stats()["failures"]["fetch"] > 0
        llm.cache.assert_invariants()


def test_seeded_sampling_is_reproducible(checkpoint):
    path = checkpoint("qwen3-tiny")
    sp = kvtier.SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    with kvtier.LLM(path, num_device_blocks=64) as llm:
        a = llm.generate([[1, 2, 3]], sp)[0].token_ids
        b = llm.generate([[1, 2, 3]], sp)[0].token_ids
        c = llm.generate([[1, 2, 3]], kvtier.SamplingParams(max_tokens=10, temperature=1.0, seed=8, ignore_eos=True))[0].token_ids
    assert a == b and len(a) == 10
    assert a != c


def test_stop_conditions(checkpoint, reference):
    preset = "llama-tiny"
    p = prompts_for(6, lengths=(9,))
    want = reference(preset, p)[0]
    with kvtier.LLM(checkpoint(preset), num_device_blocks=64) as llm:
        out = llm.generate(p, kvtier.SamplingParams(max_tokens=MAX_TOKENS, stop_token_ids=(want[3],), ignore_eos=True))[0]
        assert out.token_ids == want[: want.index(want[3]) + 1] and out.finish_reason == "stop"
        out = llm.generate(p, kvtier.SamplingParams(max_tokens=2, ignore_eos=True))[0]
        assert out.token_ids == want[:2] and out.finish_reason == "length"


def test_text_prompts_use_the_tokenizer(checkpoint):
    with kvtier.LLM(checkpoint("qwen3-tiny"), num_device_blocks=64) as llm:
        out = llm.generate(["hello kvtier"], GREEDY)[0]
        assert out.prompt_token_ids == list(b"hello kvtier")  # byte-level tokenizer
        assert isinstance(out.text, str)


def test_bad_input_names_the_problem(checkpoint, tmp_path):
    path = checkpoint("llama-tiny")
    with kvtier.LLM(path, num_device_blocks=64, max_model_len=64) as llm:
        with pytest.raises(ValueError, match="empty prompt"):
            llm.generate([[]], GREEDY)
        with pytest.raises(ValueError, match="context is 64"):
            llm.generate([list(range(64))], GREEDY)
        with pytest.raises(ValueError, match="token id -1"):
            llm.generate([[1, -1]], GREEDY)
    with pytest.raises(ValueError, match="max_tokens"):
        kvtier.SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="unknown write_policy 'sometimes'"):
        kvtier.LLM(path, num_device_blocks=8, write_policy="sometimes")
    with pytest.raises(ValueError, match="block_size must be a positive power of two, got 12"):
        kvtier.LLM(path, num_device_blocks=8, block_size=12)
    with pytest.raises(FileNotFoundError, match="config.json"):
        kvtier.LLM(tmp_path)


@pytest.mark.parametrize("preset", ["qwen3-tiny", "llama-tiny", "qwen2-moe-tiny"])
def test_padded_static_decode_path_matches(preset, checkpoint, reference):
    """The CUDA-graph decode path (static buffers, batch padded to a bucket, padding rows writing
    to the scratch block) run eagerly on the CPU: same tokens as transformers."""
    prompts = prompts_for(7, lengths=(5, 19, 33))  # 3 sequences -> bucket 4: one padding row
    want = reference(preset, prompts)
    with kvtier.LLM(checkpoint(preset), num_device_blocks=64, block_size=8, cuda_graphs=True) as llm:
        graphs = llm.runner.decode_graphs
        assert graphs is not None and graphs.bucket(3) == 4 and not graphs.capture
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want  # and with prefix hits
        assert graphs.runs and llm.runner.step_graphs.runs  # the prompts (57 tokens: bucket 64) too


@pytest.mark.parametrize("preset", ["qwen3-tiny", "qwen2-moe-tiny"])
def test_padded_static_step_path_matches(preset, checkpoint, reference):
    """The CUDA-graph path of other steps (StepGraphs: prompts chunked beside decode rows, short
    extends over cached prefixes, padded to 16..256 tokens with one-token padding sequences) run
    eagerly on the CPU: same tokens as transformers, and the same as without graphs."""
    prompts = prompts_for(21, lengths=(3, 40, 90, 17, 61))
    want = reference(preset, prompts)
    kw = dict(num_device_blocks=96, block_size=8, max_num_batched_tokens=64)  # prefills chunked
    with kvtier.LLM(checkpoint(preset), cuda_graphs=True, **kw) as llm:
        steps = llm.runner.step_graphs
        assert steps is not None and steps.buckets == [16, 32, 64] and not steps.capture
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
        ran = steps.runs
        assert {b == steps.FEW for _, b in steps.used} == {True, False}  # few sequences, and many
        # prefix hits: each prompt again with a short new tail (extends over the cached prefix)
        tails = [p + [7, 8, 9] for p in prompts]
        with kvtier.LLM(checkpoint(preset), cuda_graphs=False, **kw) as eager:
            assert eager.runner.step_graphs is None
            want_tails = [o.token_ids for o in eager.generate(tails, GREEDY)]
        assert [o.token_ids for o in llm.generate(tails, GREEDY)] == want_tails
        assert steps.runs > ran
        assert llm.cache_stats()["device"]["hit_tokens"] > 0


@pytest.mark.parametrize("preset", ["llama-tiny", "qwen2-moe-tiny"])
def test_host_hits_replayed_behind_layer_gates_match(preset, checkpoint, reference):
    """Host hits in step graphs whose layers wait on layer gates (the CPU twin: copies land
    synchronously when the forward takes them, and a wait on a gate still closed raises): the
    same tokens as transformers, cold and from the host tier."""
    prompts = prompts_for(21, lengths=(60, 60, 60))
    want = reference(preset, prompts)
    with kvtier.LLM(
        checkpoint(preset), num_device_blocks=12, block_size=8, num_host_blocks=64, write_policy="write_through", cuda_graphs=True
    ) as llm:
        assert llm.runner.step_graphs.gates is llm.transfer.gates is not None
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
        warm = [llm.generate([p], GREEDY)[0] for p in prompts]
        assert [o.token_ids for o in warm] == want
        assert all(o.cached_tokens_by_tier["host"] > 0 for o in warm)
        assert llm.transfer.gates.closes > 0 and llm.runner.graph_steps_after_loads > 0


def test_a_failing_request_leaks_nothing_and_the_engine_recovers(checkpoint, reference, monkeypatch):
    preset = "llama-tiny"
    prompts = prompts_for(8)
    want = reference(preset, prompts)
    with kvtier.LLM(
        checkpoint(preset), num_device_blocks=64, block_size=8, num_host_blocks=16, write_policy="write_through"
    ) as llm:
        real = llm.runner.execute
        victim: dict[str, list[int] | None] = {"prompt": prompts[1]}  # None: nobody fails

        def poisoned(out, start_loads=None):  # fails whenever the victim is in the batch
            if any(s.request.prompt_token_ids == victim["prompt"] for s in out.scheduled):
                raise RuntimeError("injected forward failure")
            return real(out, start_loads)

        monkeypatch.setattr(llm.runner, "execute", poisoned)
        with pytest.raises(RuntimeError, match="failed: internal error: RuntimeError.*injected"):
            llm.generate(prompts, GREEDY)
        assert not llm.scheduler.has_unfinished()
        tree = llm.cache.tree
        assert llm.cache.device_pool.num_free + tree.num_device_copies == llm.cache.device_pool.num_blocks
        assert all(n.lock_ref == 0 for n in tree.nodes.values())
        llm.cache.assert_invariants()
        assert llm.cache_stats()["failed_requests"] == 1
        victim["prompt"] = None
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want


def test_a_batch_whose_forward_fails_once_is_retried_request_by_request(checkpoint, reference, monkeypatch):
    preset = "llama-tiny"
    prompts = prompts_for(8)
    want = reference(preset, prompts)
    with kvtier.LLM(checkpoint(preset), num_device_blocks=64, block_size=8) as llm:
        calls = {"n": 0}
        real = llm.runner.execute

        def flaky(out, start_loads=None):
            calls["n"] += 1
            if calls["n"] == 3:  # a batched decode step, once
                raise RuntimeError("injected transient failure")
            return real(out, start_loads)

        monkeypatch.setattr(llm.runner, "execute", flaky)
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
        assert llm.cache_stats()["failed_requests"] == 0
        llm.cache.assert_invariants()


def test_padded_static_decode_path_captures_routing(checkpoint):
    path = checkpoint("qwen3-moe-tiny")
    prompts = prompts_for(9, lengths=(5, 19, 33))
    sp = kvtier.SamplingParams(max_tokens=10, ignore_eos=True, return_routed_experts=True)
    outs = {}
    for graphs in (True, False):
        with kvtier.LLM(path, num_device_blocks=64, block_size=8, cuda_graphs=graphs) as llm:
            outs[graphs] = llm.generate(prompts, sp)
    for a, b in zip(outs[True], outs[False]):
        assert a.token_ids == b.token_ids
        assert np.array_equal(a.routed_experts, b.routed_experts)


# ---------------------------------------------------------------- regressions found in review


def test_write_back_engine_waits_for_copies_instead_of_failing(checkpoint, reference):
    preset = "qwen3-tiny"
    a, b = prompts_for(10, lengths=(80, 80))
    want = reference(preset, [a, b])
    with kvtier.LLM(checkpoint(preset), num_device_blocks=12, block_size=8, num_host_blocks=32, write_policy="write_back") as llm:
        assert llm.generate([a], GREEDY)[0].token_ids == want[0]
        assert llm.generate([b], GREEDY)[0].token_ids == want[1]  # evicts a's blocks via copies
        again = llm.generate([a], GREEDY)[0]
        assert again.token_ids == want[0] and again.cached_tokens_by_tier["host"] > 0
        llm.cache.assert_invariants()


def test_storage_hits_are_counted_once(checkpoint):
    a, b, c = prompts_for(5, lengths=(60, 60, 60))
    with kvtier.LLM(
        checkpoint("llama-tiny"),
        num_device_blocks=10,
        block_size=8,
        num_host_blocks=8,
        storage="memory://?capacity=16MiB",
        write_policy="write_through",
    ) as llm:
        for p in (a, b, c):
            llm.generate([p], GREEDY)
        before = llm.cache_stats()
        again = llm.generate([a], GREEDY)[0]
        after = llm.cache_stats()
    by_tier = again.cached_tokens_by_tier
    assert by_tier["storage"] > 0
    for tier in ("device", "host", "storage"):
        assert after[tier]["hit_tokens"] - before[tier]["hit_tokens"] == by_tier[tier], tier


def test_failed_host_loads_recompute_and_are_not_reported_as_hits(checkpoint, reference, monkeypatch):
    preset = "qwen3-tiny"
    a, b = prompts_for(4, lengths=(60, 60))
    want = reference(preset, [a])
    with kvtier.LLM(
        checkpoint(preset), num_device_blocks=12, block_size=8, num_host_blocks=64, write_policy="write_through"
    ) as llm:
        llm.generate([a], GREEDY)
        llm.generate([b], GREEDY)
        _fail_host_to_device(llm, monkeypatch, {"load"})
        again = llm.generate([a], GREEDY)[0]
        assert again.token_ids == want[0]
        assert again.cached_tokens_by_tier["host"] == 0
        assert again.num_cached_tokens == again.cached_tokens_by_tier["device"]
        assert llm.cache_stats()["failures"]["load"] > 0
        llm.cache.assert_invariants()


def test_routed_experts_on_a_dense_model_is_refused_before_running(checkpoint):
    with kvtier.LLM(checkpoint("qwen3-tiny"), num_device_blocks=64) as llm:
        with pytest.raises(ValueError, match="needs a MoE model"):
            llm.generate([[1, 2, 3]], kvtier.SamplingParams(max_tokens=2, return_routed_experts=True))
        assert llm.cache.device_pool.num_used == 0 and not llm.scheduler.has_unfinished()


def test_score_takes_any_sequence_up_to_the_context(checkpoint):
    with kvtier.LLM(checkpoint("llama-tiny"), num_device_blocks=3, block_size=16, max_model_len=64) as llm:
        assert llm.score(list(range(64))).shape == (63,)
        with pytest.raises(ValueError, match="2..64 tokens"):
            llm.score([1])


def test_more_bad_input(checkpoint):
    path = checkpoint("llama-tiny")
    with pytest.raises(ValueError, match="got 0"):
        kvtier.LLM(path, block_size=0)
    with pytest.raises(ValueError, match="temperature"):
        kvtier.SamplingParams(temperature=float("nan"))
    with pytest.raises(ValueError, match="stop_token_ids"):
        kvtier.SamplingParams(stop_token_ids=5)
    llm = kvtier.LLM(path, num_device_blocks=8)
    llm.close()
    with pytest.raises(RuntimeError, match="closed"):
        llm.step()
