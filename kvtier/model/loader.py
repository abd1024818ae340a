"""Load a Hugging Face checkpoint directory (config.json + safetensors) into a :class:`CausalLM`.

Files: ``model.safetensors``, or shards listed in ``model.safetensors.index.json``, or any
``*.safetensors`` in the directory. Checkpoint names are mapped to ours (see ``_rename``); every
parameter the model needs must be present, or loading fails naming the missing tensor.

Multi-head latent attention checkpoints (DeepSeek-V2/V3, config.MLA_ARCHITECTURES) load through
:func:`load_model`, the engine's loader, with MTP drafting and tensor parallelism (model/deepseek.py, on
``allocate_kv_caches``' latent layers); :func:`load_mla_model` is the same model alone. The hybrid
sliding-window families (gpt-oss, Gemma 2, Gemma 3: config.SLIDING_ARCHITECTURES) load through
:func:`load_model` too (model/gpt_oss.py, model/gemma.py), on one device.

``load_format="dummy"`` (vLLM's name) needs only config.json: every weight is drawn in device
memory from a fixed seed, small enough that bf16 forwards stay finite. For benchmarks of
checkpoint shapes that are not on disk (e.g. the ``llama3-8b-shape`` preset written with
``kvtier init-model --config-only``).

:func:`weights_digest` names the weights for storage keys: every byte of the files
:func:`safetensors_files` lists (the loader's own list), cached per file by
:mod:`kvtier.model.digest_cache`.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Callable, Iterator, TypeVar

import torch
import xxhash
from safetensors import safe_open
from tqdm import tqdm

from kvtier.model.config import SLIDING_ARCHITECTURES, ModelConfig
from kvtier.model.deepseek import DeepseekForCausalLM
from kvtier.model.digest_cache import DigestCache, file_stamp
from kvtier.model.families import CausalLM
from kvtier.model.gemma import GemmaForCausalLM
from kvtier.model.gpt_oss import GptOssForCausalLM
from kvtier.model.layers import RMSNorm, RotaryEmbedding
from kvtier.model.llava import LlavaForConditionalGeneration
from kvtier.model.shard import TPShard, check_divisible, full_shape, shard_dim, take_shard, take_slice

_MIXTRAL_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.*)$")
_FUSED_EXPERTS = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
# gpt-oss: gate_up_proj [E, hidden, 2I] (gate, up interleaved), down_proj [E, I, hidden], biases [E, out]
_GPT_OSS_EXPERTS = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias)?$")
LOAD_FORMATS = ("auto", "dummy")
DUMMY_SEED = 0
_Model = TypeVar("_Model", bound=CausalLM | DeepseekForCausalLM | GemmaForCausalLM)


def safetensors_files(path: Path) -> list[Path]:
    """The weight files the loader reads, in order (and :func:`weights_digest` hashes: one list,
    so the two can never disagree). Index entries may name sub-folders (``sub/x.safetensors``) but
    never leave the checkpoint (no absolute names, no ``..``)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
        for name in names:
            parts = Path(name).parts
            if not isinstance(name, str) or not parts or Path(name).is_absolute() or ".." in parts:
                raise ValueError(f"{index} names weight file {name!r} outside the checkpoint directory")
        return [path / name for name in names]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors weights in {path} (load_format='dummy' makes random weights from config.json alone)"
        )
    return files


def _rename(name: str, num_layers: int) -> str:
    """Checkpoint name -> our parameter name (Mixtral's MoE block uses other names, gpt-oss's router
    is our gate; DeepSeek-V3's MTP blocks are ``model.layers.{num_layers + i}``: ours are ``mtp.{i}``)."""
    name = name.replace(".block_sparse_moe.", ".mlp.").replace(".mlp.router.", ".mlp.gate.")
    layer = _LAYER.match(name)
    if layer and int(layer[1]) >= num_layers:
        name = f"mtp.{int(layer[1]) - num_layers}.{layer[2]}"
    m = re.match(r"(.*\.mlp\.experts\.\d+)\.(w[123])\.(weight)$", name)
    if m:
        name = f"{m[1]}.{_MIXTRAL_EXPERT[m[2]]}.{m[3]}"
    return name


# LLaVA checkpoints name the text model language_model.model.* (transformers < 5: language_model.*
# under model.) and the tower vision_tower.vision_model.*: ours are model.*, lm_head, vision_tower.*
_VISION_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)


def _rename_vision(name: str) -> str:
    for old, new in _VISION_PREFIXES:
        if name.startswith(old):
            name = new + name[len(old) :]
            break
    return name.replace("vision_tower.vision_model.", "vision_tower.")


def _checkpoint_tensors(
    files: list[Path], cfg: ModelConfig, tp: TPShard | None = None
) -> Iterator[tuple[str, torch.Tensor, tuple[int, ...]]]:
    """(our name, tensor, the whole tensor's shape) triples; 3D fused expert tensors are split
    into per-expert weights. With ``tp``, a sharded tensor is read as this rank's slice only
    (safetensors reads just those bytes: a rank of a 70B model does not read every rank's)."""
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                name = _rename(_rename_vision(key) if cfg.vision is not None else key, cfg.num_layers)
                if cfg.architecture == "GptOssForCausalLM" and ".mlp.experts." in name:
                    yield from _gpt_oss_experts(name, f.get_tensor(key))
                    continue
                fused = _FUSED_EXPERTS.match(name)
                if not fused:
                    dim = shard_dim(name) if tp is not None and tp.size > 1 else None
                    if isinstance(dim, int):
                        assert tp is not None  # (dim is set only with tp)
                        part = f.get_slice(key)
                        shape = tuple(part.get_shape())
                        yield name, take_slice(part, shape, dim, tp, name), shape
                    else:
                        tensor = f.get_tensor(key)
                        yield name, take_shard(name, tensor, tp), tuple(tensor.shape)
                    continue
                stacked = f.get_tensor(key)  # gate_up_proj [E, 2I, H]; down_proj [E, H, I]
                for e, w in enumerate(stacked):
                    if fused[2] == "down_proj":
                        down = f"{fused[1]}.{e}.down_proj.weight"
                        yield down, take_shard(down, w, tp), tuple(w.shape)
                    else:
                        for half, part_name in zip(w.chunk(2, dim=0), ("gate_proj", "up_proj")):
                            proj = f"{fused[1]}.{e}.{part_name}.weight"
                            yield proj, take_shard(proj, half, tp), tuple(half.shape)


def _gpt_oss_experts(name: str, stacked: torch.Tensor) -> Iterator[tuple[str, torch.Tensor, tuple[int, ...]]]:
    """gpt-oss's stacked expert tensors as model/gpt_oss.py's per-expert Linears (weights transposed
    to [out, in]; gate and up stay interleaved)."""
    m = _GPT_OSS_EXPERTS.match(name)
    if m is None:
        raise ValueError(
            f"gpt-oss expert tensor {name!r} is not read (MXFP4-quantized experts, _blocks/_scales, are not "
            "supported): use a bf16 checkpoint"
        )
    for e, t in enumerate(stacked):
        part = f"{m[1]}.{e}.{m[2]}." + ("bias" if m[3] else "weight")
        t = t if m[3] else t.T
        yield part, t, tuple(t.shape)


def load_model(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = torch.float32,
    attention_backend: str = "torch",
    fuse: bool = True,
    load_format: str = "auto",
    tp: TPShard | None = None,
    mtp: bool = False,
) -> CausalLM:
    """Build the family named by config.json and fill it. ``dtype=None``: config's. ``mtp``: with
    the first MTP block (for drafting; ModelConfig.with_mtp), else without any. A DeepSeek-V2/V3
    checkpoint (multi-head latent attention) gives its :class:`DeepseekForCausalLM`, called as a
    CausalLM is (under ``tp`` its heads split, its latent whole on every rank).

    ``load_format``: "auto" reads the safetensors checkpoint; "dummy" draws random weights (see
    :func:`_dummy_weights`) and reads nothing but config.json. ``tp``: load only this rank's
    slice of every sharded tensor (model/shard.py); dummy weights are drawn whole and sliced, so
    every tensor-parallel size holds the same model."""
    path = Path(path)
    cfg = ModelConfig.from_hf_dir(path).with_mtp(mtp)
    if cfg.kv_kind == "latent":
        # decode rows on the Triton MLA kernel with the triton backend; its MTP block when it drafts;
        # under tensor parallelism the heads are split and every rank holds the whole latent
        return load_mla_model(path, device, dtype, fuse, load_format, mtp, attention_backend, tp)  # type: ignore[return-value]  # CausalLM's call signature
    if cfg.architecture in SLIDING_ARCHITECTURES:
        check_divisible(cfg, 1 if tp is None else tp.size)  # one device: ValueError naming the size
        return _fill(_sliding_model(cfg, attention_backend), path, device, dtype or cfg.torch_dtype, fuse, load_format, None)  # type: ignore[return-value]  # CausalLM's call signature
    with torch.device("meta"):
        model = (
            CausalLM(cfg, attention_backend, tp)
            if cfg.vision is None
            else LlavaForConditionalGeneration(cfg, attention_backend, tp)
        )
    return _fill(model, path, device, dtype or cfg.torch_dtype, fuse, load_format, tp)


def _sliding_model(cfg: ModelConfig, attention_backend: str) -> GptOssForCausalLM | GemmaForCausalLM:
    """A gpt-oss or Gemma 2/3 model (config.SLIDING_ARCHITECTURES) on meta, to be filled."""
    with torch.device("meta"):
        if cfg.architecture == "GptOssForCausalLM":
            return GptOssForCausalLM(cfg, attention_backend)
        return GemmaForCausalLM(cfg, attention_backend)


def load_mla_model(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = torch.float32,
    fuse: bool = True,
    load_format: str = "auto",
    mtp: bool = False,
    attention_backend: str = "torch",
    tp: TPShard | None = None,
) -> DeepseekForCausalLM:
    """A DeepSeek-V2/V3 checkpoint (config.MLA_ARCHITECTURES) as :func:`load_model` loads the
    others, with its first MTP block when ``mtp`` and this rank's slice under ``tp``; its caches:
    ``mla.allocate_latent_caches`` (one more for the MTP block)."""
    path = Path(path)
    cfg = ModelConfig.from_hf_dir(path).with_mtp(mtp)
    if cfg.kv_kind != "latent":
        raise ValueError(f"{cfg.architecture} has no latent attention: load it with load_model")
    with torch.device("meta"):
        model = DeepseekForCausalLM(cfg, attention_backend, tp)
    return _fill(model, path, device, dtype or cfg.torch_dtype, fuse, load_format, tp)


def _fill(
    model: _Model, path: Path, device: str | torch.device, dtype: torch.dtype, fuse: bool, load_format: str, tp: TPShard | None
) -> _Model:
    """``model`` (built on meta) with its weights on ``device``, its RoPE tables, fused if asked."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; choose from {', '.join(LOAD_FORMATS)}")
    if load_format == "dummy":
        std = json.loads((path / "config.json").read_text()).get("initializer_range") or 0.02
        loaded = _dummy_weights(model, device, dtype, std, tp)
    else:
        loaded = _checkpoint_weights(model, path, device, dtype, tp)
    model.load_state_dict(loaded, strict=False, assign=True)
    del loaded  # else fuse_projections keeps both copies alive
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    for owner in list(model.modules()):  # RoPE tables: built on meta, computed on CPU as transformers does
        for name, child in list(owner.named_children()):
            if isinstance(child, RotaryEmbedding):
                setattr(owner, name, RotaryEmbedding(child.config).to(device))
    if fuse:
        model.fuse_projections()
    model.eval()
    return model


def _param_dtype(model: CausalLM | DeepseekForCausalLM | GemmaForCausalLM, name: str, dtype: torch.dtype) -> torch.dtype:
    """``dtype``, or fp32 for the parameters the model keeps in fp32 (DeepSeek's router)."""
    if isinstance(model, DeepseekForCausalLM) and name.endswith(model.FP32_PARAMETERS):
        return torch.float32
    return dtype


def _checkpoint_weights(
    model: CausalLM | DeepseekForCausalLM | GemmaForCausalLM,
    path: Path,
    device: str | torch.device,
    dtype: torch.dtype,
    tp: TPShard | None = None,
) -> dict[str, torch.Tensor]:
    """Every parameter of ``model`` (on meta) from the checkpoint at ``path`` (``tp``: this
    rank's slice of each)."""
    params = dict(model.named_parameters())  # tied lm_head appears once, as embed_tokens
    size = tp.size if tp is not None else 1
    loaded: dict[str, torch.Tensor] = {}
    for name, tensor, whole in _checkpoint_tensors(safetensors_files(path), model.config, tp):
        if name not in params:
            # e.g. rotary inv_freq, tied lm_head copies, an MTP block's copies of the embedding
            # and head it shares with the target, MTP blocks of a model that does not draft
            continue
        expected = full_shape(name, tuple(params[name].shape), size)
        if whole != expected:
            raise ValueError(f"tensor {name!r} has shape {whole}, expected {expected}")
        loaded[name] = tensor.to(device=device, dtype=_param_dtype(model, name, dtype)).contiguous()
    missing = [name for name in params if name not in loaded]
    if missing:
        raise KeyError(
            f"checkpoint {path} is missing tensor {missing[0]!r}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    return loaded


def _dummy_weights(
    model: CausalLM | DeepseekForCausalLM | GemmaForCausalLM,
    device: str | torch.device,
    dtype: torch.dtype,
    std: float,
    tp: TPShard | None = None,
) -> dict[str, torch.Tensor]:
    """Random weights for every parameter of ``model`` (on meta), allocated and drawn on ``device``
    (nothing passes through host memory) from a generator seeded with DUMMY_SEED, in parameter
    order, so two loads on one device are equal. As transformers initializes: Linear / Embedding
    weights (experts and router gates too) ~ N(0, std), RMSNorm weights 1 (Gemma's: 0, the same
    norm), biases and attention sinks 0. With
    ``tp``, each tensor is drawn whole and this rank's slice kept (the same numbers at every
    tensor-parallel size)."""
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(DUMMY_SEED)
    norms = {f"{name}.weight": m.unit_weight for name, m in model.named_modules() if isinstance(m, RMSNorm)}
    norms.update({f"{name}.weight": 1.0 for name, m in model.named_modules() if isinstance(m, torch.nn.LayerNorm)})
    loaded: dict[str, torch.Tensor] = {}
    size = tp.size if tp is not None else 1
    for name, param in model.named_parameters():  # tied lm_head appears once, as embed_tokens
        tensor = torch.empty(full_shape(name, tuple(param.shape), size), device=device, dtype=_param_dtype(model, name, dtype))
        if name in norms:
            tensor.fill_(norms[name])
        elif name.endswith((".bias", ".sinks")):
            tensor.zero_()
        else:
            tensor.normal_(0.0, std, generator=generator)
        loaded[name] = take_shard(name, tensor, tp).contiguous()
    return loaded


def weights_digest(path: str | os.PathLike, load_format: str = "auto", device: str | torch.device = "cpu") -> str:
    """The digest naming a checkpoint's weights (storage keys carry it, DESIGN §3: two fine-tunes
    of one base never share a key, however few tensors differ): xxh3-128 of config.json and of
    every byte of every weight file the loader reads (:func:`safetensors_files`, sub-folders of
    an index included), each with its name. Sampling a few windows per file is not enough: a
    partial fine-tune changes only some tensors. Dummy weights are drawn from config.json by a
    seeded generator of ``device``'s type (CPU and CUDA draw different numbers): their digest is
    of the seed, the device type and config.json (two configs one ``rms_norm_eps`` apart must not
    share a block).

    Hashing reads the whole checkpoint once (disk speed: ~1 s per GB); a per-file digest is kept
    in the user's cache (:mod:`kvtier.model.digest_cache`) keyed by the file's real path, size,
    mtime, ctime, inode and device, so restarting a server on an unchanged checkpoint reads only
    config.json."""
    root = Path(path)
    if load_format == "dummy":
        kind = torch.device(device).type
        config = xxhash.xxh3_128(_framed((root / "config.json").read_bytes())).hexdigest()
        return f"dummy:{DUMMY_SEED}:{kind}:{config}"
    files = safetensors_files(root)
    h = xxhash.xxh3_128(b"kvtier-weights-v2\0")
    h.update(_framed((root / "config.json").read_bytes()))
    with DigestCache.open() as cache:
        todo = [f for f in files if cache.get(f) is None]
        total = sum(f.stat().st_size for f in todo)
        with tqdm(
            total=total,
            unit="B",
            unit_scale=True,
            desc="hashing weights",
            file=sys.stderr,
            disable=total < _PROGRESS_BYTES,
            leave=False,
        ) as bar:
            for f in files:
                digest = cache.get(f)
                if digest is None:
                    stamp = file_stamp(f)
                    digest = cache.put(f, _file_digest(f, bar.update), stamp)
                h.update(_framed(f.relative_to(root).as_posix().encode()) + _framed(bytes.fromhex(digest)))
    return h.hexdigest()


_PROGRESS_BYTES = 1 << 30  # a progress bar when more than this is to be hashed
_READ_CHUNK = 16 << 20  # large reads: hashing runs at disk speed, not syscall speed


def _framed(data: bytes) -> bytes:
    """Length-prefixed, so that no two sequences of fields hash alike."""
    return len(data).to_bytes(8, "little") + data


def _file_digest(file: Path, progress: Callable[[int], object] = lambda n: None) -> str:
    """xxh3-128 of every byte of ``file``, streamed through one reused buffer."""
    h = xxhash.xxh3_128()
    buf = bytearray(_READ_CHUNK)
    view = memoryview(buf)
    with open(file, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
            progress(n)
    return h.hexdigest()
