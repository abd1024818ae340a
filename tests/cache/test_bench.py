"""``kvtier bench cache`` and the peer adapter on tiny configurations (no timing asserted)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from kvtier.bench.cache_bench import make_trace
from kvtier.bench.peer_adapter import make_peer, make_peer_xxh3
from kvtier.cli import main

TINY = ["bench", "cache", "--requests", "12", "--prompts", "2", "--prompt-tokens", "64", "--repeat", "1"]
PEER_BENCH = Path("/work/shared/peers/peer_bench.py")


def test_bench_cache_prints_one_line_per_digest(capsys):
    assert main(TINY) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["sha256", "xxh3_128"]
    assert all("us/req" in line and "us/block" in line and "hit" in line for line in lines)


def test_bench_cache_json_has_the_figures(capsys):
    assert main(TINY + ["--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["hash"] for r in rows] == ["sha256", "xxh3_128"]
    for r in rows:
        assert r["requests"] == 12 and r["prompt_tokens"] == 12 * 64
        assert r["keys_us_per_request"] > 0 and r["us_per_request"] > 0
        assert 0.5 < r["hit_share"] < 56 / 64 + 1e-9   # a 7/8 shared prefix, first uses miss


def test_bench_trace_is_fixed_by_its_seed():
    assert make_trace(5, 2, 32) == make_trace(5, 2, 32)
    assert all(len(t) == 32 for t in make_trace(5, 2, 32))


@pytest.mark.parametrize("factory", [make_peer, make_peer_xxh3])
def test_peer_adapter_serves_hits_and_leaks_nothing(factory):
    peer = factory(64, 4)
    prompt = list(range(20))
    handles = []
    for rid in range(3):
        got = peer.admit(rid, prompt + [100 + rid])
        assert got is not None
        handle, num_cached, phases = got
        assert num_cached == (0 if rid == 0 else 20) and set(phases) == {"match", "alloc"}
        peer.publish(handle)
        handles.append(handle)
    for h in handles:
        peer.finish(h)
    peer.check()


@pytest.mark.skipif(not PEER_BENCH.is_file(), reason="peer_bench.py not present")
def test_peer_adapter_runs_in_the_peer_bench_replay():
    spec = importlib.util.spec_from_file_location("peer_bench", PEER_BENCH)
    pb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pb)
    trace = pb.make_trace(60, 4, prompt_len=(64, 256), suffix_len=(8, 64))
    ours = pb.replay(make_peer(256, 16), trace, window=8)
    toy = pb.replay(pb.ToyPeer(256, 16), trace, window=8)
    assert ours["hit_rate"] == pytest.approx(toy["hit_rate"])
