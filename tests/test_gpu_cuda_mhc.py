"""The CUDA mHC seam (cuda/mhc/hc_seam.cu) against its PyTorch references (``kernels/mhc.py`` hc_expand_ref,
hc_mixes_ref, hc_collapse_norm_ref, in float64): 1 to 16 tokens, the tiny, V4 and V4.1-Flash hidden sizes, with
and without the expansion, without a collapse or collapsing with given weights or the seam's own pre, outputs
poisoned first; the arrival counter left zeroed, repeat runs and CUDA-graph replay bit for bit; the dispatch's
choice; the binding's refusals. Skips without CUDA or v41._cuda."""

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
    pre_c = torch.rand(t, 4, generator=g, device="cuda") + 0.5
    norm_w = (1 + torch.randn(d, generator=g, device="cuda") * 0.1).to(torch.bfloat16)
    return h, y, post, comb, fn, scale, base, pre_c, norm_w


def _run(h, fn, scale, base, expand=None, collapse=None):
    """One launch into NaN-filled outputs (copies, x)."""
    t, _, d = h.shape
    pre, post = (torch.full((t, 4), float("nan"), device="cuda") for _ in range(2))
    comb = torch.full((t, 4, 4), float("nan"), device="cuda")
    if expand is not None:
        expand = (*expand, torch.full_like(h, float("nan")))
    if collapse is not None:
        collapse = (*collapse, torch.full((t, d), float("nan"), device="cuda", dtype=torch.bfloat16))
    mhc_cuda.launch(h, fn, scale, base, 20, 1e-6, 1e-6, pre, post, comb, wstream.split_counters(h.device), expand,
                    collapse)
    return (h if expand is None else expand[3]), pre, post, comb, (None if collapse is None else collapse[3])


def _bf16_close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Within one bf16 rounding step of the float64 value (the kernel rounds its float32 sum once)."""
    return bool(((got.double() - want).abs() <= want.abs() * 2.0 ** -7 + 1e-30).all())


@pytest.mark.parametrize("collapse", [None, "given", "fresh"])
@pytest.mark.parametrize("expand", [False, True], ids=["mixes", "expand"])
@pytest.mark.parametrize("t,d", [(1, 64), (1, 5120), (3, 512), (8, 5120), (16, 4096)])
def test_the_seam_equals_its_reference(t, d, expand, collapse):
    h, y, post, comb, fn, scale, base, pre_c, norm_w = _case(t, d, seed=t * 7 + d)
    col = None if collapse is None else (pre_c if collapse == "given" else None, norm_w, 1e-5)
    h2, pre, *mixes, x = _run(h, fn, scale, base, (y, post, comb) if expand else None, col)
    if expand:
        assert _bf16_close(h2, mhc.hc_expand_ref(h.double(), y.double(), post.double(), comb.double()))
    want = mhc.hc_mixes_ref(h2.double(), fn.double(), scale.double(), base.double(), 4, 20, 1e-6, 1e-6)
    for name, a, b in zip(("pre", "post", "comb"), (pre, *mixes), want):
        assert rel(a, b) <= 1e-5, (name, rel(a, b))
    if collapse is not None:  # the reference does not round the collapse to bf16 before the norm: two roundings
        w = (pre_c if collapse == "given" else pre).double()
        assert rel(x, mhc.hc_collapse_norm_ref(h2.double(), w, 1e-5, norm_w.double())) <= 8e-3
        # against the Triton launches it replaces: the same roundings, float32 sums in another order
        same = mhc.hc_collapse_norm(h2, w.float(), 1e-5, norm_w)
        assert (x.float() - same.float()).abs().max() <= same.float().abs().max() * 2.0 ** -7
    assert int(wstream.split_counters(h.device)[wstream.COUNTER_SLOTS]) == 0  # left zeroed for the next launch


def test_repeats_and_graph_replay_are_bit_equal():
    h, y, post, comb, fn, scale, base, pre_c, norm_w = _case(8, 5120, seed=3)
    call = lambda: mhc_cuda.seam(h, fn, scale, base, 20, 1e-6, 1e-6, y, post, comb, (pre_c, norm_w, 1e-5))  # noqa
    first, *runs = [call() for _ in range(20)]  # back to back: the arrival counter and generation word hand over
    assert all(torch.equal(a, b) for again in runs for a, b in zip(first, again))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for _ in range(3):
        for x in out:
            x.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(first, out))


@pytest.mark.parametrize("given", [True, False])
def test_the_dispatch_takes_decode_steps_and_leaves_longer_ones_to_triton(monkeypatch, given):
    calls = []
    real = mhc_cuda.seam
    monkeypatch.setattr(mhc_cuda, "seam", lambda *a, **k: calls.append(real(*a, **k)) or calls[-1])
    for t in (1, 8, mhc_cuda.MAX_TOKENS + 1):  # 8 with the seam's own pre: CUDA mixes, then the collapse launch
        h, y, post, comb, fn, scale, base, pre_c, norm_w = _case(t, 512)
        calls.clear()
        pre_c = pre_c if given else None
        h2, pre, *mixes, x = mhc.hc_seam(h, fn, scale, base, 4, 20, 1e-6, 1e-6, pre_c, 1e-5, norm_w, y, post, comb)
        assert calls and (calls[0] is not None) == (t <= mhc_cuda.MAX_TOKENS)  # declined: hc_mixes asks again
        want = mhc.hc_mixes_ref(h2.double(), fn.double(), scale.double(), base.double(), 4, 20, 1e-6, 1e-6)
        assert all(rel(a, b) <= 1e-5 for a, b in zip((pre, *mixes), want))
        w = (pre if pre_c is None else pre_c).double()
        assert rel(x, mhc.hc_collapse_norm_ref(h2.double(), w, 1e-5, norm_w.double())) <= 8e-3


def test_the_binding_rejects_what_the_kernel_cannot_read():
    h, y, post, comb, fn, scale, base, pre_c, norm_w = _case(2, 512)
    pre, pst = torch.empty(2, 4, device="cuda"), torch.empty(2, 4, device="cuda")
    cmb = torch.empty(2, 4, 4, device="cuda")
    counters = wstream.split_counters(h.device)
    x = torch.empty(2, 512, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(RuntimeError, match="D a positive multiple"):
        mhc_cuda.launch(h[..., :500].contiguous(), fn[:, :2000].contiguous(), scale, base, 20, 1e-6, 1e-6, pre, pst,
                        cmb, counters)
    with pytest.raises(RuntimeError, match="not h itself"):
        mhc_cuda.launch(h, fn, scale, base, 20, 1e-6, 1e-6, pre, pst, cmb, counters, (y, post, comb, h))
    with pytest.raises(RuntimeError, match="fn \\[24, 4D\\]"):
        mhc_cuda.launch(h, fn.to(torch.bfloat16), scale, base, 20, 1e-6, 1e-6, pre, pst, cmb, counters)
    with pytest.raises(RuntimeError, match="norm_w \\[D\\] and x"):
        mhc_cuda.launch(h, fn, scale, base, 20, 1e-6, 1e-6, pre, pst, cmb, counters, None,
                        (pre_c, norm_w.float(), 1e-5, x))
    assert int(counters[wstream.COUNTER_SLOTS]) == 0


def test_the_python_limits_are_the_kernels():
    """mhc_cuda's constants mirror cuda/mhc/hc_seam.h (they exist without the extension; checked against it)."""
    ext = dispatch.cuda_ext()
    assert (mhc_cuda.MAX_TOKENS, mhc_cuda.COLS, mhc_cuda.FRESH_MAX_D) == (ext.HC_MAX_TOKENS, ext.HC_COLS,
                                                                           ext.HC_FRESH_MAX_D)
    assert mhc_cuda.SEAM_MAX_TOKENS <= mhc_cuda.MAX_TOKENS and mhc_cuda.FRESH_MAX_TOKENS <= mhc_cuda.SEAM_MAX_TOKENS
