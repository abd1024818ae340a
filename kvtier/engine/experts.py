"""Rollout routing replay (R3) capture: routed expert ids kept per KV slot, beside the KV.

During a forward every MoE layer writes its top-k expert ids into ``buffer(T)`` (a device tensor
[T, num_moe_layers, top_k], no host sync). :meth:`record` then starts one non-blocking copy of
*only this step's rows* into pinned host memory on the compute stream and records an event.
:meth:`flush` (when the engine has a step's results, when a finished request needs its routing,
before a tier move) scatters the rows of every step that landed, in order, on the CPU into
routing blocks that mirror the KV blocks (a step still in flight under overlap scheduling is
left for later: its rows are for positions nobody reads yet)::

    device_store  [num_device_blocks, block_size, num_moe_layers, top_k]   (CPU, by device slot)
    host_store    [num_host_blocks,   block_size, num_moe_layers, top_k]   (CPU, by host block)

Routing follows its KV block: it is overwritten exactly when the block's KV is, copied with it
between tiers, and stored in the same storage object. So a prefix hit on any tier returns the
routing of the cached tokens. The dtype is the smallest unsigned int that holds an expert id.
"""

from __future__ import annotations

import numpy as np
import torch

from kvtier.engine.staging import PinnedRing

_RING = 4  # staging slots: steps whose rows may be on their way at once


def routing_dtype(num_experts: int) -> np.dtype:
    for dt in (np.uint8, np.uint16, np.uint32):
        if num_experts - 1 <= np.iinfo(dt).max:
            return np.dtype(dt)
    raise ValueError(f"too many experts: {num_experts}")


def routing_store(num_blocks: int, block_size: int, num_moe_layers: int, top_k: int, num_experts: int) -> np.ndarray:
    """Zeroed routing rows of ``num_blocks`` blocks: [num_blocks, block_size, num_moe_layers, top_k]
    of :func:`routing_dtype` (the layout stored beside each block's KV)."""
    return np.zeros((num_blocks, block_size, num_moe_layers, top_k), routing_dtype(num_experts))


class ExpertCapture:
    def __init__(
        self,
        num_moe_layers: int,
        top_k: int,
        num_experts: int,
        block_size: int,
        num_device_blocks: int,
        num_host_blocks: int,
        device: torch.device,
    ) -> None:
        self.num_moe_layers, self.top_k, self.num_experts = num_moe_layers, top_k, num_experts
        self.block_size = block_size
        self.dtype = routing_dtype(num_experts)
        self.device_store = routing_store(num_device_blocks, block_size, num_moe_layers, top_k, num_experts)
        self.host_store = routing_store(num_host_blocks, block_size, num_moe_layers, top_k, num_experts)
        self.device = device
        self._buf = torch.zeros((0, num_moe_layers, top_k), dtype=torch.int32, device=device)
        self._pending: list[tuple[torch.Tensor, np.ndarray, torch.cuda.Event | None]] = []
        self._ring = PinnedRing(device, _RING)  # pinned staging, reused (engine/staging.py)

    @property
    def bytes_per_token(self) -> int:
        return self.num_moe_layers * self.top_k * self.dtype.itemsize

    def buffer(self, num_tokens: int) -> torch.Tensor:
        if self._buf.shape[0] < num_tokens:  # grows to the largest step, reused after
            self._buf = torch.zeros((num_tokens, self.num_moe_layers, self.top_k), dtype=torch.int32, device=self.device)
        return self._buf[:num_tokens]

    def record(self, rows: torch.Tensor, slot_mapping: np.ndarray) -> None:
        """Start copying this step's rows to the host; no CPU wait."""
        if rows.device.type == "cuda":
            if len(self._pending) >= _RING - 1:  # its ring slot still holds rows not scattered
                self.flush(wait=True)
            copy = self._ring.download(rows)
            host, event = copy.host, copy.event
        else:
            host, event = rows.clone(), None
        self._pending.append((host, np.asarray(slot_mapping, dtype=np.int64), event))

    def flush(self, wait: bool = False) -> None:
        """Scatter the recorded steps whose rows have landed, in order, into the device-slot
        routing blocks. Every step whose results the engine has seen has landed (its routing was
        queued before its tokens); ``wait=True`` also waits for the steps still in flight."""
        flat = self.device_store.reshape(-1, self.num_moe_layers, self.top_k)
        while self._pending:
            host, slots, event = self._pending[0]
            if event is not None:
                if not wait and not event.query():
                    return
                event.synchronize()
            flat[slots] = host.numpy().astype(self.dtype)
            self._pending.pop(0)

    def gather(self, block_table: list[int], num_tokens: int) -> np.ndarray:
        """Routing of positions [0, num_tokens) of a request: [num_tokens, layers, top_k]."""
        self.flush()
        pos = np.arange(num_tokens)
        blocks = np.asarray(block_table, dtype=np.int64)[pos // self.block_size]
        return self.device_store[blocks, pos % self.block_size].copy()

    # ---- tier moves (called by the transfer executor with the KV copies)
    def device_to_host(self, device_blocks, host_blocks) -> None:
        self.flush()
        self.host_store[list(host_blocks)] = self.device_store[list(device_blocks)]

    def host_to_device(self, host_blocks, device_blocks) -> None:
        self.flush()
        self.device_store[list(device_blocks)] = self.host_store[list(host_blocks)]

    @property
    def block_nbytes(self) -> int:
        return self.block_size * self.bytes_per_token


def validate_routed_experts(routed: object, num_tokens: int, num_moe_layers: int, top_k: int, num_experts: int) -> np.ndarray:
    """Check a user-given routing array for ``llm.score``; returns it as int64."""
    if not isinstance(routed, np.ndarray):
        if isinstance(routed, torch.Tensor):
            routed = routed.detach().cpu().numpy()
        else:
            raise ValueError(f"routed_experts must be a numpy array, got {type(routed).__name__}")
    want = (num_tokens - 1, num_moe_layers, top_k)
    if routed.shape != want:
        raise ValueError(f"routed_experts has shape {routed.shape}, expected {want} (len(token_ids) - 1, num_moe_layers, top_k)")
    if routed.dtype.kind not in "iu":
        raise ValueError(f"routed_experts must have an integer dtype, got {routed.dtype}")
    if routed.size and (routed.min() < 0 or routed.max() >= num_experts):
        bad = routed.min() if routed.min() < 0 else routed.max()
        raise ValueError(f"routed_experts holds expert id {int(bad)}, outside 0..{num_experts - 1}")
    return routed.astype(np.int64)
