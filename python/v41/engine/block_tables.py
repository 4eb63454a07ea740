"""Persistent block tables on the device, updated by the scheduler's per-step diffs (docs/architecture.md §3a).

The scheduler (``v41._native.Scheduler``, contract in ``crates/v41-sched/src/step.rs``) gives every running
request a row ``0 .. max_num_seqs − 1`` and sends, per step and per kind, only the entries that changed:
``[3, D]`` (row, logical block, physical block; −1 = none). This module keeps one ``[max_num_seqs + 1, width]``
int64 table per kind on the device (views of one allocation), applies each step's diff with one scatter per kind,
and gathers the step's ``[R, max_blocks]`` tables by row (a CUDA graph's prologue does both for every kind in one
launch: :mod:`v41.kernels.table_prologue`). The last row (``padding_row``) is never given to a request and stays
−1: CUDA graph padding rows point at it, and fixed-size diff regions are padded with writes of −1 into it.
"""

from __future__ import annotations

import numpy as np
import torch


class DeviceBlockTables:
    """One persistent table per kind. ``widths``: kind → columns (blocks of the longest request plus slack);
    ``max_rows``: the scheduler's ``max_num_seqs``."""

    def __init__(self, widths: dict[str, int], max_rows: int, device: torch.device | str):
        self.widths = dict(widths)
        self.padding_row = max_rows
        self.tables = one_allocation_tables(self.widths, max_rows + 1, device)

    def check(self, kind: str, diff: np.ndarray) -> None:
        """Raise ValueError if a diff entry falls outside the table (a request longer than the width the runner
        was built for, or a row the scheduler cannot own)."""
        if diff.shape[1] == 0:
            return
        if int(diff[0].max()) >= self.padding_row or int(diff[1].max()) >= self.widths[kind] or diff[:2].min() < 0:
            raise ValueError(f"block-table diff of kind {kind!r} outside the [{self.padding_row}, "
                             f"{self.widths[kind]}] table: the scheduler and the runner disagree on max_num_seqs "
                             f"or max_model_len")

    def apply(self, kind: str, diff: torch.Tensor) -> None:
        """Write ``diff`` ([3, D] int64 on the device: rows, columns, blocks) into the table of ``kind``."""
        self.tables[kind].index_put_((diff[0], diff[1]), diff[2])

    def gather(self, kind: str, rows: torch.Tensor, width: int) -> torch.Tensor:
        """[R, width] int64: the first ``width`` columns of ``rows`` (int64 [R] on the device)."""
        return self.tables[kind][:, :width].index_select(0, rows)


def one_allocation_tables(widths: dict[str, int], rows: int, device: torch.device | str) -> dict[str, torch.Tensor]:
    """kind → [rows, width] int64 tables of −1, views of one allocation (so one launch can reach every kind's:
    :mod:`v41.kernels.table_prologue`)."""
    flat = torch.full((rows * sum(widths.values()),), -1, dtype=torch.int64, device=device)
    out, off = {}, 0
    for k, w in widths.items():
        out[k] = flat[off:off + rows * w].view(rows, w)
        off += rows * w
    return out
