"""``kvtier bench pd``: prefill/decode disaggregation through a pool vs one colocated server.

The same workload (random prompts of mixed lengths, mixed output lengths, Poisson arrivals at
``--rate``) is streamed through (1) one colocated ``kvtier serve`` and (2) ``kvtier serve --role
prefill`` + ``--role decode`` behind ``kvtier router``, one after the other (never at once: on one
GPU they would share it). Reported per setup: TTFT (request sent -> first token's chunk) and
inter-token latency (gaps between chunks / tokens in them), mean, p50, p90; and the hand-off
rate: bytes D read from the pool over the wall time its reads were in flight, against the raw
client of that pool (``kvtier bench storage``'s baseline, same object size and threads).

Every server is a process on 127.0.0.1, started and stopped here; the temporary directory
holding the model, the default pool and the logs is removed at the end, however it ends.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from kvtier.engine.config import EngineConfig
from kvtier.flags import add_json_flag, write_json
from kvtier.serve.launch import ServerProcess
from kvtier.storage.client import default_storage_workers

# the servers' engine options this bench takes (EngineConfig.add_flags)
ENGINE_OPTIONS = (
    "device",
    "kv_cache_dtype",
    "load_format",
    "num_device_blocks",
    "num_host_blocks",
    "max_model_len",
    "early_loads",
    "storage",
    "storage_workers",
)


def _stats(server: ServerProcess) -> dict:
    import httpx

    return httpx.get(server.url + "/kvtier/stats", timeout=30).json()


def _histograms(server: ServerProcess, names: tuple[str, ...]) -> dict[str, tuple[float, float]]:
    """(sum, count) of each histogram ``names`` on the server's /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(httpx.get(server.url + "/metrics", timeout=30).text):
        if fam.name in names:
            total = next((s.value for s in fam.samples if s.name.endswith("_sum")), 0.0)
            count = next((s.value for s in fam.samples if s.name.endswith("_count")), 0.0)
            out[fam.name] = (total, count)
    return out


def _means(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict[str, float]:
    """Mean of each histogram over the observations between two scrapes."""
    out = {}
    for name, (total, count) in after.items():
        t0, c0 = before.get(name, (0.0, 0.0))
        if count > c0:
            out[name] = (total - t0) / (count - c0)
    return out


_P_HISTOGRAMS = ("kvtier_time_to_first_token_seconds", "kvtier_pd_export_seconds")


def workload(
    n: int, rate: float, prompt_tokens: tuple[int, int], output_tokens: tuple[int, int], vocab: int, seed: int
) -> list[dict]:
    rng = np.random.default_rng(seed)
    t = 0.0
    out = []
    for i in range(n):
        t += rng.exponential(1.0 / rate) if rate > 0 else 0.0
        n_in = int(rng.integers(prompt_tokens[0], prompt_tokens[1] + 1))
        out.append(
            {
                "at": t,
                "prompt": rng.integers(0, min(vocab, 32000), n_in).tolist(),
                "max_tokens": int(rng.integers(output_tokens[0], output_tokens[1] + 1)),
            }
        )
    return out


async def _drive(url: str, model: str, reqs: list[dict], timeout: float) -> list[dict]:
    import httpx

    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=1024)) as client:

        async def one(r: dict) -> dict:
            await asyncio.sleep(r["at"])
            body = {
                "model": model,
                "prompt": r["prompt"],
                "max_tokens": r["max_tokens"],
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "return_token_ids": True,
            }
            t0 = time.perf_counter()
            times: list[float] = []
            counts: list[int] = []
            tokens: list[int] = []
            async with client.stream("POST", url + "/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    raise RuntimeError(f"{url}: {resp.status_code} {(await resp.aread())[:300]!r}")
                async for line in resp.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    c = json.loads(line[6:])
                    if "error" in c:
                        raise RuntimeError(f"{url}: {c['error']}")
                    ids = c["choices"][0].get("token_ids") or []
                    if ids:
                        times.append(time.perf_counter() - t0)
                        counts.append(len(ids))
                        tokens += ids
            itl = [(b - a) / k for a, b, k in zip(times, times[1:], counts[1:])]
            return {"ttft": times[0], "itl": itl, "tokens": tokens, "n": len(tokens)}

        return await asyncio.gather(*(one(r) for r in reqs))


def _summary(results: list[dict], wall: float) -> dict:
    ttft = [r["ttft"] for r in results]
    itl = [x for r in results for x in r["itl"]]
    pct = lambda xs, q: float(np.percentile(xs, q)) if xs else float("nan")  # noqa: E731
    return {
        "ttft_mean_s": statistics.fmean(ttft),
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p90_s": pct(ttft, 90),
        "itl_mean_s": statistics.fmean(itl) if itl else float("nan"),
        "itl_p50_s": pct(itl, 50),
        "itl_p90_s": pct(itl, 90),
        "output_tokens_per_s": sum(r["n"] for r in results) / wall,
        "wall_s": wall,
    }


def _spread(runs: list[dict]) -> dict:
    """Per metric over repeats: the median, and the spread (min, max)."""
    return {
        k: {"median": statistics.median(r[k] for r in runs), "min": min(r[k] for r in runs), "max": max(r[k] for r in runs)}
        for k in runs[0]
    }


def _sweep(url: str, name: str, loads: dict[float, list[list[dict]]], timeout: float, bar) -> dict:
    """{rate: [per repeat: (summary, results)]} of every workload, one after the other."""
    out: dict = {}
    for rate, repeats in loads.items():
        out[rate] = []
        for reqs in repeats:
            t0 = time.perf_counter()
            results = asyncio.run(_drive(url, name, reqs, timeout))
            out[rate].append((_summary(results, time.perf_counter() - t0), results))
            bar()
    return out


def run(
    model: str,
    storage: str | None,
    engine_args: list[str],
    requests: int,
    rates: list[float],
    prompt_tokens: tuple[int, int],
    output_tokens: tuple[int, int],
    seed: int,
    workers: int,
    tmp: Path,
    timeout: float = 600.0,
    repeat: int = 1,
    setups: tuple[str, ...] = ("colocated", "pd"),
    prefill_put_workers: int | None = None,
) -> dict:
    """Both setups (or ``setups``), each driven at every rate ``repeat`` times with ``requests``
    requests (a fresh workload per repeat: seed + repeat); servers' logs (and the default pool)
    go to ``tmp``, which the caller owns. ``points``: per rate, per setup, each metric's median
    over the repeats and its spread."""
    from kvtier.bench.storage_bench import bench_bytes
    from kvtier.model import ModelConfig

    cfg = ModelConfig.from_hf_dir(Path(model))
    pool_url = storage or f"file://{tmp / 'pool'}"
    name = "bench"
    common = [model, "--served-model-name", name, *engine_args]
    loads = {
        r: [workload(requests, r, prompt_tokens, output_tokens, cfg.vocab_size, seed + k) for k in range(repeat)] for r in rates
    }
    warm = workload(4, 0, prompt_tokens, (4, 4), cfg.vocab_size, seed + 1000)
    res: dict = {
        "model": model,
        "pool": pool_url.split("@")[-1],
        "requests": requests,
        "rates": rates,
        "repeat": repeat,
        "prompt_tokens": list(prompt_tokens),
        "output_tokens": list(output_tokens),
        "prefill_put_workers": prefill_put_workers,
    }
    servers: list[ServerProcess] = []
    done = [0]
    total = len(rates) * repeat * len(setups)

    def bar() -> None:
        done[0] += 1
        print(f"  [{done[0]}/{total}] runs done", file=sys.stderr, flush=True)

    runs: dict = {}
    try:
        if "colocated" in setups:
            colo = ServerProcess(["serve", *common], tmp / "colocated.log").wait_ready()
            servers.append(colo)
            asyncio.run(_drive(colo.url, name, warm, timeout))
            runs["colocated"] = _sweep(colo.url, name, loads, timeout, bar)
            colo.stop()
            servers.remove(colo)
        if "pd" in setups:
            pd_args = ["--storage", pool_url, "--storage-workers", str(workers)]
            p_args = [] if prefill_put_workers is None else ["--storage-put-workers", str(prefill_put_workers)]
            p = ServerProcess(["serve", *common, "--role", "prefill", *pd_args, *p_args], tmp / "prefill.log")
            d = ServerProcess(["serve", *common, "--role", "decode", *pd_args, "--storage-fetch", "always"], tmp / "decode.log")
            servers += [p, d]
            p.wait_ready(), d.wait_ready()
            router = ServerProcess(["router", "--prefill", p.url, "--decode", d.url], tmp / "router.log").wait_ready()
            servers.append(router)
            asyncio.run(_drive(router.url, name, warm, timeout))
            s0, h0 = _stats(d)["storage"], _histograms(p, _P_HISTOGRAMS)
            runs["pd"] = _sweep(router.url, name, loads, timeout, bar)
            s1, h1 = _stats(d)["storage"], _histograms(p, _P_HISTOGRAMS)
            # where P's answer time goes (all rates together): its own TTFT, then the wait for
            # the pool to store the prompt's blocks before it answers
            means = _means(h0, h1)
            res["prefill_server"] = {
                "ttft_mean_s": means.get("kvtier_time_to_first_token_seconds"),
                "export_mean_s": means.get("kvtier_pd_export_seconds"),
                "storage": _stats(p)["storage"],
            }
            busy_b = s1["busy_read_bytes"] - s0["busy_read_bytes"]
            busy_s = s1["busy_read_seconds"] - s0["busy_read_seconds"]
            res["handoff"] = {
                "bytes": busy_b,
                "gbps": busy_b / busy_s / 1e9 if busy_s else float("nan"),
                "storage_hit_tokens": s1["hit_tokens"] - s0["hit_tokens"],
                "fetch_threads": workers,
            }
            obj = int(s1["bytes_read"] / max(1, s1["hits"])) if s1["hits"] else None
            for s in servers:
                s.stop()
            servers.clear()
            if obj:
                raw = bench_bytes(pool_url, objects=256, object_bytes=obj, workers=workers, batch=16, repeat=3)
                res["pool_raw"] = {k: raw[k] for k in raw if k.endswith("gbps") or k in ("object_bytes",)}
                if "raw_get_gbps" in raw:
                    res["handoff"]["ratio_vs_raw_get"] = res["handoff"]["gbps"] / raw["raw_get_gbps"]
    finally:
        for s in servers:
            s.stop()
    res["points"] = []
    for r in rates:
        point: dict = {"rate": r, "requests": requests, "repeats": repeat}
        for setup, by_rate in runs.items():
            point[setup] = _spread([summary for summary, _ in by_rate[r]])
        if len(runs) == 2:
            point["identical_tokens"] = sum(
                a["tokens"] == b["tokens"]
                for (_, xs), (_, ys) in zip(runs["colocated"][r], runs["pd"][r])
                for a, b in zip(xs, ys)
            )
            for k in ("ttft_mean_s", "ttft_p90_s", "itl_mean_s", "itl_p90_s"):
                point[f"pd_over_colocated_{k}"] = point["pd"][k]["median"] / point["colocated"][k]["median"]
        res["points"].append(point)
    return res


def _pair(text: str) -> tuple[int, int]:
    a, _, b = text.partition(",")
    lo, hi = int(a), int(b or a)
    if not 0 < lo <= hi:
        raise argparse.ArgumentTypeError(f"expected LO,HI with 0 < LO <= HI, got {text!r}")
    return lo, hi


def _rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected rates like 2 or 2,4,8, got {text!r}") from None
    if not rates or any(r < 0 for r in rates):
        raise argparse.ArgumentTypeError(f"rates must be >= 0, got {text!r}")
    return rates


def _setups(text: str) -> tuple[str, ...]:
    names = tuple(x for x in text.split(",") if x)
    bad = [x for x in names if x not in ("colocated", "pd")]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"setups are colocated and pd, got {text!r}")
    return names


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="kvtier bench pd", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None, help="model directory (default: a fresh qwen3-moe-tiny checkpoint)")
    ap.add_argument(
        "--preset",
        default="qwen3-moe-tiny",
        help="preset written when --model is not given (with --load-format dummy: config only)",
    )
    ap.add_argument("--requests", type=int, default=24, help="requests (default 24)")
    ap.add_argument(
        "--rate",
        type=_rates,
        default=[4.0],
        help="arrivals per second, Poisson; 0 = all at once; several (2,4,8) sweep them (default 4)",
    )
    ap.add_argument(
        "--repeat", type=int, default=1, help="runs per rate, each a fresh workload; medians with their spread (default 1)"
    )
    ap.add_argument(
        "--setups",
        type=_setups,
        default=("colocated", "pd"),
        help="colocated,pd (default both; one alone e.g. to split a long sweep)",
    )
    ap.add_argument("--prompt-tokens", type=_pair, default=(64, 384), help="LO,HI prompt lengths (default 64,384)")
    ap.add_argument("--output-tokens", type=_pair, default=(8, 64), help="LO,HI output lengths (default 8,64)")
    ap.add_argument(
        "--prefill-put-workers",
        type=int,
        default=None,
        help="put threads of P (default: the server's, half of --storage-workers)",
    )
    ap.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    add_json_flag(ap, "the result")
    EngineConfig.add_flags(
        ap.add_argument_group("every server's engine options (as kvtier serve's; the pool's: P's and D's)"),
        only=ENGINE_OPTIONS,
        # a fixed host tier per server: the servers share one host, where each would size its
        # own from the same free memory
        defaults={"num_host_blocks": 1024},
        shown={
            "storage": "file:// in a temporary directory",
            "storage_workers": "one per core, 2 to 16; the raw client's baseline takes as many",
            "num_device_blocks": "sized from free memory; P and D on one GPU: give it",
        },
    )
    a = ap.parse_args(argv)
    if a.repeat < 1 or a.requests < 1:
        ap.error(f"--requests and --repeat must be >= 1, got {a.requests} and {a.repeat}")
    if a.prefill_put_workers is not None and a.prefill_put_workers < 1:
        ap.error(f"--prefill-put-workers must be >= 1, got {a.prefill_put_workers}")
    if a.prefill_put_workers is not None and "pd" not in a.setups:
        ap.error("--prefill-put-workers sets P's put threads: it needs the pd setup (--setups pd or both)")
    try:
        config = EngineConfig.from_args(a, only=ENGINE_OPTIONS)  # (checked before any server starts)
    except ValueError as e:
        ap.error(str(e))
    engine = replace(config, storage=None, storage_workers=None).to_flags()  # (the pool's: run() gives P and D)
    workers = config.storage_workers or default_storage_workers()
    # One temporary directory for the model, the default pool and the servers' logs, removed on
    # every way out: normal end, an error, Ctrl-C, and SIGTERM (turned into KeyboardInterrupt here;
    # the servers are stopped by run()'s own finally before the directory goes).
    on_term = signal.getsignal(signal.SIGTERM)
    main_thread = threading.current_thread() is threading.main_thread()
    if main_thread:
        signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        with tempfile.TemporaryDirectory(prefix="kvtier-bench-pd-") as work:
            tmp = Path(work)
            model = a.model
            if model is None:
                from kvtier.model import init_model

                model = str(init_model(a.preset, tmp / "model", seed=0, config_only=a.load_format == "dummy"))
            res = run(
                model,
                a.storage,
                engine,
                a.requests,
                a.rate,
                a.prompt_tokens,
                a.output_tokens,
                a.seed,
                workers,
                tmp,
                repeat=a.repeat,
                setups=a.setups,
                prefill_put_workers=a.prefill_put_workers,
            )
            res["early_loads"] = "on" if config.early_loads else "off"
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, on_term)
    if write_json(a.json, res):
        return 0
    print(
        f"kvtier bench pd: {a.requests} requests per run, {a.repeat} run(s) per rate, prompts "
        f"{a.prompt_tokens}, outputs {a.output_tokens}, pool {res['pool']}  (median over runs [min-max])"
    )
    ms = lambda m: f"{m['median'] * 1e3:7.1f} [{m['min'] * 1e3:.0f}-{m['max'] * 1e3:.0f}]"  # noqa: E731
    for point in res["points"]:
        for k in a.setups:
            s = point[k]
            print(
                f"  {point['rate']:5g}/s {k:10s} TTFT mean {ms(s['ttft_mean_s'])} p50 {ms(s['ttft_p50_s'])} "
                f"p90 {ms(s['ttft_p90_s'])} | ITL mean {ms(s['itl_mean_s'])} p90 {ms(s['itl_p90_s'])} | "
                f"{s['output_tokens_per_s']['median']:7.1f} tok/s"
            )
        if "identical_tokens" in point:
            print(
                f"  {point['rate']:5g}/s PD/colocated: TTFT p90 {point['pd_over_colocated_ttft_p90_s']:.2f}, "
                f"ITL p90 {point['pd_over_colocated_itl_p90_s']:.2f}; identical token streams "
                f"{point['identical_tokens']} / {a.requests * a.repeat}"
            )
    ps = res.get("prefill_server")
    if ps and ps["ttft_mean_s"] is not None:
        export = ps["export_mean_s"]
        print(
            f"  P: own TTFT mean {ps['ttft_mean_s'] * 1e3:.1f} ms, then the pool's ack of the prompt's blocks "
            + (f"{export * 1e3:.1f} ms" if export is not None else "-")
            + " (a streamed first token leaves after the first, D starts after both)"
        )
    h = res.get("handoff")
    if h:
        print(
            f"  hand-off: {h['bytes'] / 1e6:.1f} MB read by D at {h['gbps']:.3f} GB/s"
            + (
                f" = {h['ratio_vs_raw_get']:.2f} x the raw client's get ({res['pool_raw']['raw_get_gbps']:.3f} GB/s)"
                if "ratio_vs_raw_get" in h
                else ""
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
