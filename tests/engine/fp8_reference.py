"""transformers with an fp8 KV cache's arithmetic: its attention hooked so that K (after RoPE) and
V are quantized to fp8 with a scale per layer and KV head and dequantized before attending, as
an fp8 paged cache stores and reads them. Written from the definition, not from kvtier's code::

    x' = float(fp8(clamp(x / scale, -fp8_max, fp8_max))) * scale
"""

from __future__ import annotations

import torch

HOOK = "fp8_kv_reference"


def fake_quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` [batch, kv_heads, seq, head_dim] through fp8 and back, ``scale`` [kv_heads] (or [1])."""
    s = scale.float()[None, :, None, None]
    limit = torch.finfo(dtype).max
    return ((x.float() / s).clamp(-limit, limit).to(dtype).float() * s).to(x.dtype)


def _attention(module, query, key, value, attention_mask, **kwargs):
    """The family's own eager attention (its window, sinks, soft-capping) over K and V [batch,
    kv_heads, seq, head_dim] through fp8 and back."""
    import sys

    fp8 = getattr(module, "fp8_kv", None)
    if fp8 is not None:
        (k_scale, v_scale), dtype = fp8
        key, value = fake_quantize(key, k_scale, dtype), fake_quantize(value, v_scale, dtype)
    eager = sys.modules[type(module).__module__].eager_attention_forward
    return eager(module, query, key, value, attention_mask, **kwargs)


def hf_fp8_model(path, scales: list[torch.Tensor] | None, dtype: torch.dtype = torch.float8_e4m3fn):
    """The checkpoint at ``path`` in transformers (fp32), each layer's K and V through fp8 with
    ``scales[layer]`` [2, num_kv_heads] (a latent: its one scale [1]; None: plain fp32 KV)."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(HOOK, _attention)
    AttentionMaskInterface.register(HOOK, eager_mask)  # (the additive masks eager attention takes)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=HOOK).eval()
    for i, layer in enumerate(hf.model.layers):
        attn = layer.self_attn
        if hasattr(attn, "expand_kv"):  # latent attention: the cached latent, before K/V are rebuilt from it
            if scales is not None:
                attn.expand_kv = _quantized_latent(attn.expand_kv, scales[i].float().cpu(), dtype)
            continue
        attn.fp8_kv = None if scales is None else (scales[i].float().cpu(), dtype)
    return hf


def _quantized_latent(expand_kv, scale: torch.Tensor, dtype: torch.dtype):
    """DeepSeek's ``expand_kv(kv_nope, k_rot)`` over the cached latent (c_kv, roped k_pe) through
    fp8 and back, one scale for the whole latent."""

    def expand(kv_nope, k_rot, *args, **kwargs):
        return expand_kv(fake_quantize(kv_nope, scale, dtype), fake_quantize(k_rot, scale, dtype), *args, **kwargs)

    return expand


def hf_greedy(hf, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            seq = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        outs.append(seq[0, len(p) :].tolist())
    return outs


def hf_logprobs(hf, prompt: list[int], continuation: list[int]) -> list[float]:
    """log p(continuation[i] | prompt + continuation[:i]) in one forward."""
    ids = torch.tensor([prompt + continuation])
    with torch.no_grad():
        logits = hf(ids).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(continuation)]
