"""The OpenAI fields RL rollouts and eval harnesses need, through a `kvtier serve`
process: batched prompts x ``n``, ``logprobs`` (completions' and chat's shapes), ``echo``,
penalties, ``seed``, ``min_tokens``, ``stop``, streaming of several choices, usage, nulls and bad
values. References: the offline API (``kvtier.LLM.generate``, same engine settings) and the
official ``openai`` client. PD: a request a hand-off cannot carry runs colocated.

Over 600 lines: one server fixture shared by every field's tests (starting a server per file
would double the suite's time), so the fields live together."""

from __future__ import annotations

import base64
import json
import re
import time
from types import SimpleNamespace

import httpx
import numpy as np
import openai
import pytest
from starlette.testclient import TestClient

import kvtier
from kvtier.model.tokenizer import BYTE_VOCAB_SIZE
from kvtier.serve.api import Server
from kvtier.serve.router import Router

CTX = 512
PROMPTS = ["The cache keeps blocks of", "Rollouts need many samples of", "Eval harnesses score"]
TOL = 1e-5


@pytest.fixture(scope="module")
def server(procs, moe_model):
    return procs(["serve", moe_model, "--max-model-len", CTX, "--served-model-name", "moe"], "fields").wait_ready()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def ref(offline, prompts, **kw):
    return offline.generate(prompts, kvtier.SamplingParams(**kw))


def post(server, path: str, body: dict) -> dict:
    r = httpx.post(server.url + path, json={"model": "moe", **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def stream(server, path: str, body: dict) -> list[dict]:
    """Every chunk of a stream (an in-stream error fails the test)."""
    chunks = []
    with httpx.stream("POST", server.url + path, json={"model": "moe", "stream": True, **body}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                c = json.loads(line[6:])
                assert "error" not in c, c
                chunks.append(c)
    return chunks


def chat_ids(offline, messages):
    tok = offline.tokenizer
    return tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False)


def token_text(offline, t: int) -> str:
    return offline.tokenizer.decode([t], skip_special_tokens=False)


def token_bytes(offline, t: int) -> list[int]:
    """The byte-level demo tokenizer: id b < 256 is the byte b; specials are their text."""
    return [t] if t < BYTE_VOCAB_SIZE else list(token_text(offline, t).encode())


def top(lps: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(lps.items(), key=lambda kv: -kv[1])[:k]


# ---------------------------------------------------------------- batched prompts x n
@pytest.mark.parametrize("n", [1, 2])
def test_batched_prompts_times_n_equal_the_offline_api(server, offline, n):
    want = ref(offline, PROMPTS, max_tokens=8, temperature=0, n=n, ignore_eos=True)
    r = post(
        server,
        "/v1/completions",
        {"prompt": PROMPTS, "n": n, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True},
    )
    assert [c["index"] for c in r["choices"]] == list(range(3 * n))
    for i, w in enumerate(want):
        assert len(w.outputs) == n
        for j, sample in enumerate(w.outputs):
            c = r["choices"][i * n + j]
            assert c["text"] == sample.text and c["token_ids"] == sample.token_ids
            assert c["prompt_token_ids"] == w.prompt_token_ids and c["finish_reason"] == "length"
    u = r["usage"]
    assert u["prompt_tokens"] == sum(len(w.prompt_token_ids) for w in want)  # once per prompt
    assert u["completion_tokens"] == 3 * n * 8 and u["total_tokens"] == u["prompt_tokens"] + 3 * n * 8
    ids = [w.prompt_token_ids for w in want[:2]]
    r2 = post(server, "/v1/completions", {"prompt": ids, "n": n, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert [c["text"] for c in r2["choices"]] == [s.text for w in want[:2] for s in w.outputs]


def test_seeded_samples_equal_the_offline_api(server, offline):
    kw = dict(max_tokens=10, temperature=1.0, top_p=0.9, seed=1234, n=3, ignore_eos=True)
    want = ref(offline, PROMPTS[:2], **kw)
    r = post(server, "/v1/completions", {"prompt": PROMPTS[:2], **kw, "return_token_ids": True})
    got = [c["token_ids"] for c in r["choices"]]
    assert got == [s.token_ids for w in want for s in w.outputs]
    assert len({tuple(t) for t in got[:3]}) > 1  # the samples differ


def test_penalties_seed_and_min_tokens_pass_through(server, offline):
    kw = dict(
        max_tokens=12, temperature=0, presence_penalty=1.5, frequency_penalty=-0.5, repetition_penalty=1.3, min_tokens=4, seed=7
    )
    want = ref(offline, [PROMPTS[0]], **kw)[0]
    r = post(server, "/v1/completions", {"prompt": PROMPTS[0], **kw, "return_token_ids": True})
    assert r["choices"][0]["token_ids"] == want.token_ids and r["choices"][0]["text"] == want.text
    plain = ref(offline, [PROMPTS[0]], max_tokens=12, temperature=0)[0]
    assert plain.token_ids != want.token_ids  # the penalties did something
    chat = [{"role": "user", "content": "repeat after me: la la la"}]
    want = ref(offline, [chat_ids(offline, chat)], **kw)[0]
    r = post(server, "/v1/chat/completions", {"messages": chat, **kw})
    assert r["choices"][0]["message"]["content"] == want.text


@pytest.mark.parametrize("after_min_tokens", [False, True])
def test_stop_strings_end_every_choice_as_the_offline_api(server, offline, after_min_tokens):
    kw = dict(max_tokens=24, temperature=0, ignore_eos=True, n=2)
    free = ref(offline, PROMPTS, **kw)
    stop = [ascii_piece(free[0].text, 4), ascii_piece(free[2].text, 2)]
    want = ref(offline, PROMPTS, **kw, stop=tuple(stop))
    assert want[0].outputs[0].finish_reason == "stop" and not any(s in want[0].outputs[0].text for s in stop)
    if after_min_tokens:  # the first match does not count: it ends before min_tokens
        kw["min_tokens"] = len(want[0].token_ids) + 1
        want = ref(offline, PROMPTS, **kw, stop=tuple(stop))
        assert stop[0] in want[0].text or stop[1] in want[0].text
    body = {"prompt": PROMPTS, **kw, "stop": stop, "return_token_ids": True}
    r = post(server, "/v1/completions", body)
    chunks = stream(server, "/v1/completions", body)
    for i, w in enumerate(want):
        for j in range(2):
            c = r["choices"][i * 2 + j]
            assert c["text"] == w.outputs[j].text and c["finish_reason"] == w.outputs[j].finish_reason
            assert c["token_ids"] == w.outputs[j].token_ids
            mine = [ch["choices"][0] for ch in chunks if ch["choices"][0]["index"] == i * 2 + j]
            assert "".join(m["text"] for m in mine) == c["text"]


def ascii_piece(text: str, after: int) -> str:
    """Two printable ASCII characters of ``text`` from ``after`` on, else one (the model writes
    mostly other bytes)."""

    def printable(piece: str) -> bool:
        return piece.isascii() and piece.isprintable()

    for width in (2, 1):
        for start in (after, 0):
            for i in range(start, len(text) - width + 1):
                if printable(text[i : i + width]):
                    return text[i : i + width]
    raise AssertionError(f"no ASCII in {text!r}")


def test_each_choice_has_its_routed_experts(server, offline):
    want = ref(offline, PROMPTS[:2], max_tokens=5, temperature=1.0, seed=9, n=2, return_routed_experts=True)
    body = {"prompt": PROMPTS[:2], "n": 2, "max_tokens": 5, "temperature": 1.0, "seed": 9, "return_routed_experts": True}
    whole = post(server, "/v1/completions", body)["choices"]
    ends = [c["choices"][0] for c in stream(server, "/v1/completions", body) if c["choices"][0]["finish_reason"]]
    assert sorted(e["index"] for e in ends) == [0, 1, 2, 3]
    for i, w in enumerate(want):
        for j, sample in enumerate(w.outputs):
            for got in (whole[i * 2 + j], next(e for e in ends if e["index"] == i * 2 + j)):
                r = got["routed_experts"]
                arr = np.frombuffer(base64.b64decode(r["data"]), dtype=r["dtype"]).reshape(r["shape"])
                np.testing.assert_array_equal(arr, sample.routed_experts)


# ---------------------------------------------------------------- logprobs
def check_completion_logprobs(offline, lp: dict, token_ids: list[int], want: list, k: int, offset: int = 0):
    assert lp["tokens"] == [token_text(offline, t) for t in token_ids]
    for t, got_lp, got_top, w in zip(token_ids, lp["token_logprobs"], lp["top_logprobs"], want):
        if w is None:
            assert got_lp is None and got_top is None
            continue
        assert got_lp == pytest.approx(w[t], abs=TOL)
        assert len(w) in (k, k + 1) and t in w  # the sampled token and the top k
        want_top: dict[str, float] = {}
        for i, v in top(w, len(w)):  # two ids of one string (U+FFFD): the likelier
            want_top.setdefault(token_text(offline, i), v)
        assert got_top == pytest.approx(want_top, abs=TOL)
    offsets = [offset]
    for s in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(s))
    assert lp["text_offset"] == offsets


def test_completion_logprobs_equal_the_offline_api(server, offline):
    want = ref(offline, PROMPTS[:2], max_tokens=6, temperature=0, n=2, logprobs=3, ignore_eos=True)
    r = post(
        server,
        "/v1/completions",
        {
            "prompt": PROMPTS[:2],
            "n": 2,
            "max_tokens": 6,
            "temperature": 0,
            "logprobs": 3,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    for i, w in enumerate(want):
        for j, sample in enumerate(w.outputs):
            c = r["choices"][i * 2 + j]
            assert c["token_ids"] == sample.token_ids
            check_completion_logprobs(offline, c["logprobs"], sample.token_ids, sample.logprobs, 3)


def test_chat_logprobs_equal_the_offline_api(server, offline):
    messages = [{"role": "user", "content": "what is a KV cache?"}]
    want = ref(offline, [chat_ids(offline, messages)], max_tokens=6, temperature=0, logprobs=4, ignore_eos=True)[0]
    r = post(
        server,
        "/v1/chat/completions",
        {"messages": messages, "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 4, "ignore_eos": True},
    )
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == len(want.token_ids)
    for entry, t, w in zip(content, want.token_ids, want.outputs[0].logprobs):
        assert entry["token"] == token_text(offline, t) and entry["bytes"] == token_bytes(offline, t)
        assert entry["logprob"] == pytest.approx(w[t], abs=TOL)
        assert [(e["token"], e["bytes"]) for e in entry["top_logprobs"]] == [
            (token_text(offline, i), token_bytes(offline, i)) for i, _ in top(w, 4)
        ]
        assert [e["logprob"] for e in entry["top_logprobs"]] == pytest.approx([v for _, v in top(w, 4)], abs=TOL)
    plain = post(
        server,
        "/v1/chat/completions",
        {"messages": messages, "max_tokens": 6, "temperature": 0, "logprobs": True, "ignore_eos": True},
    )
    assert all(e["top_logprobs"] == [] for e in plain["choices"][0]["logprobs"]["content"])
    assert r["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"] == want.text


def test_processed_logprobs_are_those_of_the_sampling_distribution(server, offline):
    kw = dict(max_tokens=5, temperature=0.7, top_k=3, seed=3, logprobs=2, logprobs_mode="processed")
    want = ref(offline, [PROMPTS[1]], **kw)[0].outputs[0]
    r = post(server, "/v1/completions", {"prompt": PROMPTS[1], **kw, "return_token_ids": True})
    check_completion_logprobs(offline, r["choices"][0]["logprobs"], want.token_ids, want.logprobs, 2)


# ---------------------------------------------------------------- echo
def test_echo_puts_the_prompt_before_each_choice(server, offline):
    want = ref(offline, PROMPTS[:2], max_tokens=6, temperature=0, ignore_eos=True)
    r = post(
        server, "/v1/completions", {"prompt": PROMPTS[:2], "echo": True, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    )
    assert [c["text"] for c in r["choices"]] == [p + w.text for p, w in zip(PROMPTS, want)]
    ids = want[0].prompt_token_ids
    r = post(server, "/v1/completions", {"prompt": ids, "echo": True, "max_tokens": 6, "temperature": 0, "ignore_eos": True})
    assert r["choices"][0]["text"] == offline.tokenizer.decode(ids) + want[0].text
    for prompt, n in ((PROMPTS[:2], 1), (PROMPTS[0], 2)):
        chunks = stream(
            server,
            "/v1/completions",
            {"prompt": prompt, "echo": True, "n": n, "max_tokens": 6, "temperature": 0, "ignore_eos": True},
        )
        for i in range(2):
            texts = [c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == i]
            k = i if n == 1 else 0
            assert texts[0] == PROMPTS[k] and "".join(texts) == PROMPTS[k] + want[k].text


def test_echo_with_logprobs_scores_the_prompt(server, offline):
    """What eval harnesses send for a loglikelihood: echo, logprobs, max_tokens 0 (or 1)."""
    prompt = PROMPTS[2]
    want = ref(offline, [prompt], max_tokens=1, temperature=0, prompt_logprobs=2)[0]
    r = post(server, "/v1/completions", {"prompt": prompt, "echo": True, "logprobs": 2, "max_tokens": 0})
    c = r["choices"][0]
    assert c["text"] == prompt and c["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 0
    assert want.prompt_logprobs[0] is None and len(want.prompt_logprobs) == len(want.prompt_token_ids)
    check_completion_logprobs(offline, c["logprobs"], want.prompt_token_ids, want.prompt_logprobs, 2)
    full = ref(offline, [prompt], max_tokens=3, temperature=0, logprobs=2, prompt_logprobs=2, ignore_eos=True)[0]
    r = post(
        server,
        "/v1/completions",
        {"prompt": prompt, "echo": True, "logprobs": 2, "max_tokens": 3, "temperature": 0, "ignore_eos": True},
    )
    c = r["choices"][0]
    assert c["text"] == prompt + full.text
    check_completion_logprobs(
        offline, c["logprobs"], full.prompt_token_ids + full.token_ids, full.prompt_logprobs + full.outputs[0].logprobs, 2
    )


# ---------------------------------------------------------------- a chunk per token
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_stream_sends_one_chunk_per_generated_token(server, path):
    """As vLLM and SGLang do, and as their benches count (a chunk is a token): a token whose bytes
    do not complete a character yet gets a chunk with "" (its text comes with the token that
    completes it), and the last token's chunk carries the finish_reason."""
    chat = "chat" in path
    body: dict[str, object] = {"max_tokens": 40, "ignore_eos": True, "temperature": 0}
    body |= {"messages": [{"role": "user", "content": PROMPTS[2]}]} if chat else {"prompt": PROMPTS[2]}
    chunks = stream(server, path, body | {"stream_options": {"include_usage": True}})
    usage = chunks[-1]["usage"]
    tokens = [c["choices"][0] for c in chunks[:-1]]
    if chat:
        assert tokens[0]["delta"] == {"role": "assistant", "content": ""}
        tokens = tokens[1:]
    texts = [t["delta"].get("content") if chat else t["text"] for t in tokens]
    assert len(tokens) == usage["completion_tokens"] == 40
    assert [t["finish_reason"] for t in tokens] == [None] * 39 + ["length"]
    whole = post(server, path, body)["choices"][0]
    assert "".join(texts) == (whole["message"]["content"] if chat else whole["text"])
    assert "" in texts  # (this model's bytes: some tokens complete no character on their own)


# ---------------------------------------------------------------- streaming several choices
def by_choice(chunks: list[dict]) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for c in chunks:
        for ch in c["choices"]:
            out.setdefault(ch["index"], []).append(ch)
    return out


@pytest.mark.parametrize("n,logprobs", [(1, None), (3, None), (3, 2)])
def test_streamed_choices_reassemble_to_the_whole_answer(server, n, logprobs):
    body = {
        "prompt": PROMPTS[:2],
        "n": n,
        "max_tokens": 12,
        "temperature": 1.0,
        "seed": 11,
        "logprobs": logprobs,
        "return_token_ids": True,
        "stop": ["e"],
    }
    whole = post(server, "/v1/completions", body)
    chunks = stream(server, "/v1/completions", body | {"stream_options": {"include_usage": True}})
    assert chunks[-1]["choices"] == []
    assert all(chunks[-1]["usage"][k] == whole["usage"][k] for k in ("prompt_tokens", "completion_tokens"))
    parts = by_choice(chunks[:-1])
    assert sorted(parts) == list(range(2 * n))
    for i, mine in parts.items():
        want = whole["choices"][i]
        assert [m["finish_reason"] for m in mine[:-1]] == [None] * (len(mine) - 1)
        assert mine[-1]["finish_reason"] == want["finish_reason"]
        assert "".join(m["text"] for m in mine) == want["text"]
        assert sum((m.get("token_ids", []) for m in mine), []) == want["token_ids"]
        lps = [m["logprobs"] for m in mine if m["logprobs"] is not None]
        if logprobs is None:
            assert lps == [] and want["logprobs"] is None
            continue
        for key in ("tokens", "text_offset"):
            assert sum((lp[key] for lp in lps), []) == want["logprobs"][key]
        # the same tokens, their logprobs to float rounding: the second request's prompt is a
        # cache hit, so its last position is computed in a prefill of another length
        got: list[float] = sum((lp["token_logprobs"] for lp in lps), [])
        assert got == pytest.approx(want["logprobs"]["token_logprobs"], abs=1e-5)
        tops: list[dict[str, float]] = sum((lp["top_logprobs"] for lp in lps), [])
        assert [list(t) for t in tops] == [list(t) for t in want["logprobs"]["top_logprobs"]]
        flat = [v for t in tops for v in t.values()]
        assert flat == pytest.approx([v for t in want["logprobs"]["top_logprobs"] for v in t.values()], abs=1e-5)


@pytest.mark.parametrize("logprobs", [False, True])
def test_a_chat_stream_of_three_choices_through_the_openai_client(client, logprobs):
    kw = dict(
        model="moe",
        messages=[{"role": "user", "content": "sample me"}],
        n=3,
        max_tokens=8,
        temperature=1.0,
        seed=5,
        logprobs=logprobs,
        top_logprobs=2 if logprobs else None,
    )
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (
        whole.usage.prompt_tokens,
        whole.usage.completion_tokens,
    )
    for i, want in enumerate(whole.choices):
        mine = [ch for c in chunks for ch in c.choices if ch.index == i]
        assert mine[0].delta.role == "assistant"
        assert "".join(m.delta.content or "" for m in mine) == want.message.content
        assert [m.finish_reason for m in mine if m.finish_reason] == [want.finish_reason]
        streamed = [e for m in mine if m.logprobs is not None for e in m.logprobs.content]
        if not logprobs:
            assert streamed == [] and want.logprobs is None
            continue
        assert [e.model_dump() for e in streamed] == [e.model_dump() for e in want.logprobs.content]


def test_the_openai_client_parses_n_and_logprobs(client, offline):
    r = client.completions.create(
        model="moe", prompt=PROMPTS[:2], n=2, logprobs=2, max_tokens=4, temperature=0, echo=True, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    want = ref(offline, PROMPTS[:2], max_tokens=4, temperature=0, ignore_eos=True)
    for c in r.choices:
        w = want[c.index // 2]
        assert c.text == PROMPTS[c.index // 2] + w.text
        assert c.logprobs.token_logprobs[0] is None and len(c.logprobs.tokens) == len(w.prompt_token_ids) + 4
        assert all(isinstance(d, dict) for d in c.logprobs.top_logprobs[1:])
    chat = client.chat.completions.create(
        model="moe", messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=4, logprobs=True, top_logprobs=3, temperature=0
    )
    assert len(chat.choices) == 2 and chat.usage.completion_tokens == sum(len(c.logprobs.content) for c in chat.choices)
    e = chat.choices[1].logprobs.content[0]
    assert isinstance(e.bytes, list) and len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob >= e.logprob - TOL


@pytest.mark.parametrize("n", [1, 4])
def test_usage_counts_each_prompt_once_and_every_choice(server, offline, n):
    r = post(server, "/v1/completions", {"prompt": PROMPTS, "n": n, "max_tokens": 5, "temperature": 0.8, "ignore_eos": True})
    n_prompt = sum(len(offline.tokenizer.encode(p, add_special_tokens=False)) for p in PROMPTS)
    assert r["usage"]["prompt_tokens"] == n_prompt and r["usage"]["completion_tokens"] == 3 * n * 5
    assert all(len(c["text"]) > 0 for c in r["choices"])
    again = post(server, "/v1/completions", {"prompt": PROMPTS, "n": n, "max_tokens": 5, "ignore_eos": True})
    # each prompt's whole blocks (16 tokens; its last token is computed), once whatever n: on device
    hits = sum((len(offline.tokenizer.encode(p, add_special_tokens=False)) - 1) // 16 * 16 for p in PROMPTS)
    assert hits > 0 and again["usage"]["prompt_tokens_details"]["cached_tokens"] == hits
    assert again["usage"]["kvtier"] == {"cached_tokens_by_tier": {"device": hits, "host": 0, "storage": 0}}


# ---------------------------------------------------------------- nulls and bad values
NEW_NULLABLE = [
    "n",
    "logprobs",
    "echo",
    "best_of",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "stop",
    "min_tokens",
    "repetition_penalty",
    "logprobs_mode",
    "logit_bias",
    "suffix",
]


def test_null_new_fields_mean_their_default(server):
    base = {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}
    want = post(server, "/v1/completions", base)["choices"]
    got = post(server, "/v1/completions", base | {f: None for f in NEW_NULLABLE})["choices"]
    assert [c["text"] for c in got] == [c["text"] for c in want] and got[0]["logprobs"] is None
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
    want = post(server, "/v1/chat/completions", chat)["choices"]
    nulls = {f: None for f in NEW_NULLABLE if f not in ("echo", "best_of", "suffix")}
    got = post(server, "/v1/chat/completions", chat | nulls | {"top_logprobs": None, "response_format": None})
    assert got["choices"][0]["message"] == want[0]["message"] and got["choices"][0]["logprobs"] is None


@pytest.mark.parametrize(
    "path,kw,param",
    [
        ("/v1/completions", {"n": 0}, "n"),
        ("/v1/completions", {"n": 129}, "n"),
        ("/v1/completions", {"logprobs": 21}, "logprobs"),
        ("/v1/completions", {"logprobs": True}, "logprobs"),
        ("/v1/completions", {"best_of": 2}, "best_of"),
        ("/v1/completions", {"presence_penalty": 2.5}, "presence_penalty"),
        ("/v1/completions", {"frequency_penalty": -3}, "frequency_penalty"),
        ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty"),
        ("/v1/completions", {"min_tokens": 5}, "min_tokens"),
        ("/v1/completions", {"min_tokens": CTX, "max_tokens": None}, "min_tokens"),
        ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"echo": True, "logprobs": 1, "stream": True}, "echo"),
        ("/v1/completions", {"echo": "yes"}, "echo"),
        ("/v1/completions", {"logprobs_mode": "softmax"}, "logprobs_mode"),
        ("/v1/completions", {"prompt": ["ok", ""]}, "prompt"),
        ("/v1/completions", {"prompt": ["x"] * 1025}, "prompt"),
        ("/v1/completions", {"prompt": ["ok", "x" * (CTX + 10)]}, "prompt"),  # (alone past the context: the prompt's)
        ("/v1/completions", {"prompt": [[5, 6], [5] * (CTX - 2)]}, "max_tokens"),  # (fits alone: max_tokens=4 is too many)
        ("/v1/completions", {"suffix": "tail"}, "suffix"),
        ("/v1/completions", {"logit_bias": {"12": 3}}, "logit_bias"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": 2}, "logprobs"),
        ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format.type"),
        ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ("/v1/chat/completions", {"echo": True}, "echo"),
        ("/v1/completions", {"min_p": 1.5}, "min_p"),
        ("/v1/completions", {"use_beam_search": True}, "use_beam_search"),
        ("/v1/chat/completions", {"guided_json": {"type": "object"}}, "guided_json"),
        ("/v1/completions", {"regex": "[0-9]+"}, "regex"),
        ("/v1/completions", {"include_stop_str_in_output": True}, "include_stop_str_in_output"),
        ("/v1/completions", {"priority": False}, "priority"),
        ("/v1/completions", {"priority": "x"}, "priority"),
        ("/v1/chat/completions", {"priority": 2**40}, "priority"),
    ],
)
def test_bad_values_are_a_400_naming_the_field(server, path, kw, param):
    body = {
        "model": "moe",
        "max_tokens": 4,
        **({"prompt": "hi"} if "completions" == path[4:] else {"messages": [{"role": "user", "content": "hi"}]}),
        **kw,
    }
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_peers_fields_at_their_no_op_value_are_accepted_and_others_named_unsupported(server):
    """vLLM's and SGLang's clients send some fields kvtier does not implement at their defaults."""
    noop: dict[str, object] = {
        "use_beam_search": False,
        "length_penalty": 1,
        "include_stop_str_in_output": False,
        "spaces_between_special_tokens": True,
        "truncate_prompt_tokens": None,
        "bad_words": [],
        "priority": 0,
        "lora_path": None,
        "regex": None,
    }
    base = {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    assert (
        post(server, "/v1/completions", base | noop)["choices"][0]["text"]
        == post(server, "/v1/completions", base)["choices"][0]["text"]
    )
    r = httpx.post(server.url + "/v1/completions", json={"model": "moe", **base, "use_beam_search": True}, timeout=60)
    assert r.status_code == 400 and "beam search is not supported by kvtier" in r.json()["error"]["message"]


def test_a_priority_is_accepted_and_changes_no_answer(server):
    """vLLM's ``priority`` orders admission only (tests/engine/test_fair_admission.py)."""
    base = {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    want = post(server, "/v1/completions", base)["choices"][0]["text"]
    for priority in (-5, 3, 2**31 - 1):
        assert post(server, "/v1/completions", base | {"priority": priority})["choices"][0]["text"] == want
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "priority": -1}
    assert post(server, "/v1/chat/completions", chat)["choices"][0]["message"]["content"] is not None


def test_min_p_one_keeps_only_the_likeliest_token(server):
    """min_p=1 at temperature 1: every draw is the argmax (greedy's tokens); without it the same
    seed samples other tokens (a min_p that does nothing fails here)."""
    body = {"prompt": PROMPTS[1], "max_tokens": 10, "ignore_eos": True, "return_token_ids": True}
    greedy = post(server, "/v1/completions", body | {"temperature": 0})["choices"][0]["token_ids"]
    capped = post(server, "/v1/completions", body | {"temperature": 1.0, "seed": 5, "min_p": 1.0})["choices"][0]["token_ids"]
    plain = post(server, "/v1/completions", body | {"temperature": 1.0, "seed": 5})["choices"][0]["token_ids"]
    assert capped == greedy and plain != greedy


# ---------------------------------------------------------------- disconnects
def metric(server, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", httpx.get(server.url + "/metrics").text, re.M)
    return float(m.group(1)) if m else 0.0


@pytest.mark.parametrize("streamed", [True, False])
def test_a_client_that_hangs_up_aborts_every_request_of_its_call(server, streamed):
    aborted = 'kvtier_requests_total{finish_reason="abort"}'
    before, gen_before = metric(server, aborted), metric(server, "kvtier_generation_tokens_total")
    body = {"model": "moe", "prompt": PROMPTS, "n": 2, "max_tokens": 300, "ignore_eos": True, "stream": streamed}
    if streamed:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            assert next(line for line in r.iter_lines() if line.startswith("data: {"))
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", json=body, timeout=1.0)
    deadline = time.monotonic() + 30
    while metric(server, "kvtier_requests_running") != 0 or metric(server, aborted) < before + 3:
        assert time.monotonic() < deadline, "requests of the call are still running"
        time.sleep(0.1)
    assert metric(server, aborted) == before + 3  # one engine request per prompt
    assert metric(server, "kvtier_generation_tokens_total") - gen_before < 6 * 300


# ---------------------------------------------------------------- PD
def _fake_server(role: str) -> Server:
    """A server of ``role`` over an engine that must not be reached (the refusals come first):
    the attributes of an EngineClient with a pool that the server reads as it starts."""
    limits = SimpleNamespace(has_pool=True, max_model_len=CTX, vocab_size=BYTE_VOCAB_SIZE, image_tokens=0)
    engine = SimpleNamespace(limits=limits, tokenizer=None, path="moe", check_alive=lambda: None)
    return Server(engine, "moe", role=role)  # type: ignore[arg-type]  # a stand-in for the EngineClient


HANDOFF = {"namespace": "ns", "keys": ["k"], "num_tokens": 3, "first_token": 1, "prompt_token_ids": [1, 2, 3]}


@pytest.mark.parametrize("kw", [{"n": 2}, {"prompt": ["a", "b"]}, {"logprobs": 0}, {"echo": True, "logprobs": 1}])
def test_what_a_hand_off_cannot_carry_runs_colocated(kw, monkeypatch):
    body = {"model": "moe", "prompt": "hi", "max_tokens": 4, **kw}
    p = _fake_server("prefill")
    with TestClient(p.app) as pc:
        r = pc.post("/kvtier/prefill/completions", json=body)
        assert r.status_code == 501, r.text
        got_at_d = []

        def backend(req: httpx.Request) -> httpx.Response:
            if req.url.path == "/health":
                return httpx.Response(200, json={"status": "ok", "engine": "ok"})
            if req.url.host == "p.test":  # the real prefill server's answer
                answer = pc.post(req.url.path, content=req.content, headers={"Content-Type": "application/json"})
                return httpx.Response(answer.status_code, content=answer.content)
            got_at_d.append(json.loads(req.content))
            return httpx.Response(200, json={"choices": []})

        real = httpx.AsyncClient
        monkeypatch.setattr(httpx, "AsyncClient", lambda **a: real(transport=httpx.MockTransport(backend), **a))
        router = Router(["http://p.test"], ["http://d.test"], health_interval=60)
        with TestClient(router.app) as rc:
            assert rc.post("/v1/completions", json=body).status_code == 200
            assert 'kvtier_router_fallbacks_total{reason="not_handed_off"} 1.0' in rc.get("/metrics").text
        assert got_at_d == [body]  # colocated on D: no kvtier_handoff
    d = _fake_server("decode")
    with TestClient(d.app) as dc:
        r = dc.post("/v1/completions", json=body | {"kvtier_handoff": HANDOFF})
        assert r.status_code == 400 and r.json()["error"]["param"] == "kvtier_handoff", r.text
    p.close()
    d.close()
