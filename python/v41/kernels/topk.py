"""Deterministic top-k on the device: the k largest entries with exact ties broken toward the lower index
(docs/numerics.md §4 "Indexer top-k ties", "Router numerics"), the same on every backend, batch shape and length.

Each float32 score and its index are packed into one int64 key that orders like (score descending, index
ascending); keys are unique, so ``torch.topk`` over them has one answer. ``-0.0`` counts as ``+0.0`` (they
compare equal as floats). No host synchronisation; capturable in a CUDA graph. The keys are one Triton launch on
the GPU (the PyTorch reference is nine elementwise kernels).

:func:`select_topk` is the indexer's selection (docs/model.md §3.7 step 7): the top-k ids of each row sorted
ascending, picks whose score is −inf → −1. With ``v41._cuda`` on the GPU it is a radix select over the float32
scores (``cuda/indexer/select_topk.cu``, docs/kernels.md "Indexer top-k"): one launch (one CTA per row) for rows
up to 16,384 entries or at least one row per SM, else a zero fill and three passes over 4,096-entry chunks; no
int64 keys and no full sort, the same ids as the reference. When k = N every entry is picked and nothing is
selected: ids in order, −1 where not eligible (:func:`select_all`, one Triton launch) — the indexer's rows while a
request is shorter than ``index_topk`` entries, and the candidate blocks' rows below ``candidate_topk_blocks``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .dispatch import cuda_ext, triton, use_cuda, use_triton
from .pdl import enabled as pdl_enabled

_LOW32 = 0xFFFFFFFF
# Rows of the CUDA kernel's one-CTA path up to this many entries write their picks in index order from one last
# pass over the row instead of sorting the k ids (cuda/indexer/select_topk.cu; 0: always sort). Off until a GPU
# has run tests/test_gpu_cuda_topk.py on it and topk_bench.py's "cuda, ordered finish" column shows it faster
# (benches/RESULTS.md "2026-12-05 (morning)"); 8,192 is the length to try.
ORDERED_MAX_N = 0


def order_keys(scores: Tensor) -> Tensor:
    """[..., N] float scores → int64 keys (:func:`order_keys_ref`), one Triton launch where
    :func:`.dispatch.use_triton` says so."""
    if scores.numel() == 0 or scores.dtype != torch.float32 or not use_triton(scores, family="attention"):
        return order_keys_ref(scores)
    s = scores.contiguous()
    out = torch.empty(s.shape, dtype=torch.int64, device=s.device)
    block = 1024
    _keys_kernel[(triton.cdiv(s.numel(), block),)](s, out, s.numel(), s.shape[-1], _LOW32, BLOCK=block)
    return out


def order_keys_ref(scores: Tensor) -> Tensor:
    """[..., N] float scores → int64 keys: a larger key means a larger score, or an equal score at a lower
    index. NaN orders above +inf (as in ``torch.sort``). N must be below 2**32."""
    s = scores.to(torch.float32) + 0.0  # -0.0 + 0.0 = +0.0
    bits = s.view(torch.int32).to(torch.int64)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # IEEE bits → signed order of the values
    ordered = torch.where(torch.isnan(s), 0x7FFFFFFF, ordered)  # every NaN one key (devices differ in NaN bits)
    idx = torch.arange(s.shape[-1], device=s.device, dtype=torch.int64)
    return (ordered << 32) | (_LOW32 - idx)


def stable_topk(scores: Tensor, k: int) -> Tensor:
    """Indices [..., k] int64 of the k largest scores along the last dim, in descending score order, exact ties
    to the lower index (what a stable descending sort gives). Requires k ≤ N."""
    keys = order_keys(scores)
    top = torch.topk(keys, k, dim=-1, sorted=True).values
    return _LOW32 - (top & _LOW32)


def select_topk(scores: Tensor, k: int, n_valid: Tensor | None = None) -> Tensor:
    """:func:`select_topk_ref` by the CUDA kernel where :func:`.dispatch.use_cuda` says so and it takes the
    operands (float32 rows of at most ``TOPK_MAX_N`` = 65,535 × 4,096 entries, unit inner stride,
    1 ≤ k ≤ min(N, 2048), ``n_valid`` int64 with one entry per row)."""
    t, n = scores.shape
    if k == n:
        return select_all(scores, n_valid)
    extra = () if n_valid is None else (n_valid,)
    if (scores.dtype == torch.float32 and scores.stride(-1) == 1 and 1 <= k <= n
            and (n_valid is None or (n_valid.dtype == torch.int64 and n_valid.numel() == t))
            and use_cuda(scores, *extra, family="attention")
            and k <= getattr(cuda_ext(), "TOPK_MAX_K", 0) and n <= getattr(cuda_ext(), "TOPK_MAX_N", 0)):
        out = torch.empty((t, k), dtype=torch.int64, device=scores.device)
        cuda_ext().select_topk(scores, None if n_valid is None else n_valid.contiguous(), k, out,
                               pdl_enabled(scores.device), ORDERED_MAX_N)
        return out
    return select_topk_ref(scores, k, n_valid)


ALL_BLOCK = 1024  # entries per program of select_all (one compiled kernel for every row length)


def select_all(scores: Tensor, n_valid: Tensor | None = None) -> Tensor:
    """:func:`select_topk_ref` at k = N, where every entry is picked: int64 [T, N] with ``out[t, j] = j``, or −1
    where ``scores[t, j]`` is −inf or ``j ≥ n_valid[t]``. One Triton launch where :func:`.dispatch.use_triton` says
    so (float32 rows of unit inner stride, ``n_valid`` int64 with one entry per row on the same device), else
    PyTorch."""
    t, n = scores.shape
    extra = () if n_valid is None else (n_valid,)
    if (t and n and scores.dtype == torch.float32 and scores.stride(-1) == 1
            and (n_valid is None or (n_valid.dtype == torch.int64 and n_valid.numel() == t))
            and use_triton(scores, *extra, family="attention")):
        out = torch.empty((t, n), dtype=torch.int64, device=scores.device)
        _all_kernel[(t, triton.cdiv(n, ALL_BLOCK))](scores, scores if n_valid is None else n_valid.contiguous(), out,
                                                    n, scores.stride(0), HAS_VALID=n_valid is not None,
                                                    BLOCK=ALL_BLOCK)
        return out
    ids = torch.arange(n, device=scores.device).expand(t, n)
    bad = torch.isneginf(scores)
    if n_valid is not None:
        bad = bad | (ids >= n_valid[:, None])
    return torch.where(bad, torch.full_like(ids, -1), ids)


def select_topk_ref(scores: Tensor, k: int, n_valid: Tensor | None = None) -> Tensor:
    """scores [T, N] float32 (−inf = not eligible), k ≤ N, n_valid [T] (entries j ≥ n_valid[t] count as −inf;
    None = all N) → int64 [T, k]: the ids of :func:`stable_topk` sorted ascending, those whose score is −inf
    replaced by −1 (so the −1 sit where the lowest-index −inf entries would). docs/model.md §3.7 step 7."""
    if n_valid is not None:
        ent = torch.arange(scores.shape[-1], device=scores.device)
        scores = scores.masked_fill(ent[None, :] >= n_valid[:, None], float("-inf"))
    ids = torch.sort(stable_topk(scores, k), dim=-1).values
    picked = scores.gather(1, ids)
    return torch.where(torch.isneginf(picked), torch.full_like(ids, -1), ids)


if triton is not None:
    import triton.language as tl

    @triton.jit
    def _all_kernel(s_ptr, nv_ptr, out_ptr, N, stride_s, HAS_VALID: tl.constexpr, BLOCK: tl.constexpr):
        """Program (row t, block b): out[t, j] = j, or −1 where the score is −inf or j ≥ n_valid[t]."""
        t = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = j < N
        s = tl.load(s_ptr + t * stride_s + j, mask=mask, other=0.0)
        bad = s == float("-inf")
        if HAS_VALID:
            bad = bad | (j >= tl.load(nv_ptr + t))
        tl.store(out_ptr + t * N + j, tl.where(bad, -1, j).to(tl.int64), mask=mask)

    @triton.jit
    def _keys_kernel(s_ptr, out_ptr, total, N, LOW32, BLOCK: tl.constexpr):
        # LOW32 = 2**32 − 1 comes in as an int64 argument (a literal that large would be typed uint32)
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = i < total
        s = tl.load(s_ptr + i, mask=mask, other=0.0)
        s = tl.where(s == 0.0, 0.0, s)  # -0.0 → +0.0
        bits = s.to(tl.int32, bitcast=True).to(tl.int64)
        ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        ordered = tl.where(s != s, 0x7FFFFFFF, ordered)  # NaN
        key = (ordered << 32) | (LOW32 - i % N)
        tl.store(out_ptr + i, key, mask=mask)
