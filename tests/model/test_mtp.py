"""The MTP block (model/families.py) against transformers: DeepSeek-V3's block is a decoder layer
fed ``eh_proj(cat(enorm(embed(next token)), hnorm(hidden)))`` with ``shared_head.norm`` and the
target's head after it, so a one-layer HF Qwen3 model holding the block's decoder weights, with
``shared_head.norm`` as its final norm, given those inputs as ``inputs_embeds``, must give the
draft logits kvtier computes over paged KV."""

from __future__ import annotations

import pytest
import torch
import transformers
from safetensors.torch import load_file

from kvtier.model import AttentionMetadata, allocate_kv_caches, load_model


@pytest.mark.parametrize("preset", ["qwen3-mtp-tiny", "deepseek-v3-mtp-tiny"])
def test_the_mtp_block_computes_what_a_transformers_decoder_layer_does(preset, checkpoint):
    """Qwen3's block over paged K/V; DeepSeek-V3's (MLA over its own latent cache, a MoE with
    group-limited routing and a shared expert) over a paged latent cache."""
    path = checkpoint(preset)
    model = load_model(path, mtp=True)
    cfg = model.config
    ids = torch.tensor([5, 17, 99, 3, 250, 41, 7, 12, 88, 60, 2])
    nxt = torch.tensor([17, 99, 3, 250, 41, 7, 12, 88, 60, 2, 33])
    n, bs = len(ids), 4
    kv = allocate_kv_caches(cfg, 8, bs)
    meta = AttentionMetadata.build([n], [n], [list(range(-(-n // bs)))], bs)
    positions = torch.arange(n)
    hidden = model(ids, positions, kv, meta)
    got = model.draft_logits(model.draft(nxt, positions, hidden, kv, meta))

    # the reference: transformers' layer on the block's checkpoint tensors
    hf_cfg = transformers.AutoConfig.from_pretrained(path)
    hf_cfg.num_hidden_layers = 1
    if hasattr(hf_cfg, "first_k_dense_replace"):
        hf_cfg.first_k_dense_replace = 0  # DeepSeek-V3's MTP block is a MoE layer
    ref_model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32).eval()
    tensors = load_file(str(path / "model.safetensors"))
    prefix = f"model.layers.{cfg.num_layers}."
    block = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
    state = {
        f"model.layers.0.{k}": v
        for k, v in block.items()
        if not k.startswith(("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens"))
    }
    state["model.norm.weight"] = block["shared_head.norm.weight"]
    state["model.embed_tokens.weight"] = block["embed_tokens.weight"]
    state["lm_head.weight"] = block["shared_head.head.weight"]
    missing, unexpected = ref_model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)

    def rms(x, w):  # transformers' RMSNorm
        x = x.float()
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + hf_cfg.rms_norm_eps))

    with torch.no_grad():
        e = rms(ref_model.model.embed_tokens(nxt), block["enorm.weight"])
        h = rms(hidden, block["hnorm.weight"])
        x = torch.cat([e, h], dim=-1) @ block["eh_proj.weight"].T
        want = ref_model(inputs_embeds=x[None], position_ids=positions[None]).logits[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(got, model.compute_logits(hidden), atol=1e-2)  # (not the target's own head)
