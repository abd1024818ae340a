"""Helpers for the model tests: HF reference logits and a tiny paged-KV driver."""

from __future__ import annotations

import random

import torch

from kvtier.model import PRESETS, SUPPORTED_ARCHITECTURES, AttentionMetadata, CausalLM, allocate_kv_caches
from kvtier.model.presets import preset_architecture

# the served families; the latent-attention presets are tested in test_mla.py, the hybrid
# sliding-window ones (gpt-oss, Gemma) in test_sliding_window.py
TINY_PRESETS = [name for name in PRESETS if name.endswith("-tiny") and preset_architecture(name) in SUPPORTED_ARCHITECTURES]
MOE_PRESETS = ["mixtral-tiny", "qwen2-moe-tiny", "qwen3-moe-tiny"]
BLOCK_SIZE = 4


def hf_logits(hf, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([token_ids])).logits[0].float()


class PagedSequences:
    """Runs steps of several sequences over one paged KV cache, each with its own shuffled block table."""

    def __init__(self, model: CausalLM, num_blocks: int = 64, seed: int = 0):
        self.model = model
        self.kv_caches = allocate_kv_caches(model.config, num_blocks, BLOCK_SIZE)
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)  # non-contiguous, out-of-order block tables
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}

    def step(self, chunks: dict[int, list[int]], **kwargs) -> dict[int, torch.Tensor]:
        """Append ``chunks[seq_id]`` to each sequence in one varlen step; returns logits per sequence."""
        ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        for seq_id, tokens in chunks.items():
            start = self.lengths.get(seq_id, 0)
            end = start + len(tokens)
            table = self.tables.setdefault(seq_id, [])
            while len(table) * BLOCK_SIZE < end:
                table.append(self.free_blocks.pop())
            ids += tokens
            positions += range(start, end)
            query_lens.append(len(tokens))
            seq_lens.append(end)
            tables.append(list(table))
            self.lengths[seq_id] = end
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK_SIZE)
        hidden = self.model(torch.tensor(ids), torch.tensor(positions), self.kv_caches, meta, **kwargs)
        logits = self.model.compute_logits(hidden)
        out, start = {}, 0
        for seq_id, n in zip(chunks, query_lens):
            out[seq_id] = logits[start : start + n]
            start += n
        return out


def random_tokens(n: int, seed: int, vocab: int = 259) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()
