"""Speculative decoding with the model's MTP block (``num_speculative_tokens=k``).

A request in decode that holds drafts ``d1..dk'`` (k' <= k, fewer near its end) is scheduled with
``1 + k'`` tokens: its last token and the drafts. One target forward scores all of them; row j's
logits give the target's distribution ``p_j`` at the position after row j::

    rows        last   d1    d2   ...  dk'
    verify      d1?    d2?   ...       (bonus)
    greedy      accept d_j while argmax p_{j-1} == d_j; then the target's own token
    sampled     accept d_j with probability p_{j-1}(d_j); on the first rejection draw from p_{j-1}
                without d_j (renormalized); if all are accepted, draw the bonus from p_k'

The drafts are deterministic (the MTP block's argmax), so the rejection rule above is exact: every
emitted token has the target's distribution (speculative sampling with a one-hot draft). Greedy
requests emit exactly the tokens they emit without drafts. ``p`` is the processed distribution
(temperature, top-k, top-p, min-p): the one the request samples from without drafts.

After the verification, the MTP block runs over every row of the step (its KV at each
position: ``hidden[i]`` of the target and the token at ``i+1``; module docstring of
model/families.py) and drafts the next token of each request that goes on from its last accepted
row; for k > 1 it runs k-1 more single-row passes, each on its own last output, chained on the
device and replayed from a CUDA graph (engine/draft_graphs.py). When every verifying request is
greedy the verification runs on the device too, and one host sync at the step's end reads the
acceptance and every draft; a sampled request's tokens are read first (its rejection rule).
Those passes write
the MTP layer's KV at positions past the accepted ones: the next step's target forward and MTP
pass rewrite them before anything reads them, and the scheduler rewinds ``num_computed_tokens``
to the accepted positions, so no rejected token's KV is ever committed to the prefix tree.

Penalties and ``min_tokens`` (which depend on each earlier token) apply to verify row j as if
the drafts before it had been generated (Penalties ``ahead``): row j's distribution is the one
the request would sample from after those tokens, so greedy and sampled verification stay exact
for them too. Logprobs are the target's: each emitted
token's verify row, raw or processed as the request asks. A prefix hit brings the MTP
KV of its blocks (layer ``num_layers`` of every block, on every tier): nothing of it is
recomputed (:attr:`Speculator.num_mtp_rows` counts the rows the MTP block ran). The MTP KV at a
block's last position was written with the token that followed it in the request that computed
it; a request that hits the block and continues otherwise drafts with that one key from another
continuation: a draft may be worse, an output never differs.

A request whose drafts are rarely accepted stops drafting (``min_acceptance``: its running
acceptance, halved toward each step's accepted share, under it) and drafts again once every
:data:`REST_STEPS` + 1 engine steps, the same steps for every resting request, to see whether it
should go on: its drafts cost a draft head and the
chain every step, worth it only if some are kept. Its steps without drafts still run the MTP
block over its row (the KV later drafts read). A step where no request verifies or makes drafts
is the runner's own (overlapped) step, with the MTP block over its rows after sampling
(:meth:`Speculator.mtp_rows`); the others run here, their results on the host when they return.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from kvtier.engine.request import Request
from kvtier.engine.sampling import draw, to_device, topk

if TYPE_CHECKING:
    from kvtier.engine.draft_graphs import DraftGraphs
    from kvtier.engine.runner import ModelRunner, StepInputs, StepResult
    from kvtier.engine.scheduler import SchedulerOutput
    from kvtier.transfer.engine import LoadWaits

# (request, position of the draft, the MTP block's proposal) -> the token proposed instead: a
# benchmark's controlled drafter (kvtier bench speculative); None: the MTP block's argmax. The
# chained passes run on the device with the block's own proposals: a drafter replaces what they
# propose, not what they are fed.
Drafter = Callable[[Request, int, int], int]


def _entry(
    raw: torch.Tensor, penalized: torch.Tensor, processed: torch.Tensor | None, prow: int | None, req: Request, token: int
) -> dict[int, float]:
    """A logprobs entry (outputs.py) from a verify row: the emitted token's logprob, then the
    row's top-k, of the raw distribution (``raw``: the model's logits) or,
    ``logprobs_mode="processed"``, the one sampled from (a greedy row's: the log-softmax of its
    ``penalized`` logits)."""
    p = req.params
    if p.logprobs_mode != "processed":
        lp = torch.log_softmax(raw.float(), dim=-1)
    elif prow is not None:
        assert processed is not None
        lp = processed[prow]
    else:
        lp = torch.log_softmax(penalized.float(), dim=-1)
    entry = {token: float(lp[token])}
    if p.logprobs:
        top = topk(lp[None], p.logprobs)
        entry.update(zip(top.indices[0].tolist(), top.values[0].tolist()))
    return entry


REST_STEPS = 16  # steps a request with too few drafts accepted decodes without, between tries


class Speculator:
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

    def execute(
        self,
        runner: ModelRunner,
        out: SchedulerOutput,
        start_loads: Callable[[str], LoadWaits | None] | None,
        drafting: set[int],
    ) -> StepResult:
        """The step: target forward, verification, MTP passes; its results are on the host when
        this returns (``StepResult.done``), each request's accepted drafts in ``step_accepted``.

        When every verifying request is greedy (and the engine is one rank), verification runs on
        the device too: the step's work is queued back to back and read with one host sync at
        its end. Otherwise the sampled tokens come to the host for the rejection rule first
        (:meth:`_verify`), and under tensor parallelism rank 0 sends the passes' plan to the others."""
        from kvtier.engine.runner import StepResult

        model, device = runner.model, runner.device
        host = runner.build_inputs(out)
        inputs, hidden = runner.forward(host, start_loads)
        plan = _Plan(out, drafting)
        spans = plan.spans
        logits = raw = processed = None
        where: dict[int, int] = {}
        if spans:
            logits = model.compute_logits(hidden.index_select(0, to_device(plan.verify_rows, device, torch.long)))
            params = [req.params for req, _, n, _ in spans for _ in range(n)]
            gens = [req.generator for req, _, n, _ in spans for _ in range(n)]
            sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
            raw = logits  # (raw logprobs are before penalties)
            penalized = [i for i, p in enumerate(params) if p.has_penalties]
            if penalized:  # row j of a request: as if its drafts before it were generated
                if any(params[i].logprobs is not None for i in penalized):
                    raw = logits.clone()
                ahead = [(req, drafts[:j]) for req, _, n, drafts in spans for j in range(n)]
                runner.penalties.apply(logits, penalized, [ahead[i][0] for i in penalized], [ahead[i][1] for i in penalized])
            tokens, processed = draw(logits, params, gens, processed_rows=sampled_rows)
            where = {r: i for i, r in enumerate(sampled_rows)}
            on_device = not sampled_rows and runner.peers is None
        else:
            tokens, on_device = torch.zeros(0, dtype=torch.long, device=device), runner.peers is None
        hook = start_loads("layers") if start_loads is not None else None  # (the step's loads, layer num_layers too)
        if on_device:
            accepted, after = plan.accept_on_device(tokens, device)
            next_ids, rows, positions = plan.draft_inputs_on_device(tokens, accepted, device)
            drafts = draft_passes(runner, self.chain, inputs, hidden, hook, next_ids, rows, positions, plan.tables(self.chain))
            n = len(spans)
            got = torch.cat([accepted, after, drafts.flatten()]).tolist()  # (the step's one host sync)
            results = list(zip(got[:n], got[n : 2 * n]))
            draft_rows = [got[2 * n + t * len(plan.go) : 2 * n + (t + 1) * len(plan.go)] for t in range(drafts.shape[0])]
        else:
            tokens_host = tokens.tolist()
            results = []
            for req, first, n, drafts_of in spans:
                at = plan.at[id(req)]
                prow = [where.get(at + j) for j in range(n)]
                results.append(self._verify(req, drafts_of, tokens_host[at : at + n], processed, prow))
            next_ids_h, rows_h, positions_h = plan.draft_inputs_on_host(results)
            tables = plan.tables(self.chain)
            if runner.peers is not None:  # every rank runs the same passes (engine/tp)
                runner.peers.draft(next_ids_h, rows_h, positions_h, tables)
            next_ids, rows, positions = (to_device(v, device, torch.long) for v in (next_ids_h, rows_h, positions_h))
            drafts = draft_passes(runner, self.chain, inputs, hidden, hook, next_ids, rows, positions, tables)
            draft_rows = drafts.tolist()
        self.num_mtp_rows += plan.num_rows
        self.num_mtp_prompt_rows += plan.num_prompt_rows
        sampled: dict[str, int] = {}
        # what Scheduler.update takes from each request, set when the step's results are taken
        # (StepResult.collect): a step launched under overlap scheduling is finished first
        taken: list[tuple[Request, list[int], list | None, dict | None]] = []
        for (req, _, n, drafts_of), (a, token) in zip(spans, results):
            at = plan.at[id(req)]
            entries = None
            if req.params.logprobs is not None:  # the target's, for every token it emits
                assert raw is not None and logits is not None
                entries = [
                    _entry(raw[at + j], logits[at + j], processed, where.get(at + j), req, t)
                    for j, t in enumerate([*drafts_of[:a], token])
                ]
            taken.append((req, drafts_of[:a], entries[:a] if entries else None, entries[a] if entries else None))
            sampled[req.request_id] = token
            req.draft_tokens = []
            if drafts_of:
                req.draft_acceptance = 0.5 * req.draft_acceptance + 0.5 * a / len(drafts_of)
                self.num_drafted += len(drafts_of)
                self.num_accepted += a
                self.num_verified += 1
                for j in range(a):
                    self.accepted_at[j] += 1
        self._keep_drafts(runner, plan, results, draft_rows)
        prompt = runner.prompt_logprobs_step(out, hidden)  # (requests that asked for them)

        def take() -> None:
            for req, accepted, accepted_entries, entry in taken:
                req.step_accepted, req.step_accepted_logprobs = accepted, accepted_entries
                if entry is not None:
                    req.step_logprobs = entry
            if prompt is not None:
                prompt.collect()

        return StepResult.done(sampled, take)

    def _verify(
        self, req: Request, drafts: list[int], tokens: list[int], processed: torch.Tensor | None, prow: list[int | None]
    ) -> tuple[int, int]:
        """(drafts accepted, the token after them) for one request (module docstring)."""
        if req.params.greedy:
            a = 0
            while a < len(drafts) and tokens[a] == drafts[a]:
                a += 1
            return a, tokens[a]
        assert processed is not None
        if not drafts:
            return 0, tokens[0]
        gen = req.generator
        dev = processed.device
        rows = [prow[j] for j in range(len(drafts))]
        assert None not in rows
        p = processed[torch.tensor(rows, device=dev)].double().exp()  # [k', vocab]
        kept = p.gather(1, torch.tensor(drafts, device=dev)[:, None])[:, 0]
        u = torch.rand(len(drafts), generator=gen, device=dev, dtype=torch.float64)
        for j, ok in enumerate((u < kept).tolist()):  # (one sync for all of the request's drafts)
            if ok:
                continue
            r = p[j]
            r[drafts[j]] = 0.0  # the draft's share goes to the others
            if float(r.sum()) <= 0.0:  # (the draft held all the mass: it could not be rejected)
                continue
            return j, int(torch.multinomial(r / r.sum(), 1, generator=gen).item())
        return len(drafts), tokens[len(drafts)]

    def mtp_rows(
        self, runner: ModelRunner, out: SchedulerOutput, inputs: StepInputs, hidden: torch.Tensor, tokens: torch.Tensor, hook
    ) -> None:
        """A step with no draft to verify or make (runner.execute's own path, overlapped): the MTP
        block over its rows only, for the KV later drafts read, fed on the device (a sampling
        row's next token is the one just sampled, ``tokens`` in scheduled order)."""
        plan = _Plan(out, set())
        for s in out.scheduled:  # (drafts a step scheduled without are not for the next one)
            if s.samples:
                s.request.draft_tokens = []
        next_ids, rows, positions = plan.draft_inputs_on_device(tokens, tokens[:0], runner.device)
        draft_passes(runner, None, inputs, hidden, hook, next_ids, rows, positions, [])
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

    def _keep_drafts(self, runner, plan: _Plan, results: list[tuple[int, int]], draft_rows: list[list[int]]) -> None:
        """Each drafting request's ``draft_tokens`` from the passes' drafts ``[k][drafting]``."""
        bs = runner.block_size
        for n, (req, i) in enumerate(plan.go):
            q = plan.first_pos[i] + results[i][0]  # its last accepted position
            # draft t (t >= 1) came from the pass at position q + t: kept while that position's
            # slot is in the request's table (the scheduler allocates k - 1 ahead where it can)
            room = len(req.cache_req.block_table) * bs
            for t in range(len(draft_rows)):
                if t and q + t >= room:
                    break
                self.num_mtp_rows += t > 0
                tok = draft_rows[t][n]
                if self.drafter is not None:
                    tok = self.drafter(req, q + 2 + t, tok)
                req.draft_tokens.append(tok)


class _Plan:
    """What a step's verification and MTP passes need from the host, known before the forward
    ends: each sampling request's verify span (its last 1 + drafts rows), and for every row of
    the step the token after it where the prompt already says (verified rows get theirs from
    the verification: a kept draft, then the emitted token; rows past it are rewritten before
    anything reads them)."""

    def __init__(self, out: SchedulerOutput, drafting: set[int]) -> None:
        self.spans: list[tuple[Request, int, int, list[int]]] = []  # (request, first row, rows, drafts)
        self.at: dict[int, int] = {}  # id(request) -> its first verify row among all verify rows
        self.verify_rows: list[int] = []  # the verify rows' rows in the step
        self.first_pos: list[int] = []  # per span: the position of its first row
        self.go: list[tuple[Request, int]] = []  # drafting requests: (request, its span)
        self.next_known: list[int] = []  # per step row: the token after it (0 on verify rows)
        self.num_rows = 0
        self.num_prompt_rows = 0
        row = 0
        for s in out.scheduled:
            req = s.request
            start = req.num_computed_tokens  # (before advance(): this step's first position)
            known = req.all_token_ids
            n = 1 + s.num_drafts if s.samples else 0
            self.next_known += known[start + 1 : start + s.num_tokens - n + 1]
            self.next_known += [0] * n
            assert len(self.next_known) == row + s.num_tokens, "a chunk's rows past the known tokens"
            self.num_prompt_rows += max(0, min(start + s.num_tokens, req.num_prompt_tokens) - start)
            if n:
                first = row + s.num_tokens - n
                self.at[id(req)] = len(self.verify_rows)
                self.verify_rows.extend(range(first, first + n))
                self.first_pos.append(start + s.num_tokens - n)
                if id(req) in drafting:
                    self.go.append((req, len(self.spans)))
                self.spans.append((req, first, n, req.draft_tokens[: s.num_drafts]))
            row += s.num_tokens
        self.num_rows = row

    def tables(self, chain: DraftGraphs | None) -> list[list[int]]:
        return [req.cache_req.block_table for req, _ in self.go] if chain is not None else []

    def accept_on_device(self, tokens: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy verification on the device: per span, the drafts accepted (while the target's
        argmax at row j equals draft j+1) and the token after them (the argmax there)."""
        if not self.spans:
            return torch.zeros(0, dtype=torch.long, device=device), torch.zeros(0, dtype=torch.long, device=device)
        width = max(n for _, _, n, _ in self.spans)
        want = [[-1] * width for _ in self.spans]  # the draft row j must have produced; -1 never matches
        index = [[0] * width for _ in self.spans]
        for i, (req, _, n, drafts) in enumerate(self.spans):
            at = self.at[id(req)]
            want[i][: len(drafts)] = drafts
            index[i] = [at + min(j, n - 1) for j in range(width)]
        idx = to_device(index, device, torch.long)
        match = tokens[idx] == to_device(want, device, torch.long)
        accepted = match.long().cumprod(dim=1).sum(dim=1)
        after = tokens.gather(0, idx[:, 0] + accepted)
        return accepted, after

    def draft_inputs_on_device(
        self, tokens: torch.Tensor, accepted: torch.Tensor, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The MTP passes' inputs (as :meth:`draft_inputs_on_host`) from a greedy verification
        on the device: a verify row's next token is the target's argmax there (row j < a: the
        draft it kept, which equals it; row a: the emitted token; past a: rewritten later)."""
        next_ids = to_device(self.next_known, device, torch.long)
        if self.verify_rows:
            next_ids[to_device(self.verify_rows, device, torch.long)] = tokens
        spans = to_device([i for _, i in self.go], device, torch.long)
        kept = accepted[spans]
        rows = to_device([self.spans[i][1] for _, i in self.go], device, torch.long) + kept
        positions = to_device([self.first_pos[i] for _, i in self.go], device, torch.long) + kept + 1
        return next_ids, rows, positions

    def draft_inputs_on_host(self, results: list[tuple[int, int]]) -> tuple[list[int], list[int], list[int]]:
        """The MTP passes' inputs from the verification's ``(accepted, token)`` per span: the
        token after every row of the step, and per drafting request its last accepted row and
        the position after it (where the chain's first pass writes)."""
        next_ids = list(self.next_known)
        for (_, first, n, drafts), (a, token) in zip(self.spans, results):
            next_ids[first : first + n] = [*drafts[:a], token] + [0] * (n - a - 1)
        rows = [self.spans[i][1] + results[i][0] for _, i in self.go]
        positions = [self.first_pos[i] + results[i][0] + 1 for _, i in self.go]
        return next_ids, rows, positions


def draft_passes(
    runner: ModelRunner,
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
    tensor-parallel rank: rank 0 plans them, :meth:`Speculator.execute`): over every row of the
    step (``next_ids``: the token after each), then for the drafting ``rows`` the first draft
    and, with ``tables``, the chain (``positions``: where its first pass writes). The drafts
    ``[k, len(rows)]``, on the device (no host sync: the caller reads them with the rest)."""
    model = runner.model
    m = model.draft(next_ids, inputs.positions, hidden, runner.kv_caches, inputs.meta, hook)
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
