"""The serving process imports no torch: every module of ``kvtier.serve``, and the engine client
and wire types it talks through, import without torch, the model, the transfer engine or the
engine core (as vLLM's API server never imports the model). Each check runs in a fresh
interpreter: this one has torch already."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import kvtier.serve

# what the serving process may read of the model package: a checkpoint's directory, its tokenizer,
# its images (decoded and preprocessed with PIL and numpy)
MODEL_MODULES_ALLOWED = ("kvtier.model", "kvtier.model.hub", "kvtier.model.tokenizer", "kvtier.model.images")

PROBE = """
import importlib, sys
allowed = set(sys.argv[1].split(","))

def heavy(m):
    return (
        m == "torch" or m.startswith(("torch.", "kvtier.transfer")) or m == "kvtier.engine.core"
        or (m.startswith("kvtier.model") and m not in allowed)
    )

for name in sys.argv[2:]:
    importlib.import_module(name)
    found = sorted(filter(heavy, sys.modules), key=lambda m: (m != "torch", m))
    if found:
        sys.exit(f"importing {name} imported {', '.join(found[:5])}")
"""


def serving_modules() -> list[str]:
    serve = [f"kvtier.serve.{m.name}" for m in pkgutil.iter_modules(kvtier.serve.__path__)]
    return sorted(serve) + ["kvtier.engine.client", "kvtier.engine.wire", "kvtier.engine.checks"]


def probe(modules: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", PROBE, ",".join(MODEL_MODULES_ALLOWED), *modules]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_importing_the_serving_modules_imports_no_torch():
    modules = serving_modules()
    assert {"kvtier.serve.api", "kvtier.serve.server", "kvtier.serve.sglang", "kvtier.serve.router"} <= set(modules)
    r = probe(modules)
    assert r.returncode == 0, r.stderr[-2000:]


def test_the_probe_names_a_module_that_imports_torch():
    """The check itself: the engine loop (which drives the model) is caught, and named."""
    r = probe(["kvtier.engine.wire", "kvtier.engine.loop"])
    assert r.returncode != 0 and "importing kvtier.engine.loop imported torch" in r.stderr, r.stderr[-2000:]
