"""One engine process for the pool tests: python engine_proc.py MODEL URL PROMPTS.json OUT.json

Generates each prompt alone (greedy, routed experts when MoE) with a storage tier, writes
{"outputs": [{"tokens", "by_tier", "routed"}], "stats": cache_stats()} to OUT.json."""

from __future__ import annotations

import json
import sys

import kvtier

ENGINE_KW = dict(
    num_device_blocks=24,
    block_size=8,
    num_host_blocks=16,
    write_policy="write_through",
    storage_fetch="always",
    prefetch_policy="wait_complete",
)  # exact hit counts, whatever the timing


def run(llm: kvtier.LLM, prompts: list[list[int]], routed: bool) -> list[dict]:
    sp = kvtier.SamplingParams(max_tokens=8, return_routed_experts=routed)
    outs = []
    for p in prompts:
        o = llm.generate([p], sp)[0]
        outs.append(
            {
                "tokens": o.token_ids,
                "by_tier": o.cached_tokens_by_tier,
                "routed": o.routed_experts.tolist() if o.routed_experts is not None else None,
            }
        )
        llm.cache.assert_invariants()
    return outs


if __name__ == "__main__":
    model, url, prompts_path, out_path = sys.argv[1:5]
    prompts = json.load(open(prompts_path))
    with kvtier.LLM(model, storage=url, **ENGINE_KW) as llm:
        outs = run(llm, prompts, llm.routing is not None)
        stats = llm.cache_stats()
    json.dump({"outputs": outs, "stats": stats}, open(out_path, "w"), default=str)
