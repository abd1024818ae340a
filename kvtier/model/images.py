"""Images of a prompt, from bytes to the pixels a vision tower reads and the key that names them.

No torch (the serving process decodes and preprocesses images, as it tokenizes text)::

    bytes / path / PIL image ──decode_image──▶ PIL image (count, bytes and pixels bounded: ImageLimits)
       ──ImageProcessing.preprocess──▶ pixels float32 [3, S, S]   (CLIPImageProcessor's arithmetic:
                                      resize shortest edge, centre crop, rescale, normalize)
       ──image_hash──▶ sha256 of the pixels                       (the same picture as PNG or as a
                                                                   lossless re-encode: one hash)
    prompt ids ──place_images──▶ ids with each placeholder expanded to the model's tokens per
                                 image, and one MMInput per image (hash, offset, length, pixels)

The hash with its offset enters the key of every KV block the image overlaps (cache/keys.py
``MMItem``): the same text behind another image never shares a block past the image's start.
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

HASH_TAG = b"kvtier-image-v1"
_PIXELS, _BYTES = "(max_image_pixels, --max-image-pixels)", "(max_image_bytes, --max-image-bytes)"
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")  # what decode_image opens (GIF, TIFF, BMP, ...: refused)
# a long, thin image resizes (shortest edge to the tower's size) into a huge one: 1024 x 4 pixels
# (92 bytes of PNG) would become 336 x 86,016. Refused past this ratio, as Qwen2-VL's processor does.
MAX_ASPECT_RATIO = 200


@dataclass(frozen=True, slots=True)
class ImageLimits:
    """What one request may carry: images, encoded bytes (all images) and pixels per decoded image."""

    max_images: int = 8
    max_bytes: int = 20 << 20
    max_pixels: int = 4096 * 4096

    def __post_init__(self) -> None:
        for name in ("max_images", "max_bytes", "max_pixels"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class MMInput:
    """One image of a request: its content ``hash``, its placeholder tokens at
    [offset, offset + length) of the prompt, and its preprocessed ``pixels`` [C, S, S] float32."""

    hash: bytes
    offset: int
    length: int
    pixels: np.ndarray


def decode_image(data: bytes, limits: ImageLimits) -> Any:
    """A PIL image of encoded bytes (PNG, JPEG, WebP), its size checked from the header before a
    pixel is decoded (a decompression bomb is refused, not inflated). ValueError names what is wrong."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > limits.max_bytes:
        raise ValueError(f"image of {len(data)} bytes is over the limit of {limits.max_bytes} bytes {_BYTES}")
    try:
        img = Image.open(io.BytesIO(data), formats=list(IMAGE_FORMATS))
    except (UnidentifiedImageError, OSError) as e:
        raise ValueError(f"not a PNG, JPEG or WebP image ({len(data)} bytes): {e}") from None
    except Image.DecompressionBombError as e:  # (PIL's own bound, far above ours, checked first)
        raise ValueError(f"image over the limit of {limits.max_pixels} pixels {_PIXELS}: {e}") from None
    width, height = img.size
    if width * height > limits.max_pixels or width <= 0 or height <= 0:
        raise ValueError(f"image of {width}x{height} pixels is over the limit of {limits.max_pixels} pixels {_PIXELS}")
    try:
        img.load()
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise ValueError(f"broken {img.format} image: {e}") from None
    return img


def load_image(source: Any, limits: ImageLimits) -> Any:
    """A PIL image from a PIL image, encoded bytes or a file path (checked as :func:`decode_image`)."""
    from PIL import Image

    if isinstance(source, Image.Image):
        width, height = source.size
        if width * height > limits.max_pixels:
            raise ValueError(f"image of {width}x{height} pixels is over the limit of {limits.max_pixels} pixels {_PIXELS}")
        return source
    if isinstance(source, (bytes, bytearray, memoryview)):
        return decode_image(bytes(source), limits)
    if isinstance(source, (str, Path)):
        path = Path(source)
        if not path.is_file():
            raise ValueError(f"image file {str(path)!r} does not exist")
        if path.stat().st_size > limits.max_bytes:
            raise ValueError(f"image file {str(path)!r} is over the limit of {limits.max_bytes} bytes {_BYTES}")
        return decode_image(path.read_bytes(), limits)
    raise ValueError(f"an image must be a PIL image, bytes or a file path, got {type(source).__name__}")


@dataclass(frozen=True, slots=True)
class ImageProcessing:
    """A checkpoint's ``preprocessor_config.json`` (CLIPImageProcessor's keys and defaults)."""

    shortest_edge: int = 224
    crop: tuple[int, int] = (224, 224)  # (height, width)
    resample: int = 3  # PIL's BICUBIC
    do_resize: bool = True
    do_center_crop: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    mean: tuple[float, ...] = (0.48145466, 0.4578275, 0.40821073)
    std: tuple[float, ...] = (0.26862954, 0.26130258, 0.27577711)
    do_convert_rgb: bool = True

    @classmethod
    def from_dir(cls, path: str | Path) -> "ImageProcessing":
        """The checkpoint's image processor: ``preprocessor_config.json``, or the ``image_processor``
        of ``processor_config.json`` (as transformers 5 saves a processor); FileNotFoundError if neither."""
        file = Path(path) / "preprocessor_config.json"
        if file.is_file():
            return cls.from_dict(json.loads(file.read_text()))
        combined = Path(path) / "processor_config.json"
        if combined.is_file() and isinstance(d := json.loads(combined.read_text()).get("image_processor"), dict):
            return cls.from_dict(d)
        raise FileNotFoundError(
            f"no preprocessor_config.json in {path} (nor an image_processor in processor_config.json): "
            "a vision-language checkpoint ships its image processor"
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ImageProcessing":
        size, crop = d.get("size") or {}, d.get("crop_size") or {}
        edge: Any = size.get("shortest_edge", size.get("height", 224)) if isinstance(size, dict) else size
        crop_hw: Any = (crop.get("height", edge), crop.get("width", edge)) if isinstance(crop, dict) else (crop, crop)
        base = cls()
        return cls(
            shortest_edge=int(edge),
            crop=(int(crop_hw[0]), int(crop_hw[1])),
            resample=int(d.get("resample", base.resample)),
            do_resize=bool(d.get("do_resize", True)),
            do_center_crop=bool(d.get("do_center_crop", True)),
            do_rescale=bool(d.get("do_rescale", True)),
            rescale_factor=float(d.get("rescale_factor", base.rescale_factor)),
            do_normalize=bool(d.get("do_normalize", True)),
            mean=tuple(d.get("image_mean") or base.mean),
            std=tuple(d.get("image_std") or base.std),
            do_convert_rgb=bool(d.get("do_convert_rgb", True)),
        )

    def preprocess(self, image: Any) -> np.ndarray:
        """Pixels [3, H, W] float32 of a PIL image, as transformers' CLIPImageProcessor computes them."""
        from PIL import Image

        width, height = image.size
        if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
            raise ValueError(
                f"image of {width}x{height} pixels has an aspect ratio over {MAX_ASPECT_RATIO}:1 "
                "(it would be resized to far more pixels than it has)"
            )
        if self.do_convert_rgb and image.mode != "RGB":
            image = image.convert("RGB")
        if self.do_resize:
            width, height = image.size
            short, long = (width, height) if width <= height else (height, width)
            new_short, new_long = self.shortest_edge, int(self.shortest_edge * long / short)
            size = (new_short, new_long) if width <= height else (new_long, new_short)
            if size != image.size:
                image = image.resize(size, resample=Image.Resampling(self.resample))
        pixels = np.asarray(image, dtype=np.uint8)
        pixels = pixels[None] if pixels.ndim == 2 else np.moveaxis(pixels, -1, 0)
        if self.do_center_crop:
            pixels = _center_crop(pixels, *self.crop)
        out = pixels.astype(np.float32)
        if self.do_rescale:
            out = (pixels.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.do_normalize:
            mean = np.asarray(self.mean, dtype=out.dtype)[:, None, None]
            std = np.asarray(self.std, dtype=out.dtype)[:, None, None]
            out = (out - mean) / std
        return np.ascontiguousarray(out, dtype=np.float32)


def _center_crop(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """transformers' center_crop of [C, H, W] (zero-padded where the image is smaller)."""
    c, h, w = pixels.shape
    top, left = (h - height) // 2, (w - width) // 2
    if top >= 0 and left >= 0:
        return pixels[:, top : top + height, left : left + width]
    out = np.zeros((c, max(h, height), max(w, width)), dtype=pixels.dtype)
    pt, pl = max(0, (height - h) // 2), max(0, (width - w) // 2)
    out[:, pt : pt + h, pl : pl + w] = pixels
    top, left = (out.shape[1] - height) // 2, (out.shape[2] - width) // 2
    return out[:, top : top + height, left : left + width]


def image_hash(pixels: np.ndarray) -> bytes:
    """sha256 of the preprocessed pixels (shape and float32 bytes): the image's content key."""
    arr = np.ascontiguousarray(pixels, dtype="<f4")
    shape = np.asarray(arr.shape, dtype="<i8").tobytes()
    return hashlib.sha256(HASH_TAG + shape + arr.tobytes()).digest()


def place_images(
    ids: Sequence[int], image_token_id: int, tokens_per_image: int, pixels: Sequence[np.ndarray]
) -> tuple[list[int], list[MMInput]]:
    """``ids`` with each image's placeholder expanded to ``tokens_per_image`` copies, and one
    :class:`MMInput` per image in order. The prompt holds one placeholder per image (as a chat
    template writes ``<image>``, side by side for images given together), or every image's
    ``tokens_per_image`` already: which, the count of placeholders says. ValueError otherwise."""
    total = sum(1 for t in ids if t == image_token_id)
    if total == len(pixels) * tokens_per_image:  # already expanded (or one token an image)
        per = tokens_per_image
    elif total == len(pixels):
        per = 1
    else:
        raise ValueError(
            f"the prompt has {total} image placeholders but {len(pixels)} images were given "
            f"(one placeholder token, id {image_token_id}, per image, or {tokens_per_image} per image already expanded)"
        )
    out: list[int] = []
    items: list[MMInput] = []
    seen = 0
    for t in ids:
        if t != image_token_id:
            out.append(t)
            continue
        if seen % per == 0:  # an image's first placeholder
            px = pixels[seen // per]
            items.append(MMInput(image_hash(px), len(out), tokens_per_image, px))
            out.extend([image_token_id] * tokens_per_image)
        seen += 1
    return out, items


def check_placed(
    ids: Sequence[int], mm: Sequence[MMInput], image_token_id: int, tokens_per_image: int, shape: tuple[int, ...]
) -> None:
    """ValueError unless ``mm`` are the images of ``ids`` as :func:`place_images` places them: in
    order, each on ``tokens_per_image`` placeholders of its own (images side by side allowed),
    every placeholder some image's, pixels of ``shape``."""
    total = sum(1 for t in ids if t == image_token_id)
    if total != len(mm) * tokens_per_image:
        raise ValueError(f"the prompt has {total} image placeholder tokens but {len(mm)} images of {tokens_per_image} were given")
    end = 0
    for k, item in enumerate(mm):
        span = ids[item.offset : item.offset + tokens_per_image]
        if (
            item.offset < end
            or item.length != tokens_per_image
            or len(span) != tokens_per_image
            or any(t != image_token_id for t in span)
        ):
            raise ValueError(f"image {k} is not placed on {tokens_per_image} placeholder tokens at position {item.offset}")
        end = item.offset + tokens_per_image
        if tuple(item.pixels.shape) != tuple(shape) or item.pixels.dtype != np.float32:
            raise ValueError(
                f"image {k}: pixels must be float32 {list(shape)}, got {item.pixels.dtype} {list(item.pixels.shape)}"
            )
