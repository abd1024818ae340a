"""``kvtier bench pd-soak`` and what it adds to the serving benches' driver (kvtier/bench/serving.py):
answers compared token for token with the baseline configuration's (a failed or id-less answer is
unknown, never identical), 5xx apart from other failures, each started process that exited counted
as a death, and PD's prefill and decode servers on devices of their own. The soak runs end to end
on CPU (qwen3-tiny); the rest on records, argument lists and a mocked HTTP transport."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvtier.bench import multiturn, pd_soak, serving
from kvtier.cli import main as kvtier_main


def rec(group: int, round_: int, ids: list[int] | None, error: str | None = None) -> serving.Record:
    return serving.Record(group, round_, 10, 4, output_ids=ids, error=error)


def test_an_answer_that_differs_from_the_baselines_is_a_mismatch_at_its_first_differing_token():
    base = [rec(0, 0, [1, 2, 3, 4]), rec(0, 1, [5, 6, 7, 8]), rec(1, 0, [9, 9, 9, 9])]
    same = serving.compare_outputs(base, [rec(1, 0, [9, 9, 9, 9]), rec(0, 1, [5, 6, 7, 8]), rec(0, 0, [1, 2, 3, 4])])
    assert same == {"identical": True, "compared": 3, "mismatches": 0, "unknown": 0, "first_mismatches": []}
    got = serving.compare_outputs(base, [rec(0, 0, [1, 2, 3, 4]), rec(0, 1, [5, 6, 0, 8]), rec(1, 0, [9, 9, 9, 9])])
    assert not got["identical"] and (got["compared"], got["mismatches"], got["unknown"]) == (3, 1, 0)
    assert got["first_mismatches"] == [{"group": 0, "round": 1, "position": 2, "expected": [7, 8], "got": [0, 8]}]
    shorter = serving.compare_outputs(base[:1], [rec(0, 0, [1, 2])])  # a prefix differs at its end
    assert shorter["first_mismatches"][0]["position"] == 2


def test_an_answer_without_token_ids_failed_or_missing_is_unknown_never_identical():
    base = [rec(0, 0, [1, 2]), rec(0, 1, [3, 4]), rec(0, 2, [5, 6]), rec(0, 3, None)]
    got = serving.compare_outputs(
        base, [rec(0, 0, None), rec(0, 1, [3, 4], error="HTTP 503: b'down'"), rec(0, 3, [7, 8])]
    )  # (0, 2) never answered
    assert got == {"identical": False, "compared": 0, "mismatches": 0, "unknown": 4, "first_mismatches": []}
    assert serving.compare_outputs([rec(0, 0, None)], [rec(0, 0, None)])["identical"] is False


def test_expect_identical_names_the_first_mismatch_and_the_table_shows_it():
    def result(**kw: Any) -> dict:
        return {**serving.summarize([], 1.0), "cached_tokens_by_tier": {}, "errors": [], "deaths": 0, "died": [], **kw}

    ok = result(**serving.compare_outputs([rec(0, 0, [1])], [rec(0, 0, [1])]))
    bad = result(**serving.compare_outputs([rec(0, 0, [1, 2]), rec(3, 1, [5, 6])], [rec(0, 0, [1, 2]), rec(3, 1, [5, 7])]))
    unknown = result(**serving.compare_outputs([rec(0, 0, [1])], [rec(0, 0, None)]))
    assert serving.first_problem({"host": result(), "pd": ok}) is None
    problem = serving.first_problem({"host": result(), "pd": ok, "storage": bad})
    assert problem is not None
    assert problem.startswith("storage: 1 of 2 answers differ from host's; the first: group 3 round 1 at token 1")
    problem = serving.first_problem({"host": result(), "pd": unknown})
    assert problem is not None and "answers could not be compared" in problem
    died = result(deaths=1, died=[{"role": "decode", "returncode": -9, "log": "d.log", "tail": "Killed"}])
    problem = serving.first_problem({"host": result(), "pd": died})
    assert problem is not None and problem.startswith("pd: the decode server exited with -9")
    rows = serving.table({"host": result(), "pd": ok, "storage": bad, "device": unknown}).splitlines()
    assert rows[0].split()[-1] == "same" and rows[1].split()[-1] == "base"
    assert [r.split()[-1] for r in rows[2:]] == ["yes", "diff", "?"] and rows[3].split()[-2] == "1"
    with pytest.raises(SystemExit, match="--expect-identical compares configurations"):
        multiturn.main(["--model", "qwen3-tiny", "--compare", "pd", "--expect-identical"])


def test_5xx_are_counted_apart_from_other_failures_even_inside_a_stream(tmp_path):
    def answer(request: httpx.Request) -> httpx.Response:
        prompt = json.loads(request.content)["prompt"]
        if prompt == [1]:
            return httpx.Response(503, json={"error": {"message": "no decode server is up", "code": 503}})
        if prompt == [2]:
            return httpx.Response(422, json={"error": {"message": "bad", "code": 422}})
        ok = 'data: {"choices": [{"text": "a", "token_ids": [7]}]}\n\n'
        if prompt == [3]:  # P answered, then D failed: the router says so in the stream
            failed = 'data: {"error": {"message": "decode server failed", "code": 502}}\n\n'
            return httpx.Response(200, text=ok + failed)
        return httpx.Response(200, text=ok + "data: [DONE]\n\n")

    target = serving.Server("http://test", None, [], tmp_path)  # a running server's URL: nothing started
    target.name = "m"

    async def go() -> list[serving.Record]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            return [await serving.send(client, target, serving.Record(0, k, 1, 4), [k]) for k in (1, 2, 3, 4)]

    recs = asyncio.run(go())
    assert [r.status for r in recs] == [503, 422, 502, 200]
    failed_late = recs[2].error
    assert failed_late is not None and failed_late.startswith("HTTP 502 in the stream")
    assert recs[3].error is None and recs[3].output_ids == [7]
    res = serving.summarize(recs, 1.0)
    assert (res["failed"], res["http_5xx"]) == (3, 2)


class FakeProcess:
    """Stands in for ServerProcess: records what would be launched, and is ready at once."""

    launched: list[tuple[list[str], dict[str, str] | None]] = []

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None, log_level: str = "warning") -> None:
        self.args, self.log, self.url = list(args), log, f"http://127.0.0.1:{len(self.launched) + 1}"
        FakeProcess.launched.append((self.args, env))

    def wait_ready(self) -> "FakeProcess":
        return self

    def stop(self) -> None:
        pass


def soak_args(*argv: str) -> argparse.Namespace:
    return pd_soak.build_parser().parse_args(["--model", "qwen3-tiny", *argv])


def test_pd_gives_its_prefill_and_decode_servers_their_own_devices(tmp_path, monkeypatch):
    monkeypatch.setattr("kvtier.serve.launch.ServerProcess", FakeProcess)
    monkeypatch.setattr(FakeProcess, "launched", [])
    args = soak_args("--device", "cuda:0", "--prefill-device", "cuda:2", "--decode-device", "cuda:1", "--server-args", "--seed 3")
    for config in ("storage", "pd"):
        server = serving.Server(
            None,
            "/m",
            serving.server_flags(config, args, tmp_path),
            tmp_path,
            pd=config == "pd",
            name=config,
            devices=serving.devices(args),
        )
        server.start()
    (colocated, _), (p, _), (d, _), (router, _) = FakeProcess.launched

    def device(argv: list) -> list[str]:
        return [argv[i + 1] for i, a in enumerate(argv) if a == "--device"]

    assert device(colocated) == ["cuda:0"] and device(p) == ["cuda:2"] and device(d) == ["cuda:1"]
    assert device(router) == [] and router[0] == "router"
    assert p[p.index("--role") + 1] == "prefill" and d[d.index("--role") + 1] == "decode"
    assert all(argv[argv.index("--seed") + 1] == "3" for argv in (colocated, p, d))  # --server-args too
    # without --prefill-device / --decode-device both are --device's
    plain = serving.Server(None, "/m", [], tmp_path, pd=True, devices=serving.devices(soak_args("--device", "cuda:3")))
    assert plain.command("prefill")[:4] == ["serve", "/m", "--device", "cuda:3"]
    assert plain.command("decode")[:4] == ["serve", "/m", "--device", "cuda:3"]


def test_a_server_that_dies_starting_fails_the_soak_and_each_config_gets_an_empty_triton_cache(tmp_path, monkeypatch):
    caches = []

    class DiesStarting(FakeProcess):
        def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None, log_level: str = "warning") -> None:
            super().__init__(args, log, env, log_level)
            assert env is not None  # (the soak gives each server its own Triton cache)
            caches.append((env["TRITON_CACHE_DIR"], os.listdir(env["TRITON_CACHE_DIR"]), env["PATH"]))

        def wait_ready(self) -> "FakeProcess":
            raise RuntimeError(f"{self.args[:2]} exited with 1; CUDA error: out of memory")

    monkeypatch.setattr("kvtier.serve.launch.ServerProcess", DiesStarting)
    monkeypatch.setattr(FakeProcess, "launched", [])
    out = tmp_path / "soak.json"
    with pytest.raises(
        SystemExit,
        match=r"1 of 1 runs failed; run 1: 2 deaths; the first: storage starting "
        r"\(exit None, no log\):\n.*out of memory",
    ):
        pd_soak.main(["--model", "qwen3-tiny", "--runs", "1", "--fresh-triton-cache", "--no-progress", "--json", str(out)])
    # the colocated server, then P and D (the router never started): P and D share one fresh cache
    assert [c[0].rsplit("/", 1)[1] for c in caches] == ["triton-storage", "triton-pd", "triton-pd"]
    assert all(listed == [] and path == os.environ["PATH"] for _, listed, path in caches)
    res = json.loads(out.read_text())
    assert res["total"]["deaths"] == 2 and res["total"]["requests"] == 0 and len(res["problems"]) == 1


@pytest.mark.slow
def test_a_killed_decode_server_is_a_death_and_its_requests_5xx(tmp_path):
    args = soak_args(
        "--max-model-len",
        "128",
        "--warmup",
        "0",
        "--clients",
        "1",
        "--rounds",
        "1",
        "--request-length",
        "8",
        "--output-length",
        "2",
        "--no-progress",
    )
    model, args.vocab = serving.resolve_model(args, tmp_path)
    with serving.Server(
        None, model, serving.server_flags("pd", args, tmp_path), tmp_path, pd=True, name="pd", devices=serving.devices(args)
    ) as server:
        assert server.deaths() == []
        server.procs["decode"].kill()
        res, records = serving.measure(args, server, "pd", multiturn.workload(args), 1, (1, 8))
        died = server.deaths()
    assert [d["role"] for d in died] == ["decode"] and died[0]["returncode"] != 0
    assert died[0]["log"].endswith("pd-decode.log")
    assert res["failed"] == res["http_5xx"] == 1 and records[0].status in (502, 503)


@pytest.mark.slow
def test_pd_soak_runs_end_to_end_with_every_answer_identical(tmp_path, capsys):
    out = tmp_path / "soak.json"
    assert (
        kvtier_main(
            [
                "bench",
                "pd-soak",
                "--model",
                "qwen3-tiny",
                "--max-model-len",
                "128",
                "--runs",
                "1",
                "--clients",
                "2",
                "--rounds",
                "2",
                "--request-length",
                "16",
                "--output-length",
                "4",
                "--trace-requests",
                "4",
                "--block-tokens",
                "8",
                "--warmup",
                "1",
                "--fresh-triton-cache",
                "--no-progress",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "run 1/1: " in printed and "total of 1 runs: " in printed
    res = json.loads(out.read_text())
    total = res["total"]
    assert total["requests"] > 0 and total["compared"] == total["requests"] // 2
    assert {k: total[k] for k in ("deaths", "http_5xx", "errors", "mismatches", "unknown")} == dict.fromkeys(
        ("deaths", "http_5xx", "errors", "mismatches", "unknown"), 0
    )
    assert res["problems"] == []
    run = res["runs"][0]
    assert set(run["configs"]) == {"storage", "pd"}
    for config in run["configs"].values():
        assert set(config["workloads"]) == {"multiturn", "trace"} and config["died"] == []
        assert config["workloads"]["multiturn"]["requests"] == 4
    # D read P's prompts from the pool (the hand-off happened)
    decode = run["configs"]["pd"]["workloads"]["trace"]["server_stats"]["decode"]
    assert decode["storage"]["hit_tokens"] > 0
