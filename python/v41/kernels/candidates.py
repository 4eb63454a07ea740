"""V4.1's level-1 candidate blocks (docs/model.md §3.7 step 5): the candidate source ranks blocks of
``candidate_block_size`` entries by their best index score and keeps the top ``candidate_topk_blocks``; the later
index sources score only entries of kept blocks.

:func:`candidate_blocks` computes the block scores (max over the block, the block of the newest visible entry
pinned to +inf) in one Triton launch. When every block is kept (``topk_blocks ≥ #blocks``: contexts up to
``candidate_topk_blocks · candidate_block_size`` entries, 16,384 for V4.1-Flash) that launch writes the mask
itself; above, the block scores go through :func:`.topk.select_topk` and one more launch marks the kept blocks.
:func:`filter_candidates_` sets the scores of entries outside the kept blocks to −inf in place, in one launch. The
PyTorch references (:func:`candidate_blocks_ref`, :func:`filter_candidates_ref`) took about ten and three launches
(benches/RESULTS.md "2026-12-04 (prefill paths)": most of a B = 1 step's ~55 PyTorch launches are small ones like
these). Both give the reference's masks exactly: a max and comparisons, no arithmetic.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .dispatch import triton, use_triton
from .pdl import triton_kw
from .topk import select_topk

ROWS_BLOCKS = 64  # blocks per program of the block-score kernel
FILTER_BLOCK = 1024  # entries per program of the filter


def candidate_blocks_ref(scores: Tensor, n_visible: Tensor, block: int, topk_blocks: int) -> Tensor:
    """Level-1 candidate blocks of every query at once: scores [T, N] float32 (−inf where not visible), n_visible
    [T] int64 (≤ N) → [T, ceil(N / block)] bool (entry j is a candidate where block j // block is). Block score =
    max over its entries (NaN if one is NaN); the block of the newest visible entry is pinned to +inf; the top
    ``min(topk_blocks, #blocks)`` blocks whose score is not −inf are kept (ties to the lower block)."""
    t, n = scores.shape
    if n == 0:
        return torch.zeros(t, 0, dtype=torch.bool, device=scores.device)
    n_blocks = -(-n // block)
    padded = torch.full((t, n_blocks * block), float("-inf"), dtype=scores.dtype, device=scores.device)
    padded[:, :n] = scores
    bscore = padded.view(t, n_blocks, block).amax(dim=-1)
    newest = ((n_visible - 1) // block).clamp(min=0)
    pin = torch.where(n_visible > 0, torch.full_like(bscore[:, 0], float("inf")), bscore.gather(1, newest[:, None])[:, 0])
    bscore = bscore.scatter(1, newest[:, None], pin[:, None])
    keep = select_topk(bscore, min(topk_blocks, n_blocks))  # −1 where the block's score is −inf
    keep = torch.where(keep >= 0, keep, n_blocks)
    mask = torch.zeros(t, n_blocks + 1, dtype=torch.bool, device=scores.device).scatter(1, keep, True)
    return mask[:, :n_blocks]


def candidate_blocks(scores: Tensor, n_visible: Tensor, block: int, topk_blocks: int) -> Tensor:
    """:func:`candidate_blocks_ref` with the block scores and pin in one Triton launch (and, below
    ``topk_blocks`` blocks, the mask in it too) where :func:`.dispatch.use_triton` says so (float32 scores of
    unit inner stride, int64 n_visible with one entry per row), else the reference."""
    t, n = scores.shape
    if (t == 0 or n == 0 or scores.dtype != torch.float32 or scores.stride(-1) != 1
            or n_visible.dtype != torch.int64 or n_visible.numel() != t or not use_triton(scores, n_visible)):
        return candidate_blocks_ref(scores, n_visible, block, topk_blocks)
    n_blocks = -(-n // block)
    keep_all = topk_blocks >= n_blocks
    out = torch.empty(t, n_blocks, dtype=torch.bool if keep_all else torch.float32, device=scores.device)
    _block_scores_kernel[(t, triton.cdiv(n_blocks, ROWS_BLOCKS))](
        scores, n_visible.contiguous(), out, n, n_blocks, scores.stride(0), block, MASK=keep_all,
        BB=ROWS_BLOCKS, BE=triton.next_power_of_2(block), **triton_kw(scores.device))
    if keep_all:
        return out
    keep = select_topk(out, topk_blocks)  # −1 where the block's score is −inf
    mask = torch.zeros(t, n_blocks, dtype=torch.bool, device=scores.device)
    _mark_kernel[(t,)](keep, mask, topk_blocks, n_blocks, BLOCK=triton.next_power_of_2(topk_blocks),
                       **triton_kw(scores.device))
    return mask


def filter_candidates_ref(scores: Tensor, cand: Tensor, block: int) -> Tensor:
    """scores [T, N] with −inf where entry j's block ``j // block`` is not a candidate (cand [T, ≥ ceil(N / block)]
    bool); a new tensor."""
    keep = cand.repeat_interleave(block, dim=1)[:, :scores.shape[1]]
    return scores.masked_fill(~keep, float("-inf"))


def filter_candidates_(scores: Tensor, cand: Tensor, block: int) -> Tensor:
    """:func:`filter_candidates_ref` written into ``scores`` (returned) in one Triton launch where
    :func:`.dispatch.use_triton` says so (float32 scores of unit inner stride, a bool mask covering the row); else
    the reference's result (a new tensor: use the return value)."""
    t, n = scores.shape
    if (t == 0 or n == 0 or scores.dtype != torch.float32 or scores.stride(-1) != 1 or cand.dtype != torch.bool
            or cand.shape[0] != t or cand.shape[1] * block < n or cand.stride(-1) != 1
            or not use_triton(scores, cand)):
        return filter_candidates_ref(scores, cand, block)
    _filter_kernel[(t, triton.cdiv(n, FILTER_BLOCK))](scores, cand, n, scores.stride(0), cand.stride(0), block,
                                                       BLOCK=FILTER_BLOCK, **triton_kw(scores.device))
    return scores


if triton is not None:
    import triton.language as tl
    from .pdl import prologue

    @triton.jit
    def _block_scores_kernel(s_ptr, nv_ptr, out_ptr, N, NB, stride_s, block, MASK: tl.constexpr, BB: tl.constexpr,
                             BE: tl.constexpr, PDL: tl.constexpr):
        """Program (row t, BB blocks): each block's max score (NaN if it holds one), +inf at the newest visible
        entry's block; out = that score (float32) or, with MASK, whether it is not −inf (bool)."""
        prologue(PDL)
        t = tl.program_id(0).to(tl.int64)
        b = tl.program_id(1) * BB + tl.arange(0, BB)
        e = tl.arange(0, BE)
        j = b[:, None] * block + e[None, :]
        ok = (b[:, None] < NB) & (e[None, :] < block) & (j < N)
        x = tl.load(s_ptr + t * stride_s + j, mask=ok, other=float("-inf"))
        best = tl.max(x, axis=1)
        best = tl.where(tl.max((x != x).to(tl.int32), axis=1) > 0, float("nan"), best)  # amax propagates NaN
        nv = tl.load(nv_ptr + t)
        newest = tl.maximum(tl.where(nv > 0, (nv - 1) // block, 0), 0)
        best = tl.where((b == newest) & (nv > 0), float("inf"), best)
        if MASK:
            tl.store(out_ptr + t * NB + b, best != float("-inf"), mask=b < NB)
        else:
            tl.store(out_ptr + t * NB + b, best, mask=b < NB)

    @triton.jit
    def _mark_kernel(keep_ptr, mask_ptr, K, NB, BLOCK: tl.constexpr, PDL: tl.constexpr):
        """Program (row t): mask[t, keep[t, i]] = True for the kept ids (−1: none)."""
        prologue(PDL)
        t = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, BLOCK)
        ids = tl.load(keep_ptr + t * K + i, mask=i < K, other=-1)
        tl.store(mask_ptr + t * NB + ids, tl.full([BLOCK], 1, tl.int1), mask=ids >= 0)

    @triton.jit
    def _filter_kernel(s_ptr, c_ptr, N, stride_s, stride_c, block, BLOCK: tl.constexpr, PDL: tl.constexpr):
        """Program (row t, BLOCK entries): −inf where the entry's block is not a candidate."""
        prologue(PDL)
        t = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = j < N
        keep = tl.load(c_ptr + t * stride_c + j // block, mask=ok, other=1)
        tl.store(s_ptr + t * stride_s + j, tl.full([BLOCK], float("-inf"), tl.float32), mask=ok & (keep == 0))
