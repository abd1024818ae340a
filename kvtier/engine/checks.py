"""What a request may be: every check it gets before it touches the engine, in the serving
process (engine/client.py, against the sizes the engine reported when it was ready) and again in
the engine (engine/intake.py, which then makes the engine's Request). Plain Python, no torch: the
serving process imports it. Bad input raises ValueError naming the value::

    RequestLimits          the engine's sizes: vocabulary, context, block size, device tier,
                           whether it has a pool (PD) and captures MoE routing, a tokenizer
    check_request(limits, ids, params, handoff=, export=, owner=, priority=)
                           -> the ids as plain ints: token range, context and device-tier fit,
                              PD and logprob combinations, owner and priority
    check_request_id(id)   a given id: never one of the engine's own (AUTO_ID)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from kvtier.engine.params import SamplingParams
from kvtier.flags import check_int

AUTO_ID = "kvtier-auto-"  # ids the engine makes; given ids may not start so: never the same
MAX_PRIORITY = 2**31 - 1  # |priority| at most (vLLM's field is an int; this bounds it to 32 bits)


@dataclass(frozen=True)
class RequestLimits:
    """The sizes a request is checked against (an engine reports them when it is ready)."""

    model: str  # the checkpoint (named in errors)
    architecture: str
    is_moe: bool
    vocab_size: int  # prompt ids are below it
    max_model_len: int
    block_size: int
    num_device_blocks: int
    has_pool: bool  # a storage pool: PD hand-offs possible
    routing: bool  # MoE routing capture on
    has_tokenizer: bool  # stop strings are matched on the output text
    # vision-language models (else 0): the image placeholder id, its tokens per image, the side
    # of a preprocessed image, and what one request may carry (model/images.py ImageLimits)
    image_token_id: int = -1
    image_tokens: int = 0
    image_size: int = 0
    max_images: int = 0
    max_image_bytes: int = 0
    max_image_pixels: int = 0


def check_request(
    limits: RequestLimits,
    ids: Sequence,
    params: SamplingParams,
    *,
    handoff: bool = False,
    export: bool = False,
    owner: str | None = None,
    priority: int = 0,
) -> list[int]:
    """``ids`` as plain ints once a request of them and ``params`` fits ``limits`` (``handoff``:
    the decode side of a PD hand-off, whose manifest the engine checks; ``export``: the prefill
    side); ValueError naming the first problem."""
    check_int("priority", priority, -MAX_PRIORITY, MAX_PRIORITY)
    if owner is not None and not isinstance(owner, str):
        raise ValueError(f"owner must be a string (the id of the call a request belongs to), got {owner!r}")
    ids = list(ids)
    if not ids:
        raise ValueError("empty prompt: give at least one token")
    if params.return_routed_experts and not limits.routing:
        raise ValueError(
            "return_routed_experts=True needs a MoE model with routing capture on "
            f"({limits.architecture}, capture_routing={limits.is_moe and limits.routing})"
        )
    ids = check_token_ids(ids, limits.vocab_size)
    ctx = limits.max_model_len
    if len(ids) >= ctx:
        raise ValueError(
            f"prompt has {len(ids)} tokens; the model's context is {ctx} (max_model_len), leaving no room to generate"
        )
    longest = len(ids) + params.max_tokens
    if longest > ctx:
        raise ValueError(
            f"max_tokens={params.max_tokens} + {len(ids)} prompt tokens = {longest} tokens, "
            f"more than the model's context of {ctx} (max_model_len)"
        )
    blocks = -(-longest // limits.block_size)
    if blocks > limits.num_device_blocks:
        raise ValueError(
            f"a request of {len(ids)} prompt tokens + max_tokens={params.max_tokens} needs {blocks} blocks, more than "
            f"the whole device tier ({limits.num_device_blocks} blocks of {limits.block_size} tokens)"
        )
    if export and handoff:
        raise ValueError("a request is either the prefill (export) or the decode (handoff) side of a hand-off")
    if (export or handoff) and not limits.has_pool:
        raise ValueError("a PD hand-off needs a storage pool: start the engine with storage=URL")
    check_pd_samples(params.n, export, handoff)
    if handoff and (params.logprobs is not None or params.prompt_logprobs is not None):
        raise ValueError(
            f"logprobs={params.logprobs}, prompt_logprobs={params.prompt_logprobs}: the decode "
            "side of a PD hand-off has neither its first token's logits nor the prompt's"
        )
    if params.stop and not limits.has_tokenizer:
        raise ValueError(
            f"stop={list(params.stop)!r} is matched on the output text, and {limits.model} has no tokenizer; use stop_token_ids"
        )
    return ids


def check_pd_samples(n: int, export: bool, handoff: bool) -> None:
    """ValueError if ``n`` > 1 samples are asked through a PD hand-off (a manifest carries one
    first token)."""
    if n > 1 and (export or handoff):
        raise ValueError(
            f"n={n} samples cannot be served through a PD hand-off (export/handoff): send n=1 or run the request colocated"
        )


def check_request_id(request_id: object) -> str:
    """``request_id`` as a string, unless it starts as the engine's own ids do (ValueError)."""
    rid = str(request_id)
    if rid.startswith(AUTO_ID):
        raise ValueError(f"request_id {request_id!r} starts with {AUTO_ID!r}, the prefix of automatic ids")
    return rid


def check_token_ids(ids: list, vocab: int) -> list[int]:
    """``ids`` as plain ints, each checked to be a token id (ValueError naming the first bad one).
    A list of Python ints (the usual prompt) is checked in C (type set, min, max): a per-token
    Python loop cost ~2 ms for a 4K-token prompt on the engine thread."""
    if set(map(type, ids)) <= {int} and (not ids or (min(ids) >= 0 and max(ids) < vocab)):
        return ids
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < vocab:
            raise ValueError(f"token id {t!r} is not an int in 0..{vocab - 1}")
    return [int(t) for t in ids]
