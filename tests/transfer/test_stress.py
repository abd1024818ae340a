"""Stress: loads, backups, frees, swaps and forwards for many steps, checking every block's bytes.

The cache manager plans, the transfer engine copies on its streams, and a synthetic "forward" on
the compute stream reads and writes real KV memory layer by layer, exactly where the model would
(after the engine's per-layer hook). Every full block of KV holds a value derived from its block
key, layer and K/V, so a block that is read must hold precisely that value: a backup racing the
compute stream, a block reused before its copy finished, a load seen before its bytes landed or
a layer mix-up all show up as mismatches, counted on the GPU (no sync per step) and checked at
the end, together with every device and host copy in the tree.

On the GPU each layer of the forward first spins (``torch.cuda._sleep``) to widen race windows.
On CPU the same program runs with synchronous copies (the CPU twin); CI runs fewer steps.
"""

from __future__ import annotations

import random
from typing import Any, Callable, Sequence

import pytest
import torch

from kvtier.cache import CacheManager, SimulatedStorage
from kvtier.transfer import copy as reference
from kvtier.transfer.engine import TransferEngine

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
BS, L, H, D = 4, 3, 2, 24
PREFIXES = [[(7 * p + 3 * i) % 13 for i in range(40)] for p in range(5)]
GARBAGE = -1.0


def block_value(key: bytes, layer: int, kv: int) -> float:
    """Exact in fp32: 23 bits from the key, layer and K/V."""
    return float((int.from_bytes(key[:4], "little") + 2 * layer + kv) % (1 << 23))


class Harness:
    def __init__(self, policy: str, seed: int, mode: str = "layers", storage: bool = False) -> None:
        self.rng = random.Random(seed)
        self.mode = mode  # TransferEngine.load_mode of the forwards' loads
        # storage: a pool the harness itself serves (fetches write the blocks' values into host
        # memory, landing a few steps later); its hits are prefetched, then preloaded to the device
        self.mgr = CacheManager(
            block_size=BS,
            num_device_blocks=40,
            num_host_blocks=56,
            storage=SimulatedStorage(None) if storage else None,
            write_policy=policy,
            write_through_threshold=3,
            block_nbytes=L * 2 * BS * H * D * 4,
            fetch_chunk_blocks=3,
        )
        self.storage_ops: list = []  # fetches and puts in flight (the harness's pool)
        buf = torch.full((L, 2, 40, BS, H, D), GARBAGE, device=DEVICE)
        self.kv = list(buf.unbind(0))
        host = torch.full((56, L, 2, BS, H, D), GARBAGE)
        self.host = host.pin_memory() if CUDA else host
        self.engine = TransferEngine(self.kv, self.host)
        self.bad = torch.zeros((), dtype=torch.int64, device=DEVICE)
        self.reqs: list[dict] = []
        self.rid = 0

    # ---------------------------------------------------------------- requests
    def add(self) -> None:
        tokens = self.rng.choice(PREFIXES)[: self.rng.randrange(0, 41)] + [
            self.rng.randrange(13) for _ in range(self.rng.randint(1, 6))
        ]
        creq = self.mgr.new_request(self.rid, tokens)
        self.rid += 1
        self.reqs.append({"creq": creq, "tokens": tokens, "computed": 0, "scheduled": 0})

    def schedule(self) -> None:
        for r in self.reqs:
            creq = r["creq"]
            if not creq.admitted:
                m = self.mgr.match_prefix(creq)
                if m.num_storage_blocks and self.mgr.prefetch(creq):
                    continue  # its storage hits are landing
                if self.mgr.prefetch_pending(creq) and self.rng.random() < 0.8:
                    continue  # (else admitted early: preloads still in flight)
                m = self.mgr.match_prefix(creq)
                cached = (m.num_device_blocks + m.num_host_blocks) * BS
                n = min(len(r["tokens"]), cached + self.rng.randint(1, 12))
                if self.mgr.allocate(creq, n):
                    m = creq.match
                    r["computed"] = (m.num_device_blocks + m.num_host_blocks) * BS
                    r["scheduled"] = n - r["computed"]
            elif r["scheduled"] == 0:
                if r["computed"] >= len(r["tokens"]):
                    r["tokens"].append(self.rng.randrange(13))  # decode: a sampled token
                n = min(len(r["tokens"]), r["computed"] + self.rng.randint(1, 6))
                if self.mgr.allocate(creq, n):
                    r["scheduled"] = n - r["computed"]

    # ---------------------------------------------------------------- one step
    def step(self) -> None:
        mgr, eng = self.mgr, self.engine
        self.schedule()
        eng.load_mode = self.mode
        self.pump()  # loads queued (GPU) / landed (CPU)
        eng.load_mode = "whole"
        hook: Callable[[int], None] | None = eng.layer_hook()  # gated: queues them
        if self.mode == "gated":
            assert eng.gates is not None
            hook = eng.gates.wait  # what a step graph waits on
        running = [r for r in self.reqs if r["creq"].admitted and r["scheduled"]]
        plans = []
        for r in running:
            creq = r["creq"]
            end = r["computed"] + r["scheduled"]
            keys = mgr.sync_keys(creq, end)
            table = creq.block_table
            reads = [(table[i], keys[i]) for i in range(r["computed"] // BS)]
            writes = [(table[i], keys[i] if (i + 1) * BS <= end else None) for i in range(r["computed"] // BS, -(-end // BS))]
            plans.append((reads, writes))
        for layer in range(L):
            if hook is not None:
                hook(layer)
            if CUDA:
                torch.cuda._sleep(20_000)  # a slow layer: races get room to happen
            for reads, writes in plans:
                for kvi in (0, 1):
                    if reads:
                        idx = torch.tensor([b for b, _ in reads], device=DEVICE)
                        want = torch.tensor([block_value(k, layer, kvi) for _, k in reads], device=DEVICE)
                        got = self.kv[layer][kvi, idx]
                        self.bad += (got != want[:, None, None, None]).sum()
                    for b, k in writes:
                        self.kv[layer][kvi, b].fill_(GARBAGE if k is None else block_value(k, layer, kvi))
        rewinds = self.complete(eng.wait_loads())
        assert not rewinds, rewinds
        for r in running:
            r["computed"] += r["scheduled"]
            r["scheduled"] = 0
            mgr.commit(r["creq"], r["computed"])
        self.pump()  # backups of what was just written
        # finish, preempt by swap, or keep going
        for r in list(self.reqs):
            if r["creq"].admitted and r["scheduled"] == 0 and self.rng.random() < 0.15:
                (mgr.swap_out if self.rng.random() < 0.5 else mgr.free)(r["creq"])
                self.reqs.remove(r)
        if len(self.reqs) < 6 and self.rng.random() < 0.6:
            self.add()

    def complete(self, landed) -> dict:
        rewinds: dict = {}
        for op_id, failed in landed:
            assert not failed, (op_id, failed)
            rewinds.update(self.mgr.complete(op_id, failed))
        return rewinds

    def pump(self) -> None:
        while True:
            plan = self.mgr.take_plan()
            for op in plan:
                if op.kind in ("fetch", "put"):
                    self.storage_ops.append(op)
                else:
                    self.engine.submit(op)
            landed = self.engine.poll() + self.serve_storage(all_of_them=False)
            self.complete(landed)
            if not plan and not landed:
                return

    def serve_storage(self, all_of_them: bool) -> list:
        """The pool's side: a fetch writes its blocks' values into their host blocks, a put checks
        what it reads; each lands now with probability 1/2 (in any order), or ``all_of_them``."""
        landed: list[tuple[int, list[int]]] = []
        for op in list(self.storage_ops):
            if not all_of_them and self.rng.random() < 0.5:
                continue
            self.storage_ops.remove(op)
            if op.kind == "fetch":
                for key, b in zip(op.keys, op.dst_blocks):
                    for layer in range(L):
                        for kvi in (0, 1):
                            self.host[b, layer, kvi].fill_(block_value(key, layer, kvi))
            else:
                for key, b in zip(op.keys, op.src_blocks):
                    assert (self.host[b, 0, 1] == block_value(key, 0, 1)).all(), "a put reads a wrong host block"
            landed.append((op.op_id, []))
        return landed

    def finish(self) -> None:
        for r in self.reqs:
            self.mgr.free(r["creq"])
        self.reqs.clear()
        self.pump()
        while self.engine.num_in_flight or self.storage_ops:
            self.complete(self.engine.drain() + self.serve_storage(all_of_them=True))
            self.pump()
        if CUDA:
            torch.cuda.synchronize()
        assert int(self.bad) == 0, f"{int(self.bad)} KV elements read with the wrong content"
        self.mgr.assert_invariants()
        for node in self.mgr.tree.nodes.values():
            for layer in range(L):
                for kvi in (0, 1):
                    v = block_value(node.key, layer, kvi)
                    if node.device_block is not None:
                        assert (self.kv[layer][kvi, node.device_block] == v).all(), f"device copy of {node}"
                    if node.host_block is not None and node.host_ready:
                        assert (self.host[node.host_block, layer, kvi] == v).all(), f"host copy of {node}"


_GPU_ONLY = pytest.mark.skipif(not CUDA, reason="GPU only: the CPU twin copies with the torch reference ops in any mode")


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
@pytest.mark.parametrize(
    "mode", ["layers", "gated", pytest.param("gated-dma", marks=_GPU_ONLY), pytest.param("whole", marks=_GPU_ONLY)]
)
def test_every_block_holds_its_kv_through_thousands_of_async_steps(policy, mode, monkeypatch):
    """``layers``: the eager forward's per-layer event waits; ``gated``: the layer gates a step
    graph waits on (CPU: a closed gate at its wait raises); ``gated-dma``: gated, with every run
    of 2+ consecutive host blocks by DMA into staging and its scatter on the scatter stream;
    ``whole``: loads queued all layers at once go by DMA through a 3-block staging buffer, so
    pieces reuse the buffer many times per copy."""
    from kvtier.transfer import kernels

    if mode.startswith("gated"):  # gate every load, however small (the GPU stages small ones)
        monkeypatch.setattr(kernels, "TUNING", dict(kernels.TUNING, min_gated_bytes=0))
    if mode == "whole":
        monkeypatch.setattr(
            kernels, "TUNING", dict(kernels.TUNING, min_dma_bytes_staged=1, staging_bytes=3 * L * 2 * BS * H * D * 4)
        )
    elif mode == "gated-dma":
        monkeypatch.setattr(kernels, "TUNING", dict(kernels.TUNING, min_dma_run_h2d=2, min_gated_bytes=0))
        scatters: list[int] = []
        real_scatter = kernels.scatter_staged

        def counted_scatter(*a: Any) -> None:
            scatters.append(1)
            real_scatter(*a)

        monkeypatch.setattr(kernels, "scatter_staged", counted_scatter)
    steps = 3000 if CUDA else 1000
    h = Harness(policy, seed=len(policy), mode="gated" if mode == "gated-dma" else mode)
    for i in range(steps):
        h.step()
        if CUDA and i % 500 == 499:
            assert int(h.bad) == 0, f"mismatch by step {i}"
    h.finish()
    stats = h.mgr.stats  # the program exercised what it is meant to
    assert stats.hit_tokens["host"] > 0 and stats.bytes_moved["device_to_host"] > 0
    if policy != "write_through":  # write_through leaves a swap nothing to copy
        assert stats.swapped_out_blocks > 0
    if mode.startswith("gated"):
        assert h.engine.gates is not None and h.engine.gates.closes > 0
    if mode == "gated-dma":
        assert scatters  # runs went by DMA + scatter stream


class LostLoads:
    """The reference copies, except that a host-to-device copy writes garbage: the bytes never
    arrive, yet the op is reported as landed."""

    def host_to_device(
        self, host: torch.Tensor, kv: list[torch.Tensor], src: Sequence[int], dst: Sequence[int], layer: int | None = None
    ) -> None:
        for each in range(L) if layer is None else (layer,):
            kv[each][:, list(dst)] = GARBAGE

    def __getattr__(self, name: str) -> Any:
        return getattr(reference, name)


def test_a_read_before_the_load_landed_is_caught():
    """The check itself: skipping the per-layer wait on the GPU (or the copy on CPU) must be seen."""
    h = Harness("write_through", seed=5)
    h.engine.ops = LostLoads()  # type: ignore[assignment]  # (a stand-in for the copy module)
    for _ in range(300):
        h.step()
        if h.mgr.stats.hit_tokens["host"]:
            break
    for _ in range(3):
        h.step()
    assert h.mgr.stats.hit_tokens["host"] > 0
    with pytest.raises(AssertionError, match="wrong content|copy of"):
        h.finish()


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
@pytest.mark.parametrize("mode", ["layers", "gated"])
def test_every_block_holds_its_kv_with_storage_hits_preloaded_as_they_land(policy, mode, monkeypatch):
    """A storage pool under the tiers: storage hits are fetched chunk by chunk and preloaded to
    the device as each lands, while other requests' forwards, loads and backups run; a request is
    sometimes admitted with preloads still in flight. Every block read holds its KV."""
    from kvtier.transfer import kernels

    if mode == "gated":
        monkeypatch.setattr(kernels, "TUNING", dict(kernels.TUNING, min_gated_bytes=0))
    h = Harness(policy, seed=7 + len(policy), mode=mode, storage=True)
    preloaded = []
    real = h.mgr.prefetcher.complete_preload

    def complete_preload(items, failed):
        out = real(items, failed)
        preloaded.append(sum(1 for _pf, n, b in items if n.device_block == b))
        return out

    monkeypatch.setattr(h.mgr.prefetcher, "complete_preload", complete_preload)
    for i in range(2000 if CUDA else 600):
        h.step()
    h.finish()
    stats = h.mgr.stats
    assert stats.hit_tokens["storage"] > 0, stats
    assert sum(preloaded) > 0, "no preload became a device copy"
