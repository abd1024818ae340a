"""SGLang's clients against `kvtier serve`, with the requests they send and the fields they read
recorded from their sources (the sglang package is not installed): `bench_serving`
(python/sglang/benchmark/serving.py, the module `python -m sglang.bench_serving` runs:
`--backend sglang` POSTs /generate, `sglang-oai` and `vllm` /v1/completions, `sglang-oai-chat`
/v1/chat/completions; without --tokenizer it loads the tokenizer from /model_info's
tokenizer_path, else from the /v1/models id; at the end it reads /server_info's
internal_states[0].avg_spec_accept_length), the `cache_hit_kit` multi-turn test
(python/sglang/test/kits/cache_hit_kit.py: /server_info's page_size, /flush_cache, rounds of
streamed /generate with input_ids whose cached_tokens must cover the previous round's prompt and
answer, in whole pages), and the HiCache `bench_multiturn.py` (text histories, data["text"] in
every chunk).

The server is started as `kvtier serve NAME` from the model directory's parent, as a user does:
it is served under NAME as given (vLLM's rule), and requests may name it by its absolute path,
with a trailing slash, or as ./NAME from anywhere. A SIGTERM stops it cleanly: its engine stops
first, and nothing is logged as an error."""

from __future__ import annotations

import json
import os
import random
import signal
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from kvtier.serve.launch import ServerProcess

CTX = 512
TEXT = "A tiered KV cache keeps a prompt's blocks on the device, the host and a pool. "


@pytest.fixture(scope="module")
def served(moe_model, tmp_path_factory):
    """(server, the name it was started with, the model directory): `kvtier serve NAME` run in
    the directory holding NAME."""
    name = moe_model.name
    log = tmp_path_factory.mktemp("sglang") / "serve.log"
    server = ServerProcess(
        ["serve", name, "--max-model-len", CTX, "--num-host-blocks", 64], log, log_level="info", cwd=moe_model.parent
    )
    try:
        yield server.wait_ready(), name, moe_model
    finally:
        server.stop()


def get(server, path: str, **kw) -> dict:
    r = httpx.get(server.url + path, timeout=60, **kw)
    assert r.status_code == 200, r.text
    return r.json()


def post(server, path: str, body: dict, status: int = 200):
    r = httpx.post(server.url + path, json=body, timeout=120)
    assert r.status_code == status, r.text
    return r.json()


def chunks(server, path: str, payload: dict) -> list[dict]:
    """The data events of a stream, split as SGLang's clients split them (`[DONE]` left out)."""
    events = []
    with httpx.stream("POST", server.url + path, json=payload, timeout=120) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        done = False
        for raw in r.iter_lines():
            line = raw.strip()
            if not line:
                continue
            chunk = line[6:] if line.startswith("data: ") else line
            if chunk == "[DONE]":
                done = True
                continue
            assert not done, "data after [DONE]"
            events.append(json.loads(chunk))
        assert done
    return events


def completion(server, model: str, prompt, n: int, **kw) -> dict:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": n,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **kw,
    }
    return post(server, "/v1/completions", body)["choices"][0]


# ---------------------------------------------------------------- bench_serving
def test_bench_serving_finds_the_model_and_a_tokenizer_without_being_given_one(served, tmp_path, monkeypatch):
    server, name, model = served
    entry = get(server, "/v1/models")["data"][0]  # no --model: the first model's id
    assert entry["id"] == name  # the argument as given
    info = get(server, "/model_info")  # no --tokenizer: tokenizer_path, else model_path
    assert get(server, "/get_model_info") == info  # (SGLang's older name)
    assert info["is_generation"] is True and info["model_path"] == str(model)
    assert info["architectures"] == ["Qwen3MoeForCausalLM"] and info["model_type"] == "qwen3_moe"
    monkeypatch.chdir(tmp_path)  # the client runs anywhere: the path is absolute
    tok = AutoTokenizer.from_pretrained(info["tokenizer_path"])
    assert tok.encode(TEXT) == AutoTokenizer.from_pretrained(model).encode(TEXT)


def test_bench_serving_sglang_backend_streams_the_text_so_far_and_counts_tokens(served):
    """async_request_sglang_generate: it keeps the last chunk's text, and times each chunk as
    meta_info.completion_tokens' growth (ITL split over the new tokens)."""
    server, name, model = served
    payload = {
        "text": TEXT,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True},
        "stream": True,
        "lora_path": None,
        "return_logprob": False,
        "return_routed_experts": False,
        "logprob_start_len": -1,
    }
    events = chunks(server, "/generate", payload)
    generated_text, output_len, itl_tokens = "", 16, 0
    last_output_len = 0
    for i, data in enumerate(events):
        if "text" in data and data["text"]:
            generated_text = data["text"]
            output_len = data["meta_info"]["completion_tokens"]
            if i:
                itl_tokens += output_len - last_output_len
            last_output_len = output_len
    assert output_len == 16 and len(events) == 16  # a chunk per token
    want = completion(server, name, TEXT, 16)
    tok = AutoTokenizer.from_pretrained(model)
    # SGLang encodes a text prompt with the tokenizer's special tokens
    assert events[-1]["meta_info"]["prompt_tokens"] == len(tok.encode(TEXT, add_special_tokens=True))
    if tok.encode(TEXT, add_special_tokens=True) == tok.encode(TEXT, add_special_tokens=False):
        assert generated_text == want["text"] and events[-1]["output_ids"] == want["token_ids"]
    meta = [e["meta_info"] for e in events]
    assert [m["completion_tokens"] for m in meta] == list(range(1, 17))
    assert [len(e["output_ids"]) for e in events] == list(range(1, 17))  # the ids so far, as the text
    assert all(m["finish_reason"] is None for m in meta[:-1])
    assert meta[-1]["finish_reason"] == {"type": "length", "length": 16} and meta[-1]["e2e_latency"] > 0
    assert len({m["id"] for m in meta}) == 1 and "index" not in events[0]


def test_bench_serving_sglang_backend_logprobs_are_the_completions_logprobs(served):
    """--return-logprob --top-logprobs-num 2: SGLang's tuples [logprob, token_id, text or None]."""
    server, name, _ = served
    ids = [7 + i % 200 for i in range(40)]  # --tokenize-prompt: input_ids, not text
    payload = {
        "input_ids": ids,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True},
        "stream": True,
        "lora_path": None,
        "return_logprob": True,
        "return_routed_experts": False,
        "logprob_start_len": -1,
        "top_logprobs_num": 2,
    }
    events = chunks(server, "/generate", payload)
    want = completion(server, name, ids, 6, logprobs=2)
    last = events[-1]
    assert last["output_ids"] == want["token_ids"]
    out = last["meta_info"]["output_token_logprobs"]
    assert [e[1] for e in out] == want["token_ids"] and all(e[2] is None for e in out)
    assert [e[0] for e in out] == pytest.approx(want["logprobs"]["token_logprobs"], abs=1e-5)
    tops = last["meta_info"]["output_top_logprobs"]
    assert all(len(t) == 2 and t[0][0] >= t[1][0] for t in tops)
    assert last["meta_info"]["input_token_logprobs"] == []  # -1: the generated tokens' only
    # every chunk carries the logprobs so far (SGLang's cumulative stream)
    assert [len(e["meta_info"]["output_token_logprobs"]) for e in events] == list(range(1, 7))
    # the prompt's, from a start position (not streamed): position 0 has none
    whole = post(server, "/generate", payload | {"stream": False, "logprob_start_len": 0, "return_text_in_logprobs": True})
    prompt = whole["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in prompt] == ids and prompt[0][0] is None and all(isinstance(e[0], float) for e in prompt[1:])
    assert whole["meta_info"]["input_top_logprobs"][0] is None and len(whole["meta_info"]["input_top_logprobs"]) == 40
    assert all(isinstance(e[2], str) for e in whole["meta_info"]["output_token_logprobs"])


@pytest.mark.parametrize("backend", ["sglang-oai", "vllm"])
def test_bench_serving_openai_backends_time_each_text_chunk(served, backend):
    """async_request_openai_completions, with the model id /v1/models gave (the name as given),
    and the cache flush each backend calls (/reset_prefix_cache for vllm, /flush_cache for SGLang's)."""
    server, name, _ = served
    payload = {
        "model": name,
        "prompt": TEXT,
        "best_of": 1,
        "max_tokens": 12,
        "stream": True,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    events = chunks(server, "/v1/completions", payload)
    text = "".join(e["choices"][0]["text"] for e in events if e["choices"][0]["text"])
    assert len(events) == 12 and text == completion(server, name, TEXT, 12)["text"]
    flush = (
        httpx.post(server.url + "/reset_prefix_cache", timeout=60)
        if backend == "vllm"
        else httpx.post(server.url + "/flush_cache", params={"timeout": 60.0}, timeout=60)
    )
    flush.raise_for_status()


def test_bench_serving_oai_chat_reads_content_deltas_and_the_usage_chunk(served):
    server, name, _ = served
    payload = {
        "model": name,
        "messages": [{"role": "user", "content": TEXT}],
        "max_completion_tokens": 8,
        "stream": True,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    events = chunks(server, "/v1/chat/completions", payload)
    usage = [e["usage"] for e in events if e.get("usage")]
    assert usage and usage[-1]["completion_tokens"] == 8
    assert sum(1 for e in events if (e.get("choices") or [{}])[0].get("delta", {}).get("content") is not None) >= 8


def test_bench_serving_reads_no_accept_length_without_drafts(served):
    """After a run, bench_serving reads internal_states[0].get("avg_spec_accept_length"): absent
    here (no speculative decoding), so it prints none and keeps its own ITL."""
    server, name, _ = served
    info = get(server, "/server_info")
    assert get(server, "/get_server_info")["page_size"] == info["page_size"] == 16
    state = info["internal_states"][0]
    assert state.get("avg_spec_accept_length") is None and state["last_gen_throughput"] >= 0
    assert info["model_path"] == info["tokenizer_path"] and os.path.isabs(info["model_path"])
    assert info["context_length"] == CTX and info["served_model_name"] == name


def test_with_drafts_server_info_says_the_accept_length_bench_serving_reads(checkpoint):
    """With speculative decoding, internal_states[0].avg_spec_accept_length: the tokens a verify
    step yields, 1 + the drafts it accepted on average (SGLang's figure), from the engine's counts."""
    from starlette.testclient import TestClient

    from kvtier.engine.client import EngineClient
    from kvtier.engine.core import EngineCore
    from kvtier.serve.api import Server

    engine = EngineClient.in_thread(
        EngineCore(checkpoint("qwen3-mtp-tiny"), max_model_len=256, num_device_blocks=64, block_size=8, num_speculative_tokens=2)
    )
    server = Server(engine, "mtp")
    try:
        with TestClient(server.app) as c:
            r = c.post(
                "/generate",
                json={
                    "input_ids": [3, 4, 5, 6, 7],
                    "sampling_params": {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True},
                },
            )
            assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 24
            state = c.get("/server_info").json()["internal_states"][0]
            spec = c.get("/kvtier/stats").json()["speculative"]
    finally:
        server.close()
        engine.shutdown()
    assert spec["verified_steps"] > 0
    assert state["avg_spec_accept_length"] == pytest.approx(1 + spec["accepted"] / spec["verified_steps"])
    assert 1 <= state["avg_spec_accept_length"] <= 3


# ---------------------------------------------------------------- the cache_hit_kit and bench_multiturn
def kit_request(server, payload: dict) -> dict:
    """cache_hit_kit.async_request_sglang_generate: the output_ids and text of the chunks that
    carry output_ids, prompt_tokens and cached_tokens from the first of them, an ITL per later chunk."""
    out: dict[str, Any] = {"output_ids": [], "text": "", "chunks": 0}
    for data in chunks(server, "/generate", payload):
        if data.get("output_ids"):
            out["output_ids"], out["text"] = data["output_ids"], data.get("text", "")
            if not out["chunks"]:
                out["prompt_len"] = (data.get("meta_info") or {}).get("prompt_tokens", 0)
                out["cached_tokens"] = (data.get("meta_info") or {}).get("cached_tokens", 0)
            out["chunks"] += 1
    return out


def test_the_cache_hit_kits_multiturn_rounds_hit_every_earlier_page(served):
    """run_multiturn_cache_hit_test: after a flush, each client's round r prompt is its history
    (every earlier prompt and answer, output_ids as streamed) plus a new question; its cached_tokens
    (said with the first token) must cover the previous prompt and answer but the last token, in
    whole pages of /server_info's page_size."""
    server, _, _ = served
    page = get(server, "/server_info").get("page_size", 1)  # the kit assumes 1 if absent
    assert page == 16
    httpx.post(server.url + "/flush_cache", timeout=60).raise_for_status()
    rng = random.Random(1)
    clients, rounds, output_length, miss_tolerance = 3, 3, 8, 1
    histories = [[rng.randrange(3, 300) for _ in range(64)] for _ in range(clients)]
    prev_prompt = [0] * clients

    def payload(ids):  # cache_hit_kit.gen_payload
        return {
            "input_ids": ids,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": output_length, "ignore_eos": True},
            "stream": True,
            "stream_options": {"include_usage": True},
            "lora_path": "",
            "return_logprob": False,
            "logprob_start_len": -1,
        }

    for r in range(rounds):
        with ThreadPoolExecutor(clients) as ex:
            answers = list(ex.map(lambda h: kit_request(server, payload(h)), histories))
        for i, a in enumerate(answers):
            expected = 0 if r == 0 else (prev_prompt[i] + output_length - miss_tolerance) // page * page
            assert a["prompt_len"] == len(histories[i]) and len(a["output_ids"]) == output_length == a["chunks"]
            assert a["cached_tokens"] >= expected, (r, i, a["cached_tokens"], expected)
            if r:
                assert expected > 0
            prev_prompt[i] = a["prompt_len"]
            histories[i] = histories[i] + a["output_ids"] + [rng.randrange(3, 300) for _ in range(40)]


def test_hicache_bench_multiturn_reads_the_text_of_every_chunk(served):
    """bench_multiturn.py (older HiCache copies): text histories; data["text"] in every chunk."""
    server, _, _ = served
    history = TEXT * 3
    for turn in range(2):
        payload = {
            "text": history,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True},
            "stream": True,
            "lora_path": "",
            "return_logprob": False,
            "logprob_start_len": -1,
        }
        events = chunks(server, "/generate", payload)
        assert all(isinstance(d["text"], str) for d in events)
        if turn:
            assert events[0]["meta_info"]["cached_tokens"] >= 16 * 3  # the earlier turn's pages
        history += events[-1]["text"] + " And then? "


# ---------------------------------------------------------------- /generate's fields
def test_generate_stops_as_sglang_says_it_stopped(served):
    server, name, model = served
    ids = [5 + i % 90 for i in range(30)]
    free = post(
        server, "/generate", {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}}
    )
    stop_id = free["output_ids"][4]
    got = post(
        server,
        "/generate",
        {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 12, "stop_token_ids": [stop_id]}},
    )
    cut = free["output_ids"].index(stop_id) + 1
    assert got["output_ids"] == free["output_ids"][:cut]  # ends with the stop token
    assert got["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    text = free["text"]
    stop = next(
        (text[k : k + 2] for k in range(3, len(text) - 2) if text[k : k + 2].strip() and text[k : k + 2] not in text[: k + 1]),
        None,
    )
    assert stop is not None, text  # (two characters of the answer, not seen before them)
    got = post(
        server, "/generate", {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 12, "stop": ["zz", stop]}}
    )
    assert got["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert got["text"] == text[: text.index(stop)]


def test_generate_leaves_out_max_new_tokens_as_sglang_does(served):
    """Left out: SGLang's 128, or what the context leaves if less (an explicit value past it is a
    400, above)."""
    server, _, _ = served
    short = post(server, "/generate", {"input_ids": [3, 4, 5], "sampling_params": {"ignore_eos": True}})
    assert short["meta_info"]["completion_tokens"] == 128
    long = post(server, "/generate", {"input_ids": [3] * (CTX - 20), "sampling_params": {"ignore_eos": True}})
    assert long["meta_info"]["completion_tokens"] == 20
    assert long["meta_info"]["finish_reason"] == {"type": "length", "length": 20}


def test_generate_batches_and_samples_answer_in_order(served):
    server, _, _ = served
    body = {
        "input_ids": [[3, 4, 5, 6], [7, 8, 9]],
        "rid": ["a", "b"],
        "sampling_params": {"temperature": 0, "max_new_tokens": 3, "n": 2, "ignore_eos": True},
    }
    whole = post(server, "/generate", body)
    assert isinstance(whole, list) and [w["index"] for w in whole] == [0, 1, 2, 3]
    assert [w["meta_info"]["id"] for w in whole] == ["a_0", "a_1", "b_0", "b_1"]
    assert [w["meta_info"]["prompt_tokens"] for w in whole] == [4, 4, 3, 3]
    assert whole[0]["output_ids"] == whole[1]["output_ids"]  # greedy: the samples agree
    events = chunks(server, "/generate", body | {"stream": True})
    assert sorted({e["index"] for e in events}) == [0, 1, 2, 3]
    last = {e["index"]: e for e in events}
    assert [last[i]["output_ids"] for i in range(4)] == [w["output_ids"] for w in whole]
    one = post(server, "/generate", {"input_ids": [3, 4], "rid": "mine", "sampling_params": {"max_new_tokens": 2}})
    assert isinstance(one, dict) and one["meta_info"]["id"] == "mine"


@pytest.mark.parametrize(
    "body, param, says",
    [
        ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 5000}}, "sampling_params.max_new_tokens", "at most"),
        ({"input_ids": [1, 2], "sampling_params": {"temprature": 1}}, "sampling_params.temprature", "Extra inputs"),
        ({"input_ids": [1, 2], "lora_path": "adapter"}, "lora_path", "not supported"),
        ({"input_ids": [1, 2], "sampling_params": {"regex": "a+"}}, "sampling_params.regex", "not supported"),
        ({"sampling_params": {}}, "text", "text"),
        ({"text": []}, "text", "empty"),
        ({"input_ids": []}, "input_ids", "empty"),
        ({"input_ids": [[1], []]}, "input_ids", "prompt 1 is empty"),
        ({"text": "hi", "input_ids": [1]}, "text", "one of the two"),
        ({"input_ids": [1] * (CTX + 5)}, "input_ids", f"at most {CTX - 1}"),
        ({"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 5}, "logprob_start_len", "at most 1"),
        ({"input_ids": [1, 2], "stream": True, "return_logprob": True, "logprob_start_len": 0}, "logprob_start_len", "streaming"),
        ({"input_ids": [[1, 2], [3]], "rid": ["x"]}, "rid", "one per prompt"),
        ({"input_ids": [[1, 2], [3]], "sampling_params": [{"n": 1}, {"n": 2}]}, "sampling_params", "one object"),
        ({"input_ids": [1, 2], "model": "other"}, "model", "not served here"),
    ],
)
def test_generate_refuses_what_it_cannot_do_by_name(served, body, param, says):
    server, _, _ = served
    err = post(server, "/generate", body, status=404 if param == "model" else 400)["error"]
    assert err["param"] == param and says in err["message"], err


# ---------------------------------------------------------------- the served name
def test_the_model_is_named_by_its_path_spelled_any_way(served, tmp_path, monkeypatch):
    """`vllm bench serve --model /path/to/m` and `--model m`, from any directory: the request's
    model is what the client was given."""
    server, name, model = served
    monkeypatch.chdir(tmp_path)
    for spelled in (name, str(model), str(model) + "/", f"./{name}", f"{name}/"):
        assert completion(server, spelled, [3, 4, 5], 2)["text"] is not None, spelled
        assert post(server, "/generate", {"model": spelled, "input_ids": [3, 4], "sampling_params": {"max_new_tokens": 1}})
    err = post(server, "/v1/completions", {"model": name + "x", "prompt": [3], "max_tokens": 1}, status=404)["error"]
    assert err["param"] == "model" and repr(name) in err["message"]
    assert get(server, "/v1/models")["data"][0]["created"] > 1_600_000_000  # when it started, not 0


# ---------------------------------------------------------------- the end: a clean SIGTERM
def test_a_sigterm_stops_the_engine_first_and_logs_no_error(served):
    """`kill PID` of `kvtier serve`: the server stops its engine (the engine is told, and its
    copies and puts finish), logs at INFO, and exits 0; the engine never finds its parent gone."""
    server, _, _ = served
    os.kill(server.popen.pid, signal.SIGTERM)
    assert server.popen.wait(timeout=120) == 0
    log = server.log.read_text()
    assert "SIGTERM: stopping the engine" in log and "the engine stopped" in log
    assert " ERROR " not in log and " CRITICAL " not in log and "is gone" not in log, log[-3000:]
