"""RMSNorm over the last dim (docs/model.md §2): ``y = w ⊙ x / sqrt(mean(x²) + eps)`` computed in float32
(float64 stays float64), returned in x's dtype; ``w`` optional (V4's per-head q norm is unweighted). The Triton
kernel normalizes one row per program in one pass."""

from __future__ import annotations

import torch
from torch import Tensor

from .dispatch import TRITON_DTYPES, triton, use_triton
from .pdl import triton_kw


def rms_norm_ref(x: Tensor, eps: float, weight: Tensor | None = None) -> Tensor:
    """x [..., N] (float) → same shape and dtype."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(y.dtype)
    return y.to(x.dtype)


def rms_norm(x: Tensor, eps: float, weight: Tensor | None = None) -> Tensor:
    """:func:`rms_norm_ref` as one Triton launch where :func:`.dispatch.use_triton` says so. A 2-D x may be a view
    of whole rows' columns (unit column stride, e.g. one projection's columns of a fused GEMM's output): it is read
    in place; the result is contiguous."""
    n = x.shape[-1]
    if x.dtype not in TRITON_DTYPES or n > 16384 or x.numel() == 0 or not use_triton(x):
        return rms_norm_ref(x, eps, weight)
    xc = x if x.dim() == 2 and x.stride(1) == 1 else x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = xc.numel() // n
    stride = xc.stride(0) if xc.dim() == 2 else n
    _rms_kernel[(rows,)](xc, out, xc if weight is None else weight, n, stride, float(eps), HAS_W=weight is not None,
                         BLOCK=triton.next_power_of_2(n), **triton_kw(xc.device))
    return out


if triton is not None:
    import triton.language as tl
    from .pdl import prologue

    @triton.jit
    def rms_scale(x, n, eps):
        """``1 / sqrt(mean(x²) + eps)`` of one row x [BLOCK] float32 (zeros past its ``n`` values): the RMSNorm's
        reduction, which the kernels that fuse an RMSNorm (RoPE, the mHC collapse) call so they get its bits."""
        return tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)

    @triton.jit
    def rms_row(x_ptr, stride_x, n, eps, BLOCK: tl.constexpr):
        """The program's row (program id 0, int64) of x: (row, cols [BLOCK], mask, x float32 (0 past n), its
        :func:`rms_scale`)."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        return row, cols, mask, x, rms_scale(x, n, eps)

    @triton.jit
    def _rms_kernel(x_ptr, y_ptr, w_ptr, N, stride_x, eps, HAS_W: tl.constexpr, BLOCK: tl.constexpr,
                    PDL: tl.constexpr):
        prologue(PDL)
        row, cols, mask, x, r = rms_row(x_ptr, stride_x, N, eps, BLOCK)
        y = x * r
        if HAS_W:
            y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * N + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
