"""`kvtier demo` (the README's first command) runs on embedded defaults: hits on every tier and,
in float32 on CPU, every output identical to recompute."""

import pytest

from kvtier.cli import main
from kvtier.demo import run_demo


@pytest.mark.slow  # (~9 s on 2 cores: CI runs it with -m slow)
def test_demo_hits_all_three_tiers_and_matches_recompute_in_fp32(tmp_path):
    lines: list[str] = []
    res = run_demo(model_dir=str(tmp_path / "m"), out=lines.append)
    hits = res["hit_tokens"]
    assert hits["device"] > 0 and hits["storage"] > 0, hits
    assert res["prompt_tokens"] > sum(hits.values())
    assert res["dtype"] == "float32"  # auto on CPU
    assert res["outputs"] == 16 and res["identical_outputs"] == 16, lines
    assert "16 of 16 outputs identical to recompute, float32" in lines


def test_demo_dtype_flag_is_checked(capsys):
    try:
        main(["demo", "--dtype", "fp8"])
    except SystemExit:
        pass
    assert "invalid choice: 'fp8'" in capsys.readouterr().err
