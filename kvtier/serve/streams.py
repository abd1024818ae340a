"""Helpers for the async iterators an answer is made of (the engine's deltas, a stream's chunks):
take the first item apart (so that an error before it is a status code, not an in-stream error),
then go on with the rest."""

from __future__ import annotations

from typing import Any, AsyncIterator

END = object()  # what next_or_end gives at the end


async def next_or_end(it: AsyncIterator[Any]) -> Any:
    try:
        return await it.__anext__()
    except StopAsyncIteration:
        return END


async def prepend(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    if first is END:
        return
    yield first
    async for e in rest:
        yield e
