"""Content-addressed block keys (DESIGN §3).

A block key chains the parent's key, the block's token ids and its tagged extra keys::

    seed      = H(b"kvtier-ns" | format version | model fingerprint | cache_salt)
    key[0]    = H(seed     | tokens[0:bs]   | extras of block 0)
    key[i]    = H(key[i-1] | tokens[i*bs:…] | extras of block i)

Canonical bytes only: tokens as little-endian int32, tags length-prefixed. Never ``pickle`` or
Python ``hash()``: a key must be identical across processes, machines and int types (numpy
ints included). ``sha256`` (default, 32-byte keys) or ``xxh3_128`` (16-byte keys).

:class:`BlockHasher` extends a request's keys incrementally as its tokens grow (prompt, then
generated tokens), hashing each full block once.
"""
from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import xxhash

FORMAT_VERSION = 1
HASH_NAMES = ("sha256", "xxh3_128")


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _xxh3_128(data: bytes) -> bytes:
    return xxhash.xxh3_128_digest(data)


_DIGESTS: dict[str, Callable[[bytes], bytes]] = {"sha256": _sha256, "xxh3_128": _xxh3_128}


def get_digest(hash_name: str) -> Callable[[bytes], bytes]:
    try:
        return _DIGESTS[hash_name]
    except KeyError:
        raise ValueError(f"unknown hash {hash_name!r}; choose from {list(HASH_NAMES)}") from None


def _field(data: bytes) -> bytes:
    """Length-prefixed field: no two different tag lists encode to the same bytes."""
    return struct.pack("<I", len(data)) + data


def encode_tokens(tokens: Sequence[int]) -> bytes:
    """Tokens as little-endian int32 bytes. Raises ValueError naming a bad token id."""
    try:
        arr = array("i", tokens)
    except (TypeError, OverflowError):
        bad = next((t for t in tokens if not _is_token(t)), tokens)
        raise ValueError(f"token ids must be non-negative int32 ints, got {bad!r}") from None
    if arr and min(arr) < 0:
        raise ValueError(f"token ids must be non-negative int32 ints, got {min(arr)}")
    if sys.byteorder == "big":  # pragma: no cover - canonical form is little-endian
        arr.byteswap()
    return arr.tobytes()


def _is_token(t: object) -> bool:
    if isinstance(t, bool) or not hasattr(t, "__index__"):
        return False
    return 0 <= t.__index__() < 2**31  # type: ignore[attr-defined]


@dataclass(frozen=True, slots=True)
class ModelFingerprint:
    """What makes KV bytes of two engines interchangeable."""

    architecture: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int
    kv_layout: str = "page_first"

    def encode(self) -> bytes:
        parts = (self.architecture, self.num_layers, self.num_kv_heads, self.head_dim,
                 self.dtype, self.block_size, self.kv_layout)
        return b"".join(_field(str(p).encode()) for p in parts)


@dataclass(frozen=True, slots=True)
class MMItem:
    """A multimodal item occupying token positions [offset, offset + length)."""

    hash: bytes | str
    offset: int
    length: int

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length <= 0:
            raise ValueError(f"multimodal item needs offset >= 0 and length > 0, got {self}")

    def hash_bytes(self) -> bytes:
        return self.hash.encode() if isinstance(self.hash, str) else bytes(self.hash)


def namespace_seed(fingerprint: ModelFingerprint | None, cache_salt: str | None = None,
                   hash_name: str = "sha256") -> bytes:
    """Root of every key chain: format version, model fingerprint and the request's cache_salt."""
    digest = get_digest(hash_name)
    fp = fingerprint.encode() if fingerprint is not None else b""
    salt = b"" if cache_salt is None else _field(b"salt") + _field(cache_salt.encode())
    return digest(b"kvtier-ns" + struct.pack("<I", FORMAT_VERSION) + _field(fp) + salt)


def block_extras(start: int, end: int, lora_name: str | None,
                 mm_items: Sequence[MMItem]) -> bytes:
    """Tagged extra keys of the block holding token positions [start, end).

    A multimodal item belongs to every block it overlaps; one that ends exactly at ``start``
    does not. Its tag carries its offset so the same image at another position differs.
    """
    out = b""
    if lora_name is not None:
        out += _field(b"lora") + _field(lora_name.encode())
    for item in mm_items:
        if item.offset < end and item.offset + item.length > start:
            out += _field(b"mm") + _field(item.hash_bytes()) + struct.pack("<q", item.offset)
    return out


def block_key(parent: bytes, tokens: Sequence[int], extras: bytes = b"",
              hash_name: str = "sha256") -> bytes:
    """The key of one block; the one function every consumer calls."""
    return get_digest(hash_name)(parent + encode_tokens(tokens) + extras)


class BlockHasher:
    """Incremental chained keys of one request's full blocks.

    ``extend(tokens)`` hashes every block that became full; ``keys`` only grows, so generated
    tokens become cacheable blocks too. Extras (LoRA, multimodal items) are fixed per request.
    """

    __slots__ = ("block_size", "seed", "keys", "_digest", "_pending", "_lora", "_mm", "_num_tokens")

    def __init__(self, block_size: int, seed: bytes, hash_name: str = "sha256",
                 lora_name: str | None = None, mm_items: Iterable[MMItem] = ()) -> None:
        self.block_size = block_size
        self.seed = seed
        self.keys: list[bytes] = []
        self._digest = get_digest(hash_name)
        self._pending: list[int] = []
        self._lora = lora_name
        self._mm = tuple(mm_items)
        self._num_tokens = 0

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def extend(self, tokens: Sequence[int]) -> list[bytes]:
        """Append tokens; return the keys of blocks that became full."""
        bs, digest = self.block_size, self._digest
        pending = self._pending
        pending.extend(tokens)
        self._num_tokens += len(tokens)
        n_full = len(pending) // bs
        if not n_full:
            return []
        data = encode_tokens(pending[: n_full * bs])  # validates every token once
        nbytes = 4 * bs
        parent = self.keys[-1] if self.keys else self.seed
        start = self._num_tokens - len(pending)
        new: list[bytes] = []
        plain = self._lora is None and not self._mm
        for i in range(n_full):
            chunk = data[i * nbytes:(i + 1) * nbytes]
            if plain:
                parent = digest(parent + chunk)
            else:
                b0 = start + i * bs
                parent = digest(parent + chunk + block_extras(b0, b0 + bs, self._lora, self._mm))
            new.append(parent)
        del pending[: n_full * bs]
        self.keys.extend(new)
        return new

    def partial_key(self) -> str | None:
        """Name of the last, partial block (PD hand-off): ``<hex>:partial:<n>``; None if empty."""
        n = len(self._pending)
        if not n:
            return None
        parent = self.keys[-1] if self.keys else self.seed
        start = self._num_tokens - n
        extras = b"" if (self._lora is None and not self._mm) else block_extras(
            start, start + self.block_size, self._lora, self._mm)
        return f"{self._digest(parent + encode_tokens(self._pending) + extras).hex()}:partial:{n}"


def object_name(key: bytes | str, namespace: str = "default", tp_rank: int | None = None,
                tp_size: int = 1) -> str:
    """Storage object name ``kvt:<ns>:<hex>[:tp<rank>of<size>]`` (partial names pass through)."""
    name = f"kvt:{namespace}:{key.hex() if isinstance(key, bytes) else key}"
    if tp_size > 1:
        if tp_rank is None or not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank must be in 0..{tp_size - 1}, got {tp_rank!r}")
        name += f":tp{tp_rank}of{tp_size}"
    return name
