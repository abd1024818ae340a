"""Continuous batching with chunked prefill and preemption by swap or recompute.

Each step the scheduler spends a token budget (``max_num_batched_tokens``):

1. running requests first, oldest first: a decode token, or the next prefill chunk; if the device
   tier cannot hold it even after eviction, a running request is preempted: the lowest priority
   (the highest ``priority`` number), the newest of those (vLLM's order; a victim scheduled
   earlier in the step gives its chunk back). Under ``preemption_mode="swap"`` its committed
   blocks are copied to the host tier and come back by a load; under ``"recompute"`` they are
   just freed (and may still be served from cache). While device blocks are on their way out (a
   swap's copies in flight), the scheduler waits for them rather than preempting more;
2. then waiting requests, in turns (below), while the budget, ``max_num_seqs`` and the device
   tier allow: match the prefix (device, then host hits), admit, schedule the uncached rest
   (chunked). If the device tier cannot hold the one whose turn it is, no one is admitted past it
   in this step (a large request is not starved by smaller ones behind it).
   A request with storage hits first starts a prefetch into host blocks (as many blocks as the
   cost model says pay) and steps aside while it lands, holding a seat; others go on. It is
   admitted, with the chunks that landed, once its prefetch is done, or under ``prefetch_policy``:

   - ``wait_complete``: only when every chunk completed (each storage call is bounded by the
     backend's timeouts, so this wait is bounded too);
   - ``timeout``: or after ``prefetch_timeout[0] + prefetch_timeout[1] * tokens / 1000`` seconds;
   - ``best_effort``: or once the fetch is late: after 1.5x the time the cost model expected it to
     take (+10 ms), or, if longer, the time recomputing those blocks would take — a late fetch
     costs at most one recompute's worth of waiting; what landed by then is used.

Fairness between callers. Every request has an ``owner`` (the call it belongs to: a server passes
its response id for every prompt of one HTTP call; samples of ``n > 1`` inherit their head's; a
request without one is its own) and a ``priority`` (default 0, lower first, as vLLM's field):

- an owner runs at most ``max_num_seqs_per_request`` sequences at once (running, or holding a
  seat while its prefetch lands), so one call of 8 prompts x n=128 cannot fill every slot;
- admission takes turns: the next request admitted is the one with the lowest (priority, running
  sequences of its owner, position in the queue). A new request of another caller thus goes
  before the next sample of a call that runs many already; with one owner and one priority this
  is the queue order (preempted requests and forked samples are at its front);
- the token budget: while another owner has prefill work too (a running prefill, or a waiting
  request that could be admitted), one owner's prefill chunks take at most half of
  ``max_num_batched_tokens`` in a step (the rest of its prompts go on in the next steps), so a
  caller's long prompts leave room for another's. Half, not an equal part per owner: between
  many callers of similar prompts, prefill stays close to arrival order (which gives a lower
  mean time to first token than sharing every step between all of them), and a third caller
  waits at most for two others' prompts, as it would in arrival order. Decode tokens are never
  held back. Simple rather than work-conserving: with two owners, what one leaves of its half
  stays unused in that step.

A step's life after schedule()::

    launch: runner queues the forward + sampling ─► advance(): num_computed_tokens += chunk,
            num_pending += 1 per sampling request
    results on the host: update() commits the full blocks the step wrote, appends the sampled
            tokens (num_pending -= 1), applies stop conditions, returns the finished requests

With overlap scheduling (engine/core.py) the next schedule() runs between the two, while the GPU
runs the step: a decode whose token is still in flight is scheduled from ``num_tokens_ahead``
(the runner reads that token on the device), a request whose in-flight token ends it by length
is not scheduled, and ``defer_preempt=True`` makes schedule() stop and say so
(``SchedulerOutput.needs_sync``) instead of preempting, so that nothing in flight is preempted.
A request that finished by a token the host had not seen when the next step was scheduled runs
in that step for nothing: its token there is dropped.
"""

from __future__ import annotations

import heapq
import time
from collections import Counter, deque
from dataclasses import dataclass

from kvtier.cache import CacheManager, CacheRequest, MMItem
from kvtier.engine.config import EngineConfig
from kvtier.engine.request import Request, Status


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    request: Request
    num_tokens: int  # tokens computed this step, from request.num_computed_tokens
    samples: bool  # this chunk reaches the end: its last logits give the next token
    num_drafts: int = 0  # speculative decoding: drafts after the last token, verified by this step


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    preempted: list[Request]
    stalled: bool = False  # a running request waits for device blocks that copies will free
    needs_sync: bool = False  # defer_preempt: a preemption is needed; finish the step in flight first

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, cache: CacheManager, config: EngineConfig, eos_token_ids: tuple[int, ...] = ()) -> None:
        """``config``: resolved (engine/resolve.py; its options were checked there): the token
        budget, the running slots (in all and per owner), the context, the preemption mode, the
        prefetch policy and the speculative tokens. ``eos_token_ids``: the model's."""
        mode, per_owner, context = config.preemption_mode, config.max_num_seqs_per_request, config.max_model_len
        assert mode is not None and per_owner is not None and context is not None, "an unresolved config (engine/resolve.py)"
        assert mode != "swap" or cache.has_host, "swap preemption needs a cache with a host tier"
        self.preemption_mode = mode
        self.num_speculative_tokens = config.num_speculative_tokens
        self.prefetch_policy = config.prefetch_policy
        self.prefetch_timeout = config.prefetch_timeout
        self.cache = cache
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_num_seqs = config.max_num_seqs
        self.max_num_seqs_per_request = per_owner
        self.max_model_len = context
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.draining: list[Request] = []  # finished, blocks held until their steps in flight land
        self.blocked: Request | None = None  # the waiting request the last admission stopped at (no blocks)
        self.num_preemptions = 0
        self.num_prompt_tokens_computed = 0  # prompt tokens forwarded, hits excluded (stats)
        self.num_generated_tokens = 0  # tokens appended to outputs (stats)

    def add(self, req: Request) -> None:
        req.cache = self._cache_request(req)
        self.cache.start_lookup(req.cache)  # the pool's answer is ready by its first schedule
        self.waiting.append(req)

    def _cache_request(self, req: Request) -> CacheRequest:
        mm_items = [MMItem(m.hash, m.offset, m.length) for m in req.mm]
        c = self.cache.new_request(req.request_id, req.all_token_ids, cache_salt=req.cache_salt, mm_items=mm_items)
        # prompt logprobs need the logits of every prompt position: a hit has none, so such a
        # request computes its whole prompt (as vLLM does); its blocks are still committed
        c.no_hits = req.needs_prompt_logits
        return c

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ schedule
    def schedule(self, defer_preempt: bool = False) -> SchedulerOutput:
        """This step's work. ``defer_preempt``: a step is in flight; rather than preempt, return
        with ``needs_sync`` set (and nothing admitted): schedule again once it finished."""
        budget = self.max_num_batched_tokens
        out = SchedulerOutput([], [])
        self.blocked = None
        cache = self.cache
        tally = Counter(r.owner for r in self.running)  # each owner's running sequences
        share = self._prefill_share(tally)
        spent: Counter[str] = Counter()  # prefill tokens each owner got in this step
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens_ahead - req.num_computed_tokens, budget)
            prefill = self._is_prefill(req)
            if prefill:
                n = min(n, share - spent[req.owner])  # its owner's share spent: the rest next step
            if n <= 0 or (req.num_pending and self._ends_in_flight(req)):
                i += 1  # nothing to compute until its token lands
                continue
            drafts = self._num_drafts(req, n, budget)
            while not cache.allocate(req.cache_req, self._table_len(req, n + drafts)):
                if cache.wait_would_fit(req.cache_req, req.num_computed_tokens + n):  # copies landing free
                    # enough blocks (backups, early loads): wait for them rather than preempt
                    out.stalled = True
                    break
                if defer_preempt:
                    out.needs_sync = True
                    return out
                j = self._victim()
                victim = self.running[j]
                if j < i:  # scheduled earlier in this step: its chunk goes back to the budget
                    budget += self._unschedule(out, victim, spent)
                    i -= 1
                del self.running[j]
                tally[victim.owner] -= 1
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                if drafts:
                    out.scheduled.append(ScheduledRequest(req, n + drafts, True, drafts))
                else:
                    out.scheduled.append(self._scheduled(req, n))
                budget -= n + drafts
                if prefill:
                    spent[req.owner] += n
                i += 1
            if out.stalled:
                break
        if out.preempted or out.stalled:
            return out  # no admissions while short of blocks
        self._admit(out, budget, share, spent, tally)
        return out

    def _admit(self, out: SchedulerOutput, budget: int, share: int, spent: Counter[str], tally: Counter[str]) -> None:
        """Step 2 of the module docstring: waiting requests into ``out``, in turns. ``tally``:
        each owner's running sequences (and, as they are taken, its seats taken in this step)."""
        seats = self.max_num_seqs - len(self.running)
        if not self.waiting or budget <= 0 or seats <= 0:
            return
        cache = self.cache
        cap = self.max_num_seqs_per_request
        # each owner's waiting requests, its next one last: by priority, then queue position
        # (preempted requests and forked samples are at the front: first among their owner's)
        full = {owner for owner, n in tally.items() if n >= cap}
        queues: dict[str, list[tuple[int, int, Request]]] = {}
        for pos, req in enumerate(self.waiting):
            if req.owner not in full:  # (a set lookup: this loop sees every waiting request)
                queues.setdefault(req.owner, []).append((req.priority, pos, req))
        turns: list[tuple[int, int, int, str]] = []  # heap of each owner's next turn

        def take_turn(owner: str) -> None:
            q = queues[owner]
            if q and tally[owner] < cap:
                priority, pos, _ = q[-1]
                heapq.heappush(turns, (priority, tally[owner], pos, owner))

        for owner, q in queues.items():
            q.sort(reverse=True)  # (positions differ: requests are never compared)
            take_turn(owner)
        admitted = False
        # a request whose prefetch is in flight holds a seat: no more prefetches (host blocks
        # reserved) than requests that could be admitted
        while turns and budget > 0 and seats > 0:
            owner = heapq.heappop(turns)[-1]
            req = queues[owner].pop()[-1]
            allow = min(budget, share - spent[owner])
            if allow <= 0:
                continue  # its owner's share of this step is spent: its requests wait for the next
            if req.prefetch_deadline is not None and not self._prefetch_settled(req):
                seats -= 1  # its storage hits are landing: it steps aside
                tally[owner] += 1
                take_turn(owner)
                continue
            m = cache.match_prefix(req.cache_req)
            cached = (m.num_device_blocks + m.num_host_blocks) * m.block_size + cache.tail_hit(req.cache_req)
            if req.prefetch_from is None:
                req.prefetch_from = cached  # what device + host held at arrival
                req.prefetch_device = m.num_device_blocks * m.block_size
                if m.num_storage_blocks or req.cache_req.tail is not None:  # (a PD hand-off's last block)
                    n_fetch = cache.prefetch(req.cache_req)
                    if n_fetch:
                        req.metrics["prefetch_start"] = time.monotonic()
                        req.prefetch_deadline = req.metrics["prefetch_start"] + self._prefetch_budget(req, n_fetch)
                        seats -= 1
                        tally[owner] += 1
                        take_turn(owner)
                        continue
            if not cache.allocate(req.cache_req, min(req.num_tokens, cached + allow)):
                self.blocked = req  # no one admitted past it (it would wait for ever behind smaller ones)
                break
            match = req.cache_req.match  # allocate re-matches if the tree changed
            assert match is not None
            m = match
            cached = (m.num_device_blocks + m.num_host_blocks) * m.block_size + cache.tail_hit(req.cache_req)
            n = min(req.num_tokens - cached, allow)
            if not cache.allocate(req.cache_req, cached + n):  # fewer hits than first seen: grow
                n = len(req.cache_req.block_table) * m.block_size - cached
            req.metrics.setdefault("admitted", time.monotonic())
            req.status = Status.RUNNING
            req.prefetch_deadline = None
            req.num_computed_tokens = cached
            if req.num_cached_tokens is None:
                req.num_cached_tokens = cached
                device = m.num_device_blocks * m.block_size
                if "prefetch_start" in req.metrics:  # early loads made host and storage hits device hits
                    device = min(device, req.prefetch_device)
                storage = max(0, cached - max(req.prefetch_from, device))  # hits that came from storage
                req.cached_tokens_by_tier = {"device": device, "host": cached - device - storage, "storage": storage}
            self.running.append(req)
            out.scheduled.append(self._scheduled(req, n))
            admitted = True
            budget -= n
            spent[owner] += n
            seats -= 1
            tally[owner] += 1
            take_turn(owner)
        if admitted:  # (out of the queue in one pass, not one O(queue) removal each)
            kept = [r for r in self.waiting if r.status is Status.WAITING]
            self.waiting.clear()
            self.waiting.extend(kept)

    def _prefill_share(self, tally: Counter[str]) -> int:
        """The prefill tokens one owner may take in this step: the whole budget, or half of it
        while another owner has prefill work too (a running prefill, or a waiting request that
        could be admitted)."""
        owners = {r.owner for r in self.running if self._is_prefill(r)}
        if len(self.running) < self.max_num_seqs:
            cap = self.max_num_seqs_per_request
            owners |= {owner for owner in {r.owner for r in self.waiting} if tally.get(owner, 0) < cap}
        if len(owners) < 2:
            return self.max_num_batched_tokens
        return max(1, self.max_num_batched_tokens // 2)

    @staticmethod
    def _is_prefill(req: Request) -> bool:
        """Is ``req``'s next chunk more than one token (a prompt, or a recompute after a preemption)?"""
        return req.num_tokens_ahead - req.num_computed_tokens > 1

    def _victim(self) -> int:
        """The running request to preempt (its index): the lowest priority (the highest number),
        the newest of those (vLLM's order)."""
        running = self.running
        return max(range(len(running)), key=lambda k: (running[k].priority, k))

    def _unschedule(self, out: SchedulerOutput, req: Request, spent: Counter[str]) -> int:
        """Take ``req``'s chunk out of ``out`` (it is preempted after it was scheduled); returns
        its tokens (back to the budget): 0 if it was passed over in this step."""
        for k, s in enumerate(out.scheduled):
            if s.request is req:
                del out.scheduled[k]
                if self._is_prefill(req):  # (not advanced yet: as when it was scheduled)
                    spent[req.owner] -= s.num_tokens
                return s.num_tokens
        return 0

    def _num_drafts(self, req: Request, n: int, budget: int) -> int:
        """Drafts a decode step of ``req`` verifies (engine/spec.py): those it holds, as many as
        the budget, its max_tokens and the context leave room for (the last one is the bonus)."""
        if not req.draft_tokens or n != 1 or req.num_pending:
            return 0
        room = min(
            len(req.draft_tokens),
            budget - 1,
            req.params.max_tokens - len(req.output_token_ids) - 1,
            self.max_model_len - req.num_tokens - 1,
        )
        return max(0, room)

    def _table_len(self, req: Request, n: int) -> int:
        """Positions ``req``'s block table must cover for a step of ``n`` tokens: with speculative
        decoding, k - 1 more, where the MTP block drafts past the last one (engine/spec.py)."""
        end = req.num_computed_tokens + n
        if self.num_speculative_tokens > 1:
            return min(end + self.num_speculative_tokens - 1, max(end, self.max_model_len))
        return end

    def _prefetch_budget(self, req: Request, num_blocks: int) -> float:
        if self.prefetch_policy == "wait_complete":
            return float("inf")
        if self.prefetch_policy == "timeout":
            base, per_1k = self.prefetch_timeout
            return base + per_1k * req.num_tokens / 1000
        cost = self.cache.fetch_cost
        if cost is None:
            return self.prefetch_timeout[0]
        return max(cost.fetch_seconds(num_blocks) * 1.5 + 0.01, cost.recompute_seconds(num_blocks) or 0.0)

    def _prefetch_settled(self, req: Request) -> bool:
        """May a request whose prefetch started be admitted now?"""
        deadline = req.prefetch_deadline
        assert deadline is not None  # (its prefetch started)
        return not self.cache.prefetch_pending(req.cache_req) or time.monotonic() >= deadline

    def _scheduled(self, req: Request, n: int) -> ScheduledRequest:
        return ScheduledRequest(req, n, req.num_computed_tokens + n == req.num_tokens_ahead)

    def _ends_in_flight(self, req: Request) -> bool:
        """Will the token(s) in flight end ``req`` whatever they are (by length)?"""
        return (
            req.handoff_stop is not None
            or len(req.output_token_ids) + req.num_pending >= req.params.max_tokens
            or req.num_tokens_ahead >= self.max_model_len
        )

    def _preempt(self, req: Request) -> None:
        """Free everything; the request starts over from its cached prefix: under swap, every
        block it committed is copied to host first, so it comes back by a load."""
        if self.preemption_mode == "swap":
            self.cache.swap_out(req.cache_req)
        else:
            self.cache.free(req.cache_req)
        req.cache = self._cache_request(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.prefetch_from = None  # its prefix may be in storage again: prefetch anew
        req.prefetch_deadline = None
        self.num_preemptions += 1
        req.status = Status.WAITING
        self.waiting.appendleft(req)

    # ------------------------------------------------------------------ update
    def advance(self, out: SchedulerOutput) -> list[int]:
        """The step is launched: its chunks count as computed, its samples as pending. Returns
        each scheduled request's computed length after the step (for :meth:`update`)."""
        ends = []
        for s in out.scheduled:
            req = s.request
            start = req.num_computed_tokens
            req.num_computed_tokens += s.num_tokens
            req.num_pending += s.samples
            self.num_prompt_tokens_computed += max(0, min(req.num_computed_tokens, req.num_prompt_tokens) - start)
            ends.append(req.num_computed_tokens)
        return ends

    def update(
        self, out: SchedulerOutput, ends: list[int], sampled: dict[str, int], rewinds: dict[object, int] | None = None
    ) -> list[Request]:
        """Apply a step whose results reached the host (``ends`` from :meth:`advance`); returns
        the requests that finished in it."""
        finished = []
        for s, end in zip(out.scheduled, ends):
            req = s.request
            req.num_pending -= s.samples
            if req.status is not Status.RUNNING:  # finished or aborted while the step ran: dropped
                req.step_logprobs = req.step_prompt_logprobs = None
                continue
            if rewinds and req.request_id in rewinds:  # a load failed: recompute from there
                valid = rewinds[req.request_id]
                req.num_computed_tokens = min(req.num_computed_tokens, valid)
                if req.num_cached_tokens is not None and req.num_cached_tokens > valid:
                    req.num_cached_tokens = valid  # the rest is recomputed, not a hit
                    tiers = req.cached_tokens_by_tier
                    tiers["device"] = min(tiers["device"], valid)
                    tiers["host"] = min(tiers["host"], valid - tiers["device"])
                    tiers["storage"] = valid - tiers["device"] - tiers["host"]
                req.step_logprobs = req.step_prompt_logprobs = None
                continue
            if s.num_drafts:  # speculative: keep the accepted drafts' positions, rewind the rest
                accepted, req.step_accepted = req.step_accepted or [], None
                entries, req.step_accepted_logprobs = req.step_accepted_logprobs, None
                cut = s.num_drafts - len(accepted)
                req.num_computed_tokens -= cut
                end -= cut
                reason = None
                for i, token in enumerate(accepted):  # their KV is the step's: tokens first, then the commit
                    reason = self._append(req, token, entries[i] if entries is not None else None)
                    if reason is not None:
                        break
                if reason is not None:
                    self.cache.commit(req.cache_req, min(end, req.num_tokens))
                    req.status = Status.FINISHED
                    req.finish_reason = reason
                    finished.append(req)
                    continue
            self.cache.commit(req.cache_req, end)
            if req.step_prompt_logprobs is not None:
                _take_prompt_logprobs(req)
            if not s.samples:
                continue
            if req.handoff_stop is not None:  # its handed-off first token already ended it
                req.status = Status.FINISHED
                req.finish_reason = req.handoff_stop
                finished.append(req)
                continue
            reason = self._append(req, sampled[req.request_id])
            if reason is not None:
                req.status = Status.FINISHED
                req.finish_reason = reason
                finished.append(req)
        if finished:
            done = {id(r) for r in finished}
            self.running = [r for r in self.running if id(r) not in done]
        if self.draining:
            self._free_drained()
        return finished

    def _append(self, req: Request, token: int, entry: dict[int, float] | None = None) -> str | None:
        """A token the step gave ``req``: appended with its logprobs (``entry``, else the step's
        last); why it ends, if it does."""
        if not req.output_token_ids:
            req.metrics["first_token"] = time.monotonic()
        req.all_token_ids.append(token)
        req.output_token_ids.append(token)
        self.num_generated_tokens += 1
        if req.logprobs is not None:
            if entry is None:
                entry, req.step_logprobs = req.step_logprobs, None
            assert entry is not None  # the step computed them (params.logprobs)
            req.logprobs.append(entry)
        return self._stop_reason(req, token)

    def drop(self, out: SchedulerOutput) -> None:
        """A launched step whose results will never come (it failed): nothing of it is pending."""
        for s in out.scheduled:
            s.request.num_pending -= s.samples
        self._free_drained()

    def _free_drained(self) -> None:
        for req in [r for r in self.draining if not r.num_pending]:
            self.draining.remove(req)
            self.cache.free(req.cache_req)

    def release(self, req: Request) -> None:
        """Return a finished request's blocks; if a step in flight still computes for it (its
        token there is dropped), once that step's results are in (:meth:`update`): until then
        its slots are written and its routing rows are on their way to them."""
        if req.num_pending:
            self.draining.append(req)
        else:
            self.cache.free(req.cache_req)

    def abort(self, request_id: str) -> Request | None:
        for queue in (self.running, self.waiting):
            for req in list(queue):
                if req.request_id == request_id:
                    queue.remove(req)
                    req.status = Status.FINISHED
                    req.finish_reason = "abort"
                    self.release(req)
                    return req
        return None

    def stop_reason(self, req: Request, token: int) -> str | None:
        """Would ``token``, just appended to ``req``, end it? ("stop" | "length" | None)"""
        return self._stop_reason(req, token)

    def _stop_reason(self, req: Request, token: int) -> str | None:
        p = req.params
        if not p.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if token in p.stop_set:
            return "stop"
        if req.stop_strings is not None and req.stop_strings.push(token, len(req.output_token_ids)):
            return "stop"
        if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None


def _take_prompt_logprobs(req: Request) -> None:
    """Append the prompt logprobs the step computed past those the request has (a request
    recomputed after a preemption scores again what it scored before)."""
    step, kept = req.step_prompt_logprobs, req.prompt_logprobs
    assert step is not None and kept is not None  # (a request that asked for them, scored by the step)
    first, entries = step
    req.step_prompt_logprobs = None
    have = len(kept)
    if first <= have:
        kept.extend(entries[have - first :])
