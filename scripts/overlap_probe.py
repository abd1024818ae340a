"""GPU probe: overlap scheduling on vs off on the throughput workload, alternating, with a phase
breakdown of step() and a cProfile of one overlap run. Writes $OUT/overlap_probe.txt."""
from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

import kvtier
from kvtier.bench.throughput import make_requests
from kvtier.model import init_model

out_dir = Path(os.environ.get("OUT", "/tmp"))
n_req = int(sys.argv[1]) if len(sys.argv) > 1 else 128
tmp = tempfile.mkdtemp()
path = init_model("qwen3-0.6b-shape", tmp)
reqs = make_requests(n_req, 0, 32000, (100, 1024), (100, 600))
lines = []


def say(s):
    print(s, flush=True)
    lines.append(s)


def timed(llm, profile=False):
    phases = {"schedule": 0.0, "launch": 0.0, "finish": 0.0, "collect": 0.0}
    core = llm
    real = {"schedule": core.scheduler.schedule, "launch": core._launch, "finish": core._finish}

    def wrap(name, fn):
        def call(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                phases[name] += time.perf_counter() - t
        return call
    core.scheduler.schedule = wrap("schedule", real["schedule"])
    core._launch = wrap("launch", real["launch"])
    core._finish = wrap("finish", real["finish"])
    from kvtier.engine import runner as runner_mod
    real_collect = runner_mod.StepResult.collect

    def collect(self):
        t = time.perf_counter()
        try:
            return real_collect(self)
        finally:
            phases["collect"] += time.perf_counter() - t
    runner_mod.StepResult.collect = collect
    torch.cuda.synchronize()
    prof = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    outs = llm.generate([p for p, _ in reqs], [kvtier.SamplingParams(max_tokens=n, ignore_eos=True) for _, n in reqs])
    if prof:
        prof.disable()
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    runner_mod.StepResult.collect = real_collect
    core.scheduler.schedule, core._launch, core._finish = real["schedule"], real["launch"], real["finish"]
    toks = sum(len(o.token_ids) for o in outs)
    return dt, toks, phases, prof


engines = {}
for overlap in (False, True):
    llm = kvtier.LLM(path, device="cuda", dtype="bfloat16", max_num_batched_tokens=8192, max_num_seqs=256,
                     max_model_len=4096, overlap_schedule=overlap, num_device_blocks=14000)
    llm.generate([p for p, _ in reqs[:64]], kvtier.SamplingParams(max_tokens=16, ignore_eos=True))
    llm.generate([p for p, _ in reqs], [kvtier.SamplingParams(max_tokens=8, ignore_eos=True) for _ in reqs])
    engines[overlap] = llm
for rnd in range(2):
    for overlap in (False, True):
        dt, toks, ph, _ = timed(engines[overlap])
        say(f"round {rnd} overlap={overlap}: {toks} tok in {dt:.2f}s = {toks / dt:.0f} tok/s; "
            + " ".join(f"{k} {v:.2f}s" for k, v in ph.items()))
dt, toks, ph, prof = timed(engines[True], profile=True)
say(f"profiled overlap=True: {toks / dt:.0f} tok/s")
s = io.StringIO()
pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
say(s.getvalue())
s = io.StringIO()
pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(40)
say(s.getvalue())
(out_dir / "overlap_probe.txt").write_text("\n".join(lines))
