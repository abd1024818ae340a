"""One server behind ``kvtier router``, as the router sees it: its URL and role, health, the work
in flight on it, and its cache as its KV events say (the index serve/workers.py keeps in step).
The router (serve/router.py) routes over these; serve/workers.py polls them."""

from __future__ import annotations

import logging

from kvtier.redact import redact_url
from kvtier.serve.route import PrefixIndex

log = logging.getLogger(__name__)


class Backend:
    def __init__(self, url: str, role: str) -> None:
        url = url.rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"backend URL must start with http:// or https://, got {redact_url(url)!r}")
        if "@" in url.split("://", 1)[1].split("/", 1)[0]:
            raise ValueError(
                f"backend URL {redact_url(url)!r} holds credentials: the router authenticates to its "
                "servers with --backend-api-key (or $KVTIER_BACKEND_API_KEY), never with a URL's user or password"
            )
        self.url, self.role = url, role
        self.label = url  # how /metrics and /health name it (the Router sets "<role><i>" unless --expose-config)
        self.healthy = True
        self.info: dict = {}
        self._warned: set[str] = set()
        # --policy: the uncached tokens of the requests in flight on it (_load); its cache as its KV events say
        # (serve/workers.py): None until a snapshot put the index in step
        self.inflight = 0
        self.index = PrefixIndex()
        self.seq: int | None = None
        self.keying: tuple[int, str, bytes] | None = None  # block size, hash, fingerprint
        self.storage_shards = 1  # pool objects per block (its tensor-parallel ranks)
        self.synced_once = False
        self.stalled = False  # its last KV-event poll went unanswered: out of the rotation (serve/workers.py)

    @property
    def up(self) -> bool:
        """In the rotation: healthy, and answering its KV events (when the router polls them)."""
        return self.healthy and not self.stalled

    def warn_once(self, message: str) -> None:
        """Log ``message`` as a warning the first time it comes (each health check would repeat it)."""
        if message not in self._warned:
            self._warned.add(message)
            log.warning("%s", message)

    def __repr__(self) -> str:
        return f"{self.role}:{self.url}{'' if self.healthy else ' (down)'}{' (stalled)' if self.stalled else ''}"
