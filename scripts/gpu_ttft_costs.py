"""GPU: per-request fixed costs (issue 16 goals). qwen3-0.6b-shape, bf16, 4,096-token prefix + 48
new tokens, median of 5 after warm-up:

1. a device hit's TTFT (``generate(max_tokens=1)`` wall time) against the GPU time of its forward
   (the sum of its kernels under torch.profiler): goal TTFT <= 1.5x;
2. cold TTFT of fresh prompts (nothing to fetch) with a ``file://`` pool configured vs without:
   goal <= 1.05x.
"""
from __future__ import annotations

import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

import kvtier
from kvtier.model import init_model

SP = kvtier.SamplingParams(max_tokens=1, ignore_eos=True)


def ttft(llm, prompt) -> float:  # type: ignore[no-untyped-def]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate([prompt], SP)
    return time.perf_counter() - t0


def main() -> None:
    out = Path(os.environ.get("OUT", "/tmp"))
    tmp = tempfile.mkdtemp()
    path = init_model("qwen3-0.6b-shape", Path(tmp) / "m", config_only=True)
    rng = random.Random(0)
    prefix = [rng.randrange(32000) for _ in range(4096)]
    res: dict = {}
    kw = dict(device="cuda", load_format="dummy", num_device_blocks=4096, max_model_len=8192,
              max_num_batched_tokens=8192)
    with kvtier.LLM(path, **kw) as llm:
        ttft(llm, prefix + [1] * 48)                          # prefix cached on the device
        for i in range(3):
            ttft(llm, prefix + [2 + i] * 48)                  # warm-up
        hits = [ttft(llm, prefix + [10 + i] * 48) for i in range(5)]
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            ttft(llm, prefix + [20] * 48)
        gpu = sum(e.self_device_time_total for e in prof.key_averages()
                  if e.device_type == torch.autograd.DeviceType.CUDA) / 1e6
        (out / "ttft_hit_kernels.txt").write_text(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=20))
        res["device_hit_ttft_s"] = statistics.median(hits)
        res["device_hit_gpu_s"] = gpu
        res["device_hit_ratio"] = res["device_hit_ttft_s"] / gpu
        import cProfile
        import io
        import pstats
        pr = cProfile.Profile()
        pr.enable()
        for i in range(3):
            ttft(llm, prefix + [30 + i] * 48)
        pr.disable()
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(30)
        (out / "ttft_hit_cprofile.txt").write_text(buf.getvalue())
        print(buf.getvalue()[:6000])
        cold = [ttft(llm, [rng.randrange(32000) for _ in range(4144)]) for _ in range(6)][1:]
        res["cold_ttft_s"] = statistics.median(cold)
    with kvtier.LLM(path, cuda_graphs=False, **kw) as llm:       # the same hit, eager
        for i in range(4):
            ttft(llm, prefix + [1 + i] * 48)
        res["device_hit_eager_ttft_s"] = statistics.median([ttft(llm, prefix + [10 + i] * 48) for i in range(5)])
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            ttft(llm, prefix + [20] * 48)
        res["device_hit_eager_gpu_s"] = sum(e.self_device_time_total for e in prof.key_averages()
                                            if e.device_type == torch.autograd.DeviceType.CUDA) / 1e6
        (out / "ttft_hit_kernels_eager.txt").write_text(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=20))
    with kvtier.LLM(path, storage=f"file://{tmp}/pool", num_host_blocks=4096, **kw) as llm:
        for _ in range(2):
            ttft(llm, [rng.randrange(32000) for _ in range(4144)])
        cold_pool = [ttft(llm, [rng.randrange(32000) for _ in range(4144)]) for _ in range(5)]
        res["cold_ttft_with_pool_s"] = statistics.median(cold_pool)
        res["pool_ratio"] = res["cold_ttft_with_pool_s"] / res["cold_ttft_s"]
        ttft(llm, prefix + [1] * 48)
        for i in range(3):
            ttft(llm, prefix + [2 + i] * 48)
        hits_pool = [ttft(llm, prefix + [10 + i] * 48) for i in range(5)]
        res["device_hit_ttft_with_pool_s"] = statistics.median(hits_pool)
        res["pool_hit_ratio"] = res["device_hit_ttft_with_pool_s"] / res["device_hit_ttft_s"]
    print(json.dumps(res, indent=1))
    (out / "ttft_costs.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
