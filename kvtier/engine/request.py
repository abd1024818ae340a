"""A request as the engine tracks it.

``all_token_ids = prompt + generated``; ``num_computed_tokens`` of them have KV in the request's
blocks (cached prefix included). A step computes ``all_token_ids[num_computed : num_computed + n]``;
when that reaches the end, the last position's logits give the next token (and, for a request
that asked for prompt logprobs, every position's logits score the prompt token after it).
``num_computed_tokens`` moves when a step is launched; the sampled token joins ``all_token_ids``
when the step's results reach the host (``num_pending`` counts those in between)::

    prompt:  p0 p1 p2 p3 p4 p5 p6 | generated: g0 g1
             └ cached ┘└ chunk 1 ┘             └ decode steps, one token each
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from kvtier.cache import CacheRequest
from kvtier.engine.detok import StopStrings
from kvtier.engine.params import SamplingParams
from kvtier.model.images import MMInput


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int = 0
    cache_salt: str | None = None
    # fair admission (engine/scheduler.py): the call this request belongs to (a server passes its
    # response id for every prompt of one call; samples inherit their head's), "" = itself; and
    # its priority, lower first (vLLM's ``priority``)
    owner: str = ""
    priority: int = 0
    # the prompt's images (vision-language models): each one's placeholder tokens, content hash
    # and pixels; the hash keys every block the image overlaps, the pixels feed the vision tower
    mm: tuple[MMInput, ...] = ()
    all_token_ids: list[int] = field(init=False)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # tokens sampled by launched steps whose ids the host has not seen yet (overlap scheduling:
    # 0 or 1 when the scheduler runs; the next step reads the id on the device)
    num_pending: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
    cache: CacheRequest | None = None
    num_cached_tokens: int | None = None  # prompt tokens served from cache, first admission
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    num_preemptions: int = 0
    prefetch_from: int | None = None  # cached tokens (device + host) before a storage prefetch
    prefetch_device: int = 0  # ... of which on the device
    prefetch_deadline: float | None = None  # monotonic time its prefetch stops holding it back
    generator: torch.Generator | None = None
    handoff: dict | None = None  # PD, D side: P's manifest, then the result (engine/core.py)
    export: bool = False  # PD, P side: write the prompt to the pool once prefilled
    handoff_stop: str | None = None  # D: the first token P sampled already ended it
    logprobs: list[dict[int, float]] | None = None  # per generated token (params.logprobs set)
    prompt_logprobs: list[dict[int, float] | None] | None = None  # per prompt token (params.prompt_logprobs set)
    # what the runner computed in the last step, taken by Scheduler.update only if the step's
    # work is kept (a rewound step's token and logprobs are dropped together)
    step_logprobs: dict[int, float] | None = None
    step_prompt_logprobs: tuple[int, list[dict[int, float] | None]] | None = None  # (first prompt index, entries)
    # speculative decoding (engine/spec.py): the MTP block's drafts for the next step, and the
    # drafts the last step accepted (taken by Scheduler.update, like step_logprobs)
    draft_tokens: list[int] = field(default_factory=list)
    step_accepted: list[int] | None = None
    step_accepted_logprobs: list[dict[int, float]] | None = None  # their logprobs entries (params.logprobs)
    draft_acceptance: float = 1.0  # running mean of the share of its drafts accepted per step
    stop_strings: StopStrings | None = None  # params.stop, matched on the incremental text
    metrics: dict[str, float] = field(default_factory=lambda: {"arrival": time.monotonic()})
    # monotonic seconds: arrival, prefetch_start (storage fetch started), admitted (first
    # scheduled), first_token

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        if not self.owner:
            self.owner = self.request_id  # a request without an owner is its own
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = []

    @property
    def cache_req(self) -> CacheRequest:
        """``cache``, which is set while a scheduler holds the request (waiting, running or draining)."""
        assert self.cache is not None, f"request {self.request_id!r} is not in a scheduler"
        return self.cache

    @property
    def needs_prompt_logits(self) -> bool:
        """Are prompt logprobs still to come? (then no prefix hits: hit blocks have no logits)"""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_ahead(self) -> int:
        """Tokens including those still in flight: what the next step computes up to."""
        return len(self.all_token_ids) + self.num_pending

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED
