"""Paged attention benchmark: Triton backend vs the torch reference vs SDPA on contiguous K/V.

    python -m kvtier.bench.attention_bench                 # CUDA: full cases, bf16
    python -m kvtier.bench.attention_bench --json out.json
    python -m kvtier.bench.attention_bench --smoke         # tiny shapes; on CPU via TRITON_INTERPRET

Cases: decode (query_len 1 per sequence, long KV) for several batch sizes / KV lengths, and
prefill of new tokens over a cached prefix. Timing on CUDA uses CUDA events after a warm-up and
reports the median of ``--iters`` runs; off CUDA it uses the host clock. The SDPA baseline runs on
K/V already gathered into contiguous ``[batch, kv_heads, seq, head_dim]`` tensors (gather not
timed), i.e. what a non-paged engine would run; the random-length decode case has no SDPA number.
Each case also reports the Triton output's max abs error vs the fp32 reference. Without triton
installed, the torch reference and SDPA are timed alone (the Triton columns read ``-``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from kvtier.engine.config import EngineConfig


@dataclass
class Case:
    name: str
    query_lens: list[int]
    seq_lens: list[int]
    num_heads: int = 16
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    uniform: bool = True  # all sequences alike -> SDPA baseline possible


@dataclass
class Result:
    name: str
    kind: str
    num_seqs: int
    num_tokens: int
    kv_tokens: int
    dtype: str
    triton_ms: float | None = None
    triton_graph_ms: float | None = None
    reference_ms: float | None = None
    sdpa_ms: float | None = None
    triton_gbps: float | None = None
    triton_tflops: float | None = None
    max_abs_err: float | None = None
    sdpa_vs_triton_err: float | None = None
    notes: list[str] = field(default_factory=list)


def full_cases() -> list[Case]:
    cases = []
    for batch in (64, 256):
        for seq in (1024, 4096):
            cases.append(Case(f"decode_b{batch}_s{seq}", [1] * batch, [seq] * batch))
    cases.append(Case("decode_b8_s8192", [1] * 8, [8192] * 8))  # split-KV territory
    rng = random.Random(0)
    cases.append(Case("decode_b128_rand1-4k", [1] * 128, [rng.randint(1, 4096) for _ in range(128)], uniform=False))
    cases.append(Case("prefill_4x1024_over_2k", [1024] * 4, [3072] * 4))
    cases.append(Case("prefill_1x4096_full", [4096], [4096]))
    return cases


def smoke_cases() -> list[Case]:
    return [
        Case("decode_b4_s40", [1] * 4, [40] * 4, num_heads=4, num_kv_heads=2, head_dim=64),
        Case("decode_b3_rand", [1] * 3, [5, 33, 70], num_heads=4, num_kv_heads=2, head_dim=64, uniform=False),
        Case("prefill_2x24_over_32", [24] * 2, [56] * 2, num_heads=4, num_kv_heads=2, head_dim=64),
    ]


def build(case: Case, dtype: torch.dtype, device: str, seed: int = 0):
    from kvtier.model.attention import AttentionMetadata

    gen = torch.Generator().manual_seed(seed)
    bs = case.block_size
    needed = [-(-s // bs) for s in case.seq_lens]
    num_blocks = sum(needed)
    perm = torch.randperm(num_blocks, generator=gen).tolist()  # scattered blocks, like a real pool
    tables, i = [], 0
    for n in needed:
        tables.append(perm[i : i + n])
        i += n
    meta = AttentionMetadata.build(case.query_lens, case.seq_lens, tables, bs, device=device)
    kv = torch.empty(2, num_blocks, bs, case.num_kv_heads, case.head_dim, dtype=dtype, device=device)
    kv.normal_(generator=None)
    q = torch.randn(sum(case.query_lens), case.num_heads, case.head_dim, dtype=dtype, device=device)
    return q, kv, meta


def contiguous_kv(case: Case, kv: torch.Tensor, meta):
    """[B, kv_heads, S, D] K and V of uniform-length sequences (for the SDPA baseline)."""
    s = case.seq_lens[0]
    nb = -(-s // case.block_size)
    blocks = meta.block_tables[:, :nb].long()  # [B, nb]
    k = kv[0][blocks].flatten(1, 2)[:, :s].transpose(1, 2).contiguous()
    v = kv[1][blocks].flatten(1, 2)[:, :s].transpose(1, 2).contiguous()
    return k, v


def make_sdpa(case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    import torch.nn.functional as F

    b = len(case.query_lens)
    ql, sl = case.query_lens[0], case.seq_lens[0]
    qb = q.view(b, ql, case.num_heads, case.head_dim).transpose(1, 2)  # [B, H, q, D]
    group = case.num_heads // case.num_kv_heads
    causal = ql > 1 and ql == sl
    mask = None
    if ql > 1 and not causal:
        from torch.nn.attention.bias import causal_lower_right

        mask = causal_lower_right(ql, sl)

    def call(kk, vv, gqa):
        kwargs: dict[str, Any] = {"scale": scale}
        if gqa:
            kwargs["enable_gqa"] = True
        if causal:
            return F.scaled_dot_product_attention(qb, kk, vv, is_causal=True, **kwargs)
        return F.scaled_dot_product_attention(qb, kk, vv, attn_mask=mask, **kwargs)

    try:
        call(k, v, group > 1)
        return (lambda: call(k, v, group > 1)), "gqa"
    except Exception:
        ke = k.repeat_interleave(group, dim=1)
        ve = v.repeat_interleave(group, dim=1)
        call(ke, ve, False)
        return (lambda: call(ke, ve, False)), "kv heads expanded"


def time_fn(fn, warmup: int, iters: int, cuda: bool, inner: int = 1) -> float:
    """Median milliseconds per ``fn()`` call.

    On CUDA each sample times ``inner`` back-to-back calls between two events, so that the host's
    launch cost overlaps the device work (as in a running engine) instead of being added to it.
    """
    for _ in range(warmup):
        fn()
    times = []
    if cuda:
        torch.cuda.synchronize()
        for _ in range(iters):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / inner)
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            times.append((time.perf_counter() - t0) * 1e3 / inner)
    return statistics.median(times)


def time_graph(fn, iters: int) -> float | None:
    """Median milliseconds of one replay of ``fn`` captured in a CUDA graph (no launch cost)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_fn(graph.replay, 3, iters, True, inner=5)


def run_case(case: Case, dtype: torch.dtype, device: str, args, attn) -> Result:
    """``attn``: the Triton backend, or None (triton not installed): reference and SDPA only."""
    from kvtier.model.attention import reference_attention

    cuda = device == "cuda"
    q, kv, meta = build(case, dtype, device)
    scale = case.head_dim**-0.5
    kind = "decode" if meta.max_query_len == 1 else "prefill"
    res = Result(case.name, kind, meta.num_seqs, q.shape[0], sum(case.seq_lens), str(dtype).split(".")[-1])
    kw = {} if args.num_splits is None else {"num_splits": args.num_splits}

    inner = args.inner if cuda else 1
    out = None
    if attn is not None:
        out = attn(q, kv, meta, scale, **kw)
        ref = reference_attention(q.float(), kv.float(), meta, scale)
        res.max_abs_err = (out.float() - ref).abs().max().item()
        del ref
        res.triton_ms = time_fn(lambda: attn(q, kv, meta, scale, **kw), args.warmup, args.iters, cuda, inner)
    if cuda and attn is not None:
        try:
            res.triton_graph_ms = time_graph(lambda: attn(q, kv, meta, scale, **kw), args.iters)
        except Exception as exc:
            res.notes.append(f"graph capture failed: {type(exc).__name__}: {exc}"[:200])
    ref_iters = max(1, min(args.iters, args.ref_iters))
    res.reference_ms = time_fn(lambda: reference_attention(q, kv, meta, scale), 1, ref_iters, cuda)
    if case.uniform:
        try:
            k, v = contiguous_kv(case, kv, meta)
            sdpa, how = make_sdpa(case, q, k, v, scale)
            if out is not None:
                o = sdpa().transpose(1, 2).reshape(q.shape)
                res.sdpa_vs_triton_err = (o.float() - out.float()).abs().max().item()
            res.sdpa_ms = time_fn(sdpa, args.warmup, args.iters, cuda, inner)
            res.notes.append(f"sdpa: {how}")
            del k, v
        except Exception as exc:
            res.notes.append(f"sdpa failed: {type(exc).__name__}: {exc}"[:200])

    elt = kv.element_size()
    kv_bytes = sum(case.seq_lens) * case.num_kv_heads * case.head_dim * 2 * elt
    qo_bytes = 2 * q.numel() * elt
    kernel_ms = res.triton_graph_ms or res.triton_ms  # rates from the kernel-only time
    if kernel_ms is None:
        return res
    res.triton_gbps = (kv_bytes + qo_bytes) / (kernel_ms * 1e-3) / 1e9
    flops = 0
    for ql, sl in zip(case.query_lens, case.seq_lens):
        visible = ql * (sl - ql) + ql * (ql + 1) // 2  # causal (query, key) pairs
        flops += 4 * visible * case.num_heads * case.head_dim
    res.triton_tflops = flops / (kernel_ms * 1e-3) / 1e12
    return res


def fmt(res: Result) -> str:
    def ms(x):
        return "      -  " if x is None else f"{x:9.3f}"

    head = (
        f"{res.name:26s} {res.dtype:8s} T={res.num_tokens:<5d} KV={res.kv_tokens:<7d} "
        f"triton {ms(res.triton_ms)} ms (graph {ms(res.triton_graph_ms)})  ref {ms(res.reference_ms)} ms  "
        f"sdpa {ms(res.sdpa_ms)} ms"
    )
    if res.triton_ms is None:
        return head
    sd = (
        ""
        if res.sdpa_ms is None
        else (f"  triton/sdpa {res.triton_ms / res.sdpa_ms:5.2f}x (sdpa-triton err {res.sdpa_vs_triton_err:.1e})")
    )
    return head + f"  | {res.triton_gbps:7.1f} GB/s {res.triton_tflops:7.2f} TFLOP/s  err {res.max_abs_err:.1e}{sd}"


def main(argv: list[str] | None = None) -> list[Result]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes (runs on CPU via the interpreter)")
    EngineConfig.add_flags(p, only=("dtype",), shown={"dtype": "auto: bfloat16 on cuda, float32 with --smoke off it"})
    p.add_argument("--iters", type=int, default=None, help="timed runs per case (median)")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--inner", type=int, default=10, help="back-to-back calls per CUDA-event sample (launch cost overlapped)")
    p.add_argument("--ref-iters", type=int, default=5, help="timed runs of the slow reference")
    p.add_argument("--num-splits", type=int, default=None, help="force the split-KV factor")
    p.add_argument("--cases", default=None, help="comma-separated substrings of case names to run")
    p.add_argument("--json", default=None, metavar="PATH", help="write results as JSON")
    args = p.parse_args(argv)

    cuda = torch.cuda.is_available()
    if not cuda:
        if not args.smoke:
            p.error("no CUDA device: only --smoke runs here (Triton interpreter on CPU)")
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    device = "cuda" if cuda else "cpu"
    dtype_name = args.dtype if args.dtype != "auto" else "bfloat16" if cuda else "float32"
    if not cuda and dtype_name == "bfloat16":
        print("note: the Triton interpreter computes bf16 dots wrongly; use float16/float32 on CPU", file=sys.stderr)
    dtype = getattr(torch, dtype_name)
    args.iters = args.iters or (3 if args.smoke else 30)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 10)

    try:
        import triton
    except ImportError:
        triton = None
        print(
            "kvtier bench attention: triton is not installed (pip install triton): timing the torch reference and SDPA only",
            file=sys.stderr,
        )
    from kvtier.model.backends import get_backend

    attn = get_backend("triton") if triton is not None else None
    triton_version = triton.__version__ if triton is not None else "not installed"
    torch.manual_seed(0)

    cases = smoke_cases() if args.smoke else full_cases()
    if args.cases:
        wanted = [w.strip() for w in args.cases.split(",") if w.strip()]
        cases = [c for c in cases if any(w in c.name for w in wanted)]
    dev_name = torch.cuda.get_device_name() if cuda else "cpu (triton interpreter)"
    print(f"# device {dev_name}  torch {torch.__version__}  triton {triton_version}  dtype {dtype_name}  iters {args.iters}")
    results = []
    for case in cases:
        res = run_case(case, dtype, device, args, attn)
        results.append(res)
        print(fmt(res) + ("" if not res.notes else "  # " + "; ".join(res.notes)), flush=True)
        if cuda:
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": dev_name,
                    "torch": torch.__version__,
                    "triton": triton_version,
                    "dtype": dtype_name,
                    "iters": args.iters,
                    "results": [asdict(r) for r in results],
                },
                f,
                indent=2,
            )
    return results


if __name__ == "__main__":
    main()
