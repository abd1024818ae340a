"""Every request's work is bounded before it is done, and none of it holds other clients: the
tokenizer threads take each request's prompts in turn, text past the context is refused at a cost
bounded by the context, a large answer is built off the event loop and written in parts (in
process: Starlette's TestClient over the app, one real engine)."""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time

import pytest
from starlette.testclient import TestClient

from kvtier.engine.client import EngineClient
from kvtier.engine.core import EngineCore
from kvtier.serve import api, prompts
from kvtier.serve.api import Server
from kvtier.serve.prompts import FairExecutor
from kvtier.serve.router import BadJSON, parse_client_body

CTX = 256


@pytest.fixture(scope="module")
def server(moe_model):
    engine = EngineClient.in_thread(EngineCore(moe_model, max_model_len=CTX), max_queue=256)
    server = Server(engine, "moe")
    yield server
    server.close()
    engine.shutdown()


@pytest.fixture(scope="module")
def client(server):
    with TestClient(server.app) as c:
        yield c


def post(client, path: str, body: dict | bytes):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return client.post(path, content=data, headers={"Content-Type": "application/json"})


def error(r, status: int = 400) -> dict:
    assert r.status_code == status, r.text[:500]
    return r.json()["error"]


# ---------------------------------------------------------------- fair tokenization
def test_the_tokenizer_threads_take_each_owner_in_turn():
    """A request of 200 prompts queued first delays another request's one prompt by one task per
    thread, not by its whole batch (a FIFO pool ran all 200 first)."""
    pool = FairExecutor(2, "test-fair")
    gate, order = threading.Event(), []

    def task(name: str) -> str:
        gate.wait(10)
        order.append(name)
        return name

    try:
        big = [pool.submit("big", task, f"big{i}") for i in range(200)]
        time.sleep(0.05)  # both threads hold a task of "big"
        small = pool.submit("small", task, "small")
        gate.set()
        assert small.result(10) == "small"
        for f in big:
            f.result(10)
        assert order.index("small") <= 3, order[:10]
        assert sorted(order) == sorted([f"big{i}" for i in range(200)] + ["small"])
    finally:
        pool.close()


def test_a_cancelled_task_is_skipped_and_close_cancels_what_is_queued():
    pool = FairExecutor(1, "test-fair-cancel")
    gate, ran = threading.Event(), []
    try:

        def first_task() -> None:
            gate.wait(10)
            ran.append(1)

        first = pool.submit("a", first_task)
        second = pool.submit("a", ran.append, 2)
        assert second.cancel()  # its client went away before it started
        third = pool.submit("a", ran.append, 3)
        gate.set()
        first.result(10), third.result(10)
        assert ran == [1, 3]
        gate.clear()
        pool.submit("a", gate.wait, 10)
        queued = pool.submit("b", ran.append, 4)
    finally:
        pool.close()
        gate.set()
    assert queued.cancelled() and 4 not in ran


def test_a_short_prompt_is_not_held_behind_a_batch_of_long_ones(client, server, monkeypatch):
    """1,024 prompts of 13,000 characters kept both tokenizer threads for 17 s while an
    11-character prompt waited. Here every encode is slowed; the batch's prompts are counted
    when the short one is tokenized."""
    encodes = {"n": 0}
    tok = server.prompts.tokenizer

    class Slow:
        def __getattr__(self, name):
            return getattr(tok, name)

        def encode(self, text, **kw):
            time.sleep(0.02)
            encodes["n"] += 1
            if text == "hi there":
                encodes["short"] = encodes["n"]
            return tok.encode(text, **kw)

    monkeypatch.setattr(server.prompts, "tokenizer", Slow())
    batch = {"model": "moe", "prompt": ["some words " * 5] * 100, "max_tokens": 1}
    t = threading.Thread(target=post, args=(client, "/v1/completions", batch))
    t.start()
    while encodes["n"] < 4:
        time.sleep(0.005)
    r = post(client, "/v1/completions", {"model": "moe", "prompt": "hi there", "max_tokens": 1})
    assert r.status_code == 200
    t.join(60)
    assert encodes["short"] <= 10, encodes  # behind one of the batch's prompts per thread, not 100


# ---------------------------------------------------------------- bounds before the work
def test_tokenize_refuses_text_past_the_context_after_counting_only_the_context(client, server, monkeypatch):
    """``"ab " x 5,000,000`` took 58.7 s and 4 GB. A text past the context is refused after
    tokenizing about a context's worth of it, whatever its length."""
    monkeypatch.setattr(prompts, "PIECE_CHARS", 512)
    seen = {"chars": 0}
    tok = server.prompts.tokenizer

    class Counting:
        def __getattr__(self, name):
            return getattr(tok, name)

        def encode(self, text, **kw):
            seen["chars"] += len(text)
            return tok.encode(text, **kw)

    monkeypatch.setattr(server.prompts, "tokenizer", Counting())
    text = "ab " * (CTX * 8)  # under the bound by length (a token covers up to 13 characters here)
    err = error(post(client, "/tokenize", {"prompt": text}))
    assert err["param"] == "prompt" and f"over {CTX} tokens" in err["message"], err
    assert seen["chars"] <= 2 * 512, seen  # one or two pieces of the 6,144 characters
    assert post(client, "/tokenize", {"prompt": "ab " * 40}).json()["count"] > 0
    huge = error(post(client, "/tokenize", {"prompt": "ab " * 1_000_000}))  # refused by its length alone
    assert huge["param"] == "prompt" and "3000000 characters" in huge["message"]


def test_chat_messages_past_the_context_are_refused_the_same_way(client, server, monkeypatch):
    monkeypatch.setattr(prompts, "PIECE_CHARS", 512)
    body = {"model": "moe", "messages": [{"role": "user", "content": "ab " * (CTX * 8)}], "max_tokens": 1}
    err = error(post(client, "/v1/chat/completions", body))
    assert err["param"] == "messages" and "over" in err["message"]


def test_detokenize_refuses_more_ids_than_a_context_before_parsing_them(client):
    err = error(post(client, "/detokenize", b'{"tokens": [' + b",".join([b"1"] * (CTX + 1)) + b"]}"))
    assert err["param"] == "tokens" and f"{CTX + 1} ids" in err["message"] and str(CTX) in err["message"]
    assert post(client, "/detokenize", {"tokens": [1] * CTX}).status_code == 200


def test_a_huge_logit_bias_is_refused_by_its_size(client):
    """1.4 million logit_bias entries took 1.27 s to refuse after they were decoded."""
    entries = b",".join(b'"%d": 1' % i for i in range(200_000))
    err = error(post(client, "/v1/completions", b'{"model": "moe", "prompt": [1], "logit_bias": {' + entries + b"}}"))
    assert err["param"] == "logit_bias" and "bytes of JSON" in err["message"]


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 1e18}),
        ("/v1/completions", {"prompt": [1, 2], "max_tokens": 2000}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10**6}),
    ],
)
def test_max_tokens_past_the_context_names_itself_and_the_bound(client, path, body):
    err = error(post(client, path, {"model": "moe", **body}))
    field = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    assert err["param"] == field and f"at most {CTX - 1}" in err["message"], err
    assert "-" not in err["message"].split("at most")[0].split("=")[1].split(" ")[0]  # no negative count


@pytest.mark.parametrize(
    "path, body, param, subject, lower",
    [
        ("/v1/completions", {"prompt": "ab " * (CTX * 4), "max_tokens": 200}, "prompt", "the prompt has", "max_tokens"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "ab " * (CTX * 4)}], "max_completion_tokens": 200},
            "messages",
            "the messages have",
            "max_completion_tokens",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "ab " * (CTX * 4)}], "max_tokens": 200},
            "messages",
            "the messages have",
            "max_tokens",
        ),
    ],
)
def test_a_text_past_what_max_tokens_leaves_says_both_and_what_to_do(client, path, body, param, subject, lower):
    """Not "the prompt has 2 characters, so at least 0 tokens: over the -1488 tokens ...": what the
    context leaves after max_tokens, and that a shorter prompt or fewer tokens fit."""
    err = error(post(client, path, {"model": "moe", **body}))
    msg = err["message"]
    assert err["param"] == param and msg.startswith(subject), err
    assert f"the {CTX - 200} tokens the model's context of {CTX} leaves after {lower}=200" in msg, msg
    assert msg.endswith(f"shorten it, or lower {lower}"), msg
    assert "-" not in msg.split("leaves")[0]  # no negative count


def test_a_token_prompt_past_what_max_tokens_leaves_says_how_many_fit(client):
    err = error(post(client, "/v1/completions", {"model": "moe", "prompt": list(range(3, 203)), "max_tokens": 100}))
    assert err["param"] == "max_tokens"
    assert "the prompt has 200 tokens and max_tokens=100" in err["message"]
    assert f"ask for at most {CTX - 200} tokens, or shorten the prompt" in err["message"], err
    err = error(
        post(client, "/v1/completions", {"model": "moe", "prompt": [list(range(3, 10)), list(range(3, 203))], "max_tokens": 100})
    )
    assert "prompt 1 has 200 tokens" in err["message"] and err["param"] == "max_tokens"


def test_a_full_queue_says_what_waits_in_words_that_fit_the_count():
    from kvtier.engine.client import check_queue
    from kvtier.engine.wire import QueueFull

    with pytest.raises(QueueFull) as e:
        check_queue(1, 2, 2)
    assert str(e.value).startswith("1 sample is waiting and this request adds 2") and "--max-queue" in str(e.value)
    with pytest.raises(QueueFull, match="^3 samples are waiting"):
        check_queue(3, 1, 3)


# ---------------------------------------------------------------- large answers
def test_a_large_answer_written_in_parts_is_the_answer(client, monkeypatch):
    body = {
        "model": "moe",
        "prompt": [[1, 2, 3], [4, 5]],
        "n": 3,
        "max_tokens": 5,
        "temperature": 0,
        "logprobs": 3,
        "echo": True,
        "return_token_ids": True,
    }
    whole = post(client, "/v1/completions", body).json()
    monkeypatch.setattr(api, "INLINE_ENTRIES", 0)
    monkeypatch.setattr(api, "WRITE_BYTES", 100)  # many parts
    built_on: list[str] = []
    answer = Server.answer_parts

    def spy(self, call):
        try:
            asyncio.get_running_loop()
            built_on.append("the event loop")
        except RuntimeError:
            built_on.append("a worker thread")
        yield from answer(self, call)

    monkeypatch.setattr(Server, "answer_parts", spy)
    parts = post(client, "/v1/completions", body)
    assert parts.status_code == 200 and parts.headers["content-type"] == "application/json"
    got = parts.json()
    for a in (whole, got):
        a.pop("id"), a.pop("created")
    assert same_json(got, whole), (got, whole)
    assert built_on == ["a worker thread"]


def same_json(a, b, tol: float = 1e-5) -> bool:
    """Equal JSON values, floats to ``tol``: two runs of one call may differ in the last bits of
    their logprobs (the engine batches a call's prompts as they arrive, and a batch of other
    shapes sums in another order)."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=tol, abs_tol=tol)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_json(a[k], b[k], tol) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_json(x, y, tol) for x, y in zip(a, b))
    return a == b


# ---------------------------------------------------------------- the router's bodies
def test_the_router_refuses_a_list_of_millions_of_numbers_without_decoding_it():
    body = b'{"model": "m", "prompt": [' + b",".join([b"1.5"] * 3_000_000) + b'], "temperature": 1}'
    with pytest.raises(BadJSON) as e:
        parse_client_body(body)
    assert e.value.param == "prompt" and "numbers" in str(e.value)


def test_the_router_refuses_nan_in_a_large_body_and_parses_a_valid_one_as_json_does():
    long_text = "words, and more words " * 100_000
    good = json.dumps({"model": "m", "prompt": long_text, "temperature": 0.5, "logit_bias": {}, "n": 2}).encode()
    assert parse_client_body(good) == json.loads(good)
    with pytest.raises(BadJSON):
        parse_client_body(good[:-1] + b', "top_p": NaN}')
    with pytest.raises(BadJSON):
        parse_client_body(good[:-1] + b', "top_p": 1e999}')


def test_a_call_whose_prompt_is_refused_tokenizes_no_more_of_its_prompts(client, server, monkeypatch):
    """1,024 prompts of 13,000 characters were all tokenized (13 million ids held at once) before
    the first one's 400: now the first refusal cancels the prompts not yet tokenized."""
    encodes = {"n": 0}
    tok = server.prompts.tokenizer

    class Counting:
        def __getattr__(self, name):
            return getattr(tok, name)

        def encode(self, text, **kw):
            encodes["n"] += 1
            time.sleep(0.01)
            return tok.encode(text, **kw)

    monkeypatch.setattr(server.prompts, "tokenizer", Counting())
    prompts = ["ab " * 100] + ["some words"] * 200  # the first: 300 tokens, over the context of 256
    err = error(post(client, "/v1/completions", {"model": "moe", "prompt": prompts, "max_tokens": 1}))
    assert err["param"] == "prompt" and err["message"].startswith("prompt 0 has"), err
    time.sleep(0.2)  # (anything still queued would run now)
    assert encodes["n"] <= 10, encodes
