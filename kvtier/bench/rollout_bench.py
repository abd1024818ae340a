"""``kvtier bench rollout``: what an RL rollout worker pays for GRPO-style groups and logprobs.

Two measurements, each against a baseline run in the same process on the same GPU:

1. ``n`` samples of one long prompt (default n=8, 4,096 prompt tokens, temperature 0.8): one
   request with ``SamplingParams(n=8)`` (one prefill, the samples share the prompt's KV blocks)
   vs eight separate requests (seeds ``s+i``) with prefix caching off. Reports the wall time of
   each and their ratio, and the peak number of device blocks held during the n=8 request
   against ``(prompt blocks + n x generated blocks) x 1.05``. The samples must equal the
   separate requests' tokens (sample i is seeded ``s+i``).
2. Decode with ``logprobs=5`` vs without: a batch of requests (default 64 x 256 tokens, EOS
   ignored): tokens/s of each and their ratio.

Defaults use the ``llama3-8b-shape`` preset with dummy bf16 weights (``--preset``, ``--model``).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from kvtier.engine.config import EngineConfig

# the engine options this bench takes (EngineConfig.add_flags)
ENGINE_OPTIONS = ("device", "dtype", "load_format", "max_model_len", "max_num_batched_tokens")


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(llm, prompts, params, device: str):
    _sync(device)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    _sync(device)
    return time.perf_counter() - t0, outs


class PeakBlocks:
    """The most device blocks in use after any step while installed (wraps ``llm.step``)."""

    def __init__(self, llm) -> None:
        self.llm, self.peak, self._step = llm, 0, llm.step

    def __enter__(self) -> "PeakBlocks":
        pool = self.llm.cache.device_pool

        def step():
            out = self._step()
            self.peak = max(self.peak, pool.num_used - self.base)
            return out

        self.base = pool.num_used  # blocks the tree holds already (warm-up prompts)
        self.llm.step = step
        return self

    def __exit__(self, *exc) -> None:
        del self.llm.step


def bench_samples(path: Path, args: argparse.Namespace, vocab: int) -> dict:
    import kvtier

    rng = random.Random(args.seed)
    prompt = [rng.randrange(vocab) for _ in range(args.prompt_tokens)]
    warm = [rng.randrange(vocab) for _ in range(args.prompt_tokens)]
    config = EngineConfig.from_args(args, only=ENGINE_OPTIONS)
    n, g, s = args.n, args.output_tokens, args.seed

    def params(**over):
        base = dict(max_tokens=g, ignore_eos=True, temperature=0.8, top_p=0.95)
        return kvtier.SamplingParams(**(base | over))

    res: dict = {"n": n, "prompt_tokens": len(prompt), "output_tokens": g}
    with kvtier.LLM(path, config) as llm:
        llm.generate([warm], params(n=n, seed=s))  # warm-up: same shapes
        with PeakBlocks(llm) as peak:
            t_group, group = _timed(llm, [prompt], params(n=n, seed=s), args.device)
        bs = llm.block_size
        bound = (-(-len(prompt) // bs) + n * -(-g // bs)) * 1.05
        res |= {"group_s": t_group, "peak_blocks": peak.peak, "block_bound": bound, "blocks_ok": peak.peak <= bound}
    with kvtier.LLM(path, config, enable_prefix_caching=False) as llm:
        llm.generate([warm] * n, [params(seed=s + i) for i in range(n)])
        t_sep, sep = _timed(llm, [prompt] * n, [params(seed=s + i) for i in range(n)], args.device)
    res["separate_s"] = t_sep
    res["speedup"] = t_sep / t_group
    res["samples_equal_separate"] = [o.token_ids for o in group[0].outputs] == [o.token_ids for o in sep]
    return res


def bench_logprobs(path: Path, args: argparse.Namespace, vocab: int) -> dict:
    import kvtier

    rng = random.Random(args.seed + 1)
    prompts = [[rng.randrange(vocab) for _ in range(args.lp_prompt_tokens)] for _ in range(args.lp_requests)]
    config = EngineConfig.from_args(args, only=ENGINE_OPTIONS)
    out: dict = {"requests": len(prompts), "prompt_tokens": args.lp_prompt_tokens, "output_tokens": args.lp_output_tokens}
    with kvtier.LLM(path, config, enable_prefix_caching=False) as llm:
        for label, lp in (("off", None), ("on", args.logprobs)):
            p = kvtier.SamplingParams(max_tokens=args.lp_output_tokens, ignore_eos=True, logprobs=lp)
            llm.generate(prompts[:8], kvtier.SamplingParams(max_tokens=8, ignore_eos=True, logprobs=lp))
            best = None
            for _ in range(args.repeat):
                dt, outs = _timed(llm, prompts, p, args.device)
                best = dt if best is None else min(best, dt)
            assert best is not None  # (repeat >= 1)
            toks = sum(len(o.token_ids) for o in outs)
            if lp is not None:
                assert all(o.outputs[0].logprobs is not None and len(o.outputs[0].logprobs) == len(o.token_ids) for o in outs), (
                    "logprobs missing"
                )
            out[f"{label}_tok_s"] = toks / best
    out["ratio"] = out["on_tok_s"] / out["off_tok_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="kvtier bench rollout", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None, help="model directory (default: --preset written to a temp dir)")
    ap.add_argument("--preset", default="llama3-8b-shape", help="preset when --model is not given (default llama3-8b-shape)")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt (default 8)")
    ap.add_argument("--prompt-tokens", type=int, default=4096, help="(default 4096)")
    ap.add_argument("--output-tokens", type=int, default=32, help="per sample (default 32)")
    ap.add_argument("--logprobs", type=int, default=5, help="top-k logprobs in the second measurement (default 5)")
    ap.add_argument("--lp-requests", type=int, default=64, help="(default 64)")
    ap.add_argument("--lp-prompt-tokens", type=int, default=128, help="(default 128)")
    ap.add_argument("--lp-output-tokens", type=int, default=256, help="(default 256)")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs of the logprobs measurement; best (default 3)")
    ap.add_argument("--seed", type=int, default=0, help="workload and sampling seed (default 0)")
    ap.add_argument("--skip", choices=("samples", "logprobs"), action="append", default=[])
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    EngineConfig.add_flags(
        ap.add_argument_group("engine options (as kvtier serve's)"),
        only=ENGINE_OPTIONS,
        # a GPU bench on a preset's random bf16 weights (its config alone); prompts of 4K and
        # more: a context of 8K, prefilled in chunks of 8K
        defaults={
            "device": "cuda",
            "dtype": "bfloat16",
            "load_format": "dummy",
            "max_model_len": 8192,
            "max_num_batched_tokens": 8192,
        },
    )
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("kvtier bench rollout: --device cuda asked for, but no CUDA GPU is visible (--device cpu)")
    with tempfile.TemporaryDirectory(prefix="kvtier-rollout-") as tmp:
        if args.model:
            path = Path(args.model)
        else:
            from kvtier.model import init_model

            path = init_model(args.preset, tmp, config_only=args.load_format == "dummy")
        from kvtier.model import ModelConfig

        vocab = min(ModelConfig.from_hf_dir(path).vocab_size, 32000)
        res: dict = {
            "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
            "model": args.model or args.preset,
        }
        if "samples" not in args.skip:
            r = res["samples"] = bench_samples(path, args, vocab)
            print(
                f"n={r['n']} on a {r['prompt_tokens']}-token prompt, {r['output_tokens']} tokens each: "
                f"{r['group_s'] * 1e3:.0f} ms vs {r['separate_s'] * 1e3:.0f} ms for {r['n']} separate requests "
                f"without prefix caching = {r['speedup']:.2f}x; peak blocks {r['peak_blocks']} "
                f"(bound {r['block_bound']:.0f}); samples equal separate: {r['samples_equal_separate']}",
                flush=True,
            )
        if "logprobs" not in args.skip:
            r = res["logprobs"] = bench_logprobs(path, args, vocab)
            print(
                f"decode {r['requests']} x {r['output_tokens']} tokens: logprobs={args.logprobs} "
                f"{r['on_tok_s']:.0f} tok/s vs off {r['off_tok_s']:.0f} tok/s = {r['ratio']:.3f}",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
