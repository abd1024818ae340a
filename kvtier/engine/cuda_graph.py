"""Decode steps replayed from CUDA graphs.

A decode step (one new token per sequence) launches ~40 kernels per layer; at small per-kernel
work the CPU cannot launch them as fast as the GPU runs them. So, per padded batch size
(1, 2, 4, 8, 16, 32, ...), the model forward is captured once over static input buffers and
each decode step copies its inputs in and replays the graph::

    static  input_ids [Bmax]  positions [Bmax]  slot_mapping [Bmax]  query_start_loc [Bmax+1]
            seq_lens [Bmax]   block_tables [Bmax, max_blocks]
    step of B sequences -> bucket Bp >= B: rows B..Bp-1 are padding: one token at position 0 of
    a scratch block that no request owns (its K/V writes land there and are never read).

The attention kernel reads sequence lengths from device memory, so one graph serves any
lengths up to ``max_model_len`` (captured with that as the maximum). MoE layers dispatch densely
at decode sizes (no host sync) and write their routed experts into a static buffer (R3).

On a CPU the same padded static-buffer path runs eagerly (``capture=False``): that is its test.
"""
from __future__ import annotations

import torch

from kvtier.model.attention import AttentionMetadata


class DecodeGraphs:
    def __init__(self, model, kv_caches: list[torch.Tensor], block_size: int, max_model_len: int,  # type: ignore[no-untyped-def]
                 max_batch: int, scratch_block: int, device: torch.device, capture: bool,
                 routing_shape: tuple[int, int] | None = None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.scratch_block = scratch_block
        self.device = device
        self.capture = capture
        self.buckets = [b for b in (1, 2, 4, 8) if b <= max_batch] + list(range(16, max_batch + 1, 16))
        if self.buckets[-1] < max_batch:
            self.buckets.append(max_batch)
        bmax = self.buckets[-1]
        self.max_blocks = -(-max_model_len // block_size)
        i32, i64 = torch.int32, torch.int64
        self.input_ids = torch.zeros(bmax, dtype=i64, device=device)
        self.positions = torch.zeros(bmax, dtype=i64, device=device)
        self.slot_mapping = torch.zeros(bmax, dtype=i64, device=device)
        self.query_start_loc = torch.arange(bmax + 1, dtype=i32, device=device)
        self.seq_lens = torch.ones(bmax, dtype=i32, device=device)
        self.block_tables = torch.full((bmax, self.max_blocks), scratch_block, dtype=i32, device=device)
        # R3: MoE layers write the step's expert ids here inside the graph
        self.routing_out = (torch.zeros((bmax, *routing_shape), dtype=i32, device=device)
                            if routing_shape is not None else None)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None]] = {}
        self._pool = None

    def capture_all(self) -> None:
        """Capture every bucket now (engine start), not at its first decode step: a capture
        takes tens of ms, which would stall the requests of that step."""
        if self.capture:
            for bp in self.buckets:
                self._graph(bp)

    def bucket(self, batch: int) -> int | None:
        for b in self.buckets:
            if b >= batch:
                return b
        return None

    def _meta(self, bp: int, seq_lens_cpu: list[int] | None) -> AttentionMetadata:
        """Captured: lengths come from device memory, the host only knows their bound. Eager
        (CPU twin): the reference backend reads the host lengths, so they are exact."""
        lens = seq_lens_cpu if seq_lens_cpu is not None else [self.max_model_len] * bp
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bp], query_start_loc=self.query_start_loc[:bp + 1],
            seq_lens=self.seq_lens[:bp], block_tables=self.block_tables[:bp],
            query_lens_cpu=[1] * bp, seq_lens_cpu=lens, max_query_len=1, max_seq_len=max(lens))

    def _forward(self, bp: int, seq_lens_cpu: list[int] | None = None) -> torch.Tensor:
        routing = self.routing_out[:bp] if self.routing_out is not None else None
        return self.model(self.input_ids[:bp], self.positions[:bp], self.kv_caches,
                          self._meta(bp, seq_lens_cpu), routing_out=routing)

    def _graph(self, bp: int):  # type: ignore[no-untyped-def]
        if bp not in self._graphs:
            self._reset_padding(0, bp)
            torch.cuda.synchronize(self.device)
            self._forward(bp)                        # warm-up: compiles kernels outside the capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = self._forward(bp)
            if self._pool is None:
                self._pool = graph.pool()
            self._graphs[bp] = (graph, out)
        return self._graphs[bp]

    def _reset_padding(self, start: int, end: int) -> None:
        """Rows [start, end): one token at position 0 of the scratch block."""
        if end <= start:
            return
        self.input_ids[start:end] = 0
        self.positions[start:end] = 0
        self.slot_mapping[start:end] = self.scratch_block * self.block_size
        self.seq_lens[start:end] = 1
        self.block_tables[start:end, 0] = self.scratch_block

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [B, hidden] of a decode step (every query length 1)."""
        batch = meta.num_seqs
        bp = self.bucket(batch)
        assert bp is not None and meta.max_query_len == 1
        width = meta.block_tables.shape[1]
        if width > self.max_blocks:
            raise ValueError(f"block table of {width} blocks exceeds max_model_len {self.max_model_len}")
        graph, out = self._graph(bp) if self.capture else (None, None)   # capture first: it resets the buffers
        self.input_ids[:batch].copy_(input_ids)
        self.positions[:batch].copy_(positions)
        self.slot_mapping[:batch].copy_(meta.slot_mapping)
        self.seq_lens[:batch].copy_(meta.seq_lens)
        self.block_tables[:batch, :width].copy_(meta.block_tables)
        self._reset_padding(batch, bp)
        if graph is None:
            return self._forward(bp, list(meta.seq_lens_cpu) + [1] * (bp - batch))[:batch]
        graph.replay()
        return out[:batch]
