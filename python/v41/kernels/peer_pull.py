"""The two pull steps of the ``pcie-pull`` all-reduce (:mod:`v41.distributed.pcie_pull`): one kernel each,
reading every peer's buffer directly (CUDA peer access over UVA), with the PyTorch reference beside it.

``pull_reduce``: ``out[a:e] = round(Σ_{k=0..W−1} srcs[k][a:e])`` with the sum in float32 in rank order
k = 0, 1, ... (so every rank rounds identically). ``pull_gather``: ``dst[i] = srcs[owner(i)][i]`` where
``owner`` is the rank whose :func:`~v41.distributed.group.split_range` share holds element i.
The Triton kernels get the sources as an int64 tensor of addresses and add in the same order as the
reference, so their results are bitwise equal to it.
"""

from __future__ import annotations

import functools

import torch

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
    def _reduce_kernel(out, addrs, a, e, W: tl.constexpr, BLOCK: tl.constexpr):
        offs = a + tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < e
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for k in tl.static_range(W):  # rank order, as the reference
            src = tl.load(addrs + k).to(out.dtype)  # int64 address → pointer of out's element type
            acc += tl.load(src + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(out + offs, acc.to(out.dtype.element_ty), mask=m)

    @triton.jit
    def _gather_kernel(dst, addrs, n, base, extra, W: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        big = extra * (base + 1)
        owner = tl.where(offs < big, offs // (base + 1), extra + (offs - big) // tl.maximum(base, 1))
        val = tl.zeros([BLOCK], dtype=dst.dtype.element_ty)
        for k in tl.static_range(W):
            src = tl.load(addrs + k).to(dst.dtype)
            val = tl.where(owner == k, tl.load(src + offs, mask=m & (owner == k), other=0.0), val)
        tl.store(dst + offs, val, mask=m)


def has_kernels(device: torch.device) -> bool:
    """Whether the Triton kernels can run for tensors on ``device`` (CUDA with Triton installed)."""
    return triton is not None and device.type == "cuda"


@functools.lru_cache(maxsize=64)
def _addresses(ptrs: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The sources' base addresses as an int64 tensor on ``device``; cached, since a group's buffers (and so
    the addresses of its two halves) never move."""
    return torch.tensor(ptrs, dtype=torch.int64, device=device)


def pull_reduce(srcs: list[torch.Tensor], out: torch.Tensor, a: int, e: int) -> None:
    """:func:`pull_reduce_ref` as one kernel on ``out``'s device (srcs: memory of this or a peer GPU mapped into
    this device's address space); the reference when Triton or CUDA is missing."""
    if not has_kernels(out.device) or e <= a:
        return pull_reduce_ref(srcs, out, a, e)
    addrs = _addresses(tuple(s.data_ptr() for s in srcs), out.device)
    _reduce_kernel[(triton.cdiv(e - a, BLOCK),)](out, addrs, a, e, W=len(srcs), BLOCK=BLOCK)


def pull_gather(srcs: list[torch.Tensor], dst: torch.Tensor) -> None:
    """:func:`pull_gather_ref` as one kernel on ``dst``'s device; the reference when Triton or CUDA is missing."""
    n = dst.numel()
    if not has_kernels(dst.device) or n == 0:
        return pull_gather_ref(srcs, dst)
    base, extra = divmod(n, len(srcs))
    addrs = _addresses(tuple(s.data_ptr() for s in srcs), dst.device)
    _gather_kernel[(triton.cdiv(n, BLOCK),)](dst, addrs, n, base, extra, W=len(srcs), BLOCK=BLOCK)
