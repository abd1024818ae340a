"""``kvtier bench speculative``: decode tokens/s with MTP speculative decoding vs without, same run.

The drafts come from a controlled drafter, so that the machinery is measured apart from any
model's quality: the MTP block runs as in serving (its forward and KV writes are paid), but each
draft it proposes is replaced by the target's own greedy continuation (taken from the run without
drafts on the same prompts) with probability alpha, else by a wrong token. Greedy verification
then accepts about alpha^j of the j-th drafts (less where the drafted run's tokens part from the
baseline's: bf16 logits depend on the batch shape); the acceptance measured is printed.

Per batch size: the baseline (no drafts; CUDA graphs and overlap scheduling as the engine's
defaults) generates ``--output`` tokens for each of ``--batch`` prompts of ``--input`` tokens
(EOS ignored), then one engine with ``--speculative-tokens k`` does the same at every alpha.
Each figure is the best of ``--repeat`` runs. On a GPU the default model is
``llama3-8b-mtp-shape`` (dummy bf16 weights), on CPU ``qwen3-mtp-tiny``::

    kvtier bench speculative --device cuda --alphas 0,0.8 --batch-sizes 1,64 --speculative-tokens 3
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from kvtier.engine.config import EngineConfig

# the engine options this bench takes (EngineConfig.add_flags)
ENGINE_OPTIONS = ("device", "dtype", "num_speculative_tokens", "speculative_min_acceptance", "max_model_len")


def _timed(llm: Any, prompts: list[list[int]], params: Any, repeat: int, device: str) -> tuple[float, list]:
    """(best tokens/s over ``repeat`` runs, the last run's outputs)."""
    best, outs = 0.0, []
    for _ in range(repeat):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        best = max(best, sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0))
    return best, outs


def main(argv: list[str] | None = None) -> int:
    import kvtier
    from kvtier.model import PRESETS, ModelConfig, init_model

    ap = argparse.ArgumentParser(
        prog="kvtier bench speculative", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None, help="checkpoint directory or preset (default: by device, above)")
    ap.add_argument("--alphas", default="0,0.8", help="comma-separated draft acceptance probabilities (default 0,0.8)")
    ap.add_argument("--batch-sizes", default="1,64", help="comma-separated requests at once (default 1,64)")
    ap.add_argument("--input", type=int, default=128, help="prompt tokens (default 128)")
    ap.add_argument("--output", type=int, default=128, help="tokens generated per request (default 128)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    ap.add_argument("--json", default=None, help="also write the results here")
    EngineConfig.add_flags(
        ap.add_argument_group("engine options of both engines (as kvtier serve's)"),
        only=ENGINE_OPTIONS,
        # a GPU bench; three drafts per step, the figures' (docs/BENCHMARKS.md); a context of 4K
        # bounds the CUDA graphs' block tables (capped at the model's)
        defaults={"device": "cuda", "num_speculative_tokens": 3, "max_model_len": 4096},
    )
    args = ap.parse_args(argv)
    config = EngineConfig.from_args(args, only=ENGINE_OPTIONS)
    if config.num_speculative_tokens < 1:
        ap.error("--speculative-tokens must be >= 1: the bench compares drafting with not drafting")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("kvtier bench speculative --device cuda needs a CUDA GPU; none is visible (--device cpu runs on CPU)")
    alphas = [float(a) for a in args.alphas.split(",")]
    for a in alphas:
        if not 0 <= a <= 1:
            raise SystemExit(f"--alphas: {a} is not a probability in [0, 1]")
    batches = [int(b) for b in args.batch_sizes.split(",")]
    model = args.model or ("llama3-8b-mtp-shape" if args.device.startswith("cuda") else "qwen3-mtp-tiny")
    tmp = None
    load_format = "auto"
    path = Path(model)
    if model in PRESETS and not path.exists():
        tmp = tempfile.TemporaryDirectory(prefix="kvtier-bench-")
        dummy = PRESETS[model]["dtype"] == "bfloat16"
        path = init_model(model, tmp.name, config_only=dummy)
        load_format = "dummy" if dummy else "auto"
    cfg = ModelConfig.from_hf_dir(path)
    rng = random.Random(args.seed)
    vocab = min(cfg.vocab_size, 32000)
    params = kvtier.SamplingParams(max_tokens=args.output, ignore_eos=True)
    # both engines: the same options, drafting or not, on the same prompts (nothing cached between runs)
    config = replace(config, load_format=load_format, enable_prefix_caching=False)
    results: dict[str, Any] = {
        "model": model,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "speculative_tokens": config.num_speculative_tokens,
        "speculative_min_acceptance": config.speculative_min_acceptance,
        "runs": [],
    }
    for batch in batches:
        prompts = [[rng.randrange(vocab) for _ in range(args.input)] for _ in range(batch)]
        with kvtier.LLM(path, config, max_num_seqs=batch, num_speculative_tokens=0) as llm:
            llm.generate(prompts[:2], kvtier.SamplingParams(max_tokens=4, ignore_eos=True))
            base, outs = _timed(llm, prompts, params, args.repeat, args.device)
        oracle = {tuple(p): o.token_ids for p, o in zip(prompts, outs)}
        print(f"batch {batch}: without drafts {base:.0f} tok/s", flush=True)
        with kvtier.LLM(path, config, max_num_seqs=batch) as llm:
            llm.generate(prompts[:2], kvtier.SamplingParams(max_tokens=4, ignore_eos=True))
            for alpha in alphas:
                draw = random.Random(args.seed + 1)

                def drafter(req: Any, position: int, proposal: int, alpha: float = alpha, draw: Any = draw) -> int:
                    out = oracle.get(tuple(req.prompt_token_ids), [])
                    i = position - req.num_prompt_tokens
                    right = out[i] if 0 <= i < len(out) else proposal
                    return right if draw.random() < alpha else (right + 1) % vocab

                llm.spec.drafter = drafter
                before = llm.spec.stats()
                tps, spec_outs = _timed(llm, prompts, params, args.repeat, args.device)
                after = llm.spec.stats()
                drafted = after["drafted"] - before["drafted"]
                accepted = after["accepted"] - before["accepted"]
                rested = after["rested_steps"] - before["rested_steps"]
                same = sum(a.token_ids == b.token_ids for a, b in zip(outs, spec_outs))
                run = {
                    "batch": batch,
                    "alpha": alpha,
                    "tokens_per_s": tps,
                    "baseline_tokens_per_s": base,
                    "speedup": tps / base,
                    "acceptance": accepted / drafted if drafted else None,
                    "rested_steps": rested,
                    "same_tokens": f"{same} of {len(outs)}",
                }
                results["runs"].append(run)
                acc = f"{run['acceptance']:.2f}" if drafted else "-"
                print(
                    f"batch {batch}, alpha {alpha}: {tps:.0f} tok/s = {tps / base:.2f}x without drafts "
                    f"(acceptance measured {acc}; request steps resting from drafts {rested}; "
                    f"same tokens as without: {same} of {len(outs)})",
                    flush=True,
                )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
