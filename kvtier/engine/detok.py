"""Incremental detokenization with stop strings: the server streams with it, the engine matches
stop strings with it (engine/ never imports serve/).

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
        self._prefix = 0  # window start (token index)
        self._read = 0  # tokens whose text was produced
        self.text = ""  # text produced so far (sent + held back)
        self.sent = 0  # characters of self.text handed out
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

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

        before = decode(self.ids[self._prefix : self._read]) if self._read > self._prefix else ""
        after = decode(self.ids[self._prefix :])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self.text += after[len(before) :]
            self._prefix, self._read = self._read, len(self.ids)

    def _release(self, final: bool) -> str:
        text = self.text
        for s in self.stop:
            i = text.find(s, max(0, self.sent - len(s) + 1))
            if i != -1:
                self.stopped = True
                self.matched = s
                text = self.text = text[:i]
        end = len(text)
        if not final and not self.stopped:  # hold back what may begin a stop string
            for s in self.stop:
                for k in range(min(len(s) - 1, end - self.sent), 0, -1):
                    if s.startswith(text[end - k :]):
                        end = min(end, len(text) - k)
                        break
        out = text[self.sent : end]
        self.sent = max(self.sent, end)
        return out


class StopStrings:
    """The engine's stop strings of one request (``SamplingParams.stop``), on its incremental text.

    A match counts once ``min_tokens`` tokens were generated: the stream runs without stop
    strings until then and gets them at the ``min_tokens``-th token, so a match completed by that
    token or a later one is found (its search starts ``len(stop) - 1`` characters back), one
    completed earlier is not (vLLM's rule). On a match ``text`` ends before the stop string."""

    def __init__(self, tokenizer: Any, stop: Sequence[str], skip_special_tokens: bool, min_tokens: int) -> None:
        self.stream = TextStream(tokenizer, (), skip_special_tokens)
        self.stop = tuple(stop)
        self.min_tokens = min_tokens

    def push(self, token: int, num_generated: int) -> bool:
        """``token`` was appended as generated token number ``num_generated``: did it end the text?"""
        if num_generated >= self.min_tokens:
            self.stream.stop = self.stop
        self.stream.push([token])
        return self.stream.stopped

    @property
    def stopped(self) -> bool:
        return self.stream.stopped

    @property
    def text(self) -> str:
        return self.stream.text
