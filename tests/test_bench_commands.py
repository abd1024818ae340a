"""`kvtier bench` as a command: every bench listed in its help, `attention --smoke` without
triton, and `pd` leaving no temporary directory behind however it ends."""
from __future__ import annotations

import os
import signal
import sys
import tempfile

import pytest

from kvtier.bench import attention_bench, pd_bench
from kvtier.cli import BENCHES, main


def test_bench_help_lists_every_bench_with_its_line(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    assert {"cache", "peers", "throughput", "routing", "attention", "transfer", "overlap", "storage",
            "pd"} <= set(BENCHES)
    for name, (_, line) in BENCHES.items():
        assert f"  {name:<11} {line}" in out


def test_attention_smoke_without_triton_times_the_torch_backends(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "triton", None)          # `import triton` raises ImportError
    results = attention_bench.main(["--smoke", "--iters", "1", "--warmup", "0", "--ref-iters", "1"])
    assert "triton is not installed (pip install triton)" in capsys.readouterr().err
    assert results and all(r.triton_ms is None and r.reference_ms > 0 for r in results)
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


CONFIG_ONLY = ["--load-format", "dummy", "--requests", "2"]     # no weights written: fast


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
