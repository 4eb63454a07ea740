"""Compressor pooling over a flattened step, batched and without host synchronisation (docs/model.md §3.6
V4.1 ratio 2, §4 V4 HCA / CSA).

An entry pools the tokens of one window of ``r`` positions with a per-channel softmax over their gates,
``c = Σ_t softmax_t(g_t) ⊙ v_t``. A step holds runs of windows: the engine cuts every request's token run at
window boundaries into *segments* (``StepBatch.segments[r]``: ``[S, L]`` token rows, −1 padded). Each segment is
reduced to the online-softmax triple ``(m, s, a)`` per channel: ``m = max g``, ``s = Σ e^{g−m}``,
``a = Σ e^{g−m}·v``, so ``c = a / s``. A window that began in an earlier step continues from the triple kept in
the request's state row (fp32 ``[3, C]``), and a segment that does not close its window leaves its triple
there (the pooling itself: :mod:`v41.kernels.window_pool`). Two triples combine exactly (up to rounding) by rescaling to the larger ``m``. V4's overlapping CSA
entry w also pools the A half of window w−1, whose triple is kept per closed window in the ``cov{r}`` cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ...kernels.segments import segment_facts
from ...kernels.window_pool import gate_bias, pool_windows
from ..protocol import StepBatch


@dataclass(frozen=True)
class Segments:
    """Per-step facts of the windows of ratio ``r`` (computed once per step, shared by every layer).

    rows [S, L] token rows (clamped ≥ 0), valid [S, L]; req [S] request row; window [S] window index (entry id
    it closes); continues [S] the window began before this step (its triple is in the state row); closes [S]
    the segment's last token closes the window; last_row [S]; state_row [S] the request's state row; keep_row
    [S] where the segment's open triple goes (its state row, or the reserved dummy row when it closes);
    closed_row [S] last_row, −1 for a padding segment (no valid row).

    ``ring`` R > 0 (ratio 2 under speculative decoding, :func:`.cache.fast_layout`): state rows are rings of R
    slots, flat row ``state_row·R + window mod R``; every segment that opens one of its request's last R windows
    of the step keeps its first token's triple there (``keep_row``), whether the step closes that window or not,
    so a rolled-back verify step finds the triple of the window it resumes in.
    """

    ratio: int
    rows: Tensor
    valid: Tensor
    req: Tensor
    window: Tensor
    continues: Tensor
    closes: Tensor
    last_row: Tensor
    state_row: Tensor
    keep_row: Tensor
    closed_row: Tensor
    ring: int = 0

    @classmethod
    def build(cls, batch: StepBatch, ratio: int, dummy_state_row: int, ring: int = 0) -> "Segments":
        """The facts of ``batch.segments[ratio]`` (:func:`v41.kernels.segments.segment_facts`: one launch)."""
        f = segment_facts(batch.segments[ratio], batch.positions, batch.req_index, batch.state_rows, batch.seq_lens,
                          ratio, dummy_state_row, ring)
        return cls(ratio=ratio, ring=ring, **f)


def pool_step(seg: Segments, value: Tensor, gate: Tensor, state: Tensor, ape: Tensor | None = None,
              positions: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Pool this step's rows per segment, continue windows from ``state`` [rows, 3, C] (fp32; [rows, R, 3, C]
    rings with ``seg.ring``), and store the open windows' triples back into it (after every segment has read its
    own: :mod:`v41.kernels.window_pool`). ``ape`` [r, C] with the step's ``positions`` [T]: V4's gate bias, added
    to each gate as it is read. Returns the segments' full-window triples (m, s, a) [S, C]."""
    flat = state.view(-1, *state.shape[-2:])
    out = pool_windows(seg.rows, seg.valid, seg.continues, seg.state_row, value, gate, flat, ape, positions)
    if seg.ring:  # the first token's own triple (m, s, a) = (g, 1, v): what a window holds after one token
        first = seg.rows[:, 0]
        g = gate[first] if ape is None else gate[first] + gate_bias(ape, positions[first])
        flat.index_copy_(0, seg.keep_row, torch.stack([g, torch.ones_like(g), value[first]], dim=1).to(flat.dtype))
    else:
        flat.index_copy_(0, seg.keep_row, out)
    return out[:, 0], out[:, 1], out[:, 2]

