"""A second CUDA stream for independent work inside a forward (docs/kernels.md §1 "A second stream").

At decode sizes most GEMMs of a layer are latency-bound: one wave of CTAs that leaves HBM bandwidth unused. Work
that does not depend on the main stream's next kernels (the shared expert beside the router and the routed experts,
as SGLang's DeepSeek model does) is queued on a side stream and joined back before its result is used, so the two
overlap on the GPU. CUDA graph capture records the fork and join as graph edges, so replays overlap too.

Memory safety: every :func:`beside` call first makes the side stream wait for the current one, and the current
stream waits for the side stream at :meth:`Pending.wait`; so a tensor the side stream allocates and the main
stream reads, or the reverse, is never reused by one stream while the other still uses it, as long as the caller
keeps its inputs alive until :meth:`Pending.wait` (arguments of the enclosing ``forward`` are).

Scratch that a kernel keeps per device and reuses across launches (the split-K arrival counters of
:func:`.wstream.split_counters`) must not be shared by two concurrent launches: :func:`lane` says which stream a
launch is queued on (0 main, 1 side), and such scratch is kept per lane.

Memory: what side work allocates is cached in the side stream's pool, which the main stream does not reuse (the
indexer's scores of site ``cache_and_index``: up to ``EngineArgs.index_scratch_bytes``), so turning the side stream
on raises the peak beside the KV cache — little at the steps of up to 8 tokens it takes by default
(:data:`MAX_TOKENS`); programmatic dependent launch stays on with it (``pdl.WITH_SIDE_STREAM``, :mod:`.pdl`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

import torch
from torch import Tensor

# On for steps of up to 8 tokens: with programmatic dependent launch also on (:data:`.pdl.WITH_SIDE_STREAM`)
# flash-slice-v41 B = 1 took 2.55 against 2.71 ms and flash-slice-v4 1.21 against 1.27 ms on an H100, in
# interleaved pairs (benches/RESULTS.md "2026-12-05 (afternoon)"); without PDL it was 3 % slower. B = 8 took 4.91 /
# 4.92 against 5.03 / 5.03 ms, B = 64 14.72 against 13.29 ms (10.7 % slower: its GEMMs fill the GPU on their own),
# so longer steps run inline (RESULTS "2026-12-05 (evening)"). Any step of at most 8 tokens takes it: decode
# batches, and also a verification of B · (1 + K) ≤ 8 tokens or a prefill chunk that short (not timed apart).
ENABLED = True  # run side work on the side stream (False: inline on the current stream; same results)
MAX_TOKENS = 8  # ... for steps of at most this many tokens (the rows of ``like``); longer steps run inline
# The call sites that use it (benches set a subset to measure each): the shared expert beside the routed experts
# (models/fast/moe.py), an attention layer's cache writes and then its indexer's selection of compressed entries
# beside its query path (models/fast/attention.py).
SITES = "shared_expert,cache_and_index"
T = TypeVar("T")
_streams: dict[torch.device, torch.cuda.Stream] = {}
_lane = [0]


def lane() -> int:
    """0 while work is queued on the main stream, 1 inside :func:`beside`."""
    return _lane[0]


class Pending(Generic[T]):
    """The result of :func:`beside`; :meth:`wait` joins the side stream and returns it."""

    def __init__(self, value: T, stream: torch.cuda.Stream | None):
        self._value, self._stream = value, stream

    def wait(self) -> T:
        """The current stream waits for the side stream's work so far; returns the side function's result."""
        if self._stream is not None:
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)
            self._stream = None
        return self._value


def stream_for(device: torch.device) -> torch.cuda.Stream:
    """The side stream of a CUDA ``device`` (one per device, made on first use; also the MoE prefill path's
    dequantization stream, :mod:`.moe_prefill`)."""
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _streams:
        _streams[device] = torch.cuda.Stream(device)
    return _streams[device]


def takes(like: Tensor, site: str) -> bool:
    """Whether :func:`beside` queues work for ``site`` on the side stream: :data:`ENABLED`, ``site`` in
    :data:`SITES`, ``like`` a CUDA tensor of at most :data:`MAX_TOKENS` rows, and not already inside :func:`beside`."""
    return (ENABLED and site in SITES.split(",") and like.device.type == "cuda" and like.shape[0] <= MAX_TOKENS
            and not _lane[0])


def beside(fn: Callable[[], T], like: Tensor, site: str) -> Pending[T]:
    """Queues ``fn()`` on the side stream of ``like``'s device (``like``: the step's rows, [T, ...]) after
    everything queued so far on the current stream where :func:`takes` says so; otherwise runs it inline (same
    results, no overlap)."""
    if not takes(like, site):
        return Pending(fn(), None)
    side = stream_for(like.device)
    side.wait_stream(torch.cuda.current_stream(like.device))
    _lane[0] = 1
    try:
        with torch.cuda.stream(side):
            value = fn()
    finally:
        _lane[0] = 0
    return Pending(value, side)
