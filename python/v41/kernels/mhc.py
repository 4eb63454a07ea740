"""mHC coefficients of one sub-layer seam (v41-architecture.md §3.4), float32 throughout.

``mixes = fn · rmsnorm(flatten(H))`` is one GEMM; what follows (sigmoids, the 4×4 softmax and the spec's fixed
Sinkhorn procedure: one column normalisation, then ``iters − 1`` rounds of row then column normalisation) is
~45 tiny element-wise ops in PyTorch. The Triton kernel does that part for a block of tokens in registers, so
a seam costs three launches whatever ``iters`` is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .dispatch import triton, use_triton


def hc_mixes_ref(h: Tensor, fn: Tensor, scale: Tensor, base: Tensor, hc: int, iters: int, hc_eps: float,
                 norm_eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """h [T, hc, D] (any float dtype); fn [(2+hc)·hc, hc·D]; scale [3]; base [(2+hc)·hc]. Returns float32 (or
    float64 for float64 input) ``pre`` [T, hc], ``post`` [T, hc], ``comb`` [T, hc, hc] (comb[i, j]: input copy i
    → output copy j)."""
    flat = h.flatten(1).to(torch.promote_types(h.dtype, torch.float32))
    r = torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + norm_eps)
    mixes = F.linear(flat * r, fn.to(flat.dtype))
    return _finish_ref(mixes, scale.to(flat.dtype), base.to(flat.dtype), hc, iters, hc_eps)


def _finish_ref(mixes: Tensor, scale: Tensor, base: Tensor, hc: int, iters: int, hc_eps: float):
    pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.split([hc, hc, hc * hc])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(-1, hc, hc) * scale[2] + comb_b.view(hc, hc), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return pre, post, comb


def hc_mixes(h: Tensor, fn: Tensor, scale: Tensor, base: Tensor, hc: int, iters: int, hc_eps: float,
             norm_eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`hc_mixes_ref` with the post-GEMM part as one Triton kernel where :func:`.dispatch.use_triton`
    says so (float32 math; hc = 4)."""
    if h.dtype == torch.float64 or hc != 4 or not use_triton(h):
        return hc_mixes_ref(h, fn, scale, base, hc, iters, hc_eps, norm_eps)
    flat = h.flatten(1).float()
    r = torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + norm_eps)
    mixes = F.linear(flat, fn.float()) * r
    t = mixes.shape[0]
    pre = torch.empty(t, 4, dtype=torch.float32, device=h.device)
    post = torch.empty_like(pre)
    comb = torch.empty(t, 4, 4, dtype=torch.float32, device=h.device)
    if t:
        bt = 16
        _finish_kernel[(triton.cdiv(t, bt),)](mixes.contiguous(), scale.float().contiguous(),
                                              base.float().contiguous(), pre, post, comb, t, iters, hc_eps,
                                              BT=bt)
    return pre, post, comb


if triton is not None:
    import triton.language as tl

    @triton.jit
    def _finish_kernel(m_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, T, ITERS, EPS, BT: tl.constexpr):
        rt = tl.program_id(0) * BT + tl.arange(0, BT)
        tmask = rt < T
        r4 = tl.arange(0, 4)
        r16 = tl.arange(0, 16)
        s0 = tl.load(scale_ptr)
        s1 = tl.load(scale_ptr + 1)
        s2 = tl.load(scale_ptr + 2)
        row = rt[:, None] * 24
        pre_w = tl.load(m_ptr + row + r4[None, :], mask=tmask[:, None], other=0.0)
        post_w = tl.load(m_ptr + row + 4 + r4[None, :], mask=tmask[:, None], other=0.0)
        comb_w = tl.load(m_ptr + row + 8 + r16[None, :], mask=tmask[:, None], other=0.0)
        pre = tl.sigmoid(pre_w * s0 + tl.load(base_ptr + r4)[None, :]) + EPS
        post = 2.0 * tl.sigmoid(post_w * s1 + tl.load(base_ptr + 4 + r4)[None, :])
        logits = tl.reshape(comb_w * s2 + tl.load(base_ptr + 8 + r16)[None, :], (BT, 4, 4))
        mx = tl.max(logits, axis=2)
        e = tl.exp(logits - mx[:, :, None])
        c = e / tl.sum(e, axis=2)[:, :, None] + EPS
        c = c / (tl.sum(c, axis=1)[:, None, :] + EPS)
        for _ in range(ITERS - 1):
            c = c / (tl.sum(c, axis=2)[:, :, None] + EPS)
            c = c / (tl.sum(c, axis=1)[:, None, :] + EPS)
        tl.store(pre_ptr + rt[:, None] * 4 + r4[None, :], pre, mask=tmask[:, None])
        tl.store(post_ptr + rt[:, None] * 4 + r4[None, :], post, mask=tmask[:, None])
        tl.store(comb_ptr + rt[:, None] * 16 + r16[None, :], tl.reshape(c, (BT, 16)), mask=tmask[:, None])
