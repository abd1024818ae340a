"""Triton kernels of kvtier/model/fused.py (same signatures as its ``*_ref`` torch functions, which
tests compare them with; on a machine without CUDA they run in Triton's interpreter).

Rounding follows torch's: an op on half-precision tensors computes in fp32 and rounds its result
to the tensor dtype, so the kernels round at the same points (``.to(dtype)`` after each op that
torch would round), not only at the end.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    from kvtier.triton_jit import jit
except ImportError:  # pragma: no cover - the torch path runs instead (fused.use_triton)
    triton = None


def available() -> bool:
    return triton is not None


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


if triton is not None:

    @jit()
    def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, h_ptr, N, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(x_ptr + row * N + cols, mask=mask, other=0.0)
        if HAS_RES:
            r = tl.load(res_ptr + row * N + cols, mask=mask, other=0.0)
            h = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            tl.store(h_ptr + row * N + cols, h, mask=mask)
        else:
            h = x
        hf = h.to(tl.float32)
        var = tl.sum(hf * hf, axis=0) / N
        y = (hf * (1.0 / tl.sqrt(var + eps))).to(x.dtype)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        out = w.to(tl.float32) * y.to(tl.float32)
        tl.store(out_ptr + row * N + cols, out.to(out_ptr.dtype.element_ty), mask=mask)

    @jit()
    def _rope_write_kv_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        cos_ptr,
        sin_ptr,
        qw_ptr,
        kw_ptr,
        kv_ptr,
        slot_ptr,
        qout_ptr,
        kvs_ptr,
        sq_t,
        sq_h,
        sk_t,
        sk_h,
        sv_t,
        sv_h,
        v_offset,
        eps,
        HQ: tl.constexpr,
        HK: tl.constexpr,
        D: tl.constexpr,
        HAS_NORM: tl.constexpr,
        FP8_MAX: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        half = tl.arange(0, D // 2)
        c_lo = tl.load(cos_ptr + t * D + half).to(tl.float32)
        c_hi = tl.load(cos_ptr + t * D + D // 2 + half).to(tl.float32)
        s_lo = tl.load(sin_ptr + t * D + half).to(tl.float32)
        s_hi = tl.load(sin_ptr + t * D + D // 2 + half).to(tl.float32)
        if head < HQ:
            src = q_ptr + t * sq_t + head * sq_h
            w_ptr = qw_ptr
        else:
            src = k_ptr + t * sk_t + (head - HQ) * sk_h
            w_ptr = kw_ptr
        lo = tl.load(src + half)
        hi = tl.load(src + D // 2 + half)
        dt = lo.dtype
        if HAS_NORM:  # per-head RMSNorm (Qwen3), as transformers'
            lf, hf = lo.to(tl.float32), hi.to(tl.float32)
            rstd = 1.0 / tl.sqrt((tl.sum(lf * lf, axis=0) + tl.sum(hf * hf, axis=0)) / D + eps)
            w_lo = tl.load(w_ptr + half).to(tl.float32)
            w_hi = tl.load(w_ptr + D // 2 + half).to(tl.float32)
            lo = (w_lo * (lf * rstd).to(dt).to(tl.float32)).to(dt)
            hi = (w_hi * (hf * rstd).to(dt).to(tl.float32)).to(dt)
        lf, hf = lo.to(tl.float32), hi.to(tl.float32)
        # x * cos + rotate_half(x) * sin, rounded where torch rounds: each product, then the sum
        out_lo = ((lf * c_lo).to(dt).to(tl.float32) + (-hf * s_lo).to(dt).to(tl.float32)).to(dt)
        out_hi = ((hf * c_hi).to(dt).to(tl.float32) + (lf * s_hi).to(dt).to(tl.float32)).to(dt)
        if head < HQ:
            dst = qout_ptr + (t * HQ + head) * D
            tl.store(dst + half, out_lo)
            tl.store(dst + D // 2 + half, out_hi)
        else:
            h = head - HQ
            slot = tl.load(slot_ptr + t).to(tl.int64)
            dst = kv_ptr + (slot * HK + h) * D
            d = tl.arange(0, D)
            vals = tl.load(v_ptr + t * sv_t + h * sv_h + d)
            if FP8_MAX > 0:  # an fp8 cache: the rounded K and V over their head's scale, clamped, rounded once
                k_s = tl.load(kvs_ptr + h)
                v_s = tl.load(kvs_ptr + HK + h)
                out_lo = tl.minimum(tl.maximum(out_lo.to(tl.float32) / k_s, -FP8_MAX), FP8_MAX)
                out_hi = tl.minimum(tl.maximum(out_hi.to(tl.float32) / k_s, -FP8_MAX), FP8_MAX)
                vals = tl.minimum(tl.maximum(vals.to(tl.float32) / v_s, -FP8_MAX), FP8_MAX)
            tl.store(dst + half, out_lo.to(kv_ptr.dtype.element_ty))
            tl.store(dst + D // 2 + half, out_hi.to(kv_ptr.dtype.element_ty))
            tl.store(kv_ptr + v_offset + (slot * HK + h) * D + d, vals.to(kv_ptr.dtype.element_ty))

    @jit()
    def _silu_and_mul_kernel(x_ptr, out_ptr, N, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < N
        g = tl.load(x_ptr + row * 2 * N + cols, mask=mask, other=0.0)
        u = tl.load(x_ptr + row * 2 * N + N + cols, mask=mask, other=0.0)
        gf = g.to(tl.float32)
        s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
        tl.store(out_ptr + row * N + cols, (s.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=mask)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.shape[-1]
    rows = x.numel() // n
    out = torch.empty(x.shape, dtype=torch.result_type(weight, x), device=x.device)
    h = torch.empty_like(x) if residual is not None else x
    if rows:
        _add_rms_norm_kernel[(rows,)](
            x, residual if residual is not None else x, weight, out, h, n, eps, HAS_RES=residual is not None, BLOCK=_pow2(n)
        )
    return out, h


def rope_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    T, hq, d = q.shape
    hk = k.shape[1]
    assert q.stride(2) == k.stride(2) == v.stride(2) == 1 and kv_cache.is_contiguous()
    assert cos.is_contiguous() and sin.is_contiguous() and d % 2 == 0 and d & (d - 1) == 0
    q_out = torch.empty((T, hq, d), dtype=q.dtype, device=q.device)
    if kv_scale is not None:  # an fp8 cache (model/kv_quant.py): [2, num_kv_heads] fp32
        kv_scale = kv_scale.float().contiguous()
    if T:
        _rope_write_kv_kernel[(T, hq + hk)](
            q,
            k,
            v,
            cos,
            sin,
            q_norm if q_norm is not None else q,
            k_norm if k_norm is not None else k,
            kv_cache,
            slot_mapping,
            q_out,
            kv_scale if kv_scale is not None else q,  # (not read without scales)
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            kv_cache[0].numel(),
            eps,
            HQ=hq,
            HK=hk,
            D=d,
            HAS_NORM=q_norm is not None,
            FP8_MAX=torch.finfo(kv_cache.dtype).max if kv_scale is not None else 0.0,
        )
    return q_out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    n = gate_up.shape[-1] // 2
    rows = gate_up.numel() // (2 * n) if n else 0
    out = torch.empty((*gate_up.shape[:-1], n), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = min(1024, _pow2(n))
        _silu_and_mul_kernel[(rows, triton.cdiv(n, block))](gate_up, out, n, BLOCK=block)
    return out
