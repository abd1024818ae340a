"""kv_cache_dtype="fp8": kvtier's greedy tokens (and logprobs) == transformers' with its attention
hooked so K (after RoPE) and V go through fp8 and back with the same scales (fp8_reference.py),
cold and through device, host and storage hits; the scales are the checkpoint's or calibrated,
and part of the model's namespace. fp32 compute on CPU."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import kvtier
from kvtier.engine.sizing import block_nbytes
from kvtier.model import ModelConfig
from tests.engine.fp8_reference import hf_fp8_model, hf_greedy, hf_logprobs
from tests.engine.hf_reference import FAMILIES, GREEDY, MAX_TOKENS, prompts_for

PRESET = "llama-tiny"


@pytest.fixture(scope="module")
def fp8_reference():
    """fp8_reference(path, scales, prompts) -> transformers' greedy tokens with fp8 K/V (cached)."""
    memo: dict = {}

    def get(path, scales, prompts):
        key = (str(path), tuple(tuple(s.flatten().tolist()) for s in scales), tuple(map(tuple, prompts)))
        if key not in memo:
            memo[key] = hf_greedy(hf_fp8_model(path, scales), prompts, MAX_TOKENS)
        return memo[key]

    return get


@pytest.fixture(scope="module")
def scaled_checkpoint(checkpoint, tmp_path_factory):
    """llama-tiny with k_scale/v_scale tensors in its safetensors, one per KV head, as a vLLM /
    compressed-tensors fp8 checkpoint carries them."""
    src = checkpoint(PRESET)
    dst = tmp_path_factory.mktemp("scaled")
    for f in src.iterdir():
        if f.is_file():
            shutil.copy(f, dst / f.name)
    cfg = ModelConfig.from_hf_dir(src)
    tensors = load_file(str(dst / "model.safetensors"))
    for layer in range(cfg.num_layers):
        heads = torch.arange(cfg.num_kv_heads, dtype=torch.float32)
        tensors[f"model.layers.{layer}.self_attn.k_scale"] = 0.003 * (1.7 + heads) * (layer + 1)
        tensors[f"model.layers.{layer}.self_attn.v_scale"] = 0.0011 * (3.1 - heads)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_cold_and_device_hit_match_transformers_with_fp8_kv(checkpoint, fp8_reference):
    path = checkpoint(PRESET)
    prompts = prompts_for(1)
    with kvtier.LLM(path, kv_cache_dtype="fp8", num_device_blocks=64, block_size=8) as llm:
        assert all(kv.dtype == torch.float8_e4m3fn for kv in llm.kv_caches)
        assert llm.startup.kv_cache is not None and llm.startup.kv_cache["scales"] == "calibrated"
        scales = llm.kv_scales
        want = fp8_reference(path, scales, prompts)
        cold = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in cold] == want
        warm = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in warm] == want
        assert [o.num_cached_tokens for o in warm] == [(len(p) - 1) // 8 * 8 for p in prompts]


@pytest.mark.parametrize("preset", [f for f in FAMILIES if f != PRESET])
def test_every_served_family_matches_transformers_with_fp8_kv(preset, checkpoint, fp8_reference):
    """Mistral, Qwen2/3 (q/k norms), Mixtral and the Qwen MoEs: the same tokens as transformers
    with fp8 K/V, and not those of fp32 K/V (fp8 is visible in these tokens)."""
    path = checkpoint(preset)
    prompts = prompts_for(2, lengths=(17, 40))
    with kvtier.LLM(path, kv_cache_dtype="fp8", num_device_blocks=64, block_size=8) as llm:
        got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        want = fp8_reference(path, llm.kv_scales, prompts)
    assert got == want
    assert want != hf_greedy(hf_fp8_model(path, None), prompts, MAX_TOKENS)


def test_logprobs_match_fp8_transformers_and_not_fp32_kv(checkpoint):
    """The engine's logprobs equal the fp8 reference's to fp32 rounding, while the reference with
    fp32 K/V is visibly further: the test sees it if quantization or dequantization were skipped."""
    path = checkpoint(PRESET)
    prompts = prompts_for(3, lengths=(17, 40))
    params = kvtier.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    with kvtier.LLM(path, kv_cache_dtype="fp8", num_device_blocks=64, block_size=8) as llm:
        outs, scales = llm.generate(prompts, params), llm.kv_scales
    fp8, fp32 = hf_fp8_model(path, scales), hf_fp8_model(path, None)
    for prompt, out in zip(prompts, outs):
        ours = [d[t] for d, t in zip(out.outputs[0].logprobs, out.token_ids)]
        want = hf_logprobs(fp8, prompt, out.token_ids)
        unquantized = hf_logprobs(fp32, prompt, out.token_ids)
        assert max(abs(a - b) for a, b in zip(ours, want)) < 1e-4
        assert max(abs(a - b) for a, b in zip(ours, unquantized)) > 1e-2


def test_checkpoint_scales_are_used_as_they_are(scaled_checkpoint, caplog):
    cfg = ModelConfig.from_hf_dir(scaled_checkpoint)
    prompts = prompts_for(7, lengths=(30, 45))
    params = kvtier.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    with caplog.at_level(logging.INFO, logger="kvtier.engine.build"):
        llm = kvtier.LLM(scaled_checkpoint, kv_cache_dtype="fp8", num_device_blocks=64, block_size=8)
    assert "KV cache fp8, scales checkpoint" in caplog.text  # (the startup log says which)
    with llm:
        assert llm.startup.kv_cache is not None and llm.startup.kv_cache["scales"] == "checkpoint"
        scales = llm.kv_scales
        outs = llm.generate(prompts, params)
    heads = torch.arange(cfg.num_kv_heads, dtype=torch.float32)
    assert torch.equal(scales[1][0], 0.003 * (1.7 + heads) * 2) and torch.equal(scales[1][1], 0.0011 * (3.1 - heads))
    fp8 = hf_fp8_model(scaled_checkpoint, scales)
    assert [o.token_ids for o in outs] == hf_greedy(fp8, prompts, MAX_TOKENS)
    for prompt, out in zip(prompts, outs):
        ours = [d[t] for d, t in zip(out.outputs[0].logprobs, out.token_ids)]
        assert max(abs(a - b) for a, b in zip(ours, hf_logprobs(fp8, prompt, out.token_ids))) < 1e-4


def test_host_hit_returns_identical_tokens_with_fp8_kv(checkpoint, fp8_reference):
    path = checkpoint(PRESET)
    a, b = prompts_for(4, lengths=(60, 60))
    with kvtier.LLM(
        path, kv_cache_dtype="fp8", num_device_blocks=12, block_size=8, num_host_blocks=64, write_policy="write_through"
    ) as llm:
        assert llm.host_kv is not None and llm.host_kv.dtype == torch.float8_e4m3fn
        want = fp8_reference(path, llm.kv_scales, [a])[0]
        assert llm.generate([a], GREEDY)[0].token_ids == want
        llm.generate([b], GREEDY)  # pushes a's blocks out of the device tier
        again = llm.generate([a], GREEDY)[0]
        assert again.cached_tokens_by_tier["host"] > 0
        assert again.token_ids == want


def test_storage_hit_returns_identical_tokens_with_fp8_kv(checkpoint, fp8_reference, tmp_path):
    path = checkpoint(PRESET)
    a, b, c = prompts_for(5, lengths=(60, 60, 60))
    pool = f"file://{tmp_path}/pool"
    kw = dict(kv_cache_dtype="fp8", num_device_blocks=10, block_size=8, num_host_blocks=8, storage=pool)
    with kvtier.LLM(path, write_policy="write_through", **kw) as llm:
        want = fp8_reference(path, llm.kv_scales, [a])[0]
        assert llm.generate([a], GREEDY)[0].token_ids == want
        llm.generate([b], GREEDY)
        llm.generate([c], GREEDY)  # a is now only in storage
        again = llm.generate([a], GREEDY)[0]
        assert again.cached_tokens_by_tier["storage"] > 0
        assert again.token_ids == want
    # a second engine on the checkpoint calibrates the same scales: it reads what the first wrote
    with kvtier.LLM(path, **kw) as llm:
        fresh = llm.generate([a], GREEDY)[0]
        assert fresh.cached_tokens_by_tier["storage"] > 0
        assert fresh.token_ids == want


def test_fp8_blocks_never_answer_another_cache_dtype_or_other_scales(checkpoint, tmp_path, monkeypatch):
    """Engines of one checkpoint on one pool: the model's dtype (auto), fp8 with calibrated
    scales, fp8 with other scales, fp8_e5m2 each have a namespace of their own; the same fp8
    engine again shares the first one's blocks."""
    import kvtier.engine.build

    path = checkpoint(PRESET)
    a = prompts_for(8, lengths=(60,))[0]
    pool = f"file://{tmp_path}/pool"
    kw = dict(num_device_blocks=16, block_size=8, num_host_blocks=16, storage=pool, write_policy="write_through")
    with kvtier.LLM(path, kv_cache_dtype="fp8", **kw) as llm:
        llm.generate([a], GREEDY)
    for kv_cache_dtype in ("auto", "fp8_e5m2"):
        with kvtier.LLM(path, kv_cache_dtype=kv_cache_dtype, **kw) as llm:
            assert llm.generate([a], GREEDY)[0].cached_tokens_by_tier["storage"] == 0, kv_cache_dtype
    with monkeypatch.context() as m:  # the same weights, each scale doubled
        calibrated = kvtier.engine.build.kv_scales_for
        m.setattr(kvtier.engine.build, "kv_scales_for", lambda *args: ([2 * s for s in calibrated(*args)[0]], "calibrated"))
        with kvtier.LLM(path, kv_cache_dtype="fp8", **kw) as llm:
            assert llm.generate([a], GREEDY)[0].cached_tokens_by_tier["storage"] == 0
    with kvtier.LLM(path, kv_cache_dtype="fp8", **kw) as llm:
        assert llm.generate([a], GREEDY)[0].cached_tokens_by_tier["storage"] > 0


def test_fingerprint_carries_the_cache_dtype_and_scales(checkpoint):
    path = checkpoint(PRESET)
    with kvtier.LLM(path, num_device_blocks=16) as llm:
        plain = llm.cache.fingerprint
    with kvtier.LLM(path, kv_cache_dtype="fp8", num_device_blocks=16) as llm:
        fp8 = llm.cache.fingerprint
    assert plain.kv_cache == ""
    assert plain is not None and fp8 is not None
    assert fp8.kv_cache.startswith("float8_e4m3fn:") and fp8.encode() != plain.encode()


def test_fp8_blocks_take_half_the_bytes_of_bf16(checkpoint):
    cfg = ModelConfig.from_hf_dir(checkpoint(PRESET))
    assert 2 * block_nbytes(cfg, 16, torch.float8_e4m3fn) == block_nbytes(cfg, 16, torch.bfloat16)
    with kvtier.LLM(checkpoint(PRESET), kv_cache_dtype="fp8", num_device_blocks=16, num_host_blocks=8, block_size=8) as llm:
        assert llm.host_kv is not None
        assert llm.host_kv.nbytes == 8 * block_nbytes(cfg, 8, torch.float8_e4m3fn)
        assert sum(kv.nbytes for kv in llm.kv_caches) == 17 * block_nbytes(cfg, 8, torch.float8_e4m3fn)


def test_a_bad_kv_cache_dtype_is_refused_by_name(checkpoint):
    with pytest.raises(ValueError, match="unknown kv_cache_dtype 'int8'"):
        kvtier.LLM(checkpoint(PRESET), kv_cache_dtype="int8")


@pytest.mark.parametrize("preset", [PRESET, "deepseek-v3-tiny"])
def test_two_ranks_with_fp8_kv_match_transformers_and_one_rank(preset, checkpoint, fp8_reference):
    """Tensor parallelism on CPU (gloo): each rank calibrates its KV heads (a latent: the whole
    latent) in one forward of all ranks; the gathered scales, the tokens and the logprobs are
    those of one rank, through a device hit."""
    path = checkpoint(preset)
    prompts = prompts_for(10, lengths=(23, 50))
    params = kvtier.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    runs = {}
    for tp in (1, 2):
        with kvtier.LLM(path, kv_cache_dtype="fp8", tensor_parallel_size=tp, num_device_blocks=32, block_size=8) as llm:
            cold, warm = llm.generate(prompts, params), llm.generate(prompts, params)
            assert all(o.cached_tokens_by_tier["device"] > 0 for o in warm)
            runs[tp] = (llm.kv_scales, cold, warm, llm.cache.fingerprint)
    (one_scales, one, _, one_fp), (two_scales, cold, warm, two_fp) = runs[1], runs[2]
    assert [s.tolist() for s in two_scales] == [s.tolist() for s in one_scales]
    assert two_fp == one_fp  # (the same scales: one namespace)
    want = fp8_reference(path, two_scales, prompts)
    assert [o.token_ids for o in cold] == [o.token_ids for o in warm] == [o.token_ids for o in one] == want
    for a, b in zip(one, cold):
        ours = [d[t] for d, t in zip(b.outputs[0].logprobs, b.token_ids)]
        theirs = [d[t] for d, t in zip(a.outputs[0].logprobs, a.token_ids)]
        assert max(abs(x - y) for x, y in zip(ours, theirs)) < 2e-5  # partial sums add in another order


@pytest.mark.parametrize("preset", ["deepseek-v3-tiny"])
def test_latent_cache_in_fp8_matches_transformers_cold_and_through_host_and_storage(preset, checkpoint, fp8_reference, tmp_path):
    """Latent attention: the latent is quantized as one vector with one scale per layer."""
    path = checkpoint(preset)
    cfg = ModelConfig.from_hf_dir(path)
    a, b, c = prompts_for(6, lengths=(60, 60, 60))
    kw = dict(kv_cache_dtype="fp8", block_size=8, write_policy="write_through")
    with kvtier.LLM(path, num_device_blocks=12, num_host_blocks=64, **kw) as llm:
        assert all(tuple(s.shape) == (1,) for s in llm.kv_scales) and len(llm.kv_scales) == cfg.num_layers
        assert llm.kv_caches[0].dtype == torch.float8_e4m3fn
        want = fp8_reference(path, llm.kv_scales, [a])[0]
        assert llm.generate([a], GREEDY)[0].token_ids == want
        assert llm.generate([a], GREEDY)[0].token_ids == want  # a device hit
        llm.generate([b], GREEDY)  # pushes a's blocks out of the device tier
        host = llm.generate([a], GREEDY)[0]
        assert host.cached_tokens_by_tier["host"] > 0 and host.token_ids == want
    with kvtier.LLM(path, num_device_blocks=10, num_host_blocks=8, storage=f"file://{tmp_path}/pool", **kw) as llm:
        assert llm.generate([a], GREEDY)[0].token_ids == want
        llm.generate([b], GREEDY)
        llm.generate([c], GREEDY)  # a is now only in storage
        again = llm.generate([a], GREEDY)[0]
        assert again.cached_tokens_by_tier["storage"] > 0 and again.token_ids == want
    assert want != hf_greedy(hf_fp8_model(path, None), [a], MAX_TOKENS)[0]  # (fp8 is visible in these tokens)


def _run(core, **add):
    req = core.add_request(**add)
    for _ in range(10_000):
        for out in core.step():
            if out.request_id == req.request_id:
                core.cache.assert_invariants()
                return out
    raise AssertionError("request never finished")


@pytest.mark.parametrize("n_prompt", [37, 40])  # a partial last block, and none
def test_pd_handoff_with_fp8_kv_matches_transformers(checkpoint, fp8_reference, tmp_path, n_prompt):
    """P exports a prompt's fp8 blocks (the partial last one too) to the pool, D loads all of them
    and continues: transformers' tokens with fp8 K/V."""
    from kvtier.engine.config import EngineConfig
    from kvtier.engine.core import EngineCore

    path = checkpoint(PRESET)
    prompt = prompts_for(9, lengths=(n_prompt,))[0]
    config = EngineConfig(kv_cache_dtype="fp8", num_host_blocks=64, block_size=8)
    url = f"file://{tmp_path}"
    with EngineCore(path, config, storage=url) as p, EngineCore(path, config, storage=url) as d:
        want = fp8_reference(path, p.kv_scales, [prompt])[0]
        first = _run(p, prompt=prompt, params=kvtier.SamplingParams(max_tokens=1), export=True)
        assert first.handoff["complete"] and first.token_ids == want[:1]
        out = _run(d, prompt=prompt, params=GREEDY, handoff=first.handoff)
        assert out.cached_tokens_by_tier == {"device": 0, "host": 0, "storage": n_prompt}
        assert out.token_ids == want


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (one H200 runs it: pytest tests/engine/test_fp8_kv.py)"
)
def test_cuda_fp8_cache_through_device_host_and_storage_hits_matches_transformers(checkpoint, fp8_reference, tmp_path):
    """On a GPU (fp32 compute, the Triton kernel dequantizing in-kernel, CUDA graphs, the copy
    kernels moving fp8 bytes): cold, a device hit, a host hit and a storage hit all give
    transformers' tokens with fp8 K/V."""
    path = checkpoint(PRESET)
    a, b, c = prompts_for(6, lengths=(60, 60, 60))
    kw = dict(device="cuda", dtype="float32", kv_cache_dtype="fp8", block_size=8, write_policy="write_through")
    with kvtier.LLM(path, num_device_blocks=10, num_host_blocks=64, **kw) as llm:
        want = fp8_reference(path, [s.cpu() for s in llm.kv_scales], [a])[0]
        assert llm.generate([a], GREEDY)[0].token_ids == want
        device_hit = llm.generate([a], GREEDY)[0]
        assert device_hit.cached_tokens_by_tier["device"] > 0 and device_hit.token_ids == want
        llm.generate([b], GREEDY)  # a leaves the device tier; the host tier holds both
        host_hit = llm.generate([a], GREEDY)[0]
        assert host_hit.cached_tokens_by_tier["host"] > 0 and host_hit.token_ids == want
    with kvtier.LLM(path, num_device_blocks=10, num_host_blocks=8, storage=f"file://{tmp_path}/pool", **kw) as llm:
        llm.generate([a], GREEDY)
        llm.generate([b], GREEDY)
        llm.generate([c], GREEDY)  # a is now only in storage
        again = llm.generate([a], GREEDY)[0]
        assert again.cached_tokens_by_tier["storage"] > 0 and again.token_ids == want


def test_two_ranks_take_their_kv_heads_of_the_checkpoint_scales(scaled_checkpoint):
    prompts = prompts_for(11, lengths=(30,))
    with kvtier.LLM(scaled_checkpoint, kv_cache_dtype="fp8", tensor_parallel_size=2, num_device_blocks=32, block_size=8) as llm:
        assert llm.startup.kv_cache is not None and llm.startup.kv_cache["scales"] == "checkpoint"
        got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        scales = llm.kv_scales
    assert got == hf_greedy(hf_fp8_model(scaled_checkpoint, scales), prompts, MAX_TOKENS)


def test_speculative_decoding_on_an_fp8_cache_gives_the_tokens_without_it(checkpoint):
    """The MTP block's KV layer (which the calibration forward does not write) takes the largest
    of the decoder's scales; verified drafts leave greedy tokens as they are."""
    path = checkpoint("qwen3-mtp-tiny")
    prompts = prompts_for(12, lengths=(17, 40))
    with kvtier.LLM(path, kv_cache_dtype="fp8", num_device_blocks=64, block_size=8) as llm:
        plain = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    with kvtier.LLM(path, kv_cache_dtype="fp8", num_device_blocks=64, block_size=8, num_speculative_tokens=2) as llm:
        cfg = ModelConfig.from_hf_dir(path)
        assert len(llm.kv_scales) == cfg.num_layers + 1
        assert torch.equal(llm.kv_scales[-1], torch.stack(llm.kv_scales[:-1]).amax(dim=0))
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == plain
