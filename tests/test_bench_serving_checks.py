"""The serving benches (``kvtier bench multiturn | longdoc | trace``) never show a figure that
misleads: failed requests fail the bench (exit 1, the first errors on stderr) and count in no
mean or plot point; the workload must fit the served model's context and vocabulary (from its
``/v1/models``, ``--tokenizer`` or ``--vocab``, never a guess); ``--url`` takes the ``openai``
client's base URL. Against a small OpenAI-compatible server in this process that checks prompts as
a real one does (tests/test_bench_serving.py runs the benches against real kvtier servers)."""

from __future__ import annotations

import json
import math
import socket
import threading
import time
from typing import Any, Awaitable, Callable, Iterator, NoReturn

import matplotlib.axes
import pytest
import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from kvtier.bench import longdoc, multiturn, pd_soak, serving, trace_replay
from kvtier.model.tokenizer import VOCAB_SIZE, save_byte_tokenizer

FAST = ["--no-progress", "--warmup", "1", "--warmup-tokens", "8"]


class FakeServer:
    """An OpenAI-compatible server: ``/v1/models`` answers ``models`` (an entry's fields, or the
    raw answer with ``raw``); ``/v1/completions`` streams ``max_tokens`` tokens, refusing (400)
    an id at or over ``vocab`` and a prompt + answer over ``context`` (which it need not say).
    ``paths`` and ``prompts`` record what was asked."""

    def __init__(self, vocab: int = 320, context: int | None = None, raw: str | None = None, **models: object) -> None:
        self.vocab, self.context, self.raw, self.models = vocab, context, raw, models
        self.paths: list[str] = []
        self.prompts: list[tuple[int, int]] = []  # (prompt tokens, max_tokens) of each completion asked
        app = FastAPI()

        @app.middleware("http")
        async def record(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
            self.paths.append(request.url.path)
            return await call_next(request)

        @app.get("/v1/models")
        async def list_models() -> Response:
            if self.raw is not None:
                return PlainTextResponse(self.raw)
            return JSONResponse({"object": "list", "data": [{"id": "fake", "object": "model", **self.models}]})

        @app.post("/v1/completions")
        async def complete(request: Request) -> Response:
            body = await request.json()
            prompt, n = body["prompt"], body["max_tokens"]
            self.prompts.append((len(prompt), n))
            if bad := [t for t in prompt if not 0 <= t < self.vocab]:
                return JSONResponse({"error": {"message": f"token id {bad[0]} is not an int in 0..{self.vocab - 1}"}}, 400)
            if self.context is not None and len(prompt) + n > self.context:
                return JSONResponse({"error": {"message": f"{len(prompt)} + {n} tokens: over the context"}}, 400)

            def stream() -> Iterator[str]:
                for k in range(n):
                    yield f"data: {json.dumps({'choices': [{'text': 'a', 'token_ids': [k % self.vocab]}]})}\n\n"
                usage = {"prompt_tokens": len(prompt), "prompt_tokens_details": {"cached_tokens": 0}}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n"

            return StreamingResponse(stream(), media_type="text/event-stream")

        self.app = app

    def __enter__(self) -> "FakeServer":
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="error", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the fake server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def completions(self) -> int:
        return self.paths.count("/v1/completions")


# multiturn with 3 rounds of 20-token questions and 4-token answers: round 3 resends 2 turns, a
# 68-token prompt, 72 tokens with its answer
THREE_ROUNDS = ["--clients", "2", "--rounds", "3", "--request-length", "20", "--output-length", "4"]


def test_failed_rounds_fail_the_bench_naming_the_configuration_and_plot_as_gaps_not_zero(tmp_path, capsys, monkeypatch):
    drawn: list[list[float]] = []
    plot_line = matplotlib.axes.Axes.plot

    def record(self: matplotlib.axes.Axes, *args: Any, **kw: Any) -> Any:
        drawn.append(list(args[1]))
        return plot_line(self, *args, **kw)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", record)
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    with FakeServer(vocab=320, context=60, vocab_size=320) as fake:  # a context it does not say
        with pytest.raises(SystemExit) as exit_:
            multiturn.main(["--url", fake.url, *THREE_ROUNDS, *FAST, "--json", str(out), "--plot", str(png)])
    assert "kvtier bench multiturn: url: failed requests" in str(exit_.value.code)  # exit status 1
    err = capsys.readouterr().err
    first = "multiturn [url]: 2 of 6 requests failed (0 with a 5xx); the first errors:\n"
    assert first + "  HTTP 400: 68 + 4 tokens: over the context" in err
    res = json.loads(out.read_text())["results"]["url"]  # the JSON and the plot are still written
    assert res["failed_by_round"] == [0, 0, 2] and res["ttft_by_round"][2] is None
    assert res["cached_by_round"][2] is None and res["prompt_by_round"][:2] == [2 * 20, 2 * 44]
    assert len(res["ttfts"]) == 4 and res["ttft_mean"] == pytest.approx(sum(res["ttfts"]) / 4)  # successes only
    per_round, cdf_xs = drawn[0], drawn[1]
    assert all(y > 0 for y in per_round[:2]) and math.isnan(per_round[2])  # a gap, not 0 ms
    assert len(cdf_xs) == 4
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_allow_failures_exits_0_and_still_prints_the_errors(capsys):
    with FakeServer(context=60, vocab_size=320) as fake:
        assert multiturn.main(["--url", fake.url, *THREE_ROUNDS, *FAST, "--allow-failures"]) == 0
    assert "multiturn [url]: 2 of 6 requests failed" in capsys.readouterr().err


def test_a_server_that_died_fails_the_bench(capsys, monkeypatch):
    died = [{"role": "decode", "returncode": -9, "log": "pd-decode.log", "tail": "Killed"}]
    monkeypatch.setattr(serving.Server, "deaths", lambda self: died)
    with FakeServer(vocab_size=320) as fake, pytest.raises(SystemExit, match="url: failed requests or a server"):
        longdoc.main(["--url", fake.url, "--documents", "1", "--document-length", "16", "--questions", "1", *FAST])
    assert "longdoc [url]: the decode server exited with -9 (pd-decode.log):\nKilled" in capsys.readouterr().err


def test_failed_warmup_requests_fail_the_bench_too(capsys):
    # the warm-up's second wave (2 x 40 tokens) is over the context; the timed requests are not
    with FakeServer(context=70, vocab_size=320) as fake, pytest.raises(SystemExit, match="url: failed requests"):
        longdoc.main(
            [
                "--url",
                fake.url,
                "--documents",
                "1",
                "--document-length",
                "24",
                "--questions",
                "1",
                "--no-progress",
                "--warmup",
                "1",
                "--warmup-tokens",
                "40",
            ]
        )
    assert "longdoc [url]: 1 of 2 warm-up requests failed" in capsys.readouterr().err


@pytest.mark.parametrize("suffix", ["", "/", "/v1", "/v1/"])
def test_url_takes_the_base_url_with_or_without_v1(suffix):
    with FakeServer(vocab_size=320) as fake:
        assert serving.base_url(fake.url + suffix) == fake.url
        assert (
            longdoc.main(["--url", fake.url + suffix, "--documents", "1", "--document-length", "16", "--questions", "2", *FAST])
            == 0
        )
    assert fake.completions() == 2 + 2 and "/v1/models" in fake.paths  # two warm-up waves, two questions
    assert not [p for p in fake.paths if "/v1/v1" in p or "//" in p], fake.paths


def test_a_url_without_a_scheme_is_refused_by_name():
    with pytest.raises(SystemExit, match="--url '127.0.0.1:8000': give the server's http:// or https:// URL"):
        serving.base_url("127.0.0.1:8000")


@pytest.mark.parametrize("raw", ['{"object": "list"}', "<html>not here</html>"])
def test_a_models_answer_without_a_data_list_names_the_url_and_what_came_back(raw):
    with FakeServer(raw=raw) as fake, pytest.raises(SystemExit) as exit_:
        longdoc.main(["--url", fake.url + "/v1", "--vocab", "100", *FAST])
    message = str(exit_.value.code)
    assert message.startswith(f"{fake.url}/v1/models answered HTTP 200 with {raw!r}, not an OpenAI model list")
    assert fake.completions() == 0


def test_a_server_that_does_not_say_its_vocabulary_needs_vocab_or_tokenizer(tmp_path):
    save_byte_tokenizer(tmp_path / "tok")
    with FakeServer(vocab=VOCAB_SIZE, max_model_len=512) as fake:  # vLLM's /v1/models: no vocab_size
        with pytest.raises(SystemExit, match=r"does not say its model's vocabulary \(vocab_size\): pass --vocab N"):
            longdoc.main(["--url", fake.url, *FAST])
        assert fake.completions() == 0
        # the tokenizer's ids are the model's: every request is answered (ids below 32000 would be 400s)
        assert (
            longdoc.main(
                [
                    "--url",
                    fake.url,
                    "--tokenizer",
                    str(tmp_path / "tok"),
                    "--documents",
                    "2",
                    "--document-length",
                    "200",
                    "--questions",
                    "1",
                    *FAST,
                ]
            )
            == 0
        )
    with pytest.raises(SystemExit, match="--tokenizer '/no/such/tokenizer': cannot load it"):
        serving.tokenizer_vocab("/no/such/tokenizer")


def test_token_ids_are_drawn_below_the_vocabulary_the_server_says(capsys):
    with FakeServer(vocab=50, vocab_size=50) as fake:
        assert (
            longdoc.main(
                ["--url", fake.url, "--vocab", "32000", "--documents", "2", "--document-length", "300", "--questions", "1", *FAST]
            )
            == 0
        )
    assert "--vocab 32000 is over the vocab_size" in capsys.readouterr().err and fake.completions() == 2 + 2


def test_a_workload_over_the_served_context_is_refused_before_anything_is_sent(monkeypatch):
    with FakeServer(vocab_size=320, max_model_len=64) as fake:
        with pytest.raises(SystemExit) as exit_:
            multiturn.main(["--url", fake.url, *THREE_ROUNDS, *FAST])
        with pytest.raises(SystemExit, match="longdoc: a question is 1040 prompt .* > max_model_len 64"):
            longdoc.main(["--url", fake.url, *FAST])
    assert str(exit_.value.code) == (
        "multiturn: round 3 of a conversation is 68 prompt + 4 output tokens > max_model_len 64 of the served "
        "model (2 rounds fit); lower --rounds/--request-length/--output-length or serve a longer --max-model-len"
    )
    assert fake.completions() == 0

    # a started server's context is its --max-model-len: refused before it starts
    def no_server(*a: object, **kw: object) -> NoReturn:
        raise AssertionError("a server was started")

    monkeypatch.setattr("kvtier.serve.launch.ServerProcess", no_server)
    with pytest.raises(SystemExit, match="round 3 of a conversation is 68 prompt \\+ 4 output tokens > max_model_len 64"):
        multiturn.main(["--model", "qwen3-tiny", "--max-model-len", "64", *THREE_ROUNDS, *FAST])
    with pytest.raises(SystemExit, match="> max_model_len 512 of the served model"):  # the model's own
        multiturn.main(["--model", "qwen3-tiny", "--rounds", "8", "--request-length", "64", *FAST])


def test_trace_replay_leaves_out_the_requests_over_the_context_and_says_how_many(capsys):
    argv = [
        "traces/mooncake_conversation_1k.jsonl",
        "--requests",
        "20",
        "--block-tokens",
        "16",
        "--max-output-tokens",
        "4",
        "--time-scale",
        "0",
    ]
    wanted = trace_replay.prompts(trace_replay.build_parser().parse_args(argv), 320)
    over = sum(1 for _, ids, out in wanted if len(ids) + out > 200)
    assert 0 < over < 20
    with FakeServer(context=200, vocab_size=320, max_model_len=200) as fake:
        assert trace_replay.main(["--url", fake.url, *argv, "--warmup", "0", "--no-progress"]) == 0
    assert f"trace: {over} of 20 requests left out: prompt + output over max_model_len 200" in capsys.readouterr().err
    assert len(fake.prompts) == 20 - over and all(p + n <= 200 for p, n in fake.prompts)


def test_sglang_bench_multiturn_flag_names_are_taken_where_they_mean_the_same():
    for parser in (multiturn.build_parser(), pd_soak.build_parser()):
        args = parser.parse_args(
            [
                "--num-clients",
                "3",
                "--num-rounds",
                "2",
                "--request-length",
                "7",
                "--output-length",
                "5",
                "--max-parallel",
                "2",
                "--request-rate",
                "4",
            ]
        )
        assert (args.clients, args.rounds, args.request_length, args.output_length, args.max_parallel, args.request_rate) == (
            3,
            2,
            7,
            5,
            2,
            4.0,
        )
    with pytest.raises(SystemExit):  # SGLang's --model-path is its tokenizer, not a model to serve
        multiturn.build_parser().parse_args(["--model-path", "m"])


def test_a_pd_answers_cached_tokens_are_the_prefill_servers_as_for_a_colocated_one():
    # through kvtier's router D counts every handed-off token as cached; P's are the prefix hits
    pd = {"prompt_tokens_details": {"cached_tokens": 40}, "kvtier": {"prefill": {"cached_tokens": 32}}}
    assert serving.cached_prompt_tokens(pd) == 32
    assert serving.cached_prompt_tokens({"prompt_tokens_details": {"cached_tokens": 40}}) == 40
    assert serving.cached_prompt_tokens({"prompt_tokens": 7}) is None
