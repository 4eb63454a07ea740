"""Tests for v41.quant (docs/model.md §2 numerical conventions / activation quantization, §5
checkpoint dtypes; docs/known-failures.md KF-21).

Expected values come from independent slow references written here: powers of two from plain Python
floats, an E2M1 table and nibble loops for MXFP4, and a round-to-nearest-even over explicitly enumerated
E4M3 / E2M1 grids for the quantize-dequantize helpers.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from v41 import quant as Q

KF21_BYTES = [0, 120, 127, 130, 254]

# --------------------------------------------------------------------------------------------------
# independent references
# --------------------------------------------------------------------------------------------------

# FP4 E2M1: sign bit 3, magnitude index bits 0-2
E2M1_TABLE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
# (value, mantissa bit is 0) for non-negative E2M1 values
E2M1_GRID = [(v, i % 2 == 0) for i, v in enumerate(E2M1_TABLE)]


def _e4m3_grid() -> list[tuple[float, bool]]:
    """All non-negative finite float8_e4m3fn values from the format definition (bias 7, no inf,
    S.1111.111 = NaN), each with 'mantissa lsb is 0'."""
    out = []
    for e in range(16):
        for m in range(8):
            if e == 15 and m == 7:
                continue  # NaN
            v = (m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
            out.append((v, m % 2 == 0))
    return out


E4M3_GRID = _e4m3_grid()
E4M3_VALUES = {v for v, _ in E4M3_GRID}
E2M1_VALUES = {v for v, _ in E2M1_GRID}


def ref_round(v: float, grid: list[tuple[float, bool]]) -> float:
    """Round to the nearest grid value, ties to the even mantissa, saturating at the grid maximum."""
    a = abs(v)
    top = grid[-1][0]
    if a >= top:
        r = top
    else:
        best = min(abs(a - g) for g, _ in grid)
        cands = [(g, even) for g, even in grid if abs(a - g) == best]
        r = cands[0][0] if len(cands) == 1 else next(g for g, even in cands if even)
    return math.copysign(r, v)


def ref_pow2_ceil(q: float) -> float:
    """Smallest power of two >= q (q > 0), by definition."""
    k = 0
    while 2.0**k < q:
        k += 1
    while 2.0 ** (k - 1) >= q:
        k -= 1
    return 2.0**k


def f32(v) -> float:
    return float(np.float32(v))


def f32_div(a: float, b: float) -> float:
    return float(np.float32(a) / np.float32(b))


def ref_blocks(row: list[float], block: int):
    for start in range(0, len(row), block):
        yield start, row[start : start + block]


def ref_fp8_act_qdq(x: torch.Tensor, block: int) -> np.ndarray:
    rows = x.to(torch.float32).reshape(-1, x.shape[-1]).tolist()
    out = np.zeros((len(rows), x.shape[-1]), dtype=np.float64)
    for r, row in enumerate(rows):
        for start, blk in ref_blocks(row, block):
            amax = max(abs(v) for v in blk)
            s = ref_pow2_ceil(max(f32_div(amax, 448.0), f32(1e-4)))
            for j, v in enumerate(blk):
                out[r, start + j] = ref_round(v / s, E4M3_GRID) * s
    return out.reshape(tuple(x.shape))


def ref_fp4_e4m3_scale(amax: float) -> float:
    return ref_round(min(max(f32_div(amax, 6.0), 2.0**-9), 448.0), E4M3_GRID)


def ref_fp4_e4m3_qdq(x: torch.Tensor, block: int) -> np.ndarray:
    rows = x.to(torch.float32).reshape(-1, x.shape[-1]).tolist()
    out = np.zeros((len(rows), x.shape[-1]), dtype=np.float64)
    for r, row in enumerate(rows):
        for start, blk in ref_blocks(row, block):
            s = ref_fp4_e4m3_scale(max(abs(v) for v in blk))
            for j, v in enumerate(blk):
                out[r, start + j] = ref_round(f32_div(v, s), E2M1_GRID) * s
    return out.reshape(tuple(x.shape))


def ref_mxfp4_scale(amax: float) -> float:
    return ref_pow2_ceil(f32_div(max(amax, f32(1e-30)), 6.0))


def ref_mxfp4_qdq(x: torch.Tensor, block: int) -> np.ndarray:
    rows = x.to(torch.float32).reshape(-1, x.shape[-1]).tolist()
    out = np.zeros((len(rows), x.shape[-1]), dtype=np.float64)
    for r, row in enumerate(rows):
        for start, blk in ref_blocks(row, block):
            s = ref_mxfp4_scale(max(abs(v) for v in blk))
            for j, v in enumerate(blk):
                out[r, start + j] = ref_round(v / s, E2M1_GRID) * s
    return out.reshape(tuple(x.shape))


def ref_dequant_mxfp4(packed: list[list[int]], scale_bytes: list[list[int]]) -> list[list[float]]:
    """Explicit nibble loops: element 2k = low nibble of byte k, 2k+1 = high nibble."""
    out = []
    for prow, srow in zip(packed, scale_bytes):
        row = []
        for k, byte in enumerate(prow):
            byte &= 0xFF  # int8 -> raw byte
            for idx, nib in ((2 * k, byte & 0x0F), (2 * k + 1, (byte >> 4) & 0x0F)):
                mag = E2M1_TABLE[nib & 0x7]
                val = -mag if nib & 0x8 else mag
                row.append(val * 2.0 ** (srow[idx // 32] - 127))
        out.append(row)
    return out


def rand_fp8(rng: np.random.Generator, shape) -> torch.Tensor:
    """Random finite float8_e4m3fn (all byte patterns except the two NaNs 0x7F / 0xFF)."""
    b = rng.integers(0, 256, size=shape, dtype=np.uint8)
    b[(b & 0x7F) == 0x7F] = 0x7E
    return torch.from_numpy(b).view(torch.float8_e4m3fn)


def rand_e8m0(rng: np.random.Generator, shape, lo=100, hi=154) -> torch.Tensor:
    return torch.from_numpy(rng.integers(lo, hi + 1, size=shape, dtype=np.uint8)).view(torch.float8_e8m0fnu)


def exact_equal(a: torch.Tensor, b) -> bool:
    return np.array_equal(a.to(torch.float64).numpy(), np.asarray(b, dtype=np.float64))


# --------------------------------------------------------------------------------------------------
# E8M0
# --------------------------------------------------------------------------------------------------


def test_e4m3_grid_reference_agrees_with_torch():
    """Sanity check of the test's own E4M3 table (used by the rounding references)."""
    vals = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float64).tolist()
    assert sorted(vals) == sorted(E4M3_VALUES)


@pytest.mark.parametrize("as_uint8", [True, False])
def test_e8m0_to_float_all_bytes(as_uint8):
    raw = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    scale = raw if as_uint8 else raw.view(torch.float8_e8m0fnu)
    got = Q.e8m0_to_float(scale)
    assert got.dtype == torch.float32 and got.shape == (256,)
    vals = got.tolist()
    for b in range(255):
        assert vals[b] == 2.0 ** (b - 127), b
    assert math.isnan(vals[255])
    # 2-D shape preserved
    assert Q.e8m0_to_float(scale[:250].reshape(10, 25)).shape == (10, 25)


def test_e8m0_to_float_rejects_value_dtypes():
    with pytest.raises(TypeError):
        Q.e8m0_to_float(torch.tensor([127.0]))
    with pytest.raises(TypeError):
        Q.e8m0_to_float(torch.tensor([127], dtype=torch.int32))


def test_float_to_e8m0_roundtrip_and_rejects_non_powers():
    pows = torch.tensor([2.0 ** (b - 127) for b in range(255)], dtype=torch.float64)
    for dtype in (torch.float64, torch.float32):
        enc = Q.float_to_e8m0(pows.to(dtype))
        assert enc.dtype == torch.float8_e8m0fnu
        assert enc.view(torch.uint8).tolist() == list(range(255))
    assert Q.float_to_e8m0(torch.tensor([float("nan")])).view(torch.uint8).tolist() == [255]
    for bad in (3.0, 0.0, -1.0, 2.0**-128, 2.0**128, float("inf"), 1.0 + 2.0**-40):
        with pytest.raises(ValueError):
            Q.float_to_e8m0(torch.tensor([bad], dtype=torch.float64))


# --------------------------------------------------------------------------------------------------
# KF-21
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale_as_uint8", [True, False])
def test_kf21_scale_bytes_decode_as_powers_of_two(scale_as_uint8):
    """KF-21: E8M0 bytes {0, 120, 127, 130, 254} decode to 2^(b-127) on every weight path: the scale
    decoder, FP8 dense dequant (32x32 and 128x128, full and partial tiles), MXFP4 expert dequant, and the
    dequantized BF16 fallback."""
    expected = [2.0 ** (b - 127) for b in KF21_BYTES]
    raw = torch.tensor(KF21_BYTES, dtype=torch.uint8)

    def as_scale(t: torch.Tensor) -> torch.Tensor:
        return t if scale_as_uint8 else t.view(torch.float8_e8m0fnu)

    # scale decoder
    dec = Q.e8m0_to_float(as_scale(raw)).tolist()
    assert dec == expected
    assert dec[2] == 1.0 and dec[3] == 8.0  # bytes are exponents, not the values 127.0 / 130.0

    # FP8 dense: one tile row per byte, weight = 1.0 (and -1.5) everywhere
    fp8_cases = (
        ((32, 32), (160, 64)),
        ((32, 32), (150, 40)),
        ((128, 128), (640, 128)),
        ((128, 128), (600, 70)),
    )
    for block, shape in fp8_cases:
        b0, b1 = block
        n1 = -(-shape[1] // b1)
        scale = as_scale(raw[:, None].expand(5, n1).contiguous())
        for v in (1.0, -1.5):
            w = torch.full(shape, v).to(torch.float8_e4m3fn)
            out = Q.dequant_fp8_block(w, scale, block)
            assert out.dtype == torch.float32 and out.shape == shape
            rows = torch.arange(shape[0]) // b0
            want = torch.tensor([v * expected[r] for r in rows.tolist()], dtype=torch.float64)[:, None]
            assert torch.equal(out.to(torch.float64), want.expand(shape)), (block, shape, v)
            # dequantized fallback (BF16 weights): still exact powers of two, incl. the bf16 subnormal 2^-127
            assert torch.equal(out.to(torch.bfloat16).to(torch.float64), want.expand(shape))

    # MXFP4 experts: byte 0x22 = (1.0, 1.0); rows = scale bytes; int8 (checkpoint I8) and uint8
    for pdtype in (torch.int8, torch.uint8):
        packed = torch.full((5, 32), 0x22, dtype=torch.uint8).view(pdtype)  # in = 64 -> 2 scales / row
        scale = as_scale(raw[:, None].expand(5, 2).contiguous())
        out = Q.dequant_mxfp4(packed, scale)
        assert out.shape == (5, 64) and out.dtype == torch.float32
        want = torch.tensor(expected, dtype=torch.float64)[:, None].expand(5, 64)
        assert torch.equal(out.to(torch.float64), want)
        assert torch.equal(out.to(torch.bfloat16).to(torch.float64), want)


# --------------------------------------------------------------------------------------------------
# FP8 block dequant / quant
# --------------------------------------------------------------------------------------------------

FP8_CASES = [
    ((64, 96), (32, 32)),
    ((256, 384), (128, 128)),
    ((70, 100), (32, 32)),  # partial edge tiles on both dims
    ((200, 130), (128, 128)),
    ((5, 7), (32, 32)),  # smaller than one tile
    ((33, 65), (16, 8)),
]


@pytest.mark.parametrize("shape,block", FP8_CASES)
@pytest.mark.parametrize("scale_as_uint8", [True, False])
def test_fp8_dequant_matches_independent_decode(shape, block, scale_as_uint8):
    rng = np.random.default_rng(hash((shape, block)) % 2**32)
    b0, b1 = block
    grid = (-(-shape[0] // b0), -(-shape[1] // b1))
    w = rand_fp8(rng, shape)
    sbytes = rng.integers(0, 241, size=grid, dtype=np.uint8)  # <= 240: 448 * 2^113 stays finite in f32
    scale = torch.from_numpy(sbytes)
    if not scale_as_uint8:
        scale = scale.view(torch.float8_e8m0fnu)
    got = Q.dequant_fp8_block(w, scale, block)
    assert got.dtype == torch.float32 and got.shape == shape
    pow2 = np.array([[2.0 ** (int(b) - 127) for b in row] for row in sbytes], dtype=np.float64)
    rows = np.arange(shape[0])[:, None] // b0
    cols = np.arange(shape[1])[None, :] // b1
    want = w.to(torch.float32).numpy().astype(np.float64) * pow2[rows, cols]
    assert np.array_equal(got.numpy().astype(np.float64), want)


def test_fp8_dequant_validates_shapes_and_dtypes():
    w = torch.zeros(70, 100).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"expected shape \(3, 4\), got \(2, 3\)"):
        Q.dequant_fp8_block(w, torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"expected shape \(1, 1\), got \(3, 4\)"):
        Q.dequant_fp8_block(w, torch.zeros(3, 4, dtype=torch.uint8), (128, 128))
    with pytest.raises(ValueError):
        Q.dequant_fp8_block(w.reshape(7000), torch.zeros(3, 4, dtype=torch.uint8))
    with pytest.raises(TypeError):
        Q.dequant_fp8_block(torch.zeros(70, 100), torch.zeros(3, 4, dtype=torch.uint8))
    with pytest.raises(TypeError):
        Q.dequant_fp8_block(w, torch.zeros(3, 4))  # float scale: not E8M0 bytes
    with pytest.raises(ValueError):
        Q.dequant_fp8_block(w, torch.zeros(3, 4, dtype=torch.uint8), (0, 32))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    out=st.integers(1, 80),
    inn=st.integers(1, 80),
    block=st.sampled_from([(32, 32), (128, 128), (16, 8), (1, 32)]),
    seed=st.integers(0, 2**32 - 1),
    zero_tile=st.booleans(),
)
def test_fp8_quant_roundtrip_exact_for_representable(out, inn, block, seed, zero_tile):
    """dequant(q, s) values are re-encoded exactly: quant(dequant(q, s)) dequantizes to the same
    tensor, and the new per-tile scale never exceeds the old one."""
    rng = np.random.default_rng(seed)
    b0, b1 = block
    grid = (-(-out // b0), -(-inn // b1))
    w = Q.dequant_fp8_block(rand_fp8(rng, (out, inn)), rand_e8m0(rng, grid), block)
    if zero_tile:
        w[:b0, :b1] = 0.0
    q2, s2 = Q.quant_fp8_block(w, block)
    assert q2.dtype == torch.float8_e4m3fn and q2.shape == (out, inn)
    assert s2.dtype == torch.float8_e8m0fnu and s2.shape == grid
    back = Q.dequant_fp8_block(q2, s2, block)
    assert torch.equal(back, w)
    for dtype in (torch.float64, torch.bfloat16):  # other input dtypes (bf16 holds e4m3 * 2^k exactly)
        q3, s3 = Q.quant_fp8_block(w.to(dtype), block)
        assert torch.equal(Q.dequant_fp8_block(q3, s3, block), w)


@pytest.mark.parametrize("shape,block", FP8_CASES)
def test_fp8_quant_error_bounded_per_tile(shape, block):
    torch.manual_seed(0)
    b0, b1 = block
    w = torch.randn(shape) * torch.exp(torch.randn(shape[0], 1) * 3)  # rows of very different magnitude
    w[0, :] = 0.0
    q, s = Q.quant_fp8_block(w, block)
    sf = Q.e8m0_to_float(s)
    err = (Q.dequant_fp8_block(q, s, block) - w).abs()
    assert not torch.isnan(err).any()
    for i in range(sf.shape[0]):
        for j in range(sf.shape[1]):
            tw = w[i * b0 : (i + 1) * b0, j * b1 : (j + 1) * b1]
            te = err[i * b0 : (i + 1) * b0, j * b1 : (j + 1) * b1]
            amax = tw.abs().max().item()
            scale = sf[i, j].item()
            assert scale == ref_pow2_ceil(f32_div(max(amax, f32(1e-30)), 448.0))
            assert te.max().item() <= amax / 16  # E4M3: 3 mantissa bits -> half-ulp <= 2^-4 relative
            # element-wise: relative 2^-4 in the normal range, half the subnormal spacing below it
            assert bool((te <= torch.maximum(tw.abs() / 16, torch.tensor(scale * 2.0**-10))).all())


def test_fp8_quant_all_zero_and_rejects_bad_input():
    q, s = Q.quant_fp8_block(torch.zeros(40, 40))
    assert torch.equal(Q.dequant_fp8_block(q, s), torch.zeros(40, 40))
    with pytest.raises(ValueError):
        Q.quant_fp8_block(torch.tensor([[float("inf"), 1.0]]))
    with pytest.raises(ValueError):
        Q.quant_fp8_block(torch.zeros(4))
    with pytest.raises(TypeError):
        Q.quant_fp8_block(torch.zeros(4, 4, dtype=torch.int32))


# --------------------------------------------------------------------------------------------------
# MXFP4
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pdtype", [torch.int8, torch.uint8])
@pytest.mark.parametrize("scale_as_uint8", [True, False])
def test_mxfp4_decode_matches_independent_decode(pdtype, scale_as_uint8):
    rng = np.random.default_rng(7)
    praw = rng.integers(0, 256, size=(3, 48), dtype=np.uint8)  # in = 96 -> 3 scales per row
    sraw = rng.integers(100, 155, size=(3, 3), dtype=np.uint8)
    packed = torch.from_numpy(praw).view(pdtype)
    scale = torch.from_numpy(sraw) if scale_as_uint8 else torch.from_numpy(sraw).view(torch.float8_e8m0fnu)
    got = Q.dequant_mxfp4(packed, scale)
    assert got.dtype == torch.float32 and got.shape == (3, 96)
    want = ref_dequant_mxfp4(packed.tolist(), sraw.tolist())  # int8 values go through `& 0xFF`
    assert exact_equal(got, want)
    # leading expert dim
    got3 = Q.dequant_mxfp4(packed[None].expand(2, 3, 48), scale[None].expand(2, 3, 3))
    assert got3.shape == (2, 3, 96) and torch.equal(got3[1], got)


def test_mxfp4_nibble_order():
    """Element 2k is the LOW nibble, 2k+1 the HIGH nibble (vLLM: even channel in the low nibble)."""
    packed = torch.tensor([[0x21] * 16], dtype=torch.uint8)
    out = Q.dequant_mxfp4(packed, torch.tensor([[127]], dtype=torch.uint8))
    assert out[0, :2].tolist() == [0.5, 1.0]
    assert out[0].tolist() == [0.5, 1.0] * 16
    out = Q.dequant_mxfp4(packed, torch.tensor([[128]], dtype=torch.uint8))  # scale 2
    assert out[0, :2].tolist() == [1.0, 2.0]
    hand = torch.tensor([[0x9F, 0x70, 0x08, 0xC3] + [0] * 12], dtype=torch.uint8).view(torch.int8)
    out = Q.dequant_mxfp4(hand, torch.tensor([[127]], dtype=torch.uint8))
    assert out[0, :8].tolist() == [-6.0, -0.5, 0.0, 6.0, -0.0, 0.0, 1.5, -2.0]
    # the encoder packs the same way: [6, -0.5] -> codes 7 (low), 9 (high) -> byte 0x97
    packed, scale = Q.quant_mxfp4(torch.tensor([[6.0, -0.5] * 16]))
    assert packed.dtype == torch.int8 and packed.shape == (1, 16)
    assert packed.view(torch.uint8).tolist() == [[0x97] * 16]
    assert scale.view(torch.uint8).tolist() == [[127]]


def test_mxfp4_shape_validation():
    with pytest.raises(ValueError, match=r"expected shape \(4, 2\), got \(4, 3\)"):
        Q.dequant_mxfp4(torch.zeros(4, 32, dtype=torch.int8), torch.zeros(4, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple of 32"):
        Q.quant_mxfp4(torch.zeros(4, 48))
    with pytest.raises(TypeError):
        Q.dequant_mxfp4(torch.zeros(4, 32, dtype=torch.int16), torch.zeros(4, 2, dtype=torch.uint8))
    with pytest.raises(ValueError):
        Q.quant_mxfp4(torch.tensor([[float("nan")] * 32]))


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 6),
    nblk=st.integers(1, 4),
    seed=st.integers(0, 2**32 - 1),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
)
def test_mxfp4_quant_roundtrip_exact_for_representable(rows, nblk, seed, dtype):
    rng = np.random.default_rng(seed)
    praw = torch.from_numpy(rng.integers(0, 256, size=(rows, nblk * 16), dtype=np.uint8))
    w = Q.dequant_mxfp4(praw.view(torch.int8), rand_e8m0(rng, (rows, nblk)))
    packed, scale = Q.quant_mxfp4(w.to(dtype))
    assert packed.dtype == torch.int8 and packed.shape == (rows, nblk * 16)
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (rows, nblk)
    assert torch.equal(Q.dequant_mxfp4(packed, scale), w)


def test_mxfp4_quant_matches_reference_and_error_bounded():
    torch.manual_seed(1)
    w = torch.randn(8, 128) * torch.exp(torch.randn(8, 1) * 3)
    w[0, :32] = 0.0
    packed, scale = Q.quant_mxfp4(w)
    deq = Q.dequant_mxfp4(packed, scale)
    assert exact_equal(deq, ref_mxfp4_qdq(w, 32))  # same as the index-FP4 qdq formula
    sf = Q.e8m0_to_float(scale)
    err = (deq - w).abs()
    for r in range(8):
        for b in range(4):
            tw, te, s = w[r, 32 * b : 32 * b + 32], err[r, 32 * b : 32 * b + 32], sf[r, b].item()
            assert te.max().item() <= tw.abs().max().item() / 4
            assert bool((te <= torch.clamp_min(tw.abs() / 4, s / 4)).all())


def test_e2m1_rounding_ties_to_even():
    # midpoints between E2M1 neighbours go to the even-mantissa code
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    x = torch.tensor([[6.0] + mids + [-m for m in mids] + [0.0] * 17])
    packed, scale = Q.quant_mxfp4(x)
    assert scale.view(torch.uint8).tolist() == [[127]]  # amax 6 -> scale 1
    got = Q.dequant_mxfp4(packed, scale)[0, :15].tolist()
    assert got == [6.0] + want + [-v for v in want]
    assert [ref_round(v, E2M1_GRID) for v in x[0, :15].tolist()] == got
    # also through the qdq helpers (scale 1 when amax = 6)
    assert Q.mxfp4_qdq(x)[0, :15].tolist() == got
    assert Q.fp4_e4m3_qdq(x[:, :16])[0, :8].tolist() == got[:8]


# --------------------------------------------------------------------------------------------------
# quantize-dequantize helpers
# --------------------------------------------------------------------------------------------------

QDQ = [
    (Q.fp8_act_qdq, 32, ref_fp8_act_qdq),
    (Q.fp4_e4m3_qdq, 16, ref_fp4_e4m3_qdq),
    (Q.mxfp4_qdq, 32, ref_mxfp4_qdq),
]
QDQ_IDS = ["fp8_act", "fp4_e4m3", "mxfp4"]


def _mixed_input(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(*shape[:-1], 1, generator=g) * 4)
    x.view(-1, shape[-1])[0, : min(40, shape[-1])] = 0.0  # all-zero blocks
    return x


@pytest.mark.parametrize("fn,block,ref", QDQ, ids=QDQ_IDS)
@pytest.mark.parametrize("shape", [(4, 64), (3, 70), (2, 3, 512), (5, 7)])
def test_qdq_matches_independent_reference(fn, block, ref, shape):
    x = _mixed_input(shape)
    y = fn(x)
    assert y.dtype == torch.float32 and y.shape == x.shape
    assert exact_equal(y, ref(x, block))


@pytest.mark.parametrize("fn,block,ref", QDQ, ids=QDQ_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_qdq_preserves_shape_dtype_and_zero_blocks(fn, block, ref, dtype):
    x = _mixed_input((3, 5, 96), seed=3).to(dtype)
    x[1, 2] = 0.0
    y = fn(x)
    assert y.dtype == dtype and y.shape == x.shape
    assert not torch.isnan(y).any()
    assert torch.equal(y[1, 2], torch.zeros(96, dtype=dtype))
    # results are the reference values exactly, in every dtype
    assert exact_equal(y, ref(x, block))
    z = fn(torch.zeros(2, 33, dtype=dtype))
    assert torch.equal(z, torch.zeros(2, 33, dtype=dtype))
    assert fn(torch.zeros(0, 64, dtype=dtype)).shape == (0, 64)


@pytest.mark.parametrize("fn,block,ref", QDQ, ids=QDQ_IDS)
def test_qdq_values_on_representable_grid(fn, block, ref):
    """y / scale is an element of the format's grid, with the scale of the format."""
    x = _mixed_input((6, 64), seed=5)
    y = fn(x).to(torch.float64).tolist()
    for r, row in enumerate(x.tolist()):
        for start, blk in ref_blocks(row, block):
            amax = max(abs(v) for v in blk)
            if fn is Q.fp8_act_qdq:
                s, grid = ref_pow2_ceil(max(f32_div(amax, 448.0), f32(1e-4))), E4M3_VALUES
            elif fn is Q.fp4_e4m3_qdq:
                s, grid = ref_fp4_e4m3_scale(amax), E2M1_VALUES
                assert s in E4M3_VALUES
            else:
                s, grid = ref_mxfp4_scale(amax), E2M1_VALUES
            for v in y[r][start : start + block]:
                assert abs(v) / s in grid


_F32_1E30 = float(np.float32(1e30))
finite_f32 = st.floats(-_F32_1E30, _F32_1E30, allow_nan=False, allow_infinity=False, width=32)


@st.composite
def qdq_inputs(draw):
    rows = draw(st.integers(1, 3))
    n = draw(st.integers(1, 80))
    mag = draw(st.sampled_from([1e-12, 1e-6, 1e-3, 0.05, 1.0, 100.0, 1e6, 1e20]))
    arr = draw(hnp.arrays(np.float32, (rows, n), elements=st.floats(-1, 1, width=32)))
    spikes = draw(hnp.arrays(np.float32, (rows, n), elements=st.sampled_from([0.0, 0.0, 0.0, 1.0])))
    big = draw(finite_f32)
    x = torch.from_numpy(arr * np.float32(mag) + spikes * np.float32(big))
    return x.to(draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16])))


@settings(max_examples=150, deadline=None)
@given(x=qdq_inputs())
def test_qdq_idempotent_property(x):
    for fn in (Q.fp8_act_qdq, Q.mxfp4_qdq):
        y = fn(x)
        assert y.dtype == x.dtype and y.shape == x.shape
        assert not torch.isnan(y).any()
        assert torch.equal(fn(y), y), fn.__name__
    # fp4_e4m3_qdq: idempotent wherever the block's E4M3 scale is normal or clamped at 2^-9
    y = Q.fp4_e4m3_qdq(x)
    assert y.dtype == x.dtype and y.shape == x.shape and not torch.isnan(y).any()
    z = Q.fp4_e4m3_qdq(y)
    n = x.shape[-1]
    pad = (-n) % 16
    amax = torch.nn.functional.pad(x.float().abs(), (0, pad)).reshape(x.shape[0], -1, 16).amax(-1)
    ok_blocks = (amax >= 6 * 2.0**-6) | (amax <= 6 * 2.0**-9)
    mask = ok_blocks.repeat_interleave(16, dim=-1)[:, :n]
    assert torch.equal(z[mask], y[mask])


def test_fp4_e4m3_qdq_subnormal_scale_is_not_idempotent():
    """Documented property of the compressed-KV format (not a bug of the helper): with a subnormal E4M3
    scale the rounding of the scale can flip between passes. amax = 9*2^-9: scale e4m3(1.5*2^-9) = 2^-8
    (tie to even), 4.5 -> 4 (tie to even) -> 2^-6; second pass: scale e4m3(2^-6/6) = 2^-9, 8 saturates
    to 6 -> 6*2^-9."""
    x = torch.zeros(1, 16)
    x[0, 0] = 9 * 2.0**-9
    y = Q.fp4_e4m3_qdq(x)
    assert y[0, 0].item() == 2.0**-6
    assert Q.fp4_e4m3_qdq(y)[0, 0].item() == 6 * 2.0**-9
    assert exact_equal(y, ref_fp4_e4m3_qdq(x, 16))


def test_fp8_act_qdq_scale_floor_and_clamps():
    # amax/448 below 1e-4 -> scale 2^-13 (vLLM SWA formula), tiny values flush to zero
    x = torch.tensor([[1e-3, 2.0**-23, 2.0**-22 * 1.5] + [0.0] * 29])
    y = Q.fp8_act_qdq(x)
    s = 2.0**-13
    assert y[0, :3].tolist() == [ref_round(1e-3 / s, E4M3_GRID) * s, 0.0, 2.0**-22 * 2]
    # compressed-KV scale clamp at 448: values beyond 6*448 saturate
    z = Q.fp4_e4m3_qdq(torch.tensor([[1e5, -3000.0] + [0.0] * 14]))
    assert z[0, :2].tolist() == [6 * 448.0, -6 * 448.0]


def test_qdq_rejects_bad_input():
    for fn in (Q.fp8_act_qdq, Q.fp4_e4m3_qdq, Q.mxfp4_qdq):
        with pytest.raises(TypeError):
            fn(torch.zeros(4, 32, dtype=torch.int32))
        with pytest.raises(ValueError):
            fn(torch.zeros(4, 32), block=0)
        with pytest.raises(ValueError):
            fn(torch.tensor(1.0))


# --------------------------------------------------------------------------------------------------
# device parity (runs where CUDA is available)
# --------------------------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    rng = np.random.default_rng(11)
    dev = torch.device("cuda")
    raw = torch.tensor(KF21_BYTES + [255], dtype=torch.uint8)
    a, b = Q.e8m0_to_float(raw.to(dev)).cpu(), Q.e8m0_to_float(raw)
    assert torch.equal(a[:-1], b[:-1]) and torch.isnan(a[-1])
    w, s = rand_fp8(rng, (70, 100)), rand_e8m0(rng, (3, 4), 0, 240)
    assert torch.equal(Q.dequant_fp8_block(w.to(dev), s.to(dev)).cpu(), Q.dequant_fp8_block(w, s))
    p = torch.from_numpy(rng.integers(0, 256, (4, 64), dtype=np.uint8)).view(torch.int8)
    ms = rand_e8m0(rng, (4, 4))
    assert torch.equal(Q.dequant_mxfp4(p.to(dev), ms.to(dev)).cpu(), Q.dequant_mxfp4(p, ms))
    x = _mixed_input((8, 300), seed=9)
    for q_cpu, q_dev in zip(Q.quant_fp8_block(x), Q.quant_fp8_block(x.to(dev))):
        assert torch.equal(q_dev.cpu().view(torch.uint8), q_cpu.view(torch.uint8))
    x2 = x[:, :288]
    for q_cpu, q_dev in zip(Q.quant_mxfp4(x2), Q.quant_mxfp4(x2.to(dev))):
        assert torch.equal(q_dev.cpu().view(torch.uint8), q_cpu.view(torch.uint8))
    for fn in (Q.fp8_act_qdq, Q.fp4_e4m3_qdq, Q.mxfp4_qdq):
        for dtype in (torch.float32, torch.bfloat16, torch.float64):
            assert torch.equal(fn(x.to(dev, dtype)).cpu(), fn(x.to(dtype))), (fn.__name__, dtype)
