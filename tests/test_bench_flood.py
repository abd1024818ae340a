"""`kvtier bench flood`: its scenarios, how each is judged, and a short real run (slow)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvtier.bench import flood


def test_every_attack_has_a_scenario_and_an_unknown_one_is_named():
    assert {"health", "401", "slow-headers", "slow-body", "router-body", "router-tokenize"} <= set(flood.SCENARIOS)
    assert set(flood.ATTACKS) <= set(flood.SCENARIOS)
    args = flood.build_parser().parse_args(["--scenarios", "health,nope"])
    with pytest.raises(SystemExit, match="unknown nope"):
        flood.run(args)


def test_a_flood_is_judged_by_the_job_and_an_attack_by_its_answers_the_prober_and_the_victim():
    r: dict[str, Any] = {  # a scenario's figures, as run() reports them
        "job_time_ratio": 1.05,
        "health_p99_ms": 60.0,
        "victim_ratio": 1.2,
        "rss_growth_mb": 3.0,
        "attack": {"status": {"400": 9, "413": 1}, "answer_ms_max": 40.0},
    }
    assert {k: v["met"] for k, v in flood.goals("flood", r).items()} == {"job_time_ratio": True}
    goals = flood.goals("attack", r)
    assert {k: v["met"] for k, v in goals.items()} == {
        "attack_4xx_ms_max": True,
        "health_p99_ms": False,
        "victim_ratio": True,
        "rss_growth_mb": True,
    }
    r["attack"]["status"] = {"200": 3}  # answered, not refused: no 4xx goal to meet
    assert "attack_4xx_ms_max" not in flood.goals("attack", r)
    assert not flood.goals("flood", dict(r, job_time_ratio=1.2))["job_time_ratio"]["met"]


@pytest.mark.slow
def test_a_short_flood_run_reports_every_scenario_and_the_hostile_bodies_are_4xx(tmp_path, capsys):
    out = tmp_path / "flood.json"
    flood.main(["--scenarios", "401,hostile-bodies", "--streams", "2", "--max-tokens", "16", "--json", str(out)])
    res = json.loads(out.read_text())["results"]
    assert list(res) == ["baseline", "router-baseline", "401", "hostile-bodies"]
    statuses = res["hostile-bodies"]["attack"]["status"]
    assert statuses and all(k.startswith("4") for k in statuses), statuses
    assert res["401"]["attack"]["status"].get("401", 0) > 0
    for r in res.values():
        assert r["tokens_per_s"] > 0 and "goals" in r
