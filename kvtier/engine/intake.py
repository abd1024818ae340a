"""Prompts in, validated :class:`Request` objects out: every check a request gets before it
touches the engine (text or ids, token ranges, context and device-tier fit, PD and logprob
combinations), its id and its generator. Bad input raises ValueError naming the value."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import count
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from kvtier.engine.detok import StopStrings
from kvtier.engine.params import SamplingParams
from kvtier.engine.request import Request
from kvtier.flags import check_int
from kvtier.model import ModelConfig

AUTO_ID = "kvtier-auto-"  # ids the engine makes; given ids may not start so: never the same
MAX_PRIORITY = 2**31 - 1  # |priority| at most (vLLM's field is an int; this bounds it to 32 bits)


@dataclass
class Intake:
    path: Path  # the checkpoint (named in errors)
    tokenizer: Any  # None: token-id prompts only
    model: ModelConfig
    max_model_len: int
    block_size: int
    num_device_blocks: int
    has_pool: bool  # a storage pool: PD hand-offs possible
    routing: bool  # MoE routing capture on
    device: torch.device
    generator: torch.Generator  # the engine's shared generator (unseeded requests)
    _ids: Iterator[int] = field(default_factory=count)

    def request(
        self,
        prompt: str | list[int] | Any,
        params: SamplingParams,
        cache_salt: str | None,
        request_id: str | None = None,
        *,
        handoff: bool = False,
        export: bool = False,
        owner: str | None = None,
        priority: int = 0,
    ) -> Request:
        """A validated Request (``handoff``: the decode side of a PD hand-off; the manifest is
        checked by engine/pd.py). ``owner``: the call it belongs to (None: itself) and
        ``priority`` (lower first): how the scheduler shares its slots (engine/scheduler.py)."""
        check_int("priority", priority, -MAX_PRIORITY, MAX_PRIORITY)
        if owner is not None and not isinstance(owner, str):
            raise ValueError(f"owner must be a string (the id of the call a request belongs to), got {owner!r}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"text prompts need a tokenizer, and {self.path} has none; pass token ids")
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            ids = list(prompt)
        if not ids:
            raise ValueError("empty prompt: give at least one token")
        if params.return_routed_experts and not self.routing:
            raise ValueError(
                "return_routed_experts=True needs a MoE model with routing capture on "
                f"({self.model.architecture}, capture_routing={self.model.is_moe and self.routing})"
            )
        ids = check_token_ids(ids, self.model.vocab_size)
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens; the model's context is {self.max_model_len} "
                f"(max_model_len), leaving no room to generate"
            )
        longest = len(ids) + params.max_tokens
        if longest > self.max_model_len:
            raise ValueError(
                f"max_tokens={params.max_tokens} + {len(ids)} prompt tokens = {longest} tokens, "
                f"more than the model's context of {self.max_model_len} (max_model_len)"
            )
        if -(-longest // self.block_size) > self.num_device_blocks:
            raise ValueError(
                f"a request of {len(ids)} prompt tokens + max_tokens={params.max_tokens} needs "
                f"{-(-longest // self.block_size)} blocks, more than the whole device tier "
                f"({self.num_device_blocks} blocks of {self.block_size} tokens)"
            )
        if export and handoff:
            raise ValueError("a request is either the prefill (export) or the decode (handoff) side of a hand-off")
        if (export or handoff) and not self.has_pool:
            raise ValueError("a PD hand-off needs a storage pool: start the engine with storage=URL")
        if handoff and (params.logprobs is not None or params.prompt_logprobs is not None):
            raise ValueError(
                f"logprobs={params.logprobs}, prompt_logprobs={params.prompt_logprobs}: the decode "
                "side of a PD hand-off has neither its first token's logits nor the prompt's"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError(
                f"stop={list(params.stop)!r} is matched on the output text, and {self.path} has no tokenizer; use stop_token_ids"
            )
        if request_id is None:
            rid = f"{AUTO_ID}{next(self._ids)}"
        elif str(request_id).startswith(AUTO_ID):
            raise ValueError(f"request_id {request_id!r} starts with {AUTO_ID!r}, the prefix of automatic ids")
        else:
            rid = str(request_id)
        req = Request(rid, ids, params, cache_salt=cache_salt, owner=owner or "", priority=int(priority))
        if params.stop:
            req.stop_strings = StopStrings(self.tokenizer, params.stop, params.skip_special_tokens, params.min_tokens)
        req.generator = self._generator_for(params.seed)
        req.export = export
        return req

    def sample(self, head: Request, index: int, request_id: str) -> Request:
        """Sample ``index`` of ``head``'s n (engine/group.py): its prompt and params, its own id
        and generator (seed + index), its owner and priority. The prompt's logprobs are the
        request's (sample 0's): computing them again would make every sample recompute the whole
        prompt."""
        params = replace(head.params, n=1, prompt_logprobs=None)
        req = self.request(head.prompt_token_ids, params, head.cache_salt, owner=head.owner, priority=head.priority)
        req.request_id = request_id
        req.generator = self._generator_for(head.params.sample_seed(index))
        return req

    def _generator_for(self, seed: int | None) -> torch.Generator:
        return self.generator if seed is None else torch.Generator(self.device).manual_seed(seed)


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
