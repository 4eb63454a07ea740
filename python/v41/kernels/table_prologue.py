"""The CUDA-graph prologue of the persistent block tables (docs/architecture.md §3a, ``engine/block_tables.py``):
each cache kind's step diff ``[3, D]`` (row, column, block) written into its persistent table, and the step's rows
gathered at full width into the graph's static tables, for every kind in one launch (two PyTorch launches per kind
in the reference: an ``index_put_`` and an ``index_select``).

A program gathers one row of one kind and then lays that kind's diff entries for the same table row over it, so it
never depends on when the program that writes the diff into the persistent table runs: a column the diff changes
reads the diff's value whichever of the two it saw in the table. Diff entries are distinct (row, column) pairs
(the scheduler sends each change once; unused entries write −1 into the padding row's first column).

The kinds' tables, diffs and static tables are views of three storages (the tables of
:class:`v41.engine.block_tables.DeviceBlockTables`, a graph's static input buffer, the runner's static tables);
:class:`TablePrologue` finds each view's offset once and launches over those storages.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .dispatch import triton, use_triton
from .pdl import triton_kw


def apply_gather_ref(tables: list[Tensor], diffs: list[Tensor], rows: Tensor, outs: list[Tensor]) -> None:
    """Per kind: ``tables[k][diff[0], diff[1]] = diff[2]``, then ``outs[k] = tables[k][rows]`` (full width).
    tables [R + 1, W_k], diffs [3, D_k], rows [N], outs [N, W_k]: int64 on one device."""
    for table, diff, out in zip(tables, diffs, outs):
        table.index_put_((diff[0], diff[1]), diff[2])
        torch.index_select(table, 0, rows, out=out)


def _storage_base(views: list[Tensor]) -> Tensor | None:
    """An int64 tensor starting at the shared storage of ``views`` (None when they do not share one)."""
    storage = views[0].untyped_storage()
    if any(v.untyped_storage().data_ptr() != storage.data_ptr() for v in views):
        return None
    return torch.empty(0, dtype=torch.int64, device=views[0].device).set_(storage)


class TablePrologue:
    """The prologue of one graph's static inputs (module docstring). ``tables``, ``diffs``, ``outs``: kind →
    persistent table [R + 1, W], diff region [3, D], static table [N, W] (int64, row-major); ``rows`` [N] int64: the
    table row of each of the graph's requests. One Triton launch where :func:`.dispatch.use_triton` says so and each
    role's views share a storage, else :func:`apply_gather_ref`. Calling it is capturable (no allocation, no host
    synchronisation). Raises ValueError when a kind's static table is not as wide as its persistent table."""

    def __init__(self, tables: dict[str, Tensor], diffs: dict[str, Tensor], rows: Tensor, outs: dict[str, Tensor]):
        kinds = list(tables)
        bad = [k for k in kinds if outs[k].shape[1] != tables[k].shape[1] or diffs[k].shape[0] != 3]
        if bad:
            raise ValueError(f"block-table prologue: kinds {bad} have a static table of another width than their "
                             "persistent table, or a diff region that is not [3, D]")
        self.tables, self.diffs = [tables[k] for k in kinds], [diffs[k] for k in kinds]
        self.outs, self.rows = [outs[k] for k in kinds], rows
        caps = {d.shape[1] for d in self.diffs}
        bases = [_storage_base(v) for v in (self.tables, [*self.diffs, rows], self.outs)]
        contiguous = all(t.is_contiguous() for t in (*self.tables, *self.diffs, *self.outs, rows))
        self.fused = (len(caps) == 1 and None not in bases and contiguous and len(kinds) > 0
                      and use_triton(rows))
        if not self.fused:
            return
        self.bases = bases
        self.cap = caps.pop()
        meta = [[t.storage_offset(), t.shape[1], d.storage_offset(), o.storage_offset()]
                for t, d, o in zip(self.tables, self.diffs, self.outs)]
        self.meta = torch.tensor(meta, dtype=torch.int64, device=rows.device)
        self.block_w = min(1024, triton.next_power_of_2(max(t.shape[1] for t in self.tables)))
        self.block_d = min(1024, triton.next_power_of_2(self.cap))

    def __call__(self) -> None:
        if not self.fused:
            apply_gather_ref(self.tables, self.diffs, self.rows, self.outs)
            return
        tab, dev, out = self.bases
        _prologue_kernel[(len(self.tables), self.rows.shape[0] + 1)](
            tab, dev, out, self.meta, self.rows.storage_offset(), self.cap, BW=self.block_w, BD=self.block_d,
            **triton_kw(self.rows.device))


if triton is not None:
    import triton.language as tl
    from .pdl import prologue

    @triton.jit
    def _prologue_kernel(tab_ptr, dev_ptr, out_ptr, meta_ptr, ROWS_OFF, CAP, BW: tl.constexpr, BD: tl.constexpr,
                         PDL: tl.constexpr):
        """Program (kind k, i): i < N gathers row rows[i] of kind k's table and lays the diff over it; i = N writes
        the diff into the table. meta[k] = (table offset, width, diff offset, static-table offset), in elements."""
        prologue(PDL)
        k, i = tl.program_id(0), tl.program_id(1)
        t_off = tl.load(meta_ptr + k * 4)
        width = tl.load(meta_ptr + k * 4 + 1)
        d_off = tl.load(meta_ptr + k * 4 + 2)
        o_off = tl.load(meta_ptr + k * 4 + 3)
        gather = i < tl.num_programs(1) - 1
        tr = tl.load(dev_ptr + ROWS_OFF + i, mask=gather, other=-1)
        if gather:
            for c0 in range(0, width, BW):
                c = c0 + tl.arange(0, BW)
                ok = c < width
                v = tl.load(tab_ptr + t_off + tr * width + c, mask=ok)
                tl.store(out_ptr + o_off + i * width + c, v, mask=ok)
            tl.debug_barrier()  # the row's stores land before the diff's, which may hit the same columns
        for j0 in range(0, CAP, BD):
            j = j0 + tl.arange(0, BD)
            ok = j < CAP
            r = tl.load(dev_ptr + d_off + j, mask=ok, other=-1)
            c = tl.load(dev_ptr + d_off + CAP + j, mask=ok, other=0)
            b = tl.load(dev_ptr + d_off + 2 * CAP + j, mask=ok, other=0)
            if gather:
                tl.store(out_ptr + o_off + i * width + c, b, mask=ok & (r == tr))
            else:
                tl.store(tab_ptr + t_off + r * width + c, b, mask=ok & (r >= 0))
