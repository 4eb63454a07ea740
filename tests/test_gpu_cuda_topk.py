"""The CUDA indexer top-k (cuda/indexer/select_topk.cu) against its PyTorch reference on the CPU
(``kernels/topk.py`` select_topk_ref): the same ids, exactly, over random rows, ties, −inf masks, NaN / inf, the
one-launch and three-pass paths, the heavy-tie fallback, and CUDA-graph replay. Skips without CUDA or v41._cuda."""

from __future__ import annotations

import pytest
import torch

from v41.kernels import dispatch, topk

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and dispatch.cuda_runs_on(torch.device("cuda"))),
                                reason="needs a CUDA device and v41._cuda built for it")


ORDERED = 8192  # the ordered finish's row length to test (topk.ORDERED_MAX_N, off by default, would take it)


def _check(scores: torch.Tensor, k: int, n_valid: torch.Tensor | None = None) -> torch.Tensor:
    """Kernel ids (output poisoned first) == the CPU reference's, with the one-CTA rows finished by the ordered
    pass (rows up to ORDERED entries) and by the sort (``ordered_max_n = 0``); returns the ids."""
    t = scores.shape[0]
    want = topk.select_topk_ref(scores.cpu(), k, None if n_valid is None else n_valid.cpu())
    for ordered_max_n in (ORDERED, 0):
        out = torch.full((t, k), 123456789, dtype=torch.int64, device="cuda")
        dispatch.cuda_ext().select_topk(scores, n_valid, k, out, ordered_max_n=ordered_max_n)
        got = out.cpu()
        bad = (got != want).any(dim=1).nonzero().flatten().tolist()
        assert not bad, (f"ordered_max_n {ordered_max_n}: rows {bad[:5]} differ: got {got[bad[0]][:16].tolist()} "
                         f"want {want[bad[0]][:16].tolist()}")
    return out


# (T, N, k): one-launch rows (N <= 16,384; up to 8,192 the picks are written by an ordered pass, above by a sort),
# three-pass rows, many rows of a long length (one launch again)
SHAPES = [(1, 1, 1), (3, 7, 7), (5, 100, 17), (4, 513, 512), (64, 2048, 512), (3, 5000, 2048), (2, 8192, 512),
          (2, 8193, 512), (8, 16384, 512), (2, 16385, 512),
          (3, 70001, 2048), (1, 1 << 20, 512), (300, 20000, 64)]


@pytest.mark.parametrize("t,n,k", SHAPES)
def test_random_rows_match_the_reference(t, n, k):
    g = torch.Generator(device="cuda").manual_seed(t * 7919 + n)
    scores = torch.randn(t, n, device="cuda", generator=g)
    _check(scores, k)
    n_valid = torch.randint(-2, n + 3, (t,), device="cuda", generator=g)
    n_valid[0] = min(n, k - 1) if k > 1 else 0  # fewer than k eligible: −1 fill
    _check(scores, k, n_valid)
    masked = scores.masked_fill(torch.rand(t, n, device="cuda", generator=g) < 0.7, float("-inf"))
    _check(masked, k, n_valid)


@pytest.mark.parametrize("n", [3000, 200000])
def test_ties_take_the_lower_index(n):
    """Integer-valued scores: thousands of exact ties at the threshold (the band overflows shared memory), exact
    zeros and −0.0 against +0.0, NaN above +inf, all-−inf rows and rows of one value."""
    g = torch.Generator(device="cuda").manual_seed(n)
    rows = [torch.randint(0, 4, (n,), device="cuda", generator=g).float(),
            torch.zeros(n, device="cuda"),
            torch.where(torch.rand(n, device="cuda", generator=g) < 0.5, -0.0, 0.0),
            torch.full((n,), float("-inf"), device="cuda"),
            torch.randn(n, device="cuda", generator=g).clamp(min=0.0),
            torch.randn(n, device="cuda", generator=g)]
    rows[5][::97] = float("nan")
    rows[5][::89] = float("inf")
    scores = torch.stack(rows)
    for k in (1, 64, 512, 2048):
        _check(scores, k)
    _check(scores, 512, torch.tensor([n // 3, n, 0, n, 5, n - 1], device="cuda"))


@pytest.mark.parametrize("n", [6000, 200_000])
def test_narrow_band_is_resolved_exactly(n):
    """Row 0: n distinct consecutive floats above 1.0 (bands of 1,024 keys, sorted in shared memory). Row 1:
    n scores over the 1,024 floats of one 22-bit key prefix, so the band overflows and the last 10 key bits,
    then the index, decide (6,000: in the one-CTA kernel's ordered finish; 200,000: the three-pass path)."""
    g = torch.Generator(device="cuda").manual_seed(1)
    base = torch.tensor(1.0).view(torch.int32).item()
    bits = torch.stack([base + torch.randperm(n, device="cuda", generator=g),
                        base + torch.randint(0, 1024, (n,), device="cuda", generator=g)])
    scores = bits.to(torch.int32).view(torch.float32)
    for k in (1, 511, 2048):
        _check(scores, k)
        _check(scores, k, torch.tensor([n - 3, n // 2], device="cuda"))


def test_strided_rows_and_repeat_calls_are_identical():
    wide = torch.randn(4, 40000, device="cuda")
    view = wide[:, 1000:39000]
    a = _check(view, 512)
    b = topk.select_topk(view, 512)
    assert torch.equal(a, b)


def test_graph_replay_follows_new_scores():
    for t, n in ((8, 2048), (2, 100000)):
        scores = torch.randn(t, n, device="cuda")
        n_valid = torch.full((t,), n, dtype=torch.int64, device="cuda")
        topk.select_topk(scores, 512, n_valid)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = topk.select_topk(scores, 512, n_valid)
        for seed in range(3):
            scores.copy_(torch.randn(t, n, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed)))
            n_valid.fill_(n - 7 * seed)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out.cpu(), topk.select_topk_ref(scores.cpu(), 512, n_valid.cpu()))


def test_dispatch_declines_what_the_kernel_does_not_take():
    """float64 rows and k above 2,048 go to the reference; the binding rejects bad operands with an error."""
    s64 = torch.randn(2, 5000, device="cuda", dtype=torch.float64)
    assert torch.equal(topk.select_topk(s64, 8).cpu(), topk.select_topk_ref(s64.cpu(), 8))
    s = torch.randn(2, 5000, device="cuda")
    assert torch.equal(topk.select_topk(s, 3000).cpu(), topk.select_topk_ref(s.cpu(), 3000))
    with pytest.raises(RuntimeError, match="k must be"):
        dispatch.cuda_ext().select_topk(s, None, 0, torch.empty(2, 0, dtype=torch.int64, device="cuda"))
    with pytest.raises(RuntimeError, match="n_valid must be"):
        dispatch.cuda_ext().select_topk(s, torch.ones(2, dtype=torch.int32, device="cuda"), 8,
                                        torch.empty(2, 8, dtype=torch.int64, device="cuda"))
    with pytest.raises(RuntimeError, match="out must be"):
        dispatch.cuda_ext().select_topk(s, None, 8, torch.empty(2, 8, dtype=torch.int32, device="cuda"))
