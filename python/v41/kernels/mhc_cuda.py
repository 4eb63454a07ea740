"""The CUDA mHC seam of ``cuda/mhc/hc_seam.cu`` (docs/model.md §3.4, §3.2; docs/kernels.md §2 "mHC, router,
compressor"): in one launch, for T ≤ :data:`MAX_TOKENS` tokens of bf16 residual copies h [T, 4, D],

* optionally the expansion of the previous sub-layer's output y [T, D]: ``h' = hc_expand_ref(h, y, post, comb)``;
* the next sub-layer's mixes of h': ``pre`` [T, 4], ``post`` [T, 4], ``comb`` [T, 4, 4] float32
  (:func:`.mhc.hc_mixes_ref`);
* optionally the collapse into that sub-layer's normed input x [T, D] bf16 =
  ``hc_collapse_norm_ref(h', w, eps, norm_w)`` with w the given ``pre_c`` (V4.1's delayed pre-mix) or this seam's
  ``pre`` (V4).

What the Triton path does in up to three launches (expand, the split-K mixes with their finish, collapse + norm).
Only the float32 summation order differs from the references, and the Sinkhorn and softmax divisions are
reciprocals (within an ulp) times the entries. The mix weights are loaded before the programmatic-dependent wait
(:mod:`.pdl`): ``fn`` must not be written by the kernels queued before it.

:func:`seam` returns None when the kernel does not take the operands: h not bf16 or not 8-byte aligned, T outside
1..:data:`MAX_TOKENS`, hc ≠ 4, D not a positive multiple of 64, mix parameters not contiguous float32, a norm
weight not bf16 or not 8-byte aligned, the seam's own pre with D > :data:`FRESH_MAX_D`, given weights with more
CTAs than fit the GPU at once (:func:`max_ctas`), or no split-K counters during a CUDA-graph capture. The caller
then runs the Triton or PyTorch path.
:func:`.dispatch.use_cuda` decides whether to try.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import wstream
from .dispatch import cuda_ext
from .pdl import enabled as pdl_enabled

MAX_TOKENS = 16  # cuda/mhc/hc_seam.h kHcMaxTokens
COLS = 64        # kHcCols: columns of each copy per CTA
# Collapsing with the seam's own pre (V4) is done by the last CTA alone, over whole rows: worth it for few tokens
# (more: the caller collapses in its own launch). The given weights (V4.1) are collapsed by every CTA at any T.
FRESH_MAX_TOKENS = 2
FRESH_MAX_D = 8192  # kHcFreshMaxD
# The whole seam (expansion, mixes, collapse) up to this many tokens; more take the Triton expansion and collapse
# around the CUDA mixes. benches/RESULTS.md "2026-12-04 (CUDA seam)": 15.1 against 19.7 µs at 8 tokens, 22.0
# against 20.8 at 16 (9–15 not timed).
SEAM_MAX_TOKENS = 8



def max_ctas(device: torch.device) -> int:
    """CTAs of the given-weights seam that can be resident at once on CUDA ``device`` (its CTAs wait for each
    other, so the seam takes D / COLS ≤ this; cuda/mhc/hc_seam.cu, which caches it per device)."""
    return cuda_ext().hc_seam_max_ctas(device.index if device.index is not None else torch.cuda.current_device())


def takes(h: Tensor, fn: Tensor, scale: Tensor, base: Tensor, norm_w: Tensor | None = None) -> bool:
    """Whether the kernel takes these operands (cuda/bindings_glue.cpp checks the same and raises)."""
    t, hc, d = h.shape
    return (h.dtype == torch.bfloat16 and hc == 4 and 0 < t <= MAX_TOKENS and d > 0 and d % COLS == 0
            and h.is_contiguous() and h.data_ptr() % 8 == 0
            and all(x.dtype == torch.float32 and x.is_contiguous() for x in (fn, scale, base))
            and fn.shape == (24, 4 * d)
            and (norm_w is None or (norm_w.dtype == torch.bfloat16 and norm_w.is_contiguous()
                                    and norm_w.data_ptr() % 8 == 0)))


def launch(h: Tensor, fn: Tensor, scale: Tensor, base: Tensor, iters: int, hc_eps: float, norm_eps: float,
           pre: Tensor, post: Tensor, comb: Tensor, counters: Tensor, expand: tuple | None = None,
           collapse: tuple | None = None) -> None:
    """One launch writing ``pre``, ``post``, ``comb``; with ``expand = (y, post_in, comb_in, h_out)`` also
    ``h_out``; with ``collapse = (pre_c or None, norm_w, x_eps, x)`` also ``x`` (``pre_c`` None: this seam's pre).
    ``counters``: :func:`.wstream.split_counters`, whose last two words are the kernel's arrival counter (zero
    before and after) and generation word. Raises RuntimeError for operands the binding rejects."""
    t, _, d = h.shape
    partial = torch.empty(d // COLS * t * 32 + MAX_TOKENS, dtype=torch.float32, device=h.device)
    y, post_in, comb_in, h_out = expand if expand is not None else (None, None, None, None)
    pre_c, norm_w, x_eps, x = collapse if collapse is not None else (None, None, 0.0, None)
    mode = 0 if collapse is None else 2 if pre_c is None else 1  # HcCollapse: none, the seam's own pre, given
    sync = counters[wstream.COUNTER_SLOTS:]
    cuda_ext().hc_seam(h, y, post_in, comb_in, h_out, fn, scale, base, pre, post, comb, partial, sync, mode,
                       pre_c, norm_w, x, iters, float(norm_eps), float(hc_eps), float(x_eps), pdl_enabled(h.device))


def seam(h: Tensor, fn: Tensor, scale: Tensor, base: Tensor, iters: int, hc_eps: float, norm_eps: float,
         y: Tensor | None = None, post_in: Tensor | None = None, comb_in: Tensor | None = None,
         collapse: tuple | None = None):
    """``(h', pre, post, comb)``, and ``x`` last with ``collapse = (pre_c or None, norm_w, x_eps)``: h' =
    :func:`.mhc.hc_expand_ref` (h, y, post_in, comb_in) when ``y`` is given, else h itself. None when not taken
    (module docstring)."""
    norm_w = collapse[1] if collapse is not None else None
    if not takes(h, fn, scale, base, norm_w) or (y is not None and y.dtype != torch.bfloat16):
        return None
    if collapse is not None and (h.shape[2] > FRESH_MAX_D if collapse[0] is None
                                 else h.shape[2] // COLS > max_ctas(h.device)):
        return None
    counters = wstream.split_counters(h.device)
    if counters is None:
        return None
    t, _, d = h.shape
    pre = torch.empty(t, 4, dtype=torch.float32, device=h.device)
    post = torch.empty_like(pre)
    comb = torch.empty(t, 4, 4, dtype=torch.float32, device=h.device)
    expand = None
    if y is not None:
        expand = (y.contiguous(), post_in.float().contiguous(), comb_in.float().contiguous(), torch.empty_like(h))
    full = None
    if collapse is not None:
        pre_c = collapse[0].float().contiguous() if collapse[0] is not None else None
        full = (pre_c, norm_w, collapse[2], torch.empty(t, d, dtype=torch.bfloat16, device=h.device))
    launch(h, fn, scale, base, iters, hc_eps, norm_eps, pre, post, comb, counters, expand, full)
    out = ((h if expand is None else expand[3]), pre, post, comb)
    return out if full is None else (*out, full[3])
