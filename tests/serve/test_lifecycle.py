"""`kvtier serve` as a supervisor and a load balancer see it: /health says `starting` (with the
phase) until the engine is ready, `dead` once its GPU can run nothing more, and then the process
exits non-zero; bad arguments fail at once with nothing bound.

The faults are injected into real `kvtier serve` processes through a `sitecustomize.py` on their
PYTHONPATH (Python imports it at start): a slow weight load, and a forward that fails the way
a device-side assert surfaces in torch (`CUDA error: device-side assert triggered`)."""

from __future__ import annotations

import os
import subprocess
import time

import httpx
import pytest

from kvtier.serve.launch import ServerProcess, kvtier_command

SLOW_LOAD = """
import time
import kvtier.engine.build as build
_load = build.load_model
def load_model(*a, **k):
    time.sleep(3.0)
    return _load(*a, **k)
build.load_model = load_model
"""

ASSERT_ON_SECOND_STEP = """
import kvtier.engine.runner as runner
_execute = runner.ModelRunner.execute
calls = []
def execute(self, *a, **k):
    calls.append(1)
    if len(calls) >= 2:
        raise RuntimeError("CUDA error: device-side assert triggered\\nCUDA kernel errors might be "
                           "asynchronously reported at some other API call")
    return _execute(self, *a, **k)
runner.ModelRunner.execute = execute
"""


def _env(tmp_path, code: str) -> dict:
    d = tmp_path / "inject"
    d.mkdir()
    (d / "sitecustomize.py").write_text(code)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(d), env.get("PYTHONPATH", "")])
    return env


@pytest.mark.slow  # (a server or processes of its own: CI runs it with -m slow)
def test_health_says_starting_with_its_phase_until_the_engine_is_ready(checkpoint, tmp_path):
    server = ServerProcess(
        ["serve", checkpoint("qwen3-tiny")], tmp_path / "serve.log", env=_env(tmp_path, SLOW_LOAD), log_level="info"
    )
    try:
        seen = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert server.popen.poll() is None, server.tail()
            try:
                r = httpx.get(server.url + "/health", timeout=2)
            except httpx.HTTPError:
                time.sleep(0.05)
                continue
            seen.append((r.status_code, r.json()))
            if r.status_code == 200:
                break
            time.sleep(0.1)
        starting = [body for status, body in seen if status == 503]
        assert starting and all(b["status"] == "starting" for b in starting)
        assert "loading weights" in {b["phase"] for b in starting}
        # requests before ready: 503, never a hang or a 500
        status, ready = seen[-1]
        assert status == 200 and ready["status"] == "ok" and ready["startup_s"] > 0
        assert "startup: ready in" in server.tail(200)
    finally:
        server.stop()


@pytest.mark.slow  # (a server or processes of its own: CI runs it with -m slow)
def test_a_request_while_starting_gets_503_with_retry_after(checkpoint, tmp_path):
    server = ServerProcess(["serve", checkpoint("qwen3-tiny")], tmp_path / "serve.log", env=_env(tmp_path, SLOW_LOAD))
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                r = httpx.post(server.url + "/v1/completions", json={"model": "x", "prompt": "hi"}, timeout=2)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, server.tail()
                time.sleep(0.05)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert "starting" in r.json()["error"]["message"]
    finally:
        server.stop()


@pytest.mark.slow  # (a server or processes of its own: CI runs it with -m slow)
def test_a_device_side_assert_makes_the_server_say_dead_and_exit_non_zero(checkpoint, tmp_path):
    server = ServerProcess(["serve", checkpoint("qwen3-tiny")], tmp_path / "serve.log", env=_env(tmp_path, ASSERT_ON_SECOND_STEP))
    try:
        server.wait_ready(120)
        model = httpx.get(server.url + "/v1/models", timeout=5).json()["data"][0]["id"]
        body = {"model": model, "prompt": [1, 2, 3], "max_tokens": 8, "ignore_eos": True}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code >= 500
        health = httpx.get(server.url + "/health", timeout=5)
        assert health.status_code == 503 and health.json()["status"] == "dead"
        assert "device-side assert" in health.json()["error"]["message"]
        assert server.popen.wait(30) == 1  # a supervisor restarts it
        assert "the GPU can run nothing more" in server.tail(200)
    finally:
        server.stop()


def test_bad_arguments_fail_the_command_at_once_with_nothing_bound(tmp_path):
    r = subprocess.run(
        kvtier_command("serve", tmp_path / "no-such-model", "--port", "1"), capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2
    assert "no-such-model" in r.stderr and "Uvicorn running" not in r.stderr


@pytest.mark.parametrize(
    "message, lost",
    [
        ("CUDA error: device-side assert triggered", True),
        ("CUDA error: an illegal memory access was encountered", True),
        ("CUDA out of memory. Tried to allocate 2.00 GiB", False),
        ("CUDA error: out of memory", False),
        ("request 7: positions 3..4 need 1 tokens the host has not seen", False),
    ],
)
def test_device_lost_tells_a_poisoned_context_from_a_recoverable_error(message, lost):
    from kvtier.engine.fatal import device_lost

    assert device_lost(RuntimeError(message)) is lost
    wrapped = ValueError("step failed")
    wrapped.__cause__ = RuntimeError(message)
    assert device_lost(wrapped) is lost


def test_the_engine_stops_at_once_on_a_device_error_and_reports_it(checkpoint, monkeypatch):
    """No retry, no blaming request after request on a dead GPU: the first such error stops the
    loop, fails what is in flight, and calls on_dead."""
    import asyncio

    from kvtier.engine.client import EngineClient
    from kvtier.engine.core import EngineCore
    from kvtier.engine.params import SamplingParams
    from kvtier.engine.runner import ModelRunner
    from kvtier.engine.wire import EngineDead

    calls = []

    def execute(self, *a, **k):
        calls.append(1)
        raise RuntimeError("CUDA error: device-side assert triggered")

    monkeypatch.setattr(ModelRunner, "execute", execute)
    dead: list[BaseException] = []
    engine = EngineClient.in_thread(EngineCore(checkpoint("qwen3-tiny")), on_dead=dead.append)
    try:

        async def go() -> None:
            reqs = [engine.make_request([1, 2, 3 + i], SamplingParams(max_tokens=4)) for i in range(3)]

            async def one(req):
                async for _ in engine.generate(req):
                    pass

            results = await asyncio.gather(*(one(r) for r in reqs), return_exceptions=True)
            assert all(isinstance(r, EngineDead) for r in results), results

        asyncio.run(go())
        assert dead == [engine.error] and str(engine.error).startswith("DeviceLost: ")  # not retried as a transient error
        assert len(calls) == 1  # the batch was not retried request by request
    finally:
        engine.shutdown()
