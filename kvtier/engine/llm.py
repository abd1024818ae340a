"""The offline API (DESIGN §6): ``kvtier.LLM(model, ...).generate(prompts, SamplingParams(...))``.

A thin front end over :class:`~kvtier.engine.core.EngineCore`: ``generate`` queues its prompts
and steps the engine until all of them finished (the serving front end is
:class:`~kvtier.engine.client.EngineClient`). One RequestOutput per prompt, in order; with
``SamplingParams.n > 1`` its ``outputs`` hold the n samples (engine/group.py). A request that fails inside the engine raises
RuntimeError here (its batch's other requests are aborted; the engine stays usable).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from kvtier.engine.core import EngineCore
from kvtier.engine.outputs import CompletionOutput, RequestOutput
from kvtier.engine.params import SamplingParams

__all__ = ["CompletionOutput", "LLM", "RequestOutput"]


class LLM(EngineCore):
    """``kvtier.LLM(model, config=None, **options)``: the options and their defaults are
    :class:`kvtier.EngineConfig`'s (with a storage pool and nothing else set, a host tier sized
    from free memory and write_through); keywords go over ``config``."""

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]] | Sequence[dict] | str | dict,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        cache_salt: str | None = None,
        priority: int | Sequence[int] = 0,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. A prompt is text, token ids, or (vision-language
        models) ``{"prompt": text or ids, "images": [PIL image | bytes | path, ...]}`` with one image
        placeholder (the checkpoint's image token, e.g. ``<image>``) per image. ``priority``: one for every prompt, or one per
        prompt (as vLLM's); lower is admitted first when prompts wait for a running slot. Each
        prompt is its own owner: its samples (n) hold at most ``max_num_seqs_per_request`` slots."""
        self._check_open()
        if isinstance(prompts, np.ndarray):
            prompts = prompts.tolist()
        if isinstance(prompts, (str, dict)) or (len(prompts) and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]  # type: ignore[assignment]  # one prompt (text or token ids): a batch of one
        params = sampling_params if sampling_params is not None else SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        priorities = [priority] * len(prompts) if isinstance(priority, (int, np.integer)) else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"{len(priorities)} priorities for {len(prompts)} prompts")
        reqs = [self.make_request(p, sp, cache_salt, priority=pr) for p, sp, pr in zip(prompts, params, priorities)]
        mine = {r.request_id for r in reqs}
        for r in reqs:
            self.enqueue(r)
        done: dict[str, RequestOutput] = {}
        try:
            while len(done) < len(reqs):
                for out in self.step():
                    if out.request_id not in mine:
                        continue
                    if out.error_kind == "internal":  # offline: no error outputs, an exception
                        raise RuntimeError(f"request {out.request_id} failed: {out.error}")
                    done[out.request_id] = out
        except BaseException:
            # an error or Ctrl-C mid-batch: drop this call's unfinished requests and their blocks
            for r in reqs:
                if r.request_id not in done:
                    self.abort(r.request_id)
            self.drain()
            raise
        return [done[r.request_id] for r in reqs]

    def __enter__(self) -> "LLM":
        return self
