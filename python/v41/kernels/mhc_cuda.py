"""The CUDA mHC seam of ``cuda/mhc/hc_mix.cu`` (docs/model.md §3.4; docs/kernels.md §2 "mHC, router,
compressor"): a sub-layer's mixes ``pre`` [T, 4], ``post`` [T, 4], ``comb`` [T, 4, 4] (float32) from the residual
copies h [T, 4, D] (bf16), optionally after expanding the previous sub-layer's output y into them — one launch
for what the Triton path does in two (expand, then the split-K mixes with their finish).

It computes :func:`.mhc.hc_mixes_ref` (and :func:`.mhc.hc_expand_ref` first when expanding); only the float32
summation order differs, and the Sinkhorn divisions are reciprocals times the entries. The mix weights are loaded
before the programmatic-dependent wait (:mod:`.pdl`): ``fn`` must not be written by the kernels queued before it.

:func:`seam` returns None when the kernel does not take the operands (not bf16, T outside 1..:data:`MAX_TOKENS`,
hc ≠ 4, D not a multiple of 64, float32 mix parameters missing, or no split-K counters during a CUDA-graph
capture); the caller then runs the Triton or PyTorch path. :func:`.dispatch.use_cuda` decides whether to try.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import wstream
from .dispatch import cuda_ext
from .pdl import enabled as pdl_enabled

MAX_TOKENS = 16  # cuda/mhc/hc_mix.h kHcMaxTokens
COLS = 64        # kHcCols: columns of each copy per CTA


def takes(h: Tensor, fn: Tensor, scale: Tensor, base: Tensor) -> bool:
    """Whether the kernel takes these operands (cuda/bindings.cpp checks the same and raises)."""
    t, hc, d = h.shape
    return (h.dtype == torch.bfloat16 and hc == 4 and 0 < t <= MAX_TOKENS and d % COLS == 0
            and all(x.dtype == torch.float32 and x.is_contiguous() for x in (fn, scale, base))
            and fn.shape == (24, 4 * d))


def launch(h: Tensor, fn: Tensor, scale: Tensor, base: Tensor, iters: int, hc_eps: float, norm_eps: float,
           pre: Tensor, post: Tensor, comb: Tensor, counters: Tensor, expand: tuple | None = None) -> None:
    """One launch writing ``pre``, ``post``, ``comb`` (and, with ``expand = (y, post_in, comb_in, h_out)``,
    ``h_out``); the arrival counter ``counters[0]`` must be zero and is left zero. Raises RuntimeError for
    operands the binding rejects."""
    t, _, d = h.shape
    partial = torch.empty(d // COLS * t * 32, dtype=torch.float32, device=h.device)
    y, post_in, comb_in, h_out = expand if expand is not None else (None, None, None, None)
    cuda_ext().hc_mix(h, y, post_in, comb_in, h_out, fn, scale, base, pre, post, comb, partial, counters, iters,
                      float(norm_eps), float(hc_eps), pdl_enabled(h.device))


def seam(h: Tensor, fn: Tensor, scale: Tensor, base: Tensor, iters: int, hc_eps: float, norm_eps: float,
         y: Tensor | None = None, post_in: Tensor | None = None, comb_in: Tensor | None = None):
    """``(h', pre, post, comb)``: h' = :func:`.mhc.hc_expand_ref` (h, y, post_in, comb_in) when ``y`` is given,
    else h itself; then the mixes of h'. None when not taken (module docstring)."""
    if not takes(h, fn, scale, base) or (y is not None and y.dtype != torch.bfloat16):
        return None
    counters = wstream.split_counters(h.device)
    if counters is None:
        return None
    t = h.shape[0]
    h = h.contiguous()
    pre = torch.empty(t, 4, dtype=torch.float32, device=h.device)
    post = torch.empty_like(pre)
    comb = torch.empty(t, 4, 4, dtype=torch.float32, device=h.device)
    expand = None
    if y is not None:
        expand = (y.contiguous(), post_in.float().contiguous(), comb_in.float().contiguous(), torch.empty_like(h))
    launch(h, fn, scale, base, iters, hc_eps, norm_eps, pre, post, comb, counters, expand)
    return (h if expand is None else expand[3]), pre, post, comb
