"""Triton decode attention over a paged latent cache (MLA in the absorbed form: model/mla.py).

A decode row of multi-head latent attention is multi-query attention whose one key per position
is the whole latent ``[c_kv ; k_pe]`` (R + P wide: 512 + 64 for DeepSeek-V3) and whose value is
its first R columns. Every head of a sequence reads the same latents, so a program takes
``BLOCK_H`` heads of one sequence and each latent tile it gathers serves all of them::

    program (seq, head block, split):
        q      [BLOCK_H, R + P]   the absorbed queries (W_UK folded in: mla.absorb_query)
        for each tile of BLOCK_N positions of its KV range (through the block table):
            c, pe   [BLOCK_N, R], [BLOCK_N, P]   gathered once for the BLOCK_H heads
            s = q[:, :R] c^T + q[:, R:] pe^T     online softmax in fp32 (exp2, scale folded in)
            acc += p c                           [BLOCK_H, R] fp32
        out = acc / l, lse = m + log2(l)         one partial result per split

Sequences too few to fill the GPU split their KV range over ``num_splits`` programs
(flash-decoding); the partial results are merged with their log-sum-exps in torch. The kernel
has the signature of :func:`kvtier.model.mla.reference_mla_absorbed`, against which it is tested
(on CPU under Triton's interpreter: fp32 and fp16; bf16 on CUDA only, as for model/triton_attention.py).
"""

from __future__ import annotations

import math

import torch

from kvtier.model.attention import AttentionMetadata

try:
    import triton.language as tl

    from kvtier.triton_jit import jit
except ImportError as exc:  # pragma: no cover - exercised only where triton is missing
    _IMPORT_ERROR: ImportError | None = exc
else:
    _IMPORT_ERROR = None

#: heads of one sequence per program, latent positions per tile, warps, pipeline stages: the best
#: of `python scripts/gpu_mla_decode.py --sweep` on one H200 (DeepSeek-V3's 128 heads, 64 x 4K:
#: 447 us, against 697 us for 16 heads x 32 positions, 4 warps); CONFIG_OVERRIDE overrides them
DEFAULT_CONFIG = dict(block_h=64, block_n=64, num_warps=8, num_stages=2)
CONFIG_OVERRIDE: dict[str, int] = {}
MAX_SPLITS = 16
MIN_POSITIONS_PER_SPLIT = 256
LOG2E = math.log2(math.e)

if _IMPORT_ERROR is None:

    @jit(vary=["stride_bt", "num_splits"], unaligned=["seq_lens_ptr", "bt_ptr"])
    def mla_decode_kernel(
        q_ptr,  # [B, H, R + P]
        cache_ptr,  # [num_blocks, CACHE_BLOCK, R + P]
        bt_ptr,  # [B, stride_bt] int32
        seq_lens_ptr,  # [B] int32
        out_ptr,  # [num_splits, B, H, R] fp32
        lse_ptr,  # [num_splits, B, H] fp32
        kv_scale_ptr,  # [1] fp32: an fp8 cache's scale (read with HAS_KV_SCALE only)
        qk_scale,  # softmax scale * log2(e)
        stride_bt,
        num_splits,
        NUM_HEADS: tl.constexpr,
        R: tl.constexpr,
        P: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_P: tl.constexpr,
        BLOCK_HEADS: tl.constexpr,
        BLOCK_POS: tl.constexpr,
        CACHE_BLOCK: tl.constexpr,
        IEEE: tl.constexpr,
        HAS_KV_SCALE: tl.constexpr,
    ):
        seq = tl.program_id(0)
        head_block = tl.program_id(1)
        split = tl.program_id(2)
        num_seqs = tl.num_programs(0)
        W: tl.constexpr = R + P
        seq_len = tl.load(seq_lens_ptr + seq)
        tiles = tl.cdiv(seq_len, BLOCK_POS)
        per_split = tl.cdiv(tiles, num_splits)
        first = split * per_split
        last = tl.minimum(tiles, first + per_split)

        heads = head_block * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
        hmask = heads < NUM_HEADS
        r = tl.arange(0, BLOCK_R)
        rmask = r < R
        p = tl.arange(0, BLOCK_P)
        pmask = p < P
        q_rows = q_ptr + (seq * NUM_HEADS + heads[:, None]).to(tl.int64) * W
        q_nope = tl.load(q_rows + r[None, :], mask=hmask[:, None] & rmask[None, :], other=0.0)
        q_pe = tl.load(q_rows + R + p[None, :], mask=hmask[:, None] & pmask[None, :], other=0.0)

        if HAS_KV_SCALE:
            # an fp8 cache: tiles cast the stored numbers exactly; the one scale of the latent joins
            # the scores' scale and, at the end, the output's (model/kv_quant.py)
            kv_scale = tl.load(kv_scale_ptr)
            qk_scale = qk_scale * kv_scale
        m = tl.full([BLOCK_HEADS], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_HEADS], tl.float32)
        acc = tl.zeros([BLOCK_HEADS, BLOCK_R], tl.float32)
        for tile in range(first, last):
            pos = tile * BLOCK_POS + tl.arange(0, BLOCK_POS)
            nmask = pos < seq_len
            block = tl.load(bt_ptr + seq * stride_bt + pos // CACHE_BLOCK, mask=nmask, other=0)
            rows = cache_ptr + (block.to(tl.int64) * CACHE_BLOCK + pos % CACHE_BLOCK) * W
            c = tl.load(rows[:, None] + r[None, :], mask=nmask[:, None] & rmask[None, :], other=0.0).to(q_nope.dtype)
            pe = tl.load(rows[:, None] + R + p[None, :], mask=nmask[:, None] & pmask[None, :], other=0.0).to(q_pe.dtype)
            if IEEE:
                s = tl.dot(q_nope, tl.trans(c), input_precision="ieee")
                s += tl.dot(q_pe, tl.trans(pe), input_precision="ieee")
            else:
                s = tl.dot(q_nope, tl.trans(c))
                s += tl.dot(q_pe, tl.trans(pe))
            s = tl.where(nmask[None, :], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp2(m - m_new)
            prob = tl.exp2(s - m_new[:, None])
            denom = denom * alpha + tl.sum(prob, axis=1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(prob.to(c.dtype), c, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(prob.to(c.dtype), c)
            m = m_new

        safe = tl.where(denom > 0, denom, 1.0)
        out = acc / safe[:, None]
        if HAS_KV_SCALE:
            out = out * kv_scale
        lse = tl.where(denom > 0, m + tl.log2(safe), float("-inf"))
        row = (split * num_seqs + seq) * NUM_HEADS + heads
        tl.store(out_ptr + row[:, None].to(tl.int64) * R + r[None, :], out, mask=hmask[:, None] & rmask[None, :])
        tl.store(lse_ptr + row, lse, mask=hmask)


def _next_pow2(x: int) -> int:
    return max(16, 1 << max(0, (x - 1).bit_length()))  # (tl.dot needs 16 or more)


def launch_config(num_heads: int) -> dict[str, int]:
    """DEFAULT_CONFIG with CONFIG_OVERRIDE over it; a head block no wider than the heads need."""
    config = {**DEFAULT_CONFIG, **CONFIG_OVERRIDE}
    config["block_h"] = min(config["block_h"], _next_pow2(num_heads))
    return config


def choose_splits(num_seqs: int, num_heads: int, max_seq_len: int, sms: int, block_h: int) -> int:
    """Split-KV factor: 1 when the (sequence, head block) programs fill twice the SMs, else enough
    splits for that, each at least ``MIN_POSITIONS_PER_SPLIT`` positions, at most ``MAX_SPLITS``."""
    busy = num_seqs * -(-num_heads // block_h)
    if busy >= 2 * sms:
        return 1
    return max(1, min(MAX_SPLITS, -(-2 * sms // busy), max_seq_len // MIN_POSITIONS_PER_SPLIT))


def triton_mla_decode(
    query: torch.Tensor,
    latent_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kv_lora_rank: int,
    num_splits: int | None = None,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`kvtier.model.mla.reference_mla_absorbed` for decode rows (one new token per sequence):
    ``query`` [B, H, R + P] absorbed, ``latent_cache`` [num_blocks, block_size, R + P] (fp8 with
    its one ``kv_scale`` [1]). Returns [B, H, R] in the query's dtype. ``num_splits`` None:
    :func:`choose_splits`."""
    if _IMPORT_ERROR is not None:
        raise RuntimeError(f"the Triton MLA kernel needs triton ({_IMPORT_ERROR})")
    num_seqs, num_heads, width = query.shape
    if any(n != 1 for n in meta.query_lens_cpu) or num_seqs != meta.num_seqs:
        raise ValueError(f"triton_mla_decode takes decode rows only (one query per sequence), got {meta.query_lens_cpu}")
    if latent_cache.dim() != 3 or latent_cache.shape[-1] != width:
        raise ValueError(f"latent cache must be [num_blocks, block_size, {width}], got {tuple(latent_cache.shape)}")
    rank, rope = kv_lora_rank, width - kv_lora_rank
    config = launch_config(num_heads)
    if num_splits is None:
        sms = torch.cuda.get_device_properties(query.device).multi_processor_count if query.is_cuda else 4
        num_splits = choose_splits(num_seqs, num_heads, meta.max_seq_len, sms, config["block_h"])
    if kv_scale is not None and (kv_scale.numel() != 1 or kv_scale.device != query.device):
        raise ValueError(f"kv_scale must be one number on {query.device}, got {tuple(kv_scale.shape)} on {kv_scale.device}")
    query = query.contiguous()
    out = torch.empty(num_splits, num_seqs, num_heads, rank, dtype=torch.float32, device=query.device)
    lse = torch.empty(num_splits, num_seqs, num_heads, dtype=torch.float32, device=query.device)
    grid = (num_seqs, -(-num_heads // config["block_h"]), num_splits)
    mla_decode_kernel[grid](
        query,
        latent_cache,
        meta.block_tables,
        meta.seq_lens,
        out,
        lse,
        kv_scale.float().contiguous() if kv_scale is not None else lse,  # (not read without a scale)
        scale * LOG2E,
        meta.block_tables.stride(0),
        num_splits,
        NUM_HEADS=num_heads,
        R=rank,
        P=rope,
        BLOCK_R=_next_pow2(rank),
        BLOCK_P=_next_pow2(rope),
        BLOCK_HEADS=config["block_h"],
        BLOCK_POS=config["block_n"],
        CACHE_BLOCK=latent_cache.shape[1],
        IEEE=query.dtype == torch.float32,
        HAS_KV_SCALE=kv_scale is not None,
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
    )
    if num_splits == 1:
        return out[0].to(query.dtype)
    weights = torch.softmax(lse * math.log(2.0), dim=0)  # (log2 units; an empty split weighs 0)
    return (weights[..., None] * out).sum(dim=0).to(query.dtype)
