"""Request traces (JSONL, one request per line), as ``kvtier sim`` and the benchmarks read them.

Two formats, told apart per line:

* token ids: ``{"timestamp": ms, "input_ids": [...], "output_length": n}``
* Mooncake: ``{"timestamp": ms, "input_length": n, "output_length": n, "hash_ids": [...]}`` where
  each hash id stands for one block of ``block_tokens`` tokens (512 in the published traces) and
  two requests share a leading hash id only if they share that whole prefix.

Mooncake requests get synthetic token ids: the tokens of hash id ``h`` are a fixed function of
``h``, so equal hash-id prefixes give equal token prefixes and different ones differ. They are
generated (vectorized) each time ``input_ids`` is read, not kept: a whole trace of 12k requests
of 12k tokens would hold 144M Python ints (GBs, and a slow garbage collector).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import numpy as np

_MAX_TOKEN = 2**31 - 1
_MASK = 0xFFFFFFFF


class TraceRequest:
    """One request of a trace: ``input_ids`` given, or made from Mooncake ``hash_ids``;
    ``output_ids``: the answer, where it is known (a serving bench's requests), whose KV the
    engine caches as it decodes (a later turn that repeats it finds it)."""

    __slots__ = (
        "timestamp",
        "_input_ids",
        "output_length",
        "line",
        "hash_ids",
        "input_length",
        "block_tokens",
        "vocab",
        "output_ids",
    )

    def __init__(
        self,
        timestamp: float,
        input_ids: list[int] | None,
        output_length: int,
        line: int,
        hash_ids: list[int] | None = None,
        input_length: int = 0,
        block_tokens: int = 512,
        vocab: int = 1 << 30,
        output_ids: list[int] | None = None,
    ) -> None:
        if input_ids is None and hash_ids is None:
            raise ValueError("a trace request needs input_ids or hash_ids")
        self.timestamp = timestamp
        self._input_ids = input_ids
        self.output_length = output_length
        self.line = line
        self.hash_ids = hash_ids
        self.input_length = len(input_ids) if input_ids is not None else input_length
        self.block_tokens = block_tokens
        self.vocab = vocab
        self.output_ids = output_ids

    @property
    def input_ids(self) -> list[int]:
        if self._input_ids is not None:
            return self._input_ids
        assert self.hash_ids is not None  # (one of the two is given)
        n_blocks = -(-self.input_length // self.block_tokens)
        return tokens_of_hashes(self.hash_ids[:n_blocks], self.block_tokens, self.vocab)[: self.input_length]

    def __repr__(self) -> str:
        return (
            f"TraceRequest(timestamp={self.timestamp}, input_length={self.input_length}, "
            f"output_length={self.output_length}, line={self.line})"
        )


def tokens_of_hashes(hash_ids: list[int], block_tokens: int, vocab: int) -> list[int]:
    """The synthetic tokens of each hash id's block, concatenated: token ``k`` of id ``h`` is a
    multiplicative hash of (h, k) mod 2**32, mod ``vocab`` (distinct ids give distinct blocks, so
    two hash ids never look alike to the block hasher). Computed with numpy for every id at once."""
    if not hash_ids:
        return []
    base = (np.array([h & _MASK for h in hash_ids], dtype=np.uint64) * np.uint64(0x9E3779B1)) & np.uint64(_MASK)
    steps = np.arange(block_tokens, dtype=np.uint64) * np.uint64(0x85EBCA77)
    tokens = ((base[:, None] + steps[None, :]) & np.uint64(_MASK)) % np.uint64(vocab)
    return tokens.ravel().tolist()


class TraceError(ValueError):
    pass


def _field(obj: dict, name: str, line: int, kind: type, *, required: bool = True, default=None):
    if name not in obj:
        if required:
            raise TraceError(f"line {line}: missing field {name!r}")
        return default
    value = obj[name]
    ok = isinstance(value, kind) and not isinstance(value, bool)
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok:
        raise TraceError(f"line {line}: field {name!r} must be {kind.__name__}, got {value!r}")
    return value


def read_trace(path: str | Path, block_tokens: int = 512, vocab: int = 1 << 30, limit: int | None = None) -> list[TraceRequest]:
    """All requests of a JSONL trace, ordered by timestamp (stable for ties)."""
    if block_tokens < 1:
        raise ValueError(f"--trace-block-tokens must be >= 1, got {block_tokens}")
    out = list(_iter_trace(Path(path), block_tokens, vocab, limit))
    out.sort(key=lambda r: r.timestamp)
    return out


def _iter_trace(path: Path, block_tokens: int, vocab: int, limit: int | None) -> Iterator[TraceRequest]:
    if not path.is_file():
        raise TraceError(f"trace file not found: {path}")
    n = 0
    with path.open() as f:
        for line_no, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            if limit is not None and n >= limit:
                return
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as e:
                raise TraceError(f"line {line_no}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise TraceError(f"line {line_no}: expected a JSON object, got {type(obj).__name__}")
            ts = float(_field(obj, "timestamp", line_no, float))
            out_len = _field(obj, "output_length", line_no, int, required=False, default=0)
            if out_len < 0:
                raise TraceError(f"line {line_no}: field 'output_length' must be >= 0, got {out_len}")
            if "input_ids" in obj:
                ids = _field(obj, "input_ids", line_no, list)
                if ids and (set(map(type, ids)) != {int} or min(ids) < 0 or max(ids) > _MAX_TOKEN):
                    bad = next(t for t in ids if type(t) is not int or not 0 <= t <= _MAX_TOKEN)
                    raise TraceError(f"line {line_no}: field 'input_ids' has a bad token id {bad!r}")
            else:
                if "hash_ids" not in obj:
                    raise TraceError(f"line {line_no}: missing field 'input_ids' (or 'hash_ids')")
                hash_ids = _field(obj, "hash_ids", line_no, list)
                length = _field(obj, "input_length", line_no, int)
                if length < 0 or length > len(hash_ids) * block_tokens:
                    raise TraceError(
                        f"line {line_no}: field 'input_length' {length} does not fit {len(hash_ids)} "
                        f"hash ids of {block_tokens} tokens"
                    )
                for h in hash_ids:
                    if type(h) is not int or h < 0:
                        raise TraceError(f"line {line_no}: field 'hash_ids' has a bad id {h!r}")
                if length == 0:
                    raise TraceError(f"line {line_no}: empty prompt")
                n += 1
                yield TraceRequest(ts, None, out_len, line_no, hash_ids, length, block_tokens, vocab)
                continue
            if not ids:
                raise TraceError(f"line {line_no}: empty prompt")
            n += 1
            yield TraceRequest(ts, ids, out_len, line_no)
