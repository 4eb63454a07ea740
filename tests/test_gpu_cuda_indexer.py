"""The CUDA index scorer (cuda/indexer/index_scores.cu) against its PyTorch reference in float64
(``kernels/indexer.py`` index_scores_ref): bf16 key rows and MXFP4 key records, 16–64 heads, shuffled block tables
with unmapped blocks, visible counts from negative to past N, queries of one request and CTAs straddling requests
(contiguous and interleaved), entries per CTA from one pass to several, strided queries, block sizes that split
the kernel's 8-entry tiles, tables narrower than the entries, record scales over 2^-20 … 2^20, outputs poisoned
first, and CUDA-graph replay. Skips without CUDA or v41._cuda."""

from __future__ import annotations

import pytest
import torch

from kernel_checks import poison
from v41.cache.records import RecordFormat
from v41.kernels import dispatch, indexer

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and dispatch.cuda_runs_on(torch.device("cuda"))),
                                reason="needs a CUDA device and v41._cuda built for it")

RPB = 16  # entries per block of the index cache (the tests' default)
IDX = RecordFormat("idx_mxfp4", 128)


MIN_ENTRIES = indexer.CUDA_MIN_ENTRIES  # the dispatch's threshold as shipped


@pytest.fixture(autouse=True)
def cuda_scorer(monkeypatch):
    """The dispatch takes the CUDA scorer at every row length."""
    monkeypatch.setattr(indexer, "CUDA_SCORER", True)
    monkeypatch.setattr(indexer, "CUDA_MIN_ENTRIES", 0)


@pytest.mark.parametrize("longer", [False, True])
def test_the_dispatch_scores_short_rows_in_triton_and_long_rows_in_cuda(longer, monkeypatch):
    monkeypatch.setattr(indexer, "CUDA_MIN_ENTRIES", MIN_ENTRIES)
    g = torch.Generator(device="cuda").manual_seed(7)
    n = MIN_ENTRIES if longer else MIN_ENTRIES - 1
    q, w, keys, table, req, n_vis = _case(g, 4, 32, n, torch.zeros(4, dtype=torch.int64), True)
    calls = []
    real = indexer._scores_cuda
    monkeypatch.setattr(indexer, "_scores_cuda", lambda *a: calls.append(1) or real(*a))
    out = indexer.index_scores(q, w, keys, table, req, n_vis, RPB, n, record=IDX).double()
    assert len(calls) == int(longer)
    want = indexer.index_scores_ref(q.double(), w.double(), keys, table, req, n_vis, RPB, n, record=IDX)
    fin = torch.isfinite(want)
    assert torch.equal(fin, torch.isfinite(out))
    assert ((out[fin] - want[fin]).norm() / want[fin].norm()).item() < 1e-3


def _case(g, t, heads, n, req, records, q_pad=0, rpb=RPB, narrow=False):
    """Inputs for T queries of the requests ``req`` [T] over n_max = n entries (keys of every request in one cache,
    blocks shuffled, every fifth block of request 1 unmapped; ``narrow``: the table lacks the last block's column,
    so entries there read as unmapped). Key rows have a random power-of-two scale per 32 dims (2^-20 … 2^20)."""
    r = int(req.max()) + 1
    nb = -(-n // rpb)
    slots = (r * nb + 3) * rpb
    q_all = torch.randn(t, heads, 128 + q_pad, generator=g, device="cuda").to(torch.bfloat16)
    q = q_all[:, :, :128]  # q_pad > 0: a head stride other than 128
    w = torch.randn(t, heads, generator=g, device="cuda")
    scale = torch.exp2(torch.randint(-20, 21, (slots, 4, 1), generator=g, device="cuda").float())
    rows = (torch.randn(slots, 4, 32, generator=g, device="cuda") * scale).view(slots, 128)
    keys = IDX.encode(rows) if records else rows.to(torch.bfloat16)
    table = torch.randperm(slots // rpb, generator=g, device="cuda")[: r * nb].view(r, nb)
    if r > 1:
        table[1, ::5] = -1
    if narrow and nb > 1:
        table = table[:, : nb - 1]
    n_vis = torch.randint(-2, n + 40, (t,), generator=g, device="cuda")
    n_vis[0] = n
    return q, w, keys, table, req.cuda(), n_vis


def _check(q, w, keys, table, req, n_vis, n, records, qb=None, entries=None, rpb=RPB):
    """The kernel's scores (launch shape ``qb`` / ``entries``, or the wrapper's) against the float64 reference:
    −inf exactly where the reference has it, relative L2 below 1e-4 elsewhere."""
    fmt = IDX if records else None
    if qb is None:
        poison("cuda")
        out = indexer._scores_cuda(q, w, keys, table, req, n_vis, rpb, n, fmt)
        assert out is not None, "the wrapper declined operands the kernel takes"
        assert torch.equal(indexer.index_scores(q, w, keys, table, req, n_vis, rpb, n, record=fmt), out)
    else:
        out = torch.full((q.shape[0], n), float("nan"), device="cuda")
        dispatch.cuda_ext().index_scores(q, w, keys, table, req, n_vis, out, rpb, int(records), qb, entries)
    want = indexer.index_scores_ref(q.double(), w.double(), keys if records else keys.double(), table, req, n_vis,
                                    rpb, n, record=fmt)
    got = out.double()
    fin = torch.isfinite(want)
    assert torch.equal(fin, torch.isfinite(got)), "finite entries differ"
    assert torch.equal(got[~fin], want[~fin]), "masked entries must be -inf"
    err = ((got[fin] - want[fin]).norm() / want[fin].norm().clamp(min=1e-30)).item()
    assert err < 1e-4, err


@pytest.mark.parametrize("records", [False, True], ids=["bf16", "mxfp4"])
@pytest.mark.parametrize("heads", [16, 32, 48, 64])
@pytest.mark.parametrize("t,n,rpb,narrow", [(1, 5, 16, False), (3, 100, 12, True), (5, 1000, 1, False),
                                            (2, 70001, 48, True)])
def test_decode_steps_match_the_reference(records, heads, t, n, rpb, narrow):
    g = torch.Generator(device="cuda").manual_seed(heads * 1009 + t * 31 + n)
    inputs = _case(g, t, heads, n, torch.arange(t), records, rpb=rpb, narrow=narrow)
    _check(*inputs, n, records, rpb=rpb)


@pytest.mark.parametrize("records", [False, True], ids=["bf16", "mxfp4"])
@pytest.mark.parametrize("heads", [32, 48, 64])
@pytest.mark.parametrize("layout", ["one request", "contiguous", "interleaved"])
def test_query_blocks_match_the_reference(records, heads, layout):
    """Prefill-sized steps: 8 (4 at 64 heads) queries per CTA; CTAs within one request, straddling requests of
    consecutive tokens, and straddling several requests at once."""
    t, n = 61, 3000
    req = {"one request": torch.zeros(t, dtype=torch.int64),
           "contiguous": torch.tensor([0] * 20 + [1] * 13 + [2] * 28),
           "interleaved": torch.arange(t) % 3}[layout]
    g = torch.Generator(device="cuda").manual_seed(t + heads + len(layout))
    inputs = _case(g, t, heads, n, req, records)
    _check(*inputs, n, records)
    for qb, entries in ((1, 128), (3, 256), (16 if heads == 32 else 4, 640)):  # 16 × 32 heads: 128 KB, opt-in
        _check(*inputs, n, records, qb=qb, entries=entries)


def test_strided_queries_and_graph_replay():
    g = torch.Generator(device="cuda").manual_seed(5)
    t, n = 4, 4096
    q, w, keys, table, req, n_vis = _case(g, t, 32, n, torch.arange(t), True, q_pad=64)
    assert q.stride(1) == 192
    _check(q, w, keys, table, req, n_vis, n, True)
    static_q = q.clone()
    call = lambda: indexer.index_scores(static_q, w, keys, table, req, n_vis, RPB, n, record=IDX)
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for seed in (1, 2):
        static_q.copy_(torch.randn(q.shape, generator=g, device="cuda").to(torch.bfloat16))
        graph.replay()
        want = indexer.index_scores_ref(static_q.double(), w.double(), keys, table, req, n_vis, RPB, n, record=IDX)
        fin = torch.isfinite(want)
        assert torch.equal(fin, torch.isfinite(out))
        assert ((out.double()[fin] - want[fin]).norm() / want[fin].norm()).item() < 1e-4


def test_operands_the_kernel_does_not_take():
    """The wrapper declines (the Triton kernel runs) what the kernel does not read; the binding raises on launch
    shapes it cannot take."""
    g = torch.Generator(device="cuda").manual_seed(9)
    q, w, keys, table, req, n_vis = _case(g, 2, 20, 300, torch.arange(2), False)  # 20 heads: not a multiple of 16
    assert indexer._scores_cuda(q, w, keys, table, req, n_vis, RPB, 300, None) is None
    got = indexer.index_scores(q, w, keys, table, req, n_vis, RPB, 300)  # the public function still answers (Triton)
    want = indexer.index_scores_ref(q.double(), w.double(), keys.double(), table, req, n_vis, RPB, 300)
    fin = torch.isfinite(want)
    assert torch.equal(fin, torch.isfinite(got))
    assert ((got.double()[fin] - want[fin]).norm() / want[fin].norm()).item() < 1e-2
    q, w, keys, table, req, n_vis = _case(g, 2, 32, 300, torch.arange(2), False)
    out = torch.empty(2, 300, device="cuda")
    with pytest.raises(RuntimeError, match="entries_per_cta"):
        dispatch.cuda_ext().index_scores(q, w, keys, table, req, n_vis, out, RPB, 0, 1, 100)
    with pytest.raises(RuntimeError, match="fmt"):
        dispatch.cuda_ext().index_scores(q, w, keys, table, req, n_vis, out, RPB, 2, 1, 128)
