"""A model as users name it: a checkpoint directory, or a Hugging Face hub id (``Qwen/Qwen3-0.6B``)
fetched into the local HF cache by ``huggingface_hub`` (``HF_HUB_OFFLINE=1``: from that cache
alone; ``HF_HOME`` / ``HF_HUB_CACHE`` say where it is; ``HF_TOKEN`` for gated repos).

An existing directory always wins over a hub id of the same spelling, as in vLLM and SGLang.
With ``load_format="dummy"`` only the config and tokenizer files are fetched, not the weights.
"""

from __future__ import annotations

import os
from pathlib import Path

# what the engine reads from a checkpoint: config and generation config, tokenizer files, weights
_CONFIG_FILES = ["*.json", "tokenizer*", "*.model", "*.tiktoken", "*.txt"]
_WEIGHT_FILES = ["*.safetensors"]


def is_hub_id(model: str) -> bool:
    """Whether ``model`` is spelled as a hub repo id (``name`` or ``org/name``), whatever exists."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(model)
    except HFValidationError:
        return False
    return True


def resolve_model(model: str | os.PathLike, revision: str | None = None, load_format: str = "auto") -> Path:
    """The checkpoint directory of ``model``: itself if it is a directory, else the hub repo's
    snapshot at ``revision`` (default: its main branch), downloaded where the network allows.
    FileNotFoundError naming ``model`` when it is neither; ValueError for a ``revision`` given
    with a local directory (it would be ignored)."""
    path = Path(model).expanduser()
    if path.is_dir():
        if revision is not None:
            raise ValueError(f"revision {revision!r} is for hub ids; {str(model)!r} is a local directory")
        return path
    name = str(model)
    if path.exists():
        raise FileNotFoundError(f"model {name!r} is a file; give a checkpoint directory (with config.json) or a hub id")
    if not is_hub_id(name):
        raise FileNotFoundError(f"model {name!r}: no such directory (nor a Hugging Face hub id, which reads 'org/name')")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f" at revision {revision!r}" if revision is not None else ""
    patterns = _CONFIG_FILES + ([] if load_format == "dummy" else _WEIGHT_FILES)
    try:
        return Path(snapshot_download(name, revision=revision, allow_patterns=patterns))
    except GatedRepoError:
        raise FileNotFoundError(
            f"model {name!r} is a gated hub repo: accept its terms on huggingface.co and set HF_TOKEN"
        ) from None
    except RepositoryNotFoundError:
        raise FileNotFoundError(
            f"model {name!r}: no such directory, and no such Hugging Face hub repo (or it is private: set HF_TOKEN)"
        ) from None
    except RevisionNotFoundError:
        raise FileNotFoundError(f"model {name!r}: the hub repo has no revision {revision!r}") from None
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE=1 is set" if constants.HF_HUB_OFFLINE else "the hub could not be reached"
        raise FileNotFoundError(
            f"model {name!r}{at}: no such directory, not in the local Hugging Face cache ({constants.HF_HUB_CACHE}), and {why}"
        ) from None


def default_served_name(model: str) -> str:
    """The name a server answers to when not told (``--served-model-name``): a hub id as given, a
    directory's base name."""
    path = Path(model).expanduser()
    return path.resolve().name if path.is_dir() else model
