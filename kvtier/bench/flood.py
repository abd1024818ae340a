"""``kvtier bench flood``: what floods and hostile bodies cost the clients that generate.

One ``kvtier serve`` (started here, with an API key), the same generation in each phase:
``--streams`` streaming greedy requests of ``--max-tokens`` tokens each (``ignore_eos``), while

    baseline   nothing else
    health     --flood connections loop GET /health
    401        --flood connections loop POST /v1/completions with a wrong key
    attack     --flood connections loop the soak's hostile bodies (kvtier/bench/soak.py ATTACKS),
               each of which must be a 4xx

Per phase: generated tokens/s and its ratio to the baseline, ``/health`` latency (p50, p99, max)
from a prober at 20 Hz, the flood's requests and their statuses, and the growth of the server's
memory (its processes' RSS: the HTTP process and the engine process). The flood runs in a
process of its own, so its load never shares an interpreter with the measurement.
Prints one JSON object (``--json PATH`` writes it too).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

KEY = "flood-bench-key"
PHASES = ("baseline", "health", "401", "attack")


def _rss_mb(pid: int) -> float:
    """RSS of ``pid`` and its descendants, in MB (Linux /proc)."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) / 1024
            children = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        todo += [int(c) for c in children]
    return total


async def _flood(url: str, phase: str, connections: int, stop: Any) -> dict:
    import httpx

    from kvtier.bench import soak

    soak.ATTACK_ENTRIES = 300_000  # the attack's lists at a tenth of their size (3,000,000 entries)
    ATTACKS = soak.ATTACKS

    statuses: Counter = Counter()
    good = {"Authorization": f"Bearer {KEY}"}

    async def worker(i: int) -> None:
        async with httpx.AsyncClient(timeout=30.0) as client:
            n = 0
            while not stop.is_set():
                try:
                    if phase == "health":
                        r = await client.get(url + "/health")
                    elif phase == "401":
                        r = await client.post(url + "/v1/completions", json={"model": "soak", "prompt": [1]}, headers={})
                    else:
                        body = ATTACKS[(i + n) % len(ATTACKS)]()
                        r = await client.post(
                            url + "/v1/completions", content=body, headers=good | {"content-type": "application/json"}
                        )
                    statuses[r.status_code] += 1
                except httpx.HTTPError as e:
                    statuses[type(e).__name__] += 1
                n += 1

    await asyncio.gather(*(worker(i) for i in range(connections)))
    return {str(k): v for k, v in statuses.items()}


def _flood_process(conn: Any, *args: Any) -> None:
    conn.send(asyncio.run(_flood(*args)))


async def _generate(url: str, model: str, streams: int, max_tokens: int, vocab: int) -> tuple[int, float, list[float]]:
    import httpx

    headers = {"Authorization": f"Bearer {KEY}"}
    health: list[float] = []
    done = asyncio.Event()

    async def probe() -> None:
        async with httpx.AsyncClient(timeout=30.0) as client:
            while not done.is_set():
                t = time.perf_counter()
                await client.get(url + "/health")
                health.append(time.perf_counter() - t)
                await asyncio.sleep(0.05)

    async def one(i: int, client: Any) -> int:
        body = {
            "model": model,
            "prompt": [(i * 7 + j) % vocab for j in range(32)],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
        }
        n = 0
        async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    for c in json.loads(line[6:]).get("choices", ()):
                        n += len(c.get("token_ids") or ())
        return n

    prober = asyncio.create_task(probe())
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=600.0, limits=httpx.Limits(max_connections=streams + 4)) as client:
        counts = await asyncio.gather(*(one(i, client) for i in range(streams)))
    elapsed = time.perf_counter() - t0
    done.set()
    await prober
    return sum(counts), elapsed, health


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def run(args: argparse.Namespace) -> dict:
    from kvtier.bench.serving import resolve_model
    from kvtier.serve.launch import ServerProcess

    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-flood-") as tmp_name:
        tmp = Path(tmp_name)
        args.url, args.vocab = None, None
        model, vocab = resolve_model(args, tmp)
        flags: list[Any] = ["serve", model, "--device", args.device, "--api-key", KEY, "--served-model-name", "soak"]
        if args.load_format:
            flags += ["--load-format", args.load_format]
        if args.max_model_len:
            flags += ["--max-model-len", args.max_model_len]
        server = ServerProcess(flags, tmp / "server.log").wait_ready()
        try:
            asyncio.run(_generate(server.url, "soak", args.streams, 16, vocab))  # warm-up
            for phase in PHASES:
                rss0 = _rss_mb(server.popen.pid)
                proc = parent = None
                ctx = mp.get_context("spawn")
                stop = ctx.Event()
                if phase != "baseline":
                    parent, child = ctx.Pipe()
                    proc = ctx.Process(target=_flood_process, args=(child, server.url, phase, args.flood, stop), daemon=True)
                    proc.start()
                    time.sleep(1.0)  # the flood is on before the generation starts
                tokens, elapsed, health = asyncio.run(_generate(server.url, "soak", args.streams, args.max_tokens, vocab))
                rss1 = _rss_mb(server.popen.pid)
                flood: dict = {}
                if proc is not None and parent is not None:
                    stop.set()
                    flood = parent.recv() if parent.poll(60) else {"error": "the flood process did not report"}
                    proc.join(10)
                    bad = {k: v for k, v in flood.items() if phase == "attack" and not k.startswith("4")}
                    if bad:
                        raise SystemExit(f"hostile bodies answered other than 4xx: {bad}")
                results[phase] = {
                    "tokens": tokens,
                    "tokens_per_s": round(tokens / elapsed, 1),
                    "health_p50_ms": round(_pct(health, 0.5) * 1e3, 2),
                    "health_p99_ms": round(_pct(health, 0.99) * 1e3, 2),
                    "health_max_ms": round(max(health) * 1e3, 2) if health else None,
                    "rss_growth_mb": round(rss1 - rss0, 1),
                    "flood": flood,
                }
                if server.popen.poll() is not None:
                    raise SystemExit(f"the server died in phase {phase}:\n{server.tail()}")
        finally:
            server.stop()
    base = results["baseline"]["tokens_per_s"]
    for r in results.values():
        r["throughput_ratio"] = round(r["tokens_per_s"] / base, 3) if base else None
    return {"bench": "flood", "args": {k: v for k, v in vars(args).items()}, "results": results}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvtier bench flood", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-tiny", help="a checkpoint directory or a preset name (default qwen3-tiny)")
    p.add_argument("--device", default="cpu", help="the server's device (default cpu)")
    p.add_argument("--load-format", default=None, choices=("auto", "dummy"), help="auto or dummy (default auto; presets: dummy)")
    p.add_argument("--max-model-len", type=int, default=None, help="the server's context (default the model's)")
    p.add_argument("--streams", type=int, default=16, help="concurrent generations (default 16)")
    p.add_argument("--max-tokens", type=int, default=800, help="tokens each generates (default 800)")
    p.add_argument("--flood", type=int, default=32, help="flooding connections (default 32)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results here")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    for name in ("streams", "max_tokens", "flood"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    out = run(args)
    text = json.dumps(out, indent=1, default=str)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
