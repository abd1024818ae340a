"""Triton MLA decode (absorbed form) vs the torch reference, on shuffled paged latent caches.

On a machine without CUDA the kernel runs in Triton's interpreter (TRITON_INTERPRET=1) in fp32
and fp16; bf16 runs on CUDA only (the interpreter's bf16 dot products are wrong)."""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

triton = pytest.importorskip("triton", reason="triton is not installed: the Triton MLA kernel is untested")

from kvtier.model.attention import AttentionMetadata  # noqa: E402
from kvtier.model.mla import reference_mla_absorbed  # noqa: E402
from kvtier.model.triton_mla import triton_mla_decode  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    pytest.skip("no CUDA and TRITON_INTERPRET is off: triton kernels cannot run", allow_module_level=True)


def make_case(seq_lens, heads, rank, rope, block_size, dtype, seed=0):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-s // block_size) for s in seq_lens]
    ids = list(range(sum(needed) + 3))
    rng.shuffle(ids)
    tables, i = [], 0
    for n in needed:
        tables.append(ids[i : i + n])
        i += n
    meta = AttentionMetadata.build([1] * len(seq_lens), seq_lens, tables, block_size, device=DEVICE)
    cache = torch.randn(len(ids), block_size, rank + rope, generator=gen).to(DEVICE, dtype)
    q = torch.randn(len(seq_lens), heads, rank + rope, generator=gen).to(DEVICE, dtype)
    return q, cache, meta


CASES = [
    # (seq_lens, heads, rank, rope, block_size): DeepSeek-V3's widths; the tiny presets'; odd sizes
    ([1, 37, 130], 16, 512, 64, 16),
    ([5, 64, 9, 200], 4, 32, 16, 8),
    ([300], 20, 48, 24, 4),
]
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("seq_lens, heads, rank, rope, block_size", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_matches_the_reference(seq_lens, heads, rank, rope, block_size, dtype, num_splits):
    q, cache, meta = make_case(seq_lens, heads, rank, rope, block_size, dtype)
    scale = 0.07
    want = reference_mla_absorbed(q, cache, meta, scale, rank)
    got = triton_mla_decode(q, cache, meta, scale, rank, num_splits=num_splits)
    assert got.shape == want.shape and got.dtype == q.dtype
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_a_block_table_entry_past_the_sequence_is_never_read():
    """Positions past a sequence's length are masked: garbage there (NaN) must not leak."""
    q, cache, meta = make_case([13, 3], 4, 32, 16, 8, torch.float32)
    used = {int(b) for row, n in zip(meta.block_tables.tolist(), meta.seq_lens_cpu) for b in row[: -(-n // 8)]}
    for b in range(cache.shape[0]):
        if b not in used:
            cache[b] = float("nan")
    cache[meta.block_tables[1, 0], 3:] = float("nan")  # the rest of sequence 1's only block
    got = triton_mla_decode(q, cache, meta, 0.1, 32, num_splits=2)
    assert torch.isfinite(got).all()


def test_prefill_rows_are_refused():
    q, cache, _ = make_case([4], 4, 32, 16, 8, torch.float32)
    meta = AttentionMetadata.build([2], [4], [[0]], 8, device=DEVICE)
    with pytest.raises(ValueError, match="decode rows only"):
        triton_mla_decode(q[:1].expand(2, -1, -1), cache, meta, 0.1, 32)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_an_fp8_latent_cache_is_dequantized_in_the_kernel_like_the_reference(fp8):
    """One scale per layer: the kernel folds it into the scores and the output; the reference
    multiplies the latents it reads. A kernel that ignored the scale would be off by its factor."""
    q, cache, meta = make_case([1, 37, 130], 8, 64, 32, 16, torch.float32)
    kv_scale = torch.tensor([0.03125], device=DEVICE)
    stored = (cache / kv_scale).clamp(-200, 200).to(fp8)
    want = reference_mla_absorbed(q, stored, meta, 0.08, 64, kv_scale)
    for splits in (1, 2):
        got = triton_mla_decode(q, stored, meta, 0.08, 64, num_splits=splits, kv_scale=kv_scale)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    unscaled = triton_mla_decode(q, stored, meta, 0.08, 64)
    assert not torch.allclose(unscaled, want, atol=1e-2)
    with pytest.raises(ValueError, match="kv_scale must be one number"):
        triton_mla_decode(q, stored, meta, 0.08, 64, kv_scale=torch.ones(2, device=DEVICE))
