"""DeepSeek-V2/V3 on a paged latent cache: logits equal transformers' (fp32, CPU).

Reference: transformers' ``DeepseekV3ForCausalLM`` / ``DeepseekV2ForCausalLM`` on the same random
checkpoints (``deepseek-v3-tiny``, ``deepseek-v2-lite-tiny``: init_model presets), logits of the
whole sequence in one forward; kvtier computes the same positions in paged steps (prefill, a second
chunk over the first's cached latents, absorbed decode, varlen batches) over shuffled block tables.
Routing, RoPE and the softmax scale are also checked against transformers' own modules, on
DeepSeek's published configs where the size allows.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import transformers

import kvtier.model.mla as mla_module
from kvtier.model import SUPPORTED_ARCHITECTURES, AttentionMetadata, ModelConfig, load_model
from kvtier.model.config import MLA_ARCHITECTURES
from kvtier.model.deepseek import DeepseekDecoderLayer, DeepseekForCausalLM, DeepseekMoE
from kvtier.model.layers import RotaryEmbedding
from kvtier.model.loader import load_mla_model
from kvtier.model.mla import (
    absorb_query,
    allocate_latent_caches,
    mla_attention,
    reference_mla_absorbed,
    reference_mla_decompressed,
    softmax_scale,
)
from kvtier.model.presets import PRESETS, init_model, preset_architecture
from tests.model.paged_helpers import BLOCK_SIZE, PagedSequences, hf_logits, random_tokens

ATOL = 1e-4
MLA_PRESETS = ["deepseek-v3-tiny", "deepseek-v2-lite-tiny"]

# DeepSeek-V3's published config.json (deepseek-ai/DeepSeek-V3), the keys kvtier reads; Kimi K2
# has the same architecture and keys
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc",
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "moe_layer_freq": 1,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "num_nextn_predict_layers": 1,
    "vocab_size": 129280,
    "torch_dtype": "bfloat16",
    "eos_token_id": 1,
}
# DeepSeek-V2-Lite's (deepseek-ai/DeepSeek-V2-Lite): no query compression, greedy softmax routing
DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "n_shared_experts": 2,
    "n_routed_experts": 64,
    "routed_scaling_factor": 1.0,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
    "num_experts_per_tok": 6,
    "moe_layer_freq": 1,
    "first_k_dense_replace": 1,
    "norm_topk_prob": False,
    "scoring_func": "softmax",
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "vocab_size": 102400,
    "torch_dtype": "bfloat16",
    "eos_token_id": 100001,
}


@pytest.fixture(scope="module")
def mla_model():
    """mla_model(path) -> kvtier DeepseekForCausalLM in fp32 on CPU (cached)."""
    loaded: dict = {}

    def get(path):
        if path not in loaded:
            loaded[path] = load_mla_model(path, device="cpu", dtype=torch.float32)
        return loaded[path]

    return get


def first_moe(model: DeepseekForCausalLM) -> tuple[DeepseekMoE, DeepseekDecoderLayer]:
    """(the MoE block, its layer) of the tiny presets' layer 1."""
    layer = model.model.layers[1]
    assert isinstance(layer, DeepseekDecoderLayer) and isinstance(layer.mlp, DeepseekMoE)
    return layer.mlp, layer


def latent_sequences(model: DeepseekForCausalLM, seed: int = 0) -> PagedSequences:
    """paged_helpers' steps and shuffled block tables, over latent caches."""
    seqs = PagedSequences(model, seed=seed)  # type: ignore[arg-type]  # it is called as a CausalLM is
    seqs.kv_caches = allocate_latent_caches(model.config, len(seqs.free_blocks), BLOCK_SIZE)
    return seqs


# ------------------------------------------------------------------ logits against transformers


@pytest.mark.parametrize("preset", MLA_PRESETS)
def test_prefill_logits_match_transformers(preset, checkpoint, hf_model, mla_model):
    path = checkpoint(preset)
    tokens = random_tokens(17, seed=1)
    expected = hf_logits(hf_model(path), tokens)

    got = latent_sequences(mla_model(path)).step({0: tokens})[0]

    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("preset", MLA_PRESETS)
def test_second_chunk_reads_the_first_chunks_latent_blocks(preset, checkpoint, hf_model, mla_model):
    path = checkpoint(preset)
    tokens = random_tokens(18, seed=2)  # 7 (ends inside a block) + 11
    expected = hf_logits(hf_model(path), tokens)
    seqs = latent_sequences(mla_model(path), seed=3)

    got = [seqs.step({0: tokens[:7]})[0], seqs.step({0: tokens[7:]})[0]]

    torch.testing.assert_close(torch.cat(got), expected, atol=ATOL, rtol=0)
    assert len(seqs.tables[0]) == 5 and seqs.tables[0] != sorted(seqs.tables[0])


@pytest.mark.parametrize("preset", MLA_PRESETS)
def test_prefix_hit_reads_another_sequences_latent_blocks(preset, checkpoint, hf_model, mla_model):
    path = checkpoint(preset)
    first = random_tokens(13, seed=4)
    second = first[:8] + random_tokens(6, seed=5)  # shares two full blocks with the first
    seqs = latent_sequences(mla_model(path), seed=6)
    seqs.step({0: first})
    seqs.tables[1], seqs.lengths[1] = seqs.tables[0][:2], 8  # the prefix cache's hit: blocks, not tokens

    got = seqs.step({1: second[8:]})[1]

    torch.testing.assert_close(got, hf_logits(hf_model(path), second)[8:], atol=ATOL, rtol=0)


@pytest.mark.parametrize("preset", MLA_PRESETS)
def test_absorbed_decode_matches_transformers_at_each_position(preset, checkpoint, hf_model, mla_model, monkeypatch):
    path = checkpoint(preset)
    tokens = random_tokens(19, seed=7)  # 9 prefill + 10 decode steps
    expected = hf_logits(hf_model(path), tokens)
    seqs = latent_sequences(mla_model(path), seed=8)
    got = [seqs.step({0: tokens[:9]})[0]]

    def never(*args):
        raise AssertionError("a decode step decompressed the latent cache")

    monkeypatch.setattr(mla_module, "reference_mla_decompressed", never)
    for pos in range(9, len(tokens)):
        got.append(seqs.step({0: [tokens[pos]]})[0])

    torch.testing.assert_close(torch.cat(got), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("preset", MLA_PRESETS)
def test_varlen_batches_match_transformers_per_sequence(preset, checkpoint, hf_model, mla_model):
    path = checkpoint(preset)
    seqs = {0: random_tokens(7, seed=9), 1: random_tokens(19, seed=10)}
    first = {0: 6, 1: 14}  # step 1: two prefills of different lengths; step 2: a decode row and a chunk
    batched = latent_sequences(mla_model(path), seed=11)

    step1 = batched.step({i: s[: first[i]] for i, s in seqs.items()})
    step2 = batched.step({i: s[first[i] :] for i, s in seqs.items()})

    for i, tokens in seqs.items():
        expected = hf_logits(hf_model(path), tokens)
        torch.testing.assert_close(torch.cat([step1[i], step2[i]]), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("preset", MLA_PRESETS)
def test_layer_hook_runs_before_each_layer_writes_its_latents(preset, checkpoint, mla_model):
    model = mla_model(checkpoint(preset))
    seqs = latent_sequences(model)
    calls = []
    seqs.step({0: random_tokens(5, seed=12)}, layer_hook=lambda layer: calls.append([bool(kv.any()) for kv in seqs.kv_caches]))

    n = model.config.num_layers
    assert calls == [[i < layer for i in range(n)] for layer in range(n)]


def test_routing_in_replays_captured_experts_exactly(checkpoint, mla_model):
    model = mla_model(checkpoint("deepseek-v3-tiny"))
    cfg = model.config
    tokens = random_tokens(12, seed=13)
    routing = torch.full((len(tokens), cfg.num_moe_layers, cfg.top_k), -1, dtype=torch.int32)
    captured = latent_sequences(model).step({0: tokens}, routing_out=routing)[0]
    assert (routing >= 0).all() and cfg.num_moe_layers == 2

    replayed = latent_sequences(model, seed=1).step({0: tokens}, routing_in=routing)[0]
    forced = latent_sequences(model, seed=1).step({0: tokens}, routing_in=routing.flip(-1).roll(1, dims=0))[0]

    torch.testing.assert_close(replayed, captured, atol=1e-6, rtol=0)
    assert not torch.allclose(forced, captured, atol=1e-3)


def test_dummy_weights_need_only_config_json(tmp_path):
    path = init_model("deepseek-v3-tiny", tmp_path, config_only=True)
    model = load_mla_model(path, load_format="dummy")

    logits = latent_sequences(model).step({0: random_tokens(9, seed=15)})[0]

    assert not (tmp_path / "model.safetensors").exists() and logits.isfinite().all()


def test_bf16_load_keeps_the_router_in_fp32_and_stays_close(checkpoint, mla_model):
    path = checkpoint("deepseek-v3-tiny")
    model = load_mla_model(path, dtype=torch.bfloat16)
    moe, layer = first_moe(model)
    tokens = random_tokens(11, seed=14)

    got = latent_sequences(model).step({0: tokens})[0]

    assert moe.gate.e_score_correction_bias is not None
    assert moe.gate.weight.dtype == moe.gate.e_score_correction_bias.dtype == torch.float32
    assert layer.self_attn.kv_b_proj.weight.dtype == torch.bfloat16
    expected = latent_sequences(mla_model(path)).step({0: tokens})[0]
    assert (got - expected).abs().mean() < 0.05  # bf16 rounding through three layers: ~0.015


# ------------------------------------------------------------------ the two attention forms


def random_latent_step(seed: int):
    """A varlen step (decode rows and prefill chunks) over random latents and up-projections."""
    g = torch.Generator().manual_seed(seed)
    heads, d_nope, d_rope, d_v, rank, num_blocks = 4, 24, 16, 20, 32, 24
    query_lens, seq_lens = [1, 5, 1, 7], [9, 12, 3, 7]
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables, used = [], 0
    for n in seq_lens:
        count = -(-n // BLOCK_SIZE)
        tables.append(order[used : used + count])
        used += count
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK_SIZE)
    cache = torch.randn(num_blocks, BLOCK_SIZE, rank + d_rope, generator=g)
    query = torch.randn(sum(query_lens), heads, d_nope + d_rope, generator=g)
    w_uk = torch.randn(heads, d_nope, rank, generator=g) / rank**0.5
    w_uv = torch.randn(heads, d_v, rank, generator=g) / rank**0.5
    return query, cache, meta, w_uk, w_uv, (d_nope + d_rope) ** -0.5


def test_absorbed_attention_equals_decompressed_on_random_data():
    query, cache, meta, w_uk, w_uv, scale = random_latent_step(seed=0)
    rank = w_uk.shape[2]

    decompressed = reference_mla_decompressed(query, cache, meta, w_uk, w_uv, scale)
    in_latent = reference_mla_absorbed(absorb_query(query, w_uk), cache, meta, scale, rank)
    absorbed = torch.einsum("thr,hvr->thv", in_latent, w_uv)

    assert decompressed.shape == (sum(meta.query_lens_cpu), 4, 20)
    torch.testing.assert_close(absorbed, decompressed, atol=1e-5, rtol=1e-5)


def test_decompressed_attention_equals_dense_causal_attention_over_rebuilt_keys():
    """One sequence, its latents in order: the paged reference equals softmax(q k^T) v written out."""
    query, cache, _, w_uk, w_uv, scale = random_latent_step(seed=1)
    meta = AttentionMetadata.build([6], [10], [[5, 2, 9]], BLOCK_SIZE)
    q = query[:6]
    latents = cache[[5, 2, 9]].reshape(-1, cache.shape[-1])[:10]
    c_kv, k_pe = latents[:, :32], latents[:, 32:]
    k = torch.cat([torch.einsum("sr,hdr->hsd", c_kv, w_uk), k_pe.expand(4, -1, -1)], dim=-1)
    v = torch.einsum("sr,hvr->hsv", c_kv, w_uv)
    mask = torch.ones(6, 10, dtype=torch.bool).tril(diagonal=4)  # query i is position 4 + i
    expected = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=scale)

    got = reference_mla_decompressed(q, cache, meta, w_uk, w_uv, scale)

    torch.testing.assert_close(got, expected.transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_mixed_step_sends_decode_rows_to_the_absorbed_form(monkeypatch):
    query, cache, meta, w_uk, w_uv, scale = random_latent_step(seed=2)
    expected = reference_mla_decompressed(query, cache, meta, w_uk, w_uv, scale)
    calls = []

    def recording(name):
        form = getattr(mla_module, name)

        def record(query, cache, meta, *args):
            calls.append((name, meta.query_lens_cpu))
            return form(query, cache, meta, *args)

        return record

    for name in ("reference_mla_decompressed", "reference_mla_absorbed"):
        monkeypatch.setattr(mla_module, name, recording(name))

    got = mla_attention(query, cache, meta, w_uk, w_uv, scale)

    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert sorted(calls) == [("reference_mla_absorbed", [1, 1]), ("reference_mla_decompressed", [5, 7])]


# ------------------------------------------------------------------ routing, RoPE, scale, config


def hf_config(preset: str, **overrides):
    spec = PRESETS[preset]
    return getattr(transformers, spec["config_class"])(**{**spec["kwargs"], **overrides})


def hf_modeling(config):
    """transformers' modeling module of ``config``'s model type."""
    return importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")


def kvtier_config(config) -> ModelConfig:
    arch = type(config).__name__.replace("Config", "ForCausalLM")
    return ModelConfig.from_hf_dict({**config.to_dict(), "architectures": [arch]})


@pytest.mark.parametrize(
    "preset, overrides, router_class",
    [
        ("deepseek-v3-tiny", {}, "DeepseekV3TopkRouter"),
        ("deepseek-v2-lite-tiny", {}, "DeepseekV2TopkRouter"),  # group_limited_greedy
        ("deepseek-v2-lite-tiny", {"topk_method": "greedy", "n_group": None, "topk_group": None}, "DeepseekV2TopkRouter"),
    ],
)
def test_routing_equals_transformers_router(preset, overrides, router_class):
    config = hf_config(preset, **overrides)
    reference = getattr(hf_modeling(config), router_class)(config)
    g = torch.Generator().manual_seed(0)
    reference.weight.data = torch.randn(reference.weight.shape, generator=g) * 0.3
    ours = DeepseekMoE(kvtier_config(config), moe_index=0)
    ours.gate.weight.data = reference.weight.data.clone()
    if hasattr(reference, "e_score_correction_bias"):
        reference.e_score_correction_bias.copy_(torch.randn(8, generator=g) * 0.15)
        assert ours.gate.e_score_correction_bias is not None
        ours.gate.e_score_correction_bias.data = reference.e_score_correction_bias.clone()
    x = torch.randn(64, config.hidden_size, generator=g)

    _, ref_weights, ref_ids = reference(x)
    ids, weights = ours.route(x)

    ref_order, order = ref_ids.argsort(-1), ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), ref_ids.gather(1, ref_order))
    torch.testing.assert_close(weights.gather(1, order), ref_weights.gather(1, ref_order), atol=1e-6, rtol=1e-6)


def test_correction_bias_of_the_tiny_preset_steers_expert_choice(checkpoint, mla_model):
    """init_model draws the bias (transformers starts it at 0): the logits tests then see it."""
    moe = first_moe(mla_model(checkpoint("deepseek-v3-tiny")))[0]
    x = torch.randn(200, moe.gate.in_features, generator=torch.Generator().manual_seed(0))
    biased = moe.route(x)[0].sort(-1).values
    bias = moe.gate.e_score_correction_bias
    moe.gate.e_score_correction_bias = None
    try:
        unbiased = moe.route(x)[0].sort(-1).values
    finally:
        moe.gate.e_score_correction_bias = bias

    changed = (biased != unbiased).any(-1).float().mean()
    assert 0.1 < changed < 0.9


@pytest.mark.parametrize("published", [DEEPSEEK_V3, DEEPSEEK_V2_LITE], ids=["DeepSeek-V3", "DeepSeek-V2-Lite"])
def test_softmax_scale_and_rope_equal_transformers_on_published_configs(published):
    arch = published["architectures"][0]
    config_class = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    config = config_class(**{k: v for k, v in published.items() if k not in ("architectures", "torch_dtype")})
    modeling = hf_modeling(config)
    with torch.device("meta"):
        attention = getattr(modeling, arch.replace("ForCausalLM", "Attention"))(config, 0)
    cfg = ModelConfig.from_hf_dict(published)
    positions = torch.tensor([0, 1, 17, 4095, 4096, 100_000, 163_839])

    freqs = getattr(modeling, arch.replace("ForCausalLM", "RotaryEmbedding"))(config)(torch.zeros(1), positions[None])
    cos, sin = RotaryEmbedding(cfg).cos_sin(positions, torch.float32)

    assert softmax_scale(cfg) == pytest.approx(attention.scaling, rel=1e-12)
    assert softmax_scale(cfg) != pytest.approx(cfg.qk_head_dim**-0.5)  # YaRN's mscale is in it
    if isinstance(freqs, tuple):  # V3: (cos, sin) of the frequencies twice
        torch.testing.assert_close(cos[:, 0], freqs[0][0], atol=1e-6, rtol=0)
        torch.testing.assert_close(sin[:, 0], freqs[1][0], atol=1e-6, rtol=0)
    else:  # V2: complex exp(i * freqs) * attention factor
        half = cfg.qk_rope_head_dim // 2
        torch.testing.assert_close(cos[:, 0, :half], freqs[0].real, atol=1e-6, rtol=0)
        torch.testing.assert_close(sin[:, 0, :half], freqs[0].imag, atol=1e-6, rtol=0)


def test_published_deepseek_v3_config_reads_as_a_latent_cache():
    cfg = ModelConfig.from_hf_dict(DEEPSEEK_V3)

    assert (cfg.kv_kind, cfg.kv_width, cfg.num_kv_heads) == ("latent", 576, 1)
    assert (cfg.kv_lora_rank, cfg.q_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (
        512,
        1536,
        128,
        64,
        128,
    )
    assert (cfg.num_experts, cfg.top_k, cfg.n_shared_experts, cfg.moe_intermediate_size) == (256, 8, 1, 2048)
    assert (cfg.scoring_func, cfg.topk_method, cfg.n_group, cfg.topk_group) == ("sigmoid", "noaux_tc", 8, 4)
    assert cfg.norm_topk_prob and cfg.routed_scaling_factor == 2.5 and cfg.rope_interleave
    assert cfg.moe_layer_ids == tuple(range(3, 61)) and cfg.num_mtp_layers == 1
    assert cfg.rope_type == "yarn" and cfg.rope_scaling["factor"] == 40 and cfg.torch_dtype == torch.bfloat16
    assert ModelConfig.from_hf_dict(DEEPSEEK_V2_LITE).q_lora_rank is None
    assert ModelConfig.from_hf_dict(DEEPSEEK_V2_LITE).kv_width == 576


def test_full_attention_configs_keep_their_kv_shape():
    cfg = ModelConfig.from_hf_dict({**DEEPSEEK_V3, "architectures": ["LlamaForCausalLM"], "num_key_value_heads": 8})
    assert (cfg.kv_kind, cfg.kv_width) == ("full", 2 * 8 * 56)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
        ({"n_group": 3}, "n_group=3"),
        ({"architectures": ["DeepseekV2ForCausalLM"], "topk_method": "greedy", "scoring_func": "softmax"}, "norm_topk_prob"),
    ],
)
def test_routing_transformers_does_not_implement_is_refused_naming_the_value(change, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict({**DEEPSEEK_V3, **change})


@pytest.mark.parametrize("preset", MLA_PRESETS)
def test_the_engine_loader_builds_the_latent_model(preset, checkpoint):
    arch = preset_architecture(preset)
    assert arch in MLA_ARCHITECTURES and arch not in SUPPORTED_ARCHITECTURES  # (the GQA families' list)
    assert isinstance(load_model(checkpoint(preset)), DeepseekForCausalLM)
