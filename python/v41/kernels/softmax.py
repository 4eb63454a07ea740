"""Row softmax over a vocabulary, with the sampler's temperature folded in (the sampler's steps 6 and 10 without
top-k / top-p, ``engine/sampler.py``): ``softmax(x / t[:, None])`` of x [R, V] float32.

PyTorch's softmax runs one thread block per row: 34 µs for one row of 129,280 columns on the H200 (benches/RESULTS.md
"2026-12-04 (afternoon)", a B = 1 step's profile). The Triton path spreads a row over ``BLOCK``-column programs in
two launches: each program's running max and sum of exponentials, then each program rescales the row's partials
and writes its columns. Every row is computed alone (batch-invariant), in a fixed order (deterministic).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .dispatch import triton, use_triton
from .pdl import triton_kw

BLOCK = 4096  # columns per program (129,280 columns: 32 programs per row)


def softmax_rows_ref(x: Tensor, temperature: Tensor | None = None) -> Tensor:
    """x [R, V] float → ``softmax(x / temperature[:, None], -1)`` (temperature [R] > 0; None = 1) in x's dtype."""
    if temperature is not None:
        x = x / temperature.to(x.dtype)[:, None]
    return torch.softmax(x, dim=-1)


def softmax_rows(x: Tensor, temperature: Tensor | None = None) -> Tensor:
    """:func:`softmax_rows_ref` in two Triton launches where :func:`.dispatch.use_triton` says so (float32 x; the
    division by the temperature correctly rounded, as PyTorch's). A row of −inf only gives NaN, as PyTorch's."""
    r, vocab = x.shape
    if x.dtype != torch.float32 or r == 0 or vocab == 0 or not use_triton(x):
        return softmax_rows_ref(x, temperature)
    xc = x if x.stride(1) == 1 else x.contiguous()
    nb = triton.cdiv(vocab, BLOCK)
    stats = torch.empty(2, r, nb, dtype=torch.float32, device=x.device)
    out = torch.empty(r, vocab, dtype=torch.float32, device=x.device)
    t = xc if temperature is None else temperature.to(torch.float32).contiguous()
    kw = dict(HAS_T=temperature is not None, BLOCK=BLOCK, **triton_kw(x.device))
    _stats_kernel[(r, nb)](xc, t, stats, vocab, xc.stride(0), nb, r * nb, **kw)
    _write_kernel[(r, nb)](xc, t, stats, out, vocab, xc.stride(0), nb, r * nb, NB=triton.next_power_of_2(nb), **kw)
    return out


if triton is not None:
    import triton.language as tl
    from .pdl import prologue

    @triton.jit
    def _scaled(x_ptr, t_ptr, r, cols, V, stride_x, HAS_T: tl.constexpr):
        """Row r's logits at ``cols`` over its temperature (−inf past V)."""
        x = tl.load(x_ptr + r.to(tl.int64) * stride_x + cols, mask=cols < V, other=float("-inf"))
        if HAS_T:
            x = tl.math.div_rn(x, tl.load(t_ptr + r))
        return x

    @triton.jit
    def _stats_kernel(x_ptr, t_ptr, st_ptr, V, stride_x, NB_RUN, PLANE, HAS_T: tl.constexpr, BLOCK: tl.constexpr,
                      PDL: tl.constexpr):
        """st[0, r, b] = max of row r's block b, st[1, r, b] = Σ exp(x − that max) (0 for a block of −inf)."""
        prologue(PDL)
        r, b = tl.program_id(0), tl.program_id(1)
        x = _scaled(x_ptr, t_ptr, r, b * BLOCK + tl.arange(0, BLOCK), V, stride_x, HAS_T)
        m = tl.max(x, 0)
        s = tl.sum(tl.where(x == float("-inf"), 0.0, tl.exp(x - m)), 0)
        tl.store(st_ptr + r * NB_RUN + b, m)
        tl.store(st_ptr + PLANE + r * NB_RUN + b, s)

    @triton.jit
    def _write_kernel(x_ptr, t_ptr, st_ptr, out_ptr, V, stride_x, NB_RUN, PLANE, NB: tl.constexpr, HAS_T: tl.constexpr,
                      BLOCK: tl.constexpr, PDL: tl.constexpr):
        """out = exp(x − M) / S with the row's max M and sum S rebuilt from its blocks' partials (the same in every
        program of the row: a fixed tree over the blocks)."""
        prologue(PDL)
        r, b = tl.program_id(0), tl.program_id(1)
        nb = tl.arange(0, NB)
        ms = tl.load(st_ptr + r * NB_RUN + nb, mask=nb < NB_RUN, other=float("-inf"))
        ss = tl.load(st_ptr + PLANE + r * NB_RUN + nb, mask=nb < NB_RUN, other=0.0)
        mx = tl.max(ms, 0)
        total = tl.sum(tl.where(ms == float("-inf"), 0.0, ss * tl.exp(ms - mx)), 0)
        cols = b * BLOCK + tl.arange(0, BLOCK)
        x = _scaled(x_ptr, t_ptr, r, cols, V, stride_x, HAS_T)
        tl.store(out_ptr + r.to(tl.int64) * V + cols, tl.exp(x - mx) / total, mask=cols < V)
