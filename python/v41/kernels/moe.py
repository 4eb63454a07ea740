"""Grouped expert GEMMs for MoE without host synchronisation (DESIGN.md §3a; kernels.md §2 "MoE").

The T·k (token, slot) pairs are sorted by expert on the device (:func:`align_pairs`); expert e owns the sorted
rows ``[offsets[e], offsets[e+1])``. :func:`grouped_linear` computes, for every sorted row i of expert e,
``y[i] = x[rows[i]] · W[e]ᵀ`` over a packed ``[E, N, K]`` weight (MXFP4 experts dequantized in the kernel:
W4A16; FP8 and dense too). One launch covers every expert: programs ``(expert, N tile)`` walk their expert's
rows in ``BM`` blocks, so an expert's weights are read once per row block and unused experts cost nothing but
an empty program.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .dispatch import TRITON_DTYPES, dot_dtype, triton, use_triton
from .packed import PackedWeight


def align_pairs(ids: Tensor, n_experts: int) -> tuple[Tensor, Tensor]:
    """ids [T, k] int64 expert of each (token, slot) pair → (order [T·k] int64: flat pair indices sorted by
    expert, stably; offsets [E + 1] int64: expert e's rows of ``order`` are ``[offsets[e], offsets[e+1])``)."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(n_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    return order, offsets


def grouped_linear_ref(x: Tensor, w: PackedWeight, offsets: Tensor, rows: Tensor | None = None) -> Tensor:
    """Reference: x [M, K] (float); w [E, N, K]; offsets [E+1]; rows [P] int64 (None: x's rows in order, P = M).
    Returns [P, N] in x's dtype. Reads the offsets on the host (a reference: CPU, or CUDA for debugging)."""
    xs = x if rows is None else x[rows]
    wd = w.dequantize(x.dtype)
    if xs.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16, torch.float16):
        return torch._grouped_mm(xs, wd.transpose(1, 2), offs=offsets[1:].to(torch.int32))
    out = xs.new_zeros(xs.shape[0], wd.shape[1])
    bounds = offsets.tolist()
    for e in range(wd.shape[0]):
        a, b = bounds[e], bounds[e + 1]
        if b > a:
            out[a:b] = xs[a:b] @ wd[e].T
    return out


def grouped_linear(x: Tensor, w: PackedWeight, offsets: Tensor, rows: Tensor | None = None) -> Tensor:
    """:func:`grouped_linear_ref` as one Triton launch where :func:`.dispatch.use_triton` says so."""
    if x.dtype in TRITON_DTYPES and use_triton(x, w.data):
        return _grouped_triton(x, w, offsets, rows)
    return grouped_linear_ref(x, w, offsets, rows)


if triton is not None:
    import triton.language as tl

    from .wtile import FMT_CODES, TILE_K, scale_k, tile_scale, w_tile

    @triton.jit
    def _grouped_kernel(x_ptr, rows_ptr, w_ptr, s_ptr, offs_ptr, y_ptr, N, K, stride_xm, stride_we, stride_wn,
                        stride_se, stride_sn, stride_ym, GATHER: tl.constexpr, B0: tl.constexpr,
                        SK: tl.constexpr, FMT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                        DOT: tl.constexpr, IEEE: tl.constexpr):
        e, pid_n = tl.program_id(0), tl.program_id(1)
        start = tl.load(offs_ptr + e)
        end = tl.load(offs_ptr + e + 1)
        rn = pid_n * BN + tl.arange(0, BN)
        nmask = rn < N
        w_e = w_ptr + e.to(tl.int64) * stride_we
        s_e = s_ptr + e.to(tl.int64) * stride_se
        for m0 in range(start, end, BM):
            rm = m0 + tl.arange(0, BM)
            mmask = rm < end
            if GATHER:
                src = tl.load(rows_ptr + rm, mask=mmask, other=0)
            else:
                src = rm
            acc = tl.zeros([BM, BN], dtype=tl.float32)
            for k0 in range(0, K, BK):
                rk = k0 + tl.arange(0, BK)
                a = tl.load(x_ptr + src[:, None] * stride_xm + rk[None, :],
                            mask=mmask[:, None] & (rk < K)[None, :], other=0.0).to(DOT)
                w = w_tile(w_e, s_e, rn, k0, nmask, stride_wn, stride_sn, K, B0, SK, BK, FMT, DOT)
                if IEEE:
                    part = tl.dot(a, tl.trans(w), input_precision="ieee")
                else:
                    part = tl.dot(a, tl.trans(w))
                acc += part * tile_scale(s_e, rn, k0, nmask, stride_sn, B0, SK, BK, FMT)[None, :]
            tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                     mask=mmask[:, None] & nmask[None, :])


def _grouped_triton(x: Tensor, w: PackedWeight, offsets: Tensor, rows: Tensor | None) -> Tensor:
    n_exp, n, k = w.shape
    p = x.shape[0] if rows is None else rows.shape[0]
    y = torch.empty((p, n), dtype=x.dtype, device=x.device)
    if p == 0:
        return y
    bk = TILE_K
    x = x.contiguous()
    scale = w.scale if w.scale is not None else w.data
    per_expert = p / n_exp  # the host's view of the step's shape, not of its routing
    bm = 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64
    bn = 128 if bm == 16 else 64
    _grouped_kernel[(n_exp, triton.cdiv(n, bn))](
        x, x if rows is None else rows, w.data, scale, offsets, y, n, k, x.stride(0), w.data.stride(0),
        w.data.stride(1), scale.stride(0), scale.stride(1), y.stride(0), GATHER=rows is not None,
        B0=w.block[0], SK=scale_k(w.fmt, w.block), FMT=FMT_CODES[w.fmt], BM=bm, BN=bn, BK=bk, DOT=dot_dtype(x.dtype),
        IEEE=x.dtype == torch.float32, num_stages=4)
    return y
