"""Session fixtures: kvtier models of the tiny checkpoints (checkpoint, hf_model: tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtier.model import load_model


@pytest.fixture(scope="session")
def our_model():
    """our_model(path) -> kvtier CausalLM in fp32 on CPU (cached)."""
    loaded = {}

    def get(path: Path):
        if path not in loaded:
            loaded[path] = load_model(path, device="cpu", dtype=torch.float32)
        return loaded[path]

    return get
