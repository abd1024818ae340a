"""The MTP block's draft chain, replayed from CUDA graphs (speculative decoding, engine/spec.py).

After a step's verification the MTP block has drafted each request's first token; drafts 2..k
come from k-1 more single-row passes, each fed its own last output and token. Run from Python,
each pass built its attention metadata on the host, uploaded it, launched ~30 kernels and synced
for its argmax: on one H100 80GB (8B shape, batch 1) the three passes of k = 3 took longer than
the verifying forward itself. Here the whole chain is one graph per padded batch size, over
static buffers::

    static  ids [Bmax]  positions [Bmax]  hidden [Bmax, H]  block_tables [Bmax, W + extra]
    pass s: seq_lens = positions + 1; slot = table[pos // block_size] * block_size + pos % bs;
            m = draft(ids, positions, hidden); ids = argmax(draft_logits(m)); tokens[s] = ids;
            hidden = m; positions += 1

Everything a pass needs is computed on the device from the one before, so a chain costs one
copy-in, one replay and no host sync (the caller reads ``tokens`` once, with the first draft).
A row whose chain runs past its block table (a request near its end: the scheduler covers k-1
positions ahead only where the request may still grow) finds the scratch block there (``extra``
columns, and every column past the request's table): its writes land where nothing reads, and
the caller drops those drafts. Padding rows are one token at position 0 of the scratch block.

On a CPU the same static-buffer path runs eagerly (``capture=False``) with exact host lengths
for the reference attention: that is its test.
"""

from __future__ import annotations

import numpy as np
import torch

from kvtier.model.attention import AttentionMetadata


class DraftGraphs:
    """The k-1 chained MTP passes of a decoding batch (module docstring)."""

    def __init__(
        self,
        model,
        kv_caches: list[torch.Tensor],
        block_size: int,
        max_model_len: int,
        max_batch: int,
        passes: int,
        scratch_block: int,
        device: torch.device,
        capture: bool,
        pool=None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.passes = passes
        self.scratch_block = scratch_block
        self.device = device
        self.capture = capture
        self.pool = pool
        buckets = [b for b in (1, 2, 4, 8) if b <= max_batch] + list(range(16, max_batch + 1, 16))
        if buckets[-1] < max_batch:
            buckets.append(max_batch)
        self.buckets = buckets
        rows = buckets[-1]
        # a chain starts at most at a table's last position and runs passes - 1 past it
        self.width = -(-max_model_len // block_size) + -(-passes // block_size) + 1
        self.max_len = self.width * block_size  # the kernels' length bound (lengths come from the device)
        i32, i64 = torch.int32, torch.int64
        cfg = model.config
        dtype = next(model.parameters()).dtype
        self.ids = torch.zeros(rows, dtype=i64, device=device)
        self.positions = torch.zeros(rows, dtype=i64, device=device)
        self.hidden = torch.zeros(rows, cfg.hidden_size, dtype=dtype, device=device)
        self.block_tables = torch.full((rows, self.width), scratch_block, dtype=i32, device=device)
        self.seq_lens = torch.ones(rows, dtype=i32, device=device)
        self.slot_mapping = torch.zeros(rows, dtype=i64, device=device)
        self.query_start_loc = torch.arange(rows + 1, dtype=i32, device=device)
        self.tokens = torch.zeros(passes, rows, dtype=i64, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._stream: torch.cuda.Stream | None = None
        self.runs = 0  # chains run through this path (replayed, or eagerly on a CPU)

    def bucket(self, n: int) -> int | None:
        for b in self.buckets:
            if b >= n:
                return b
        return None

    def _meta(self, bp: int, lens: list[int] | None) -> AttentionMetadata:
        host = lens if lens is not None else [self.max_len] * bp
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bp],
            query_start_loc=self.query_start_loc[: bp + 1],
            seq_lens=self.seq_lens[:bp],
            block_tables=self.block_tables[:bp],
            query_lens_cpu=[1] * bp,
            seq_lens_cpu=host,
            max_query_len=1,
            max_seq_len=max(host),
        )

    def _chain(self, bp: int, host_positions: list[int] | None) -> None:
        """The passes over rows [0, bp) (captured, or eager with ``host_positions``' lengths)."""
        bs = self.block_size
        ids, pos, cur = self.ids[:bp], self.positions[:bp], self.hidden[:bp]
        table = self.block_tables[:bp]
        for s in range(self.passes):
            self.seq_lens[:bp].copy_(pos + 1)
            block = table.gather(1, torch.div(pos, bs, rounding_mode="floor")[:, None])[:, 0].long()
            self.slot_mapping[:bp].copy_(block * bs + torch.remainder(pos, bs))
            lens = None if host_positions is None else [p + 1 + s for p in host_positions]
            cur = self.model.draft(ids, pos, cur, self.kv_caches, self._meta(bp, lens))
            ids = self.model.draft_logits(cur).argmax(dim=-1)
            self.tokens[s, :bp].copy_(ids)
            pos = pos + 1

    def capture_all(self) -> None:
        """Capture every bucket now (engine start), not under a step's requests."""
        if self.capture:
            for bp in self.buckets:
                self._graph(bp)

    def _graph(self, bp: int) -> torch.cuda.CUDAGraph:
        if bp not in self._graphs:
            self._pad(0, bp)
            torch.cuda.synchronize(self.device)
            self._chain(bp, None)  # warm-up: compiles kernels outside the capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            if self._stream is None:
                self._stream = torch.cuda.Stream(self.device)
            with torch.cuda.graph(graph, pool=self.pool, stream=self._stream):
                self._chain(bp, None)
            if self.pool is None:
                self.pool = graph.pool()
            self._graphs[bp] = graph
        return self._graphs[bp]

    def _pad(self, start: int, end: int) -> None:
        """Rows [start, end): one token at position 0 of the scratch block."""
        if end > start:
            self.ids[start:end].zero_()
            self.positions[start:end].zero_()
            self.hidden[start:end].zero_()
            self.block_tables[start:end].fill_(self.scratch_block)

    def run(self, ids: torch.Tensor, positions: list[int], hidden: torch.Tensor, tables: list[list[int]]) -> torch.Tensor:
        """Drafts 2..passes+1 [passes, B] of B rows: ``ids`` the first drafts (on the device),
        ``positions`` where the chain's first pass writes (the row after the last accepted
        position), ``hidden`` the MTP block's output there, ``tables`` the requests' block tables."""
        n = len(positions)
        bp = self.bucket(n)
        assert bp is not None, f"{n} drafting rows exceed the chain's {self.buckets[-1]}"
        graph = self._graph(bp) if self.capture else None  # capture first: it resets the buffers
        table = np.full((n, self.width), self.scratch_block, dtype=np.int32)
        for row, t in zip(table, tables):
            row[: len(t)] = t
        self.block_tables[:n].copy_(torch.from_numpy(table))
        self.positions[:n].copy_(torch.tensor(positions, dtype=torch.int64))
        self.ids[:n].copy_(ids)
        self.hidden[:n].copy_(hidden)
        self._pad(n, bp)
        self.runs += 1
        if graph is None:
            self._chain(bp, list(positions) + [0] * (bp - n))
        else:
            graph.replay()
        return self.tokens[:, :n]
