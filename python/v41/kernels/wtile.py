"""Triton helpers shared by the GEMM kernels: a ``[BN, BK]`` tile of a :class:`~.packed.PackedWeight` in the dot's
operand type (``BK`` = 128 inputs, so each row's bytes arrive in one wide load), and the per-row scale of a K tile.
Imported only where Triton is available.

Scales: where the scale block along K equals the tile (V4's 128×128 FP8) the kernels multiply the tile's partial
dot by a ``[BN]`` scale vector; where it is finer (MXFP4 and V4.1's FP8: 32 inputs) the tile is scaled in
registers, one power of two per 32 inputs. Both are exact: ``w = code · 2^(byte − 127)`` with E4M3 / E2M1 codes
(docs/model.md §2).

MXFP4 tiles have three decodes into the dot's bf16 operand: :func:`w_tile` (float32 per element, any dot type),
``tl.dot_scaled`` (Triton's upcast; kernels/moe.py) and :func:`mxfp4_tile_bits` (bit moves in inline PTX, bf16 only).

Format codes (``FMT``): 0 dense, 1 fp8 (E4M3 × E8M0 per ``B0 × B1`` tile), 2 mxfp4 (two E2M1 codes per byte, low
nibble = even input, E8M0 per 32 inputs of a row). Formulas: :mod:`v41.quant` (e8m0_to_float, dequant_mxfp4).
"""

from __future__ import annotations

import triton
import triton.language as tl

FMT_CODES = {"dense": 0, "fp8": 1, "mxfp4": 2}


TILE_K = 128


def scale_k(fmt: str, block: tuple[int, int]) -> int:
    """Inputs per scale along K: fp8 ``b1``, mxfp4 32; dense weights have none (the tile)."""
    return {"fp8": block[1], "mxfp4": 32}.get(fmt, TILE_K)


@triton.jit
def e8m0_to_f32(b):
    """E8M0 byte (any int type) → float32 ``2^(b − 127)``; byte 0 is the subnormal 2^-127."""
    bi = b.to(tl.int32)
    bits = tl.where(bi == 0, 1 << 22, bi << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e2m1_to_f32(code):
    """FP4 E2M1 nibbles (int32 0..15, bit 3 = sign) → float32 {0, ±0.5, ±1, ±1.5, ±2, ±3, ±4, ±6}, built from
    bits: exponent field e + 126 and mantissa bit m for e ≥ 1, 0.5 · m for e = 0."""
    e = (code >> 1) & 3
    m = code & 1
    bits = tl.where(e == 0, m * (126 << 23), ((e + 126) << 23) | (m << 22)) | ((code & 8) << 28)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def w_tile(w_ptr, s_ptr, rn, k0, nmask, stride_wn, stride_sn, K, B0: tl.constexpr, SK: tl.constexpr,
           BK: tl.constexpr, FMT: tl.constexpr, DOT: tl.constexpr):
    """Rows ``rn`` [BN] × inputs ``k0 .. k0 + BK`` of one weight (``w_ptr``/``s_ptr`` at the expert) as ``DOT``;
    scaled here when the scale block ``SK`` is finer than the tile, else unscaled (see :func:`tile_scale`).
    Elements past ``K`` or outside ``nmask`` are 0."""
    if FMT == 2:
        rb = k0 // 2 + tl.arange(0, BK // 2)
        b = tl.load(w_ptr + rn[:, None] * stride_wn + rb[None, :],
                    mask=nmask[:, None] & (rb < K // 2)[None, :], other=0).to(tl.int32)
        w = e2m1_to_f32(tl.reshape(tl.join(b & 15, b >> 4), (rn.shape[0], BK)))
    else:
        rk = k0 + tl.arange(0, BK)
        w = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :], mask=nmask[:, None] & (rk < K)[None, :],
                    other=0.0)
    if FMT != 0 and SK < BK:
        rs = k0 // SK + tl.arange(0, BK // SK)
        srow = rn // B0 if FMT == 1 else rn
        sb = tl.load(s_ptr + srow[:, None] * stride_sn + rs[None, :], mask=nmask[:, None] & (rs < tl.cdiv(K, SK))[None, :],
                     other=127)
        w = tl.reshape(tl.reshape(w.to(tl.float32), (rn.shape[0], BK // SK, SK)) * e8m0_to_f32(sb)[:, :, None],
                       (rn.shape[0], BK))
    return w.to(DOT)


@triton.jit
def tile_scale(s_ptr, rn, k0, nmask, stride_sn, B0: tl.constexpr, SK: tl.constexpr, BK: tl.constexpr,
               FMT: tl.constexpr):
    """float32 [BN] scale of the tile's partial dot: the FP8 block scale when one block covers the tile, else 1."""
    if FMT == 1 and SK >= BK:
        return e8m0_to_f32(tl.load(s_ptr + (rn // B0) * stride_sn + k0 // SK, mask=nmask, other=127))
    else:
        return tl.full(rn.shape, 1.0, dtype=tl.float32)


@triton.jit
def tile_dot(a, w_ptr, s_ptr, rn, k0, nmask, stride_wn, stride_sn, K, B0: tl.constexpr, SK: tl.constexpr,
             BK: tl.constexpr, FMT: tl.constexpr, DOT: tl.constexpr, IEEE: tl.constexpr):
    """``a [BM, BK] · W[rn, k0 : k0 + BK]ᵀ`` → float32 [BM, BN], the weight tile from :func:`w_tile` and the
    tile's scale applied (IEEE float32 products when ``IEEE``)."""
    w = w_tile(w_ptr, s_ptr, rn, k0, nmask, stride_wn, stride_sn, K, B0, SK, BK, FMT, DOT)
    if IEEE:
        part = tl.dot(a, tl.trans(w), input_precision="ieee")
    else:
        part = tl.dot(a, tl.trans(w))
    return part * tile_scale(s_ptr, rn, k0, nmask, stride_sn, B0, SK, BK, FMT)[None, :]


def _code_pair_ptx(out: str, pair: str, scale: str, shift: int) -> str:
    """PTX for two codes' bf16 weights into ``out``: the nibble at bits ``6 − shift`` … ``9 − shift`` of each 16-bit
    half of ``pair`` (shift 6: the low nibbles, 2: the high ones) moved to sign bit 15 and bits 8..6, then times 2^126
    (``c``) and the halves' scales (``scale``)."""
    return (f"shl.b32 t0, {pair}, {shift};\n"
            f"shl.b32 t1, {pair}, {shift + 6};\n"
            "and.b32 t1, t1, 0x80008000;\n"
            "lop3.b32 t0, t0, 0x01C001C0, t1, 0xEA;\n"
            "mul.rn.bf16x2 t0, t0, c;\n"
            f"mul.rn.bf16x2 {out}, t0, {scale};\n")


# MXFP4 → bf16 in bit moves (:func:`mxfp4_tile_bits`), four packed bytes a call: $4 = bytes b0..b3 (two E2M1 codes
# each, low nibble = even input), $5 = their four E8M0 scale bytes; out $0, $1 = the low nibbles' values of b0, b1 /
# b2, b3 as bf16 pairs, $2, $3 = the high nibbles'. A code's sign goes to bit 15 and its three exponent / mantissa
# bits to bits 8..6, which reads as bf16 code · 2^-126 (e = 0 lands on the subnormal m · 2^-127); one exact multiply
# by 2^126 (0x7E80) makes the code's value, and one correctly rounded multiply by the scale 2^(s − 127) (bf16 bits
# s << 7; s = 0 is the subnormal 0x0040) makes the weight: what rounding code · 2^(s − 127) to bf16 gives (subnormal
# and overflowing results included). tests/test_mxfp4_ptx.py runs this text through an interpreter of its seven
# instructions for every (byte, scale) pair.
MXFP4_BF16_PTX = ("""{
.reg .b32 r01, r23, f01, f23, t0, t1, c, m;
mov.b32 c, 0x7E807E80;
mov.b32 m, 0x00400040;
prmt.b32 r01, $4, 0, 0x4140;
prmt.b32 r23, $4, 0, 0x4342;
prmt.b32 f01, $5, 0, 0x4140;
prmt.b32 f23, $5, 0, 0x4342;
shl.b32 f01, f01, 7;
shl.b32 f23, f23, 7;
max.u16x2 f01, f01, m;
max.u16x2 f23, f23, m;
""" + _code_pair_ptx("$0", "r01", "f01", 6) + _code_pair_ptx("$1", "r23", "f23", 6)
                  + _code_pair_ptx("$2", "r01", "f01", 2) + _code_pair_ptx("$3", "r23", "f23", 2) + "}")
_MXFP4_BF16_PTX = tl.constexpr(MXFP4_BF16_PTX)


@triton.jit
def mxfp4_tile_bits(w_ptr, s_ptr, rn, k0, nmask, stride_wn, stride_sn, K, BK: tl.constexpr,
                    EVEN_K: tl.constexpr = False):
    """Rows ``rn`` [BN] × inputs ``k0 .. k0 + BK`` of an MXFP4 weight (``w_ptr`` / ``s_ptr`` at the expert) as bf16
    [BN, BK], decoded by :data:`MXFP4_BF16_PTX` (inline PTX for sm_90+: not under the interpreter); bit for bit
    :func:`w_tile`'s bf16 tile and the spec's value rounded to bf16, except at scale byte 255 (NaN in the OCP spec,
    in no checkpoint), which reads as 2^128 here and in :func:`w_tile` (±inf; NaN for code 0). Elements past ``K`` or
    outside ``nmask`` are 0; ``EVEN_K``: the caller promises ``k0 + BK ≤ K`` (a whole step), and only rows are
    masked."""
    rb = k0 // 2 + tl.arange(0, BK // 2)
    rs = k0 // 32 + tl.arange(0, BK // 32)
    if EVEN_K:  # the step lies inside K: only the rows are masked
        b = tl.load(w_ptr + rn[:, None] * stride_wn + rb[None, :], mask=nmask[:, None], other=0)
        sb = tl.load(s_ptr + rn[:, None] * stride_sn + rs[None, :], mask=nmask[:, None], other=127)
    else:
        b = tl.load(w_ptr + rn[:, None] * stride_wn + rb[None, :], mask=nmask[:, None] & (rb < K // 2)[None, :],
                    other=0)
        sb = tl.load(s_ptr + rn[:, None] * stride_sn + rs[None, :], mask=nmask[:, None] & (rs < K // 32)[None, :],
                     other=127)
    sb = tl.reshape(tl.broadcast_to(sb[:, :, None], (rn.shape[0], BK // 32, 16)), (rn.shape[0], BK // 2))
    lo, hi = tl.inline_asm_elementwise(_MXFP4_BF16_PTX, "=r,=r,=r,=r,r,r", [b, sb], dtype=(tl.bfloat16, tl.bfloat16),
                                       is_pure=True, pack=4)
    return tl.reshape(tl.join(lo, hi), (rn.shape[0], BK))
