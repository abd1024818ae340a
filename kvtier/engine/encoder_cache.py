"""The vision tower's outputs by image hash: a bounded LRU on the device, so that a conversation
which resends its image (every turn of a chat does) runs the tower once, also where the image's
KV blocks were evicted, and a prefill chunked through an image encodes it once::

    step's image spans ──features──▶ hit: the kept tensor (moved to the LRU's end)
                                     miss: tower batches (TOWER_BATCH) of the step's missing images,
                                           kept; past ``capacity`` images the least recent goes

Features depend on the pixels alone (the hash is of the preprocessed pixels, model/images.py),
so a kept tensor is exactly what the tower would give again.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol, Sequence

import numpy as np
import torch

from kvtier.engine.step_inputs import ImageSpan
from kvtier.model.images import MMInput

TOWER_BATCH = 16  # images per tower forward at most


class ImageEncoder(Protocol):
    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor: ...


class EncoderCache:
    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"encoder_cache_size must be >= 0, got {capacity}")
        self.capacity = capacity
        self.entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.num_tower_runs = 0  # tower forwards (one per step that had an image to encode)
        self.num_images_encoded = 0  # images those forwards encoded
        self.num_hits = 0  # images served from the cache

    def features(self, model: ImageEncoder, images: Sequence[MMInput], device: torch.device) -> dict[bytes, torch.Tensor]:
        """Features [num_image_tokens, hidden] of each distinct image of ``images`` by hash: the
        kept ones, and the others from one batched tower forward."""
        out: dict[bytes, torch.Tensor] = {}
        missing: dict[bytes, MMInput] = {}
        for image in images:
            if image.hash in out or image.hash in missing:
                continue
            kept = self.entries.get(image.hash)
            if kept is None:
                missing[image.hash] = image
                continue
            self.entries.move_to_end(image.hash)
            self.num_hits += 1
            out[image.hash] = kept
        todo = list(missing.values())
        for start in range(0, len(todo), TOWER_BATCH):  # (a step of many images: its activations bounded)
            batch = todo[start : start + TOWER_BATCH]
            pixels = torch.from_numpy(np.stack([m.pixels for m in batch])).to(device, non_blocking=True)
            encoded = model.encode_images(pixels)
            self.num_tower_runs += 1
            self.num_images_encoded += len(batch)
            for image, feats in zip(batch, encoded):
                out[image.hash] = feats
                self.put(image.hash, feats)
        return out

    def embeds(self, model: ImageEncoder, spans: Sequence[ImageSpan], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, features) of a step's image spans (``mm_embeds`` of the forward): each distinct
        image encoded once or taken from here, each span's rows given its part of the features."""
        feats = self.features(model, [s.image for s in spans], device)
        rows = [r for s in spans for r in range(s.row, s.row + s.last - s.first)]
        parts = torch.cat([feats[s.image.hash][s.first : s.last] for s in spans])
        return torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True), parts

    def put(self, key: bytes, feats: torch.Tensor) -> None:
        if self.capacity == 0:
            return
        self.entries[key] = feats
        self.entries.move_to_end(key)
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)
