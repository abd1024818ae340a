"""Prompt token ids for the HTTP API, computed off the event loop.

::

    event loop ── await ids(...) ──► tokenizer threads (2): [cheap length bound] ─► render ─► encode
        │ keeps answering /health, streams, other requests meanwhile

Tokenizing a prompt of megabytes takes seconds; on the event loop it would stall every other
client (and ``/health``). A text far longer than the context is refused before tokenizing: no
token covers more characters than the longest vocabulary entry, so ``len(text) / (2 * longest)``
is a lower bound on its token count (the 2 leaves room for normalizers that contract text).

Chat messages: the template is rendered to text and tokenized, as ``apply_chat_template`` does.
But then a special-token string in a message's content (``<|im_end|>`` in user text) would become
the control token: a client could end its turn and write the system's. When a content holds such
text, the template is rendered a second time with placeholders to find where each content lies,
and only the template's own special tokens stay control tokens; contents are encoded as plain
text. Contents without special-token text keep today's ids exactly (the plain path is not taken).
"""

from __future__ import annotations

import asyncio
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from kvtier.serve.errors import APIError

_MARK = "\ue000kvtier-content-{}\ue001"  # private-use characters: never in a template
_MARK_RE = re.compile("\ue000kvtier-content-(\\d+)\ue001")


class PromptTokenizer:
    def __init__(self, tokenizer: Any, max_model_len: int, workers: int = 2) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="kvtier-tokenize")
        self._longest_token = 1
        self._specials: re.Pattern | None = None
        self._plain: Any = None  # a copy of the fast tokenizer that never matches specials
        if tokenizer is not None:
            self._longest_token = max((len(t) for t in tokenizer.get_vocab()), default=1)
            specials = _special_tokens(tokenizer)
            if specials:
                self._specials = re.compile("|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)))
            backend = getattr(tokenizer, "backend_tokenizer", None)
            if backend is not None:
                # a copy, not a toggle of the shared one's flag: tokenizer threads run concurrently
                from tokenizers import Tokenizer

                self._plain = Tokenizer.from_str(backend.to_str())
                self._plain.encode_special_tokens = True

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _run(self, fn: Callable[..., list[int]], *args: Any) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # ------------------------------------------------------------------ completions
    async def completion_ids(self, prompt: str | list[int], budget: int, add_special_tokens: bool = False) -> list[int]:
        """Ids of a completion prompt; ``budget``: the most tokens it may have;
        ``add_special_tokens``: with the tokenizer's own (a BOS), as ``/tokenize`` may ask."""
        if not isinstance(prompt, str):
            return list(prompt)
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send the prompt as token ids", "prompt")
        return await self._run(self._encode_text, prompt, budget, add_special_tokens)

    def _encode_text(self, text: str, budget: int, add_special_tokens: bool) -> list[int]:
        self._check_bound(text, budget, "prompt")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _check_bound(self, text: str, budget: int, param: str) -> None:
        at_least = len(text) // (2 * self._longest_token)
        if at_least > budget:
            raise APIError(
                400,
                f"the {param} has {len(text)} characters, so at least {at_least} tokens: over the "
                f"{budget} tokens the model's context of {self.max_model_len} leaves it",
                param,
            )

    # ------------------------------------------------------------------ chat
    async def chat_ids(self, messages: list[dict], add_generation_prompt: bool, budget: int) -> list[int]:
        tok = self.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise APIError(400, "this model has no chat template (tokenizer_config.json): use /v1/completions", "messages")
        return await self._run(self._encode_chat, messages, add_generation_prompt, budget)

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        except Exception as e:  # noqa: BLE001 - a template that rejects these messages is the client's 400
            raise APIError(400, f"the chat template cannot render these messages: {e}", "messages") from None

    def _encode_chat(self, messages: list[dict], add_generation_prompt: bool, budget: int) -> list[int]:
        self._check_bound("".join(m["content"] for m in messages), budget, "messages")
        text = self._render(messages, add_generation_prompt)
        self._check_bound(text, budget, "messages")
        injected = [i for i, m in enumerate(messages) if self._specials is not None and self._specials.search(m["content"])]
        if not injected:
            return self.tokenizer.encode(text, add_special_tokens=False)
        if self._plain is None:
            raise APIError(
                400,
                f"messages[{injected[0]}].content holds special-token text, which this (slow) "
                "tokenizer cannot keep as plain text",
                f"messages.{injected[0]}.content",
            )
        return self._encode_chat_plain_contents(messages, add_generation_prompt, text, injected[0])

    def _encode_chat_plain_contents(self, messages: list[dict], add_generation_prompt: bool, text: str, first: int) -> list[int]:
        """Ids of ``text`` where only special tokens written by the template are control tokens.

        The placeholder render splits the text into template pieces and contents; text between
        two template special tokens is encoded in one piece (as the tokenizer itself does on
        ``text``), with a tokenizer that does not match special tokens."""
        marked = [dict(m, content=_MARK.format(i)) for i, m in enumerate(messages)]
        parts = _MARK_RE.split(self._render(marked, add_generation_prompt))
        # parts: template, content index, template, content index, ..., template
        pieces = [(p, False) if k % 2 == 0 else (messages[int(p)]["content"], True) for k, p in enumerate(parts)]
        if "".join(p for p, _ in pieces) != text:
            raise APIError(
                400,
                f"messages[{first}].content holds special-token text, and this chat template "
                "changes contents, so it cannot be kept as plain text: remove it",
                f"messages.{first}.content",
            )
        specials = self._specials
        assert specials is not None  # (a content holds special-token text)
        ids: list[int] = []
        run: list[str] = []  # text since the last template special token

        def flush() -> None:
            if run:
                ids.extend(self._plain.encode_batch(["".join(run)], add_special_tokens=False)[0].ids)
                run.clear()

        for piece, is_content in pieces:
            if is_content:
                run.append(piece)
                continue
            at = 0
            for m in specials.finditer(piece):
                run.append(piece[at : m.start()])
                flush()
                ids.append(self.tokenizer.convert_tokens_to_ids(m.group()))
                at = m.end()
            run.append(piece[at:])
        flush()
        return ids


def _special_tokens(tokenizer: Any) -> set[str]:
    """Every token string the tokenizer turns into a control token when it meets it in text."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    found = {t.content for t in added.values() if getattr(t, "special", False)}
    return found | set(getattr(tokenizer, "all_special_tokens", ()) or ())
