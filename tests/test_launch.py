"""Child processes (`kvtier bench pd`'s servers, the HTTP tests' servers, `kvtier bench peers`'
peers) import the launcher's kvtier, not a `kvtier/` folder in the working directory."""

from __future__ import annotations

import subprocess
import sys

import pytest

import kvtier
from kvtier.serve.launch import ServerProcess, kvtier_command


@pytest.fixture
def decoy_cwd(tmp_path, monkeypatch):
    """A working directory holding a `kvtier/` package that cannot be imported."""
    (tmp_path / "kvtier").mkdir()
    (tmp_path / "kvtier" / "__init__.py").write_text("raise ImportError('decoy kvtier imported')\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_decoy_is_what_python_m_would_import(decoy_cwd):
    # the failure the launcher avoids: `-m` puts the cwd first on sys.path
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli", "--version"], capture_output=True, text=True)
    assert proc.returncode != 0 and "decoy kvtier imported" in proc.stderr


def test_kvtier_command_imports_the_launchers_kvtier_from_a_decoy_cwd(decoy_cwd):
    proc = subprocess.run(kvtier_command("--version"), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"kvtier {kvtier.__version__}"


def test_server_process_starts_from_a_decoy_cwd(decoy_cwd):
    # `kvtier --version` exits at once (before the flags ServerProcess appends are parsed)
    server = ServerProcess(["--version"], decoy_cwd / "server.log")
    assert server.popen.wait(timeout=60) == 0, server.tail()
    assert server.tail().strip() == f"kvtier {kvtier.__version__}"
    server.stop()
