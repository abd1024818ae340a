"""GPU: a request's fixed costs through `kvtier serve` (the engine in its own process).
qwen3-0.6b-shape, bf16, dummy weights; medians of 5 after warm-up:

1. a device hit's TTFT through the server (a 4,096-token cached prefix + 48 new tokens,
   ``max_tokens=1``, the client's wall time of the whole answer) against the GPU time of the
   same forward (its kernels under torch.profiler, offline ``kvtier.LLM``): goal <= 1.5x;
2. cold 4K prompts and device hits with a ``file://`` pool configured vs without: goal <= 1.05x.

    . scripts/gpu_webdeps.sh && python scripts/gpu_server_ttft.py   # JSON on stdout and in $OUT
"""

from __future__ import annotations

import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import torch

import kvtier
from kvtier.model import init_model
from kvtier.serve.launch import ServerProcess

CTX = 8192
N = 5


def gpu_time(path: Path, prefix: list[int]) -> float:
    """The GPU time of a device hit's forward (offline, under torch.profiler), seconds."""
    from torch.profiler import ProfilerActivity, profile

    sp = kvtier.SamplingParams(max_tokens=1, ignore_eos=True)
    kw = dict(device="cuda", load_format="dummy", max_model_len=CTX, max_num_batched_tokens=CTX)
    with kvtier.LLM(path, **kw) as llm:
        llm.generate([prefix + [1] * 48], sp)
        for i in range(3):
            llm.generate([prefix + [2 + i] * 48], sp)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            llm.generate([prefix + [20] * 48], sp)
    return sum(e.self_device_time_total for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA) / 1e6


_CLIENT = httpx.Client(timeout=120)  # one kept-alive connection, as a serving client has


def answer_s(url: str, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    r = _CLIENT.post(
        url + "/v1/completions",
        json={"model": "m", "prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True},
    )
    r.raise_for_status()
    return time.perf_counter() - t0


def served(path: Path, tmp: Path, pool: bool, prefix: list[int], rng: random.Random) -> dict:
    flags: list = ["serve", path, "--device", "cuda", "--load-format", "dummy", "--max-model-len", CTX]
    flags += ["--max-num-batched-tokens", CTX, "--served-model-name", "m"]
    if pool:
        flags += ["--storage", f"file://{tmp}/pool?capacity=20GiB"]
    server = ServerProcess(flags, tmp / f"serve-{pool}.log").wait_ready(900)
    try:
        answer_s(server.url, prefix + [1] * 48)  # the prefix, cached
        for i in range(3):
            answer_s(server.url, prefix + [2 + i] * 48)
            answer_s(server.url, [rng.randrange(32000) for _ in range(4096)])
        hits = [answer_s(server.url, prefix + [10 + i] * 48) for i in range(N)]
        cold = [answer_s(server.url, [rng.randrange(32000) for _ in range(4096)]) for _ in range(N)]
        return {"device_hit_s": statistics.median(hits), "cold_4k_s": statistics.median(cold), "hits": hits, "cold": cold}
    finally:
        server.stop()


def main() -> None:
    out = Path(os.environ.get("OUT", "/tmp"))
    tmp = Path(tempfile.mkdtemp())
    path = init_model("qwen3-0.6b-shape", tmp / "m", config_only=True)
    rng = random.Random(0)
    prefix = [rng.randrange(32000) for _ in range(4096)]
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    res["gpu_s"] = gpu_time(path, prefix)
    res["no_pool"] = served(path, tmp, False, prefix, rng)
    res["pool"] = served(path, tmp, True, prefix, rng)
    res["device_hit_vs_gpu"] = res["no_pool"]["device_hit_s"] / res["gpu_s"]
    res["pool_cost_device_hit"] = res["pool"]["device_hit_s"] / res["no_pool"]["device_hit_s"]
    res["pool_cost_cold"] = res["pool"]["cold_4k_s"] / res["no_pool"]["cold_4k_s"]
    text = json.dumps(res, indent=1)
    print(text)
    (out / "server_ttft.json").write_text(text)


if __name__ == "__main__":
    main()
