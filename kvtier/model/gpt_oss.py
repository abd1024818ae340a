"""gpt-oss (``GptOssForCausalLM``): model/families.py's decoder with attention sinks, sliding layers and its MoE.

::

    h = embed(ids)
    per layer l:  h = h + o_proj(attn(rope(q), rope(k), v))     q/k/v/o biases; layer_types: sliding
                                                                 (window 128) and full, alternating;
                                                                 a learned sink logit per head
                  h = h + GptOssMoE(h)                           every layer
    hidden = norm(h);  logits = lm_head(hidden)

Attention sinks (``self_attn.sinks`` [num_heads]): one more logit per head in every softmax, so a
query may attend to "nothing" (model/attention.py). RoPE is YaRN (factor 32, truncate false).

The MoE, as transformers' GptOssTopKRouter and GptOssExperts::

    logits  = router(x)                      a Linear with bias (checkpoint: mlp.router)
    experts = top_k of logits;  weights = softmax over those k logits
    expert(x) = down(glu) + down.bias,  with  gate, up = gate_up(x)[..., 0::2], gate_up(x)[..., 1::2]
                glu = (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g),  g = clamp(gate, max=limit)

The checkpoint stacks the experts (``mlp.experts.gate_up_proj`` [E, hidden, 2I] with gate and up
interleaved, ``down_proj`` [E, I, hidden], and their ``_bias``); model/loader.py splits them into
the per-expert Linears of :class:`GptOssExpert` (MXFP4-quantized experts are not read). Tokens are
dispatched to their experts by moe.py's grouped path (with routing capture and replay).

Served on one device (config.SLIDING_ARCHITECTURES; model/loader.py ``load_model``).
transformers keeps the RMSNorm weights in fp32 when loading bf16 (``_keep_in_fp32_modules``); here
they take the load dtype, so bf16 logits differ from transformers' by that rounding (fp32 equal).
"""

from __future__ import annotations

import torch
from torch import nn

from kvtier.model.config import ModelConfig
from kvtier.model.families import CausalLM, DecoderLayer
from kvtier.model.moe import SparseMoE


class GptOssExpert(nn.Module):
    """One expert: ``gate_up_proj`` [2I, hidden] (gate and up rows interleaved, as the checkpoint
    stores them), ``down_proj`` [hidden, I], both with bias; the clamped SwiGLU between them."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.moe_intermediate_size, bias=True)
        self.down_proj = nn.Linear(cfg.moe_intermediate_size, cfg.hidden_size, bias=True)
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        gate = gate_up[..., 0::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
        return self.down_proj((up + 1) * gate * torch.sigmoid(gate * self.alpha))


class GptOssMoE(SparseMoE):
    """moe.py's dispatch with gpt-oss's router (a bias; softmax over the top-k logits) and experts."""

    router_bias = True

    def make_expert(self, cfg: ModelConfig) -> nn.Module:
        return GptOssExpert(cfg)

    def route(self, x: torch.Tensor, routing_in: torch.Tensor | None = None):
        """(expert ids [T, top_k] int64, gate weights [T, top_k] fp32): the top_k router logits
        and their softmax, in the activations' dtype as transformers computes them; ``routing_in``
        forces the ids, whose weights are then the softmax of their logits."""
        logits = self.gate(x)
        if routing_in is None:
            top, ids = torch.topk(logits, self.top_k, dim=-1)
        else:
            ids = routing_in[:, self.moe_index].long()
            top = logits.gather(1, ids)
        return ids, torch.softmax(top, dim=-1).float()

    def fuse(self) -> None:
        """Nothing to stack: the experts' biases and activation do not fit moe.py's dense
        dispatch, so every step takes the grouped path."""


class GptOssDecoderLayer(DecoderLayer):
    moe_cls = GptOssMoE


class GptOssForCausalLM(CausalLM):
    """gpt-oss on paged KV, called as CausalLM is; one device (no tensor parallelism: the sinks
    would have to be split with the heads)."""

    layer_cls = GptOssDecoderLayer

    def __init__(self, cfg: ModelConfig, attention_backend: str = "torch"):
        if not cfg.attention_sinks or cfg.num_mtp_layers:
            raise ValueError(f"{cfg.architecture} is not gpt-oss (attention sinks, no MTP blocks)")
        super().__init__(cfg, attention_backend)
