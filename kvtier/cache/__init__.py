"""The engine-agnostic cache core: keys, pools, radix tree, policies, manager. Pure Python, no torch."""

from kvtier.cache.keys import BlockHasher, MMItem, ModelFingerprint, block_key, namespace_seed, object_name
from kvtier.cache.manager import CacheManager, CacheRequest, CacheStats, check_block_size, parse_capacity
from kvtier.cache.plan import MatchResult, StepPlan, TransferOp
from kvtier.cache.pool import BlockPool, DoubleFreeError
from kvtier.cache.storage_index import SimulatedStorage, StorageIndex

__all__ = [
    "BlockHasher",
    "BlockPool",
    "CacheManager",
    "CacheRequest",
    "CacheStats",
    "DoubleFreeError",
    "MMItem",
    "MatchResult",
    "ModelFingerprint",
    "SimulatedStorage",
    "StepPlan",
    "StorageIndex",
    "TransferOp",
    "block_key",
    "check_block_size",
    "namespace_seed",
    "object_name",
    "parse_capacity",
]
