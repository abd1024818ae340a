"""Triton paged attention vs the torch reference.

On a machine without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1, numpy on
CPU tensors), on small shapes; the interpreter's ``tl.dot`` gives wrong results for bf16, so on CPU
the half-precision path is checked in fp16 (same kernel code) and bf16 only runs on CUDA.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    # must be set before triton is imported (kernels are decorated at import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton", reason="triton is not installed: triton attention backend untested")

from kvtier.model.attention import AttentionMetadata, reference_attention, write_kv  # noqa: E402
from kvtier.model.backends import get_backend  # noqa: E402
from kvtier.model.triton_attention import choose_splits, triton_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
if DEVICE == "cpu" and not INTERPRET:
    pytest.skip("no CUDA and TRITON_INTERPRET is off: triton kernels cannot run", allow_module_level=True)


def make_case(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0, device=DEVICE, spare_blocks=5):
    """Random paged KV cache with shuffled, non-contiguous block tables (+ unused blocks)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(needed) + spare_blocks
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables, i = [], 0
    for n in needed:
        tables.append(ids[i : i + n])
        i += n
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, device=device)
    # cached prefix: random fill; the step's new tokens: written through write_kv like the engine
    kv = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    kv = kv.to(device=device, dtype=dtype)
    t = sum(query_lens)
    new_k = torch.randn(t, num_kv_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    new_v = torch.randn(t, num_kv_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    write_kv(kv, new_k, new_v, meta.slot_mapping)
    q = torch.randn(t, num_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    return q, kv, meta


def check(q, kv, meta, atol, rtol=0.0, num_splits=None, **options):
    """triton_attention vs reference_attention with the same ``options`` (window, sinks, softcap)."""
    scale = q.shape[-1] ** -0.5
    out = triton_attention(q, kv, meta, scale, num_splits=num_splits, **options)
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    ref = reference_attention(q.float(), kv.float(), meta, scale, **options)
    assert torch.isfinite(out.float()).all()
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=rtol)
    return out


def random_batch(rng, num_seqs, max_seq, block_size):
    """Mixed decode / prefill over a cached prefix / full-prompt prefill."""
    q_lens, s_lens = [], []
    for _ in range(num_seqs):
        kind = rng.choice(["decode", "cached_prefill", "full_prefill"])
        s = rng.randint(1, max_seq)
        if s % block_size == 0 and rng.random() < 0.7:
            s = max(1, s - rng.randint(1, block_size - 1))
        if kind == "decode":
            q = 1
        elif kind == "full_prefill":
            q = s
        else:
            q = rng.randint(1, s)
        q_lens.append(q)
        s_lens.append(s)
    return q_lens, s_lens


# --------------------------------------------------------------------------- CPU (interpreter) + GPU


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("block_size", [16, 32])
def test_random_mixed_batches_fp32(group, block_size):
    rng = random.Random(100 * group + block_size)
    num_kv_heads = 2
    for trial in range(2):
        q_lens, s_lens = random_batch(rng, num_seqs=4, max_seq=90, block_size=block_size)
        q, kv, meta = make_case(q_lens, s_lens, group * num_kv_heads, num_kv_heads, 64, block_size, torch.float32, seed=trial)
        check(q, kv, meta, atol=1e-4)


def test_explicit_mix_decode_cached_prefill_full_prefill():
    # decode over long KV, prefill of 37 new tokens after a 50-token prefix, full 45-token prompt,
    # a 1-token prompt; lengths not multiples of the block size; spans several query tiles
    q_lens, s_lens = [1, 37, 45, 1, 1], [83, 87, 45, 1, 16]
    q, kv, meta = make_case(q_lens, s_lens, 4, 2, 64, 16, torch.float32, seed=1)
    check(q, kv, meta, atol=1e-4)


def test_non_power_of_two_group():
    q_lens, s_lens = [1, 30, 6], [50, 41, 6]
    q, kv, meta = make_case(q_lens, s_lens, 6, 2, 64, 16, torch.float32, seed=11)
    check(q, kv, meta, atol=1e-4)


def test_head_dim_128_block_64():
    q_lens, s_lens = [1, 20, 3], [70, 90, 3]
    q, kv, meta = make_case(q_lens, s_lens, 4, 1, 128, 64, torch.float32, seed=2)
    check(q, kv, meta, atol=1e-4)


def test_short_queries_use_decode_tile():
    # max_query_len <= 16 (speculative-decode-like): small tiles hold several tokens of a sequence
    q_lens, s_lens = [3, 1, 7, 16], [40, 9, 7, 50]
    q, kv, meta = make_case(q_lens, s_lens, 8, 2, 64, 16, torch.float32, seed=3)
    check(q, kv, meta, atol=1e-4)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 8])
def test_split_kv_decode(num_splits):
    # sequence lengths from 1 to several splits: some splits of short sequences are empty
    q_lens, s_lens = [1, 1, 1, 1], [1, 33, 150, 200]
    q, kv, meta = make_case(q_lens, s_lens, 4, 2, 64, 16, torch.float32, seed=4)
    check(q, kv, meta, atol=1e-4, num_splits=num_splits)


def test_split_kv_with_multi_token_queries():
    q_lens, s_lens = [4, 1, 9], [130, 64, 9]
    q, kv, meta = make_case(q_lens, s_lens, 4, 2, 64, 16, torch.float32, seed=5)
    check(q, kv, meta, atol=1e-4, num_splits=3)


def test_choose_splits():
    # a device hit: 48 new tokens over a 4K prefix fill 8 of 132 SMs -> split the KV range
    assert choose_splits([48], 4144, 64, 8, 132) == 16
    # decode of 4 sequences: few programs, split; bounded by MIN_POSITIONS_PER_SPLIT for short ones
    assert choose_splits([1] * 4, 4096, 8, 8, 132) == 8
    assert choose_splits([1] * 4, 300, 8, 8, 132) == 1
    # a full 4K prompt (64 query blocks x 8 heads) or a big decode batch already fill the GPU
    assert choose_splits([4096], 4096, 64, 8, 132) == 1
    assert choose_splits([1] * 64, 4096, 8, 8, 132) == 1
    for q in ([1], [48], [200, 3], [1] * 9):
        n = choose_splits(q, 8192, 64, 2, 132)
        assert n >= 1 and n & (n - 1) == 0


def test_split_kv_short_extend_over_long_prefix():
    # the shape of a device hit (a few new tokens over a cached prefix), split as choose_splits does;
    # the early rows of the tile see fewer positions: some splits are empty for them
    q, kv, meta = make_case([20, 3], [300, 150], 4, 2, 64, 16, torch.float32, seed=11)
    check(q, kv, meta, atol=1e-4, num_splits=4)


def test_fp16():
    q_lens, s_lens = [1, 25, 10], [60, 70, 10]
    q, kv, meta = make_case(q_lens, s_lens, 4, 2, 64, 16, torch.float16, seed=6)
    check(q, kv, meta, atol=2e-3, rtol=1e-2)
    check(q, kv, meta, atol=2e-3, rtol=1e-2, num_splits=2)


def test_non_contiguous_query_and_scale():
    q_lens, s_lens = [1, 19], [40, 30]
    q, kv, meta = make_case(q_lens, s_lens, 4, 2, 64, 16, torch.float32, seed=7)
    big = torch.zeros(q.shape[0], 3 * q.shape[1], q.shape[2], dtype=q.dtype, device=q.device)
    big[:, 4:8] = q
    qv = big[:, 4:8]  # e.g. a view into a fused qkv projection
    assert not qv.is_contiguous()
    out = triton_attention(qv, kv, meta, 0.3)
    ref = reference_attention(q, kv, meta, 0.3)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)


def test_registered_backend():
    assert get_backend("triton") is triton_attention


def test_rejects_bad_shapes():
    q, kv, meta = make_case([1], [5], 4, 2, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        q48 = torch.zeros(1, 4, 48, device=q.device)
        kv48 = torch.zeros(2, kv.shape[1], 16, 2, 48, device=q.device)
        triton_attention(q48, kv48, meta, 1.0)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        triton_attention(torch.zeros(1, 3, 64, device=q.device), kv, meta, 1.0)
    with pytest.raises(ValueError, match="tokens"):
        triton_attention(torch.zeros(2, 4, 64, device=q.device), kv, meta, 1.0)


# ------------------------------------------------- sliding window, attention sinks, soft-capping


@pytest.mark.parametrize("window", [1, 5, 16, 33, 1000])
def test_sliding_window_matches_reference(window):
    # windows starting mid-tile, at a tile edge, before position 0; a decode row, a chunk over a
    # cached prefix, a full prompt spanning query tiles
    q_lens, s_lens = [1, 37, 45, 1], [83, 87, 45, 16]
    q, kv, meta = make_case(q_lens, s_lens, 4, 2, 64, 16, torch.float32, seed=21)
    check(q, kv, meta, atol=1e-4, window=window)


def test_sliding_window_with_short_queries_split_over_the_window():
    # decode tiles; the window (not the sequence) is what the splits share
    q, kv, meta = make_case([1, 3, 1], [150, 90, 7], 4, 2, 64, 16, torch.float32, seed=22)
    check(q, kv, meta, atol=1e-4, window=40, num_splits=3)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_sinks_and_softcap_with_a_window_match_reference(num_splits):
    q, kv, meta = make_case([1, 19, 1], [70, 40, 30], 4, 2, 64, 16, torch.float32, seed=23)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(23)).to(DEVICE) * 2
    check(q, kv, meta, atol=1e-4, num_splits=num_splits, window=20, sinks=sinks, softcap=2.0)


def test_sinks_alone_and_softcap_alone_match_reference():
    q, kv, meta = make_case([1, 25], [40, 25], 4, 2, 64, 16, torch.float32, seed=24)
    check(q, kv, meta, atol=1e-4, sinks=torch.full((4,), 3.0, device=DEVICE))
    check(q, kv, meta, atol=1e-4, softcap=1.0)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_keys_below_every_window_are_never_read(num_splits):
    """The cache may drop the blocks a sliding layer no longer sees (their table entries then name
    other blocks): poisoning the positions below each sequence's lowest visible key changes nothing."""
    window = 12
    q_lens, s_lens = [1, 20, 2], [90, 60, 41]
    q, kv, meta = make_case(q_lens, s_lens, 4, 2, 64, 16, torch.float32, seed=25)
    clean = triton_attention(q, kv, meta, 0.125, window=window, num_splits=num_splits)
    for i, (q_len, s_len) in enumerate(zip(q_lens, s_lens)):
        below = torch.arange(s_len - q_len - window + 1, device=DEVICE)  # under the first query's window
        blocks = meta.block_tables[i].long()[below // 16]
        kv[:, blocks, below % 16] = float("nan")

    out = triton_attention(q, kv, meta, 0.125, window=window, num_splits=num_splits)

    torch.testing.assert_close(out, clean, atol=0, rtol=0)
    torch.testing.assert_close(out, reference_attention(q, kv, meta, 0.125, window=window), atol=1e-4, rtol=0)


def test_rejects_bad_attention_options():
    q, kv, meta = make_case([1], [5], 4, 2, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="window must be"):
        triton_attention(q, kv, meta, 1.0, window=0)
    with pytest.raises(ValueError, match=r"sinks must be one logit per query head \(\[4\]\)"):
        triton_attention(q, kv, meta, 1.0, sinks=torch.zeros(2, device=q.device))


# --------------------------------------------------------------------------- GPU only

gpu = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU (one H100 or H200 runs it): large cases, too slow in the Triton interpreter on CPU",
)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 2e-2), (torch.float16, 4e-3), (torch.float32, 1e-4)])
@pytest.mark.parametrize("group,head_dim", [(2, 128), (4, 64), (1, 128)])
def test_gpu_mixed_large(dtype, atol, group, head_dim):
    rng = random.Random(7)
    num_kv_heads = 4
    q_lens, s_lens = random_batch(rng, num_seqs=12, max_seq=1500, block_size=16)
    q_lens += [1] * 20
    s_lens += [rng.randint(1, 3000) for _ in range(20)]
    q, kv, meta = make_case(q_lens, s_lens, group * num_kv_heads, num_kv_heads, head_dim, 16, dtype)
    check(q, kv, meta, atol=atol, rtol=1e-2 if dtype != torch.float32 else 0.0)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-4)])
@pytest.mark.parametrize("num_splits", [None, 1, 7])
def test_gpu_decode(dtype, atol, num_splits):
    rng = random.Random(8)
    n = 48
    s_lens = [rng.randint(1, 4096) for _ in range(n)]
    q, kv, meta = make_case([1] * n, s_lens, 16, 8, 128, 16, dtype, seed=8)
    check(q, kv, meta, atol=atol, rtol=1e-2 if dtype != torch.float32 else 0.0, num_splits=num_splits)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-4)])
def test_gpu_short_extend_auto_splits(dtype, atol):
    # 48 new tokens over a 4K cached prefix: split automatically (the device-hit shape)
    q, kv, meta = make_case([48], [4144], 16, 8, 128, 16, dtype, seed=12)
    check(q, kv, meta, atol=atol, rtol=1e-2 if dtype != torch.float32 else 0.0)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-4)])
@pytest.mark.parametrize("window", [128, 1000])
def test_gpu_sliding_window_with_sinks_and_softcap(dtype, atol, window):
    # gpt-oss's window (128) and a wider one; decode rows split automatically, prefill chunks
    rng = random.Random(13)
    q_lens = [1] * 16 + [300, 77]
    s_lens = [rng.randint(1, 3000) for _ in range(16)] + [2300, 500]
    q, kv, meta = make_case(q_lens, s_lens, 16, 8, 128, 16, dtype, seed=13)
    sinks = torch.randn(16, device=DEVICE)
    rtol = 1e-2 if dtype != torch.float32 else 0.0
    check(q, kv, meta, atol=atol, rtol=rtol, window=window)
    check(q, kv, meta, atol=atol, rtol=rtol, window=window, sinks=sinks)
    check(q, kv, meta, atol=atol, rtol=rtol, window=window, softcap=20.0)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-4)])
@pytest.mark.parametrize("block_size", [16, 64])
def test_gpu_prefill_over_cached_prefix(dtype, atol, block_size):
    q, kv, meta = make_case([1024, 1000, 77], [3072, 1000, 2100], 16, 8, 128, block_size, dtype, seed=9)
    check(q, kv, meta, atol=atol, rtol=1e-2 if dtype != torch.float32 else 0.0)


# ------------------------------------------------------------------ one kernel per configuration
def test_step_varying_arguments_are_not_specialized():
    """A new batch size, block-table width or upload offset must not compile a new kernel in the
    middle of serving (kvtier/triton_jit.py); the copy kernel's layer, block count and id offsets
    likewise. The rest (strides of the KV cache, the q/out pointers) stays specialized."""
    from kvtier.model.triton_attention import unified_attention_kernel
    from kvtier.transfer.kernels import copy_chunks

    def flags(kernel):
        """name -> (value not specialized, alignment not specialized), as the decorator was given them."""
        kw = getattr(kernel, "kwargs", None) or vars(kernel)  # interpreted (CPU) or compiled (GPU)
        vary = set(kw["do_not_specialize"] or ())
        unaligned = set(kw.get("do_not_specialize_on_alignment") or ()) | vary
        names = getattr(kernel, "arg_names", None) or [p.name for p in kernel.params]
        return {n: (n in vary, n in unaligned) for n in names}

    attn = flags(unified_attention_kernel)
    assert all(attn[n][0] for n in ("num_seqs", "tiles_per_split", "stride_bt", "window"))
    assert all(attn[n][1] for n in ("seq_lens_ptr", "bt_ptr"))
    assert not any(attn[n][0] or attn[n][1] for n in ("q_ptr", "kv_ptr", "out_ptr", "stride_kb", "stride_qt"))
    copy = flags(copy_chunks)
    assert all(copy[n][0] for n in ("src_layer0", "dst_layer0", "num_work", "num_lk", "num_parts"))
    assert all(copy[n][1] for n in ("src_ids", "dst_ids"))
    assert not any(copy[n][0] or copy[n][1] for n in ("src", "dst", "src_block_stride", "dst_block_stride"))


def packed(meta):
    """``meta`` with query_start_loc, seq_lens and block_tables carved from one int32 buffer, as
    the engine uploads them (engine/runner.py): where each starts moves with the batch size."""
    b = meta.num_seqs
    flat = torch.cat([meta.query_start_loc, meta.seq_lens, meta.block_tables.reshape(-1)])
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping,
        query_start_loc=flat[: b + 1],
        seq_lens=flat[b + 1 : 2 * b + 1],
        block_tables=flat[2 * b + 1 :].view(b, -1),
        query_lens_cpu=meta.query_lens_cpu,
        seq_lens_cpu=meta.seq_lens_cpu,
        max_query_len=meta.max_query_len,
        max_seq_len=meta.max_seq_len,
        slot_mapping_cpu=meta.slot_mapping_cpu,
    )


@pytest.mark.skipif(DEVICE != "cuda", reason="GPU only: counts the kernels Triton compiled for CUDA")
def test_batches_of_any_size_and_table_width_share_one_compiled_kernel():
    from kvtier.model.triton_attention import unified_attention_kernel as kernel

    def compiled():
        return sum(len(cache[0]) for cache in kernel.device_caches.values())

    # prefill steps (one launch configuration: every query > 16 tokens), 1..6 sequences, tables
    # 2, 16, 17 blocks wide
    cases = [
        ([18], [18]),
        ([20, 17], [20, 30]),
        ([40, 33, 17], [250, 33, 17]),
        ([32] * 4, [32, 64, 96, 272]),
        ([24] * 5, [24, 48, 256, 100, 31]),
        ([17] * 6, [17, 18, 19, 20, 21, 260]),
    ]
    seen = None
    for i, (q_lens, s_lens) in enumerate(cases):
        q, kv, meta = make_case(q_lens, s_lens, 8, 2, 64, 16, torch.bfloat16, seed=i)
        check(q, kv, packed(meta), atol=2e-2, rtol=2e-2, num_splits=1)
        seen = compiled() if seen is None else seen
    assert compiled() == seen, f"{compiled() - seen} more kernels compiled for step-varying shapes"
