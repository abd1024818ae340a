"""``kvtier bench experts`` (GPU): decode throughput with R3 capture on vs off, same run.

A MoE preset (``qwen3-moe-small`` unless ``--model``), ``--requests`` requests of ``--input``
prompt tokens each generating ``--output`` tokens (EOS ignored). Runs alternate capture on / off
``--repeat`` times and keep each arm's best; prints tokens/s of both, the ratio (goal >= 0.99)
and routing bytes per token.
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

ENGINE_OPTIONS = ("device", "dtype")  # the engine options this bench takes (EngineConfig.add_flags)


def main(argv: list[str] | None = None) -> int:
    import kvtier
    from kvtier.model import ModelConfig, init_model

    ap = argparse.ArgumentParser(
        prog="kvtier bench experts", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--input", type=int, default=256)
    ap.add_argument("--output", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", default=None)
    # a GPU bench, in bf16 also for a --model checkpoint written in another dtype
    EngineConfig.add_flags(ap, only=ENGINE_OPTIONS, defaults={"device": "cuda", "dtype": "bfloat16"})
    args = ap.parse_args(argv)
    config = EngineConfig.from_args(args, only=ENGINE_OPTIONS)
    cuda = config.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise SystemExit("kvtier bench experts needs a CUDA GPU; none is visible")
    tmp = None
    path = Path(args.model) if args.model else None
    if path is None:
        tmp = tempfile.TemporaryDirectory(prefix="kvtier-bench-")
        path = init_model("qwen3-moe-small", tmp.name)
    cfg = ModelConfig.from_hf_dir(path)
    rng = random.Random(0)
    prompts = [[rng.randrange(min(cfg.vocab_size, 32000)) for _ in range(args.input)] for _ in range(args.requests)]
    sp = kvtier.SamplingParams(max_tokens=args.output, ignore_eos=True)
    samples: dict[bool, list[float]] = {True: [], False: []}
    engines = {
        on: kvtier.LLM(path, config, capture_routing=on, enable_prefix_caching=False, max_num_seqs=args.requests)
        for on in (True, False)
    }
    bytes_per_token = engines[True].routing.bytes_per_token
    dtype_name = str(engines[True].routing.dtype)
    for llm in engines.values():
        llm.generate(prompts[:4], kvtier.SamplingParams(max_tokens=8, ignore_eos=True))
    for _ in range(args.repeat):
        for on in (True, False):
            llm = engines[on]
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, sp)
            if cuda:
                torch.cuda.synchronize()
            toks = sum(len(o.token_ids) for o in outs)
            samples[on].append(toks / (time.perf_counter() - t0))
    for llm in engines.values():
        llm.close()
    best = {on: max(v) for on, v in samples.items()}
    ratio = best[True] / best[False]
    pair_ratios = sorted(a / b for a, b in zip(samples[True], samples[False]))
    median_pair = pair_ratios[len(pair_ratios) // 2]
    print(
        f"capture on: {best[True]:.0f} tok/s  off: {best[False]:.0f} tok/s  ratio (best/best) {ratio:.3f}  "
        f"median of back-to-back pairs {median_pair:.3f}  runs on {[round(x) for x in samples[True]]} "
        f"off {[round(x) for x in samples[False]]}"
    )
    print(f"routing {bytes_per_token} bytes/token ({cfg.num_moe_layers} MoE layers x top-{cfg.top_k}, {dtype_name})")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "on": samples[True],
                    "off": samples[False],
                    "ratio_best": ratio,
                    "ratio_median_pair": median_pair,
                    "bytes_per_token": bytes_per_token,
                }
            )
        )
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
