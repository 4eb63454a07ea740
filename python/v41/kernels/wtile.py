"""Triton helpers shared by the GEMM kernels: a ``[BN, BK]`` tile of a :class:`~.packed.PackedWeight` in the dot's
operand type (``BK`` = 128 inputs, so each row's bytes arrive in one wide load), and the per-row scale of a K tile.
Imported only where Triton is available.

Scales: where the scale block along K equals the tile (V4's 128×128 FP8) the kernels multiply the tile's partial
dot by a ``[BN]`` scale vector; where it is finer (MXFP4 and V4.1's FP8: 32 inputs) the tile is scaled in
registers, one power of two per 32 inputs. Both are exact: ``w = code · 2^(byte − 127)`` with E4M3 / E2M1 codes
(docs/model.md §2).

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
