"""EngineConfig: every engine option once, with its type, default, flag, help and check.

``kvtier.LLM(path, **options)``, ``EngineCore(path, config)``, ``kvtier serve``, ``kvtier
generate`` and every ``kvtier bench`` (their flags come from :meth:`EngineConfig.add_flags`; a
bench takes the options it uses, with defaults of its own by name), the servers ``kvtier bench``
starts (:meth:`EngineConfig.to_flags`) and ``kvtier serve --role`` (:func:`dataclasses.replace`)
all take their options from here, so an option is added, documented and checked in one place::

    options ─► EngineConfig(**options)  (__post_init__: ValueError naming the bad value)
    flags   ─► EngineConfig.from_args(argparse namespace)  ◄── add_flags(parser[, only, defaults])
    config  ─► to_flags() ─► `kvtier serve MODEL ...` argv of a started server

Defaults that depend on the model or the machine stay ``None`` here and are resolved once, when
the engine is built (engine/resolve.py, engine/sizing.py); every part of the engine takes the
resolved config:

- ``num_device_blocks=None``: sized from free memory (90% of free GPU memory after weights,
  less 1 GiB; 20% of available RAM on CPU), capped at ``max_num_seqs`` full-length sequences;
  with ``gpu_memory_utilization=u`` (vLLM's option), ``u`` x the GPU's total memory less what is
  in use after loading the weights (this engine's and other processes') and an activation
  reserve (engine/sizing.py), and not capped;
- ``num_host_blocks=None``: no host tier (0), unless ``storage`` is set: then a host tier of
  twice the device tier, at most a quarter of the available RAM, since storage I/O goes
  through it;
- ``write_policy=None``: ``"write_through"`` with a host tier or a storage pool (every computed
  block is copied down: multi-turn histories come back from the host tier, and the pool serves
  the next engine; ``write_through_selective`` left most of a multi-turn working set uncached,
  docs/BENCHMARKS.md), else ``"write_through_selective"``;
- ``early_loads=True``: a request waiting for a storage fetch has its host hits, then each chunk
  as it lands, copied on to the device meanwhile (when the device tier can hold the whole
  request), so it is admitted with device hits: the H2D of a storage hit overlaps the fetch
  instead of following it (``False``: loaded at admission, layer-overlapped);
- ``storage_workers=None``: fetch threads, one per core, 2 to 16 (they wait on I/O);
- ``storage_put_workers=None``: one put thread. Each put thread takes the interpreter from the
  engine thread at every syscall and checksum; on an H100 host a cold 4K prompt took 57-60 ms
  with 8 put threads writing the last request's blocks, 24-29 ms with one (21 ms without a
  pool). A prefill server of PD, whose product is its writes, takes more (``kvtier serve
  --role prefill``: half the fetch threads);
- ``preemption_mode=None``: swap with a host tier, else recompute;
- ``max_num_seqs_per_request=None``: a quarter of ``max_num_seqs``, at least 1
  (engine/resolve.py; what it bounds: engine/scheduler.py);
- ``cuda_graphs=None``: on for CUDA (with the triton attention backend);
- ``overlap_schedule=None``: on for CUDA (the CPU schedules step N+1 while the GPU runs step N),
  off on CPU (where a step runs to its end before the host goes on: nothing to overlap, and a
  finished request's extra step would cost a forward).

This module imports no torch, so ``kvtier --help`` stays fast.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Callable, Iterable, Mapping

from kvtier import flags as types
from kvtier.cache.policy import EVICTION_POLICIES, WRITE_POLICIES


def _opt(
    default: Any,
    help: str,
    *,
    type: Callable[[str], Any] | None = None,  # noqa: A002
    choices: tuple | None = None,
    flag: str | None = None,
    switch: str | None = None,
    metavar: str | None = None,
    aliases: tuple[str, ...] = (),
    off: tuple[str, ...] = (),
) -> Any:
    """A field with its command-line form: ``flag`` (default ``--name-with-dashes``); ``switch``:
    a bool set by one flag (``--no-prefix-caching``); a bool or None default without ``switch``
    and without ``type``: ``--x/--no-x``. ``aliases``: the same flag under the names vLLM and
    SGLang users type (``--num-gpu-blocks-override``); ``off``: their flags that turn a bool
    option off (``--enforce-eager``)."""
    return field(
        default=default,
        metadata={
            "help": help,
            "type": type,
            "choices": choices,
            "flag": flag,
            "switch": switch,
            "metavar": metavar,
            "aliases": aliases,
            "off": off,
        },
    )


@dataclass(frozen=True)
class EngineConfig:
    device: str = _opt("cpu", "cpu, cuda or cuda:N (default cpu)", type=str)
    dtype: str = _opt(
        "auto",
        "compute dtype; auto = the checkpoint's on cuda, float32 on cpu (default auto)",
        choices=("auto", "float32", "bfloat16", "float16"),
    )
    kv_cache_dtype: str = _opt(
        "auto",
        "dtype of the KV cache in every tier (device, host, storage): auto = the compute dtype; fp8 (= fp8_e4m3) "
        "or fp8_e5m2 = half the bytes of bf16 (twice the blocks in the same memory), K and V quantized where they "
        "are written with a scale per layer and KV head: the checkpoint's k_scale/v_scale, else calibrated when the "
        "engine starts on a fixed built-in input, so engines of one checkpoint share a pool (default auto)",
        choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"),
    )
    block_size: int = _opt(
        16, "tokens per KV block, a power of two (default 16)", type=types.block_size, aliases=("--page-size",)
    )
    num_device_blocks: int | None = _opt(
        None,
        "device tier size in blocks (default: sized from free memory)",
        type=types.positive_int,
        aliases=("--num-gpu-blocks-override",),
    )
    gpu_memory_utilization: float | None = _opt(
        None,
        "cuda: the fraction of the GPU's total memory this engine may use (weights, activations and "
        "the device tier; memory other processes hold counts against it): the device tier gets what "
        "is left (default: 90% of the memory free after the weights, less 1 GiB); ignored on cpu, with a warning",
        type=types.fraction,
    )
    num_host_blocks: int | None = _opt(
        None,
        "host tier size in blocks; 0 = none (default: none, or with --storage a host tier sized from free "
        "memory: twice the device tier, at most a quarter of available RAM)",
        type=types.non_negative_int,
    )
    storage: str | None = _opt(
        None,
        "storage pool URL (its I/O goes through the host tier): file:///dir[?capacity=100GiB], "
        "memory://?capacity=1GiB, redis://[:password@]host:port/db, rediss://..., "
        "redis+cluster://host:port,host:port, mooncake://host:port?protocol=tcp[&segment=4GiB]; "
        "any URL takes &throttle=RATE to simulate a slow pool (default none)",
        type=str,
    )
    write_policy: str | None = _opt(
        None,
        "when blocks are copied down a tier (default: write_through with --storage, so every computed block "
        "reaches the pool, and with a host tier; else write_through_selective)",
        choices=tuple(WRITE_POLICIES),
        aliases=("--hicache-write-policy",),
    )
    write_through_threshold: int = _opt(2, "hits before write_through_selective copies down (default 2)", type=types.positive_int)
    enable_prefix_caching: bool = _opt(
        True,
        "disable prefix caching",
        switch="--no-prefix-caching",
        aliases=("--no-enable-prefix-caching", "--disable-radix-cache"),
    )
    prefetch_policy: str = _opt(
        "best_effort",
        "when a request with storage hits starts: best_effort = after the time the fetch was "
        "expected to take, with what landed; wait_complete = when all landed; timeout = after "
        "--prefetch-timeout (default best_effort)",
        choices=("best_effort", "wait_complete", "timeout"),
        aliases=("--hicache-storage-prefetch-policy",),
    )
    prefetch_timeout: tuple[float, float] = _opt(
        (0.1, 0.05),
        "prefetch_policy=timeout: seconds, plus seconds per 1K prompt tokens (default 0.1,0.05)",
        type=types.timeout_pair,
        metavar="BASE,PER_1K",
    )
    storage_fetch: str = _opt(
        "auto", "fetch from storage only when cheaper than recompute (auto) or always (default auto)", choices=("auto", "always")
    )
    storage_workers: int | None = _opt(None, "storage fetch threads (default: one per core, 2 to 16)", type=types.positive_int)
    storage_put_workers: int | None = _opt(
        None,
        "storage put threads (default 1: each one slows the engine thread while it writes; "
        "kvtier serve --role prefill: half the fetch threads)",
        type=types.positive_int,
    )
    early_loads: bool = _opt(
        True,
        "a request waiting for a storage fetch has its host hits and each fetched chunk, as it lands, "
        "copied on to the device meanwhile, so it starts with device hits (default on; --no-early-loads "
        "loads them when it starts)",
    )
    tensor_parallel_size: int = _opt(
        1,
        "tensor parallel ranks: the model's heads and MLPs split over this many GPUs of the host (cuda:N.."
        "cuda:N+size-1 from --device), or processes on cpu; one process per rank (default 1)",
        type=types.positive_int,
        aliases=("-tp", "--tp-size"),
    )
    tp_timeout: float = _opt(
        60.0,
        "tensor parallel: seconds a rank may take to join a collective or answer rank 0; past it, or "
        "when a rank process dies, the engine stops with an error naming the rank (default 60)",
        type=types.positive_float,
        metavar="S",
    )
    preemption_mode: str | None = _opt(
        None,
        "when the device tier is full: swap a request's KV to the host tier and load it back, or "
        "recompute it (default: swap when there is a host tier, else recompute)",
        choices=("swap", "recompute"),
    )
    load_format: str = _opt(
        "auto",
        "auto: the checkpoint's safetensors; dummy: random weights in device memory "
        "from config.json alone (benchmarks; a hub id then fetches no weights) (default auto)",
        choices=("auto", "dummy"),
    )
    revision: str | None = _opt(None, "a hub id's branch, tag or commit (default: its main branch)", type=str, metavar="REV")
    seed: int = _opt(0, "engine seed (default 0)", type=int, aliases=("--random-seed",))
    max_num_batched_tokens: int = _opt(2048, "token budget per step (default 2048)", type=types.positive_int)
    max_num_seqs: int = _opt(
        256, "running requests at most (default 256)", type=types.positive_int, aliases=("--max-running-requests",)
    )
    max_num_seqs_per_request: int | None = _opt(
        None,
        "running sequences one request holds at most: kvtier serve counts every prompt and sample (n) "
        "of one HTTP call together, kvtier.LLM each prompt's samples; a call of many samples then runs "
        "beside other callers' requests, not ahead of them. 1..max_num_seqs; max_num_seqs lets one "
        "request fill the batch (default: a quarter of max_num_seqs, at least 1)",
        type=types.positive_int,
        metavar="N",
    )
    max_model_len: int | None = _opt(
        None, "context length (default: the model's)", type=types.positive_int, aliases=("--context-length",)
    )
    attention_backend: str | None = _opt(
        None, "attention kernels (default: triton on cuda, torch on cpu)", choices=("torch", "triton")
    )
    eviction: str = _opt(
        "lru", "eviction order (default lru)", choices=tuple(sorted(EVICTION_POLICIES)), aliases=("--radix-eviction-policy",)
    )
    capture_routing: bool = _opt(True, "MoE: do not capture routed experts (R3)", switch="--no-routing-capture")
    cuda_graphs: bool | None = _opt(
        None,
        "replay decode steps and other steps of up to 256 tokens from CUDA graphs captured at start (default: on for cuda)",
        off=("--enforce-eager", "--disable-cuda-graph"),
    )
    overlap_schedule: bool | None = _opt(
        None,
        "schedule step N+1 on the CPU while the GPU runs step N (default: on for cuda; --no-overlap-schedule turns it off)",
        off=("--disable-overlap-schedule",),
    )
    num_speculative_tokens: int = _opt(
        0,
        "speculative decoding: tokens the model's MTP block drafts per step, verified by one target forward "
        "(greedy: the same tokens as without; sampled: the same distribution); 0 = off. A step that verifies "
        "or makes drafts is not overlapped, nor any under tensor parallelism; the others are (default 0)",
        type=types.non_negative_int,
        flag="--speculative-tokens",
        aliases=("--num-speculative-tokens",),
        metavar="K",
    )
    speculative_min_acceptance: float = _opt(
        0.1,
        "speculative decoding: a request whose drafts are accepted at a rate under this (a running mean "
        "over its last steps) stops drafting, and drafts again every 17th engine step to see whether it should "
        "go on (its tokens never depend on it); 0 = always draft (default 0.1)",
        type=types.unit_interval,
        metavar="RATE",
    )
    pd_on_miss: str = _opt(
        "recompute",
        "PD decode side: blocks missing, corrupt or late in the pool are "
        "recomputed, or the request fails with 502 (default recompute)",
        choices=("recompute", "error"),
    )
    export_timeout: float = _opt(
        30.0, "PD prefill side: seconds to wait for the pool to ack a prompt's blocks (default 30)", type=types.positive_float
    )
    max_images_per_request: int = _opt(
        8, "vision-language models: images one request may carry; more are refused (default 8)", type=types.non_negative_int
    )
    max_image_bytes: int = _opt(
        20 << 20,
        "vision-language models: encoded image bytes one request may carry, all its images together (default 20971520)",
        type=types.positive_int,
        metavar="BYTES",
    )
    max_image_pixels: int = _opt(
        4096 * 4096,
        "vision-language models: pixels of one decoded image at most, read from its header before it is "
        "decoded (default 16777216)",
        type=types.positive_int,
        metavar="PIXELS",
    )
    encoder_cache_size: int = _opt(
        64,
        "vision-language models: vision tower outputs kept on the device by image hash (least recently used "
        "dropped first), so a resent image does not run the tower again; 0 = none (default 64 images)",
        type=types.non_negative_int,
        metavar="IMAGES",
    )

    def __post_init__(self) -> None:
        """Every check that needs no model: ValueError naming the bad value, before anything loads."""
        for f in fields(self):
            value, meta = getattr(self, f.name), f.metadata
            if value is None and f.default is None:
                continue
            if meta["choices"] is not None and value not in meta["choices"]:
                raise ValueError(f"unknown {f.name} {value!r}; choose {', '.join(map(str, meta['choices']))}")
            if (
                meta["type"] is None
                and meta["choices"] is None
                and isinstance(f.default, bool | None)
                and not isinstance(value, bool)
            ):
                raise ValueError(f"{f.name} must be True or False, got {value!r}")
        for name, lo in (
            ("num_device_blocks", 1),
            ("num_host_blocks", 0),
            ("max_num_seqs", 1),
            ("max_num_seqs_per_request", 1),
            ("max_num_batched_tokens", 1),
            ("write_through_threshold", 1),
            ("seed", None),
            ("storage_workers", 1),
            ("storage_put_workers", 1),
            ("max_model_len", 1),
            ("tensor_parallel_size", 1),
            ("num_speculative_tokens", 0),
            ("max_images_per_request", 0),
            ("max_image_bytes", 1),
            ("max_image_pixels", 1),
            ("encoder_cache_size", 0),
        ):
            types.check_int(name, getattr(self, name), lo, optional=getattr(EngineConfig, name, 0) is None)
        if self.max_num_seqs_per_request is not None and self.max_num_seqs_per_request > self.max_num_seqs:
            raise ValueError(
                f"max_num_seqs_per_request must be at most max_num_seqs ({self.max_num_seqs}), "
                f"got {self.max_num_seqs_per_request}"
            )
        from kvtier.cache.manager import check_block_size
        from kvtier.cache.policy import WritePolicy

        check_block_size(self.block_size)
        if self.write_policy is not None:
            WritePolicy(self.write_policy, self.write_through_threshold)
        if self.storage is not None and self.num_host_blocks == 0:
            raise ValueError(
                "a storage tier needs a host tier: num_host_blocks=0 turns it off; "
                "leave num_host_blocks unset (sized from free memory) or set it > 0"
            )
        if self.preemption_mode == "swap" and not self.num_host_blocks and self.storage is None:
            raise ValueError("preemption_mode='swap' needs a host tier: set num_host_blocks > 0")
        if not (isinstance(self.export_timeout, int | float) and self.export_timeout > 0):
            raise ValueError(f"export_timeout must be > 0 seconds, got {self.export_timeout!r}")
        if self.revision is not None and (not isinstance(self.revision, str) or not self.revision.strip()):
            raise ValueError(f"revision must be a branch, tag or commit name, got {self.revision!r}")
        if self.gpu_memory_utilization is not None:
            u = self.gpu_memory_utilization
            if isinstance(u, bool) or not isinstance(u, int | float) or not 0 < u <= 1:
                raise ValueError(f"gpu_memory_utilization must be a fraction in (0, 1], got {u!r}")
            # (on cpu it is accepted and ignored, with a warning when the engine starts: a vLLM
            # command line carries it; the device tier there is sized from available RAM)
            if self.num_device_blocks is not None and str(self.device).startswith("cuda"):
                raise ValueError("give num_device_blocks or gpu_memory_utilization, not both")
        if not (isinstance(self.tp_timeout, int | float) and self.tp_timeout > 0):
            raise ValueError(f"tp_timeout must be > 0 seconds, got {self.tp_timeout!r}")
        if self.tensor_parallel_size > 1 and isinstance(self.storage, str) and self.storage.startswith("memory:"):
            raise ValueError(
                f"tensor_parallel_size={self.tensor_parallel_size} needs a pool every rank's process reaches "
                f"(file://, redis://, mooncake://), not {self.storage!r}: a memory:// pool lives in one process"
            )
        if self.num_speculative_tokens:
            k = self.num_speculative_tokens
            if k > 8:
                raise ValueError(f"num_speculative_tokens must be at most 8, got {k}")
            if not 0 <= self.speculative_min_acceptance <= 1:
                raise ValueError(f"speculative_min_acceptance must be in [0, 1], got {self.speculative_min_acceptance!r}")
        device = str(self.device)
        if device not in ("cpu", "cuda") and not (device.startswith("cuda:") and device[5:].isdigit()):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if len(self.prefetch_timeout) != 2 or not all(isinstance(x, int | float) and x >= 0 for x in self.prefetch_timeout):
            raise ValueError(f"prefetch_timeout must be two numbers >= 0 (base, per 1K tokens), got {self.prefetch_timeout!r}")

    # ------------------------------------------------------------------ command lines
    @classmethod
    def add_flags(
        cls,
        parser: argparse.ArgumentParser | Any,
        only: Iterable[str] | None = None,
        defaults: Mapping[str, Any] | None = None,
        shown: Mapping[str, str] | None = None,
    ) -> None:
        """Every field as a flag of ``parser`` (dest = the field's name). A bench takes ``only``
        the options it uses, ``defaults`` another default by name where it needs one (its
        help then says that default), and ``shown``: how the help says a default the bench
        decides itself when the flag is not given (``{"storage": "a temporary file:// pool"}``).
        ValueError naming an option that is not a field (or, in ``defaults`` or ``shown``, not
        among ``only``)."""
        chosen = _names(only) if only is not None else [f.name for f in fields(cls)]
        defaults, shown = dict(defaults or {}), dict(shown or {})
        unknown = sorted((set(defaults) | set(shown)) - set(chosen))
        if unknown:
            raise ValueError(f"defaults or shown for {', '.join(unknown)}: not among the flags added ({', '.join(chosen)})")
        for f in fields(cls):
            if f.name not in chosen:
                continue
            name = f.metadata["flag"] or "--" + f.name.replace("_", "-")
            meta = dict(f.metadata)
            default = defaults.get(f.name, f.default)
            if f.name in shown:
                meta["help"] = _with_default(meta["help"], f"default: {shown[f.name]}")
            elif f.name in defaults:
                meta["help"] = _with_default(meta["help"], f"default {_default_text(default)}")
            meta["help"] = meta["help"].replace("%", "%%")  # argparse formats help with %
            if meta["off"]:
                meta["help"] += " (also " + ", ".join(meta["off"]) + ": off)"
            if meta["switch"]:
                parser.add_argument(
                    meta["switch"], *meta["aliases"], dest=f.name, action="store_false", default=default, help=meta["help"]
                )
            elif meta["type"] is None and meta["choices"] is None:  # --x / --no-x
                parser.add_argument(name, dest=f.name, action=argparse.BooleanOptionalAction, default=default, help=meta["help"])
            else:
                parser.add_argument(
                    name,
                    *meta["aliases"],
                    dest=f.name,
                    type=meta["type"],
                    choices=meta["choices"],
                    default=default,
                    metavar=meta["metavar"],
                    help=meta["help"],
                )
            for flag in meta["off"]:
                parser.add_argument(flag, dest=f.name, action="store_const", const=False, help=argparse.SUPPRESS)

    @classmethod
    def from_args(cls, args: argparse.Namespace, only: Iterable[str] | None = None) -> "EngineConfig":
        """The config of parsed flags: every field's, or ``only`` those (the rest: defaults)."""
        names = _names(only) if only is not None else [f.name for f in fields(cls)]
        return cls(**{name: getattr(args, name) for name in names})

    def to_flags(self) -> list[str]:
        """The ``kvtier serve`` / ``generate`` flags that give this config (its non-default fields)."""
        out: list[str] = []
        for f in fields(self):
            value, meta = getattr(self, f.name), f.metadata
            default = f.default if f.default is not MISSING else None
            if value == default:
                continue
            name = meta["flag"] or "--" + f.name.replace("_", "-")
            if meta["switch"]:
                out.append(meta["switch"])
            elif meta["type"] is None and meta["choices"] is None:
                out.append(name if value else "--no-" + name[2:])
            elif isinstance(value, tuple):
                out += [name, ",".join(map(str, value))]
            else:
                out += [name, str(value)]
        return out


def _names(only: Iterable[str]) -> list[str]:
    """``only`` as a list, each a field of EngineConfig (ValueError naming one that is not)."""
    names, known = list(only), {f.name for f in fields(EngineConfig)}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown engine option {', '.join(map(repr, unknown))}; choose from {', '.join(sorted(known))}")
    return names


def _default_text(value: Any) -> str:
    """A default as a help line says it: on/off, none, 0.1,0.05."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None:
        return "none"
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value)


def _with_default(help: str, default: str) -> str:  # noqa: A002
    """``help`` with its "(default ...)" clause, wherever it is, replaced by "(DEFAULT)" at its end."""
    return re.sub(r" ?\(default[^()]*\)", "", help, count=1) + f" ({default})"
