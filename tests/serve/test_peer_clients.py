"""What the field's clients send and read, recorded from their sources, against `kvtier serve`:
`vllm bench serve` (vLLM 0.33 vllm/benchmarks/lib/endpoint_request_func.py: openai and
openai-chat), SGLang 0.5.23's bench_serving (sglang-oai), lm-eval 0.4.13's remote tokenizer; and
the endpoints vLLM's and SGLang's clients call besides the OpenAI API, in vLLM's shapes:
/tokenize gives the ids the completions and chat endpoints feed the engine (their usage counts
them), /detokenize inverts it, /tokenizer_info is the checkpoint's tokenizer,
/reset_prefix_cache and /flush_cache empty the device and host tiers (the next identical prompt
is a miss, the one after a hit again), /server_info the engine's configuration; every one of them
behind --api-key. /metrics' TTFT starts where the clients' does, less HTTP: a request waiting for
the engine (the step in progress) waits in both."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest
from transformers import AutoTokenizer

CTX = 512
KEY = "tok-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
TEXT = "A tiered KV cache keeps a prompt's blocks on the device, the host and a pool. "


@pytest.fixture(scope="module")
def server(procs, moe_model):
    return procs(
        ["serve", moe_model, "--max-model-len", CTX, "--served-model-name", "moe", "--num-host-blocks", 64, "--api-key", KEY],
        "tokenize",
    ).wait_ready()


def call(server, method: str, path: str, body: dict | None = None, status: int = 200) -> dict:
    r = httpx.request(method, server.url + path, json=body, headers=AUTH, timeout=60)
    assert r.status_code == status, r.text
    return r.json()


def completion(server, prompt, **kw) -> dict:
    body = {"model": "moe", "prompt": prompt, "max_tokens": 2, "temperature": 0, **kw}
    return call(server, "POST", "/v1/completions", body)


def test_tokenize_gives_the_ids_a_completion_feeds_the_engine(server, moe_model):
    got = call(server, "POST", "/tokenize", {"model": "moe", "prompt": TEXT, "return_token_strs": True})
    tok = AutoTokenizer.from_pretrained(moe_model)
    want = tok.encode(TEXT, add_special_tokens=False)
    assert got["tokens"] == want and got["count"] == len(want) and got["max_model_len"] == CTX
    assert got["token_strs"] == tok.convert_ids_to_tokens(want)
    special = call(server, "POST", "/tokenize", {"prompt": TEXT, "add_special_tokens": True})["tokens"]
    assert special == tok.encode(TEXT, add_special_tokens=True)
    assert completion(server, TEXT)["usage"]["prompt_tokens"] == got["count"]
    # a token-id prompt of those ids is the same prompt: the same greedy answer
    assert completion(server, got["tokens"])["choices"][0]["text"] == completion(server, TEXT)["choices"][0]["text"]


def test_tokenize_a_chat_counts_what_the_chat_endpoint_counts(server):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXT}]
    got = call(server, "POST", "/tokenize", {"model": "moe", "messages": messages})
    chat = call(server, "POST", "/v1/chat/completions", {"model": "moe", "messages": messages, "max_tokens": 2})
    assert got["count"] == chat["usage"]["prompt_tokens"] > len(TEXT)  # the template's tokens too
    plain = call(server, "POST", "/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert plain["count"] < got["count"]


def test_detokenize_inverts_tokenize_and_refuses_ids_outside_the_vocabulary(server):
    ids = call(server, "POST", "/tokenize", {"prompt": TEXT})["tokens"]
    assert call(server, "POST", "/detokenize", {"model": "moe", "tokens": ids}) == {"prompt": TEXT}
    vocab = call(server, "GET", "/v1/models")["data"][0]["vocab_size"]
    err = call(server, "POST", "/detokenize", {"tokens": [1, vocab]}, status=400)["error"]
    assert err["param"] == "tokens" and str(vocab) in err["message"]
    err = call(server, "POST", "/tokenize", {"model": "other", "prompt": "x"}, status=404)["error"]
    assert err["param"] == "model"
    call(server, "POST", "/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, status=400)


def test_tokenizer_info_is_the_checkpoints_tokenizer(server, moe_model):
    info = call(server, "GET", "/tokenizer_info")
    tok = AutoTokenizer.from_pretrained(moe_model)
    assert info["tokenizer_class"] == type(tok).__name__
    assert info["chat_template"] == tok.chat_template and info["eos_token"] == tok.eos_token
    assert info["vocab_size"] == len(tok) and info["model_max_length"] == CTX


@pytest.mark.parametrize("method, path", [("POST", "/reset_prefix_cache"), ("POST", "/flush_cache"), ("GET", "/flush_cache")])
def test_reset_empties_the_device_and_host_tiers(server, method, path):
    prompt = [7 + i % 200 for i in range(100)]  # six whole 16-token blocks
    completion(server, prompt)
    assert completion(server, prompt)["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
    dropped = call(server, method, path)["dropped_blocks"]
    assert dropped["device"] >= 6 and dropped["host"] >= 6  # (and whatever earlier tests left)
    assert completion(server, prompt)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert completion(server, prompt)["usage"]["prompt_tokens_details"]["cached_tokens"] == 96


def test_server_info_has_the_engine_configuration(server, moe_model):
    info = call(server, "GET", "/server_info")
    assert info["model"] == "moe" and info["max_model_len"] == CTX and info["role"] == "colocated"
    assert info["engine_config"]["num_host_blocks"] == 64 and info["engine_config"]["max_model_len"] == CTX
    assert moe_model.name in info["model_path"]


@pytest.mark.parametrize(
    "method, path",
    [
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
        ("GET", "/tokenizer_info"),
        ("POST", "/reset_prefix_cache"),
        ("GET", "/flush_cache"),
        ("GET", "/server_info"),
        ("POST", "/generate"),
        ("GET", "/model_info"),
        ("GET", "/get_model_info"),
        ("GET", "/get_server_info"),
    ],
)
def test_every_one_needs_the_api_key(server, method, path):
    r = httpx.request(method, server.url + path, json={"prompt": "x"}, timeout=30)
    assert r.status_code == 401, r.text


def test_lm_evals_remote_tokenizer_finds_what_it_reads(server, moe_model):
    """lm-eval 0.4.13's local-completions (tokenizer_backend "auto") uses the server's tokenizer
    when GET /tokenizer_info has "eos_token" and POST /tokenize {"prompt", "add_special_tokens":
    false} answers "tokens"; its eos_token_id is the first id of the EOS text tokenized, and it
    renders chats with the template it was given (lm_eval/utils.py RemoteTokenizer)."""
    from jinja2 import Environment

    tok = AutoTokenizer.from_pretrained(moe_model)
    info = call(server, "GET", "/tokenizer_info")
    assert "eos_token" in info
    assert isinstance(call(server, "POST", "/tokenize", {"prompt": "test", "add_special_tokens": False})["tokens"], list)
    eos = call(server, "POST", "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False})["tokens"]
    assert eos[0] == tok.eos_token_id
    chat = [{"role": "user", "content": "hi"}]
    rendered = Environment().from_string(info["chat_template"]).render(messages=chat, add_generation_prompt=True)
    assert rendered == tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)


# ---------------------------------------------------------------- the peers' benchmark clients
def sse(server, path: str, payload: dict) -> list[dict]:
    """The data events of a stream, as the clients split them (``[DONE]`` left out)."""
    events = []
    with httpx.stream("POST", server.url + path, json=payload, headers=AUTH, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def test_vllm_bench_serve_finds_the_model_and_its_root_without_model(server, moe_model):
    entry = call(server, "GET", "/v1/models")["data"][0]  # `vllm bench serve` without --model
    assert entry["id"] == "moe" and entry["root"] == str(moe_model)
    assert entry["max_model_len"] == CTX and entry["parent"] is None and entry["permission"] == []


def test_vllm_bench_serve_openai_times_a_chunk_per_token(server):
    payload = {
        "model": "moe",
        "prompt": TEXT,
        "repetition_penalty": 1.0,
        "max_tokens": 24,
        "logprobs": None,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "temperature": 0.0,
    }  # (--ignore-eos --temperature 0: extra_body)
    events = sse(server, "/v1/completions", payload)
    token_chunks = [e for e in events if e.get("choices")]  # each timed as a token (text may be "")
    usage = next(e["usage"] for e in events if not e.get("choices") and e.get("usage"))
    assert len(token_chunks) == usage["completion_tokens"] == 24 and usage["prompt_tokens"] > 0
    text = "".join(e["choices"][0].get("text") or "" for e in token_chunks)
    assert text == completion(server, TEXT, max_tokens=24, ignore_eos=True)["choices"][0]["text"]


def test_vllm_bench_serve_openai_chat_times_the_role_chunk_then_a_chunk_per_token(server):
    payload = {
        "model": "moe",
        "messages": [{"role": "user", "content": [{"type": "text", "text": TEXT}]}],
        "max_completion_tokens": 16,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    events = sse(server, "/v1/chat/completions", payload)
    token_chunks = [e for e in events if e.get("choices")]
    usage = next(e["usage"] for e in events if not e.get("choices") and e.get("usage"))
    assert token_chunks[0]["choices"][0]["delta"]["role"] == "assistant"  # as vLLM's server sends it
    assert len(token_chunks) == 1 + usage["completion_tokens"] == 17


def test_sglang_bench_serving_oai_reads_text_chunks_and_generated_text(server):
    payload = {
        "model": "moe",
        "prompt": TEXT,
        "temperature": 0.0,
        "best_of": 1,
        "max_tokens": 24,
        "stream": True,
        "ignore_eos": True,
    }
    events = sse(server, "/v1/completions", payload)
    assert all(e["choices"] for e in events)  # it indexes choices[0] of every event
    texts = [e["choices"][0]["text"] for e in events if e["choices"][0]["text"]]
    assert "".join(texts) == completion(server, TEXT, max_tokens=24, ignore_eos=True)["choices"][0]["text"]
    assert len(events) == 24


def test_metrics_ttft_counts_the_wait_for_the_engine_as_the_clients_do(moe_model, monkeypatch):
    """`vllm bench serve` and SGLang's bench_serving time the first token from their send. The engine
    process takes a request between steps and starts its own clock then: at 4 streams on 2 cores
    the wait for the step in progress was a third of the clients' TTFT (108 ms against 66 ms from
    the engine's clock). The server's histogram counts from the request handed to the engine to the
    first token back; here the engine takes each request 0.3 s late, its clock starting then."""
    from starlette.testclient import TestClient

    from kvtier.engine.client import EngineClient
    from kvtier.engine.core import EngineCore
    from kvtier.serve.api import Server

    engine = EngineClient.in_thread(EngineCore(moe_model, max_model_len=CTX))
    inner = engine.generate

    async def late(req):
        await asyncio.sleep(0.3)  # the engine's clock (its request's arrival) starts after this
        async for delta in inner(req):
            yield delta

    monkeypatch.setattr(engine, "generate", late)
    server = Server(engine, "moe")
    body = {"model": "moe", "prompt": TEXT, "max_tokens": 4, "ignore_eos": True}
    try:
        with TestClient(server.app) as c:
            with c.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
                assert r.status_code == 200 and sum(1 for line in r.iter_lines() if line.startswith("data: {")) == 4
            assert c.post("/v1/completions", json=body).json()["usage"]["completion_tokens"] == 4
            text = c.get("/metrics").text
    finally:
        server.close()
        engine.shutdown()

    def sample(name: str) -> float:
        m = re.search(rf"^{name} (\S+)$", text, re.M)
        assert m is not None, f"no {name} in /metrics"
        return float(m.group(1))

    seconds = sample("kvtier_time_to_first_token_seconds_sum")
    count = sample("kvtier_time_to_first_token_seconds_count")
    assert count == 2 and seconds >= 0.6  # each of the 2 includes the 0.3 s the engine was made to wait (a floor, not a speed)
