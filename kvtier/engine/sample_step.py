"""One sampling step: the logits of a step's sampling rows to their tokens and logprobs, the
same for a plain step and a speculative one (engine/runner.py runs both)::

    logits [rows, vocab]  (the model's, float32)
        │─► raw logprobs: log_softmax, before anything else    (rows whose request asks "raw")
        ▼
    penalties and min_tokens, in place (Penalties.apply; a verify row counts the drafts before
        │   it as generated: ``ahead``)
        ▼
    draw: greedy, or temperature, top-k, min-p, top-p with each request's generator
        ├─► tokens [rows]                          (on the device: the caller moves them to the host)
        └─► processed logprobs: the log of the distribution each row was drawn from (rows whose
            request asks "processed", and those the caller names: the verifier's sampled rows)

A plain step has one row per sampling request, its last token; a speculative step has one per
verified position, its last token and each draft (engine/verify.py). What the request's fields
mean: engine/params.py; the sampler itself: engine/sampling.py.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Sequence

import torch

from kvtier.engine.request import Request
from kvtier.engine.sampling import Penalties, draw, to_device


@dataclass(slots=True)
class SampledRows:
    """What :func:`sample_rows` gives, on the device (nothing read to the host)."""

    tokens: torch.Tensor  # [rows] the token drawn at each row
    logprob_rows: list[int]  # the rows whose request asked for logprobs, ascending ...
    logprobs: torch.Tensor | None  # ... theirs [len(logprob_rows), vocab]: raw or processed, as each asks
    processed_rows: list[int]  # the rows of ``processed``, ascending
    processed: torch.Tensor | None  # [len(processed_rows), vocab] float32: the log of what each was drawn from

    def processed_of(self, first: int, n: int) -> torch.Tensor:
        """``processed`` of rows ``first .. first + n - 1`` (all among ``processed_rows``), a view."""
        at = bisect.bisect_left(self.processed_rows, first)
        if self.processed is None or self.processed_rows[at : at + n] != list(range(first, first + n)):
            raise ValueError(f"rows {first}..{first + n - 1} are not all among the processed rows {self.processed_rows}")
        return self.processed[at : at + n]


def sample_rows(
    logits: torch.Tensor,
    reqs: Sequence[Request],
    penalties: Penalties,
    ahead: Sequence[Sequence[int]] | None = None,
    processed_rows: Sequence[int] = (),
) -> SampledRows:
    """Row i of ``logits`` [rows, vocab] (penalized in place) drawn for ``reqs[i]`` (module
    docstring). ``ahead[i]``: the tokens taken as generated after the request's output before
    row i (a verify row: the drafts before it; None: none); ``processed_rows``: rows whose
    processed distribution the caller needs besides those asking for processed logprobs."""
    params = [r.params for r in reqs]
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    raw_rows = [i for i in want if params[i].logprobs_mode == "raw"]
    asked_processed = [i for i in want if params[i].logprobs_mode == "processed"]
    proc_rows = sorted({*processed_rows, *asked_processed})
    raw = torch.log_softmax(select_rows(logits, raw_rows), dim=-1) if raw_rows else None  # (before penalties)
    penalized = [i for i, p in enumerate(params) if p.has_penalties]
    if penalized:
        penalties.apply(
            logits, penalized, [reqs[i] for i in penalized], [ahead[i] for i in penalized] if ahead is not None else None
        )
    tokens, processed = draw(logits, params, [r.generator for r in reqs], proc_rows)
    if not want:
        lp = None
    elif raw_rows == want:
        lp = raw
    elif proc_rows == want:
        lp = processed
    else:  # both modes in one step (or processed rows the caller asked for): back to the order of ``want``
        at_raw = {row: n for n, row in enumerate(raw_rows)}
        at_proc = {row: len(raw_rows) + n for n, row in enumerate(proc_rows)}
        index = [at_raw[i] if params[i].logprobs_mode == "raw" else at_proc[i] for i in want]
        parts = [t for t in (raw, processed) if t is not None]
        lp = torch.cat(parts)[to_device(index, logits.device)]
    return SampledRows(tokens, want, lp, proc_rows, processed)


def select_rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``t[rows]``; ``t`` itself when that is every row in order (the usual decode step, where
    every request asked alike: no index upload, no copy)."""
    return t if len(rows) == t.shape[0] and rows[-1] == len(rows) - 1 else t.index_select(0, to_device(rows, t.device))
