"""Tensor parallelism: one model over ``tensor_parallel_size`` ranks, one process per rank.

::

    rank 0 (the engine's process)                          rank r > 0 (engine/tp/worker.py)
    scheduler ─ cache manager ─ copy pump                  nothing decides here
         │ TransferOps ──────────── ops ─────────────────► its own transfer engine, KV shard, host shard
         │ runner.forward(host inputs) ─ forward ─────────► runner.follow(host inputs): the same forward
         │     all-reduce after attention and MLP  ◄═══════►     (torch.distributed: NCCL / gloo)
         │ logits, sampling; broadcast of the tokens ═════►     (the next step may read them on the device)
         ◄────────────────── landed ops, acks, errors ──── (a copy counts as landed once every rank's has)

One scheduler and one cache manager decide for every rank: rank 0 sends each rank the same
transfer ops and step inputs, over a socket pair per rank (engine/tp/ranks.py), in the order it
runs them. The collectives are the forward's (two all-reduces per layer) and one broadcast of
the sampled tokens per step; none is inside a loop whose length one rank decides alone.

Waits are bounded: the process group is made with ``tp_timeout`` (a collective that a rank never
joins raises on gloo, and NCCL's watchdog ends the process), every answer rank 0 waits for has
the same timeout, and a watchdog thread sees a rank process exit. Any of these is
:class:`RankLost` (a :class:`~kvtier.engine.fatal.DeviceLost`): the engine stops, naming the rank,
and ``kvtier serve`` exits non-zero. A rank whose rank 0 is gone exits on its own.
"""

from kvtier.engine.tp.ranks import RankLost, Ranks

__all__ = ["RankLost", "Ranks"]
