"""The ``reference`` fixture: transformers' greedy continuations of a preset's checkpoint."""

from __future__ import annotations

import pytest
import torch

from tests.engine.hf_reference import MAX_TOKENS


@pytest.fixture(scope="module")
def reference(checkpoint, hf_model):
    """reference(preset, prompts) -> HF greedy continuations (cached)."""
    memo = {}

    def get(preset, prompts):
        key = (preset, tuple(map(tuple, prompts)))
        if key not in memo:
            hf = hf_model(checkpoint(preset))
            outs = []
            for p in prompts:
                ids = torch.tensor([p])
                with torch.no_grad():  # explicit mask: HF would mask prompt tokens equal to pad_token_id
                    seq = hf.generate(
                        ids,
                        attention_mask=torch.ones_like(ids),
                        max_new_tokens=MAX_TOKENS,
                        min_new_tokens=MAX_TOKENS,
                        do_sample=False,
                        pad_token_id=0,
                    )
                outs.append(seq[0, len(p) :].tolist())
            memo[key] = outs
        return memo[key]

    return get
