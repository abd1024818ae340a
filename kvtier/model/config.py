"""One normalized view of a Hugging Face ``config.json`` for every supported family.

Families differ in key names (``num_local_experts`` vs ``num_experts``), in defaults (Qwen2 always
has q/k/v bias) and in how RoPE is described (transformers 5 ``rope_parameters`` vs the older
``rope_theta`` + ``rope_scaling``). :class:`ModelConfig` hides all of that: the model code reads
only its fields.

Two KV shapes (:attr:`ModelConfig.kv_kind`)::

    "full"    SUPPORTED_ARCHITECTURES: K and V per KV head       2 x num_kv_heads x head_dim per token
    "latent"  MLA_ARCHITECTURES (DeepSeek-V2/V3, Kimi K2):      kv_lora_rank + qk_rope_head_dim per token
              one compressed latent per token, shared by every head (model/mla.py)

:attr:`ModelConfig.kv_layout` is the one description of both that the engine allocates, sizes
and copies by: ``(2, num_kv_heads, head_dim)`` or ``(1, kv_width)`` per token and layer.

Two kinds of attention layer (:attr:`ModelConfig.layer_types`, grouped by :attr:`ModelConfig.attention_groups`)::

    "full_attention"      a query at position p sees keys 0..p
    "sliding_attention"   a query at position p sees keys p - sliding_window + 1 .. p

    Mistral, Mixtral, Qwen3-MoE   every layer slides when sliding_window is set (Qwen: and use_sliding_window)
    Qwen2, Qwen3                  layers i >= max_window_layers slide (use_sliding_window), or as layer_types says
    Qwen2-MoE                     even layers i < max_window_layers slide (use_sliding_window), or layer_types
    Gemma 2, gpt-oss              layer_types, else alternating: sliding, full, sliding, ...
    Gemma 3                       layer_types, else every sliding_window_pattern-th layer full (5 sliding : 1 full)

SLIDING_ARCHITECTURES (gpt-oss, Gemma 2, Gemma 3: model/gpt_oss.py, model/gemma.py) are served on
one device (no tensor parallelism, no MTP drafts: both refused by name), as Mistral/Qwen with sliding
layers are; attention applies each layer's window. The engine keeps a sliding group's KV in blocks
of its own where it can (cache/sliding.py), else every layer keeps every block (docs/DESIGN.md §4).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from kvtier.model.vision_config import VisionConfig

DENSE_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
SUPPORTED_ARCHITECTURES = DENSE_ARCHITECTURES + MOE_ARCHITECTURES
MLA_ARCHITECTURES = ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM")  # multi-head latent attention
# hybrid sliding-window / full attention, with their own layers (attention sinks, soft-capping, Gemma norms)
SLIDING_ARCHITECTURES = ("GptOssForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM")
# vision-language: a vision tower whose features replace image placeholder tokens of a text model above
VISION_ARCHITECTURES = ("LlavaForConditionalGeneration",)
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


@dataclass(frozen=True, slots=True)
class AttentionGroup:
    """Layers that attend alike, and so cache alike: every layer of a group keeps KV for the same
    positions of a sequence (a sliding group only the last ``window``)."""

    kind: str  # FULL_ATTENTION or SLIDING_ATTENTION
    window: int | None  # sliding: a query at position p sees keys p - window + 1 .. p; full: None
    layer_ids: tuple[int, ...]  # indices into the model's KV caches (MTP blocks: num_layers and on)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # bias on q/k/v projections (Qwen2 always); MLA: on q_a_proj and kv_a_proj_with_mqa
    o_bias: bool = False  # bias on o_proj (Llama attention_bias)
    mlp_bias: bool = False  # bias on gate/up/down (Llama mlp_bias)
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (Qwen3)
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] = field(default_factory=dict)  # rope_type + its parameters
    # attention per decoder layer (module docstring): () means every layer full
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None  # the window of the sliding layers; None when no layer slides
    attention_sinks: bool = False  # gpt-oss: a learned logit per head joins every softmax's denominator
    attn_logit_softcapping: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None  # Gemma 2: logits -> cap * tanh(logits / cap)
    query_pre_attn_scalar: float | None = None  # Gemma: softmax scale query_pre_attn_scalar ** -0.5, not head_dim's
    local_rope_theta: float | None = None  # Gemma 3 (rope_local_base_freq): RoPE of sliding layers; None: rope_theta
    local_rope_scaling: dict[str, Any] = field(default_factory=dict)  # its rope_type + parameters
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: torch.dtype = torch.float32
    # MoE (zero / empty for dense families)
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    moe_layer_ids: tuple[int, ...] = ()
    # multi-token prediction (DeepSeek-V3's layout): MTP blocks after the last decoder layer, held
    # (and given KV) only when the engine drafts with them (engine: num_speculative_tokens)
    num_mtp_layers: int = 0
    # Multi-head latent attention (MLA_ARCHITECTURES; 0 for the others). head_dim is then the
    # rotary part of a query/key head (qk_rope_head_dim, as transformers sets it) and num_kv_heads 1:
    # the cache holds one latent per token, shared by all num_heads heads (model/mla.py)
    kv_lora_rank: int = 0  # width of the compressed latent c_kv
    q_lora_rank: int | None = None  # None: q_proj straight from the hidden state (DeepSeek-V2-Lite)
    qk_nope_head_dim: int = 0  # query/key part of a head without RoPE (decompressed from c_kv)
    qk_rope_head_dim: int = 0  # query/key part with RoPE; the key's is shared by all heads (k_pe)
    v_head_dim: int = 0
    rope_interleave: bool = False  # RoPE over (even, odd) pairs, as DeepSeek checkpoints lay them out
    # DeepSeek MoE (model/deepseek.py; moe.py's softmax top-k for Mixtral/Qwen ignores these)
    n_shared_experts: int = 0  # ungated shared experts, n_shared_experts * moe_intermediate_size wide
    scoring_func: str = "softmax"  # "softmax" (V2) or "sigmoid" (V3)
    topk_method: str = "greedy"  # "greedy", "group_limited_greedy" (V2), "noaux_tc" (V3: + e_score_correction_bias)
    n_group: int = 1  # experts in n_group groups; a token's experts come from its topk_group best groups
    topk_group: int = 1
    routed_scaling_factor: float = 1.0  # multiplies the routed experts' gate weights
    # gpt-oss experts (model/gpt_oss.py): (up + 1) * gate * sigmoid(swiglu_alpha * gate), gate and up clamped
    swiglu_alpha: float = 0.0
    swiglu_limit: float = 0.0
    # a vision-language checkpoint (VISION_ARCHITECTURES): its tower, projector and image token;
    # the fields above describe its text model (architecture: the text model's, e.g. LlamaForCausalLM)
    vision: VisionConfig | None = None

    def with_mtp(self, drafting: bool) -> "ModelConfig":
        """The config an engine builds: one MTP block when it drafts with MTP (more in the
        checkpoint draft with the first, as vLLM and SGLang do for DeepSeek-V3), none otherwise
        (its weights are not read and its layers have no KV). The sliding families (gpt-oss,
        Gemma 2/3) do not draft: ValueError."""
        if drafting and self.architecture in SLIDING_ARCHITECTURES:
            raise ValueError(
                f"num_speculative_tokens > 0 is not supported for {self.architecture}: its checkpoints have no "
                "MTP layers to draft with; use num_speculative_tokens=0"
            )
        if drafting and self.num_mtp_layers == 0:
            raise ValueError(
                "num_speculative_tokens > 0 drafts with the model's MTP layers, but its config.json has none "
                "(num_nextn_predict_layers is 0 or absent); e.g. `kvtier init-model qwen3-mtp-tiny DIR` writes one"
            )
        return replace(self, num_mtp_layers=1 if drafting else 0)

    @property
    def num_kv_layers(self) -> int:
        """Layers with KV in every block: the decoder's and the MTP blocks'."""
        return self.num_layers + self.num_mtp_layers

    @property
    def kv_kind(self) -> str:
        """``"full"`` (K and V per KV head) or ``"latent"`` (one MLA latent per token)."""
        return "latent" if self.kv_lora_rank else "full"

    @property
    def kv_width(self) -> int:
        """Numbers cached per token and layer: the latent ``c_kv`` and the shared roped key ``k_pe``
        (latent: 512 + 64 = 576 for DeepSeek-V3), or K and V of every KV head (full)."""
        if self.kv_kind == "latent":
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.num_kv_heads * self.head_dim

    @property
    def kv_layout(self) -> tuple[int, ...]:
        """What one token of one layer caches, as the engine lays it out: planes first, then one
        plane's shape. Full: ``(2, num_kv_heads, head_dim)`` (a K plane and a V plane); latent:
        ``(1, kv_width)`` (one plane, the latent and the roped key). A device layer is
        ``[planes, num_blocks, block_size, *plane]``, a host block
        ``[num_kv_layers, planes, block_size, *plane]`` (model.allocate_kv_caches, DESIGN §4)."""
        if self.kv_kind == "latent":
            return (1, self.kv_width)
        return (2, self.num_kv_heads, self.head_dim)

    @property
    def qk_head_dim(self) -> int:
        """MLA: a query/key head, its part without RoPE then its part with RoPE."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def layer_window(self, layer_idx: int) -> int | None:
        """The sliding window of layer ``layer_idx`` (a query at p sees keys p - window + 1 .. p),
        None for a full-attention layer (MTP blocks are)."""
        if layer_idx < len(self.layer_types) and self.layer_types[layer_idx] == SLIDING_ATTENTION:
            return self.sliding_window
        return None

    @property
    def attention_groups(self) -> tuple[AttentionGroup, ...]:
        """Every KV layer (the decoder's, then the MTP blocks') in groups of one kind and window,
        in order of their first layer: gpt-oss-20b has (sliding 128: 0, 2, .., 22) and (full: 1, 3, .., 23)."""
        groups: dict[int | None, list[int]] = {}
        for layer in range(self.num_kv_layers):
            groups.setdefault(self.layer_window(layer), []).append(layer)
        return tuple(
            AttentionGroup(SLIDING_ATTENTION if window else FULL_ATTENTION, window, tuple(ids)) for window, ids in groups.items()
        )

    def sliding_rope_config(self) -> "ModelConfig":
        """The config whose RoPE the sliding layers use: Gemma 3's local base, else this one."""
        if self.local_rope_theta is None:
            return self
        return replace(self, rope_theta=self.local_rope_theta, rope_scaling=self.local_rope_scaling)

    @property
    def is_moe(self) -> bool:
        return len(self.moe_layer_ids) > 0

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layer_ids)

    @property
    def rope_type(self) -> str:
        return self.rope_scaling.get("rope_type", "default")

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"no config.json in {path} (expected a Hugging Face model directory)")
        hf = json.loads(config_file.read_text())
        gen_file = path / "generation_config.json"
        gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
        return cls.from_hf_dict(hf, gen)

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], generation_config: dict[str, Any] | None = None) -> "ModelConfig":
        arch = (hf.get("architectures") or [None])[0]
        if arch in VISION_ARCHITECTURES:
            return _vision_language(hf, generation_config)
        if arch not in SUPPORTED_ARCHITECTURES + MLA_ARCHITECTURES + SLIDING_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r}; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES + MLA_ARCHITECTURES + SLIDING_ARCHITECTURES + VISION_ARCHITECTURES)}"
            )
        num_heads = hf["num_attention_heads"]
        num_layers = hf["num_hidden_layers"]
        moe = _moe_fields(arch, hf, num_layers)
        fields: dict[str, Any] = dict(
            architecture=arch,
            num_layers=num_layers,
            hidden_size=hf["hidden_size"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            intermediate_size=hf.get("intermediate_size", 0),
            vocab_size=hf["vocab_size"],
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            hidden_act=hf.get("hidden_act", "silu"),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=_qkv_bias(arch, hf),
            o_bias=arch in ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
            and bool(hf.get("attention_bias", False)),
            mlp_bias=arch == "LlamaForCausalLM" and bool(hf.get("mlp_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            rope_theta=float(_rope_dict(hf).get("rope_theta", hf.get("rope_theta", 10000.0))),
            rope_scaling=_rope_dict(hf),
            eos_token_ids=_eos_ids(hf, generation_config or {}),
            torch_dtype=_DTYPES.get(str(hf.get("dtype") or hf.get("torch_dtype") or "float32"), torch.float32),
            num_mtp_layers=int(hf.get("num_nextn_predict_layers") or 0),  # DeepSeek-V3, GLM-4.5, MiMo
            **moe,
            **_attention_layers(arch, hf, num_layers),
        )
        if arch in MLA_ARCHITECTURES:
            fields.update(_mla_fields(arch, hf))
        if arch in SLIDING_ARCHITECTURES:
            fields.update(_sliding_family_fields(arch, hf))
        return cls(**fields)


# a LLaVA text_config's model_type -> the text architecture it reuses
_TEXT_OF_VISION = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def _vision_language(hf: dict[str, Any], generation_config: dict[str, Any] | None) -> ModelConfig:
    """A LLaVA config: its ``text_config`` read as that family's, with :class:`VisionConfig`."""
    arch = hf["architectures"][0]
    text = dict(hf.get("text_config") or {})
    kind = text.get("model_type", "llama")
    if kind not in _TEXT_OF_VISION:
        raise ValueError(f"{arch} with a {kind!r} text model is not supported; supported: {', '.join(_TEXT_OF_VISION)}")
    v = dict(hf.get("vision_config") or {})
    if v.get("model_type", "clip_vision_model") != "clip_vision_model":
        raise ValueError(f"{arch} with a {v.get('model_type')!r} vision tower is not supported; supported: clip_vision_model")
    strategy = hf.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise ValueError(f"vision_feature_select_strategy must be 'default' or 'full', got {strategy!r}")
    layers = hf.get("vision_feature_layer", -2)
    num_layers = v.get("num_hidden_layers", 12)
    feature_layers = tuple(layers) if isinstance(layers, list) else (int(layers),)
    if not all(-num_layers - 1 <= i <= num_layers for i in feature_layers):
        raise ValueError(f"vision_feature_layer {layers!r} is outside the tower's {num_layers} layers")
    vision = VisionConfig(
        architecture=arch,
        hidden_size=v.get("hidden_size", 768),
        intermediate_size=v.get("intermediate_size", 3072),
        num_layers=num_layers,
        num_heads=v.get("num_attention_heads", 12),
        image_size=v.get("image_size", 224),
        patch_size=v.get("patch_size", 32),
        num_channels=v.get("num_channels", 3),
        hidden_act=v.get("hidden_act", "quick_gelu"),
        layer_norm_eps=v.get("layer_norm_eps", 1e-5),
        image_token_id=int(hf.get("image_token_index", hf.get("image_token_id", 32000))),
        feature_layers=feature_layers,
        select_strategy=strategy,
        projector_act=hf.get("projector_hidden_act", "gelu"),
        projector_bias=bool(hf.get("multimodal_projector_bias", True)),
    )
    text["architectures"] = [_TEXT_OF_VISION[kind]]
    text.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", False))
    text.setdefault("dtype", hf.get("dtype") or hf.get("torch_dtype"))
    return replace(ModelConfig.from_hf_dict(text, generation_config), vision=vision)


def _attention_layers(arch: str, hf: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """``layer_types`` and ``sliding_window`` as transformers reads each family's config (module
    docstring); ``sliding_window`` None when no layer slides."""
    window = hf.get("sliding_window", _SLIDING_DEFAULTS.get(arch))
    given = hf.get("layer_types")
    use = bool(hf.get("use_sliding_window", False))
    max_window_layers = hf.get("max_window_layers", 28)
    if arch in ("MistralForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM"):
        # transformers applies the window to every layer, whatever layer_types says
        if arch == "Qwen3MoeForCausalLM" and not use:
            window = None
        types = [SLIDING_ATTENTION if window else FULL_ATTENTION] * num_layers
    elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        window = window if use else None
        types = given or [
            SLIDING_ATTENTION if window is not None and i >= max_window_layers else FULL_ATTENTION for i in range(num_layers)
        ]
    elif arch == "Qwen2MoeForCausalLM":
        window = window if use else None
        types = given or [
            SLIDING_ATTENTION if (i + 1) % 2 and i < max_window_layers and use else FULL_ATTENTION for i in range(num_layers)
        ]
    elif arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "GptOssForCausalLM"):
        if hf.get("use_bidirectional_attention"):
            raise ValueError(f"{arch} with use_bidirectional_attention=true (an embedding model) is not a causal LM")
        # Gemma 3: every sliding_window_pattern-th layer is full (its checkpoints before layer_types)
        pattern = hf.get("sliding_window_pattern", 6) if arch == "Gemma3ForCausalLM" else 2
        types = given or [SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(num_layers)]
    else:  # Llama, DeepSeek: no sliding layers
        types = [FULL_ATTENTION] * num_layers
    if len(types) != num_layers or not set(types) <= {FULL_ATTENTION, SLIDING_ATTENTION}:
        raise ValueError(
            f"layer_types must name {FULL_ATTENTION!r} or {SLIDING_ATTENTION!r} for each of the {num_layers} layers, got {types}"
        )
    if SLIDING_ATTENTION not in types:
        return dict(layer_types=tuple(types), sliding_window=None)
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"{arch} has sliding_attention layers but sliding_window is {window!r} (a positive number expected)")
    return dict(layer_types=tuple(types), sliding_window=window)


# transformers' defaults of the keys the sliding families' config classes have and a config.json may leave out
_SLIDING_DEFAULTS = {"GptOssForCausalLM": 128, "Gemma2ForCausalLM": 4096, "Gemma3ForCausalLM": 4096}


def _sliding_family_fields(arch: str, hf: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss, Gemma 2 and Gemma 3: their class defaults (where they differ from Llama's), RoPE,
    soft-capping, softmax scale, attention sinks and expert activation."""
    if arch == "GptOssForCausalLM":
        attention_bias = bool(hf.get("attention_bias", True))
        return dict(
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
            attention_sinks=True,
            swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
            **_rope_fields(hf, hf.get("rope_parameters") or hf.get("rope_scaling") or _GPT_OSS_ROPE, 150000.0),
        )
    attention_bias = bool(hf.get("attention_bias", False))
    fields: dict[str, Any] = dict(
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        hidden_act=hf.get("hidden_activation") or "gelu_pytorch_tanh",  # Gemma's MLP reads this key, not hidden_act
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
        final_logit_softcapping=hf.get("final_logit_softcapping", 30.0 if arch == "Gemma2ForCausalLM" else None),
    )
    if arch == "Gemma2ForCausalLM":
        fields.update(attn_logit_softcapping=hf.get("attn_logit_softcapping", 50.0))
        fields.update(_rope_fields(hf, hf.get("rope_parameters") or hf.get("rope_scaling") or {}, 10000.0))
        return fields
    # Gemma 3: q/k norms; no attention soft-capping (transformers ignores attn_logit_softcapping);
    # RoPE per layer kind: transformers 5's {"full_attention": {..}, "sliding_attention": {..}}, or
    # the checkpoints' rope_theta + rope_scaling (global) and rope_local_base_freq (local)
    params = hf.get("rope_parameters") or {}
    full = dict(params.get("full_attention") or {})
    local = dict(params.get("sliding_attention") or {})
    full.update(hf.get("rope_scaling") or {})
    full.setdefault("rope_theta", hf.get("rope_theta", 1_000_000.0))
    local.setdefault("rope_theta", hf.get("rope_local_base_freq", 10_000.0))
    local_rope = _rope_fields(hf, local, 10_000.0)
    fields.update(
        qk_norm=True,
        local_rope_theta=local_rope["rope_theta"],
        local_rope_scaling=local_rope["rope_scaling"],
        **_rope_fields(hf, full, 1_000_000.0),
    )
    return fields


# transformers' GptOssConfig default (a config.json without RoPE keys)
_GPT_OSS_ROPE = dict(
    rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False, original_max_position_embeddings=4096
)


def _rope_fields(hf: dict[str, Any], rope: dict[str, Any], default_theta: float) -> dict[str, Any]:
    """``rope_theta`` and ``rope_scaling`` of one RoPE description (``rope`` as a checkpoint gives it)."""
    scaling = _rope_dict(hf, rope)
    return dict(rope_theta=float(scaling.get("rope_theta", hf.get("rope_theta", default_theta))), rope_scaling=scaling)


def _qkv_bias(arch: str, hf: dict[str, Any]) -> bool:
    if arch == "Qwen2ForCausalLM":
        return True
    if arch == "Qwen2MoeForCausalLM":
        return bool(hf.get("qkv_bias", True))
    return bool(hf.get("attention_bias", False))


def _rope_dict(hf: dict[str, Any], rope: dict[str, Any] | None = None) -> dict[str, Any]:
    """``rope`` (default: ``rope_parameters`` (transformers 5) or ``rope_scaling`` (older)), with
    ``rope_type`` set."""
    rope = dict(rope if rope is not None else hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
    rope.pop("type", None)
    if rope["rope_type"] in ("llama3", "yarn"):
        # transformers lets a top-level original_max_position_embeddings win (standardize_rope_params)
        rope["original_max_position_embeddings"] = (
            hf.get("original_max_position_embeddings")
            or rope.get("original_max_position_embeddings")
            or hf.get("max_position_embeddings")
        )
    return rope


def _eos_ids(hf: dict[str, Any], gen: dict[str, Any]) -> tuple[int, ...]:
    eos = gen.get("eos_token_id", hf.get("eos_token_id"))
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def _moe_fields(arch: str, hf: dict[str, Any], num_layers: int) -> dict[str, Any]:
    if arch == "MixtralForCausalLM":
        return dict(
            num_experts=hf["num_local_experts"],
            top_k=hf["num_experts_per_tok"],
            moe_intermediate_size=hf["intermediate_size"],
            norm_topk_prob=True,
            moe_layer_ids=tuple(range(num_layers)),
        )
    if arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        num_experts = hf.get("num_experts") or hf.get("num_local_experts") or 0  # v5 Qwen3-MoE: the latter
        step = hf.get("decoder_sparse_step", 1) or 1
        dense_only = set(hf.get("mlp_only_layers") or [])
        layers = tuple(i for i in range(num_layers) if num_experts > 0 and i not in dense_only and (i + 1) % step == 0)
        shared = hf.get("shared_expert_intermediate_size", 0) if arch == "Qwen2MoeForCausalLM" else 0
        return dict(
            num_experts=num_experts,
            top_k=hf["num_experts_per_tok"],
            moe_intermediate_size=hf["moe_intermediate_size"],
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            shared_expert_intermediate_size=shared,
            moe_layer_ids=layers,
        )
    if arch in MLA_ARCHITECTURES:
        return _deepseek_moe_fields(arch, hf, num_layers)
    if arch == "GptOssForCausalLM":  # top-k of the router logits (with bias), softmax over those k
        return dict(
            num_experts=hf["num_local_experts"],
            top_k=hf["num_experts_per_tok"],
            moe_intermediate_size=hf["intermediate_size"],
            norm_topk_prob=True,
            moe_layer_ids=tuple(range(num_layers)),
        )
    return {}


# transformers' defaults where DeepSeek-V3's and V2's config classes differ (a config.json that
# leaves a key out means the class default, as transformers reads it)
_DEEPSEEK_DEFAULTS: dict[str, dict[str, Any]] = {
    "DeepseekV3ForCausalLM": dict(
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        n_group=8,
        topk_group=4,
        first_k_dense_replace=3,
        norm_topk_prob=True,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
    ),
    "DeepseekV2ForCausalLM": dict(
        n_shared_experts=2,
        routed_scaling_factor=1.0,
        n_group=None,
        topk_group=None,
        first_k_dense_replace=0,
        norm_topk_prob=False,
        topk_method="greedy",
        scoring_func="softmax",
    ),
}
# the routings transformers implements: V3 always sigmoid + bias-corrected group choice, V2 softmax
_DEEPSEEK_ROUTINGS = {
    "DeepseekV3ForCausalLM": {("sigmoid", "noaux_tc")},
    "DeepseekV2ForCausalLM": {("softmax", "greedy"), ("softmax", "group_limited_greedy")},
}


def _deepseek_moe_fields(arch: str, hf: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """DeepSeek's MoE keys: layer i is MoE iff i >= first_k_dense_replace and i % moe_layer_freq == 0."""
    d = {key: hf.get(key, default) for key, default in _DEEPSEEK_DEFAULTS[arch].items()}
    num_experts, top_k = hf["n_routed_experts"], hf["num_experts_per_tok"]
    n_group, topk_group = d["n_group"] or 1, d["topk_group"] or 1
    routing = (d["scoring_func"], d["topk_method"])
    if routing not in _DEEPSEEK_ROUTINGS[arch]:
        raise ValueError(
            f"{arch} with scoring_func={routing[0]!r}, topk_method={routing[1]!r}: supported are "
            + ", ".join(f"({s!r}, {m!r})" for s, m in sorted(_DEEPSEEK_ROUTINGS[arch]))
        )
    if arch == "DeepseekV2ForCausalLM" and d["norm_topk_prob"]:
        raise ValueError(
            "DeepseekV2ForCausalLM with norm_topk_prob=true: transformers ignores it and DeepSeek's own code then "
            "skips routed_scaling_factor; no published DeepSeek-V2 checkpoint sets it"
        )
    if num_experts % n_group or not 1 <= topk_group <= n_group or top_k > topk_group * (num_experts // n_group):
        raise ValueError(
            f"n_routed_experts={num_experts} in n_group={n_group} groups, topk_group={topk_group}: "
            f"cannot choose num_experts_per_tok={top_k} experts"
        )
    freq = hf.get("moe_layer_freq") or 1
    first_dense = d["first_k_dense_replace"]
    return dict(
        num_experts=num_experts,
        top_k=top_k,
        moe_intermediate_size=hf["moe_intermediate_size"],
        norm_topk_prob=bool(d["norm_topk_prob"]),
        moe_layer_ids=tuple(i for i in range(num_layers) if i >= first_dense and i % freq == 0),
        n_shared_experts=d["n_shared_experts"],
        scoring_func=d["scoring_func"],
        topk_method=d["topk_method"],
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=float(d["routed_scaling_factor"]),
    )


def _mla_fields(arch: str, hf: dict[str, Any]) -> dict[str, Any]:
    """The attention keys of DeepSeek-V2/V3 (``q_lora_rank`` null: DeepSeek-V2-Lite)."""
    attention_bias = bool(hf.get("attention_bias", False))
    return dict(
        num_kv_heads=1,
        head_dim=hf["qk_rope_head_dim"],
        kv_lora_rank=hf["kv_lora_rank"],
        q_lora_rank=hf["q_lora_rank"],
        qk_nope_head_dim=hf["qk_nope_head_dim"],
        qk_rope_head_dim=hf["qk_rope_head_dim"],
        v_head_dim=hf["v_head_dim"],
        # V2 rotates (even, odd) pairs as complex numbers; V3 as configured (pairs unless told not to)
        rope_interleave=arch == "DeepseekV2ForCausalLM" or bool(hf.get("rope_interleave", True)),
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        mlp_bias=arch == "DeepseekV2ForCausalLM" and bool(hf.get("mlp_bias", False)),
    )
