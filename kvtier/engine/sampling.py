"""The sampler (DESIGN §6): greedy, temperature, top-k, min-p, top-p, per-request seed, penalties and
logprobs; never fails on valid params, whatever the logits (NaN, +-inf, huge). What the fields of
:class:`~kvtier.engine.params.SamplingParams` mean: engine/params.py."""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Sequence

import torch

from kvtier.engine.params import SamplingParams

if TYPE_CHECKING:
    from kvtier.engine.request import Request


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """One token id per row of ``logits`` [n, vocab] (see :func:`draw`), on the host."""
    return draw(logits, params, generators)[0].tolist()


@functools.lru_cache(maxsize=64)
def _topk_width(n: int) -> int | None:
    """A divisor of ``n`` between 512 and 2,048 (the chunk width of :func:`topk`), or None."""
    for width in range(1024, 2049):
        if n % width == 0:
            return width
    for width in range(1023, 511, -1):
        if n % width == 0:
            return width
    return None


def topk(x: torch.Tensor, k: int) -> torch.return_types.topk:
    """``torch.topk(x, k, dim=-1)`` (values in descending order, their indices) for rows as long
    as a vocabulary, in two passes: the top k of each chunk of ~1,024 columns, then the top k of
    those candidates. On an H100 one ``torch.topk`` over 64 rows of 151,936 logits takes ~190 us
    (its single-pass kernel goes slow on long rows), a tenth of a decode step of a small model.
    Chunks divide the row exactly (a padded tail would rank its padding among -inf entries);
    a row length with no such divisor takes torch.topk. Same values; among equal values the
    indices may differ."""
    n = x.shape[-1]
    k = min(k, n)
    width = _topk_width(n) if n > 4096 and k <= 64 else None
    if width is None:
        return torch.topk(x, k, dim=-1)
    chunks = n // width
    part = torch.topk(x.contiguous().view(*x.shape[:-1], chunks, width), k, dim=-1)
    base = torch.arange(chunks, device=x.device).mul_(width).unsqueeze(-1)
    cand_idx = (part.indices + base).flatten(-2)
    top = torch.topk(part.values.flatten(-2), k, dim=-1)
    return torch.return_types.topk((top.values, cand_idx.gather(-1, top.indices)))


def draw(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    processed_rows: Sequence[int] = (),
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One token id per row of ``logits`` [n, vocab], as a device tensor [n] (no host sync: the
    caller moves it with whatever else the step returns), and for ``processed_rows`` the log of
    the distribution each row was drawn from ([len(processed_rows), vocab] float32: after
    temperature, top-k, min-p, top-p; a greedy row's is ``log_softmax`` of its logits). Never raises on
    valid params, whatever the logits.

    The model's logits may hold NaN or +-inf (e.g. a bf16 overflow): NaN counts as the lowest
    logit, +-inf as the largest/lowest finite one, so greedy is the argmax of the cleaned row and
    a row with no finite value at all falls back to it. Sampled rows work in float64 from their
    max (``row - max`` <= 0, the max exactly 0): dividing by any temperature down to 1e-300 then
    cannot overflow into inf - inf, the top token always has probability > 0, and top-p always
    keeps it (so temperature -> 0+ and top_p -> 0+ both give the argmax). Temperature and top-k
    are applied to all sampled rows at once; each row draws with its own generator (a seeded
    request's tokens must not depend on its batch-mates), from its probabilities in vocabulary
    order, or, under top-p, sorted by logit."""
    if not logits.dtype.is_floating_point:
        logits = logits.float()
    device = logits.device
    finfo = torch.finfo(logits.dtype)
    clean = torch.nan_to_num(logits, nan=finfo.min, posinf=finfo.max, neginf=finfo.min)
    tokens = clean.argmax(dim=-1)
    processed = None
    if processed_rows:  # greedy rows' distribution; sampled ones are overwritten below
        processed = torch.log_softmax(logits[list(processed_rows)].float(), dim=-1)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if not sampled:
        return tokens, processed
    sp = [params[i] for i in sampled]
    idx = to_device(sampled, device)
    rows = clean[idx].double()
    rows = (rows - rows.max(dim=-1, keepdim=True).values) / _column([p.temperature for p in sp], rows)
    # a -inf logit (a token masked out, e.g. by min_tokens) stays -inf, not the dtype's lowest
    # finite value: its processed logprob is -inf, as a top-k or top-p cut's is
    finite = torch.isfinite(logits[idx]).any(dim=-1)  # else: the argmax of the cleaned row
    rows = rows.masked_fill(torch.isneginf(logits[idx]) & finite[:, None], float("-inf"))
    if any(p.top_k for p in sp):
        vocab = rows.shape[-1]
        ks = [min(p.top_k, vocab) for p in sp]
        top = topk(rows, max(ks)).values
        kth = top.gather(1, to_device([max(k - 1, 0) for k in ks], device)[:, None])
        kth = kth.masked_fill(to_device([k == 0 for k in ks], device)[:, None], float("-inf"))
        rows = rows.masked_fill(rows < kth, float("-inf"))
    if any(p.min_p for p in sp):
        # each row's max is 0 (above): a token's probability over the likeliest's is exp(row),
        # so min_p keeps row >= log(min_p) (vLLM's order: after temperature, before top-p)
        floor = [math.log(p.min_p) if p.min_p else float("-inf") for p in sp]
        rows = rows.masked_fill(rows < _column(floor, rows), float("-inf"))
    logp = torch.log_softmax(rows, dim=-1)
    nucleus = [j for j, p in enumerate(sp) if p.top_p < 1.0]
    sorted_probs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    if nucleus:
        nidx = to_device(nucleus, device)
        # sorted by logit, not by probability: distinct logits whose probabilities round equal
        # keep their order, so the first kept token is an argmax
        sorted_rows, order = rows[nidx].sort(dim=-1, descending=True, stable=True)
        sorted_p = torch.softmax(sorted_rows, dim=-1)
        keep = sorted_p.cumsum(-1) - sorted_p < _column([sp[j].top_p for j in nucleus], rows)  # smallest set reaching top_p
        keep[:, 0] = True  # and never empty
        sorted_p = sorted_p * keep
        kept_logp = torch.log_softmax(sorted_rows.masked_fill(~keep, float("-inf")), dim=-1)
        logp[nidx] = torch.empty_like(kept_logp).scatter_(1, order, kept_logp)
        for n, j in enumerate(nucleus):
            sorted_probs[j] = sorted_p[n], order[n]
    probs = logp.exp()
    picks = []
    for j in range(len(sp)):
        if j in sorted_probs:
            p_sorted, order_j = sorted_probs[j]
            picks.append(order_j[torch.multinomial(p_sorted, 1, generator=generators[sampled[j]])])
        else:
            picks.append(torch.multinomial(probs[j], 1, generator=generators[sampled[j]]))
    tokens[idx] = torch.where(finite, torch.cat(picks), tokens[idx])
    if processed is not None:
        where = {row: n for n, row in enumerate(processed_rows)}
        pairs = [(where[i], j) for j, i in enumerate(sampled) if i in where]
        if pairs:
            dst, src = zip(*pairs)
            processed[list(dst)] = logp[list(src)].float()
    return tokens, processed


def to_device(values, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A small host list or array on ``device`` without waiting for the GPU: through pinned memory,
    non-blocking (``torch.tensor(..., device="cuda")`` synchronizes the stream, which with overlap
    scheduling would wait for the step in flight)."""
    t = torch.as_tensor(values, dtype=dtype)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return to_device(values, like.device, like.dtype)[:, None]


class Penalties:
    """Repetition / presence / frequency penalties and ``min_tokens``, on the device, for the rows
    of a step whose requests have them (the others cost nothing).

    Each such request owns a slot: a row of token counts of its output and a row marking its
    prompt's tokens, in two device tensors grown by doubling. A slot learns the tokens appended
    since it last looked from the host's ``output_token_ids`` (one upload per step for all rows,
    O(new tokens) host work), so a step whose token was dropped (a rewind), a preemption or a
    hand-off's first token never leave the counts wrong. Slots of finished requests are reused."""

    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int], device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.device = device
        self.counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)
        self.in_prompt = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self.ends = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)  # min_tokens: what would end it
        self.owners: list[Request | None] = []
        self.counted: list[int] = []  # output tokens each slot has counted
        self.slot_of: dict[Request, int] = {}

    def _slot(self, req: Request) -> int:
        slot = self.slot_of.get(req)
        if slot is not None:
            return slot
        for s, owner in enumerate(self.owners):
            if owner is not None and owner.is_finished:
                del self.slot_of[owner]
                self.owners[s] = None
        free = [s for s, owner in enumerate(self.owners) if owner is None]
        if free:
            slot = free[0]
        else:
            slot = len(self.owners)
            grow = max(4, 2 * slot) - slot
            self.counts = torch.cat([self.counts, self.counts.new_zeros(grow, self.vocab_size)])
            self.in_prompt = torch.cat([self.in_prompt, self.in_prompt.new_zeros(grow, self.vocab_size)])
            self.ends = torch.cat([self.ends, self.ends.new_zeros(grow, self.vocab_size)])
            self.owners += [None] * grow
            self.counted += [0] * grow
        self.owners[slot], self.slot_of[req] = req, slot
        self.counts[slot] = 0
        self.counted[slot] = 0
        self.in_prompt[slot] = False
        self.in_prompt[slot, torch.tensor(req.prompt_token_ids, device=self.device)] = True
        p = req.params
        ends = [t for t in p.stop_set | (frozenset() if p.ignore_eos else frozenset(self.eos_token_ids)) if t < self.vocab_size]
        self.ends[slot] = False
        if ends:
            self.ends[slot, torch.tensor(ends, device=self.device)] = True
        return slot

    @torch.inference_mode()  # the logits are an inference tensor (compute_logits)
    def apply(
        self, logits: torch.Tensor, rows: list[int], reqs: list[Request], ahead: Sequence[Sequence[int]] | None = None
    ) -> None:
        """Penalize ``logits[rows]`` (of ``reqs``) in place. ``ahead[n]``: tokens taken as generated
        after the request's output before row n (a speculative verify row: the drafts before it)."""
        slots = [self._slot(r) for r in reqs]
        new_slots: list[int] = []
        new_tokens: list[int] = []
        for slot, req in zip(slots, reqs):
            out = req.output_token_ids
            if len(out) < self.counted[slot]:  # (a request made anew under the same object)
                self.counts[slot] = 0
                self.counted[slot] = 0
            new_tokens += out[self.counted[slot] :]
            new_slots += [slot] * (len(out) - self.counted[slot])
            self.counted[slot] = len(out)
        if new_tokens:
            self.counts.index_put_(
                (torch.tensor(new_slots, device=self.device), torch.tensor(new_tokens, device=self.device)),
                torch.ones(len(new_tokens), dtype=torch.int32, device=self.device),
                accumulate=True,
            )
        ridx = torch.tensor(rows, device=self.device)
        x = logits[ridx]
        # min_tokens: what would end the request, masked (its slot's row: O(1) host work per row)
        extra = [len(a) for a in ahead] if ahead is not None else [0] * len(reqs)
        under = [n for n, req in enumerate(reqs) if len(req.output_token_ids) + extra[n] < req.params.min_tokens]
        if under:
            rows_under = torch.tensor(under, device=self.device)
            mask = self.ends[torch.tensor([slots[n] for n in under], device=self.device)]
            x[rows_under] = x[rows_under].masked_fill(mask, float("-inf"))
        sidx = torch.tensor(slots, device=self.device)
        counts = self.counts[sidx]  # (a copy: the rows' own counts)
        if any(extra):
            assert ahead is not None
            at = [n for n, a in enumerate(ahead) for _ in a]
            counts.index_put_(
                (torch.tensor(at, device=self.device), torch.tensor([t for a in ahead for t in a], device=self.device)),
                torch.ones(len(at), dtype=torch.int32, device=self.device),
                accumulate=True,
            )
        if any(r.params.repetition_penalty != 1.0 for r in reqs):
            rep = _column([r.params.repetition_penalty for r in reqs], x)
            seen = self.in_prompt[sidx] | (counts > 0)  # HF / CTRL: prompt and output
            x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        if any(r.params.presence_penalty or r.params.frequency_penalty for r in reqs):
            freq = _column([r.params.frequency_penalty for r in reqs], x)
            pres = _column([r.params.presence_penalty for r in reqs], x)
            x = x - freq * counts - pres * (counts > 0)  # OpenAI: the output only
        logits[ridx] = x
