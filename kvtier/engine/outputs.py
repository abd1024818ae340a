"""What the engine returns: a finished request's :class:`RequestOutput`, one
:class:`CompletionOutput` per sample, and :func:`request_output`, which makes them from a
:class:`~kvtier.engine.request.Request`. Plain data, no torch: an output travels to a serving
process as it is (engine/wire.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from kvtier.engine.experts import ExpertCapture
    from kvtier.engine.request import Request


@dataclass
class CompletionOutput:
    """One sample of a request (``SamplingParams.n`` of them)."""

    index: int
    token_ids: list[int]
    text: str | None
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    routed_experts: np.ndarray | None = None  # [len(prompt)+len(token_ids)-1, num_moe_layers, top_k]
    logprobs: list[dict[int, float]] | None = None  # per generated token: {token_id: logprob}, sampled + top-k


@dataclass
class RequestOutput:
    """A finished request. ``token_ids``, ``text``, ``finish_reason`` and ``routed_experts`` are
    those of ``outputs[0]`` (the only sample when n=1)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str
    num_cached_tokens: int
    cached_tokens_by_tier: dict[str, int]
    routed_experts: np.ndarray | None = None
    metrics: dict[str, float] | None = None  # monotonic times: arrival, [prefetch_start], admitted, first_token
    handoff: dict | None = None  # PD: P's manifest, or D's hand-off result (engine/core.py)
    error: str | None = None  # the request failed (finish_reason "error"): why
    # which failure, when finish_reason is "error": "handoff" = a PD hand-off that could not be
    # served as asked (pd_on_miss="error"; handoff["result"] == "error"; HTTP 502), or "internal" =
    # the engine failed while running it (a step raised; the engine goes on; HTTP 500)
    error_kind: str | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)  # one per sample, by index
    prompt_logprobs: list[dict[int, float] | None] | None = None  # per prompt token (the first: None)


def request_output(
    req: Request, tokenizer: Any, routing: ExpertCapture | None, error: str | None = None, error_kind: str | None = None
) -> RequestOutput:
    """``req``'s output (one sample); with ``error``, a failed one (finish_reason "error", no
    text nor routing: its blocks may be gone already) of ``error_kind`` (RequestOutput says which)."""
    routed = None
    if req.params.return_routed_experts and error is None:
        if routing is None:
            raise ValueError("return_routed_experts=True needs a MoE model")
        assert req.cache is not None  # a request that ran without error has its blocks
        routed = routing.gather(req.cache.block_table, req.num_tokens - 1)
    if error is not None or tokenizer is None:
        text = None
    elif req.stop_strings is not None and req.stop_strings.stopped:
        text = req.stop_strings.text  # ends before the stop string
    else:
        text = tokenizer.decode(req.output_token_ids, skip_special_tokens=req.params.skip_special_tokens)
    finish = "error" if error else (req.finish_reason or "length")
    sample = CompletionOutput(
        0, list(req.output_token_ids), text, finish, routed, None if req.logprobs is None else list(req.logprobs)
    )
    return RequestOutput(
        req.request_id,
        list(req.prompt_token_ids),
        sample.token_ids,
        text,
        finish,
        req.num_cached_tokens or 0,
        dict(req.cached_tokens_by_tier),
        routed,
        dict(req.metrics),
        None if req.handoff is None else dict(req.handoff),
        error,
        error_kind if error else None,
        [sample],
        req.prompt_logprobs,
    )
