"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi K2) on a paged latent cache.

Every token and layer caches one compressed latent, shared by all heads (no K/V split)::

    latent_cache[layer] : [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]
                            [.. , :R] = c_kv  RMS-normed latent (R = kv_lora_rank)
                            [.. , R:] = k_pe  roped key part (P = qk_rope_head_dim)

written at ``AttentionMetadata.slot_mapping`` and read through the block tables, as the paged
attention of model/attention.py (the same varlen batches: prefill chunks, decode rows, prefix hits).
``kv_b_proj`` holds, per head h, W_UK_h [Dn, R] and W_UV_h [Dv, R] (Dn = qk_nope_head_dim,
Dv = v_head_dim); a head's key and value at position s are::

    k_h(s) = [W_UK_h c(s) ; k_pe(s)]        v_h(s) = W_UV_h c(s)

Two ways to attend, equal up to float rounding::

    decompressed (prefill chunks)   K and V of every cached position rebuilt per head,
                                    attention of the [Dn + P] query over them
    absorbed (decode rows)          W_UK folded into the query:  q_lat_h = W_UK_h^T q_nope_h  [R]
                                    score(t, s) = [q_lat_h ; q_pe_h] . latent(s)   (576 wide: V3)
                                    out_h = W_UV_h (sum_s p(s) c(s))   W_UV folded into the output

Decompressing costs H x (Dn + Dv) x R per cached position, worth it when many queries share it;
a decode row has one query, so it attends over the latent directly (FlashMLA's form: multi-query
attention with head dim R + P whose values are the first R columns). :func:`mla_attention` sends
each sequence of a step to one form. The two torch functions below are the reference a kernel of
the same signature is checked against: model/triton_mla.py's decode kernel (the ``triton``
attention backend, the default on CUDA) against :func:`reference_mla_absorbed`.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from kvtier.model.attention import AttentionMetadata
from kvtier.model.config import ModelConfig
from kvtier.model.kv_quant import quantize
from kvtier.model.layers import RMSNorm


def allocate_latent_caches(
    cfg: ModelConfig, num_blocks: int, block_size: int, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> list[torch.Tensor]:
    """One zeroed [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim] tensor per layer with KV,
    views of one buffer (a block of every layer is one copy apart, as for full-attention caches):
    the one plane of ``allocate_kv_caches``' [1, num_blocks, block_size, kv_width] layers."""
    if cfg.kv_kind != "latent":
        raise ValueError(f"{cfg.architecture} caches full K/V, not a latent (kv_kind {cfg.kv_kind!r})")
    from kvtier.model import allocate_kv_caches

    return [kv[0] for kv in allocate_kv_caches(cfg, num_blocks, block_size, device, dtype)]  # (its one plane)


def write_latent(
    latent_cache: torch.Tensor,
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
) -> None:
    """Store new tokens' latent ``c_kv`` [T, R] and roped key ``k_pe`` [T, P] at their slots; an
    fp8 cache stores the whole latent quantized as one vector with the layer's one ``kv_scale`` [1]."""
    num_blocks, block_size, width = latent_cache.shape
    flat = latent_cache.view(num_blocks * block_size, width)
    latent = torch.cat([c_kv, k_pe], dim=-1)
    if kv_scale is None:
        flat.index_copy_(0, slot_mapping, latent.to(latent_cache.dtype))
    else:  # (fp8 has no index_copy_ on the CPU: the bytes move as uint8)
        flat.view(torch.uint8).index_copy_(0, slot_mapping, quantize(latent, kv_scale, latent_cache.dtype).view(torch.uint8))


def _cached_latents(latent_cache: torch.Tensor, meta: AttentionMetadata, seq: int, kv_scale: torch.Tensor | None) -> torch.Tensor:
    """Sequence ``seq``'s latents [seq_len, R + P] through its block table (fp32; an fp8 cache's
    times ``kv_scale``)."""
    block_size = latent_cache.shape[1]
    s_len = meta.seq_lens_cpu[seq]
    blocks = meta.block_tables[seq, : -(-s_len // block_size)].long()
    latents = latent_cache[blocks].reshape(-1, latent_cache.shape[-1])[:s_len].float()
    return latents if kv_scale is None else latents * kv_scale.float()


def _causal_softmax(scores: torch.Tensor, q_len: int, s_len: int) -> torch.Tensor:
    """softmax over [H, q_len, s_len] scores; query i (absolute position s_len - q_len + i) sees 0..itself."""
    q_pos = torch.arange(s_len - q_len, s_len, device=scores.device)[:, None]
    k_pos = torch.arange(s_len, device=scores.device)[None, :]
    return torch.softmax(scores.masked_fill(k_pos > q_pos, float("-inf")), dim=-1)


def reference_mla_decompressed(
    query: torch.Tensor,
    latent_cache: torch.Tensor,
    meta: AttentionMetadata,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of ``query`` [T, H, Dn + P] (nope part, then roped part) over the paged
    latents, K and V rebuilt per head with ``w_uk`` [H, Dn, R] and ``w_uv`` [H, Dv, R].
    Returns [T, H, Dv]. Plain torch, one sequence at a time, fp32."""
    num_heads, d_nope, rank = w_uk.shape
    out = query.new_empty(query.shape[0], num_heads, w_uv.shape[1])
    start = 0
    for i, q_len in enumerate(meta.query_lens_cpu):
        latents = _cached_latents(latent_cache, meta, i, kv_scale)
        c_kv, k_pe = latents[:, :rank], latents[:, rank:]
        k_nope = torch.einsum("sr,hdr->hsd", c_kv, w_uk.float())
        v = torch.einsum("sr,hvr->hsv", c_kv, w_uv.float())
        k = torch.cat([k_nope, k_pe[None].expand(num_heads, -1, -1)], dim=-1)  # [H, s, Dn + P]
        q = query[start : start + q_len].float().transpose(0, 1)  # [H, q, Dn + P]
        probs = _causal_softmax(torch.matmul(q, k.transpose(1, 2)) * scale, q_len, latents.shape[0])
        out[start : start + q_len] = torch.matmul(probs, v).transpose(0, 1).to(out.dtype)
        start += q_len
    return out


def reference_mla_absorbed(
    query: torch.Tensor,
    latent_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kv_lora_rank: int,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of ``query`` [T, H, R + P] (``W_UK^T q_nope``, then the roped part) over
    the paged latents as they are: keys are the whole latent, values its first R = ``kv_lora_rank``
    columns. Returns [T, H, R] (to be mapped through W_UV). Plain torch, one sequence at a time, fp32."""
    out = query.new_empty(query.shape[0], query.shape[1], kv_lora_rank)
    start = 0
    for i, q_len in enumerate(meta.query_lens_cpu):
        latents = _cached_latents(latent_cache, meta, i, kv_scale)  # [s, R + P]
        q = query[start : start + q_len].float().transpose(0, 1)  # [H, q, R + P]
        probs = _causal_softmax(torch.matmul(q, latents.T) * scale, q_len, latents.shape[0])
        out[start : start + q_len] = torch.matmul(probs, latents[:, :kv_lora_rank]).transpose(0, 1).to(out.dtype)
        start += q_len
    return out


def absorb_query(query: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """[T, H, Dn + P] -> [T, H, R + P]: the nope part through W_UK^T (``w_uk`` [H, Dn, R])."""
    d_nope = w_uk.shape[1]
    q_latent = torch.einsum("thd,hdr->thr", query[..., :d_nope], w_uk)
    return torch.cat([q_latent, query[..., d_nope:]], dim=-1)


def select_sequences(meta: AttentionMetadata, seqs: list[int]) -> tuple[torch.Tensor, AttentionMetadata]:
    """(the step's token rows of sequences ``seqs``, metadata of those sequences alone)."""
    starts = np.concatenate([[0], np.cumsum(meta.query_lens_cpu)])
    rows = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in seqs])
    query_lens = [meta.query_lens_cpu[i] for i in seqs]
    seq_lens = [meta.seq_lens_cpu[i] for i in seqs]
    device = meta.slot_mapping.device
    index = torch.tensor(seqs, device=device)
    rows_t = torch.from_numpy(rows).to(device)
    sub = AttentionMetadata(
        slot_mapping=meta.slot_mapping[rows_t],
        query_start_loc=torch.tensor(np.concatenate([[0], np.cumsum(query_lens)]), dtype=torch.int32, device=device),
        seq_lens=meta.seq_lens[index],
        block_tables=meta.block_tables[index],
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    return rows_t, sub


def mla_attention(
    query: torch.Tensor,
    latent_cache: torch.Tensor,
    meta: AttentionMetadata,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    backend: str = "torch",
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """A step's attention, [T, H, Dn + P] -> [T, H, Dv]: decode rows (sequences with one new token)
    in the absorbed form, prefill chunks decompressed (module docstring). ``backend`` "triton":
    decode rows through model/triton_mla.py's kernel, else the torch reference; ``kv_scale``: an
    fp8 cache's scale, the latents dequantized as they are read."""
    decode = [i for i, n in enumerate(meta.query_lens_cpu) if n == 1]
    if len(decode) == meta.num_seqs:
        return _absorbed(query, latent_cache, meta, w_uk, w_uv, scale, backend, kv_scale)
    if not decode:
        return reference_mla_decompressed(query, latent_cache, meta, w_uk, w_uv, scale, kv_scale)
    prefill = [i for i, n in enumerate(meta.query_lens_cpu) if n > 1]
    out = query.new_empty(query.shape[0], query.shape[1], w_uv.shape[1])
    rows, sub = select_sequences(meta, decode)
    out[rows] = _absorbed(query[rows], latent_cache, sub, w_uk, w_uv, scale, backend, kv_scale)
    rows, sub = select_sequences(meta, prefill)
    out[rows] = reference_mla_decompressed(query[rows], latent_cache, sub, w_uk, w_uv, scale, kv_scale)
    return out


def _absorbed(
    query: torch.Tensor,
    latent_cache: torch.Tensor,
    meta: AttentionMetadata,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    backend: str,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    q = absorb_query(query, w_uk)
    if backend == "triton":
        from kvtier.model.triton_mla import triton_mla_decode

        out_latent = triton_mla_decode(q, latent_cache, meta, scale, w_uk.shape[2], kv_scale=kv_scale)
    else:
        out_latent = reference_mla_absorbed(q, latent_cache, meta, scale, w_uk.shape[2], kv_scale)
    return torch.einsum("thr,hvr->thv", out_latent, w_uv)


# ---------------------------------------------------------------------------------------------------


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention temperature for a context stretched ``factor`` times (1 when not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def softmax_scale(cfg: ModelConfig) -> float:
    """qk_head_dim ** -0.5, times yarn_mscale(factor, mscale_all_dim) ** 2 when the RoPE is scaled
    and names ``mscale_all_dim`` (DeepSeek's YaRN: 1.3 for V3's factor 40)."""
    scale = cfg.qk_head_dim**-0.5
    p = cfg.rope_scaling
    if cfg.rope_type != "default" and p.get("mscale_all_dim"):
        factor = p.get("factor") or cfg.max_position_embeddings / p["original_max_position_embeddings"]
        scale *= yarn_mscale(factor, p["mscale_all_dim"]) ** 2
    return scale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """RoPE of ``x`` [T, n, P] with the step's ``cos``, ``sin`` [T, 1, P] (RotaryEmbedding.cos_sin:
    the frequencies twice). ``interleave``: rotate (even, odd) pairs and return the rotated pairs'
    first then second coordinates (transformers' DeepSeek layout; only q.k products read it);
    else rotate the two halves. In fp32, rounded to x's dtype."""
    xf, cos, sin = x.float(), cos.float(), sin.float()
    if interleave:
        half = x.shape[-1] // 2
        cos, sin = cos[..., :half], sin[..., :half]
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)


class LatentAttention(nn.Module):
    """DeepSeek's attention block, its parameters named as in the checkpoints.

    ::

        q = q_b_proj(q_a_layernorm(q_a_proj(x)))     (q_proj(x) when q_lora_rank is None)
        c_kv, k_pe = split(kv_a_proj_with_mqa(x));  c_kv = kv_a_layernorm(c_kv)
        RoPE of q's last P columns and of k_pe;  (c_kv, k_pe) -> latent cache;  attention;  o_proj
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int, backend: str = "torch"):
        super().__init__()
        self.layer_idx = layer_idx
        self.backend = backend  # decode rows: "triton" (model/triton_mla.py) or "torch"
        self.num_heads, self.rank = cfg.num_heads, cfg.kv_lora_rank
        self.d_nope, self.d_rope, self.d_v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.interleave = cfg.rope_interleave
        self.scale = softmax_scale(cfg)
        h, q_width = cfg.hidden_size, cfg.num_heads * cfg.qk_head_dim
        self.q_proj: nn.Linear | None = None
        self.q_a_proj: nn.Linear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: nn.Linear | None = None
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(h, q_width, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, bias=cfg.qkv_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6)  # transformers' default eps, not rms_norm_eps
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, q_width, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.rank + self.d_rope, bias=cfg.qkv_bias)
        self.kv_a_layernorm = RMSNorm(self.rank, 1e-6)
        self.kv_b_proj = nn.Linear(self.rank, cfg.num_heads * (self.d_nope + self.d_v), bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * self.d_v, h, bias=cfg.o_bias)
        self.kv_scale: torch.Tensor | None = None  # an fp8 cache's one scale [1] (model/kv_quant.py)

    def up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, Dn, R], W_UV [H, Dv, R]): views of ``kv_b_proj.weight``."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.d_nope + self.d_v, self.rank)
        return w[:, : self.d_nope], w[:, self.d_nope :]

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        latent_cache: torch.Tensor,
        meta: AttentionMetadata,
        layer_hook=None,
    ) -> torch.Tensor:
        """``rope``: the step's (cos, sin) from RotaryEmbedding.cos_sin; ``layer_hook(layer_idx)``
        runs before this layer's latents are written (e.g. to wait for them from the host tier)."""
        T = x.shape[0]
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(T, self.num_heads, self.d_nope + self.d_rope)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.d_rope], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)
        cos, sin = rope
        q = torch.cat([q[..., : self.d_nope], apply_rope(q[..., self.d_nope :], cos, sin, self.interleave)], dim=-1)
        k_pe = apply_rope(k_pe[:, None], cos, sin, self.interleave)[:, 0]
        if layer_hook is not None:
            layer_hook(self.layer_idx)
        write_latent(latent_cache, c_kv, k_pe, meta.slot_mapping, self.kv_scale)
        w_uk, w_uv = self.up_projections()
        out = mla_attention(q, latent_cache, meta, w_uk, w_uv, self.scale, self.backend, self.kv_scale)
        return self.o_proj(out.reshape(T, self.num_heads * self.d_v))
