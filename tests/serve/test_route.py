"""The routing policies (serve/route.py) that `kvtier router` and `kvtier sim --instances` share."""

from __future__ import annotations

import pytest

from kvtier.serve.route import BALANCE_ABS, PREDICTED_S, STORAGE_WEIGHT, Candidate, Picker, PrefixIndex


def test_round_robin_goes_in_turn_whatever_is_cached():
    p = Picker("round_robin")
    cands = [Candidate(device_hit=800), Candidate(), Candidate()]
    assert [p.pick(cands) for _ in range(6)] == [0, 1, 2, 0, 1, 2]


def test_least_load_takes_the_fewest_tokens_in_flight_and_rotates_ties():
    p = Picker("least_load")
    assert p.pick([Candidate(load=50), Candidate(load=10, device_hit=0), Candidate(load=30)]) == 1
    ties = [p.pick([Candidate(), Candidate(), Candidate()]) for _ in range(3)]
    assert sorted(ties) == [0, 1, 2]


def test_cache_aware_takes_the_longest_prefix_device_hits_over_host_hits():
    p = Picker("cache_aware")
    assert p.pick([Candidate(device_hit=64), Candidate(device_hit=128), Candidate()]) == 1
    assert p.pick([Candidate(host_hit=128), Candidate(device_hit=96)]) == 1  # 96 > 0.5 x 128
    assert p.pick([Candidate(host_hit=256), Candidate(device_hit=96)]) == 0


def test_cache_aware_leaves_an_overloaded_holder_for_an_idle_instance():
    p = Picker("cache_aware")
    busy = Candidate(device_hit=1024, load=BALANCE_ABS + 10_000)
    assert p.pick([busy, Candidate(load=0), Candidate(load=500)]) == 1
    within = Candidate(device_hit=1024, load=BALANCE_ABS - 1)
    assert p.pick([within, Candidate(load=0)]) == 0


def test_cache_aware_sends_a_new_conversation_where_there_is_room():
    p = Picker("cache_aware")
    assert p.pick([Candidate(load=900), Candidate(load=100), Candidate(load=400)]) == 1
    # a shared system prompt (a small part of the prompt) does not draw the request to its holder
    assert p.pick([Candidate(device_hit=64, load=900), Candidate(load=100)], prompt_tokens=1000) == 1
    assert p.pick([Candidate(device_hit=640, load=900), Candidate(load=100)], prompt_tokens=1000) == 0


def test_an_unknown_policy_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown routing policy 'sticky'"):
        Picker("sticky")


def test_the_index_counts_the_leading_run_of_held_blocks_per_tier():
    ix = PrefixIndex()
    for k in (b"a", b"b"):
        ix.apply("stored", "device", k)
    ix.apply("stored", "host", b"c")
    assert ix.overlap([b"a", b"b", b"c", b"d"]) == (3, 1)
    assert ix.overlap([b"x", b"a"]) == (0, 0)  # a prefix, not any block
    ix.apply("removed", "device", b"b")
    assert ix.overlap([b"a", b"b", b"c"]) == (1, 0)
    c = ix.candidate([b"a", b"b", b"c"], 16, load=7)
    assert (c.device_hit, c.host_hit, c.load) == (16, 0, 7)


def test_a_prompt_just_sent_counts_as_held_until_its_prediction_expires():
    ix = PrefixIndex()
    ix.predict([b"a", b"b"], now=100.0)
    assert ix.overlap([b"a", b"b", b"c"], now=101.0) == (2, 0)
    assert ix.overlap([b"a", b"b"], now=100.0 + PREDICTED_S + 1) == (0, 0)
    ix.reset()
    assert ix.overlap([b"a"], now=100.5) == (0, 0)


def test_the_shared_pool_counts_for_every_instance_past_what_each_holds():
    """A prompt of 10 blocks of 16: instance A holds its first block, B none, the pool all ten.
    Without the pool A's one block is under the overlap threshold (the least loaded B takes it);
    with it A's prefix and the pool's rest outscore B's pool hits alone."""
    keys = [bytes([i]) for i in range(10)]
    a, b = PrefixIndex(), PrefixIndex()
    a.apply("stored", "device", keys[0])
    ca, cb = a.candidate(keys, 16, load=500, pooled=10), b.candidate(keys, 16, load=0, pooled=10)
    assert (ca.device_hit, ca.storage_hit, cb.storage_hit) == (16, 144, 160)
    assert ca.score == 16 + STORAGE_WEIGHT * 144 and cb.score == STORAGE_WEIGHT * 160
    assert a.candidate(keys, 16, load=0, pooled=0).storage_hit == 0  # (a pool that holds less: nothing past A)
    assert Picker("cache_aware").pick([a.candidate(keys, 16, load=500), b.candidate(keys, 16, load=0)], 160) == 1
    assert Picker("cache_aware").pick([ca, cb], 160) == 0
