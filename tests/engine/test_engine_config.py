"""EngineConfig: every engine option once — each has a flag on `kvtier serve` and `kvtier
generate`, a help line, a line in docs/DESIGN.md, and survives the trip to flags and back (the
servers the benches start get their options that way); bad values are named before anything loads."""

from __future__ import annotations

import argparse
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import pytest

from kvtier.cli import build_parser
from kvtier.engine.config import EngineConfig

FIELDS = [f.name for f in fields(EngineConfig)]
DOCS = Path(__file__).resolve().parents[2] / "docs"


def _subparser(name: str) -> argparse.ArgumentParser:
    ap = build_parser()
    sub = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_every_option_is_a_flag_of_the_command(command):
    dests = {a.dest: a for a in _subparser(command)._actions}
    for name in FIELDS:
        assert name in dests, f"{name} has no flag on kvtier {command}"
        help_line = dests[name].help
        assert help_line is not None and len(help_line) > 10, f"{name}: no help line"


def test_every_option_is_documented():
    design = (DOCS / "DESIGN.md").read_text()
    assert [n for n in FIELDS if f"`{n}" not in design and f"{n}=" not in design] == []


def test_a_config_survives_the_trip_to_flags_and_back():
    ap = argparse.ArgumentParser()
    EngineConfig.add_flags(ap)
    config = EngineConfig(
        device="cuda:1",
        num_host_blocks=0,
        enable_prefix_caching=False,
        cuda_graphs=False,
        overlap_schedule=True,
        prefetch_timeout=(0.2, 0.1),
        write_policy="write_back",
        capture_routing=False,
        early_loads=False,
        max_model_len=4096,
        export_timeout=12.5,
        gpu_memory_utilization=0.8,
        revision="v1.0",
    )
    flags = config.to_flags()
    assert EngineConfig.from_args(ap.parse_args(flags)) == config
    assert EngineConfig().to_flags() == [] and EngineConfig.from_args(ap.parse_args([])) == EngineConfig()


@pytest.mark.parametrize(
    "options, message",
    [
        ({"block_size": 12}, "block_size must be a positive power of two, got 12"),
        ({"device": "gpu"}, "device must be 'cpu', 'cuda' or 'cuda:N', got 'gpu'"),
        ({"eviction": "fifo"}, "unknown eviction 'fifo'; choose lfu, lru"),
        ({"early_loads": "yes"}, "early_loads must be True or False, got 'yes'"),
        ({"prefetch_timeout": (0.1,)}, "prefetch_timeout must be two numbers"),
        ({"preemption_mode": "swap"}, "preemption_mode='swap' needs a host tier"),
        ({"export_timeout": 0}, "export_timeout must be > 0 seconds, got 0"),
        ({"device": "cuda", "gpu_memory_utilization": 1.5}, "gpu_memory_utilization must be a fraction in (0, 1], got 1.5"),
        (
            {"device": "cuda", "gpu_memory_utilization": 0.5, "num_device_blocks": 10},
            "give num_device_blocks or gpu_memory_utilization, not both",
        ),
        ({"revision": ""}, "revision must be a branch, tag or commit name, got ''"),
        ({"max_num_seqs_per_request": 0}, "max_num_seqs_per_request must be an int >= 1 or None, got 0"),
        ({"max_num_seqs_per_request": 2.5}, "max_num_seqs_per_request must be an int >= 1 or None, got 2.5"),
        (
            {"max_num_seqs": 16, "max_num_seqs_per_request": 17},
            "max_num_seqs_per_request must be at most max_num_seqs (16), got 17",
        ),
    ],
)
def test_a_bad_option_is_named(options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EngineConfig(**options)


def test_max_num_seqs_per_request_defaults_to_a_quarter_of_the_slots(checkpoint):
    import kvtier
    from kvtier.engine.resolve import default_seqs_per_request

    assert [default_seqs_per_request(n) for n in (1, 3, 4, 16, 256)] == [1, 1, 1, 4, 64]
    assert EngineConfig(max_num_seqs=8, max_num_seqs_per_request=8).to_flags() == [
        "--max-num-seqs",
        "8",
        "--max-num-seqs-per-request",
        "8",
    ]
    with kvtier.LLM(checkpoint("qwen3-tiny"), num_device_blocks=24, max_num_seqs=16) as llm:
        assert llm.scheduler.max_num_seqs_per_request == 4


def test_an_unknown_option_is_refused_by_name():
    options: dict[str, Any] = {"num_gpu_blocks": 10}  # as a caller's dict of options may name it
    with pytest.raises(TypeError, match="num_gpu_blocks"):
        EngineConfig(**options)


def test_keywords_go_over_a_config(checkpoint):
    import kvtier

    base = EngineConfig(num_device_blocks=40, block_size=8)
    with kvtier.LLM(checkpoint("qwen3-tiny"), base, num_device_blocks=24) as llm:
        assert llm.engine_config == EngineConfig(num_device_blocks=24, block_size=8)
        assert llm.cache.device_pool.num_blocks == 24 and llm.block_size == 8


def test_gpu_memory_utilization_counts_what_is_in_use_against_the_fraction():
    from kvtier.engine.sizing import ACTIVATION_RESERVE, device_budget

    gib = 1 << 30
    # an 80 GiB GPU, 16 GiB of weights loaded, 6 GiB held by another process: 58 GiB free
    assert device_budget(58 * gib, 80 * gib, 0.9) == int(72 * gib) - 22 * gib - ACTIVATION_RESERVE
    assert device_budget(58 * gib, 80 * gib, 0.5) == 40 * gib - 22 * gib - ACTIVATION_RESERVE
    # without it: 90% of the free memory
    assert device_budget(58 * gib, 80 * gib, None) == int(58 * gib * 0.9) - ACTIVATION_RESERVE


def test_gpu_memory_utilization_on_cpu_is_accepted_and_ignored_with_one_warning(checkpoint, caplog):
    """A vLLM command line carries --gpu-memory-utilization: on a CPU it changes nothing, and the
    log says once what sizes the device tier there."""
    import logging

    import kvtier
    from kvtier.engine.sizing import CPU_SIZING

    path = checkpoint("llama-tiny")
    EngineConfig(gpu_memory_utilization=0.9, num_device_blocks=40)  # (on cuda: "not both")
    with kvtier.LLM(path, max_model_len=256) as llm:
        plain = llm.cache.device_pool.num_blocks
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        with kvtier.LLM(path, max_model_len=256, gpu_memory_utilization=0.3) as llm:
            assert llm.cache.device_pool.num_blocks == plain  # (not a fraction of anything here)
        warned = [r.getMessage() for r in caplog.records if "gpu_memory_utilization" in r.getMessage()]
        assert len(warned) == 1 and "ignored" in warned[0] and CPU_SIZING in warned[0], warned
        caplog.clear()
        with kvtier.LLM(path, max_model_len=256, gpu_memory_utilization=0.3, num_device_blocks=40) as llm:
            assert llm.cache.device_pool.num_blocks == 40
        assert any("num_device_blocks=40 sizes it" in r.getMessage() for r in caplog.records)
    from kvtier.cli import build_parser

    args = build_parser().parse_args(["serve", "m", "--gpu-memory-utilization", "0.9"])
    assert args.gpu_memory_utilization == 0.9


def test_gpu_memory_utilization_flag_takes_a_fraction():
    from kvtier.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "m", "--gpu-memory-utilization", "90"])
    assert e.value.code == 2


@pytest.mark.parametrize("command", ["serve", "router"])
def test_every_flag_of_the_server_commands_is_in_the_serving_guide(command):
    guide = (DOCS / "SERVING.md").read_text()
    flags = {s for a in _subparser(command)._actions for s in a.option_strings if s not in ("-h", "--help")}
    flags |= {"--enforce-eager", "--disable-cuda-graph", "--disable-overlap-schedule"}  # (hidden: named in help)
    assert sorted(f for f in flags if f"`{f}`" not in guide and f"`{f} " not in guide) == []


@pytest.mark.parametrize(
    "flags, options",
    [
        (["--num-gpu-blocks-override", "64"], {"num_device_blocks": 64}),  # vLLM
        (["--no-enable-prefix-caching"], {"enable_prefix_caching": False}),
        (["--disable-radix-cache"], {"enable_prefix_caching": False}),  # SGLang
        (["--enforce-eager"], {"cuda_graphs": False}),
        (["--disable-cuda-graph"], {"cuda_graphs": False}),
        (["--disable-overlap-schedule"], {"overlap_schedule": False}),
        (["--num-speculative-tokens", "3"], {"num_speculative_tokens": 3}),
        (
            ["--page-size", "32", "--context-length", "4096", "--max-running-requests", "8"],
            {"block_size": 32, "max_model_len": 4096, "max_num_seqs": 8},
        ),
        (
            ["--hicache-write-policy", "write_back", "--radix-eviction-policy", "lfu"],
            {"write_policy": "write_back", "eviction": "lfu"},
        ),
    ],
)
def test_vllm_and_sglang_flag_names_give_the_same_options(flags, options):
    ap = argparse.ArgumentParser()
    EngineConfig.add_flags(ap)
    assert EngineConfig.from_args(ap.parse_args(flags)) == EngineConfig(**options)


def test_a_bench_takes_some_flags_with_its_own_defaults_and_its_help_says_them():
    """What a bench declares: the options it uses, under `kvtier serve`'s names, a default of its
    own where it needs one, said in its --help in place of the engine's."""
    ap = argparse.ArgumentParser()
    only = ("device", "num_host_blocks", "storage", "cuda_graphs", "prefetch_timeout")
    EngineConfig.add_flags(
        ap,
        only=only,
        defaults={"device": "cuda", "num_host_blocks": 4096, "cuda_graphs": False, "prefetch_timeout": (0.2, 0.1)},
        shown={"storage": "a temporary file:// pool"},
    )
    flags = {s for a in ap._actions for s in a.option_strings}
    assert "--block-size" not in flags and "--max-num-seqs" not in flags and "--device" in flags
    helps: dict = {}
    for a in ap._actions:
        helps.setdefault(a.dest, a.help)  # (not the hidden --enforce-eager's)
    assert helps["device"].endswith("(default cuda)") and helps["num_host_blocks"].endswith("(default 4096)")
    assert "(default: none, or with --storage" not in helps["num_host_blocks"]  # (the engine's, replaced)
    assert helps["storage"].endswith("(default: a temporary file:// pool)")
    assert "(default off)" in helps["cuda_graphs"] and helps["prefetch_timeout"].endswith("(default 0.2,0.1)")
    got = EngineConfig.from_args(ap.parse_args([]), only=only)
    assert got == EngineConfig(device="cuda", num_host_blocks=4096, cuda_graphs=False, prefetch_timeout=(0.2, 0.1))
    assert EngineConfig.from_args(ap.parse_args(["--num-host-blocks", "8"]), only=only).num_host_blocks == 8


def test_an_unknown_or_unchosen_option_of_a_bench_is_named():
    with pytest.raises(ValueError, match="unknown engine option 'num_gpu_blocks'"):
        EngineConfig.add_flags(argparse.ArgumentParser(), only=("num_gpu_blocks",))
    with pytest.raises(ValueError, match="defaults or shown for dtype: not among the flags added"):
        EngineConfig.add_flags(argparse.ArgumentParser(), only=("device",), defaults={"dtype": "float32"})


class _Parser(Exception):
    """Raised by parse_args in place of parsing: carries the parser a bench built."""


# a bench's own flag that shares an option's name: `kvtier bench storage --early-loads both`
# runs the storage row both ways (a sweep, not one value); every bench's --seed is its workload's
BENCH_OWN = {("storage", "early_loads")}


def test_every_bench_takes_its_engine_flags_from_the_config(monkeypatch):
    """No bench declares an engine flag of its own: wherever `kvtier bench NAME` (and `kvtier sim`)
    has an engine option, it has the engine's flag and help line, whatever its default."""
    import importlib

    from kvtier.cli import BENCHES

    def capture(self, *args, **kwargs):
        raise _Parser(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    engine_help = {f.name: f.metadata["help"].split(" (default")[0] for f in fields(EngineConfig)}
    found: dict[str, set[str]] = {}  # bench -> the engine options among its flags
    for name, module in {**{n: m for n, (m, _) in BENCHES.items()}, "sim": "kvtier.bench.sim"}.items():
        with pytest.raises(_Parser) as got:
            importlib.import_module(module).main([])
        for a in got.value.args[0]._actions:
            if a.dest in engine_help and a.dest != "seed" and a.help is not argparse.SUPPRESS and (name, a.dest) not in BENCH_OWN:
                assert a.help.replace("%%", "%").startswith(engine_help[a.dest]), f"bench {name}: --{a.dest}: {a.help!r}"
                found.setdefault(name, set()).add(a.dest)
    assert {"block_size", "max_num_batched_tokens", "max_num_seqs", "dtype"} <= set().union(*found.values())
    assert {"throughput", "multiturn", "pd", "soak", "speculative", "transfer", "sim"} <= set(found)


def test_resolving_decides_every_default_the_model_and_the_machine_leave_open(checkpoint):
    """engine/resolve.py against the checkpoint's own config.json (the reference): its context,
    its dtype on cpu, and the tiers' sizes once known."""
    import json

    from kvtier.engine.resolve import resolve, size_tiers
    from kvtier.model import ModelConfig

    path = checkpoint("qwen3-tiny")
    hf = json.loads((path / "config.json").read_text())
    c = resolve(EngineConfig(max_num_seqs=16), ModelConfig.from_hf_dir(path))
    assert c.max_model_len == hf["max_position_embeddings"] and c.dtype == "float32" and c.device == "cpu"
    assert (c.attention_backend, c.cuda_graphs, c.overlap_schedule, c.max_num_seqs_per_request) == ("torch", False, False, 4)
    longer = resolve(EngineConfig(max_model_len=10**9), ModelConfig.from_hf_dir(path))
    assert longer.max_model_len == hf["max_position_embeddings"]  # (capped at the model's)
    sized = size_tiers(replace(c, num_device_blocks=40), 4096, rank_fits=[32, 48])
    assert (sized.num_device_blocks, sized.num_host_blocks, sized.preemption_mode) == (32, 0, "recompute")
    assert sized.write_policy == "write_through_selective"
    pooled = size_tiers(replace(c, num_device_blocks=40, storage="memory://", num_host_blocks=8), 4096)
    assert (pooled.num_host_blocks, pooled.preemption_mode, pooled.write_policy) == (8, "swap", "write_through")
    assert resolve(pooled, ModelConfig.from_hf_dir(path)) == pooled  # (nothing left to decide)
