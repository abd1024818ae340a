"""One normalized view of a Hugging Face ``config.json`` for every supported family.

Families differ in key names (``num_local_experts`` vs ``num_experts``), in defaults (Qwen2 always
has q/k/v bias) and in how RoPE is described (transformers 5 ``rope_parameters`` vs the older
``rope_theta`` + ``rope_scaling``). :class:`ModelConfig` hides all of that: the model code reads
only its fields.
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
    qkv_bias: bool = False  # bias on q/k/v projections (Qwen2 always)
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
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        num_heads = hf["num_attention_heads"]
        num_layers = hf["num_hidden_layers"]
        moe = _moe_fields(arch, hf, num_layers)
        sliding = hf.get("sliding_window")
        if arch.startswith("Qwen") and not hf.get("use_sliding_window", False):
            sliding = None
        return cls(
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
    return {}
