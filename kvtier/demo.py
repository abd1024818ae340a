"""``kvtier demo``: the first thing a newcomer runs.

Writes a small random MoE checkpoint (on CUDA: a larger MoE shape, ``qwen3-moe-small``, from its
config alone with random weights made on the GPU, and a longer shared system prompt — a tiny
model's forward is bound by kernel launches, not by the tokens a cache hit saves), then serves a
multi-turn chat workload (several clients, each turn resends the whole history plus a new question)
with a deliberately small device tier, a host tier and a storage pool (by default ``file://`` in a
temporary directory — the embedded pool that persists), so that hits come from all three tiers. For
every turn it times the first token (TTFT) with the cache and by recompute (a second engine with
prefix caching off, same weights), and counts the turns whose first token is the same both ways.

It runs in the dtype users run (``dtype="auto"``: the checkpoint's on CUDA, bf16 for the CUDA
model; float32 on CPU). In float32 every output is identical to recompute (the tests check it).
In bf16 a prefix read from the cache was computed by other kernels (a prefill over cached KV,
not one full prefill), so its rounding differs, and where a random model's top two logits nearly
tie, that can flip a greedy token: the demo reports how many outputs matched rather than
stopping at the first that did not.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import kvtier
from kvtier.model import init_model
from kvtier.model.hub import is_hub_id, resolve_model

if TYPE_CHECKING:
    from kvtier.engine.llm import RequestOutput

TIERS = ("device", "host", "storage")


def _ttft(llm: kvtier.LLM, prompt: list[int]) -> tuple[float, RequestOutput]:
    t0 = time.perf_counter()
    out = llm.generate([prompt], kvtier.SamplingParams(max_tokens=1, ignore_eos=True))[0]
    return time.perf_counter() - t0, out


def _warm_up(llm: kvtier.LLM, cold: kvtier.LLM, prompt_tokens: int, device_blocks: int, rng: random.Random) -> None:
    """Run every path the timed turns take once, on prompts of their length (a kernel compiles,
    or autotunes, on its first use in a process: on a GPU that is hundreds of ms the TTFT column
    would otherwise charge to the cache): a full prefill on both engines, a prefill over a cached
    prefix, and a host-tier hit (a short prompt pushed out of the device tier by a long one)."""

    def toks(n: int) -> list[int]:
        return [rng.randrange(256) for _ in range(n)]

    long = toks(prompt_tokens)
    for engine in (llm, cold):
        _ttft(engine, long)
    _ttft(llm, long + toks(16))  # device hit + new tokens
    short = toks(48)
    _ttft(llm, short)
    _ttft(llm, toks(min(prompt_tokens, (device_blocks - 4) * 16)))  # evicts `short` to host
    _ttft(llm, short + toks(16))  # host hit + new tokens


def run_demo(
    model_dir: str | None = None,
    clients: int = 4,
    turns: int = 4,
    system_tokens: int | None = None,
    question_tokens: int = 48,
    answer_tokens: int = 24,
    seed: int = 0,
    device: str = "cpu",
    storage: str | None = None,
    dtype: str = "auto",
    out=print,
) -> dict:
    tmp = None
    pool_dir = None
    if storage is None:
        pool_dir = tempfile.TemporaryDirectory(prefix="kvtier-pool-")
        storage = f"file://{pool_dir.name}?capacity=2GiB"
    cuda = str(device).startswith("cuda")
    load_format = "auto"
    if model_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="kvtier-demo-")
        model_dir = tmp.name
    path = Path(model_dir)
    if not path.exists() and is_hub_id(model_dir):  # a hub id, not a folder to write a checkpoint to
        path = resolve_model(model_dir)
    if not (path / "config.json").is_file():
        if cuda:
            out(f"writing a qwen3-moe-small config to {path} (random weights are made on the GPU) ...")
            init_model("qwen3-moe-small", path, seed=seed, config_only=True)
            load_format = "dummy"
        else:
            out(f"writing a random qwen3-moe-demo checkpoint to {path} ...")
            init_model("qwen3-moe-demo", path, seed=seed)
    if system_tokens is None:
        system_tokens = 4096 if cuda else 384
    rng = random.Random(seed)
    system = [rng.randrange(256) for _ in range(system_tokens)]
    histories = [list(system) for _ in range(clients)]
    totals = {t: 0 for t in TIERS}
    prompt_tokens = 0
    rows = []
    # Small device tier: the clients' histories do not all fit, so older turns fall to host and
    # storage. The recompute engine has the same sizes and no prefix caching.
    # On CUDA the same proportions, scaled to the longer prompts: the device tier holds one
    # client's history and a little more, the host tier a little more again.
    per_client = -(-(system_tokens + turns * (question_tokens + answer_tokens)) // 16)
    device_blocks, host_blocks = (per_client + 16, per_client + 24) if cuda else (48, 56)
    sizes = dict(
        block_size=16,
        num_device_blocks=device_blocks,
        device=device,
        load_format=load_format,
        dtype=dtype,
        max_num_batched_tokens=max(1024, 16 * per_client + 64),
    )
    out(f"storage pool: {storage}")
    identical = 0
    # storage_fetch="auto": storage hits are fetched only when the cost model says they beat recompute
    with (
        kvtier.LLM(
            path, num_host_blocks=host_blocks, storage=storage, storage_fetch="auto", write_policy="write_through", **sizes
        ) as llm,
        kvtier.LLM(path, enable_prefix_caching=False, **sizes) as cold,
    ):
        _warm_up(llm, cold, system_tokens + question_tokens, device_blocks, random.Random(seed + 1))
        for turn in range(turns):
            for c in range(clients):
                histories[c] += [rng.randrange(256) for _ in range(question_tokens)]
                prompt = list(histories[c])
                t_cache, o = _ttft(llm, prompt)
                t_cold, o_cold = _ttft(cold, prompt)
                identical += o.token_ids == o_cold.token_ids
                by_tier = o.cached_tokens_by_tier
                for t in TIERS:
                    totals[t] += by_tier[t]
                prompt_tokens += len(prompt)
                rows.append((turn, c, len(prompt), by_tier, t_cache, t_cold))
                answer = llm.generate([prompt], kvtier.SamplingParams(max_tokens=answer_tokens, ignore_eos=True))[0]
                histories[c] += answer.token_ids
        stats = llm.cache_stats()
        dtype_used = str(llm.dtype).removeprefix("torch.")
    out(
        f"{'turn':>4} {'client':>6} {'prompt':>7} {'device':>7} {'host':>6} {'storage':>8} "
        f"{'TTFT cache':>11} {'TTFT recompute':>15}"
    )
    for turn, c, n, by_tier, t_cache, t_cold in rows:
        out(
            f"{turn:>4} {c:>6} {n:>7} {by_tier['device']:>7} {by_tier['host']:>6} {by_tier['storage']:>8} "
            f"{t_cache * 1e3:>9.1f}ms {t_cold * 1e3:>13.1f}ms"
        )
    hit = sum(totals.values())
    later = [r for r in rows if r[0] > 0]
    speedup = sum(r[5] for r in later) / max(1e-9, sum(r[4] for r in later))
    median = statistics.median(r[5] / max(1e-9, r[4]) for r in later) if later else 1.0
    out(
        f"hit tokens: device {totals['device']}, host {totals['host']}, storage {totals['storage']} "
        f"= {hit / prompt_tokens:.0%} of {prompt_tokens} prompt tokens"
    )

    def ratio(x: float) -> str:
        return f"{x:.2f}x faster than recompute" if x >= 1 else f"{1 / x:.2f}x slower than recompute"

    note = ""
    if median < 1:
        note = " (this model is too small for the tokens a cache hit saves to outweigh the copies)"
    elif median > 1.5 * speedup:
        note = " (a few requests waited for others' blocks on their way down to the pool: see the TTFT column)"
    out(f"TTFT after the first turn: {ratio(speedup)} in total, {ratio(median)} for the median request{note}")
    why = (
        ""
        if identical == len(rows)
        else (
            f" (the others differ by a flipped greedy token: in {dtype_used} a cached prefix rounds differently "
            f"from a full prefill, and this random model's logits nearly tie)"
        )
    )
    out(f"{identical} of {len(rows)} outputs identical to recompute, {dtype_used}{why}")
    if tmp is not None:
        tmp.cleanup()
    if pool_dir is not None:
        pool_dir.cleanup()
    return {
        "hit_tokens": totals,
        "prompt_tokens": prompt_tokens,
        "ttft_speedup": speedup,
        "stats": stats,
        "ttft_speedup_median": median,
        "outputs": len(rows),
        "identical_outputs": identical,
        "dtype": dtype_used,
    }
