"""The CUDA mHC seam (cuda/mhc/hc_mix.cu) against its PyTorch references (``kernels/mhc.py`` hc_expand_ref,
hc_mixes_ref, in float64): 1 to 16 tokens, the tiny and V4.1-Flash hidden sizes, with and without the expansion,
outputs poisoned first; the arrival counter left zeroed, repeat runs and CUDA-graph replay bit for bit; the
dispatch's choice. Skips without CUDA or v41._cuda."""

from __future__ import annotations

import pytest
import torch

from kernel_checks import rel
from v41.kernels import dispatch, mhc, mhc_cuda, wstream

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and dispatch.cuda_runs_on(torch.device("cuda"))),
                                reason="needs a CUDA device and v41._cuda built for it")


def _case(t: int, d: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(t, 4, d, generator=g, device="cuda").to(torch.bfloat16)
    y = torch.randn(t, d, generator=g, device="cuda").to(torch.bfloat16)
    post = 2 * torch.rand(t, 4, generator=g, device="cuda")
    comb = torch.rand(t, 4, 4, generator=g, device="cuda")
    comb = comb / comb.sum(1, keepdim=True)
    fn = torch.randn(24, 4 * d, generator=g, device="cuda") * 0.05
    scale = 1 + torch.randn(3, generator=g, device="cuda") * 0.1
    base = torch.randn(24, generator=g, device="cuda") * 0.3
    return h, y, post, comb, fn, scale, base


def _run(h, fn, scale, base, expand=None):
    """One launch into NaN-filled outputs (and copies)."""
    t = h.shape[0]
    pre, post = (torch.full((t, 4), float("nan"), device="cuda") for _ in range(2))
    comb = torch.full((t, 4, 4), float("nan"), device="cuda")
    if expand is not None:
        expand = (*expand, torch.full_like(h, float("nan")))
    mhc_cuda.launch(h, fn, scale, base, 20, 1e-6, 1e-6, pre, post, comb, wstream.split_counters(h.device), expand)
    return (h if expand is None else expand[3]), pre, post, comb


def _bf16_close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Within one bf16 rounding step of the float64 value (the kernel rounds its float32 sum once)."""
    return bool(((got.double() - want).abs() <= want.abs() * 2.0 ** -7 + 1e-30).all())


@pytest.mark.parametrize("expand", [False, True], ids=["mixes", "expand+mixes"])
@pytest.mark.parametrize("t,d", [(1, 64), (1, 5120), (3, 512), (8, 5120), (16, 4096)])
def test_the_seam_equals_its_reference(t, d, expand):
    h, y, post, comb, fn, scale, base = _case(t, d, seed=t * 7 + d)
    h2, *mixes = _run(h, fn, scale, base, (y, post, comb) if expand else None)
    if expand:
        want = mhc.hc_expand_ref(h.double(), y.double(), post.double(), comb.double())
        assert _bf16_close(h2, want)
    want = mhc.hc_mixes_ref(h2.double(), fn.double(), scale.double(), base.double(), 4, 20, 1e-6, 1e-6)
    for name, a, b in zip(("pre", "post", "comb"), mixes, want):
        assert rel(a, b) <= 1e-5, (name, rel(a, b))
    assert int(wstream.split_counters(h.device)[0]) == 0  # left zeroed for the next launch


def test_repeats_and_graph_replay_are_bit_equal():
    h, y, post, comb, fn, scale, base = _case(8, 5120, seed=3)
    first = mhc_cuda.seam(h, fn, scale, base, 20, 1e-6, 1e-6, y, post, comb)
    again = mhc_cuda.seam(h, fn, scale, base, 20, 1e-6, 1e-6, y, post, comb)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mhc_cuda.seam(h, fn, scale, base, 20, 1e-6, 1e-6, y, post, comb)
    for _ in range(3):
        for x in out:
            x.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(first, out))


def test_the_dispatch_takes_decode_steps_and_leaves_longer_ones_to_triton(monkeypatch):
    calls = []
    real = mhc_cuda.seam
    monkeypatch.setattr(mhc_cuda, "seam", lambda *a, **k: calls.append(1) or real(*a, **k))
    for t in (1, mhc_cuda.MAX_TOKENS + 1):
        h, y, post, comb, fn, scale, base = _case(t, 512)
        calls.clear()
        got = mhc.hc_expand_mixes(h, y, post, comb, fn, scale, base, 4, 20, 1e-6, 1e-6)
        assert (real(h, fn, scale, base, 20, 1e-6, 1e-6, y, post, comb) is not None) == (t == 1)
        want = mhc.hc_mixes_ref(got[0].double(), fn.double(), scale.double(), base.double(), 4, 20, 1e-6, 1e-6)
        assert all(rel(a, b) <= 1e-5 for a, b in zip(got[1:], want))
        assert calls, "the dispatch did not try the CUDA seam"


def test_the_binding_rejects_what_the_kernel_cannot_read():
    h, y, post, comb, fn, scale, base = _case(2, 512)
    pre, pst, cmb = torch.empty(2, 4, device="cuda"), torch.empty(2, 4, device="cuda"), torch.empty(2, 4, 4, device="cuda")
    counters = wstream.split_counters(h.device)
    with pytest.raises(RuntimeError, match="D a positive multiple"):
        mhc_cuda.launch(h[..., :500].contiguous(), fn[:, :2000].contiguous(), scale, base, 20, 1e-6, 1e-6, pre, pst,
                        cmb, counters)
    with pytest.raises(RuntimeError, match="not h itself"):
        mhc_cuda.launch(h, fn, scale, base, 20, 1e-6, 1e-6, pre, pst, cmb, counters, (y, post, comb, h))
    with pytest.raises(RuntimeError, match="fn \\[24, 4D\\]"):
        mhc_cuda.launch(h, fn.to(torch.bfloat16), scale, base, 20, 1e-6, 1e-6, pre, pst, cmb, counters)
