"""Copies of latent KV (multi-head latent attention: one plane per layer, ``[1, blocks, block_size,
kv_width]`` on the device, ``[blocks, layers, 1, block_size, kv_width]`` on the host) by the fast
ops (Triton, zero-copy, DMA runs, staged) and the torch reference, against the expected bytes: a
host block's layer l is device block d's latent in layer l, and nothing else moves.

Destinations are poisoned (every byte 0xA5) first, as in test_copy_ops.py. On a machine without
CUDA the kernel runs in Triton's interpreter on CPU tensors.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

pytest.importorskip("triton", reason="triton is not installed: the fast copy path is untested")

from kvtier.model import ModelConfig, allocate_kv_caches, host_kv_shape  # noqa: E402
from kvtier.transfer import copy as ref  # noqa: E402
from kvtier.transfer import kernels as fast  # noqa: E402
from tests.transfer.copy_helpers import poison, random_, same_bytes  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
if not CUDA and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    pytest.skip("no CUDA and TRITON_INTERPRET is off: triton kernels cannot run", allow_module_level=True)

# a small DeepSeek-shaped latent: kv_lora_rank 24 + qk_rope_head_dim 8 = 32 numbers per token and layer
LATENT = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 24,
    "q_lora_rank": None,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "n_routed_experts": 4,
    "n_group": 1,
    "topk_group": 1,
    "num_experts_per_tok": 2,
    "vocab_size": 64,
    "max_position_embeddings": 128,
}
ND, NH, BS = 12, 10, 4
DEV = [2, 3, 4, 9, 0, 11, 6]  # a run 2-4 (both sides consecutive), scattered rest
HST = [5, 6, 7, 1, 9, 8, 3]


def _layers(cfg: ModelConfig, dtype: torch.dtype, gen: torch.Generator, shared: bool = True) -> list[torch.Tensor]:
    if shared:  # the engine's: views of one buffer
        kv = allocate_kv_caches(cfg, ND, BS, DEVICE, dtype)
    else:
        planes, *plane = cfg.kv_layout
        kv = [torch.empty((planes, ND, BS, *plane), dtype=dtype, device=DEVICE) for _ in range(cfg.num_kv_layers)]
    return [random_(t, gen) for t in kv]


def _host(cfg: ModelConfig, dtype: torch.dtype) -> torch.Tensor:
    return poison(torch.empty(host_kv_shape(cfg, NH, BS), dtype=dtype, pin_memory=CUDA))


def _cfg() -> ModelConfig:
    cfg = ModelConfig.from_hf_dict(LATENT)
    assert cfg.kv_layout == (1, 32)
    return cfg


def _expect_backup(kv: list[torch.Tensor], host: torch.Tensor, dev: list[int], hst: list[int]) -> None:
    for d, h in zip(dev, hst):
        for layer, t in enumerate(kv):
            assert same_bytes(host[h, layer, 0], t[0, d]), f"host block {h} layer {layer} != device block {d}"
    untouched = [b for b in range(host.shape[0]) if b not in hst]
    assert all((host[b].view(torch.uint8) == 0xA5).all() for b in untouched)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shared", [True, False], ids=["one-buffer", "per-layer"])
@pytest.mark.parametrize("min_run", [0, 2], ids=["kernel", "dma-runs"])
def test_backup_of_latent_blocks(dtype, shared, min_run, monkeypatch):
    monkeypatch.setattr(fast, "TUNING", dict(fast.TUNING, min_dma_run_d2h=min_run or 10**9))
    cfg, gen = _cfg(), torch.Generator().manual_seed(1)
    kv = _layers(cfg, dtype, gen, shared)
    got, want = _host(cfg, dtype), _host(cfg, dtype)
    fast.device_to_host(kv, got, DEV, HST)
    ref.device_to_host(kv, want, DEV, HST)
    if CUDA:
        torch.cuda.synchronize()
    _expect_backup(kv, got, DEV, HST)
    assert same_bytes(got, want)


@pytest.mark.parametrize("min_run", [0, 2, 3], ids=["kernel", "dma-runs", "staging"])
def test_per_layer_load_of_latent_blocks(min_run, monkeypatch):
    """min_run 2: the run 5-7 lands by DMA in device blocks 2-4; 3 with scattered device blocks
    (DEV reversed): into staging, then a scatter."""
    monkeypatch.setattr(fast, "TUNING", dict(fast.TUNING, min_dma_run_h2d=min_run or 10**9))
    cfg, gen = _cfg(), torch.Generator().manual_seed(2)
    host = random_(torch.empty(host_kv_shape(cfg, NH, BS), dtype=torch.float16, pin_memory=CUDA), gen)
    dev = DEV[::-1] if min_run == 3 else DEV
    got = [poison(t) for t in _layers(cfg, torch.float16, gen)]
    want = [poison(t) for t in _layers(cfg, torch.float16, gen)]
    pairs = fast.BlockPairs.split(HST, dev, CUDA, min_run, scatter_device=torch.device(DEVICE))
    for layer in range(cfg.num_kv_layers):
        fast.host_to_device(host, got, pairs, None, layer=layer)
        ref.host_to_device(host, want, HST, dev, layer=layer)
    if CUDA:
        torch.cuda.synchronize()
    for layer in range(cfg.num_kv_layers):
        assert same_bytes(got[layer], want[layer]), f"layer {layer}"
        for d, h in zip(dev, HST):
            assert same_bytes(got[layer][0, d], host[h, layer, 0])
    untouched = [b for b in range(ND) if b not in dev]
    assert all((t[:, b].view(torch.uint8) == 0xA5).all() for t in got for b in untouched)


def test_staged_copies_of_every_layer_of_latent_blocks(monkeypatch):
    """The staged path (HostRuns: a DMA per run of host blocks, one scatter/gather kernel)."""
    monkeypatch.setattr(fast, "TUNING", dict(fast.TUNING, min_dma_bytes_staged=1))
    cfg, gen = _cfg(), torch.Generator().manual_seed(3)
    host = random_(torch.empty(host_kv_shape(cfg, NH, BS), dtype=torch.float32, pin_memory=CUDA), gen)
    got = [poison(t) for t in _layers(cfg, torch.float32, gen)]
    pairs = fast.host_runs(host, got, HST, DEV)
    assert pairs is not None and pairs.runs
    fast.host_to_device(host, got, pairs, None)
    back = _host(cfg, torch.float32)
    fast.device_to_host(got, back, fast.host_runs(back, got, HST, DEV), None)
    if CUDA:
        torch.cuda.synchronize()
    for d, h in zip(DEV, HST):
        for layer in range(cfg.num_kv_layers):
            assert same_bytes(got[layer][0, d], host[h, layer, 0])
    _expect_backup(got, back, DEV, HST)


def test_a_latent_host_tier_is_refused_against_full_attention_layers():
    cfg = _cfg()
    kv = [torch.empty((2, ND, BS, 1, 32)) for _ in range(cfg.num_kv_layers)]  # K and V planes
    host = _host(cfg, torch.float32)
    with pytest.raises(ValueError, match="layouts disagree"):
        fast.device_to_host(kv, host, [0], [0])
