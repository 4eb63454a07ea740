"""Linear layer over a packed weight: ``y = x · Wᵀ`` with W dequantized inside the kernel (W8A16 for FP8
block-scaled weights, plain for dense ones; docs/model.md §2, docs/kernels.md §2 "Dense FP8 GEMMs").

``groups`` > 1 is the block-diagonal grouped projection of attention's ``wo_a`` (§3.5 step 7): W ``[G·N_g, K_g]``,
x ``[M, G·K_g]``, output group g reads only input columns ``[g·K_g, (g+1)·K_g)``.

The Triton kernel streams weight tiles (each program: a ``BM × BN`` output tile over a slice of K). When too few
output tiles exist to fill the GPU it splits K: each program writes its float32 partial tile, and where the
partials of a tile are small (``SPLIT_REDUCE_BYTES``) the last program of the tile to arrive (an arrival counter it
resets, :func:`.wstream.split_counters`) sums them in a fixed order and writes the output — one launch, not kernel +
sum + cast; larger partials are summed by one parallel float32 sum after the kernel (one program summing them
alone was slower: benches/RESULTS.md "2026-12-03 (ring and CUDA scorer)"). Either way the result never depends on
timing. It serves small M (decode, the LM head's sampled rows); larger M dequantizes the weight once per call and
uses the BLAS GEMM.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import wstream
from .dequant import dequantize
from .dispatch import TRITON_DTYPES, dot_dtype, kernel_mode, triton, use_cuda, use_triton
from .pdl import triton_kw
from .packed import PackedWeight

# Above this many rows the dequantize + BLAS path wins (compute-bound prefill chunks). 512, not 256: speculative
# verify steps and draft passes of 257..512 rows paid ~1.4x for the dequantization (benches/RESULTS.md 2026-12-02,
# flash-slice-v41 + drafter: B = 64 draft pass 26.6 -> 13.6 ms, verify of 6 rows per request 94.1 -> 68.9 ms).
TRITON_MAX_M = 512
TARGET_PROGRAMS = 264  # ~2 waves of an H200's 132 SMs
# Split-K partials (of the rows present) a tile's last program sums in the kernel, at most; above, a float32 sum
# after the kernel (measured on the H200 at 64 rows: 208–528 KB per tile summed in the kernel lost 1.5–5 µs to the
# sum after; 32–64 KB won)
SPLIT_REDUCE_BYTES = 128 << 10
# Weight bytes per split-K program at least: on the H200 the indexer's weights_proj [32, 5120] (one tile, 40 slices
# of 8 KB) took 9.4 µs with the sum in the kernel, 5.6 µs summed after it (glue_bench.py, benches/RESULTS.md
# "2026-12-04 (afternoon)"): slices that read little leave the tile's last program a long sum.
MIN_SLICE_BYTES = 64 << 10


def linear_ref(x: Tensor, w: PackedWeight, out_dtype: torch.dtype | None = None, groups: int = 1) -> Tensor:
    """Reference: x ``[M, G·K_g]`` (float), w ``[G·N_g, K_g]`` → ``[M, G·N_g]`` in ``out_dtype`` (default x's).
    Computed in x's dtype (bf16 GEMMs accumulate in float32), or in float32 when ``out_dtype`` is wider."""
    out_dtype = out_dtype or x.dtype
    return _dense_linear(x, w.dequantize(torch.promote_types(x.dtype, out_dtype)), out_dtype, groups)


def _dense_linear(x: Tensor, wd: Tensor, out_dtype: torch.dtype, groups: int) -> Tensor:
    """:func:`linear_ref` over the dequantized weight ``wd`` (in the compute dtype) by the BLAS GEMM."""
    xc = x.to(wd.dtype)
    if groups == 1:
        return F.linear(xc, wd).to(out_dtype)
    m = x.shape[0]
    y = torch.einsum("mgk,gnk->mgn", xc.view(m, groups, -1), wd.view(groups, -1, wd.shape[-1]))
    return y.reshape(m, -1).to(out_dtype)


def linear(x: Tensor, w: PackedWeight, out_dtype: torch.dtype | None = None, groups: int = 1) -> Tensor:
    """:func:`linear_ref`, as the CUDA weight-streaming kernel where :func:`.dispatch.use_cuda` says so and it
    takes the shapes (:func:`.wstream.linear`: bf16, at most ``wstream.MAX_ROWS`` rows, fp8 or mxfp4 weights), else
    as the Triton kernel where
    :func:`.dispatch.use_triton` says so (2-D weights in fp8 or dense format, at most ``TRITON_MAX_M`` rows,
    bf16/fp16/fp32 activations), else (CUDA, bf16 / fp16 x and weight, float32 output) the BLAS GEMM with a float32
    output, else (FP8 weights where Triton runs) the weight dequantized in one launch and the BLAS GEMM, else the
    reference."""
    if use_cuda(x, w.data):
        y = wstream.linear(x, w, out_dtype or x.dtype, groups)
        if y is not None:
            return y
    if (0 < x.shape[0] <= TRITON_MAX_M and x.dtype in TRITON_DTYPES and w.fmt in ("fp8", "dense")
            and w.data.dim() == 2 and use_triton(x, w.data)):
        return _linear_triton(x, w, out_dtype or x.dtype, groups)
    if (out_dtype == torch.float32 and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and x.dim() == 2
            and groups == 1 and w.fmt == "dense" and w.data.dim() == 2 and w.data.dtype == x.dtype
            and kernel_mode() != "torch"):  # "torch": the reference, as for every op
        # Prefill rows with a float32 output over bf16 weights (router gate, compressors, indexer weights): the BLAS
        # GEMM in x's dtype with a float32 output. A product of two bf16 numbers is exact in float32, so this is
        # linear_ref's float32 GEMM up to the order of the float32 sums, on tensor cores (the float32 GEMMs took
        # 11 ms of an 8,192-token flash-slice-v41 prefill: benches/RESULTS.md "2026-12-04 (evening)").
        return torch.mm(x, w.data.t(), out_dtype=torch.float32)
    if w.fmt == "fp8" and w.data.dim() == 2 and x.dtype in TRITON_DTYPES and use_triton(x, w.data):
        out_dtype = out_dtype or x.dtype  # prefill rows: the weight dequantized in one launch (kernels/dequant.py)
        return _dense_linear(x, dequantize(w, torch.promote_types(x.dtype, out_dtype)), out_dtype, groups)
    return linear_ref(x, w, out_dtype, groups)


if triton is not None:
    import triton.language as tl
    from .pdl import prologue

    from .wtile import FMT_CODES, TILE_K, scale_k, tile_dot

    @triton.jit
    def _linear_kernel(x_ptr, w_ptr, s_ptr, y_ptr, part_ptr, count_ptr, M, N, K, NG, K_SPLIT, stride_xm, stride_wn,
                       stride_sn, stride_ym, B0: tl.constexpr, SK: tl.constexpr, FMT: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr, IEEE: tl.constexpr,
                       SPLIT_K: tl.constexpr, PDL: tl.constexpr):
        prologue(PDL)
        # SPLIT_K: 0 one slice (store the output), 1 store the slice's float32 partial, 2 also sum in the kernel
        pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        nmask = rn < N
        col0 = (pid_n * BN // NG) * K  # the group's first input column (BN divides NG)
        k_lo = pid_k * K_SPLIT
        k_hi = tl.minimum(K, k_lo + K_SPLIT)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BK):
            rk = k0 + tl.arange(0, BK)
            a = tl.load(x_ptr + rm[:, None] * stride_xm + col0 + rk[None, :],
                        mask=(rm < M)[:, None] & (rk < k_hi)[None, :], other=0.0).to(DOT)
            acc += tile_dot(a, w_ptr, s_ptr, rn, k0, nmask, stride_wn, stride_sn, K, B0, SK, BK, FMT, DOT, IEEE)
        omask = (rm < M)[:, None] & nmask[None, :]
        plane = N.to(tl.int64) * M  # one partial [M, N] plane (M may be a constexpr 1)
        if SPLIT_K == 0:
            tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=omask)
        else:
            # Split K: write this slice's partial [M, N] plane; with SPLIT_K 2 the tile's last program to arrive
            # sums the planes in a fixed order (.cg loads: past L1, which does not see other SMs' writes) and resets
            # the tile's counter for the next launch (or graph replay).
            tl.store(part_ptr + pid_k * plane + rm[:, None] * N + rn[None, :], acc, mask=omask)
        if SPLIT_K == 2:
            n_split = tl.num_programs(2)
            tl.debug_barrier()
            tile = pid_m * tl.num_programs(1) + pid_n
            if tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu") == n_split - 1:
                _sum_planes(part_ptr, y_ptr, pid_m * BM, pid_n * BN, M, N, n_split, plane, stride_ym, BM, BN)
                tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")

    @triton.jit
    def _sum_planes(part_ptr, y_ptr, m0, n0, M, N, n_split, plane, stride_ym, BM: tl.constexpr, BN: tl.constexpr):
        """y[m0:m0+BM, n0:n0+BN] = Σ_z part[z] over the tile's rows present: 8 slices in one load (one L2
        round trip per 8 slices; a plain loop waited on every slice's load, benches/RESULTS.md
        "2026-12-04 (afternoon)"), summed by a fixed tree, chunks in slice order; .cg loads: past L1, which does
        not see other SMs' writes."""
        CH: tl.constexpr = min(BM * BN, 1024)
        ZB: tl.constexpr = 8
        n_el = tl.minimum(M - m0, BM) * BN
        rz = tl.arange(0, ZB)
        for c0 in range(0, n_el, CH):
            e = c0 + tl.arange(0, CH)
            rm = m0 + e // BN
            rn = n0 + e % BN
            emask = (e < n_el) & (rn < N)
            at = rm.to(tl.int64) * N + rn
            total = tl.zeros([CH], dtype=tl.float32)
            for z0 in range(0, n_split, ZB):
                z = z0 + rz
                v = tl.load(part_ptr + z[:, None] * plane + at[None, :], mask=(z < n_split)[:, None] & emask[None, :],
                            other=0.0, cache_modifier=".cg")
                total += tl.sum(v, 0)
            tl.store(y_ptr + rm * stride_ym + rn, total.to(y_ptr.dtype.element_ty), mask=emask)


def _pow2_divisor(n: int, cap: int) -> int:
    b = 16
    while b * 2 <= cap and n % (b * 2) == 0:
        b *= 2
    return b


def linear_tiles(m: int, n: int, ng: int) -> tuple[int, int, int, int]:
    """(BM, BN, warps, stages) of the Triton kernel for ``m`` rows and ``n`` output features, ``ng`` per group:
    BN up to 128 at ≤ 16 rows, else up to 64 unless that already makes ``TARGET_PROGRAMS`` tiles (wide projections
    such as V4.1's ``wq_b``, which need no split-K at BN 64; there BN 128 reads the activations half as often:
    31.8 → 23.0 µs at 64 rows on the H200, benches/RESULTS.md "2026-12-03 (ring and CUDA scorer)")."""
    bm = 16 if m <= 16 else 32 if m <= 32 else 64
    bn = _pow2_divisor(ng, 128 if m <= 16 else 64)
    if m > 16 and -(-m // bm) * (n // bn) >= TARGET_PROGRAMS:
        bn = _pow2_divisor(ng, 128)
        return bm, bn, 4, 3 if bm == 64 else 4
    return bm, bn, 4, 4


def _linear_triton(x: Tensor, w: PackedWeight, out_dtype: torch.dtype, groups: int,
                   tiles: tuple[int, int, int, int] | None = None) -> Tensor:
    """The Triton kernel (module docstring) at ``tiles`` (BM, BN, warps, stages; default :func:`linear_tiles`;
    BN must divide the group's output features)."""
    m = x.shape[0]
    n, k_g = w.out_features, w.in_features
    ng = n // groups
    bk = TILE_K
    if x.shape[1] != groups * k_g or ng * groups != n or ng % 16:
        return linear_ref(x, w, out_dtype, groups)
    x = x.contiguous()
    bm, bn, warps, stages = tiles or linear_tiles(m, n, ng)
    if ng % bn:
        raise ValueError(f"tiles: BN {bn} must divide the {ng} output features of a group")
    grid_mn = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    n_kb = triton.cdiv(k_g, bk)
    split = max(1, min(n_kb, TARGET_PROGRAMS // grid_mn, bn * k_g * w.data.element_size() // MIN_SLICE_BYTES))
    k_split = triton.cdiv(n_kb, split) * bk
    split = triton.cdiv(k_g, k_split)
    mode = 0 if split == 1 else 2 if split * min(m, bm) * bn * 4 <= SPLIT_REDUCE_BYTES else 1
    counters = wstream.split_counters(x.device) if mode == 2 and grid_mn <= wstream.COUNTER_SLOTS else None
    if mode == 2 and counters is None:
        mode = 1
    y = torch.empty((m, n), dtype=out_dtype, device=x.device) if mode != 1 else None
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else y
    scale = w.scale if w.scale is not None else w.data  # unused for dense
    _linear_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn), split)](
        x, w.data, scale, y if y is not None else part, part, counters if counters is not None else part, m, n, k_g,
        ng, k_split, x.stride(0), w.data.stride(0), scale.stride(0), n, B0=w.block[0], SK=scale_k(w.fmt, w.block),
        FMT=FMT_CODES[w.fmt], BM=bm, BN=bn, BK=bk, DOT=dot_dtype(x.dtype), IEEE=x.dtype == torch.float32,
        SPLIT_K=mode, num_warps=warps, num_stages=stages, **triton_kw(x.device))
    return y if y is not None else part.sum(0).to(out_dtype)
