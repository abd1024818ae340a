"""The engine core: model, KV tiers, scheduler and the step loop, behind two front ends: the
offline ``kvtier.LLM`` (engine/llm.py) and the serving ``AsyncEngine`` (engine/async_engine.py).

    add_request(prompt, params, ...) -> Request     validated and queued; joins the next step
    step() -> [RequestOutput]                        one engine step; the requests it finished
    abort(request_id)                                drop a request (every sample), return its blocks
    has_unfinished()

``SamplingParams.n > 1`` (engine/group.py): one prefill, n decodes. The request runs as sample 0;
once it sampled its first token, samples 1..n-1 are queued at the front, share the prompt's
full blocks through the tree and compute only its last partial block. One RequestOutput per
request, when every sample finished (``outputs``, by index); a sample that fails fails the request.
A PD hand-off of n > 1 samples is refused (ValueError).

Prefill/decode hand-off (DESIGN §7): ``add_request(..., export=True)`` (P) runs the prefill and,
once its first token is sampled, writes every block of the prompt to the pool; its output comes
out when the pool acked them (or ``export_timeout`` passed), carrying the manifest in
``RequestOutput.handoff``. ``add_request(..., handoff=manifest)`` (D) starts from P's first
token and loads the prompt's blocks from the pool (storage hits, and the last partial block),
recomputing whatever is missing (or failing the request under ``pd_on_miss="error"``).

One engine step::

    poll copies ─► schedule() ─► upload inputs ─► submit plan (loads queued on the load stream,
        layer by layer) ─► forward (layer l waits on load event l, GPU-side) + sample, queued
        ─► advance() ─► [results of the step:] tokens to the host ─► loads landed ─► update()
        ─► fork (n > 1: a sample 0 that sampled its first token queues samples 1..n-1)
        ─► submit plan (backups of the blocks just written: offload stream, after the forward)
        ─► poll copies ─► finished requests: outputs, free ─► samples folded into their requests

Overlap scheduling (``overlap_schedule``, on for CUDA): the results of step N are taken after
step N+1 is scheduled and queued, so the host's work (scheduling, inputs, outputs, copies) runs
while the GPU computes and the GPU never waits for it in steady decode::

    host:  sched N+1 ─ launch N+1 ─ results N ─ sched N+2 ─ launch N+2 ─ results N+1 ─ ...
    GPU:   ... forward N ────────────┤ forward N+1 ──────────────────┤ forward N+2 ...

A decode of step N+1 reads its input token from step N's sampled tokens on the device. A request
that step N finishes (a stop token) runs in step N+1 for nothing; its token there is dropped and
its blocks return once step N+1's results are in. Outputs are the same as without overlap (a
seeded or greedy request draws from its own generator; an unseeded sampled request draws from
the engine's shared generator, so its tokens depend on the batches around it either way). The
step in flight is finished first when the next schedule needs its tokens on the host: a step
that loaded blocks (a failed load rewinds its request), one with repetition/presence/frequency
penalties or min_tokens (they count the output on the host), and before any preemption.

A step that raises fails its requests, not the engine (:meth:`step`): they come out with
``finish_reason="error"`` and ``error_kind="internal"``, their blocks returned (an n > 1 request's
other samples aborted); the others go on.

Copies complete asynchronously on the GPU (the transfer engine polls their events) and
synchronously on CPU; storage fetches and puts run on the storage client's worker threads on both
(polled too). The manager counts bytes as landed only when they have.
"""
from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass, field, replace
from itertools import count
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from kvtier.cache import CacheManager, ModelFingerprint
from kvtier.cache.cost import FetchCostModel
from kvtier.engine.config import EngineConfig
from kvtier.engine.cuda_graph import DecodeGraphs, StepGraphs
from kvtier.engine.detok import StopStrings
from kvtier.engine.fatal import raise_if_device_lost
from kvtier.engine.group import SampleGroup, check_n
from kvtier.engine.request import Request, Status
from kvtier.engine.routing import RoutingCapture, validate_routed_experts
from kvtier.engine.runner import ModelRunner, StepResult, graph_loads_mode
from kvtier.engine.sampling import SamplingParams
from kvtier.engine.scheduler import Scheduler, SchedulerOutput
from kvtier.engine.startup import Startup
from kvtier.engine.warmup import compile_kernels
from kvtier.model import ModelConfig, allocate_kv_caches, load_model, weights_digest
from kvtier.model.moe import SparseMoE
from kvtier.storage import BlobLayout, namespace_digest, open_storage
from kvtier.storage.client import default_storage_workers
from kvtier.transfer.engine import TransferEngine
from kvtier.transfer.host_pool import HostKV

log = logging.getLogger(__name__)

# With a storage pool, its I/O threads take and give back the interpreter lock at every syscall,
# and the engine thread gives it up in every torch call; at CPython's default 5 ms switch
# interval the engine thread waited up to that long to get it back (H100, 0.6B: a device hit with
# puts in flight took 15.4 ms at 5 ms, 7.7 ms at 0.5 ms; without a pool 9.4 ms). Process-wide;
# only ever lowered.
IO_SWITCH_INTERVAL_S = 0.0005
_AUTO_ID = "kvtier-auto-"      # ids the engine makes; given ids may not start so: never the same
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class CompletionOutput:
    """One sample of a request (``SamplingParams.n`` of them)."""
    index: int
    token_ids: list[int]
    text: str | None
    finish_reason: str                          # "stop" | "length" | "abort" | "error"
    routed_experts: np.ndarray | None = None    # [len(prompt)+len(token_ids)-1, num_moe_layers, top_k]
    logprobs: list[dict[int, float]] | None = None   # per generated token: {token_id: logprob}, sampled + top-k


@dataclass
class RequestOutput:
    """A finished request. ``token_ids``, ``text``, ``finish_reason`` and ``routed_experts`` are
    those of ``outputs[0]`` (the only sample when n=1)."""
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str
    num_cached_tokens: int
    cached_tokens_by_tier: dict[str, int]
    routed_experts: np.ndarray | None = None
    metrics: dict[str, float] | None = None     # monotonic times: arrival, [prefetch_start], admitted, first_token
    handoff: dict | None = None                 # PD: P's manifest, or D's hand-off result (engine/core.py)
    error: str | None = None                    # the request failed (finish_reason "error"): why
    # which failure, when finish_reason is "error": "handoff" = a PD hand-off that could not be
    # served as asked (pd_on_miss="error"; handoff["result"] == "error"; HTTP 502), or "internal" =
    # the engine failed while running it (a step raised; the engine goes on; HTTP 500)
    error_kind: str | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)   # one per sample, by index
    prompt_logprobs: list[dict[int, float] | None] | None = None    # per prompt token (the first: None)


@dataclass(slots=True)
class _Launched:
    """A step queued on the device whose results the host has not taken yet."""
    out: SchedulerOutput
    ends: list[int]              # each scheduled request's computed length after it (Scheduler.advance)
    result: StepResult
    sync: bool                   # the next schedule needs its results first
    loads: bool                  # it loaded blocks (host -> device)
    t0: float                    # perf_counter at launch


class HandoffError(RuntimeError):
    """A PD hand-off that cannot be served as asked (``pd_on_miss="error"`` and blocks missing)."""


class EngineCore:
    def __init__(self, model: str | os.PathLike, config: EngineConfig | None = None, *,
                 startup: Startup | None = None, **options: Any) -> None:
        """Load ``model`` and set up the tiers. The options (DESIGN §6 lists them) are
        ``config`` (engine/config.py: every option, its default, flag and check), with
        ``options`` as keywords over it (``EngineCore(path, device="cuda")``). Defaults that
        depend on others:

        - ``num_device_blocks=None``: sized from free memory;
        - ``num_host_blocks=None``: no host tier (0), unless ``storage`` is set: then a host tier
          sized from free RAM (:meth:`_size_host_blocks`), since storage I/O goes through it;
        - ``write_policy=None``: ``"write_through"`` with a host tier or a storage pool (every
          computed block is copied down: multi-turn histories come back from the host tier, and
          the pool serves the next engine; ``write_through_selective`` left most of a multi-turn
          working set uncached, docs/BENCHMARKS.md), else ``"write_through_selective"``;
        - ``early_loads=True``: a request waiting for a storage fetch has its host hits, then each
          chunk as it lands, copied on to the device meanwhile (when the device tier can hold the
          whole request), so it is admitted with device hits: the H2D of a storage hit overlaps
          the fetch instead of following it (``False``: loaded at admission, layer-overlapped);
        - ``storage_workers=None``: fetch threads, one per core, 2 to 16 (they wait on I/O);
        - ``storage_put_workers=None``: one put thread. Each put thread takes the interpreter from
          the engine thread at every syscall and checksum; on the H100 host a cold 4K prompt took
          57-60 ms with 8 put threads writing the last request's blocks, 24-29 ms with one
          (21 ms without a pool; docs/BENCHMARKS.md). A prefill server of PD, whose product is
          its writes, takes more (``kvtier serve --role prefill``: half the fetch threads);
        - ``overlap_schedule=None``: on for CUDA (the CPU schedules step N+1 while the GPU runs
          step N), off on CPU (where a step runs to its end before the host goes on: nothing to
          overlap, and a finished request's extra step would cost a forward).

        ``startup``: where the phases of the start are reported (engine/startup.py; a server's
        ``/health`` reads it while the engine starts). On CUDA every kernel variant a step can
        launch is compiled, and every CUDA graph captured, before this returns (engine/warmup.py).

        Bad sizes and types raise ValueError naming the value before the model is loaded."""
        c = self.engine_config = replace(config, **options) if config is not None else EngineConfig(**options)
        device, dtype, block_size = c.device, c.dtype, c.block_size
        num_device_blocks, num_host_blocks, storage = c.num_device_blocks, c.num_host_blocks, c.storage
        write_policy, write_through_threshold = c.write_policy, c.write_through_threshold
        preemption_mode, attention_backend, cuda_graphs = c.preemption_mode, c.attention_backend, c.cuda_graphs
        max_num_seqs, max_num_batched_tokens = c.max_num_seqs, c.max_num_batched_tokens
        if write_policy is None:
            write_policy = "write_through" if storage is not None or num_host_blocks else "write_through_selective"
        self.pd_on_miss = c.pd_on_miss
        self.export_timeout = float(c.export_timeout)
        if str(device).startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("device='cuda' asked for, but torch sees no CUDA device")
        self.path = Path(model)
        self.device = torch.device(device)
        if self.device.type == "cuda":
            # the GPU is this thread's current device from here on (AsyncEngine's thread sets it
            # too): every stream, event and capture the engine makes is on it, also where a
            # library call takes "the current device" (an engine on cuda:1 would otherwise
            # record its events on cuda:0, docs/ARCHITECTURE.md)
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
        self.config = cfg = ModelConfig.from_hf_dir(self.path)
        self.dtype = self._resolve_dtype(dtype, cfg)
        if attention_backend is None:
            attention_backend = "triton" if self.device.type == "cuda" else "torch"
        self.max_model_len = min(c.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        bytes_per_block = 2 * block_size * cfg.num_kv_heads * cfg.head_dim * cfg.num_layers * self.dtype.itemsize
        if num_host_blocks is not None and num_host_blocks * bytes_per_block > _available_ram():
            raise ValueError(f"num_host_blocks={num_host_blocks} needs {num_host_blocks * bytes_per_block / 2**30:.1f} "
                             f"GiB of host memory ({bytes_per_block} bytes per block), more than the "
                             f"{_available_ram() / 2**30:.1f} GiB available")
        self.startup = startup = startup if startup is not None else Startup()
        with startup("loading weights"):
            self.model = load_model(self.path, self.device, self.dtype, attention_backend, load_format=c.load_format)
        with startup("loading tokenizer"):
            self.tokenizer = _load_tokenizer(self.path)
        self.seed = c.seed
        self._generator = torch.Generator(self.device).manual_seed(c.seed)

        if num_device_blocks is None:
            num_device_blocks = self._size_device_blocks(bytes_per_block, block_size, max_num_seqs)
        if num_host_blocks is None:
            num_host_blocks = (self._size_host_blocks(bytes_per_block, block_size, num_device_blocks)
                               if storage is not None else 0)
        if preemption_mode is None:
            preemption_mode = "swap" if num_host_blocks else "recompute"
        self.preemption_mode = preemption_mode
        routing_payload = ""
        if cfg.is_moe and c.capture_routing:    # stored blocks carry routing: not the same objects
            routing_payload = f"routing:{cfg.num_moe_layers}x{cfg.top_k}:{cfg.num_experts}"
        fingerprint = ModelFingerprint(cfg.architecture, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                                       str(self.dtype).removeprefix("torch."), block_size,
                                       weights=weights_digest(self.path, c.load_format), payload=routing_payload)
        self.storage = open_storage(storage, workers=c.storage_workers or default_storage_workers(),
                                    put_workers=c.storage_put_workers or 1)
        self.fetch_cost = None
        if self.storage is not None:      # always measured; decides only under storage_fetch="auto"
            self.fetch_cost = FetchCostModel(self.storage.backend.scheme, self.storage.workers, self.storage.batch,
                                             0, block_size, always=c.storage_fetch == "always")
            self.storage.on_fetch_io = self.fetch_cost.observe_fetch
            self.storage.on_fetch_busy = self.fetch_cost.observe_busy
        self.cache = CacheManager(
            block_size=block_size, num_device_blocks=num_device_blocks, num_host_blocks=num_host_blocks,
            storage=self.storage, write_policy=write_policy, write_through_threshold=write_through_threshold,
            eviction=c.eviction, fingerprint=fingerprint, block_nbytes=bytes_per_block,
            enable_prefix_caching=c.enable_prefix_caching, fetch_cost=self.fetch_cost, early_loads=bool(c.early_loads))
        with startup("allocating KV tiers"):
            # one block more than the pool hands out: the scratch block padded CUDA-graph rows
            # (and the start's kernel warm-up) write to
            self.kv_caches = allocate_kv_caches(cfg, num_device_blocks + 1, block_size, self.device, self.dtype)
            # pinned (on CUDA) and on the GPU's NUMA node; one storage object per host block
            self._host = (HostKV((num_host_blocks, cfg.num_layers, 2, block_size, cfg.num_kv_heads, cfg.head_dim),
                                 self.dtype, self.device) if num_host_blocks else None)
        self.host_kv = self._host.tensor if self._host is not None else None
        self.routing = (RoutingCapture(cfg.num_moe_layers, cfg.top_k, cfg.num_experts, block_size,
                                       num_device_blocks, num_host_blocks, self.device)
                        if cfg.is_moe and c.capture_routing else None)
        self.transfer = TransferEngine(self.kv_caches, self.host_kv, self.routing)
        if self.storage is not None:
            self._bind_storage(fingerprint)
        if cuda_graphs is None:        # default: on for CUDA, where launches bound decode speed
            cuda_graphs = self.device.type == "cuda"
        if cuda_graphs and self.device.type == "cuda" and attention_backend != "triton":
            # a captured graph keeps the host lengths the torch reference read at capture
            log.warning("CUDA graphs need the triton attention backend (got %r): running eagerly",
                        attention_backend)
            cuda_graphs = False
        if self.device.type == "cuda":
            with startup("compiling kernels"):
                startup.kernels_compiled = compile_kernels(
                    self.model, self.kv_caches, self.host_kv, num_device_blocks, block_size,
                    self.max_model_len, attention_backend)
        graphs = step_graphs = None
        if cuda_graphs:
            capture = self.device.type == "cuda"
            routing_shape = (cfg.num_moe_layers, cfg.top_k) if self.routing else None
            with startup("capturing CUDA graphs"):
                graphs = DecodeGraphs(self.model, self.kv_caches, block_size, self.max_model_len,
                                      min(max_num_seqs, 256), num_device_blocks, self.device,
                                      capture=capture, routing_shape=routing_shape)
                graphs.capture_all()
                # other steps of up to 256 tokens (MoE layers dispatch densely up to there: no sync)
                max_tokens = min(max_num_batched_tokens, SparseMoE.DENSE_MAX_TOKENS)
                if os.environ.get("KVTIER_STEP_GRAPHS", "1") == "0":   # A/B switch (benchmarks)
                    max_tokens = 0
                if max_tokens >= StepGraphs.SIZES[0]:
                    step_graphs = StepGraphs(self.model, self.kv_caches, block_size, self.max_model_len,
                                             max_tokens, num_device_blocks, self.device, capture=capture,
                                             routing_shape=routing_shape, pool=graphs.pool(),
                                             gates=self.transfer.gates if graph_loads_mode() == "gated" else None)
                    step_graphs.capture_all()
        self.runner = ModelRunner(self.model, self.kv_caches, block_size, self.device, self.routing, graphs,
                                  step_graphs)
        self.scheduler = Scheduler(self.cache, max_num_batched_tokens, max_num_seqs, self.max_model_len,
                                   cfg.eos_token_ids, preemption_mode, c.prefetch_policy, tuple(c.prefetch_timeout))
        self.block_size = block_size
        self._ids = count()
        self._exports: dict[str, tuple[RequestOutput, object, float]] = {}   # P: outputs waiting for acks
        # n > 1 (engine/group.py): the groups by the user's request id, and every sample's
        # (sample 0's too) request id -> (its group, its index)
        self._groups: dict[str, SampleGroup] = {}
        self._sample_of: dict[str, tuple[SampleGroup, int]] = {}
        self._ops_done = 0            # copies completed so far (progress: write_back frees blocks late)
        self.num_failed_requests = 0  # failed by an internal error (RequestOutput.error_kind "internal")
        self.overlap_schedule = self.device.type == "cuda" if c.overlap_schedule is None else bool(c.overlap_schedule)
        self._inflight: _Launched | None = None   # overlap: the step on the GPU, results not taken
        self._rewinds: dict[object, int] = {}     # failed loads: request id -> tokens still valid
        self._loads_submitted = 0
        self._closed = False
        startup.done()

    # ------------------------------------------------------------------ set-up helpers
    def _bind_storage(self, fingerprint: ModelFingerprint) -> None:
        """One storage object per host block: its KV bytes (then its routing bytes), zero-copy views."""
        if sys.getswitchinterval() > IO_SWITCH_INTERVAL_S:
            sys.setswitchinterval(IO_SWITCH_INTERVAL_S)
        host_u8 = self.host_kv.view(torch.uint8).numpy()       # [num_host_blocks, block bytes...]
        routing = self.routing
        layout = BlobLayout(namespace_digest(self.storage.namespace, fingerprint.encode()),
                            str(self.dtype).removeprefix("torch."), tuple(self.host_kv.shape[1:]),
                            fingerprint.block_size,
                            host_u8[0].nbytes, routing.block_nbytes if routing is not None else 0)
        self.storage.bind(layout, host_u8.__getitem__,
                          (lambda h: routing.host_store[h].view(np.uint8)) if routing is not None else None)
        if self.fetch_cost is not None:
            self.fetch_cost.block_nbytes = layout.nbytes
            self.storage.calibrate()           # the cost model starts from this pool's measured speed

    def _resolve_dtype(self, dtype: str, cfg: ModelConfig) -> torch.dtype:
        if dtype == "auto":
            return cfg.torch_dtype if self.device.type == "cuda" else torch.float32
        if dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; choose auto, float32, bfloat16 or float16")
        return _DTYPES[dtype]

    def _size_device_blocks(self, bytes_per_block: int, block_size: int, max_num_seqs: int) -> int:
        """Blocks that fit in free memory (90% of free GPU memory after weights; 20% of available
        RAM on CPU), capped at what max_num_seqs full-length sequences could use."""
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * 0.9) - (1 << 30)          # 1 GiB headroom for activations
        else:
            budget = int(_available_ram() * 0.2)
        cap = max_num_seqs * -(-self.max_model_len // block_size)
        n = min(budget // bytes_per_block, cap)
        need = -(-self.max_model_len // block_size)
        if n < need:
            raise ValueError(f"only {n} KV blocks fit in free memory, but one {self.max_model_len}-token "
                             f"sequence needs {need}; lower max_model_len or free memory")
        return int(n)

    def _size_host_blocks(self, bytes_per_block: int, block_size: int, num_device_blocks: int) -> int:
        """The host tier a storage pool gets when num_host_blocks is not given: twice the device
        tier (room for its backups and for fetches) and at least two full-length sequences,
        capped at a quarter of the available RAM."""
        need = -(-self.max_model_len // block_size)
        budget = int(_available_ram() * 0.25) // bytes_per_block
        n = min(max(2 * num_device_blocks, 2 * need), budget)
        if n < 1:
            raise ValueError(f"no room for a host tier in free memory ({_available_ram()} bytes, "
                             f"{bytes_per_block} per block); set num_host_blocks")
        log.info("host tier: %d blocks (%.2f GiB; num_host_blocks not set, a storage pool is)",
                 n, n * bytes_per_block / 2**30)
        return int(n)

    # ------------------------------------------------------------------ API
    def add_request(self, prompt, params: SamplingParams | None = None, cache_salt: str | None = None,  # type: ignore[no-untyped-def]
                    request_id: str | None = None, *, handoff: dict | None = None, export: bool = False) -> Request:
        """Validate and queue a request; it joins the next step. ``export``: P of a PD hand-off;
        ``handoff``: D of one (``{"first_token", "num_tokens", "keys", "namespace"}``)."""
        if request_id is not None:
            self._check_new_id(str(request_id))       # before the work of make_request
        req = self.make_request(prompt, params or SamplingParams(), cache_salt, request_id,
                                handoff=handoff, export=export)
        self.enqueue(req)
        return req

    def enqueue(self, req: Request) -> None:
        """Queue a request made by :meth:`make_request` (the engine thread's half of add_request).
        ValueError if a request with its id is still in the engine (their outputs would mix)."""
        self._check_open()
        self._check_new_id(req.request_id)
        check_n(req)
        self.scheduler.add(req)
        if req.handoff is not None:
            self.cache.expect_tail(req.cache, req.num_prompt_tokens)
        if req.params.n > 1:
            group = self._groups[req.request_id] = SampleGroup(req)
            self._sample_of[req.request_id] = (group, 0)
            if not self.cache.enable_prefix_caching:   # no prompt to share: n requests from the start
                self._fork(group, front=False)

    def abort(self, request_id: str) -> bool:
        """Drop a queued or running request (every sample of it) and return its blocks; False if
        unknown/finished."""
        self._exports.pop(request_id, None)     # an export in flight finishes on its own
        entry = self._sample_of.get(request_id)
        if entry is None:
            return self.scheduler.abort(request_id) is not None
        group = entry[0]                        # (an internal sample id aborts its whole request)
        self._end_group(group)
        aborted = [self.scheduler.abort(r.request_id) for r in group.unfinished()]
        return any(r is not None for r in aborted)

    def progress(self, req: Request) -> list[tuple[int, list[int], list | None, str | None]]:
        """(index, token_ids, logprobs, finish_reason or None) of every sample of ``req`` started
        so far (streaming: AsyncEngine); token_ids and logprobs are live lists, not copies."""
        entry = self._sample_of.get(req.request_id)
        if entry is None or entry[0].head is not req:
            return [(0, req.output_token_ids, req.logprobs, None)]
        return entry[0].progress()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._exports) or self._inflight is not None

    def _fork(self, group: SampleGroup, front: bool = True) -> None:
        """Queue samples 1..n-1 of ``group`` (engine/group.py): sample 0 has sampled its first
        token, so the prompt's full blocks are in the tree. At the front of the queue: admitted
        next, while those blocks are on device (nothing else allocates before them)."""
        head = group.head
        # the prompt's logprobs are the request's (sample 0's): computing them again would make
        # every sample recompute the whole prompt (a prompt_logprobs request matches nothing)
        params = replace(head.params, n=1, prompt_logprobs=None)
        for i in range(1, group.n):
            req = self.make_request(head.prompt_token_ids, params, head.cache_salt)
            req.request_id = group.sample_id(i, _AUTO_ID)
            seed = head.params.sample_seed(i)
            req.generator = self._generator if seed is None else torch.Generator(self.device).manual_seed(seed)
            group.samples[i] = req
            self._sample_of[req.request_id] = (group, i)
            self.scheduler.add(req)
        group.forked = True
        if front:
            self.scheduler.waiting.rotate(group.n - 1)    # the ones just added, in index order

    def _end_group(self, group: SampleGroup) -> None:
        """``group``'s request is answered or aborted: its id (and its samples') are free again."""
        group.ended = True
        self._groups.pop(group.request_id, None)
        for r in group.samples:
            if r is not None:
                self._sample_of.pop(r.request_id, None)

    def _group_outputs(self, results: list[RequestOutput]) -> list[RequestOutput]:
        """A step's outputs with samples folded into their requests' (engine/group.py): a sample
        that finished waits in its group, the last one gives the request's output; one that
        failed fails the request: its other samples are aborted (their blocks returned)."""
        if not self._sample_of:
            return results
        entries = [(o, self._sample_of.get(o.request_id)) for o in results]   # before groups end
        outs = []
        for o, entry in entries:
            if entry is None:
                outs.append(o)
                continue
            group, i = entry
            if group.ended:               # another sample of it failed in this step: answered
                continue
            if o.error is not None:
                self._end_group(group)
                for r in group.unfinished():
                    self.scheduler.abort(r.request_id)
                error = f"sample {i} of {group.n}: {o.error}"
                outs.append(group.fail(self._output(group.head, error=error, error_kind=o.error_kind)))
                continue
            done = group.finish(i, o)
            if done is not None:
                self._end_group(group)
                outs.append(done)
        return outs

    def _check_new_id(self, request_id: str) -> None:
        sched = self.scheduler
        # (a group whose sample 0 finished still owns its id until its last sample did)
        if request_id in self._exports or request_id in self._groups or any(
                r.request_id == request_id for r in (*sched.waiting, *sched.running)):
            raise ValueError(f"request_id {request_id!r} is already in use by a request in the engine")

    def make_request(self, prompt, params: SamplingParams, cache_salt: str | None,  # type: ignore[no-untyped-def]
                     request_id: str | None = None, *, handoff: dict | None = None,
                     export: bool = False) -> Request:
        """A validated :class:`Request` (no engine state touched but the id counter)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"text prompts need a tokenizer, and {self.path} has none; pass token ids")
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            ids = list(prompt)
        if not ids:
            raise ValueError("empty prompt: give at least one token")
        if params.return_routed_experts and self.routing is None:
            raise ValueError("return_routed_experts=True needs a MoE model with routing capture on "
                             f"({self.config.architecture}, capture_routing="
                             f"{self.config.is_moe and self.routing is not None})")
        ids = _token_ids(ids, self.config.vocab_size)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; the model's context is {self.max_model_len} "
                             f"(max_model_len), leaving no room to generate")
        longest = len(ids) + params.max_tokens
        if longest > self.max_model_len:
            raise ValueError(f"max_tokens={params.max_tokens} + {len(ids)} prompt tokens = {longest} tokens, "
                             f"more than the model's context of {self.max_model_len} (max_model_len)")
        if -(-longest // self.block_size) > self.cache.device_pool.num_blocks:
            raise ValueError(f"a request of {len(ids)} prompt tokens + max_tokens={params.max_tokens} needs "
                             f"{-(-longest // self.block_size)} blocks, more than the whole device tier "
                             f"({self.cache.device_pool.num_blocks} blocks of {self.block_size} tokens)")
        if export and handoff is not None:
            raise ValueError("a request is either the prefill (export) or the decode (handoff) side of a hand-off")
        if (export or handoff is not None) and self.storage is None:
            raise ValueError("a PD hand-off needs a storage pool: start the engine with storage=URL")
        if handoff is not None and (params.logprobs is not None or params.prompt_logprobs is not None):
            raise ValueError(f"logprobs={params.logprobs}, prompt_logprobs={params.prompt_logprobs}: the decode "
                             "side of a PD hand-off has neither its first token's logits nor the prompt's")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop={list(params.stop)!r} is matched on the output text, and {self.path} has "
                             "no tokenizer; use stop_token_ids")
        if request_id is None:
            rid = f"{_AUTO_ID}{next(self._ids)}"
        elif str(request_id).startswith(_AUTO_ID):
            raise ValueError(f"request_id {request_id!r} starts with {_AUTO_ID!r}, the prefix of automatic ids")
        else:
            rid = str(request_id)
        req = Request(rid, ids, params, cache_salt=cache_salt)
        if params.stop:
            req.stop_strings = StopStrings(self.tokenizer, params.stop, params.skip_special_tokens, params.min_tokens)
        if params.seed is not None:
            req.generator = torch.Generator(self.device).manual_seed(params.seed)
        else:
            req.generator = self._generator
        if export:
            req.export = True
        elif handoff is not None:
            self._accept_handoff(req, handoff)
        return req

    def _accept_handoff(self, req: Request, manifest: dict) -> None:
        """D: start ``req`` from P's first token; check P's manifest names the blocks we would."""
        if not isinstance(manifest, dict):
            raise ValueError(f"handoff must be a manifest object, got {type(manifest).__name__}")
        first, n = manifest.get("first_token"), manifest.get("num_tokens")
        vocab = self.config.vocab_size
        if isinstance(first, bool) or not isinstance(first, int) or not 0 <= first < vocab:
            raise ValueError(f"handoff.first_token must be a token id in 0..{vocab - 1}, got {first!r}")
        if n != req.num_prompt_tokens:
            raise ValueError(f"handoff.num_tokens is {n!r}, but the prompt has {req.num_prompt_tokens} tokens")
        ns = manifest.get("namespace")
        if ns != self.storage.namespace:                                 # type: ignore[union-attr]
            raise ValueError(f"handoff.namespace is {ns!r}, but this engine's pool namespace is "
                             f"{self.storage.namespace!r}")                # type: ignore[union-attr]
        probe = self.cache.new_request(req.request_id, req.prompt_token_ids, cache_salt=req.cache_salt)
        mine = self.cache.manifest_names(*self.cache.handoff_keys(probe, n))
        if manifest.get("keys") != mine:
            raise ValueError("handoff.keys do not match the blocks this engine would read for this prompt: "
                             "the prefill engine runs another model, dtype, block size or cache_salt")
        req.all_token_ids.append(first)
        req.output_token_ids.append(first)
        req.metrics["first_token"] = req.metrics["arrival"]
        req.handoff = dict(manifest)
        req.handoff_stop = self.scheduler.stop_reason(req, first)

    def step(self) -> list[RequestOutput]:
        """One engine step; returns the requests that finished in it.

        Overlap scheduling (``overlap_schedule``, the module docstring): the step launched last
        time is still on the GPU while this one is scheduled and launched; its results are taken
        after. It is taken first instead when the next schedule needs its tokens on the host
        (:attr:`_Launched.sync`), or when scheduling would have to preempt (``needs_sync``).

        A failure fails requests, not the engine: if the forward of a batch raises, its requests
        run one by one and only those that fail alone are blamed; if anything after the forward
        raises, every request of the step without an output is. A blamed request comes out with
        ``finish_reason="error"``, ``error_kind="internal"``; its blocks return to the pools, the
        copies in flight are drained and the step goes on. Only a failure with no request to blame
        (before anything was scheduled) raises."""
        self._check_open()
        ops_before = self._ops_done
        self._pump()                              # copies that landed since the last step
        results: list[RequestOutput] = []
        prev, self._inflight = self._inflight, None
        if prev is not None and prev.sync:
            self._finish(prev, results)
            prev = None
        out = self.scheduler.schedule(defer_preempt=prev is not None)
        if out.needs_sync:                        # it would preempt: first the step in flight
            self._finish(prev, results)           # type: ignore[arg-type]
            prev = None
            out = self.scheduler.schedule()
        cur = self._launch(out, results) if out.scheduled else None
        if prev is not None:
            self._finish(prev, results)
        if cur is not None:
            if self.overlap_schedule and not cur.sync:
                self._inflight = cur
            else:
                self._finish(cur, results)
        elif not out.scheduled:
            self._pump()                          # staged copies (e.g. a swap's) go out now
            self._complete(self.transfer.wait_loads())
        if self._exports:
            results += self._finished_exports()
        progressed = out.scheduled or self._ops_done != ops_before or results
        if not progressed and self.has_unfinished():
            if self.transfer.num_in_flight:        # nothing to run until copies land: wait for them
                self._complete(self.transfer.drain())
            elif self.storage is not None and self.storage.num_in_flight:   # prefetches, puts landing
                self._complete(self.storage.wait(timeout=0.05))
            elif not self.cache.num_pending_ops and self.scheduler.waiting:
                req = self.scheduler.waiting[0]     # blocks held elsewhere (e.g. exports): it cannot run
                results.append(self._fail(req, RuntimeError(
                    f"request {req.request_id} ({req.num_tokens} tokens) cannot be scheduled: the device "
                    f"tier has {self.cache.device_pool.num_blocks} blocks")))
        return self._group_outputs(results)

    def _launch(self, out: SchedulerOutput, results: list[RequestOutput]) -> _Launched | None:
        """Queue the step (forward and sampling) and advance its requests; None if every one of
        them failed (their outputs into ``results``)."""
        loads_before = self._loads_submitted

        def start_loads(mode: str):  # type: ignore[no-untyped-def]
            if not hook:                          # once per step, whatever forwards run in it
                self.transfer.load_mode = mode
                try:
                    self._pump()                  # loads: queued (GPU) or done (CPU)
                finally:
                    self.transfer.load_mode = "whole"
                hook.append(self.transfer.layer_hook())
            return hook[0]
        hook: list = []
        t0 = time.perf_counter()
        self.runner.start_step()
        try:
            result = self._forward(out, start_loads, results)
            if not out.scheduled:
                return None
            ends = self.scheduler.advance(out)
        except Exception as e:  # noqa: BLE001 - blamed on this step's requests, reported in their outputs
            self._blame(out, results, e)
            return None
        # the next schedule needs this step's tokens on the host if it loaded blocks (a failed
        # load rewinds its request), fell back to one-by-one, or penalizes by what it samples
        loads = self._loads_submitted != loads_before
        sync = loads or result.collected or any(s.request.params.has_penalties for s in out.scheduled)
        return _Launched(out, ends, result, sync, loads, t0)

    def _forward(self, out: SchedulerOutput, start_loads, results: list[RequestOutput]) -> StepResult:  # type: ignore[no-untyped-def]
        """The step's forward and sampling, queued. If a batch of several raises, its requests
        run one by one, each to its results (the KV they write is their own, rewritten alike):
        those that fail alone are failed (outputs into ``results``) and dropped from ``out``, the
        others go on with the step."""
        try:
            return self.runner.execute(out, start_loads)
        except Exception as e:  # noqa: BLE001
            raise_if_device_lost(e)               # nothing more runs on this GPU: no retry
            if len(out.scheduled) == 1:
                raise
            log.warning("a forward of %d requests failed (%r): running them one by one", len(out.scheduled), e)
        sampled: dict[str, int] = {}
        survivors = []
        for s in out.scheduled:
            try:
                sampled.update(self.runner.execute(SchedulerOutput([s], []), start_loads).collect())
                survivors.append(s)
            except Exception as e:  # noqa: BLE001 - this request alone fails
                raise_if_device_lost(e)
                log.exception("request %s failed in the forward", s.request.request_id)
                results.append(self._fail(s.request, e))
        out.scheduled = survivors
        return StepResult.done(sampled)

    def _finish(self, step: _Launched, results: list[RequestOutput]) -> None:
        """A launched step's results: update, outputs (into ``results``), copies."""
        out = step.out
        try:
            sampled = step.result.collect()
            if self.routing is not None:
                self.routing.flush()
            if self.fetch_cost is not None and sampled and out.num_tokens >= 2 * len(out.scheduled):
                # a step with prefill work, from launch to results: the recompute side of the cost model
                self.fetch_cost.observe_prefill(out.num_tokens, time.perf_counter() - step.t0)
            if step.loads:
                self._complete(self.transfer.wait_loads())     # the forward waited on them
            rewinds = {s.request.request_id: self._rewinds.pop(s.request.request_id)
                       for s in out.scheduled if s.request.request_id in self._rewinds}
            finished = self.scheduler.update(out, step.ends, sampled, rewinds)
        except Exception as e:  # noqa: BLE001
            self.scheduler.drop(out)
            self._blame(out, results, e)
            return
        try:
            self._outputs(out, finished, results)
        except Exception as e:  # noqa: BLE001
            self._blame(out, results, e)

    def _outputs(self, out: SchedulerOutput, finished: list[Request], results: list[RequestOutput]) -> None:
        if self._groups:                 # n > 1: a sample 0 that sampled its first token forks
            for s in out.scheduled:
                entry = self._sample_of.get(s.request.request_id)
                if entry is not None and not entry[0].forked and s.request.output_token_ids:
                    self._fork(entry[0])
        results += self._check_handoffs(out, finished)
        for req in finished:
            try:
                output = self._output(req)
                if req.export:
                    self._start_export(req, output)      # comes out once the pool acked its blocks
                else:
                    results.append(output)
            finally:                      # a failed output still returns the request's blocks
                self.scheduler.release(req)
        self._pump()                              # backups of what the forward wrote, puts

    def _blame(self, out: SchedulerOutput, results: list[RequestOutput], exc: BaseException) -> None:
        """Fail the requests of ``out`` without an output yet (the step raised ``exc``); an
        error after which the GPU can run nothing more stops the engine instead (engine/fatal.py)."""
        raise_if_device_lost(exc)
        answered = {o.request_id for o in results} | set(self._exports)
        blamed = [s.request for s in out.scheduled
                  if s.request.request_id not in answered and not s.request.is_finished]
        if not blamed:
            raise exc
        log.error("engine step failed; failing its %d requests", len(blamed), exc_info=exc)
        results += [self._fail(req, exc) for req in blamed]
        self.drain()

    def _fail(self, req: Request, exc: BaseException) -> RequestOutput:
        """Fail ``req`` for an internal error: return its blocks (wherever the step left it) and
        make its error output."""
        self._exports.pop(req.request_id, None)
        if (self.scheduler.abort(req.request_id) is None and req.cache is not None and not req.cache.freed
                and req not in self.scheduler.draining):
            self.scheduler.release(req)           # finished in update, not yet released
        req.status = Status.FINISHED
        self.num_failed_requests += 1
        return self._output(req, error=f"internal error: {exc!r}", error_kind="internal")

    # ------------------------------------------------------------------ PD hand-off
    def _check_handoffs(self, out, finished: list[Request]) -> list[RequestOutput]:  # type: ignore[no-untyped-def]
        """D: once a handed-off request ran its first step, how much of P's prompt did it find?
        Under pd_on_miss="error", a request that has to recompute any of it fails."""
        failed: list[RequestOutput] = []
        for s in out.scheduled:
            req = s.request
            h = req.handoff
            if h is None or "result" in h or req.num_cached_tokens is None:
                continue                 # (a failed load has lowered num_cached_tokens already)
            missing = req.num_prompt_tokens - req.num_cached_tokens
            h["missing_tokens"] = missing
            h["result"] = "ok" if missing == 0 else ("error" if self.pd_on_miss == "error" else "recomputed")
            if h["result"] == "error":
                msg = (f"PD hand-off: {missing} of the {req.num_prompt_tokens} prompt tokens were missing, "
                       f"corrupt or late in the pool (pd_on_miss='error')")
                if req in finished:
                    finished.remove(req)
                    self.scheduler.release(req)
                else:
                    self.scheduler.abort(req.request_id)
                failed.append(self._output(req, error=msg, error_kind="handoff"))
        return failed

    def _start_export(self, req: Request, output: RequestOutput) -> None:
        """P: the prefill is done and its first token sampled: write the prompt to the pool."""
        exp = self.cache.export(req.cache, req.num_prompt_tokens)
        self._exports[req.request_id] = (output, exp, time.monotonic() + self.export_timeout)

    def export_names(self, request_id: str) -> dict | None:
        """P: the manifest's names of ``request_id``'s export in flight (``namespace``, ``keys``,
        ``num_tokens``, and the prompt tokens P found cached), or None if it is not exporting."""
        entry = self._exports.get(request_id)
        if entry is None:
            return None
        output, exp, _ = entry
        return {"namespace": self.storage.namespace, "keys": list(exp.keys),   # type: ignore[union-attr]
                "num_tokens": exp.num_tokens, "cached_tokens": output.num_cached_tokens}

    def _finished_exports(self) -> list[RequestOutput]:
        done = []
        now = time.monotonic()
        for rid, (output, exp, deadline) in list(self._exports.items()):
            late = now >= deadline
            if not (exp.done or late):                             # type: ignore[attr-defined]
                continue
            del self._exports[rid]
            output.handoff = {
                "namespace": self.storage.namespace,               # type: ignore[union-attr]
                "keys": exp.keys, "num_tokens": exp.num_tokens,    # type: ignore[attr-defined]
                "first_token": output.token_ids[0],
                "complete": exp.done and not exp.failed,           # type: ignore[attr-defined]
                "failed_blocks": exp.failed + (exp.num_waiting if late else 0),   # type: ignore[attr-defined]
                "stored_before": exp.skipped,                      # type: ignore[attr-defined]
                "seconds": now - output.metrics["first_token"] if output.metrics else None,
            }
            done.append(output)
        return done

    def pump_idle(self) -> int:
        """With no request to step: submit staged copies and hand back those that landed (the
        server's engine thread calls it while idle, so that the last requests' backups and their
        puts to the pool finish instead of waiting for the next request). Returns the copies
        still pending."""
        if not self.closed and not self.has_unfinished():
            self._pump()
        return self.cache.num_pending_ops

    def _pump(self) -> None:
        """Submit the manager's staged copies and hand back those that landed, until quiet (on
        CPU every copy lands at once, and a landed copy may stage the next: backup -> put)."""
        while True:
            plan = self.cache.take_plan()
            for op in plan:
                if op.kind in ("fetch", "put"):
                    self.storage.submit(op)        # type: ignore[union-attr]
                else:
                    self._loads_submitted += op.kind == "load"
                    self.transfer.submit(op)
            landed = self.transfer.poll()
            if self.storage is not None:
                landed += self.storage.poll()
            self._complete(landed)
            if not plan and not landed:
                return

    def _complete(self, landed: list[tuple[int, list[int]]]) -> None:
        """Hand landed copies to the manager; a failed load's rewind (recompute its request from
        there) waits in ``_rewinds`` for the step that loaded, which applies it."""
        for op_id, failed in landed:
            self._rewinds.update(self.cache.complete(op_id, failed))
        self._ops_done += len(landed)

    def drain(self) -> None:
        """Finish the step in flight; wait for every copy in flight and hand it to the manager
        (close, errors)."""
        if self._inflight is not None:
            step, self._inflight = self._inflight, None
            self._finish(step, [])                 # (close: its requests' outputs are not wanted)
        self._pump()
        while self.transfer.num_in_flight or (self.storage is not None and self.storage.num_in_flight):
            self._complete(self.transfer.drain())
            if self.storage is not None:
                self._complete(self.storage.drain())
            self._pump()

    def _output(self, req: Request, error: str | None = None, error_kind: str | None = None) -> RequestOutput:
        """The request's output; with ``error``, a failed one (finish_reason "error", no text
        nor routing: its blocks may be gone already) of ``error_kind`` (RequestOutput says which)."""
        routed = None
        if req.params.return_routed_experts and error is None:
            if self.routing is None:
                raise ValueError("return_routed_experts=True needs a MoE model")
            routed = self.routing.gather(req.cache.block_table, req.num_tokens - 1)
        if error is not None or self.tokenizer is None:
            text = None
        elif req.stop_strings is not None and req.stop_strings.stopped:
            text = req.stop_strings.text          # ends before the stop string
        else:
            text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=req.params.skip_special_tokens)
        finish = "error" if error else (req.finish_reason or "length")
        sample = CompletionOutput(0, list(req.output_token_ids), text, finish, routed,
                                  None if req.logprobs is None else list(req.logprobs))
        return RequestOutput(req.request_id, list(req.prompt_token_ids), sample.token_ids, text,
                             finish, req.num_cached_tokens or 0,
                             dict(req.cached_tokens_by_tier), routed, dict(req.metrics),
                             None if req.handoff is None else dict(req.handoff),
                             error, error_kind if error else None, [sample], req.prompt_logprobs)

    def score(self, token_ids: Sequence[int], routed_experts: np.ndarray | None = None) -> np.ndarray:
        """Per-token logprobs of token_ids[1:] (float32 [len-1]); routing forced when given."""
        self._check_open()
        ids = list(token_ids.tolist() if isinstance(token_ids, np.ndarray) else token_ids)
        ids = _token_ids(ids, self.config.vocab_size)
        if not 2 <= len(ids) <= self.max_model_len:
            raise ValueError(f"score needs 2..{self.max_model_len} tokens (max_model_len), got {len(ids)}")
        forced = None
        if routed_experts is not None:
            cfg = self.config
            if not cfg.is_moe:
                raise ValueError("routed_experts given, but the model has no MoE layers")
            forced = validate_routed_experts(routed_experts, len(ids), cfg.num_moe_layers, cfg.top_k, cfg.num_experts)
        return self.runner.score(ids, forced)

    @property
    def num_exports(self) -> int:
        """P: finished prompts whose blocks the pool has not acked yet."""
        return len(self._exports)

    def cache_stats(self) -> dict:
        s = self.cache.stats
        moved = s.bytes_moved
        hits = sum(s.hit_tokens.values())
        return {
            "device": {"hit_tokens": s.hit_tokens["device"], "evictions": s.evictions["device"],
                       "bytes_in": moved["host_to_device"], "blocks_used": self.cache.device_pool.num_used},
            "host": {"hit_tokens": s.hit_tokens["host"], "evictions": s.evictions["host"],
                     "bytes_in": moved["device_to_host"] + moved["storage_to_host"],
                     "blocks_used": self.cache.host_pool.num_used},
            "storage": self._storage_stats(),
            "query_tokens": s.query_tokens,
            "miss_tokens": max(0, s.query_tokens - hits),
            "failures": dict(s.failures),
            "failed_requests": self.num_failed_requests,
            "startup": self.startup.as_dict(),
        }

    def _storage_stats(self) -> dict:
        s = self.cache.stats
        out = {"hit_tokens": s.hit_tokens["storage"], "bytes_in": s.bytes_moved["host_to_storage"],
               "bytes_out": s.bytes_moved["storage_to_host"]}
        if self.storage is not None:
            out.update(self.storage.stats())
            out["evictions"] = out.get("server", {}).get("evictions", 0)
        if self.fetch_cost is not None:
            out["fetch_cost"] = self.fetch_cost.as_dict()
        return out

    def close(self) -> None:
        """Wait for copies in flight, then release device and (pinned) host memory."""
        if self._closed:
            return
        self.drain()
        if self.routing is not None:
            self.routing.flush(wait=True)
        self._closed = True
        self.kv_caches.clear()
        self.host_kv = None
        if self.storage is not None:
            self.storage.close()
        if self._host is not None:
            self._host.release()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this LLM is closed")

    def __enter__(self) -> "EngineCore":
        return self

    def __exit__(self, *exc) -> None:  # type: ignore[no-untyped-def]
        self.close()


def _token_ids(ids: list, vocab: int) -> list[int]:
    """``ids`` as plain ints, each checked to be a token id (ValueError naming the first bad one).
    A list of Python ints (the usual prompt) is checked in C (type set, min, max): a per-token
    Python loop cost ~2 ms for a 4K-token prompt on the engine thread."""
    if set(map(type, ids)) <= {int} and (not ids or (min(ids) >= 0 and max(ids) < vocab)):
        return ids
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < vocab:
            raise ValueError(f"token id {t!r} is not an int in 0..{vocab - 1}")
    return [int(t) for t in ids]


def _available_ram() -> int:
    """Bytes of memory available to allocate now (MemAvailable: free + reclaimable cache)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _load_tokenizer(path: Path):  # type: ignore[no-untyped-def]
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
