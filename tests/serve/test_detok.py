"""TextStream: streamed pieces add up to the offline text; stop strings cut and hold back; special
tokens are left out of the text unless asked for."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.engine.detok import TextStream
from kvtier.model.tokenizer import EOS_TOKEN_ID, IM_END_TOKEN_ID, build_byte_tokenizer


class Tok:
    def __init__(self) -> None:
        self.t = build_byte_tokenizer()

    def decode(self, ids, skip_special_tokens=False):
        return self.t.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def encode(self, s):
        return self.t.encode(s, add_special_tokens=False).ids


TOK = Tok()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 255), max_size=60), st.lists(st.integers(1, 4), min_size=1, max_size=60))
def test_pieces_add_up_to_the_offline_decode(ids, steps):
    ts = TextStream(TOK, skip_special_tokens=False)
    out, i, k = "", 0, 0
    while i < len(ids):
        n = steps[k % len(steps)]
        out += ts.push(ids[i : i + n])
        i, k = i + n, k + 1
    out += ts.finish()
    assert out == TOK.decode(ids)


def test_multibyte_characters_are_not_split():
    ids = TOK.encode("héllo €")
    ts = TextStream(TOK)
    pieces = [ts.push([t]) for t in ids] + [ts.finish()]
    assert "".join(pieces) == "héllo €"
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize("stop,want", [(["lo w"], "hel"), (["xyz"], "hello world"), (["o", "l"], "he")])
def test_stop_strings_cut_the_text_and_hold_back_prefixes(stop, want):
    ts = TextStream(TOK, stop)
    got = ""
    for t in TOK.encode("hello world"):
        piece = ts.push([t])
        got += piece
        if ts.stopped:
            break
    got += ts.finish()
    assert got == want
    assert ts.stopped == (want != "hello world")


def test_random_model_outputs_round_trip():
    rng = np.random.default_rng(0)
    for _ in range(50):
        ids = rng.integers(0, 260, 40).tolist()
        ts = TextStream(TOK, skip_special_tokens=False)
        assert "".join(ts.push([t]) for t in ids) + ts.finish() == TOK.decode(ids)


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_are_skipped_by_default_as_the_tokenizer_does(skip):
    ids = TOK.encode("done") + [IM_END_TOKEN_ID] + TOK.encode("\n") + [EOS_TOKEN_ID]
    ts = TextStream(TOK) if skip else TextStream(TOK, skip_special_tokens=False)
    text = "".join(ts.push([t]) for t in ids) + ts.finish()
    assert text == TOK.decode(ids, skip_special_tokens=skip)
    assert (text == "done\n") == skip and ("<|im_end|>" in text) != skip
