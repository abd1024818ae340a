"""``kvtier bench pd-soak``: prefill/decode disaggregation run after run on fresh servers, every
greedy answer through P + D checked token for token against a colocated server's.

::

    run k (fresh servers and pools; --fresh-triton-cache: an empty Triton cache per configuration)
      storage: one server on --device (host tier + file:// pool)          ─┐ the same requests,
      pd: P on --prefill-device, D on --decode-device, behind the router  ─┘ one config after the other
        each: the multiturn workload, then the trace's (each after a warm-up)
    per run: requests, deaths (a started process that exited), 5xx, other failed requests,
    mismatches (PD's token ids differ from the colocated answer's), unknown (either side failed)

Workloads: ``kvtier bench multiturn``'s (``--clients`` conversations of ``--rounds`` rounds; each
round resends the history, answers included, so equal answers make equal prompts; seed ``--seed``
+ the run), then the first ``--trace-requests`` of ``--trace`` (``kvtier bench trace``;
``--block-tokens`` per hash block, sent at once, at most ``--max-parallel`` in flight, prompts
longer than the context less ``--output-length`` left out). A conversation must fit the context:
``--rounds x (--request-length + --output-length) <= --max-model-len`` (default: the model's).

A preset is served with ``--load-format dummy``: every server draws the same weights from one seed
on its own device (kvtier/model/loader.py), so the answers of two servers are comparable, on two
GPUs as long as they are of one model (CUDA's generator gives equal draws on equal devices). Greedy
answers can still differ where batches differ and a near-tie flips: bf16 does that far more often
than float32 (use --dtype float32 to test the hand-off, not the rounding).

One line per run and a total line; ``--json PATH``, written again after each run, has every run's
results (per configuration and workload: ``kvtier bench multiturn``'s summary; the first mismatches
with their group, round and first differing token; each death's log tail). Exit status 1, naming
the first problem, if any run had a death, a 5xx, another failed request, a mismatch or an
unknown answer::

    kvtier bench pd-soak --model qwen3-0.6b-shape --dtype float32 --device cuda:0 \\
        --prefill-device cuda:0 --decode-device cuda:1 --runs 10 --fresh-triton-cache --clients 16 \\
        --rounds 4 --request-length 512 --output-length 32 --device-blocks 2048 --host-blocks 8192 \\
        --max-model-len 8192 --block-tokens 64 --trace-requests 200 --json pd_soak.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import kvtier
from kvtier.bench import multiturn, serving, trace_replay
from kvtier.flags import non_negative_int, positive_int

CONFIGS = ("storage", "pd")  # the baseline first
TRACE = Path(kvtier.__file__).resolve().parent.parent / "traces" / "mooncake_conversation_1k.jsonl"
COUNTS = ("requests", "compared", "deaths", "http_5xx", "errors", "mismatches", "unknown")


def workloads(args: argparse.Namespace, limit: int) -> dict[str, tuple[serving.Workload, int, tuple[int, int]]]:
    """name -> (workload, its requests, its start shape for the warm-up), as their benches run them."""
    out = {
        "multiturn": (
            multiturn.workload(args),
            args.clients * args.rounds,
            (min(args.clients, args.max_parallel), args.request_length),
        )
    }
    if args.trace_requests:
        targs = argparse.Namespace(
            **{
                **vars(args),
                "file": args.trace,
                "requests": args.trace_requests,
                "max_output_tokens": args.output_length,
                "max_input_tokens": limit - args.output_length,
            }
        )
        reqs = trace_replay.prompts(targs, args.vocab)
        if not reqs:
            raise SystemExit(
                f"{args.trace}: no request of the first {args.trace_requests} fits the context "
                f"({limit} tokens less --output-length)"
            )
        first = [len(ids) for _, ids, _ in reqs[: min(8, args.max_parallel)]]
        out["trace"] = (trace_replay.workload(targs), len(reqs), (len(first), round(sum(first) / len(first))))
    return out


def run_config(
    args: argparse.Namespace, config: str, name: str, model: str, tmp: Path, log_dir: Path, todo: dict
) -> tuple[dict, dict[str, list[serving.Record]]]:
    """One configuration of a run: its servers started, every workload on them, their deaths.
    A server that exits (or hangs) while starting is a death; the workloads are then not run."""
    import httpx

    env = None
    if args.fresh_triton_cache:  # P and D share theirs: both compile, at once
        cache = tmp / f"triton-{config}"
        cache.mkdir()
        env = {**os.environ, "TRITON_CACHE_DIR": str(cache)}
    out: dict[str, Any] = {"workloads": {}, "died": []}
    records: dict[str, list[serving.Record]] = {}
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        try:
            server = stack.enter_context(
                serving.Server(
                    None,
                    model,
                    serving.server_flags(config, args, tmp),
                    log_dir,
                    pd=config == "pd",
                    name=f"{name}-{config}",
                    log_level="info" if args.log_dir else "warning",
                    devices=serving.devices(args),
                    env=env,
                )
            )
        except (RuntimeError, httpx.HTTPError) as e:  # ServerProcess.wait_ready: exited, or not ready
            out["died"] = [{"role": "starting", "returncode": None, "log": "", "tail": str(e)}]
        else:
            for wname, (workload, count, start) in todo.items():
                out["workloads"][wname], records[wname] = serving.measure(
                    args, server, f"{name} {wname} [{config}]", workload, count, start
                )
            out["died"] = server.deaths()
    out["seconds"] = time.perf_counter() - t0
    return out, records


def soak_run(args: argparse.Namespace, k: int, model: str, limit: int, log_dir: Path) -> dict:
    """Run ``k`` (from 1): both configurations on fresh servers, PD's answers against storage's."""
    rargs = argparse.Namespace(**{**vars(args), "seed": args.seed + k - 1})
    todo = workloads(rargs, limit)
    configs: dict[str, dict] = {}
    records: dict[str, dict[str, list[serving.Record]]] = {}
    with tempfile.TemporaryDirectory(prefix=f"kvtier-pd-soak-{k}-") as tmp_name:
        for config in CONFIGS:
            configs[config], records[config] = run_config(rargs, config, f"run{k}", model, Path(tmp_name), log_dir, todo)
    run: dict[str, Any] = dict.fromkeys(COUNTS, 0)
    run.update(run=k, first_mismatches=[], first_errors=[], died=[])
    for config, c in configs.items():
        run["deaths"] += len(c["died"])
        run["died"] += [dict(d, config=config) for d in c["died"]]
        for res in c["workloads"].values():
            failed, fivexx = res["failed"] + res["warmup"]["failed"], res["http_5xx"] + res["warmup"]["http_5xx"]
            run["requests"] += res["requests"]
            run["http_5xx"] += fivexx
            run["errors"] += failed - fivexx
            run["first_errors"] += [f"{config}: {e}" for e in res["errors"]][: 5 - len(run["first_errors"])]
    for wname in todo:
        same = serving.compare_outputs(records["storage"].get(wname, []), records["pd"].get(wname, []))
        for key in ("compared", "mismatches", "unknown"):
            run[key] += same[key]
        run["first_mismatches"] += [dict(m, workload=wname) for m in same["first_mismatches"]]
    run["configs"] = configs
    return run


def problem(run: dict) -> str | None:
    """The first thing wrong with a run, worst first (None: nothing)."""
    k = run["run"]
    if run["deaths"]:
        d = run["died"][0]
        return (
            f"run {k}: {run['deaths']} deaths; the first: {d['config']} {d['role']} "
            f"(exit {d['returncode']}, {d['log'] or 'no log'}):\n{d['tail']}"
        )
    if run["mismatches"]:
        m = run["first_mismatches"][0]
        return (
            f"run {k}: {run['mismatches']} of {run['compared']} PD answers differ from the colocated ones; "
            f"the first: {m['workload']} group {m['group']} round {m['round']} at token {m['position']} "
            f"({m['got']} instead of {m['expected']})"
        )
    if run["http_5xx"] or run["errors"]:
        return (
            f"run {k}: {run['http_5xx']} 5xx and {run['errors']} other failed requests, e.g. {(run['first_errors'] or ['?'])[0]}"
        )
    if run["unknown"]:
        return f"run {k}: {run['unknown']} PD answers could not be compared (no token ids on either side)"
    return None


def line(what: str, r: dict) -> str:
    return (
        f"{what}: {r['requests']} requests ({r['compared']} PD answers compared), {r['deaths']} deaths, "
        f"{r['http_5xx']} 5xx, {r['errors']} other errors, {r['mismatches']} mismatches, {r['unknown']} unknown"
    )


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kvtier bench pd-soak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--runs", type=positive_int, default=3, help="runs, each on fresh servers (default %(default)s)")
    ap.add_argument(
        "--fresh-triton-cache",
        action="store_true",
        help="each run's configurations start with an empty TRITON_CACHE_DIR of their own (a "
        "temporary directory): every kernel compiled while serving, as on a new machine",
    )
    multiturn.add_workload_flags(ap)
    ap.add_argument(
        "--trace",
        default=str(TRACE),
        metavar="FILE",
        help="Mooncake-format trace replayed after the conversations (default: "
        "traces/mooncake_conversation_1k.jsonl of this checkout)",
    )
    ap.add_argument(
        "--trace-requests",
        type=non_negative_int,
        default=16,
        help="its first N requests, at once (0: no trace) (default %(default)s)",
    )
    ap.add_argument(
        "--block-tokens",
        type=positive_int,
        default=16,
        help="tokens per Mooncake hash block (512: the trace's; default %(default)s)",
    )
    ap.set_defaults(clients=4, rounds=3, request_length=32, output_length=8, time_scale=0.0)
    serving.add_common_flags(ap, compare=False)
    ap.set_defaults(url=None)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    started = time.perf_counter()
    runs: list[dict] = []

    def report() -> tuple[dict, list[str]]:  # --json after every run: a run cut short keeps the others
        total = {key: sum(r[key] for r in runs) for key in COUNTS}
        problems = [p for p in map(problem, runs) if p]
        if args.json:
            out = {"bench": "pd-soak", "args": vars(args), "total": total, "problems": problems, "runs": runs}
            Path(args.json).write_text(json.dumps(out, indent=1, default=str))
        return total, problems

    with tempfile.TemporaryDirectory(prefix="kvtier-pd-soak-") as tmp_name:
        model, args.vocab = serving.resolve_model(args, Path(tmp_name))
        assert model is not None  # (no --url: the soak starts its own servers)
        limit = args.max_model_len = args.served_max_model_len = serving.served_max_model_len(args, model)
        if args.rounds * (args.request_length + args.output_length) > limit:
            raise SystemExit(
                f"a conversation grows to {args.rounds * (args.request_length + args.output_length)} "
                f"tokens (--rounds x (--request-length + --output-length)), over the context, {limit}"
            )
        log_dir = Path(args.log_dir or tmp_name)
        log_dir.mkdir(parents=True, exist_ok=True)
        for k in range(1, args.runs + 1):
            runs.append(soak_run(args, k, model, limit, log_dir))
            c = runs[-1]["configs"]
            print(
                line(f"run {k}/{args.runs}", runs[-1])
                + f" [storage {c['storage']['seconds']:.0f} s, pd {c['pd']['seconds']:.0f} s]",
                flush=True,
            )
            total, problems = report()
    print(line(f"total of {args.runs} runs", total) + f" ({time.perf_counter() - started:.0f} s)")
    if problems:
        raise SystemExit(f"kvtier bench pd-soak: {len(problems)} of {args.runs} runs failed; {problems[0]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
