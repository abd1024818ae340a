"""``kvtier init-model PRESET DIR``: random Hugging Face checkpoints for tests, demos and benchmarks.

A preset is a transformers config (class name + keyword arguments); :func:`init_model` instantiates
the HF model with a fixed seed and saves it with the byte-level tokenizer (tokenizer.py), so the
directory loads in ``kvtier`` and in ``transformers`` alike. Tiny presets exercise every family
feature (GQA, explicit head_dim, tied embeddings, llama3 / yarn RoPE, MoE variants); the large
ones have benchmark shapes (bf16) and take ~10-30 s to write. ``config_only=True`` writes no weights
(in milliseconds, for any shape): load such a directory with ``load_format="dummy"``.

Over 600 lines: one table, a preset per served family and benchmark shape (each a config's keyword
arguments, one per line), and the one function that writes them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvtier.model.tokenizer import EOS_TOKEN_ID, IMAGE_TOKEN, IMAGE_TOKEN_ID, save_byte_tokenizer

_TINY = dict(
    vocab_size=320,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.15,
    rms_norm_eps=1e-6,
    bos_token_id=None,
    eos_token_id=EOS_TOKEN_ID,
    pad_token_id=None,
)
_TINY_MOE = dict(_TINY, num_experts_per_tok=2)

PRESETS: dict[str, dict[str, Any]] = {
    "llama-tiny": dict(
        config_class="LlamaConfig",
        dtype="float32",
        kwargs=dict(
            _TINY,
            num_hidden_layers=2,
            intermediate_size=128,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    "mistral-tiny": dict(
        config_class="MistralConfig",
        dtype="float32",
        kwargs=dict(
            _TINY,
            num_hidden_layers=2,
            intermediate_size=128,
            num_key_value_heads=1,
            head_dim=32,
            sliding_window=None,
            rope_parameters=dict(rope_type="default", rope_theta=1e6),
        ),
    ),
    "qwen2-tiny": dict(
        config_class="Qwen2Config",
        dtype="float32",
        kwargs=dict(
            _TINY,
            num_hidden_layers=3,
            intermediate_size=128,
            tie_word_embeddings=True,
            rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128),
        ),
    ),
    "qwen3-tiny": dict(
        config_class="Qwen3Config",
        dtype="float32",
        kwargs=dict(
            _TINY,
            num_hidden_layers=2,
            intermediate_size=128,
            head_dim=32,
            tie_word_embeddings=True,
            rope_parameters=dict(rope_type="default", rope_theta=1e6),
        ),
    ),
    "mixtral-tiny": dict(
        config_class="MixtralConfig",
        dtype="float32",
        kwargs=dict(
            _TINY_MOE,
            num_hidden_layers=2,
            intermediate_size=64,
            num_local_experts=8,
            sliding_window=None,
            rope_parameters=dict(rope_type="default", rope_theta=1e6),
        ),
    ),
    "qwen2-moe-tiny": dict(
        config_class="Qwen2MoeConfig",
        dtype="float32",
        kwargs=dict(
            _TINY_MOE,
            num_hidden_layers=3,
            intermediate_size=128,
            num_experts=8,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
    "qwen3-moe-tiny": dict(
        config_class="Qwen3MoeConfig",
        dtype="float32",
        kwargs=dict(
            _TINY_MOE,
            num_hidden_layers=2,
            intermediate_size=128,
            num_experts=8,
            moe_intermediate_size=32,
            head_dim=32,
            norm_topk_prob=True,
            rope_parameters=dict(rope_type="yarn", rope_theta=1e6, factor=2.0, original_max_position_embeddings=256),
        ),
    ),
    # `kvtier demo`: large enough that a prefix hit visibly beats recompute on a CPU, small enough to
    # write in a second.
    "qwen3-moe-demo": dict(
        config_class="Qwen3MoeConfig",
        dtype="float32",
        kwargs=dict(
            _TINY_MOE,
            hidden_size=256,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=32,
            intermediate_size=512,
            num_experts=8,
            moe_intermediate_size=256,
            norm_topk_prob=True,
            max_position_embeddings=8192,
            initializer_range=0.05,
            rope_parameters=dict(rope_type="default", rope_theta=1e6),
        ),
    ),
    # Benchmark shapes (bf16): never instantiate these in unit tests.
    "qwen3-0.6b-shape": dict(
        config_class="Qwen3Config",
        dtype="bfloat16",
        kwargs=dict(
            vocab_size=151936,
            hidden_size=1024,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=3072,
            tie_word_embeddings=True,
            max_position_embeddings=40960,
            rms_norm_eps=1e-6,
            initializer_range=0.02,
            rope_parameters=dict(rope_type="default", rope_theta=1e6),
            bos_token_id=None,
            eos_token_id=EOS_TOKEN_ID,
            pad_token_id=None,
        ),
    ),
    "qwen3-moe-small": dict(
        config_class="Qwen3MoeConfig",
        dtype="bfloat16",
        kwargs=dict(
            vocab_size=32768,
            hidden_size=1024,
            num_hidden_layers=8,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=128,
            intermediate_size=3072,
            num_experts=32,
            num_experts_per_tok=4,
            moe_intermediate_size=384,
            norm_topk_prob=True,
            max_position_embeddings=32768,
            rms_norm_eps=1e-6,
            initializer_range=0.02,
            rope_parameters=dict(rope_type="default", rope_theta=1e6),
            bos_token_id=None,
            eos_token_id=EOS_TOKEN_ID,
            pad_token_id=None,
        ),
    ),
    # Llama-3.1-8B's shape (128K context, llama3 RoPE). ~16 GB of bf16 weights: write it with
    # config_only=True and load it with load_format="dummy".
    "llama3-8b-shape": dict(
        config_class="LlamaConfig",
        dtype="bfloat16",
        kwargs=dict(
            vocab_size=128256,
            hidden_size=4096,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=14336,
            tie_word_embeddings=False,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            initializer_range=0.02,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=8192,
            ),
            bos_token_id=None,
            eos_token_id=EOS_TOKEN_ID,
            pad_token_id=None,
        ),
    ),
}
# Multi-token prediction (DeepSeek-V3's layout: one MTP block as model.layers.{num_hidden_layers},
# written by init_model beside the decoder's weights): models that draft their own next tokens
# (engine: num_speculative_tokens).
PRESETS["qwen3-mtp-tiny"] = dict(PRESETS["qwen3-tiny"], kwargs=dict(PRESETS["qwen3-tiny"]["kwargs"], num_nextn_predict_layers=1))
PRESETS["qwen3-moe-mtp-tiny"] = dict(
    PRESETS["qwen3-moe-tiny"], kwargs=dict(PRESETS["qwen3-moe-tiny"]["kwargs"], num_nextn_predict_layers=1)
)
PRESETS["llama3-8b-mtp-shape"] = dict(
    PRESETS["llama3-8b-shape"], kwargs=dict(PRESETS["llama3-8b-shape"]["kwargs"], num_nextn_predict_layers=1)
)
# Llama-3.1-70B's shape: ~141 GB of bf16 weights, more than one 80 GB GPU holds: served with
# tensor_parallel_size 2 (H200s) or 4 (H100s), from config_only=True and load_format="dummy".
PRESETS["llama3-70b-shape"] = dict(
    PRESETS["llama3-8b-shape"],
    kwargs=dict(
        PRESETS["llama3-8b-shape"]["kwargs"],
        hidden_size=8192,
        num_hidden_layers=80,
        num_attention_heads=64,
        intermediate_size=28672,
    ),
)

# Multi-head latent attention (model/deepseek.py on the latent cache of model/mla.py). DeepSeek-V3's
# layout at toy size: a dense first layer, then MoE with one shared expert and 8 routed experts in 4
# groups (a token's 2 experts from its 2 best groups, sigmoid scores, bias-corrected choice), a low-rank
# query (q_lora_rank), YaRN with mscale != mscale_all_dim (both the cos/sin factor and the softmax mscale
# differ from 1), v_head_dim != qk_nope_head_dim.
_TINY_MLA = dict(
    _TINY,
    num_key_value_heads=4,  # = num_attention_heads: every head reads the one latent
    num_hidden_layers=3,
    intermediate_size=128,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    kv_lora_rank=32,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=24,
    num_nextn_predict_layers=0,
)
PRESETS["deepseek-v3-tiny"] = dict(
    config_class="DeepseekV3Config",
    dtype="float32",
    kwargs=dict(
        _TINY_MLA,
        q_lora_rank=48,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=4.0,
            original_max_position_embeddings=128,
            mscale=1.0,
            mscale_all_dim=0.8,
            beta_fast=32,
            beta_slow=1,
        ),
    ),
)
# DeepSeek-V3 with its MTP block (model.layers.{num_hidden_layers}: MLA and a MoE), for speculative decoding
PRESETS["deepseek-v3-mtp-tiny"] = dict(
    PRESETS["deepseek-v3-tiny"], kwargs=dict(PRESETS["deepseek-v3-tiny"]["kwargs"], num_nextn_predict_layers=1)
)
# DeepSeek-V2-Lite's attention (q_proj straight from the hidden state: q_lora_rank None, complex-pair
# RoPE) with the full DeepSeek-V2's routing: softmax scores, group_limited_greedy over 4 groups, 2
# shared experts, routed_scaling_factor != 1.
PRESETS["deepseek-v2-lite-tiny"] = dict(
    config_class="DeepseekV2Config",
    dtype="float32",
    kwargs=dict(
        _TINY_MLA,
        num_hidden_layers=2,
        q_lora_rank=None,
        n_shared_experts=2,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        norm_topk_prob=False,
        routed_scaling_factor=2.0,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=4.0,
            original_max_position_embeddings=128,
            mscale=0.707,
            mscale_all_dim=0.707,
            beta_fast=32,
            beta_slow=1,
        ),
    ),
)

# DeepSeek-V3's widths (671B: 61 layers, the first 3 dense) in three layers, one dense and two MoE
# (256 routed experts of 2,048, 8 per token from 4 of 8 groups, one shared): ~46 GB of bf16 weights,
# for GPU benches with load_format="dummy" (write it with config_only=True). Its latent: 576 values
# per token and layer.
PRESETS["deepseek-v3-shape"] = dict(
    config_class="DeepseekV3Config",
    dtype="bfloat16",
    kwargs=dict(
        vocab_size=129280,
        hidden_size=7168,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        num_attention_heads=128,
        num_key_value_heads=128,
        kv_lora_rank=512,
        q_lora_rank=1536,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        n_routed_experts=256,
        n_shared_experts=1,
        num_experts_per_tok=8,
        n_group=8,
        topk_group=4,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        max_position_embeddings=163840,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=40.0,
            original_max_position_embeddings=4096,
            mscale=1.0,
            mscale_all_dim=1.0,
            beta_fast=32,
            beta_slow=1,
        ),
        bos_token_id=None,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=None,
    ),
)

# Hybrid sliding-window / full attention (config.SLIDING_ARCHITECTURES, served on one device).
# A window of 8 tokens, so that short prompts cross it; values transformers starts at zero or one (biases,
# attention sinks, Gemma's norm weights) drawn at random ("random_init": name suffix -> std), as trained
# ones are, so that a model ignoring them shows; gpt-oss's expert inputs wide enough that its SwiGLU clamp
# (7) bites; soft-caps small enough to bend these scores and logits.
_TINY_SLIDING = dict(_TINY, num_hidden_layers=3, head_dim=16, sliding_window=8)
PRESETS["gpt-oss-tiny"] = dict(
    config_class="GptOssConfig",
    dtype="float32",
    random_init={".bias": 0.15, "_bias": 0.15, ".sinks": 0.5, "experts.gate_up_proj": 1.0},
    kwargs=dict(
        _TINY_SLIDING,  # layers: sliding, full, sliding
        intermediate_size=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=150000.0,
            factor=32.0,
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
            original_max_position_embeddings=16,  # x factor 32 = max_position_embeddings
        ),
    ),
)
PRESETS["gemma2-tiny"] = dict(
    config_class="Gemma2Config",
    dtype="float32",
    random_init={"norm.weight": 0.15},
    kwargs=dict(
        _TINY_SLIDING,  # layers: sliding, full, sliding
        intermediate_size=128,
        query_pre_attn_scalar=24,  # not head_dim: the softmax scale is 24 ** -0.5
        attn_logit_softcapping=1.5,
        final_logit_softcapping=2.0,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0),
    ),
)
PRESETS["gemma3-tiny"] = dict(
    config_class="Gemma3TextConfig",
    architecture="Gemma3ForCausalLM",
    dtype="float32",
    random_init={"norm.weight": 0.15},
    kwargs=dict(
        _TINY_SLIDING,
        num_hidden_layers=4,
        sliding_window_pattern=3,  # layers: sliding, sliding, full, sliding
        intermediate_size=128,
        query_pre_attn_scalar=24,
        rope_parameters=dict(
            full_attention=dict(rope_type="linear", rope_theta=1e6, factor=4.0),
            sliding_attention=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
)


# gpt-oss-20b's widths (24 layers alternating sliding (window 128) and full, 64 query and 8 KV heads
# of 64, 32 experts of 2,880 with 4 per token, YaRN x32; ~42 GB of bf16 weights, experts unquantized)
# and Gemma-3-12B's (48 layers, 5 sliding (window 1,024) : 1 full, 16 query and 8 KV heads of 256,
# MLP 15,360, local RoPE base 10,000, global 1e6 linear x8; ~24 GB), for GPU benches with
# load_format="dummy" (write them with config_only=True).
PRESETS["gpt-oss-20b-shape"] = dict(
    config_class="GptOssConfig",
    dtype="bfloat16",
    kwargs=dict(
        vocab_size=201088,
        hidden_size=2880,
        num_hidden_layers=24,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        intermediate_size=2880,
        num_local_experts=32,
        num_experts_per_tok=4,
        sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 12,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=150000.0,
            factor=32.0,
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
            original_max_position_embeddings=4096,
        ),
        bos_token_id=None,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=None,
    ),
)
PRESETS["gemma3-12b-shape"] = dict(
    config_class="Gemma3TextConfig",
    architecture="Gemma3ForCausalLM",
    dtype="bfloat16",
    kwargs=dict(
        vocab_size=262208,
        hidden_size=3840,
        num_hidden_layers=48,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=256,
        intermediate_size=15360,
        query_pre_attn_scalar=256,
        sliding_window=1024,
        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 8,
        max_position_embeddings=131072,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        rope_parameters=dict(
            full_attention=dict(rope_type="linear", rope_theta=1e6, factor=8.0),
            sliding_attention=dict(rope_type="default", rope_theta=10000.0),
        ),
        bos_token_id=None,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=None,
    ),
)
# LLaVA: a 3-layer CLIP tower on 32x32 images (16 patches of 8x8: 16 image tokens with the
# "default" strategy) in front of llama-tiny's text model; its image processor and <image> token
PRESETS["llava-tiny"] = dict(
    config_class="LlavaConfig",
    architecture="LlavaForConditionalGeneration",
    dtype="float32",
    kwargs=dict(
        text_config=dict(_TINY, model_type="llama", num_hidden_layers=2, intermediate_size=128),
        vision_config=dict(
            model_type="clip_vision_model",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            image_size=32,
            patch_size=8,
            projection_dim=32,
            initializer_range=0.15,
        ),
        image_token_index=IMAGE_TOKEN_ID,
        image_seq_length=16,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    ),
    image_processor=dict(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}),
)


# LLaVA-1.5-7B's shape (CLIP ViT-L/14 at 336 px: 576 image tokens; Llama-2-7B) for GPU benches with
# --config-only and --load-format dummy (the byte tokenizer's <image> as its image token)
_LLAMA2_7B = dict(vocab_size=32064, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32)
_CLIP_L_336 = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16, patch_size=14)
PRESETS["llava-1.5-7b-shape"] = dict(
    PRESETS["llava-tiny"],
    dtype="bfloat16",
    kwargs=dict(
        PRESETS["llava-tiny"]["kwargs"],
        text_config=dict(
            _LLAMA2_7B, model_type="llama", max_position_embeddings=4096, rms_norm_eps=1e-5, eos_token_id=EOS_TOKEN_ID
        ),
        vision_config=dict(_CLIP_L_336, model_type="clip_vision_model", image_size=336, projection_dim=768),
        image_seq_length=576,
    ),
    image_processor=dict(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336}),
)


def preset_architecture(preset: str) -> str:
    """The ``architectures`` entry of ``preset``'s config.json (e.g. "DeepseekV3ForCausalLM")."""
    spec = PRESETS[preset]
    return spec.get("architecture") or spec["config_class"].replace("Config", "ForCausalLM")


def init_model(
    preset: str, out_dir: str | Path, seed: int = 0, dtype: torch.dtype | str | None = None, config_only: bool = False
) -> Path:
    """Write a random checkpoint of ``preset`` (config, safetensors, generation config, tokenizer).

    ``config_only``: everything but the safetensors, without building the model (for
    ``load_format="dummy"``); ``seed`` then has no effect."""
    import transformers  # only needed to write checkpoints, never to load them

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    spec = PRESETS[preset]
    dtype = dtype or spec["dtype"]
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    config = getattr(transformers, spec["config_class"])(**spec["kwargs"])
    generation_config = transformers.GenerationConfig(eos_token_id=EOS_TOKEN_ID, pad_token_id=EOS_TOKEN_ID, bos_token_id=None)
    out_dir = Path(out_dir)
    if config_only:
        config.architectures = [preset_architecture(preset)]
        config.dtype = dtype
        config.save_pretrained(out_dir)
        generation_config.save_pretrained(out_dir)
    else:
        torch.manual_seed(seed)
        auto = transformers.AutoModelForImageTextToText if "image_processor" in spec else transformers.AutoModelForCausalLM
        model = auto.from_config(config, dtype=dtype)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                # DeepSeek-V3: transformers starts it at zero, a trained one is not; random values
                # make the bias steer expert choice in tests, as it does in real checkpoints
                buffer.normal_(0.0, config.initializer_range)
        with torch.no_grad():
            for name, param in model.named_parameters():
                for suffix, std in spec.get("random_init", {}).items():
                    if name.endswith(suffix):
                        param.normal_(0.0, std)
        model.generation_config = generation_config
        model.save_pretrained(out_dir, safe_serialization=True)
        if getattr(config, "num_nextn_predict_layers", 0):
            _add_mtp_weights(config, model, out_dir, dtype, seed)
    text = config.get_text_config()
    save_byte_tokenizer(out_dir, model_max_length=text.max_position_embeddings, image_token="image_processor" in spec)
    if "image_processor" in spec:
        _save_image_processor(spec, config, out_dir)
    return out_dir


def _save_image_processor(spec: dict[str, Any], config: Any, out_dir: Path) -> None:
    """A vision preset's ``preprocessor_config.json`` and its LLaVA processor (transformers'
    ``AutoProcessor`` then expands ``<image>`` as kvtier does)."""
    import transformers

    images = transformers.CLIPImageProcessor(**spec["image_processor"])
    tokenizer = transformers.AutoTokenizer.from_pretrained(out_dir)
    vision = config.vision_config
    processor = transformers.LlavaProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=vision.patch_size,
        vision_feature_select_strategy=config.vision_feature_select_strategy,
        image_token=IMAGE_TOKEN,
        num_additional_image_tokens=1,
    )
    processor.save_pretrained(out_dir)


def _add_mtp_weights(config: Any, model: Any, out_dir: Path, dtype: torch.dtype, seed: int) -> None:
    """Random MTP blocks in DeepSeek-V3's layout, added to ``model.safetensors``: for block i,
    ``model.layers.{L+i}.`` + a decoder layer's tensors (a fresh one-layer model of the same
    config, initialized as transformers does), ``enorm``, ``hnorm``, ``shared_head.norm`` (ones),
    ``eh_proj`` [hidden, 2 hidden] ~ N(0, initializer_range), and copies of the embedding and
    head the block shares with the target (``embed_tokens``, ``shared_head.head``)."""
    import copy

    import transformers
    from safetensors.torch import load_file, save_file

    path = out_dir / "model.safetensors"
    tensors = load_file(str(path))
    one = copy.deepcopy(config)
    one.num_hidden_layers = 1
    if hasattr(one, "first_k_dense_replace"):
        one.first_k_dense_replace = 0  # DeepSeek-V3's MTP block is a MoE layer
    h, L = config.hidden_size, config.num_hidden_layers
    std = getattr(config, "initializer_range", 0.02)
    embed = model.get_input_embeddings().weight.detach()
    head = model.get_output_embeddings().weight.detach()
    for i in range(config.num_nextn_predict_layers):
        torch.manual_seed(seed + 1 + i)
        block = transformers.AutoModelForCausalLM.from_config(one, dtype=dtype)
        for name, buffer in block.named_buffers():
            if name.endswith("e_score_correction_bias"):  # as init_model draws the decoder's
                buffer.normal_(0.0, std)
        prefix = f"model.layers.{L + i}."
        for name, t in block.state_dict().items():
            if name.startswith("model.layers.0."):
                tensors[prefix + name.removeprefix("model.layers.0.")] = t.contiguous()
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            tensors[f"{prefix}{norm}.weight"] = torch.ones(h, dtype=dtype)
        tensors[f"{prefix}eh_proj.weight"] = (torch.randn(h, 2 * h) * std).to(dtype)
        tensors[f"{prefix}embed_tokens.weight"] = embed.clone().contiguous()
        tensors[f"{prefix}shared_head.head.weight"] = head.clone().contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})
