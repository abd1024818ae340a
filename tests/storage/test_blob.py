"""Blob format: a stored object is accepted only if it is exactly the block it claims to be."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvtier.storage.blob import HEADER_NBYTES, BlobLayout, BlobStatus, namespace_digest

KEY = bytes(range(32))


def layout(**kw: Any) -> BlobLayout:
    args: dict[str, Any] = dict(
        namespace=namespace_digest("default", b"model-a"),
        dtype="bfloat16",
        shape=(2, 2, 4, 2, 8),
        block_size=4,
        kv_nbytes=2 * 2 * 4 * 2 * 8 * 2,
        routing_nbytes=24,
    )
    args.update(kw)
    return BlobLayout(**args)


def encoded(lay: BlobLayout, key: bytes = KEY, seed: int = 0):
    rng = np.random.default_rng(seed)
    kv = rng.integers(0, 256, lay.kv_nbytes, dtype=np.uint8)
    rt = rng.integers(0, 256, lay.routing_nbytes, dtype=np.uint8) if lay.routing_nbytes else None
    buf = np.zeros(lay.nbytes + 64, np.uint8)
    n = lay.encode_into(buf, key, kv, rt)
    return buf, n, kv, rt


def test_round_trip_is_byte_exact():
    lay = layout()
    buf, n, kv, rt = encoded(lay)
    assert n == lay.nbytes == HEADER_NBYTES + lay.kv_nbytes + lay.routing_nbytes
    assert lay.check(buf, n, KEY) is BlobStatus.OK
    kv2, rt2 = np.zeros_like(kv), np.zeros_like(rt)
    lay.decode_into(buf, kv2, rt2)
    assert np.array_equal(kv, kv2) and np.array_equal(rt, rt2)


@pytest.mark.parametrize("offset", [HEADER_NBYTES, HEADER_NBYTES + 100, -1])
def test_a_flipped_payload_byte_is_a_bad_checksum(offset):
    lay = layout()
    buf, n, _, _ = encoded(lay)
    buf[offset if offset >= 0 else n - 1] ^= 0x10
    assert lay.check(buf, n, KEY) is BlobStatus.BAD_CHECKSUM


def test_truncated_objects_are_detected():
    lay = layout()
    buf, n, _, _ = encoded(lay)
    for size in (0, 10, HEADER_NBYTES, n - 1):
        assert lay.check(buf, size, KEY) is BlobStatus.TRUNCATED


def test_another_namespace_key_or_shape_is_refused():
    lay = layout()
    buf, n, _, _ = encoded(lay)
    other_ns = layout(namespace=namespace_digest("default", b"model-b"))
    assert other_ns.check(buf, n, KEY) is BlobStatus.WRONG_NAMESPACE
    assert lay.check(buf, n, bytes(32)) is BlobStatus.WRONG_KEY
    assert layout(dtype="float16").check(buf, n, KEY) is BlobStatus.BAD_HEADER
    assert layout(shape=(2, 2, 4, 8, 2)).check(buf, n, KEY) is BlobStatus.BAD_HEADER
    buf[0:4] = np.frombuffer(b"XXXX", np.uint8)
    assert lay.check(buf, n, KEY) is BlobStatus.BAD_HEADER


def test_an_object_with_trailing_bytes_is_refused():
    lay = layout()
    buf, n, _, _ = encoded(lay)
    assert lay.check(buf, n + 8, KEY) is BlobStatus.BAD_HEADER


def test_no_routing_payload_and_short_keys():
    lay = layout(routing_nbytes=0)
    key = b"k" * 16  # xxh3_128 keys are 16 bytes
    buf, n, kv, _ = encoded(lay, key)
    assert lay.check(buf, n, key) is BlobStatus.OK
    assert lay.check(buf, n, key + b"\0") is BlobStatus.WRONG_KEY


def test_bad_layouts_are_errors():
    with pytest.raises(ValueError, match="dtype"):
        layout(dtype="complex64")
    with pytest.raises(ValueError, match="payload"):
        lay = layout()
        lay.encode_into(np.zeros(lay.nbytes, np.uint8), KEY, np.zeros(3, np.uint8), None)


def _parts(lay: BlobLayout, buf: np.ndarray):
    """An encoded object as a reader of parts sees it: header, KV and routing views."""
    kv = buf[HEADER_NBYTES : HEADER_NBYTES + lay.kv_nbytes]
    rt = buf[HEADER_NBYTES + lay.kv_nbytes : lay.nbytes] if lay.routing_nbytes else None
    return buf[:HEADER_NBYTES], kv, rt


def _status_of_damage(offset: int) -> BlobStatus:
    """What a reader must report for an object with byte ``offset`` flipped (the header layout
    in kvtier/storage/blob.py's docstring)."""
    if 16 <= offset < 32:
        return BlobStatus.WRONG_NAMESPACE
    if 32 <= offset < 64 or offset == 8:  # the key, or its length
        return BlobStatus.WRONG_KEY
    if 84 <= offset < 88:  # the unused 6th shape dim of a 5-dim shape: never read
        return BlobStatus.OK
    if 88 <= offset < 104:  # KV / routing sizes: the flip (of a 0 bit here) claims more
        return BlobStatus.TRUNCATED  # bytes than the object has
    if offset < 104:
        return BlobStatus.BAD_HEADER  # magic, version, sizes, dtype, ndim, algo, tokens, shape
    return BlobStatus.BAD_CHECKSUM  # the checksum itself, or the payload


@pytest.mark.parametrize("routing", [24, 0])
def test_check_and_check_parts_report_every_damaged_byte(routing):
    """Both checks compare the whole expected header at once on their fast path: whatever byte
    is damaged, they report what that byte's field says."""
    lay = layout(routing_nbytes=routing)
    clean, n, _, _ = encoded(lay)
    header, kv, rt = _parts(lay, clean)
    assert lay.check_parts(header, n, KEY, kv, rt) is BlobStatus.OK
    for offset in [*range(112), HEADER_NBYTES, n - 1]:  # every header field, payload ends
        buf = clean.copy()
        buf[offset] ^= 0x01
        want = _status_of_damage(offset)
        assert lay.check(buf, n, KEY) is want, offset
        head, kv2, rt2 = _parts(lay, buf)
        assert lay.check_parts(head, n, KEY, kv2, rt2) is want, offset
    for size, want in (
        (0, BlobStatus.TRUNCATED),
        (HEADER_NBYTES, BlobStatus.TRUNCATED),
        (n - 1, BlobStatus.TRUNCATED),
        (n + 1, BlobStatus.BAD_HEADER),
    ):
        assert lay.check(clean, size, KEY) is want, size
        assert lay.check_parts(header, size, KEY, kv, rt) is want, size
    assert lay.check_parts(header, n, bytes(32), kv, rt) is BlobStatus.WRONG_KEY
    assert lay.check_parts(header, n, KEY + b"x", kv, rt) is BlobStatus.WRONG_KEY  # no key is that long
    other = layout(namespace=namespace_digest("default", b"model-b"), routing_nbytes=routing)
    assert other.check_parts(header, n, KEY, kv, rt) is BlobStatus.WRONG_NAMESPACE
