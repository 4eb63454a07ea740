"""The fast model's indexer selection (``kernels/topk.py`` select_topk) against the oracle's (docs/model.md §3.7
step 7) on the CPU; the CUDA kernel is held to the same reference in tests/test_gpu_cuda_topk.py."""

import torch

from v41.kernels.topk import select_topk
from v41.models.reference.attention import select_topk as oracle_select


def test_the_fast_selection_is_the_oracles():
    """kernels.topk.select_topk (the CPU fallback here; the CUDA kernel on the GPU, tests/test_gpu_cuda_topk.py)
    = the oracle's select_topk on scores masked beyond n_valid: ids ascending, −1 where the pick is −inf."""
    g = torch.Generator().manual_seed(3)
    s = torch.randint(0, 5, (6, 300), generator=g).float()  # many ties
    s[1] = float("-inf")
    s[2, ::3] = float("-inf")
    n_valid = torch.tensor([300, 300, 100, 7, 0, 250])
    masked = s.masked_fill(torch.arange(300)[None, :] >= n_valid[:, None], float("-inf"))
    for k in (1, 16, 128, 300):
        got = select_topk(s, k, n_valid)
        assert torch.equal(got, oracle_select(masked, k)), k
        assert torch.equal(got, select_topk(masked, k))
    assert select_topk(s, 16, n_valid)[3].tolist() == sorted(torch.topk(s[3, :7], 7).indices.tolist()) + [-1] * 9

