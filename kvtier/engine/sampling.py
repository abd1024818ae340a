"""SamplingParams (DESIGN §6) and the sampler: greedy, temperature, top-k, top-p, per-request seed;
never fails on valid params, whatever the logits (NaN, +-inf, huge).

What the fields mean (the OpenAI / vLLM meanings):

- ``n``: samples per prompt. One prefill; the samples share the prompt's KV blocks. Sample ``i``
  draws from its own generator seeded ``seed + i`` (when ``seed`` is given): sample ``i`` of
  ``n=8, seed=s`` equals one request with ``n=1, seed=s+i``.
- ``logprobs=k``: per generated token, the logprob of the sampled token and of the ``k`` most
  likely ones (``0``: the sampled token's only). ``logprobs_mode="raw"`` (vLLM V1's default):
  ``log_softmax`` of the model's logits, before temperature, penalties, top-k/top-p;
  ``"processed"``: of the distribution the token was drawn from (after all of them; greedy rows:
  after the penalties) — what an RL trainer comparing behaviour and target policies needs.
- ``prompt_logprobs=k``: the same per prompt token (the first has none); such a request computes
  its whole prompt (prefix-cache hits would have no logits).
- ``presence_penalty`` / ``frequency_penalty`` (OpenAI, -2..2): subtracted from the logits of
  tokens generated so far, once / per occurrence. ``repetition_penalty`` (HF / CTRL, > 0): the
  logit of every token of the prompt and the output is divided by it when positive, multiplied
  when negative.
- ``min_tokens``: EOS and ``stop_token_ids`` cannot be sampled before this many tokens.
- ``stop``: strings matched on the detokenized output; the output ends before the match (the
  text excludes it; the tokens up to the one that completed it are kept), finish_reason "stop".
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


MAX_N = 128
MAX_LOGPROBS = 20           # as vLLM and OpenAI's chat top_logprobs
LOGPROBS_MODES = ("raw", "processed")


def _check_int(name: str, value: object, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"{name} must be an int in {lo}..{hi}, got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    return_routed_experts: bool = False
    skip_special_tokens: bool = True            # RequestOutput.text leaves out special tokens (EOS...)
    n: int = 1
    logprobs: int | None = None                 # None: none; k: sampled token + top-k per generated token
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    logprobs_mode: str = "raw"                  # raw | processed (see the module docstring)

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) \
                or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        try:
            stop = tuple(self.stop_token_ids)
        except TypeError:
            raise ValueError(f"stop_token_ids must be a sequence of token ids, got {self.stop_token_ids!r}") from None
        for t in stop:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids must be non-negative ints, got {t!r}")
        object.__setattr__(self, "stop_token_ids", stop)
        for flag in ("ignore_eos", "return_routed_experts", "skip_special_tokens"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be a bool, got {getattr(self, flag)!r}")
        _check_int("n", self.n, 1, MAX_N)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 0, MAX_LOGPROBS)
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be a number in [-2, 2], got {v!r}")
        v = self.repetition_penalty
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {v!r}")
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens)
        stop_strings = (self.stop,) if isinstance(self.stop, str) else self.stop
        try:
            stop_strings = tuple(stop_strings)
        except TypeError:
            raise ValueError(f"stop must be a string or a sequence of strings, got {self.stop!r}") from None
        for s in stop_strings:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        object.__setattr__(self, "stop", stop_strings)
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")

    def sample_seed(self, index: int) -> int | None:
        """The seed of sample ``index`` of ``n`` (None: the engine's generator)."""
        return None if self.seed is None else self.seed + index

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                or self.min_tokens > 0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """One token id per row of ``logits`` [n, vocab]; never raises on any valid params and logits.

    The model's logits may hold NaN or +-inf (e.g. a bf16 overflow): NaN counts as the lowest
    logit, +-inf as the largest/lowest finite one, so greedy is the argmax of the cleaned row and
    a row with no finite value at all falls back to it. A sampled row works in float64 from its
    max (``row - max`` <= 0, the max exactly 0): dividing by any temperature down to 1e-300 then
    cannot overflow into inf - inf, the top token always has probability > 0, and top-p always
    keeps it (so temperature -> 0+ and top_p -> 0+ both give the argmax)."""
    out: list[int] = [0] * len(params)
    if not logits.dtype.is_floating_point:
        logits = logits.float()
    finfo = torch.finfo(logits.dtype)
    clean = torch.nan_to_num(logits, nan=finfo.min, posinf=finfo.max, neginf=finfo.min)
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    if sampled_rows:       # (one sync, and none on an all-greedy step)
        finite = torch.isfinite(logits[sampled_rows]).any(dim=-1).tolist()
        sampled_rows = [i for i, ok in zip(sampled_rows, finite) if ok]
    greedy_rows = sorted(set(range(len(params))) - set(sampled_rows))
    if greedy_rows:
        ids = clean[greedy_rows].argmax(dim=-1).tolist()
        for i, t in zip(greedy_rows, ids):
            out[i] = t
    for i in sampled_rows:
        p = params[i]
        row = clean[i].double()
        row = (row - row.max()) / p.temperature          # <= 0; the top token(s) exactly 0
        if p.top_k:
            kth = torch.topk(row, min(p.top_k, row.numel())).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if p.top_p >= 1.0:
            out[i] = int(torch.multinomial(torch.softmax(row, dim=-1), 1, generator=generators[i]).item())
            continue
        # sorted by logit, not by probability: distinct logits whose probabilities round equal keep
        # their order, so the first kept token is an argmax
        sorted_row, order = row.sort(descending=True, stable=True)
        sorted_p = torch.softmax(sorted_row, dim=-1)
        keep = sorted_p.cumsum(0) - sorted_p < p.top_p       # smallest set reaching top_p
        keep[0] = True                                        # and never empty
        pick = torch.multinomial(sorted_p * keep, 1, generator=generators[i])
        out[i] = int(order[pick].item())
    return out
