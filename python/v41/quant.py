"""Block-scaled FP8 / MXFP4 weight codecs and the "deployed" quantize-dequantize (QAT) helpers.

Pure torch; every function runs on CPU or GPU (the device of its inputs) and never leaves torch.

Formats (docs/model.md §2 "Numerical conventions", §5 "Checkpoint tensors"):

* **E8M0 scale** (checkpoint dtype ``F8_E8M0``, torch ``float8_e8m0fnu``): one byte ``b`` is the power of
  two ``2^(b-127)``; ``b = 255`` is NaN (OCP Microscaling Formats spec v1.0, §5.4). The byte is an
  *exponent*, never a value (KF-21: reading byte 127 as ``127.0`` is the bug). Scales are accepted either
  as ``float8_e8m0fnu`` tensors or as the raw bytes in a ``uint8`` tensor (``t.view(torch.uint8)``).
* **FP8 dense weights** (``F8_E4M3``, torch ``float8_e4m3fn``) with one E8M0 scale per ``block[0] x
  block[1]`` tile, scale grid ``[ceil(out/b0), ceil(in/b1)]`` (V4.1: 32x32; V4: 128x128). Edge tiles
  may be partial. ``w = fp8_value * 2^(b-127)``.
* **MXFP4 routed experts** (``I8``, ``[out, in/2]``): FP4 E2M1 values, two per byte, **element ``2k`` in
  the low nibble and element ``2k+1`` in the high nibble** (vLLM's "even channel in the low nibble");
  nibble bit 3 is the sign, bits 0-2 index the magnitudes ``[0, 0.5, 1, 1.5, 2, 3, 4, 6]``. One E8M0
  scale per 32 consecutive input elements, scale shape ``[out, in/32]``.

QAT helpers (the ``deployed`` numerics mode; §2 "Activation quantization"): they quantize and immediately
dequantize, blockwise along the last dim, and return a tensor of the input's dtype and shape:

* :func:`fp8_act_qdq` - FP8 E4M3, power-of-two scale, block 32 (activations before FP8/FP4 GEMMs and the
  SWA KV cache);
* :func:`fp4_e4m3_qdq` - FP4 E2M1 with E4M3 scales, block 16 (compressed KV);
* :func:`mxfp4_qdq` - FP4 E2M1 with power-of-two scale, block 32 (index queries/keys).

Rounding everywhere is round-to-nearest, ties to even (torch's float8 casts, and an explicit E2M1
rounder here). Power-of-two scales ``2^ceil(log2(v))`` are computed exactly from the float32 bits of
``v`` (``frexp``), never through a float ``log2``/``pow`` that could round.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "e8m0_to_float",
    "float_to_e8m0",
    "dequant_fp8_block",
    "quant_fp8_block",
    "dequant_mxfp4",
    "quant_mxfp4",
    "fp8_act_qdq",
    "fp4_e4m3_qdq",
    "mxfp4_qdq",
]

_E8M0 = torch.float8_e8m0fnu
_FP8 = torch.float8_e4m3fn
_FP8_MAX = 448.0  # largest finite float8_e4m3fn
_E2M1_MAX = 6.0  # largest FP4 E2M1 magnitude
_MX_BLOCK = 32  # MXFP4 weight block along the input dim
_AMAX_FLOOR = 1e-30  # weight / index-FP4 amax floor (all-zero blocks); scales stay E8M0-encodable
_ACT_SCALE_FLOOR = 1e-4  # SWA/activation FP8: scale = 2^ceil(log2(max(amax/448, 1e-4)))
_FP4_E4M3_SCALE_MIN = 2.0**-9  # compressed-KV E4M3 scale clamp (smallest E4M3 subnormal)
_FP4_E4M3_SCALE_MAX = 448.0

# E2M1 code -> value (code bit 3 = sign). Index with a nibble.
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------


def _e8m0_bytes(scale: Tensor) -> Tensor:
    """Raw E8M0 bytes of ``scale`` as ``uint8`` (same shape). Accepts ``float8_e8m0fnu`` or ``uint8``."""
    if not isinstance(scale, Tensor):
        raise TypeError(f"scale must be a torch.Tensor, got {type(scale).__name__}")
    if scale.dtype == _E8M0:
        return scale.view(torch.uint8)
    if scale.dtype == torch.uint8:
        return scale
    raise TypeError(
        f"E8M0 scale must be torch.float8_e8m0fnu or uint8 raw bytes, got {scale.dtype} "
        "(a scale stored as a value, e.g. float32, is not an E8M0 byte; see KF-21)"
    )


def _exp2_int(k: Tensor) -> Tensor:
    """Exact float32 ``2^k`` for an integer tensor ``k`` (bits built directly; >127 -> inf, <-149 -> 0)."""
    k = k.to(torch.int32).clamp(-150, 128)
    normal = torch.bitwise_left_shift(k + 127, 23)  # k in [-126, 128]; 128 gives the +inf pattern
    sub = torch.bitwise_left_shift(torch.ones_like(k), (k + 149).clamp(0, 22))  # k in [-149, -127]
    bits = torch.where(k >= -126, normal, torch.where(k >= -149, sub, torch.zeros_like(k)))
    return bits.view(torch.float32)


def _pow2_ceil(v: Tensor) -> Tensor:
    """``2^ceil(log2(v))`` computed exactly, elementwise, for a positive float32 tensor.

    ``frexp`` gives ``v = m * 2^e`` with ``0.5 <= m < 1``; ``ceil(log2 v)`` is ``e - 1`` when ``m == 0.5``
    (``v`` an exact power of two) and ``e`` otherwise. Non-finite ``v`` (inf/NaN) is passed through.
    """
    m, e = torch.frexp(v)
    k = e - (m == 0.5).to(e.dtype)
    return torch.where(torch.isfinite(v), _exp2_int(k), v)


def _e2m1_codes(q: Tensor) -> Tensor:
    """Round float32 ``q`` to the nearest FP4 E2M1 value (ties to even mantissa, saturating at +-6).

    Returns the 4-bit codes as ``uint8`` (bit 3 = sign of ``q``). Decision points between consecutive
    magnitudes ``0, .5, 1, 1.5, 2, 3, 4, 6`` are the midpoints; at a midpoint the code with mantissa bit 0
    (even code) wins, hence ``>`` where the lower neighbour is even and ``>=`` where the upper one is.
    NaN maps to a (signed) zero code; callers make NaN blocks NaN through their scale.
    """
    a = q.abs()
    mag = (
        (a > 0.25).to(torch.uint8)  # 0 | 0.5   -> tie to 0   (code 0 even)
        + (a >= 0.75).to(torch.uint8)  # 0.5 | 1   -> tie to 1   (code 2 even)
        + (a > 1.25).to(torch.uint8)  # 1 | 1.5   -> tie to 1
        + (a >= 1.75).to(torch.uint8)  # 1.5 | 2   -> tie to 2
        + (a > 2.5).to(torch.uint8)  # 2 | 3     -> tie to 2
        + (a >= 3.5).to(torch.uint8)  # 3 | 4     -> tie to 4
        + (a > 5.0).to(torch.uint8)  # 4 | 6     -> tie to 4; everything above 6 saturates to 6
    )
    return mag | (torch.signbit(q).to(torch.uint8) << 3)


def e2m1_codes(q: Tensor) -> Tensor:
    """Public name of :func:`_e2m1_codes` (RNE, saturating E2M1 codes as uint8, bit 3 = sign)."""
    return _e2m1_codes(q)


def e2m1_values(codes: Tensor) -> Tensor:
    """E2M1 codes (any integer dtype, 0..15) → their float32 values (:data:`_E2M1_VALUES`): exponent bits
    ``e = (c >> 1) & 3`` and mantissa bit ``m``: ``m/2`` when ``e = 0``, else ``(2 + m)·2^(e−2)``; bit 3 = sign."""
    c = codes.to(torch.int32)
    e, m = torch.bitwise_right_shift(c, 1) & 3, (c & 1).to(torch.float32)
    mag = torch.where(e == 0, m * 0.5, (m + 2) * _exp2_int(e - 2))
    return torch.where((c & 8) != 0, -mag, mag)


def _e2m1_round(q: Tensor) -> Tensor:
    """Nearest E2M1 value of float32 ``q`` (RNE, saturating), as float32."""
    return e2m1_values(_e2m1_codes(q))


def _block2(block: int | Sequence[int]) -> tuple[int, int]:
    if isinstance(block, int):
        b = (block, block)
    else:
        b = tuple(int(x) for x in block)
    if len(b) != 2 or b[0] < 1 or b[1] < 1:
        raise ValueError(f"block must be a positive int or a pair of positive ints, got {block!r}")
    return b  # type: ignore[return-value]


def _check_float(x: Tensor, name: str) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point() or x.dtype in (_FP8, _E8M0, torch.float8_e5m2):
        raise TypeError(f"{name} must be float16/bfloat16/float32/float64, got {x.dtype}")


def _split_last(x: Tensor, block: int) -> tuple[Tensor, int]:
    """float32 view of ``x`` as ``[..., nblocks, block]``, zero-padding a partial last block."""
    _check_float(x, "x")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}")
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (blocks run along the last dim)")
    n = x.shape[-1]
    nb = -(-n // block)
    xf = x.to(torch.float32)
    if nb * block != n:
        xf = F.pad(xf, (0, nb * block - n))  # zeros never raise a block's amax
    return xf.reshape(*x.shape[:-1], nb, block), n


def _merge_last(y: Tensor, n: int, like: Tensor) -> Tensor:
    return y.reshape(*y.shape[:-2], y.shape[-2] * y.shape[-1])[..., :n].to(like.dtype).contiguous()


# --------------------------------------------------------------------------------------------------
# E8M0
# --------------------------------------------------------------------------------------------------


def e8m0_to_float(scale: Tensor) -> Tensor:
    """Decode E8M0 scale bytes to float32 powers of two.

    Args:
        scale: any shape; ``torch.float8_e8m0fnu`` or ``torch.uint8`` holding the raw bytes
            (checkpoint dtype ``F8_E8M0``, docs/model.md §5).
    Returns:
        float32, same shape: byte ``b`` -> ``2^(b-127)`` exactly (byte 0 -> ``2^-127``, a float32
        subnormal; byte 254 -> ``2^127``); byte 255 -> NaN (OCP MX spec v1.0).

    The float32 bit pattern is assembled directly (``b << 23``; ``1 << 22`` for byte 0), so the result is
    exact on every device; no ``pow``. KF-21: a byte is an exponent, never the value ``float(b)``.
    """
    b = _e8m0_bytes(scale).to(torch.int32)
    bits = torch.where(b == 0, torch.full_like(b, 1 << 22), torch.bitwise_left_shift(b, 23))
    bits = torch.where(b == 255, torch.full_like(b, 0x7FC00000), bits)
    return bits.view(torch.float32)


def float_to_e8m0(scale_pow2: Tensor) -> Tensor:
    """Encode exact powers of two as E8M0.

    Args:
        scale_pow2: floating tensor, any shape, every element ``2^k`` with ``-127 <= k <= 127``
            (NaN is allowed and encodes as byte 255).
    Returns:
        ``torch.float8_e8m0fnu``, same shape, byte ``k + 127``.
    Raises:
        TypeError: non-floating input.
        ValueError: an element that is not such a power of two (zero, negative, inf, out of range, or
            with mantissa bits), so a silent rounding can never happen. (Checks synchronize the device.)
    """
    _check_float(scale_pow2, "scale_pow2")
    x = scale_pow2.to(torch.float32)
    bits = x.view(torch.int32)
    exp = torch.bitwise_right_shift(bits, 23) & 0xFF
    man = bits & 0x7FFFFF
    nonneg = bits >= 0
    is_nan = torch.isnan(x)
    normal_ok = nonneg & (exp >= 1) & (exp <= 254) & (man == 0)
    min_ok = nonneg & (exp == 0) & (man == (1 << 22))  # 2^-127 is a float32 subnormal -> byte 0
    exact = (x.to(scale_pow2.dtype) == scale_pow2) | is_nan  # float64 input must not round to a power
    ok = (normal_ok | min_ok | is_nan) & exact
    if not bool(ok.all()):
        bad = scale_pow2[~ok].flatten()[:4].tolist()
        raise ValueError(f"float_to_e8m0 expects powers of two in [2^-127, 2^127] (or NaN); got e.g. {bad}")
    byte = torch.where(is_nan, torch.full_like(exp, 255), torch.where(min_ok, torch.zeros_like(exp), exp))
    return byte.to(torch.uint8).view(_E8M0)


# --------------------------------------------------------------------------------------------------
# FP8 block-scaled weights
# --------------------------------------------------------------------------------------------------


def dequant_fp8_block(weight: Tensor, scale: Tensor, block: int | Sequence[int] = (32, 32)) -> Tensor:
    """Dequantize a block-scaled FP8 weight (docs/model.md §5: FP8 linears + sibling ``.scale``).

    Args:
        weight: ``[out, in]`` ``torch.float8_e4m3fn`` (checkpoint ``F8_E4M3``).
        scale: ``[ceil(out/b0), ceil(in/b1)]`` E8M0 (``float8_e8m0fnu`` or raw ``uint8`` bytes).
        block: ``(b0, b1)`` tile size (V4.1 ``(32, 32)``, V4 ``(128, 128)``); an int means square.
    Returns:
        float32 ``[out, in]``, ``w[i, j] = fp8(weight[i, j]) * 2^(scale[i // b0, j // b1] - 127)``.
        Exact (products of an E4M3 value and a power of two are float32-representable except
        overflow past ~3.4e38 -> inf). Partial edge tiles (``out``/``in`` not multiples of the block)
        use their tile's scale.
    Raises:
        TypeError on wrong dtypes; ValueError naming expected vs got on wrong ranks/shapes.
    """
    b0, b1 = _block2(block)
    if not isinstance(weight, Tensor) or weight.dtype != _FP8:
        got = weight.dtype if isinstance(weight, Tensor) else type(weight).__name__
        raise TypeError(f"weight must be torch.float8_e4m3fn, got {got}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [out, in], got shape {tuple(weight.shape)}")
    s = e8m0_to_float(scale)
    out, inn = weight.shape
    n0, n1 = -(-out // b0), -(-inn // b1)
    if tuple(s.shape) != (n0, n1):
        raise ValueError(
            f"FP8 scale grid for weight {tuple(weight.shape)} with block ({b0}, {b1}): "
            f"expected shape {(n0, n1)}, got {tuple(s.shape)}"
        )
    w = weight.to(torch.float32)
    if out == n0 * b0 and inn == n1 * b1:
        return (w.reshape(n0, b0, n1, b1) * s[:, None, :, None]).reshape(out, inn)
    s_full = s.repeat_interleave(b0, dim=0)[:out].repeat_interleave(b1, dim=1)[:, :inn]
    return w * s_full


def quant_fp8_block(w: Tensor, block: int | Sequence[int] = (32, 32)) -> tuple[Tensor, Tensor]:
    """Quantize a weight to block-scaled FP8 (the inverse of :func:`dequant_fp8_block`).

    Args:
        w: ``[out, in]`` float16/bfloat16/float32/float64 (computed in float32), finite.
        block: ``(b0, b1)`` tile size; partial edge tiles allowed.
    Returns:
        ``(q, scale)``: ``q`` ``[out, in]`` ``torch.float8_e4m3fn``; ``scale``
        ``[ceil(out/b0), ceil(in/b1)]`` ``torch.float8_e8m0fnu`` with per-tile
        ``scale = 2^ceil(log2(max(amax, 1e-30) / 448))`` and ``q = RNE_e4m3(w / scale)`` (torch's cast).
        All-zero tiles get a tiny scale and zero codes. Values already of the form
        ``e4m3 * 2^k`` with tile scales in the normal range round-trip exactly.
    Raises:
        TypeError / ValueError on bad dtype, rank, block, or non-finite input.
    """
    b0, b1 = _block2(block)
    _check_float(w, "w")
    if w.dim() != 2:
        raise ValueError(f"w must be 2-D [out, in], got shape {tuple(w.shape)}")
    out, inn = w.shape
    n0, n1 = -(-out // b0), -(-inn // b1)
    x = w.to(torch.float32)
    if (n0 * b0, n1 * b1) != (out, inn):
        x = F.pad(x, (0, n1 * b1 - inn, 0, n0 * b0 - out))
    t = x.reshape(n0, b0, n1, b1)
    amax = t.abs().amax(dim=(1, 3))
    if not bool(torch.isfinite(amax).all()):
        raise ValueError("quant_fp8_block: w contains inf or NaN")
    s = _pow2_ceil(amax.clamp_min(_AMAX_FLOOR) / _FP8_MAX)
    q = (t / s[:, None, :, None]).to(_FP8).reshape(n0 * b0, n1 * b1)[:out, :inn].contiguous()
    return q, float_to_e8m0(s)


# --------------------------------------------------------------------------------------------------
# MXFP4 experts
# --------------------------------------------------------------------------------------------------


def dequant_mxfp4(packed: Tensor, scale: Tensor) -> Tensor:
    """Dequantize MXFP4 (FP4 E2M1 + E8M0 per 32) expert weights (docs/model.md §5: ``I8`` experts).

    Args:
        packed: ``[out, in/2]`` ``int8`` (checkpoint ``I8``; reinterpreted with ``.view(torch.uint8)``)
            or ``uint8``. Leading batch dims (``[E, out, in/2]``) are allowed. Nibble order: element
            ``2k`` is the **low** nibble of byte ``k``, element ``2k+1`` the **high** nibble (vLLM's "even
            channel in the low nibble"); nibble = sign bit 3 + magnitude index into
            ``[0, 0.5, 1, 1.5, 2, 3, 4, 6]``.
        scale: ``[out, ceil(in/32)]`` E8M0 (``float8_e8m0fnu`` or raw ``uint8``), one per 32 inputs.
    Returns:
        float32 ``[out, in]`` (exact): ``e2m1(nibble) * 2^(scale_byte - 127)``.
    Raises:
        TypeError on wrong dtypes; ValueError naming expected vs got on a wrong scale shape.
    """
    if not isinstance(packed, Tensor) or packed.dtype not in (torch.int8, torch.uint8):
        got = packed.dtype if isinstance(packed, Tensor) else type(packed).__name__
        raise TypeError(f"packed must be int8 or uint8 (two E2M1 values per byte), got {got}")
    if packed.dim() < 1:
        raise ValueError("packed must have at least one dimension [..., in/2]")
    p = packed.view(torch.uint8)
    s = e8m0_to_float(scale)
    lead = tuple(p.shape[:-1])
    inn = 2 * p.shape[-1]
    nb = -(-inn // _MX_BLOCK)
    if tuple(s.shape) != (*lead, nb):
        raise ValueError(
            f"MXFP4 scale for packed {tuple(p.shape)} (in = {inn}): expected shape {(*lead, nb)}, "
            f"got {tuple(s.shape)}"
        )
    codes = torch.stack((p & 0x0F, torch.bitwise_right_shift(p, 4)), dim=-1).reshape(*lead, inn)
    vals = e2m1_values(codes)
    if inn == nb * _MX_BLOCK:
        return (vals.reshape(*lead, nb, _MX_BLOCK) * s[..., None]).reshape(*lead, inn)
    return vals * s.repeat_interleave(_MX_BLOCK, dim=-1)[..., :inn]


def quant_mxfp4(w: Tensor) -> tuple[Tensor, Tensor]:
    """Quantize to MXFP4 (the inverse of :func:`dequant_mxfp4`).

    Args:
        w: ``[out, in]`` (leading batch dims allowed) float16/bfloat16/float32/float64, finite;
            ``in`` must be a multiple of 32.
    Returns:
        ``(packed, scale)``: ``packed`` ``int8`` ``[out, in/2]`` (element ``2k`` low nibble, ``2k+1`` high
        nibble); ``scale`` ``torch.float8_e8m0fnu`` ``[out, in/32]`` with
        ``scale = 2^ceil(log2(max(amax, 1e-30) / 6))`` per 32-block and codes
        ``RNE_e2m1(w / scale)`` (ties to even mantissa). Blocks already of the form ``e2m1 * 2^k``
        round-trip exactly.
    Raises:
        TypeError / ValueError on bad dtype, ``in % 32 != 0`` or non-finite input.
    """
    _check_float(w, "w")
    if w.dim() < 1:
        raise ValueError("w must have at least one dimension [..., in]")
    inn = w.shape[-1]
    if inn % _MX_BLOCK != 0:
        raise ValueError(f"quant_mxfp4: in (last dim) must be a multiple of {_MX_BLOCK}, got {inn}")
    lead = tuple(w.shape[:-1])
    x = w.to(torch.float32).reshape(*lead, inn // _MX_BLOCK, _MX_BLOCK)
    amax = x.abs().amax(dim=-1)
    if not bool(torch.isfinite(amax).all()):
        raise ValueError("quant_mxfp4: w contains inf or NaN")
    s = _pow2_ceil(amax.clamp_min(_AMAX_FLOOR) / _E2M1_MAX)
    codes = _e2m1_codes(x / s[..., None]).reshape(*lead, inn)
    packed = (codes[..., 0::2] | torch.bitwise_left_shift(codes[..., 1::2], 4)).contiguous()
    return packed.view(torch.int8), float_to_e8m0(s)


# --------------------------------------------------------------------------------------------------
# quantize -> dequantize helpers (deployed numerics)
# --------------------------------------------------------------------------------------------------


def fp8_act_qdq(x: Tensor, block: int = 32) -> Tensor:
    """FP8 E4M3 quantize-dequantize per row, per ``block`` elements of the last dim, power-of-two scale.

    ``scale = 2^ceil(log2(max(amax/448, 1e-4)))``; ``y = e4m3(x / scale) * scale`` (RNE cast).
    Used for activations before FP8/FP4 GEMMs (w8a8 / w4a8) and for the SWA KV cache (all 512 dims,
    after RoPE); formula as pinned for vLLM's V4.1 SWA cache (docs/model.md §2).

    Args:
        x: ``[..., n]`` float32/float64/bfloat16 (float16 works while results stay in its range);
            computed in float32. A partial last block (``n % block != 0``) is its own block.
    Returns:
        same dtype and shape as ``x``; idempotent; all-zero blocks stay zero.
    """
    xb, n = _split_last(x, block)
    s = fp8_act_scale(xb)
    y = (xb / s).to(_FP8).to(torch.float32) * s
    return _merge_last(y, n, x)


def fp8_act_scale(xb: Tensor) -> Tensor:
    """The power-of-two scale of :func:`fp8_act_qdq` per block: float32 ``xb [..., nblocks, block]`` →
    ``[..., nblocks, 1]``."""
    amax = xb.abs().amax(dim=-1, keepdim=True)
    return _pow2_ceil((amax / _FP8_MAX).clamp_min(_ACT_SCALE_FLOOR))


def fp4_e4m3_qdq(x: Tensor, block: int = 16) -> Tensor:
    """FP4 E2M1 quantize-dequantize with E4M3 block scales (compressed-KV format, block 16).

    Per ``block`` elements of the last dim (docs/model.md §2, vLLM V4.1 paged compressed KV):
    ``scale = e4m3(clamp(amax/6, 2^-9, 448))`` (ordinary RNE float8 cast), ``q = x / scale`` (IEEE float32
    division), ``y = RNE_e2m1(q) * scale`` (ties to even, saturating at +-6).

    Args:
        x: ``[..., n]`` float32/float64/bfloat16, computed in float32; partial last block allowed.
    Returns:
        same dtype and shape as ``x``; all-zero blocks stay zero. Idempotent for blocks whose scale is
        an E4M3 normal (``amax >= 6 * 2^-6``) or clamped at ``2^-9``; with a subnormal E4M3 scale the
        format itself is not idempotent (e.g. ``9*2^-9 -> 2^-6 -> 6*2^-9``).
    """
    xb, n = _split_last(x, block)
    s = fp4_e4m3_scale(xb)
    y = _e2m1_round(xb / s) * s
    return _merge_last(y, n, x)


def fp4_e4m3_scale(xb: Tensor) -> Tensor:
    """The E4M3 scale of :func:`fp4_e4m3_qdq` per block (an exact FP8 value, as float32): ``xb [..., nblocks,
    block]`` → ``[..., nblocks, 1]``."""
    amax = xb.abs().amax(dim=-1, keepdim=True)
    return (amax / _E2M1_MAX).clamp(_FP4_E4M3_SCALE_MIN, _FP4_E4M3_SCALE_MAX).to(_FP8).to(torch.float32)


def mxfp4_qdq(x: Tensor, block: int = 32) -> Tensor:
    """FP4 E2M1 quantize-dequantize with power-of-two (ue8m0) block scales (index queries and keys).

    Per ``block`` elements of the last dim: ``scale = 2^ceil(log2(max(amax, 1e-30) / 6))``,
    ``y = RNE_e2m1(x / scale) * scale`` (docs/model.md §2; the formula is the MX convention, not
    seen in reference code).

    Args:
        x: ``[..., n]`` float32/float64/bfloat16, computed in float32; partial last block allowed.
    Returns:
        same dtype and shape as ``x``; idempotent; all-zero blocks stay zero.
    """
    xb, n = _split_last(x, block)
    s = mxfp4_scale(xb)
    y = _e2m1_round(xb / s) * s
    return _merge_last(y, n, x)


def mxfp4_scale(xb: Tensor) -> Tensor:
    """The power-of-two scale of :func:`mxfp4_qdq` per block: ``xb [..., nblocks, block]`` → ``[..., nblocks,
    1]``."""
    amax = xb.abs().amax(dim=-1, keepdim=True)
    return _pow2_ceil(amax.clamp_min(_AMAX_FLOOR) / _E2M1_MAX)

