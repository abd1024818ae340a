"""Speculative decoding: which drafts a step keeps (the drafts themselves: engine/spec.py).

A request in decode that holds drafts ``d1..dk'`` (k' <= k, fewer near its end) is scheduled with
``1 + k'`` tokens: its last token and the drafts. One target forward scores all of them; row j's
logits give the target's distribution ``p_j`` at the position after row j (the rows are sampled
as any step's, engine/sample_step.py, row j's penalties counting ``d1..dj`` as generated)::

    rows        last   d1    d2   ...  dk'
    verify      d1?    d2?   ...       (bonus)
    greedy      accept d_j while argmax p_{j-1} == d_j; then the target's own token
    sampled     accept d_j with probability p_{j-1}(d_j); on the first rejection draw from p_{j-1}
                without d_j (renormalized); if all are accepted, draw the bonus from p_k'

The drafts are deterministic (the MTP block's argmax), so the rejection rule above is exact: every
emitted token has the target's distribution (speculative sampling with a one-hot draft). Greedy
requests emit exactly the tokens they emit without drafts. ``p`` is the processed distribution
(penalties, temperature, top-k, top-p, min-p): the one the request samples from without drafts.

Penalties and ``min_tokens`` (which depend on each earlier token) apply to verify row j as if
``d1..dj`` had been generated (Penalties ``ahead``): row j's distribution is the one the request
would sample from after those tokens, so greedy and sampled verification stay exact for them too.
Logprobs are the target's: each emitted token's verify row, raw or processed as the request asks.

When every verifying request is greedy, :meth:`Verification.accept_on_device` compares the
target's argmax with the drafts on the device (no host sync: the MTP passes are fed from it);
a sampled request's rule draws on its generator, on the host (:func:`accept`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from kvtier.engine.request import Request
from kvtier.engine.sampling import to_device

if TYPE_CHECKING:
    from kvtier.engine.sample_step import SampledRows
    from kvtier.engine.scheduler import SchedulerOutput


@dataclass(slots=True)
class Span:
    """One sampling request's verify rows: its last token, then the drafts after it."""

    req: Request
    row: int  # its first row in the step
    at: int  # its first row among the step's verify rows (the rows sampled)
    position: int  # the position of its first row
    drafts: list[int]  # the drafts it verifies (none: a step that only samples its last token)

    @property
    def num_rows(self) -> int:
        return 1 + len(self.drafts)


class Verdict(NamedTuple):
    """A request's verification: the drafts kept, and the token after them."""

    num_accepted: int
    token: int


class Verification:
    """A step's verify rows, by request (:class:`Span`), and the rule that accepts their drafts
    (module docstring)."""

    def __init__(self, out: SchedulerOutput) -> None:
        self.spans: list[Span] = []
        self.rows: list[int] = []  # the verify rows' rows in the step (the logits sampled)
        row = 0
        for s in out.scheduled:
            if s.samples:
                req = s.request
                n = 1 + s.num_drafts
                first = row + s.num_tokens - n
                position = req.num_computed_tokens + s.num_tokens - n  # (before advance(): this step's)
                self.spans.append(Span(req, first, len(self.rows), position, req.draft_tokens[: s.num_drafts]))
                self.rows.extend(range(first, first + n))
            row += s.num_tokens
        # per verify row: its request, and the drafts before it (its penalties count them as generated)
        self.requests = [span.req for span in self.spans for _ in range(span.num_rows)]
        self.ahead = [span.drafts[:j] for span in self.spans for j in range(span.num_rows)]
        # the verify rows of sampled (not greedy) requests: their rule reads ``p``
        self.sampled_rows = [span.at + j for span in self.spans if not span.req.params.greedy for j in range(span.num_rows)]

    def accept_on_device(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy verification on the device, ``tokens`` the argmax at each verify row: per span,
        the drafts accepted (while the target's argmax at row j equals draft j+1) and the token
        after them (the argmax there)."""
        device = tokens.device
        if not self.spans:
            return torch.zeros(0, dtype=torch.long, device=device), torch.zeros(0, dtype=torch.long, device=device)
        width = max(span.num_rows for span in self.spans)
        want = [[-1] * width for _ in self.spans]  # the draft row j must have produced; -1 never matches
        index = [[0] * width for _ in self.spans]
        for i, span in enumerate(self.spans):
            want[i][: len(span.drafts)] = span.drafts
            index[i] = [span.at + min(j, span.num_rows - 1) for j in range(width)]
        idx = to_device(index, device, torch.long)
        match = tokens[idx] == to_device(want, device, torch.long)
        accepted = match.long().cumprod(dim=1).sum(dim=1)
        after = tokens.gather(0, idx[:, 0] + accepted)
        return accepted, after

    def accept_on_host(self, tokens: list[int], sampled: SampledRows) -> list[Verdict]:
        """Each span's :func:`accept`, ``tokens`` those drawn at the verify rows."""
        verdicts = []
        for span in self.spans:
            n = span.num_rows
            processed = None if span.req.params.greedy else sampled.processed_of(span.at, n)
            verdicts.append(accept(span.req, span.drafts, tokens[span.at : span.at + n], processed))
        return verdicts


def accept(req: Request, drafts: list[int], tokens: list[int], processed: torch.Tensor | None) -> Verdict:
    """One request's verification (module docstring): ``tokens`` drawn at its rows (its last
    token's, then each draft's), ``processed`` the log of the distributions they were drawn
    from ([rows, vocab]; a sampled request's, None for a greedy one)."""
    if req.params.greedy:
        a = 0
        while a < len(drafts) and tokens[a] == drafts[a]:
            a += 1
        return Verdict(a, tokens[a])
    assert processed is not None
    if not drafts:
        return Verdict(0, tokens[0])
    gen = req.generator
    dev = processed.device
    p = processed[: len(drafts)].double().exp()  # [k', vocab] (a copy)
    kept = p.gather(1, torch.tensor(drafts, device=dev)[:, None])[:, 0]
    u = torch.rand(len(drafts), generator=gen, device=dev, dtype=torch.float64)
    for j, ok in enumerate((u < kept).tolist()):  # (one sync for all of the request's drafts)
        if ok:
            continue
        r = p[j]
        r[drafts[j]] = 0.0  # the draft's share goes to the others
        if float(r.sum()) <= 0.0:  # (the draft held all the mass: it could not be rejected)
            continue
        return Verdict(j, int(torch.multinomial(r / r.sum(), 1, generator=gen).item()))
    return Verdict(len(drafts), tokens[len(drafts)])
