"""The CUDA kernels of ``cuda/`` (the extension ``v41._cuda``) on a GPU, each against its PyTorch reference on
fresh random inputs with poisoned outputs (skipped without CUDA or without an extension built for the device; run
on the device machine by ``benches/gpu/cuda_gpu.sh``). The dispatch falling back without the extension is tested
on the CPU in ``tests/test_cuda_dispatch.py``."""

from __future__ import annotations

import pytest
import torch

from kernel_checks import packed, poison, rel
from v41.kernels import dispatch, linear, moe, moe_align, wstream
from v41.kernels.packed import PackedWeight, stack_experts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or not dispatch.cuda_runs_on(torch.device("cuda")),
                                reason="needs CUDA and v41._cuda built for this GPU (make cuda)")

DEV = "cuda"


def _gen():
    return torch.Generator().manual_seed(torch.seed() % (1 << 31))


def _random_codes(shape, fmt, g):
    """Every code of the format, NaN codes excluded (E4M3 0x7F / 0xFF), and scale bytes spread over 2^-20..2^4
    (including ones whose single-factor product would overflow bf16, handled by a second multiply)."""
    if fmt == "fp8":
        codes = torch.randint(0, 256, shape, generator=g, dtype=torch.int32)
        codes = torch.where((codes & 0x7F) == 0x7F, codes - 1, codes).to(torch.uint8)
        return codes.view(torch.float8_e4m3fn)
    return torch.randint(0, 256, (*shape[:-1], shape[-1] // 2), generator=g, dtype=torch.int32).to(torch.uint8)


# The largest scale byte whose factor is one bf16 multiply (cuda/common/dequant.cuh kOneFactorMax): batches of
# the kernel with only such bytes take the one-multiply conversion, others two multiplies.
ONE_FACTOR_MAX = {"mxfp4": 128, "fp8": 134}
# The kernel's register variants (cuda/linear/wstream.cu): single batches uncapped or capped for 5 CTAs per SM, and
# double-buffered batches of 2 chunks (taken by every expert launch here, whatever its grid; dense linears never
# take them).
VARIANTS = ["single", "five_ctas", "db2"]


def _variant(monkeypatch, variant):
    monkeypatch.setattr(wstream, "FIVE_CTAS", variant == "five_ctas")
    monkeypatch.setattr(wstream, "DOUBLE_BUFFER", 2 if variant == "db2" else 0)
    monkeypatch.setattr(wstream, "DOUBLE_BUFFER_CTAS_PER_SM", 1 << 20)


def _weight(fmt, n, k, g, block=(32, 32), experts=None, one_factor=False):
    """Random codes and scale bytes: spread over both conversions, or (one_factor) all up to ONE_FACTOR_MAX, as
    in checkpoints."""
    lead = () if experts is None else (experts,)
    data = _random_codes((*lead, n, k), fmt, g)
    if fmt == "fp8":
        sshape = (*lead, -(-n // block[0]), -(-k // block[1]))
    else:
        block, sshape = (1, 32), (*lead, n, k // 32)
    top = ONE_FACTOR_MAX[fmt] + (0 if one_factor else 3)
    scale = torch.randint(107, top + 1, sshape, generator=g, dtype=torch.int32).to(torch.uint8)
    edges = [0, 1, 127, top] if one_factor else [0, 1, 127, 128, 129, 134, 135]
    scale.view(-1)[:len(edges)] = torch.tensor(edges, dtype=torch.uint8)[: scale.numel()]
    return PackedWeight(data.to(DEV), scale.to(DEV), fmt, block).check()


@pytest.mark.parametrize("one_factor", [False, True])
@pytest.mark.parametrize("fmt,block", [("fp8", (32, 32)), ("fp8", (128, 128)), ("mxfp4", (1, 32))])
def test_every_weight_code_reaches_the_output_exactly(fmt, block, one_factor):
    """One-hot activations make each output one weight: the kernel's bf16 conversion (one multiply per word or,
    for scale bytes past ONE_FACTOR_MAX, two) and the K order of its fragments must reproduce the dequantized
    weight bit for bit."""
    g = _gen()
    n, k = 80, 256
    w = _weight(fmt, n, k, g, block, one_factor=one_factor)
    want = w.dequantize(torch.float32).T  # [k, n]
    m = wstream.MAX_ROWS
    for k0 in range(0, k, m):
        x = torch.zeros(m, k, dtype=torch.bfloat16, device=DEV)
        x[torch.arange(m), torch.arange(k0, k0 + m)] = 1
        poison(DEV)
        y = wstream.linear(x, w, torch.bfloat16)
        assert y is not None
        assert torch.equal(y.float(), want[k0:k0 + m].to(torch.bfloat16).float())


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("case", ["fp8-32", "fp8-128", "fp8-32-g8", "mxfp4"])
def test_linear_equals_its_reference(case, m):
    g = _gen()
    fmt = case.split("-")[0]
    block = (128, 128) if "128" in case else (32, 32)
    groups = 8 if case.endswith("g8") else 1
    n, k = (1024 + 16, 512 if fmt == "mxfp4" else 448) if groups == 1 else (8 * 48, 128)
    w = packed(torch.randn(n, k, generator=g) / k ** 0.5, fmt, block).to(DEV)
    x = torch.randn(m, k * groups, generator=g).to(DEV, torch.bfloat16)
    poison(DEV)
    y = wstream.linear(x, w, torch.bfloat16, groups)
    assert y is not None
    ref = linear.linear_ref(x.double(), w, torch.float64, groups)
    assert rel(y, ref) < 4e-3
    poison(DEV)
    assert torch.equal(linear.linear(x, w, torch.bfloat16, groups), y)  # the dispatch takes the CUDA path


@pytest.mark.parametrize("m", [1, 8, 24, 64])
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_long_rows_in_one_slice_and_several_row_groups(fmt, m, monkeypatch):
    """One K slice of 64 chunks per CTA (no split-K), so each warp runs 16 register batches; 24 and 64 rows take 3
    and 8 passes over the weight; the scale bytes are a view at an odd offset."""
    monkeypatch.setattr(wstream, "CTAS_PER_SM", 0)  # split = 1
    monkeypatch.setattr(wstream, "MAX_ROWS", 64)
    g = _gen()
    n, k = 80, 4096 if fmt == "fp8" else 8192
    w = packed(torch.randn(n, k, generator=g) / k ** 0.5, fmt).to(DEV)
    wide = torch.zeros(w.scale.shape[0], w.scale.shape[1] + 1, dtype=torch.uint8, device=DEV)
    wide[:, 1:] = w.scale
    w = PackedWeight(w.data, wide[:, 1:], fmt, w.block)  # scale rows start at an odd byte
    assert wstream._launch_shape(1, n, k, fmt, torch.device(DEV))[0] == 1
    x = torch.randn(m, k, generator=g).to(DEV, torch.bfloat16)
    poison(DEV)
    y = wstream.linear(x, w, torch.bfloat16)
    assert y is not None
    assert rel(y, linear.linear_ref(x.double(), w, torch.float64)) < 4e-3


@pytest.mark.parametrize("floor", [32 << 10, 64 << 10])
def test_a_slice_bytes_floor_keeps_the_results(floor, monkeypatch):
    """wstream.MIN_SLICE_BYTES only makes fewer, longer split-K slices: a small projection's result (V4.1's wkv shape
    at one and eight rows) stays within rounding of the reference, with fewer slices than without the floor."""
    g = _gen()
    w = packed(torch.randn(512, 5120, generator=g) / 72, "fp8").to(DEV)
    x = torch.randn(8, 5120, generator=g).to(DEV, torch.bfloat16)
    monkeypatch.setattr(wstream, "MIN_SLICE_BYTES", 0)
    before = wstream._launch_shape(1, 512, 5120, "fp8", torch.device(DEV))[0]
    monkeypatch.setattr(wstream, "MIN_SLICE_BYTES", floor)
    assert wstream._launch_shape(1, 512, 5120, "fp8", torch.device(DEV))[0] < before
    for m in (1, 8):
        poison(DEV)
        y = wstream.linear(x[:m], w, torch.bfloat16)
        assert y is not None and rel(y, linear.linear_ref(x[:m].double(), w, torch.float64)) < 4e-3


def test_linear_declines_what_it_does_not_take():
    g = _gen()
    w = packed(torch.randn(64, 256, generator=g), "fp8").to(DEV)
    x = torch.randn(wstream.MAX_ROWS + 1, 256, generator=g).to(DEV, torch.bfloat16)
    assert wstream.linear(x, w, torch.bfloat16) is None  # more than MAX_ROWS rows
    assert wstream.linear(x[:4].float(), w, torch.float32) is None  # float32
    w_odd = packed(torch.randn(64, 96, generator=g), "fp8").to(DEV)
    assert wstream.linear(x[:4, :96], w_odd, torch.bfloat16) is None  # K not a whole chunk
    w_48 = packed(torch.randn(64, 192, generator=g), "fp8", (32, 48)).to(DEV)
    assert wstream.linear(x[:4, :192], w_48, torch.bfloat16) is None  # scale blocks of 48 inputs


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("tokens,experts,top_k", [(1, 384, 6), (8, 384, 6), (64, 256, 6), (16, 8, 1)])
@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
def test_grouped_equals_its_reference(fmt, tokens, experts, top_k, variant, monkeypatch):
    """Sorted expert pairs with empty experts, one expert holding every token (several passes over its weight:
    more than 8 rows), gathered rows and pre-sorted rows, split K (few experts: 16 tokens over 8); in each of the
    kernel's register variants (K = 640: 5 MXFP4 / 10 FP8 chunks, so the double-buffered batches end part-full)."""
    _variant(monkeypatch, variant)
    g = _gen()
    n, k = 4608 // 16, 640
    w = stack_experts([packed(torch.randn(n, k, generator=g) / k ** 0.5, fmt) for _ in range(experts)]).to(DEV)
    ids = torch.randint(0, experts, (tokens, top_k), generator=g)
    if tokens > 8:
        ids[:, 0] = 3
        ids[:, 1:] = torch.where(ids[:, 1:] == 3, 4, ids[:, 1:])
    pairs = moe_align.route_pairs(ids.to(DEV), experts)
    x = torch.randn(tokens, k, generator=g).to(DEV, torch.bfloat16)
    for rows in (pairs.rows, None):
        xin = x if rows is not None else torch.randn(tokens * top_k, k, generator=g).to(DEV, torch.bfloat16)
        poison(DEV)
        y = wstream.grouped(xin, w, pairs.offsets, rows, pairs.active)
        assert y is not None
        ref = moe.grouped_linear_ref(xin.double(), w, pairs.offsets, rows)  # float64 on the GPU: seconds on the CPU
        assert rel(y, ref) < 4e-3, rows is None


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("one_factor", [False, True])
@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
def test_grouped_converts_every_code_and_scale(fmt, one_factor, variant, monkeypatch):
    """The expert path over every code of the format and scale bytes in the one-multiply range only or spread over
    both conversions (the sums compared to float64 ones from the dequantized weights)."""
    _variant(monkeypatch, variant)
    g = _gen()
    experts, n, k, tokens = 16, 64, 512, 8
    w = _weight(fmt, n, k, g, (32, 32), experts=experts, one_factor=one_factor)
    ids = torch.randint(0, experts, (tokens, 2), generator=g)
    pairs = moe_align.route_pairs(ids.to(DEV), experts)
    x = torch.randn(tokens, k, generator=g).to(DEV, torch.bfloat16)
    poison(DEV)
    y = wstream.grouped(x, w, pairs.offsets, pairs.rows, pairs.active)
    assert y is not None
    ref = moe.grouped_linear_ref(x.double(), w, pairs.offsets, pairs.rows)
    assert rel(y, ref) < 4e-3


def test_split_k_is_deterministic_and_graph_capturable():
    """Split-K partials are summed in slice order by the last CTA, which resets its counter: repeated calls and
    CUDA-graph replays with new inputs give bit-identical results to eager calls."""
    g = _gen()
    w = packed(torch.randn(128, 5120, generator=g) / 70, "fp8").to(DEV)
    x = torch.randn(2, 5120, generator=g).to(DEV, torch.bfloat16)
    assert wstream._launch_shape(1, 128, 5120, "fp8", x.device)[0] > 1
    first = wstream.linear(x, w, torch.bfloat16)
    for _ in range(3):
        assert torch.equal(wstream.linear(x, w, torch.bfloat16), first)
    static_x = x.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        wstream.linear(static_x, w, torch.bfloat16)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = wstream.linear(static_x, w, torch.bfloat16)
    for _ in range(3):
        fresh = torch.randn(2, 5120, generator=g).to(DEV, torch.bfloat16)
        static_x.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_y, wstream.linear(fresh, w, torch.bfloat16))
