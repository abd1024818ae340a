"""`kvtier bench` as a command: every bench listed in its help, `attention --smoke` without
triton, and `pd` leaving no temporary directory behind however it ends."""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile

import pytest

from kvtier.bench import attention_bench, pd_bench, vlm_chat
from kvtier.cli import BENCHES, main


def test_bench_help_lists_every_bench_with_its_line(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    assert {"cache", "peers", "throughput", "experts", "attention", "transfer", "overlap", "storage", "pd"} <= set(BENCHES)
    for name, (_, line) in BENCHES.items():
        assert f"  {name:<11} {line}" in out


def test_attention_smoke_without_triton_times_the_torch_backends(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    results = attention_bench.main(["--smoke", "--iters", "1", "--warmup", "0", "--ref-iters", "1"])
    assert "triton is not installed (pip install triton)" in capsys.readouterr().err
    assert results and all(r.triton_ms is None and r.reference_ms is not None and r.reference_ms > 0 for r in results)
    assert any(r.sdpa_ms is not None for r in results)


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    """tempfile's directory, to see what a bench leaves there."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


class _Interrupted:
    """Stands in for ServerProcess: the run is interrupted as the first server starts."""

    def __init__(self, *args, **kwargs):
        raise KeyboardInterrupt


class _Terminated:
    def __init__(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)


CONFIG_ONLY = ["--load-format", "dummy", "--requests", "2"]  # no weights written: fast


def test_bench_pd_removes_its_temp_dir_on_an_error(private_tmp):
    with pytest.raises(FileNotFoundError):
        pd_bench.main(["--model", str(private_tmp / "no-such-model"), "--requests", "2"])
    assert not list(private_tmp.iterdir())


def test_bench_pd_removes_its_temp_dir_on_ctrl_c(private_tmp, monkeypatch):
    monkeypatch.setattr(pd_bench, "ServerProcess", _Interrupted)
    with pytest.raises(KeyboardInterrupt):
        pd_bench.main(CONFIG_ONLY)
    assert not list(private_tmp.iterdir())


def test_bench_pd_removes_its_temp_dir_on_sigterm_and_restores_the_handler(private_tmp, monkeypatch):
    monkeypatch.setattr(pd_bench, "ServerProcess", _Terminated)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        pd_bench.main(CONFIG_ONLY)
    assert not list(private_tmp.iterdir())
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.slow
def test_bench_pd_sweeps_rates_with_repeats_end_to_end(tmp_path, capsys):
    """Two rates x two runs of 3 requests through a colocated server and P + D behind the router
    (CPU, fp32): per rate each metric's median and spread, ratios, and identical token streams."""
    out = tmp_path / "pd.json"
    assert (
        pd_bench.main(
            [
                "--requests",
                "3",
                "--rate",
                "0,50",
                "--repeat",
                "2",
                "--prompt-tokens",
                "24,40",
                "--output-tokens",
                "4,6",
                "--num-host-blocks",
                "64",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    import json

    res = json.loads(out.read_text())
    assert res["rates"] == [0.0, 50.0] and res["repeat"] == 2 and len(res["points"]) == 2
    for point in res["points"]:
        for setup in ("colocated", "pd"):
            ttft = point[setup]["ttft_p90_s"]
            assert 0 < ttft["min"] <= ttft["median"] <= ttft["max"] < 60
        assert point["identical_tokens"] == 6  # fp32 on CPU: the hand-off changes nothing
        assert point["pd_over_colocated_ttft_p90_s"] > 0
    assert res["handoff"]["storage_hit_tokens"] > 0
    ps = res["prefill_server"]  # P's own TTFT and its wait for the pool, from its /metrics
    assert 0 < ps["ttft_mean_s"] < 60 and 0 < ps["export_mean_s"] < 60
    assert ps["storage"]["put_blocks"] > 0
    text = capsys.readouterr().out
    assert "P: own TTFT mean" in text
    assert "50/s PD/colocated" in text and "identical token streams 6 / 6" in text


def test_bench_pd_names_bad_rates_and_setups(capsys):
    for bad in (
        ["--rate", "fast"],
        ["--rate", "-1"],
        ["--setups", "both"],
        ["--repeat", "0"],
        ["--prefill-put-workers", "0"],
        ["--prefill-put-workers", "2", "--setups", "colocated"],
    ):
        with pytest.raises(SystemExit):
            pd_bench.main(bad)
    err = capsys.readouterr().err
    assert "'fast'" in err and "'-1'" in err and "'both'" in err and "--requests and --repeat must be >= 1" in err
    assert "--prefill-put-workers must be >= 1, got 0" in err and "it needs the pd setup" in err


def test_bench_vlm_chat_runs_the_tower_once_per_conversation(tmp_path, capsys):
    out = tmp_path / "vlm.json"
    args = ["--device", "cpu", "--clients", "2", "--rounds", "2", "--turn-length", "20", "--num-device-blocks", "128"]
    assert vlm_chat.main([*args, "--json", str(out)]) == 0
    rounds = json.loads(out.read_text())["rounds"]
    assert [r["images_encoded"] for r in rounds] == [2, 2]
    assert rounds[1]["cached_tokens_with_image"] > 0
    assert "round 2: TTFT" in capsys.readouterr().out
