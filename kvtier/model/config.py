"""One normalized view of a Hugging Face ``config.json`` for every supported family.

Families differ in key names (``num_local_experts`` vs ``num_experts``), in defaults (Qwen2 always
has q/k/v bias) and in how RoPE is described (transformers 5 ``rope_parameters`` vs the older
``rope_theta`` + ``rope_scaling``). :class:`ModelConfig` hides all of that: the model code reads
only its fields.

Two KV shapes (:attr:`ModelConfig.kv_kind`)::

    "full"    SUPPORTED_ARCHITECTURES: K and V per KV head       2 x num_kv_heads x head_dim per token
    "latent"  MLA_ARCHITECTURES (DeepSeek-V2/V3, Kimi K2):      kv_lora_rank + qk_rope_head_dim per token
              one compressed latent per token, shared by every head (model/mla.py); the engine does
              not serve these yet (the model alone loads with model/loader.py ``load_mla_model``)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

DENSE_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
SUPPORTED_ARCHITECTURES = DENSE_ARCHITECTURES + MOE_ARCHITECTURES
MLA_ARCHITECTURES = ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM")  # multi-head latent attention

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


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
    sliding_window: int | None = None  # recorded, not applied (see families.py)
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

    def with_mtp(self, drafting: bool) -> "ModelConfig":
        """The config an engine builds: one MTP block when it drafts with MTP (more in the
        checkpoint draft with the first, as vLLM and SGLang do for DeepSeek-V3), none otherwise
        (its weights are not read and its layers have no KV)."""
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
    def qk_head_dim(self) -> int:
        """MLA: a query/key head, its part without RoPE then its part with RoPE."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

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
        if arch not in SUPPORTED_ARCHITECTURES + MLA_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
                f" (read, not served yet: {', '.join(MLA_ARCHITECTURES)})"
            )
        num_heads = hf["num_attention_heads"]
        num_layers = hf["num_hidden_layers"]
        moe = _moe_fields(arch, hf, num_layers)
        sliding = hf.get("sliding_window")
        if arch.startswith("Qwen") and not hf.get("use_sliding_window", False):
            sliding = None
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
            sliding_window=sliding or None,
            eos_token_ids=_eos_ids(hf, generation_config or {}),
            torch_dtype=_DTYPES.get(str(hf.get("dtype") or hf.get("torch_dtype") or "float32"), torch.float32),
            num_mtp_layers=int(hf.get("num_nextn_predict_layers") or 0),  # DeepSeek-V3, GLM-4.5, MiMo
            **moe,
        )
        if arch in MLA_ARCHITECTURES:
            fields.update(_mla_fields(arch, hf))
        return cls(**fields)


def _qkv_bias(arch: str, hf: dict[str, Any]) -> bool:
    if arch == "Qwen2ForCausalLM":
        return True
    if arch == "Qwen2MoeForCausalLM":
        return bool(hf.get("qkv_bias", True))
    return bool(hf.get("attention_bias", False))


def _rope_dict(hf: dict[str, Any]) -> dict[str, Any]:
    """``rope_parameters`` (transformers 5) or ``rope_scaling`` (older), with ``rope_type`` set."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
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
