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

import array
import hashlib
import struct
import sys
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np
import xxhash

FORMAT_VERSION = 1
HASH_NAMES = ("sha256", "xxh3_128")


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


_xxh3_128 = xxhash.xxh3_128_digest

_DIGESTS: dict[str, Callable[[bytes], bytes]] = {"sha256": _sha256, "xxh3_128": _xxh3_128}


def get_digest(hash_name: str) -> Callable[[bytes], bytes]:
    try:
        return _DIGESTS[hash_name]
    except KeyError:
        raise ValueError(f"unknown hash {hash_name!r}; choose from {list(HASH_NAMES)}") from None


def _field(data: bytes) -> bytes:
    """Length-prefixed field: no two different tag lists encode to the same bytes."""
    return struct.pack("<I", len(data)) + data


_INT32_LIMIT = 2**31
# array("I") packs a list in one C loop without building an argument tuple (~10% faster than
# struct.pack for a prompt); its items are native unsigned ints, the wire's <u4 only here
_ARRAY_U32 = array.array("I").itemsize == 4 and sys.byteorder == "little"


def encode_tokens(tokens: Sequence[int]) -> bytes:
    """Tokens as little-endian int32 bytes. Raises ValueError naming a bad token id.

    Python ints and numpy integers encode alike; bools, floats, negatives and ids >= 2**31 are
    refused. One C-level pack does the work; the bool check only looks at the ids 0 and 1.
    """
    if isinstance(tokens, np.ndarray):
        if tokens.dtype.kind not in "iu":
            raise ValueError(f"token ids must be non-negative int32 ints, got an array of {tokens.dtype}")
        tokens = tokens.reshape(-1)
        if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= _INT32_LIMIT):
            bad = next(int(t) for t in tokens if not 0 <= t < _INT32_LIMIT)
            raise ValueError(f"token ids must be non-negative int32 ints, got {bad}")
        return tokens.astype("<i4").tobytes()
    n = len(tokens)
    try:
        data = array.array("I", tokens).tobytes() if n > 16 and _ARRAY_U32 else struct.pack(f"<{n}I", *tokens)
    except (struct.error, TypeError, OverflowError):
        raise ValueError(f"token ids must be non-negative int32 ints, got {_first_bad(tokens)!r}") from None
    if n > 16:
        # one reduction: read as int32, an id >= 2**31 is negative, and a bool packs as 0 or 1
        arr = np.frombuffer(data, dtype="<i4")
        if arr.min() <= 1:
            for i in np.flatnonzero(arr <= 1).tolist():
                if not (type(tokens[i]) is int and tokens[i] < _INT32_LIMIT) and not _is_token(tokens[i]):
                    raise ValueError(f"token ids must be non-negative int32 ints, got {tokens[i]!r}")
    else:
        for t in tokens:
            if type(t) is not int or t >= _INT32_LIMIT:
                if not _is_token(t):
                    raise ValueError(f"token ids must be non-negative int32 ints, got {t!r}")
    return data


def _first_bad(tokens: Sequence[int]) -> object:
    return next((t for t in tokens if not _is_token(t)), tokens)


def _is_token(t: object) -> bool:
    if isinstance(t, (bool, np.bool_)) or not hasattr(t, "__index__"):
        return False
    return 0 <= t.__index__() < _INT32_LIMIT


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
    weights: str = ""  # which weights (a digest): two fine-tunes of one shape never share KV
    payload: str = ""  # what else a stored block carries, e.g. R3 routing "routing:48x8:uint8"
    kv_cache: str = ""  # a quantized cache: its dtype and scales, "float8_e4m3fn:<scales digest>"

    def encode(self) -> bytes:
        parts = (
            self.architecture,
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            self.dtype,
            self.block_size,
            self.kv_layout,
        )
        out = b"".join(_field(str(p).encode()) for p in parts)
        for tag, value in (("weights", self.weights), ("payload", self.payload), ("kv_cache", self.kv_cache)):
            if value:  # absent when empty: fingerprints without them keep their keys
                out += _field(tag.encode()) + _field(value.encode())
        return out


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


def namespace_seed(fingerprint: ModelFingerprint | None, cache_salt: str | None = None, hash_name: str = "sha256") -> bytes:
    """Root of every key chain: format version, model fingerprint and the request's cache_salt."""
    return encoded_seed(fingerprint.encode() if fingerprint is not None else b"", cache_salt, hash_name)


def encoded_seed(fp: bytes, cache_salt: str | None = None, hash_name: str = "sha256") -> bytes:
    """:func:`namespace_seed` from an encoded fingerprint (``ModelFingerprint.encode()``: what an
    engine's KV snapshot gives a router, which keys tokens without the model)."""
    digest = get_digest(hash_name)
    salt = b"" if cache_salt is None else _field(b"salt") + _field(cache_salt.encode())
    return digest(b"kvtier-ns" + struct.pack("<I", FORMAT_VERSION) + _field(fp) + salt)


def block_extras(start: int, end: int, lora_name: str | None, mm_items: Sequence[MMItem]) -> bytes:
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


def block_key(parent: bytes, tokens: Sequence[int], extras: bytes = b"", hash_name: str = "sha256") -> bytes:
    """The key of one block; the one function every consumer calls."""
    return get_digest(hash_name)(parent + encode_tokens(tokens) + extras)


class BlockHasher:
    """Incremental chained keys of one request's full blocks.

    Each full block has a *label*: its token bytes plus its tagged extras, block 0 prefixed by
    the namespace seed, so that ``key[i] = H(key[i-1] + label[i])`` with ``key[-1] = b""``.
    The labels are kept end to end in one byte string, ``stream`` (one pack of the tokens, no
    per-block objects): the radix tree compares a run of blocks with one slice of it
    (:meth:`RadixTree.match`), and a block's label is cut out only when that block is hashed or
    inserted. Digests are computed lazily, only when asked for; a matched node already carries
    its key (:meth:`adopt_keys`), so a cache hit never hashes its blocks again.

    Without extras every label but the first is ``4 * block_size`` bytes (``uniform``) and
    block ``i`` ends at ``len(seed) + 4 * block_size * (i + 1)``; with extras (LoRA, multimodal
    items) the ends are kept in a list.

    ``extend(tokens)`` appends tokens and returns the keys of blocks that became full;
    ``keys`` only grows, so generated tokens become cacheable blocks too. Extras are fixed per
    request.
    """

    __slots__ = (
        "block_size",
        "seed",
        "stream",
        "uniform",
        "num_blocks",
        "_ends",
        "_width",
        "_keys",
        "_digest",
        "_pending",
        "_lora",
        "_mm",
        "_num_tokens",
    )

    def __init__(
        self,
        block_size: int,
        seed: bytes,
        hash_name: str = "sha256",
        lora_name: str | None = None,
        mm_items: Iterable[MMItem] = (),
    ) -> None:
        self.block_size = block_size
        self.seed = seed
        self.stream = seed  # seed + the labels of the full blocks, end to end
        self._lora = lora_name
        self._mm = tuple(mm_items)
        self.uniform = lora_name is None and not self._mm
        self.num_blocks = 0
        self._ends: list[int] = []  # end offset of each label in ``stream`` (extras only)
        self._width = 4 * block_size  # bytes of a label without extras
        self._keys: list[bytes] = []  # digests of the first len(_keys) labels
        self._digest = get_digest(hash_name)
        self._pending: list[int] = []  # tokens of the last, partial block
        self._num_tokens = 0

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def end(self, i: int) -> int:
        """Offset in ``stream`` where block ``i``'s label ends (``end(-1)`` is 0)."""
        if i < 0:
            return 0
        return len(self.seed) + self._width * (i + 1) if self.uniform else self._ends[i]

    def label(self, i: int) -> bytes:
        return self.stream[self.end(i - 1) : self.end(i)]

    def label_ends(self, i: int, n: int) -> Sequence[int]:
        """Where the labels of blocks ``i..n-1`` end, counted from the start of block ``i``'s."""
        start = self.end(i - 1)
        if self.uniform:  # block 0's label starts with the seed
            return range(self.end(i) - start, self.end(n - 1) - start + 1, self._width)
        return [e - start for e in self._ends[i:n]]

    @property
    def keys(self) -> list[bytes]:
        """Keys of every full block so far (the same list object, growing)."""
        if len(self._keys) < self.num_blocks:
            self.ensure_keys(self.num_blocks)
        return self._keys

    def add_tokens(self, tokens: Sequence[int]) -> int:
        """Append tokens (validated); label the blocks that became full, without hashing them.
        Returns the number of full blocks."""
        bs = self.block_size
        added = len(tokens)
        if self._pending:
            tokens = self._pending + list(tokens)
        data = encode_tokens(tokens)  # validates every token first: a refusal changes nothing
        self._num_tokens += added
        n_full = len(tokens) // bs
        self._pending = list(tokens[n_full * bs :])
        if not n_full:
            return self.num_blocks
        nbytes = self._width
        if self.uniform:
            cut = n_full * nbytes  # one copy: concatenating a view does not copy it first
            self.stream += memoryview(data)[:cut] if len(data) > cut else data
        else:
            b0 = self.num_blocks * bs
            parts = [
                data[i * nbytes : (i + 1) * nbytes] + block_extras(b0 + i * bs, b0 + (i + 1) * bs, self._lora, self._mm)
                for i in range(n_full)
            ]
            end = len(self.stream)
            for part in parts:
                end += len(part)
                self._ends.append(end)
            self.stream += b"".join(parts)
        self.num_blocks += n_full
        return self.num_blocks

    def ensure_keys(self, num_blocks: int) -> list[bytes]:
        """Digest labels up to block ``num_blocks`` (chained); returns the key list."""
        keys = self._keys
        i = len(keys)
        if i >= num_blocks:
            return keys
        assert num_blocks <= self.num_blocks, (num_blocks, self.num_blocks)
        parent = keys[-1] if keys else b""
        digest, stream, start = self._digest, self.stream, self.end(i - 1)
        ends = range(self.end(i), self.end(num_blocks - 1) + 1, self._width) if self.uniform else self._ends[i:num_blocks]
        if digest is _sha256:  # hashlib's object directly: no wrapper call per block
            sha256 = hashlib.sha256
            for end in ends:
                parent = sha256(parent + stream[start:end]).digest()
                keys.append(parent)
                start = end
        else:
            for end in ends:
                parent = digest(parent + stream[start:end])
                keys.append(parent)
                start = end
        return keys

    def adopt_keys(self, keys: list[bytes]) -> None:
        """Take the keys of the leading blocks from a tree match (``keys[i]`` is block ``i``'s)
        instead of hashing them."""
        mine = self._keys
        if len(mine) < len(keys):
            mine.extend(keys[len(mine) :] if mine else keys)  # the same list object: it only grows

    def extend(self, tokens: Sequence[int]) -> list[bytes]:
        """Append tokens; return the keys of blocks that became full."""
        before = self.num_blocks
        after = self.add_tokens(tokens)
        self.ensure_keys(after)
        return self._keys[before:after]

    def partial_key(self, num_tokens: int | None = None, tokens: Sequence[int] | None = None) -> str | None:
        """Name of a last, partial block (PD hand-off): ``<hex>:partial:<n>``; None if empty.

        Default: the block after every full block so far (the pending tokens). With
        ``num_tokens`` and ``tokens`` (the sequence's tokens): the partial block that ends the
        first ``num_tokens`` of them (its full blocks must be hashed: ``ensure_keys``)."""
        if num_tokens is None:
            num_tokens, pending = self._num_tokens, self._pending
        else:
            assert tokens is not None, "num_tokens comes with tokens"
            pending = list(tokens[num_tokens - num_tokens % self.block_size : num_tokens])
        n = len(pending)
        if not n:
            return None
        n_full = (num_tokens - n) // self.block_size
        parent = self.ensure_keys(n_full)[n_full - 1] if n_full else self.seed
        start = num_tokens - n
        extras = (
            b"" if (self._lora is None and not self._mm) else block_extras(start, start + self.block_size, self._lora, self._mm)
        )
        return f"{self._digest(parent + encode_tokens(pending) + extras).hex()}:partial:{n}"


def object_name(key: bytes | str, namespace: str = "default", tp_rank: int | None = None, tp_size: int = 1) -> str:
    """Storage object name ``kvt:<ns>:<hex>[:tp<rank>of<size>]`` (partial names pass through)."""
    name = f"kvt:{namespace}:{key.hex() if isinstance(key, bytes) else key}"
    if tp_size > 1:
        if tp_rank is None or not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank must be in 0..{tp_size - 1}, got {tp_rank!r}")
        name += f":tp{tp_rank}of{tp_size}"
    return name
