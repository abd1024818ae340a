"""`kvtier serve --tensor-parallel-size 2`: answers like one rank does, and a rank killed mid-run
ends the server with a non-zero status and a message naming the rank, within --tp-timeout.
On CPU (gloo) always; on two GPUs (NCCL, CUDA graphs) where there are two."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest
import torch

import kvtier

TIMEOUT = 20


def rank_processes(server_pid: int) -> list[int]:
    """The tensor-parallel rank processes below ``server_pid`` (server -> engine -> ranks)."""
    parents: dict[int, int] = {}
    ranks = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        pid = int(entry.name)
        parents[pid] = int(stat.rsplit(")", 1)[1].split()[1])
        if b"kvtier.engine.tp.worker" in cmdline:
            ranks.append(pid)
    return [p for p in ranks if parents.get(parents.get(p, 0), 0) == server_pid]


DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(
            not torch.cuda.is_available() or torch.cuda.device_count() < 2,
            reason="needs two CUDA GPUs (2x H100 80GB: pytest -m slow tests/serve/test_tensor_parallel_serve.py)",
        ),
    ),
]


@pytest.mark.slow  # a server of two ranks (~20 s on 2 cores): CI runs it with -m slow
@pytest.mark.parametrize("device", DEVICES)
def test_a_server_over_two_ranks_answers_and_exits_when_a_rank_dies(device, procs, checkpoint):
    path = checkpoint("qwen3-moe-tiny")
    prompt = list(range(5, 45))
    with kvtier.LLM(path, device=device, num_device_blocks=64, max_model_len=256) as llm:
        want = llm.generate([prompt], kvtier.SamplingParams(max_tokens=16, ignore_eos=True))[0].token_ids
    server = procs(
        ["serve", path, "--device", device, "-tp", 2, "--tp-timeout", TIMEOUT, "--num-device-blocks", 64, "--max-model-len", 256],
        f"tp-{device}",
        env=dict(os.environ, KVTIER_LOG_LEVEL="WARNING"),
    ).wait_ready()
    body = {
        "model": Path(path).name,
        "prompt": prompt,
        "max_tokens": 16,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == want
    ranks = rank_processes(server.popen.pid)
    assert len(ranks) == 1, ranks
    os.kill(ranks[0], signal.SIGKILL)
    try:
        httpx.post(server.url + "/v1/completions", json=dict(body, max_tokens=200), timeout=TIMEOUT + 10)
    except httpx.HTTPError:
        pass  # the server may close the connection as it goes down
    status = server.popen.wait(timeout=TIMEOUT + 15)  # (TimeoutExpired: the server hung)
    assert status != 0
    assert "tensor-parallel rank 1" in server.tail(60), server.tail(60)
