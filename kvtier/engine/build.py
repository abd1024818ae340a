"""An engine built once: the config resolved against the model and the machine, then every part in
the order each needs those before it. :class:`~kvtier.engine.core.EngineCore` takes the parts as
they are and only adds, aborts and steps requests::

    EngineConfig ─► resolve (engine/resolve.py: dtype, attention backend, context, ...)
      ─► [tensor parallel: ranks 1.. start and load their shards beside rank 0]
      ─► weights, tokenizer ─► size_tiers (device and host blocks, preemption, write policy)
      ─► storage pool (its threads) ─► cache manager
      ─► KV tiers: device (one scratch block more), pinned host ─► routing capture (MoE)
      ─► transfer engine, copy pump ─► pool bound to the host tier
      ─► kernels compiled ─► CUDA graphs ─► runner, speculator and its draft chain
      ─► [tensor parallel: every rank ready] ─► scheduler, intake
      = EngineParts

Every part takes the resolved config (``EngineParts.config``), not the options one by one.
A failure part way closes what was started, last first: the pinned host tier, the pool's threads,
the other ranks' processes. A tensor-parallel rank builds its own tiers, kernels, graphs and
runner with the same functions (:func:`allocate_tiers`, :func:`build_runner`; engine/tp/worker.py).
"""

from __future__ import annotations

import logging
import math
import os
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import torch

from kvtier.cache import CacheManager, ModelFingerprint
from kvtier.cache.cost import FetchCostModel
from kvtier.engine.config import EngineConfig
from kvtier.engine.copies import CopyPump
from kvtier.engine.cuda_graph import DecodeGraphs, StepGraphs, capture_graphs
from kvtier.engine.draft_graphs import build_chain
from kvtier.engine.encoder_cache import EncoderCache
from kvtier.engine.experts import ExpertCapture
from kvtier.engine.intake import Intake
from kvtier.engine.pool import bind_pool, open_pool
from kvtier.engine.resolve import resolve, resolve_device, size_tiers
from kvtier.engine.runner import ModelRunner
from kvtier.engine.scheduler import Scheduler
from kvtier.engine.sizing import DTYPES, block_nbytes, sliding_slots
from kvtier.engine.spec import Speculator
from kvtier.engine.startup import Startup
from kvtier.engine.tp.ranks import Ranks, backend_for, init_group
from kvtier.engine.tp.transfer import RankOps, TPStorage, TPTransfer
from kvtier.engine.warmup import compile_kernels
from kvtier.model import ModelConfig, allocate_kv_caches, host_kv_shape, load_model, weights_digest
from kvtier.model.families import CausalLM
from kvtier.model.hub import resolve_model
from kvtier.model.kv_quant import is_fp8, kv_cache_torch_dtype, scales_digest
from kvtier.model.kv_scales import kv_scales_for, set_kv_scales
from kvtier.model.shard import TPShard
from kvtier.model.tokenizer import load_tokenizer
from kvtier.storage.client import StorageClient
from kvtier.transfer.engine import TransferEngine
from kvtier.transfer.host_pool import HostKV

log = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineParts:
    """What :func:`build_engine` made, each part built over those above it."""

    config: EngineConfig  # resolved (engine/resolve.py): no option left to the model or the machine
    path: Path  # the checkpoint directory (a hub id's snapshot)
    model_config: ModelConfig  # the checkpoint's, with its MTP block when drafting (every rank's heads)
    device: torch.device  # rank 0's (cuda:N or cpu)
    dtype: torch.dtype
    model: CausalLM  # this rank's shard under tensor parallelism
    tokenizer: Any  # None: token-id prompts only
    ranks: Ranks | None  # tensor parallelism: ranks 1.. (engine/tp)
    storage: StorageClient | None  # the pool (rank 0's client of every rank's shards under TP)
    fetch_cost: FetchCostModel | None  # the pool's fetch-vs-recompute cost model
    cache: CacheManager
    kv_caches: list[torch.Tensor]  # per layer; num_device_blocks + 1 blocks (the last: scratch)
    kv_scales: list[torch.Tensor] | None  # an fp8 cache's scales per layer (model/kv_quant.py); None: not quantized
    host: HostKV | None  # the pinned host tier (None: no host tier)
    routing: ExpertCapture | None  # MoE routing capture (R3)
    transfer: TransferEngine | TPTransfer
    copies: CopyPump
    graphs: DecodeGraphs | None  # CUDA graphs of decode steps (None: eager)
    step_graphs: StepGraphs | None  # CUDA graphs of other steps of up to 256 tokens
    runner: ModelRunner
    spec: Speculator | None  # speculative decoding (MTP drafts)
    scheduler: Scheduler
    intake: Intake
    startup: Startup

    @property
    def host_kv(self) -> torch.Tensor | None:
        return self.host.tensor if self.host is not None else None

    def close(self) -> None:
        """Release what the parts hold: the other ranks, device memory, the pool's threads,
        pinned host memory (an engine's last word: copies in flight were waited for)."""
        if self.ranks is not None:
            # NCCL's teardown waits for every graph that holds its kernels: none may stay referenced
            self.graphs = self.step_graphs = None
            self.runner.release_graphs()
            self.ranks.close()  # (and leaves the process group)
        self.kv_caches.clear()
        if self.storage is not None:
            self.storage.close()
        if self.host is not None:
            self.host.release()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def build_engine(config: EngineConfig, model: str | os.PathLike, startup: Startup | None = None) -> EngineParts:
    """Every part of an engine serving ``model`` (a checkpoint directory or a hub id) under
    ``config`` (as given: resolved here). ``startup``: where the phases are reported
    (engine/startup.py). On CUDA every kernel variant a step can launch is compiled, and every
    CUDA graph captured, before this returns (engine/warmup.py).

    Bad sizes and types raise ValueError naming the value before the weights load."""
    device = resolve_device(config.device)  # (no GPU: nothing fetched)
    path = resolve_model(model, config.revision, config.load_format)
    model_config = ModelConfig.from_hf_dir(path).with_mtp(config.num_speculative_tokens > 0)
    c = resolve(config, model_config)
    assert c.attention_backend is not None  # (resolve)
    if device.type == "cuda":
        # the GPU is this thread's current device from here on (the engine loop's thread sets it
        # too): every stream, event and capture the engine makes is on it, also where a library
        # call takes "the current device" (an engine on cuda:1 would otherwise record its events
        # on cuda:0, docs/ARCHITECTURE.md)
        torch.cuda.set_device(device)
    startup = startup if startup is not None else Startup()
    dtype = DTYPES[c.dtype]
    kv_dtype = kv_cache_torch_dtype(c.kv_cache_dtype, dtype)  # every tier's (fp8: one byte a number)
    bytes_per_block = block_nbytes(model_config, c.block_size, kv_dtype)  # every rank's KV heads
    tp = c.tensor_parallel_size
    with ExitStack() as undo:  # a failure closes what was started, last first
        ranks = shard = None
        if tp > 1:
            # the other ranks start now and load their shards while this one loads its own
            # (the options as resolved here: every rank takes them as they are)
            ranks = Ranks.start(tp, str(path), replace(c, revision=None), device, c.tp_timeout)
            undo.callback(ranks.close)
            try:
                shard = TPShard(0, tp, init_group(backend_for(device), ranks.store, 0, tp, c.tp_timeout, device))
            except BaseException as e:
                ranks.lost(f"the tensor-parallel process group did not form: {e!r}")
                raise
        with startup("loading weights"):
            lm = load_model(
                path, device, dtype, c.attention_backend, load_format=c.load_format, tp=shard, mtp=c.num_speculative_tokens > 0
            )
        with startup("loading tokenizer"):
            tokenizer = load_tokenizer(path)
        # every rank holds as many device blocks as the tightest one fits
        c = size_tiers(c, bytes_per_block, ranks.gather_sizes() if ranks is not None else ())
        assert c.num_device_blocks is not None and c.num_host_blocks is not None and c.write_policy is not None  # (size_tiers)
        kv_scales = None
        if is_fp8(kv_dtype):  # fixed before any block is written into any tier (model/kv_quant.py)
            with startup("fp8 KV scales"):  # (every rank at once, each loaded and sized: engine/tp/worker.py)
                kv_scales, source = kv_scales_for(path, lm, kv_dtype, c.load_format)
                set_kv_scales(lm, kv_scales, device)
            startup.kv_cache = {"dtype": c.kv_cache_dtype, "scales": source, "digest": scales_digest(kv_scales)}
            log.info("KV cache %s, scales %s (digest %s)", c.kv_cache_dtype, source, scales_digest(kv_scales))
        fingerprint = _fingerprint(c, model_config, path, device, kv_dtype, kv_scales)
        storage, fetch_cost = open_pool(c)
        if storage is not None:
            undo.callback(storage.close)
        rank_ops = None
        if ranks is not None:  # every rank copies its shard of each op (engine/tp/transfer.py)
            rank_ops = RankOps(ranks)
            if storage is not None:
                storage.shard(0, tp, replicated=model_config.kv_kind == "latent")  # (a latent: one object per block)
                storage = TPStorage(storage, rank_ops)  # type: ignore[assignment]  # a StorageClient to the engine
        sliding = sliding_groups(model_config, c, storage is not None)
        cache = CacheManager(
            sliding=[(w, n) for w, _, n in sliding],
            block_size=c.block_size,
            num_device_blocks=c.num_device_blocks,
            num_host_blocks=c.num_host_blocks,
            storage=storage,
            write_policy=c.write_policy,
            write_through_threshold=c.write_through_threshold,
            eviction=c.eviction,
            fingerprint=fingerprint,
            block_nbytes=bytes_per_block,
            enable_prefix_caching=c.enable_prefix_caching,
            fetch_cost=fetch_cost,
            early_loads=bool(c.early_loads),
        )
        if ranks is not None:  # the others allocate, compile and capture beside this one
            ranks.send(("build", c, (storage.namespace, fingerprint) if storage is not None else None))
        with startup("allocating KV tiers"):
            kv_caches, host = allocate_tiers(lm.config, c, kv_dtype, sliding)  # (this rank's KV heads)
            if host is not None:
                undo.callback(host.release)
        host_kv = host.tensor if host is not None else None
        routing = None
        if model_config.is_moe and c.capture_routing:
            m = model_config
            routing = ExpertCapture(
                m.num_moe_layers, m.top_k, m.num_experts, c.block_size, c.num_device_blocks, c.num_host_blocks, device
            )
        local = TransferEngine(kv_caches, host_kv, routing)
        transfer = local if rank_ops is None else TPTransfer(local, rank_ops)
        copies = CopyPump(cache, transfer, storage)
        if storage is not None:
            assert host_kv is not None  # a pool always gets a host tier (config, size_tiers)
            bind_pool(storage, fetch_cost, host_kv, routing.host_store if routing is not None else None, fingerprint)
        runner, graphs, step_graphs = build_runner(lm, kv_caches, host_kv, c, routing, transfer.gates, startup)
        if sliding:
            runner.sliding_layers = [layers for _, layers, _ in sliding]
            runner.sliding_tables = cache.sliding_tables
        if ranks is not None:
            with startup("waiting for the other tensor-parallel ranks"):
                ranks.wait_ready()
            runner.peers = ranks
        parts = EngineParts(
            config=c,
            path=path,
            model_config=model_config,
            device=device,
            dtype=dtype,
            model=lm,
            tokenizer=tokenizer,
            ranks=ranks,
            storage=storage,
            fetch_cost=fetch_cost,
            cache=cache,
            kv_caches=kv_caches,
            kv_scales=kv_scales,
            host=host,
            routing=routing,
            transfer=transfer,
            copies=copies,
            graphs=graphs,
            step_graphs=step_graphs,
            runner=runner,
            spec=runner.spec,
            scheduler=Scheduler(cache, c, model_config.eos_token_ids),
            intake=Intake(path, tokenizer, model_config, c),
            startup=startup,
        )
        undo.pop_all()  # built: the parts are the engine's to close
    startup.done()
    return parts


def sliding_groups(model_config: ModelConfig, config: EngineConfig, has_pool: bool) -> list[tuple[int, tuple[int, ...], int]]:
    """(window, layers, slots) of each sliding group that keeps blocks of its own (cache/sliding.py),
    in model order; none where every layer keeps every block: with a host tier or a pool (they
    store every layer of a block), on CUDA (its warm-up and graphs read one block table),
    under tensor parallelism or with MTP drafts."""
    c = config
    assert c.num_device_blocks is not None and c.num_host_blocks is not None, "an unresolved config (engine/resolve.py)"
    if c.num_host_blocks or has_pool or c.device != "cpu" or c.tensor_parallel_size > 1 or c.num_speculative_tokens:
        return []
    sizes = (c.block_size, c.num_device_blocks, c.max_num_seqs, c.max_num_batched_tokens)
    groups = [g for g in model_config.attention_groups if g.window is not None]
    return [(g.window, g.layer_ids, sliding_slots(g.window, *sizes)) for g in groups if g.window is not None]


def allocate_tiers(
    model_config: ModelConfig,
    config: EngineConfig,
    dtype: torch.dtype,
    sliding: Sequence[tuple[int, tuple[int, ...], int]] = (),
) -> tuple[list[torch.Tensor], HostKV | None]:
    """The device tier, one block more than the pool hands out (the scratch block padded CUDA-
    graph rows and the start's kernel warm-up write to), and the host tier: pinned (on CUDA) and
    on the GPU's NUMA node, one storage object per host block. ``model_config``: this rank's
    (its KV heads). ``sliding``: the layers of each sliding group get its slots (plus the scratch)."""
    c, m = config, model_config
    assert c.num_device_blocks is not None and c.num_host_blocks is not None, "an unresolved config (engine/resolve.py)"
    device = torch.device(c.device)
    if sliding:  # one buffer per group: the full layers' device blocks, each sliding group's slots
        in_group = {layer for _, layers, _ in sliding for layer in layers}
        full = tuple(i for i in range(m.num_kv_layers) if i not in in_group)
        planes, *plane = m.kv_layout
        kv_caches: list[torch.Tensor] = [torch.empty(0)] * m.num_kv_layers
        for layers, n in [(full, c.num_device_blocks), *((layers, n) for _, layers, n in sliding)]:
            shape = (len(layers), planes, n + 1, c.block_size, *plane)
            for layer, kv in zip(layers, torch.zeros(shape, device=device, dtype=dtype).unbind(0)):
                kv_caches[layer] = kv
        return kv_caches, None
    kv_caches = allocate_kv_caches(m, c.num_device_blocks + 1, c.block_size, device, dtype)
    shape = host_kv_shape(m, c.num_host_blocks, c.block_size)
    return kv_caches, HostKV(shape, dtype, device) if c.num_host_blocks else None


def build_runner(
    model: CausalLM,
    kv_caches: list[torch.Tensor],
    host_kv: torch.Tensor | None,
    config: EngineConfig,
    routing: ExpertCapture | None,
    gates: Any,
    startup: Startup,
) -> tuple[ModelRunner, DecodeGraphs | None, StepGraphs | None]:
    """The runner over ``kv_caches``, with every kernel compiled (CUDA), its CUDA graphs
    captured (``config.cuda_graphs``; step graphs wait on the transfer engine's layer ``gates``)
    and, with speculative decoding, its speculator and draft chain (``runner.spec``)."""
    c, device = config, kv_caches[0].device
    if device.type == "cuda":
        with startup("compiling kernels"):
            startup.kernels_compiled = compile_kernels(model, kv_caches, host_kv, c)
    graphs = step_graphs = None
    if c.cuda_graphs:
        with startup("capturing CUDA graphs"):
            routing_shape = (model.config.num_moe_layers, model.config.top_k) if routing is not None else None
            graphs, step_graphs = capture_graphs(model, kv_caches, c, routing_shape, gates)
    runner = ModelRunner(model, kv_caches, c.block_size, device, routing, graphs, step_graphs)
    if model.config.vision is not None:
        runner.encoder = EncoderCache(c.encoder_cache_size)
    if c.num_speculative_tokens:
        runner.spec = Speculator(c.num_speculative_tokens, c.speculative_min_acceptance)
        if runner.spec.k > 1:
            with startup("capturing the draft chain's CUDA graphs" if c.cuda_graphs else "building the draft chain"):
                runner.spec.chain = build_chain(model, kv_caches, c, graphs.pool() if graphs is not None else None)
    return runner, graphs, step_graphs


def _fingerprint(
    config: EngineConfig,
    model_config: ModelConfig,
    path: Path,
    device: torch.device,
    kv_dtype: torch.dtype,
    kv_scales: list[torch.Tensor] | None,
) -> ModelFingerprint:
    """What a stored block's key says of the model that wrote it (DESIGN §3): its KV's shape
    (``kv_layout``: KV heads and head_dim, or one latent's width) and dtype, its weights, what
    blocks carry besides the decoder's KV, and a quantized cache's dtype and scales (an fp8 block
    never answers a bf16 engine, nor one of other scales)."""
    c, m = config, model_config
    payload = []  # not the same objects: a block with routing rows or the MTP block's KV
    if m.is_moe and c.capture_routing:
        payload.append(f"routing:{m.num_moe_layers}x{m.top_k}:{m.num_experts}")
    if m.num_mtp_layers:  # the MTP block's KV, layer num_layers of every block
        payload.append(f"mtp:{m.num_mtp_layers}")
    heads, width = math.prod(m.kv_layout[1:-1]), m.kv_layout[-1]  # full: KV heads, head_dim; latent: 1, kv_width
    return ModelFingerprint(
        m.architecture,
        m.num_layers,
        heads,
        width,
        c.dtype,
        c.block_size,
        weights=weights_digest(path, c.load_format, device),
        payload=";".join(payload),
        kv_cache=f"{str(kv_dtype).removeprefix('torch.')}:{scales_digest(kv_scales)}" if kv_scales is not None else "",
    )
