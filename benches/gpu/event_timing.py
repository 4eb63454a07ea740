"""GPU time of a call by CUDA events (docs/benchmarking.md "How a figure is taken"): the shared timing loop of the
scripts in benches/gpu."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def median_ms(fn: Callable[[], object], reps: int, before: Callable[[int], object] | None = None,
              warmup: int = 1) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` calls, each timed between two events on the current stream
    and waited for; ``before(i)`` runs untimed before call i (e.g. fresh inputs copied into a graph's static
    buffers); ``warmup`` untimed calls first."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(reps):
        if before is not None:
            before(i)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)
