"""The engine core: model, KV tiers, scheduler and the step loop, behind two front ends: the
offline ``kvtier.LLM`` (engine/llm.py) and the serving loop (engine/loop.py, which a serving
process reaches through engine/client.py's ``EngineClient``).

    add_request(prompt, params, ...) -> Request     validated and queued; joins the next step
    step(updated) -> [RequestOutput]                 one engine step; the requests it finished (and
                                                     into ``updated``, those whose tokens may have moved)
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

The parts are built once, by engine/build.py (from the config resolved against the model and
the machine, engine/resolve.py); the parts of a step after its schedule are engine/stepper.py.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any, Sequence

import numpy as np

from kvtier.engine.build import build_engine
from kvtier.engine.cache_stats import cache_stats
from kvtier.engine.checks import AUTO_ID, check_token_ids
from kvtier.engine.config import EngineConfig
from kvtier.engine.experts import validate_routed_experts
from kvtier.engine.group import SampleGroup, SampleGroups, SampleProgress, check_n
from kvtier.engine.outputs import RequestOutput
from kvtier.engine.params import SamplingParams
from kvtier.engine.pd import Exports, accept_handoff
from kvtier.engine.request import Request
from kvtier.engine.scheduler import SchedulerOutput
from kvtier.engine.startup import Startup
from kvtier.engine.stepper import Steps
from kvtier.engine.tp.ranks import RankLost
from kvtier.model.images import MMInput


class EngineCore(Steps):
    def __init__(
        self, model: str | os.PathLike, config: EngineConfig | None = None, *, startup: Startup | None = None, **options: Any
    ) -> None:
        """An engine serving ``model`` (a checkpoint directory or a hub id), built by
        engine/build.py. The options are ``config`` (engine/config.py: every option, its default,
        flag and check), with ``options`` as keywords over it (``EngineCore(path, device="cuda")``);
        ``engine_config`` keeps them as given, ``resolved`` as the model and the machine decided
        them (engine/resolve.py). ``startup``: where the phases of the start are reported (a
        server's ``/health`` reads it while the engine starts).

        Bad sizes and types raise ValueError naming the value before the model is loaded."""
        self.engine_config = replace(config, **options) if config is not None else EngineConfig(**options)
        self.parts = parts = build_engine(self.engine_config, model, startup)
        self.resolved = c = parts.config
        assert c.max_model_len is not None and c.preemption_mode is not None  # (resolved)
        self.path, self.device, self.dtype, self.config = parts.path, parts.device, parts.dtype, parts.model_config
        self.model, self.tokenizer, self.ranks, self.startup = parts.model, parts.tokenizer, parts.ranks, parts.startup
        self.storage, self.fetch_cost, self.cache, self.routing = parts.storage, parts.fetch_cost, parts.cache, parts.routing
        self.kv_caches, self.host_kv, self.transfer, self.copies = parts.kv_caches, parts.host_kv, parts.transfer, parts.copies
        self.kv_scales = parts.kv_scales  # an fp8 cache's scales per layer, fixed at build (None: not quantized)
        self.runner, self.spec, self.scheduler, self.intake = parts.runner, parts.spec, parts.scheduler, parts.intake
        self.max_model_len, self.block_size, self.preemption_mode = c.max_model_len, c.block_size, c.preemption_mode
        self.overlap_schedule, self.pd_on_miss = bool(c.overlap_schedule), c.pd_on_miss
        namespace = self.storage.namespace if self.storage is not None else ""
        # the split of a stored block: one shard per rank, or one object whatever the ranks (a latent)
        self._block_shards = self.storage.tp_size if self.storage is not None else c.tensor_parallel_size
        self._exports = Exports(self.cache, namespace, float(c.export_timeout), self._block_shards)
        self._groups = SampleGroups(self.scheduler, self._make_sample)
        self.num_failed_requests = 0  # failed by an internal error (RequestOutput.error_kind "internal")
        self._inflight = None
        self._closed = False

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

    def progress(self, req: Request) -> list[SampleProgress]:
        """Every sample of ``req`` started so far, its tokens and logprobs live lists, not copies
        (a serving loop streams them: engine/loop.py asks for the requests ``step`` names)."""
        return self._groups.progress(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._exports) or self._inflight is not None

    def _make_sample(self, group: SampleGroup, i: int) -> Request:
        return self.intake.sample(group.head, i, group.sample_id(i, AUTO_ID))

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
        mm: tuple[MMInput, ...] | None = None,
    ) -> Request:
        """A validated :class:`Request` (engine/intake.py; no engine state touched but the id
        counter); ``handoff``: P's manifest, checked against the blocks this engine would read;
        ``owner``, ``priority``: as :meth:`add_request`'s; ``mm``: images placed already (the
        serving process's, engine/loop.py)."""
        req = self.intake.request(
            prompt,
            params,
            cache_salt,
            request_id,
            handoff=handoff is not None,
            export=export,
            owner=owner,
            priority=priority,
            mm=mm,
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
                self._block_shards,
            )
        return req

    def step(self, updated: set[str] | None = None) -> list[RequestOutput]:
        """One engine step; returns the requests that finished in it. ``updated``, when given,
        gets the id of every request (as added: a sample's is its request's) whose results were
        taken in this step: those whose tokens may have moved, which a serving loop streams
        (engine/loop.py) instead of asking every open request.

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
        taken: list[SchedulerOutput] = []  # the steps whose results were taken: their requests may have new tokens
        prev, self._inflight = self._inflight, None
        if prev is not None and prev.sync:
            self._finish(prev, results)
            taken.append(prev.out)
            prev = None
        out = self.scheduler.schedule(defer_preempt=prev is not None)
        if out.needs_sync:  # it would preempt: first the step in flight
            assert prev is not None  # (schedule defers a preemption only with a step in flight)
            self._finish(prev, results)
            taken.append(prev.out)
            prev = None
            out = self.scheduler.schedule()
        cur = self._launch(out, results) if out.scheduled else None
        if prev is not None:
            self._finish(prev, results)
            taken.append(prev.out)
        if cur is not None:
            if self.overlap_schedule and not cur.sync:
                self._inflight = cur
            else:
                self._finish(cur, results)
                taken.append(cur.out)
        elif not out.scheduled:
            self.copies.pump()  # staged copies (e.g. a swap's) go out now
            self.copies.wait_loads()
        if updated is not None:  # (before the fold: a group that ends in it still maps its samples)
            updated.update(self._groups.request_id_of(s.request.request_id) for o in taken for s in o.scheduled)
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
        self.host_kv = None
        self.parts.close()

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
