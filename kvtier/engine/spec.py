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

After the verification (one host sync), the MTP block runs over every row of the step (its KV at
each position: ``hidden[i]`` of the target and the token at ``i+1``; module docstring of
model/families.py) and drafts the next token of each request that goes on from its last accepted
row; for k > 1 it runs k-1 more single-row passes, each on its own last output, chained on the
device and replayed from a CUDA graph (engine/draft_graphs.py; one host sync reads every draft
of the step, after the last pass). Those passes write
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


class Speculator:
    def __init__(self, num_speculative_tokens: int) -> None:
        self.k = num_speculative_tokens
        self.drafter: Drafter | None = None
        self.chain: DraftGraphs | None = None  # drafts 2..k (the engine builds it when k > 1)
        self.num_drafted = 0  # drafts verified
        self.num_accepted = 0  # of which accepted
        self.accepted_at = [0] * num_speculative_tokens  # accepted drafts by place (1st, 2nd, ...)
        self.num_mtp_rows = 0  # positions the MTP block ran over (draft passes included)
        self.num_mtp_prompt_rows = 0  # of which prompt positions (0 for a prompt's cached prefix)

    def stats(self) -> dict:
        return {
            "num_speculative_tokens": self.k,
            "drafted": self.num_drafted,
            "accepted": self.num_accepted,
            "acceptance_rate": self.num_accepted / self.num_drafted if self.num_drafted else None,
            "accepted_at": list(self.accepted_at),
            "mtp_rows": self.num_mtp_rows,
            "mtp_prompt_rows": self.num_mtp_prompt_rows,
        }

    def execute(
        self, runner: ModelRunner, out: SchedulerOutput, start_loads: Callable[[str], LoadWaits | None] | None
    ) -> StepResult:
        """The step: target forward, verification, MTP passes; its results are on the host when
        this returns (``StepResult.done``), each request's accepted drafts in ``step_accepted``."""
        from kvtier.engine.runner import StepResult

        model, device = runner.model, runner.device
        host = runner.build_inputs(out)
        inputs, hidden = runner.forward(host, start_loads)
        # the verify rows: each sampling request's last 1 + num_drafts rows
        spans: list[tuple[Request, int, int, list[int]]] = []  # (request, first row, rows, drafts)
        row = 0
        for s in out.scheduled:
            row += s.num_tokens
            if s.samples:
                n = 1 + s.num_drafts
                spans.append((s.request, row - n, n, s.request.draft_tokens[: s.num_drafts]))
        sampled: dict[str, int] = {}
        last_row: dict[int, int] = {}  # id(request) -> the row of its last accepted position
        if spans:
            rows = [first + j for _, first, n, _ in spans for j in range(n)]
            logits = model.compute_logits(hidden.index_select(0, to_device(rows, device)))
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
            tokens_host = tokens.tolist()
            where = {r: i for i, r in enumerate(sampled_rows)}
            at = 0
            for req, first, n, drafts in spans:
                a, token = self._verify(req, drafts, tokens_host[at : at + n], processed, [where.get(at + j) for j in range(n)])
                if req.params.logprobs is not None:  # the target's, for every token it emits
                    entries = [
                        _entry(raw[at + j], logits[at + j], processed, where.get(at + j), req, t)
                        for j, t in enumerate([*drafts[:a], token])
                    ]
                    req.step_accepted_logprobs, req.step_logprobs = entries[:a], entries[a]
                at += n
                req.step_accepted = drafts[:a]
                sampled[req.request_id] = token
                last_row[id(req)] = first + a
                if drafts:
                    self.num_drafted += len(drafts)
                    self.num_accepted += a
                    for j in range(a):
                        self.accepted_at[j] += 1
        self._draft(runner, out, inputs, hidden, sampled, last_row, start_loads)
        return StepResult.done(sampled)

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

    def _draft(self, runner, out, inputs, hidden, sampled: dict[str, int], last_row: dict[int, int], start_loads) -> None:
        """The MTP passes: over every row of the step, then k-1 single rows per drafting request;
        sets ``draft_tokens`` of every request that sampled."""
        bs = runner.block_size
        next_ids: list[int] = []
        go: list[tuple[Request, int, int]] = []  # drafting: (request, row, position of that row)
        row = 0
        for s in out.scheduled:
            req = s.request
            start = req.num_computed_tokens  # (before advance(): this step's first position)
            known = req.all_token_ids
            accepted = req.step_accepted if s.num_drafts else None
            for j in range(s.num_tokens):
                pos = start + j
                if accepted is not None:  # a verify row: the token after it, if it was kept
                    a = len(accepted)
                    nxt = accepted[j] if j < a else (sampled[req.request_id] if j == a else 0)
                elif pos + 1 < len(known):
                    nxt = known[pos + 1]
                else:  # the last row of a chunk that sampled
                    nxt = sampled[req.request_id]
                next_ids.append(nxt)
                self.num_mtp_prompt_rows += pos < req.num_prompt_tokens
            if s.samples:
                req.draft_tokens = []
                r = last_row[id(req)]
                if not req.export:
                    go.append((req, r, start + r - row))
            row += s.num_tokens
        self.num_mtp_rows += len(next_ids)
        hook = start_loads("layers") if start_loads is not None else None  # (the step's loads, layer num_layers too)
        rows = [r for _, r, _ in go]
        positions = [q + 1 for _, _, q in go]
        tables = [req.cache_req.block_table for req, _, _ in go] if self.chain is not None else []
        if runner.peers is not None:  # every rank runs the same passes (engine/tp)
            runner.peers.draft(next_ids, rows, positions, tables)
        toks = draft_passes(runner, self.chain, inputs, hidden, hook, next_ids, rows, positions, tables)
        for n, (req, _, q) in enumerate(go):
            # draft t (t >= 1) came from the pass at position q + t: kept while that position's
            # slot is in the request's table (the scheduler allocates k - 1 ahead where it can)
            room = len(req.cache_req.block_table) * bs
            for t in range(self.k):
                if t and q + t >= room:
                    break
                self.num_mtp_rows += t > 0
                tok = toks[t][n]
                if self.drafter is not None:
                    tok = self.drafter(req, q + 2 + t, tok)
                req.draft_tokens.append(tok)


def draft_passes(
    runner: ModelRunner,
    chain: DraftGraphs | None,
    inputs: StepInputs,
    hidden: torch.Tensor,
    hook: LoadWaits | None,
    next_ids: list[int],
    rows: list[int],
    positions: list[int],
    tables: list[list[int]],
) -> list[list[int]]:
    """The MTP block's passes of a step, on this rank's shard (the same on every
    tensor-parallel rank: rank 0 plans them, :meth:`Speculator._draft`): over every row of the
    step (``next_ids``: the token after each), then for the drafting ``rows`` the first draft
    and, with ``tables``, the chain (``positions``: where its first pass writes). The drafts
    ``[k][len(rows)]`` (one host sync)."""
    model, device = runner.model, runner.device
    m = model.draft(to_device(next_ids, device), inputs.positions, hidden, runner.kv_caches, inputs.meta, hook)
    if not rows:
        return []
    cur = m.index_select(0, to_device(rows, device))
    first = model.draft_logits(cur).argmax(dim=-1)
    if chain is None or not tables:
        return [first.tolist()]
    # drafts 2..k: the chained passes (engine/draft_graphs.py), read with the first
    cap = chain.buckets[-1]
    parts = [
        chain.run(first[i : i + cap], positions[i : i + cap], cur[i : i + cap], tables[i : i + cap]).clone()
        for i in range(0, len(rows), cap)
    ]
    return torch.cat([first[None], torch.cat(parts, dim=1)]).tolist()
