"""Sliding-window and hybrid attention: logits equal transformers' past the window (fp32, CPU).

Reference: transformers' ``GptOssForCausalLM``, ``Gemma2ForCausalLM``, ``Gemma3ForCausalLM``,
``MistralForCausalLM`` and ``Qwen2ForCausalLM`` on the same random checkpoints (the ``gpt-oss-tiny``,
``gemma2-tiny``, ``gemma3-tiny`` presets: a window of 8 tokens; Mistral and Qwen2 written here with
one), logits of the whole sequence in one forward, with its eager attention (transformers 5.17 runs
Gemma 2 on SDPA by default, which drops the soft-capping). kvtier computes the same positions in paged steps
over shuffled block tables of 4-token blocks: the whole prompt, chunks reading earlier blocks,
decode past the window, two sequences in one step. Layer types, RoPE and the attention arithmetic
are also checked against transformers' own config classes, rotary modules and eager attention.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from types import SimpleNamespace
from typing import Any, TypedDict

import pytest
import torch
import transformers
from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function

from kvtier.model import SUPPORTED_ARCHITECTURES, AttentionMetadata, ModelConfig, allocate_kv_caches, load_model
from kvtier.model.attention import reference_attention, write_kv
from kvtier.model.config import FULL_ATTENTION, SLIDING_ARCHITECTURES, SLIDING_ATTENTION, AttentionGroup
from kvtier.model.gemma import GemmaForCausalLM
from kvtier.model.gpt_oss import GptOssExpert, GptOssForCausalLM
from kvtier.model.layers import RotaryEmbedding
from kvtier.model.presets import PRESETS, preset_architecture
from kvtier.model.shard import TPShard
from tests.model.paged_helpers import PagedSequences, hf_logits, random_tokens

ATOL = 1e-4
WINDOW = 8
SLIDING_PRESETS = ["gpt-oss-tiny", "gemma2-tiny", "gemma3-tiny"]
# served families with a window, written from the presets: Mistral slides on every layer, Qwen2 on
# layers >= max_window_layers (layer 0 stays full)
WINDOWED = {
    "mistral-window": ("mistral-tiny", dict(sliding_window=WINDOW)),
    "qwen2-window": ("qwen2-tiny", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
}


@pytest.fixture(scope="module")
def model_path(checkpoint, tmp_path_factory):
    """model_path(name) -> a checkpoint directory: a sliding preset, or a WINDOWED one."""
    written = {}

    def get(name: str):
        if name in SLIDING_PRESETS:
            return checkpoint(name)
        if name not in written:
            preset, extra = WINDOWED[name]
            spec = PRESETS[preset]
            config = getattr(transformers, spec["config_class"])(**{**spec["kwargs"], **extra})
            torch.manual_seed(0)
            hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            written[name] = tmp_path_factory.mktemp(name)
            hf.save_pretrained(written[name])
        return written[name]

    return get


def load(path):
    """kvtier's model of ``path``, through the engine's loader."""
    return load_model(path)


@pytest.fixture(scope="module")
def hf_model():
    """hf_model(path) -> transformers' model in fp32 with eager attention (cached)."""
    loaded = {}

    def get(path):
        if path not in loaded:
            loaded[path] = transformers.AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.float32, attn_implementation="eager"
            ).eval()
        return loaded[path]

    return get


@pytest.fixture(scope="module")
def ours(model_path):
    loaded = {}

    def get(name: str):
        if name not in loaded:
            loaded[name] = load(model_path(name))
        return loaded[name]

    return get


ALL = SLIDING_PRESETS + list(WINDOWED)


@pytest.mark.parametrize("name", ALL)
def test_whole_prompt_past_the_window_matches_transformers(name, model_path, hf_model, ours):
    tokens = random_tokens(30, seed=1)
    expected = hf_logits(hf_model(model_path(name)), tokens)

    got = PagedSequences(ours(name)).step({0: tokens})[0]

    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ALL)
def test_prompt_in_chunks_reads_earlier_blocks_and_matches_transformers(name, model_path, hf_model, ours):
    tokens = random_tokens(30, seed=2)
    expected = hf_logits(hf_model(model_path(name)), tokens)
    seqs = PagedSequences(ours(name), seed=3)

    got = [seqs.step({0: tokens[:11]})[0], seqs.step({0: tokens[11:20]})[0], seqs.step({0: tokens[20:]})[0]]

    torch.testing.assert_close(torch.cat(got), expected, atol=ATOL, rtol=0)
    assert seqs.tables[0] != sorted(seqs.tables[0])


@pytest.mark.parametrize("name", ALL)
def test_decode_token_by_token_past_the_window_matches_transformers(name, model_path, hf_model, ours):
    tokens = random_tokens(26, seed=4)
    expected = hf_logits(hf_model(model_path(name)), tokens)
    seqs = PagedSequences(ours(name), seed=5)

    got = [seqs.step({0: tokens[:5]})[0]]
    for pos in range(5, len(tokens)):  # positions 5..25: the window slides 18 times
        got.append(seqs.step({0: [tokens[pos]]})[0])

    torch.testing.assert_close(torch.cat(got), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ALL)
def test_two_sequences_in_one_varlen_step_match_transformers(name, model_path, hf_model, ours):
    hf = hf_model(model_path(name))
    seqs = {0: random_tokens(23, seed=6), 1: random_tokens(19, seed=7)}
    batch = PagedSequences(ours(name), seed=8)

    first = batch.step({0: seqs[0][:13], 1: seqs[1][:18]})
    second = batch.step({0: seqs[0][13:], 1: seqs[1][18:]})  # a 10-token chunk and a decode row

    for i, tokens in seqs.items():
        torch.testing.assert_close(torch.cat([first[i], second[i]]), hf_logits(hf, tokens), atol=ATOL, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU (one H100 or H200) for the compiled Triton kernel (on CPU: tests/test_triton_attention.py)",
)
@pytest.mark.parametrize("name", ALL)
def test_triton_backend_on_cuda_matches_transformers_past_the_window(name, model_path, hf_model):
    path = model_path(name)
    tokens = random_tokens(30, seed=9)
    expected = hf_logits(hf_model(path), tokens)
    model = load_model(path, device="cuda", attention_backend="triton")
    caches = allocate_kv_caches(model.config, 16, 4, "cuda")
    table = list(reversed(range(8)))
    got = []
    for start, end in [(0, 13), *((p, p + 1) for p in range(13, 30))]:  # a prompt chunk, then decode past the window
        meta = AttentionMetadata.build([end - start], [end], [table], 4, "cuda")
        ids, positions = torch.tensor(tokens[start:end], device="cuda"), torch.arange(start, end, device="cuda")
        got.append(model.compute_logits(model(ids, positions, caches, meta)).cpu())

    torch.testing.assert_close(torch.cat(got), expected, atol=ATOL, rtol=0)


# ------------------------------------------------------------------ each plausible bug shows


def _mutate(model, bug: str) -> None:
    """Break ``model`` the way a plausible wrong implementation would."""
    cfg = model.config
    attns = [layer.self_attn for layer in model.model.layers]
    if bug in ("window one too wide", "window one too narrow"):
        for attn in attns:
            if attn.window is not None:
                attn.window += 1 if bug == "window one too wide" else -1
    elif bug == "window not applied":
        for attn in attns:
            attn.window = None
    elif bug == "sliding mask on full layers":
        for attn in attns:
            attn.window = cfg.sliding_window
    elif bug == "sinks ignored":
        for attn in attns:
            attn.sinks = None
    elif bug == "soft-capping missing":
        for attn in attns:
            attn.softcap = None
    elif bug == "final soft-capping missing":
        model.config = replace(cfg, final_logit_softcapping=None)
    elif bug == "global rope on local layers":
        model.local_rotary = None
    elif bug == "head_dim softmax scale":
        for attn in attns:
            attn.scale = cfg.head_dim**-0.5
    elif bug in ("swiglu clamp missing", "expert biases ignored"):
        for expert in (m for m in model.modules() if isinstance(m, GptOssExpert)):
            if bug == "swiglu clamp missing":
                expert.limit = math.inf
            else:
                expert.gate_up_proj.bias.data.zero_()
                expert.down_proj.bias.data.zero_()
    else:
        raise AssertionError(bug)


BUGS = [
    ("gpt-oss-tiny", "window one too wide"),
    ("gpt-oss-tiny", "window one too narrow"),
    ("gpt-oss-tiny", "sinks ignored"),
    ("gpt-oss-tiny", "sliding mask on full layers"),
    ("gpt-oss-tiny", "swiglu clamp missing"),
    ("gpt-oss-tiny", "expert biases ignored"),
    ("gemma2-tiny", "window one too wide"),
    ("gemma2-tiny", "soft-capping missing"),
    ("gemma2-tiny", "final soft-capping missing"),
    ("gemma2-tiny", "head_dim softmax scale"),
    ("gemma2-tiny", "sliding mask on full layers"),
    ("gemma3-tiny", "window one too narrow"),
    ("gemma3-tiny", "global rope on local layers"),
    ("gemma3-tiny", "sliding mask on full layers"),
    ("mistral-window", "window one too wide"),
    ("mistral-window", "window not applied"),
    ("qwen2-window", "window not applied"),
    ("qwen2-window", "sliding mask on full layers"),
]


@pytest.mark.parametrize("name, bug", BUGS)
def test_each_plausible_bug_makes_the_logits_differ_from_transformers(name, bug, model_path, hf_model):
    """The tests above compare at ATOL; each bug here moves the logits far more on their prompts
    (were it not to, those tests could not catch it)."""
    path = model_path(name)
    tokens = random_tokens(30, seed=1)
    expected = hf_logits(hf_model(path), tokens)
    model = load(path)
    _mutate(model, bug)

    seqs = PagedSequences(model, seed=3)
    got = torch.cat([seqs.step({0: tokens[:11]})[0], seqs.step({0: tokens[11:]})[0]])

    assert (got - expected).abs().max() > 100 * ATOL


# ------------------------------------------------------------------ configs, as transformers reads them

# (architecture, config class, config.json keys): what each family does with sliding_window
DERIVED = [
    ("Gemma2ForCausalLM", "Gemma2Config", dict(num_hidden_layers=5, sliding_window=4096)),
    ("Gemma3ForCausalLM", "Gemma3TextConfig", dict(num_hidden_layers=13, sliding_window=512, sliding_window_pattern=6)),
    ("Gemma3ForCausalLM", "Gemma3TextConfig", dict(num_hidden_layers=7, sliding_window=1024)),
    ("GptOssForCausalLM", "GptOssConfig", dict(num_hidden_layers=6, sliding_window=128, num_local_experts=4)),
    (
        "Qwen2ForCausalLM",
        "Qwen2Config",
        dict(num_hidden_layers=4, use_sliding_window=True, sliding_window=64, max_window_layers=2),
    ),
    ("Qwen2ForCausalLM", "Qwen2Config", dict(num_hidden_layers=4, use_sliding_window=False, sliding_window=64)),
    (
        "Qwen3ForCausalLM",
        "Qwen3Config",
        dict(num_hidden_layers=4, use_sliding_window=True, sliding_window=64, max_window_layers=3),
    ),
    (
        "Qwen2MoeForCausalLM",
        "Qwen2MoeConfig",
        dict(num_hidden_layers=6, use_sliding_window=True, sliding_window=64, max_window_layers=4, moe_intermediate_size=16),
    ),
]


class Sizes(TypedDict):
    """The sizes of a small config (keyword arguments of transformers' config classes)."""

    vocab_size: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int


class LayeredSizes(Sizes):
    num_hidden_layers: int


_SMALL = Sizes(vocab_size=320, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=32)


@pytest.mark.parametrize("arch, config_class, keys", DERIVED)
def test_layer_types_absent_from_a_config_are_derived_as_transformers_derives_them(arch, config_class, keys):
    hf = getattr(transformers, config_class)(**_SMALL, **keys)
    cfg = ModelConfig.from_hf_dict({"architectures": [arch], "num_experts_per_tok": 1, **_SMALL, **keys})

    assert cfg.layer_types == tuple(hf.layer_types)
    assert cfg.sliding_window == (hf.sliding_window if SLIDING_ATTENTION in hf.layer_types else None)


@pytest.mark.parametrize("arch", ["MistralForCausalLM", "MixtralForCausalLM"])
def test_mistral_and_mixtral_slide_on_every_layer_when_the_window_is_set(arch):
    # transformers' MistralModel / MixtralModel pick the sliding mask for every layer iff sliding_window is set
    keys = dict(_SMALL, architectures=[arch], num_hidden_layers=3, num_local_experts=4, num_experts_per_tok=2)
    assert ModelConfig.from_hf_dict({**keys, "sliding_window": 4096}).layer_types == (SLIDING_ATTENTION,) * 3
    assert ModelConfig.from_hf_dict({**keys, "sliding_window": None}).layer_types == (FULL_ATTENTION,) * 3
    assert ModelConfig.from_hf_dict({**keys, "sliding_window": None}).sliding_window is None


# openai/gpt-oss-20b's config.json, the keys kvtier reads (as json.load reads them)
GPT_OSS_20B: dict[str, Any] = {
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "head_dim": 64,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072,
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "vocab_size": 201088,
    "eos_token_id": 200002,
}
# google/gemma-3-1b-it's config.json: the RoPE keys of Gemma 3 checkpoints written before layer_types
GEMMA3_1B: dict[str, Any] = {
    "architectures": ["Gemma3ForCausalLM"],
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 1152,
    "intermediate_size": 6912,
    "max_position_embeddings": 32768,
    "num_attention_heads": 4,
    "num_hidden_layers": 26,
    "num_key_value_heads": 1,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "vocab_size": 262144,
}


def test_published_gpt_oss_config_reads_as_two_attention_groups():
    cfg = ModelConfig.from_hf_dict(GPT_OSS_20B)

    assert cfg.attention_groups == (
        AttentionGroup(SLIDING_ATTENTION, 128, tuple(range(0, 24, 2))),
        AttentionGroup(FULL_ATTENTION, None, tuple(range(1, 24, 2))),
    )
    assert cfg.attention_sinks and cfg.qkv_bias and cfg.o_bias and (cfg.swiglu_alpha, cfg.swiglu_limit) == (1.702, 7.0)
    assert (cfg.num_experts, cfg.top_k, cfg.moe_intermediate_size, cfg.num_moe_layers) == (32, 4, 2880, 24)
    assert cfg.kv_width == 2 * 8 * 64
    hf = transformers.GptOssConfig(**{k: v for k, v in GPT_OSS_20B.items() if k != "architectures"})
    ours, expected = RotaryEmbedding(cfg), transformers.models.gpt_oss.modeling_gpt_oss.GptOssRotaryEmbedding(hf)
    torch.testing.assert_close(ours.inv_freq, expected.inv_freq, atol=0, rtol=0)
    assert ours.attention_factor == pytest.approx(expected.attention_scaling)


@pytest.mark.parametrize("rope_scaling", [None, {"rope_type": "linear", "factor": 8.0}])
def test_gemma3_sliding_layers_take_the_local_rope_base_as_transformers_does(rope_scaling):
    keys = {**GEMMA3_1B, "rope_scaling": rope_scaling}  # linear scaling: Gemma 3 4B and up (global layers)
    cfg = ModelConfig.from_hf_dict(keys)
    hf = transformers.Gemma3TextConfig(**{k: v for k, v in keys.items() if k != "architectures"})
    expected = transformers.models.gemma3.modeling_gemma3.Gemma3RotaryEmbedding(hf)

    assert hf.layer_types is not None
    assert cfg.layer_types == tuple(hf.layer_types) and cfg.layer_types.count(FULL_ATTENTION) == 4
    assert cfg.attn_logit_softcapping is None and cfg.final_logit_softcapping is None and cfg.qk_norm
    torch.testing.assert_close(RotaryEmbedding(cfg).inv_freq, expected.full_attention_inv_freq, atol=0, rtol=0)
    local = RotaryEmbedding(cfg.sliding_rope_config()).inv_freq
    torch.testing.assert_close(local, expected.sliding_attention_inv_freq, atol=0, rtol=0)


def test_gemma2_defaults_are_transformers_defaults():
    keys = LayeredSizes(**_SMALL, num_hidden_layers=4)  # a config.json without Gemma 2's own keys
    cfg = ModelConfig.from_hf_dict({"architectures": ["Gemma2ForCausalLM"], **keys})
    hf = transformers.Gemma2Config(**keys)

    assert (cfg.sliding_window, cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (
        hf.sliding_window,
        hf.attn_logit_softcapping,
        hf.final_logit_softcapping,
    )
    assert (cfg.query_pre_attn_scalar, cfg.hidden_act, cfg.tie_word_embeddings) == (
        hf.query_pre_attn_scalar,
        hf.hidden_activation,
        hf.tie_word_embeddings,
    )


def test_sliding_layers_without_a_window_are_refused_naming_it():
    keys = dict(_SMALL, architectures=["Qwen2ForCausalLM"], num_hidden_layers=2)
    with pytest.raises(ValueError, match="sliding_window is None"):
        ModelConfig.from_hf_dict({**keys, "layer_types": [SLIDING_ATTENTION, FULL_ATTENTION], "use_sliding_window": False})
    with pytest.raises(ValueError, match="'chunked_attention'"):
        ModelConfig.from_hf_dict({**keys, "layer_types": ["chunked_attention", FULL_ATTENTION]})


@pytest.mark.parametrize("preset", SLIDING_PRESETS)
def test_engine_loader_loads_hybrid_families_on_one_device_only(preset, checkpoint):
    arch = preset_architecture(preset)
    assert arch in SLIDING_ARCHITECTURES and arch not in SUPPORTED_ARCHITECTURES
    want = GptOssForCausalLM if arch == "GptOssForCausalLM" else GemmaForCausalLM
    assert isinstance(load_model(checkpoint(preset)), want)
    with pytest.raises(ValueError, match=f"tensor_parallel_size=2 is not supported for {arch}"):
        load_model(checkpoint(preset), tp=TPShard(rank=0, size=2))


# ------------------------------------------------------------------ the attention arithmetic


def _paged_case(q_len: int, s_len: int, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 16, seed: int = 0):
    """One sequence of ``s_len`` positions in 4-token blocks (table reversed), its last ``q_len``
    queries, and the dense K/V transformers' attention takes."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = -(-s_len // 4)
    meta = AttentionMetadata.build([q_len], [s_len], [list(reversed(range(num_blocks)))], 4)
    kv = torch.zeros(2, num_blocks, 4, num_kv_heads, head_dim)
    k, v = torch.randn(2, s_len, num_kv_heads, head_dim, generator=gen) * 2
    write_kv(kv, k, v, torch.from_numpy(_all_slots(meta, s_len)))
    q = torch.randn(q_len, num_heads, head_dim, generator=gen) * 2
    return q, kv, meta, k, v


def _all_slots(meta: AttentionMetadata, s_len: int):
    table = meta.block_tables[0].numpy().astype("int64")
    pos = torch.arange(s_len).numpy()
    return table[pos // 4] * 4 + pos % 4


def _hf_mask(q_len: int, s_len: int, window: int | None) -> torch.Tensor:
    """transformers' mask functions as an additive [1, 1, q, s] mask (queries at the last q_len positions)."""
    # (transformers types the indices as ints; given index tensors, they broadcast to a bool tensor)
    allowed: Callable[..., Any] = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    visible: torch.Tensor = allowed(0, 0, torch.arange(s_len - q_len, s_len)[:, None], torch.arange(s_len)[None, :])
    return torch.where(visible, 0.0, torch.finfo(torch.float32).min)[None, None]


@pytest.mark.parametrize("window", [None, 1, 5, 8])
def test_window_and_sinks_equal_gpt_oss_eager_attention(window):
    q, kv, meta, k, v = _paged_case(q_len=7, s_len=21)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(1))
    module = SimpleNamespace(num_key_value_groups=2, sinks=sinks, training=False)
    eager = transformers.models.gpt_oss.modeling_gpt_oss.eager_attention_forward
    scale = 16**-0.5

    expected, _ = eager(
        module,  # type: ignore[arg-type]  # a stand-in for the attention module: the attributes eager attention reads
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        _hf_mask(7, 21, window),
        scale,
    )
    got = reference_attention(q, kv, meta, scale, window=window, sinks=sinks)

    torch.testing.assert_close(got, expected[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("window", [None, 3, 8])
def test_window_and_softcap_equal_gemma2_eager_attention(window):
    q, kv, meta, k, v = _paged_case(q_len=5, s_len=18, seed=2)
    module = SimpleNamespace(num_key_value_groups=2, head_dim=16, training=False)
    eager = transformers.models.gemma2.modeling_gemma2.eager_attention_forward
    scale = 24**-0.5

    expected, _ = eager(
        module,  # type: ignore[arg-type]  # a stand-in for the attention module: the attributes eager attention reads
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        _hf_mask(5, 18, window),
        scaling=scale,
        softcap=1.5,
    )
    got = reference_attention(q, kv, meta, scale, window=window, softcap=1.5)

    torch.testing.assert_close(got, expected[0], atol=1e-5, rtol=0)


def test_keys_below_every_window_are_not_read():
    """The cache may drop the blocks a sliding layer no longer sees: poisoning them changes nothing."""
    q, kv, meta, _, _ = _paged_case(q_len=3, s_len=22)
    clean = reference_attention(q, kv, meta, 0.25, window=6)
    lowest = 22 - 3 - 6 + 1  # the first query (position 19) sees keys 14..19
    slots = torch.from_numpy(_all_slots(meta, lowest))
    kv.view(2, -1, 2, 16)[:, slots] = math.nan

    torch.testing.assert_close(reference_attention(q, kv, meta, 0.25, window=6), clean, atol=0, rtol=0)
    assert reference_attention(q, kv, meta, 0.25).isnan().all()  # (full attention reads them)


@pytest.mark.parametrize(
    "options, match",
    [(dict(window=0), "window must be"), (dict(softcap=-1.0), "softcap must be"), (dict(sinks=torch.zeros(3)), r"\[4\]")],
)
def test_bad_attention_options_are_refused_naming_the_value(options, match):
    q, kv, meta, _, _ = _paged_case(q_len=2, s_len=6)
    with pytest.raises(ValueError, match=match):
        reference_attention(q, kv, meta, 0.25, **options)
