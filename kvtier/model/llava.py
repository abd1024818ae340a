"""LLaVA (``LlavaForConditionalGeneration``): a CLIP vision tower and a projector in front of a
Llama / Mistral / Qwen2 text model (model/families.py), as transformers computes it::

    pixels [N, 3, S, S]
      -> patch conv + CLS + positions -> pre_layrnorm                     hidden state 0
      -> encoder layers 1..L (pre-norm attention + quick-gelu MLP)       hidden states 1..L
      -> cat(hidden_states[l] for l in vision_feature_layer)            (default: -2, the layer before last)
         drop the CLS position ("default" strategy; "full" keeps it)
      -> projector: linear_2(act(linear_1(x)))                           features [N, tokens, text hidden]

    prompt embeddings = embed(ids), then row r of image placeholder i (``image_token_id``) takes
    features[i][r - offset_i]; the text model runs on them as on any prompt.

Only the layers the selected hidden states need are run (-2 of 24: 23). The features of an image
depend on its pixels alone, so the engine keeps them by the image's content hash (engine/encoder_cache.py)
and a chunk of prefill that covers part of an image takes the matching rows.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvtier.model.config import ModelConfig, VisionConfig
from kvtier.model.families import CausalLM
from kvtier.model.shard import TPShard

_ACTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def _act(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in _ACTS:
        raise ValueError(f"unsupported vision activation {name!r}; choose from {sorted(_ACTS)}")
    return _ACTS[name]


class ClipEmbeddings(nn.Module):
    def __init__(self, v: VisionConfig):
        super().__init__()
        self.class_embedding = nn.Parameter(torch.empty(v.hidden_size))
        self.patch_embedding = nn.Conv2d(v.num_channels, v.hidden_size, v.patch_size, v.patch_size, bias=False)
        self.position_embedding = nn.Embedding(v.num_patches + 1, v.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(pixels.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight[None]


class ClipAttention(nn.Module):
    def __init__(self, v: VisionConfig):
        super().__init__()
        h = v.hidden_size
        self.num_heads, self.head_dim = v.num_heads, h // v.num_heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(h, h) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, h = x.shape
        q, k, v = (
            p(x).view(n, t, self.num_heads, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5)  # every patch sees every patch
        return self.out_proj(out.transpose(1, 2).reshape(n, t, h))


class ClipMLP(nn.Module):
    def __init__(self, v: VisionConfig):
        super().__init__()
        self.fc1 = nn.Linear(v.hidden_size, v.intermediate_size)
        self.fc2 = nn.Linear(v.intermediate_size, v.hidden_size)
        self.act = _act(v.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class ClipLayer(nn.Module):
    def __init__(self, v: VisionConfig):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(v.hidden_size, eps=v.layer_norm_eps)
        self.self_attn = ClipAttention(v)
        self.layer_norm2 = nn.LayerNorm(v.hidden_size, eps=v.layer_norm_eps)
        self.mlp = ClipMLP(v)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class ClipEncoder(nn.Module):
    def __init__(self, v: VisionConfig):
        super().__init__()
        self.layers = nn.ModuleList(ClipLayer(v) for _ in range(v.num_layers))


class ClipVisionTower(nn.Module):
    """transformers' ``CLIPVisionModel`` up to the hidden states LLaVA selects (parameter names
    as the checkpoint's ``vision_tower.*``, ``vision_model.`` dropped; its post_layernorm is kept
    for loading but LLaVA never reads it)."""

    def __init__(self, v: VisionConfig):
        super().__init__()
        self.config = v
        self.embeddings = ClipEmbeddings(v)
        self.pre_layrnorm = nn.LayerNorm(v.hidden_size, eps=v.layer_norm_eps)
        self.encoder = ClipEncoder(v)
        self.post_layernorm = nn.LayerNorm(v.hidden_size, eps=v.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """The selected hidden states of ``pixels`` [N, C, S, S], concatenated: [N, tokens, hidden * layers]."""
        v = self.config
        if tuple(pixels.shape[1:]) != (v.num_channels, v.image_size, v.image_size):
            raise ValueError(f"images must be [N, {v.num_channels}, {v.image_size}, {v.image_size}], got {list(pixels.shape)}")
        x = self.pre_layrnorm(self.embeddings(pixels))
        states = [x]
        for layer in list(self.encoder.layers)[: v.num_layers_run]:
            x = layer(x)
            states.append(x)
        picked = [states[i if i >= 0 else v.num_layers + 1 + i] for i in v.feature_layers]
        if v.select_strategy == "default":
            picked = [s[:, 1:] for s in picked]
        return torch.cat(picked, dim=-1)


class Projector(nn.Module):
    def __init__(self, v: VisionConfig, text_hidden: int):
        super().__init__()
        self.linear_1 = nn.Linear(v.hidden_size * len(v.feature_layers), text_hidden, bias=v.projector_bias)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=v.projector_bias)
        self.act = _act(v.projector_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(CausalLM):
    """The text model of a LLaVA checkpoint (a :class:`CausalLM`, called as one) with its vision
    tower and projector: :meth:`encode_images` gives the features that ``forward``'s
    ``mm_embeds`` places at the placeholder rows."""

    def __init__(self, cfg: ModelConfig, attention_backend: str = "torch", tp: TPShard | None = None):
        if cfg.vision is None:
            raise ValueError(f"{cfg.architecture} has no vision tower: load it as a CausalLM")
        if tp is not None and tp.size > 1:
            raise ValueError(
                f"{cfg.vision.architecture} under tensor parallelism (tensor_parallel_size={tp.size}) is not supported: "
                "vision-language models are served on one device"
            )
        super().__init__(cfg, attention_backend, tp)
        self.vision_tower = ClipVisionTower(cfg.vision)
        self.multi_modal_projector = Projector(cfg.vision, cfg.hidden_size)

    @torch.inference_mode()
    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """Projected features [N, num_image_tokens, hidden] of preprocessed images [N, C, S, S]."""
        dtype = self.multi_modal_projector.linear_1.weight.dtype
        return self.multi_modal_projector(self.vision_tower(pixels.to(dtype)))
