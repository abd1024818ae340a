"""What a step hands to the host, packed on the device into one vector and moved in one transfer
(one host sync), then taken apart into logprobs entries (engine/outputs.py) on the host::

    [ tokens (n) | logprobs block: rows x (1 + 2k) | prompt logprobs block: rows x (1 + 2k) ]
                   each row: logprob of its token, the top-k logprobs, their token ids

float64 holds every token id exactly, so ids and logprobs share the vector. The plain step
(engine/runner.py) packs its tokens, its sampled tokens' logprobs and its prompt logprobs; a
drafted step packs the logprobs of the tokens its verification emits.
"""

from __future__ import annotations

import numpy as np
import torch

from kvtier.engine.sampling import topk


class ResultPack:
    """What one step hands to the host, packed on the device into one float64 vector (token ids
    and top-k ids are exact in float64) and moved in one transfer (module docstring)."""

    def __init__(self, tokens: torch.Tensor) -> None:
        self.parts = [tokens.double()]
        self.size = tokens.numel()

    @staticmethod
    def scored(lp: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
        """[rows, 1 + 2k]: logprob of ``ids``, then the top-k logprobs, then their token ids."""
        top = topk(lp, k)
        return torch.cat([lp.gather(1, ids[:, None]), top.values, top.indices.to(lp.dtype)], dim=1).double()

    def add(self, lp: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[int, int, int]:
        return self.add_block(self.scored(lp, ids, k), k)

    def add_block(self, block: torch.Tensor, k: int) -> tuple[int, int, int]:
        where = (self.size, block.shape[0], block.shape[1])
        self.parts.append(block.flatten())
        self.size += block.numel()
        return where

    def vector(self) -> torch.Tensor:
        return torch.cat(self.parts) if len(self.parts) > 1 else self.parts[0]

    @staticmethod
    def entries(host: np.ndarray, where: tuple[int, int, int], ids: list[int], ks: list[int]) -> list[dict[int, float]]:
        """Per row: {its token: logprob, then its own top-k (rank order): logprob}."""
        start, n, width = where
        block = host[start : start + n * width].reshape(n, width)
        k = (width - 1) // 2
        # whole columns to Python at once, then one dict per row built in C (dict.update over a
        # zip): this runs on the engine thread after every step's sync, with the GPU idle
        sampled = block[:, 0].tolist()
        values = block[:, 1 : 1 + k].tolist()
        top_ids = block[:, 1 + k :].astype(np.int64).tolist()
        out = []
        for token, s, v, i, kr in zip(ids, sampled, values, top_ids, ks):
            entry = {token: s}
            # the sampled token's top-k value (if it is in the top k) is the same logprob
            entry.update(zip(i[:kr], v[:kr]))
            out.append(entry)
        return out
