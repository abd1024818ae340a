"""Incremental detokenization with stop strings, for streaming.

Decoding the whole output again for every new token costs O(n^2); instead each step decodes a
short window: the text of ``ids[prefix:read]`` (already sent) and of ``ids[prefix:]``, and sends
the difference. A window that ends in U+FFFD (a multi-byte character cut between tokens) waits
for the next token. Windows start only where the text was complete, so the pieces add up to
``tokenizer.decode(ids)`` exactly (what the offline API returns).

Stop strings: text that could be the start of a stop string is held back until it is not; on a
match the text is cut before the stop string and the stream ends (``stopped``).

``skip_special_tokens`` (default, as the offline API and vLLM): special tokens (``<|im_end|>``,
``<|endoftext|>``) add no text.
"""
from __future__ import annotations

from typing import Any, Sequence


class TextStream:
    def __init__(self, tokenizer: Any, stop: Sequence[str] = (), skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(s for s in stop if s)
        self.ids: list[int] = []
        self._prefix = 0          # window start (token index)
        self._read = 0            # tokens whose text was produced
        self.text = ""            # text produced so far (sent + held back)
        self.sent = 0             # characters of self.text handed out
        self.stopped = False

    def push(self, token_ids: Sequence[int]) -> str:
        """Append tokens; returns the text that can be sent now ('' if none)."""
        if self.stopped or not token_ids:
            return ""
        self.ids.extend(token_ids)
        self._decode(final=False)
        return self._release(final=False)

    def finish(self) -> str:
        """The request ended: the rest of the text (incomplete characters included)."""
        if self.stopped:
            return ""
        self._decode(final=True)
        return self._release(final=True)

    def _decode(self, final: bool) -> None:
        if self.tokenizer is None:
            return
        def decode(ids: list[int]) -> str:
            return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        before = decode(self.ids[self._prefix:self._read]) if self._read > self._prefix else ""
        after = decode(self.ids[self._prefix:])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self.text += after[len(before):]
            self._prefix, self._read = self._read, len(self.ids)

    def _release(self, final: bool) -> str:
        text = self.text
        for s in self.stop:
            i = text.find(s, max(0, self.sent - len(s) + 1))
            if i != -1:
                self.stopped = True
                text = self.text = text[:i]
        end = len(text)
        if not final and not self.stopped:       # hold back what may begin a stop string
            for s in self.stop:
                for k in range(min(len(s) - 1, end - self.sent), 0, -1):
                    if s.startswith(text[end - k:]):
                        end = min(end, len(text) - k)
                        break
        out = text[self.sent:end]
        self.sent = max(self.sent, end)
        return out
