"""`gpu_memory_utilization` (`kvtier serve --gpu-memory-utilization`) bounds what the engine
process holds on its GPU, as vLLM's does: weights, the device tier, activations, CUDA graphs and
the CUDA context together stay under that fraction of the GPU's memory, after a batch that fills
the step budget; a larger fraction gives the device tier what it adds, block for block."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU (one H100 80GB runs it: python -m pytest tests/engine/test_gpu_memory.py)",
)

CHILD = r"""
import json, sys, tempfile, torch, kvtier
from kvtier.model import init_model
u = float(sys.argv[1])
free0, total = torch.cuda.mem_get_info()
path = init_model("qwen3-0.6b-shape", tempfile.mkdtemp(), config_only=True)
with kvtier.LLM(path, device="cuda", load_format="dummy", gpu_memory_utilization=u, max_num_seqs=64) as llm:
    prompts = [[(7 * i + j) % 1000 for j in range(500 + i)] for i in range(64)]
    llm.generate(prompts, kvtier.SamplingParams(max_tokens=16, ignore_eos=True))
    free, _ = torch.cuda.mem_get_info()
    print(json.dumps({"total": total, "used_before": total - free0, "used": total - free,
                      "blocks": llm.cache.device_pool.num_blocks, "block_bytes": llm.cache.block_nbytes}))
"""


def run(u: float) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(u)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_engine_stays_under_its_fraction_of_gpu_memory():
    half, more = run(0.5), run(0.7)
    for u, got in ((0.5, half), (0.7, more)):
        assert got["used"] <= u * got["total"], (u, got)
    # the 0.2 more of the GPU goes to the device tier (less a block's rounding, and what another
    # process took meanwhile)
    extra = (more["blocks"] - half["blocks"]) * half["block_bytes"]
    assert abs(extra - 0.2 * half["total"]) <= 0.02 * half["total"], (half, more)
