"""mHC seams (docs/model.md §3.4, §3.2): the coefficients of a sub-layer, the collapse of the residual
copies into the sub-layer input and the expansion of its output back into the copies; float32 math.

``mixes = fn · rmsnorm(flatten(H))`` is a skinny GEMM; what follows (sigmoids, the 4×4 softmax and the spec's fixed
Sinkhorn procedure: one column normalisation, then ``iters − 1`` rounds of row then column normalisation) is ~45
tiny element-wise ops in PyTorch. The Triton path is a split-K pass that reads H once in its own dtype and leaves
partial dot products and sums of squares, then the finish: the sigmoids, the softmax and Sinkhorn in registers,
the partials summed in slice order. With :data:`ONE_LAUNCH` the last program of a token block to arrive (an arrival
counter it resets, :func:`.wstream.split_counters`) finishes the block in the same launch; otherwise, at the
64-token tiles of :data:`MIX_WIDE_T` (faster in two), or where the counters do not exist yet (a CUDA-graph capture
before any eager run), a second kernel does. Collapse and expand
are one launch each; :func:`hc_collapse_norm` joins the collapse with the sub-layer's RMSNorm, which is the only
reader of its result (one launch per seam fewer; the same rounding as the two launches).

Where :func:`.dispatch.use_cuda` says so, decode-sized steps take the CUDA seam (:mod:`.mhc_cuda`) instead: the
mixes in one launch, and :func:`hc_seam` joins them with the expansion before them and the collapse + RMSNorm
after them (one launch for three).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import mhc_cuda, wstream
from .dispatch import triton, use_cuda, use_triton
from .pdl import triton_kw
from .norm import rms_norm, rms_norm_ref

# One launch per seam instead of two: the last program of a token block to arrive finishes it. On the H200
# (glue_bench.py, benches/RESULTS.md "2026-12-04 (afternoon)") 14.4 / 14.7 / 16.3 µs per seam at 1 / 8 / 64 tokens
# against 15.2 / 15.8 / 17.6 µs in two launches (within noise in an earlier call, "2026-12-03 (late night)").
ONE_LAUNCH = True
# The collapse and the sub-layer's RMSNorm in one launch (hc_collapse_norm); False: the two launches (an A/B switch).
FUSED_NORM = True
# K slices of the mixes' split-K pass at most (fewer where the token blocks already give ~2 waves of programs). On
# the H200 (glue_bench.py, benches/RESULTS.md "2026-12-04 (afternoon)") 16 or 160 slices were slower than 32.
MIX_SPLIT_MAX = 32
# Slices the finish adds per round of loads (their loads issued together, the sums in slice order: the same bits at
# any value). A B = 1 profile had the finish at ~6.8 µs per seam for 32 slices, about one L2 round trip per slice.
# On the H200 (glue_bench.py, benches/RESULTS.md "2026-12-04 (evening)", the mix weight then still in L2) 14.6 µs
# per seam at one token, 14.3 rolled, 14.4 at 8: noise.
FINISH_UNROLL = 4
# Steps of at most this many tokens take the one-token split-K pass (float32 FMAs, no 16-token tensor-core tile
# for one token). Off: glue_bench.py timed it at 13.5 / 12.5 µs per seam at 1 / 8 tokens against 14.6 / 15.5 µs
# tiled, but in a B = 1 step of flash-slice-v41 (profile_step.py, PDL off; benches/RESULTS.md "2026-12-04
# (evening)") it took 22 µs per seam against the tiled pass and finish's 16 µs: there each seam's 2 MB of mix
# weights come from HBM, in the bench's graph of 24 calls over one weight from L2.
MIX_GEMV_T = 0
GEMV_BK = 256
# Steps of at least this many tokens take 64-token tiles in the split-K pass (0 = never). The 16-token tiles read
# the seam's 2 MB of mix weights again per tile (1 GB from L2 per seam at 8,192 tokens) with a 16-row dot.
# glue_bench.py --tokens 2048,8192 --ops mhc (benches/RESULTS.md "2026-12-04 (night)"): 143 against 163 µs per
# seam at 2,048 tokens, 536 against 635 at 8,192; smaller steps were not timed, so they keep the 16-token tiles.
# These steps take two launches whatever ONE_LAUNCH says: 105 against 144 µs at 2,048 tokens, 378 against 541 at
# 8,192 (the same call).
MIX_WIDE_T = 2048
# Decode-sized steps (≤ mhc_cuda.MAX_TOKENS tokens, bf16) take the CUDA seam where it runs (False: the Triton path).
CUDA_SEAM = True


def hc_mixes_ref(h: Tensor, fn: Tensor, scale: Tensor, base: Tensor, hc: int, iters: int, hc_eps: float,
                 norm_eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """h [T, hc, D] (any float dtype); fn [(2+hc)·hc, hc·D]; scale [3]; base [(2+hc)·hc]. Returns float32 (or
    float64 for float64 input) ``pre`` [T, hc], ``post`` [T, hc], ``comb`` [T, hc, hc] (comb[i, j]: input copy i
    → output copy j)."""
    flat = h.flatten(1).to(torch.promote_types(h.dtype, torch.float32))
    r = torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + norm_eps)
    mixes = F.linear(flat * r, fn.to(flat.dtype))
    return _finish_ref(mixes, scale.to(flat.dtype), base.to(flat.dtype), hc, iters, hc_eps)


def _finish_ref(mixes: Tensor, scale: Tensor, base: Tensor, hc: int, iters: int, hc_eps: float):
    pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.split([hc, hc, hc * hc])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(-1, hc, hc) * scale[2] + comb_b.view(hc, hc), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return pre, post, comb


def hc_mixes(h: Tensor, fn: Tensor, scale: Tensor, base: Tensor, hc: int, iters: int, hc_eps: float,
             norm_eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`hc_mixes_ref` as one or two Triton launches where :func:`.dispatch.use_triton` says so (hc = 4):
    the split-K pass over tiles of 16 tokens (64 from :data:`MIX_WIDE_T` tokens), or one token per program at most
    :data:`MIX_GEMV_T` tokens; the CUDA seam first where it takes the step (module docstring)."""
    if CUDA_SEAM and use_cuda(h, fn, scale, base):
        got = mhc_cuda.seam(h, fn, scale, base, iters, hc_eps, norm_eps)
        if got is not None:
            return got[1:]
    if h.dtype == torch.float64 or hc != 4 or h.shape[0] == 0 or not use_triton(h):
        return hc_mixes_ref(h, fn, scale, base, hc, iters, hc_eps, norm_eps)
    t = h.shape[0]
    flat = h.reshape(t, -1)
    k = flat.shape[1]
    gemv = t <= MIX_GEMV_T
    wide = not gemv and MIX_WIDE_T and t >= MIX_WIDE_T
    bt, bk = (1, GEMV_BK) if gemv else (64, 64) if wide else (16, 128)
    n_tb = triton.cdiv(t, bt)
    split = max(1, min(triton.cdiv(k, bk), MIX_SPLIT_MAX, 264 // n_tb))
    k_split = triton.cdiv(triton.cdiv(k, bk), split) * bk
    split = triton.cdiv(k, k_split)
    part = torch.empty(split, t, 32, dtype=torch.float32, device=h.device)
    prec = "ieee" if h.device.type == "cpu" else "tf32x3"  # tf32x3: float32-accurate on the tensor cores
    pre = torch.empty(t, 4, dtype=torch.float32, device=h.device)
    post = torch.empty_like(pre)
    comb = torch.empty(t, 4, 4, dtype=torch.float32, device=h.device)
    one_launch = ONE_LAUNCH and not wide and n_tb <= wstream.COUNTER_SLOTS
    counters = wstream.split_counters(h.device) if one_launch else None
    scale, base = scale.float().contiguous(), base.float().contiguous()
    args = (flat, fn.float().contiguous(), part, part if counters is None else counters, scale, base, pre, post, comb,
            t, k, k_split, flat.stride(0), float(norm_eps), iters, hc_eps)
    if gemv:
        _mix_gemv_kernel[(t, split)](*args, BK=bk, FUSED=counters is not None, UNROLL=FINISH_UNROLL,
                                     **triton_kw(flat.device))
    else:
        _mix_partial_kernel[(n_tb, split)](*args, BT=bt, BK=bk, PREC=prec, FUSED=counters is not None,
                                           UNROLL=FINISH_UNROLL, **triton_kw(flat.device))
    if counters is None:
        _finish_kernel[(n_tb,)](part, scale, base, pre, post, comb, t, split, k, float(norm_eps), iters, hc_eps, BT=bt,
                                UNROLL=FINISH_UNROLL, **triton_kw(part.device))
    return pre, post, comb


def hc_seam(h: Tensor, fn: Tensor, scale: Tensor, base: Tensor, hc: int, iters: int, hc_eps: float,
            norm_eps: float, pre_c: Tensor | None, norm_eps_x: float, norm_w: Tensor, y: Tensor | None = None,
            post: Tensor | None = None, comb: Tensor | None = None) -> tuple[Tensor, ...]:
    """A whole seam: ``h' = hc_expand(h, y, post, comb)`` when ``y`` is given (the previous sub-layer's output
    into the copies; else h' = h), the next sub-layer's mixes of h', and its normed input ``x =
    hc_collapse_norm(h', pre_c, norm_eps_x, norm_w)`` — ``pre_c`` None: collapsed with the seam's own pre.

    h [T, hc, D], y [T, D] (h's dtype), post [T, hc] and comb [T, hc, hc] (the previous seam's, float32), fn
    [(2+hc)·hc, hc·D], scale [3], base [(2+hc)·hc] (float32), pre_c [T, hc] float32 or None, norm_w [D]. Returns
    ``(h' [T, hc, D], pre' [T, hc], post' [T, hc], comb' [T, hc, hc], x [T, D])``, the mixes float32, h' and x in
    h's dtype. One CUDA launch where the CUDA seam takes the step (:mod:`.mhc_cuda`: bf16, up to
    ``mhc_cuda.SEAM_MAX_TOKENS`` tokens; with ``pre_c`` None above ``mhc_cuda.FRESH_MAX_TOKENS`` tokens the collapse
    is a launch of its own), else :func:`hc_expand`, :func:`hc_mixes` and :func:`hc_collapse_norm`."""
    t, _, d = h.shape
    given = [x for x in (y, post, comb, pre_c) if x is not None]
    if CUDA_SEAM and t <= mhc_cuda.SEAM_MAX_TOKENS and use_cuda(h, fn, scale, base, norm_w, *given):
        fused = pre_c is not None or (t <= mhc_cuda.FRESH_MAX_TOKENS and d <= mhc_cuda.FRESH_MAX_D)
        got = mhc_cuda.seam(h, fn, scale, base, iters, hc_eps, norm_eps, y, post, comb,
                            (pre_c, norm_w, norm_eps_x) if fused else None)
        if got is not None:
            return got if fused else (*got, hc_collapse_norm(got[0], got[1], norm_eps_x, norm_w))
    if y is not None:
        h = hc_expand(h, y, post, comb)
    pre, post_n, comb_n = hc_mixes(h, fn, scale, base, hc, iters, hc_eps, norm_eps)
    x = hc_collapse_norm(h, pre if pre_c is None else pre_c, norm_eps_x, norm_w)
    return h, pre, post_n, comb_n, x


def hc_collapse_ref(h: Tensor, pre: Tensor) -> Tensor:
    """``x = Σ_h pre[h]·H[h]``: h [T, hc, D], pre [T, hc] → [T, D] in h's dtype."""
    ct = torch.promote_types(h.dtype, torch.float32)
    return torch.einsum("th,thd->td", pre.to(ct), h.to(ct)).to(h.dtype)


def hc_expand_ref(h: Tensor, y: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    """``H'[j] = post[j]·y + Σ_i comb[i, j]·H[i]``: h [T, hc, D], y [T, D] → [T, hc, D] in h's dtype."""
    ct = torch.promote_types(h.dtype, torch.float32)
    mixed = torch.einsum("tij,tid->tjd", comb.to(ct), h.to(ct))
    return (post.to(ct)[..., None] * y.to(ct)[:, None, :] + mixed).to(h.dtype)


def hc_collapse(h: Tensor, pre: Tensor) -> Tensor:
    """:func:`hc_collapse_ref` as one Triton launch where :func:`.dispatch.use_triton` says so (hc = 4)."""
    if h.dtype == torch.float64 or h.shape[1] != 4 or h.shape[0] == 0 or not use_triton(h):
        return hc_collapse_ref(h, pre)
    t, _, d = h.shape
    hc_ = h.contiguous()
    out = torch.empty(t, d, dtype=h.dtype, device=h.device)
    bd = min(1024, triton.next_power_of_2(d))
    _collapse_kernel[(t, triton.cdiv(d, bd))](hc_, pre.float().contiguous(), out, d, BD=bd, **triton_kw(out.device))
    return out


def hc_collapse_norm_ref(h: Tensor, pre: Tensor, eps: float, weight: Tensor) -> Tensor:
    """``rms_norm(collapse(H, pre))``: h [T, hc, D], pre [T, hc], weight [D] → [T, D] in h's dtype (the collapse
    rounded to h's dtype first, as it is stored between the two launches; :mod:`.norm`)."""
    return rms_norm_ref(hc_collapse_ref(h, pre), eps, weight)


def hc_collapse_norm(h: Tensor, pre: Tensor, eps: float, weight: Tensor, rows: Tensor | None = None) -> Tensor:
    """:func:`hc_collapse_norm_ref` of the tokens ``rows`` [N] int64 (None: all; the head's logits rows) as one
    Triton launch (a program per token, D ≤ 16384) where :func:`.dispatch.use_triton` says so (hc = 4); its result
    equals :func:`hc_collapse` then :func:`.norm.rms_norm` bit for bit (the same float32 sums in the same order)."""
    t, _, d = h.shape
    if not FUSED_NORM or h.dtype == torch.float64 or h.shape[1] != 4 or t == 0 or d > 16384 or not use_triton(h):
        if rows is not None:
            h, pre = h[rows], pre[rows]
        return rms_norm(hc_collapse(h, pre), eps, weight)
    n = t if rows is None else rows.shape[0]
    out = torch.empty(n, d, dtype=h.dtype, device=h.device)
    if n == 0:
        return out
    bd = triton.next_power_of_2(d)
    # _rms_kernel's launch shape (4 warps, one row of next_power_of_2(D)): the same reduction tree, the same bits
    _collapse_norm_kernel[(n,)](h.contiguous(), pre.float().contiguous(), weight, out,
                                out if rows is None else rows.contiguous(), d, float(eps), ROWS=rows is not None,
                                BD=bd, **triton_kw(out.device))
    return out


def hc_expand(h: Tensor, y: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    """:func:`hc_expand_ref` as one Triton launch where :func:`.dispatch.use_triton` says so (hc = 4)."""
    if h.dtype == torch.float64 or h.shape[1] != 4 or h.shape[0] == 0 or not use_triton(h):
        return hc_expand_ref(h, y, post, comb)
    t, _, d = h.shape
    hc_ = h.contiguous()
    out = torch.empty_like(hc_)
    bd = min(1024, triton.next_power_of_2(d))
    _expand_kernel[(t, triton.cdiv(d, bd))](hc_, y.contiguous(), post.float().contiguous(),
                                            comb.float().contiguous(), out, d, BD=bd, **triton_kw(out.device))
    return out


if triton is not None:
    import triton.language as tl
    from .norm import rms_scale
    from .pdl import prologue

    @triton.jit
    def _mix_partial_kernel(h_ptr, fn_ptr, part_ptr, count_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, T, K,
                            K_SPLIT, stride_h, NORM_EPS, ITERS, EPS, BT: tl.constexpr, BK: tl.constexpr,
                            PREC: tl.constexpr, FUSED: tl.constexpr, UNROLL: tl.constexpr, PDL: tl.constexpr):
        """partial[s, t, 0:24] = Σ_{k in split s} fn[:, k]·h[t, k]; partial[s, t, 24] = Σ h[t, k]² (float32).
        FUSED: the token block's last program to arrive (``count_ptr``, reset by it) also finishes the block."""
        prologue(PDL)
        pid_t, pid_s = tl.program_id(0), tl.program_id(1)
        rt = pid_t * BT + tl.arange(0, BT)
        r32 = tl.arange(0, 32)
        tmask = rt < T
        k_lo = pid_s * K_SPLIT
        k_hi = tl.minimum(K, k_lo + K_SPLIT)
        acc = tl.zeros([BT, 32], dtype=tl.float32)
        ss = tl.zeros([BT], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BK):
            rk = k0 + tl.arange(0, BK)
            kmask = rk < k_hi
            x = tl.load(h_ptr + rt[:, None].to(tl.int64) * stride_h + rk[None, :],
                        mask=tmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
            f = tl.load(fn_ptr + r32[:, None] * K + rk[None, :], mask=(r32 < 24)[:, None] & kmask[None, :], other=0.0)
            acc += tl.dot(x, tl.trans(f), input_precision=PREC)
            ss += tl.sum(x * x, axis=1)
        acc = tl.where((r32 == 24)[None, :], ss[:, None], acc)
        tl.store(part_ptr + (pid_s * T + rt[:, None]) * 32 + r32[None, :], acc, mask=tmask[:, None] & (r32 < 25)[None, :])
        if FUSED:
            _finish_if_last(count_ptr + pid_t, part_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, rt, T, K,
                            NORM_EPS, ITERS, EPS, BT, UNROLL)

    @triton.jit
    def _mix_gemv_kernel(h_ptr, fn_ptr, part_ptr, count_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, T, K,
                         K_SPLIT, stride_h, NORM_EPS, ITERS, EPS, BK: tl.constexpr, FUSED: tl.constexpr,
                         UNROLL: tl.constexpr, PDL: tl.constexpr):
        """:func:`_mix_partial_kernel` for one token per program (float32 FMAs): partial[s, t, 0:24], [24] = the
        sum of squares; FUSED: token t's last program to arrive (``count_ptr + t``, reset by it) finishes it."""
        prologue(PDL)
        t, pid_s = tl.program_id(0), tl.program_id(1)
        r32 = tl.arange(0, 32)
        k_lo = pid_s * K_SPLIT
        k_hi = tl.minimum(K, k_lo + K_SPLIT)
        acc = tl.zeros([32], dtype=tl.float32)
        sq = tl.zeros([BK], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BK):
            rk = k0 + tl.arange(0, BK)
            kmask = rk < k_hi
            x = tl.load(h_ptr + t.to(tl.int64) * stride_h + rk, mask=kmask, other=0.0).to(tl.float32)
            f = tl.load(fn_ptr + r32[:, None] * K + rk[None, :], mask=(r32 < 24)[:, None] & kmask[None, :], other=0.0)
            acc += tl.sum(f * x[None, :], axis=1)
            sq += x * x
        acc = tl.where(r32 == 24, tl.sum(sq, axis=0), acc)
        tl.store(part_ptr + (pid_s * T + t) * 32 + r32, acc, mask=r32 < 25)
        if FUSED:
            _finish_if_last(count_ptr + t, part_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr,
                            t + tl.arange(0, 1), T, K, NORM_EPS, ITERS, EPS, 1, UNROLL)

    @triton.jit
    def _finish_if_last(counter, part_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, rt, T, K, NORM_EPS, ITERS,
                        EPS, BT: tl.constexpr, UNROLL: tl.constexpr):
        """The one-launch finish: the last of the grid's K-slice programs (axis 1) of tokens ``rt`` to arrive at
        ``counter`` finishes them and resets it for the next launch (or graph replay)."""
        tl.debug_barrier()
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == tl.num_programs(1) - 1:
            _finish_rows(part_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, rt, T, tl.num_programs(1), K,
                         NORM_EPS, ITERS, EPS, BT, UNROLL, ".cg")
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")

    @triton.jit
    def _finish_kernel(part_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, T, SPLIT, K, NORM_EPS, ITERS, EPS,
                       BT: tl.constexpr, UNROLL: tl.constexpr, PDL: tl.constexpr):
        prologue(PDL)
        rt = tl.program_id(0) * BT + tl.arange(0, BT)
        _finish_rows(part_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, rt, T, SPLIT, K, NORM_EPS, ITERS, EPS,
                     BT, UNROLL, "")

    @triton.jit
    def _finish_rows(part_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, rt, T, SPLIT, K, NORM_EPS, ITERS, EPS,
                     BT: tl.constexpr, UNROLL: tl.constexpr, CACHE: tl.constexpr):
        """pre, post, comb of the tokens ``rt`` from the SPLIT partial planes, summed in slice order (CACHE ".cg":
        loads past L1, which does not see other SMs' writes)."""
        tmask = rt < T
        r4 = tl.arange(0, 4)
        r16 = tl.arange(0, 16)
        pre_w = tl.zeros([BT, 4], dtype=tl.float32)
        post_w = tl.zeros([BT, 4], dtype=tl.float32)
        comb_w = tl.zeros([BT, 16], dtype=tl.float32)
        ss = tl.zeros([BT], dtype=tl.float32)
        for s0 in range(0, SPLIT, UNROLL):
            # UNROLL slices per round: their loads do not depend on the sums, so they are issued together (a rolled
            # loop waited a load round trip per slice); still added in slice order, a slice past SPLIT skipped
            for j in tl.static_range(UNROLL):
                s = s0 + j
                live = s < SPLIT
                m2 = tmask[:, None] & live
                row = (s * T + rt[:, None]) * 32
                v = tl.load(part_ptr + row + r4[None, :], mask=m2, other=0.0, cache_modifier=CACHE)
                pre_w = tl.where(live, pre_w + v, pre_w)
                v = tl.load(part_ptr + row + 4 + r4[None, :], mask=m2, other=0.0, cache_modifier=CACHE)
                post_w = tl.where(live, post_w + v, post_w)
                v = tl.load(part_ptr + row + 8 + r16[None, :], mask=m2, other=0.0, cache_modifier=CACHE)
                comb_w = tl.where(live, comb_w + v, comb_w)
                v = tl.load(part_ptr + (s * T + rt) * 32 + 24, mask=tmask & live, other=0.0, cache_modifier=CACHE)
                ss = tl.where(live, ss + v, ss)
        r = tl.rsqrt(ss / K + NORM_EPS)[:, None]
        s0 = tl.load(scale_ptr)
        s1 = tl.load(scale_ptr + 1)
        s2 = tl.load(scale_ptr + 2)
        pre = tl.sigmoid(pre_w * r * s0 + tl.load(base_ptr + r4)[None, :]) + EPS
        post = 2.0 * tl.sigmoid(post_w * r * s1 + tl.load(base_ptr + 4 + r4)[None, :])
        logits = tl.reshape(comb_w * r * s2 + tl.load(base_ptr + 8 + r16)[None, :], (BT, 4, 4))
        mx = tl.max(logits, axis=2)
        e = tl.exp(logits - mx[:, :, None])
        c = e / tl.sum(e, axis=2)[:, :, None] + EPS
        c = c / (tl.sum(c, axis=1)[:, None, :] + EPS)
        for _ in range(ITERS - 1):
            c = c / (tl.sum(c, axis=2)[:, :, None] + EPS)
            c = c / (tl.sum(c, axis=1)[:, None, :] + EPS)
        tl.store(pre_ptr + rt[:, None] * 4 + r4[None, :], pre, mask=tmask[:, None])
        tl.store(post_ptr + rt[:, None] * 4 + r4[None, :], post, mask=tmask[:, None])
        tl.store(comb_ptr + rt[:, None] * 16 + r16[None, :], tl.reshape(c, (BT, 16)), mask=tmask[:, None])

    @triton.jit
    def _collapse_kernel(h_ptr, pre_ptr, out_ptr, D, BD: tl.constexpr, PDL: tl.constexpr):
        prologue(PDL)
        t, db = tl.program_id(0), tl.program_id(1)
        rd = db * BD + tl.arange(0, BD)
        mask = rd < D
        base = t.to(tl.int64) * 4 * D
        acc = tl.zeros([BD], dtype=tl.float32)
        for i in tl.static_range(4):
            acc += tl.load(pre_ptr + t * 4 + i) * tl.load(h_ptr + base + i * D + rd, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + t.to(tl.int64) * D + rd, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _collapse_norm_kernel(h_ptr, pre_ptr, w_ptr, out_ptr, rows_ptr, D, eps, ROWS: tl.constexpr, BD: tl.constexpr,
                              PDL: tl.constexpr):
        prologue(PDL)
        prog = tl.program_id(0).to(tl.int64)
        t = tl.load(rows_ptr + prog).to(tl.int64) if ROWS else prog  # the token this program collapses
        rd = tl.arange(0, BD)
        mask = rd < D
        base = t * 4 * D
        acc = tl.zeros([BD], dtype=tl.float32)
        for i in tl.static_range(4):  # _collapse_kernel's sum, term by term
            acc += tl.load(pre_ptr + t * 4 + i) * tl.load(h_ptr + base + i * D + rd, mask=mask, other=0.0).to(tl.float32)
        x = acc.to(out_ptr.dtype.element_ty).to(tl.float32)  # the collapse as stored, then _rms_kernel's math
        y = x * rms_scale(x, D, eps)
        y = y * tl.load(w_ptr + rd, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + prog * D + rd, y.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _expand_kernel(h_ptr, y_ptr, post_ptr, comb_ptr, out_ptr, D, BD: tl.constexpr, PDL: tl.constexpr):
        prologue(PDL)
        t, db = tl.program_id(0), tl.program_id(1)
        rd = db * BD + tl.arange(0, BD)
        mask = rd < D
        base = t.to(tl.int64) * 4 * D
        y = tl.load(y_ptr + t.to(tl.int64) * D + rd, mask=mask, other=0.0).to(tl.float32)
        h0 = tl.load(h_ptr + base + rd, mask=mask, other=0.0).to(tl.float32)
        h1 = tl.load(h_ptr + base + D + rd, mask=mask, other=0.0).to(tl.float32)
        h2 = tl.load(h_ptr + base + 2 * D + rd, mask=mask, other=0.0).to(tl.float32)
        h3 = tl.load(h_ptr + base + 3 * D + rd, mask=mask, other=0.0).to(tl.float32)
        for j in tl.static_range(4):
            c = comb_ptr + t * 16 + j  # comb[i, j] at i·4 + j
            v = tl.load(post_ptr + t * 4 + j) * y + tl.load(c) * h0 + tl.load(c + 4) * h1 + tl.load(c + 8) * h2 \
                + tl.load(c + 12) * h3
            tl.store(out_ptr + base + j * D + rd, v.to(out_ptr.dtype.element_ty), mask=mask)
