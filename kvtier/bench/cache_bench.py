"""``kvtier bench cache``: CPU cost of the cache manager per request (no model, no copies).

Trace: ``--requests`` prompts of ``--prompt-tokens`` tokens, each one of ``--prompts`` shared
prefixes (7/8 of the prompt) plus a unique suffix. Each request runs the scheduler's calls::

    new_request -> match_prefix -> allocate(all tokens) -> commit(all tokens) -> free (later)

with at most ``WINDOW`` requests holding blocks at once (the oldest is freed first) on a device
tier that holds every shared prefix plus ``2 * WINDOW`` whole prompts, so the unique suffixes
are evicted as the replay goes (eviction is part of the cost). Fixed seed, one warm-up run, best of
``--repeat`` timed runs, one line per key digest. ``keys`` replays the key work alone: label
every full block (tokens packed to bytes, validated) and digest the blocks that were not found
in the tree (a hit takes its key from the tree node); ``rest`` is everything else (tree walk,
allocate, commit, free, eviction).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from collections import deque

from kvtier.cache import CacheManager
from kvtier.engine.config import EngineConfig
from kvtier.flags import add_json_flag, positive_int, write_json

WINDOW = 32
HASHES = ("sha256", "xxh3_128")


def make_trace(num_requests: int, num_prompts: int, prompt_tokens: int, seed: int = 0, vocab: int = 32000) -> list[list[int]]:
    """Prompts of ``prompt_tokens`` tokens: a shared prefix (7/8) plus a unique suffix."""
    rng = random.Random(seed)
    prefix_len = prompt_tokens * 7 // 8
    prefixes = [[rng.randrange(vocab) for _ in range(prefix_len)] for _ in range(num_prompts)]
    return [
        prefixes[rng.randrange(num_prompts)] + [rng.randrange(vocab) for _ in range(prompt_tokens - prefix_len)]
        for _ in range(num_requests)
    ]


def device_blocks_for(num_prompts: int, prompt_tokens: int, block_size: int) -> int:
    """Room for every shared prefix and 2 * WINDOW whole prompts."""
    prompt_blocks = -(-prompt_tokens // block_size)
    return num_prompts * (prompt_tokens * 7 // 8 // block_size) + 2 * WINDOW * prompt_blocks


def replay(
    trace: list[list[int]],
    block_size: int,
    hash_name: str,
    num_device_blocks: int,
    window: int = WINDOW,
    hit_blocks: list[int] | None = None,
) -> tuple[float, int]:
    """Seconds for the whole trace, and prompt tokens served from the cache (``hit_blocks``:
    filled with each request's number of hit blocks)."""
    mgr = CacheManager(block_size=block_size, num_device_blocks=num_device_blocks, hash_name=hash_name)
    running: deque = deque()
    hit = 0
    t0 = time.perf_counter()
    for rid, tokens in enumerate(trace):
        while len(running) >= window:
            mgr.free(running.popleft())
        req = mgr.new_request(rid, tokens)
        m = mgr.match_prefix(req)
        hit += m.num_cached_tokens
        if hit_blocks is not None:
            hit_blocks.append(m.num_blocks)
        while not mgr.allocate(req, len(tokens)):
            if not running:
                raise RuntimeError(f"request {rid} ({len(tokens)} tokens) does not fit the device tier")
            mgr.free(running.popleft())
        mgr.commit(req, len(tokens))
        running.append(req)
    while running:
        mgr.free(running.popleft())
    elapsed = time.perf_counter() - t0
    assert mgr.device_pool.num_free + mgr.tree.num_device_copies == num_device_blocks
    return elapsed, hit


def time_keys(trace: list[list[int]], block_size: int, hash_name: str, hit_blocks: list[int]) -> float:
    """Seconds of the replay's key work: labels of every full block, digests of the misses."""
    mgr = CacheManager(block_size=block_size, num_device_blocks=1, hash_name=hash_name)
    known = [bytes(32)] * max(hit_blocks, default=0)  # hits: keys a tree match hands over
    t0 = time.perf_counter()
    for rid, (tokens, n_hit) in enumerate(zip(trace, hit_blocks)):
        h = mgr.new_request(rid, tokens).hasher
        n_full = h.add_tokens(tokens)
        h.adopt_keys(known[:n_hit])
        h.ensure_keys(n_full)
    return time.perf_counter() - t0


def best_of(fn, repeat: int):
    runs = []
    for _ in range(repeat):
        gc.collect()
        runs.append(fn())
    return min(runs, key=lambda r: r[0] if isinstance(r, tuple) else r)


def run(
    num_requests: int = 2000,
    num_prompts: int = 200,
    prompt_tokens: int = 4096,
    block_size: int = 16,
    repeat: int = 5,
    seed: int = 0,
) -> list[dict]:
    num_device_blocks = device_blocks_for(num_prompts, prompt_tokens, block_size)
    trace = make_trace(num_requests, num_prompts, prompt_tokens, seed)
    num_tokens = sum(map(len, trace))
    num_blocks = sum(-(-len(t) // block_size) for t in trace)
    rows = []
    for hash_name in HASHES:
        hit_blocks: list[int] = []
        replay(trace, block_size, hash_name, num_device_blocks, hit_blocks=hit_blocks)
        total, hit = best_of(lambda: replay(trace, block_size, hash_name, num_device_blocks), repeat)
        keys = best_of(lambda: time_keys(trace, block_size, hash_name, hit_blocks), repeat)
        rows.append(
            {
                "hash": hash_name,
                "requests": num_requests,
                "prompt_tokens": num_tokens,
                "blocks": num_blocks,
                "device_blocks": num_device_blocks,
                "us_per_request": total / num_requests * 1e6,
                "us_per_block": total / num_blocks * 1e6,
                "keys_us_per_request": keys / num_requests * 1e6,
                "rest_us_per_request": max(0.0, total - keys) / num_requests * 1e6,
                "hit_share": hit / num_tokens,
                "best_of": repeat,
            }
        )
    return rows


def format_row(r: dict) -> str:
    return (
        f"{r['hash']:<9} {r['requests']} req x {r['prompt_tokens'] // r['requests']} tok: "
        f"{r['us_per_request']:8.1f} us/req {r['us_per_block']:6.2f} us/block  "
        f"(keys {r['keys_us_per_request']:.1f} + rest {r['rest_us_per_request']:.1f} us/req)  "
        f"hit {r['hit_share']:.3f}  best of {r['best_of']}"
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvtier bench cache", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--requests", type=positive_int, default=2000, help="requests in the trace (default 2000)")
    p.add_argument("--prompts", type=positive_int, default=200, help="shared prefixes (default 200)")
    p.add_argument("--prompt-tokens", type=positive_int, default=4096, help="tokens per prompt (default 4096)")
    p.add_argument("--repeat", type=positive_int, default=5, help="timed runs; the best is reported (default 5)")
    EngineConfig.add_flags(p, only=("block_size",))
    add_json_flag(p, "the rows (printed: one object per line)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rows = run(args.requests, args.prompts, args.prompt_tokens, args.block_size, args.repeat)
    for r in rows:
        print(json.dumps(r) if args.json == "-" else format_row(r))
    if args.json != "-":
        write_json(args.json, rows)
    return 0
