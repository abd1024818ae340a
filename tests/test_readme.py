"""The README works as written, from a clone of the repository and nothing else.

Every command of the README's bash blocks is either run here as written — CPU, a tiny model in a
temporary directory (``/tmp/`` in a command becomes that directory) — or named below with the
reason it is not; a new command
fails the test until it is one or the other. Every file a command names must be in the
repository, and no tracked file may name a path outside it.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from kvtier.serve.launch import kvtier_command

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()

# Flip once `--storage URL` alone gives a default host tier and writes every block through
# (write_through is the default with a pool): then the README's persistent-pool example runs.
POOL_DEFAULTS_LANDED = True

POOL_EXAMPLE = "--storage file:///tmp/kvtier-pool"
# the commands run here, as written (CPU, a tiny model: each is sized in the README to take seconds)
RUN = [
    r"^kvtier init-model ",
    r"^kvtier generate /tmp/m --prompt ",
    r"^kvtier sim traces/",
    r"^kvtier bench cache ",
    r"^kvtier bench peers ",
    r"^kvtier bench soak ",
    r"^kvtier bench multiturn --model qwen3-tiny ",
]
# command pattern -> why it is not run here
NOT_RUN = {
    re.escape(POOL_EXAMPLE): "run twice by test_persistent_pool_example_is_served_from_storage_by_a_second_run",
    r"^python3 -m venv ": "the install line: .ci/run installs the same way",
    r"python -m pytest": "the test suite itself",
    r"^apt-get install ": "system packages: .ci/run installs them",
    r"--device cuda": "needs a GPU",
    r"^kvtier bench (transfer|overlap|rollout|speculative)\b": "GPU benchmark",
    r"^kvtier bench storage --ttft\b": "two engines on a 1 GiB prompt: minutes on a CPU",
    r"^kvtier (serve|router) ": "a server: tests/serve start the same ones",
    r"^kvtier bench \w+ .*--url ": "needs a running server: tests/test_bench_serving.py runs --url against one",
    r"^kvtier pool mooncake ": "starts a Mooncake master: tests/storage start the same one",
    r"^python scripts/bench_pools\.py": "starts Valkey and Mooncake servers",
}


def bash_blocks(text: str) -> list[list[str]]:
    """The commands of each bash block: continuations joined, comments dropped."""
    blocks = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M):
        lines = (re.sub(r"(^|\s+)#.*$", "", line).strip() for line in block.replace("\\\n", " ").splitlines())
        blocks.append([line for line in lines if line])
    return blocks


COMMANDS = [command for block in bash_blocks(README) for command in block]


def _matches(table: dict, command: str) -> str | None:
    return next((v for k, v in table.items() if re.search(k, command)), None)


def _run_here(command: str) -> bool:
    return any(re.search(k, command) for k in RUN)


def run_kvtier(command: str, tmp: Path) -> str:
    """Run a README line in bash, ``kvtier`` being this checkout's, ``/tmp/`` mapped into ``tmp``."""
    python, flag, boot = kvtier_command()
    script = 'kvtier() { "$KVTIER_PY" -c "$KVTIER_BOOT" "$@"; }\n' + command.replace("/tmp/", f"{tmp}/")
    env = {**os.environ, "KVTIER_PY": python, "KVTIER_BOOT": boot}
    proc = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{command}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_the_first_block_holds_exactly_the_two_set_up_commands():
    first = bash_blocks(README)[0]
    assert README.startswith("# kvtier\n\n```bash\n") and len(first) == 2, first
    install, tests = first
    assert "pip install torch==2.13.0" in install and "pip install -e '.[test]'" in install
    assert install.endswith("&& kvtier demo")
    assert tests == ". .venv/bin/activate && python -m pytest -q"


def test_every_command_is_run_here_or_says_why_not():
    unknown = [c for c in COMMANDS if not _run_here(c) and _matches(NOT_RUN, c) is None]
    assert not unknown, f"README commands neither run by this test nor listed in NOT_RUN: {unknown}"
    assert sum(POOL_EXAMPLE in c for c in COMMANDS) == 1


def test_every_file_a_command_names_is_in_the_repository():
    named = set()
    for command in COMMANDS:
        for word in shlex.split(re.sub(r"\$\([^)]*\)", "", command)):
            if re.fullmatch(r"[\w.-]+/[\w./-]*\.\w+", word) and not word.startswith(".venv/"):
                named.add(word)
    assert "traces/mooncake_conversation_1k.jsonl" in named
    missing = sorted(w for w in named if not (ROOT / w).is_file())
    assert not missing, f"README commands name files the repository does not have: {missing}"


@pytest.mark.slow  # ~100 s on 2 cores (the soak, the multi-turn bench, the sim): CI runs it with -m slow
def test_the_cpu_commands_run_as_written(tmp_path):
    ran = []
    for command in COMMANDS:
        if not _run_here(command):
            continue
        out = run_kvtier(command, tmp_path)
        ran.append(command.split()[1])
        if command.startswith("kvtier generate"):
            first, second = re.findall(r"cached=(\d+)", out)
            assert int(first) == 0 and int(second) > 0, out  # --repeat 2: the second run hits
        if command.startswith("kvtier sim"):
            assert "hit tokens" in out and "device" in out, out
    assert ran.count("init-model") == 2 and {"generate", "sim", "bench"} <= set(ran)


@pytest.mark.skipif(
    not POOL_DEFAULTS_LANDED,
    reason="`--storage URL` alone does not yet give a host tier that writes through (flip POOL_DEFAULTS_LANDED when it does)",
)
@pytest.mark.slow  # (tests/engine/test_engine_inputs.py runs the same two generates in the default run)
def test_persistent_pool_example_is_served_from_storage_by_a_second_run(tmp_path):
    command = next(c for c in COMMANDS if POOL_EXAMPLE in c)
    run_kvtier("kvtier init-model qwen3-moe-tiny /tmp/m", tmp_path)
    by_tier = []
    for _ in range(2):  # two processes, one after the other
        out = run_kvtier(command, tmp_path)
        m = re.search(r"cached=\d+ (\{.*?\})", out)
        assert m, out
        by_tier.append(ast.literal_eval(m.group(1)))
    assert by_tier[0]["storage"] == 0
    assert by_tier[1]["storage"] == 32, by_tier  # 40 tokens: two full 16-token blocks


def test_no_tracked_file_names_a_path_outside_the_repository():
    outside = re.compile(
        "|".join(map(re.escape, ["/wo" + "rk/", "../sha" + "red", "sha" + "red/peers", "sha" + "red/traces", "/ho" + "me/"]))
    )
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if files.returncode:
        pytest.skip("not a git checkout: no list of tracked files")
    found = []
    for name in files.stdout.splitlines():
        path = ROOT / name
        if not path.is_file() or path.suffix in (".jsonl", ".json", ".png", ".pdf"):
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if outside.search(line):
                found.append(f"{name}:{n}: {line.strip()[:120]}")
    assert not found, "\n".join(found)
