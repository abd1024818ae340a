"""The HTTP soak (``kvtier bench soak``) in a short version: mixed normal, streaming, bad, huge,
hung-up and aborted requests against a server with host and storage tiers; then no 5xx, no engine
stop, no leaked block or pin (the cache's invariants at quiescence), every greedy answer equal to
the offline API, no cross-salt hit."""

from __future__ import annotations

import pytest

from kvtier.bench import soak


@pytest.mark.slow
def test_short_soak_meets_every_goal(checkpoint):
    args = soak.build_parser().parse_args(
        [
            "--requests",
            "240",
            "--concurrency",
            "8",
            "--no-progress",
            "--huge-bytes",
            str(20 << 20),
            "--model",
            str(checkpoint("qwen3-tiny")),
        ]
    )
    s = soak.run(args)
    assert s["requests"] == 240
    assert s["five_xx"] == 0, s["unexpected_examples"]
    assert s["unexpected"] == 0, s["unexpected_examples"]
    assert s["engine_error"] is None and s["health_not_200"] == 0
    assert s["leak_check"]["invariants"] == "ok", s["leak_check"]
    assert s["leak_check"]["requests_left"] == 0 and s["leak_check"]["copies_in_flight"] == 0
    assert s["answers_compared"] >= 50 and s["mismatches"] == 0, s["mismatch_examples"]
    assert s["cross_salt_hits"] == 0
    assert s["by_kind"]["huge"] == {"413": s["by_kind"]["huge"].get("413", 0)} and s["by_kind"]["huge"]["413"] >= 1
    assert sum(s["hit_tokens"].values()) > 0 and s["hit_tokens"]["host"] + s["hit_tokens"]["storage"] > 0
    # /health never stopped answering under the load (every poll a 200 within its 10 s timeout,
    # above); its latency is a figure of the machine, which the soak reports (health_p99_ms,
    # latency_goals) and docs/BENCHMARKS.md records: a 2-core CI runner shares its cores with the load
    assert s["health_p99_ms"] > 0 and "health_p99_under_100ms" in s["latency_goals"]
