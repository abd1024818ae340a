"""Shared fixtures: tiny random checkpoints written once per session, and their HF models."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run in its interpreter on CPU; the flag must be set before anything imports
    # triton (a test module importing kvtier.engine at collection would, before the kernel tests)
    os.environ.setdefault("TRITON_INTERPRET", "1")

# weights digests are cached per user (kvtier/model/digest_cache.py): the tests, and the engine
# processes they start (they inherit the environment), keep theirs in a folder of their own
if "KVTIER_CACHE_DIR" not in os.environ:
    os.environ["KVTIER_CACHE_DIR"] = _cache_dir = tempfile.mkdtemp(prefix="kvtier-test-cache-")
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)

from kvtier.model import init_model  # noqa: E402


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(preset) -> directory written by init_model (cached for the session)."""
    written: dict[str, Path] = {}

    def get(preset: str) -> Path:
        if preset not in written:
            written[preset] = init_model(preset, tmp_path_factory.mktemp(preset), seed=0)
        return written[preset]

    return get


@pytest.fixture(scope="session")
def hf_model():
    """hf_model(path) -> transformers model in fp32 eval mode (cached)."""
    from transformers import AutoModelForCausalLM

    loaded = {}

    def get(path: Path):
        if path not in loaded:
            loaded[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return loaded[path]

    return get
