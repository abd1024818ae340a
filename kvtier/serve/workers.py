"""The router's view of its instances' caches (``kvtier router --workers --policy cache_aware``).

Per instance, a :class:`~kvtier.serve.route.PrefixIndex` fed by its KV events: the router takes
``GET /kvtier/kv_events/snapshot`` once (and again after a gap, a restart of the instance or of
the router), then polls ``GET /kvtier/kv_events?since=N`` every ``interval`` seconds and applies
what came. An instance that does not answer a poll within :data:`POLL_TIMEOUT_S` is stalled: out
of the rotation at once, its index kept, polled on; its next answer brings it back with the events
it missed (its numbering says whether any were lost: then a snapshot). One that cannot be reached,
or that fails its health check (a stall that lasts), is down: its index is dropped, and it rejoins
with a snapshot, its overlap counting 0 until then. (A busy engine answers its events between
steps: on four 8B instances under load, one step past a second would otherwise cost the index of
every conversation the instance held, and send their next turns elsewhere.)

With ``--storage URL`` (the pool the instances share) the router also asks the pool how many of
a request's leading blocks it holds (one lookup per choice; a cold prompt is one name, as the
engines ask): those past what an instance holds count for it as storage hits
(serve/route.py). Nothing of the pool is indexed: it is shared, so it is asked.

A request's keys are the instance's own (cache/keys.py): the router tokenizes the request as the
server does (``serve/prompts.py``; only the tokenizer is loaded, from ``--tokenizer`` or the
directory the instances' ``/v1/models`` name: its ``root``) and chains the block keys with the salt and the
model fingerprint the snapshot gave. A request it cannot tokenize is routed by load alone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from kvtier.cache.keys import BlockHasher, encoded_seed
from kvtier.serve.route import Candidate

if TYPE_CHECKING:
    from kvtier.serve.backend import Backend
    from kvtier.storage.client import StorageClient

log = logging.getLogger(__name__)
POLL_TIMEOUT_S = 1.0  # a poll or snapshot, call to last byte: past it the instance is stalled (module docstring)
DEFAULT_CONTEXT = 1 << 20  # tokens a prompt is keyed up to where no instance said its context
MAX_EVENTS_BYTES = 64 * 1024 * 1024  # one poll's answer (10,000 events at most, ~80 bytes each)


class CacheView:
    """Every instance's index and the keying of requests (module docstring)."""

    def __init__(self, interval: float = 0.1, tokenizer: str | None = None, storage: str | None = None) -> None:
        self.interval = interval
        self.tokenizer_path = tokenizer
        # the instances' shared pool (--storage), asked how much of a prompt it holds: one client
        # per shard count (instances of N tensor-parallel ranks name N objects per block)
        self.storage = storage
        self.pools: dict[int, StorageClient] = {}
        if storage is not None:
            self._pool(1)  # (a bad URL is named now, not at the first request)
        self._prompts: Any = None  # serve/prompts.PromptTokenizer, loaded at first need
        self._tokenizer_tried = False
        self._model_root: str | None = None  # the instances' model directory (their /v1/models)
        self._context: int | None = None  # ... and its context: no prompt is tokenized past it
        self.resyncs = 0  # snapshots taken after the first one of an instance (gaps, rejoins)

    # ------------------------------------------------------------------ events
    async def poll(self, client: httpx.AsyncClient, b: Backend) -> None:
        """One round for ``b``: a snapshot if its index is not in step, else the new events."""
        if not b.healthy:
            self.drop(b)
            return
        try:
            if b.seq is None:
                snap = await self._get(client, b, "/kvtier/kv_events/snapshot")
                b.index.reset((bytes.fromhex(k) for k in snap["device"]), (bytes.fromhex(k) for k in snap["host"]))
                b.keying = (int(snap["block_size"]), str(snap["hash"]), bytes.fromhex(snap["fingerprint"]))
                shards = snap.get("storage_shards")
                b.storage_shards = shards if isinstance(shards, int) and shards >= 1 else 1
                if b.synced_once:
                    self.resyncs += 1
                b.synced_once = True
                b.seq = int(snap["seq"])
                if self._context is None:
                    await self._find_model(client, b)
                return
            got = await self._get(client, b, f"/kvtier/kv_events?since={b.seq}")
            if got.get("gap"):
                log.info("instance %s: KV events were lost (a gap after %d): taking a snapshot", b.url, b.seq)
                b.seq = None
                return
            for _seq, kind, tier, key in got["events"]:
                b.index.apply(kind, tier, bytes.fromhex(key))
            b.seq = int(got["events"][-1][0]) if got["events"] else b.seq
            if b.stalled:
                log.info("instance %s answers its KV events again: back in the rotation", b.url)
                b.stalled = False
        except (httpx.HTTPError, asyncio.TimeoutError) as e:
            # late: stalled; not reached (a connect timeout too) or failed: down
            late = isinstance(e, (httpx.TimeoutException, asyncio.TimeoutError)) and not isinstance(e, httpx.ConnectTimeout)
            if late:
                if not b.stalled:
                    log.warning(
                        "instance %s did not answer its KV events within %g s: out of the rotation until it does",
                        b.url,
                        POLL_TIMEOUT_S,
                    )
                b.stalled = True
            else:
                log.warning("instance %s did not answer its KV events (%s): out of the rotation", b.url, e)
                b.healthy = False
                self.drop(b)
        except (KeyError, TypeError, ValueError) as e:  # not a kvtier instance's answer
            b.warn_once(f"instance {b.url}: KV events unreadable ({e!r}): routed by load only")
            self.drop(b)

    async def _find_model(self, client: httpx.AsyncClient, b: Backend) -> None:
        """The model directory ``b`` serves (``/v1/models``' root: where the router's tokenizer is
        loaded from without ``--tokenizer``) and its context (what a prompt is tokenized up to)."""
        try:
            model = (await self._get(client, b, "/v1/models"))["data"][0]
            self._model_root, self._context = str(model["root"]), int(model["max_model_len"])
        except (httpx.HTTPError, asyncio.TimeoutError, LookupError, TypeError, ValueError) as e:
            log.debug("instance %s did not name its model: %r", b.url, e)

    async def _get(self, client: httpx.AsyncClient, b: Backend, path: str) -> dict:
        async def go() -> dict:
            r = await client.get(b.url + path, timeout=httpx.Timeout(POLL_TIMEOUT_S))
            r.raise_for_status()
            if len(r.content) > MAX_EVENTS_BYTES:
                raise ValueError(f"answer of {len(r.content)} bytes")
            out = r.json()
            if not isinstance(out, dict):
                raise TypeError("not a JSON object")
            return out

        return await asyncio.wait_for(go(), POLL_TIMEOUT_S)

    def drop(self, b: Backend) -> None:
        b.seq = None
        b.stalled = False
        b.index.reset()

    # ------------------------------------------------------------------ requests
    async def candidates(self, backends: list[Backend], kind: str, body: dict) -> tuple[list[Candidate], dict, int]:
        """What each of ``backends`` holds of the request, and its load; the request's keys per
        keying (for :meth:`sent`); its prompt tokens (0 if unknown)."""
        keys: dict[tuple, list[bytes]] = {}
        pooled: dict[tuple, int] = {}  # leading keys the shared pool holds, per keying and shard count
        now = time.monotonic()
        ids = None
        out = []
        for b in backends:
            if b.seq is None or b.keying is None:
                out.append(Candidate(load=b.inflight))
                continue
            if ids is None:
                ids = await self.token_ids(kind, body, b)
            if not ids:
                out.append(Candidate(load=b.inflight))
                continue
            if b.keying not in keys:
                bs, hash_name, fp = b.keying
                salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
                keys[b.keying] = BlockHasher(bs, encoded_seed(fp, salt, hash_name), hash_name).extend(ids)
            where = (b.keying, b.storage_shards)
            if where not in pooled:  # (a dead pool answers 0 at once: StorageClient's breaker)
                pool = self._pool(b.storage_shards) if self.storage is not None else None
                pooled[where] = await asyncio.to_thread(pool.lookup_prefix, keys[b.keying]) if pool is not None else 0
            out.append(b.index.candidate(keys[b.keying], b.keying[0], b.inflight, now, pooled[where]))
        return out, keys, len(ids or ())

    def _pool(self, shards: int) -> StorageClient:
        pool = self.pools.get(shards)
        if pool is None:
            from kvtier.storage import open_storage

            pool = open_storage(self.storage)
            assert pool is not None  # (a URL was given)
            if shards > 1:
                pool.shard(0, shards)  # (looks up every rank's object of a block)
            self.pools[shards] = pool
        return pool

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()

    def sent(self, b: Backend, keys: dict) -> None:
        """The request went to ``b``: its prompt's blocks are taken as held there (PrefixIndex)."""
        if b.keying in keys:
            b.index.predict(keys[b.keying], time.monotonic())

    async def token_ids(self, kind: str, body: dict, b: Backend) -> list[int]:
        """The request's prompt token ids as the server will see them; [] if unknown."""
        try:
            if kind == "completion":
                prompt = body.get("prompt")
                if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
                    prompt = prompt[0]  # a batch: the first prompt's prefix decides
                if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                    return list(prompt)
                if not isinstance(prompt, str):
                    return []
                prompts = await self._tokenizer(b)
                return [] if prompts is None else await prompts.completion_ids(prompt, prompts.max_model_len, owner=id(body))
            messages = body.get("messages")
            if not isinstance(messages, list):
                return []
            prompts = await self._tokenizer(b)
            if prompts is None:
                return []
            add = body.get("add_generation_prompt", True) is not False
            return await prompts.chat_ids(messages, add, prompts.max_model_len, owner=id(body))
        except Exception as e:  # a request the router cannot key goes by load
            log.debug("could not tokenize a request for routing: %r", e)
            return []

    async def _tokenizer(self, b: Backend) -> Any:
        if self._tokenizer_tried:
            return self._prompts
        path = self.tokenizer_path or self._model_root
        if not path:  # (no instance has named its model yet: asked again at the next request)
            return None
        self._tokenizer_tried = True
        from kvtier.model.tokenizer import load_tokenizer
        from kvtier.serve.prompts import PromptTokenizer

        if not Path(path).is_dir():
            from kvtier.model.hub import resolve_model

            path = str(resolve_model(path, None, "dummy"))
        tok = await asyncio.get_running_loop().run_in_executor(None, load_tokenizer, path)
        # a prompt past the context is not tokenized (the server refuses it): routed by load
        self._prompts = PromptTokenizer(tok, self._context or DEFAULT_CONTEXT) if tok is not None else None
        return self._prompts
