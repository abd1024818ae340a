"""``n > 1`` samples per prompt (``SamplingParams.n``, GRPO-style groups): one prefill, n decodes.

::

    add_request(prompt, n=4) ─► sample 0: the request itself (its id, generator seed+0)
        prefill ─► first token sampled, the prompt's full blocks committed to the tree
        └─► fork: samples 1..3 queued at the FRONT of the waiting queue (ids
            "kvtier-auto-<id>#<i>", generators seed+i, same prompt and params, and the
            request's owner and priority: they take the request's turns, engine/scheduler.py)
    samples 1..3: the prompt's full blocks match as device hits (locked, shared, never copied);
        each computes only the tokens of the prompt's last partial block (< block_size: that
        recompute is the "copy on write" of the partial block, exact and cheaper than a copy
        kernel), then decodes on its own blocks
    a sample that finishes: its CompletionOutput waits in the group (its blocks are freed)
    the last one ─► one RequestOutput, ``outputs`` sorted by index; the request-level fields
        (cached tokens, metrics, prompt_logprobs) are sample 0's: the prompt's

Prefix hits on any tier are shared the same way: sample 0 loads/fetches the prompt once, the
others find it on device. With ``enable_prefix_caching=False`` there is nothing to share: the
samples are queued with sample 0 and run as n independent requests. A PD hand-off
(``export``/``handoff``) of n > 1 samples is refused (ValueError): a manifest carries one
first token. ``abort(id)`` aborts every sample; a sample that fails (``error_kind="internal"``)
fails the request, its other samples aborted.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable

from kvtier.engine.checks import check_pd_samples
from kvtier.engine.outputs import CompletionOutput, RequestOutput
from kvtier.engine.request import Request

if TYPE_CHECKING:
    from kvtier.engine.scheduler import Scheduler


def check_n(req: Request) -> None:
    """ValueError if ``req`` asks for n > 1 samples where they cannot be served."""
    check_pd_samples(req.params.n, req.export, req.handoff is not None)


@dataclass(frozen=True, slots=True)
class SampleProgress:
    """What sample ``index`` of a request has so far: its tokens and their logprobs (live lists
    of a running sample, not copies), and its finish reason once it finished."""

    index: int
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None


@dataclass(eq=False)
class SampleGroup:
    """The samples of one request: ``samples[i]`` is sample i's Request (None until forked)."""

    head: Request  # sample 0, the request the user added
    samples: list[Request | None] = field(init=False)
    done: dict[int, CompletionOutput] = field(default_factory=dict)
    head_output: RequestOutput | None = None  # sample 0's own output
    forked: bool = False
    ended: bool = False  # its output is out, or it was aborted (SampleGroups.end)

    def __post_init__(self) -> None:
        self.samples = [self.head] + [None] * (self.head.params.n - 1)

    @property
    def request_id(self) -> str:
        return self.head.request_id

    @property
    def n(self) -> int:
        return len(self.samples)

    def sample_id(self, index: int, prefix: str) -> str:
        """Sample ``index``'s request id: ``prefix`` is reserved (users cannot pass ids starting
        with it) and ``#`` never occurs in the engine's own ids, so no id can collide."""
        return self.request_id if index == 0 else f"{prefix}{self.request_id}#{index}"

    def unfinished(self) -> list[Request]:
        """The samples forked and not finished (queued or running)."""
        return [r for i, r in enumerate(self.samples) if r is not None and i not in self.done]

    def finish(self, index: int, output: RequestOutput) -> RequestOutput | None:
        """Sample ``index`` finished with ``output`` (its own RequestOutput, one sample): the
        request's RequestOutput once every sample has, else None."""
        self.done[index] = replace(output.outputs[0], index=index)
        if index == 0:
            self.head_output = output
        if len(self.done) < self.n:
            return None
        out = self.head_output
        assert out is not None  # sample 0 is among the finished
        out.outputs = [self.done[i] for i in range(self.n)]  # token_ids etc. are outputs[0]'s already
        return out

    def fail(self, error_output: RequestOutput) -> RequestOutput:
        """The request failed: ``error_output`` is sample 0's error output (the request-level
        fields); every sample, finished or not, is reported with finish_reason "error" and the
        tokens it had, so that the request's fields stay ``outputs[0]``'s."""
        template = error_output.outputs[0]
        started = {p.index: (p.token_ids, p.logprobs) for p in self.progress()}
        outputs = []
        for i in range(self.n):
            toks, lps = started.get(i, ([], None))
            outputs.append(
                replace(
                    template,
                    index=i,
                    token_ids=list(toks),
                    text=None,
                    routed_experts=None,
                    logprobs=None if lps is None else list(lps),
                )
            )
        error_output.outputs = outputs
        error_output.token_ids = outputs[0].token_ids
        return error_output

    def progress(self) -> list[SampleProgress]:
        """Every sample started so far, by index."""
        rows: list[SampleProgress] = []
        for i, r in enumerate(self.samples):
            c = self.done.get(i)
            if c is not None:
                rows.append(SampleProgress(i, c.token_ids, c.logprobs, c.finish_reason))
            elif r is not None:
                rows.append(SampleProgress(i, r.output_token_ids, r.logprobs))
        return rows


class SampleGroups:
    """Every n > 1 request in the engine: the groups by the user's request id, and every
    sample's (sample 0's too) request id -> (its group, its index). ``make_sample(group, i)``
    makes sample i's Request (the engine's: validation, id, generator); the groups queue them on
    ``scheduler``."""

    def __init__(self, scheduler: Scheduler, make_sample: Callable[[SampleGroup, int], Request]) -> None:
        self.scheduler = scheduler
        self.make_sample = make_sample
        self.groups: dict[str, SampleGroup] = {}
        self.sample_of: dict[str, tuple[SampleGroup, int]] = {}

    def __bool__(self) -> bool:
        return bool(self.groups)

    def owns(self, request_id: str) -> bool:
        """A group holds ``request_id`` (until its last sample finished, even after sample 0 did)."""
        return request_id in self.groups

    def add(self, head: Request, fork_now: bool) -> None:
        """``head`` (queued already) asks for n > 1 samples. ``fork_now``: queue the others with
        it (no prefix caching: nothing to share, n independent requests)."""
        group = self.groups[head.request_id] = SampleGroup(head)
        self.sample_of[head.request_id] = (group, 0)
        if fork_now:
            self.fork(group, front=False)

    def fork(self, group: SampleGroup, front: bool = True) -> None:
        """Queue samples 1..n-1 of ``group``: sample 0 has sampled its first token, so the
        prompt's full blocks are in the tree. At the front of the queue: first of their owner's
        waiting requests, admitted as soon as its turns and its ``max_num_seqs_per_request``
        allow (engine/scheduler.py): while sample 0 runs it holds those blocks on device; once it
        finished they are cached like any others (an evicted one is a host hit or a recompute)."""
        for i in range(1, group.n):
            req = self.make_sample(group, i)
            group.samples[i] = req
            self.sample_of[req.request_id] = (group, i)
            self.scheduler.add(req)
        group.forked = True
        if front:
            self.scheduler.waiting.rotate(group.n - 1)  # the ones just added, in index order

    def fork_ready(self, scheduled: list[Request]) -> None:
        """After a step: fork every group whose sample 0 (among ``scheduled``) has its first token."""
        for req in scheduled:
            entry = self.sample_of.get(req.request_id)
            if entry is not None and not entry[0].forked and req.output_token_ids:
                self.fork(entry[0])

    def end(self, group: SampleGroup) -> None:
        """``group``'s request is answered or aborted: its id (and its samples') are free again."""
        group.ended = True
        self.groups.pop(group.request_id, None)
        for r in group.samples:
            if r is not None:
                self.sample_of.pop(r.request_id, None)

    def abort(self, request_id: str) -> bool | None:
        """Abort every sample of the request ``request_id`` belongs to (an internal sample id
        aborts its whole request); None if it is no sample of a group, else whether any ran."""
        entry = self.sample_of.get(request_id)
        if entry is None:
            return None
        group = entry[0]
        self.end(group)
        aborted = [self.scheduler.abort(r.request_id) for r in group.unfinished()]
        return any(r is not None for r in aborted)

    def progress(self, req: Request) -> list[SampleProgress]:
        """Every sample of ``req`` started so far (``req`` itself when it has no group)."""
        entry = self.sample_of.get(req.request_id)
        if entry is None or entry[0].head is not req:
            return [SampleProgress(0, req.output_token_ids, req.logprobs)]
        return entry[0].progress()

    def request_id_of(self, request_id: str) -> str:
        """The id of the request (as added) that the sample ``request_id`` belongs to: its own
        for a request without a group (n = 1)."""
        entry = self.sample_of.get(request_id)
        return request_id if entry is None else entry[0].request_id

    def fold(
        self, results: list[RequestOutput], error_output: Callable[[Request, str, str | None], RequestOutput]
    ) -> list[RequestOutput]:
        """A step's outputs with samples folded into their requests': a sample that finished
        waits in its group, the last one gives the request's output; one that failed fails the
        request: its other samples are aborted (their blocks returned), and
        ``error_output(head, error, error_kind)`` makes the request's error output."""
        if not self.sample_of:
            return results
        entries = [(o, self.sample_of.get(o.request_id)) for o in results]  # before groups end
        outs = []
        for o, entry in entries:
            if entry is None:
                outs.append(o)
                continue
            group, i = entry
            if group.ended:  # another sample of it failed in this step: answered
                continue
            if o.error is not None:
                self.end(group)
                for r in group.unfinished():
                    self.scheduler.abort(r.request_id)
                outs.append(group.fail(error_output(group.head, f"sample {i} of {group.n}: {o.error}", o.error_kind)))
                continue
            done = group.finish(i, o)
            if done is not None:
                self.end(group)
                outs.append(done)
        return outs
