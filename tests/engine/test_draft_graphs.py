"""The draft chain (engine/draft_graphs.py) against the MTP block run one pass at a time, each
with its own attention metadata: the same drafts and the same MTP KV, rows padded up to a
bucket, a request whose chain runs past its block table writing only into the scratch block.
The engine's tests cannot see a wrong draft (verification keeps every output exact; only the
acceptance would drop), so the drafts themselves are compared here. On a CPU the chain runs
eagerly over its static buffers; tests/engine/test_speculative_gpu.py replays it on CUDA."""

from __future__ import annotations

import pytest
import torch

from kvtier.engine.draft_graphs import DraftGraphs
from kvtier.model import AttentionMetadata, allocate_kv_caches, load_model

BS, BLOCKS, PASSES = 4, 24, 3
SCRATCH = BLOCKS  # (the pool's extra block)


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(
                not torch.cuda.is_available(),
                reason=(
                    "replays the chain from CUDA graphs: needs a CUDA GPU (one H100 80GB runs it: "
                    "python -m pytest tests/engine/test_draft_graphs.py)"
                ),
            ),
        ),
    ],
)
def test_the_chain_drafts_what_one_pass_at_a_time_drafts(checkpoint, device):
    dev = torch.device(device)
    # (CUDA graphs need the Triton kernels, which read the lengths from device memory)
    model = load_model(
        checkpoint("qwen3-mtp-tiny"), mtp=True, device=dev, attention_backend="triton" if device == "cuda" else "torch"
    )
    cfg = model.config
    gen = torch.Generator().manual_seed(0)
    # (prompt length, block table): the second's table ends one position after its prompt, so
    # only its first chained pass has a slot; the third fills its table's first two blocks
    seqs = [(11, [3, 0, 9, 4]), (7, [5, 6]), (8, [12, 2, 7])]
    kv = allocate_kv_caches(cfg, BLOCKS + 1, BS, dev)
    first, cur, starts = [], [], []
    for n, table in seqs:  # each prompt's target and MTP KV, and its first draft
        ids = torch.randint(0, cfg.vocab_size, (n + 1,), generator=gen).to(dev)
        meta = AttentionMetadata.build([n], [n], [table[: -(-n // BS)]], BS, dev)
        pos = torch.arange(n, device=dev)
        hidden = model(ids[:n], pos, kv, meta)
        m = model.draft(ids[1:], pos, hidden, kv, meta)
        first.append(int(model.draft_logits(m[-1:]).argmax()))
        cur.append(m[-1])
        starts.append(n)  # the chain's first pass writes the position after the prompt
    before = [t.clone() for t in kv]

    want = []  # one pass at a time, each with host-built metadata (as a reference)
    ref_kv = [t.clone() for t in kv]
    for (n, table), tok, h in zip(seqs, first, cur):
        toks, h = [], h[None]
        for s in range(PASSES):
            p = n + s
            if p >= len(table) * BS:
                break
            meta = AttentionMetadata.build([1], [p + 1], [table[: p // BS + 1]], BS, dev)
            h = model.draft(torch.tensor([tok], device=dev), torch.tensor([p], device=dev), h, ref_kv, meta)
            tok = int(model.draft_logits(h).argmax())
            toks.append(tok)
        want.append(toks)
    assert [len(t) for t in want] == [3, 1, 3]

    chain = DraftGraphs(model, kv, BS, 32, 8, PASSES, SCRATCH, dev, capture=device == "cuda")
    chain.capture_all()  # (on CUDA: every bucket's graph, each capture writing the scratch block only)
    kv_captured = [t.clone() for t in kv]
    assert all(torch.equal(a[:, :BLOCKS], b[:, :BLOCKS]) for a, b in zip(kv_captured, before))
    got = chain.run(
        torch.tensor(first, device=dev), torch.tensor(starts, device=dev), torch.stack(cur), [t for _, t in seqs]
    ).tolist()
    assert chain.bucket(len(seqs)) == 4  # one padding row
    assert chain.seq_lens[: len(seqs)].tolist() == [n + PASSES for n in starts]  # the last pass's lengths
    for i, toks in enumerate(want):
        assert [got[s][i] for s in range(len(toks))] == toks
    # the MTP layer's KV: what the reference wrote, at every block a request owns; blocks no
    # request owns are untouched (the overflowing pass and the padding row wrote the scratch block)
    mtp = cfg.num_layers  # every layer is [2, blocks, block_size, kv heads, head dim]
    owned = sorted({b for _, t in seqs for b in t})
    torch.testing.assert_close(kv[mtp][:, owned], ref_kv[mtp][:, owned])
    free = [b for b in range(BLOCKS) if b not in owned]
    assert all(torch.equal(a[:, free], b[:, free]) for a, b in zip(kv, before))
    assert not torch.equal(kv[mtp][:, SCRATCH], before[mtp][:, SCRATCH])
