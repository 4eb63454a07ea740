"""Reading cache records inside Triton kernels (``--kv-cache-dtype fp8``; the layouts and their PyTorch encoder /
decoder are :mod:`v41.cache.records`, docs/model.md §6.1).

:func:`load_rows` gathers BK records and returns their values as float32 [BK, D], decoded with integer bit moves
only (no float8 types, so the same code runs under Triton's interpreter on the CPU): an E4M3 byte
``s eeee mmm`` is ``±m·2^-9`` when ``e = 0`` and the float32 with exponent ``e + 120`` and mantissa ``mmm``
otherwise; an E8M0 byte ``b`` is ``2^(b−127)`` (byte 0 is the float32 subnormal 2^-127); an E2M1 nibble
``s ee m`` is ``±m/2`` when ``e = 0`` and ``±(2 + m)·2^(e−2)`` otherwise. Each product code × scale is exact in
float32 and in bf16, so the kernels see the values :meth:`RecordFormat.decode` gives bit for bit.
"""

from __future__ import annotations

from ..cache.records import RecordFormat
from .dispatch import triton

# the ``FMT`` constexpr of :func:`load_rows`: 0 = plain rows in the cache's dtype
FORMAT_IDS = {"swa_fp8": 1, "ckv_fp4": 2, "idx_mxfp4": 3, "swa_v4": 4}


def format_id(record: RecordFormat | None) -> int:
    """The ``FMT`` value of :func:`load_rows` for ``record`` (None = plain rows)."""
    return 0 if record is None else FORMAT_IDS[record.kind]


def rope_dims(record: RecordFormat | None) -> int:
    """The ``ROPE`` value of :func:`load_rows` for ``record``."""
    return 0 if record is None else record.rope


if triton is not None:
    import triton.language as tl

    @triton.jit
    def e4m3_value(b):
        """int32 bytes 0..255 → float32 values of their FP8 E4M3 codes (finite codes)."""
        e = (b >> 3) & 15
        m = b & 7
        normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
        mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
        return tl.where((b & 128) != 0, -mag, mag)

    @triton.jit
    def e8m0_value(b):
        """int32 bytes 0..254 → float32 2^(b−127)."""
        return tl.where(b == 0, 0x00400000, b << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def e2m1_value(n):
        """int32 nibbles 0..15 → float32 values of their FP4 E2M1 codes."""
        e = (n >> 1) & 3
        m = n & 1
        scale = ((e + 125) << 23).to(tl.float32, bitcast=True)  # 2^(e − 2)
        mag = tl.where(e == 0, m.to(tl.float32) * 0.5, (2 + m).to(tl.float32) * scale)
        return tl.where((n & 8) != 0, -mag, mag)

    @triton.jit
    def load_rows(base_ptr, row_start, valid, D: tl.constexpr, FMT: tl.constexpr, ROPE: tl.constexpr):
        """Rows at element offsets ``row_start`` int64 [BK] of ``base_ptr`` (``valid`` [BK] bool; invalid rows
        give zeros) → float32 [BK, D]. FMT 0: D plain values; 1: ``swa_fp8`` (D E4M3 bytes, then an E8M0 byte
        per 32); 2: ``ckv_fp4`` (D/2 bytes of E2M1 pairs, low nibble first, then an E4M3 byte per 16);
        3: ``idx_mxfp4`` (D/2 bytes of E2M1 pairs, then an E8M0 byte per 32); 4: ``swa_v4`` (D − ROPE E4M3
        bytes, ROPE bf16 values, then an E8M0 byte per 64 coded dims)."""
        rd = tl.arange(0, D)
        at = base_ptr + row_start[:, None]
        mask = valid[:, None]
        if FMT == 0:
            out = tl.load(at + rd[None, :], mask=mask, other=0.0).to(tl.float32)
        elif FMT == 1:
            code = tl.load(at + rd[None, :], mask=mask, other=0).to(tl.int32)
            sb = tl.load(at + D + rd[None, :] // 32, mask=mask, other=0).to(tl.int32)
            out = e4m3_value(code) * e8m0_value(sb)
        elif FMT == 4:
            n: tl.constexpr = D - ROPE
            coded = (rd < n)[None, :]
            code = tl.load(at + rd[None, :], mask=mask & coded, other=0).to(tl.int32)
            sb = tl.load(at + n + 2 * ROPE + rd[None, :] // 64, mask=mask & coded, other=0).to(tl.int32)
            half = at + n + 2 * (rd[None, :] - n)  # the bf16 RoPE dims, little-endian byte pairs
            lo = tl.load(half, mask=mask & ~coded, other=0).to(tl.int32)
            hi = tl.load(half + 1, mask=mask & ~coded, other=0).to(tl.int32)
            bf = ((hi << 24) | (lo << 16)).to(tl.float32, bitcast=True)
            out = tl.where(coded, e4m3_value(code) * e8m0_value(sb), bf)
        else:
            byte = tl.load(at + rd[None, :] // 2, mask=mask, other=0).to(tl.int32)
            nib = (byte >> ((rd[None, :] % 2) * 4)) & 15
            if FMT == 2:
                sb = tl.load(at + D // 2 + rd[None, :] // 16, mask=mask, other=0).to(tl.int32)
                out = e2m1_value(nib) * e4m3_value(sb)
            else:
                sb = tl.load(at + D // 2 + rd[None, :] // 32, mask=mask, other=0).to(tl.int32)
                out = e2m1_value(nib) * e8m0_value(sb)
        return out
