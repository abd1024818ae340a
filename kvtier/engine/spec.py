"""Speculative decoding with the model's MTP block (``num_speculative_tokens=k``): the drafts.

A step's verify rows and which drafts it keeps: engine/verify.py; the step itself (the target
forward, the sampling shared with plain steps, the verification, then the passes here):
``ModelRunner`` (engine/runner.py)::

    target forward ─ sample the verify rows ─ verify ─ MTP pass over every row ─ draft head ─ k-1 chained passes
                     (engine/sample_step.py)  (verify.py)  (draft_passes, here)                 (engine/draft_graphs.py)

After the verification, the MTP block runs over every row of the step (its KV at each
position: ``hidden[i]`` of the target and the token at ``i+1``; module docstring of
model/families.py) and drafts the next token of each request that goes on from its last accepted
row; for k > 1 it runs k-1 more single-row passes, each on its own last output, chained on the
device and replayed from a CUDA graph (engine/draft_graphs.py). When every verifying request is
greedy the verification runs on the device too, and one host sync at the step's end reads the
acceptance and every draft (:class:`DraftPlan` feeds the passes from either). Those passes write
the MTP layer's KV at positions past the accepted ones: the next step's target forward and MTP
pass rewrite them before anything reads them, and the scheduler rewinds ``num_computed_tokens``
to the accepted positions, so no rejected token's KV is ever committed to the prefix tree.

A prefix hit brings the MTP KV of its blocks (layer ``num_layers`` of every block, on every
tier): nothing of it is recomputed (:attr:`Speculator.num_mtp_rows` counts the rows the MTP block
ran). The MTP KV at a block's last position was written with the token that followed it in the
request that computed it; a request that hits the block and continues otherwise drafts with that
one key from another continuation: a draft may be worse, an output never differs.

A request whose drafts are rarely accepted stops drafting (``min_acceptance``: its running
acceptance, halved toward each step's accepted share, under it) and drafts again once every
:data:`REST_STEPS` + 1 engine steps, the same steps for every resting request, to see whether it
should go on: its drafts cost a draft head and the
chain every step, worth it only if some are kept. Its steps without drafts still run the MTP
block over its row (the KV later drafts read). A step where no request verifies or makes drafts
is the runner's plain (overlapped) step, with the MTP block over its rows after sampling
(:meth:`Speculator.mtp_rows`); the others are the runner's drafted steps, their results on the
host when they return.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from kvtier.engine.request import Request
from kvtier.engine.sampling import to_device
from kvtier.engine.verify import Span, Verdict, Verification

if TYPE_CHECKING:
    from kvtier.engine.draft_graphs import DraftGraphs
    from kvtier.engine.scheduler import SchedulerOutput
    from kvtier.engine.step_inputs import StepInputs
    from kvtier.model.families import CausalLM
    from kvtier.transfer.engine import LoadWaits

# (request, position of the draft, the MTP block's proposal) -> the token proposed instead: a
# benchmark's controlled drafter (kvtier bench speculative); None: the MTP block's argmax. The
# chained passes run on the device with the block's own proposals: a drafter replaces what they
# propose, not what they are fed.
Drafter = Callable[[Request, int, int], int]

REST_STEPS = 16  # steps a request with too few drafts accepted decodes without, between tries


class Speculator:
    """Which requests draft at a step, the MTP block's passes that draft, each request's drafts
    for its next step, and the counters of what was drafted and accepted (module docstring)."""

    def __init__(self, num_speculative_tokens: int, min_acceptance: float = 0.0) -> None:
        self.k = num_speculative_tokens
        self.min_acceptance = min_acceptance  # (module docstring: when a request stops drafting)
        self.drafter: Drafter | None = None
        self.chain: DraftGraphs | None = None  # drafts 2..k (the engine builds it when k > 1)
        self.num_drafted = 0  # drafts verified
        self.num_accepted = 0  # of which accepted
        self.num_verified = 0  # a request's steps that verified drafts
        self.accepted_at = [0] * num_speculative_tokens  # accepted drafts by place (1st, 2nd, ...)
        self.num_mtp_rows = 0  # positions the MTP block ran over (draft passes included)
        self.num_mtp_prompt_rows = 0  # of which prompt positions (0 for a prompt's cached prefix)
        self.num_rested = 0  # a request's steps without drafts: its acceptance was under the minimum
        self.num_steps = 0  # steps run (the resting requests' tries fall on the same ones)

    def stats(self) -> dict:
        return {
            "num_speculative_tokens": self.k,
            "drafted": self.num_drafted,
            "accepted": self.num_accepted,
            "acceptance_rate": self.num_accepted / self.num_drafted if self.num_drafted else None,
            "verified_steps": self.num_verified,
            "accepted_at": list(self.accepted_at),
            "mtp_rows": self.num_mtp_rows,
            "mtp_prompt_rows": self.num_mtp_prompt_rows,
            "rested_steps": self.num_rested,
        }

    def new_step(self) -> None:
        """An engine step begins (its forwards, several if a batch is retried request by request)."""
        self.num_steps += 1

    def drafting(self, out: SchedulerOutput) -> set[int]:
        """The requests (ids) that draft at this step (once per step: it counts their rests)."""
        return {id(s.request) for s in out.scheduled if s.samples and not s.request.export and self._drafts_now(s.request)}

    def propose(
        self,
        model: CausalLM,
        kv_caches: list[torch.Tensor],
        plan: DraftPlan,
        inputs: StepInputs,
        hidden: torch.Tensor,
        hook: LoadWaits | None,
        next_ids: torch.Tensor,
        rows: torch.Tensor,
        positions: torch.Tensor,
    ) -> torch.Tensor:
        """A drafted step's MTP passes (:func:`draft_passes` with the chain), fed as ``plan``
        says from the verification; the drafts ``[k, drafting requests]`` on the device."""
        self.num_mtp_rows += plan.num_rows
        self.num_mtp_prompt_rows += plan.num_prompt_rows
        return draft_passes(
            model, kv_caches, self.chain, inputs, hidden, hook, next_ids, rows, positions, plan.tables(self.chain)
        )

    def update(self, plan: DraftPlan, verdicts: list[Verdict], draft_rows: list[list[int]], block_size: int) -> None:
        """After a drafted step: each request's acceptance counted, each drafting request's
        ``draft_tokens`` from the passes' drafts ``[k][drafting]`` (the others': none)."""
        for span, (a, _) in zip(plan.spans, verdicts):
            req = span.req
            req.draft_tokens = []
            if span.drafts:
                req.draft_acceptance = 0.5 * req.draft_acceptance + 0.5 * a / len(span.drafts)
                self.num_drafted += len(span.drafts)
                self.num_accepted += a
                self.num_verified += 1
                for j in range(a):
                    self.accepted_at[j] += 1
        for n, i in enumerate(plan.go):
            req = plan.spans[i].req
            q = plan.spans[i].position + verdicts[i].num_accepted  # its last accepted position
            # draft t (t >= 1) came from the pass at position q + t: kept while that position's
            # slot is in the request's table (the scheduler allocates k - 1 ahead where it can)
            room = len(req.cache_req.block_table) * block_size
            for t in range(len(draft_rows)):
                if t and q + t >= room:
                    break
                self.num_mtp_rows += t > 0
                tok = draft_rows[t][n]
                if self.drafter is not None:
                    tok = self.drafter(req, q + 2 + t, tok)
                req.draft_tokens.append(tok)

    def mtp_rows(
        self,
        model: CausalLM,
        kv_caches: list[torch.Tensor],
        out: SchedulerOutput,
        inputs: StepInputs,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        hook: LoadWaits | None,
    ) -> None:
        """A step with no draft to verify or make (the runner's plain step, overlapped): the MTP
        block over its rows only, for the KV later drafts read, fed on the device (a sampling
        row's next token is the one just sampled, ``tokens`` in scheduled order)."""
        plan = DraftPlan(out, set(), Verification(out).spans)
        for s in out.scheduled:  # (drafts a step scheduled without are not for the next one)
            if s.samples:
                s.request.draft_tokens = []
        next_ids, rows, positions = plan.draft_inputs_on_device(tokens, tokens[:0])
        draft_passes(model, kv_caches, None, inputs, hidden, hook, next_ids, rows, positions, [])
        self.num_mtp_rows += plan.num_rows
        self.num_mtp_prompt_rows += plan.num_prompt_rows

    def _drafts_now(self, req: Request) -> bool:
        """Whether ``req`` drafts at this step: while its drafts' running acceptance is at least
        ``min_acceptance``; under it, once every :data:`REST_STEPS` + 1 steps of the engine (to see
        whether it rose).
        A step without drafts still runs the MTP block over the request's row (its KV, for the
        drafts to come), but not the draft head nor the chain."""
        if req.draft_acceptance >= self.min_acceptance:
            return True
        # every resting request tries at the same steps: a step where one drafts is not
        # overlapped, so tries spread over the steps would leave few steps overlapped
        if self.num_steps % (REST_STEPS + 1):
            self.num_rested += 1
            return False
        return True


class DraftPlan:
    """What a step's MTP passes need from the host, known before the forward ends: for every row
    of the step the token after it where the prompt already says (verify rows get theirs from
    the verification: a kept draft, then the emitted token; rows past it are rewritten before
    anything reads them), and which verify spans (engine/verify.py) draft on."""

    def __init__(self, out: SchedulerOutput, drafting: set[int], spans: list[Span]) -> None:
        self.spans = spans
        self.go = [i for i, span in enumerate(spans) if id(span.req) in drafting]  # the drafting spans
        self.verify_rows = [span.row + j for span in spans for j in range(span.num_rows)]
        self.next_known: list[int] = []  # per step row: the token after it (0 on verify rows)
        self.num_prompt_rows = 0
        row = 0
        for s in out.scheduled:
            req = s.request
            start = req.num_computed_tokens  # (before advance(): this step's first position)
            n = 1 + s.num_drafts if s.samples else 0
            self.next_known += req.all_token_ids[start + 1 : start + s.num_tokens - n + 1]
            self.next_known += [0] * n
            assert len(self.next_known) == row + s.num_tokens, "a chunk's rows past the known tokens"
            self.num_prompt_rows += max(0, min(start + s.num_tokens, req.num_prompt_tokens) - start)
            row += s.num_tokens
        self.num_rows = row

    def tables(self, chain: DraftGraphs | None) -> list[list[int]]:
        return [self.spans[i].req.cache_req.block_table for i in self.go] if chain is not None else []

    def draft_inputs_on_device(
        self, tokens: torch.Tensor, accepted: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The MTP passes' inputs (as :meth:`draft_inputs_on_host`) from a greedy verification
        on the device (``tokens``: the argmax at each verify row; ``accepted``: per span,
        Verification.accept_on_device): a verify row's next token is the target's argmax there
        (row j < a: the draft it kept, which equals it; row a: the emitted token; past a:
        rewritten later)."""
        device = tokens.device
        next_ids = to_device(self.next_known, device, torch.long)
        if self.verify_rows:
            next_ids[to_device(self.verify_rows, device, torch.long)] = tokens
        kept = accepted[to_device(self.go, device, torch.long)]
        rows = to_device([self.spans[i].row for i in self.go], device, torch.long) + kept
        positions = to_device([self.spans[i].position for i in self.go], device, torch.long) + kept + 1
        return next_ids, rows, positions

    def draft_inputs_on_host(self, verdicts: list[Verdict]) -> tuple[list[int], list[int], list[int]]:
        """The MTP passes' inputs from each span's verdict: the token after every row of the
        step, and per drafting request its last accepted row and the position after it (where
        the chain's first pass writes)."""
        next_ids = list(self.next_known)
        for span, (a, token) in zip(self.spans, verdicts):
            next_ids[span.row : span.row + span.num_rows] = [*span.drafts[:a], token] + [0] * (span.num_rows - a - 1)
        rows = [self.spans[i].row + verdicts[i].num_accepted for i in self.go]
        positions = [self.spans[i].position + verdicts[i].num_accepted + 1 for i in self.go]
        return next_ids, rows, positions


def draft_passes(
    model: CausalLM,
    kv_caches: list[torch.Tensor],
    chain: DraftGraphs | None,
    inputs: StepInputs,
    hidden: torch.Tensor,
    hook: LoadWaits | None,
    next_ids: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    tables: list[list[int]],
) -> torch.Tensor:
    """The MTP block's passes of a step, on this rank's shard (the same on every
    tensor-parallel rank: rank 0 plans them, ``ModelRunner``'s drafted step): over every row of
    the step (``next_ids``: the token after each), then for the drafting ``rows`` the first draft
    and, with ``tables``, the chain (``positions``: where its first pass writes). The drafts
    ``[k, len(rows)]``, on the device (no host sync: the caller reads them with the rest)."""
    m = model.draft(next_ids, inputs.positions, hidden, kv_caches, inputs.meta, hook)
    if not rows.numel():
        return rows.new_zeros(1, 0)
    cur = m.index_select(0, rows)
    first = model.draft_logits(cur).argmax(dim=-1)
    if chain is None or not tables:
        return first[None]
    # drafts 2..k: the chained passes (engine/draft_graphs.py)
    cap = chain.buckets[-1]
    parts = [
        chain.run(first[i : i + cap], positions[i : i + cap], cur[i : i + cap], tables[i : i + cap]).clone()
        for i in range(0, len(tables), cap)
    ]
    return torch.cat([first[None], torch.cat(parts, dim=1)])
