"""The parts of an engine step after it was scheduled (engine/core.py's ``step()`` runs them)::

    _launch: forward + sampling queued (_forward: a batch that raises runs one by one), advance()
    _finish: results on the host ─► loads landed ─► update() ─► _outputs: fork n > 1, PD checks,
             outputs of the finished, their blocks released ─► copies pumped
    _blame / _fail: a step that raised fails its requests (their blocks returned), not the engine
    drain: the step in flight finished, every copy in flight waited for (close, errors)

:class:`Steps` is a base of :class:`~kvtier.engine.core.EngineCore`: these methods work on the
core's parts (declared below) and on the step in flight (``_inflight``, overlap scheduling; read
it as :attr:`Steps.step_in_flight`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from kvtier.cache import CacheManager
from kvtier.cache.cost import FetchCostModel
from kvtier.engine.copies import CopyPump
from kvtier.engine.experts import ExpertCapture
from kvtier.engine.fatal import raise_if_device_lost
from kvtier.engine.group import SampleGroups
from kvtier.engine.outputs import RequestOutput, request_output
from kvtier.engine.pd import Exports, check_handoffs
from kvtier.engine.request import Request, Status
from kvtier.engine.runner import ModelRunner, StepResult
from kvtier.engine.scheduler import Scheduler, SchedulerOutput
from kvtier.engine.tp.ranks import Ranks
from kvtier.engine.tp.transfer import TPTransfer
from kvtier.transfer.engine import TransferEngine

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


class Steps:
    """Launch, finish and blame of a step (module docstring), over the core's parts."""

    runner: ModelRunner
    scheduler: Scheduler
    cache: CacheManager
    copies: CopyPump
    transfer: TransferEngine | TPTransfer
    ranks: Ranks | None
    routing: ExpertCapture | None
    fetch_cost: FetchCostModel | None
    tokenizer: Any
    pd_on_miss: str
    num_failed_requests: int
    _exports: Exports  # P: outputs waiting for the pool's acks (engine/pd.py)
    _groups: SampleGroups  # n > 1 (engine/group.py)
    _inflight: _Launched | None  # overlap: the step on the GPU, results not taken

    @property
    def step_in_flight(self) -> SchedulerOutput | None:
        """Overlap scheduling: the step launched last whose results the host has not taken yet
        (the next :meth:`step` takes them), or None."""
        return self._inflight.out if self._inflight is not None else None

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

    def drain(self) -> None:
        """Finish the step in flight; wait for every copy in flight and hand it to the manager
        (close, errors)."""
        if self._inflight is not None:
            step, self._inflight = self._inflight, None
            self._finish(step, [])  # (close: its requests' outputs are not wanted)
        self.copies.drain()

    def _error_output(self, req: Request, error: str, error_kind: str | None) -> RequestOutput:
        return request_output(req, self.tokenizer, self.routing, error, error_kind)
