"""Triton attention backend over paged KV (same contract as :func:`reference_attention`).

Over 600 lines: one kernel and what only it uses (its tile step, the merge of its splits, its
launch configurations, its launcher); the tile step's three call sites (a window's lower edge,
the tiles every row sees, the causal edge) spell out its arguments one per line.

One "unified" flash-attention kernel serves decode, chunked prefill over a cached prefix and
full-prompt prefill in the same varlen batch:

* program ``(q_block, kv_head[, split])``: a tile of ``BLOCK_M`` rows = ``BLOCK_Q`` consecutive
  query tokens of one sequence x the ``GROUP`` query heads that share ``kv_head`` (GQA), so every
  K/V tile fetched from the cache is used by the whole head group;
* the sequence of a ``q_block`` is found by a binary search over ``query_start_loc`` on the device
  (no host->device copy per step); the grid is an upper bound (``T // BLOCK_Q + num_seqs``) and
  programs with no tokens exit at once;
* KV is walked in tiles of ``BLOCK_N`` positions gathered through the block table (tile size is
  independent of the cache block size); tiles entirely visible to every row of the query tile run
  without the mask, the rest are masked (query at absolute position p sees 0..p, or with a
  sliding ``window`` p - window + 1 .. p). With a window the walk starts at the tile of the first
  row's lowest key: positions below every row's window are never read, nor their block-table
  entries::

      tiles     |  A  |  A  |  B  |  B  |  C  |  C  |        A: masked (the window's lower edge)
      keys      kv_start ...                   kv_end        B: unmasked, C: masked (causal edge)

* online softmax in fp32 (``exp2`` with the scale folded in), fp32 accumulator; Gemma 2's
  soft-capping bounds the scores before the mask, gpt-oss's attention sinks join the final
  normalisation (and the merge of splits) as one more logit per head;
* steps with too few programs to fill the GPU (decode; a short extend over a long cached prefix)
  split the KV range of each program over ``num_splits`` programs (flash-decoding); a small
  second kernel merges the partial results (:func:`choose_splits`).

fp32 inputs use IEEE fp32 dot products (set ``ALLOW_TF32 = True`` to trade accuracy for speed).
Tile sizes come from :func:`_launch_config` (a "decode" config when ``max_query_len <= 16``, else a
"prefill" one); ``CONFIG_OVERRIDE`` overrides them for tuning. The kernels have no host syncs and
can be captured in a CUDA graph (the output is allocated with ``torch.empty``).

Measured on an H100 (torch 2.11, triton 3.6, bf16, 16 heads / 8 KV heads, head_dim 128, block 16,
kernel time from CUDA-graph replays): decode of 64-256 sequences x 1-4K tokens reads KV at
2.7-3.0 TB/s (within 3-7% of SDPA flash-decoding on contiguous K/V); 4 x 1024 new tokens over a
2K cached prefix 0.29 ms (~300 TFLOP/s, on par with SDPA); a 4K full prompt 0.26 ms (SDPA's
contiguous causal flash kernel: 0.15 ms).

Under Triton's CPU interpreter (``TRITON_INTERPRET=1``) fp32 and fp16 are right; bf16 dot
products are not (interpreter limitation), so bf16 is only checked on CUDA.
"""

from __future__ import annotations

import math

import torch

from kvtier.model.attention import AttentionMetadata, check_attention_options

try:
    import triton
    import triton.language as tl

    from kvtier.triton_jit import jit
except ImportError as exc:  # pragma: no cover - exercised only where triton is missing
    _IMPORT_ERROR: ImportError | None = exc
else:
    _IMPORT_ERROR = None

#: use TF32 tensor cores for fp32 inputs (faster on GPU, ~1e-3 relative error)
ALLOW_TF32 = False
#: a step whose longest query has at most this many tokens uses the small (decode) tile
DECODE_MAX_QUERY_LEN = 16
#: split-KV when fewer programs than SMs have work; then aim at this many programs per SM
SPLIT_TARGET_PROGRAMS_PER_SM = 2
MAX_SPLITS = 32
#: minimum KV positions per split (each split must amortize its partial write + merge)
MIN_POSITIONS_PER_SPLIT = 256
#: tuning hook: {"decode"|"prefill": {"block_m"?, "block_n"?, "num_warps"?, "num_stages"?, "k_rows"?}}
#: ("k_rows": load K tiles as [BLOCK_N, HEAD_DIM] and transpose on chip, else [HEAD_DIM, BLOCK_N])
CONFIG_OVERRIDE: dict[str, dict[str, int]] = {}


LOG2E = math.log2(math.e)  # (the kernels spell it out: a jitted function reads no module globals)

if _IMPORT_ERROR is None:

    @triton.jit
    def _find_seq(qsl_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
        """Largest i with ``qsl[i] // BLOCK_Q + i <= q_block`` (first q-block slot of sequence i)."""
        lo = 0
        hi = num_seqs
        while lo < hi:
            mid = (lo + hi) // 2
            val = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
            is_le = val <= q_block
            lo = tl.where(is_le, mid + 1, lo)
            hi = tl.where(is_le, hi, mid)
        return lo - 1

    @triton.jit
    def _attn_tile(
        q,
        acc,
        l_i,
        m_i,
        kv_ptr,
        bt_row_ptr,
        tile,
        kvh,
        kv_start,
        kv_end,
        q_pos,
        q_lo,
        offs_d,
        scale_log2,
        cap_log2,
        stride_kv,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_kd,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        MASKED: tl.constexpr,
        SOFTCAP: tl.constexpr,
        PRECISION: tl.constexpr,
        K_ROWS: tl.constexpr,
    ):
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        if MASKED:
            in_range = (offs_n >= kv_start) & (offs_n < kv_end)
            blk = tl.load(bt_row_ptr + offs_n // BLOCK_SIZE, mask=in_range, other=0)
        else:
            blk = tl.load(bt_row_ptr + offs_n // BLOCK_SIZE)
        slot = blk.to(tl.int64) * stride_kb + (offs_n % BLOCK_SIZE) * stride_ks + kvh * stride_kh
        v_ptrs = kv_ptr + stride_kv + slot[:, None] + offs_d[None, :] * stride_kd  # [N, D]
        if K_ROWS:
            k_ptrs = kv_ptr + slot[:, None] + offs_d[None, :] * stride_kd  # [N, D]
            if MASKED:
                k = tl.load(k_ptrs, mask=in_range[:, None], other=0.0)
            else:
                k = tl.load(k_ptrs)
            k = tl.trans(k.to(q.dtype))
        else:
            k_ptrs = kv_ptr + slot[None, :] + offs_d[:, None] * stride_kd  # [D, N]
            if MASKED:
                k = tl.load(k_ptrs, mask=in_range[None, :], other=0.0)
            else:
                k = tl.load(k_ptrs)
            k = k.to(q.dtype)
        if MASKED:
            v = tl.load(v_ptrs, mask=in_range[:, None], other=0.0)
        else:
            v = tl.load(v_ptrs)
        v = v.to(q.dtype)
        s = tl.dot(q, k, input_precision=PRECISION) * scale_log2  # [M, N] fp32
        if SOFTCAP:
            # here scale_log2 = scale / softcap: softcap * tanh(scale * qk / softcap), in log2 units
            s = (2.0 * tl.sigmoid(2.0 * s) - 1.0) * cap_log2
        if MASKED:
            visible = (offs_n[None, :] <= q_pos[:, None]) & (offs_n[None, :] >= q_lo[:, None])
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # rows with nothing visible yet keep m = -inf; use 0 as the exp reference for them
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_ref[:, None])
        alpha = tl.math.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        return acc, l_i, m_new

    # Nothing that changes from step to step is specialized (kvtier/triton_jit.py): a new batch
    # size, block-table width or batch-size parity (where seq_lens and the block tables start in
    # the step's upload buffer) must not compile a new kernel in the middle of serving.
    # (a model's window is fixed, but it is not specialized either: every window shares the kernel)
    @jit(vary=["num_seqs", "tiles_per_split", "stride_bt", "window"], unaligned=["seq_lens_ptr", "bt_ptr"])
    def unified_attention_kernel(
        q_ptr,
        kv_ptr,
        out_ptr,
        part_o_ptr,
        part_ml_ptr,
        bt_ptr,
        seq_lens_ptr,
        qsl_ptr,
        sinks_ptr,
        kv_scale_ptr,
        scale_log2,
        cap_log2,
        window,
        num_seqs,
        num_heads,
        tiles_per_split,
        stride_qt,
        stride_qh,
        stride_qd,
        stride_kv,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_kd,
        stride_ot,
        stride_oh,
        stride_od,
        stride_bt,
        BLOCK_SIZE: tl.constexpr,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        BLOCK_N: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        HAS_SINKS: tl.constexpr,
        SOFTCAP: tl.constexpr,
        PRECISION: tl.constexpr,
        K_ROWS: tl.constexpr,
        HAS_KV_SCALE: tl.constexpr,
    ):
        # last q-blocks first: under the causal mask they have the most KV to walk
        q_block = tl.num_programs(0) - 1 - tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)

        seq = _find_seq(qsl_ptr, q_block, num_seqs, BLOCK_Q)
        q_start = tl.load(qsl_ptr + seq)
        q_len = tl.load(qsl_ptr + seq + 1) - q_start
        q_block_local = q_block - (q_start // BLOCK_Q + seq)
        if q_block_local * BLOCK_Q >= q_len:
            return
        seq_len = tl.load(seq_lens_ptr + seq)
        context_len = seq_len - q_len

        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        tok_local = q_block_local * BLOCK_Q + offs_m // GROUP
        head = kvh * GROUP + offs_m % GROUP
        row_valid = (offs_m < BLOCK_Q * GROUP) & (tok_local < q_len)
        q_pos = context_len + tok_local
        token = (q_start + tok_local).to(tl.int64)

        q = tl.load(
            q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
            mask=row_valid[:, None],
            other=0.0,
        )

        # KV range of this query tile: [kv_start, kv_end) (module docstring); tiles in
        # [w_full, n_full) are visible to all rows: inside every row's window, below every row's position
        first_pos = context_len + q_block_local * BLOCK_Q
        last_pos = context_len + tl.minimum(q_block_local * BLOCK_Q + BLOCK_Q, q_len) - 1
        kv_end = last_pos + 1
        q_lo = tl.where(window > 0, q_pos - window + 1, 0)  # each row's lowest visible key
        kv_start = tl.where(window > 0, tl.maximum(first_pos - window + 1, 0), 0)
        w_full = tl.where(window > 0, tl.cdiv(tl.maximum(last_pos - window + 1, 0), BLOCK_N), 0)
        n_tiles = tl.cdiv(kv_end, BLOCK_N)
        n_full = (first_pos + 1) // BLOCK_N
        if NUM_SPLITS == 1:
            t_lo = kv_start // BLOCK_N
            t_hi = n_tiles
        else:
            t_lo = kv_start // BLOCK_N + split * tiles_per_split
            t_hi = tl.minimum(t_lo + tiles_per_split, n_tiles)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        bt_row_ptr = bt_ptr + seq.to(tl.int64) * stride_bt
        if HAS_KV_SCALE:
            # an fp8 cache: tiles cast the stored numbers exactly; K's scale joins the score's
            # scale, V's the output's (kv_scale [2, num_kv_heads], model/kv_quant.py)
            scale_log2 = scale_log2 * tl.load(kv_scale_ptr + kvh)
            v_scale = tl.load(kv_scale_ptr + tl.num_programs(1) + kvh)

        for tile in range(t_lo, tl.minimum(t_hi, w_full)):  # A: the window's lower edge
            acc, l_i, m_i = _attn_tile(
                q,
                acc,
                l_i,
                m_i,
                kv_ptr,
                bt_row_ptr,
                tile,
                kvh,
                kv_start,
                kv_end,
                q_pos,
                q_lo,
                offs_d,
                scale_log2,
                cap_log2,
                stride_kv,
                stride_kb,
                stride_ks,
                stride_kh,
                stride_kd,
                BLOCK_SIZE,
                BLOCK_N,
                True,
                SOFTCAP,
                PRECISION,
                K_ROWS,
            )
        for tile in range(tl.maximum(t_lo, w_full), tl.minimum(t_hi, n_full)):  # B: visible to every row
            acc, l_i, m_i = _attn_tile(
                q,
                acc,
                l_i,
                m_i,
                kv_ptr,
                bt_row_ptr,
                tile,
                kvh,
                kv_start,
                kv_end,
                q_pos,
                q_lo,
                offs_d,
                scale_log2,
                cap_log2,
                stride_kv,
                stride_kb,
                stride_ks,
                stride_kh,
                stride_kd,
                BLOCK_SIZE,
                BLOCK_N,
                False,
                SOFTCAP,
                PRECISION,
                K_ROWS,
            )
        for tile in range(tl.maximum(tl.maximum(t_lo, w_full), n_full), t_hi):  # C: the causal edge
            acc, l_i, m_i = _attn_tile(
                q,
                acc,
                l_i,
                m_i,
                kv_ptr,
                bt_row_ptr,
                tile,
                kvh,
                kv_start,
                kv_end,
                q_pos,
                q_lo,
                offs_d,
                scale_log2,
                cap_log2,
                stride_kv,
                stride_kb,
                stride_ks,
                stride_kh,
                stride_kd,
                BLOCK_SIZE,
                BLOCK_N,
                True,
                SOFTCAP,
                PRECISION,
                K_ROWS,
            )
        if HAS_KV_SCALE:
            acc = acc * v_scale

        if NUM_SPLITS == 1:
            if HAS_SINKS:  # one more logit per head in the denominator, in log2 units (x log2(e)) as m_i
                sink = tl.load(sinks_ptr + head, mask=row_valid, other=0.0).to(tl.float32) * 1.4426950408889634
                m_fin = tl.maximum(m_i, sink)
                rescale = tl.math.exp2(m_i - m_fin)
                l_i = l_i * rescale + tl.math.exp2(sink - m_fin)
                acc = acc * rescale[:, None]
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            tl.store(
                out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od,
                out.to(out_ptr.dtype.element_ty),
                mask=row_valid[:, None],
            )
        else:
            # partials: o [T, H, S, D] (unnormalized), ml [T, H, S, 2] (log2-domain max, sum)
            part = (token * num_heads + head) * NUM_SPLITS + split
            tl.store(part_o_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_valid[:, None])
            tl.store(part_ml_ptr + part * 2, m_i, mask=row_valid)
            tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_valid)

    @jit()
    def _merge_splits_kernel(
        part_o_ptr,
        part_ml_ptr,
        out_ptr,
        sinks_ptr,
        num_heads,
        stride_ot,
        stride_oh,
        stride_od,
        HEAD_DIM: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        SPLITS_P2: tl.constexpr,
        HAS_SINKS: tl.constexpr,
    ):
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        offs_s = tl.arange(0, SPLITS_P2)
        offs_d = tl.arange(0, HEAD_DIM)
        s_valid = offs_s < NUM_SPLITS
        part = (token * num_heads + head) * NUM_SPLITS + offs_s
        m = tl.load(part_ml_ptr + part * 2, mask=s_valid, other=float("-inf"))
        sums = tl.load(part_ml_ptr + part * 2 + 1, mask=s_valid, other=0.0)
        m_max = tl.max(m, axis=0)
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634  # log2(e)
            m_max = tl.maximum(m_max, sink)
        w = tl.where(m == float("-inf"), 0.0, tl.math.exp2(m - m_max))
        o = tl.load(part_o_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], mask=s_valid[:, None], other=0.0)
        denom = tl.sum(sums * w, axis=0)
        if HAS_SINKS:
            denom += tl.math.exp2(sink - m_max)
        res = tl.sum(o * w[:, None], axis=0) / tl.where(denom == 0.0, 1.0, denom)
        tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d * stride_od, res.to(out_ptr.dtype.element_ty))


def choose_splits(query_lens: list[int], max_seq_len: int, block_q: int, num_kv_heads: int, sms: int) -> int:
    """Split-KV factor (a power of two) for a step: 1 when its programs fill the GPU, else enough
    splits of the KV range for ``SPLIT_TARGET_PROGRAMS_PER_SM`` programs per SM, each split at
    least ``MIN_POSITIONS_PER_SPLIT`` positions. Decode steps and short extends over a long cached
    prefix (a device hit: 48 new tokens over 4K are 8 programs on 132 SMs) both need it."""
    if max(query_lens) <= block_q:
        busy = len(query_lens) * num_kv_heads
    else:
        busy = sum(-(-q // block_q) for q in query_lens) * num_kv_heads
    if busy >= sms:
        return 1
    n = min(MAX_SPLITS, -(-SPLIT_TARGET_PROGRAMS_PER_SM * sms // busy), max(1, max_seq_len // MIN_POSITIONS_PER_SPLIT))
    return 1 << (max(1, n).bit_length() - 1)  # a power of two: NUM_SPLITS is a compile-time constant


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def _launch_config(dtype: torch.dtype, head_dim: int, group: int, max_query_len: int):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages, K_ROWS) for this step.

    Defaults measured on an H100 (torch 2.11, triton 3.6, bf16, head_dim 128, block_size 16):
    decode ~3 TB/s of KV (on par with SDPA flash-decoding on contiguous K/V); prefill over a
    cached prefix ~290 TFLOP/s.
    """
    is_fp32 = dtype == torch.float32
    if max_query_len <= DECODE_MAX_QUERY_LEN:
        # memory-bound: few rows (one token x the GQA group), wide KV tiles
        kind = "decode"
        block_m = max(16, _next_pow2(group))
        block_n = 32 if (head_dim > 128 or (is_fp32 and head_dim > 64)) else (64 if is_fp32 else 128)
        num_warps, num_stages, k_rows = 4, 2, False
    elif is_fp32 or head_dim > 128:
        kind = "prefill"
        block_m, block_n, num_warps, num_stages = max(64, _next_pow2(group)), 32, 4, 2
        k_rows = True
    else:
        # 128x128 tiles, 8 warps, 3 stages, K loaded row-major: best of a sweep on H100
        kind = "prefill"
        block_m, block_n, num_warps, num_stages = max(128, _next_pow2(group)), 128, 8, 3
        k_rows = True
    over = CONFIG_OVERRIDE.get(kind)
    if over:
        block_m = max(over.get("block_m", block_m), _next_pow2(group))
        block_n = over.get("block_n", block_n)
        num_warps = over.get("num_warps", num_warps)
        num_stages = over.get("num_stages", num_stages)
        k_rows = bool(over.get("k_rows", k_rows))
    return block_m, block_n, num_warps, num_stages, k_rows


def triton_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    kv_scale: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Causal attention of ``query`` [num_tokens, num_heads, head_dim] over paged KV.

    Same contract as :func:`kvtier.model.attention.reference_attention` (``window``, ``sinks``,
    ``softcap``, ``kv_scale`` of an fp8 cache included). ``num_splits`` forces the split-KV factor (``None``: chosen from the
    GPU size; always 1 off CUDA).
    """
    if _IMPORT_ERROR is not None:
        raise ImportError("the triton attention backend needs the `triton` package") from _IMPORT_ERROR
    if query.dim() != 3:
        raise ValueError(f"query must be [num_tokens, num_heads, head_dim], got {tuple(query.shape)}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim], got {tuple(kv_cache.shape)}")
    num_tokens, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, kv_head_dim = kv_cache.shape
    if kv_head_dim != head_dim:
        raise ValueError(f"query head_dim {head_dim} != kv_cache head_dim {kv_head_dim}")
    if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
        raise ValueError(f"triton attention needs a power-of-two head_dim in [16, 256], got {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if query.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"unsupported dtype {query.dtype}")
    if query.device != kv_cache.device:
        raise ValueError(f"query on {query.device} but kv_cache on {kv_cache.device}")
    if num_tokens != sum(meta.query_lens_cpu):
        raise ValueError(f"query has {num_tokens} tokens, metadata {sum(meta.query_lens_cpu)}")
    check_attention_options(query, window, sinks, softcap)
    if kv_scale is not None and (tuple(kv_scale.shape) != (2, num_kv_heads) or kv_scale.device != query.device):
        raise ValueError(
            f"kv_scale must be [2, {num_kv_heads}] on {query.device}, got {tuple(kv_scale.shape)} on {kv_scale.device}"
        )
    if kv_scale is not None:
        kv_scale = kv_scale.float().contiguous()

    out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    num_seqs = meta.num_seqs if meta.graph_num_seqs is None else meta.graph_num_seqs
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    qsl = meta.query_start_loc
    seq_lens = meta.seq_lens
    block_tables = meta.block_tables
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()

    block_m, block_n, num_warps, num_stages, k_rows = _launch_config(query.dtype, head_dim, group, meta.max_query_len)
    block_q = block_m // group
    num_q_blocks = num_tokens // block_q + num_seqs  # upper bound; extra programs exit
    # KV positions one program walks: the whole prefix, or a window and a query tile's spread
    kv_span = meta.max_seq_len if window is None else min(meta.max_seq_len, window + block_q - 1)
    n_kv_tiles = triton.cdiv(meta.max_seq_len, block_n)
    if window is not None:  # tiles a window of kv_span positions can touch, however it is aligned
        n_kv_tiles = min(n_kv_tiles, (kv_span - 1) // block_n + 2)

    if num_splits is None:
        num_splits = (
            choose_splits(meta.query_lens_cpu, kv_span, block_q, num_kv_heads, _sm_count(query.device)) if query.is_cuda else 1
        )
        num_splits = 1 << (min(num_splits, n_kv_tiles).bit_length() - 1)
    num_splits = max(1, min(int(num_splits), n_kv_tiles))
    tiles_per_split = triton.cdiv(n_kv_tiles, num_splits)

    if num_splits > 1:
        part_o = torch.empty((num_tokens, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device)
        part_ml = torch.empty((num_tokens, num_heads, num_splits, 2), dtype=torch.float32, device=query.device)
    else:
        part_o = part_ml = out  # unused

    precision = "tf32" if (ALLOW_TF32 and query.dtype == torch.float32) else "ieee"
    # soft-capping: the kernel scales q.k by scale / softcap, then tanh(.) by softcap (log2 units)
    scale_log2 = float(scale) / softcap if softcap is not None else float(scale) * LOG2E
    cap_log2 = softcap * LOG2E if softcap is not None else 1.0
    grid = (num_q_blocks, num_kv_heads, num_splits)
    unified_attention_kernel[grid](
        query,
        kv_cache,
        out,
        part_o,
        part_ml,
        block_tables,
        seq_lens,
        qsl,
        sinks if sinks is not None else query,  # (not read without sinks)
        kv_scale if kv_scale is not None else query,  # (not read without scales)
        scale_log2,
        cap_log2,
        window or 0,
        num_seqs,
        num_heads,
        tiles_per_split,
        query.stride(0),
        query.stride(1),
        query.stride(2),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        kv_cache.stride(4),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        block_tables.stride(0),
        BLOCK_SIZE=block_size,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        HAS_SINKS=sinks is not None,
        SOFTCAP=softcap is not None,
        PRECISION=precision,
        K_ROWS=k_rows,
        HAS_KV_SCALE=kv_scale is not None,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            part_o,
            part_ml,
            out,
            sinks if sinks is not None else out,
            num_heads,
            out.stride(0),
            out.stride(1),
            out.stride(2),
            HEAD_DIM=head_dim,
            NUM_SPLITS=num_splits,
            SPLITS_P2=_next_pow2(num_splits),
            HAS_SINKS=sinks is not None,
            num_warps=4 if head_dim >= 128 else 2,
        )
    return out


def compile_variants(
    kv_cache: torch.Tensor,
    num_heads: int,
    block: int,
    max_model_len: int,
    dtype: torch.dtype | None = None,
    kv_scale: torch.Tensor | None = None,
) -> int:
    """Launch the attention kernel once in every variant a step can need: both tile kinds (a
    decode-sized query, a prefill-sized one) times every split count up to what
    ``max_model_len`` allows (NUM_SPLITS is a compile-time constant: each one is its own
    kernel, with its merge kernel). The queries read block ``block`` only (the engine's scratch
    block) and write nothing to the KV cache. ``dtype``: the queries' (default: the cache's);
    ``kv_scale``: an fp8 cache's scales. Returns the launches made."""
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    device, dtype = kv_cache.device, dtype or kv_cache.dtype
    group = num_heads // num_kv_heads
    launches = 0
    for q_len in (1, DECODE_MAX_QUERY_LEN + 1):
        block_n = _launch_config(dtype, head_dim, group, q_len)[1]
        max_tiles = min(MAX_SPLITS, triton.cdiv(max_model_len, block_n))
        splits = 1
        while splits <= max_tiles:
            seq_len = min(max_model_len, max(q_len, splits * block_n))
            width = -(-seq_len // block_size)
            meta = AttentionMetadata.build([q_len], [seq_len], [[block] * width], block_size, device)
            query = torch.zeros((q_len, num_heads, head_dim), dtype=dtype, device=device)
            triton_attention(query, kv_cache, meta, 1.0, kv_scale=kv_scale, num_splits=splits)
            launches += 1
            splits *= 2
    return launches
