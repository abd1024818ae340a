"""``kvtier sim TRACE``: replay a request trace through the real CacheManager (no model).

Each request, in timestamp order: match its prefix (hits are counted per tier from this first
match), fetch storage hits into host blocks, admit (loads host hits), "prefill" the rest,
commit, and run the step's copies to completion. At most ``max_running`` requests hold their
blocks at once; the oldest finishes first, and a request that does not fit finishes older ones.
Decode tokens are not simulated (prompt KV only): a trace's next turn carries the previous
answer inside its own prompt.

Every tier size may be ``inf`` (unbounded: sized to the trace's total blocks). Storage hits are
fetched only when the fetch-vs-recompute cost model says they pay, with a pool of
``storage_gbps`` / ``storage_latency_ms`` per call against a prefill rate of
``prefill_tokens_per_s`` (0: fetch every hit); the decisions are reported.

The write policy defaults to the engine's (``default_write_policy``): ``write_through`` with a
host or storage tier, so every computed block is copied down and each configured tier is
filled; ``write_through_selective`` copies a block down only after its second hit. The report
names the policy that ran and says why a lower tier got no hits. A device tier that can hold
every block of the trace never evicts, so no block copied below it could ever be hit: the replay
then copies none (the CPU those copies cost; a fleet's shared pool still gets its writes, which
other instances read), and the report says that its bytes moved leave them out.

A progress bar goes to stderr when it is a terminal (``--no-progress``: none; ``--progress``:
one anyway); bare ``--json`` (the result on stdout, for a program) has none.

The cyclic garbage collector is paused during the replay: the manager frees its objects by
reference counting (removed nodes form no cycles), and a full collection over a tree whose
nodes churn by the million cost a third of the wall time.
"""

from __future__ import annotations

import argparse
import sys

from kvtier import flags
from kvtier.bench.replay import TIERS, SimConfig, simulate
from kvtier.bench.traces import read_trace
from kvtier.engine.config import EngineConfig
from kvtier.serve.route import POLICIES


def format_report(res: dict) -> str:
    lines = [
        f"requests {res['requests']}  prompt tokens {res['prompt_tokens']:,}  "
        f"skipped {res['skipped_requests']}  wall {res['wall_s']:.1f}s"
    ]
    lines.append(f"{'tier':<8} {'hit tokens':>14} {'hit rate':>9} {'evictions':>11}")
    for t in TIERS:
        lines.append(f"{t:<8} {res['hit_tokens'][t]:>14,} {res['hit_rate'][t]:>9.3f} {res['evictions'][t]:>11,}")
    total = sum(res["hit_tokens"].values())
    lines.append(f"{'all':<8} {total:>14,} {total / max(1, res['prompt_tokens']):>9.3f}")
    lines.append("bytes moved: " + ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in res["bytes_moved"].items()))
    if res.get("fetch_decisions"):
        lines.append("storage fetch decisions: " + ", ".join(f"{k} {v:,}" for k, v in res["fetch_decisions"].items()))
    lines.extend(res["notes"])
    return "\n".join(lines)


def add_cache_flags(p: argparse.ArgumentParser) -> None:
    """The cache manager's options, as the engine takes them, and the block key digest."""
    EngineConfig.add_flags(
        p,
        only=("block_size", "write_policy", "write_through_threshold", "eviction"),
        # (the engine's rule, said of the replay's tiers: --storage-blocks is its pool)
        shown={
            "write_policy": "write_through with a host or storage tier, so every computed block reaches them; "
            "else write_through_selective"
        },
    )
    p.add_argument("--hash", choices=("sha256", "xxh3_128"), default="sha256", help="block key digest (default sha256)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvtier sim",
        description="Replay a JSONL trace through the real CacheManager and print hits, evictions and bytes moved per tier.",
    )
    p.add_argument(
        "trace",
        help="JSONL trace: {timestamp, input_ids, output_length} or the Mooncake "
        "format {timestamp, input_length, output_length, hash_ids}",
    )
    add_cache_flags(p)
    p.add_argument(
        "--device-blocks",
        "--num-device-blocks",
        type=flags.tier_blocks,
        default=8192,
        help="device tier size in blocks; inf = unbounded (default 8192)",
    )
    p.add_argument(
        "--host-blocks",
        "--num-host-blocks",
        type=flags.capacity,
        default=32768,
        help="host tier size in blocks; 0 = no host tier, inf = unbounded (default 32768)",
    )
    p.add_argument(
        "--storage-blocks",
        type=flags.capacity,
        default=0,
        help="storage tier size in blocks (its I/O goes through the host tier); 0 = none, inf = unbounded (default 0)",
    )
    p.add_argument(
        "--trace-block-tokens",
        type=flags.positive_int,
        default=512,
        help="tokens per hash id in Mooncake-format traces (default 512)",
    )
    p.add_argument(
        "--kv-bytes-per-token",
        type=flags.positive_int,
        default=131072,
        help="KV bytes per token, all layers, for bytes moved (default 131072)",
    )
    p.add_argument("--max-running", type=flags.positive_int, default=16, help="requests holding blocks at once (default 16)")
    p.add_argument(
        "--storage-gbps",
        type=flags.positive_float,
        default=2.0,
        help="storage read bandwidth per call, GB/s, for the fetch-vs-recompute decision (default 2.0)",
    )
    p.add_argument(
        "--storage-latency-ms", type=flags.non_negative_float, default=0.5, help="storage latency per call, ms (default 0.5)"
    )
    p.add_argument(
        "--prefill-tokens-per-s",
        type=flags.non_negative_float,
        default=0.0,
        help="recompute rate; storage hits are fetched only when that is faster than "
        "recomputing them at this rate; 0 = fetch every hit (default 0)",
    )
    p.add_argument(
        "--instances",
        type=flags.positive_int,
        default=1,
        help="instances behind a router, each with the device and host tier sizes above, all on "
        "one shared pool of --storage-blocks (default 1: one engine)",
    )
    p.add_argument(
        "--route",
        choices=POLICIES,
        default="cache_aware",
        help="--instances > 1: the router's policy, as kvtier router --policy (default cache_aware)",
    )
    p.add_argument(
        "--drop-events",
        type=flags.non_negative_float,
        default=0.0,
        help="--instances > 1: probability that a KV event is lost on its way to the router (default 0)",
    )
    p.add_argument("--limit", type=flags.positive_int, default=None, help="replay only the first N requests")
    flags.add_json_flag(p, "the result (one object)")
    p.add_argument(
        "--progress",
        dest="progress",
        action="store_true",
        default=None,
        help="a progress bar on stderr even when it is not a terminal (default: on a terminal, unless bare --json)",
    )
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")

    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = SimConfig(
        block_size=args.block_size,
        device_blocks=args.device_blocks,
        host_blocks=args.host_blocks,
        storage_blocks=args.storage_blocks,
        write_policy=args.write_policy,
        write_through_threshold=args.write_through_threshold,
        eviction=args.eviction,
        hash_name=args.hash,
        kv_bytes_per_token=args.kv_bytes_per_token,
        max_running=args.max_running,
        storage_gbps=args.storage_gbps,
        storage_latency_ms=args.storage_latency_ms,
        prefill_tokens_per_s=args.prefill_tokens_per_s,
    )
    trace = read_trace(args.trace, block_tokens=args.trace_block_tokens, limit=args.limit)
    # a bar on a terminal (stderr), none when the JSON goes to stdout for a program to read
    progress = args.progress if args.progress is not None else args.json != "-" and sys.stderr.isatty()
    if args.instances > 1:
        from kvtier.bench.fleet import format_fleet, simulate_fleet

        res = simulate_fleet(trace, cfg, args.instances, args.route, drop_events=args.drop_events, progress=progress)
        if not flags.write_json(args.json, res):
            print(format_fleet(res))
        return 0
    res = simulate(trace, cfg, progress=progress)
    if not flags.write_json(args.json, res):
        print(format_report(res))
    return 0
