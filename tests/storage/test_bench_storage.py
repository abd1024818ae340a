"""`kvtier bench storage` runs end to end on CPU (small sizes): bytes vs the raw client, TTFT from
storage vs recompute, and the slow pool the cost model refuses."""

from __future__ import annotations

import json

from kvtier.cli import main


def test_bench_storage_bytes_and_ttft(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(
        [
            "bench",
            "storage",
            "--url",
            f"file://{tmp_path}/pool",
            "--objects",
            "16",
            "--object-mib",
            "0.25",
            "--repeat",
            "1",
            "--workers",
            "2",
            "--ttft",
            "--prompt-tokens",
            "200",
            "--early-loads",
            "both",
            "--json",
            str(out),
        ]
    ) in (0, None)
    res = json.loads(out.read_text())
    (b,) = res["bytes"]
    assert b["objects"] == 16 and b["kvtier_get_gbps"] > 0 and b["raw_get_gbps"] > 0 and "get_ratio" in b
    t = res["ttft"]
    assert t["storage"]["outputs_equal"] and t["slow_auto"]["outputs_equal"] and t["slow_always"]["outputs_equal"]
    assert t["storage"]["cached_tokens_by_tier"]["storage"] > 0  # served from the pool
    late = t["storage_late_loads"]
    assert late["outputs_equal"] and late["cached_tokens_by_tier"]["storage"] > 0 and not late["early_loads"]
    assert t["storage"]["early_loads"]
    assert t["slow_always"]["cached_tokens_by_tier"]["storage"] > 0
    assert t["slow_auto"]["fetch_cost"]["decisions"]["recompute"] >= 1  # the slow pool is refused
