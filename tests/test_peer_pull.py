"""The pcie-pull all-reduce's pull steps (v41.kernels.peer_pull): the PyTorch references on CPU here, and the
Triton kernels against them bit for bit on CUDA (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from v41.distributed.group import split_range
from v41.kernels.peer_pull import pull_gather, pull_gather_ref, pull_reduce, pull_reduce_ref


@pytest.mark.parametrize("w", [1, 2, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_references_reduce_in_rank_order_and_gather_by_owner(w, dtype):
    g = torch.Generator().manual_seed(w)
    n = 1000 + w
    srcs = [torch.randn(n, generator=g).to(dtype) for _ in range(w)]
    out = torch.zeros(n, dtype=dtype)
    for r in range(w):
        pull_reduce_ref(srcs, out, *split_range(n, w, r))
    acc = torch.zeros(n)
    for s in srcs:
        acc += s.float()
    assert torch.equal(out, acc.to(dtype))
    owners = [torch.full((n,), float(k)).to(dtype) for k in range(w)]
    dst = torch.empty(n, dtype=dtype)
    pull_gather_ref(owners, dst)
    for k in range(w):
        a, e = split_range(n, w, k)
        assert torch.all(dst[a:e] == k)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("w", [1, 2, 5, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernels_equal_the_references(w, dtype):
    g = torch.Generator().manual_seed(w)
    n = 5 * 1024 + 3
    srcs = [torch.randn(n, generator=g).to(dtype).cuda() for _ in range(w)]
    got, want = torch.zeros(n, dtype=dtype, device="cuda"), torch.zeros(n, dtype=dtype, device="cuda")
    for r in range(w):
        a, e = split_range(n, w, r)
        pull_reduce(srcs, got, a, e)
        pull_reduce_ref(srcs, want, a, e)
    assert torch.equal(got, want)
    dst, ref = torch.empty_like(got), torch.empty_like(got)
    pull_gather(srcs, dst)
    pull_gather_ref(srcs, ref)
    assert torch.equal(dst, ref)
