"""Writing cache records in one launch (``--kv-cache-dtype fp8``; the layouts are :mod:`v41.cache.records`,
docs/model.md §6): :func:`store_records` encodes rows and stores the bytes at their cache slots, and
:func:`mxfp4_qdq_rows` rounds the index queries to MXFP4 the same way. The PyTorch encoder takes about 25 small
kernels per write; on a GPU that was most of a decode step's cost (benches/RESULTS.md).

Every rounding is done with float32 adds, correctly rounded divisions (``tl.math.div_rn``: Triton's ``/`` is an
approximate division on NVIDIA GPUs) and integer bit moves, so the Triton kernels give the bytes of
:meth:`RecordFormat.encode` bit for bit (also under Triton's interpreter):

* a power-of-two scale ``2^ceil(log2 v)`` (v a positive normal float32) has E8M0 byte ``exponent(v) + [mantissa(v)
  ≠ 0]``;
* E4M3 round-to-nearest-even of ``0 ≤ v ≤ 448``: at or above 2^-6 the float32 mantissa is rounded to 3 bits by
  adding ``0x7FFFF + lsb`` to the bits and clearing the low 20; below, ``(v + 2^14) − 2^14`` is the float32 add's own
  rounding to a multiple of 2^-9 (the subnormal step); the byte is ``(exponent − 120) << 3 | mantissa`` or
  ``v · 512`` (8 · 2^-9 = 2^-6 has the same byte either way);
* E2M1 codes by the midpoint comparisons of :func:`v41.quant.e2m1_codes`; bf16 (V4's RoPE dims) by rounding the
  float32 bits to their upper 16, to nearest even.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import quant
from ..cache.records import RecordFormat
from .dispatch import TRITON_DTYPES, triton, use_triton
from .norm import rms_norm
from .pdl import triton_kw
from .paged import scatter_rows
from .records import format_id
from .rope import rms_norm_rope, rope as rope_rows


def prepare_rows(rows: Tensor, norm: tuple[Tensor, float] | None = None,
                 rope: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """What a cache write stores for ``rows`` [n, dims]: ``rope(rms_norm(rows, eps, weight), cos, sin)`` with
    ``norm`` = (weight [dims], eps) and ``rope`` = (cos, sin) [n, rd/2] (:func:`.rope.rms_norm_rope`, :func:`.rope.rope`,
    :func:`.norm.rms_norm`), each step only where given; rows as they are when neither is."""
    if norm is not None and rope is not None:
        return rms_norm_rope(rows, norm[1], norm[0], *rope)
    if norm is not None:
        return rms_norm(rows, norm[1], norm[0])
    return rope_rows(rows, *rope) if rope is not None else rows


def store_records(cache: Tensor, slots: Tensor, rows: Tensor, record: RecordFormat, dummy_slot: int,
                  index: Tensor | None = None, norm: tuple[Tensor, float] | None = None,
                  rope: tuple[Tensor, Tensor] | None = None) -> None:
    """Encode ``prepare_rows(rows, norm, rope)`` ([n, dims], float) as ``record`` and store them at ``slots`` [n] (or
    ``slots[index]``) of ``cache`` uint8 [num_slots, record.nbytes]; slot −1 (or index −1) writes nothing. One Triton launch
    where :func:`.dispatch.use_triton` says so — the RMSNorm and RoPE computed in it with the bits of their own
    kernels (``rows`` may then be a view of whole rows' columns) — else :func:`prepare_rows`,
    :meth:`RecordFormat.encode` and :func:`~v41.kernels.paged.scatter_rows`."""
    n = rows.shape[0]
    if (n == 0 or rows.dtype not in TRITON_DTYPES or not use_triton(cache, rows) or not cache.is_contiguous()
            or (norm is not None and record.dims > 16384)):
        scatter_rows(cache, slots, record.encode(prepare_rows(rows, norm, rope)), dummy_slot, index=index)
        return
    src = rows.reshape(n, record.dims)
    if src.stride(-1) != 1:
        src = src.contiguous()
    coded = record.dims - record.rope
    nb = -(-coded // record.block)
    weight, eps = norm if norm is not None else (src, 0.0)
    cos, sin = (r.float().contiguous() for r in rope) if rope is not None else (src, src)
    _encode_kernel[(n,)](cache, slots, slots if index is None else index, src, cache.stride(0), src.stride(0),
                         weight, cos, sin, float(eps), cos.shape[-1] if rope is not None else 0,
                         INDEXED=index is not None, FMT=format_id(record), CODED=coded, ROPE=record.rope,
                         BS=record.block, NB=triton.next_power_of_2(nb),
                         RP=triton.next_power_of_2(max(record.rope, 1)), SCALES=record.code_bytes + 2 * record.rope,
                         NORM=norm is not None, ROT=rope is not None, DB=triton.next_power_of_2(record.dims),
                         **triton_kw(cache.device))


def mxfp4_qdq_rows(x: Tensor, rope: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """:func:`v41.quant.mxfp4_qdq` with blocks of 32 over the last dim (a multiple of 32) of x [T, ..., d], after
    ``rope`` = (cos, sin) [T, rd/2] where given (:func:`.rope.rope`: the index queries), in one Triton launch where
    :func:`.dispatch.use_triton` says so (the rotation with its bits). Returns x's shape and dtype."""
    d = x.shape[-1]
    if x.numel() == 0 or d % 32 or x.dtype not in TRITON_DTYPES or not use_triton(x):
        return quant.mxfp4_qdq(x if rope is None else rope_rows(x, *rope), 32)
    src = x.reshape(-1, d).contiguous()
    out = torch.empty_like(src)
    cos, sin = (r.float().contiguous() for r in rope) if rope is not None else (src, src)
    _mxfp4_qdq_kernel[(src.shape[0],)](src, out, cos, sin, src.shape[0] // x.shape[0], cos.shape[-1] if rope else 0,
                                       NB=triton.next_power_of_2(d // 32), NBLK=d // 32, ROT=rope is not None,
                                       **triton_kw(src.device))
    return out.view(x.shape)


if triton is not None:
    import triton.language as tl
    from .pdl import prologue

    from .norm import rms_scale
    from .records import e2m1_value
    from .rope import rotate_pairs

    @triton.jit
    def _pow2_ceil_byte(v):
        """E8M0 byte of ``2^ceil(log2 v)`` for positive normal float32 ``v`` (int32)."""
        bits = v.to(tl.int32, bitcast=True)
        return ((bits >> 23) & 255) + ((bits & 0x7FFFFF) != 0).to(tl.int32)

    @triton.jit
    def _e4m3_round(v):
        """float32 ``0 ≤ v ≤ 448`` → (E4M3 byte without sign as int32, its value as float32), nearest even."""
        bits = v.to(tl.int32, bitcast=True)
        rb = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576
        sub = (v + 16384.0) - 16384.0
        normal = v >= 0.015625
        byte = tl.where(normal, (((rb >> 23) - 120) << 3) | ((rb >> 20) & 7), (sub * 512.0).to(tl.int32))
        return byte, tl.where(normal, rb.to(tl.float32, bitcast=True), sub)

    @triton.jit
    def _e2m1_code(q):
        """Nearest E2M1 code (ties to even, saturating; bit 3 = sign) of float32 ``q`` (int32)."""
        a = tl.abs(q)
        mag = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
               + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32))
        return mag | ((q.to(tl.int32, bitcast=True) < 0).to(tl.int32) << 3)

    @triton.jit
    def _row_values(row, cols, ok, r, w_ptr, c_ptr, s_ptr, D, HALF, NORM: tl.constexpr, ROT: tl.constexpr):
        """float32 values at ``cols`` (any shape; 0 where not ``ok``) of the row to store: x, RMS-normed by the
        scale ``r`` and weight, then rotated (pairs (2i, 2i + 1) of the last 2·HALF of D columns) — each step
        rounded to x's dtype as :func:`.rope.rms_norm_rope` / :func:`.rope.rope` round, with their rotation."""
        x = tl.load(row + cols, mask=ok, other=0.0)
        y = x.to(tl.float32)
        if NORM:
            y = (y * r * tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)).to(x.dtype).to(tl.float32)
        if ROT:
            start = D - 2 * HALF
            rot = (cols >= start) & ok
            pair = tl.where(rot, cols ^ 1, cols)
            yp = tl.load(row + pair, mask=rot, other=0.0).to(tl.float32)
            if NORM:
                yp = (yp * r * tl.load(w_ptr + pair, mask=rot, other=0.0).to(tl.float32)).to(x.dtype).to(tl.float32)
            k = tl.where(rot, (cols - start) // 2, 0)
            c = tl.load(c_ptr + k, mask=rot, other=1.0)
            s = tl.load(s_ptr + k, mask=rot, other=0.0)
            y = rotate_pairs(y, yp, c, s, (cols - start) % 2 == 1, rot).to(x.dtype).to(tl.float32)
        return y

    @triton.jit
    def _encode_kernel(cache_ptr, slots_ptr, index_ptr, src_ptr, stride_c, stride_s, w_ptr, cos_ptr, sin_ptr, eps,
                       HALF, INDEXED: tl.constexpr, FMT: tl.constexpr, CODED: tl.constexpr, ROPE: tl.constexpr,
                       BS: tl.constexpr, NB: tl.constexpr, RP: tl.constexpr, SCALES: tl.constexpr,
                       NORM: tl.constexpr, ROT: tl.constexpr, DB: tl.constexpr, PDL: tl.constexpr):
        prologue(PDL)
        i = tl.program_id(0)
        j = tl.load(index_ptr + i) if INDEXED else i
        slot = tl.load(slots_ptr + j, mask=j >= 0, other=-1)
        if slot >= 0:
            row = src_ptr + i.to(tl.int64) * stride_s
            dst = cache_ptr + slot * stride_c
            blk = tl.arange(0, NB)
            dims = CODED + ROPE
            r = 1.0
            if NORM:  # the RMSNorm's scale from the whole row, reduced as its own kernel reduces it
                whole = tl.arange(0, DB)
                r = rms_scale(tl.load(row + whole, mask=whole < dims, other=0.0).to(tl.float32), dims, eps)
            c_row = cos_ptr + i.to(tl.int64) * HALF
            s_row = sin_ptr + i.to(tl.int64) * HALF
            if FMT == 1 or FMT == 4:  # FP8 codes, E8M0 scale per BS
                col = blk[:, None] * BS + tl.arange(0, BS)[None, :]
                ok = col < CODED
                x = _row_values(row, col, ok, r, w_ptr, c_row, s_row, dims, HALF, NORM, ROT)
                amax = tl.max(tl.abs(x), axis=1)
                sb = _pow2_ceil_byte(tl.maximum(tl.math.div_rn(amax, 448.0), 1e-4))
                q = tl.math.div_rn(x, (sb << 23).to(tl.float32, bitcast=True)[:, None])
                code, _ = _e4m3_round(tl.abs(q))
                code = code | ((q.to(tl.int32, bitcast=True) < 0).to(tl.int32) << 7)
                tl.store(dst + col, code.to(tl.uint8), mask=ok)
            else:  # FP4 pairs (even dim in the low nibble); E4M3 scale per 16 (FMT 2) or E8M0 per 32 (FMT 3)
                pair = blk[:, None] * (BS // 2) + tl.arange(0, BS // 2)[None, :]
                ok = pair < CODED // 2
                xe = _row_values(row, 2 * pair, ok, r, w_ptr, c_row, s_row, dims, HALF, NORM, ROT)
                xo = _row_values(row, 2 * pair + 1, ok, r, w_ptr, c_row, s_row, dims, HALF, NORM, ROT)
                amax = tl.maximum(tl.max(tl.abs(xe), axis=1), tl.max(tl.abs(xo), axis=1))
                if FMT == 2:
                    sb, s = _e4m3_round(tl.minimum(tl.maximum(tl.math.div_rn(amax, 6.0), 0.001953125), 448.0))
                else:
                    sb = _pow2_ceil_byte(tl.math.div_rn(tl.maximum(amax, 1e-30), 6.0))
                    s = (sb << 23).to(tl.float32, bitcast=True)
                code = _e2m1_code(tl.math.div_rn(xe, s[:, None])) | (_e2m1_code(tl.math.div_rn(xo, s[:, None])) << 4)
                tl.store(dst + pair, code.to(tl.uint8), mask=ok)
            nbytes_codes: tl.constexpr = SCALES - 2 * ROPE
            tl.store(dst + SCALES + blk, sb.to(tl.uint8), mask=blk * BS < CODED)
            if ROPE > 0:  # V4: the RoPE dims as bf16, little-endian, between the codes and the scales
                rc = tl.arange(0, RP)
                rok = rc < ROPE
                bits = _row_values(row, CODED + rc, rok, r, w_ptr, c_row, s_row, dims, HALF, NORM, ROT).to(
                    tl.int32, bitcast=True)
                hi16 = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
                tl.store(dst + nbytes_codes + 2 * rc, (hi16 & 255).to(tl.uint8), mask=rok)
                tl.store(dst + nbytes_codes + 2 * rc + 1, ((hi16 >> 8) & 255).to(tl.uint8), mask=rok)

    @triton.jit
    def _mxfp4_qdq_kernel(src_ptr, out_ptr, cos_ptr, sin_ptr, ROWS, HALF, NB: tl.constexpr, NBLK: tl.constexpr,
                          ROT: tl.constexpr, PDL: tl.constexpr):
        """Program (row i of ROWS per token): its MXFP4 round trip, rotated first with ROT (token i // ROWS)."""
        prologue(PDL)
        i = tl.program_id(0).to(tl.int64)
        blk = tl.arange(0, NB)
        col = blk[:, None] * 32 + tl.arange(0, 32)[None, :]
        ok = blk[:, None] < NBLK
        x = tl.load(src_ptr + i * NBLK * 32 + col, mask=ok, other=0.0)
        t = i // ROWS
        xf = _row_values(src_ptr + i * NBLK * 32, col, ok, 1.0, src_ptr, cos_ptr + t * HALF, sin_ptr + t * HALF,
                         NBLK * 32, HALF, False, ROT)
        s = (_pow2_ceil_byte(tl.math.div_rn(tl.maximum(tl.max(tl.abs(xf), axis=1), 1e-30), 6.0)) << 23).to(
            tl.float32, bitcast=True)
        y = e2m1_value(_e2m1_code(tl.math.div_rn(xf, s[:, None]))) * s[:, None]
        tl.store(out_ptr + i * NBLK * 32 + col, y.to(x.dtype), mask=ok)
