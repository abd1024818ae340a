"""Steps replayed from CUDA graphs: decode steps (:class:`DecodeGraphs`) and any other step of
at most 256 tokens (:class:`StepGraphs`: prefill chunks, extends over a cached prefix, mixed).

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

A step that is not pure decode (a device hit's 48 new tokens over a 4K cached prefix; a short
prompt; a prefill chunk beside decode rows) launched ~250 kernels from Python, 10-25 ms of CPU for
4 ms of GPU work on an H100 (0.6B model). :class:`StepGraphs` captures, per padded token count
(16, 32, 64, 128, 256), the forward of a step of that many tokens in any number of sequences::

    step of T tokens in S sequences -> bucket Tp >= T; static buffers hold the step's rows, then
    tokens T..Tp-1 as one padding sequence (positions 0.. in the scratch block, its slots
    written by the same layer before attention reads them), then empty sequences up to the
    graph's bound (4, or Tp): the attention grid covers that many sequences
    (``AttentionMetadata.graph_num_seqs``); programs without tokens exit.

Its attention tiles and split-KV factor are those of a single Tp-token query over
``max_model_len`` (fixed at capture). MoE layers dispatch densely up to 256 tokens (no host sync).
A step with host loads is replayed too: step graphs are captured with a wait on a *layer gate*
before each layer's attention (kvtier.transfer.gates), which the load stream opens once that
layer's copies ran, so one launch overlaps loads and layers as the eager forward's per-layer
waits do, without its ~250 launches from Python. Without gates (a driver without stream memory
operations) the replay waits for all of the step's loads.
"""

from __future__ import annotations

from typing import Any

import torch

from kvtier.engine.config import EngineConfig
from kvtier.model.attention import AttentionMetadata
from kvtier.model.moe import SparseMoE


def batch_buckets(max_batch: int) -> list[int]:
    """Padded batch sizes of graphs with one token per sequence: 1, 2, 4, 8, then every 16."""
    buckets = [b for b in (1, 2, 4, 8) if b <= max_batch] + list(range(16, max_batch + 1, 16))
    if buckets[-1] < max_batch:
        buckets.append(max_batch)
    return buckets


class Graphs:
    """Captured forwards keyed by padded size, over static buffers of ``rows`` sequences/tokens."""

    def __init__(
        self,
        model,
        kv_caches: list[torch.Tensor],
        block_size: int,
        max_model_len: int,
        rows: int,
        scratch_block: int,
        device: torch.device,
        capture: bool,
        routing_shape: tuple[int, int] | None,
        pool=None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.scratch_block = scratch_block
        self.device = device
        self.capture = capture
        self.max_blocks = -(-max_model_len // block_size)
        i32, i64 = torch.int32, torch.int64
        self.input_ids = torch.zeros(rows, dtype=i64, device=device)
        self.positions = torch.zeros(rows, dtype=i64, device=device)
        self.slot_mapping = torch.zeros(rows, dtype=i64, device=device)
        self.query_start_loc = torch.arange(rows + 1, dtype=i32, device=device)
        self.seq_lens = torch.ones(rows, dtype=i32, device=device)
        self.block_tables = torch.full((rows, self.max_blocks), scratch_block, dtype=i32, device=device)
        # R3: MoE layers write the step's expert ids here inside the graph
        self.routing_out = torch.zeros((rows, *routing_shape), dtype=i32, device=device) if routing_shape is not None else None
        self.buckets: list[int] = []  # padded sizes
        self.keys: list = []  # one graph each (captured by capture_all)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None]] = {}
        self._pool = pool
        self._capture_stream: torch.cuda.Stream | None = None
        self.runs = 0  # steps run through this path (replayed, or eagerly on a CPU)
        self._arange = torch.arange(rows + 1, dtype=torch.int64, device=device)
        self.gates = None  # StepGraphs: layer gates each layer waits on (transfer/gates.py)

    def capture_all(self) -> None:
        """Capture every bucket now (engine start), not at its first step: a capture takes tens
        of ms, which would stall the requests of that step."""
        if self.capture:
            for key in self.keys:
                self._graph(key)

    def bucket(self, n: int) -> int | None:
        for b in self.buckets:
            if b >= n:
                return b
        return None

    def pool(self):
        """The memory pool the graphs share (graphs replay one at a time, in stream order)."""
        return self._pool

    def _forward(self, bp: int, meta: AttentionMetadata) -> torch.Tensor:
        routing = self.routing_out[:bp] if self.routing_out is not None else None
        hook = self.gates.wait if self.gates is not None else None
        return self.model(self.input_ids[:bp], self.positions[:bp], self.kv_caches, meta, routing_out=routing, layer_hook=hook)

    def _rows(self, key) -> int:
        """Token rows of the graph of ``key``."""
        return key

    def _meta(self, bp: int, seq_lens_cpu: list[int] | None) -> AttentionMetadata:
        """One token in each of ``bp`` sequences. Captured: lengths come from device memory, the
        host only knows their bound. Eager (CPU twin): the reference backend reads the host
        lengths, so they are exact."""
        lens = seq_lens_cpu if seq_lens_cpu is not None else [self.max_model_len] * bp
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bp],
            query_start_loc=self.query_start_loc[: bp + 1],
            seq_lens=self.seq_lens[:bp],
            block_tables=self.block_tables[:bp],
            query_lens_cpu=[1] * bp,
            seq_lens_cpu=lens,
            max_query_len=1,
            max_seq_len=max(lens),
        )

    def _capture_meta(self, bp: int) -> AttentionMetadata:
        raise NotImplementedError

    def _reset(self, bp: int) -> None:
        """Every row of bucket ``bp`` a padding row (before a capture)."""
        raise NotImplementedError

    def _graph(self, bp):
        """The graph of key ``bp`` (a padded size, or a (size, bound) pair), captured once."""
        if bp not in self._graphs:
            self._reset(bp)
            torch.cuda.synchronize(self.device)
            self._forward(self._rows(bp), self._capture_meta(bp))  # warm-up: compiles kernels outside the capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            # captured on a stream of this engine's GPU: torch.cuda.graph's default capture stream
            # belongs to whichever device was current when it was first made
            if self._capture_stream is None:
                self._capture_stream = torch.cuda.Stream(self.device)
            with torch.cuda.graph(graph, pool=self._pool, stream=self._capture_stream):
                out = self._forward(self._rows(bp), self._capture_meta(bp))
            if self._pool is None:
                self._pool = graph.pool()
            self._graphs[bp] = (graph, out)
        return self._graphs[bp]


class StepGraphs(Graphs):
    """Forwards of steps of up to ``max_tokens`` tokens in any mix of sequences (module docstring).

    Two graphs per token bucket Tp, by how many sequences the attention grid covers: ``FEW``
    (a device hit, a short prompt: the KV range split over the GPU as for one Tp-token query
    over ``max_model_len``) and Tp (a prefill chunk beside decode rows: no split). A grid sized
    for Tp sequences when the step has one would launch thousands of programs that only exit
    (measured: 200 us of a 48-token hit's attention per layer instead of 18)."""

    SIZES = (16, 32, 64, 128, 256)
    FEW = 4

    def __init__(
        self,
        model,
        kv_caches: list[torch.Tensor],
        block_size: int,
        max_model_len: int,
        max_tokens: int,
        scratch_block: int,
        device: torch.device,
        capture: bool,
        routing_shape: tuple[int, int] | None = None,
        pool=None,
        gates=None,
    ) -> None:
        sizes = [b for b in self.SIZES if b <= max_tokens]
        super().__init__(
            model,
            kv_caches,
            block_size,
            max_model_len,
            sizes[-1] if sizes else 1,
            scratch_block,
            device,
            capture,
            routing_shape,
            pool,
        )
        self.gates = gates
        self.buckets = sizes
        self.keys = [(bp, bound) for bp in sizes for bound in (self.FEW, bp)]
        self.used: set[tuple[int, int]] = set()  # (bucket, bound) of the steps run (tests)

    def _rows(self, key) -> int:
        return key[0]

    def _capture_meta(self, key) -> AttentionMetadata:
        # the kernels' bounds (lengths come from the device): FEW sequences as one bp-token query
        # over max_model_len (split-KV as for a device hit), or bp sequences (no split)
        bp, bound = key
        q_lens = [bp] if bound == self.FEW else [1] * bp
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bp],
            query_start_loc=self.query_start_loc[: bound + 1],
            seq_lens=self.seq_lens[:bound],
            block_tables=self.block_tables[:bound],
            query_lens_cpu=q_lens,
            seq_lens_cpu=[self.max_model_len] * len(q_lens),
            max_query_len=bp,
            max_seq_len=self.max_model_len,
            graph_num_seqs=bound,
        )

    def _reset(self, key) -> None:
        bp, bound = key
        self._pad(0, 0, bp, bound)

    def _pad(self, tokens: int, seqs: int, bp: int, bound: int) -> int:
        """Tokens [tokens, bp) become one padding sequence after the step's ``seqs`` (positions
        0.. in the scratch block, written before they are read); sequences after it, up to
        ``bound``, are empty. Returns how many sequences the step now has."""
        pad = bp - tokens
        bs = self.block_size
        # fill_ with Python numbers only: they travel as kernel arguments (an item assignment
        # may copy through the host and block until the stream ran, loads included)
        if pad:
            self.input_ids[tokens:bp].zero_()
            self.positions[tokens:bp].copy_(self._arange[:pad])
            torch.remainder(self._arange[:pad], bs, out=self.slot_mapping[tokens:bp])
            self.slot_mapping[tokens:bp] += self.scratch_block * bs
            self.seq_lens[seqs : seqs + 1].fill_(pad)
            self.block_tables[seqs, : -(-pad // bs)].fill_(self.scratch_block)
            seqs += 1
        self.query_start_loc[seqs : bound + 1].fill_(bp)
        return seqs

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden] of a step of T <= max bucket tokens."""
        n, seqs = input_ids.shape[0], meta.num_seqs
        bp = self.bucket(n)
        assert bp is not None
        bound = self.FEW if seqs + (n < bp) <= self.FEW else bp
        width = meta.block_tables.shape[1]
        if width > self.max_blocks:
            raise ValueError(f"block table of {width} blocks exceeds max_model_len {self.max_model_len}")
        graph, out = self._graph((bp, bound)) if self.capture else (None, None)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.query_start_loc[: seqs + 1].copy_(meta.query_start_loc)
        self.seq_lens[:seqs].copy_(meta.seq_lens)
        self.block_tables[:seqs, :width].copy_(meta.block_tables)
        total = self._pad(n, seqs, bp, bound)
        self.runs += 1
        self.used.add((bp, bound))
        if graph is None:  # the CPU twin: the reference backend reads exact host lengths
            q_lens = list(meta.query_lens_cpu) + [bp - n] * (total - seqs)
            s_lens = list(meta.seq_lens_cpu) + [bp - n] * (total - seqs)
            eager = AttentionMetadata(
                slot_mapping=self.slot_mapping[:bp],
                query_start_loc=self.query_start_loc[: total + 1],
                seq_lens=self.seq_lens[:total],
                block_tables=self.block_tables[:total],
                query_lens_cpu=q_lens,
                seq_lens_cpu=s_lens,
                max_query_len=max(q_lens),
                max_seq_len=max(s_lens),
            )
            return self._forward(bp, eager)[:n]
        graph.replay()
        assert out is not None
        return out[:n]


class DecodeGraphs(Graphs):
    """Decode steps (one token per sequence) by padded batch size (module docstring)."""

    def __init__(
        self,
        model,
        kv_caches: list[torch.Tensor],
        block_size: int,
        max_model_len: int,
        max_batch: int,
        scratch_block: int,
        device: torch.device,
        capture: bool,
        routing_shape: tuple[int, int] | None = None,
        pool=None,
    ) -> None:
        buckets = batch_buckets(max_batch)
        super().__init__(
            model, kv_caches, block_size, max_model_len, buckets[-1], scratch_block, device, capture, routing_shape, pool
        )
        self.buckets = self.keys = buckets

    def _capture_meta(self, bp: int) -> AttentionMetadata:
        return self._meta(bp, None)

    def _reset(self, bp: int) -> None:
        self._reset_padding(0, bp)

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
        graph, out = self._graph(bp) if self.capture else (None, None)  # capture first: it resets the buffers
        self.input_ids[:batch].copy_(input_ids)
        self.positions[:batch].copy_(positions)
        self.slot_mapping[:batch].copy_(meta.slot_mapping)
        self.seq_lens[:batch].copy_(meta.seq_lens)
        self.block_tables[:batch, :width].copy_(meta.block_tables)
        self._reset_padding(batch, bp)
        self.runs += 1
        if graph is None:
            return self._forward(bp, self._meta(bp, list(meta.seq_lens_cpu) + [1] * (bp - batch)))[:batch]
        graph.replay()
        assert out is not None
        return out[:batch]


def capture_graphs(
    model: Any, kv_caches: list[torch.Tensor], config: EngineConfig, routing_shape: tuple[int, int] | None, gates: Any
) -> tuple[DecodeGraphs, StepGraphs | None]:
    """The engine's graphs, captured (on CUDA; built uncaptured elsewhere, for their CPU tests):
    decode steps of up to 256 sequences, and other steps of up to 256 tokens (MoE layers
    dispatch densely up to there: no host sync), whose layers wait on ``gates`` (None: a step
    with loads waits for all of them before its replay). ``config``: resolved (engine/resolve.py):
    the block size, the context, the step's sequences and tokens at most, and the device tier,
    whose scratch block (number ``num_device_blocks``) padding rows write to."""
    assert config.max_model_len is not None and config.num_device_blocks is not None, "an unresolved config"
    device = torch.device(config.device)
    capture = device.type == "cuda"
    graphs = DecodeGraphs(
        model,
        kv_caches,
        config.block_size,
        config.max_model_len,
        min(config.max_num_seqs, 256),
        config.num_device_blocks,
        device,
        capture=capture,
        routing_shape=routing_shape,
    )
    graphs.capture_all()
    max_tokens = min(config.max_num_batched_tokens, SparseMoE.DENSE_MAX_TOKENS)
    if max_tokens < StepGraphs.SIZES[0]:
        return graphs, None
    step_graphs = StepGraphs(
        model,
        kv_caches,
        config.block_size,
        config.max_model_len,
        max_tokens,
        config.num_device_blocks,
        device,
        capture=capture,
        routing_shape=routing_shape,
        pool=graphs.pool(),
        gates=gates,
    )
    step_graphs.capture_all()
    return graphs, step_graphs
