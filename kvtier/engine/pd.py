"""The engine's side of a prefill/decode hand-off through the pool (DESIGN §7).

P (``add_request(..., export=True)``) runs the prefill; once its first token is sampled,
:class:`Exports` writes every block of the prompt to the pool and holds the request's output
until the pool acked them (or ``export_timeout`` passed), then hands it out with the manifest in
``RequestOutput.handoff``::

    {"namespace", "keys", "num_tokens", "first_token", "complete", "failed_blocks",
     "stored_before", "seconds", "tensor_parallel_size"}

D (``add_request(..., handoff=manifest)``): :func:`accept_handoff` checks the manifest names the
blocks this engine would read and starts the request from P's first token; after its first step
:func:`check_handoffs` records how much of the prompt came from the pool (``result``: ``ok``,
``recomputed``, or ``error`` under ``pd_on_miss="error"``, which fails the request).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

from kvtier.cache.keys import MMItem
from kvtier.engine.outputs import RequestOutput
from kvtier.engine.request import Request

if TYPE_CHECKING:
    from kvtier.cache import CacheManager
    from kvtier.cache.handoff import Export
    from kvtier.engine.scheduler import Scheduler

# error_output(req, error, error_kind): a failed request's output
ErrorOutput = Callable[[Request, str, str], RequestOutput]


def accept_handoff(
    req: Request,
    manifest: object,
    vocab_size: int,
    namespace: str,
    cache: CacheManager,
    scheduler: Scheduler,
    tensor_parallel_size: int = 1,
) -> None:
    """D: start ``req`` from P's first token; ValueError (naming the field) unless P's manifest
    names the blocks this engine would read for this prompt, split as this engine splits them
    (P and D at the same tensor-parallel size: each rank reads the shard its peer wrote; a latent
    cache's block is one object whatever the size, and its manifest says 1)."""
    if not isinstance(manifest, dict):
        raise ValueError(f"handoff must be a manifest object, got {type(manifest).__name__}")
    first, n = manifest.get("first_token"), manifest.get("num_tokens")
    if isinstance(first, bool) or not isinstance(first, int) or not 0 <= first < vocab_size:
        raise ValueError(f"handoff.first_token must be a token id in 0..{vocab_size - 1}, got {first!r}")
    if n != req.num_prompt_tokens:
        raise ValueError(f"handoff.num_tokens is {n!r}, but the prompt has {req.num_prompt_tokens} tokens")
    tp = manifest.get("tensor_parallel_size", 1)
    if tp != tensor_parallel_size:
        raise ValueError(
            f"handoff.tensor_parallel_size is {tp!r}, but this engine runs {tensor_parallel_size}: the prefill "
            f"and decode engines must run the same tensor-parallel size (each rank reads its own shard)"
        )
    ns = manifest.get("namespace")
    if ns != namespace:
        raise ValueError(f"handoff.namespace is {ns!r}, but this engine's pool namespace is {namespace!r}")
    mm_items = [MMItem(m.hash, m.offset, m.length) for m in req.mm]  # (keys of image blocks: P's, from the same images)
    probe = cache.new_request(req.request_id, req.prompt_token_ids, cache_salt=req.cache_salt, mm_items=mm_items)
    if manifest.get("keys") != cache.manifest_names(*cache.handoff_keys(probe, n)):
        raise ValueError(
            "handoff.keys do not match the blocks this engine would read for this prompt: "
            "the prefill engine runs another model, dtype, block size or cache_salt"
        )
    req.all_token_ids.append(first)
    req.output_token_ids.append(first)
    req.metrics["first_token"] = req.metrics["arrival"]
    req.handoff = dict(manifest)
    req.handoff_stop = scheduler.stop_reason(req, first)


def check_handoffs(
    scheduled: list[Request], finished: list[Request], pd_on_miss: str, scheduler: Scheduler, error_output: ErrorOutput
) -> list[RequestOutput]:
    """D: once a handed-off request ran its first step, how much of P's prompt did it find?
    Under ``pd_on_miss="error"``, a request that has to recompute any of it fails (its output
    returned; it leaves ``finished``)."""
    failed: list[RequestOutput] = []
    for req in scheduled:
        h = req.handoff
        if h is None or "result" in h or req.num_cached_tokens is None:
            continue  # (a failed load has lowered num_cached_tokens already)
        missing = req.num_prompt_tokens - req.num_cached_tokens
        h["missing_tokens"] = missing
        h["result"] = "ok" if missing == 0 else ("error" if pd_on_miss == "error" else "recomputed")
        if h["result"] == "error":
            msg = (
                f"PD hand-off: {missing} of the {req.num_prompt_tokens} prompt tokens were missing, "
                f"corrupt or late in the pool (pd_on_miss='error')"
            )
            if req in finished:
                finished.remove(req)
                scheduler.release(req)
            else:
                scheduler.abort(req.request_id)
            failed.append(error_output(req, msg, "handoff"))
    return failed


class Exports:
    """P: finished prefills whose prompt blocks are on their way to the pool, by request id."""

    def __init__(self, cache: CacheManager, namespace: str, timeout_s: float, tensor_parallel_size: int = 1) -> None:
        self.cache = cache
        self.namespace = namespace
        self.timeout_s = timeout_s
        self.tensor_parallel_size = tensor_parallel_size  # (D must run the same: the manifest says it)
        self._pending: dict[str, tuple[RequestOutput, Export, float]] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._pending

    def ids(self) -> set[str]:
        return set(self._pending)

    def start(self, req: Request, output: RequestOutput) -> None:
        """The prefill is done and its first token sampled: write the prompt to the pool; the
        output comes out of :meth:`finished` once it is there."""
        assert req.cache is not None  # a finished request not yet released
        exp = self.cache.export(req.cache, req.num_prompt_tokens)
        self._pending[req.request_id] = (output, exp, time.monotonic() + self.timeout_s)

    def discard(self, request_id: str) -> None:
        """Forget ``request_id``'s export (aborted or failed): its writes finish on their own."""
        self._pending.pop(request_id, None)

    def names(self, request_id: str) -> dict | None:
        """The manifest's names of ``request_id``'s export in flight (``namespace``, ``keys``,
        ``num_tokens``, and the prompt tokens P found cached: ``cached_tokens``, and per tier
        ``cached_tokens_by_tier``), or None if it is not exporting."""
        entry = self._pending.get(request_id)
        if entry is None:
            return None
        output, exp, _ = entry
        return {
            "namespace": self.namespace,
            "keys": list(exp.keys),
            "num_tokens": exp.num_tokens,
            "cached_tokens": output.num_cached_tokens,
            "cached_tokens_by_tier": dict(output.cached_tokens_by_tier),
        }

    def finished(self) -> list[RequestOutput]:
        """The outputs whose blocks the pool acked, or whose time ran out, with their manifests."""
        done = []
        now = time.monotonic()
        for rid, (output, exp, deadline) in list(self._pending.items()):
            late = now >= deadline
            if not (exp.done or late):
                continue
            del self._pending[rid]
            output.handoff = {
                "namespace": self.namespace,
                "keys": exp.keys,
                "num_tokens": exp.num_tokens,
                "first_token": output.token_ids[0],
                "complete": exp.done and not exp.failed,
                "failed_blocks": exp.failed + (exp.num_waiting if late else 0),
                "stored_before": exp.skipped,
                "seconds": now - output.metrics["first_token"] if output.metrics else None,
                "tensor_parallel_size": self.tensor_parallel_size,
            }
            done.append(output)
        return done
