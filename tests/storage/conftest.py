"""Real pool servers for the storage tests (started on 127.0.0.1, stopped by PID): Valkey/Redis
standalone and cluster (redis_servers), a Mooncake master + pool node (mooncake_servers). Every
test keeps its weights digest cache in its own folder, not in the user's."""

import pytest

from kvtier.model.digest_cache import CACHE_DIR_ENV
from tests.storage.mooncake_servers import make_mooncake_launch, mooncake_launch  # noqa: F401
from tests.storage.redis_servers import make_valkey, valkey_cluster, valkey_server  # noqa: F401


@pytest.fixture(autouse=True)
def private_digest_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "kvtier-cache"))
