"""``kvtier sim`` on tiny traces written here and on the shipped Mooncake samples, through the CLI
entry point."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.bench.sim import SimConfig
from kvtier.bench.traces import TraceError, read_trace, tokens_of_hashes
from kvtier.cache.policy import default_write_policy
from kvtier.cli import main

TIERS = {"device", "host", "storage"}
SAMPLES = Path(__file__).resolve().parents[2] / "traces"


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture
def trace(tmp_path):
    shared = list(range(1, 65))
    return write_jsonl(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 0, "input_ids": shared + [100, 101, 102], "output_length": 4},
            {"timestamp": 1, "input_ids": shared + [200, 201], "output_length": 4},
            {"timestamp": 2, "input_length": 40, "output_length": 2, "hash_ids": [7, 8, 9]},
            {"timestamp": 3, "input_length": 47, "output_length": 2, "hash_ids": [7, 8, 10]},
        ],
    )


def run_json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_sim_reads_both_formats_and_reports_per_tier(trace, capsys):
    res = run_json(
        capsys,
        [
            "sim",
            str(trace),
            "--json",
            "--trace-block-tokens",
            "16",
            "--device-blocks",
            "64",
            "--host-blocks",
            "64",
            "--storage-blocks",
            "inf",
        ],
    )
    assert res["requests"] == 4
    assert res["prompt_tokens"] == 67 + 66 + 40 + 47
    for field in ("hit_tokens", "evictions"):
        assert set(res[field]) == TIERS
    assert set(res["bytes_moved"]) == {"host_to_device", "device_to_host", "storage_to_host", "host_to_storage"}
    assert res["hit_tokens"]["device"] == 64 + 32  # shared 64 ids; hash ids 7, 8 = 32 tokens


def test_sim_table_output(trace, capsys):
    assert main(["sim", str(trace), "--trace-block-tokens", "16"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("requests 4") and "device" in out and "bytes moved" in out


@pytest.mark.parametrize(
    "line, field",
    [
        ('{"timestamp": 0, "input_length": 10, "hash_ids": [1, -2]}', "'hash_ids'"),
        ('{"timestamp": 0, "input_length": 99999, "hash_ids": [1]}', "'input_length'"),
        ('{"timestamp": "soon", "input_ids": [1, 2]}', "'timestamp'"),
        ('{"timestamp": 0, "input_ids": [1, true]}', "'input_ids'"),
        ('{"timestamp": 0, "input_ids": [1, 2], "output_length": -1}', "'output_length'"),
        ('{"timestamp": 0}', "'input_ids'"),
        ('{"timestamp": 0, "input_ids": [1]', "not valid JSON"),
    ],
)
def test_malformed_line_is_named_with_its_field(tmp_path, capsys, line, field):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"timestamp": 0, "input_ids": [1, 2, 3]}, line])
    assert main(["sim", str(path)]) == 2
    err = capsys.readouterr().err
    assert "line 2" in err and field in err


def test_missing_trace_file_returns_2(tmp_path, capsys):
    assert main(["sim", str(tmp_path / "nope.jsonl")]) == 2
    assert "not found" in capsys.readouterr().err


def test_trace_is_ordered_by_timestamp(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"timestamp": 5, "input_ids": [1]}, {"timestamp": 1, "input_ids": [2]}])
    assert [r.line for r in read_trace(path)] == [2, 1]
    with pytest.raises(TraceError):
        read_trace(tmp_path / "missing.jsonl")


def tokens_of_hash(h: int, block_tokens: int, vocab: int) -> list[int]:
    """The synthetic tokens of one hash id, one at a time in plain Python: a multiplicative hash
    of (id, position) mod 2**32, the reference the vectorized ``tokens_of_hashes`` must match."""
    base = (h * 0x9E3779B1) & 0xFFFFFFFF
    return [((base + k * 0x85EBCA77) & 0xFFFFFFFF) % vocab for k in range(block_tokens)]


def test_synthetic_tokens_are_deterministic_and_distinct(tmp_path):
    path = write_jsonl(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 0, "input_length": 20, "hash_ids": [3, 4]},
            {"timestamp": 1, "input_length": 20, "hash_ids": [3, 5]},
        ],
    )
    a, b = read_trace(path, block_tokens=16)
    assert a.input_ids == read_trace(path, block_tokens=16)[0].input_ids
    assert a.input_ids[:16] == b.input_ids[:16] and a.input_ids[16:] != b.input_ids[16:]
    assert len(a.input_ids) == 20
    hs = [0, 1, 2, 2**32 - 1, 2**40 + 3]
    assert tokens_of_hashes(hs, 8, 1 << 30) == [t for h in hs for t in tokens_of_hash(h, 8, 1 << 30)]
    assert len({tuple(tokens_of_hashes([h], 8, 1 << 30)) for h in range(1000)}) == 1000


def test_every_tier_accepts_inf(trace, capsys):
    res = run_json(
        capsys,
        [
            "sim",
            str(trace),
            "--json",
            "--trace-block-tokens",
            "16",
            "--device-blocks",
            "inf",
            "--host-blocks",
            "inf",
            "--storage-blocks",
            "inf",
        ],
    )
    assert res["hit_tokens"]["device"] == 64 + 32 and res["evictions"]["device"] == 0
    assert res["config"]["device_blocks"] == "inf"


def _storage_only_trace(tmp_path):
    """The same 8-block prompt twice, 40 others between: the second one hits only in storage."""
    shared = list(range(1, 129))
    rows = [{"timestamp": 0, "input_ids": shared + [999], "output_length": 1}]
    rows += [{"timestamp": 1 + i, "input_ids": [1000 + 200 * i + j for j in range(129)], "output_length": 1} for i in range(40)]
    rows.append({"timestamp": 100, "input_ids": shared + [998], "output_length": 1})
    return write_jsonl(tmp_path / "s.jsonl", rows)


@pytest.mark.parametrize("gbps,fetched", [(100.0, True), (0.001, False)])
def test_sim_fetches_storage_hits_only_when_cheaper_than_recompute(tmp_path, capsys, gbps, fetched):
    res = run_json(
        capsys,
        [
            "sim",
            str(_storage_only_trace(tmp_path)),
            "--json",
            "--block-size",
            "16",
            "--device-blocks",
            "16",
            "--host-blocks",
            "16",
            "--storage-blocks",
            "inf",
            "--write-policy",
            "write_through",
            "--prefill-tokens-per-s",
            "20000",
            "--storage-gbps",
            str(gbps),
            "--storage-latency-ms",
            "0.1",
        ],
    )
    assert res["hit_tokens"]["storage"] == (128 if fetched else 0)
    assert res["fetch_decisions"] == {"fetch": int(fetched), "partial": 0, "recompute": int(not fetched), "explore": 0}


@pytest.mark.parametrize(
    "flag,value,msg",
    [
        ("--device-blocks", "0", "at least one block"),
        ("--storage-gbps", "0", "positive"),
        ("--storage-latency-ms", "-1", "non-negative"),
    ],
)
def test_sim_bad_tier_and_cost_flags_are_named(trace, capsys, flag, value, msg):
    with pytest.raises(SystemExit):
        main(["sim", str(trace), flag, value])
    assert msg in capsys.readouterr().err


@pytest.mark.parametrize("name,requests", [("mooncake_conversation_1k.jsonl", 1000), ("mooncake_synthetic_500.jsonl", 500)])
def test_shipped_samples_are_mooncake_traces_with_shared_prefixes(name, requests):
    rows = [json.loads(line) for line in (SAMPLES / name).read_text().splitlines()]
    assert len(rows) == requests
    assert all(set(r) == {"timestamp", "input_length", "output_length", "hash_ids"} for r in rows)
    # one hash id per 512-token block of the prompt, the last one partial
    assert all(len(r["hash_ids"]) == -(-r["input_length"] // 512) for r in rows)
    firsts = [r["hash_ids"][0] for r in rows]
    assert len(set(firsts)) < len(firsts)  # some requests share a leading block
    assert (SAMPLES / "README.md").read_text().count("Apache License 2.0") == 1


def test_sim_on_the_shipped_sample_hits_the_cache(capsys):
    res = run_json(
        capsys,
        [
            "sim",
            str(SAMPLES / "mooncake_conversation_1k.jsonl"),
            "--limit",
            "200",
            "--block-size",
            "64",
            "--device-blocks",
            "2048",
            "--host-blocks",
            "4096",
            "--storage-blocks",
            "inf",
            "--json",
        ],
    )
    assert res["requests"] == 200 and res["skipped_requests"] == 0
    assert res["hit_tokens"]["device"] > 0 and res["hit_tokens"]["storage"] > 0
    assert res["prompt_tokens"] > sum(res["hit_tokens"].values())


# --- the write policy: the engine's default, so every configured tier is filled ---------------

SYNTHETIC_SMALL_TIERS = [
    str(SAMPLES / "mooncake_synthetic_500.jsonl"),
    "--limit",
    "100",
    "--block-size",
    "64",
    "--device-blocks",
    "1024",
    "--host-blocks",
    "2048",
    "--storage-blocks",
    "inf",
]


def test_by_default_every_configured_tier_takes_hits_on_the_shipped_sample(capsys):
    res = run_json(capsys, ["sim", *SYNTHETIC_SMALL_TIERS, "--json"])
    assert all(res["hit_tokens"][t] > 0 for t in TIERS), res["hit_tokens"]
    assert res["config"]["write_policy"] == "write_through" and res["config"]["write_policy_is_default"]
    assert res["notes"] == [
        "write policy: write_through, every computed block is copied down (the default with a "
        "host or storage tier; --write-policy to change)"
    ]


def test_explicit_write_through_selective_keeps_blocks_hit_once_off_the_lower_tiers(capsys):
    res = run_json(capsys, ["sim", *SYNTHETIC_SMALL_TIERS, "--write-policy", "write_through_selective", "--json"])
    assert res["hit_tokens"]["host"] == 0 and res["hit_tokens"]["storage"] == 0
    assert res["config"]["write_policy"] == "write_through_selective" and not res["config"]["write_policy_is_default"]
    assert res["notes"][0] == "write policy: write_through_selective, a block is copied down after 2 hits (--write-policy)"


@pytest.mark.parametrize(
    "tiers,policy",
    [
        ([], "write_through"),  # the default host tier
        (["--host-blocks", "0"], "write_through_selective"),  # the device tier alone
        (["--host-blocks", "64", "--storage-blocks", "inf"], "write_through"),
    ],
)
def test_default_write_policy_is_the_engines(trace, capsys, tiers, policy):
    res = run_json(capsys, ["sim", str(trace), "--trace-block-tokens", "16", *tiers, "--json"])
    host, storage = res["config"]["host_blocks"], res["config"]["storage_blocks"]
    assert res["config"]["write_policy"] == policy == default_write_policy(host != 0, storage != 0)


@pytest.mark.parametrize("policy,storage_hits", [(None, 128), ("write_through_selective", 0)])
def test_a_prompt_evicted_from_device_and_host_comes_back_from_storage(tmp_path, capsys, policy, storage_hits):
    chosen = ["--write-policy", policy] if policy else []
    res = run_json(
        capsys,
        [
            "sim",
            str(_storage_only_trace(tmp_path)),
            "--block-size",
            "16",
            "--device-blocks",
            "16",
            "--host-blocks",
            "16",
            "--storage-blocks",
            "inf",
            *chosen,
            "--json",
        ],
    )
    assert res["hit_tokens"]["storage"] == storage_hits


@pytest.mark.parametrize("policy,host_hits", [(None, 128), ("write_through_selective", 0)])
def test_a_prompt_evicted_from_device_comes_back_from_the_host_tier(tmp_path, capsys, policy, host_hits):
    chosen = ["--write-policy", policy] if policy else []
    res = run_json(
        capsys,
        [
            "sim",
            str(_storage_only_trace(tmp_path)),
            "--block-size",
            "16",
            "--device-blocks",
            "16",
            "--host-blocks",
            "inf",
            *chosen,
            "--json",
        ],
    )
    assert res["hit_tokens"]["host"] == host_hits


def test_storage_without_a_host_tier_is_an_error_naming_both_flags(trace, capsys):
    assert main(["sim", str(trace), "--host-blocks", "0", "--storage-blocks", "inf"]) == 2
    err = capsys.readouterr().err
    assert "--storage-blocks inf with --host-blocks 0" in err and "needs a host tier" in err


@pytest.mark.parametrize(
    "flags,notes",
    [
        (
            ["--device-blocks", "inf", "--storage-blocks", "inf"],
            [
                "no block was copied down: the device tier (378 blocks) holds every block the trace can use (378 at most), "
                "so it never evicts and a copy below could serve no hit (the engine's write_through would still copy them: "
                "those bytes are not in 'bytes moved')",
                "host: 0 hits — the device tier never evicted",
                "storage: 0 hits — the device tier never evicted",
            ],
        ),
        (
            ["--device-blocks", "16", "--host-blocks", "0"],
            ["host: 0 hits — no host tier (--host-blocks 0)", "storage: 0 hits — no storage tier (--storage-blocks to add one)"],
        ),
        (
            [
                "--device-blocks",
                "16",
                "--host-blocks",
                "16",
                "--storage-blocks",
                "inf",
                "--write-policy",
                "write_through_selective",
            ],
            [
                "host: 0 hits — no block was copied down to it (write policy write_through_selective)",
                "storage: 0 hits — no block was copied down to it (write policy write_through_selective)",
            ],
        ),
        (
            ["--device-blocks", "16", "--host-blocks", "inf", "--storage-blocks", "inf"],
            ["storage: 0 hits — the host tier never evicted"],
        ),
    ],
)
def test_a_tier_without_hits_is_explained_in_one_line(tmp_path, capsys, flags, notes):
    trace = str(_storage_only_trace(tmp_path))
    res = run_json(capsys, ["sim", trace, "--block-size", "16", *flags, "--json"])
    assert res["notes"][1:] == notes  # after the write policy's line
    assert main(["sim", trace, "--block-size", "16", *flags]) == 0
    assert capsys.readouterr().out.splitlines()[-len(res["notes"]) :] == res["notes"]  # the table ends with them


def test_json_path_writes_the_file_that_bare_json_prints_and_the_table_too(trace, tmp_path, capsys):
    argv = ["sim", str(trace), "--trace-block-tokens", "16", "--storage-blocks", "inf"]
    printed = run_json(capsys, [*argv, "--json"])
    assert run_json(capsys, [*argv, "--json", "-"]).keys() == printed.keys()
    out = tmp_path / "res.json"
    assert main([*argv, "--json", str(out)]) == 0
    assert capsys.readouterr().out.startswith("requests 4")  # the table still prints
    written = json.loads(out.read_text())
    assert {**written, "wall_s": 0} == {**printed, "wall_s": 0}


def test_a_device_tier_that_holds_the_whole_trace_copies_nothing_down_and_hits_the_same(tmp_path, capsys, monkeypatch):
    """Copies below a device tier that never evicts can serve no hit: the replay makes none (the
    CPU they cost), every hit and device figure is what it is with them, and the report says why
    no byte moved down. A device tier one block smaller copies as the policy says."""
    from kvtier.bench import replay

    trace = str(_storage_only_trace(tmp_path))
    total = replay.trace_blocks(read_trace(trace), 16)
    argv = ["sim", trace, "--block-size", "16", "--host-blocks", "64", "--storage-blocks", "inf", "--json"]
    lean = run_json(capsys, [*argv, "--device-blocks", str(total)])
    monkeypatch.setattr(replay, "copies_down_pay", lambda trace, cfg: True)  # copy as write_through says
    full = run_json(capsys, [*argv, "--device-blocks", str(total)])
    monkeypatch.undo()
    assert lean["hit_tokens"] == full["hit_tokens"] and lean["evictions"]["device"] == full["evictions"]["device"] == 0
    assert full["bytes_moved"]["device_to_host"] > 0 and full["bytes_moved"]["host_to_storage"] > 0
    assert lean["bytes_moved"]["device_to_host"] == lean["bytes_moved"]["host_to_storage"] == 0
    assert any(n.startswith("no block was copied down: the device tier") for n in lean["notes"])
    assert not any(n.startswith("no block was copied down") for n in full["notes"])
    smaller = run_json(capsys, [*argv, "--device-blocks", str(total - 1)])
    assert smaller["bytes_moved"]["device_to_host"] > 0
    assert not any(n.startswith("no block was copied down") for n in smaller["notes"])


@pytest.mark.parametrize(
    "argv, tty, bar",
    [
        ([], False, False),  # not a terminal: none
        ([], True, True),  # a terminal: one
        (["--json"], True, False),  # the JSON on stdout is for a program: none
        (["--json", "{out}"], True, True),  # the JSON to a file, the table on the terminal: one
        (["--no-progress"], True, False),
        (["--progress"], False, True),
        (["--instances", "2", "--no-progress"], True, False),
        (["--instances", "2"], True, True),  # a fleet too (and its one-instance baseline)
    ],
)
def test_the_progress_bar_is_on_a_terminal_and_off_when_asked(trace, tmp_path, capsys, monkeypatch, argv, tty, bar):
    from kvtier.bench import fleet, replay

    bars = []
    real = replay.progress_bar

    def spy(total, desc):
        bars.append(desc)
        return real(total, desc)

    monkeypatch.setattr(replay, "progress_bar", spy)
    monkeypatch.setattr(fleet, "progress_bar", spy)
    monkeypatch.setattr("sys.stderr.isatty", lambda: tty, raising=False)
    argv = [a.replace("{out}", str(tmp_path / "r.json")) for a in argv]
    assert main(["sim", str(trace), "--trace-block-tokens", "16", *argv]) == 0
    capsys.readouterr()
    assert bool(bars) == bar, bars


# ------------------------------------------------------------------ --instances (bench/fleet.py)


def FLEET() -> SimConfig:  # noqa: N802 - a config factory, used like the class
    """Blocks of 128 tokens and tiers to match: the trace's blocks 8x fewer, the test 8x faster."""
    return SimConfig(block_size=128, device_blocks=1024, host_blocks=4096)


@pytest.mark.slow  # (~6 s on 2 cores: CI runs it with -m slow)
def test_a_cache_aware_fleet_keeps_conversations_where_their_blocks_are():
    """Four instances on the shipped conversation trace: the router's policy over indexes fed by
    the instances' KV events keeps most of what one instance with the fleet's whole cache hits,
    round robin much less, and no instance takes much more than its share."""
    from kvtier.bench.fleet import simulate_fleet

    trace = read_trace(SAMPLES / "mooncake_conversation_1k.jsonl", block_tokens=512, limit=500)
    aware = simulate_fleet(trace, FLEET(), 4, "cache_aware")
    rr = simulate_fleet(trace, FLEET(), 4, "round_robin", baseline=False)
    assert aware["hit_rate_vs_one_big_instance"] >= 0.9, aware
    assert aware["hit_rate"] > 1.2 * rr["hit_rate"], (aware["hit_rate"], rr["hit_rate"])
    assert aware["max_load_vs_mean"] <= 1.5
    assert aware["ttft_model_s"]["mean"] < rr["ttft_model_s"]["mean"]  # modelled from the hits: no clock read
    assert sum(p["requests"] for p in aware["per_instance"]) == 500


def test_lost_events_resync_the_router_and_cost_little():
    from kvtier.bench.fleet import simulate_fleet

    trace = read_trace(SAMPLES / "mooncake_conversation_1k.jsonl", block_tokens=512, limit=300)
    clean = simulate_fleet(trace, FLEET(), 4, "cache_aware", baseline=False)
    lossy = simulate_fleet(trace, FLEET(), 4, "cache_aware", drop_events=0.01, baseline=False)
    assert lossy["events_dropped"] > 0 and lossy["resyncs"] >= lossy["events_dropped"] - 4
    assert lossy["hit_rate"] >= 0.95 * clean["hit_rate"]


def test_the_fleet_is_a_cli_flag_and_bad_values_are_named(capsys):
    from kvtier.bench.fleet import simulate_fleet

    assert (
        main(["sim", str(SAMPLES / "mooncake_synthetic_500.jsonl"), "--instances", "3", "--route", "least_load", "--limit", "60"])
        == 0
    )
    out = capsys.readouterr().out
    assert "3 instances, route least_load" in out and "modelled TTFT" in out
    trace = read_trace(SAMPLES / "mooncake_synthetic_500.jsonl", block_tokens=512, limit=5)
    with pytest.raises(ValueError, match="drop_events must be a probability in \\[0, 1\\), got 1.5"):
        simulate_fleet(trace, SimConfig(), 2, "cache_aware", drop_events=1.5)
    with pytest.raises(ValueError, match="unknown routing policy 'sticky'"):
        simulate_fleet(trace, SimConfig(), 2, "sticky")


def test_a_turn_finds_the_answer_before_it_when_the_trace_knows_the_answer():
    """A conversation's second turn repeats the first prompt and its answer: the engine cached
    the answer's KV as it decoded (all but its last token), so the sim with the recorded answer
    hits those blocks too, and without it only the first prompt's. Warm-up requests fill the
    caches and are left out of the figures."""
    from kvtier.bench.fleet import simulate_fleet
    from kvtier.bench.traces import TraceRequest

    first, answer, question = list(range(1, 33)), list(range(100, 133)), list(range(200, 216))
    second = first + answer + question  # 32 + 33 + 16 tokens
    cfg = SimConfig(block_size=16, device_blocks=64, host_blocks=0)

    def run(out, warm=0, extra=()):
        trace = [*extra, TraceRequest(0.0, first, len(answer), 0, output_ids=out), TraceRequest(1.0, second, 4, 1)]
        return simulate_fleet(trace, cfg, 1, "round_robin", baseline=False, warm=warm)

    assert run(answer)["hit_tokens"]["device"] == 64  # the prompt's 2 blocks and the answer's 2 full ones
    assert run(None)["hit_tokens"]["device"] == 32
    warm = TraceRequest(0.0, list(range(500, 540)), 2, 0)
    with_warm = run(answer, warm=1, extra=[warm])
    assert with_warm["requests"] == 2 and with_warm["prompt_tokens"] == len(first) + len(second)
    assert with_warm["hit_tokens"]["device"] == 64
    with pytest.raises(ValueError, match="baseline=False with warm"):
        simulate_fleet([warm], cfg, 1, "round_robin", warm=1)


def test_a_fleet_on_one_pool_finds_another_instances_blocks_there():
    """Round robin sends a conversation's second turn to the other instance: without a pool it
    recomputes the history, with the shared pool (written by the first instance) it fetches it."""
    from kvtier.bench.fleet import simulate_fleet
    from kvtier.bench.traces import TraceRequest

    first = list(range(1, 65))
    trace = [TraceRequest(0.0, first, 2, 0), TraceRequest(1.0, first + list(range(300, 332)), 2, 1)]
    alone = simulate_fleet(trace, SimConfig(block_size=16, device_blocks=64, host_blocks=64), 2, "round_robin", baseline=False)
    pooled = simulate_fleet(
        trace, SimConfig(block_size=16, device_blocks=64, host_blocks=64, storage_blocks=256), 2, "round_robin", baseline=False
    )
    assert alone["hit_tokens"] == {"device": 0, "host": 0, "storage": 0}
    assert pooled["hit_tokens"]["storage"] == 64 and pooled["per_instance"][1]["hit_tokens"]["storage"] == 64
