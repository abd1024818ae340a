"""``kvtier bench flood``: what floods, slow sockets and hostile requests cost the other clients.

One ``kvtier serve`` and one ``kvtier router --workers`` in front of it (cache-aware: it tokenizes
to key prompts), both with an API key, started here. Each scenario runs an attacker process (its
sockets bound to 127.0.0.2, another client address than the measurement's 127.0.0.1) while the
measurement runs, from 127.0.0.1:

    job       --streams streaming greedy generations of --max-tokens tokens each, on the server
    prober    GET /health of the attacked process (server or router) at 20 Hz
    victim    another client's small request (an 11-character prompt, 4 tokens) every 0.25 s,
              to the attacked process

Scenarios (``--scenarios``, default all; ``flood`` kinds are judged by the job, ``attack`` kinds
by the attacked request, the prober and the victim)::

    baseline         nothing else (the reference of every ratio)
    health           flood  --flood connections loop GET /health
    401              flood  --flood connections loop POST /v1/completions with a wrong key
    slow-headers     flood  up to 2,000 connections each send a header line every 2 s
    slow-body        flood  200 connections each send a body at 1 byte every second
    hostile-bodies   attack the bodies that once cost seconds or gigabytes (soak.ATTACKS, 1.2M
                            logit_bias entries, max_tokens=1e18): each a 4xx
    tokenize-huge    attack POST /tokenize of "ab " x 5,000,000
    tokenize-batch   attack 1,024 prompts of 13,000 characters in one request
    big-answer       attack n=64, echo, logprobs=20 over 4 prompts of 370 ids: a 27 MB answer
    detokenize       attack POST /detokenize of 4,000,000 ids
    head-of-line     attack 8 prompts x n=128 x 200 tokens in one request
    router-body      attack the router: 12 MB of floats as a prompt, and NaN
    router-tokenize  attack the router: a 15 MB text prompt (it tokenizes to key it)

Per scenario: the job's tokens/s and its ratio to the baseline's; /health p50/p99/max; the
victim's median and its ratio to the baseline's on the same process; each attack's statuses and
its time to answer (median and max); the servers' memory growth (RSS of every process); and each
goal met or missed. Prints one JSON object (``--json PATH`` writes it too).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import resource
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from kvtier.engine.config import EngineConfig

KEY = "flood-bench-key"
ENGINE_OPTIONS = ("device", "load_format", "max_model_len")  # the started server's, as kvtier serve's
ATTACKER = "127.0.0.2"  # the attacker's source address (the measurement's is 127.0.0.1)
GOALS = {
    "flood_job_ratio": 1.1,  # a concurrent job takes at most this much longer under a flood
    "attack_answer_ms": 100.0,  # the attacked request's 4xx comes within this (or it is answered)
    "health_p99_ms": 50.0,
    "victim_ratio": 1.5,  # another client's small request, to its time alone
    "rss_growth_mb": 100.0,
}


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


# ---------------------------------------------------------------------- the attacks
@dataclass(frozen=True)
class Scenario:
    kind: str  # "baseline" | "flood" | "attack"
    target: str  # "server" | "router": what the prober and the victim measure
    attack: Callable[..., Any] | None = None  # async attack(urls, stop, stats), in the attacker's process


def _client(**kw: Any) -> Any:
    import httpx

    transport = httpx.AsyncHTTPTransport(local_address=ATTACKER, retries=0)
    return httpx.AsyncClient(transport=transport, timeout=60.0, **kw)


async def _loop_requests(urls: dict, stop: Any, stats: dict, make: Callable[[int], tuple], connections: int = 1) -> None:
    """``connections`` loops sending ``make(i)`` = (target, method, path, body, headers) until
    ``stop``; each answer's status and time are recorded."""
    import httpx

    async def worker(w: int) -> None:
        async with _client() as client:
            i = w
            while not stop.is_set():
                target, method, path, body, headers = make(i)
                stats["started"].set()  # (the request is on its way: a long one is measured while it runs)
                t = time.perf_counter()
                try:
                    r = await client.request(method, urls[target] + path, content=body, headers=headers)
                    await r.aread()
                    stats["status"][str(r.status_code)] += 1
                except httpx.HTTPError as e:
                    stats["status"][type(e).__name__] += 1
                stats["seconds"].append(time.perf_counter() - t)
                i += connections

    await asyncio.gather(*(worker(w) for w in range(connections)))


def _json(obj: Any) -> bytes:
    return json.dumps(obj).encode()


_AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


_HOSTILE: list[bytes] = []


def _hostile(i: int) -> tuple:
    if not _HOSTILE:
        from kvtier.bench import soak

        soak.ATTACK_ENTRIES = 3_000_000  # the lists at the size that was measured
        _HOSTILE.extend(a() for a in soak.ATTACKS)
        _HOSTILE.append(
            b'{"model": "soak", "prompt": [1], "logit_bias": {' + b",".join(b'"%d":1' % k for k in range(1_200_000)) + b"}}"
        )
        _HOSTILE.append(b'{"model": "soak", "prompt": "hi", "max_tokens": 1e18}')
    return "server", "POST", "/v1/completions", _HOSTILE[i % len(_HOSTILE)], _AUTH


def _make(target: str, path: str, body: Callable[[], bytes]) -> Callable[[int], tuple]:
    built: list[bytes] = []

    def make(_i: int) -> tuple:
        if not built:
            built.append(body())
        return target, "POST", path, built[0], _AUTH

    return make


async def _flood(phase: str, urls: dict, stop: Any, stats: dict, connections: int) -> None:
    if phase == "health":
        await _loop_requests(urls, stop, stats, lambda i: ("server", "GET", "/health", None, {}), connections)
    elif phase == "401":
        bad = {"Authorization": "Bearer wrong", "Content-Type": "application/json"}
        body = _json({"model": "soak", "prompt": [1]})
        await _loop_requests(urls, stop, stats, lambda i: ("server", "POST", "/v1/completions", body, bad), connections)
    elif phase == "slow-headers":
        await _slow_sockets(urls["server"], stop, stats, _slow_headers, 2000)
    elif phase == "slow-body":
        await _slow_sockets(urls["server"], stop, stats, _slow_body, 200)


async def _slow_sockets(url: str, stop: Any, stats: dict, behave: Callable, n: int) -> None:
    """``n`` connections at a time, each behaving slowly until the server closes it, then again."""
    host, port = url.removeprefix("http://").split(":")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    n = min(n, hard - 64)

    async def one() -> None:
        while not stop.is_set():
            try:
                reader, writer = await asyncio.open_connection(host, int(port), local_addr=(ATTACKER, 0))
            except OSError as e:
                stats["status"][type(e).__name__] += 1
                await asyncio.sleep(1.0)
                continue
            stats["started"].set()
            t = time.perf_counter()
            answer = await behave(reader, writer, stop)
            stats["status"][answer] += 1
            stats["seconds"].append(time.perf_counter() - t)
            writer.close()

    await asyncio.gather(*(one() for _ in range(n)))


async def _until_answer(reader: Any, stop: Any, send: Callable[[], Any], every: float) -> str:
    """``send()`` every ``every`` s until the server answers (its status) or closes."""
    while not stop.is_set():
        try:
            await send()
            line = await asyncio.wait_for(reader.readline(), every)
        except asyncio.TimeoutError:
            continue
        except OSError:
            return "closed"
        return line.split(b" ")[1].decode() if line.startswith(b"HTTP/") else "closed"
    return "held to the end"


async def _slow_headers(reader: Any, writer: Any, stop: Any) -> str:
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    n = [0]

    async def send() -> None:
        n[0] += 1
        writer.write(b"X-Slow-%d: y\r\n" % n[0])
        await writer.drain()

    return await _until_answer(reader, stop, send, 2.0)


async def _slow_body(reader: Any, writer: Any, stop: Any) -> str:
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
        + KEY.encode()
        + b"\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n{"
    )

    async def send() -> None:
        writer.write(b" ")
        await writer.drain()

    return await _until_answer(reader, stop, send, 1.0)


ATTACKS: dict[str, Callable[[int], tuple]] = {
    "hostile-bodies": _hostile,
    "tokenize-huge": _make("server", "/tokenize", lambda: _json({"prompt": "ab " * 5_000_000})),
    "tokenize-batch": _make(
        "server",
        "/v1/completions",
        lambda: _json({"model": "soak", "prompt": [("lorem ipsum dolor " * 723)[:13_000]] * 1024, "max_tokens": 1}),
    ),
    "big-answer": _make(
        "server",
        "/v1/completions",
        lambda: _json(
            {
                "model": "soak",
                "prompt": [[3 + i % 300 for i in range(370)]] * 4,
                "n": 64,
                "echo": True,
                "logprobs": 20,
                "max_tokens": 1,
            }
        ),
    ),
    "detokenize": _make("server", "/detokenize", lambda: b'{"tokens": [' + b",".join([b"1"] * 4_000_000) + b"]}"),
    "head-of-line": _make(
        "server",
        "/v1/completions",
        lambda: _json({"model": "soak", "prompt": [[1, 2, 3]] * 8, "n": 128, "max_tokens": 200, "ignore_eos": True}),
    ),
    "router-body": _make(
        "router",
        "/v1/completions",
        lambda: b'{"model": "soak", "prompt": [' + b",".join([b"1.5"] * 3_000_000) + b'], "temperature": NaN}',
    ),
    "router-tokenize": _make("router", "/v1/completions", lambda: _json({"model": "soak", "prompt": "ab " * 5_000_000})),
}
SCENARIOS: dict[str, Scenario] = {
    "baseline": Scenario("baseline", "server"),
    "router-baseline": Scenario("baseline", "router"),
    **{name: Scenario("flood", "server") for name in ("health", "401", "slow-headers", "slow-body")},
    **{name: Scenario("attack", ATTACKS[name](0)[0]) for name in ATTACKS},
}


async def _attack(phase: str, urls: dict, stop: Any, started: Any, connections: int) -> dict:
    """The attack of ``phase`` until ``stop``; ``started`` is set once it is under way (its first
    request sent, or its first slow connection open)."""
    stats: dict = {"status": Counter(), "seconds": [], "started": started}
    if SCENARIOS[phase].kind == "flood":
        await _flood(phase, urls, stop, stats, connections)
    else:
        await _loop_requests(urls, stop, stats, ATTACKS[phase])
    secs = sorted(stats["seconds"])
    return {
        "status": dict(stats["status"]),
        "count": len(secs),
        "answer_ms_p50": round(_pct(secs, 0.5) * 1e3, 1) if secs else None,
        "answer_ms_max": round(secs[-1] * 1e3, 1) if secs else None,
    }


def _attacker_process(conn: Any, phase: str, urls: dict, stop: Any, started: Any, connections: int) -> None:
    conn.send(asyncio.run(_attack(phase, urls, stop, started, connections)))


# ---------------------------------------------------------------------- the measurement
async def _measure(urls: dict, target: str, streams: int, max_tokens: int, vocab: int) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {KEY}"}
    health: list[float] = []
    victim: list[float] = []
    done = asyncio.Event()

    async def probe() -> None:
        async with httpx.AsyncClient(timeout=60.0) as client:
            while not done.is_set():
                t = time.perf_counter()
                await client.get(urls[target] + "/health")
                health.append(time.perf_counter() - t)
                await asyncio.sleep(0.05)

    async def small() -> None:
        body = {"model": "soak", "prompt": "hello there", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        async with httpx.AsyncClient(timeout=600.0) as client:
            while not done.is_set():
                t = time.perf_counter()
                r = await client.post(urls[target] + "/v1/completions", json=body, headers=headers)
                r.raise_for_status()
                victim.append(time.perf_counter() - t)
                await asyncio.sleep(0.25)

    async def one(i: int, client: Any) -> int:
        body = {
            "model": "soak",
            "prompt": [(i * 7 + j) % vocab for j in range(32)],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
        }
        n = 0
        async with client.stream("POST", urls["server"] + "/v1/completions", json=body, headers=headers) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    for c in json.loads(line[6:]).get("choices", ()):
                        n += len(c.get("token_ids") or ())
        return n

    side = [asyncio.create_task(probe()), asyncio.create_task(small())]
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=600.0, limits=httpx.Limits(max_connections=streams + 4)) as client:
        counts = await asyncio.gather(*(one(i, client) for i in range(streams)))
    elapsed = time.perf_counter() - t0
    done.set()
    await asyncio.gather(*side)
    return {"tokens": sum(counts), "seconds": elapsed, "health": health, "victim": victim}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def goals(kind: str, r: dict) -> dict:
    """Each goal of the scenario's kind: its figure, its bound and whether it is met."""
    out: dict[str, dict] = {}

    def goal(name: str, figure: Any, bound: float) -> None:
        out[name] = {"figure": figure, "bound": bound, "met": figure is not None and figure <= bound}

    if kind == "flood":
        goal("job_time_ratio", r["job_time_ratio"], GOALS["flood_job_ratio"])
    elif kind == "attack":
        a = r["attack"]
        refused = all(k.startswith("4") for k in a["status"])
        if refused:  # every attack got its 4xx: within the bound; an answered one counts as met
            goal("attack_4xx_ms_max", a["answer_ms_max"], GOALS["attack_answer_ms"])
        goal("health_p99_ms", r["health_p99_ms"], GOALS["health_p99_ms"])
        goal("victim_ratio", r["victim_ratio"], GOALS["victim_ratio"])
        goal("rss_growth_mb", r["rss_growth_mb"], GOALS["rss_growth_mb"])
    return out


def run(args: argparse.Namespace) -> dict:
    from kvtier.bench.serving import resolve_model
    from kvtier.serve.launch import ServerProcess

    unknown = [s for s in args.scenarios if s not in SCENARIOS]
    if unknown:
        raise SystemExit(f"--scenarios: unknown {', '.join(unknown)}; choose from {', '.join(SCENARIOS)}")
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-flood-") as tmp_name:
        tmp = Path(tmp_name)
        args.url, args.vocab = None, None
        model, vocab = resolve_model(args, tmp)
        args.load_format = args.load_format or "auto"  # (a preset: resolve_model said dummy)
        engine = EngineConfig.from_args(args, only=ENGINE_OPTIONS).to_flags()
        flags = ["serve", model, *engine, "--api-key", KEY, "--served-model-name", "soak"]
        server = ServerProcess(flags, tmp / "server.log").wait_ready()
        router = None
        try:
            router = ServerProcess(
                ["router", "--workers", server.url, "--api-key", KEY, "--backend-api-key", KEY], tmp / "router.log"
            ).wait_ready()
            urls = {"server": server.url, "router": router.url}
            procs = {"server": server, "router": router}
            for target in ("server", "router"):  # warm-up (the router loads its tokenizer at its first text prompt)
                asyncio.run(_measure(urls, target, args.streams, 16, vocab))
            order = ["baseline", "router-baseline"] + [s for s in args.scenarios if s not in ("baseline", "router-baseline")]
            for phase in order:
                scenario = SCENARIOS[phase]
                rss0 = {k: _rss_mb(p.popen.pid) for k, p in procs.items()}
                proc = parent = None
                ctx = mp.get_context("spawn")
                stop, started = ctx.Event(), ctx.Event()
                if scenario.kind != "baseline":
                    parent, child = ctx.Pipe()
                    proc = ctx.Process(
                        target=_attacker_process, args=(child, phase, urls, stop, started, args.flood), daemon=True
                    )
                    proc.start()
                    started.wait(120)  # the attack is under way before the measurement starts
                    time.sleep(1.0)
                m = asyncio.run(_measure(urls, scenario.target, args.streams, args.max_tokens, vocab))
                rss1 = {k: _rss_mb(p.popen.pid) for k, p in procs.items()}
                attack: dict = {}
                if proc is not None and parent is not None:
                    stop.set()
                    attack = parent.recv() if parent.poll(120) else {"error": "the attacker did not report", "status": {}}
                    proc.join(10)
                    if proc.is_alive():
                        proc.kill()
                results[phase] = {
                    "kind": scenario.kind,
                    "target": scenario.target,
                    "tokens_per_s": round(m["tokens"] / m["seconds"], 1),
                    "job_seconds": round(m["seconds"], 2),
                    "health_p50_ms": round(_pct(m["health"], 0.5) * 1e3, 2),
                    "health_p99_ms": round(_pct(m["health"], 0.99) * 1e3, 2),
                    "health_max_ms": round(max(m["health"]) * 1e3, 2) if m["health"] else None,
                    "victim_ms_p50": round(_pct(m["victim"], 0.5) * 1e3, 1),
                    "rss_growth_mb": round(max(rss1[k] - rss0[k] for k in procs), 1),
                    "attack": attack,
                }
                _judge(results)
                r = results[phase]
                print(
                    f"{phase}: job {r['job_time_ratio']}x, /health p99 {r['health_p99_ms']} ms, victim {r['victim_ratio']}x, "
                    f"attack {r['attack'].get('status')} max {r['attack'].get('answer_ms_max')} ms",
                    file=sys.stderr,
                    flush=True,
                )
                if args.json:  # after every scenario: a run cut short keeps what it measured
                    Path(args.json).write_text(json.dumps(_output(args, results), indent=1, default=str))
                for name, p in procs.items():
                    if p.popen.poll() is not None:
                        raise SystemExit(f"the {name} died in scenario {phase}:\n{p.tail()}")
        finally:
            if router is not None:
                router.stop()
            server.stop()
    return _output(args, results)


def _judge(results: dict) -> None:
    """Each scenario's ratios to its baseline (the server's or the router's) and its goals."""
    for r in results.values():
        base = results.get("baseline" if r["target"] == "server" else "router-baseline")
        if base is None:
            continue
        r["job_time_ratio"] = round(r["job_seconds"] / results["baseline"]["job_seconds"], 3)
        r["victim_ratio"] = round(r["victim_ms_p50"] / base["victim_ms_p50"], 2) if base["victim_ms_p50"] else None
        r["goals"] = goals(r["kind"], r)


def _output(args: argparse.Namespace, results: dict) -> dict:
    return {"bench": "flood", "args": {k: v for k, v in vars(args).items()}, "goals": GOALS, "results": results}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvtier bench flood", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-tiny", help="a checkpoint directory or a preset name (default qwen3-tiny)")
    EngineConfig.add_flags(
        p.add_argument_group("the server's engine options (as kvtier serve's)"),
        only=ENGINE_OPTIONS,
        # the context the figures of docs/BENCHMARKS.md were measured at; a preset has no weights to load
        defaults={"max_model_len": 8192, "load_format": None},
        shown={"load_format": "auto; presets: dummy"},
    )
    p.add_argument("--streams", type=int, default=16, help="concurrent generations of the job (default 16)")
    p.add_argument("--max-tokens", type=int, default=200, help="tokens each of the job's generations makes (default 200)")
    p.add_argument("--flood", type=int, default=32, help="connections of the health and 401 floods (default 32)")
    p.add_argument(
        "--scenarios",
        default=",".join(s for s in SCENARIOS if s not in ("baseline", "router-baseline")),
        type=lambda s: [x.strip() for x in s.split(",") if x.strip()],
        help=f"comma-separated, in order (the baselines always run first; default all: {', '.join(SCENARIOS)})",
    )
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
