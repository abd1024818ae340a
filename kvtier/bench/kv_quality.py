"""``kvtier bench kv-quality``: what a quantized KV cache (``--kv-cache-dtype fp8``) changes in a
model's answers, against the same engine with the compute dtype in its cache. A report, not a
pass mark: fp8 KV is exact against its own reference (tests/engine/test_fp8_kv.py), not against
bf16 KV.

Per prompt, both engines continue it greedily (``--output-length`` tokens); then each reads the
reference engine's continuation teacher-forced (``prompt_logprobs=20``), so both distributions
are taken at the same positions:

- greedy agreement: the share of continuations the quantized cache gives token for token, and
  the mean share of a continuation's tokens before its first difference;
- mean per-token KL(reference || quantized) over the reference's top-20 tokens at each position,
  both renormalized over them (a token outside the quantized run's top 20 takes its 20th
  logprob): an estimate over where the mass is, since the engine returns at most 20 logprobs.

Prompts: the lines of ``--prompts FILE`` (text, through the checkpoint's tokenizer), else
``--input-length`` random token ids each (seed ``--seed``). One line of output; ``--json`` too.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path
from typing import Any

from kvtier.engine.config import EngineConfig

ENGINE_OPTIONS = ("device", "dtype", "kv_cache_dtype", "block_size", "num_device_blocks", "max_model_len", "max_num_seqs")
TOP = 20  # logprobs per position (the engine's most)


def continuations(llm: Any, prompts: list[list[int]], output_length: int) -> list[list[int]]:
    """``llm``'s greedy continuations of ``prompts``."""
    import kvtier

    greedy = kvtier.SamplingParams(max_tokens=output_length, ignore_eos=True)
    return [list(o.token_ids) for o in llm.generate(prompts, greedy)]


def teacher_forced(llm: Any, prompts: list[list[int]], conts: list[list[int]]) -> list[list[dict[int, float]]]:
    """Per prompt, the top-``TOP`` logprobs at each position of its continuation ``conts[i]``."""
    import kvtier

    scored = kvtier.SamplingParams(max_tokens=1, prompt_logprobs=TOP)
    outs = llm.generate([p + c for p, c in zip(prompts, conts)], scored)
    return [list(o.prompt_logprobs[len(p) : len(p) + len(c)]) for o, p, c in zip(outs, prompts, conts)]


def top_kl(ref: dict[int, float], other: dict[int, float]) -> float:
    """KL(ref || other) over ``ref``'s tokens, both renormalized over them (module docstring)."""
    floor = min(other.values())
    tokens = list(ref)
    p = [math.exp(ref[t]) for t in tokens]
    q = [math.exp(other.get(t, floor)) for t in tokens]
    sp, sq = sum(p), sum(q)
    return sum(pi / sp * math.log((pi / sp) / (qi / sq)) for pi, qi in zip(p, q) if pi > 0)


def compare(ref_conts, quant_conts, ref_lps, quant_lps) -> dict[str, float]:
    """Greedy agreement and mean per-token KL (module docstring)."""
    same = sum(a == b for a, b in zip(ref_conts, quant_conts))
    prefix = []
    for a, b in zip(ref_conts, quant_conts):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        prefix.append(n / max(1, len(a)))
    kls = [top_kl(r, q) for rs, qs in zip(ref_lps, quant_lps) for r, q in zip(rs, qs)]
    return {
        "continuations": len(ref_conts),
        "identical_share": same / max(1, len(ref_conts)),
        "mean_share_before_first_difference": sum(prefix) / max(1, len(prefix)),
        "mean_kl_top20": sum(kls) / max(1, len(kls)),
        "tokens_scored": len(kls),
    }


def make_prompts(args: argparse.Namespace, path: Path, vocab: int) -> list[list[int]]:
    if args.prompts:
        from kvtier.model.tokenizer import load_tokenizer

        tok = load_tokenizer(path)
        if tok is None:
            raise SystemExit(f"--prompts needs a tokenizer; {path} has none")
        lines = [line for line in Path(args.prompts).read_text().splitlines() if line.strip()]
        return [tok.encode(line)[: args.input_length] for line in lines[: args.num_prompts]]
    rng = random.Random(args.seed)
    return [[rng.randrange(vocab) for _ in range(args.input_length)] for _ in range(args.num_prompts)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="kvtier bench kv-quality", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", required=True, help="checkpoint directory or hub id (a real tokenizer for --prompts)")
    ap.add_argument("--prompts", default=None, help="a text file: one prompt per line (default: random token ids)")
    ap.add_argument("--num-prompts", type=int, default=1000, help="continuations compared (default 1000)")
    ap.add_argument("--input-length", type=int, default=256, help="prompt tokens at most (default 256)")
    ap.add_argument("--output-length", type=int, default=64, help="tokens per continuation (default 64)")
    ap.add_argument("--seed", type=int, default=0, help="random prompts' seed (default 0)")
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    EngineConfig.add_flags(
        ap.add_argument_group("engine options (as kvtier serve's)"), only=ENGINE_OPTIONS, defaults={"kv_cache_dtype": "fp8"}
    )
    args = ap.parse_args(argv)
    if args.num_prompts < 1 or args.input_length < 1 or args.output_length < 1:
        ap.error("--num-prompts, --input-length and --output-length must be >= 1")
    try:
        config = EngineConfig.from_args(args, only=ENGINE_OPTIONS)
    except ValueError as e:
        ap.error(str(e))
    if config.kv_cache_dtype == "auto":
        ap.error("--kv-cache-dtype auto is the reference: give the dtype to compare (fp8, fp8_e5m2)")
    from dataclasses import replace

    import kvtier
    from kvtier.model import ModelConfig
    from kvtier.model.hub import resolve_model

    path = resolve_model(args.model, None, "auto")
    prompts = make_prompts(args, path, ModelConfig.from_hf_dir(path).vocab_size)
    t0 = time.monotonic()
    with kvtier.LLM(path, replace(config, kv_cache_dtype="auto")) as llm:
        ref_conts = continuations(llm, prompts, args.output_length)
        ref_lps = teacher_forced(llm, prompts, ref_conts)
        dtype = str(llm.kv_caches[0].dtype).removeprefix("torch.")
    with kvtier.LLM(path, config) as llm:
        quant_conts = continuations(llm, prompts, args.output_length)
        quant_lps = teacher_forced(llm, prompts, ref_conts)
        scales = llm.startup.kv_cache
    res: dict[str, Any] = {"reference_kv": dtype, "kv_cache_dtype": config.kv_cache_dtype, "scales": scales}
    res.update(compare(ref_conts, quant_conts, ref_lps, quant_lps))
    res["seconds"] = round(time.monotonic() - t0, 1)
    print(
        f"{config.kv_cache_dtype} KV vs {dtype} KV ({scales['scales'] if scales else '?'} scales): "
        f"{res['continuations']} continuations of {args.output_length} tokens, identical {res['identical_share']:.3f}, "
        f"tokens before the first difference {res['mean_share_before_first_difference']:.3f}, "
        f"mean per-token KL (top 20) {res['mean_kl_top20']:.2e} over {res['tokens_scored']} tokens",
        flush=True,
    )
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
