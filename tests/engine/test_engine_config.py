"""EngineConfig: every engine option once — each has a flag on `kvtier serve` and `kvtier
generate`, a help line, a line in docs/DESIGN.md, and survives the trip to flags and back (the
servers the benches start get their options that way); bad values are named before anything loads."""
from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path

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
        assert dests[name].help and len(dests[name].help) > 10, f"{name}: no help line"


def test_every_option_is_documented():
    design = (DOCS / "DESIGN.md").read_text()
    assert [n for n in FIELDS if f"`{n}" not in design and f"{n}=" not in design] == []


def test_a_config_survives_the_trip_to_flags_and_back():
    ap = argparse.ArgumentParser()
    EngineConfig.add_flags(ap)
    config = EngineConfig(device="cuda:1", num_host_blocks=0, enable_prefix_caching=False, cuda_graphs=False,
                          overlap_schedule=True, prefetch_timeout=(0.2, 0.1), write_policy="write_back",
                          capture_routing=False, early_loads=False, max_model_len=4096, export_timeout=12.5)
    flags = config.to_flags()
    assert EngineConfig.from_args(ap.parse_args(flags)) == config
    assert EngineConfig().to_flags() == [] and EngineConfig.from_args(ap.parse_args([])) == EngineConfig()


@pytest.mark.parametrize("options, message", [
    ({"block_size": 12}, "block_size must be a positive power of two, got 12"),
    ({"device": "gpu"}, "device must be 'cpu', 'cuda' or 'cuda:N', got 'gpu'"),
    ({"eviction": "fifo"}, "unknown eviction 'fifo'; choose lfu, lru"),
    ({"early_loads": "yes"}, "early_loads must be True or False, got 'yes'"),
    ({"prefetch_timeout": (0.1,)}, "prefetch_timeout must be two numbers"),
    ({"preemption_mode": "swap"}, "preemption_mode='swap' needs a host tier"),
    ({"export_timeout": 0}, "export_timeout must be > 0 seconds, got 0"),
])
def test_a_bad_option_is_named(options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EngineConfig(**options)


def test_an_unknown_option_is_refused_by_name():
    with pytest.raises(TypeError, match="num_gpu_blocks"):
        EngineConfig(num_gpu_blocks=10)


def test_keywords_go_over_a_config(checkpoint):
    import kvtier
    base = EngineConfig(num_device_blocks=40, block_size=8)
    with kvtier.LLM(checkpoint("qwen3-tiny"), base, num_device_blocks=24) as llm:
        assert llm.engine_config == EngineConfig(num_device_blocks=24, block_size=8)
        assert llm.cache.device_pool.num_blocks == 24 and llm.block_size == 8
