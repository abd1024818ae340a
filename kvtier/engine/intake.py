"""Prompts in, validated :class:`Request` objects out: a text prompt's ids, the checks of
engine/checks.py (token ranges, context and device-tier fit, PD and logprob combinations: the
serving process runs the same ones first), its id and its generator. Bad input raises
ValueError naming the value."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from itertools import count
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from kvtier.engine.checks import AUTO_ID, RequestLimits, check_request, check_request_id
from kvtier.engine.config import EngineConfig
from kvtier.engine.detok import StopStrings
from kvtier.engine.params import SamplingParams
from kvtier.engine.request import Request
from kvtier.model import ModelConfig
from kvtier.model.images import ImageLimits, ImageProcessing, MMInput, check_placed, load_image, place_images


@dataclass
class Intake:
    path: Path  # the checkpoint (named in errors)
    tokenizer: Any  # None: token-id prompts only
    model: ModelConfig
    config: EngineConfig  # resolved (engine/resolve.py): the rest is read from it
    max_model_len: int = field(init=False)
    block_size: int = field(init=False)
    num_device_blocks: int = field(init=False)
    has_pool: bool = field(init=False)  # a storage pool: PD hand-offs possible
    routing: bool = field(init=False)  # MoE routing capture on
    device: torch.device = field(init=False)
    generator: torch.Generator = field(init=False)  # the engine's shared generator (unseeded requests), seeded by config.seed
    _ids: Iterator[int] = field(default_factory=count)

    def __post_init__(self) -> None:
        c = self.config
        assert c.max_model_len is not None and c.num_device_blocks is not None, "an unresolved config (engine/resolve.py)"
        self.max_model_len, self.block_size, self.num_device_blocks = c.max_model_len, c.block_size, c.num_device_blocks
        self.has_pool = c.storage is not None
        self.routing = self.model.is_moe and c.capture_routing
        self.device = torch.device(c.device)
        self.generator = torch.Generator(self.device).manual_seed(c.seed)

    @cached_property
    def limits(self) -> RequestLimits:
        """The sizes requests are checked against (a serving process gets them when the engine is ready)."""
        m = self.model
        return RequestLimits(
            str(self.path),
            m.architecture,
            m.is_moe,
            m.vocab_size,
            self.max_model_len,
            self.block_size,
            self.num_device_blocks,
            self.has_pool,
            self.routing,
            self.tokenizer is not None,
            *self._image_limits(),
        )

    def _image_limits(self) -> tuple[int, ...]:
        v, c = self.model.vision, self.config
        if v is None:
            return ()
        return (
            v.image_token_id,
            v.num_image_tokens,
            v.image_size,
            c.max_images_per_request,
            c.max_image_bytes,
            c.max_image_pixels,
        )

    @cached_property
    def image_limits(self) -> ImageLimits:
        c = self.config
        return ImageLimits(c.max_images_per_request, c.max_image_bytes, c.max_image_pixels)

    @cached_property
    def image_processing(self) -> ImageProcessing:
        return ImageProcessing.from_dir(self.path)

    def request(
        self,
        prompt: str | list[int] | dict | Any,
        params: SamplingParams,
        cache_salt: str | None,
        request_id: str | None = None,
        *,
        handoff: bool = False,
        export: bool = False,
        owner: str | None = None,
        priority: int = 0,
        mm: tuple[MMInput, ...] | None = None,
    ) -> Request:
        """A validated Request (``handoff``: the decode side of a PD hand-off; the manifest is
        checked by engine/pd.py). ``owner``: the call it belongs to (None: itself) and
        ``priority`` (lower first): how the scheduler shares its slots (engine/scheduler.py).
        ``prompt`` may be ``{"prompt": text or ids, "images": [...]}`` (:meth:`images`); ``mm``:
        the images of a prompt whose placeholders are placed already (a sample of its request)."""
        images: list[Any] = []
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "images"}
            if unknown or "prompt" not in prompt:
                raise ValueError(f"a prompt dict has 'prompt' and optionally 'images', got keys {sorted(prompt)}")
            images = list(prompt.get("images") or [])
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"text prompts need a tokenizer, and {self.path} has none; pass token ids")
            prompt = self.tokenizer.encode(prompt, add_special_tokens=False)
        vision = self.model.vision
        if vision is None and (images or mm):
            raise ValueError(f"{self.path} is a text model ({self.model.architecture}): it takes no images")
        if vision is not None and mm is None:
            pixels = self.images(images)
            prompt, placed = place_images(list(prompt), vision.image_token_id, vision.num_image_tokens, pixels)
            mm = tuple(placed)
        elif vision is not None and mm is not None:  # placed by the serving process (or a sample's head): checked
            shape = (vision.num_channels, vision.image_size, vision.image_size)
            check_placed(prompt, mm, vision.image_token_id, vision.num_image_tokens, shape)
        ids = check_request(self.limits, prompt, params, handoff=handoff, export=export, owner=owner, priority=priority)
        rid = f"{AUTO_ID}{next(self._ids)}" if request_id is None else check_request_id(request_id)
        req = Request(rid, ids, params, cache_salt=cache_salt, owner=owner or "", priority=int(priority), mm=mm or ())
        if params.stop:
            req.stop_strings = StopStrings(self.tokenizer, params.stop, params.skip_special_tokens, params.min_tokens)
        req.generator = self._generator_for(params.seed)
        req.export = export
        return req

    def images(self, images: list[Any]) -> list[np.ndarray]:
        """Preprocessed pixels [C, S, S] of a request's images: PIL images, encoded bytes or file
        paths (decoded within :attr:`image_limits`), or arrays preprocessed already (checked
        for the tower's shape). ValueError names the limit or the bad image."""
        limits, vision = self.image_limits, self.model.vision
        assert vision is not None
        if len(images) > limits.max_images:
            raise ValueError(
                f"{len(images)} images in one request, over the limit of {limits.max_images} "
                "(max_images_per_request, --max-images-per-request)"
            )
        encoded = sum(
            len(i) if isinstance(i, (bytes, bytearray, memoryview)) else Path(i).stat().st_size
            for i in images
            if isinstance(i, (bytes, bytearray, memoryview)) or (isinstance(i, (str, Path)) and Path(i).is_file())
        )  # (encoded bytes and files, together)
        if encoded > limits.max_bytes:
            raise ValueError(
                f"{encoded} bytes of images in one request, over the limit of {limits.max_bytes} "
                "(max_image_bytes, --max-image-bytes)"
            )
        want = (vision.num_channels, vision.image_size, vision.image_size)
        out = []
        for i, image in enumerate(images):
            if isinstance(image, np.ndarray):
                if image.shape != want or image.dtype != np.float32:
                    raise ValueError(
                        f"image {i}: preprocessed pixels must be float32 {list(want)}, got {image.dtype} {list(image.shape)}"
                    )
                out.append(image)
                continue
            pixels = self.image_processing.preprocess(load_image(image, limits))
            if pixels.shape != want:
                raise ValueError(f"image {i} preprocesses to {list(pixels.shape)}, the tower reads {list(want)}")
            out.append(pixels)
        return out

    def sample(self, head: Request, index: int, request_id: str) -> Request:
        """Sample ``index`` of ``head``'s n (engine/group.py): its prompt and params, its own id
        and generator (seed + index), its owner and priority. The prompt's logprobs are the
        request's (sample 0's): computing them again would make every sample recompute the whole
        prompt."""
        params = replace(head.params, n=1, prompt_logprobs=None)
        req = self.request(head.prompt_token_ids, params, head.cache_salt, owner=head.owner, priority=head.priority, mm=head.mm)
        req.request_id = request_id
        req.generator = self._generator_for(head.params.sample_seed(index))
        return req

    def _generator_for(self, seed: int | None) -> torch.Generator:
        return self.generator if seed is None else torch.Generator(self.device).manual_seed(seed)
