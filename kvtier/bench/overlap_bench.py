"""``kvtier bench overlap`` (GPU): does a host-tier hit pay off, and do backups stay out of the way?

TTFT of one request = an ``--prefix``-token cached prefix (default 8K) + ``--new`` new tokens (512),
with the prefix

    device      still in device memory (a device hit: only the new tokens are computed)
    host        only in the host tier (loaded layer by layer while the new tokens are computed)
    recompute   nowhere (the whole prompt is computed)

on ``llama3-8b-shape`` and ``qwen3-0.6b-shape`` with dummy weights (a config.json is written to a
temporary directory). The link bandwidth is measured in the same run (a contiguous pinned copy of
the prefix's KV bytes), giving the bound a perfect overlap reaches: ``max(device TTFT, prefix KV
bytes / link)``. Then decode throughput (``--decode-requests`` sequences) with write_through
backups running vs with no host tier.

Goals: host TTFT <= 1.1 x max(device TTFT, bytes / link); host <= 0.3 x recompute on the 8B
shape; decode with backups >= 0.97 x decode without.

``--tensor-parallel-sizes 1,2`` runs each case at each size (GPUs 0..N-1): with N ranks each
loads its 1/N of the prefix over its own link, so the bound is ``max(device TTFT, bytes / N /
link)``; the decode lines add the step time against the first size's.

    kvtier bench overlap [--models llama3-8b-shape,qwen3-0.6b-shape] [--tensor-parallel-sizes 1,2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvtier.engine.config import EngineConfig


def _ttft(llm, prompt: list[int]):
    import kvtier

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = llm.generate([prompt], kvtier.SamplingParams(max_tokens=1, ignore_eos=True))[0]
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    return dt, out


def _link_gbps(nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=True)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return nbytes / statistics.median(times) / 1e9


def ttft_case(
    path: Path, prefix_len: int, new_len: int, repeat: int, block_size: int = 16, cuda_graphs: bool | None = None, tp: int = 1
) -> dict:
    import kvtier

    cfg = kvtier.model.ModelConfig.from_hf_dir(path)
    rng = random.Random(0)
    vocab = cfg.vocab_size

    def tokens(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    need = -(-(prefix_len + new_len + 1) // block_size)
    # device tier: one request and a little more, so filler prompts (twice its blocks, even for
    # a one-block prefix) push the prefix out; host tier: room for the prefix and the fillers
    fillers = 1 + -(-2 * (need + 16) // need)
    llm = kvtier.LLM(
        path,
        device="cuda",
        dtype="bfloat16",
        load_format="dummy",
        block_size=block_size,
        num_device_blocks=need + 16,
        num_host_blocks=(fillers + 2) * need,
        write_policy="write_through",
        max_num_batched_tokens=prefix_len + new_len + 64,
        max_model_len=prefix_len + new_len + 64,
        cuda_graphs=cuda_graphs,
        tensor_parallel_size=tp,
    )
    try:
        prefix = tokens(prefix_len)
        # warm-up: compile kernels for these shapes, on every path (device hit, host hit, cold)
        _ttft(llm, prefix + tokens(new_len))
        _ttft(llm, prefix + tokens(new_len))
        _ttft(llm, tokens(prefix_len + new_len))
        _ttft(llm, prefix + tokens(new_len))
        res: dict[str, list[float]] = {"device": [], "host": [], "recompute": []}
        host_tokens: list[int] = []

        def check(ok: bool, what: str, out) -> None:
            if not ok:
                raise RuntimeError(
                    f"bench overlap (prefix {prefix_len}, new {new_len}): {what}; "
                    f"cached tokens by tier {out.cached_tokens_by_tier}"
                )

        for _ in range(repeat):
            _ttft(llm, prefix + tokens(1))  # prefix on device (and host)
            dt, out = _ttft(llm, prefix + tokens(new_len))
            check(out.cached_tokens_by_tier["device"] >= prefix_len - block_size, "the device hit missed", out)
            res["device"].append(dt)
            for _ in range(fillers):  # evict the prefix from device
                _ttft(llm, tokens(prefix_len + new_len))
            dt, out = _ttft(llm, prefix + tokens(new_len))
            # LRU keeps the prefix's head on device if the filler left room: most must come from host
            check(out.cached_tokens_by_tier["host"] >= 0.9 * prefix_len, "the host hit missed", out)
            host_tokens.append(out.cached_tokens_by_tier["host"])
            res["host"].append(dt)
            dt, out = _ttft(llm, tokens(prefix_len + new_len))
            check(out.num_cached_tokens == 0, "the recompute case hit the cache", out)
            res["recompute"].append(dt)
        kv_bytes_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
        prefix_bytes = min(host_tokens) * kv_bytes_per_token  # what the host hit loaded
        link = _link_gbps(prefix_bytes)
        med = {k: statistics.median(v) for k, v in res.items()}
        bound = max(med["device"], prefix_bytes / tp / (link * 1e9))  # each rank loads its heads' share
        return {
            "tensor_parallel_size": tp,
            "prefix_tokens": prefix_len,
            "new_tokens": new_len,
            "prefix_kv_bytes": prefix_bytes,
            "link_GBps": link,
            "ttft_s": med,
            "ttft_all_s": res,
            "overlap_bound_s": bound,
            "host_vs_bound": med["host"] / bound,
            "host_vs_recompute": med["host"] / med["recompute"],
            "host_load_GBps_effective": prefix_bytes / med["host"] / 1e9,
        }
    finally:
        llm.close()


def decode_case(
    path: Path,
    num_requests: int,
    prompt_len: int,
    max_tokens: int,
    order: tuple[str, ...] = ("without", "with_backups"),
    tp: int = 1,
) -> dict:
    import kvtier

    cfg = kvtier.model.ModelConfig.from_hf_dir(path)
    rng = random.Random(1)
    prompts = [[rng.randrange(cfg.vocab_size) for _ in range(prompt_len)] for _ in range(num_requests)]
    blocks = 2 * num_requests * -(-(prompt_len + max_tokens) // 16)  # room enough: no preemption
    out = {}
    for name in order:
        host_blocks = 0 if name == "without" else 2 * blocks
        llm = kvtier.LLM(
            path,
            device="cuda",
            dtype="bfloat16",
            load_format="dummy",
            num_device_blocks=blocks,
            num_host_blocks=host_blocks,
            write_policy="write_through",
            max_model_len=prompt_len + max_tokens + 16,
            max_num_seqs=num_requests,
            tensor_parallel_size=tp,
        )
        try:
            params = kvtier.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            warm = [[rng.randrange(cfg.vocab_size) for _ in range(prompt_len)] for _ in range(num_requests)]
            llm.generate(warm, params)  # the same shapes: compiles and captures everything
            # prefill separately, so the timed part is decode
            llm.generate(prompts, kvtier.SamplingParams(max_tokens=1, ignore_eos=True))
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            toks = sum(len(o.token_ids) for o in outs)
            stats = llm.cache_stats()
            out[name] = {
                "tokens_per_s": toks / dt,
                "step_s": dt / max_tokens,  # every step decodes the whole batch
                "seconds": dt,
                "bytes_backed_up": stats["host"]["bytes_in"],
                "preemptions": llm.scheduler.num_preemptions,
            }
        finally:
            llm.close()
    out["ratio"] = out["with_backups"]["tokens_per_s"] / out["without"]["tokens_per_s"]
    return out


def one_size(path: Path, name: str, tp: int, args: argparse.Namespace, first: dict | None) -> dict:
    """Both cases at one tensor-parallel size, printed as they finish."""
    r: dict[str, Any] = {"ttft": ttft_case(path, args.prefix, args.new, args.repeat, cuda_graphs=args.cuda_graphs, tp=tp)}
    t = r["ttft"]
    print(
        f"{name} TP={tp}: TTFT device {t['ttft_s']['device'] * 1e3:.1f} ms, host {t['ttft_s']['host'] * 1e3:.1f} ms, "
        f"recompute {t['ttft_s']['recompute'] * 1e3:.1f} ms; link {t['link_GBps']:.1f} GB/s, "
        f"bound {t['overlap_bound_s'] * 1e3:.1f} ms; host/bound {t['host_vs_bound']:.2f} (goal <= 1.1), "
        f"host/recompute {t['host_vs_recompute']:.2f}",
        flush=True,
    )
    if not args.skip_decode:
        r["decode"] = d = decode_case(path, args.decode_requests, args.decode_prompt, args.decode_tokens, tp=tp)
        vs = ""
        if first is not None and "decode" in first:
            r["decode"]["step_vs_first_size"] = ratio = d["without"]["step_s"] / first["decode"]["without"]["step_s"]
            vs = f"; step time {ratio:.2f}x the first size's"
        print(
            f"{name} TP={tp}: decode {d['without']['tokens_per_s']:.0f} tok/s without backups "
            f"({d['without']['step_s'] * 1e3:.2f} ms/step at batch {args.decode_requests}), "
            f"{d['with_backups']['tokens_per_s']:.0f} with write_through backups "
            f"({d['with_backups']['bytes_backed_up'] / 2**20:.0f} MiB backed up): ratio {d['ratio']:.3f} "
            f"(goal >= 0.97){vs}",
            flush=True,
        )
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="kvtier bench overlap", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--models",
        default="llama3-8b-shape,qwen3-0.6b-shape",
        help="presets (dummy weights) or model directories, comma separated",
    )
    ap.add_argument("--prefix", type=int, default=8192, help="cached prefix tokens (default 8192)")
    ap.add_argument("--new", type=int, default=512, help="new tokens after the prefix (default 512)")
    ap.add_argument("--repeat", type=int, default=3, help="TTFT runs per case; the median is reported (default 3)")
    ap.add_argument("--decode-requests", type=int, default=64, help="sequences in the decode run (default 64)")
    ap.add_argument("--decode-prompt", type=int, default=512, help="prompt tokens per decode sequence (default 512)")
    ap.add_argument("--decode-tokens", type=int, default=256, help="tokens generated per sequence (default 256)")
    ap.add_argument("--skip-decode", action="store_true", help="only the TTFT cases")
    ap.add_argument(
        "--tensor-parallel-sizes",
        default="1",
        help="comma-separated tensor-parallel sizes; each case runs at each (default 1)",
    )
    ap.add_argument("--json", default=None, help="write the results to this file")
    # the TTFT cases' CUDA graphs (--enforce-eager: the eager forward's per-layer event waits)
    EngineConfig.add_flags(ap, only=("cuda_graphs",))
    args = ap.parse_args(argv)
    try:
        sizes = [int(x) for x in args.tensor_parallel_sizes.split(",")]
    except ValueError:
        ap.error(f"--tensor-parallel-sizes must be integers separated by commas, got {args.tensor_parallel_sizes!r}")
    if any(n < 1 for n in sizes):
        ap.error(f"--tensor-parallel-sizes must be >= 1, got {args.tensor_parallel_sizes!r}")
    if not torch.cuda.is_available():
        raise SystemExit("kvtier bench overlap needs a CUDA GPU (torch sees none)")
    if max(sizes) > torch.cuda.device_count():
        raise SystemExit(f"--tensor-parallel-sizes {max(sizes)} needs as many GPUs; torch sees {torch.cuda.device_count()}")
    from kvtier.model import PRESETS, init_model

    results: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            path = Path(name)
            if name in PRESETS:
                path = init_model(name, Path(tmp) / name, config_only=True)
            r: dict[str, Any] = {}
            for tp in sizes:
                r[f"tp{tp}"] = one_size(path, name, tp, args, r.get(f"tp{sizes[0]}"))
            results["models"][name] = r
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
