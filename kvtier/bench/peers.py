"""``kvtier bench peers``: kvtier's cache manager against vLLM's and SGLang's prefix caches.

CPU only, bookkeeping only (no model, no copies): the same trace replayed through each peer's
real, unmodified classes (``kvtier/bench/peer_caches.py`` says which) and through
``kvtier.cache.CacheManager`` (device tier only, with SHA-256 and with xxh3_128 keys)::

    admit    match the longest cached prefix (keys included), pin it, allocate the rest
    publish  the prefill ran: the prompt's full blocks become matchable
    finish   unpin; the request's own blocks go back, cached ones stay (evictable)

At most ``--window`` requests hold blocks; the oldest finishes first, and a request that does
not fit finishes the oldest in flight and tries again. Trace: ``--requests`` prompts, each one
of ``--prompts`` shared prompts of 1-4K tokens plus 32-512 unique tokens (fixed seed). Each
peer runs in a process of its own, so that one peer's imports (vLLM and SGLang load torch and
much more) do not slow another's garbage collector; a warm-up replay, then the best of
``--repeat`` timed replays, each on an empty cache.

The peers come from ``pip install 'kvtier[peers]'``. A peer whose package is missing is skipped
with a message naming it; kvtier always runs.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import random
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Protocol

from kvtier.bench import peer_caches
from kvtier.bench.peer_caches import Admitted
from kvtier.cache import CacheManager, CacheRequest
from kvtier.engine.config import EngineConfig
from kvtier.flags import add_json_flag, positive_int, write_json

INSTALL_HINT = "pip install 'kvtier[peers]'"
# peer -> (package it needs, variants: the keyword its adapter takes for the key digest)
PEERS: dict[str, tuple[str | None, tuple[str, ...]]] = {
    "kvtier": (None, ("sha256", "xxh3_128")),
    "vllm": ("vllm", ("sha256",)),
    "sglang": ("sglang", ("none",)),  # the radix tree compares tokens: no digest
}


class Peer(Protocol):
    name: str

    def admit(self, rid: int, tokens: list[int]) -> Admitted | None:
        """None when the cache has no room for the request now."""

    def publish(self, handle: Any) -> dict[str, int]: ...

    def finish(self, handle: Any) -> dict[str, int]: ...

    def check(self) -> None:
        """After a replay: nothing pinned, every block free or cached (raises otherwise)."""


class KvtierPeer:
    """The scheduler's calls on :class:`CacheManager`, timed by phase."""

    def __init__(self, num_blocks: int, block_size: int, hash_name: str = "sha256") -> None:
        self.mgr = CacheManager(block_size=block_size, num_device_blocks=num_blocks, hash_name=hash_name)
        self.name = f"kvtier[{hash_name}]"
        self._refused: dict[int, CacheRequest] = {}  # retried with the keys already computed

    def admit(self, rid: int, tokens: list[int]) -> Admitted | None:
        mgr = self.mgr
        t0 = time.perf_counter_ns()
        req = self._refused.pop(rid, None) or mgr.new_request(rid, tokens)
        match = mgr.match_prefix(req)
        t1 = time.perf_counter_ns()
        ok = mgr.allocate(req, len(tokens))
        t2 = time.perf_counter_ns()
        if not ok:
            self._refused[rid] = req
            return None
        return Admitted(req, match.num_cached_tokens, {"match": t1 - t0, "alloc": t2 - t1})

    def publish(self, req: CacheRequest) -> dict[str, int]:
        t0 = time.perf_counter_ns()
        self.mgr.commit(req, len(req.token_ids))
        return {"commit": time.perf_counter_ns() - t0}

    def finish(self, req: CacheRequest) -> dict[str, int]:
        t0 = time.perf_counter_ns()
        self.mgr.free(req)
        return {"free": time.perf_counter_ns() - t0}

    def check(self) -> None:
        mgr = self.mgr
        mgr.assert_invariants()
        assert not self._refused, sorted(self._refused)
        assert mgr.device_pool.num_free + mgr.tree.num_device_copies == mgr.device_pool.num_blocks
        assert mgr.tree.num_device_unlocked == mgr.tree.num_device_copies, "a block is still pinned"


def make_trace(
    num_requests: int,
    num_prompts: int,
    prompt_tokens: tuple[int, int] = (1024, 4096),
    unique_tokens: tuple[int, int] = (32, 512),
    vocab: int = 32000,
    seed: int = 0,
) -> list[list[int]]:
    """Each request: one of ``num_prompts`` shared prompts, then tokens of its own."""
    rng = random.Random(seed)
    shared = [[rng.randrange(vocab) for _ in range(rng.randint(*prompt_tokens))] for _ in range(num_prompts)]
    return [rng.choice(shared) + [rng.randrange(vocab) for _ in range(rng.randint(*unique_tokens))] for _ in range(num_requests)]


def replay(peer: Peer, trace: list[list[int]], window: int) -> dict:
    """Run the trace through ``peer``; per-request time is the sum of its phases."""
    phases: dict[str, int] = {}
    per_request = [0] * len(trace)
    in_flight: list[tuple[int, Any]] = []  # (request index, handle), oldest first
    hit_tokens = 0

    def count(i: int, times: dict[str, int]) -> None:
        for phase, ns in times.items():
            phases[phase] = phases.get(phase, 0) + ns
            per_request[i] += ns

    def finish_oldest() -> None:
        i, handle = in_flight.pop(0)
        count(i, peer.finish(handle))

    wall = time.perf_counter()
    for i, tokens in enumerate(trace):
        if len(in_flight) >= window:
            finish_oldest()
        while (got := peer.admit(i, tokens)) is None:
            if not in_flight:
                raise RuntimeError(f"request {i} ({len(tokens)} tokens) does not fit an empty cache")
            finish_oldest()
        hit_tokens += got.num_cached_tokens
        count(i, got.phases_ns)
        count(i, peer.publish(got.handle))
        in_flight.append((i, got.handle))
    while in_flight:
        finish_oldest()
    wall = time.perf_counter() - wall
    peer.check()
    us = sorted(ns / 1e3 for ns in per_request)
    n = len(us)
    return {
        "peer": peer.name,
        "requests": n,
        "mean_us": statistics.fmean(us),
        "p50_us": us[n // 2],
        "p99_us": us[min(n - 1, n * 99 // 100)],
        "phase_mean_us": {k: v / 1e3 / n for k, v in phases.items()},
        "hit_share": hit_tokens / sum(map(len, trace)),
        "wall_s": wall,
    }


def peer_factory(name: str, variant: str) -> Callable[[int, int], Peer]:
    """``factory(num_blocks, block_size)``; imports the peer's package (ImportError if missing)."""
    if name == "kvtier":
        return lambda n, bs: KvtierPeer(n, bs, variant)
    if name == "vllm":
        return lambda n, bs: peer_caches.VllmPeer(n, bs, variant)
    if name == "sglang":
        return lambda n, bs: peer_caches.SglangPeer(n, bs)
    raise ValueError(f"unknown peer {name!r}; choose from {sorted(PEERS)}")


def run_peer(name: str, variant: str, trace: list[list[int]], args: argparse.Namespace) -> dict:
    make = peer_factory(name, variant)
    replay(make(args.num_blocks, args.block_size), make_trace(args.warmup, 5, seed=args.seed + 1), args.window)
    runs = []
    for _ in range(args.repeat):
        gc.collect()
        runs.append(replay(make(args.num_blocks, args.block_size), trace, args.window))  # empty cache
    best = min(runs, key=lambda r: r["mean_us"])
    best["runs_mean_us"] = [round(r["mean_us"], 1) for r in runs]
    return best


def missing_package(name: str) -> str | None:
    """Why ``name`` cannot run here (its package is not installed), or None."""
    package = PEERS[name][0]
    if package is None or importlib.util.find_spec(package) is not None:
        return None
    return f"package {package!r} is not installed: {INSTALL_HINT}"


def _in_child(name: str, args: argparse.Namespace, argv: list[str]) -> list[dict]:
    """Run one peer (all its variants) in a fresh process; its rows, or one row saying why not."""
    from kvtier.serve.launch import kvtier_command

    proc = subprocess.run(kvtier_command("bench", "peers", *argv, "--one", name), capture_output=True, text=True)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not rows:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        rows.append({"peer": name, "skipped": f"failed (exit {proc.returncode}):\n{tail}"})
    return rows


def format_row(r: dict) -> str:
    if "skipped" in r:
        return f"{r['peer']:<17} skipped: {r['skipped']}"
    phases = " ".join(f"{k} {v:.1f}" for k, v in r["phase_mean_us"].items())
    return (
        f"{r['peer']:<17} {r['mean_us']:8.1f} us/request  p50 {r['p50_us']:8.1f}  p99 {r['p99_us']:8.1f}  "
        f"hit {r['hit_share']:.3f}  [{phases}]  runs {r['runs_mean_us']}"
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(
        prog="kvtier bench peers", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--peer",
        action="append",
        choices=sorted(PEERS),
        default=None,
        help="run only this peer (repeat for several; default: all)",
    )
    for flag, default, what in (
        ("--requests", 2000, "requests in the trace"),
        ("--prompts", 50, "shared prompts"),
        ("--num-blocks", 16384, "cache size in blocks, the same for every peer"),
        ("--window", 32, "requests holding blocks at once"),
        ("--warmup", 200, "requests of a throwaway replay first"),
        ("--repeat", 3, "timed replays; the fastest is reported"),
    ):
        ap.add_argument(flag, type=positive_int, default=default, help=f"{what} (default {default})")
    EngineConfig.add_flags(ap, only=("block_size",))  # (every peer's)
    ap.add_argument("--seed", type=int, default=0, help="trace seed (default 0)")
    add_json_flag(ap, "one object per peer")
    ap.add_argument("--one", choices=sorted(PEERS), default=None, help=argparse.SUPPRESS)  # the child's side
    args = ap.parse_args(argv)
    trace = make_trace(args.requests, args.prompts, seed=args.seed)

    if args.one is not None:
        for variant in PEERS[args.one][1]:
            try:
                row = run_peer(args.one, variant, trace, args)
            except ImportError as e:  # the package is there, something it imports is not
                row = {"peer": args.one, "skipped": f"{e}: {INSTALL_HINT}"}
            print(json.dumps(row), flush=True)
        return 0

    child_argv = [a for a in argv if a != "--json" and not a.startswith("--json=")]
    if args.json is not None and args.json != "-" and args.json in child_argv:  # --json PATH: the path too
        child_argv.remove(args.json)
    peer_flags = [i for i, a in enumerate(child_argv) if a == "--peer" or a.startswith("--peer=")]
    for i in reversed(peer_flags):  # the child runs one peer, named by --one
        del child_argv[i : i + (1 if "=" in child_argv[i] else 2)]
    rows: list[dict] = []
    if args.json != "-":
        print(
            f"trace: {len(trace)} requests ({sum(map(len, trace))} tokens), {args.prompts} shared prompts "
            f"of 1-4K tokens + 32-512 unique ones; block {args.block_size}, {args.num_blocks} blocks, "
            f"window {args.window}, best of {args.repeat}"
        )
    for name in args.peer or list(PEERS):
        why = missing_package(name)
        got = [{"peer": name, "skipped": why}] if why else _in_child(name, args, child_argv)
        for r in got:
            print(json.dumps(r) if args.json == "-" else format_row(r), flush=True)
        rows += got
    if args.json not in (None, "-"):
        write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
