"""CUDA graphs for decode and speculative verify steps (docs/architecture.md §3a; nano-vllm's ``capture_cudagraph``
and mini-sglang's graph runner are the models): one graph per padded batch size, captured at start-up largest first
into one shared memory pool, replayed for every step whose requests each compute at most ``query_tokens`` tokens
(1 for plain decode; ``1 + K`` verify rows when speculating).

Each graph reads its own region of static inputs (:mod:`.graph_inputs`: token ids, positions, per-token request
rows, cached lengths, state rows, block-table rows, a fixed-size block-table diff per kind, slot mappings, Engram
rows, compressor segments). Each step packs its host plan padded to the graph's size into that region's pinned twin
and copies it with one non-blocking copy; the graph itself applies the diff to the persistent tables and gathers
its rows at full width (:mod:`.block_tables`) before the forward, and returns the logits of every row; the step's
rows are picked after the replay. A step whose diff exceeds the region (many admissions into one step) or with a
request of more tokens than ``query_tokens`` runs eager (:mod:`.model_runner`).
On a CPU device the runner "replays" by running the same prologue and forward eagerly on the static inputs, so the
packing and padding are tested without a GPU.
"""

from __future__ import annotations

import logging

import torch

from .graph_inputs import GraphInputs
from .host_step import HostStep

log = logging.getLogger("v41.engine")
CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def capture_sizes(max_size: int) -> list[int]:
    """Padded batch sizes captured for ``--max-cudagraph-capture-size`` = ``max_size`` (itself included)."""
    sizes = [s for s in CAPTURE_SIZES if s < max_size]
    return sizes + [max_size]


class CudaGraphRunner:
    """Captures ``model.forward`` on static inputs (``make_inputs(size)`` → :class:`~.graph_inputs.GraphInputs` of
    ``query_tokens`` rows per request) for every size in ``sizes`` (largest first, one memory pool) and replays the
    smallest graph that fits a step. ``capture``: False runs the static inputs eagerly (CPU tests); ``pool``: a
    graph memory pool to capture into (runners of several ``query_tokens`` share one; the last pool is ``.pool``)."""

    def __init__(self, model, sizes: list[int], make_inputs, capture: bool = True, pool=None):
        self.model, self.capture, self.pool = model, capture, pool
        self.sizes = sorted(sizes)
        self.inputs: dict[int, GraphInputs] = {size: make_inputs(size) for size in self.sizes}
        self.query_tokens = self.inputs[self.sizes[0]].q
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        if not capture:
            return
        pool = pool
        for size in sorted(sizes, reverse=True):
            batch = self.inputs[size].batch()
            prologue = self.inputs[size].prologue
            for _ in range(2):  # warm up: Triton compiles, the allocator settles
                prologue()
                model.forward(batch)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                prologue()
                self.outputs[size] = model.forward(batch)
            pool = graph.pool()
            self.graphs[size] = graph
        self.pool = pool
        torch.cuda.synchronize()
        log.info("captured CUDA graphs for batch sizes %s, %d query tokens per request", self.sizes,
                 self.query_tokens)

    def fits(self, step: HostStep) -> bool:
        """A step whose requests fit the largest graph."""
        return (step.num_requests <= self.sizes[-1]
                and self.inputs[self._size(step.num_requests)].fits(step))

    def _size(self, r: int) -> int:
        return next(s for s in self.sizes if s >= r)

    def run(self, step: HostStep, before_replay=None) -> torch.Tensor:
        """Logits [N, vocab] of ``step.logits_rows`` (in order). ``before_replay(token_ids, engram_rows)``, if
        given, runs on the filled static inputs before the replay (async scheduling's pending rows,
        :mod:`.pending`; token row i of the step is row i of the graph at one query token per request)."""
        size = self._size(step.num_requests)
        inputs = self.inputs[size]
        inputs.fill(step)
        if before_replay is not None:
            assert inputs.q == 1, "pending rows are resolved in plain decode graphs only"
            before_replay(inputs.views["token_ids"], inputs.views["engram_rows"])
        return inputs.outputs(self._replay(size))

    def run_dummy(self, size: int, token_ids) -> torch.Tensor:
        """Replay graph ``size`` on all-padding inputs with ``token_ids`` [size·q] (the verify-cost profile of
        :mod:`.adaptive_verify`): every row's logits, nothing written to the cache."""
        self.inputs[size].fill(None, token_ids)
        return self._replay(size)

    def _replay(self, size: int) -> torch.Tensor:
        if self.capture:
            self.graphs[size].replay()
            return self.outputs[size]
        self.inputs[size].prologue()
        return self.model.forward(self.inputs[size].batch())
