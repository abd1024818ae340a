"""A shared pool never hands one model's KV to another: storage keys carry the weights and what a
stored block contains (R3 routing), so different engines simply miss each other's objects."""
from __future__ import annotations

import numpy as np

import kvtier
from kvtier.model import init_model, weights_digest

PROMPT = np.random.default_rng(0).integers(0, 250, 100).tolist()
ONE = kvtier.SamplingParams(max_tokens=2, ignore_eos=True)
KW = dict(num_host_blocks=32, block_size=8, write_policy="write_through", prefetch_policy="wait_complete",
          storage_fetch="always")


def storage_hits(model, url: str, **kw) -> int:
    with kvtier.LLM(model, storage=url, **KW, **kw) as llm:
        return llm.generate([PROMPT], ONE)[0].cached_tokens_by_tier["storage"]


def test_same_shape_other_weights_do_not_share_kv(tmp_path):
    a = init_model("llama-tiny", tmp_path / "a", seed=0)
    b = init_model("llama-tiny", tmp_path / "b", seed=1)      # a "fine-tune": same config, other weights
    assert weights_digest(a) != weights_digest(b)
    assert weights_digest(a) == weights_digest(init_model("llama-tiny", tmp_path / "a2", seed=0))
    url = f"file://{tmp_path}/pool"
    storage_hits(a, url)
    assert storage_hits(b, url) == 0                           # b's keys are its own
    assert storage_hits(a, url) == 96                          # a still hits its objects


def test_routing_capture_on_and_off_use_different_objects(checkpoint, tmp_path):
    moe = checkpoint("qwen3-moe-tiny")
    url = f"file://{tmp_path}/pool"
    storage_hits(moe, url, capture_routing=True)
    assert storage_hits(moe, url, capture_routing=False) == 0  # no routing payload: another object
    assert storage_hits(moe, url, capture_routing=True) == 96
    names = list((tmp_path / "pool").rglob("kvt:*"))
    assert len(names) == 2 * ((100 + 2) // 8)                  # both kinds kept, none deleted
