"""Start every pool the tests use (Valkey standalone + 3-primary cluster, Mooncake master + node,
a file:// pool on tmpfs), run `kvtier bench storage` against all of them, stop them.

    python scripts/bench_pools.py [--objects 128 --repeat 5 ...]   (extra flags go to the bench)
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "storage"))
from redis_servers import start_cluster, start_standalone  # noqa: E402

from kvtier.storage.mooncake_launch import start_pool  # noqa: E402

work = tempfile.mkdtemp(prefix="kvtier-bench-pools-")
shm = tempfile.mkdtemp(prefix="kvtier-bench-pools-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
servers = []
try:
    servers.append(start_standalone(f"{work}/valkey"))
    servers.append(start_cluster(f"{work}/cluster", primaries=3))
    servers.append(start_pool(size="1GiB"))
    urls = [f"file://{shm}/pool", *(s.url for s in servers)]
    cmd = [sys.executable, "-m", "kvtier.cli", "bench", "storage", *sys.argv[1:]]
    for u in urls:
        cmd += ["--url", u]
    sys.exit(subprocess.run(cmd).returncode)
finally:
    for s in servers:
        s.stop()
