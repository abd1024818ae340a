"""ChoiceText: a choice's streamed pieces add up to the engine's output text (its stop-string
matcher with ``min_tokens``, else the whole decode), end at the same token, and never carry text
of the stop string that ends the output."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.engine.detok import StopStrings
from kvtier.model.tokenizer import build_byte_tokenizer
from kvtier.serve.choice_text import ChoiceText


class Tok:
    def __init__(self) -> None:
        self.t = build_byte_tokenizer()

    def decode(self, ids, skip_special_tokens=False):
        return self.t.decode(list(ids), skip_special_tokens=skip_special_tokens)


TOK = Tok()
ALPHABET = [ord(c) for c in "abx"] + [0xC3, 0xA9]  # "é" is two byte tokens


def engine_text(ids: list[int], stop: list[str], min_tokens: int) -> tuple[str, int, bool]:
    """What the engine outputs for ``ids`` (its matcher, token by token): text, tokens kept, and
    whether a stop string ended it."""
    m = StopStrings(TOK, stop, True, min_tokens)
    for n, t in enumerate(ids, 1):
        if m.push(t, n):
            return m.text, n, True
    return TOK.decode(ids, skip_special_tokens=True), len(ids), False


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.sampled_from(ALPHABET), max_size=30),
    st.lists(st.text("abxé", min_size=1, max_size=3), max_size=3),
    st.integers(0, 8),
    st.lists(st.integers(1, 3), min_size=1, max_size=30),
)
def test_pieces_are_the_engine_text_and_never_a_cut_stop_string(ids, stop, min_tokens, steps):
    want, kept, stopped = engine_text(ids, stop, min_tokens)
    ct = ChoiceText(TOK, stop, True, min_tokens)
    pieces, used, i = [], 0, 0
    for k in steps * (len(ids) + 1):
        if i >= len(ids) or ct.stopped:
            break
        piece, n = ct.push(ids[i : i + k])
        pieces.append(piece)
        used += n
        i += k
        assert want.startswith("".join(pieces))  # nothing sent that the end cuts
    pieces.append(ct.finish())
    assert "".join(pieces) == ct.text == want
    assert used == kept and ct.stopped == stopped


def test_a_stop_string_completed_at_min_tokens_may_begin_before_it():
    ct = ChoiceText(TOK, ["ab"], True, min_tokens=2)
    assert ct.push([ord("a")]) == ("", 1)  # held: it may begin the stop string
    assert ct.push([ord("b"), ord("x")]) == ("", 1) and ct.stopped and ct.finish() == ""
    ct = ChoiceText(TOK, ["ab"], True, min_tokens=3)  # completed at token 2 < 3: text
    assert ct.push([ord("a"), ord("b")]) == ("ab", 2)
    assert ct.push([ord("x")]) == ("x", 1) and not ct.stopped
