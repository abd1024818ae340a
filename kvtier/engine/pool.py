"""The engine's storage pool: opened with its fetch cost model, then bound to the host tier
(one storage object per host block: its KV bytes, then its routing bytes, as zero-copy views)."""

from __future__ import annotations

import sys

import numpy as np
import torch

from kvtier.cache import ModelFingerprint
from kvtier.cache.cost import FetchCostModel
from kvtier.engine.config import EngineConfig
from kvtier.storage import BlobLayout, namespace_digest, open_storage
from kvtier.storage.client import StorageClient, default_storage_workers

# With a storage pool, its I/O threads take and give back the interpreter lock at every syscall,
# and the engine thread gives it up in every torch call; at CPython's default 5 ms switch
# interval the engine thread waited up to that long to get it back (H100, 0.6B: a device hit with
# puts in flight took 15.4 ms at 5 ms, 7.7 ms at 0.5 ms; without a pool 9.4 ms). Process-wide;
# only ever lowered.
IO_SWITCH_INTERVAL_S = 0.0005


def open_pool(c: EngineConfig) -> tuple[StorageClient | None, FetchCostModel | None]:
    """The pool ``c.storage`` names (None, None without one) and its fetch cost model: always
    measured, deciding only under ``storage_fetch="auto"``."""
    storage = open_storage(
        c.storage, workers=c.storage_workers or default_storage_workers(), put_workers=c.storage_put_workers or 1
    )
    if storage is None:
        return None, None
    cost = FetchCostModel(
        storage.backend.scheme, storage.workers, storage.batch, 0, c.block_size, always=c.storage_fetch == "always"
    )
    storage.on_fetch_io = cost.observe_fetch
    storage.on_fetch_busy = cost.observe_busy
    return storage, cost


def bind_pool(
    storage: StorageClient,
    cost: FetchCostModel | None,
    host_kv: torch.Tensor,
    routing_store: np.ndarray | None,
    fingerprint: ModelFingerprint,
) -> None:
    """Bind ``storage`` to the host tier (and the routing rows stored beside it,
    ``ExpertCapture.host_store``) and calibrate the cost model on this pool's speed."""
    if sys.getswitchinterval() > IO_SWITCH_INTERVAL_S:
        sys.setswitchinterval(IO_SWITCH_INTERVAL_S)
    host_u8 = host_kv.view(torch.uint8).numpy()  # [num_host_blocks, block bytes...]
    layout = BlobLayout(
        namespace_digest(storage.namespace, fingerprint.encode()),
        str(host_kv.dtype).removeprefix("torch."),
        tuple(host_kv.shape[1:]),
        fingerprint.block_size,
        host_u8[0].nbytes,
        routing_store[0].nbytes if routing_store is not None else 0,
    )
    rows = (lambda h: routing_store[h].view(np.uint8)) if routing_store is not None else None
    storage.bind(layout, host_u8.__getitem__, rows)
    if cost is not None:
        cost.block_nbytes = layout.nbytes
        storage.calibrate()
