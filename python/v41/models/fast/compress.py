"""Compressor pooling over a flattened step, batched and without host synchronisation (docs/model.md §3.6
V4.1 ratio 2, §4 V4 HCA / CSA).

An entry pools the tokens of one window of ``r`` positions with a per-channel softmax over their gates,
``c = Σ_t softmax_t(g_t) ⊙ v_t``. A step holds runs of windows: the engine cuts every request's token run at
window boundaries into *segments* (``StepBatch.segments[r]``: ``[S, L]`` token rows, −1 padded). Each segment is
reduced to the online-softmax triple ``(m, s, a)`` per channel: ``m = max g``, ``s = Σ e^{g−m}``,
``a = Σ e^{g−m}·v``, so ``c = a / s``. A window that began in an earlier step continues from the triple kept in
the request's state row (fp32 ``[3, C]``), and a segment that does not close its window leaves its triple
there. Two triples combine exactly (up to rounding) by rescaling to the larger ``m``. V4's overlapping CSA
entry w also pools the A half of window w−1, whose triple is kept per closed window in the ``cov{r}`` cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..protocol import StepBatch

NEG = float("-inf")


@dataclass(frozen=True)
class Segments:
    """Per-step facts of the windows of ratio ``r`` (computed once per step, shared by every layer).

    rows [S, L] token rows (clamped ≥ 0), valid [S, L]; req [S] request row; window [S] window index (entry id
    it closes); continues [S] the window began before this step (its triple is in the state row); closes [S]
    the segment's last token closes the window; last_row [S]; state_row [S] the request's state row; keep_row
    [S] where the segment's open triple goes (its state row, or the reserved dummy row when it closes).
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

    @classmethod
    def build(cls, batch: StepBatch, ratio: int, dummy_state_row: int) -> "Segments":
        seg = batch.segments[ratio]
        valid = seg >= 0
        rows = seg.clamp(min=0)
        count = valid.sum(1)
        first = rows[:, 0]
        last = rows.gather(1, (count - 1).clamp(min=0)[:, None])[:, 0]
        pos_first = batch.positions[first]
        req = batch.req_index[first]
        seg_ok = valid[:, 0]
        closes = seg_ok & (batch.positions[last] % ratio == ratio - 1)
        state_row = batch.state_rows[req]
        dummy = torch.full_like(state_row, dummy_state_row)
        return cls(ratio=ratio, rows=rows, valid=valid, req=req, window=pos_first // ratio,
                   continues=seg_ok & (pos_first % ratio != 0), closes=closes, last_row=last,
                   state_row=torch.where(seg_ok, state_row, dummy),
                   keep_row=torch.where(seg_ok & ~closes, state_row, dummy))


def reduce_segments(seg: Segments, value: Tensor, gate: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """value, gate [T, C] float32 → the segments' triples (m, s, a) [S, C] over their own rows."""
    g = gate[seg.rows].masked_fill(~seg.valid[..., None], NEG)  # [S, L, C]
    m = g.amax(dim=1)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(g - m_safe[:, None])
    return m, e.sum(dim=1), (e * value[seg.rows]).sum(dim=1)


def combine(t1: tuple[Tensor, Tensor, Tensor], t2: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """The triple of the union of two disjoint token sets (either may be empty: m = −inf, s = a = 0)."""
    (m1, s1, a1), (m2, s2, a2) = t1, t2
    m = torch.maximum(m1, m2)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    f1 = torch.exp(m1 - m_safe)
    f2 = torch.exp(m2 - m_safe)
    return m, s1 * f1 + s2 * f2, a1 * f1 + a2 * f2


def pool_step(seg: Segments, value: Tensor, gate: Tensor, state: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Pool this step's rows per segment, continue windows from ``state`` [rows, 3, C] (fp32), and store the
    open windows' triples back into it. Returns the segments' full-window triples (m, s, a) [S, C]."""
    own = reduce_segments(seg, value, gate)
    prev = state[seg.state_row]  # [S, 3, C]
    cont = seg.continues[:, None]
    empty = (torch.full_like(own[0], NEG), torch.zeros_like(own[1]), torch.zeros_like(own[2]))
    before = tuple(torch.where(cont, p, e) for p, e in zip((prev[:, 0], prev[:, 1], prev[:, 2]), empty))
    m, s, a = combine(before, own)
    state.index_copy_(0, seg.keep_row, torch.stack([m, s, a], dim=1))
    return m, s, a


def finish(m: Tensor, s: Tensor, a: Tensor) -> Tensor:
    """The pooled value ``a / s`` of full triples (windows with no token give 0)."""
    return a / torch.where(s > 0, s, torch.ones_like(s))
