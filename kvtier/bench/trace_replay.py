"""``kvtier bench trace FILE``: replay a request trace (Mooncake's published format, or token ids;
kvtier/bench/traces.py reads both) against the server, each request at its timestamp.

A Mooncake request is ``hash_ids`` (one per 512-token block; equal leading hash ids = equal
prefixes) plus an input and output length. Its tokens are made from the hash ids, so requests
share exactly the prefixes the trace says. ``--block-tokens`` shrinks every block (and the input
length with it) to fit a small model: 512 is the trace as published. Timestamps (ms) are honoured,
scaled by ``--time-scale`` (0.5 = twice as fast; 0 = all at once); ``--requests`` replays the
first N, ``--max-output-tokens`` caps the answers. A request whose prompt and answer do not fit
the served model's ``max_model_len`` is left out (their number is printed). A record's group is the request's index in the
replay; a round is a tenth of the replay, in order::

    kvtier bench trace traces/mooncake_conversation_1k.jsonl --model qwen3-0.6b-shape --device cuda \\
        --block-tokens 64 --requests 300 --compare device,host
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from typing import Any, Callable

from kvtier.bench import serving
from kvtier.bench.traces import TraceError, read_trace, tokens_of_hashes
from kvtier.flags import positive_int


def prompts(args: argparse.Namespace, vocab: int, max_model_len: int | None = None) -> list[tuple[float, list[int], int]]:
    """(seconds after the start, prompt ids, output tokens) of each request to replay: those over
    ``--max-input-tokens``, or whose prompt and output do not fit ``max_model_len``, left out."""
    try:
        reqs = read_trace(args.file, 512, vocab, args.requests)
    except TraceError as e:
        raise SystemExit(f"{args.file}: {e}") from None
    if not reqs:
        raise SystemExit(f"{args.file}: no requests")
    t0 = reqs[0].timestamp
    out = []
    for r in reqs:
        if r.hash_ids is not None:
            n = max(1, math.ceil(r.input_length * args.block_tokens / 512))
            ids = tokens_of_hashes(r.hash_ids, args.block_tokens, vocab)[:n]
        else:
            ids = [t % vocab for t in r.input_ids]
        if args.max_input_tokens is not None and len(ids) > args.max_input_tokens:
            continue
        output_tokens = max(1, min(r.output_length or 1, args.max_output_tokens))
        if max_model_len is not None and len(ids) + output_tokens > max_model_len:
            continue
        out.append(((r.timestamp - t0) / 1e3 * args.time_scale, ids, output_tokens))
    return out


def plan(args: argparse.Namespace, max_model_len: int | None) -> serving.Plan:
    """The replay's shape; the requests that do not fit ``max_model_len`` (None: not checked)
    are left out, and said (an error if none is left)."""
    wanted = prompts(args, 1 << 20)
    if not wanted:
        raise SystemExit(f"{args.file}: every request is over --max-input-tokens {args.max_input_tokens}")
    fit = prompts(args, 1 << 20, max_model_len)
    if len(fit) < len(wanted):
        longest = max(len(ids) + out for _, ids, out in wanted)
        print(
            f"trace: {len(wanted) - len(fit)} of {len(wanted)} requests left out: prompt + output over max_model_len "
            f"{max_model_len} of the served model (the longest: {longest} tokens; --block-tokens shrinks prompts)",
            file=sys.stderr,
        )
    if not fit:
        raise SystemExit(
            f"trace: no request of {args.file} fits max_model_len {max_model_len} of the served model; "
            f"lower --block-tokens or serve a longer --max-model-len"
        )
    first = [len(ids) for _, ids, _ in fit[: min(8, args.max_parallel)]]
    return serving.Plan(len(fit), (len(first), round(sum(first) / len(first))))


def workload(args: argparse.Namespace) -> serving.Workload:
    async def run(server: serving.Server, client: Any, tick: Callable[[], None]) -> list[serving.Record]:
        todo = prompts(args, args.vocab, args.served_max_model_len)
        per_round = max(1, math.ceil(len(todo) / 10))
        records: list[serving.Record] = []
        start = time.perf_counter()
        slots = asyncio.Semaphore(args.max_parallel)

        async def replay(i: int, at: float, prompt: list[int], out: int) -> None:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            async with slots:
                rec = serving.Record(i, i // per_round, len(prompt), out)
                await serving.send(client, server, rec, prompt)
            records.append(rec)
            tick()

        await asyncio.gather(*(replay(i, at, p, o) for i, (at, p, o) in enumerate(todo)))
        return records

    return run


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kvtier bench trace", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("file", help="JSONL trace (e.g. traces/mooncake_conversation_1k.jsonl)")
    ap.add_argument("--requests", type=positive_int, default=None, help="replay the first N (default all)")
    ap.add_argument(
        "--block-tokens",
        type=positive_int,
        default=512,
        help="tokens per Mooncake hash block (default 512, the trace's; smaller shrinks prompts)",
    )
    ap.add_argument("--time-scale", type=float, default=1.0, help="timestamps x this (default 1; 0: all at once)")
    ap.add_argument("--max-output-tokens", type=positive_int, default=64, help="answers capped at this (default 64)")
    ap.add_argument(
        "--max-input-tokens",
        type=positive_int,
        default=None,
        help="leave out requests whose prompt is longer (default: none left out)",
    )
    ap.add_argument("--max-parallel", type=positive_int, default=64, help="requests in flight at most (default 64)")
    serving.add_common_flags(ap)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.time_scale < 0:
        raise SystemExit(f"--time-scale must be >= 0, got {args.time_scale}")
    serving.run(args, "trace", workload(args), lambda max_model_len: plan(args, max_model_len))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
