"""Real pool servers for the storage tests (started on 127.0.0.1, stopped by PID)."""
from redis_servers import make_valkey, valkey_cluster, valkey_server  # noqa: F401
try:
    from mooncake_servers import make_mooncake_pool, mooncake_pool  # noqa: F401
except ImportError:  # TEMP while being written
    pass
