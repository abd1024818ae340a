"""Prompt token ids for the HTTP API, computed off the event loop.

::

    event loop ── await ids(..., owner) ──► tokenizer threads (2), round robin over owners:
        │                                    [cheap length bound] ─► render ─► encode
        │ keeps answering /health, streams, other requests meanwhile

Fairness: every prompt is a task of its owner (the HTTP request it came in); the threads take one
task of each owner in turn (:class:`FairExecutor`), so a request of 1,024 long prompts delays
another request's short prompt by one prompt's tokenization, not by its whole batch.

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
import threading
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable, Hashable

from kvtier.serve.errors import APIError
from kvtier.serve.media import IMAGE_MARK

# A text of more characters a token than this (natural text has 3 to 6) is counted in pieces
# before it is tokenized whole: its cost is then bounded by the budget, not by its length.
COUNT_PAST_CHARS_PER_TOKEN = 8
PIECE_CHARS = 16 * 1024
SLACK_PER_PIECE = 4
_MARK = "\ue000kvtier-content-{}\ue001"  # private-use characters: never in a template
_MARK_RE = re.compile("\ue000kvtier-content-(\\d+)\ue001")


class PromptTokenizer:
    def __init__(self, tokenizer: Any, max_model_len: int, workers: int = 2) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        # vision-language models: the image token each image mark of a message becomes (serve/media.py)
        self.image_token_id: int | None = None
        self._pool = FairExecutor(workers, "kvtier-tokenize")
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
        self._pool.close()

    async def run(self, owner: Hashable, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on a tokenizer thread, in turn with other owners' work (a client that
        goes away cancels what it has not started)."""
        return await asyncio.wrap_future(self._pool.submit(owner, fn, *args))

    # ------------------------------------------------------------------ completions
    async def completion_ids(
        self,
        prompt: str | list[int],
        budget: int,
        add_special_tokens: bool = False,
        owner: Hashable = None,
        after: str = "",
        param: str = "prompt",
    ) -> list[int]:
        """Ids of a completion prompt; ``budget``: the most tokens it may have (``after``: what
        the rest of the context is kept for, as the error says it); ``add_special_tokens``: with
        the tokenizer's own (a BOS), as ``/tokenize`` may ask; ``owner``: whose work it is (the
        request's; None: its own); ``param``: the field it came in."""
        if not isinstance(prompt, str):
            return list(prompt)
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send the prompt as token ids", param)
        return await self.run(_own(owner), self._encode_text, prompt, budget, add_special_tokens, after, param)

    def _encode_text(self, text: str, budget: int, add_special_tokens: bool, after: str = "", param: str = "prompt") -> list[int]:
        self._check_bound(text, budget, param, after)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _check_bound(self, text: str, budget: int, param: str, after: str = "", count: bool = True) -> None:
        """APIError(400) if ``text`` has more than ``budget`` tokens for certain, found at a cost
        bounded by the budget, not by the text: first by its length, then (a text longer than
        ``COUNT_PAST_CHARS_PER_TOKEN`` characters a token) by counting the tokens of its pieces
        up to the budget's worth. A piece ends before a space, where the tokenizers split words
        anyway; ``SLACK_PER_PIECE`` tokens a piece allow for a merge the cut may have prevented."""
        at_least = len(text) // (2 * self._longest_token)
        subject = "the messages have" if param == "messages" else f"the {param} has"
        room = (
            f"the {budget} tokens the model's context of {self.max_model_len} leaves {after}"
            if after
            else f"the model's context of {budget} tokens"
        )
        fix = "shorten it" + (f", or lower {after.split('=')[0].split()[-1]}" if "=" in after else "")
        if at_least > budget:
            raise APIError(
                400,
                f"{subject} {len(text)} characters, so at least {at_least} tokens: more than {room}; {fix}",
                param,
            )
        if not count or len(text) <= budget * COUNT_PAST_CHARS_PER_TOKEN:
            return
        counted = at = pieces = 0
        step = max(PIECE_CHARS, 2 * self._longest_token)
        while at < len(text):
            end = min(len(text), at + step)
            if end < len(text):
                space = text.rfind(" ", at + step // 2, end)
                end = space if space > at else end
            counted += len(self.tokenizer.encode(text[at:end], add_special_tokens=False))
            pieces += 1
            at = end
            if counted - SLACK_PER_PIECE * pieces > budget:
                raise APIError(
                    400,
                    f"{subject} over {budget} tokens (more than {counted - SLACK_PER_PIECE * pieces} in its "
                    f"first {at} of {len(text)} characters): more than {room}; {fix}",
                    param,
                )

    # ------------------------------------------------------------------ chat
    async def chat_ids(
        self, messages: list[dict], add_generation_prompt: bool, budget: int, owner: Hashable = None, after: str = ""
    ) -> list[int]:
        tok = self.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise APIError(400, "this model has no chat template (tokenizer_config.json): use /v1/completions", "messages")
        return await self.run(_own(owner), self._encode_chat, messages, add_generation_prompt, budget, after)

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        except Exception as e:  # a template that rejects these messages is the client's 400
            raise APIError(400, f"the chat template cannot render these messages: {e}", "messages") from None

    def _encode_chat(self, messages: list[dict], add_generation_prompt: bool, budget: int, after: str = "") -> list[int]:
        self._check_bound("".join(m["content"] for m in messages), budget, "messages", after)
        text = self._render(messages, add_generation_prompt)
        self._check_bound(text, budget, "messages", after, count=False)  # (its contents were counted)
        injected = [i for i, m in enumerate(messages) if self._specials is not None and self._specials.search(m["content"])]
        if not injected:
            return self._encode_marked(text, lambda piece: self.tokenizer.encode(piece, add_special_tokens=False))
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
                ids.extend(
                    self._encode_marked("".join(run), lambda p: self._plain.encode_batch([p], add_special_tokens=False)[0].ids)
                )
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

    def _encode_marked(self, text: str, encode: Callable[[str], list[int]]) -> list[int]:
        """``encode(text)``, each image mark (serve/media.py) the image token: the pieces between
        marks are encoded apart, as a tokenizer splits its text at a special token."""
        if self.image_token_id is None or IMAGE_MARK not in text:
            return encode(text)
        ids: list[int] = []
        for k, piece in enumerate(text.split(IMAGE_MARK)):
            if k:
                ids.append(self.image_token_id)
            if piece:
                ids.extend(encode(piece))
        return ids


def _special_tokens(tokenizer: Any) -> set[str]:
    """Every token string the tokenizer turns into a control token when it meets it in text."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    found = {t.content for t in added.values() if getattr(t, "special", False)}
    return found | set(getattr(tokenizer, "all_special_tokens", ()) or ())


def _own(owner: Hashable) -> Hashable:
    return object() if owner is None else owner


class FairExecutor:
    """Worker threads that take queued tasks round robin over their owners: each owner's tasks
    run in the order given, and an owner with one task waits for at most one task of each other
    owner. (concurrent.futures' pool is one FIFO queue: the first request's 1,024 prompts would
    all run before the next request's one.)"""

    def __init__(self, workers: int, name: str) -> None:
        self._queues: dict[Hashable, deque] = {}  # insertion order is the rotation
        self._cv = threading.Condition()
        self._closed = False
        for i in range(workers):
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True).start()

    def submit(self, owner: Hashable, fn: Callable[..., Any], *args: Any) -> Future:
        fut: Future = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("the tokenizer threads are stopped")
            self._queues.setdefault(owner, deque()).append((fut, fn, args))
            self._cv.notify()
        return fut

    def pending(self) -> int:
        with self._cv:
            return sum(map(len, self._queues.values()))

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._queues and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                owner = next(iter(self._queues))
                queue = self._queues.pop(owner)
                fut, fn, args = queue.popleft()
                if queue:
                    self._queues[owner] = queue  # to the back of the rotation
            if not fut.set_running_or_notify_cancel():
                continue  # its client went away
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # the caller's error, raised where it awaits
                fut.set_exception(e)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            queued = [t for q in self._queues.values() for t in q]
            self._queues.clear()
            self._cv.notify_all()
        for fut, _, _ in queued:
            fut.cancel()
