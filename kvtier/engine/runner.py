"""ModelRunner: turns a SchedulerOutput into one forward over paged KV and samples.

Over 600 lines: one step's life (its inputs, the forward, the sampling step's launch, the results)
over the buffers and pinned rings the runner owns; sliding groups' tables and images' features are
inputs of that one step.

Input layout of a step (flattened varlen batch, DESIGN §4)::

    input_ids  = [ r0 chunk ........ | r1 decode | r2 decode | r3 chunk .... ]
    positions  = [ c0 .. c0+n0-1     | c1        | c2        | c3 .. c3+n3-1 ]   c = num_computed
    sample at  = the last token of each request whose chunk reaches its end

:meth:`ModelRunner.execute` queues a step and returns a :class:`StepResult` at once: the sampled
tokens (and logprobs) are on their way to pinned host memory; :meth:`StepResult.collect` waits for
them. Between the two the engine may schedule and launch the next step (overlap scheduling): a
decode whose last token is still in flight takes it from the previous step's token tensor on the
device, so the host never waits for it::

    step N   : forward ─ sample ─► tokens_N (device) ─► copy to pinned host ─► collect (host)
    step N+1 :          (built on the host meanwhile)   input_ids[at] = tokens_N[row] ─ forward ...

A step's integer inputs go up in two non-blocking copies from pinned memory (int64: ids,
positions, slots, sample rows, placeholder places; int32: the attention metadata), and its
results come down in one, through rings of reusable pinned buffers (engine/staging.py): a
blocking ``torch.tensor(..., device=cuda)`` would wait for the step in flight.

Both kinds of step sample through one function (engine/sample_step.py): a plain step its
requests' last rows; a drafted step (speculative decoding) the verify rows of each request,
which engine/verify.py accepts before the speculator's MTP passes draft on (engine/spec.py)::

    plain    forward ─ sample_rows(last rows) ─────────────────────────────► pack ─► host (overlapped)
    drafted  forward ─ sample_rows(verify rows, ahead = drafts) ─ verify ─ MTP passes ─► host (one sync)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Protocol

import numpy as np
import torch

from kvtier import index_checks
from kvtier.engine.cuda_graph import DecodeGraphs, StepGraphs
from kvtier.engine.encoder_cache import EncoderCache
from kvtier.engine.experts import ExpertCapture
from kvtier.engine.request import Request
from kvtier.engine.result_pack import ResultPack
from kvtier.engine.sample_step import SampledRows, sample_rows, select_rows
from kvtier.engine.sampling import Penalties, to_device
from kvtier.engine.scheduler import SchedulerOutput
from kvtier.engine.spec import DraftPlan, Speculator
from kvtier.engine.staging import HostCopy, PinnedRing
from kvtier.engine.step_inputs import HostInputs, ImageSpan, StepInputs
from kvtier.engine.verify import Verdict, Verification
from kvtier.model.attention import AttentionMetadata
from kvtier.model.families import CausalLM
from kvtier.model.shard import broadcast_from_first

if TYPE_CHECKING:
    from kvtier.cache.records import CacheRequest
    from kvtier.transfer.engine import LoadWaits


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[torch.Tensor],
        block_size: int,
        device: torch.device,
        routing: ExpertCapture | None = None,
        decode_graphs: DecodeGraphs | None = None,
        step_graphs: StepGraphs | None = None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.routing = routing
        self.decode_graphs = decode_graphs
        self.step_graphs = step_graphs
        self.penalties = Penalties(model.config.vocab_size, model.config.eos_token_ids, device)
        self._last: StepResult | None = None  # the last launched step ...
        self._feed: StepResult | None = None  # ... as of this step's start: its tokens feed this one
        self._up, self._down = PinnedRing(device), PinnedRing(device)  # a step's inputs, its results
        self.graph_steps_after_loads = 0  # graph replays that waited for host->device loads
        self.steps_fed_in_flight = 0  # steps whose inputs took a token the step in flight sampled (overlap)
        # tensor parallel, rank 0: the other ranks (engine/tp/ranks.py), told of each forward
        self.peers: Peers | None = None
        self.spec: Speculator | None = None  # speculative decoding: its drafts (engine/spec.py)
        # a tensor-parallel rank > 0 with drafts: the last forward's (inputs, hidden, load waits)
        self.followed: tuple[StepInputs, torch.Tensor, LoadWaits | None] | None = None
        # sliding groups with blocks of their own (cache/sliding.py): each group's layers, and the
        # cache's tables of a request per group (CacheManager.sliding_tables); none: one table
        self.sliding_layers: list[tuple[int, ...]] = []
        self.sliding_tables: Callable[[CacheRequest, int], list[list[int]]] | None = None
        self.encoder: EncoderCache | None = None  # vision-language models: tower outputs by image hash

    def release_graphs(self) -> None:
        """Drop the CUDA graphs (closing): under tensor parallelism they hold NCCL kernels, and
        the communicator's teardown waits until no graph holds one."""
        self.decode_graphs = self.step_graphs = None
        if self.spec is not None:
            self.spec.chain = None  # (the draft chain's graphs: the MTP layer's all-reduces)
        if self.device.type == "cuda":
            import gc

            gc.collect()
            torch.cuda.synchronize(self.device)

    def start_step(self) -> None:
        """A new step begins (its forwards, several if a batch is retried request by request,
        read the tokens still in flight from the step launched before it)."""
        self._feed = self._last
        if self.spec is not None:
            self.spec.new_step()

    def _wait_all_loads(self, layer_hook: Callable[[int], None] | None) -> None:
        """Before a replayed graph: the compute stream waits for every layer of the step's loads."""
        if layer_hook is not None:
            layer_hook(len(self.kv_caches) - 1)
            self.graph_steps_after_loads += 1

    def build_inputs(self, out: SchedulerOutput) -> HostInputs:
        """The step's inputs as host lists (what every tensor-parallel rank uploads alike)."""
        ids: list[int] = []
        positions: list[int] = []
        query_lens, seq_lens, tables, sample_rows = [], [], [], []
        group_tables: list[list[list[int]]] = [[] for _ in self.sliding_layers]
        pending_at: list[int] = []  # places in ids of tokens still on the device ...
        pending_rows: list[int] = []  # ... and their rows in the last step's tokens
        images: list[ImageSpan] = []
        for s in out.scheduled:
            req = s.request
            start = req.num_computed_tokens
            end = start + s.num_tokens
            for image in req.mm:  # the part of each image this chunk covers
                lo, hi = max(start, image.offset), min(end, image.offset + image.length)
                if lo < hi:
                    images.append(ImageSpan(image, lo - image.offset, hi - image.offset, len(ids) + lo - start))
            known = req.all_token_ids[start:end]
            ids.extend(known)
            if s.num_drafts:  # speculative: the drafts after the last token (engine/spec.py)
                ids.extend(req.draft_tokens[: s.num_drafts])
            elif len(known) < s.num_tokens:  # the last one was sampled by the step in flight
                last = self._feed
                if len(known) != s.num_tokens - 1 or last is None or req not in last.rows:
                    raise RuntimeError(
                        f"request {req.request_id}: positions {start}..{end - 1} need "
                        f"{s.num_tokens - len(known)} tokens the host has not seen"
                    )
                pending_at.append(len(ids))
                pending_rows.append(last.rows[req])
                ids.append(0)
            positions.extend(range(start, end))
            query_lens.append(s.num_tokens)
            seq_lens.append(end)
            tables.append(req.cache_req.block_table[: -(-end // self.block_size)])
            if self.sliding_tables is not None:
                for group, table in zip(group_tables, self.sliding_tables(req.cache_req, len(tables[-1]))):
                    group.append(table)
            if s.samples:
                sample_rows.append(len(ids) - 1)
        return HostInputs(
            ids, positions, query_lens, seq_lens, tables, sample_rows, pending_at, pending_rows, group_tables, images
        )

    def _upload(self, host: HostInputs) -> StepInputs:
        """The step's inputs on the device, in two non-blocking copies (the module docstring)."""
        ids, positions, sample_rows = host.ids, host.positions, host.sample_rows
        pending_at, pending_rows = host.pending_at, host.pending_rows
        meta = AttentionMetadata.build(host.query_lens, host.seq_lens, host.tables, self.block_size, "cpu")
        n = len(ids)
        wide = np.concatenate(
            [
                np.asarray(ids, np.int64),
                np.asarray(positions, np.int64),
                meta.slot_mapping_cpu,
                np.asarray(sample_rows + pending_at + pending_rows, np.int64),
            ]
        )
        narrow = np.concatenate([meta.query_start_loc.numpy(), meta.seq_lens.numpy(), meta.block_tables.numpy().ravel()])
        wide_d, narrow_d = self._up.upload(wide), self._up.upload(narrow)
        b = meta.num_seqs
        dev = AttentionMetadata(
            slot_mapping=wide_d[2 * n : 3 * n],
            query_start_loc=narrow_d[: b + 1],
            seq_lens=narrow_d[b + 1 : 2 * b + 1],
            block_tables=narrow_d[2 * b + 1 :].view(b, -1),
            query_lens_cpu=meta.query_lens_cpu,
            seq_lens_cpu=meta.seq_lens_cpu,
            max_query_len=meta.max_query_len,
            max_seq_len=meta.max_seq_len,
            slot_mapping_cpu=meta.slot_mapping_cpu,
        )
        if host.group_tables:
            dev.layer_views = self._group_views(host, dev)
        input_ids = wide_d[:n]
        tail = wide_d[3 * n :]
        ns, npend = len(sample_rows), len(pending_at)
        if index_checks.ENABLED:  # KVTIER_CHECK_INDICES=1: as the GPU reads them
            kv = max(self.kv_caches, key=lambda t: t.shape[1])  # a full layer's (sliding groups' are smaller)
            index_checks.check("input_ids", input_ids, self.model.config.vocab_size)
            index_checks.check("slot_mapping", dev.slot_mapping, kv.shape[1] * kv.shape[2])
            index_checks.check("block_tables", dev.block_tables, kv.shape[1])
            index_checks.check("sample_rows", tail[:ns], n)
        if npend:
            self.steps_fed_in_flight += 1
            last = self._feed  # the step in flight (build_inputs checked it)
            assert last is not None and last.tokens is not None
            at, rows = tail[ns : ns + npend], tail[ns + npend :]
            if index_checks.ENABLED:
                index_checks.check("pending token places", at, n)
                index_checks.check("pending token rows", rows, last.tokens.numel())
            input_ids.index_copy_(0, at, last.tokens.index_select(0, rows))
        return StepInputs(input_ids, wide_d[n : 2 * n], dev, sample_rows, tail[:ns])

    def _group_views(self, host: HostInputs, dev: AttentionMetadata) -> tuple[AttentionMetadata | None, ...]:
        """Per layer, the metadata of its sliding group's slots (None: the full group's ``dev``)."""
        views: list[AttentionMetadata | None] = [None] * len(self.kv_caches)
        for layers, tables in zip(self.sliding_layers, host.group_tables):
            g = AttentionMetadata.build(host.query_lens, host.seq_lens, tables, self.block_size, "cpu")
            view = replace(
                dev,
                slot_mapping=g.slot_mapping.to(self.device, non_blocking=True),
                block_tables=g.block_tables.to(self.device, non_blocking=True),
                slot_mapping_cpu=g.slot_mapping_cpu,
                layer_views=(),
            )
            for layer in layers:
                views[layer] = view
        return tuple(views)

    def forward(
        self, host: HostInputs, start_loads: Callable[[str], LoadWaits | None] | None = None
    ) -> tuple[StepInputs, torch.Tensor]:
        """Upload ``host``, take the step's loads and queue the forward (a replayed graph or the
        eager model); (the inputs on the device, the hidden states). Every tensor-parallel rank
        runs this on the same ``host`` (engine/tp): rank 0 tells the others through
        :attr:`peers` once its loads are queued, then all of them meet in the forward's
        all-reduces."""
        inputs = self._upload(host)
        input_ids, positions, meta = inputs.input_ids, inputs.positions, inputs.meta
        graphs, steps = self.decode_graphs, self.step_graphs
        if host.images:  # image features enter the eager forward only
            graphs = steps = None
        decode_graph = graphs is not None and meta.max_query_len == 1 and graphs.bucket(meta.num_seqs) is not None
        step_graph = not decode_graph and steps is not None and steps.bucket(len(input_ids)) is not None
        if decode_graph or step_graph:  # replayed, whatever it loads
            mode = "gated" if step_graph and steps is not None and steps.gates is not None else "whole"
        else:
            mode = "layers"
        layer_hook = start_loads(mode) if start_loads is not None else None
        if self.peers is not None:
            self.peers.forward(host)
        if decode_graph:
            assert graphs is not None
            self._wait_all_loads(layer_hook)
            hidden = graphs.run(input_ids, positions, meta)
            routing_out = graphs.routing_out[: len(input_ids)] if graphs.routing_out is not None else None
        elif step_graph and (mode != "layers" or layer_hook is None):
            assert steps is not None
            if mode != "gated":
                self._wait_all_loads(layer_hook)  # any other short step
            elif layer_hook is not None:
                layer_hook.before_graph()
                self.graph_steps_after_loads += 1
            hidden = steps.run(input_ids, positions, meta)
            routing_out = steps.routing_out[: len(input_ids)] if steps.routing_out is not None else None
        else:
            routing_out = self.routing.buffer(len(input_ids)) if self.routing is not None else None
            images = {}  # (vision models only: a text model's forward takes no mm_embeds)
            if host.images:
                encoder = self.encoder if self.encoder is not None else EncoderCache(0)
                images["mm_embeds"] = encoder.embeds(self.model, host.images, self.device)  # type: ignore[arg-type]  # a vision model
            hidden = self.model(
                input_ids, positions, self.kv_caches, meta, layer_hook=layer_hook, routing_out=routing_out, **images
            )
        if self.routing is not None:  # (the buffers and the host slots come with routing)
            assert routing_out is not None and meta.slot_mapping_cpu is not None
            self.routing.record(routing_out, meta.slot_mapping_cpu)
        return inputs, hidden

    def execute(self, out: SchedulerOutput, start_loads: Callable[[str], LoadWaits | None] | None = None) -> StepResult:
        """Queue the step's forward and sampling; returns at once (:class:`StepResult`).

        ``start_loads(mode)`` is called once the step's inputs are uploaded, before the first
        layer: it queues the step's host->device loads in ``mode`` (TransferEngine.load_mode) and
        returns the hook ``layer_hook(l)`` that runs before attention of layer ``l`` reads the KV
        cache (a wait for that layer's loads; :class:`~kvtier.transfer.engine.LoadWaits`), or
        None if the step loads nothing.
        Inputs go first because the small input uploads share the host->device copy engine (FIFO)
        with the loads' DMA: queued after a GiB of KV, they would hold the whole forward back
        until the loads were done.

        - a step replayed from a step graph captured with layer gates loads ``gated``: the graph
          waits for each layer's gate, so one launch overlaps loads and layers;
        - a decode graph (or a step graph without gates) loads ``whole`` and waits for the last
          layer (so for all of them) before the replay;
        - an eager forward loads ``layers`` and waits per layer through the hook. Short steps are
          not run eagerly because of their loads: the eager forward's ~250 launches from Python
          cost more CPU than such a step's loads and compute take on the GPU
          (docs/BENCHMARKS.md)."""
        if self.spec is not None:
            # a step that verifies or makes drafts is a drafted step (its results on the host
            # when it returns); one with neither (every request resting from drafts, a PD
            # export) runs plain, overlapped, and the MTP block runs over its rows after sampling
            drafting = self.spec.drafting(out)
            if drafting or self.peers is not None or any(s.num_drafts for s in out.scheduled):
                self._last = None  # (its tokens reach the host before the next step is scheduled)
                return self._drafted_step(out, start_loads, drafting)
        inputs, hidden = self.forward(self.build_inputs(out), start_loads)
        samplers = [s.request for s in out.scheduled if s.samples]
        prompt_rows = self._prompt_logprob_rows(out)
        result = StepResult(samplers)
        if not samplers and not prompt_rows:
            self._mtp_rows(out, inputs, hidden, None, start_loads)
            self._last = None
            return result
        sampled = None
        if samplers:
            sampled = sample_rows(self.model.compute_logits(hidden.index_select(0, inputs.sample_rows)), samplers, self.penalties)
            tokens = sampled.tokens
            if self.peers is not None:  # the next step's inputs on every rank may read them
                broadcast_from_first(tokens, self.model.tp)
        else:
            tokens = torch.zeros(0, dtype=torch.long, device=self.device)
        self._mtp_rows(out, inputs, hidden, tokens, start_loads)
        # everything the host needs from this step in one transfer (one sync): the tokens, then
        # per logprobs row the sampled token's logprob and its top-k, then the prompt's
        pack = ResultPack(tokens)
        if sampled is not None and sampled.logprob_rows:
            want = sampled.logprob_rows
            assert sampled.logprobs is not None
            k = max(_asked(samplers[i].params.logprobs) for i in want)
            result.logprobs = (want, pack.add(sampled.logprobs, select_rows(tokens, want), k))
        if prompt_rows:
            result.prompt = (prompt_rows, self._prompt_logprobs(hidden, prompt_rows, pack))
        result.tokens = tokens
        result.host = self._down.download(pack.vector())
        self._last = result
        return result

    def _drafted_step(
        self, out: SchedulerOutput, start_loads: Callable[[str], LoadWaits | None] | None, drafting: set[int]
    ) -> StepResult:
        """A step that verifies or makes drafts (engine/spec.py, engine/verify.py): the target
        forward, the sampling of the verify rows, the verification and the speculator's MTP
        passes; its results are on the host when this returns (``StepResult.done``), each
        request's accepted drafts in ``step_accepted``.

        When every verifying request is greedy (and the engine is one rank), verification runs on
        the device too: the step's work is queued back to back and read with one host sync at
        its end. Otherwise the sampled tokens come to the host for the rejection rule first, and
        under tensor parallelism rank 0 sends the passes' plan to the others."""
        spec = self.spec
        assert spec is not None
        inputs, hidden = self.forward(self.build_inputs(out), start_loads)
        check = Verification(out)
        plan = DraftPlan(out, drafting, check.spans)
        sampled = None
        if check.spans:
            logits = self.model.compute_logits(hidden.index_select(0, to_device(check.rows, self.device, torch.long)))
            sampled = sample_rows(logits, check.requests, self.penalties, check.ahead, check.sampled_rows)
            tokens = sampled.tokens
        else:
            tokens = torch.zeros(0, dtype=torch.long, device=self.device)
        hook = start_loads("layers") if start_loads is not None else None  # (the step's loads, layer num_layers too)
        model, kv = self.model, self.kv_caches
        if not check.sampled_rows and self.peers is None:
            accepted, after = check.accept_on_device(tokens)
            drafts = spec.propose(model, kv, plan, inputs, hidden, hook, *plan.draft_inputs_on_device(tokens, accepted))
            n, m = len(check.spans), len(plan.go)
            got = torch.cat([accepted, after, drafts.flatten()]).tolist()  # (the step's one host sync)
            verdicts = [Verdict(a, t) for a, t in zip(got[:n], got[n : 2 * n])]
            draft_rows = [got[2 * n + t * m : 2 * n + (t + 1) * m] for t in range(drafts.shape[0])]
        else:
            verdicts = check.accept_on_host(tokens.tolist(), sampled) if sampled is not None else []
            next_ids, rows, positions = plan.draft_inputs_on_host(verdicts)
            if self.peers is not None:  # every rank runs the same passes (engine/tp)
                self.peers.draft(next_ids, rows, positions, plan.tables(spec.chain))
            on_device = (to_device(v, self.device, torch.long) for v in (next_ids, rows, positions))
            draft_rows = spec.propose(model, kv, plan, inputs, hidden, hook, *on_device).tolist()
        entries = self._verified_logprobs(check, verdicts, sampled)  # (requests that asked for them)
        spec.update(plan, verdicts, draft_rows, self.block_size)
        prompt = self._prompt_logprobs_step(out, hidden)  # (requests that asked for them)
        # what Scheduler.update takes from each request, set when the step's results are taken
        # (StepResult.collect): a step launched under overlap scheduling is finished first
        taken = [(span.req, span.drafts[:a], entries.get(i)) for i, (span, (a, _)) in enumerate(zip(check.spans, verdicts))]

        def take() -> None:
            for req, accepted, emitted in taken:
                req.step_accepted = accepted
                req.step_accepted_logprobs = emitted[: len(accepted)] if emitted is not None else None
                if emitted is not None:
                    req.step_logprobs = emitted[len(accepted)]
            if prompt is not None:
                prompt.collect()

        return StepResult.done({span.req.request_id: v.token for span, v in zip(check.spans, verdicts)}, take)

    def _verified_logprobs(
        self, check: Verification, verdicts: list[Verdict], sampled: SampledRows | None
    ) -> dict[int, list[dict[int, float]]]:
        """Per span (index) whose request asked for logprobs, an entry for each token it emits
        (its kept drafts, then the token after them) from that token's verify row, raw or
        processed (engine/sample_step.py); read in one transfer."""
        if sampled is None or not sampled.logprob_rows:
            return {}
        assert sampled.logprobs is not None
        place = {row: n for n, row in enumerate(sampled.logprob_rows)}
        asking = [i for i, span in enumerate(check.spans) if span.req.params.logprobs is not None]
        rows, ids, ks = [], [], []
        for i in asking:
            span, (a, token) = check.spans[i], verdicts[i]
            rows += [place[span.at + j] for j in range(a + 1)]
            ids += [*span.drafts[:a], token]
            ks += [_asked(span.req.params.logprobs)] * (a + 1)
        pack = ResultPack(torch.zeros(0, dtype=torch.long, device=self.device))
        where = pack.add(select_rows(sampled.logprobs, rows), to_device(ids, self.device), max(ks))
        entries = iter(ResultPack.entries(pack.vector().cpu().numpy(), where, ids, ks))
        return {i: [next(entries) for _ in range(verdicts[i].num_accepted + 1)] for i in asking}

    def _mtp_rows(
        self, out: SchedulerOutput, inputs: StepInputs, hidden: torch.Tensor, tokens: torch.Tensor | None, start_loads
    ) -> None:
        """Speculative decoding, a plain step: the MTP block over its rows (engine/spec.py), after
        the step's loads of its layer; ``tokens``: the sampled ones (None: none sampled)."""
        if self.spec is None:
            return
        if tokens is None:
            tokens = torch.zeros(0, dtype=torch.long, device=self.device)
        hook = start_loads("layers") if start_loads is not None else None
        self.spec.mtp_rows(self.model, self.kv_caches, out, inputs, hidden, tokens, hook)

    def _prompt_logprobs_step(self, out: SchedulerOutput, hidden: torch.Tensor) -> StepResult | None:
        """The prompt logprobs of a drafted step, on their way to the host; None if no request of
        it asked for them."""
        prompt_rows = self._prompt_logprob_rows(out)
        if not prompt_rows:
            return None
        result = StepResult([])
        pack = ResultPack(torch.zeros(0, dtype=torch.long, device=self.device))
        result.prompt = (prompt_rows, self._prompt_logprobs(hidden, prompt_rows, pack))
        result.host = self._down.download(pack.vector())
        return result

    def follow(self, host: HostInputs, start_loads: Callable[[str], LoadWaits | None] | None) -> None:
        """A tensor-parallel rank other than 0 (engine/tp/worker.py): rank 0's step on this
        rank's shard, without sampling; the tokens rank 0 samples arrive by broadcast, for the
        next step's inputs (overlap scheduling reads them on the device)."""
        self.start_step()
        hooks: list = []

        def keep(mode: str) -> LoadWaits | None:
            hooks.append(start_loads(mode) if start_loads is not None else None)
            return hooks[-1]

        inputs, hidden = self.forward(host, keep)
        if self.spec is not None:  # the MTP passes come next (engine/spec.py draft_passes)
            self.followed = (inputs, hidden, hooks[0] if hooks else None)
            self._last = None  # (rank 0 samples and verifies: no token is broadcast with drafts)
            return
        if host.sample_rows:
            tokens = torch.empty(len(host.sample_rows), dtype=torch.long, device=self.device)
            broadcast_from_first(tokens, self.model.tp)
            last = StepResult([])
            last.tokens = tokens
            self._last = last
        else:
            self._last = None

    def _prompt_logprob_rows(self, out: SchedulerOutput) -> list[_PromptSpan]:
        """The positions of this step whose logits score a prompt token, per request that asked
        for prompt logprobs: position j scores token j+1, so a chunk's last position scores the
        next chunk's first token (the prompt is known: nothing is carried between chunks)."""
        spans = []
        offset = 0
        for s in out.scheduled:
            req = s.request
            start = req.num_computed_tokens
            if req.params.prompt_logprobs is not None and start < req.num_prompt_tokens:
                end = min(start + s.num_tokens, req.num_prompt_tokens - 1)
                spans.append(
                    _PromptSpan(
                        req, start, list(range(offset, offset + max(0, end - start))), req.prompt_token_ids[start + 1 : end + 1]
                    )
                )
            offset += s.num_tokens
        return spans

    def _prompt_logprobs(self, hidden: torch.Tensor, spans: list[_PromptSpan], pack: ResultPack) -> tuple[int, int, int]:
        """Raw logprobs of the prompt tokens ``spans`` score, onto ``pack``. Only these rows'
        logits are computed, a slice of rows at a time (a [rows, vocab] float32 block each)."""
        rows = [r for span in spans for r in span.rows]
        targets = to_device([t for span in spans for t in span.targets], self.device)
        k = max(_asked(span.req.params.prompt_logprobs) for span in spans)
        pieces = []
        for a in range(0, len(rows), _PROMPT_SLICE):
            at = to_device(rows[a : a + _PROMPT_SLICE], self.device)
            lp = torch.log_softmax(self.model.compute_logits(hidden.index_select(0, at)), dim=-1)
            pieces.append(ResultPack.scored(lp, targets[a : a + _PROMPT_SLICE], k))
        if not pieces:
            pieces.append(ResultPack.scored(hidden.new_zeros(0, 1, dtype=torch.float32), targets, 0))
        return pack.add_block(torch.cat(pieces), k)

    @torch.inference_mode()
    def score(self, token_ids: list[int], routing_in: np.ndarray | None) -> np.ndarray:
        """Log-probabilities of token_ids[1:] given their prefixes, on scratch KV blocks."""
        from kvtier.model import allocate_kv_caches

        cfg = self.model.config
        n = len(token_ids) - 1  # every token but the last goes through the model
        if self.peers is not None:  # the other ranks run the same forward
            self.peers.score(token_ids, routing_in)
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


class Peers(Protocol):
    """Tensor parallel, rank 0: how the other ranks learn of a forward (engine/tp/ranks.py)."""

    def forward(self, host: HostInputs) -> None: ...

    def score(self, token_ids: list[int], routing_in: np.ndarray | None) -> None: ...

    def draft(self, next_ids: list[int], rows: list[int], positions: list[int], tables: list[list[int]]) -> None: ...


class StepResult:
    """A launched step's sampled tokens (and logprobs), by request; :meth:`collect` waits for them.
    ``tokens`` (device) and ``rows`` let the next step read a token before the host has it."""

    def __init__(self, samplers: list[Request]) -> None:
        self.samplers = samplers
        self.rows = {r: i for i, r in enumerate(samplers)}
        self.tokens: torch.Tensor | None = None
        self.host: HostCopy | None = None
        self.logprobs: tuple[list[int], tuple[int, int, int]] | None = None  # (sampler rows, where in pack)
        self.prompt: tuple[list[_PromptSpan], tuple[int, int, int]] | None = None
        self._sampled: dict[str, int] | None = None
        self._take: Callable[[], None] | None = None  # (done: sets what Scheduler.update takes)

    def collect(self) -> dict[str, int]:
        """Wait for the step's results; the sampled token by request id. Sets each sampler's
        ``step_logprobs`` and ``step_prompt_logprobs`` (taken by Scheduler.update)."""
        if self._take is not None:
            take, self._take = self._take, None
            take()
        if self._sampled is not None:
            return self._sampled
        if self.host is None:
            self._sampled = {}
            return self._sampled
        host = self.host.wait()
        samplers = self.samplers
        token_ids = [int(t) for t in host[: len(samplers)]]
        if self.logprobs is not None:
            want, where = self.logprobs
            entries = ResultPack.entries(
                host, where, [token_ids[i] for i in want], [_asked(samplers[i].params.logprobs) for i in want]
            )
            for i, entry in zip(want, entries):
                samplers[i].step_logprobs = entry
        if self.prompt is not None:
            spans, where = self.prompt
            targets = [t for span in spans for t in span.targets]
            ks = [_asked(span.req.params.prompt_logprobs) for span in spans for _ in span.targets]
            entries_it = iter(ResultPack.entries(host, where, targets, ks))
            for span in spans:
                scored: list[dict[int, float] | None] = [next(entries_it) for _ in span.targets]
                if span.start == 0:  # the first prompt token has no logprob
                    span.req.step_prompt_logprobs = (0, [None, *scored])
                else:
                    span.req.step_prompt_logprobs = (span.start + 1, scored)
        self._sampled = {r.request_id: t for r, t in zip(samplers, token_ids)}
        self.host = None  # the pinned buffer goes back to torch's cache
        return self._sampled

    @property
    def collected(self) -> bool:
        return self._sampled is not None

    @classmethod
    def done(cls, sampled: dict[str, int], take: Callable[[], None] | None = None) -> "StepResult":
        """A result the host has already (a step run request by request, a drafted step);
        ``take``: sets the requests' results for Scheduler.update when they are collected (under
        overlap scheduling, after the step launched before this one was finished)."""
        r = cls([])
        r._sampled = sampled
        r._take = take
        return r


def _asked(k: int | None) -> int:
    """A top-k of logprobs a request asked for (set: the rows that use it are chosen by it)."""
    assert k is not None
    return k


_PROMPT_SLICE = 512  # prompt positions whose logits are computed at once (bounds their memory)


@dataclass
class _PromptSpan:
    req: Request
    start: int  # the chunk's first position
    rows: list[int]  # rows of the step's hidden states that score a prompt token
    targets: list[int]  # the tokens they score: prompt[start+1 : start+1+len(rows)]
