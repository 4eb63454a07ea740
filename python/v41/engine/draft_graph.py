"""The DSpark draft pass of a batch, eager or replayed from CUDA graphs (docs/speculative-decoding.md §2 step 5,
docs/architecture.md §3a).

Per request the pass computes the block ``[anchor, noise × (K − 1)]`` at positions ``n .. n + K − 1`` through the
drafter stages (:meth:`v41.models.fast.model.FastModel.draft`): base logits ``[K, V]`` and the confidence head's
hidden input ``y`` ``[K, D]``, and with greedy drafts their confidence logits. Then the Markov head
follows slot by slot; with greedy drafts that loop (``d_{i+1} = argmax(base_i + markov(d_i))``, ``d_0`` = the
anchor) is part of the pass too, so a graph replay yields the drafts with no host round trip between slots.
Probabilistic drafts need each request's sampling parameters and keyed draws per slot: the engine runs that loop
on the returned base logits (:mod:`.spec_decode`).

:class:`DraftGraphs` captures one graph per padded batch size (the sizes of the verify graphs). Its static inputs
are one int64 region ``[3, size]`` (anchor ids, anchor positions, block-table rows) and its pinned twin, filled by
one non-blocking copy; padding rows point at the block tables' padding row (every ring slot −1, nothing read) and
their drafts are dropped. The persistent ``dspark`` tables are read at full width, so a graph serves every step.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import Tensor

from ..models.fast.dspark import DraftBatch
from .block_tables import DeviceBlockTables

log = logging.getLogger("v41.engine")


def draft_pass(model, tables: DeviceBlockTables, rows: Tensor, anchors: Tensor, positions: Tensor,
               num_drafts: int) -> tuple[Tensor, Tensor, Tensor]:
    """The draft pass of B requests on the device: ``rows``, ``anchors``, ``positions`` [B] int64 (block-table
    rows, anchor ids, anchor positions n). Returns base logits [B, K, V] float32, the confidence head's hidden
    input ``y`` [B, K, D], the greedy drafts [B, num_drafts] int64 (``num_drafts`` ≤ K) and their raw confidence
    logits [B, num_drafts] float32 (:meth:`~v41.models.fast.dspark.FastDrafter.confidence`). No host
    synchronisation (capturable)."""
    cfg = model.cfg
    k = cfg.dspark_block_size
    b = anchors.shape[0]
    offs = torch.arange(k, device=anchors.device)
    ids = torch.where(offs[None, :] == 0, anchors[:, None], cfg.dspark_noise_token_id)
    batch = DraftBatch(token_ids=ids.reshape(-1), positions=(positions[:, None] + offs[None, :]).reshape(-1),
                       req_index=torch.arange(b, device=anchors.device).repeat_interleave(k),
                       block_table=tables.tables["dspark"].index_select(0, rows))
    base, y = model.draft(batch)
    base = base.view(b, k, -1)
    out, drafts = anchors, []
    for i in range(num_drafts):
        out = (base[:, i] + model.drafter.markov_logits(out)).argmax(dim=-1)
        drafts.append(out)
    drafts = torch.stack(drafts, dim=1)
    y = y.view(b, k, -1)
    outs = torch.cat([anchors[:, None], drafts[:, :-1]], dim=1)  # the Markov inputs out_0..out_{k-1}
    return base, y, drafts, model.drafter.confidence(y[:, :num_drafts], outs)


class DraftGraphs:
    """Draft-pass graphs of ``sizes`` requests (module docstring). ``tables``: the runner's persistent block
    tables; ``num_drafts``: the drafts per request (``num_speculative_tokens``)."""

    def __init__(self, model, tables: DeviceBlockTables, sizes: list[int], num_drafts: int, device: torch.device):
        self.model, self.tables, self.num_drafts = model, tables, num_drafts
        self.sizes = sorted(sizes)
        self.host, self.dev, self.outputs, self.graphs = {}, {}, {}, {}
        self._done: torch.cuda.Event | None = None
        pool = None
        for size in reversed(self.sizes):
            self.host[size] = torch.zeros(3, size, dtype=torch.int64, pin_memory=True)
            self.dev[size] = torch.zeros(3, size, dtype=torch.int64, device=device)
            self.dev[size][2] = tables.padding_row
            run = self._runner(size)
            for _ in range(2):  # warm up: Triton compiles, the allocator settles
                run()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = run()
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
        log.info("captured DSpark draft graphs for batch sizes %s", self.sizes)

    def _runner(self, size: int):
        d = self.dev[size]
        return lambda: draft_pass(self.model, self.tables, d[2], d[0], d[1], self.num_drafts)

    def fits(self, b: int) -> bool:
        return b <= self.sizes[-1]

    def run(self, table_rows: np.ndarray, anchors: np.ndarray, positions: np.ndarray
            ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """:func:`draft_pass` of B ≤ the largest size requests (host int64 [B] arrays) by one replay: views of the
        graph's outputs [B, K, V] / [B, K, D] / [B, num_drafts] / [B, num_drafts], valid until the next replay of
        this size."""
        b = anchors.shape[0]
        size = next(s for s in self.sizes if s >= b)
        if self._done is not None:
            self._done.synchronize()  # the pinned twin's last copy has finished
        host = self.host[size].numpy()
        host[0], host[1], host[2] = 0, 0, self.tables.padding_row
        host[0, :b], host[1, :b], host[2, :b] = anchors, positions, table_rows
        self.dev[size].copy_(self.host[size], non_blocking=True)
        self._done = torch.cuda.Event()
        self._done.record()
        self.graphs[size].replay()
        return tuple(t[:b] for t in self.outputs[size])
