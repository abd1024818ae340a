"""LLaVA served by kvtier's engine: greedy tokens of kvtier.LLM == transformers' `generate` (its own
processor expanding ``<image>``) on the llava-tiny checkpoint, with one and two images per prompt,
cold and through device, host and storage hits and prefill chunks that cut an image; image blocks
keyed by the image's content (no false hits: another image behind the same text shares nothing
from the image's first block on); the encoder cache runs the tower once per image. fp32 on CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

import kvtier
from tests.engine.hf_reference import GREEDY, MAX_TOKENS

PRESET = "llava-tiny"
BS = 8
TOKENS_PER_IMAGE = 16  # llava-tiny: 32x32 images in 8x8 patches, CLS dropped


def picture(seed: int, size=(40, 52)) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def llava(checkpoint):
    return checkpoint(PRESET)


@pytest.fixture(scope="module")
def hf_llava(llava):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    return AutoProcessor.from_pretrained(llava), LlavaForConditionalGeneration.from_pretrained(llava, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def want(hf_llava):
    """want(text, images) -> transformers' greedy continuation of the prompt with its images."""
    processor, model = hf_llava
    memo: dict = {}

    def get(text: str, images: list[Image.Image]) -> list[int]:
        key = (text, tuple(im.tobytes() for im in images))
        if key not in memo:
            inputs = processor(text=text, images=images or None, return_tensors="pt")
            with torch.no_grad():
                seq = model.generate(
                    **inputs, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0
                )
            memo[key] = seq[0, inputs["input_ids"].shape[1] :].tolist()
        return memo[key]

    return get


ONE = "describe <image> in a few words"
TWO = "first <image> then <image>, which is brighter?"
LONG = "a question asked of a picture: <image>. answer in one line"  # the image at token 31


def test_one_image_cold_then_device_hit_match_transformers(llava, want):
    prompt = {"prompt": ONE, "images": [picture(1)]}
    with kvtier.LLM(llava, num_device_blocks=64, block_size=BS) as llm:
        cold = llm.generate(prompt, GREEDY)[0]
        assert cold.token_ids == want(ONE, [picture(1)])
        assert cold.num_cached_tokens == 0
        warm = llm.generate(prompt, GREEDY)[0]
        assert warm.token_ids == cold.token_ids
        n = len(warm.prompt_token_ids)
        assert n == len("describe ") + TOKENS_PER_IMAGE + len(" in a few words")
        assert warm.num_cached_tokens == warm.cached_tokens_by_tier["device"] == (n - 1) // BS * BS


def test_two_images_in_chunks_that_cut_them_match_transformers(llava, want):
    images = [picture(2), picture(3, size=(64, 30))]
    expected = want(TWO, images)
    assert expected != want(TWO, images[::-1])  # (the images matter to the tokens)
    with kvtier.LLM(llava, num_device_blocks=64, block_size=BS) as llm:
        assert llm.generate({"prompt": TWO, "images": images}, GREEDY)[0].token_ids == expected
    # chunks of 7 tokens: every image is computed in three or four pieces
    with kvtier.LLM(llava, num_device_blocks=64, block_size=BS, max_num_batched_tokens=7) as llm:
        batch = [{"prompt": TWO, "images": images}, {"prompt": ONE, "images": [picture(1)]}]
        out = llm.generate(batch, GREEDY)
        assert [o.token_ids for o in out] == [expected, want(ONE, [picture(1)])]
        assert llm.runner.encoder is not None and llm.runner.encoder.num_images_encoded == 3  # once each


def test_samples_of_an_image_prompt_share_its_image(llava, want):
    prompt = {"prompt": ONE, "images": [picture(1)]}
    with kvtier.LLM(llava, num_device_blocks=64, block_size=BS) as llm:
        out = llm.generate(prompt, kvtier.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, n=2))[0]
        assert [o.token_ids for o in out.outputs] == [want(ONE, [picture(1)])] * 2


def test_token_id_prompts_take_one_placeholder_per_image(llava, want):
    with kvtier.LLM(llava, num_device_blocks=64, block_size=BS) as llm:
        ids = llm.tokenizer.encode(ONE, add_special_tokens=False)
        out = llm.generate({"prompt": ids, "images": [picture(1)]}, GREEDY)[0]
        assert out.token_ids == want(ONE, [picture(1)])


def test_host_hit_returns_identical_tokens(llava, want):
    a = {"prompt": TWO, "images": [picture(4), picture(5)]}
    b = {"prompt": TWO, "images": [picture(6), picture(7)]}
    with kvtier.LLM(llava, num_device_blocks=12, block_size=BS, num_host_blocks=64, write_policy="write_through") as llm:
        assert llm.generate(a, GREEDY)[0].token_ids == want(TWO, a["images"])
        llm.generate(b, GREEDY)  # pushes a's blocks out of the device tier
        again = llm.generate(a, GREEDY)[0]
        assert again.cached_tokens_by_tier["host"] > 0
        assert again.token_ids == want(TWO, a["images"])


def test_storage_hit_returns_identical_tokens_in_a_new_engine(llava, want, tmp_path):
    a = {"prompt": TWO, "images": [picture(8), picture(9)]}
    others = [{"prompt": TWO, "images": [picture(10 + i), picture(20 + i)]} for i in range(2)]
    kw = dict(num_device_blocks=10, block_size=BS, num_host_blocks=8, storage=f"file://{tmp_path}/pool")
    with kvtier.LLM(llava, write_policy="write_through", **kw) as llm:
        assert llm.generate(a, GREEDY)[0].token_ids == want(TWO, a["images"])
        for other in others:
            llm.generate(other, GREEDY)  # a is now only in storage
        again = llm.generate(a, GREEDY)[0]
        assert again.cached_tokens_by_tier["storage"] > 0
        assert again.token_ids == want(TWO, a["images"])
    with kvtier.LLM(llava, **kw) as llm:  # a new engine reads what the first wrote
        fresh = llm.generate(a, GREEDY)[0]
        assert fresh.cached_tokens_by_tier["storage"] > 0
        assert fresh.token_ids == want(TWO, a["images"])


IMAGE_AT = len("a question asked of a picture: ")  # 31: the image starts in block 3 (tokens 24..31)


def _first_image_block_start() -> int:
    return IMAGE_AT // BS * BS


def test_same_text_another_image_hits_nothing_from_the_images_first_block(llava, want):
    first, other = picture(30), picture(31)
    with kvtier.LLM(llava, num_device_blocks=64, block_size=BS) as llm:
        llm.generate({"prompt": LONG, "images": [first]}, GREEDY)
        out = llm.generate({"prompt": LONG, "images": [other]}, GREEDY)[0]
        assert out.num_cached_tokens == _first_image_block_start() == 24
        assert out.token_ids == want(LONG, [other])
        same = llm.generate({"prompt": LONG, "images": [first]}, GREEDY)[0]
        assert same.num_cached_tokens == (len(same.prompt_token_ids) - 1) // BS * BS


@pytest.mark.parametrize("tier", ["host", "storage"])
def test_no_false_hit_and_same_image_hit_in_lower_tiers(llava, want, tier, tmp_path):
    """Another image behind the same text finds the text's blocks only, the same image all of
    its blocks, from the host tier and from storage alike."""
    first, other = picture(40), picture(41)
    fillers = [{"prompt": TWO, "images": [picture(50 + i), picture(60 + i)]} for i in range(3)]
    kw: dict = dict(num_device_blocks=10, block_size=BS, write_policy="write_through")
    kw |= dict(num_host_blocks=64) if tier == "host" else dict(num_host_blocks=8, storage=f"file://{tmp_path}/pool")
    with kvtier.LLM(llava, **kw) as llm:

        def evicted_then(images):
            for f in fillers:  # the earlier prompts leave the device tier (and, for storage, the host tier)
                llm.generate(f, GREEDY)
            return llm.generate({"prompt": LONG, "images": images}, GREEDY)[0]

        llm.generate({"prompt": LONG, "images": [first]}, GREEDY)
        out = evicted_then([other])
        assert out.num_cached_tokens == _first_image_block_start()
        assert out.token_ids == want(LONG, [other])
        same = evicted_then([first])
        assert same.cached_tokens_by_tier[tier] > 0
        assert same.num_cached_tokens == (len(same.prompt_token_ids) - 1) // BS * BS
        assert same.token_ids == want(LONG, [first])


def test_cache_salt_separates_the_same_image(llava):
    prompt = {"prompt": LONG, "images": [picture(70)]}
    with kvtier.LLM(llava, num_device_blocks=64, block_size=BS) as llm:
        llm.generate(prompt, GREEDY, cache_salt="alice")
        assert llm.generate(prompt, GREEDY, cache_salt="bob")[0].num_cached_tokens == 0
        assert llm.generate(prompt, GREEDY, cache_salt="alice")[0].num_cached_tokens > IMAGE_AT


def test_a_resent_image_runs_the_tower_once_even_after_its_kv_is_evicted(llava, want):
    chat = {"prompt": LONG, "images": [picture(80)]}
    fillers = [{"prompt": TWO, "images": [picture(81 + i), picture(91 + i)]} for i in range(2)]
    with kvtier.LLM(llava, num_device_blocks=10, block_size=BS) as llm:
        encoder = llm.runner.encoder
        assert encoder is not None
        llm.generate(chat, GREEDY)
        assert encoder.num_images_encoded == 1
        for f in fillers:
            llm.generate(f, GREEDY)  # the chat's KV is gone (no host tier)
        assert encoder.num_images_encoded == 5
        again = llm.generate(chat, GREEDY)[0]
        assert again.num_cached_tokens < IMAGE_AT + TOKENS_PER_IMAGE  # recomputed ...
        assert encoder.num_images_encoded == 5  # ... from the kept features
        assert again.token_ids == want(LONG, [picture(80)])
    with kvtier.LLM(llava, num_device_blocks=10, block_size=BS, encoder_cache_size=0) as llm:
        for f in [chat, *fillers, chat]:
            llm.generate(f, GREEDY)
        assert llm.runner.encoder is not None and llm.runner.encoder.num_images_encoded == 6  # the chat's image twice


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu_suite.sh vlm runs it)")
def test_cuda_image_prompts_through_device_host_and_storage_hits_match_transformers(llava, want, tmp_path):
    """On a GPU (fp32, the triton backend and CUDA graphs for the text-only steps): cold, a device
    hit, a host hit and a storage hit all give transformers' greedy tokens."""
    a = {"prompt": TWO, "images": [picture(100), picture(101)]}
    fillers = [{"prompt": TWO, "images": [picture(102 + i), picture(112 + i)]} for i in range(3)]
    expected = want(TWO, a["images"])
    kw: dict = dict(device="cuda", dtype="float32", block_size=BS, write_policy="write_through")
    with kvtier.LLM(llava, num_device_blocks=10, num_host_blocks=64, **kw) as llm:
        assert llm.generate(a, GREEDY)[0].token_ids == expected
        device_hit = llm.generate(a, GREEDY)[0]
        assert device_hit.cached_tokens_by_tier["device"] > 0 and device_hit.token_ids == expected
        llm.generate(fillers[0], GREEDY)
        host_hit = llm.generate(a, GREEDY)[0]
        assert host_hit.cached_tokens_by_tier["host"] > 0 and host_hit.token_ids == expected
    with kvtier.LLM(llava, num_device_blocks=10, num_host_blocks=8, storage=f"file://{tmp_path}/p", **kw) as llm:
        llm.generate(a, GREEDY)
        for f in fillers:
            llm.generate(f, GREEDY)
        storage_hit = llm.generate(a, GREEDY)[0]
        assert storage_hit.cached_tokens_by_tier["storage"] > 0 and storage_hit.token_ids == expected


def test_image_inputs_are_refused_by_name(llava, checkpoint):
    import io

    with kvtier.LLM(llava, num_device_blocks=64, block_size=BS, max_images_per_request=2, max_image_pixels=64 * 64) as llm:
        with pytest.raises(ValueError, match="3 images in one request, over the limit of 2 .max_images_per_request."):
            llm.generate({"prompt": "<image><image><image>", "images": [picture(1)] * 3}, GREEDY)
        with pytest.raises(ValueError, match="1 image placeholders but 2 images"):
            llm.generate({"prompt": ONE, "images": [picture(1)] * 2}, GREEDY)
        with pytest.raises(ValueError, match="1 image placeholders but 0 images"):
            llm.generate(ONE, GREEDY)
        with pytest.raises(ValueError, match="not a PNG, JPEG or WebP image"):
            llm.generate({"prompt": ONE, "images": [b"\x89PNG\r\n\x1a\n broken"]}, GREEDY)
        big = io.BytesIO()
        Image.new("L", (4000, 4000)).save(big, format="PNG")  # a few KB that decode to 16M pixels
        with pytest.raises(ValueError, match="4000x4000 pixels is over the limit of 4096 pixels .max_image_pixels."):
            llm.generate({"prompt": ONE, "images": [big.getvalue()]}, GREEDY)
        with pytest.raises(ValueError, match="a prompt dict has 'prompt' and optionally 'images'"):
            llm.generate({"text": ONE}, GREEDY)  # the wrong key
    with pytest.raises(ValueError, match="tensor_parallel_size=2 is not supported for LlavaForConditionalGeneration"):
        kvtier.LLM(llava, num_device_blocks=16, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="num_speculative_tokens > 0 drafts with the model's MTP layers"):
        kvtier.LLM(llava, num_device_blocks=16, num_speculative_tokens=1)
    with kvtier.LLM(checkpoint("llama-tiny"), num_device_blocks=16) as llm:
        with pytest.raises(ValueError, match="is a text model .LlamaForCausalLM.: it takes no images"):
            llm.generate({"prompt": "hi", "images": [picture(1)]}, GREEDY)


def test_image_files_count_toward_the_bytes_of_one_request(llava, tmp_path):
    """Two files each under max_image_bytes, together over it: refused, as two bytes objects are."""
    paths = []
    for i in range(2):
        paths.append(tmp_path / f"{i}.png")
        picture(30 + i).save(paths[-1], format="PNG")
    size = max(p.stat().st_size for p in paths)
    with kvtier.LLM(llava, num_device_blocks=64, block_size=BS, max_image_bytes=size + 1) as llm:
        with pytest.raises(ValueError, match="bytes of images in one request, over the limit .*max_image_bytes"):
            llm.generate({"prompt": TWO, "images": paths}, GREEDY)
        assert len(llm.generate({"prompt": ONE, "images": paths[:1]}, GREEDY)[0].token_ids) > 0


def test_a_pd_hand_off_of_an_image_prompt_loads_every_block_from_the_pool(llava, want, tmp_path):
    """P writes the prompt's blocks, keyed by its images; D, given the same request, reads them all
    (the same keys) and continues as a colocated engine would; another image is not P's prompt."""
    from kvtier.engine.config import EngineConfig
    from kvtier.engine.core import EngineCore

    prompt = {"prompt": TWO, "images": [picture(120), picture(121)]}
    config = EngineConfig(num_host_blocks=64, block_size=BS, num_device_blocks=64)
    url = f"file://{tmp_path}"

    def run(core: EngineCore, **add) -> kvtier.RequestOutput:
        req = core.add_request(**add)
        for _ in range(10_000):
            for out in core.step():
                if out.request_id == req.request_id:
                    return out
        raise AssertionError("request never finished")

    with EngineCore(llava, config, storage=url) as p, EngineCore(llava, config, storage=url) as d:
        first = run(p, prompt=prompt, params=kvtier.SamplingParams(max_tokens=1), export=True)
        h = first.handoff
        assert h["complete"] and h["failed_blocks"] == 0
        out = run(d, prompt=prompt, params=GREEDY, handoff=h)
        assert out.token_ids == want(TWO, prompt["images"])
        assert out.cached_tokens_by_tier["storage"] == len(out.prompt_token_ids) and out.handoff["result"] == "ok"
        other = {"prompt": TWO, "images": [picture(122), picture(121)]}
        with pytest.raises(ValueError, match="handoff.keys do not match"):
            d.add_request(prompt=other, params=GREEDY, handoff=h)
