"""Attention on paged KV: the metadata the engine builds per step and the torch reference backend.

Device KV layout (DESIGN §4), one tensor per layer::

    kv_cache[layer] : [2, num_blocks, block_size, num_kv_heads, head_dim]   (0 = K, 1 = V)

A step's tokens are flattened into one varlen batch. Sequence ``i`` contributes
``query_lens[i]`` new tokens, which are the *last* tokens of its ``seq_lens[i]`` KV positions
(the first ``seq_lens[i] - query_lens[i]`` positions are already in the cache: a prefix hit or
an earlier chunk / decode step)::

    block_tables[i] = [b0, b1, b2, ...]          positions 0..bs-1 -> b0, bs..2bs-1 -> b1, ...
    slot_mapping[t] = block * block_size + offset   for every new token t (where its K/V is written)

Queries attend causally: the query at absolute position p sees KV positions 0..p; in a layer with
a sliding ``window`` only the last ``window`` of them (transformers' sliding_window)::

    keys      0 1 2 3 4 5 6 7 8 9
    p = 9     . . . . . . x x x x      window 4: keys p - 3 .. p
    p = 9     x x x x x x x x x x      full attention

Per layer, as the family defines it: ``softcap`` (Gemma 2) bounds each score to cap * tanh(score / cap)
before the mask; ``sinks`` (gpt-oss) adds one learned logit per head to the softmax's denominator,
so a row's weights sum to less than one::

    weights = exp(s_j) / (sum_k exp(s_k) + exp(sink[head]))

Every fast backend (Triton) has the same signature as :func:`reference_attention` and is
tested against it on random shapes; :mod:`kvtier.model.backends` picks one by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvtier.model.kv_quant import quantize


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [num_seqs] int32, KV length after this step
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32 (padding: 0)
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    slot_mapping_cpu: np.ndarray | None = None  # the same slots on the CPU (routing capture)
    # CUDA graphs: query_start_loc has this many sequences' entries (trailing ones empty), the
    # kernel's grid covers them all, and the host lists above are only bounds (engine/cuda_graph.py)
    graph_num_seqs: int | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> "AttentionMetadata":
        """Build metadata from plain lists (the scheduler's view); vectorized with numpy, since
        this runs on the CPU every step for every sequence."""
        if len(query_lens) != len(seq_lens) or len(seq_lens) != len(block_tables):
            raise ValueError("query_lens, seq_lens and block_tables must have one entry per sequence")
        q = np.asarray(query_lens, dtype=np.int64)
        s = np.asarray(seq_lens, dtype=np.int64)
        widths = np.fromiter((len(t) for t in block_tables), dtype=np.int64, count=len(block_tables))
        bad = np.flatnonzero((q < 1) | (q > s))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"query length {query_lens[i]} must be in 1..seq_len ({seq_lens[i]})")
        short = np.flatnonzero(widths * block_size < s)
        if short.size:
            i = int(short[0])
            raise ValueError(f"block table of {widths[i]} blocks cannot hold {seq_lens[i]} tokens")
        width = int(widths.max())
        table = np.zeros((len(block_tables), width), dtype=np.int32)
        for row, t in zip(table, block_tables):
            row[: len(t)] = t
        # position of every new token, then its block through the table
        qsl = np.zeros(len(q) + 1, dtype=np.int64)
        np.cumsum(q, out=qsl[1:])
        seq_of = np.repeat(np.arange(len(q)), q)
        pos = np.arange(int(qsl[-1])) - qsl[seq_of] + (s - q)[seq_of]
        slots = table[seq_of, pos // block_size].astype(np.int64) * block_size + pos % block_size
        return cls(
            slot_mapping=torch.from_numpy(slots).to(device),
            query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(device),
            seq_lens=torch.from_numpy(s.astype(np.int32)).to(device),
            block_tables=torch.from_numpy(table).to(device),
            query_lens_cpu=list(query_lens),
            seq_lens_cpu=list(seq_lens),
            max_query_len=int(q.max()),
            max_seq_len=int(s.max()),
            slot_mapping_cpu=slots,
        )


def write_kv(
    kv_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
) -> None:
    """Store new tokens' K/V ([num_tokens, num_kv_heads, head_dim]) at their slots. An fp8 cache
    stores them quantized with ``kv_scale`` [2, num_kv_heads] (model/kv_quant.py)."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    if kv_scale is None:
        flat[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
        flat[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))
        return
    # fp8 has no index_copy_ on the CPU: the quantized bytes move as uint8
    raw = flat.view(torch.uint8)
    for plane, x in enumerate((key, value)):
        raw[plane].index_copy_(0, slot_mapping, quantize(x, kv_scale[plane], kv_cache.dtype).view(torch.uint8))


def reference_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of ``query`` [num_tokens, num_heads, head_dim] over paged KV.

    ``window``: a query at position p sees keys p - window + 1 .. p (None: 0 .. p); ``sinks``
    [num_heads]: a logit per head in every softmax's denominator; ``softcap``: scores become
    softcap * tanh(score / softcap) (module docstring); ``kv_scale`` [2, num_kv_heads]: an fp8
    cache's scales, K and V dequantized as they are read (model/kv_quant.py). Plain torch, one
    sequence at a time, softmax in fp32; keys below every query's window are not read. The
    reference every backend is checked against; also the CPU backend.
    """
    check_attention_options(query, window, sinks, softcap)
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_heads = query.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    start = 0
    for i, (q_len, s_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        first = 0 if window is None else max(0, s_len - q_len - window + 1)  # lowest key of the first query's window
        blocks = meta.block_tables[i, first // block_size : -(-s_len // block_size)].long()
        offset = first - first // block_size * block_size
        k = kv_cache[0, blocks].reshape(-1, num_kv_heads, head_dim)[offset : offset + s_len - first]
        v = kv_cache[1, blocks].reshape(-1, num_kv_heads, head_dim)[offset : offset + s_len - first]
        q = query[start : start + q_len].float().transpose(0, 1)  # [H, q, D]
        if kv_scale is not None:
            k, v = k.float() * kv_scale[0, :, None].float(), v.float() * kv_scale[1, :, None].float()
        k = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, s, D]
        v = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = torch.matmul(q, k.transpose(1, 2)) * scale  # [H, q, s]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(s_len - q_len, s_len, device=query.device)[:, None]
        k_pos = torch.arange(first, s_len, device=query.device)[None, :]
        hidden = k_pos > q_pos
        if window is not None:
            hidden |= k_pos <= q_pos - window
        scores.masked_fill_(hidden, float("-inf"))
        if sinks is None:
            probs = torch.softmax(scores, dim=-1)
        else:
            sink = sinks.float()[:, None, None].expand(num_heads, q_len, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        out[start : start + q_len] = torch.matmul(probs, v).transpose(0, 1).to(query.dtype)
        start += q_len
    return out


def check_attention_options(query: torch.Tensor, window: int | None, sinks: torch.Tensor | None, softcap: float | None) -> None:
    """ValueError naming a bad ``window``, ``sinks`` or ``softcap`` (the options every backend takes)."""
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive number of positions or None, got {window!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive or None, got {softcap!r}")
    if sinks is not None and (sinks.shape != (query.shape[1],) or sinks.device != query.device):
        raise ValueError(
            f"sinks must be one logit per query head ([{query.shape[1]}]) on {query.device}, "
            f"got {tuple(sinks.shape)} on {sinks.device}"
        )
