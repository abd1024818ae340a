"""The `kvtier` command: help, presets, generate, bad input."""

import json

import pytest

from kvtier.cli import PRESET_NAMES, main
from kvtier.model.presets import PRESETS


def test_preset_names_in_help_are_the_presets():
    assert set(PRESET_NAMES) == set(PRESETS)


def test_init_model_then_generate_twice_hits_the_cache(tmp_path, capsys):
    model = tmp_path / "m"
    assert main(["init-model", "qwen3-moe-tiny", str(model)]) == 0
    assert (
        main(
            [
                "generate",
                str(model),
                "--prompt-ids",
                ",".join(str(i) for i in range(40)),
                "--max-tokens",
                "4",
                "--ignore-eos",
                "--repeat",
                "2",
                "--num-device-blocks",
                "32",
                "--return-routed-experts",
                "--json",
            ]
        )
        == 0
    )
    first, second = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert first["token_ids"] == second["token_ids"] and len(first["token_ids"]) == 4
    assert first["num_cached_tokens"] == 0 and second["num_cached_tokens"] == 32
    assert first["routed_experts_shape"] == [43, 2, 2] and first["routed_experts_dtype"] == "uint8"


def test_bad_input_is_an_error_naming_it(tmp_path, capsys):
    assert main(["init-model", "no-such-preset", str(tmp_path / "x")]) == 2
    assert "no-such-preset" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["sim", "t.jsonl", "--block-size", "12"])
    assert "power of two, got 12" in capsys.readouterr().err


def test_config_only_checkpoint_generates_with_dummy_weights(tmp_path, capsys):
    model = tmp_path / "m"
    assert main(["init-model", "qwen3-moe-tiny", str(model), "--config-only"]) == 0
    assert (model / "config.json").is_file() and not list(model.glob("*.safetensors"))
    args = ["generate", str(model), "--prompt", "hello", "--max-tokens", "3", "--ignore-eos", "--json"]
    assert main(args) == 2 and "load_format='dummy'" in capsys.readouterr().err  # auto: no weights
    assert main([*args, "--load-format", "dummy"]) == 0
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert len(out) == 1 and len(out[0]["token_ids"]) == 3 and isinstance(out[0]["text"], str)
    with pytest.raises(SystemExit):
        main([*args, "--load-format", "npz"])
    assert "npz" in capsys.readouterr().err


def test_generate_with_a_file_pool_is_served_from_storage_by_a_second_run(tmp_path, capsys):
    model = tmp_path / "m"
    assert main(["init-model", "llama-tiny", str(model)]) == 0
    args = [
        "generate",
        str(model),
        "--prompt-ids",
        ",".join(str(i) for i in range(70)),
        "--max-tokens",
        "3",
        "--ignore-eos",
        "--block-size",
        "8",
        "--num-host-blocks",
        "16",
        "--storage",
        f"file://{tmp_path}/pool",
        "--write-policy",
        "write_through",
        "--storage-fetch",
        "always",
        "--prefetch-policy",
        "timeout",
        "--prefetch-timeout",
        "5,0",
        "--storage-workers",
        "2",
        "--json",
    ]
    assert main(args) == 0 and main(args) == 0  # two engines, one after the other
    first, second = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert first["token_ids"] == second["token_ids"]
    assert first["cached_tokens_by_tier"]["storage"] == 0 and second["cached_tokens_by_tier"]["storage"] == 64


@pytest.mark.parametrize(
    "flag,value,msg",
    [
        ("--storage", "s3://bucket", "unknown storage URL scheme 's3'"),
        ("--storage", "file:///tmp/x?size=1", "unknown parameter 'size'"),
        ("--prefetch-timeout", "1", "BASE,PER_1K"),
    ],
)
def test_bad_storage_flags_are_named(tmp_path, capsys, flag, value, msg):
    model = tmp_path / "m"
    assert main(["init-model", "llama-tiny", str(model)]) == 0
    args = ["generate", str(model), "--prompt-ids", "1,2,3", "--num-host-blocks", "8", flag, value]
    try:
        assert main(args) == 2
    except SystemExit:
        pass
    assert msg in capsys.readouterr().err


def _sim_trace(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"timestamp": i, "input_ids": list(range(40))}) + "\n" for i in range(2)))
    return path


def test_sim_takes_the_engines_tier_flag_names_too(tmp_path, capsys):
    assert main(["sim", str(_sim_trace(tmp_path)), "--num-device-blocks", "16", "--num-host-blocks", "0", "--json"]) == 0
    config = json.loads(capsys.readouterr().out)["config"]
    assert config["device_blocks"] == 16 and config["host_blocks"] == 0


def test_sim_json_before_the_trace_does_not_take_the_trace_as_its_file(tmp_path, capsys):
    trace = _sim_trace(tmp_path)
    before = trace.read_text()
    with pytest.raises(SystemExit):
        main(["sim", "--json", str(trace)])
    assert "ending in .json" in capsys.readouterr().err and trace.read_text() == before
    assert main(["sim", "--json", "-", str(trace)]) == 0  # '-' or a .json path may come first
    assert json.loads(capsys.readouterr().out)["requests"] == 2
    assert main(["sim", "--json", str(tmp_path / "r.json"), str(trace)]) == 0
    assert json.loads((tmp_path / "r.json").read_text())["requests"] == 2
