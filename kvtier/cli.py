"""The ``kvtier`` command. Each subcommand imports what it needs when it runs.

Over 600 lines: it is the flag table of every subcommand (the engine's flags come from
EngineConfig.add_flags, as the benches' do; each bench parses its own flags in its module)."""

from __future__ import annotations

import argparse
import sys

from kvtier.flags import add_json_flag, non_negative_int, positive_int, write_json
from kvtier.flags import non_negative_float as _non_negative_float
from kvtier.flags import port as _port
from kvtier.flags import positive_float as _positive_float
from kvtier.serve.guard import DEFAULTS as CONNECTION_DEFAULTS
from kvtier.serve.guard import FD_MARGIN, ConnectionLimits
from kvtier.serve.route import POLICIES

# kvtier.model.presets.PRESETS, named here so that `kvtier --help` does not import torch
# (tests/test_cli.py keeps the two equal).
PRESET_NAMES = (
    "llama-tiny",
    "mistral-tiny",
    "qwen2-tiny",
    "qwen3-tiny",
    "mixtral-tiny",
    "qwen2-moe-tiny",
    "qwen3-moe-tiny",
    "qwen3-moe-demo",
    "qwen3-0.6b-shape",
    "qwen3-moe-small",
    "llama3-8b-shape",
    "qwen3-mtp-tiny",
    "qwen3-moe-mtp-tiny",
    "llama3-8b-mtp-shape",
    "llama3-70b-shape",
    "deepseek-v3-tiny",
    "deepseek-v3-mtp-tiny",
    "deepseek-v2-lite-tiny",
    "deepseek-v3-shape",
    "gpt-oss-tiny",
    "gemma2-tiny",
    "gemma3-tiny",
    "gpt-oss-20b-shape",
    "gemma3-12b-shape",
    "llava-tiny",
    "llava-1.5-7b-shape",
)
# Every `kvtier bench NAME`: the module whose main(argv) parses its own flags, and its line in
# `kvtier bench --help`.
BENCHES = {
    "cache": ("kvtier.bench.cache_bench", "CPU: cost of the cache manager per request (match, allocate, commit, free)"),
    "peers": (
        "kvtier.bench.peers",
        "CPU: the same per request, kvtier vs vLLM's and SGLang's prefix caches (pip install 'kvtier[peers]')",
    ),
    "throughput": ("kvtier.bench.throughput", "GPU: engine tokens/s vs HF transformers generate"),
    "kv-quality": (
        "kvtier.bench.kv_quality",
        "CPU or GPU: greedy agreement and per-token KL of an fp8 KV cache against the compute dtype's",
    ),
    "experts": ("kvtier.bench.experts_bench", "GPU: tokens/s with R3 routing capture on vs off"),
    "speculative": (
        "kvtier.bench.spec_bench",
        "decode tokens/s with MTP speculative decoding vs without, drafts of a controlled acceptance (--device cpu: tiny)",
    ),
    "attention": (
        "kvtier.bench.attention_bench",
        "GPU: paged attention, Triton vs torch reference vs SDPA (--smoke: tiny shapes on CPU)",
    ),
    "transfer": ("kvtier.bench.transfer_bench", "GPU: host<->device copy GB/s vs a contiguous pinned copy"),
    "overlap": ("kvtier.bench.overlap_bench", "GPU: host-hit TTFT vs device hit and recompute; decode with backups"),
    "storage": (
        "kvtier.bench.storage_bench",
        "CPU or GPU: pool put/get GB/s vs its raw client; --ttft: TTFT served from storage vs recompute",
    ),
    "pd": (
        "kvtier.bench.pd_bench",
        "CPU or GPU: prefill/decode disaggregation through a pool vs one colocated server (TTFT, ITL, hand-off GB/s)",
    ),
    "rollout": (
        "kvtier.bench.rollout_bench",
        "GPU: n=8 samples on one prompt vs 8 requests (time, blocks held); decode with logprobs on vs off",
    ),
    "vlm-chat": (
        "kvtier.bench.vlm_chat",
        "GPU or CPU: a multi-turn chat resending its image vs the same chat without it (TTFT, tower runs)",
    ),
    "multiturn": (
        "kvtier.bench.multiturn",
        "any OpenAI server (--url) or kvtier's: multi-turn chat, histories "
        "resent each round; TTFT/ITL/throughput per --compare config",
    ),
    "longdoc": (
        "kvtier.bench.longdoc",
        "any OpenAI server or kvtier's: long documents asked several times (tile/interleave/random); TTFT per round",
    ),
    "trace": ("kvtier.bench.trace_replay", "any OpenAI server or kvtier's: replay a Mooncake-format trace at its timestamps"),
    "pd-soak": (
        "kvtier.bench.pd_soak",
        "CPU or GPU: PD on its own devices vs colocated, run after run on "
        "fresh servers: every greedy answer identical, 0 deaths, 0 5xx",
    ),
    "flood": (
        "kvtier.bench.flood",
        "CPU or GPU: generation tokens/s and /health latency while connections flood /health, 401s or hostile bodies",
    ),
    "soak": (
        "kvtier.bench.soak",
        "CPU or GPU: thousands of mixed, bad and hung-up HTTP requests against a "
        "server with every tier; checks 5xx, leaks, answers, /health latency",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvtier", description="Tiered KV cache for LLM serving, with its inference engine.")
    ap.add_argument("--version", action="version", version=f"kvtier {__import__('kvtier').__version__}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")

    sub.add_parser(
        "sim",
        help="replay a request trace through the cache manager (no model)",
        add_help=False,  # `kvtier sim --help`: kvtier/bench/sim.py's parser
    )
    p = sub.add_parser(
        "bench",
        help="benchmarks: " + ", ".join(BENCHES),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run a benchmark (`kvtier bench NAME --help` lists its flags):\n"
        + "\n".join(f"  {name:<11} {line}" for name, (_, line) in BENCHES.items()),
    )
    p.add_argument("name", choices=tuple(BENCHES), help="which benchmark")
    p = sub.add_parser(
        "init-model",
        help="write a small random HF-format checkpoint",
        description="Write a random Hugging Face checkpoint (config.json, safetensors, "
        "tokenizer) that transformers and kvtier both load; with --config-only, "
        "no weights (load it with --load-format dummy).",
    )
    p.add_argument("preset", metavar="PRESET", help="one of: " + ", ".join(PRESET_NAMES))
    p.add_argument("dir", help="output directory")
    p.add_argument("--seed", type=int, default=0, help="weights seed (default 0)")
    p.add_argument(
        "--dtype", choices=("float32", "bfloat16", "float16"), default=None, help="weights dtype (default: the preset's)"
    )
    p.add_argument(
        "--config-only",
        action="store_true",
        help="write config.json, generation config and tokenizer but no weights, without building "
        "the model (instant for any shape, e.g. llama3-8b-shape); load with --load-format dummy",
    )

    p = sub.add_parser(
        "generate",
        help="generate from a prompt with the offline engine",
        description="Run kvtier.LLM(MODEL, ...).generate on one prompt and print the result.",
    )
    _add_model_arg(p)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt", help="prompt text (needs a tokenizer in the model directory)")
    g.add_argument("--prompt-ids", help="prompt token ids, comma separated, e.g. 1,2,3")
    _add_llm_flags(p)
    p.add_argument("--max-tokens", type=positive_int, default=16, help="tokens to generate (default 16)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0)")
    p.add_argument("--top-k", type=non_negative_int, default=0, help="sample from the k best tokens; 0 = off (default 0)")
    p.add_argument(
        "--min-p",
        type=float,
        default=0.0,
        help="drop tokens less likely than MIN_P x the likeliest (after temperature); 0 = off (default 0)",
    )
    p.add_argument(
        "--sampling-seed", type=int, default=None, help="per-request sampling seed (sample i of --n draws with seed + i)"
    )
    p.add_argument(
        "--n", type=positive_int, default=1, help="samples of the prompt (one prefill, n decodes sharing its KV; default 1)"
    )
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    p.add_argument(
        "--logprobs",
        type=non_negative_int,
        default=None,
        metavar="K",
        help="per generated token: its logprob and the K most likely (0..20; printed with --json)",
    )
    p.add_argument(
        "--prompt-logprobs",
        type=non_negative_int,
        default=None,
        metavar="K",
        help="the same per prompt token (the whole prompt is computed; printed with --json)",
    )
    p.add_argument(
        "--presence-penalty",
        type=float,
        default=0.0,
        help="-2..2, subtracted once from the logit of every token generated so far (default 0)",
    )
    p.add_argument(
        "--frequency-penalty",
        type=float,
        default=0.0,
        help="-2..2, subtracted per occurrence from the logit of tokens generated so far (default 0)",
    )
    p.add_argument(
        "--repetition-penalty",
        type=_positive_float,
        default=1.0,
        help="> 1 discourages every token of the prompt and output (HF's; default 1)",
    )
    p.add_argument("--min-tokens", type=non_negative_int, default=0, help="no EOS or stop token before this many (default 0)")
    p.add_argument(
        "--stop", action="append", default=[], metavar="TEXT", help="end the output before this text (repeat for several)"
    )
    p.add_argument(
        "--skip-special-tokens",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="leave special tokens (EOS...) out of the text (default: on)",
    )
    p.add_argument("--return-routed-experts", action="store_true", help="print the routed experts' shape (MoE)")
    p.add_argument("--repeat", type=positive_int, default=1, help="run the prompt N times (shows prefix hits)")
    add_json_flag(p, "each run's result (one object per --repeat)")

    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (colocated, or the prefill/decode side of PD)",
        description="Serve MODEL over an OpenAI-compatible API: POST /v1/completions, "
        "/v1/chat/completions (SSE streaming), GET /v1/models, /health, /metrics. "
        "--role prefill|decode with a shared --storage pool runs one side of "
        "prefill/decode disaggregation (put `kvtier router` in front).",
    )
    _add_model_arg(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=_port, default=8000, help="port, 1..65535 (default 8000)")
    p.add_argument(
        "--role",
        choices=("colocated", "prefill", "decode"),
        default="colocated",
        help="colocated: whole requests; prefill: runs prefills for the router and writes their "
        "KV to --storage; decode: continues them from the pool (default colocated)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/* and /kvtier/* (default: $KVTIER_API_KEY, "
        "else none; the variable keeps the key out of `ps`)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=positive_int,
        default=None,
        help="largest request body; larger ones get 413 before any parsing (default 16 MiB)",
    )
    p.add_argument(
        "--allowed-media-domains",
        default=None,
        metavar="HOSTS",
        help="vision-language models: comma-separated host names whose http(s) image URLs the server fetches "
        "(no redirects, within --max-image-bytes, 10 s timeout); default none: images come as data: URLs, "
        "other URLs get 400 (a server that fetches any URL is an SSRF hole)",
    )
    p.add_argument(
        "--require-cache-salt",
        action="store_true",
        help="refuse requests without cache_salt (400): cached_tokens would tell a client whether "
        "another tenant sent the same prefix (docs/SERVING.md)",
    )
    p.add_argument(
        "--expose-config",
        action="store_true",
        help="let /health (which needs no API key) show the model's path and the storage pool's "
        "address and errors (default: only states and counts; /server_info, behind the key, "
        "always shows the configuration, its passwords masked)",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients send and /v1/models lists (default: the hub id as given, or the model "
        "directory's name); the model's path and hub id are accepted too",
    )
    p.add_argument(
        "--max-queue",
        type=positive_int,
        default=1024,
        help="samples (each prompt's n) waiting for admission before new requests get 503; "
        "a request asking for more samples than this gets 400 (default 1024)",
    )
    p.add_argument(
        "--log-level",
        choices=("critical", "error", "warning", "info", "debug"),
        default="info",
        help="log level of uvicorn and kvtier (default info)",
    )
    p.add_argument(
        "--log-stats-interval",
        type=_non_negative_float,
        default=10.0,
        metavar="SECONDS",
        help="while it has work, the engine logs one INFO line every SECONDS: tokens/s, requests "
        "running and waiting, blocks used per tier, copies and exports pending (0: never; "
        "default 10)",
    )
    _add_connection_flags(p)
    _add_llm_flags(p)

    p = sub.add_parser(
        "router",
        help="OpenAI-compatible front of several instances (--workers) or of prefill and decode servers (PD)",
        description="With --workers: route each request to one of several colocated kvtier "
        "servers, by --policy (cache_aware: where its prefix is cached, fed by each server's KV "
        "events; least_load; round_robin). With --prefill/--decode: route each request to a "
        "prefill server (which writes the prompt's KV to the shared pool) and then to a decode "
        "server (which reads it from there); a failed prefill side runs the request colocated "
        "on a decode server.",
    )
    p.add_argument(
        "--workers",
        action="append",
        default=[],
        metavar="URL,URL",
        help="colocated kvtier servers, comma-separated or repeated, e.g. http://127.0.0.1:8001,http://127.0.0.1:8002",
    )
    p.add_argument(
        "--policy",
        choices=POLICIES,
        default=None,
        help="which instance takes a request: cache_aware (the longest cached prefix, device hits "
        "first, among instances not overloaded), least_load (the least uncached work in flight) or "
        "round_robin; under PD it picks the prefill server and the decode server (default: "
        "cache_aware with --workers, round_robin for PD)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="NAME_OR_PATH",
        help="cache_aware: the served model's tokenizer, to key text prompts as the servers do "
        "(default: the model directory the servers name in /v1/models)",
    )
    p.add_argument(
        "--events-interval",
        type=_positive_float,
        default=0.1,
        help="cache_aware: seconds between polls of each server's KV events (default 0.1)",
    )
    p.add_argument(
        "--storage",
        default=None,
        metavar="URL",
        help="cache_aware: the pool the servers share (their --storage), asked how much of each "
        "prompt it holds: those blocks count for every server, at a quarter of a device hit (default: none)",
    )
    p.add_argument(
        "--prefill",
        action="append",
        default=[],
        metavar="URL",
        help="a prefill server, e.g. http://127.0.0.1:8100 (repeat for several)",
    )
    p.add_argument("--decode", action="append", default=[], metavar="URL", help="a decode server (repeat for several)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=_port, default=8000, help="port, 1..65535 (default 8000)")
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' from clients on /v1/* (default: $KVTIER_API_KEY, else none)",
    )
    p.add_argument(
        "--backend-api-key", default=None, help="key the router sends to P and D (default: $KVTIER_BACKEND_API_KEY, else none)"
    )
    p.add_argument(
        "--max-body-bytes",
        type=positive_int,
        default=None,
        help="largest request body; larger ones get 413 before any parsing (default 16 MiB)",
    )
    p.add_argument("--timeout", type=_positive_float, default=600.0, help="seconds a request to P or D may take (default 600)")
    p.add_argument(
        "--expose-config",
        action="store_true",
        help="let /health and /metrics (which need no API key) name the servers by URL (default: "
        "by role and number, e.g. decode0, worker1)",
    )
    p.add_argument(
        "--health-interval",
        type=_positive_float,
        default=None,
        help="seconds between health checks of every server (default 2; 0.5 with --workers)",
    )
    p.add_argument(
        "--log-level",
        choices=("critical", "error", "warning", "info", "debug"),
        default="info",
        help="log level of uvicorn and kvtier (default info)",
    )
    _add_connection_flags(p)

    p = sub.add_parser(
        "demo",
        help="multi-turn workload through all three tiers (start here)",
        description="Write a small random MoE checkpoint, run a multi-turn chat workload "
        "through device, host and storage tiers, print hits per tier and TTFT "
        "against recompute.",
    )
    p.add_argument("--model", default=None, help="use this model (a directory or a hub id) instead of a fresh random one")
    p.add_argument("--clients", type=positive_int, default=4, help="concurrent conversations (default 4)")
    p.add_argument("--turns", type=positive_int, default=4, help="turns per conversation (default 4)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        default="auto",
        help="compute dtype; auto = the checkpoint's on cuda (bfloat16), float32 on cpu (default auto)",
    )
    p.add_argument(
        "--storage", default=None, help="storage pool URL (default: file:// in a temporary directory, removed at the end)"
    )

    p = sub.add_parser(
        "pool",
        help="start a local storage pool: `kvtier pool mooncake --port P --size 4GiB`",
        description="`kvtier pool mooncake --port P --size 4GiB` starts a Mooncake master and one "
        "pool node contributing SIZE of memory on 127.0.0.1 and prints the URL to pass "
        "as --storage; `kvtier pool mooncake --help` lists its flags.",
    )
    p.add_argument("kind", choices=("mooncake",), help="which pool")
    return ap


def _add_model_arg(p: argparse.ArgumentParser) -> None:
    """MODEL as a positional argument or as ``--model`` (vLLM takes both)."""
    what = "a checkpoint directory or a Hugging Face hub id (e.g. Qwen/Qwen3-0.6B; --revision picks its version)"
    p.add_argument("model", nargs="?", metavar="MODEL", help=what)
    p.add_argument(
        "--model",
        "--model-path",
        dest="model_flag",
        default=None,
        metavar="MODEL",
        help="MODEL given as a flag (vLLM's, SGLang's)",
    )


def _model(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``args.model`` from the positional argument or ``--model``; a usage error without either
    or with two different ones."""
    flag = args.__dict__.pop("model_flag", None)
    if args.model is not None and flag is not None and args.model != flag:
        ap.error(f"{args.command}: MODEL given twice, as {args.model!r} and --model {flag!r}")
    args.model = args.model or flag
    if args.model is None:
        ap.error(f"{args.command}: give MODEL (a checkpoint directory or a hub id), as an argument or --model")


def _add_connection_flags(p: argparse.ArgumentParser) -> None:
    """The bounds on HTTP connections (kvtier/serve/guard.py), the same for the server and the router."""
    d = CONNECTION_DEFAULTS
    g = p.add_argument_group("connections and timeouts (docs/SERVING.md)")
    g.add_argument(
        "--header-timeout",
        type=_positive_float,
        default=d["header_timeout"],
        metavar="SECONDS",
        help="a request's headers must arrive within SECONDS of the connection opening (on a kept-alive "
        f"connection: of the request's first byte), else 408 and the connection closes (default {d['header_timeout']:g})",
    )
    g.add_argument(
        "--body-min-rate",
        type=_non_negative_float,
        default=d["body_min_rate"],
        metavar="BYTES_PER_S",
        help="a request body must arrive at BYTES_PER_S at least, measured over windows of --header-timeout, "
        f"else 408 and the connection closes (0: no minimum; default {d['body_min_rate']:g})",
    )
    g.add_argument(
        "--timeout-keep-alive",
        type=_positive_float,
        default=d["keep_alive_timeout"],
        metavar="SECONDS",
        help=f"close a kept-alive connection idle for SECONDS (uvicorn's; default {d['keep_alive_timeout']:g})",
    )
    g.add_argument(
        "--max-connections-per-client",
        type=positive_int,
        default=d["max_connections_per_client"],
        metavar="N",
        help="open connections from one client address; the next gets 429 and is closed (behind a proxy or "
        f"`kvtier router`, every client shares the proxy's address; default {d['max_connections_per_client']})",
    )
    g.add_argument(
        "--max-connections",
        type=positive_int,
        default=d["max_connections"],
        metavar="N",
        help="open connections in all; the next gets 503 and is closed; never more than the open-file limit "
        f"less {FD_MARGIN} (default {d['max_connections']})",
    )
    g.add_argument(
        "--cheap-request-rate",
        type=_non_negative_float,
        default=d["cheap_request_rate"],
        metavar="PER_S",
        help="GET /health answers and 401s per second per client address, in bursts of up to twice as many; "
        "over it, that address's connections are not read until it is back under (0: no limit; "
        f"default {d['cheap_request_rate']:g})",
    )


def connection_limits(args: argparse.Namespace) -> ConnectionLimits:
    return ConnectionLimits(
        header_timeout=args.header_timeout,
        body_min_rate=args.body_min_rate,
        keep_alive_timeout=args.timeout_keep_alive,
        max_connections_per_client=args.max_connections_per_client,
        max_connections=args.max_connections,
        cheap_request_rate=args.cheap_request_rate,
    )


def _add_llm_flags(p: argparse.ArgumentParser) -> None:
    """Every engine option (kvtier/engine/config.py, DESIGN §6) as a flag."""
    from kvtier.engine.config import EngineConfig

    EngineConfig.add_flags(p)


def _engine_config(args: argparse.Namespace):
    from kvtier.engine.config import EngineConfig

    return EngineConfig.from_args(args)


def _generate(args) -> int:
    import json

    import kvtier

    if args.prompt_ids is not None:
        try:
            prompt = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError:
            raise ValueError(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}") from None
    else:
        prompt = args.prompt
    sp = kvtier.SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.sampling_seed,
        ignore_eos=args.ignore_eos,
        return_routed_experts=args.return_routed_experts,
        skip_special_tokens=args.skip_special_tokens,
        n=args.n,
        logprobs=args.logprobs,
        prompt_logprobs=args.prompt_logprobs,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        min_tokens=args.min_tokens,
        stop=tuple(args.stop),
    )
    results: list[dict] = []
    with kvtier.LLM(args.model, _engine_config(args)) as llm:
        for _ in range(args.repeat):
            o = llm.generate([prompt], sp)[0]
            res = {
                "token_ids": o.token_ids,
                "text": o.text,
                "finish_reason": o.finish_reason,
                "num_cached_tokens": o.num_cached_tokens,
                "cached_tokens_by_tier": o.cached_tokens_by_tier,
            }
            if o.routed_experts is not None:
                res["routed_experts_shape"] = list(o.routed_experts.shape)
                res["routed_experts_dtype"] = str(o.routed_experts.dtype)
            if sp.logprobs is not None:  # [{token id: logprob}] per generated token
                res["logprobs"] = o.outputs[0].logprobs
            if sp.prompt_logprobs is not None:  # per prompt token; the first: null
                res["prompt_logprobs"] = o.prompt_logprobs
            if args.n > 1:  # the fields above are sample 0's
                res["samples"] = [
                    {"index": c.index, "token_ids": c.token_ids, "text": c.text, "finish_reason": c.finish_reason}
                    for c in o.outputs
                ]
                if sp.logprobs is not None:
                    for sample, c in zip(res["samples"], o.outputs):
                        sample["logprobs"] = c.logprobs
            results.append(res)
            if args.json == "-":
                print(json.dumps(res))
            else:
                if o.text is not None:
                    print(o.text)
                print(
                    f"token_ids={o.token_ids} finish={o.finish_reason} cached={o.num_cached_tokens} "
                    f"{o.cached_tokens_by_tier}"
                    + (f" routed_experts={res['routed_experts_shape']}" if o.routed_experts is not None else "")
                )
                if res.get("logprobs") is not None:
                    print("logprobs=" + str([round(lps[t], 4) for t, lps in zip(o.token_ids, res["logprobs"])]))
                for c in o.outputs[1:]:
                    if c.text is not None:
                        print(c.text)
                    print(f"sample {c.index}: token_ids={c.token_ids} finish={c.finish_reason}")
    if args.json != "-":
        write_json(args.json, results)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if len(argv) >= 2 and argv[0] == "bench" and argv[1] in BENCHES:  # each parses its own flags
        import importlib

        return importlib.import_module(BENCHES[argv[1]][0]).main(argv[2:]) or 0
    if argv and argv[0] == "sim":
        from kvtier.bench import sim

        try:
            return sim.main(argv[1:])
        except (ValueError, FileNotFoundError) as e:
            print(f"kvtier sim: error: {e}", file=sys.stderr)
            return 2
    if len(argv) >= 2 and argv[0] == "pool" and argv[1] == "mooncake":
        from kvtier.storage import mooncake_launch

        return mooncake_launch.main(argv[2:])
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.command in ("serve", "generate"):
        _model(ap, args)
    if args.command is None:
        ap.print_help()
        return 0
    try:
        if args.command == "init-model":
            from kvtier.model import init_model

            path = init_model(args.preset, args.dir, seed=args.seed, dtype=args.dtype, config_only=args.config_only)
            print(f"wrote {args.preset} to {path}")
            return 0
        if args.command == "generate":
            return _generate(args)
        if args.command == "serve":
            from kvtier.serve.server import serve

            return serve(
                args.model,
                host=args.host,
                port=args.port,
                role=args.role,
                api_key=args.api_key,
                served_model_name=args.served_model_name,
                max_queue=args.max_queue,
                log_level=args.log_level,
                max_body_bytes=args.max_body_bytes,
                require_cache_salt=args.require_cache_salt,
                allowed_media_domains=args.allowed_media_domains,
                expose_config=args.expose_config,
                limits=connection_limits(args),
                log_stats_interval=args.log_stats_interval,
                config=_engine_config(args),
            )
        if args.command == "router":
            from kvtier.serve.server import route

            workers = [u.strip() for w in args.workers for u in w.split(",") if u.strip()]
            if not workers and not args.decode:
                raise ValueError("kvtier router needs --workers URL,... (colocated instances) or --decode URL (PD)")
            route(
                args.prefill,
                args.decode,
                host=args.host,
                port=args.port,
                log_level=args.log_level,
                api_key=args.api_key,
                backend_api_key=args.backend_api_key,
                timeout=args.timeout,
                health_interval=args.health_interval or (0.5 if workers else 2.0),
                max_body_bytes=args.max_body_bytes,
                workers=workers,
                policy=args.policy or ("cache_aware" if workers else "round_robin"),
                tokenizer=args.tokenizer,
                events_interval=args.events_interval,
                storage=args.storage,
                expose_config=args.expose_config,
                limits=connection_limits(args),
            )
            return 0
        if args.command == "demo":
            from kvtier.demo import run_demo

            run_demo(
                model_dir=args.model,
                clients=args.clients,
                turns=args.turns,
                device=args.device,
                storage=args.storage,
                dtype=args.dtype,
            )
            return 0
        if args.command == "bench":  # (a bench name is handled above)
            ap.parse_args(["bench", "--help"])
    except (ValueError, FileNotFoundError) as e:
        print(f"kvtier {args.command}: error: {e}", file=sys.stderr)
        return 2
    ap.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
