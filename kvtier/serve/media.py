"""Images of chat messages, for vision-language models: from a content part's URL to pixels placed
on the prompt's placeholders, on the tokenizer threads (serve/prompts.py), never on the event loop::

    {"type": "image_url", "image_url": {"url": U}}  ──the message's text──▶  IMAGE_MARK where it stood
    U = data:image/png;base64,...    ──base64 (size checked first)──▶ bytes
    U = https://host/...            ──refused (400) unless --allowed-media-domains names host; then
                                       fetched without redirects, within --max-image-bytes and a timeout
    bytes ──decode (pixels from the header first) ─ preprocess ─ hash──▶ MMInput (model/images.py)

The serving process preprocesses (PIL and numpy, no torch) and sends the pixels: the engine loop
never decodes an image, and the request's limits (count, bytes, pixels) are enforced where the
bytes arrive. A message's text gets IMAGE_MARK (private-use characters, in no template) where
each image stood; prompts.py turns each into the model's image token after rendering the chat
template, so a client's own ``<image>`` text never becomes a placeholder.
"""

from __future__ import annotations

import base64
import binascii
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any, Sequence

from kvtier.engine.checks import RequestLimits
from kvtier.model.images import ImageLimits, ImageProcessing, MMInput, decode_image, place_images
from kvtier.serve.errors import APIError

IMAGE_MARK = "\ue002kvtier-image\ue003"
DATA_TYPES = ("image/png", "image/jpeg", "image/webp")
FETCH_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class MediaPolicy:
    """Where image URLs may point: ``allowed_domains`` (host names; none: only ``data:`` URLs)."""

    allowed_domains: frozenset[str] = frozenset()
    fetch_timeout: float = FETCH_TIMEOUT_S


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001 (urllib's signature)
        raise APIError(400, f"the image URL redirects ({code}) to {newurl!r}: not followed", "messages")


class Images:
    """The image side of a vision-language model's serving process (its limits from the engine)."""

    def __init__(self, path: str, limits: RequestLimits, policy: MediaPolicy) -> None:
        self.limits = ImageLimits(limits.max_images, limits.max_image_bytes, limits.max_image_pixels)
        self.image_token_id, self.tokens_per_image = limits.image_token_id, limits.image_tokens
        self.processing = ImageProcessing.from_dir(path)
        self.policy = policy

    def check_count(self, urls: Sequence[str | bytes]) -> None:
        """400 before any image is read: more images than a request may carry."""
        if len(urls) > self.limits.max_images:
            raise APIError(
                400,
                f"{len(urls)} images in one request, over the limit of {self.limits.max_images} "
                "(max_images_per_request, --max-images-per-request)",
                "messages",
            )

    def fetch_remote(self, urls: Sequence[str]) -> list[str | bytes]:
        """``urls`` with each http(s) one fetched (or refused: a host --allowed-media-domains does
        not name). A thread of its own runs this, not a tokenizer thread: a slow host holds
        only its own request up."""
        budget = self.limits.max_bytes
        out: list[str | bytes] = []
        for k, url in enumerate(urls):
            if url.startswith(("http://", "https://")):
                data = self.read(url, k, budget)
                budget -= len(data)
                out.append(data)
            else:
                out.append(url)
        return out

    def place(self, ids: list[int], sources: Sequence[str | bytes]) -> tuple[list[int], list[MMInput]]:
        """(ids with each placeholder expanded, the images on them) for the prompt ``ids`` and its
        images, in order: URLs, or the bytes :meth:`fetch_remote` fetched (a tokenizer thread runs
        this). APIError(400) names what is wrong."""
        self.check_count(sources)
        budget = self.limits.max_bytes
        pixels = []
        for k, source in enumerate(sources):
            data = source if isinstance(source, bytes) else self.read(source, k, budget)
            if len(data) > budget:
                over = f"over the limit of {self.limits.max_bytes} bytes of images in one request"
                raise APIError(400, f"image {k}: {over} (max_image_bytes, --max-image-bytes)", "messages")
            budget -= len(data)
            try:
                pixels.append(self.processing.preprocess(decode_image(data, self.limits)))
            except ValueError as e:
                raise APIError(400, f"image {k}: {e}", "messages") from None
        try:
            return place_images(ids, self.image_token_id, self.tokens_per_image, pixels)
        except ValueError as e:
            raise APIError(400, str(e), "messages") from None

    def expanded(self, ids: list[int]) -> list[int]:
        """``ids`` with each placeholder as the tokens of its image (what /tokenize counts; no image is read)."""
        n, token = self.tokens_per_image, self.image_token_id
        return [t for i in ids for t in ([i] * n if i == token else [i])]

    def read(self, url: str, k: int, budget: int) -> bytes:
        """The bytes of image ``k``'s URL, at most ``budget`` (what the request's images have left)."""
        over = f"over the limit of {self.limits.max_bytes} bytes of images in one request (max_image_bytes, --max-image-bytes)"
        if url.startswith("data:"):
            header, comma, payload = url.partition(",")
            kind = header[5:].split(";")[0].strip().lower()
            if not comma or not header.endswith(";base64"):
                raise APIError(400, f"image {k}: a data: URL must be data:<type>;base64,<data>", "messages")
            if kind not in DATA_TYPES:
                raise APIError(400, f"image {k}: data: URL of type {kind!r}; send one of {', '.join(DATA_TYPES)}", "messages")
            if len(payload) // 4 * 3 > budget:
                raise APIError(400, f"image {k}: {over}", "messages")
            try:
                return base64.b64decode(payload, validate=True)
            except (binascii.Error, ValueError) as e:
                raise APIError(400, f"image {k}: its data: URL is not valid base64 ({e})", "messages") from None
        try:
            parts = urllib.parse.urlsplit(url)
            host = (parts.hostname or "").lower()
        except ValueError as e:  # (an unclosed IPv6 bracket, ...)
            raise APIError(400, f"image {k}: not a URL ({e})", "messages") from None
        if parts.scheme not in ("http", "https"):
            raise APIError(400, f"image {k}: URL scheme {parts.scheme!r} is not supported; send a data: URL", "messages")
        if host not in self.policy.allowed_domains:
            raise APIError(
                400,
                f"image {k}: the server does not fetch images from {host!r}: send the image as a data: URL, or "
                "start the server with --allowed-media-domains naming the hosts it may fetch from",
                "messages",
            )
        return self.fetch(url, k, budget, over)

    def fetch(self, url: str, k: int, budget: int, over: str) -> bytes:
        opener = urllib.request.build_opener(_NoRedirects)
        try:
            with opener.open(url, timeout=self.policy.fetch_timeout) as r:
                data = r.read(budget + 1)
        except APIError:
            raise
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise APIError(400, f"image {k}: fetching {url!r} failed: {e}", "messages") from None
        if len(data) > budget:
            raise APIError(400, f"image {k}: {over}", "messages")
        return data


def parse_domains(text: str | None) -> frozenset[str]:
    """``--allowed-media-domains a.com,b.org`` as a set of lower-case host names."""
    return frozenset(d.strip().lower() for d in (text or "").split(",") if d.strip())


def message_images(messages: Sequence[Any]) -> list[str]:
    """The image URLs of chat messages (``ChatMessage``), in order."""
    return [url for m in messages for url in m.image_urls()]
