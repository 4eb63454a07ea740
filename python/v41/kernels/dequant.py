"""Packed weights dequantized in one launch: an FP8 block-scaled weight (docs/kernels.md §2 "Dense FP8 GEMMs": the
prefill path dequantizes each dense weight once per call and uses the BLAS GEMM), and a run of MXFP4 experts into
bf16 (:func:`dequantize_experts`, the MoE prefill path of :mod:`.moe_prefill`).

:meth:`.packed.PackedWeight.dequantize` forms ``fp8 → float32``, the scale tiles expanded to the weight's shape
twice (``repeat_interleave`` per dim), the product and the cast: five full-size passes, about 30 bytes moved per
weight element. In an 8,192-token flash-slice-v41 prefill those copies and products were ~15 ms of 419
(benches/RESULTS.md "2026-12-04 (evening)"). :func:`dequantize` reads the FP8 byte and its tile's scale and writes
the result: 1 + 2 bytes per element for a bf16 weight. The same float32 product and rounding as the PyTorch form,
so the same bits (``check_linear``'s ``dequant/…`` cases).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import quant
from .dispatch import triton, use_triton
from .packed import PackedWeight
from .pdl import triton_kw

BN, BK = 32, 128  # one program's tile of the weight


def dequantize(w: PackedWeight, dtype: torch.dtype) -> Tensor:
    """``w.dequantize(dtype)``: the dense ``[out, in]`` weight, in one Triton launch for a 2-D FP8 weight where
    :func:`.dispatch.use_triton` says so (bf16 / fp16 / float32 results), else the PyTorch form. Raises as
    :meth:`.packed.PackedWeight.dequantize` does."""
    if (w.fmt != "fp8" or w.data.dim() != 2 or w.data.numel() == 0 or w.data.stride(1) != 1
            or dtype not in (torch.bfloat16, torch.float16, torch.float32) or not use_triton(w.data)):
        return w.dequantize(dtype)
    n, k = w.data.shape
    scale = quant.e8m0_to_float(w.scale).contiguous()  # [⌈n / b0⌉, ⌈k / b1⌉] float32, exact powers of two
    out = torch.empty(n, k, dtype=dtype, device=w.data.device)
    _fp8_kernel[(triton.cdiv(n, BN), triton.cdiv(k, BK))](
        w.data, scale, out, n, k, w.data.stride(0), scale.stride(0), B0=w.block[0], B1=w.block[1], BN=BN, BK=BK,
        **triton_kw(out.device))
    return out


def dequantize_experts(w: PackedWeight, start: int, stop: int, out: Tensor, programs: int = 0) -> Tensor:
    """Experts ``start .. stop`` of an MXFP4 ``[E, N, K]`` weight into ``out[:stop − start]`` (bf16 / fp16 / float32
    ``[≥ stop − start, N, K]``, contiguous), exact: ``e2m1 · 2^(byte − 127)`` (:func:`v41.quant.dequant_mxfp4`; a
    scale byte 255, NaN there, gives ±inf or NaN here). One Triton launch where :func:`.dispatch.use_triton` says so,
    else the PyTorch form: a program per tile of ``BN × BK``, or with ``programs`` > 0 at most that many programs,
    each looping over tiles (so the launch leaves the other SMs to a GEMM beside it; the same bits). Returns
    ``out``. Raises ValueError for another format or a wrong ``out``."""
    if w.fmt != "mxfp4" or w.data.dim() != 3:
        raise ValueError(f"dequantize_experts takes a 3-D mxfp4 weight, got {w.fmt} {tuple(w.data.shape)}")
    e, n, k = w.shape
    if not 0 <= start <= stop <= e or out.dim() != 3 or out.shape[0] < stop - start or tuple(out.shape[1:]) != (n, k) \
            or not out.is_contiguous():
        raise ValueError(f"experts {start}..{stop} of {e} into out {tuple(out.shape)}: expected a contiguous "
                         f"[>= {stop - start}, {n}, {k}] tensor")
    if stop == start:
        return out
    part = PackedWeight(w.data[start:stop], w.scale[start:stop], w.fmt, w.block)
    if out.dtype not in (torch.bfloat16, torch.float16, torch.float32) or w.data.stride(-1) != 1 \
            or w.scale.stride(-1) != 1 \
            or not use_triton(w.data, out):
        out[:stop - start] = part.dequantize(out.dtype)
        return out
    tiles = (stop - start) * triton.cdiv(n, BN) * triton.cdiv(k, BK)
    _mxfp4_kernel[(min(tiles, programs) if programs > 0 else tiles,)](
        part.data, part.scale, out, n, k, tiles, part.data.stride(0), part.data.stride(1), part.scale.stride(0),
        part.scale.stride(1), BN=BN, BK=BK, **triton_kw(out.device))
    return out


if triton is not None:
    import triton.language as tl
    from .pdl import prologue
    from .wtile import w_tile

    @triton.jit
    def _fp8_kernel(w_ptr, s_ptr, out_ptr, N, K, stride_wn, stride_sn, B0: tl.constexpr, B1: tl.constexpr,
                    BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr):
        prologue(PDL)
        rn = tl.program_id(0) * BN + tl.arange(0, BN)
        rk = tl.program_id(1) * BK + tl.arange(0, BK)
        mask = (rn < N)[:, None] & (rk < K)[None, :]
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :], mask=mask, other=0.0)
        s = tl.load(s_ptr + (rn // B0)[:, None] * stride_sn + (rk // B1)[None, :], mask=mask, other=0.0)
        tl.store(out_ptr + rn[:, None].to(tl.int64) * K + rk[None, :],
                 (w.to(tl.float32) * s).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _mxfp4_kernel(w_ptr, s_ptr, out_ptr, N, K, TILES, stride_we, stride_wn, stride_se, stride_sn,
                      BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr):
        """Tiles (expert, row block, column block) in that order, program p taking p, p + programs, …"""
        prologue(PDL)
        n_blocks, k_blocks = tl.cdiv(N, BN), tl.cdiv(K, BK)
        for tile in range(tl.program_id(0), TILES, tl.num_programs(0)):
            e = (tile // (n_blocks * k_blocks)).to(tl.int64)
            rn = (tile // k_blocks) % n_blocks * BN + tl.arange(0, BN)
            k0 = tile % k_blocks * BK
            nmask = rn < N
            w = w_tile(w_ptr + e * stride_we, s_ptr + e * stride_se, rn, k0, nmask, stride_wn, stride_sn, K, 1, 32,
                       BK, 2, out_ptr.dtype.element_ty)  # the GEMM kernels' tile: e2m1 × 2^(byte − 127) in float32
            rk = k0 + tl.arange(0, BK)
            tl.store(out_ptr + (e * N + rn[:, None]) * K + rk[None, :], w, mask=nmask[:, None] & (rk < K)[None, :])
