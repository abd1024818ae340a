"""Prompts and greedy settings shared by the tests that compare kvtier with transformers."""

from __future__ import annotations

import torch

import kvtier

FAMILIES = ["llama-tiny", "mistral-tiny", "qwen2-tiny", "qwen3-tiny", "mixtral-tiny", "qwen2-moe-tiny", "qwen3-moe-tiny"]
MAX_TOKENS = 12


def prompts_for(seed: int, lengths=(3, 17, 40, 66)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


GREEDY = kvtier.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
