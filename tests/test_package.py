"""`import kvtier` is cheap, and what the README uses after it is reachable as an attribute."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import kvtier

ROOT = str(Path(kvtier.__file__).resolve().parent.parent)


def _fresh(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a new interpreter importing this kvtier (nothing imported before)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)


def test_routing_is_an_attribute_after_a_bare_import():
    proc = _fresh(
        "import sys, kvtier; assert 'kvtier.experts' not in sys.modules; "
        "print(kvtier.experts.replay.__name__, kvtier.experts.__name__)"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["replay", "kvtier.experts"]


def test_import_kvtier_does_not_import_torch():
    proc = _fresh("import sys, kvtier, kvtier.cache; print('torch' in sys.modules)")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


def test_an_unknown_attribute_is_an_error_naming_it():
    proc = _fresh("import kvtier; kvtier.no_such_thing")
    assert "module 'kvtier' has no attribute 'no_such_thing'" in proc.stderr
