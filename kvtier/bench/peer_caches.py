"""vLLM's and SGLang's prefix caches behind ``kvtier bench peers``'s peer interface.

Their real classes, unmodified, on the CPU; written against vllm 0.33.0 and sglang 0.5.23 (the
versions ``kvtier[peers]`` pins: these are internal APIs, they move between releases):

    vllm    vllm.v1.core.kv_cache_manager.KVCacheManager (block pool + hash-keyed prefix cache),
            request block hashes from vllm.v1.core.kv_cache_utils.get_request_block_hasher
    sglang  sglang.srt.mem_cache.radix_cache.RadixCache over a PagedTokenToKVPoolAllocator, driven
            the way its scheduler does (match, lock, allocate; insert after the prefill; unlock)

What is timed is what the peer's scheduler calls per request; building the engine-side request
object is not (kvtier's adapter builds none).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Admitted:
    """A request a peer's cache admitted."""

    handle: Any  # what the peer needs to publish and finish this request
    num_cached_tokens: int  # prompt tokens served from the cache
    phases_ns: dict[str, int]  # time of each step of the admission


class VllmPeer:
    def __init__(self, num_blocks: int, block_size: int, hash_name: str = "sha256", max_model_len: int = 8192):
        import torch
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.request import Request

        digest = get_hash_fn_by_name(hash_name)
        init_none_hash(digest)
        self._hasher = get_request_block_hasher(block_size, digest)
        # one full-attention layer group: the KV shape does not matter to the bookkeeping
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
        config = KVCacheConfig(
            num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn"], spec)]
        )
        self.mgr = KVCacheManager(
            config, max_model_len=max_model_len, scheduler_block_size=block_size, hash_block_size=block_size, enable_caching=True
        )
        self._request, self._params = Request, SamplingParams(max_tokens=1)
        self.name = f"vllm[{hash_name}]"

    def admit(self, rid, tokens):
        req = self._request(str(rid), tokens, self._params, None)
        t0 = time.perf_counter_ns()
        req._block_hasher = self._hasher
        req.update_block_hashes()  # the chained block keys
        t1 = time.perf_counter_ns()
        hit_blocks, num_hit, _ = self.mgr.get_computed_blocks(req)
        t2 = time.perf_counter_ns()
        # pins the hits, allocates the rest and caches its full blocks (vLLM publishes here)
        if self.mgr.allocate_slots(req, len(tokens) - num_hit, num_hit, hit_blocks) is None:
            return None
        t3 = time.perf_counter_ns()
        req.num_computed_tokens = len(tokens)
        return Admitted(req, num_hit, {"hash": t1 - t0, "match": t2 - t1, "alloc+insert": t3 - t2})

    def publish(self, req) -> dict[str, int]:
        return {}  # done inside allocate_slots

    def finish(self, req) -> dict[str, int]:
        t0 = time.perf_counter_ns()
        self.mgr.free(req)
        return {"free": time.perf_counter_ns() - t0}

    def check(self) -> None:
        assert self.mgr.usage == 0.0, f"vLLM blocks still in use: {self.mgr.usage}"


def _let_sglang_import_on_cpu() -> None:
    """SGLang's import chain wants triton and torchvision. Without them: its own macOS stand-in
    for triton (``sglang/_platform_stubs.py``, installed as if on macOS) and an empty module for
    each torchvision import. Neither is used by the radix cache."""
    import platform

    import torch
    import transformers.utils.import_utils as hf_imports

    sglang = importlib.util.find_spec("sglang")
    assert sglang is not None and sglang.origin is not None, "sglang is not installed"
    spec = importlib.util.spec_from_file_location(
        "_sglang_platform_stubs", os.path.join(os.path.dirname(sglang.origin), "_platform_stubs.py")
    )
    assert spec is not None and spec.loader is not None
    stubs = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = stubs
    spec.loader.exec_module(stubs)
    if importlib.util.find_spec("triton") is None:
        # leave torch.Tensor.to alone
        stubs._patch_non_blocking = lambda: None  # type: ignore[attr-defined]  # a module loaded from a file
        saved = sys.platform, platform.machine, torch.backends.mps.is_available
        sys.platform, platform.machine, torch.backends.mps.is_available = ("darwin", lambda: "arm64", lambda: True)  # type: ignore[assignment]  # replaced for the import only
        try:
            stubs.install_platform_stubs()
        finally:
            sys.platform, platform.machine, torch.backends.mps.is_available = saved
    if importlib.util.find_spec("torchvision") is None:
        # transformers caches "torchvision available?": ask before the finder below exists
        hf_imports.is_torchvision_available(), hf_imports.is_torchvision_v2_available()

        class _EmptyTorchvision:
            def find_spec(self, fullname, path=None, target=None):
                if fullname.split(".")[0] != "torchvision":
                    return None
                module = sys.modules.setdefault(fullname, stubs._MockModule(fullname))
                return module.__spec__

        sys.meta_path.insert(0, _EmptyTorchvision())


class SglangPeer:
    name = "sglang"

    def __init__(self, num_blocks: int, block_size: int):
        _let_sglang_import_on_cpu()
        from array import array

        import torch
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

        self._torch, self._array = torch, array
        self._key, self._evict, self._insert, self._match = RadixKey, EvictParams, InsertParams, MatchPrefixParams
        self.page = block_size
        self.alloc = PagedTokenToKVPoolAllocator(
            size=num_blocks * block_size, page_size=block_size, dtype=torch.bfloat16, device="cpu", kvcache=None, need_sort=False
        )
        self.tree = RadixCache.create_simulated(mock_allocator=self.alloc, page_size=block_size)

    def admit(self, rid, tokens):
        ids = self._array("q", tokens)  # the request's input ids
        tree, alloc, page = self.tree, self.alloc, self.page
        t0 = time.perf_counter_ns()
        # the scheduler matches at most len - 1 tokens (one must be computed)
        match = tree.match_prefix(self._match(key=self._key(ids, limit=len(tokens) - 1)))
        num_hit, node = match.device_prefix_len, match.last_device_node
        lock = tree.lock(node)
        hit_slots = tree.path_device_indices(node)[:num_hit]
        t1 = time.perf_counter_ns()
        need = len(tokens) - num_hit
        want = -(-need // page) * page
        if alloc.available_size() < want:
            tree.evict(self._evict(num_tokens=want - alloc.available_size()))
        new_slots = alloc.alloc(want)
        if new_slots is None:
            tree.unlock(lock)
            return None
        slots = self._torch.cat([hit_slots, new_slots[:need]])  # the request's req_to_token row
        t2 = time.perf_counter_ns()
        handle = {"ids": ids, "slots": slots, "owned_from": num_hit, "lock": lock}
        return Admitted(handle, num_hit, {"match": t1 - t0, "alloc": t2 - t1})

    def publish(self, h) -> dict[str, int]:
        """After the prefill, as RadixCache's scheduler does: insert the full pages, free the
        request's copies of pages the tree already had, take the tree's, move the lock down."""
        tree, slots, owned = self.tree, h["slots"], h["owned_from"]
        t0 = time.perf_counter_ns()
        key = self._key(h["ids"]).page_aligned(self.page)
        inserted = tree.insert(self._insert(key=key, value=slots[: len(key)].to(self._torch.int64, copy=True)))
        self.alloc.free_segment(slots[owned : inserted.prefix_len], start_pos=owned)  # duplicates
        node = tree.match_prefix(self._match(key=key)).last_device_node
        tree_slots = tree.path_device_indices(node)
        slots[owned : len(tree_slots)] = tree_slots[owned:]
        h["owned_from"] = len(tree_slots)
        tree.unlock(h["lock"])
        h["lock"] = tree.lock(node)
        return {"insert": time.perf_counter_ns() - t0}

    def finish(self, h) -> dict[str, int]:
        t0 = time.perf_counter_ns()
        self.alloc.free_segment(h["slots"][h["owned_from"] :], start_pos=h["owned_from"])  # the partial page
        self.tree.unlock(h["lock"])
        return {"free": time.perf_counter_ns() - t0}

    def check(self) -> None:
        total = self.alloc.num_pages * self.page
        assert self.tree.protected_size_ == 0, f"SGLang tokens still locked: {self.tree.protected_size_}"
        assert self.alloc.available_size() + self.tree.evictable_size_ == total, (
            "SGLang pages leaked",
            self.alloc.available_size(),
            self.tree.evictable_size_,
            total,
        )
