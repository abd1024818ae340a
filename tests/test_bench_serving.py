"""``kvtier bench multiturn | longdoc | trace`` end to end on a tiny model on CPU: real kvtier
servers (one per --compare configuration, its own process), real sockets. Checked for shape and
sanity, not speed: every request answered, later rounds served from the prefix cache where the
workload shares prefixes (and never with the cache off), the JSON and the plot written."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from types import ModuleType

import httpx
import pytest

from kvtier.bench import longdoc, multiturn, serving, trace_replay
from kvtier.model import ModelConfig
from kvtier.serve.launch import ServerProcess

TINY = ["--model", "qwen3-tiny", "--max-model-len", "512", "--no-progress"]


def run_bench(module: ModuleType, argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> dict:
    """Run a bench's ``main`` on the tiny model; its JSON, checked for what every bench reports."""
    out = tmp_path / "result.json"
    assert module.main([*argv, *TINY, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    for config, r in result["results"].items():
        assert config in printed  # one table row per configuration
        assert r["failed"] == 0, r["errors"]
        assert r["ttft_mean"] > 0 and r["itl_mean"] > 0 and r["output_tokens_per_s"] > 0
        assert r["ttft_p50"] <= r["ttft_p90"] <= r["ttft_p99"]
    return result


@pytest.mark.slow
def test_multiturn_rounds_after_the_first_hit_the_cache_unless_it_is_off(tmp_path, capsys):
    plot = tmp_path / "ttft.png"
    res = run_bench(
        multiturn,
        [
            "--clients",
            "3",
            "--rounds",
            "3",
            "--request-length",
            "24",
            "--output-length",
            "4",
            "--compare",
            "recompute,host",
            "--plot",
            str(plot),
        ],
        tmp_path,
        capsys,
    )["results"]
    assert list(res) == ["recompute", "host"]
    for r in res.values():
        assert r["requests"] == 9 and len(r["ttft_by_round"]) == 3
        warm = r["warmup"]  # two waves of round 1, not counted,
        assert (warm["requests"], warm["failed"]) == (2 * 3, 0)  # then their copies landed
        assert warm["settle"]["settled"] and 0 <= warm["settle"]["s"] < 60
        # round k resends k earlier rounds of 24 + 4 tokens: the prompt grows as the recipe says
        assert r["prompt_by_round"] == [3 * 24, 3 * (2 * 24 + 4), 3 * (3 * 24 + 2 * 4)]
    assert res["recompute"]["cached_tokens"] == 0
    assert res["host"]["cached_by_round"][0] == 0
    # each later round finds the client's history, the full 16-token blocks of what the last
    # request computed: round 1 has 28 tokens of history (1 block), round 2 has 56 (3 blocks)
    assert res["host"]["cached_by_round"][1:] == [3 * 16, 3 * 48]
    assert sum(res["host"]["cached_tokens_by_tier"].values()) == res["host"]["cached_tokens"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_multiturn_through_pd_answers_every_round_as_colocated_does(tmp_path, capsys):
    """--compare host,pd: the same conversations through one server and through P + D behind the
    router (token identity across a hand-off: tests/serve/test_pd.py); later rounds find their
    history in P's cache, and the warm-up's copies settle on both servers."""
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "host.log").write_text("an earlier run\n")  # a kept directory used again
    res = run_bench(
        multiturn,
        [
            "--clients",
            "2",
            "--rounds",
            "3",
            "--request-length",
            "24",
            "--output-length",
            "4",
            "--compare",
            "host,pd",
            "--log-dir",
            str(logs),
            "--server-args",
            "--log-stats-interval 0.1",
        ],
        tmp_path,
        capsys,
    )["results"]
    assert list(res) == ["host", "pd"]
    # --log-dir keeps every server's log at info, each engine's stats lines in it
    assert sorted(f.name for f in logs.iterdir()) == [
        "host-2.log",
        "host.log",
        "pd-decode.log",
        "pd-prefill.log",
        "pd-router.log",
    ]
    assert (logs / "host.log").read_text() == "an earlier run\n"
    for name in ("host-2", "pd-prefill", "pd-decode"):
        text = (logs / f"{name}.log").read_text()
        assert "kvtier: serving" in text and "kvtier.engine: engine (" in text, text[-2000:]
        pool = r"pool read [\d.]+ GB/s, written [\d.]+ \| " if name != "host-2" else ""  # P and D have a pool
        assert re.search(r"exports \d+ \| " + pool + r"slowest step [\d,]+ ms", text), text[-2000:]
    assert "POST /v1/completions" in (logs / "pd-router.log").read_text()
    # and the JSON has each server's /kvtier/stats at the end
    assert set(res["host"]["server_stats"]) == {"server"} and set(res["pd"]["server_stats"]) == {"prefill", "decode"}
    assert res["pd"]["server_stats"]["decode"]["storage"]["hit_tokens"] > 0  # D read P's prompts from the pool
    assert res["pd"]["requests"] == 6 and res["pd"]["warmup"]["settle"]["settled"]
    assert res["pd"]["prompt_by_round"] == res["host"]["prompt_by_round"]
    assert res["pd"]["cached_by_round"][0] == 0 and res["pd"]["cached_by_round"][2] == 2 * 48
    assert sum(res["pd"]["cached_tokens_by_tier"].values()) == res["pd"]["cached_tokens"]


@pytest.mark.slow  # seven servers (three, three, a router each): CI runs it with -m slow
def test_multiturn_behind_the_router_keeps_conversations_where_their_history_is(tmp_path, capsys):
    """--compare round_robin,cache_aware --instances 3: five conversations over three servers;
    behind the cache-aware router every later round finds its whole history (as the servers'
    /metrics count it), behind round robin most miss. One request at a time, so that the order
    the router sees is the order sent (round robin's choices follow it) and each prefill ends
    before the next request arrives, as the simulator has them."""
    res = run_bench(
        multiturn,
        [
            "--clients",
            "5",
            "--rounds",
            "3",
            "--request-length",
            "24",
            "--output-length",
            "4",
            "--max-parallel",
            "1",
            "--compare",
            "round_robin,cache_aware",
            "--instances",
            "3",
        ],
        tmp_path,
        capsys,
    )["results"]
    rr, aware = res["round_robin"], res["cache_aware"]
    assert set(aware["server_stats"]) == {"server0", "server1", "server2"}
    # every history in full blocks of 16: 28 tokens before round 2 (one block), 56 before round 3
    assert aware["cached_by_round"][1] >= 5 * 16 and aware["cached_by_round"][2] >= 5 * 48
    assert aware["cached_tokens"] > rr["cached_tokens"]
    # kvtier sim on the same requests (and answers), each instance with the servers' tiers,
    # predicts the hit rate each policy measured
    for res_ in (rr, aware):
        assert abs(res_["predicted"]["hit_rate"] - res_["hit_rate"]) <= 0.05, (res_["hit_rate"], res_["predicted"])


@pytest.mark.slow  # (a server or processes of its own: CI runs it with -m slow)
def test_longdoc_tile_asks_every_document_again_from_the_cache(tmp_path, capsys):
    res = run_bench(
        longdoc,
        [
            "--documents",
            "3",
            "--document-length",
            "64",
            "--questions",
            "2",
            "--order",
            "tile",
            "--max-inflight",
            "1",
            "--compare",
            "device",
        ],
        tmp_path,
        capsys,
    )["results"]["device"]
    assert res["requests"] == 6 and res["cached_by_round"][0] == 0
    assert res["cached_by_round"][1] == 3 * 64  # every document, whole blocks: a hit


@pytest.mark.slow  # (a server or processes of its own: CI runs it with -m slow)
def test_trace_replay_shares_the_prefixes_its_hash_ids_share(tmp_path, capsys):
    # one request at a time: each finds the blocks of the ones before it (the trace's first hash
    # id is shared by its conversations: 32 tokens here, two full blocks)
    res = run_bench(
        trace_replay,
        [
            "traces/mooncake_conversation_1k.jsonl",
            "--requests",
            "40",
            "--block-tokens",
            "32",
            "--max-input-tokens",
            "400",
            "--max-output-tokens",
            "4",
            "--time-scale",
            "0.001",
            "--max-parallel",
            "1",
            "--compare",
            "device",
        ],
        tmp_path,
        capsys,
    )["results"]["device"]
    assert 2 <= res["requests"] <= 40 and res["cached_tokens"] >= 32 * (res["requests"] - 1)


@pytest.mark.slow  # (a server or processes of its own: CI runs it with -m slow)
def test_url_measures_a_running_server(tmp_path, capsys, checkpoint):
    """--url as the openai client takes it (with /v1); the vocabulary and the context come from
    the server's /v1/models (vocab_size, max_model_len, as vLLM's fields root, parent, permission)."""
    model = checkpoint("qwen3-tiny")
    server = ServerProcess(["serve", model, "--max-model-len", "384"], tmp_path / "s.log")
    try:
        server.wait_ready(timeout=300)
        entry = httpx.get(server.url + "/v1/models").json()["data"][0]
        out = tmp_path / "r.json"
        assert (
            longdoc.main(
                [
                    "--url",
                    server.url + "/v1/",
                    "--documents",
                    "2",
                    "--document-length",
                    "40",
                    "--questions",
                    "2",
                    "--max-inflight",
                    "1",
                    "--no-progress",
                    "--json",
                    str(out),
                ]
            )
            == 0
        )
        with pytest.raises(SystemExit, match="1040 prompt .* > max_model_len 384 of the served model"):
            longdoc.main(["--url", server.url, "--no-progress"])
    finally:
        server.stop()
    assert (entry["max_model_len"], entry["vocab_size"]) == (384, ModelConfig.from_hf_dir(model).vocab_size)
    assert (entry["root"], entry["parent"], entry["permission"]) == (str(model), None, [])
    res = json.loads(out.read_text())
    assert res["args"]["vocab"] == 320 and res["args"]["served_max_model_len"] == 384
    res = res["results"]
    assert list(res) == ["url"] and res["url"]["failed"] == 0 and res["url"]["cached_tokens"] == 2 * 32


def test_orders_and_bad_settings():
    assert longdoc.order(2, 2, "tile", 0) == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert longdoc.order(2, 2, "interleave", 0) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    rand = longdoc.order(3, 2, "random", 1)
    assert sorted(rand) == longdoc.order(3, 2, "interleave", 0)
    assert all(q == 0 for d, q in rand if (d, q) == min((x for x in rand if x[0] == d), key=rand.index))
    with pytest.raises(ValueError, match="unknown configuration 'gpu'"):
        serving.server_flags("gpu", argparse.Namespace(), Path("unused"))
    with pytest.raises(ValueError, match="request-rate"):
        serving.Arrivals(0, 4, 0)
    with pytest.raises(SystemExit):
        multiturn.main(["--clients", "0"])
