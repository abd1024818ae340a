"""``kvtier bench kv-quality``: the KL estimate against a direct computation, and a run end to end
on a tiny checkpoint (CPU)."""

from __future__ import annotations

import json
import math

import pytest

from kvtier.bench.kv_quality import compare, main, top_kl


def test_top_kl_is_the_kl_of_the_renormalized_distributions():
    ref = {1: math.log(0.5), 2: math.log(0.3)}
    other = {1: math.log(0.2), 3: math.log(0.1)}  # token 2 is not among other's: it takes other's least, 0.1
    p, q = [0.5 / 0.8, 0.3 / 0.8], [0.2 / 0.3, 0.1 / 0.3]
    assert top_kl(ref, other) == pytest.approx(sum(a * math.log(a / b) for a, b in zip(p, q)))
    assert top_kl(ref, ref) == pytest.approx(0.0)


def test_agreement_counts_identical_continuations_and_tokens_before_the_first_difference():
    res = compare([[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 3, 4], [5, 6, 0, 8]], [[{1: 0.0}]], [[{1: 0.0}]])
    assert res["identical_share"] == 0.5 and res["mean_share_before_first_difference"] == 0.75
    assert res["mean_kl_top20"] == 0.0 and res["tokens_scored"] == 1


def test_kv_quality_runs_end_to_end(checkpoint, tmp_path, capsys):
    out = tmp_path / "q.json"
    args = ["--model", str(checkpoint("llama-tiny")), "--num-prompts", "3", "--input-length", "20", "--output-length", "6"]
    assert main([*args, "--num-device-blocks", "64", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["continuations"] == 3 and res["tokens_scored"] == 18 and res["scales"]["scales"] == "calibrated"
    assert 0 <= res["identical_share"] <= 1 and res["mean_kl_top20"] >= 0
    assert "fp8 KV vs float32 KV" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([*args, "--kv-cache-dtype", "auto"])
