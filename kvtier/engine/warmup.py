"""Everything a step can launch, compiled before the engine takes its first request.

Triton compiles a kernel the first time a launch needs a variant it has not seen (and loads it
from its disk cache on later starts); torch loads a CUDA module the first time one of its
kernels runs. Either, in the middle of serving, is an engine step of seconds for every request
in it (H100: 1.6-2.6 s steps in a fresh server's first minute). So at start, on the GPU:

1. the model's own kernels: eager forwards of a decode row, a short extend and a prefill chunk
   in one step (and of the MTP block, when the engine drafts), then its logits and sampling
   (greedy and sampled rows, top-k for logprobs);
2. attention in every variant a step can take (``triton_attention.compile_variants``: both tile
   kinds times every split count);
3. every copy path of the host tier (``kernels.compile_variants``).

Everything reads or writes the scratch block only (the block padded CUDA-graph rows write to,
which no request owns) and a host block no one holds yet. What is left to specialize on is fixed
by the model and the engine's sizes (kvtier/triton_jit.py), so after this the engine compiles
nothing more: :func:`kvtier.triton_jit.num_compiled` then stays where it was at start.
The CUDA graphs are captured after this (engine/cuda_graph.py), each over kernels already built.
"""

from __future__ import annotations

import logging

import torch

from kvtier.engine.config import EngineConfig
from kvtier.engine.params import SamplingParams
from kvtier.engine.sampling import draw, topk
from kvtier.model.attention import AttentionMetadata
from kvtier.model.families import CausalLM

log = logging.getLogger(__name__)


def compile_kernels(model: CausalLM, kv_caches: list[torch.Tensor], host_kv: torch.Tensor | None, config: EngineConfig) -> int:
    """Run each kernel variant once (module docstring); returns the Triton variants compiled or
    loaded. A no-op off CUDA (Triton's interpreter compiles nothing; torch has nothing to load).
    ``config``: resolved (engine/resolve.py): the block size, the context, the attention
    backend and the device tier, whose scratch block (number ``num_device_blocks``) the
    forwards write to."""
    device = kv_caches[0].device
    if device.type != "cuda":
        return 0
    scratch_block, block_size, max_model_len = config.num_device_blocks, config.block_size, config.max_model_len
    assert scratch_block is not None and max_model_len is not None, "an unresolved config (engine/resolve.py)"
    from kvtier.triton_jit import num_compiled

    before = num_compiled()
    cfg = model.config
    # a decode row, a short extend (decode tiles' upper bound + 1) and a prefill chunk in one step
    query_lens = [q for q in (1, 17, 300) if q <= max_model_len]
    tables = [[scratch_block] * -(-q // block_size) for q in query_lens]
    meta = AttentionMetadata.build(query_lens, query_lens, tables, block_size, device)
    ids = torch.zeros(sum(query_lens), dtype=torch.long, device=device)
    positions = torch.cat([torch.arange(q, device=device) for q in query_lens])
    hidden = model(ids, positions, kv_caches, meta)
    if len(model.mtp):  # speculative decoding: the MTP block's pass and its draft logits
        model.draft_logits(model.draft(ids, positions, hidden, kv_caches, meta)[:2]).argmax(dim=-1)
    logits = model.compute_logits(hidden[:2])
    greedy, sampled = SamplingParams(), SamplingParams(temperature=0.7, top_k=5, top_p=0.9)
    tokens, _ = draw(logits, [greedy, sampled], [None, None], processed_rows=[0, 1])
    topk(torch.log_softmax(logits, dim=-1), 5)
    if config.attention_backend == "triton" and cfg.kv_kind != "latent":  # (MLA: its decode kernel ran above)
        from kvtier.model.triton_attention import compile_variants

        attn = model.model.layers[0].self_attn  # (an fp8 cache's scales: the kernel's fp8 variant)
        kv_scale = getattr(attn, "kv_scale", None)
        dtype = next(model.parameters()).dtype
        compile_variants(kv_caches[0], cfg.num_heads, scratch_block, max_model_len, dtype, kv_scale)
    if host_kv is not None and host_kv.shape[0] > 0:
        from kvtier.transfer import kernels

        if kernels.available():
            kernels.compile_variants(host_kv, kv_caches, scratch_block, 0)
    tokens.cpu()  # (a sync: everything above ran)
    return num_compiled() - before
