"""ModelRunner: turns a SchedulerOutput into one forward over paged KV and samples.

Input layout of a step (flattened varlen batch, DESIGN §4)::

    input_ids  = [ r0 chunk ........ | r1 decode | r2 decode | r3 chunk .... ]
    positions  = [ c0 .. c0+n0-1     | c1        | c2        | c3 .. c3+n3-1 ]   c = num_computed
    sample at  = the last token of each request whose chunk reaches its end
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from kvtier.engine.cuda_graph import DecodeGraphs
from kvtier.engine.routing import RoutingCapture
from kvtier.engine.sampling import sample
from kvtier.engine.scheduler import SchedulerOutput
from kvtier.model.attention import AttentionMetadata
from kvtier.model.families import CausalLM


class ModelRunner:
    def __init__(self, model: CausalLM, kv_caches: list[torch.Tensor], block_size: int,
                 device: torch.device, routing: RoutingCapture | None = None,
                 decode_graphs: DecodeGraphs | None = None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.routing = routing
        self.decode_graphs = decode_graphs

    def build_inputs(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        ids: list[int] = []
        positions: list[int] = []
        query_lens, seq_lens, tables, sample_rows = [], [], [], []
        for s in out.scheduled:
            req = s.request
            start = req.num_computed_tokens
            end = start + s.num_tokens
            ids.extend(req.all_token_ids[start:end])
            positions.extend(range(start, end))
            query_lens.append(s.num_tokens)
            seq_lens.append(end)
            tables.append(req.cache.block_table[: -(-end // self.block_size)])
            if s.samples:
                sample_rows.append(len(ids) - 1)
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, self.block_size, self.device)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        return input_ids, pos, meta, sample_rows

    def execute(self, out: SchedulerOutput,
                start_loads: Callable[[], Callable[[int], None] | None] | None = None) -> dict[str, int]:
        """Forward the step; returns the sampled token of every request that samples.

        ``start_loads()`` is called once the step's inputs are uploaded, before the first layer:
        it queues the step's host->device loads and returns the hook ``layer_hook(l)`` that runs
        before attention of layer ``l`` reads the KV cache (a wait for that layer's loads). Inputs
        go first because the small input uploads share the host->device copy engine (FIFO) with
        the loads' DMA: queued after a GiB of KV, they would hold the whole forward back until the
        loads were done. A replayed CUDA graph has no per-layer hook: it waits for the last layer
        (so for all of them) before the replay."""
        input_ids, positions, meta, sample_rows = self.build_inputs(out)
        layer_hook = start_loads() if start_loads is not None else None
        graphs = self.decode_graphs
        if graphs is not None and meta.max_query_len == 1 and graphs.bucket(meta.num_seqs) is not None:
            if layer_hook is not None:
                layer_hook(len(self.kv_caches) - 1)
            hidden = graphs.run(input_ids, positions, meta)
            routing_out = graphs.routing_out[:len(input_ids)] if graphs.routing_out is not None else None
        else:
            routing_out = self.routing.buffer(len(input_ids)) if self.routing is not None else None
            hidden = self.model(input_ids, positions, self.kv_caches, meta, layer_hook=layer_hook,
                                routing_out=routing_out)
        if self.routing is not None:
            self.routing.record(routing_out, meta.slot_mapping_cpu)
        samplers = [s.request for s in out.scheduled if s.samples]
        if not samplers:
            return {}
        logits = self.model.compute_logits(hidden[sample_rows])
        tokens = sample(logits, [r.params for r in samplers], [r.generator for r in samplers])
        return {r.request_id: t for r, t in zip(samplers, tokens)}

    @torch.inference_mode()
    def score(self, token_ids: list[int], routing_in: np.ndarray | None) -> np.ndarray:
        """Log-probabilities of token_ids[1:] given their prefixes, on scratch KV blocks."""
        from kvtier.model import allocate_kv_caches

        cfg = self.model.config
        n = len(token_ids) - 1            # every token but the last goes through the model
        num_blocks = -(-n // self.block_size)
        kv = allocate_kv_caches(cfg, num_blocks, self.block_size, self.device, self.kv_caches[0].dtype)
        meta = AttentionMetadata.build([n], [n], [list(range(num_blocks))], self.block_size, self.device)
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        forced = None
        if routing_in is not None:
            forced = torch.as_tensor(routing_in.astype(np.int64), device=self.device)
        hidden = self.model(ids[:-1], torch.arange(n, device=self.device), kv, meta, routing_in=forced)
        logprobs = torch.log_softmax(self.model.compute_logits(hidden), dim=-1)
        return logprobs.gather(1, ids[1:, None]).squeeze(1).cpu().numpy()
