"""Real Mooncake Store pools for tests: a ``mooncake_master`` and one pool-node process on
127.0.0.1 (free ports), started by :func:`kvtier.storage.mooncake_launch.start_pool` and stopped by
PID at fixture teardown, even when the test failed or killed/paused a process (children also die
with the test process: ``PR_SET_PDEATHSIG`` and an ``atexit`` hook).

Fixtures (import them into a conftest or a test module)::

    mooncake_launch       (module scope) -> PoolHandle   256 MiB pool node; .url, .kill_node(),
                                                       .kill_master(), .kill(), .pause_node(),
                                                       .resume_node(), .restart(), .clear(), .stop()
    make_mooncake_launch  (function)     -> make(size="256MiB", lease_ttl_ms=2000) -> PoolHandle,
                                                       all stopped at teardown

Both skip the test, with the reason, when the ``mooncake`` package (``pip install
'kvtier[mooncake]'``) or its system libraries (``apt-get install -y libibverbs1``) are missing.
"""

from __future__ import annotations

from typing import Iterator

import pytest

from kvtier.storage.mooncake_launch import DEFAULT_LEASE_TTL_MS, PoolError, PoolHandle, find_master_binary, start_pool

POOL_SIZE = "256MiB"
_unavailable: list[str] = []


def mooncake_unavailable() -> str | None:
    """Why no Mooncake pool can run here (None: it can). Checked once per process."""
    if not _unavailable:
        reason = ""
        try:
            from kvtier.storage.mooncake_launch import import_store

            import_store()
            find_master_binary()
        except (ImportError, PoolError, OSError) as e:
            reason = f"Mooncake Store unavailable: {e}"
        _unavailable.append(reason)
    return _unavailable[0] or None


def _require() -> None:
    reason = mooncake_unavailable()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def mooncake_launch(tmp_path_factory) -> Iterator[PoolHandle]:
    """A 256 MiB pool (master + one node) shared by a test module."""
    _require()
    h = start_pool(size=POOL_SIZE, workdir=tmp_path_factory.mktemp("mooncake"))
    try:
        yield h
    finally:
        h.stop()


@pytest.fixture
def make_mooncake_launch(tmp_path_factory):
    """make(size="256MiB", lease_ttl_ms=2000) -> PoolHandle (fresh master + node on free ports)."""
    _require()
    started: list[PoolHandle] = []

    def make(size: int | str = POOL_SIZE, lease_ttl_ms: int = DEFAULT_LEASE_TTL_MS) -> PoolHandle:
        h = start_pool(size=size, lease_ttl_ms=lease_ttl_ms, workdir=tmp_path_factory.mktemp("mooncake-custom"))
        started.append(h)
        return h

    try:
        yield make
    finally:
        for h in reversed(started):
            try:
                h.stop()
            except Exception:
                h.kill()
