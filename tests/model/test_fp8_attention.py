"""fp8 KV at the kernel level: what write_kv stores, what the torch reference reads back, and the
Triton kernel's in-kernel dequantization against the reference (Triton's interpreter on CPU).

The reference everything is checked against is written here from the definition: attention over
K and V that went through fp8 and back (``x' = float(fp8(x / scale)) * scale``), in fp32.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvtier.model.attention import AttentionMetadata, reference_attention, write_kv  # noqa: E402
from kvtier.model.kv_quant import kv_cache_torch_dtype, scale_from_amax  # noqa: E402
from kvtier.model.kv_scales import calibration_ids, checkpoint_kv_scales  # noqa: E402

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def through_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[T, H, D] through fp8 with one scale per head, back in fp32."""
    limit = torch.finfo(dtype).max
    return (x / scale[None, :, None]).clamp(-limit, limit).to(dtype).float() * scale[None, :, None]


def dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One sequence, every key cached: [T, Hq, D] over [T, Hk, D] (GQA by repetition), fp32."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) * scale
    t = q.shape[0]
    scores.masked_fill_(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hts,shd->thd", torch.softmax(scores, dim=-1), v)


def fp8_case(dtype, seed=0, num_tokens=37, num_heads=4, num_kv_heads=2, head_dim=32, block_size=8, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g) * 3
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=g)
    # per head scales of different sizes (one saturates some numbers: the clamp is part of the contract)
    kv_scale = torch.tensor([[0.004, 0.03], [0.0025, 0.01]])
    num_blocks = -(-num_tokens // block_size) + 2
    kv = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    table = list(range(num_blocks - 1, 0, -1))[: -(-num_tokens // block_size)]  # not in order
    meta = AttentionMetadata.build([num_tokens], [num_tokens], [table], block_size, device)
    return q.to(device), k.to(device), v.to(device), kv, kv_scale.to(device), meta


@pytest.mark.parametrize("dtype", FP8)
def test_write_kv_stores_each_head_divided_by_its_scale(dtype):
    q, k, v, kv, kv_scale, meta = fp8_case(dtype)
    write_kv(kv, k, v, meta.slot_mapping, kv_scale)
    assert kv.dtype == dtype
    flat = kv.view(torch.uint8).view(2, -1, *kv.shape[3:]).view(dtype)
    stored_k, stored_v = flat[0, meta.slot_mapping].float(), flat[1, meta.slot_mapping].float()
    limit = torch.finfo(dtype).max
    assert torch.equal(stored_k, (k / kv_scale[0][None, :, None]).clamp(-limit, limit).to(dtype).float())
    assert torch.equal(stored_v, (v / kv_scale[1][None, :, None]).clamp(-limit, limit).to(dtype).float())


@pytest.mark.parametrize("dtype", FP8)
def test_reference_attention_dequantizes_with_the_scales(dtype):
    q, k, v, kv, kv_scale, meta = fp8_case(dtype)
    write_kv(kv, k, v, meta.slot_mapping, kv_scale)
    scale = q.shape[-1] ** -0.5
    out = reference_attention(q, kv, meta, scale, kv_scale=kv_scale)
    want = dense_causal(q, through_fp8(k, kv_scale[0], dtype), through_fp8(v, kv_scale[1], dtype), scale)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    # and not what the unquantized K/V give: fp8 is visible at this tolerance
    assert (dense_causal(q, k, v, scale) - want).abs().max() > 1e-3


def test_kv_cache_dtype_names_a_bad_value():
    assert kv_cache_torch_dtype("fp8", torch.bfloat16) == torch.float8_e4m3fn
    assert kv_cache_torch_dtype("fp8_e5m2", torch.bfloat16) == torch.float8_e5m2
    assert kv_cache_torch_dtype("auto", torch.bfloat16) == torch.bfloat16
    with pytest.raises(ValueError, match="'int4'"):
        kv_cache_torch_dtype("int4", torch.bfloat16)


def test_calibrated_scales_are_powers_of_two_above_twice_the_largest_value():
    amax = torch.tensor([[1.0, 448.0], [0.0, 3.3]])
    s = scale_from_amax(amax, torch.float8_e4m3fn)
    assert s.tolist() == [[2.0**-7, 2.0], [1.0, 2.0**-6]]  # 2 * 3.3 / 448 = 0.0147 -> 2^-6; nothing seen: 1
    assert bool((2 * amax / s <= 448).all())


def test_the_calibration_input_is_fixed():
    assert calibration_ids(1000) == calibration_ids(1000)
    assert len(set(calibration_ids(1000))) > 100


def test_checkpoint_scales_are_read_per_layer_and_head(tmp_path):
    from safetensors.torch import save_file

    save_file(
        {
            "model.layers.0.self_attn.k_scale": torch.tensor(0.5),
            "model.layers.0.self_attn.v_scale": torch.tensor([0.25, 0.125]),
            "model.layers.1.self_attn.k_proj.k_scale": torch.tensor([2.0]),
            "model.layers.1.self_attn.v_proj.v_scale": torch.tensor(4.0),
            "model.layers.0.self_attn.q_proj.weight": torch.zeros(2, 2),
        },
        str(tmp_path / "model.safetensors"),
    )
    scales = checkpoint_kv_scales([tmp_path / "model.safetensors"], (2, 2, 16), num_layers=2, num_kv_layers=3)
    assert scales is not None
    assert [s.tolist() for s in scales] == [[[0.5, 0.5], [0.25, 0.125]], [[2.0, 2.0], [4.0, 4.0]], [[2.0, 2.0], [4.0, 4.0]]]
    with pytest.raises(ValueError, match="layer 2"):
        checkpoint_kv_scales([tmp_path / "model.safetensors"], (2, 2, 16), num_layers=3, num_kv_layers=3)


def _triton_or_skip():
    pytest.importorskip("triton", reason="triton is not installed: triton attention backend untested")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("no CUDA and TRITON_INTERPRET is off: triton kernels cannot run")


@pytest.mark.parametrize("dtype", FP8)
def test_triton_dequantizes_fp8_in_the_kernel_like_the_reference(dtype):
    _triton_or_skip()
    from kvtier.model.triton_attention import triton_attention

    q, k, v, kv, kv_scale, meta = fp8_case(dtype)
    write_kv(kv, k, v, meta.slot_mapping, kv_scale)
    scale = q.shape[-1] ** -0.5
    want = reference_attention(q, kv, meta, scale, kv_scale=kv_scale)
    for splits in (1, 2):
        out = triton_attention(q, kv, meta, scale, kv_scale=kv_scale, num_splits=splits)
        torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="kv_scale"):
        triton_attention(q, kv, meta, scale, kv_scale=kv_scale[0])


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (one H200 runs it: pytest tests/model/test_fp8_attention.py)"
)
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("compute", [torch.bfloat16, torch.float16])
def test_cuda_triton_fp8_attention_matches_the_reference(dtype, compute):
    """On a GPU: decode and prefill shapes of a GQA model (head_dim 128) over an fp8 cache."""
    from kvtier.model.triton_attention import triton_attention

    for num_tokens in (1, 300):
        q, k, v, kv, kv_scale, _ = fp8_case(
            dtype, num_tokens=num_tokens, num_heads=32, num_kv_heads=8, head_dim=128, device="cuda"
        )
        kv_scale = torch.rand(2, 8, device="cuda") * 0.05 + 0.005
        num_blocks = kv.shape[1]
        ctx = 700 if num_tokens == 1 else num_tokens
        kv = torch.zeros(2, num_blocks + ctx // 8 + 2, 8, 8, 128, dtype=dtype, device="cuda")
        table = list(range(-(-ctx // 8)))
        meta = AttentionMetadata.build([num_tokens], [ctx], [table], 8, "cuda")
        g = torch.Generator(device="cuda").manual_seed(1)
        keys = torch.randn(ctx, 8, 128, device="cuda", generator=g)
        write_kv(kv, keys, keys.flip(0), AttentionMetadata.build([ctx], [ctx], [table], 8, "cuda").slot_mapping, kv_scale)
        q = q.to(compute)
        want = reference_attention(q, kv, meta, 128**-0.5, kv_scale=kv_scale)
        out = triton_attention(q, kv, meta, 128**-0.5, kv_scale=kv_scale)
        torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)
