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

from kvtier.engine.config import EngineConfig
from kvtier.engine.cuda_graph import Graphs, batch_buckets
from kvtier.engine.sampling import to_device
from kvtier.model.attention import AttentionMetadata


class DraftGraphs(Graphs):
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
        buckets = batch_buckets(max_batch)
        # a chain starts at most at a table's last position and runs passes - 1 past it: its
        # tables have that many more columns (the kernels' length bound grows with them)
        width = -(-max_model_len // block_size) + -(-passes // block_size) + 1
        rows = buckets[-1]
        super().__init__(model, kv_caches, block_size, width * block_size, rows, scratch_block, device, capture, None, pool)
        self.buckets = self.keys = buckets
        self.passes = passes
        dtype = next(model.parameters()).dtype
        self.hidden = torch.zeros(rows, model.config.hidden_size, dtype=dtype, device=device)
        self.tokens = torch.zeros(passes, rows, dtype=torch.int64, device=device)

    def _chain(self, bp: int, host_positions: list[int] | None) -> torch.Tensor:
        """The passes over rows [0, bp) (captured, or eager with ``host_positions``' lengths)."""
        bs = self.block_size
        ids, pos, cur = self.input_ids[:bp], self.positions[:bp], self.hidden[:bp]
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
        return self.tokens

    def _forward(self, bp: int, meta: AttentionMetadata) -> torch.Tensor:
        return self._chain(bp, None)  # (each pass makes its own metadata over the buffers)

    def _capture_meta(self, bp: int) -> AttentionMetadata:
        return self._meta(bp, None)

    def _reset(self, bp: int) -> None:
        self._pad(0, bp)

    def _pad(self, start: int, end: int) -> None:
        """Rows [start, end): one token at position 0 of the scratch block."""
        if end > start:
            self.input_ids[start:end].zero_()
            self.positions[start:end].zero_()
            self.hidden[start:end].zero_()
            self.block_tables[start:end].fill_(self.scratch_block)

    def run(self, ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, tables: list[list[int]]) -> torch.Tensor:
        """Drafts 2..passes+1 [passes, B] of B rows: ``ids`` the first drafts, ``positions``
        where the chain's first pass writes (the row after the last accepted position; both on
        the device, so a verification there needs no host sync before the chain), ``hidden``
        the MTP block's output there, ``tables`` the requests' block tables."""
        n = len(tables)
        bp = self.bucket(n)
        assert bp is not None, f"{n} drafting rows exceed the chain's {self.buckets[-1]}"
        graph, _ = self._graph(bp) if self.capture else (None, None)  # capture first: it resets the buffers
        table = np.full((n, self.max_blocks), self.scratch_block, dtype=np.int32)
        for row, t in zip(table, tables):
            row[: len(t)] = t
        # (through pinned memory: a copy from pageable memory would wait for the step's forward)
        self.block_tables[:n].copy_(to_device(table, self.device))
        self.positions[:n].copy_(positions)
        self.input_ids[:n].copy_(ids)
        self.hidden[:n].copy_(hidden)
        self._pad(n, bp)
        self.runs += 1
        if graph is None:
            self._chain(bp, positions.tolist() + [0] * (bp - n))  # (exact lengths for eager attention)
        else:
            graph.replay()
        return self.tokens[:, :n]


def build_chain(model, kv_caches: list[torch.Tensor], config: EngineConfig, pool=None) -> DraftGraphs | None:
    """An engine's draft chain (every tensor-parallel rank builds the same), captured on CUDA
    with ``config.cuda_graphs``; None for one draft (no chain). ``config``: resolved
    (engine/resolve.py)."""
    if config.num_speculative_tokens <= 1:
        return None
    assert config.max_model_len is not None and config.num_device_blocks is not None, "an unresolved config"
    device = torch.device(config.device)
    chain = DraftGraphs(
        model,
        kv_caches,
        config.block_size,
        config.max_model_len,
        min(config.max_num_seqs, 256),
        config.num_speculative_tokens - 1,
        config.num_device_blocks,  # the scratch block
        device,
        capture=bool(config.cuda_graphs) and device.type == "cuda",
        pool=pool,
    )
    chain.capture_all()
    return chain
