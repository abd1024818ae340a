"""The ``kvtier`` command. Each subcommand imports what it needs when it runs."""
from __future__ import annotations

import argparse
import sys

from kvtier.cache.manager import check_block_size, parse_capacity
from kvtier.cache.policy import EVICTION_POLICIES, WRITE_POLICIES


def _block_size(text: str) -> int:
    try:
        return check_block_size(int(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {value}")
    return value


def _positive(text: str) -> int:
    value = _count(text)
    if value == 0:
        raise argparse.ArgumentTypeError("expected a positive integer, got 0")
    return value


def _capacity(text: str) -> int | float:
    try:
        return parse_capacity(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_cache_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--block-size", type=_block_size, default=16, help="tokens per KV block (power of two; default 16)")
    p.add_argument("--write-policy", choices=WRITE_POLICIES, default="write_through_selective",
                   help="when blocks are copied down a tier (default write_through_selective)")
    p.add_argument("--write-through-threshold", type=_positive, default=2,
                   help="hits before write_through_selective copies a block down (default 2)")
    p.add_argument("--eviction", choices=sorted(EVICTION_POLICIES), default="lru", help="eviction order (default lru)")
    p.add_argument("--hash", choices=("sha256", "xxh3_128"), default="sha256", help="block key digest (default sha256)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvtier", description="Tiered KV cache for LLM serving, with its inference engine.")
    ap.add_argument("--version", action="version", version=f"kvtier {__import__('kvtier').__version__}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("sim", help="replay a request trace through the cache manager (no model)",
                       description="Replay a JSONL trace through the real CacheManager and print hits, "
                                   "evictions and bytes moved per tier.")
    p.add_argument("trace", help="JSONL trace: {timestamp, input_ids, output_length} or the Mooncake "
                                 "format {timestamp, input_length, output_length, hash_ids}")
    _add_cache_flags(p)
    p.add_argument("--device-blocks", type=_positive, default=8192, help="device tier size in blocks (default 8192)")
    p.add_argument("--host-blocks", type=_count, default=32768, help="host tier size in blocks; 0 = no host tier (default 32768)")
    p.add_argument("--storage-blocks", type=_capacity, default=0,
                   help="storage tier size in blocks; 0 = none, inf = unbounded (default 0)")
    p.add_argument("--trace-block-tokens", type=_positive, default=512,
                   help="tokens per hash id in Mooncake-format traces (default 512)")
    p.add_argument("--kv-bytes-per-token", type=_positive, default=131072,
                   help="KV bytes per token, all layers, for bytes moved (default 131072)")
    p.add_argument("--max-running", type=_positive, default=16, help="requests holding blocks at once (default 16)")
    p.add_argument("--limit", type=_positive, default=None, help="replay only the first N requests")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--progress", action="store_true", help="show a progress bar even when stderr is not a terminal")

    p = sub.add_parser("bench", help="benchmarks: cache (CPU cost of the manager)",
                       description="Run a benchmark. 'cache': CPU cost of match+allocate+commit+free per request.")
    p.add_argument("name", choices=("cache",), help="which benchmark")
    p.add_argument("--requests", type=_positive, default=2000, help="requests in the trace (default 2000)")
    p.add_argument("--prompts", type=_positive, default=200, help="shared prefixes (default 200)")
    p.add_argument("--prompt-tokens", type=_positive, default=4096, help="tokens per prompt (default 4096)")
    p.add_argument("--repeat", type=_positive, default=5, help="timed runs; the best is reported (default 5)")
    p.add_argument("--block-size", type=_block_size, default=16, help="tokens per block (default 16)")
    p.add_argument("--json", action="store_true", help="print JSON")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.command is None:
        ap.print_help()
        return 0
    try:
        if args.command == "sim":
            from kvtier.bench import sim
            return sim.main(args)
        if args.command == "bench":
            from kvtier.bench import cache_bench
            return cache_bench.main(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"kvtier {args.command}: error: {e}", file=sys.stderr)
        return 2
    ap.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
