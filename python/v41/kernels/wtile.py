"""Triton helpers shared by the GEMM kernels: load a ``[BN, BK]`` tile of a :class:`~.packed.PackedWeight` and
dequantize it in registers (float32, exact). Imported only where Triton is available.

Format codes (``FMT``): 0 dense, 1 fp8 (E4M3 × E8M0 per ``B0 × B1`` tile), 2 mxfp4 (E2M1 pairs per byte, low
nibble = even input, E8M0 per 32 inputs of a row). Formulas: :mod:`v41.quant` (e8m0_to_float, dequant_mxfp4).
"""

from __future__ import annotations

import triton
import triton.language as tl

FMT_CODES = {"dense": 0, "fp8": 1, "mxfp4": 2}


@triton.jit
def e8m0_to_f32(b):
    """E8M0 byte (any int type) → float32 ``2^(b − 127)``; byte 0 is the subnormal 2^-127."""
    bi = b.to(tl.int32)
    bits = tl.where(bi == 0, 1 << 22, bi << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e2m1_to_f32(code):
    """FP4 E2M1 nibble (int32 0..15, bit 3 = sign) → float32 value in {0, ±0.5, …, ±6}."""
    mag = code & 7
    e = mag >> 1
    m = (mag & 1).to(tl.float32)
    pow2 = ((e + 125) << 23).to(tl.float32, bitcast=True)  # 2^(e − 2), e ≥ 1
    v = tl.where(e == 0, m * 0.5, (2.0 + m) * pow2)
    return tl.where((code & 8) != 0, -v, v)


@triton.jit
def load_w_tile(w_ptr, s_ptr, rn, rk, mask, stride_wn, stride_sn, B0: tl.constexpr, B1: tl.constexpr,
                FMT: tl.constexpr):
    """Rows ``rn`` [BN] × input columns ``rk`` [BK] of one weight (``w_ptr``/``s_ptr`` already offset to the
    expert) → float32 [BN, BK]; masked elements are 0."""
    if FMT == 2:
        b = tl.load(w_ptr + rn[:, None] * stride_wn + (rk // 2)[None, :], mask=mask, other=0).to(tl.int32)
        code = tl.where((rk % 2 == 0)[None, :], b & 15, b >> 4)
        sb = tl.load(s_ptr + rn[:, None] * stride_sn + (rk // 32)[None, :], mask=mask, other=127)
        return e2m1_to_f32(code) * e8m0_to_f32(sb)
    elif FMT == 1:
        w = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :], mask=mask, other=0.0).to(tl.float32)
        sb = tl.load(s_ptr + (rn // B0)[:, None] * stride_sn + (rk // B1)[None, :], mask=mask, other=127)
        return w * e8m0_to_f32(sb)
    else:
        return tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :], mask=mask, other=0.0).to(tl.float32)
