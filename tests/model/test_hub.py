"""A model named by its Hugging Face hub id, resolved from the local HF cache with the network off
(HF_HUB_OFFLINE=1; `kvtier generate` runs in this process with huggingface_hub set that way, the
server in its own with the variables): `kvtier generate`, and `kvtier serve` take `org/name` and
`--revision` as vLLM users give them.

The cache is laid out as huggingface_hub writes it (models--org--name/{refs,snapshots}); its
`main` branch holds one random checkpoint and its `v1` tag another (a different seed), so a
revision that is ignored shows in the tokens."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest

from kvtier.cli import main
from kvtier.model import init_model
from kvtier.model.hub import default_served_name, resolve_model
from kvtier.serve.launch import ServerProcess

MAIN, V1 = "a" * 40, "b" * 40
PROMPT = ["--prompt-ids", "3,1,4,1,5,9,2,6", "--max-tokens", "6", "--ignore-eos", "--json"]


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """(HF cache dir, main's checkpoint directory, v1's) for the repo id acme/tiny."""
    root = tmp_path_factory.mktemp("hf")
    repo = root / "hub" / "models--acme--tiny"
    for commit, seed in ((MAIN, 0), (V1, 1)):
        init_model("qwen3-tiny", repo / "snapshots" / commit, seed=seed)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN)
    (repo / "refs" / "v1").write_text(V1)
    return root / "hub", repo / "snapshots" / MAIN, repo / "snapshots" / V1


def offline_env(cache: Path) -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}


@pytest.fixture
def offline(hub_cache, monkeypatch):
    """This process's huggingface_hub offline, on the test's cache (as HF_HUB_OFFLINE=1 and
    HF_HUB_CACHE would set it at import)."""
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub_cache[0]))
    return hub_cache


def generate(args: list[str], capsys) -> tuple[int, str, str]:
    """`kvtier generate ARGS` in this process: (exit status, stdout, stderr)."""
    try:
        rc = main(["generate", *args])
    except SystemExit as e:  # a usage error (argparse exits with a status, never a message)
        assert isinstance(e.code, int), e.code
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def tokens(result: tuple[int, str, str]) -> list[int]:
    rc, out, err = result
    assert rc == 0, err
    return json.loads(out.splitlines()[-1])["token_ids"]


def test_a_directory_is_itself_and_a_revision_with_it_is_refused(tmp_path):
    assert resolve_model(tmp_path) == tmp_path
    with pytest.raises(ValueError, match="'v1' is for hub ids"):
        resolve_model(tmp_path, revision="v1")
    # served under the argument as given (vLLM's and SGLang's rule), whatever it names
    assert default_served_name(str(tmp_path)) == str(tmp_path)
    assert default_served_name("./m/") == "./m/"
    assert default_served_name("acme/tiny") == "acme/tiny"


def test_a_directory_is_named_by_its_path_spelled_any_way_and_by_its_base_name(tmp_path, monkeypatch):
    from kvtier.model.hub import model_aliases, name_form, same_name

    model = tmp_path / "m"
    model.mkdir()
    (tmp_path / "link").symlink_to(model)
    monkeypatch.chdir(tmp_path)
    names = frozenset({default_served_name("link"), *model_aliases("link", "link")})
    forms = frozenset(map(name_form, names))
    for name in (
        "link",
        "./link",
        "link/",
        str(tmp_path / "link"),
        str(tmp_path / "link") + "/",
        "link",
        "m",
        "./m",
        "m/",
        str(model),
        str(model) + "//",
        str(tmp_path / "x" / ".." / "m"),
    ):
        assert same_name(name, names, forms), name
    for name in ("n", "/m", "acme/m", str(tmp_path), "", "mm", str(model) + "x"):
        assert not same_name(name, names, forms), name
    hub = frozenset({"acme/tiny", *model_aliases("acme/tiny", model)})
    hub_forms = frozenset(map(name_form, hub))
    assert same_name("acme/tiny", hub, hub_forms) and not same_name("acme/tin", hub, hub_forms)


def test_a_name_that_is_neither_a_directory_nor_a_hub_id_names_itself(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"'\./nope/x/y': no such directory \(nor a Hugging Face hub id"):
        resolve_model("./nope/x/y")
    (tmp_path / "file").write_text("")
    with pytest.raises(FileNotFoundError, match="is a file"):
        resolve_model(tmp_path / "file")


def test_generate_with_a_hub_id_equals_generate_with_its_snapshot_directory(offline, capsys):
    _, main_dir, v1_dir = offline
    want = tokens(generate([str(main_dir), *PROMPT], capsys))
    assert tokens(generate(["acme/tiny", *PROMPT], capsys)) == want
    assert tokens(generate(["--model", "acme/tiny", *PROMPT], capsys)) == want  # vLLM's --model form
    # --revision picks the tag's snapshot: another checkpoint, other tokens
    v1 = tokens(generate(["acme/tiny", "--revision", "v1", *PROMPT], capsys))
    assert v1 == tokens(generate([str(v1_dir), *PROMPT], capsys))
    assert v1 != want


def test_a_hub_id_missing_from_the_offline_cache_is_a_clear_error(offline, capsys):
    rc, _, err = generate(["acme/other", *PROMPT], capsys)
    assert rc == 2
    assert "'acme/other'" in err and "not in the local Hugging Face cache" in err
    assert "HF_HUB_OFFLINE=1" in err and "Traceback" not in err
    # and what to do: download it (the command names it), or let the server download it
    assert "huggingface-cli download acme/other" in err and "unset" in err
    rc, _, err = generate(["acme/tiny", "--revision", "v9", *PROMPT], capsys)
    assert rc == 2 and "at revision 'v9'" in err and "download acme/tiny --revision v9" in err


def test_a_hub_id_the_hub_does_not_answer_for_says_what_to_do(offline, monkeypatch, capsys):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # online, but the hub is not reached

    def unreachable(repo_id, **kw):
        from huggingface_hub.errors import LocalEntryNotFoundError

        raise LocalEntryNotFoundError("no connection")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    rc, _, err = generate(["acme/other", *PROMPT], capsys)
    assert rc == 2 and "could not be reached" in err and "HF_ENDPOINT" in err
    assert "huggingface-cli download acme/other" in err


def test_model_given_twice_differently_is_a_usage_error(offline, capsys):
    _, main_dir, _ = offline
    rc, _, err = generate([str(main_dir), "--model", "acme/tiny", *PROMPT], capsys)
    assert rc == 2 and "MODEL given twice" in err
    rc, _, err = generate(PROMPT, capsys)
    assert rc == 2 and "give MODEL" in err


@pytest.mark.slow  # (a server or processes of its own: CI runs it with -m slow)
def test_serve_a_hub_id_lists_it_and_answers_to_its_id_and_path(hub_cache, tmp_path):
    cache, main_dir, _ = hub_cache
    server = ServerProcess(["serve", "acme/tiny", "--num-device-blocks", "64"], tmp_path / "serve.log", env=offline_env(cache))
    try:
        server.wait_ready(timeout=300)
        entry = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]
        assert entry["id"] == "acme/tiny"
        outs = {}
        for name in ("acme/tiny", str(main_dir)):
            r = httpx.post(
                server.url + "/v1/completions",
                json={"model": name, "prompt": [3, 1, 4], "max_tokens": 3, "temperature": 0, "ignore_eos": True},
                timeout=60,
            )
            assert r.status_code == 200, r.text
            outs[name] = r.json()["choices"][0]["text"]
        assert len(set(outs.values())) == 1
        r = httpx.post(server.url + "/v1/completions", json={"model": "acme/other", "prompt": [3], "max_tokens": 1}, timeout=60)
        assert r.status_code == 404 and "acme/tiny" in r.text
    finally:
        server.stop()


def test_a_dummy_load_of_a_hub_id_fetches_no_weights(offline, monkeypatch):
    _, main_dir, _ = offline
    import huggingface_hub

    calls: list[list[str]] = []
    real = huggingface_hub.snapshot_download

    def spy(repo_id, **kw):
        calls.append(kw.get("allow_patterns") or [])
        return real(repo_id, **kw)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", spy)
    assert resolve_model("acme/tiny", load_format="dummy") == main_dir
    assert calls and not any("safetensors" in p for p in calls[-1])
    assert resolve_model("acme/tiny") == main_dir
    assert any("safetensors" in p for p in calls[-1])
