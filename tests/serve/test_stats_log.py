"""The engine's periodic stats line (``kvtier serve --log-stats-interval``)."""

from __future__ import annotations

import asyncio
import logging
import re

import pytest

import kvtier
from kvtier.engine.client import EngineClient
from kvtier.engine.core import EngineCore
from kvtier.engine.stats_log import StatsLog

PARAMS = kvtier.SamplingParams(max_tokens=5, ignore_eos=True)


def numbers(line: str) -> dict[str, float]:
    """The line's fields as numbers, by the word before or after them."""

    def get(pat: str) -> float:
        m = re.search(pat, line)
        assert m is not None, f"{pat!r} not in {line!r}"
        return float(m.group(1).replace(",", ""))

    return {
        "dt": get(r"engine \(([\d.]+) s\)"),
        "prompt": get(r"([\d,]+) prompt"),
        "generated": get(r"([\d,]+) generated"),
        "running": get(r"running (\d+)"),
        "waiting": get(r"waiting (\d+)"),
        "device_used": get(r"device ([\d,]+)/"),
        "device": get(r"device [\d,]+/([\d,]+) blocks"),
    }


def test_the_line_counts_prompt_and_generated_tokens_and_what_the_engine_holds(checkpoint):
    core = EngineCore(checkpoint("llama-tiny"), block_size=8, num_device_blocks=64)
    try:
        stats = StatsLog(1.0)
        t0 = stats.last
        assert stats.maybe_log(core, t0 + 11) is None  # nothing done, nothing held: no line
        a = core.add_request([1, 2, 3] * 7, PARAMS)  # 21 prompt tokens
        core.add_request([4, 5] * 6, PARAMS)  # 12
        core.step()  # both prefilled: 1 token sampled each
        for seconds in (0.25, 0.5, 0.125):
            stats.note_step(seconds)
        line = stats.maybe_log(core, t0 + 12)  # 1 s after the last (empty) check
        assert line is not None
        assert "slowest step 500 ms" in line and "pool" not in line  # (no pool configured)
        got = numbers(line)
        assert got["dt"] == 1.0
        assert got["prompt"] == 21 + 12 and got["generated"] == 2
        assert (got["running"], got["waiting"]) == (2, 0)
        assert got["device"] == 64 and got["device_used"] == 3 + 2
        assert stats.maybe_log(core, t0 + 12.5) is None  # before the next interval
        while core.has_unfinished():
            core.step()
        core.add_request([1, 2, 3] * 7, PARAMS)  # the same prompt: a device hit ...
        core.step()
        line = stats.maybe_log(core, t0 + 13)
        assert line is not None
        assert "slowest step 0 ms" in line  # the slowest since the last line
        got = numbers(line)
        assert got["prompt"] == 5  # ... computes only its last block's 5 tokens
        assert got["generated"] == 2 * 4 + 1
        del a
    finally:
        core.close()


def test_a_negative_interval_is_refused():
    with pytest.raises(ValueError, match="-1"):
        StatsLog(-1)


def test_a_served_engine_logs_the_line_while_it_works(checkpoint, caplog):
    eng = EngineClient.in_thread(EngineCore(checkpoint("llama-tiny"), block_size=8, num_device_blocks=64), stats_interval=0.01)
    caplog.set_level(logging.INFO, logger="kvtier.engine")
    try:

        async def run():
            out = None
            async for d in eng.generate(eng.make_request([1, 2, 3] * 7, kvtier.SamplingParams(max_tokens=40, ignore_eos=True))):
                await asyncio.sleep(0.002)
                out = d.output or out
            return out

        assert len(asyncio.run(run()).token_ids) == 40
    finally:
        eng.shutdown()
    lines = [numbers(r.getMessage()) for r in caplog.records if r.name == "kvtier.engine"]
    assert lines and all(line["running"] in (0, 1) for line in lines) and lines[0]["running"] == 1
    assert lines[0]["prompt"] > 0 and any(line["generated"] > 0 for line in lines)


def test_a_failing_line_turns_itself_off_and_the_engine_serves_on(checkpoint, caplog, monkeypatch):
    calls = []

    def boom(self, core, now=None):
        calls.append(1)
        raise RuntimeError("stats broke")

    monkeypatch.setattr(StatsLog, "maybe_log", boom)
    eng = EngineClient.in_thread(EngineCore(checkpoint("llama-tiny"), block_size=8, num_device_blocks=64), stats_interval=0.001)
    try:

        async def run():
            return [d async for d in eng.generate(eng.make_request([1, 2, 3], PARAMS))][-1].output

        assert len(asyncio.run(run()).token_ids) == 5
    finally:
        eng.shutdown()
    assert calls == [1]  # turned off after the first failure: never tried again
    assert any("stats line failed" in r.getMessage() for r in caplog.records)


def test_generated_counts_tokens_returned_not_tokens_sampled_ahead(checkpoint):
    """Under overlap scheduling a request that stops on a stop token has one more step queued
    before the host sees that token: its sample is dropped, and must not count as generated."""
    core = EngineCore(checkpoint("llama-tiny"), block_size=8, num_device_blocks=64, overlap_schedule=True)
    try:
        core.add_request([1, 2, 3] * 7, kvtier.SamplingParams(max_tokens=8, ignore_eos=True))
        outs = []
        while core.has_unfinished():
            outs += core.step()
        assert core.scheduler.num_generated_tokens == 8
        stop = outs[-1].token_ids[2]  # the same prompt stops on its 3rd token
        core.add_request([1, 2, 3] * 7, kvtier.SamplingParams(max_tokens=8, ignore_eos=True, stop_token_ids=[stop]))
        outs = []
        while core.has_unfinished():
            outs += core.step()
        got = len(outs[-1].token_ids)
        assert got <= 3 and core.scheduler.num_generated_tokens == 8 + got
    finally:
        core.close()


def test_setup_logging_leaves_an_applications_logging_alone(monkeypatch):
    """serve()/route() give kvtier's lines a stderr handler only where nobody set logging up: an
    application's root handler would otherwise print every line twice."""
    from kvtier.serve.server import setup_logging

    kv, root = logging.getLogger("kvtier"), logging.getLogger()
    monkeypatch.setattr(kv, "handlers", [])
    monkeypatch.setattr(kv, "level", logging.NOTSET)
    app = logging.StreamHandler()
    monkeypatch.setattr(root, "handlers", [app])  # the application's basicConfig
    setup_logging("info")
    assert kv.handlers == [] and kv.level == logging.NOTSET
    monkeypatch.setattr(root, "handlers", [])  # nobody configured logging: kvtier does
    setup_logging("warning")
    assert len(kv.handlers) == 1 and kv.level == logging.WARNING
    setup_logging("info")  # once
    assert len(kv.handlers) == 1
