"""Engines sharing a real pool, for every backend: a second process gets storage hits and the same
greedy tokens and routed experts as a cold run; a pool that dies, corrupts or evicts costs a
recompute, never a wrong answer or an error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import kvtier
from tests.storage.engine_proc import ENGINE_KW, run

HERE = Path(__file__).parent
PRESET = "qwen3-moe-tiny"  # MoE: routed experts travel inside the stored objects
SERVERS = ["redis", "redis-cluster", "mooncake"]
BACKENDS = ["file", *SERVERS]


def prompts(seed: int, n: int = 4, length: int = 60) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (length,), generator=g).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def cold(checkpoint):
    """cold(prompts) -> outputs of an engine with no cache at all (the reference)."""
    memo: dict = {}

    def get(ps):
        key = tuple(map(tuple, ps))
        if key not in memo:
            with kvtier.LLM(checkpoint(PRESET), num_device_blocks=64, block_size=8, enable_prefix_caching=False) as llm:
                memo[key] = run(llm, ps, True)
        return memo[key]

    return get


@pytest.fixture(params=BACKENDS)
def pool(request, tmp_path):
    """(url, server handle or None) of a fresh pool of each kind."""
    kind = request.param
    if kind == "file":
        yield f"file://{tmp_path}/pool", None
    elif kind == "redis":
        server = request.getfixturevalue("valkey_server")
        server.flushall()
        yield server.url, server
    elif kind == "redis-cluster":
        cluster = request.getfixturevalue("valkey_cluster")
        cluster.flushall()
        yield cluster.url, cluster
    else:
        handle = request.getfixturevalue("mooncake_launch")
        if not handle.alive:  # killed by an earlier test: the same URL again
            handle.restart()
        handle.clear()
        yield handle.url, handle


def same(a: list[dict], b: list[dict]) -> None:
    for x, y in zip(a, b, strict=True):
        assert x["tokens"] == y["tokens"]
        assert x["routed"] == y["routed"]


def engine_process(model, url: str, ps, tmp_path: Path) -> dict:
    src, dst = tmp_path / "prompts.json", tmp_path / "out.json"
    src.write_text(json.dumps(ps))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    subprocess.run(
        [sys.executable, str(HERE / "engine_proc.py"), str(model), url, str(src), str(dst)], check=True, timeout=300, env=env
    )
    return json.loads(dst.read_text())


@pytest.mark.slow
def test_a_second_engine_process_gets_storage_hits_and_identical_outputs(pool, checkpoint, cold, tmp_path):
    url, _ = pool
    ps = prompts(1)
    first = engine_process(checkpoint(PRESET), url, ps, tmp_path)
    assert first["stats"]["storage"]["put_blocks"] > 0
    same(first["outputs"], cold(ps))
    second = engine_process(checkpoint(PRESET), url, ps, tmp_path)  # a fresh process: cold device/host
    same(second["outputs"], cold(ps))
    hits = [o["by_tier"]["storage"] for o in second["outputs"]]
    assert all(h == 56 for h in hits), hits  # 7 full blocks of 8 (the last token is computed)
    assert second["stats"]["storage"]["corrupt"] == 0


@pytest.mark.parametrize("pool", SERVERS, indirect=True)
@pytest.mark.slow
def test_a_pool_killed_mid_run_costs_recompute_then_recovers(pool, checkpoint, cold, tmp_path):
    url, server = pool
    ps = prompts(2, n=6)
    later = prompts(6, n=2)
    with kvtier.LLM(checkpoint(PRESET), storage=url, **ENGINE_KW) as llm:
        llm.storage.breaker.base_cooldown = llm.storage.breaker.cooldown = 0.5
        out = run(llm, ps[:3], True)
        server.kill()
        out += run(llm, ps[3:], True)  # puts and lookups fail: served by recompute
        out += run(llm, ps[:3], True)  # their hits are on device/host or recomputed
        same(out, cold(ps) + cold(ps[:3]))
        assert llm.cache_stats()["storage"]["failed_calls"] > 0
        llm.cache.assert_invariants()
        if hasattr(server, "restart"):  # the pool comes back (empty)
            server.restart()
        else:
            server.flushall()
        # past the breaker's cooldown a lookup probes the pool; a pool still starting (a loaded
        # machine) fails the probe and the cooldown doubles: lookups go on until one closes it
        deadline = time.monotonic() + 30
        while llm.storage.breaker.is_open and time.monotonic() < deadline:
            time.sleep(0.2)
            llm.storage.lookup_prefix([b"probe".ljust(32, b"\0")])
        assert not llm.storage.breaker.is_open, "the restarted pool never closed the breaker"
        puts_before = llm.cache_stats()["storage"]["put_blocks"]
        same(run(llm, later, True), cold(later))
    stats = llm.cache_stats()["storage"]  # after close(): puts drained
    assert not stats["breaker_open"] and stats["put_blocks"] > puts_before
    second = engine_process(checkpoint(PRESET), url, later, tmp_path)  # and they are served again
    same(second["outputs"], cold(later))
    assert all(o["by_tier"]["storage"] == 56 for o in second["outputs"])


@pytest.mark.slow
def test_corrupt_and_truncated_objects_are_misses(checkpoint, cold, tmp_path):
    url = f"file://{tmp_path}/pool"
    ps = prompts(3)
    engine_process(checkpoint(PRESET), url, ps, tmp_path)
    files = sorted(p for p in (tmp_path / "pool").rglob("kvt:*"))
    assert files
    for i, f in enumerate(files):
        data = bytearray(f.read_bytes())
        if i % 2:
            data[len(data) // 2] ^= 0xFF  # a flipped byte in the payload
        else:
            data = data[: len(data) - 100]  # truncated
        f.write_bytes(bytes(data))
    second = engine_process(checkpoint(PRESET), url, ps, tmp_path)
    same(second["outputs"], cold(ps))
    assert all(o["by_tier"]["storage"] == 0 for o in second["outputs"])
    assert second["stats"]["storage"]["corrupt"] >= len(ps)  # at least the first block of each
    third = engine_process(checkpoint(PRESET), url, ps, tmp_path)  # bad objects were replaced
    same(third["outputs"], cold(ps))
    assert all(o["by_tier"]["storage"] == 56 for o in third["outputs"])


@pytest.mark.slow
def test_a_pool_that_fills_up_evicts_and_misses(checkpoint, cold, tmp_path):
    with kvtier.LLM(checkpoint(PRESET), **ENGINE_KW) as llm:
        blob = llm.cache.block_nbytes
    url = f"file://{tmp_path}/pool?capacity={int(blob * 1.3) * 10}"  # ~10 objects of 28 written
    ps = prompts(4)
    first = engine_process(checkpoint(PRESET), url, ps, tmp_path)
    assert first["stats"]["storage"]["server"]["evictions"] > 0
    second = engine_process(checkpoint(PRESET), url, ps, tmp_path)
    same(second["outputs"], cold(ps))
    hits = [o["by_tier"]["storage"] for o in second["outputs"]]
    assert sum(hits) < 4 * 56, hits


@pytest.mark.slow  # (a server or processes of its own: CI runs it with -m slow)
def test_objects_are_named_the_same_in_every_process(checkpoint, tmp_path):
    ps = prompts(5, n=1)
    names = []
    for run_dir in ("a", "b"):
        url = f"file://{tmp_path}/{run_dir}"
        engine_process(checkpoint(PRESET), url, ps, tmp_path)
        names.append(sorted(p.name for p in (tmp_path / run_dir).rglob("kvt:*")))
    assert names[0] == names[1] and len(names[0]) == (60 + 8) // 8  # prompt + generated full blocks
