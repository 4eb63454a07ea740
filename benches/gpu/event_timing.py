"""GPU time of a call by CUDA events (docs/benchmarking.md "How a figure is taken"): the shared timing loops of the
scripts in benches/gpu (eager calls, or calls captured in one CUDA graph), and the relative difference they print."""

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


def graph_us(calls) -> float:
    """Median µs per call of ``calls`` (zero-argument callables) captured in one graph."""
    for c in calls[:2]:
        c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    return statistics.median(median_ms(g.replay, 5) for _ in range(3)) * 1e3 / len(calls)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 difference ‖a − b‖ / ‖b‖ (float32), the check printed beside a bench cell."""
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()
