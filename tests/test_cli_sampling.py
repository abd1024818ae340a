"""`kvtier generate` with the sampling flags RL rollouts use (--logprobs, --prompt-logprobs, penalties,
--min-tokens, --stop): the same answer as the offline API with the same SamplingParams, logprobs
printed with --json."""

from __future__ import annotations

import json

import pytest

import kvtier
from kvtier.cli import main


def test_generate_passes_every_sampling_flag_and_prints_logprobs(checkpoint, capsys):
    model = checkpoint("qwen3-moe-tiny")
    with kvtier.LLM(model) as llm:
        free = llm.generate(["rollouts"], kvtier.SamplingParams(max_tokens=12, ignore_eos=True))[0].text
        stop = next(c for c in free[3:] if c.isascii() and c.isprintable())
        want = llm.generate(
            ["rollouts"],
            kvtier.SamplingParams(
                max_tokens=12,
                ignore_eos=True,
                logprobs=2,
                prompt_logprobs=1,
                presence_penalty=0.5,
                frequency_penalty=0.25,
                repetition_penalty=1.2,
                min_tokens=2,
                stop=(stop, "never"),
            ),
        )[0]
    assert (
        main(
            [
                "generate",
                str(model),
                "--prompt",
                "rollouts",
                "--max-tokens",
                "12",
                "--ignore-eos",
                "--logprobs",
                "2",
                "--prompt-logprobs",
                "1",
                "--presence-penalty",
                "0.5",
                "--frequency-penalty",
                "0.25",
                "--repetition-penalty",
                "1.2",
                "--min-tokens",
                "2",
                "--stop",
                stop,
                "--stop",
                "never",
                "--json",
            ]
        )
        == 0
    )
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["token_ids"] == want.token_ids and res["text"] == want.text
    assert res["finish_reason"] == want.finish_reason
    got = [{int(t): lp for t, lp in d.items()} for d in res["logprobs"]]
    assert [d.keys() for d in got] == [d.keys() for d in want.outputs[0].logprobs]
    for g, w in zip(got, want.outputs[0].logprobs):
        assert list(g.values()) == pytest.approx(list(w.values()), abs=1e-6)
    assert res["prompt_logprobs"][0] is None and len(res["prompt_logprobs"]) == len(want.prompt_token_ids)


def test_bad_sampling_flags_are_an_error_naming_them(checkpoint, capsys):
    model = str(checkpoint("qwen3-moe-tiny"))
    assert main(["generate", model, "--prompt", "x", "--logprobs", "21"]) == 2
    assert "logprobs" in capsys.readouterr().err
    assert main(["generate", model, "--prompt", "x", "--max-tokens", "2", "--min-tokens", "3"]) == 2
    assert "min_tokens" in capsys.readouterr().err
    assert main(["generate", model, "--prompt", "x", "--presence-penalty", "3"]) == 2
    assert "presence_penalty" in capsys.readouterr().err
