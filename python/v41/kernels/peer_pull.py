"""The two pull steps of the ``pcie-pull`` all-reduce (:mod:`v41.distributed.pcie_pull`): one kernel each,
reading every peer's buffer directly (CUDA peer access over UVA), with the PyTorch reference beside it.

``pull_reduce``: ``out[a:e] = round(Σ_{k=0..W−1} srcs[k][a:e])`` with the sum in float32 in rank order
k = 0, 1, ... (so every rank rounds identically). ``pull_gather``: ``dst[i] = srcs[owner(i)][i]`` where
``owner`` is the rank whose :func:`~v41.distributed.group.split_range` share holds element i.
The Triton kernels take up to :data:`MAX_RANKS` peer tensors and add in the same order as the reference, so
their results are bitwise equal to it.
"""

from __future__ import annotations

import torch

MAX_RANKS = 8
BLOCK = 1024


def pull_reduce_ref(srcs: list[torch.Tensor], out: torch.Tensor, a: int, e: int) -> None:
    """Reference: srcs W 1-D tensors (bf16/fp32, any devices) of ≥ e elements; writes out[a:e] in place."""
    acc = torch.zeros(e - a, dtype=torch.float32, device=out.device)
    for s in srcs:
        acc += s[a:e].to(out.device).float()
    out[a:e].copy_(acc)


def pull_gather_ref(srcs: list[torch.Tensor], dst: torch.Tensor) -> None:
    """Reference: dst[range_k] = srcs[k][range_k] for each rank k's split_range share of dst's elements."""
    n, w = dst.numel(), len(srcs)
    base, extra = divmod(n, w)
    start = 0
    for k, s in enumerate(srcs):
        stop = start + base + (1 if k < extra else 0)
        dst[start:stop].copy_(s[start:stop].to(dst.device))
        start = stop


try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the references serve
    triton = None

if triton is not None:
    @triton.jit
    def _reduce_kernel(out, p0, p1, p2, p3, p4, p5, p6, p7, a, e, W: tl.constexpr, BLOCK: tl.constexpr):
        offs = a + tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < e
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        acc += tl.load(p0 + offs, mask=m, other=0.0).to(tl.float32)
        if W > 1:
            acc += tl.load(p1 + offs, mask=m, other=0.0).to(tl.float32)
        if W > 2:
            acc += tl.load(p2 + offs, mask=m, other=0.0).to(tl.float32)
        if W > 3:
            acc += tl.load(p3 + offs, mask=m, other=0.0).to(tl.float32)
        if W > 4:
            acc += tl.load(p4 + offs, mask=m, other=0.0).to(tl.float32)
        if W > 5:
            acc += tl.load(p5 + offs, mask=m, other=0.0).to(tl.float32)
        if W > 6:
            acc += tl.load(p6 + offs, mask=m, other=0.0).to(tl.float32)
        if W > 7:
            acc += tl.load(p7 + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(out + offs, acc.to(out.dtype.element_ty), mask=m)

    @triton.jit
    def _gather_kernel(dst, p0, p1, p2, p3, p4, p5, p6, p7, n, base, extra, W: tl.constexpr,
                       BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        big = extra * (base + 1)
        owner = tl.where(offs < big, offs // (base + 1), extra + (offs - big) // tl.maximum(base, 1))
        val = tl.load(p0 + offs, mask=m & (owner == 0), other=0.0)
        if W > 1:
            val = tl.where(owner == 1, tl.load(p1 + offs, mask=m & (owner == 1), other=0.0), val)
        if W > 2:
            val = tl.where(owner == 2, tl.load(p2 + offs, mask=m & (owner == 2), other=0.0), val)
        if W > 3:
            val = tl.where(owner == 3, tl.load(p3 + offs, mask=m & (owner == 3), other=0.0), val)
        if W > 4:
            val = tl.where(owner == 4, tl.load(p4 + offs, mask=m & (owner == 4), other=0.0), val)
        if W > 5:
            val = tl.where(owner == 5, tl.load(p5 + offs, mask=m & (owner == 5), other=0.0), val)
        if W > 6:
            val = tl.where(owner == 6, tl.load(p6 + offs, mask=m & (owner == 6), other=0.0), val)
        if W > 7:
            val = tl.where(owner == 7, tl.load(p7 + offs, mask=m & (owner == 7), other=0.0), val)
        tl.store(dst + offs, val, mask=m)


def has_kernels(device: torch.device) -> bool:
    """Whether the Triton kernels can run for tensors on ``device`` (CUDA with Triton installed)."""
    return triton is not None and device.type == "cuda"


def _padded(srcs: list[torch.Tensor]) -> list[torch.Tensor]:
    if not 1 <= len(srcs) <= MAX_RANKS:
        raise ValueError(f"peer pull takes 1..{MAX_RANKS} ranks, got {len(srcs)}")
    return srcs + [srcs[0]] * (MAX_RANKS - len(srcs))


def pull_reduce(srcs: list[torch.Tensor], out: torch.Tensor, a: int, e: int) -> None:
    """:func:`pull_reduce_ref` as one kernel on ``out``'s device (srcs may live on peer GPUs with peer access
    enabled); the reference when Triton or CUDA is missing."""
    if not has_kernels(out.device) or e <= a:
        return pull_reduce_ref(srcs, out, a, e)
    grid = (triton.cdiv(e - a, BLOCK),)
    _reduce_kernel[grid](out, *_padded(srcs), a, e, W=len(srcs), BLOCK=BLOCK)


def pull_gather(srcs: list[torch.Tensor], dst: torch.Tensor) -> None:
    """:func:`pull_gather_ref` as one kernel on ``dst``'s device; the reference when Triton or CUDA is missing."""
    n = dst.numel()
    if not has_kernels(dst.device) or n == 0:
        return pull_gather_ref(srcs, dst)
    base, extra = divmod(n, len(srcs))
    _gather_kernel[(triton.cdiv(n, BLOCK),)](dst, *_padded(srcs), n, base, extra, W=len(srcs), BLOCK=BLOCK)
