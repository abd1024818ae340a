"""``jit``: ``triton.jit`` that compiles one kernel per launch configuration, and counts its
compiles.

Triton specializes every integer argument on its value (== 1, divisible by 16) and every pointer
on its 16-byte alignment, and compiles a new kernel the first time a new combination comes: on
an H100 that is a 1-2.5 s engine step, in the middle of serving. Measured (``bash
scripts/gpu_serving_benches.sh multiturn_pd``, H100): with a cold Triton cache the P, D and colocated
servers each had 1.7-2.6 s steps at random rounds (PD TTFT mean 884 ms, p99 4.6 s); the same run
again on a warm cache had none (281 ms, p99 0.53 s). The arguments that change from step to step
(batch size, block-table width, which layer, how many blocks; where a step's inputs start in its
upload buffer) are therefore not specialized: ``vary`` (ints: neither value nor divisibility)
and ``unaligned`` (pointers: no alignment assumption). What is left to specialize on is fixed
by the model and the engine's sizes, so the engine compiles every variant at start
(``kvtier/engine/warmup.py``) and :func:`num_compiled` tells whether serving compiled any more.

Triton before 3.2 has no ``do_not_specialize_on_alignment``: there ``unaligned`` pointers go to
``do_not_specialize``, which drops the same assumption.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

import triton

KERNELS: list[Any] = []  # every kernel made by jit(), for num_compiled()


def jit(*, vary: Sequence[str] = (), unaligned: Sequence[str] = ()) -> Callable[[Any], Any]:
    if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters:
        # (ints in both lists: some Triton versions read an int's divisibility as its "alignment")
        wrap = triton.jit(do_not_specialize=list(vary), do_not_specialize_on_alignment=[*vary, *unaligned])
    else:
        wrap = triton.jit(do_not_specialize=[*vary, *unaligned])

    def register(fn: Callable[..., Any]) -> Any:
        kernel = wrap(fn)
        KERNELS.append(kernel)
        return kernel

    return register


def num_compiled() -> int:
    """Kernel variants compiled (or loaded from Triton's disk cache) so far in this process, over
    every kernel of :data:`KERNELS`; 0 under Triton's interpreter, which compiles nothing."""
    total = 0
    for kernel in KERNELS:
        caches = getattr(kernel, "device_caches", None)  # Triton >= 3.2: device -> (cache, ...)
        if caches is not None:
            total += sum(len(entry[0]) for entry in list(caches.values()))
            continue
        cache = getattr(kernel, "cache", None)  # older: device -> {key: kernel}
        if isinstance(cache, dict):
            total += sum(len(v) for v in cache.values())
    return total
