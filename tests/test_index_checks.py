"""KVTIER_CHECK_INDICES=1: index tensors checked against their bounds before the ops that read
them, with the tensor named; an engine with the checks on answers as without them."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import kvtier
from kvtier import index_checks
from kvtier.transfer import kernels


@pytest.fixture
def checks_on(monkeypatch):
    monkeypatch.setattr(index_checks, "ENABLED", True)


def test_an_index_out_of_bounds_is_named(checks_on):
    index_checks.check("ok ids", torch.tensor([0, 3, 4]), 5)
    with pytest.raises(RuntimeError, match="block ids out of \\[0, 5\\)"):
        index_checks.check("block ids", torch.tensor([0, 5]), 5)
    with pytest.raises(RuntimeError, match="negative out of"):
        index_checks.check("negative", torch.tensor([-1]), 5)


def test_checks_are_off_unless_asked():
    assert not index_checks.ENABLED  # the test run's environment does not set it
    index_checks.check("anything", torch.tensor([99]), 5)


def test_a_scatter_to_a_block_that_does_not_exist_is_refused_by_name(checks_on):
    kv = torch.zeros(2, 4, 2, 1, 8)
    staging = torch.ones(1, 2, 2, 1, 8)
    with pytest.raises(RuntimeError, match="scatter dst_ids out of \\[0, 4\\)"):
        kernels.scatter_staged(kv, torch.tensor([7]), staging)
    kernels.scatter_staged(kv, torch.tensor([2]), staging)
    assert kv[:, 2].eq(1).all() and kv[:, [0, 1, 3]].eq(0).all()


def test_an_engine_with_the_checks_on_answers_as_without(checkpoint, monkeypatch):
    path = checkpoint("qwen3-tiny")
    prompts = [[5, 6, 7] * 9, [5, 6, 7] * 9 + [1, 2], [9] * 40]
    sp = kvtier.SamplingParams(max_tokens=6, ignore_eos=True)
    with kvtier.LLM(path, num_device_blocks=32, num_host_blocks=32, block_size=4) as llm:
        want = [o.token_ids for o in llm.generate(prompts, sp)]
    monkeypatch.setattr(index_checks, "ENABLED", True)
    calls = []
    real = index_checks.check

    def counted(*a: Any) -> Any:
        calls.append(a[0])
        return real(*a)

    monkeypatch.setattr(index_checks, "check", counted)
    with kvtier.LLM(path, num_device_blocks=32, num_host_blocks=32, block_size=4) as llm:
        assert [o.token_ids for o in llm.generate(prompts, sp)] == want
    assert {"slot_mapping", "block_tables", "input_ids"} <= set(calls)
