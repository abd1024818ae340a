"""SamplingParams (DESIGN §6): what a request asks of the sampler, checked when made. Plain data, no
torch (the serving process imports it; engine/sampling.py draws).

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
from dataclasses import dataclass, field

from kvtier.flags import check_int

MAX_N = 128
MAX_LOGPROBS = 20  # as vLLM and OpenAI's chat top_logprobs
MAX_STOP_TOKEN_IDS = 1024  # stop_token_ids of one request (checked once, then a set: O(1) per token)
LOGPROBS_MODES = ("raw", "processed")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0  # drop tokens less likely than min_p x the likeliest (after temperature); 0 = off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    return_routed_experts: bool = False
    skip_special_tokens: bool = True  # RequestOutput.text leaves out special tokens (EOS...)
    n: int = 1
    logprobs: int | None = None  # None: none; k: sampled token + top-k per generated token
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    logprobs_mode: str = "raw"  # raw | processed (see the module docstring)
    # stop_token_ids as a set (made by __post_init__): what the scheduler tests each token against
    stop_set: frozenset[int] = field(default=frozenset(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if isinstance(self.min_p, bool) or not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        try:
            stop = tuple(self.stop_token_ids)
        except TypeError:
            raise ValueError(f"stop_token_ids must be a sequence of token ids, got {self.stop_token_ids!r}") from None
        if len(stop) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids has {len(stop)} ids: at most {MAX_STOP_TOKEN_IDS}")
        for t in stop:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids must be non-negative ints, got {t!r}")
        object.__setattr__(self, "stop_token_ids", tuple(dict.fromkeys(stop)))  # each once, in order
        object.__setattr__(self, "stop_set", frozenset(stop))
        for flag in ("ignore_eos", "return_routed_experts", "skip_special_tokens"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be a bool, got {getattr(self, flag)!r}")
        check_int("n", self.n, 1, MAX_N)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 0, MAX_LOGPROBS)
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be a number in [-2, 2], got {v!r}")
        v = self.repetition_penalty
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {v!r}")
        check_int("min_tokens", self.min_tokens, 0, self.max_tokens)
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
        return (
            self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0 or self.min_tokens > 0
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
