"""A choice's text as the server sends it, streamed or whole.

The engine decides where a stop string ends an output (``SamplingParams.stop``, with vLLM's rule
for ``min_tokens``: ``engine/detok.py``'s ``StopStrings``). The server runs that same matcher on
the same tokens, so a choice's text is the engine's output text exactly, and it holds back, until
the choice ends, text that may begin a stop string: from the first token on, since a match
completed at token ``min_tokens`` may begin before it. No text of a stop string that ends an
output is ever sent; a match completed before ``min_tokens`` does not end it, and is sent.
"""

from __future__ import annotations

from typing import Any, Sequence

from kvtier.engine.detok import StopStrings


class ChoiceText:
    def __init__(self, tokenizer: Any, stop: Sequence[str] = (), skip_special_tokens: bool = True, min_tokens: int = 0) -> None:
        self.stop = tuple(s for s in stop if s)
        self.matcher = StopStrings(tokenizer, self.stop, skip_special_tokens, min_tokens)
        self.num_tokens = 0  # generated tokens pushed
        self.sent = 0  # characters of the text handed out

    @property
    def stopped(self) -> bool:
        """A stop string ended the text."""
        return self.matcher.stopped

    @property
    def matched(self) -> str | None:
        """The stop string that ended the text (None: none did)."""
        return self.matcher.stream.matched

    @property
    def text(self) -> str:
        """The text handed out so far (all of it, once finished)."""
        return self.matcher.text[: self.sent]

    def push(self, token_ids: Sequence[int]) -> tuple[str, int]:
        """Append generated tokens: the text that can be sent now, and how many of the tokens
        count (all, or those up to the one that completed a stop string)."""
        n = 0
        while n < len(token_ids) and not self.stopped:
            self.num_tokens += 1
            self.matcher.push(token_ids[n], self.num_tokens)
            n += 1
        return self._release(final=False), n

    def finish(self) -> str:
        """The choice ended: the rest of its text (incomplete characters included)."""
        if not self.stopped:
            stream = self.matcher.stream
            stream.stop = ()  # the text's incomplete end, matched no more (as the engine's output)
            stream.finish()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        text = self.matcher.text
        end = len(text)
        if not final and not self.stopped:  # hold back what may begin a stop string
            for s in self.stop:
                for k in range(min(len(s) - 1, len(text) - self.sent), 0, -1):
                    if s.startswith(text[len(text) - k :]):
                        end = min(end, len(text) - k)
                        break
        out = text[self.sent : end]
        self.sent = max(self.sent, end)
        return out
