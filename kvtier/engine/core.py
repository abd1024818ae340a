"""The engine core: model, KV tiers, scheduler and the step loop, behind two front ends: the
offline ``kvtier.LLM`` (engine/llm.py) and the serving ``AsyncEngine`` (engine/async_engine.py).

    add_request(prompt, params, ...) -> Request     validated and queued; joins the next step
    step() -> [RequestOutput]                        one engine step; the requests it finished
    abort(request_id)                                drop a request (every sample), return its blocks
    has_unfinished()

What a request may be is checked in engine/intake.py; ``SamplingParams.n > 1`` (one prefill,
n decodes) is engine/group.py; the prefill/decode hand-off through the pool (``export=True``
on P, ``handoff=manifest`` on D) is engine/pd.py; outputs are engine/outputs.py.

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

Over 600 lines: it still builds the engine's parts as well as adding, aborting and stepping
requests; the build is to move to a module of its own.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np
import torch

from kvtier.cache import CacheManager, ModelFingerprint
from kvtier.cache.policy import default_write_policy
from kvtier.engine.cache_stats import cache_stats
from kvtier.engine.config import EngineConfig
from kvtier.engine.copies import CopyPump
from kvtier.engine.cuda_graph import capture_graphs
from kvtier.engine.draft_graphs import build_chain
from kvtier.engine.experts import ExpertCapture, validate_routed_experts
from kvtier.engine.fatal import raise_if_device_lost
from kvtier.engine.group import SampleGroup, SampleGroups, check_n
from kvtier.engine.intake import AUTO_ID, Intake, check_token_ids
from kvtier.engine.outputs import RequestOutput, request_output
from kvtier.engine.params import SamplingParams
from kvtier.engine.pd import Exports, accept_handoff, check_handoffs
from kvtier.engine.pool import bind_pool, open_pool
from kvtier.engine.request import Request, Status
from kvtier.engine.runner import ModelRunner, StepResult
from kvtier.engine.scheduler import Scheduler, SchedulerOutput
from kvtier.engine.sizing import (
    CPU_SIZING,
    block_nbytes,
    check_host_blocks,
    resolve_dtype,
    size_device_blocks,
    size_host_blocks,
)
from kvtier.engine.spec import Speculator
from kvtier.engine.startup import Startup
from kvtier.engine.tp.ranks import RankLost, Ranks, backend_for, init_group
from kvtier.engine.tp.transfer import RankOps, TPStorage, TPTransfer
from kvtier.engine.warmup import compile_kernels
from kvtier.model import ModelConfig, allocate_kv_caches, load_model, weights_digest
from kvtier.model.hub import resolve_model
from kvtier.model.shard import TPShard, check_divisible
from kvtier.model.tokenizer import load_tokenizer
from kvtier.transfer.engine import TransferEngine
from kvtier.transfer.host_pool import HostKV

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Launched:
    """A step queued on the device whose results the host has not taken yet."""

    out: SchedulerOutput
    ends: list[int]  # each scheduled request's computed length after it (Scheduler.advance)
    result: StepResult
    sync: bool  # the next schedule needs its results first
    loads: bool  # it loaded blocks (host -> device)
    t0: float  # perf_counter at launch


class EngineCore:
    def __init__(
        self, model: str | os.PathLike, config: EngineConfig | None = None, *, startup: Startup | None = None, **options: Any
    ) -> None:
        """Load ``model`` and set up the tiers. The options are ``config`` (engine/config.py: every
        option, its default, flag and check, and how the defaults that depend on the model or
        the machine are resolved), with ``options`` as keywords over it
        (``EngineCore(path, device="cuda")``).

        ``startup``: where the phases of the start are reported (engine/startup.py; a server's
        ``/health`` reads it while the engine starts). On CUDA every kernel variant a step can
        launch is compiled, and every CUDA graph captured, before this returns (engine/warmup.py).

        Bad sizes and types raise ValueError naming the value before the model is loaded."""
        c = self.engine_config = replace(config, **options) if config is not None else EngineConfig(**options)
        device, dtype, block_size = c.device, c.dtype, c.block_size
        num_device_blocks, num_host_blocks, storage = c.num_device_blocks, c.num_host_blocks, c.storage
        write_policy, attention_backend = c.write_policy, c.attention_backend
        if write_policy is None:
            write_policy = default_write_policy(bool(num_host_blocks), storage is not None)
        self.pd_on_miss = c.pd_on_miss
        if str(device).startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("device='cuda' asked for, but torch sees no CUDA device")
        self.path = resolve_model(model, c.revision, c.load_format)
        self.device = torch.device(device)
        if self.device.type == "cuda":
            # the GPU is this thread's current device from here on (AsyncEngine's thread sets it
            # too): every stream, event and capture the engine makes is on it, also where a
            # library call takes "the current device" (an engine on cuda:1 would otherwise
            # record its events on cuda:0, docs/ARCHITECTURE.md)
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
        self.config = cfg = ModelConfig.from_hf_dir(self.path).with_mtp(c.num_speculative_tokens > 0)
        self.dtype = resolve_dtype(dtype, cfg, self.device)
        if attention_backend is None:
            attention_backend = "triton" if self.device.type == "cuda" else "torch"
        self.max_model_len = min(c.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        bytes_per_block = block_nbytes(cfg, block_size, self.dtype)
        if num_host_blocks is not None:
            check_host_blocks(num_host_blocks, bytes_per_block)
        self.startup = startup = startup if startup is not None else Startup()
        self.ranks: Ranks | None = None  # tensor parallel: ranks 1.. (engine/tp)
        tp = c.tensor_parallel_size
        shard = None
        if tp > 1:
            check_divisible(cfg, tp)
            if self.device.type == "cuda" and self.device.index + tp > torch.cuda.device_count():
                raise ValueError(
                    f"tensor_parallel_size={tp} from {self.device} needs GPUs {self.device.index}.."
                    f"{self.device.index + tp - 1}; torch sees {torch.cuda.device_count()}"
                )
            # the other ranks start now and load their shards while this one loads its own
            # (the options as resolved here: every rank takes them as they are)
            resolved = replace(
                c,
                revision=None,
                dtype=str(self.dtype).removeprefix("torch."),
                attention_backend=attention_backend,
                max_model_len=self.max_model_len,
            )
            self.ranks = Ranks.start(tp, str(self.path), resolved, self.device, c.tp_timeout)
            try:
                shard = TPShard(0, tp, init_group(backend_for(self.device), self.ranks.store, 0, tp, c.tp_timeout, self.device))
            except BaseException as e:
                self.ranks.lost(f"the tensor-parallel process group did not form: {e!r}")
                self.ranks.close()
                raise
        try:
            self._build(c, cfg, shard, bytes_per_block, attention_backend, num_device_blocks, num_host_blocks, write_policy)
        except BaseException:
            if self.ranks is not None:
                self.ranks.close()
            raise

    def _build(self, c, cfg, shard, bytes_per_block, attention_backend, num_device_blocks, num_host_blocks, write_policy) -> None:
        """The rest of the start, after the checks (and, tensor parallel, after the other ranks
        were started: a failure here ends them)."""
        startup, storage, block_size = self.startup, c.storage, c.block_size
        write_through_threshold, preemption_mode, cuda_graphs = c.write_through_threshold, c.preemption_mode, c.cuda_graphs
        max_num_seqs, max_num_batched_tokens = c.max_num_seqs, c.max_num_batched_tokens
        tp = c.tensor_parallel_size
        with startup("loading weights"):
            self.model = load_model(
                self.path,
                self.device,
                self.dtype,
                attention_backend,
                load_format=c.load_format,
                tp=shard,
                mtp=c.num_speculative_tokens > 0,
            )
        rcfg = self.model.config  # this rank's KV heads (the model's, without tensor parallelism)
        with startup("loading tokenizer"):
            self.tokenizer = load_tokenizer(self.path)

        if c.gpu_memory_utilization is not None and self.device.type != "cuda":
            log.warning(
                "gpu_memory_utilization=%s is for cuda devices and is ignored: %s",
                c.gpu_memory_utilization,
                f"num_device_blocks={num_device_blocks} sizes it here" if num_device_blocks is not None else CPU_SIZING,
            )
        if num_device_blocks is None:
            num_device_blocks = size_device_blocks(
                self.device, bytes_per_block // tp, block_size, max_num_seqs, self.max_model_len, c.gpu_memory_utilization
            )
        if self.ranks is not None:  # every rank holds as many blocks as the tightest one fits
            num_device_blocks = min(num_device_blocks, *self.ranks.gather_sizes())
        if num_host_blocks is None:
            num_host_blocks = (
                size_host_blocks(bytes_per_block, block_size, num_device_blocks, self.max_model_len) if storage is not None else 0
            )
        if preemption_mode is None:
            preemption_mode = "swap" if num_host_blocks else "recompute"
        self.preemption_mode = preemption_mode
        payload = []  # what stored blocks carry besides the decoder's KV: not the same objects
        if cfg.is_moe and c.capture_routing:
            payload.append(f"routing:{cfg.num_moe_layers}x{cfg.top_k}:{cfg.num_experts}")
        if cfg.num_mtp_layers:  # the MTP block's KV, layer num_layers of every block
            payload.append(f"mtp:{cfg.num_mtp_layers}")
        fingerprint = ModelFingerprint(
            cfg.architecture,
            cfg.num_layers,
            cfg.num_kv_heads,
            cfg.head_dim,
            str(self.dtype).removeprefix("torch."),
            block_size,
            weights=weights_digest(self.path, c.load_format, self.device),
            payload=";".join(payload),
        )
        self.storage, self.fetch_cost = open_pool(c)
        rank_ops = None
        if self.ranks is not None:  # every rank copies its shard of each op (engine/tp/transfer.py)
            rank_ops = RankOps(self.ranks)
            if self.storage is not None:
                self.storage.shard(0, tp)
                self.storage = TPStorage(self.storage, rank_ops)  # type: ignore[assignment]  # a StorageClient to the engine
        self.cache = CacheManager(
            block_size=block_size,
            num_device_blocks=num_device_blocks,
            num_host_blocks=num_host_blocks,
            storage=self.storage,
            write_policy=write_policy,
            write_through_threshold=write_through_threshold,
            eviction=c.eviction,
            fingerprint=fingerprint,
            block_nbytes=bytes_per_block,
            enable_prefix_caching=c.enable_prefix_caching,
            fetch_cost=self.fetch_cost,
            early_loads=bool(c.early_loads),
        )
        if cuda_graphs is None:  # default: on for CUDA, where launches bound decode speed
            cuda_graphs = self.device.type == "cuda"
        if cuda_graphs and self.device.type == "cuda" and attention_backend != "triton":
            # a captured graph keeps the host lengths the torch reference read at capture
            log.warning("CUDA graphs need the triton attention backend (got %r): running eagerly", attention_backend)
            cuda_graphs = False
        if self.ranks is not None:  # the others allocate, compile and capture beside this one
            pool = (self.storage.namespace, fingerprint) if self.storage is not None else None
            self.ranks.send(("build", num_device_blocks, num_host_blocks, bool(cuda_graphs), pool))
        with startup("allocating KV tiers"):
            # one block more than the pool hands out: the scratch block padded CUDA-graph rows
            # (and the start's kernel warm-up) write to
            self.kv_caches = allocate_kv_caches(rcfg, num_device_blocks + 1, block_size, self.device, self.dtype)
            # pinned (on CUDA) and on the GPU's NUMA node; one storage object per host block
            self._host = (
                HostKV(
                    (num_host_blocks, rcfg.num_kv_layers, 2, block_size, rcfg.num_kv_heads, rcfg.head_dim),
                    self.dtype,
                    self.device,
                )
                if num_host_blocks
                else None
            )
        self.host_kv = self._host.tensor if self._host is not None else None
        self.routing = (
            ExpertCapture(
                cfg.num_moe_layers, cfg.top_k, cfg.num_experts, block_size, num_device_blocks, num_host_blocks, self.device
            )
            if cfg.is_moe and c.capture_routing
            else None
        )
        local = TransferEngine(self.kv_caches, self.host_kv, self.routing)
        self.transfer = local if rank_ops is None else TPTransfer(local, rank_ops)
        self.copies = CopyPump(self.cache, self.transfer, self.storage)
        if self.storage is not None:
            assert self.host_kv is not None  # a pool always gets a host tier (config, sizing)
            bind_pool(self.storage, self.fetch_cost, self.host_kv, self.routing, fingerprint)
        if self.device.type == "cuda":
            with startup("compiling kernels"):
                startup.kernels_compiled = compile_kernels(
                    self.model, self.kv_caches, self.host_kv, num_device_blocks, block_size, self.max_model_len, attention_backend
                )
        graphs = step_graphs = None
        if cuda_graphs:
            with startup("capturing CUDA graphs"):
                graphs, step_graphs = capture_graphs(
                    self.model,
                    self.kv_caches,
                    block_size,
                    self.max_model_len,
                    max_num_seqs,
                    max_num_batched_tokens,
                    num_device_blocks,
                    self.device,
                    (cfg.num_moe_layers, cfg.top_k) if self.routing else None,
                    self.transfer.gates,
                )
        self.runner = ModelRunner(self.model, self.kv_caches, block_size, self.device, self.routing, graphs, step_graphs)
        self.spec = Speculator(c.num_speculative_tokens, c.speculative_min_acceptance) if c.num_speculative_tokens else None
        if self.spec is not None and self.spec.k > 1:
            with startup("capturing the draft chain's CUDA graphs" if cuda_graphs else "building the draft chain"):
                self.spec.chain = build_chain(
                    self.model,
                    self.kv_caches,
                    block_size,
                    self.max_model_len,
                    max_num_seqs,
                    self.spec.k,
                    num_device_blocks,
                    self.device,
                    bool(cuda_graphs),
                    graphs.pool() if graphs is not None else None,
                )
        self.runner.spec = self.spec
        if self.ranks is not None:
            with startup("waiting for the other tensor-parallel ranks"):
                self.ranks.wait_ready()
            self.runner.peers = self.ranks
        self.scheduler = Scheduler(
            self.cache,
            max_num_batched_tokens,
            max_num_seqs,
            self.max_model_len,
            cfg.eos_token_ids,
            preemption_mode,
            c.prefetch_policy,
            c.prefetch_timeout,
            c.num_speculative_tokens,
            c.max_num_seqs_per_request,
        )
        self.block_size = block_size
        # P: outputs waiting for the pool's acks (engine/pd.py)
        self._exports = Exports(
            self.cache, self.storage.namespace if self.storage is not None else "", float(c.export_timeout), tp
        )
        self._groups = SampleGroups(self.scheduler, self._make_sample)  # n > 1 (engine/group.py)
        self.intake = Intake(
            self.path,
            self.tokenizer,
            cfg,
            self.max_model_len,
            block_size,
            num_device_blocks,
            self.storage is not None,
            self.routing is not None,
            self.device,
            torch.Generator(self.device).manual_seed(c.seed),  # unseeded requests draw from it
        )
        self.num_failed_requests = 0  # failed by an internal error (RequestOutput.error_kind "internal")
        self.overlap_schedule = self.device.type == "cuda" if c.overlap_schedule is None else bool(c.overlap_schedule)
        self._inflight: _Launched | None = None  # overlap: the step on the GPU, results not taken
        self._closed = False
        startup.done()

    # ------------------------------------------------------------------ API
    def add_request(
        self,
        prompt,
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        request_id: str | None = None,
        *,
        handoff: dict | None = None,
        export: bool = False,
        owner: str | None = None,
        priority: int = 0,
    ) -> Request:
        """Validate and queue a request; it joins the next step. ``export``: P of a PD hand-off;
        ``handoff``: D of one (``{"first_token", "num_tokens", "keys", "namespace"}``).
        ``owner``: the call it belongs to (None: itself), whose requests share the running slots
        of one (``max_num_seqs_per_request``); ``priority``: lower runs first (engine/scheduler.py)."""
        if request_id is not None:
            self._check_new_id(str(request_id))  # before the work of make_request
        req = self.make_request(
            prompt,
            params or SamplingParams(),
            cache_salt,
            request_id,
            handoff=handoff,
            export=export,
            owner=owner,
            priority=priority,
        )
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
            self.cache.expect_tail(req.cache_req, req.num_prompt_tokens)
        if req.params.n > 1:  # no prefix caching: no prompt to share, n requests from the start
            self._groups.add(req, fork_now=not self.cache.enable_prefix_caching)

    def abort(self, request_id: str) -> bool:
        """Drop a queued or running request (every sample of it) and return its blocks; False if
        unknown/finished."""
        self._exports.discard(request_id)  # an export in flight finishes on its own
        aborted = self._groups.abort(request_id)
        return self.scheduler.abort(request_id) is not None if aborted is None else aborted

    def progress(self, req: Request) -> list[tuple[int, list[int], list | None, str | None]]:
        """(index, token_ids, logprobs, finish_reason or None) of every sample of ``req`` started
        so far (streaming: AsyncEngine); token_ids and logprobs are live lists, not copies."""
        return self._groups.progress(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._exports) or self._inflight is not None

    def _make_sample(self, group: SampleGroup, i: int) -> Request:
        return self.intake.sample(group.head, i, group.sample_id(i, AUTO_ID))

    def _error_output(self, req: Request, error: str, error_kind: str | None) -> RequestOutput:
        return request_output(req, self.tokenizer, self.routing, error, error_kind)

    def _check_new_id(self, request_id: str) -> None:
        sched = self.scheduler
        # (a group whose sample 0 finished still owns its id until its last sample did)
        if (
            request_id in self._exports
            or self._groups.owns(request_id)
            or any(r.request_id == request_id for r in (*sched.waiting, *sched.running))
        ):
            raise ValueError(f"request_id {request_id!r} is already in use by a request in the engine")

    def make_request(
        self,
        prompt,
        params: SamplingParams,
        cache_salt: str | None,
        request_id: str | None = None,
        *,
        handoff: dict | None = None,
        export: bool = False,
        owner: str | None = None,
        priority: int = 0,
    ) -> Request:
        """A validated :class:`Request` (engine/intake.py; no engine state touched but the id
        counter); ``handoff``: P's manifest, checked against the blocks this engine would read;
        ``owner``, ``priority``: as :meth:`add_request`'s."""
        req = self.intake.request(
            prompt, params, cache_salt, request_id, handoff=handoff is not None, export=export, owner=owner, priority=priority
        )
        if handoff is not None:
            assert self.storage is not None  # (intake checked)
            accept_handoff(
                req,
                handoff,
                self.config.vocab_size,
                self.storage.namespace,
                self.cache,
                self.scheduler,
                self.engine_config.tensor_parallel_size,
            )
        return req

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
        ops_before = self.copies.num_done
        self.copies.pump()  # copies that landed since the last step
        results: list[RequestOutput] = []
        prev, self._inflight = self._inflight, None
        if prev is not None and prev.sync:
            self._finish(prev, results)
            prev = None
        out = self.scheduler.schedule(defer_preempt=prev is not None)
        if out.needs_sync:  # it would preempt: first the step in flight
            self._finish(prev, results)  # type: ignore[arg-type]
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
            self.copies.pump()  # staged copies (e.g. a swap's) go out now
            self.copies.wait_loads()
        if self._exports:
            results += self._exports.finished()
        progressed = out.scheduled or self.copies.num_done != ops_before or results
        if not progressed and self.has_unfinished():
            if self.copies.in_flight:  # nothing to run until copies land: wait for them
                self.copies.wait_some()
            elif not self.cache.num_pending_ops and self.scheduler.waiting:
                # the request admission stopped at: blocks held elsewhere (e.g. exports), it cannot run
                req = self.scheduler.blocked or self.scheduler.waiting[0]
                results.append(
                    self._fail(
                        req,
                        RuntimeError(
                            f"request {req.request_id} ({req.num_tokens} tokens) cannot be scheduled: the device "
                            f"tier has {self.cache.device_pool.num_blocks} blocks"
                        ),
                    )
                )
        return self._groups.fold(results, self._error_output)

    def _launch(self, out: SchedulerOutput, results: list[RequestOutput]) -> _Launched | None:
        """Queue the step (forward and sampling) and advance its requests; None if every one of
        them failed (their outputs into ``results``)."""
        loads_before = self.copies.num_loads

        def start_loads(mode: str):
            if not hook:  # once per step, whatever forwards run in it
                self.transfer.load_mode = mode
                try:
                    self.copies.pump()  # loads: queued (GPU) or done (CPU)
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
        except Exception as e:  # blamed on this step's requests, reported in their outputs
            self._blame(out, results, e)
            return None
        # the next schedule needs this step's tokens on the host if it loaded blocks (a failed
        # load rewinds its request), fell back to one-by-one, or penalizes by what it samples
        loads = self.copies.num_loads != loads_before
        sync = loads or result.collected or any(s.request.params.has_penalties for s in out.scheduled)
        return _Launched(out, ends, result, sync, loads, t0)

    def _forward(self, out: SchedulerOutput, start_loads, results: list[RequestOutput]) -> StepResult:
        """The step's forward and sampling, queued. If a batch of several raises, its requests
        run one by one, each to its results (the KV they write is their own, rewritten alike):
        those that fail alone are failed (outputs into ``results``) and dropped from ``out``, the
        others go on with the step."""
        try:
            return self.runner.execute(out, start_loads)
        except Exception as e:  # blamed on this step's requests, reported in their outputs
            if self.ranks is not None:  # the other ranks are inside this step's collectives
                raise self.ranks.explain(e) from e
            raise_if_device_lost(e)  # nothing more runs on this GPU: no retry
            if len(out.scheduled) == 1:
                raise
            log.warning("a forward of %d requests failed (%r): running them one by one", len(out.scheduled), e)
        sampled: dict[str, int] = {}
        survivors = []
        for s in out.scheduled:
            try:
                sampled.update(self.runner.execute(SchedulerOutput([s], []), start_loads).collect())
                survivors.append(s)
            except Exception as e:  # this request alone fails
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
                self.copies.wait_loads()  # the forward waited on them
            rewinds = self.copies.take_rewinds([s.request.request_id for s in out.scheduled])
            finished = self.scheduler.update(out, step.ends, sampled, rewinds)
        except Exception as e:  # blamed on this step's requests, reported in their outputs
            self.scheduler.drop(out)
            self._blame(out, results, e)
            return
        try:
            self._outputs(out, finished, results)
        except Exception as e:  # blamed on this step's requests, reported in their outputs
            self._blame(out, results, e)

    def _outputs(self, out: SchedulerOutput, finished: list[Request], results: list[RequestOutput]) -> None:
        scheduled = [s.request for s in out.scheduled]
        if self._groups:  # n > 1: a sample 0 that sampled its first token forks
            self._groups.fork_ready(scheduled)
        results += check_handoffs(scheduled, finished, self.pd_on_miss, self.scheduler, self._error_output)
        for req in finished:
            try:
                output = request_output(req, self.tokenizer, self.routing)
                if req.export:
                    self._exports.start(req, output)  # comes out once the pool acked its blocks
                else:
                    results.append(output)
            finally:  # a failed output still returns the request's blocks
                self.scheduler.release(req)
        self.copies.pump()  # backups of what the forward wrote, puts

    def _blame(self, out: SchedulerOutput, results: list[RequestOutput], exc: BaseException) -> None:
        """Fail the requests of ``out`` without an output yet (the step raised ``exc``); an
        error after which the GPU can run nothing more stops the engine instead (engine/fatal.py),
        as does any under tensor parallelism (the ranks could no longer be kept in step)."""
        if self.ranks is not None:
            raise self.ranks.explain(exc) from exc
        raise_if_device_lost(exc)
        answered = {o.request_id for o in results} | self._exports.ids()
        blamed = [s.request for s in out.scheduled if s.request.request_id not in answered and not s.request.is_finished]
        if not blamed:
            raise exc
        log.error("engine step failed; failing its %d requests", len(blamed), exc_info=exc)
        results += [self._fail(req, exc) for req in blamed]
        self.drain()

    def _fail(self, req: Request, exc: BaseException) -> RequestOutput:
        """Fail ``req`` for an internal error: return its blocks (wherever the step left it) and
        make its error output."""
        self._exports.discard(req.request_id)
        if (
            self.scheduler.abort(req.request_id) is None
            and req.cache is not None
            and not req.cache.freed
            and req not in self.scheduler.draining
        ):
            self.scheduler.release(req)  # finished in update, not yet released
        req.status = Status.FINISHED
        self.num_failed_requests += 1
        return self._error_output(req, f"internal error: {exc!r}", "internal")

    def export_names(self, request_id: str) -> dict | None:
        """P: the manifest's names of ``request_id``'s export in flight, or None (engine/pd.py)."""
        return self._exports.names(request_id)

    def pump_idle(self) -> int:
        """With no request to step: submit staged copies and hand back those that landed (the
        server's engine thread calls it while idle, so that the last requests' backups and their
        puts to the pool finish instead of waiting for the next request). Returns the copies
        still pending."""
        if not self.closed and not self.has_unfinished():
            self.copies.pump()
        return self.cache.num_pending_ops

    def drain(self) -> None:
        """Finish the step in flight; wait for every copy in flight and hand it to the manager
        (close, errors)."""
        if self._inflight is not None:
            step, self._inflight = self._inflight, None
            self._finish(step, [])  # (close: its requests' outputs are not wanted)
        self.copies.drain()

    def score(self, token_ids: Sequence[int], routed_experts: np.ndarray | None = None) -> np.ndarray:
        """Per-token logprobs of token_ids[1:] (float32 [len-1]); routing forced when given."""
        self._check_open()
        ids = list(token_ids.tolist() if isinstance(token_ids, np.ndarray) else token_ids)
        ids = check_token_ids(ids, self.config.vocab_size)
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
        """Hits, evictions, bytes moved and blocks used per tier; failures; the start's phases."""
        stats = cache_stats(self.cache, self.storage, self.fetch_cost, self.num_failed_requests, self.startup)
        if self.spec is not None:  # speculative decoding: drafts, acceptance, MTP rows run
            stats["speculative"] = self.spec.stats()
        return stats

    def close(self) -> None:
        """Wait for copies in flight, then release device and (pinned) host memory."""
        if self._closed:
            return
        try:
            self.drain()
        except RankLost:
            pass  # a rank is gone: nothing more to wait for
        if self.routing is not None:
            self.routing.flush(wait=True)
        self._closed = True
        if self.ranks is not None:
            self.runner.release_graphs()  # (NCCL's teardown waits for graphs that hold its kernels)
            self.ranks.close()  # (and leaves the process group)
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

    def __exit__(self, *exc: object) -> None:
        self.close()
