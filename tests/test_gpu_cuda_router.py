"""The CUDA MoE router (cuda/moe/router.cu) against its PyTorch reference (``kernels/router.py`` route_ref over the
float64 gate product): 1–16 tokens, 8–512 experts, top-1 to top-16, the tiny and V4.1-Flash hidden sizes, x rows
wider than D, bias and hash routing, with and without renormalisation; exact ties to the lower expert id; NaN
logits; outputs poisoned first; the arrival counter left zeroed; CUDA-graph replay bit for bit; the dispatch's
choice; the bf16 fast model's logits and greedy tokens with it against without it. Skips without CUDA or
v41._cuda."""

from __future__ import annotations

import pytest
import torch

from kernel_checks import poison, rel
from engine_helpers import BF16_BOUND, BF16_MARGIN, cuda_step_logits
from v41.kernels import dispatch, router, wstream
from v41.kernels.packed import from_dense

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and dispatch.cuda_runs_on(torch.device("cuda"))),
                                reason="needs a CUDA device and v41._cuda built for it")


@pytest.fixture(autouse=True)
def cuda_router(monkeypatch):
    monkeypatch.setattr(router, "CUDA_ROUTER", True)
    monkeypatch.setattr(router, "CUDA_ROUTER_MAX_TOKENS", router.ROUTER_MAX_TOKENS)


def _case(t, e, d, k, hashed, seed=0, tied=0, pad=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, d + pad, generator=g, device="cuda").to(torch.bfloat16)[:, :d]  # pad: rows wider than D
    w = (torch.randn(e, d, generator=g, device="cuda") / d ** 0.5).to(torch.bfloat16)
    if tied:  # experts 0..tied-1 equal to the last one and leading for every token: exactly equal top scores
        w[-1] = (x.float().mean(0) * 4 / d ** 0.5).to(torch.bfloat16)
        w[:tied] = w[-1]
    bias = None if hashed else torch.randn(e, generator=g, device="cuda") * 0.1 * (tied == 0)
    hash_ids = torch.randint(0, e, (t, k), generator=g, device="cuda") if hashed else None
    return x, from_dense(w), bias, hash_ids


def _want(x, gate, bias, hash_ids, k, renorm):
    logits = x.double() @ gate.data.double().T
    ids, weights = router.route_ref(logits, None if bias is None else bias.double(), hash_ids, k, 1.5, renorm, 2.5)
    return ids, weights


@pytest.mark.parametrize("renorm", [True, False])
@pytest.mark.parametrize("hashed", [False, True], ids=["bias", "hash"])
@pytest.mark.parametrize("t,e,d,k,pad", [(1, 384, 5120, 6, 0), (3, 256, 64, 8, 8), (16, 384, 5120, 6, 0),
                                         (5, 8, 128, 1, 0), (2, 40, 256, 8, 0), (11, 512, 1024, 16, 16),
                                         (2, 7, 40, 3, 0), (3, 129, 8, 4, 0), (1, 65, 7168, 6, 0)])
def test_the_router_equals_its_reference(t, e, d, k, pad, hashed, renorm):
    """Also an odd E (the last CTA's second expert a clamped repeat, not stored), D = 8 and 40 (warps whose quarter
    of the row is empty or short) and D = 7,168 (two passes per warp)."""
    x, gate, bias, hash_ids = _case(t, e, d, k, hashed, seed=t + e + k, pad=pad)
    poison("cuda")
    ids, weights = router._route_cuda(x, gate, bias, hash_ids, k, 1.5, renorm, 2.5)
    want_ids, want_w = _want(x, gate, bias, hash_ids, k, renorm)
    assert torch.equal(ids, want_ids)
    assert rel(weights, want_w) <= 1e-5
    assert int(wstream.split_counters(x.device)[0]) == 0  # left zeroed for the next launch


def test_exact_ties_go_to_the_lower_expert_id():
    x, gate, bias, _ = _case(4, 64, 256, 6, False, seed=5, tied=20)  # experts 0..19 and 63 tie, no bias
    ids, _ = router._route_cuda(x, gate, bias, None, 6, 1.0, True, 1.0)
    want, _ = router.route_ref(x.double() @ gate.data.double().T, bias.double(), None, 6, 1.0, True, 1.0)
    assert torch.equal(ids, want)
    assert (want < 20).sum(-1).min() >= 2  # the ties were in play: several of the tied experts chosen per token


def test_nan_logits_give_the_references_ids():
    """NaN ranks above +inf, ties to the lower id (kernels/topk.py order_keys_ref): ids stay in range."""
    x, gate, bias, _ = _case(3, 64, 256, 6, False, seed=6)
    x[1] = float("nan")
    ids, _ = router._route_cuda(x, gate, bias, None, 6, 1.0, True, 1.0)
    want, _ = router.route_ref(x.double() @ gate.data.double().T, bias.double(), None, 6, 1.0, True, 1.0)
    assert torch.equal(ids, want) and torch.equal(ids[1].cpu(), torch.arange(6))


def test_graph_replay_is_bit_equal():
    x, gate, bias, _ = _case(8, 384, 5120, 6, False, seed=9)
    first = router._route_cuda(x, gate, bias, None, 6, 1.0, True, 2.5)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = router._route_cuda(x, gate, bias, None, 6, 1.0, True, 2.5)
    for _ in range(3):
        out[0].fill_(-1)
        out[1].fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out[0], first[0]) and torch.equal(out[1], first[1])


def test_the_dispatch_takes_decode_steps_and_leaves_longer_ones_to_triton(monkeypatch):
    """Up to CUDA_ROUTER_MAX_TOKENS (here 2) the CUDA router runs; past it the dispatch does not try it, and past
    the kernel's 16 tokens the kernel declines; either way the Triton path gives the reference's routing."""
    monkeypatch.setattr(router, "CUDA_ROUTER_MAX_TOKENS", 2)
    calls = []
    real = router._route_cuda
    monkeypatch.setattr(router, "_route_cuda", lambda *a: calls.append(real(*a)) or calls[-1])
    for t in (1, 2, 3):
        x, gate, bias, _ = _case(t, 64, 256, 6, False, seed=t)
        calls.clear()
        ids, weights = router.route_fused(x, gate, bias, None, 6, 1.5, True, 2.5)
        assert len(calls) == (t <= 2) and all(c is not None for c in calls)
        want_ids, want_w = _want(x, gate, bias, None, 6, True)
        assert torch.equal(ids, want_ids) and rel(weights, want_w) <= 1e-5
    monkeypatch.setattr(router, "CUDA_ROUTER_MAX_TOKENS", 99)
    x, gate, bias, _ = _case(router.ROUTER_MAX_TOKENS + 1, 64, 256, 6, False, seed=3)
    calls.clear()
    router.route_fused(x, gate, bias, None, 6, 1.5, True, 2.5)
    assert calls == [None]  # tried, declined: the kernel takes at most 16 tokens
    monkeypatch.setattr(router, "CUDA_ROUTER", False)
    calls.clear()
    router.route_fused(x[:1], gate, bias, None, 6, 1.5, True, 2.5)
    assert not calls


@pytest.mark.parametrize("arch", ["deepseek_v41", "deepseek_v4"])
def test_the_bf16_model_with_the_cuda_router_gives_the_triton_routers_logits(tmp_path, arch, monkeypatch):
    """Prefill then decode (the decode steps take the CUDA router): logits within the bf16 bound of the same model
    with the Triton router, and greedy tokens equal where the Triton run's top-1 lead exceeds the bf16 margin."""
    from v41.testing.tiny import make_tiny

    path = make_tiny(tmp_path / arch, arch, num_experts_per_tok=8)
    ids = torch.randint(3, 1000, (41,), generator=torch.Generator().manual_seed(4)).tolist()
    runs, taken = {}, []
    real = router._route_cuda
    monkeypatch.setattr(router, "_route_cuda", lambda *a: taken.append(real(*a)) or taken[-1])
    for on in (False, True):
        monkeypatch.setattr(router, "CUDA_ROUTER", on)
        taken.clear()
        runs[on] = cuda_step_logits(path, "auto", ids, monkeypatch, "auto")
        assert any(r is not None for r in taken) == on, "the CUDA router ran in the decode steps only when on"
    want = runs[False]
    err = ((runs[True] - want).norm(dim=-1) / want.norm(dim=-1)).max().item()
    top2 = want.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) / want.norm(dim=-1) > BF16_MARGIN
    assert err <= BF16_BOUND
    assert clear.sum() >= len(ids) // 4
    assert torch.equal(runs[True].argmax(-1)[clear], want.argmax(-1)[clear])


def test_the_python_limits_are_the_kernels():
    """router's limits mirror cuda/moe/router.h (they exist without the extension; checked against it)."""
    ext = dispatch.cuda_ext()
    assert (router.ROUTER_MAX_TOKENS, router.ROUTER_MAX_K, router.ROUTER_MAX_EXPERTS) == (
        ext.ROUTER_MAX_TOKENS, ext.ROUTER_MAX_K, ext.ROUTER_MAX_EXPERTS)
    assert router.CUDA_ROUTER_MAX_TOKENS <= router.ROUTER_MAX_TOKENS
