"""Logprobs in OpenAI's shapes, from the engine's ``{token_id: logprob}`` per token (the sampled
or prompt token + the top-k, ``CompletionOutput.logprobs`` / ``RequestOutput.prompt_logprobs``).

::

    completions: {"tokens": [str], "token_logprobs": [lp], "top_logprobs": [{str: lp}], "text_offset": [int]}
                 (a position without logprobs, the prompt's first token: null in the last three)
    chat:        {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}

A token's string is its text alone (``decode([id])``, special tokens written out: a byte that is
part of a multi-byte character is U+FFFD); its ``bytes`` are its own UTF-8 bytes (a byte-level
BPE's raw byte, ``<0xNN>`` pieces' byte). Completions' ``top_logprobs`` are the engine's whole
dict (the sampled token + the top-k, as vLLM); chat's the ``top_logprobs`` most likely. Logprobs
that are not finite (-inf after top-k in ``processed`` mode) are -9999.0, as vLLM, since JSON has
no -inf.
"""

from __future__ import annotations

import math
import re
from typing import Any, Sequence

from kvtier.model.tokenizer import bytes_to_unicode

Logprobs = Sequence[dict[int, float] | None]
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
FLOOR = -9999.0


def _finite(lp: float) -> float:
    lp = float(lp)
    return lp if math.isfinite(lp) else FLOOR


class TokenStrings:
    """Each token id's string and bytes (cached: top-k lists repeat the same ids)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        self._byte_of: dict[str, int] | None = None
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        if decoder is not None and b'"ByteLevel"' in decoder.__getstate__():
            self._byte_of = {c: b for b, c in bytes_to_unicode().items()}
        self._added = set(getattr(tokenizer, "added_tokens_decoder", None) or ())

    def get(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._compute(token_id)
        return hit

    def _compute(self, token_id: int) -> tuple[str, list[int]]:
        tok = self.tokenizer
        if tok is None:  # token ids only: the id is the string
            return f"token_id:{token_id}", list(str(token_id).encode())
        text = tok.decode([token_id], skip_special_tokens=False)
        raw = None
        if token_id not in self._added:
            piece = tok.convert_ids_to_tokens(token_id)
            if isinstance(piece, str):
                if self._byte_of is not None and piece and all(c in self._byte_of for c in piece):
                    raw = bytes(self._byte_of[c] for c in piece)
                elif (m := _BYTE_PIECE.fullmatch(piece)) is not None:
                    raw = bytes([int(m.group(1), 16)])
        return text, list(raw if raw is not None else text.encode("utf-8"))


def completion_logprobs(
    strings: TokenStrings, token_ids: Sequence[int], logprobs: Logprobs, offset: int = 0
) -> tuple[dict[str, list], int]:
    """Completions' shape for ``token_ids``; ``offset``: the text offset of the first. Returns it
    and the offset after the last token."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tid, lps in zip(token_ids, logprobs):
        text = strings.get(tid)[0]
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if lps is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_finite(lps[tid]))
        top: dict[str, float] = {}
        for t, lp in sorted(lps.items(), key=lambda kv: -kv[1]):
            top.setdefault(strings.get(t)[0], _finite(lp))  # two ids of one string: the likelier
        out["top_logprobs"].append(top)
    return out, offset


def chat_logprobs(strings: TokenStrings, token_ids: Sequence[int], logprobs: Logprobs, top: int) -> dict[str, list]:
    """Chat's shape for ``token_ids``, with the ``top`` most likely tokens at each position."""

    def entry(t: int, lp: float) -> dict[str, Any]:
        text, raw = strings.get(t)
        return {"token": text, "logprob": _finite(lp), "bytes": raw}

    content = []
    for tid, lps in zip(token_ids, logprobs):
        assert lps is not None
        best = sorted(lps.items(), key=lambda kv: -kv[1])[:top]
        content.append(entry(tid, lps[tid]) | {"top_logprobs": [entry(t, lp) for t, lp in best]})
    return {"content": content}
