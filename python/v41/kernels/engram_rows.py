"""The Engram table rows of a step, gathered and dequantized (docs/model.md §3.3, §5): for ``row_ids`` [T, C] (full
table rows; this rank's hash columns ``[c0, c1)``, whose rows start at ``row0``) the rows ``table[row_ids[t, c] −
row0]`` of an FP8 (E4M3) table with E8M0 scales per ``block`` inputs, ``code · 2^(byte − 127)`` in float32 (exact),
then cast to ``dtype`` → [T, (c1 − c0)·hd]. A local row outside the table (a CUDA-graph padding row's id 0 on a rank
past the first) is wrapped once and clamped into it, so it reads a real row; its result is never used. The Triton
kernel does it in one launch (one program per token and column) instead of ~14 index, elementwise and decode
kernels, decoding with the cache records' bit-level helpers (:mod:`.records`): the same values for finite codes and
scale bytes 0..254, which is all a checkpoint holds (the NaN codes 0x7F / 0xFF and byte 255 are not reproduced;
a −0 code gives +0).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .dispatch import TRITON_DTYPES, triton, use_triton
from .packed import PackedWeight
from .pdl import triton_kw


def gather_table_rows_ref(table: PackedWeight, row_ids: Tensor, c0: int, c1: int, row0: int,
                          dtype: torch.dtype) -> Tensor:
    """table [rows_local, hd] (any PackedWeight format); row_ids [T, C] int64 → [T, (c1 − c0)·hd] in ``dtype``."""
    rows = table.data.shape[0]
    flat = (row_ids[:, c0:c1] - row0).reshape(-1)
    flat = torch.where(flat < 0, flat + rows, flat).clamp(0, rows - 1)  # padding rows: any row of the table
    scale = None if table.scale is None else table.scale[flat]
    out = PackedWeight(table.data[flat], scale, table.fmt, table.block).dequantize(dtype)
    return out.view(row_ids.shape[0], -1)


def gather_table_rows(table: PackedWeight, row_ids: Tensor, c0: int, c1: int, row0: int,
                      dtype: torch.dtype) -> Tensor:
    """:func:`gather_table_rows_ref` as one Triton launch for FP8 tables with one scale per ``block[1]`` inputs of
    a row (``block[0] == 1``), where :func:`.dispatch.use_triton` says so."""
    t, hd, cols = row_ids.shape[0], table.data.shape[-1], c1 - c0
    if (table.fmt != "fp8" or table.block[0] != 1 or hd % table.block[1] or dtype not in TRITON_DTYPES
            or t * cols == 0 or row_ids.dtype != torch.int64 or row_ids.stride(1) != 1
            or table.data.stride(1) != 1 or table.scale.stride(1) != 1 or not use_triton(row_ids, table.data)):
        return gather_table_rows_ref(table, row_ids, c0, c1, row0, dtype)
    data, scale = table.data.view(torch.uint8), table.scale.view(torch.uint8)
    out = torch.empty(t, cols * hd, dtype=dtype, device=row_ids.device)
    _rows_kernel[(t, cols)](row_ids, data, scale, out, row_ids.stride(0), c0, row0, data.shape[0], cols,
                            data.stride(0), scale.stride(0), HD=hd, BLOCK=table.block[1],
                            BH=triton.next_power_of_2(hd), **triton_kw(row_ids.device))
    return out


if triton is not None:
    import triton.language as tl
    from .pdl import prologue
    from .records import e4m3_value, e8m0_value

    @triton.jit
    def _rows_kernel(ids_ptr, data_ptr, scale_ptr, out_ptr, stride_ids, c0, row0, ROWS, COLS, stride_d, stride_s,
                     HD: tl.constexpr, BLOCK: tl.constexpr, BH: tl.constexpr, PDL: tl.constexpr):
        prologue(PDL)
        t, c = tl.program_id(0).to(tl.int64), tl.program_id(1)
        row = tl.load(ids_ptr + t * stride_ids + c0 + c) - row0
        row = tl.minimum(tl.maximum(tl.where(row < 0, row + ROWS, row), 0), ROWS - 1)  # never outside the table
        rd = tl.arange(0, BH)
        m = rd < HD
        code = e4m3_value(tl.load(data_ptr + row * stride_d + rd, mask=m, other=0).to(tl.int32))
        v = code * e8m0_value(tl.load(scale_ptr + row * stride_s + rd // BLOCK, mask=m, other=127).to(tl.int32))
        tl.store(out_ptr + (t * COLS + c) * HD + rd, v.to(out_ptr.dtype.element_ty), mask=m)
