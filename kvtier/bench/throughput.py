"""``kvtier bench throughput`` (GPU): offline generation throughput, kvtier vs HF transformers.

256 requests with random input 100–1024 and output 100–1024 tokens (EOS ignored), bf16, on the
``qwen3-0.6b-shape`` preset (written to a temporary directory unless ``--model`` is given).
kvtier runs all of them; HF ``generate`` runs the first ``--hf-requests`` of the same requests in
padded batches of ``--hf-batch`` (each batch generates to its longest output; only each request's
own output tokens count as useful). Both in the same process on the same GPU; prints tokens/s of
each and the ratio.

It also prints the run's HBM roofline: the bytes the workload must read (every step reads the
weights once and the KV of every sequence in its batch) over the HBM bandwidth measured by a
device copy in the same run, and the ratio roofline / time taken (1.0 = at the memory limit).
``--no-overlap-schedule`` runs without overlap scheduling; ``--compare-overlap`` runs both.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvtier.engine.config import EngineConfig

# the engine options this bench takes (EngineConfig.add_flags)
ENGINE_OPTIONS = (
    "device",
    "dtype",
    "kv_cache_dtype",
    "tensor_parallel_size",
    "max_num_batched_tokens",
    "max_num_seqs",
    "max_model_len",
    "attention_backend",
    "cuda_graphs",
    "overlap_schedule",
)


def make_requests(n: int, seed: int, vocab: int, in_range=(100, 1024), out_range=(100, 1024)):
    rng = random.Random(seed)
    return [([rng.randrange(vocab) for _ in range(rng.randint(*in_range))], rng.randint(*out_range)) for _ in range(n)]


def run_kvtier(path: Path, reqs, config: Any, profile: bool = False, **options: Any) -> dict:
    """kvtier's run of ``reqs`` under ``config`` (an EngineConfig; ``options`` over it)."""
    import kvtier

    device = "cuda" if config.device.startswith("cuda") else "cpu"
    with kvtier.LLM(path, config, **options) as llm:
        # warm-up on the same shapes (Triton compiles each kernel variant on first use): every
        # prompt, a few tokens each
        llm.generate([p for p, _ in reqs], kvtier.SamplingParams(max_tokens=8, ignore_eos=True))
        if profile:
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as torch_profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
            with torch_profile(activities=acts) as prof:
                llm.generate([p for p, _ in reqs[:128]], kvtier.SamplingParams(max_tokens=24, ignore_eos=True))
            key = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
            print(prof.key_averages().table(sort_by=key, row_limit=15), flush=True)
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15), flush=True)
        if device == "cuda":
            torch.cuda.synchronize()
        read = _count_bytes_read(llm)
        t0 = time.perf_counter()
        outs = llm.generate([p for p, _ in reqs], [kvtier.SamplingParams(max_tokens=n, ignore_eos=True) for _, n in reqs])
        if device == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        toks = sum(len(o.token_ids) for o in outs)
        assert toks == sum(n for _, n in reqs), "every request must generate exactly its output length"
        return {
            "requests": len(reqs),
            "output_tokens": toks,
            "seconds": dt,
            "tokens_per_s": toks / dt,
            "preemptions": llm.scheduler.num_preemptions,
            "overlap_schedule": llm.overlap_schedule,
            "num_device_blocks": llm.cache.device_pool.num_blocks,
            "steps": read["steps"],
            "weight_bytes_read": read["weights"],
            "kv_bytes_read": read["kv"],
        }


def _count_bytes_read(llm) -> dict:
    """Wraps the runner to count, per step, the weights (once) and the KV of every sequence of
    the batch (its whole context, K and V, every layer): what the step must read from HBM. Under
    tensor parallelism, what rank 0's GPU must read (its shard of the weights, its KV heads):
    every rank reads as much at once, so the roofline is one GPU's."""
    weights = sum(p.numel() * p.element_size() for p in llm.model.parameters())
    cfg = llm.model.config  # (this rank's KV heads)
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * llm.kv_caches[0].element_size()  # (fp8: 1)
    counts = {"steps": 0, "weights": 0, "kv": 0}
    real = llm.runner.execute

    def execute(out, start_loads=None):
        counts["steps"] += 1
        counts["weights"] += weights
        counts["kv"] += kv_per_token * sum(s.request.num_computed_tokens + s.num_tokens for s in out.scheduled)
        return real(out, start_loads)

    llm.runner.execute = execute
    return counts


def hbm_bandwidth(device: str, nbytes: int = 1 << 30) -> float:
    """Bytes/s of a device-to-device copy (read + write counted), median of 5."""
    if not device.startswith("cuda"):
        return float("nan")
    a = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    times = []
    for _ in range(6):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    del a, b
    return nbytes / sorted(times[1:])[2]


def roofline(run: dict, bandwidth: float) -> dict:
    seconds = (run["weight_bytes_read"] + run["kv_bytes_read"]) / bandwidth
    return {"roofline_seconds": seconds, "roofline_ratio": seconds / run["seconds"]}


def run_hf(path: Path, reqs, device: str, batch: int) -> dict:
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    model = loaded.to(device).eval()  # type: ignore[arg-type]  # PreTrainedModel.to is typed by @wraps(Module.to)
    useful, t_total = 0, 0.0
    for i in range(0, len(reqs), batch):
        chunk = reqs[i : i + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, (p, _) in enumerate(chunk):  # left padding
            ids[r, width - len(p) :] = torch.tensor(p)
            mask[r, width - len(p) :] = 1
        new = max(n for _, n in chunk)
        torch.cuda.synchronize() if device.startswith("cuda") else None
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(
                ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
        torch.cuda.synchronize() if device.startswith("cuda") else None
        t_total += time.perf_counter() - t0
        useful += sum(n for _, n in chunk)
    del model
    return {"requests": len(reqs), "output_tokens": useful, "seconds": t_total, "tokens_per_s": useful / t_total}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="kvtier bench throughput", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model",
        default=None,
        help="model directory, or a preset written to a temp dir (config only, dummy weights: e.g. llama3-70b-shape); "
        "default: qwen3-0.6b-shape with random weights",
    )
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--hf-requests", type=int, default=64, help="requests HF generates (the first N of the same)")
    ap.add_argument("--hf-batch", type=int, default=64)
    ap.add_argument("--input-range", type=int, nargs=2, default=(100, 1024))
    ap.add_argument("--output-range", type=int, nargs=2, default=(100, 1024))
    ap.add_argument("--compare-overlap", action="store_true", help="run with and without overlap scheduling")
    ap.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    ap.add_argument("--profile", action="store_true", help="print a torch.profiler table of a short run first")
    EngineConfig.add_flags(
        ap.add_argument_group("engine options (as kvtier serve's)"),
        only=ENGINE_OPTIONS,
        # a GPU bench, in bf16 also for a --model checkpoint written in another dtype; prefill chunks of 8K
        # tokens; a context of 4K holds the longest request (1024 + 1024) and bounds the CUDA
        # graphs' block tables
        defaults={"device": "cuda", "dtype": "bfloat16", "max_num_batched_tokens": 8192, "max_model_len": 4096},
    )
    args = ap.parse_args(argv)
    config = EngineConfig.from_args(args, only=ENGINE_OPTIONS)
    cuda = config.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise SystemExit("kvtier bench throughput needs a CUDA GPU (--device cuda); none is visible")
    from kvtier.model import PRESETS, init_model

    tmp = None
    path = Path(args.model) if args.model else None
    load_format = "auto"
    if path is None:
        tmp = tempfile.TemporaryDirectory(prefix="kvtier-bench-")
        path = init_model("qwen3-0.6b-shape", tmp.name)
    elif args.model in PRESETS and not path.exists():
        tmp = tempfile.TemporaryDirectory(prefix="kvtier-bench-")
        path = init_model(args.model, tmp.name, config_only=True)
        load_format = "dummy"
        if args.hf_requests:
            print("a preset's dummy weights: no HF transformers comparison (--hf-requests 0)", flush=True)
            args.hf_requests = 0
    from kvtier.model import ModelConfig

    vocab = min(ModelConfig.from_hf_dir(path).vocab_size, 32000)
    reqs = make_requests(args.requests, args.seed, vocab, tuple(args.input_range), tuple(args.output_range))
    bandwidth = hbm_bandwidth(config.device)
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "hbm_bytes_per_s": bandwidth,
    }
    modes = [True, False] if args.compare_overlap else [config.overlap_schedule]
    for overlap in modes:
        run = run_kvtier(path, reqs, config, args.profile, overlap_schedule=overlap, load_format=load_format)
        run.update(roofline(run, bandwidth))
        print(
            f"kvtier (overlap {'on' if run['overlap_schedule'] else 'off'}): {run['requests']} requests, "
            f"{run['output_tokens']} tokens in {run['seconds']:.1f}s = {run['tokens_per_s']:.0f} tok/s "
            f"(preemptions {run['preemptions']}, {run['steps']} steps); HBM roofline "
            f"{run['roofline_seconds']:.1f}s at {bandwidth / 1e12:.2f} TB/s measured: "
            f"{run['roofline_ratio']:.2f} of roofline",
            flush=True,
        )
        res.setdefault("kvtier", run)
        res["kvtier_overlap_" + ("on" if run["overlap_schedule"] else "off")] = run
    ours = res["kvtier"]
    if args.hf_requests:
        hf = run_hf(path, reqs[: args.hf_requests], config.device, args.hf_batch)
        print(
            f"hf transformers: {hf['requests']} requests (batch {args.hf_batch}), {hf['output_tokens']} useful "
            f"tokens in {hf['seconds']:.1f}s = {hf['tokens_per_s']:.0f} tok/s"
        )
        res["hf"] = hf
        res["ratio"] = ours["tokens_per_s"] / hf["tokens_per_s"]
        print(f"ratio kvtier / hf: {res['ratio']:.1f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
