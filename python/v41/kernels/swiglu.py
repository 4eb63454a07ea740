"""SwiGLU of the experts with the V4 clamps (docs/model.md §3.8): ``h13 = [g | u]`` [P, 2I] →
``silu(min(g, L)) · clamp(u, ±L) · w`` [P, I] in h13's dtype (float32 math; the routing weight w multiplies before
``w2``, as the V4.1 reference). Row p's weight is ``weight[p]``, or ``weight[order[p]]`` with ``order`` (the expert-
sorted pairs' routing weights read in place: no gather launch). The Triton kernel does it in one pass."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .dispatch import TRITON_DTYPES, triton, use_triton
from .pdl import triton_kw


def swiglu_ref(h13: Tensor, limit: float, weight: Tensor | None = None, order: Tensor | None = None) -> Tensor:
    """h13 [P, 2I]; weight [P] (or [n] with order [P] int64) float → [P, I] in h13's dtype."""
    if weight is not None and order is not None:
        weight = weight[order]
    ct = torch.promote_types(h13.dtype, torch.float32)
    g, u = h13.to(ct).chunk(2, dim=-1)
    h = F.silu(g.clamp(max=limit)) * u.clamp(min=-limit, max=limit)
    if weight is not None:
        h = h * weight.to(ct)[:, None]
    return h.to(h13.dtype)


def swiglu(h13: Tensor, limit: float, weight: Tensor | None = None, order: Tensor | None = None) -> Tensor:
    """:func:`swiglu_ref` as one Triton launch where :func:`.dispatch.use_triton` says so."""
    if h13.dtype not in TRITON_DTYPES or h13.numel() == 0 or not use_triton(h13):
        return swiglu_ref(h13, limit, weight, order)
    has_order = weight is not None and order is not None
    p, two_i = h13.shape
    inter = two_i // 2
    h = h13.contiguous()
    out = torch.empty(p, inter, dtype=h.dtype, device=h.device)
    block = 1024
    _swiglu_kernel[(p, triton.cdiv(inter, block))](h, out, h if weight is None else weight.float().contiguous(),
                                                   order.contiguous() if has_order else h, inter, float(limit),
                                                   HAS_W=weight is not None, HAS_ORDER=has_order, BLOCK=block,
                                                   **triton_kw(h.device))
    return out


if triton is not None:
    import triton.language as tl
    from .pdl import prologue

    @triton.jit
    def _swiglu_kernel(h_ptr, y_ptr, w_ptr, order_ptr, INTER, limit, HAS_W: tl.constexpr, HAS_ORDER: tl.constexpr,
                       BLOCK: tl.constexpr, PDL: tl.constexpr):
        prologue(PDL)
        r, cb = tl.program_id(0), tl.program_id(1)
        cols = cb * BLOCK + tl.arange(0, BLOCK)
        mask = cols < INTER
        base = r.to(tl.int64) * 2 * INTER
        g = tl.minimum(tl.load(h_ptr + base + cols, mask=mask, other=0.0).to(tl.float32), limit)
        u = tl.load(h_ptr + base + INTER + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        y = g * tl.sigmoid(g) * u
        if HAS_W:
            if HAS_ORDER:
                y = y * tl.load(w_ptr + tl.load(order_ptr + r))
            else:
                y = y * tl.load(w_ptr + r)
        tl.store(y_ptr + r.to(tl.int64) * INTER + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
