"""Grouped expert GEMMs for MoE without host synchronisation (docs/architecture.md §3a; docs/kernels.md §2 "MoE").

The T·k (token, slot) pairs are sorted by expert on the device (:func:`.moe_align.route_pairs`); expert e owns the sorted
rows ``[offsets[e], offsets[e+1])``. :func:`grouped_linear` computes, for every sorted row i of expert e,
``y[i] = x[rows[i]] · W[e]ᵀ`` over a packed ``[E, N, K]`` weight (MXFP4 experts dequantized in the kernel:
W4A16; FP8 and dense too). One launch covers every expert: programs ``(expert, N tile)`` walk their expert's
rows in ``BM`` blocks, so an expert's weights are read once per row block and unused experts cost nothing but
an empty program; prefill tiles launch a program per (row block, N tile) instead. On a GPU with bf16/fp16
activations MXFP4 tiles go through ``tl.dot_scaled`` (Triton's own FP4 upcast, 1.3–1.6× faster than the nibble
decode: benches/RESULTS.md), or, for bf16 prefill tiles on sm_90 (from 32 rows per expert; ``PREFILL_*`` below),
through the inline-PTX bit moves of :func:`.wtile.mxfp4_tile_bits`; float32 and the interpreter decode in code
(:func:`.wtile.tile_dot`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import moe_prefill, wstream
from .dispatch import TRITON_DTYPES, dot_dtype, interpreting, triton, use_cuda, use_triton
from .pdl import triton_kw
from .moe_align import active_experts, row_blocks
from .packed import PackedWeight


def combine_pairs_ref(y: Tensor, inv: Tensor, top_k: int, extra: Tensor | None = None) -> Tensor:
    """``out[t] = Σ_j y[inv[t·k + j]] (+ extra[t])`` summed in float32: y [P, D] sorted-pair rows, inv [T·k] →
    [T, D] in y's dtype (the routed experts' outputs back per token, the shared expert's added)."""
    ct = torch.promote_types(y.dtype, torch.float32)
    out = y.index_select(0, inv).view(-1, top_k, y.shape[1]).sum(dim=1, dtype=ct)
    if extra is not None:
        out = out + extra.to(ct)
    return out.to(y.dtype)


def combine_pairs(y: Tensor, inv: Tensor, top_k: int, extra: Tensor | None = None) -> Tensor:
    """:func:`combine_pairs_ref` as one Triton launch where :func:`.dispatch.use_triton` says so."""
    if y.dtype not in TRITON_DTYPES or inv.numel() == 0 or not use_triton(y, family="moe"):
        return combine_pairs_ref(y, inv, top_k, extra)
    t, d = inv.shape[0] // top_k, y.shape[1]
    out = torch.empty(t, d, dtype=y.dtype, device=y.device)
    block = min(1024, triton.next_power_of_2(d))
    yc = y.contiguous()
    _combine_kernel[(t, triton.cdiv(d, block))](yc, inv, yc if extra is None else extra.contiguous(), out, d,
                                                K=top_k, HAS_EXTRA=extra is not None, BLOCK=block,
                                                **triton_kw(out.device))
    return out


def grouped_linear_ref(x: Tensor, w: PackedWeight, offsets: Tensor, rows: Tensor | None = None) -> Tensor:
    """Reference: x [M, K] (float); w [E, N, K]; offsets [E+1]; rows [P] int64 (None: x's rows in order, P = M).
    Returns [P, N] in x's dtype. Reads the offsets on the host (a reference: CPU, or CUDA for debugging)."""
    xs = x if rows is None else x[rows]
    wd = w.dequantize(x.dtype)
    if xs.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16, torch.float16):
        return torch._grouped_mm(xs, wd.transpose(1, 2), offs=offsets[1:].to(torch.int32))
    out = xs.new_zeros(xs.shape[0], wd.shape[1])
    bounds = offsets.tolist()
    for e in range(wd.shape[0]):
        a, b = bounds[e], bounds[e + 1]
        if b > a:
            out[a:b] = xs[a:b] @ wd[e].T
    return out


def grouped_linear(x: Tensor, w: PackedWeight, offsets: Tensor, rows: Tensor | None = None,
                   active: Tensor | None = None) -> Tensor:
    """:func:`grouped_linear_ref` as one launch of the CUDA weight-streaming kernel where :func:`.dispatch.use_cuda`
    says so and it takes the step (:func:`.wstream.grouped`: decode-sized steps), else where
    :func:`.dispatch.use_triton` says so the dequantize-then-grouped-GEMM path when it takes the step
    (:func:`.moe_prefill.grouped`: prefill chunks, off by default) or one Triton launch; ``active``: the live
    experts (:class:`.moe_align.PairRouting`), derived from ``offsets`` when not given."""
    if use_cuda(x, w.data, family="moe"):
        if active is None:
            active = active_experts(offsets, min(w.shape[0], x.shape[0] if rows is None else rows.shape[0]))
        y = wstream.grouped(x, w, offsets, rows, active)
        if y is not None:
            return y
    if x.dtype in TRITON_DTYPES and use_triton(x, w.data, family="moe"):
        y = moe_prefill.grouped(x, w, offsets, rows)  # prefill chunks: dequantize, then a grouped bf16 GEMM
        return y if y is not None else grouped_linear_triton(x, w, offsets, rows, active=active)
    return grouped_linear_ref(x, w, offsets, rows)


if triton is not None:
    import triton.language as tl
    from .pdl import prologue

    from .wtile import FMT_CODES, TILE_K, mxfp4_tile_bits, scale_k, tile_dot, w_tile

    @triton.jit
    def _grouped_kernel(x_ptr, rows_ptr, w_ptr, s_ptr, offs_ptr, act_ptr, blk_ptr, y_ptr, N, K, K_SPLIT, stride_xm,
                        stride_we, stride_wn, stride_se, stride_sn, stride_ys, stride_ym, GATHER: tl.constexpr,
                        B0: tl.constexpr, SK: tl.constexpr, FMT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                        BK: tl.constexpr, DOT: tl.constexpr, IEEE: tl.constexpr, DECODE: tl.constexpr,
                        LHS_FMT: tl.constexpr, ROW_GRID: tl.constexpr, SWAP: tl.constexpr, EVEN_K: tl.constexpr,
                        PDL: tl.constexpr):
        prologue(PDL)
        e = tl.load(act_ptr + tl.program_id(0))  # ROW_GRID: the owner of row block program_id(0)
        if e < 0:
            return
        pid_n, pid_k = tl.program_id(1), tl.program_id(2)
        k_lo = pid_k * K_SPLIT
        k_hi = tl.minimum(K, k_lo + K_SPLIT)
        start = tl.load(offs_ptr + e)
        end = tl.load(offs_ptr + e + 1)
        if ROW_GRID:  # one block of the expert's rows (moe_align.row_blocks), not all of them
            start += (tl.program_id(0) - tl.load(blk_ptr + e)) * BM
            end = tl.minimum(end, start + BM)
        rn = pid_n * BN + tl.arange(0, BN)
        nmask = rn < N
        w_e = w_ptr + e.to(tl.int64) * stride_we
        s_e = s_ptr + e.to(tl.int64) * stride_se
        for m0 in range(start, end, BM):
            rm = m0 + tl.arange(0, BM)
            mmask = rm < end
            if GATHER:
                src = tl.load(rows_ptr + rm, mask=mmask, other=0)
            else:
                src = rm
            if SWAP:  # yᵀ = W·xᵀ: the decoded weight tile is WGMMA's A operand, straight from registers
                acc = tl.zeros([BN, BM], dtype=tl.float32)
            else:
                acc = tl.zeros([BM, BN], dtype=tl.float32)
            for k0 in range(k_lo, k_hi, BK):
                rk = k0 + tl.arange(0, BK)
                if EVEN_K:  # K and its split slices are whole steps: only the rows are masked
                    a = tl.load(x_ptr + src[:, None] * stride_xm + rk[None, :], mask=mmask[:, None], other=0.0).to(DOT)
                else:
                    a = tl.load(x_ptr + src[:, None] * stride_xm + rk[None, :],
                                mask=mmask[:, None] & (rk < k_hi)[None, :], other=0.0).to(DOT)
                if SWAP:  # MXFP4 only (no tile_scale here: V4's 128 × 128 FP8 blocks would stay unscaled)
                    tl.static_assert(DECODE != 1, "the swap takes the bit moves or the nibble decode")
                    if DECODE == 2:
                        w = mxfp4_tile_bits(w_e, s_e, rn, k0, nmask, stride_wn, stride_sn, K, BK, EVEN_K)
                    else:
                        w = w_tile(w_e, s_e, rn, k0, nmask, stride_wn, stride_sn, K, B0, SK, BK, FMT, DOT)
                    if IEEE:
                        acc = tl.dot(w, tl.trans(a), acc, input_precision="ieee")
                    else:
                        acc = tl.dot(w, tl.trans(a), acc)
                elif DECODE == 1:  # MXFP4 through Triton's scaled dot: its own FP4 → bf16 upcast
                    rb = k0 // 2 + tl.arange(0, BK // 2)
                    wb = tl.load(w_e + rn[:, None] * stride_wn + rb[None, :],
                                 mask=nmask[:, None] & (rb < K // 2)[None, :], other=0)
                    rs = k0 // 32 + tl.arange(0, BK // 32)
                    sb = tl.load(s_e + rn[:, None] * stride_sn + rs[None, :],
                                 mask=nmask[:, None] & (rs < K // 32)[None, :], other=127)
                    acc = tl.dot_scaled(a, None, LHS_FMT, tl.trans(wb), sb, "e2m1", acc)
                elif DECODE == 2:  # MXFP4 → bf16 in inline-PTX bit moves
                    w = mxfp4_tile_bits(w_e, s_e, rn, k0, nmask, stride_wn, stride_sn, K, BK, EVEN_K)
                    acc = tl.dot(a, tl.trans(w), acc)
                else:
                    acc += tile_dot(a, w_e, s_e, rn, k0, nmask, stride_wn, stride_sn, K, B0, SK, BK, FMT, DOT, IEEE)
            if SWAP:
                tl.store(y_ptr + pid_k * stride_ys + rm[None, :] * stride_ym + rn[:, None],
                         acc.to(y_ptr.dtype.element_ty), mask=mmask[None, :] & nmask[:, None])
            else:
                tl.store(y_ptr + pid_k * stride_ys + rm[:, None] * stride_ym + rn[None, :],
                         acc.to(y_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])

    @triton.jit
    def _combine_kernel(y_ptr, inv_ptr, extra_ptr, out_ptr, D, K: tl.constexpr, HAS_EXTRA: tl.constexpr,
                        BLOCK: tl.constexpr, PDL: tl.constexpr):
        prologue(PDL)
        t, db = tl.program_id(0), tl.program_id(1)
        cols = db * BLOCK + tl.arange(0, BLOCK)
        mask = cols < D
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(K):
            row = tl.load(inv_ptr + t * K + j)
            acc += tl.load(y_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_EXTRA:
            acc += tl.load(extra_ptr + t.to(tl.int64) * D + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + t.to(tl.int64) * D + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


# The prefill launch (A/B switches for flash_slice.py --set). Compiled for sm_90a (benches/gpu/triton_regs.py:
# ptxas -v on Triton 3.6's PTX, no GPU needed), 128 × 128 tiles over 8 warps at a K step of 128 through tl.dot_scaled
# take 255 registers per thread: one CTA per SM. With the PTX bit moves at a K step of 64 and a 128-register cap
# they compile without spills (two CTAs per SM, 598 PTX instructions per 128 inputs against 645 for tl.dot_scaled);
# on an H100 at 8,192 tokens of V4.1's experts (moe_bench.py) w13 took 11.6 against 13.6 ms, w2 6.7 against 7.3
# (benches/RESULTS.md "2026-12-05 (evening)"). A program per row block rather than per expert (PREFILL_ROW_GRID)
# took the flash-slice-v41 8,192-token prefill from 24,200 to 28,650 tok/s: the engine's routing is uneven. The
# default since "2026-12-05 (night)": 64-row blocks over one warp group (4 warps, 72 bytes of stack spilled, four
# CTAs per SM), from 32 pairs per expert: w13 / w2 at 2,048 tokens 4.37 / 2.48 ms against 7.86 / 4.19 for the
# decode tiles that ran there before, at 4,096 6.38 / 3.63 against 10.54 / 6.08, at 8,192 10.64 / 5.92 against
# 11.16 / 6.32 for the 128-row blocks; the 2,048-token prefill 13,377 -> 20,935 / 21,651 tok/s.
# Where the bit moves do not apply (fp16 activations; a GPU other than sm_90, whose PTX lacks bf16x2 multiplies
# before it and whose tl.dot_scaled may be native after it) prefill tiles keep 128 × 128 over 8 warps, the K step of
# 128 through tl.dot_scaled, uncapped, above 64 pairs per expert: the default before, 13.6 / 7.3 ms there with
# programs per expert (per row block there: not timed).
PREFILL_BM = 64  # rows per block: one warp group's WGMMA M
PREFILL_BN = 128  # weight rows per tile
PREFILL_WARPS = 4
PREFILL_BK = 64  # 64 halves the tiles held in registers (wtile.TILE_K = 128 at 128 x 128 over 8 warps: one CTA/SM)
PREFILL_STAGES = 3
PREFILL_MAXNREG = 128  # 0: the compiler's choice
PREFILL_DECODE = "bits"  # wtile.mxfp4_tile_bits; "scaled": tl.dot_scaled; "nibble": wtile.tile_dot (A/B, sm_90)
PREFILL_MIN_ROWS = 32  # pairs per expert from which the bit-move tiles run (timed at 32, 64 and 128)
BITS_MAJORS = (9,)  # compute capabilities (major) whose prefill tiles take the bit moves: timed on Hopper only
PREFILL_ROW_GRID = True  # programs per (row block, N tile): RESULTS 2026-12-05 (night), +18 % at 8,192 tokens
# The bit-move tile as the MMA's left operand (yᵀ = W·xᵀ): Triton then issues WGMMA with the decoded weights as its
# register A operand, where the default stores each decoded 128 × 64 tile to shared memory for WGMMA's B operand and
# waits on a barrier (the compiled kernel's TTGIR; triton_regs.py --swaps 0,1 counts registers and spills). It wants
# PREFILL_WARPS = 8 (two warp groups of 64 weight rows; at 4 warps the 128-register cap spills ~400 bytes). An A/B
# switch until timed (benches/RESULTS.md "2026-12-05 (late, CPU only)", issue17_check.sh MODE=swap).
PREFILL_SWAP = False
DECODES = {"nibble": 0, "scaled": 1, "bits": 2}  # the kernel's DECODE


def bits_decode_runs(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether :func:`.wtile.mxfp4_tile_bits` takes ``dtype`` activations on ``device``: bf16 on a CUDA GPU of
    :data:`BITS_MAJORS` (its PTX needs sm_90's bf16x2 multiply and u16x2 max), not under the interpreter."""
    return (dtype == torch.bfloat16 and device.type == "cuda" and not interpreting()
            and torch.cuda.get_device_capability(device)[0] in BITS_MAJORS)


def grouped_config(pairs: int, w: PackedWeight, dtype: torch.dtype) -> dict:
    """The launch of :func:`grouped_linear_triton` for ``pairs`` sorted rows over ``w`` (host shapes only, never the
    routing): row block ``bm``, N tile ``bn``, K step ``bk`` (128, or 64: half the tiles held in registers), K
    ``split`` (few rows per expert split K so the weight stream spreads over the GPU), ``decode`` (of
    :data:`DECODES`: MXFP4 through ``tl.dot_scaled`` with bf16 / fp16 activations on a GPU, not under the
    interpreter, or for prefill tiles the PTX bit moves where :func:`bits_decode_runs`; else the nibble decode),
    ``warps``, ``stages``, ``maxnreg`` (a register cap per thread for the compiler, None = its choice),
    ``row_grid`` (prefill: a program per block of an expert's rows, :func:`grouped_linear_triton`), ``swap`` (the
    weight tile as the dot's left operand: ``PREFILL_SWAP``, prefill tiles outside ``tl.dot_scaled``). Prefill chunks
    (from ``PREFILL_MIN_ROWS`` pairs per expert, MXFP4 with bf16 where :func:`bits_decode_runs`) take the
    ``PREFILL_*`` settings, ``PREFILL_DECODE`` included; elsewhere more than 64 pairs per expert take 128 × 128 tiles
    through ``tl.dot_scaled``. Chosen with ``benches/gpu/moe_bench.py --sweep`` (decode) and ``--tiles`` (prefill:
    at 128 rows per expert of V4.1-Flash, 128 × 128 tiles over 8 warps took 13.2 / 6.8 ms for w13 / w2 against 17.6
    / 9.1 ms with the 64 × 64 tiles of 4 warps before; 256-row tiles 11.5 / 6.8 ms; the weight tile as the dot's
    left operand 3× slower; 128 rows, not 256: a 256-row tile is mostly masked rows at ~128 per expert and gave w2
    nothing; benches/RESULTS.md "2026-12-04 (evening)"; then the K step of 64 with
    the bit moves: 11.6 / 6.7 ms against 13.6 / 7.3 on an H100, "2026-12-05 (evening)"; then 64-row blocks over 4
    warps, programs per row block, "2026-12-05 (night)": the comment above ``PREFILL_BM``)."""
    n_exp, n, k = w.shape
    per_expert = pairs / n_exp
    scaled = (w.fmt == "mxfp4" and dtype in (torch.bfloat16, torch.float16) and w.data.is_cuda
              and not interpreting())
    if per_expert >= PREFILL_MIN_ROWS and scaled and bits_decode_runs(dtype, w.data.device):
        return dict(bm=PREFILL_BM, bn=PREFILL_BN, bk=PREFILL_BK, split=1, decode=PREFILL_DECODE,
                    warps=PREFILL_WARPS, stages=PREFILL_STAGES, maxnreg=PREFILL_MAXNREG or None,
                    row_grid=PREFILL_ROW_GRID, swap=PREFILL_SWAP and PREFILL_DECODE != "scaled")
    if per_expert > 64 and scaled:  # fp16, other GPUs (float32 tiles this size would not fit in shared memory)
        return dict(bm=128, bn=128, bk=TILE_K, split=1, decode="scaled", warps=8, stages=3, maxnreg=None,
                    row_grid=PREFILL_ROW_GRID)
    bm = 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64
    bn = 128 if bm == 16 else 64
    slots = min(n_exp, pairs)
    n_kb = triton.cdiv(k, TILE_K)
    split = max(1, min(n_kb, 1024 // (slots * triton.cdiv(n, bn)))) if bm == 16 else 1
    return dict(bm=bm, bn=bn, bk=TILE_K, split=split, decode="scaled" if scaled else "nibble", warps=4, stages=4,
                maxnreg=None)


def grouped_linear_triton(x: Tensor, w: PackedWeight, offsets: Tensor, rows: Tensor | None,
                          config: dict | None = None, active: Tensor | None = None) -> Tensor:
    """The Triton launch of :func:`grouped_linear` (``config``: :func:`grouped_config`'s keys, ``bk`` 64 or
    :data:`.wtile.TILE_K`; default: its choice; ValueError for another ``bk``, for a ``decode`` not in
    :data:`DECODES`, or for one the operands do not take: "scaled" needs MXFP4 weights with bf16 / fp16 activations on
    a GPU, "bits" MXFP4 with bf16 where :func:`bits_decode_runs`; and for ``swap`` with other than MXFP4 weights or
    with the scaled decode). Programs (live expert, N tile, K
    split): only the experts with rows get programs (a compact list made on the device), each walking its expert's
    row blocks; with ``config["row_grid"]`` programs (row block, N tile, K split) instead, so an expert with many rows
    spreads over as many programs (:func:`.moe_align.row_blocks`; ``active`` is then not used); split partials are
    summed in float32 in a fixed order."""
    n_exp, n, k = w.shape
    p = x.shape[0] if rows is None else rows.shape[0]
    if p == 0:
        return torch.empty((0, n), dtype=x.dtype, device=x.device)
    c = config or grouped_config(p, w, x.dtype)
    if c["bk"] not in (64, TILE_K):  # a K step of 32 would leave MXFP4 tiles unscaled (wtile.w_tile scales SK < BK)
        raise ValueError(f"bk = {c['bk']}: the K step must be 64 or {TILE_K}")
    if c["decode"] not in DECODES:
        raise ValueError(f"decode {c['decode']!r}: expected one of {tuple(DECODES)}")
    if c.get("swap") and (w.fmt != "mxfp4" or c["decode"] == "scaled"):
        raise ValueError(f"swap takes MXFP4 weights through the bits or nibble decode, not {w.fmt} / {c['decode']!r}")
    if c["decode"] != "nibble":
        runs = (bits_decode_runs(x.dtype, x.device) if c["decode"] == "bits" else
                x.dtype in (torch.bfloat16, torch.float16) and x.is_cuda and not interpreting())
        if w.fmt != "mxfp4" or not runs:
            raise ValueError(f"decode {c['decode']!r} does not take {w.fmt} weights with {x.dtype} activations on "
                             f"{x.device} (scaled: MXFP4, bf16 / fp16 on a GPU; bits: MXFP4, bf16 on sm_90)")
    x = x.contiguous()
    scale = w.scale if w.scale is not None else w.data
    slots = min(n_exp, p)
    n_kb = triton.cdiv(k, TILE_K)
    k_split = triton.cdiv(n_kb, min(n_kb, c["split"])) * TILE_K  # whole K steps (bk divides TILE_K): EVEN_K below
    split = triton.cdiv(k, k_split)
    y = torch.empty((split, p, n), dtype=x.dtype if split == 1 else torch.float32, device=x.device)
    if c.get("row_grid"):
        owner, first = row_blocks(offsets, c["bm"], triton.cdiv(p, c["bm"]) + slots)
        progs = owner.shape[0]
    else:
        owner = active_experts(offsets, slots) if active is None else active
        first, progs = offsets, slots
    _grouped_kernel[(progs, triton.cdiv(n, c["bn"]), split)](
        x, x if rows is None else rows, w.data, scale, offsets, owner, first, y, n, k, k_split,
        x.stride(0), w.data.stride(0), w.data.stride(1), scale.stride(0), scale.stride(1), y.stride(0),
        y.stride(1), GATHER=rows is not None, B0=w.block[0], SK=scale_k(w.fmt, w.block), FMT=FMT_CODES[w.fmt],
        BM=c["bm"], BN=c["bn"], BK=c["bk"], DOT=dot_dtype(x.dtype), IEEE=x.dtype == torch.float32,
        DECODE=DECODES[c["decode"]], LHS_FMT="fp16" if x.dtype == torch.float16 else "bf16",
        ROW_GRID=bool(c.get("row_grid")), SWAP=bool(c.get("swap")), EVEN_K=k % c["bk"] == 0,
        num_warps=c["warps"], num_stages=c["stages"], **triton_kw(x.device),
        **({"maxnreg": c["maxnreg"]} if c.get("maxnreg") and not interpreting() else {}))
    return y[0] if split == 1 else y.sum(0).to(x.dtype)
