"""`kvtier demo` (the README's first command) runs on embedded defaults: hits on every tier,
every output identical to recompute (the demo itself raises otherwise)."""
from kvtier.demo import run_demo


def test_demo_hits_all_three_tiers(tmp_path):
    lines = []
    res = run_demo(model_dir=str(tmp_path / "m"), out=lines.append)
    hits = res["hit_tokens"]
    assert hits["device"] > 0 and hits["storage"] > 0, hits
    assert res["prompt_tokens"] > sum(hits.values())
    assert any("identical to recompute" in line for line in lines)
