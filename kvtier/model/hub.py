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
        rev = f" --revision {revision}" if revision is not None else ""
        get = f"`huggingface-cli download {name}{rev}` (or `hf download {name}{rev}`) on a machine that reaches the hub"
        if constants.HF_HUB_OFFLINE:
            why = f"HF_HUB_OFFLINE=1 is set: unset it to download it, or fetch it first with {get}"
        else:
            why = (
                "the hub could not be reached: check the network (or HF_ENDPOINT), or fetch it with "
                f"{get} and copy the cache here (HF_HUB_CACHE)"
            )
        raise FileNotFoundError(
            f"model {name!r}{at}: no such directory, not in the local Hugging Face cache ({constants.HF_HUB_CACHE}), and {why}"
        ) from None


def default_served_name(model: str) -> str:
    """The name a server answers to when not told (``--served-model-name``): the model argument
    as given (a hub id, or a directory as it was spelled), as vLLM and SGLang serve it."""
    return model


def model_aliases(model: str, path: str | os.PathLike) -> tuple[str, ...]:
    """The other names requests may give the model served from ``path`` (its checkpoint
    directory) started as ``model``: the argument as given, the directory's base name, its
    absolute path (and the resolved one, through symlinks). :func:`same_name` accepts each
    spelled with a trailing slash or ``./`` too."""
    p = Path(path).expanduser()
    names = [model, p.name, os.path.abspath(p), str(p.resolve())]
    given = Path(model).expanduser()
    if given.is_dir():
        names.append(os.path.abspath(given))
    return tuple(dict.fromkeys(n for n in names if n))


def name_form(name: str) -> str:
    """``name`` as :func:`same_name` compares it: a path without trailing slashes, ``./`` or
    ``a/../``; a hub id as it is."""
    return os.path.normpath(name) if name else name


def same_name(name: str, names: "frozenset[str]", forms: "frozenset[str]") -> bool:
    """Whether a request's model ``name`` is one of ``names`` (``forms``: their
    :func:`name_form`), spelled as given or as a path (trailing slash, ``./m``, relative to the
    server's working directory). Pure string work: nothing on disk is looked at."""
    if name in names:
        return True
    return name_form(name) in forms or os.path.abspath(name) in forms
