"""The deployed KV-cache records (``v41/cache/records.py``; docs/model.md §6.1): sizes as the spec pins them,
byte layouts by known answers, and decode(encode(x)) equal bit for bit to the deployed-numerics
quantize-dequantize of ``v41.quant`` on rows of many magnitudes."""

from __future__ import annotations

import pytest
import torch

from v41 import quant
from v41.cache.records import CKV_FP4, IDX_MXFP4, SWA_FP8, SWA_V4, RecordFormat


def qdq(fmt: RecordFormat, x: torch.Tensor) -> torch.Tensor:
    """The deployed-numerics rounding of a row of ``fmt``, from v41.quant (V4: as the reference's window rows)."""
    if fmt.kind == "swa_v4":
        n = fmt.dims - fmt.rope
        return torch.cat([quant.fp8_act_qdq(x[..., :n], 64), x[..., n:].to(torch.bfloat16).to(x.dtype)], dim=-1)
    return {"swa_fp8": lambda: quant.fp8_act_qdq(x, 32), "ckv_fp4": lambda: quant.fp4_e4m3_qdq(x, 16),
            "idx_mxfp4": lambda: quant.mxfp4_qdq(x, 32)}[fmt.kind]()


def test_record_sizes_are_the_specs():
    """528 B window, 288 B compressed, 68 B index records (890 B/token of long-range KV at V4.1's mix); V4's 584 B
    row (448 FP8 + 64 bf16 + 7 scales + 1 pad)."""
    assert (SWA_FP8.nbytes, CKV_FP4.nbytes, IDX_MXFP4.nbytes, SWA_V4.nbytes) == (528, 288, 68, 584)
    assert 2.5 * (CKV_FP4.nbytes + IDX_MXFP4.nbytes) == 890


@pytest.mark.parametrize("fmt", [SWA_FP8, CKV_FP4, IDX_MXFP4, SWA_V4, RecordFormat("swa_fp8", 64),
                                 RecordFormat("ckv_fp4", 96), RecordFormat("idx_mxfp4", 32),
                                 RecordFormat("swa_v4", 64, rope=16)],
                         ids=lambda f: f"{f.kind}-{f.dims}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_of_encode_is_the_quantize_dequantize(fmt, dtype):
    g = torch.Generator().manual_seed(fmt.dims)
    x = torch.randn(6, 5, fmt.dims, generator=g)
    x = x * torch.logspace(-7, 5, 6).view(6, 1, 1)  # 1e-7 .. 1e5 per row group: clamped and subnormal scales
    x[0, 0] = 0.0  # an all-zero row
    x[1, 1, : fmt.block] = 0.0  # an all-zero block
    x = x.to(dtype)
    rec = fmt.encode(x)
    assert rec.dtype == torch.uint8 and rec.shape == (6, 5, fmt.nbytes)
    got = fmt.decode(rec)
    want = qdq(fmt, x).to(torch.float32)
    assert torch.equal(got, want)
    assert torch.equal(fmt.decode(rec, torch.bfloat16).float(), want.to(torch.bfloat16).float())


@pytest.mark.parametrize("fmt", [SWA_FP8, IDX_MXFP4], ids=lambda f: f.kind)
def test_power_of_two_records_keep_their_values_when_re_encoded(fmt):
    """A decoded row encodes to the same values (not always the same bytes: a block whose largest value rounds
    down to half the range may take the next smaller scale)."""
    x = torch.randn(9, fmt.dims, generator=torch.Generator().manual_seed(1)) * 17
    y = fmt.decode(fmt.encode(x))
    assert torch.equal(fmt.decode(fmt.encode(y)), y)


def test_known_answers_fix_the_byte_layout():
    """Rows of 1.0: codes first, scale bytes last.
    Window: scale 2^ceil(log2(1/448)) = 2^-8 (byte 119), code E4M3(256) = 0x78.
    Compressed: scale E4M3(1/6) = 0.171875 (0x23), 1/0.171875 = 5.8 → E2M1 6 (code 7): bytes 0x77.
    Index: scale 2^ceil(log2(1/6)) = 2^-2 (byte 125), 1/0.25 = 4 → code 6: bytes 0x66."""
    one = torch.ones(512)
    swa = SWA_FP8.encode(one)
    assert torch.all(swa[:512] == 0x78) and torch.all(swa[512:] == 119)
    ckv = CKV_FP4.encode(one)
    assert torch.all(ckv[:256] == 0x77) and torch.all(ckv[256:] == 0x23)
    idx = IDX_MXFP4.encode(torch.ones(128))
    assert torch.all(idx[:64] == 0x66) and torch.all(idx[64:] == 125)
    x = torch.zeros(128)
    x[0], x[1] = 0.5, -1.0  # even dim in the low nibble: codes 1 (0.5 · 2^0 → q 0.5 · 6 / 1) and sign | 2
    rec = IDX_MXFP4.encode(x)
    s = quant.e8m0_to_float(rec[64:65]).item()
    lo, hi = rec[0].item() & 15, rec[0].item() >> 4
    assert quant.e2m1_values(torch.tensor([lo, hi])).tolist() == [0.5 / s, -1.0 / s]
    v4 = SWA_V4.encode(one)  # V4: 448 codes 0x78, 64 bf16 ones (0x3F80, little-endian), 7 scale bytes 119, 1 pad
    assert torch.all(v4[:448] == 0x78) and v4[448:576].view(torch.bfloat16).eq(1).all()
    assert v4[576:583].eq(119).all() and v4[583] == 0


def test_bad_rows_and_records_are_errors():
    with pytest.raises(ValueError, match="rows of 512"):
        SWA_FP8.encode(torch.zeros(3, 500))
    with pytest.raises(ValueError, match="uint8 records of 288"):
        CKV_FP4.decode(torch.zeros(3, 287, dtype=torch.uint8))
    with pytest.raises(ValueError, match="record kind"):
        RecordFormat("ckv_fp4", 40)
    with pytest.raises(ValueError, match="record kind"):
        RecordFormat("bf16", 512)
    with pytest.raises(ValueError, match="RoPE dims for swa_v4 only"):
        RecordFormat("swa_fp8", 512, rope=64)
    with pytest.raises(ValueError, match="RoPE dims for swa_v4 only"):
        RecordFormat("swa_v4", 512)
