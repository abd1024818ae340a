"""Real pool servers for the storage tests (started on 127.0.0.1, stopped by PID): Valkey/Redis
standalone and cluster (redis_servers), a Mooncake master + pool node (mooncake_servers)."""
from mooncake_servers import make_mooncake_pool, mooncake_pool  # noqa: F401
from redis_servers import make_valkey, valkey_cluster, valkey_server  # noqa: F401
