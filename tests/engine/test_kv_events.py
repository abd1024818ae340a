"""KV events (cache/events.py): a reader that starts from a snapshot and applies the events after
it holds exactly what a snapshot taken later says, per tier, through commits, evictions, host
backups, loads and swap; a reader that fell behind the kept events is told so (a gap)."""

from __future__ import annotations

import pytest

import kvtier
from kvtier.cache.events import KVEvents
from kvtier.cache.keys import BlockHasher
from kvtier.engine.loop import kv_events, kv_snapshot
from tests.engine.hf_reference import prompts_for


def apply(state: dict[str, set[str]], events: list[list]) -> None:
    for _seq, kind, tier, key in events:
        if kind == "stored":
            assert key not in state[tier], f"{key} stored twice on {tier}"
            state[tier].add(key)
        else:
            state[tier].remove(key)


def test_events_after_a_snapshot_rebuild_every_later_snapshot(checkpoint):
    params = kvtier.SamplingParams(max_tokens=12, ignore_eos=True)
    with kvtier.LLM(checkpoint("llama-tiny"), num_device_blocks=24, block_size=8, num_host_blocks=64, max_num_seqs=4) as llm:
        llm.generate(prompts_for(70, lengths=(30,)), params)  # before anyone listens: not events
        first = kv_snapshot(llm)
        state = {"device": set(first["device"]), "host": set(first["host"])}
        seq, kinds = first["seq"], set()
        for round_ in range(4):  # evictions, host backups, host hits loaded back, swaps
            llm.generate(prompts_for(71 + round_, lengths=(40, 33, 52, 25)), params)
            got = kv_events(llm, seq)
            assert "events" in got
            apply(state, got["events"])
            kinds |= {(e[1], e[2]) for e in got["events"]}
            assert [e[0] for e in got["events"]] == list(range(seq + 1, got["seq"] + 1))  # numbered, no gap
            seq = got["seq"]
            now = kv_snapshot(llm)
            assert now["seq"] == seq
            assert state == {"device": set(now["device"]), "host": set(now["host"])}
        assert kinds == {("stored", "device"), ("removed", "device"), ("stored", "host"), ("removed", "host")}
        assert llm.scheduler.num_preemptions > 0
        # the keys a router derives from the tokens (and the snapshot's keying) are the engine's
        prompt = prompts_for(75, lengths=(40,))[0]
        llm.generate([prompt], params)
        snap = kv_snapshot(llm)
        seed = seed_from(snap)
        keys = BlockHasher(snap["block_size"], seed, snap["hash"]).extend(prompt)
        assert keys and all(k.hex() in snap["device"] for k in keys[:4])


def seed_from(snap: dict) -> bytes:
    from kvtier.cache.keys import encoded_seed

    return encoded_seed(bytes.fromhex(snap["fingerprint"]), None, snap["hash"])


def test_a_reader_behind_the_kept_events_is_told_of_the_gap():
    ev = KVEvents(capacity=3)
    for i in range(5):
        ev.emit("stored", "device", bytes([i]))
    assert ev.since(5) == []
    kept = ev.since(2)
    assert kept is not None and [e[0] for e in kept] == [3, 4, 5]
    assert ev.since(1) is None  # event 2 is gone
    with pytest.raises(ValueError, match="seq must be in 0..5, got 6"):
        ev.since(6)
