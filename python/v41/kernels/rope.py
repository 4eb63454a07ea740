"""Interleaved ("GPT-J") rotary embedding of the last ``rd`` channels (docs/model.md §2): channel pairs
``(2i, 2i+1)`` of that slice rotate by the token's angle ``θ_i`` (``inverse``: by ``−θ_i``); the other channels pass
through. cos/sin come precomputed per token [T, rd/2] (formed in float64, used in float32 or float64). The Triton
kernel writes each output row in one pass (one program per token and head); :func:`rope_` rotates in place, reading
and writing the rotated columns only."""

from __future__ import annotations

import torch
from torch import Tensor

from .dispatch import TRITON_DTYPES, triton, use_triton
from .norm import rms_norm_ref
from .pdl import triton_kw


def rope_ref(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool = False) -> Tensor:
    """x [T, ..., d]; cos, sin [T, rd/2] → x's shape and dtype."""
    half = cos.shape[-1]
    rd = 2 * half
    ctype = torch.float64 if x.dtype == torch.float64 else torch.float32
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    c, s = cos.to(ctype).view(shape), sin.to(ctype).view(shape)
    if inverse:
        s = -s
    r = x[..., -rd:].to(ctype)
    even, odd = r[..., 0::2], r[..., 1::2]
    rot = torch.stack((even * c - odd * s, even * s + odd * c), dim=-1).flatten(-2)
    return torch.cat([x[..., :-rd], rot.to(x.dtype)], dim=-1)


def rope(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool = False) -> Tensor:
    """:func:`rope_ref` as one Triton launch where :func:`.dispatch.use_triton` says so."""
    if x.dtype not in TRITON_DTYPES or x.numel() == 0 or not use_triton(x):
        return rope_ref(x, cos, sin, inverse)
    xc = x.contiguous()
    out = torch.empty_like(xc)
    t, d = xc.shape[0], xc.shape[-1]
    rows_per_t = xc.numel() // (t * d)
    _rope_kernel[(t, rows_per_t)](xc, out, cos.float().contiguous(), sin.float().contiguous(), rows_per_t, d,
                                  cos.shape[-1], -1.0 if inverse else 1.0, BLOCK=triton.next_power_of_2(d),
                                  **triton_kw(xc.device))
    return out


# Rows (heads) of one token that one :func:`rope_` program rotates: one row per program was 524,288 programs of
# 64 columns for an 8,192-token query (6.3 ms in 22 launches of the prefill, ~9× their bytes; benches/RESULTS.md
# "2026-12-04 (night)").
ROPE_COLS_ROWS = 16


def rope_(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool = False) -> Tensor:
    """:func:`rope` in place: x [T, ..., d] (bf16 / fp16 / float32; the Triton kernel needs it contiguous), cos, sin
    [T, rd/2]; x's last ``rd`` columns rotated, the others left where they are (at prefill the query
    [T, 64, 512] was copied whole to rotate its last 64 columns: 7.6 ms of an 8,192-token flash-slice-v41 prefill,
    benches/RESULTS.md "2026-12-04 (evening)"); one Triton launch reading and writing only those columns (the same
    bits as :func:`rope`: the same rotation helper) where :func:`.dispatch.use_triton` says so and x is contiguous.
    Returns x."""
    if x.dtype not in TRITON_DTYPES or x.numel() == 0 or not x.is_contiguous() or not use_triton(x):
        rot = x[..., -2 * cos.shape[-1]:]  # every column of this view rotates
        rot.copy_(rope_ref(rot, cos, sin, inverse))
        return x
    t, d, half = x.shape[0], x.shape[-1], cos.shape[-1]
    rows_per_t = x.numel() // (t * d)
    rows = min(triton.next_power_of_2(rows_per_t), ROPE_COLS_ROWS)
    _rope_cols_kernel[(t, triton.cdiv(rows_per_t, rows))](
        x, cos.float().contiguous(), sin.float().contiguous(), rows_per_t, d, half, -1.0 if inverse else 1.0,
        BLOCK=triton.next_power_of_2(2 * half), ROWS_PER_PROGRAM=rows, **triton_kw(x.device))
    return x


def rms_norm_rope_ref(x: Tensor, eps: float, weight: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``rope_ref(rms_norm_ref(x, eps, weight), cos, sin)``: x [T, D]; weight [D]; cos, sin [T, rd/2] → [T, D] in
    x's dtype (the normalized row is rounded to x's dtype before it is rotated, as the two ops do)."""
    return rope_ref(rms_norm_ref(x, eps, weight), cos, sin)


def rms_norm_rope(x: Tensor, eps: float, weight: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """:func:`rms_norm_rope_ref` in one Triton launch (one program per row: the RMSNorm's reduction as
    :func:`.norm.rms_norm` runs it, the rotation as :func:`rope` does, so the bits are those of the two launches)
    where :func:`.dispatch.use_triton` says so; a cache write's prologue (kv_norm, the index keys' k_norm). x may be
    a view of whole rows' columns (unit column stride): read in place; the result is contiguous."""
    if (x.dim() != 2 or x.dtype not in TRITON_DTYPES or x.numel() == 0 or x.shape[-1] > 16384
            or not use_triton(x, weight)):
        return rms_norm_rope_ref(x, eps, weight, cos, sin)
    xc = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    t, d = xc.shape
    _norm_rope_kernel[(t,)](xc, out, weight, cos.float().contiguous(), sin.float().contiguous(), d, xc.stride(0),
                            cos.shape[-1], float(eps), BLOCK=triton.next_power_of_2(d), **triton_kw(xc.device))
    return out


def angle_tables_ref(pos: Tensor, inv_freq: Tensor, dtype: torch.dtype, scale: int = 1) -> tuple[Tensor, Tensor]:
    """RoPE's (cos, sin) [T, H] in ``dtype`` of the angles ``(pos·scale)·inv_freq`` formed in float64 (positions up to
    1M need it): pos [T] int64, inv_freq [H] float64, ``scale`` an integer factor of the positions (a compressed
    entry's first position ``j·ratio``)."""
    angles = (pos * scale).to(torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def angle_tables(pos: Tensor, inv_freq: Tensor, dtype: torch.dtype, scale: int = 1) -> tuple[Tensor, Tensor]:
    """:func:`angle_tables_ref` in one Triton launch (float32 tables) where :func:`.dispatch.use_triton` says so;
    about six PyTorch launches per table pair before (cast, product, cos, sin, two casts). The same float64 product
    and rounding to float32; cos / sin are libdevice's, which PyTorch's CUDA kernels call too (``check_angle_tables``
    bounds the tables against float64)."""
    t, h = pos.shape[0], inv_freq.shape[0]
    if dtype != torch.float32 or t == 0 or not use_triton(pos):
        return angle_tables_ref(pos, inv_freq, dtype, scale)
    cos = torch.empty(t, h, dtype=dtype, device=pos.device)
    sin = torch.empty_like(cos)
    _angles_kernel[(t,)](pos.contiguous(), inv_freq.contiguous(), cos, sin, h, scale,
                         BLOCK=triton.next_power_of_2(h), **triton_kw(pos.device))
    return cos, sin


if triton is not None:
    import triton.language as tl
    from .norm import rms_row
    from .pdl import prologue

    @triton.jit
    def rotate_pairs(x, xp, c, s, odd, rot):
        """Channel values x with their pair partners xp (float32) rotated where ``rot``: ``x·c ∓ xp·s`` as one
        explicit FMA over the rounded ``xp·(±s)``, shared by every kernel here so each gives the same bits whatever
        its tile shape (left to the compiler, the 2-D tiles of :func:`rope_` contracted it the other way round)."""
        return tl.where(rot, tl.fma(x, c, xp * tl.where(odd, s, -s)), x)

    @triton.jit
    def _rope_cols_kernel(x_ptr, cos_ptr, sin_ptr, ROWS, D, HALF, sign, BLOCK: tl.constexpr,
                          ROWS_PER_PROGRAM: tl.constexpr, PDL: tl.constexpr):
        prologue(PDL)
        t = tl.program_id(0)
        h = tl.program_id(1) * ROWS_PER_PROGRAM + tl.arange(0, ROWS_PER_PROGRAM)[:, None]  # rows (heads) of token t
        start = D - 2 * HALF
        base = (t.to(tl.int64) * ROWS + h) * D + start
        j = tl.arange(0, BLOCK)[None, :]  # column start + j; pairs (2i, 2i+1) stay in this program's columns
        rot = j < 2 * HALF
        m = rot & (h < ROWS)
        x = tl.load(x_ptr + base + j, mask=m, other=0.0).to(tl.float32)
        xp = tl.load(x_ptr + base + (j ^ 1), mask=m, other=0.0).to(tl.float32)
        c = tl.load(cos_ptr + t * HALF + j // 2, mask=rot, other=1.0)
        s = tl.load(sin_ptr + t * HALF + j // 2, mask=rot, other=0.0) * sign
        y = rotate_pairs(x, xp, c, s, j % 2 == 1, rot)
        tl.store(x_ptr + base + j, y.to(x_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _norm_rope_kernel(x_ptr, y_ptr, w_ptr, cos_ptr, sin_ptr, D, stride_x, HALF, eps, BLOCK: tl.constexpr,
                          PDL: tl.constexpr):
        prologue(PDL)
        t, cols, mask, x, r = rms_row(x_ptr, stride_x, D, eps, BLOCK)  # _rms_kernel's row and scale: its bits
        y = (x * r * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)).to(y_ptr.dtype.element_ty)
        start = D - 2 * HALF
        rot = (cols >= start) & mask
        pair = tl.where(rot, cols ^ 1, cols)
        xp = tl.load(x_ptr + t * stride_x + pair, mask=rot, other=0.0).to(tl.float32)
        yp = (xp * r * tl.load(w_ptr + pair, mask=rot, other=0.0).to(tl.float32)).to(y_ptr.dtype.element_ty)
        i = tl.where(rot, (cols - start) // 2, 0)
        c = tl.load(cos_ptr + t * HALF + i, mask=rot, other=1.0)
        s = tl.load(sin_ptr + t * HALF + i, mask=rot, other=0.0)
        odd = (cols - start) % 2 == 1
        out = rotate_pairs(y.to(tl.float32), yp.to(tl.float32), c, s, odd, rot)
        tl.store(y_ptr + t * D + cols, out.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rope_kernel(x_ptr, y_ptr, cos_ptr, sin_ptr, ROWS, D, HALF, sign, BLOCK: tl.constexpr, PDL: tl.constexpr):
        prologue(PDL)
        t, h = tl.program_id(0), tl.program_id(1)
        base = (t.to(tl.int64) * ROWS + h) * D
        cols = tl.arange(0, BLOCK)
        mask = cols < D
        x = tl.load(x_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
        start = D - 2 * HALF
        rot = (cols >= start) & mask
        pair = tl.where(rot, cols ^ 1, cols)  # start is even: pairs (2i, 2i+1) of the slice stay pairs
        xp = tl.load(x_ptr + base + pair, mask=rot, other=0.0).to(tl.float32)
        i = tl.where(rot, (cols - start) // 2, 0)
        c = tl.load(cos_ptr + t * HALF + i, mask=rot, other=1.0)
        s = tl.load(sin_ptr + t * HALF + i, mask=rot, other=0.0) * sign
        odd = (cols - start) % 2 == 1
        y = rotate_pairs(x, xp, c, s, odd, rot)
        tl.store(y_ptr + base + cols, y.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _angles_kernel(pos_ptr, freq_ptr, cos_ptr, sin_ptr, H, scale, BLOCK: tl.constexpr, PDL: tl.constexpr):
        prologue(PDL)
        t = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < H
        p = (tl.load(pos_ptr + t) * scale).to(tl.float64)
        ang = p * tl.load(freq_ptr + cols, mask=mask, other=0.0)
        tl.store(cos_ptr + t * H + cols, tl.cos(ang).to(tl.float32), mask=mask)
        tl.store(sin_ptr + t * H + cols, tl.sin(ang).to(tl.float32), mask=mask)
