"""``kvtier bench cache`` and ``kvtier bench peers`` on tiny configurations (no timing asserted)."""

from __future__ import annotations

import json

import pytest

from kvtier.bench import peers
from kvtier.bench.cache_bench import make_trace
from kvtier.cli import main

TINY = ["bench", "cache", "--requests", "12", "--prompts", "2", "--prompt-tokens", "64", "--repeat", "1"]
TINY_PEERS = ["bench", "peers", "--requests", "30", "--prompts", "3", "--warmup", "5", "--repeat", "1", "--num-blocks", "2048"]


def test_bench_cache_prints_one_line_per_digest(capsys):
    assert main(TINY) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["sha256", "xxh3_128"]
    assert all("us/req" in line and "us/block" in line and "hit" in line for line in lines)


def test_bench_cache_json_has_the_figures(capsys, tmp_path):
    assert main(TINY + ["--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert main(TINY + ["--json", str(tmp_path / "rows.json")]) == 0  # a path: the table, and the file
    assert capsys.readouterr().out.splitlines()[0].startswith("sha256 ")
    assert [r["hash"] for r in json.loads((tmp_path / "rows.json").read_text())] == ["sha256", "xxh3_128"]
    assert [r["hash"] for r in rows] == ["sha256", "xxh3_128"]
    for r in rows:
        assert r["requests"] == 12 and r["prompt_tokens"] == 12 * 64
        assert r["keys_us_per_request"] > 0 and r["us_per_request"] > 0
        assert 0.5 < r["hit_share"] < 56 / 64 + 1e-9  # a 7/8 shared prefix, first uses miss


def test_bench_trace_is_fixed_by_its_seed():
    assert make_trace(5, 2, 32) == make_trace(5, 2, 32)
    assert all(len(t) == 32 for t in make_trace(5, 2, 32))


@pytest.mark.parametrize("hash_name", ["sha256", "xxh3_128"])
def test_kvtier_peer_serves_hits_and_leaks_nothing(hash_name):
    peer = peers.KvtierPeer(64, 4, hash_name)
    prompt = list(range(20))
    handles = []
    for rid in range(3):
        got = peer.admit(rid, prompt + [100 + rid])
        assert got is not None
        assert got.num_cached_tokens == (0 if rid == 0 else 20) and set(got.phases_ns) == {"match", "alloc"}
        peer.publish(got.handle)
        handles.append(got.handle)
    for h in handles:
        peer.finish(h)
    peer.check()


def test_peer_replay_hits_the_longest_cached_prefix_of_whole_blocks():
    trace = peers.make_trace(40, 4, prompt_tokens=(64, 128), unique_tokens=(8, 24))
    res = peers.replay(peers.KvtierPeer(1024, 16), trace, window=8)  # room for all: nothing evicted

    def common(a: list[int], b: list[int]) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    # reference: the longest prefix shared with any earlier request, in whole 16-token blocks,
    # leaving at least one token to compute
    expected = sum(min(max((common(t, u) for u in trace[:i]), default=0), len(t) - 1) // 16 * 16 for i, t in enumerate(trace))
    assert expected > 0
    assert res["requests"] == 40 and res["hit_share"] == expected / sum(map(len, trace))


def test_bench_peers_runs_kvtier_and_skips_a_missing_peer_naming_the_install(capsys, monkeypatch):
    # the peers' packages are reported missing whether or not this machine has them
    monkeypatch.setattr(peers.importlib.util, "find_spec", lambda name: None)
    assert main(TINY_PEERS + ["--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["peer"] for r in rows] == ["kvtier[sha256]", "kvtier[xxh3_128]", "vllm", "sglang"]
    for r in rows[:2]:
        assert r["requests"] == 30 and r["mean_us"] > 0 and 0 < r["hit_share"] < 1
    for r, package in zip(rows[2:], ("vllm", "sglang")):
        assert r["skipped"] == f"package {package!r} is not installed: pip install 'kvtier[peers]'"


def test_bench_peers_table_says_which_peer_was_skipped(capsys, monkeypatch):
    monkeypatch.setattr(peers.importlib.util, "find_spec", lambda name: None)
    assert main(TINY_PEERS + ["--peer", "sglang", "--peer", "kvtier"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("trace: 30 requests")
    assert out[1].startswith("sglang") and "skipped: package 'sglang' is not installed" in out[1]
    assert out[1].endswith("pip install 'kvtier[peers]'")
    assert [line.split()[0] for line in out[2:]] == ["kvtier[sha256]", "kvtier[xxh3_128]"]
