"""GPU: where a request's TTFT goes (issue 16's fixed costs). qwen3-0.6b-shape, bf16, a 4,096-token
prefix + 48 new tokens. Wraps the engine's phases with wall-clock timers and reports, per request
(median of 5): total, schedule, forward launch (runner.execute), waiting for results (collect),
pumping copies, storage lookups; with and without a ``file://`` pool, with the pool's puts idle or in
flight, and with a short GIL switch interval (to see contention with the I/O threads).

Environment: ``PROBE_CONFIGS`` (nopool,host,pool: which to run), ``PROBE_SWITCH`` (switch intervals
of the busy runs, default 0.005,0.0005), ``PROBE_PUT_WORKERS`` (the pool's put threads),
``PROBE_PROFILE=1`` (one hit under torch.profiler), ``PROBE_CPROFILE=1`` (pool hits under cProfile),
``PROBE_STAGING_BYTES`` (``kernels.TUNING["staging_bytes"]``; 0 turns the staged copies off).
Put threads, as measured on 2026-11-24 (docs/BENCHMARKS.md)::

    for pw in 8 1 2; do PROBE_PUT_WORKERS=$pw PROBE_CONFIGS=pool PROBE_SWITCH=0.0005 \
        python scripts/gpu_ttft_probe.py; done
"""
from __future__ import annotations

import collections
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import kvtier
from kvtier.engine import runner as runner_mod
from kvtier.model import init_model

_GPU = os.environ.get("PROBE_DEVICE", "cuda") == "cuda"
VOCAB, PREFIX = (32000, 4096) if _GPU else (300, 256)
SP = kvtier.SamplingParams(max_tokens=1, ignore_eos=True)
T: collections.Counter = collections.Counter()


if os.environ.get("PROBE_STAGING_BYTES"):  # 0: no staged copies (loads of replayed steps per layer again)
    from kvtier.transfer import kernels as _kernels
    _kernels.TUNING["staging_bytes"] = int(os.environ["PROBE_STAGING_BYTES"])


if os.environ.get("PROBE_PUT_WORKERS"):    # put threads of the pool's client (default: half the fetch threads)
    import functools
    import kvtier.engine.core as _core
    _core.open_storage = functools.partial(_core.open_storage, put_workers=int(os.environ["PROBE_PUT_WORKERS"]))


def timed(name, fn):  # type: ignore[no-untyped-def]
    def wrap(*a, **k):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            T[name] += time.perf_counter() - t0
    return wrap


def instrument(llm) -> None:  # type: ignore[no-untyped-def]
    llm.scheduler.schedule = timed("schedule", llm.scheduler.schedule)
    llm.runner.execute = timed("execute", llm.runner.execute)
    llm._pump = timed("pump", llm._pump)
    llm._outputs = timed("outputs", llm._outputs)
    llm.cache.match_prefix = timed("match", llm.cache.match_prefix)
    if llm.storage is not None:
        llm.storage.lookup_prefix = timed("lookup", llm.storage.lookup_prefix)


_collect = runner_mod.StepResult.collect
runner_mod.StepResult.collect = timed("collect", _collect)  # type: ignore[method-assign]


def one(llm, prompt) -> dict:  # type: ignore[no-untyped-def]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    T.clear()
    t0 = time.perf_counter()
    llm.generate([prompt], SP)
    d = {k: v * 1e3 for k, v in T.items()}
    d["total"] = (time.perf_counter() - t0) * 1e3
    return d


def workload():  # type: ignore[no-untyped-def]
    """(output dir, temp dir, qwen3-0.6b-shape config dir, the 4K prefix, a fresh-prompt maker)."""
    out = Path(os.environ.get("OUT", "/tmp"))
    tmp = tempfile.mkdtemp()
    path = init_model("qwen3-0.6b-shape", Path(tmp) / "m", config_only=True)
    rng = random.Random(0)
    prefix = [rng.randrange(VOCAB) for _ in range(PREFIX)]
    return out, tmp, path, prefix, lambda: [rng.randrange(VOCAB) for _ in range(PREFIX + 48)]


def med(rows: list[dict]) -> dict:
    keys = sorted({k for r in rows for k in r})
    return {k: round(statistics.median(r.get(k, 0.0) for r in rows), 3) for k in keys}


def idle(llm) -> None:  # type: ignore[no-untyped-def]
    while llm.storage is not None and llm.storage.num_in_flight:
        llm.step()
        time.sleep(0.01)
    for _ in range(3):
        llm.step()


def main() -> None:
    out = Path(os.environ.get("OUT", "/tmp"))
    tmp = tempfile.mkdtemp()
    dev = os.environ.get("PROBE_DEVICE", "cuda")
    preset = "qwen3-0.6b-shape" if dev == "cuda" else "llama-tiny"
    path = init_model(preset, Path(tmp) / "m", config_only=dev == "cuda")
    rng = random.Random(0)
    prefix = [rng.randrange(VOCAB) for _ in range(PREFIX)]
    fresh = lambda: [rng.randrange(VOCAB) for _ in range(PREFIX + 48)]  # noqa: E731
    res: dict = {}
    kw = dict(device=dev, load_format="dummy", num_device_blocks=4096 if _GPU else 256, max_model_len=8192 if _GPU else 512,
              max_num_batched_tokens=8192 if _GPU else 512)
    configs = (("nopool", {}), ("host", {"num_host_blocks": 4096}),
               ("pool", {"storage": f"file://{tmp}/pool", "num_host_blocks": 4096}))
    only = os.environ.get("PROBE_CONFIGS")
    for label, extra in configs:
        if only and label not in only.split(","):
            continue
        with kvtier.LLM(path, **kw, **extra) as llm:
            instrument(llm)
            one(llm, prefix + [1] * 48)
            for i in range(3):
                one(llm, prefix + [2 + i] * 48)
                one(llm, fresh())
            idle(llm)
            hits, colds = [], []
            for i in range(5):
                idle(llm)
                hits.append(one(llm, prefix + [10 + i] * 48))
                idle(llm)
                colds.append(one(llm, fresh()))
            res[f"{label}_hit_idle"] = med(hits)
            res[f"{label}_cold_idle"] = med(colds)
            if label == "pool":
                for si in [float(x) for x in os.environ.get("PROBE_SWITCH", "0.005,0.0005").split(",")]:
                    sys.setswitchinterval(si)
                    hits, colds = [], []
                    for i in range(5):
                        idle(llm)
                        one(llm, fresh())                 # its puts are in flight during the next
                        hits.append(one(llm, prefix + [20 + i] * 48))
                        colds.append(one(llm, fresh()))
                    res[f"pool_hit_busy_si{si}"] = med(hits)
                    res[f"pool_cold_busy_si{si}"] = med(colds)
                sys.setswitchinterval(0.005)
                res["storage_stats"] = llm.storage.stats() if hasattr(llm.storage, "stats") else None
    print(json.dumps(res, indent=1, default=str))
    (out / "ttft_probe.json").write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__" and not any(os.environ.get(v) for v in ("PROBE_PROFILE", "PROBE_CPROFILE", "PROBE_HOSTHIT")):
    main()


def profile_hit() -> None:
    """One device hit under torch.profiler (CPU and CUDA): the top CPU-side ops and runtime calls."""
    from torch.profiler import ProfilerActivity, profile
    out = Path(os.environ.get("OUT", "/tmp"))
    tmp = tempfile.mkdtemp()
    path = init_model("qwen3-0.6b-shape", Path(tmp) / "m", config_only=True)
    rng = random.Random(0)
    prefix = [rng.randrange(VOCAB) for _ in range(PREFIX)]
    with kvtier.LLM(path, device="cuda", load_format="dummy", num_device_blocks=4096, max_model_len=8192,
                    max_num_batched_tokens=8192) as llm:
        for i in range(4):
            one(llm, prefix + [1 + i] * 48)
        times = [one(llm, prefix + [10 + i] * 48)["total"] for i in range(5)]
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            one(llm, prefix + [20] * 48)
        ka = prof.key_averages()
        text = (f"hit TTFT ms {times}\n" + ka.table(sort_by="self_cpu_time_total", row_limit=40)
                + "\n" + ka.table(sort_by="self_cuda_time_total", row_limit=25))
        print(text)
        (out / "hit_profile.txt").write_text(text)
        prof.export_chrome_trace(str(out / "hit_trace.json"))


if __name__ == "__main__" and os.environ.get("PROBE_PROFILE"):
    profile_hit()


def cprofile_pool_hit() -> None:
    """``PROBE_CPROFILE=1``: device hits with a ``file://`` pool configured and idle, under cProfile
    (engine thread): where the CPU time a pool adds goes. Also the same hits with the default
    5 ms switch interval (the engine sets 0.5 ms when a pool is configured)."""
    import cProfile
    import io
    import pstats
    out, tmp, path, prefix, fresh = workload()
    text = ""
    with kvtier.LLM(path, device="cuda", load_format="dummy", num_device_blocks=4096, max_model_len=8192,
                    max_num_batched_tokens=8192, storage=f"file://{tmp}/pool", num_host_blocks=4096) as llm:
        instrument(llm)
        for i in range(4):
            one(llm, prefix + [1 + i] * 48)
            one(llm, fresh())
        idle(llm)
        for si in (0.0005, 0.005):
            sys.setswitchinterval(si)
            rows = []
            for i in range(5):
                idle(llm)
                rows.append(one(llm, prefix + [30 + i + int(si * 1e4)] * 48))
            text += f"switch {si}: {json.dumps(med(rows))}\n"
        sys.setswitchinterval(0.0005)
        prof = cProfile.Profile()
        for i in range(5):
            idle(llm)
            prof.enable()
            one(llm, prefix + [60 + i] * 48)
            prof.disable()
        s = io.StringIO()
        st = pstats.Stats(prof, stream=s)
        st.sort_stats("tottime").print_stats(35)
        st.sort_stats("cumulative").print_stats(45)
        text += s.getvalue()
    print(text)
    (out / "pool_hit_cprofile.txt").write_text(text)


if __name__ == "__main__" and os.environ.get("PROBE_CPROFILE"):
    cprofile_pool_hit()


def host_hit_phases() -> None:
    """``PROBE_HOSTHIT=1``: a host hit (the 4K prefix evicted from the device tier, on the host
    tier) against a device hit of the same prefix right after it, phases timed as above, medians
    of 5; then one host hit under cProfile. Issue 17: what a host hit costs over a device hit."""
    import cProfile
    import io
    import pstats
    out, tmp, path, prefix, fresh = workload()
    # 600 device blocks: two fresh 4K prompts (2 x 262 blocks) push the prefix's 256 out
    with kvtier.LLM(path, device="cuda", load_format="dummy", num_device_blocks=600, num_host_blocks=4096,
                    max_model_len=8192, max_num_batched_tokens=8192) as llm:
        instrument(llm)
        for i in range(3):
            one(llm, prefix + [1 + i] * 48)
            one(llm, fresh())
            one(llm, fresh())
        hosts, devs = [], []
        for i in range(5):
            one(llm, fresh())
            one(llm, fresh())
            idle(llm)
            hosts.append(one(llm, prefix + [10 + i] * 48))
            idle(llm)
            devs.append(one(llm, prefix + [20 + i] * 48))
        res = {"host_hit": med(hosts), "device_hit": med(devs), "stats": llm.cache.stats.as_dict()}
        one(llm, fresh())
        one(llm, fresh())
        idle(llm)
        prof = cProfile.Profile()
        prof.enable()
        one(llm, prefix + [40] * 48)
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
    text = json.dumps(res, indent=1) + "\n" + s.getvalue()
    print(text)
    (out / "host_hit_probe.txt").write_text(text)


if __name__ == "__main__" and os.environ.get("PROBE_HOSTHIT"):
    host_hit_phases()
