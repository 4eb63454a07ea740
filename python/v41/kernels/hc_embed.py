"""The residual copies entering the first layer of an mHC model (docs/model.md §3.1): each token's embedding row in
every one of the ``hc`` copies, and V4.1's delayed pre-mix (1, 0, …, 0), in one launch."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .dispatch import triton, use_triton
from .pdl import triton_kw


def hc_copies(e: Tensor, hc: int, mix_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The residual copies entering the first layer from the embedding rows e [T, D]: ``h [T, hc, D]`` = e in each
    copy, and the delayed pre-mix ``[T, hc]`` of ``mix_dtype`` = (1, 0, …, 0) (docs/model.md §3.1); PyTorch."""
    h = e.unsqueeze(1).repeat(1, hc, 1)
    pre = torch.zeros(e.shape[0], hc, dtype=mix_dtype, device=e.device)
    pre[:, 0] = 1
    return h, pre


def hc_embed(ids: Tensor, weight: Tensor, hc: int, mix_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """:func:`hc_copies` of the rows ``weight[ids]`` (ids [T] int64, weight [V, D]) in one Triton launch where
    :func:`.dispatch.use_triton` says so (four PyTorch launches otherwise: the lookup, the copies, the zeros and
    the one)."""
    t, d = ids.shape[0], weight.shape[1]
    if t == 0 or not use_triton(ids, weight):
        return hc_copies(F.embedding(ids, weight), hc, mix_dtype)
    h = torch.empty(t, hc, d, dtype=weight.dtype, device=weight.device)
    pre = torch.empty(t, hc, dtype=mix_dtype, device=weight.device)
    bd = min(1024, triton.next_power_of_2(d))
    _embed_kernel[(t, triton.cdiv(d, bd))](ids.contiguous(), weight, h, pre, d, weight.stride(0), HC=hc,
                                           BHC=triton.next_power_of_2(hc), BD=bd, **triton_kw(h.device))
    return h, pre


if triton is not None:
    import triton.language as tl
    from .pdl import prologue

    @triton.jit
    def _embed_kernel(ids_ptr, w_ptr, h_ptr, pre_ptr, D, stride_w, HC: tl.constexpr, BHC: tl.constexpr,
                      BD: tl.constexpr, PDL: tl.constexpr):
        """Program (token t, BD columns): the embedding row into each of the HC copies; block 0 writes the
        token's pre-mix (1, 0, …)."""
        prologue(PDL)
        t, db = tl.program_id(0).to(tl.int64), tl.program_id(1)
        cols = db * BD + tl.arange(0, BD)
        mask = cols < D
        row = tl.load(w_ptr + tl.load(ids_ptr + t) * stride_w + cols, mask=mask)
        for c in tl.static_range(HC):
            tl.store(h_ptr + (t * HC + c) * D + cols, row, mask=mask)
        if db == 0:
            k = tl.arange(0, BHC)
            tl.store(pre_ptr + t * HC + k, (k == 0).to(pre_ptr.dtype.element_ty), mask=k < HC)
