"""The per-step facts of a compression ratio's window segments (docs/model.md §3.6; the layout and the meaning of
each field: :class:`v41.models.fast.compress.Segments`), computed once per step from ``StepBatch.segments[r]``.

From ``seg`` [S, L] (token rows, −1 padded at the end of each segment), the step's ``positions`` / ``req_index``
[T], and the requests' ``state_rows`` / ``seq_lens`` [R]:

* ``rows = max(seg, 0)``, ``valid = seg ≥ 0``, ``last_row`` = the segment's last valid row (row 0's when none),
  ``closed_row`` = ``last_row``, or −1 for a segment with no valid row (the row whose cache slots a closed entry
  takes: :meth:`v41.models.fast.attention.StepContext.write_closed`);
* ``req``, ``window = ⌊pos / r⌋``, ``continues = valid₀ ∧ pos mod r ≠ 0`` of its first token;
* ``closes = valid₀ ∧ pos(last) mod r = r − 1``;
* ``state_row`` / ``keep_row``: the request's state row (ring slot ``state_row·R + window mod R`` with a ring of
  R slots) or ``dummy·max(1, R)``; ``keep_row`` only where the segment leaves its triple (without a ring: it does
  not close; with one: it opens one of the request's last R windows).

All integer arithmetic, floor division and modulo as Python's; the Triton kernel (one launch, a program per block
of segments) equals the reference exactly, instead of ~25 small kernels per ratio and step.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .dispatch import triton, use_triton
from .pdl import triton_kw

FIELDS = ("rows", "valid", "req", "window", "continues", "closes", "last_row", "state_row", "keep_row", "closed_row")


def segment_facts_ref(seg: Tensor, positions: Tensor, req_index: Tensor, state_rows: Tensor, seq_lens: Tensor,
                      ratio: int, dummy_state_row: int, ring: int = 0) -> dict[str, Tensor]:
    """The fields of :data:`FIELDS` (module docstring): rows [S, L] int64, valid [S, L] bool, the others [S]
    (int64; continues, closes bool)."""
    valid = seg >= 0
    rows = seg.clamp(min=0)
    count = valid.sum(1)
    first = rows[:, 0]
    last = rows.gather(1, (count - 1).clamp(min=0)[:, None])[:, 0]
    pos_first = positions[first]
    req = req_index[first]
    seg_ok = valid[:, 0]
    closes = seg_ok & (positions[last] % ratio == ratio - 1)
    state_row = state_rows[req]
    dummy = torch.full_like(state_row, dummy_state_row * max(1, ring))
    window = pos_first // ratio
    continues = seg_ok & (pos_first % ratio != 0)
    out = dict(rows=rows, valid=valid, req=req, window=window, continues=continues, closes=closes, last_row=last,
               closed_row=torch.where(seg_ok, last, torch.full_like(last, -1)))
    if ring:
        slot = state_row * ring + window % ring
        recent = window > (seq_lens[req] - 1) // ratio - ring  # one writer per ring slot
        out.update(state_row=torch.where(seg_ok, slot, dummy),
                   keep_row=torch.where(seg_ok & ~continues & recent, slot, dummy))
    else:
        out.update(state_row=torch.where(seg_ok, state_row, dummy),
                   keep_row=torch.where(seg_ok & ~closes, state_row, dummy))
    return out


def segment_facts(seg: Tensor, positions: Tensor, req_index: Tensor, state_rows: Tensor, seq_lens: Tensor,
                  ratio: int, dummy_state_row: int, ring: int = 0) -> dict[str, Tensor]:
    """:func:`segment_facts_ref` in one Triton launch where :func:`.dispatch.use_triton` says so (int64 inputs)."""
    s, length = seg.shape
    ins = (seg, positions, req_index, state_rows, seq_lens)
    if s == 0 or length == 0 or any(t.dtype != torch.int64 for t in ins) or not use_triton(*ins):
        return segment_facts_ref(seg, positions, req_index, state_rows, seq_lens, ratio, dummy_state_row, ring)
    dev = seg.device
    out = dict(rows=torch.empty_like(seg), valid=torch.empty(s, length, dtype=torch.bool, device=dev),
               **{k: torch.empty(s, dtype=torch.int64, device=dev)
                  for k in ("req", "window", "last_row", "state_row", "keep_row", "closed_row")},
               continues=torch.empty(s, dtype=torch.bool, device=dev), closes=torch.empty(s, dtype=torch.bool,
                                                                                          device=dev))
    bs = 32
    segc = seg.contiguous()
    _facts_kernel[(triton.cdiv(s, bs),)](
        segc, positions.contiguous(), req_index.contiguous(), state_rows.contiguous(), seq_lens.contiguous(),
        *(out[k] for k in FIELDS), s, length, ratio, dummy_state_row * max(1, ring), ring,
        BS=bs, BL=triton.next_power_of_2(length), RING=ring > 0, **triton_kw(dev))
    return out


def visible_entries(positions: Tensor, ratios: list[int]) -> dict[int, Tensor]:
    """{r: ``(positions + 1) // r``} (int64 [T] each): the compressed entries of ratio r visible to each token
    (docs/model.md §3.7), for up to four ratios in one Triton launch where :func:`.dispatch.use_triton` says so (two
    PyTorch launches per ratio otherwise)."""
    t = positions.shape[0]
    if t == 0 or not ratios or len(ratios) > 4 or positions.dtype != torch.int64 or not use_triton(positions):
        return {r: (positions + 1) // r for r in ratios}
    out = torch.empty(len(ratios), t, dtype=torch.int64, device=positions.device)
    rs = list(ratios) + [1] * (4 - len(ratios))
    block = min(1024, triton.next_power_of_2(t))
    _visible_kernel[(triton.cdiv(t, block),)](positions.contiguous(), out, t, *rs, NR=len(ratios), BLOCK=block,
                                              **triton_kw(positions.device))
    return {r: out[i] for i, r in enumerate(ratios)}


if triton is not None:
    import triton.language as tl
    from .pdl import prologue

    @triton.jit
    def _floordiv(a, b):
        q = a // b  # C division truncates toward zero; Python's rounds toward −inf
        return tl.where((a % b != 0) & ((a < 0) != (b < 0)), q - 1, q)

    @triton.jit
    def _floormod(a, b):
        return a - _floordiv(a, b) * b

    @triton.jit
    def _facts_kernel(seg_ptr, pos_ptr, req_ptr, srow_ptr, slen_ptr, rows_ptr, valid_ptr, o_req_ptr, window_ptr,
                      cont_ptr, closes_ptr, last_ptr, o_srow_ptr, keep_ptr, closed_ptr, S, L, ratio, dummy, ring,
                      BS: tl.constexpr, BL: tl.constexpr, RING: tl.constexpr, PDL: tl.constexpr):
        prologue(PDL)
        rs = tl.program_id(0) * BS + tl.arange(0, BS)
        rl = tl.arange(0, BL)
        smask = rs < S
        m2 = smask[:, None] & (rl < L)[None, :]
        seg = tl.load(seg_ptr + rs[:, None] * L + rl[None, :], mask=m2, other=-1)
        valid = seg >= 0
        rows = tl.maximum(seg, 0)
        tl.store(rows_ptr + rs[:, None] * L + rl[None, :], rows, mask=m2)
        tl.store(valid_ptr + rs[:, None] * L + rl[None, :], valid.to(tl.int1), mask=m2)
        count = tl.sum(valid.to(tl.int32), axis=1)
        at = tl.maximum(count - 1, 0)
        first = tl.sum(tl.where(rl[None, :] == 0, rows, 0), axis=1)
        last = tl.sum(tl.where(rl[None, :] == at[:, None], rows, 0), axis=1)
        seg_ok = tl.sum(tl.where(rl[None, :] == 0, valid.to(tl.int32), 0), axis=1) > 0
        pos_first = tl.load(pos_ptr + first, mask=smask, other=0)
        req = tl.load(req_ptr + first, mask=smask, other=0)
        closes = seg_ok & (_floormod(tl.load(pos_ptr + last, mask=smask, other=0), ratio) == ratio - 1)
        srow = tl.load(srow_ptr + req, mask=smask, other=0)
        window = _floordiv(pos_first, ratio)
        continues = seg_ok & (_floormod(pos_first, ratio) != 0)
        if RING:
            slot = srow * ring + _floormod(window, ring)
            recent = window > _floordiv(tl.load(slen_ptr + req, mask=smask, other=0) - 1, ratio) - ring
            out_srow = tl.where(seg_ok, slot, dummy)
            keep = tl.where(seg_ok & (~continues) & recent, slot, dummy)
        else:
            out_srow = tl.where(seg_ok, srow, dummy)
            keep = tl.where(seg_ok & (~closes), srow, dummy)
        tl.store(o_req_ptr + rs, req, mask=smask)
        tl.store(window_ptr + rs, window, mask=smask)
        tl.store(cont_ptr + rs, continues.to(tl.int1), mask=smask)
        tl.store(closes_ptr + rs, closes.to(tl.int1), mask=smask)
        tl.store(last_ptr + rs, last, mask=smask)
        tl.store(o_srow_ptr + rs, out_srow.to(tl.int64), mask=smask)
        tl.store(keep_ptr + rs, keep.to(tl.int64), mask=smask)
        tl.store(closed_ptr + rs, tl.where(seg_ok, last, -1).to(tl.int64), mask=smask)

    @triton.jit
    def _visible_kernel(pos_ptr, out_ptr, T, r0, r1, r2, r3, NR: tl.constexpr, BLOCK: tl.constexpr,
                        PDL: tl.constexpr):
        prologue(PDL)
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = i < T
        p1 = tl.load(pos_ptr + i, mask=mask, other=0) + 1
        tl.store(out_ptr + i, _floordiv(p1, r0), mask=mask)
        if NR > 1:
            tl.store(out_ptr + T + i, _floordiv(p1, r1), mask=mask)
        if NR > 2:
            tl.store(out_ptr + 2 * T + i, _floordiv(p1, r2), mask=mask)
        if NR > 3:
            tl.store(out_ptr + 3 * T + i, _floordiv(p1, r3), mask=mask)
