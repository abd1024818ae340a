"""LLaVA's vision side against transformers (fp32, CPU): the tower + projector's features and the
prompt's logits with the features at the placeholder rows, for both feature strategies and for
a Llama and a Qwen2 text model; image preprocessing equals CLIPImageProcessor's pixel for pixel;
an image's hash is of its pixels; placeholders expand and check as the processor places them."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from kvtier.model import AttentionMetadata, ModelConfig, allocate_kv_caches, load_model
from kvtier.model.images import ImageProcessing, MMInput, check_placed, image_hash, place_images
from kvtier.model.llava import LlavaForConditionalGeneration

IMAGE_TOKEN = 299
VISION: dict[str, Any] = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    image_size=32,
    patch_size=8,
    projection_dim=32,
)
TEXT: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=320,
    max_position_embeddings=512,
    initializer_range=0.15,
)


def _write(tmp_path, text_type: str, strategy: str, layer) -> tuple:
    import transformers

    text = getattr(transformers, "LlamaConfig" if text_type == "llama" else "Qwen2Config")(**TEXT)
    config = getattr(transformers, "LlavaConfig")(
        vision_config=transformers.CLIPVisionConfig(**VISION),
        text_config=text,
        image_token_index=IMAGE_TOKEN,
        vision_feature_select_strategy=strategy,
        vision_feature_layer=layer,
    )
    torch.manual_seed(0)
    hf = transformers.LlavaForConditionalGeneration(config).eval()
    hf.save_pretrained(tmp_path)
    return hf, tmp_path


@pytest.mark.parametrize(
    "text_type, strategy, layer", [("llama", "default", -2), ("qwen2", "full", [-1, -3]), ("llama", "default", -4)]
)
def test_features_and_logits_match_transformers(tmp_path, text_type, strategy, layer):
    hf, path = _write(tmp_path, text_type, strategy, layer)
    model = load_model(path)
    assert isinstance(model, LlavaForConditionalGeneration)
    v = model.config.vision
    assert v is not None and v.num_image_tokens == 16 + (strategy == "full")
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want_feats = torch.stack(hf.model.get_image_features(pixels).pooler_output)
    feats = model.encode_images(pixels)
    torch.testing.assert_close(feats, want_feats, atol=1e-5, rtol=1e-5)
    n = v.num_image_tokens
    ids = [5, 6, 7] + [IMAGE_TOKEN] * n + [8, 9] + [IMAGE_TOKEN] * n + [10, 11]
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([ids]), pixel_values=pixels).logits[0]
    T = len(ids)
    meta = AttentionMetadata.build([T], [T], [list(range(1, 1 + -(-T // 8)))], 8, "cpu")
    rows = torch.tensor([i for i, t in enumerate(ids) if t == IMAGE_TOKEN])
    kv = allocate_kv_caches(model.config, 16, 8)
    hidden = model(torch.tensor(ids), torch.arange(T), kv, meta, mm_embeds=(rows, feats.reshape(-1, feats.shape[-1])))
    torch.testing.assert_close(model.compute_logits(hidden), want, atol=1e-4, rtol=1e-4)
    # features one row off are another prompt
    shifted = model(torch.tensor(ids), torch.arange(T), kv, meta, mm_embeds=(rows + 1, feats.reshape(-1, feats.shape[-1])))
    assert (model.compute_logits(shifted) - want).abs().max() > 1e-2


def test_a_llava_config_reads_its_text_model_and_tower():
    hf = {
        "architectures": ["LlavaForConditionalGeneration"],
        "image_token_index": 32000,
        "text_config": {"model_type": "mistral", **TEXT, "sliding_window": None},
        "vision_config": {"model_type": "clip_vision_model", **VISION},
    }
    cfg = ModelConfig.from_hf_dict(hf)
    assert cfg.architecture == "MistralForCausalLM" and cfg.num_layers == 2 and cfg.vision is not None
    assert (cfg.vision.image_token_id, cfg.vision.feature_layers, cfg.vision.num_layers_run) == (32000, (-2,), 2)
    with pytest.raises(ValueError, match="'siglip_vision_model' vision tower is not supported"):
        ModelConfig.from_hf_dict({**hf, "vision_config": {"model_type": "siglip_vision_model"}})
    with pytest.raises(ValueError, match="vision_feature_select_strategy must be 'default' or 'full', got 'cls'"):
        ModelConfig.from_hf_dict({**hf, "vision_feature_select_strategy": "cls"})


def _image(seed: int, size=(40, 52), mode="RGB") -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)).convert(mode)


@pytest.mark.parametrize("size", [(32, 32), (50, 70), (70, 41), (20, 33)])
@pytest.mark.parametrize("mode", ["RGB", "L", "RGBA"])
def test_preprocessing_equals_clip_image_processor(size, mode):
    from transformers import CLIPImageProcessor

    spec = dict(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    image = _image(size[0] * size[1], size, mode)
    want = CLIPImageProcessor(**spec)(images=image, return_tensors="np")["pixel_values"][0]
    got = ImageProcessing.from_dict(spec).preprocess(image)
    assert got.dtype == np.float32 and np.array_equal(got, want)


def test_an_images_hash_is_of_its_pixels_not_its_encoding():
    proc = ImageProcessing.from_dict(dict(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}))
    image = _image(3)

    def decoded(fmt: str, **kw) -> np.ndarray:
        buf = io.BytesIO()
        image.save(buf, format=fmt, **kw)
        return proc.preprocess(Image.open(io.BytesIO(buf.getvalue())))

    png, webp = decoded("PNG"), decoded("WEBP", lossless=True)
    assert image_hash(png) == image_hash(webp)
    assert image_hash(png) != image_hash(proc.preprocess(_image(4)))


def test_placeholders_expand_to_the_tokens_of_each_image():
    px = [np.zeros((3, 4, 4), np.float32), np.ones((3, 4, 4), np.float32)]
    ids, items = place_images([1, 9, 2, 9, 3], 9, 3, px)
    assert ids == [1, 9, 9, 9, 2, 9, 9, 9, 3]
    assert [(m.offset, m.length) for m in items] == [(1, 3), (5, 3)]
    assert place_images(ids, 9, 3, px)[0] == ids  # already expanded: kept
    check_placed(ids, items, 9, 3, (3, 4, 4))
    # two images side by side ("compare these two"): one placeholder each, or both expanded
    side, both = place_images([1, 9, 9, 2], 9, 3, px)
    assert side == [1, 9, 9, 9, 9, 9, 9, 2] and [(m.offset, m.length) for m in both] == [(1, 3), (4, 3)]
    assert place_images(side, 9, 3, px)[0] == side
    check_placed(side, both, 9, 3, (3, 4, 4))
    with pytest.raises(ValueError, match="image 1 is not placed on 3 placeholder tokens at position 3"):
        check_placed(side, [both[0], MMInput(both[1].hash, 3, 3, px[1])], 9, 3, (3, 4, 4))  # overlapping
    with pytest.raises(ValueError, match="2 image placeholders but 1 images"):
        place_images([1, 9, 9, 2], 9, 3, px[:1])
    with pytest.raises(ValueError, match="2 image placeholders but 1 images"):
        place_images([1, 9, 2, 9], 9, 3, px[:1])
    moved = [MMInput(items[0].hash, 2, 3, px[0]), items[1]]
    with pytest.raises(ValueError, match="image 0 is not placed on 3 placeholder tokens at position 2"):
        check_placed(ids, moved, 9, 3, (3, 4, 4))
    with pytest.raises(ValueError, match="7 image placeholder tokens but 2 images of 3"):
        check_placed(ids + [9], items, 9, 3, (3, 4, 4))
