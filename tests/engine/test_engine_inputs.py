"""What the engine accepts and what it does by default: constructor values checked before the
model loads, request ids, max_tokens against the context, the per-salt seed cache, a storage pool
used with no other flag, special tokens in the text."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import kvtier
from kvtier.cache.manager import MAX_SEEDS, CacheManager
from kvtier.cli import main
from kvtier.model.tokenizer import EOS_TOKEN, EOS_TOKEN_ID

GREEDY = kvtier.SamplingParams(max_tokens=4, ignore_eos=True)


@pytest.mark.parametrize(
    "kwargs,msg",
    [
        ({"max_model_len": -5}, "max_model_len must be an int >= 1 or None, got -5"),
        ({"max_model_len": 0}, "max_model_len must be an int >= 1 or None, got 0"),
        ({"num_device_blocks": 0}, "num_device_blocks must be an int >= 1 or None, got 0"),
        ({"num_device_blocks": -3}, "num_device_blocks must be an int >= 1 or None, got -3"),
        ({"num_device_blocks": 2.5}, "num_device_blocks must be an int >= 1 or None, got 2.5"),
        ({"max_num_seqs": -1}, "max_num_seqs must be an int >= 1, got -1"),
        ({"max_num_seqs": "8"}, "max_num_seqs must be an int >= 1, got '8'"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be an int >= 1, got 0"),
        ({"num_host_blocks": -1}, "num_host_blocks must be an int >= 0 or None, got -1"),
        ({"num_host_blocks": True}, "num_host_blocks must be an int >= 0 or None, got True"),
        ({"num_host_blocks": 10**12}, r"num_host_blocks=1000000000000 needs [\d.]+ GiB .* more than the [\d.]+ GiB available"),
        ({"write_through_threshold": 0}, "write_through_threshold must be an int >= 1, got 0"),
        ({"seed": 1.5}, "seed must be an int, got 1.5"),
        ({"write_policy": "sometimes"}, "unknown write_policy 'sometimes'"),
        ({"storage": "memory://", "num_host_blocks": 0}, "num_host_blocks=0 turns it off"),
        ({"storage_put_workers": 0}, "storage_put_workers must be an int >= 1 or None, got 0"),
        ({"storage_workers": -2}, "storage_workers must be an int >= 1 or None, got -2"),
    ],
)
def test_bad_constructor_values_are_named_before_the_model_loads(checkpoint, monkeypatch, kwargs, msg):
    def no_loading(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr("kvtier.engine.build.load_model", no_loading)
    with pytest.raises(ValueError, match=msg):
        kvtier.LLM(checkpoint("llama-tiny"), **kwargs)


@pytest.fixture(scope="module")
def llm(checkpoint):
    with kvtier.LLM(checkpoint("llama-tiny"), num_device_blocks=64, block_size=8) as engine:
        yield engine


def test_a_request_id_in_use_is_refused_and_auto_ids_never_collide(llm):
    first = llm.add_request([1, 2, 3], GREEDY, request_id="r1")
    with pytest.raises(ValueError, match="request_id 'r1' is already in use"):
        llm.add_request([4, 5, 6], GREEDY, request_id="r1")
    twin = llm.make_request([4, 5, 6], GREEDY, None, "r1")
    with pytest.raises(ValueError, match="request_id 'r1' is already in use"):
        llm.enqueue(twin)
    auto = llm.make_request([1], GREEDY, None)
    with pytest.raises(ValueError, match="prefix of automatic ids"):
        llm.make_request([1], GREEDY, None, auto.request_id)
    outs = []
    while llm.has_unfinished():
        outs += llm.step()
    assert [o.request_id for o in outs] == [first.request_id] and outs[0].token_ids == llm.generate([[1, 2, 3]], GREEDY)[
        0
    ].token_ids
    llm.add_request([1, 2, 3], GREEDY, request_id="r1")  # finished: its id is free again
    llm.abort("r1")
    llm.cache.assert_invariants()


def test_max_tokens_past_the_context_is_an_error_not_a_silent_stop(llm):
    with pytest.raises(
        ValueError,
        match=r"max_tokens=100000 \+ 5 prompt tokens = 100005 tokens, more than "
        r"the model's context of 512",
    ):
        llm.generate([[1, 2, 3, 4, 5]], kvtier.SamplingParams(max_tokens=100000))
    out = llm.generate([[1, 2, 3, 4, 5]], kvtier.SamplingParams(max_tokens=507, ignore_eos=True))[0]
    assert len(out.token_ids) == 507 and out.finish_reason == "length"  # exactly the context
    assert not llm.scheduler.has_unfinished()


def test_the_cli_says_max_tokens_is_past_the_context_and_exits_2(checkpoint, capsys):
    code = main(
        [
            "generate",
            str(checkpoint("llama-tiny")),
            "--prompt-ids",
            "1,2,3",
            "--max-tokens",
            "100000",
            "--num-device-blocks",
            "64",
        ]
    )
    assert code == 2
    assert "kvtier generate: error: max_tokens=100000 + 3 prompt tokens" in capsys.readouterr().err


def test_seed_cache_stays_bounded_and_keys_survive_eviction():
    mgr = CacheManager(block_size=4, num_device_blocks=8)
    tokens = list(range(8))

    def keys(salt):
        return mgr.sync_keys(mgr.new_request(salt, tokens, cache_salt=salt))

    first = keys("salt-0")
    for i in range(10_000):
        keys(f"salt-{i}")
    assert len(mgr.table.seeds) == MAX_SEEDS
    assert "salt-0" not in mgr.table.seeds  # evicted long ago...
    assert keys("salt-0") == first  # ...and computed again to the same keys
    assert keys("salt-1") != first and keys(None) != first


def test_a_storage_pool_alone_is_written_and_serves_the_next_engine(checkpoint, tmp_path):
    prompt = list(range(1, 41))
    runs = []
    for put_workers in (None, 3):
        with kvtier.LLM(
            checkpoint("llama-tiny"),
            block_size=16,
            num_device_blocks=64,
            storage=f"file://{tmp_path}/pool",
            storage_put_workers=put_workers,
        ) as engine:
            assert engine.cache.host_pool.num_blocks == 128 and engine.cache.policy.name == "write_through"
            # one put thread unless asked: each one slows the engine thread while it writes
            assert engine.storage.put_workers == (put_workers or 1)
            runs.append(engine.generate([prompt], GREEDY)[0])
    assert runs[0].cached_tokens_by_tier["storage"] == 0
    assert runs[1].cached_tokens_by_tier["storage"] >= 32
    assert runs[1].token_ids == runs[0].token_ids


def test_without_storage_there_is_no_host_tier_by_default(llm):
    assert llm.cache.host_pool.num_blocks == 0 and llm.cache.policy.name == "write_through_selective"
    assert llm.preemption_mode == "recompute"


@pytest.mark.slow  # (a server or processes of its own: CI runs it with -m slow)
def test_the_readme_generate_with_a_pool_shows_storage_hits_on_the_second_run(tmp_path):
    model = tmp_path / "m"
    assert main(["init-model", "qwen3-moe-tiny", str(model)]) == 0
    cmd = [
        sys.executable,
        "-m",
        "kvtier.cli",
        "generate",
        str(model),
        "--prompt-ids",
        ",".join(str(i) for i in range(1, 41)),
        "--storage",
        f"file://{tmp_path}/pool",
        "--json",
    ]
    first, second = (json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout) for _ in range(2))
    assert first["cached_tokens_by_tier"]["storage"] == 0
    assert second["cached_tokens_by_tier"]["storage"] == 32 and second["token_ids"] == first["token_ids"]


def test_special_tokens_are_left_out_of_the_text_unless_asked(checkpoint, monkeypatch):
    with kvtier.LLM(checkpoint("qwen3-tiny"), num_device_blocks=64) as engine:
        real, calls = engine.model.compute_logits, {"n": 0}

        def eos_second(hidden):  # the model's own first token, then EOS
            logits = real(hidden).clone()  # (an inference tensor: not writable in place)
            calls["n"] += 1
            if calls["n"] % 2 == 0:
                logits[:, EOS_TOKEN_ID] = float("inf")
            return logits

        monkeypatch.setattr(engine.model, "compute_logits", eos_second)
        outs = {
            skip: engine.generate([[104, 105]], kvtier.SamplingParams(max_tokens=4, skip_special_tokens=skip))[0]
            for skip in (True, False)
        }
    for o in outs.values():
        assert o.token_ids[-1] == EOS_TOKEN_ID and len(o.token_ids) == 2 and o.finish_reason == "stop"
    plain = engine.tokenizer.decode(outs[True].token_ids[:1])
    assert outs[True].text == plain
    assert outs[False].text == plain + EOS_TOKEN
