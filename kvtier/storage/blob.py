"""Self-checking storage objects: a fixed header, then the KV payload, then the routing payload.

::

    0        4     6     8    9    10   11   12        16                32                     64
    | magic  | ver | hdr |klen|dtyp|ndim|algo| tokens  | namespace digest (16) | key (32, padded) ...
    64                      88         96          104        112          128
    | shape (6 x u32)       | kv bytes | rt bytes  | checksum | (zero pad) | KV payload | routing payload

All integers little-endian. ``checksum`` is xxh3-64 of the payload (KV then routing). A reader
knows what it expects (namespace, key, dtype, shape, sizes) and accepts an object only if every
field matches and the checksum holds: anything else (another model's or another namespace's
object, a truncated or corrupted object, a format from another version) is reported as *bad*, and
the client counts it, deletes it and treats it as a miss. No pickle: the header is ``struct``.
"""

from __future__ import annotations

import enum
import hashlib
import struct
from dataclasses import dataclass

import numpy as np
import xxhash

MAGIC = b"KVTB"
VERSION = 1
HEADER_NBYTES = 128
_FMT = struct.Struct("<4sHHBBBBI16s32s6IQQQ")
assert _FMT.size <= HEADER_NBYTES
_CHECKSUM_OFFSET = _FMT.size - 8
_ALGO_XXH3_64 = 1
# dtype codes (stable on disk: append only)
_DTYPES = ("float32", "float16", "bfloat16", "float64", "int8", "uint8", "float8_e4m3fn", "float8_e5m2")


class BlobStatus(enum.Enum):
    OK = "ok"
    TRUNCATED = "truncated"  # shorter than header + payload sizes
    BAD_HEADER = "bad_header"  # magic, version, dtype, shape or sizes differ
    WRONG_NAMESPACE = "wrong_namespace"
    WRONG_KEY = "wrong_key"
    BAD_CHECKSUM = "bad_checksum"


def namespace_digest(namespace: str, fingerprint: bytes = b"") -> bytes:
    """16 bytes naming whose KV an object holds (pool namespace + model fingerprint)."""
    return hashlib.sha256(b"kvtier-ns\0" + namespace.encode() + b"\0" + fingerprint).digest()[:16]


@dataclass(frozen=True, slots=True)
class BlobLayout:
    """What every object of one engine looks like (same for all its blocks)."""

    namespace: bytes  # namespace_digest(...)
    dtype: str  # KV dtype name, e.g. "bfloat16"
    # one host block: (num_layers, 2, block_size, kv_heads, head_dim); a latent: (num_layers, 1, block_size, kv_width)
    shape: tuple[int, ...]
    block_size: int  # tokens per block
    kv_nbytes: int
    routing_nbytes: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype {self.dtype!r} has no blob code; known: {_DTYPES}")
        if len(self.shape) > 6:
            raise ValueError(f"shape {self.shape} has more than 6 dims")
        if len(self.namespace) != 16:
            raise ValueError("namespace digest must be 16 bytes")

    @property
    def nbytes(self) -> int:
        """Size of a whole object."""
        return HEADER_NBYTES + self.kv_nbytes + self.routing_nbytes

    def _header(self, key: bytes | str, checksum: int) -> bytes:
        key = header_key(key)
        if len(key) > 32:
            raise ValueError(f"block key of {len(key)} bytes; at most 32")
        shape = tuple(self.shape) + (0,) * (6 - len(self.shape))
        return _FMT.pack(
            MAGIC,
            VERSION,
            HEADER_NBYTES,
            len(key),
            _DTYPES.index(self.dtype),
            len(self.shape),
            _ALGO_XXH3_64,
            self.block_size,
            self.namespace,
            key.ljust(32, b"\0"),
            *shape,
            self.kv_nbytes,
            self.routing_nbytes,
            checksum,
        )

    def encode_into(self, buf: np.ndarray, key: bytes | str, kv: np.ndarray, routing: np.ndarray | None) -> int:
        """Write the object of block ``key`` into ``buf`` (uint8, >= nbytes); returns its size.

        ``kv``/``routing`` are uint8 views of the host block's bytes (one copy each into ``buf``)."""
        h, k = HEADER_NBYTES, self.kv_nbytes
        if kv.nbytes != k or (routing.nbytes if routing is not None else 0) != self.routing_nbytes:
            raise ValueError(
                f"payload of {kv.nbytes} + {0 if routing is None else routing.nbytes} bytes; "
                f"layout expects {k} + {self.routing_nbytes}"
            )
        np.copyto(buf[h : h + k], kv.reshape(-1))
        if routing is not None:
            np.copyto(buf[h + k : h + k + self.routing_nbytes], routing.reshape(-1))
        checksum = xxhash.xxh3_64_intdigest(buf[h : self.nbytes].data)
        header = self._header(key, checksum)
        buf[: len(header)] = np.frombuffer(header, np.uint8)
        buf[len(header) : h] = 0
        return self.nbytes

    def header_for(self, key: bytes | str, kv: np.ndarray, routing: np.ndarray | None) -> bytes:
        """The header of block ``key`` whose payload is ``kv`` then ``routing`` (scatter-gather
        writers send header, kv and routing as three parts: no staging copy)."""
        return self._header(key, _digest(kv, routing)).ljust(HEADER_NBYTES, b"\0")

    def check_parts(
        self, header: np.ndarray, size: int, key: bytes | str, kv: np.ndarray, routing: np.ndarray | None
    ) -> BlobStatus:
        """:meth:`check` of an object read in parts: header into ``header``, payload straight into
        the host block's ``kv`` and ``routing`` views."""
        status = self._check_header(header, size, key)
        if status is not BlobStatus.OK:
            return status
        if _digest(kv, routing) != int.from_bytes(header[_CHECKSUM_OFFSET : _FMT.size].tobytes(), "little"):
            return BlobStatus.BAD_CHECKSUM
        return BlobStatus.OK

    def check(self, buf: np.ndarray, size: int, key: bytes | str) -> BlobStatus:
        """Is ``buf[:size]`` the object of block ``key`` in this layout?"""
        status = self._check_header(buf, size, key)
        if status is not BlobStatus.OK:
            return status
        checksum = _FMT.unpack_from(buf[: _FMT.size].data)[18]
        if xxhash.xxh3_64_intdigest(buf[HEADER_NBYTES : self.nbytes].data) != checksum:
            return BlobStatus.BAD_CHECKSUM
        return BlobStatus.OK

    def _check_header(self, buf: np.ndarray, size: int, key: bytes | str) -> BlobStatus:
        key = header_key(key)
        # fast path (a thread pool's worth of these share the GIL): every field but the checksum
        # is known, so one comparison with the expected header checks them all
        if size == self.nbytes and len(key) <= 32 and buf[:_CHECKSUM_OFFSET].tobytes() == self._header(key, 0)[:_CHECKSUM_OFFSET]:
            return BlobStatus.OK
        if size < _FMT.size:
            return BlobStatus.TRUNCATED
        f = _FMT.unpack_from(buf[: _FMT.size].data)
        magic, version, hdr, klen, dtype, ndim, algo, tokens, ns, stored_key = f[:10]
        shape, kv_nbytes, rt_nbytes = f[10 : 10 + ndim], f[16], f[17]
        if magic != MAGIC or version != VERSION or hdr != HEADER_NBYTES or algo != _ALGO_XXH3_64:
            return BlobStatus.BAD_HEADER
        if size < hdr + kv_nbytes + rt_nbytes:
            return BlobStatus.TRUNCATED
        if ns != self.namespace:
            return BlobStatus.WRONG_NAMESPACE
        if stored_key[:klen] != key or klen != len(key):
            return BlobStatus.WRONG_KEY
        if (
            dtype >= len(_DTYPES)
            or _DTYPES[dtype] != self.dtype
            or tuple(shape) != tuple(self.shape)
            or tokens != self.block_size
            or kv_nbytes != self.kv_nbytes
            or rt_nbytes != self.routing_nbytes
            or size != self.nbytes
        ):
            return BlobStatus.BAD_HEADER
        return BlobStatus.OK

    def decode_into(self, buf: np.ndarray, kv: np.ndarray, routing: np.ndarray | None) -> None:
        """Copy a checked object's payload into the host block's bytes."""
        h, k = HEADER_NBYTES, self.kv_nbytes
        assert kv.flags.c_contiguous and (routing is None or routing.flags.c_contiguous)
        np.copyto(kv.reshape(-1), buf[h : h + k])
        if routing is not None:
            np.copyto(routing.reshape(-1), buf[h + k : h + k + self.routing_nbytes])


def _digest(kv: np.ndarray, routing: np.ndarray | None) -> int:
    """xxh3-64 of the payload: the KV bytes, then the routing bytes."""
    if routing is None:
        return xxhash.xxh3_64_intdigest(kv.reshape(-1).data)
    h = xxhash.xxh3_64(kv.reshape(-1).data)
    h.update(routing.reshape(-1).data)
    return h.intdigest()


def header_key(key: bytes | str) -> bytes:
    """The key bytes a header carries: a block key, or the digest of a partial block's name
    (``<hex>:partial:<n>``, PD hand-off)."""
    return bytes.fromhex(key.split(":", 1)[0]) if isinstance(key, str) else key
