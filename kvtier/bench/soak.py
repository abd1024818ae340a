"""``kvtier bench soak``: thousands of mixed HTTP requests against one server with device, host and
storage tiers, then the checks a hostile day must leave true.

::

    engine process                                 client process (its own interpreter: the load it
    ───────────────────────────────────────        makes never steals the server's GIL)
    EngineCore (small device tier, host tier,      N workers ─ POST /v1/... ─►  normal, streaming,
      file:// pool), as `kvtier serve` runs it       chat, odd (1e-300, nulls), bad (4xx), huge (413),
    this process: EngineClient ─ Server ◄──────
      (uvicorn on 127.0.0.1, real sockets)           hung up, aborted mid-stream / mid-prefetch,
                                                     fresh cache_salt on a known prompt
                                                   one poller ─ GET /health every 50 ms
    after the load: engine idle -> drain copies -> cache invariants (DESIGN §5: no block owned
    twice, none leaked, no pin left) -> every greedy answer compared with the offline API
    (``kvtier.LLM.generate``, prefix caching off, same weights)

The default model is dense. A MoE model's greedy answer depends on its batch more than a dense
model's: a near-tie between two experts at the router's top-k flips with the rounding of another
batch shape and moves the hidden state by a whole expert — a difference of batching, not of the
cache. During development one answer (a 125-token prompt) came out differently batched by the
server and batched offline. Comparing thousands of answers, the soak would then fail for a
reason other than the one under test; MoE is a flag away (``--preset qwen3-moe-tiny``: the
10,000-request run in docs/BENCHMARKS.md used it, 0 mismatches), and the cache's exactness on
MoE models, routed experts included, is tested where batches are controlled (tests/engine,
tests/storage, tests/serve/test_pd.py).

Goals: 0 5xx, 0 engine stops, 0 leaked blocks or pins, 0 mismatched answers, 0
cross-salt hits, every status expected: exit status 1 if one is missed. The latency goal,
``/health`` p99 < 100 ms, is a figure of the machine and its load: a miss is reported (stderr,
and ``latency_goals`` in the JSON), and is an exit status 1 with ``--strict``. Prints one JSON
object (``--json PATH`` writes it too).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from kvtier.engine.config import EngineConfig

MODEL_NAME = "soak"
ENGINE_OPTIONS = ("device", "num_device_blocks", "num_host_blocks", "overlap_schedule")  # the server's, as kvtier serve's
# kind -> weight in the mix; every kind's expected outcome is checked in _check_status
MIX = {
    "ids": 30,
    "stream": 16,
    "chat": 8,
    "text": 6,
    "odd": 8,
    "bad": 10,
    "salt": 4,
    "hangup": 6,
    "stream_abort": 5,
    "prefetch_abort": 5,
    "huge": 0.3,
    "stop": 2,
    "attack": 3,
}
BAD_BODIES = [
    b'{"model": "soak", "prompt": [1, 2,',  # invalid JSON
    b'{"model": "soak", "prompt": [1, 2], "max_tokens": -3}',
    b'{"model": "soak", "prompt": [1, 2], "frobnicate": 1}',  # unknown field
    b'{"model": "soak", "prompt": [1, 99999999]}',  # token id past the vocab
    b'{"model": "soak", "prompt": [1, 2], "max_tokens": 100000}',  # over the context
    b'{"model": "soak", "prompt": "a\\ud800b"}',  # lone surrogate
    b'{"model": "soak", "prompt": []}',
    b'{"model": "soak", "prompt": [1, 2], "temperature": "hot"}',
    b'{"model": "soak", "prompt": [1, 2], "top_p": 0}',
    b'{"model": "not-this-one", "prompt": [1, 2]}',  # 404
    b"[1, 2, 3]",
    b'{"model": "soak", "messages": []}',
    b'{"model": "soak", "prompt": [1, 2], "n": 0}',
    b'{"model": "soak", "prompt": [1, 2], "stream": "yes"}',
]

# small bodies that once cost the server seconds or gigabytes: each must be a 4xx at once. The
# two long lists have ATTACK_ENTRIES entries (the attack had 3,000,000; any count past the
# context takes the same path: refused by counting, never parsed)
ATTACK_ENTRIES = 30_000
ATTACKS = [
    lambda: b'{"model": "soak", "prompt": [' + b",".join([b"1.5"] * ATTACK_ENTRIES) + b"]}",  # floats as token ids
    lambda: b'{"model": "soak", "prompt": [' + b",".join([b"{}"] * ATTACK_ENTRIES) + b"]}",  # objects as token ids
    lambda: json.dumps({"model": "soak", "prompt": [[1, 2]] * 1024, "n": 128, "max_tokens": 1}).encode(),  # 131,072 samples
    lambda: json.dumps(  # echo x logprobs x n: a response of millions of entries
        {"model": "soak", "prompt": [[1, 2, 3]] * 32, "n": 32, "echo": True, "logprobs": 20, "max_tokens": None}
    ).encode(),
    lambda: json.dumps({"model": "soak", "prompt": [1, 2], "stop_token_ids": list(range(5000))}).encode(),
    lambda: b'{"model": "soak", "prompt": [1, 2], "temperature": NaN}',
    lambda: b'{"model": "soak", "prompt": [1, 2], "stop": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",  # nested 100k deep
    lambda: b'{"model": "soak", "prompt": [true, false]}',  # booleans as token ids
    lambda: b'{"model": "soak", "messages": [{"role": "user", "content": "hi"}], "logprobs": true, "top_logprobs": true}',
    lambda: b'{"model": "soak", "prompt": [1, 2], "max_tokens": 1e26}',
]


# ---------------------------------------------------------------------- workload (client side)
class Workload:
    """Prompts that share prefixes the way a multi-turn service does: a few long documents, many
    conversations over them, each turn resending its whole history (so hits come from every tier
    once the small device tier has evicted older turns to host and the pool)."""

    def __init__(self, seed: int, context: int, vocab: int = 256) -> None:
        self.rng = random.Random(seed)
        self.context = context
        self.max_prompt = context - 48
        self.vocab = vocab
        self.docs = [self._toks(self.rng.randrange(64, 224)) for _ in range(6)]
        self.convs = [list(self.rng.choice(self.docs)) for _ in range(24)]
        self.seen: list[list[int]] = []

    def _toks(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(n)]

    def prompt(self) -> list[int]:
        i = self.rng.randrange(len(self.convs))
        conv = self.convs[i]
        conv += self._toks(self.rng.randrange(4, 40))
        if len(conv) > self.max_prompt:
            conv[:] = list(self.rng.choice(self.docs)) + self._toks(8)
        self.seen.append(list(conv))
        return list(conv)

    def old_prompt(self) -> list[int]:
        """A prompt sent a while ago: its prefix has likely left the device tier (a storage hit)."""
        if len(self.seen) < 8:
            return self.prompt()
        return list(self.seen[self.rng.randrange(len(self.seen) // 2)])


def _body(kind: str, wl: Workload, rng: random.Random, salt_id: int) -> dict:
    greedy = {"model": MODEL_NAME, "temperature": 0, "return_token_ids": True}
    if kind in ("ids", "stream"):
        return dict(
            greedy, prompt=wl.prompt(), max_tokens=rng.randrange(1, 17), stream=kind == "stream", ignore_eos=rng.random() < 0.5
        )
    if kind == "stop":
        return dict(
            greedy, prompt=wl.prompt(), max_tokens=24, stop=[chr(rng.randrange(97, 123))], stop_token_ids=[rng.randrange(256)]
        )
    if kind == "chat":
        text = "".join(chr(rng.randrange(97, 123)) for _ in range(rng.randrange(8, 200)))
        return dict(
            greedy,
            messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": text}],
            max_tokens=rng.randrange(1, 9),
            stream=rng.random() < 0.5,
        )
    if kind == "text":
        return dict(
            greedy,
            prompt="".join(chr(rng.randrange(32, 127)) for _ in range(rng.randrange(4, 300))),
            max_tokens=rng.randrange(1, 9),
        )
    if kind == "odd":  # extremes a valid request may carry: nulls, 1e-300, top_k 1, huge seeds
        return rng.choice(
            [
                {"model": MODEL_NAME, "prompt": wl.prompt(), "max_tokens": 4, "temperature": 1e-300},
                {"model": MODEL_NAME, "prompt": wl.prompt(), "max_tokens": 4, "temperature": 1, "top_p": 1e-300},
                {"model": MODEL_NAME, "prompt": wl.prompt(), "max_tokens": 4, "temperature": 100, "top_k": 1},
                {"model": MODEL_NAME, "prompt": wl.prompt(), "max_tokens": 4, "temperature": 1.5, "seed": 2**63 - 1},
                {
                    "model": MODEL_NAME,
                    "prompt": wl.prompt()[:40],
                    "max_tokens": None,
                    "temperature": None,
                    "top_p": None,
                    "stream": None,
                    "stop": None,
                    "n": None,
                    "seed": None,
                    "user": None,
                },
            ]
        )
    if kind == "salt":  # a fresh salt on a prompt others sent: must not hit anything
        return dict(greedy, prompt=wl.old_prompt(), max_tokens=1, cache_salt=f"tenant-{salt_id}")
    if kind in ("hangup", "stream_abort"):  # long answers: the client leaves before the end
        prompt = wl.prompt()
        return dict(
            greedy, prompt=prompt, max_tokens=min(200, wl.context - len(prompt)), ignore_eos=True, stream=kind == "stream_abort"
        )
    if kind == "prefetch_abort":
        return dict(greedy, prompt=wl.old_prompt(), max_tokens=8)
    raise ValueError(kind)


def _expected(kind: str, status: int) -> bool:
    if kind in ("bad", "attack"):
        return 400 <= status < 500
    if kind == "huge":
        return status == 413
    if kind in ("hangup", "stream_abort", "prefetch_abort"):
        return status in (0, 200)  # 0: we hung up before an answer
    return status == 200


async def _one(client: Any, url: str, kind: str, body: Any, rng: random.Random) -> dict:
    import httpx

    path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
    rec: dict[str, Any] = {"kind": kind, "status": 0}
    rec["body"] = body if isinstance(body, dict) else body[:200].decode(errors="replace")
    try:
        if kind in ("bad", "huge", "attack"):
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = await client.post(url + path, content=content, headers={"content-type": "application/json"})
            rec["status"] = r.status_code
            return rec
        if kind == "hangup" or kind == "prefetch_abort":
            try:
                r = await asyncio.wait_for(
                    client.post(url + path, json=body), timeout=rng.uniform(0.002, 0.05 if kind == "prefetch_abort" else 0.3)
                )
                rec["status"] = r.status_code
            except asyncio.TimeoutError:
                pass  # cancelled: httpx drops the connection mid-request
            return rec
        if body.get("stream"):
            toks: list[int] = []
            async with client.stream("POST", url + path, json=body) as r:
                rec["status"] = r.status_code
                if r.status_code != 200:
                    await r.aread()
                    return rec
                n_chunks = 0
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        rec["stream_error"] = chunk["error"]
                        break
                    for c in chunk.get("choices", ()):
                        toks += c.get("token_ids") or []
                    n_chunks += 1
                    if kind == "stream_abort" and n_chunks >= rng.randrange(1, 4):
                        return rec  # leave mid-stream
            rec["token_ids"] = toks
            return rec
        r = await client.post(url + path, json=body)
        rec["status"] = r.status_code
        if r.status_code == 200:
            res = r.json()
            ch = res["choices"][0]
            rec["token_ids"] = ch.get("token_ids")
            rec["cached_tokens"] = res["usage"]["prompt_tokens_details"]["cached_tokens"]
    except httpx.HTTPError as e:
        rec["status"] = -1
        rec["error"] = repr(e)
    return rec


async def _health_poller(client: Any, url: str, stop: asyncio.Event, out: list) -> None:
    import httpx

    while not stop.is_set():
        t0 = time.perf_counter()
        try:
            r = await client.get(url + "/health", timeout=10.0)
            out.append((time.perf_counter() - t0, r.status_code))
        except httpx.HTTPError:
            out.append((time.perf_counter() - t0, -1))
        await asyncio.sleep(0.05)


async def _client(url: str, requests: int, concurrency: int, seed: int, context: int, huge_bytes: int, progress: bool) -> dict:
    import httpx
    from tqdm import tqdm

    rng = random.Random(seed)
    wl = Workload(seed, context)
    kinds, weights = zip(*MIX.items())
    # every kind at least once (a short CI soak too), then the mix, shuffled
    plan = list(kinds)[:requests] + rng.choices(kinds, weights, k=max(0, requests - len(kinds)))
    rng.shuffle(plan)
    records: list[dict] = []
    health: list[tuple[float, int]] = []
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    queue: asyncio.Queue = asyncio.Queue()
    for i, kind in enumerate(plan):
        queue.put_nowait((i, kind))
    bar = tqdm(total=requests, desc="soak", unit="req", disable=not progress, file=sys.stderr)

    async with (
        httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits) as client,
        httpx.AsyncClient(timeout=10.0) as health_client,
    ):
        stop = asyncio.Event()
        poller = asyncio.create_task(_health_poller(health_client, url, stop, health))

        async def worker(w: int) -> None:
            wrng = random.Random(seed * 1000 + w)
            while True:
                try:
                    i, kind = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                if kind == "bad":
                    body: Any = wrng.choice(BAD_BODIES)
                elif kind == "attack":
                    body = wrng.choice(ATTACKS)()
                elif kind == "huge":
                    body = b'{"model": "soak", "prompt": "' + b"a" * huge_bytes + b'"}'
                else:
                    body = _body(kind, wl, wrng, i)
                records.append(await _one(client, url, kind, body, wrng))
                bar.update(1)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
        elapsed = time.perf_counter() - t0
        stop.set()
        await poller
    bar.close()
    return {"records": records, "health": health, "elapsed_s": elapsed}


def _client_process(conn: Any, *args: Any) -> None:
    try:
        conn.send(asyncio.run(_client(*args)))
    except BaseException as e:  # reported to the parent, which fails the soak
        conn.send({"error": repr(e)})
    finally:
        conn.close()


# ---------------------------------------------------------------------- server side
def _serve(model: Path, pool: str, args: argparse.Namespace) -> tuple[Any, Any, threading.Thread, str]:
    """The server as `kvtier serve` runs it (the engine in a process of its own, engine/client.py),
    its HTTP side on a thread of this process."""
    from dataclasses import replace

    import uvicorn

    from kvtier.engine.client import EngineClient
    from kvtier.serve.api import Server
    from kvtier.serve.launch import free_port

    config = replace(
        EngineConfig.from_args(args, only=ENGINE_OPTIONS),
        storage=pool,
        write_policy="write_through",
        max_num_seqs=32,
        max_num_batched_tokens=1024,
        storage_fetch="always",
    )
    engine = EngineClient(str(model), config, max_queue=4096, log_level="warning")
    server = Server(engine, MODEL_NAME)
    port = free_port()
    userver = uvicorn.Server(
        uvicorn.Config(server.app, host="127.0.0.1", port=port, log_level="critical", timeout_graceful_shutdown=2)
    )
    thread = threading.Thread(target=userver.run, name="soak-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not userver.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the soak server did not start")
        time.sleep(0.05)
    return engine, userver, thread, f"http://127.0.0.1:{port}"


def _quiesce_and_check(engine: Any, timeout: float = 60.0) -> dict:
    """Wait until no request is in the engine, land every copy, then DESIGN §5 on the whole cache
    (engine/loop.py's ``leak_check``, run by the engine process)."""
    deadline = time.monotonic() + timeout
    while True:
        busy = _call(engine, "requests")
        if (busy == 0 and engine.num_streams == 0) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return _call(engine, "leak_check") | {"sinks_left": engine.num_streams}


def _call(engine: Any, fn: Any) -> Any:
    async def run() -> Any:
        return await engine.call(fn)

    return asyncio.run(run())


def _scrape(url: str) -> dict[str, float]:
    import httpx

    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("kvtier_requests_total") or line.startswith("kvtier_generation_tokens_total"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _references(model: Path, records: list[dict], device: str) -> tuple[int, int, list[dict]]:
    """Greedy answers that came back, compared with the offline API on the same weights."""
    import kvtier

    todo: dict[tuple, list[dict]] = {}
    for r in records:
        b = r.get("body") or {}
        if (
            r["status"] != 200
            or r.get("token_ids") is None
            or "stream_error" in r
            or r["kind"] not in ("ids", "stream", "salt", "stop")
        ):
            continue
        if r["kind"] == "stream" and len(r["token_ids"]) == 0:
            continue
        key = (tuple(b["prompt"]), b["max_tokens"], bool(b.get("ignore_eos")), tuple(b.get("stop_token_ids", ())))
        todo.setdefault(key, []).append(r)
    mismatches: list[dict] = []
    keys = list(todo)
    with kvtier.LLM(model, device=device, enable_prefix_caching=False) as llm:
        for i in range(0, len(keys), 64):
            batch = keys[i : i + 64]
            outs = llm.generate(
                [list(k[0]) for k in batch],
                [kvtier.SamplingParams(max_tokens=k[1], ignore_eos=k[2], stop_token_ids=k[3]) for k in batch],
            )
            for k, o in zip(batch, outs):
                for r in todo[k]:
                    got = r["token_ids"]
                    want = o.token_ids
                    if r["kind"] == "stop":  # a stop string may end the answer early
                        ok = want[: len(got)] == got
                    else:
                        ok = got == want
                    if not ok:
                        mismatches.append({"kind": r["kind"], "prompt_len": len(k[0]), "got": got, "want": want})
    return sum(len(v) for v in todo.values()), len(keys), mismatches


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run(args: argparse.Namespace) -> dict:
    from kvtier.model import init_model

    with tempfile.TemporaryDirectory(prefix="kvtier-soak-") as tmp:
        model = Path(args.model) if args.model else init_model(args.preset, Path(tmp) / "model", seed=0)
        pool = f"file://{tmp}/pool?capacity=64MiB"
        engine, userver, thread, url = _serve(model, pool, args)
        try:
            ctx = mp.get_context("spawn")
            parent, child = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_client_process,
                args=(
                    child,
                    url,
                    args.requests,
                    args.concurrency,
                    args.seed,
                    engine.limits.max_model_len,
                    args.huge_bytes,
                    not args.no_progress,
                ),
            )
            proc.start()
            child.close()
            res = parent.recv()
            proc.join(30)
            if "error" in res:
                raise RuntimeError(f"the soak client failed: {res['error']}")
            engine_error = repr(engine.error) if engine.error is not None else None
            if engine_error is None:
                leaks = _quiesce_and_check(engine)
                stats = _call(engine, "cache_stats")
            else:  # a stopped engine cannot be inspected
                leaks, stats = {"invariants": "not checked: the engine stopped", "requests_left": -1}, None
            metrics = _scrape(url)
        finally:
            userver.should_exit = True
            thread.join(10)
            engine.shutdown()
        records = res["records"]
        compared, unique, mismatches = _references(model, records, args.device)

    statuses = Counter(r["status"] for r in records)
    by_kind: dict[str, Counter] = {}
    unexpected = []
    for r in records:
        by_kind.setdefault(r["kind"], Counter())[r["status"]] += 1
        if not _expected(r["kind"], r["status"]) or "stream_error" in r:
            unexpected.append({k: v for k, v in r.items() if k != "body"} | {"body": str(r.get("body"))[:200]})
    cross_salt = [r for r in records if r["kind"] == "salt" and r.get("cached_tokens")]
    lat = [t for t, _ in res["health"]]
    health_bad = sum(1 for _, s in res["health"] if s != 200)
    five_xx = sum(n for s, n in statuses.items() if s >= 500)
    summary = {
        "requests": len(records),
        "elapsed_s": round(res["elapsed_s"], 1),
        "requests_per_s": round(len(records) / res["elapsed_s"], 1),
        "status": {str(k): v for k, v in sorted(statuses.items())},
        "by_kind": {k: {str(s): n for s, n in sorted(c.items())} for k, c in sorted(by_kind.items())},
        "five_xx": five_xx,
        "unexpected": len(unexpected),
        "unexpected_examples": unexpected[:5],
        "engine_error": engine_error,
        "health_checks": len(lat),
        "health_not_200": health_bad,
        "health_p50_ms": round(_pct(lat, 0.5) * 1e3, 2),
        "health_p99_ms": round(_pct(lat, 0.99) * 1e3, 2),
        "health_max_ms": round(max(lat, default=float("nan")) * 1e3, 2),
        "leak_check": leaks,
        "answers_compared": compared,
        "unique_prompts_compared": unique,
        "mismatches": len(mismatches),
        "mismatch_examples": mismatches[:3],
        "cross_salt_hits": len(cross_salt),
        "hit_tokens": stats and {t: stats[t]["hit_tokens"] for t in ("device", "host", "storage")},
        "metrics": metrics,
    }
    summary["goals"] = {
        "no_5xx": five_xx == 0,
        "no_engine_stop": engine_error is None and health_bad == 0,
        "no_leaks": leaks["invariants"] == "ok" and leaks["requests_left"] == 0,
        "answers_equal_offline": not mismatches and compared > 0,
        "no_cross_salt_hits": not cross_salt,
        "every_status_expected": not unexpected,
    }
    summary["latency_goals"] = {"health_p99_under_100ms": summary["health_p99_ms"] < 100}
    return summary


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvtier bench soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=2000, help="requests to send (default 2000)")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight at once (default 16)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument("--model", default=None, help="HF model directory (default: a fresh random --preset)")
    p.add_argument(
        "--preset",
        default="qwen3-tiny",
        help="preset when --model is not given (default qwen3-tiny: dense; see the module docstring)",
    )
    EngineConfig.add_flags(
        p.add_argument_group("the server's engine options (as kvtier serve's)"),
        only=ENGINE_OPTIONS,
        # tiers small enough that the mixed requests evict, swap and go through the pool
        defaults={"num_device_blocks": 96, "num_host_blocks": 192},
    )
    p.add_argument("--huge-bytes", type=int, default=40 << 20, help="size of the oversized bodies (default 40 MiB)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the result to PATH")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--strict", action="store_true", help="a missed latency goal (/health p99 < 100 ms) is an exit status 1 too")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    for name in ("requests", "concurrency", "num_host_blocks", "huge_bytes"):
        if getattr(args, name) < 1:
            raise SystemExit(f"kvtier bench soak: error: --{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    summary = run(args)
    text = json.dumps(summary, indent=2, default=str)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    slow = [g for g, ok in summary["latency_goals"].items() if not ok]
    if slow:
        print(
            f"kvtier bench soak: latency goals missed: {', '.join(slow)} (/health p99 "
            f"{summary['health_p99_ms']:.0f} ms){'' if args.strict else '; --strict makes that an exit status 1'}",
            file=sys.stderr,
        )
    missed = [g for g, ok in summary["goals"].items() if not ok] + (slow if args.strict else [])
    if missed:
        print(f"kvtier bench soak: goals missed: {', '.join(missed)}", file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
