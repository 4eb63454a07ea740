"""Checks of every Triton kernel of ``v41.kernels`` against its PyTorch reference, on fresh random inputs.

Run two ways (docs/numerics.md §4a): on the CPU through Triton's interpreter, in a subprocess that sets
``TRITON_INTERPRET=1`` and ``V41_KERNELS=triton`` before importing v41 (``python tests/kernel_checks.py`` prints
one JSON line per check; float32 operands, small shapes), and on a GPU by ``tests/test_gpu_fast.py`` (bf16 and
float32). Outputs are poisoned first (freed NaN memory that the next allocation reuses) and a non-finite output
never passes. Each check returns ``(name, relative error, tolerance)``.
"""

from __future__ import annotations

import itertools
import json
import os
import sys

import torch

from v41 import quant
from v41.cache.records import RecordFormat
from v41.kernels import (candidates, dequant, engram_gate, engram_rows, hc_embed, indexer, linear, mhc, moe,
                         moe_align, moe_prefill, norm, paged, record_store, rope, router, sampling, segments, softmax,
                         sparse_attention, swiglu, table_prologue, topk, window_pool, wstream)
from v41.engine.block_tables import one_allocation_tables
from v41.kernels.packed import PackedWeight, from_dense, stack_experts


def poison(device: str) -> None:
    """Leave NaN in memory the next allocations will reuse (CUDA caching allocator)."""
    if device.startswith("cuda"):
        x = torch.full((1 << 24,), float("nan"), device=device)
        del x


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    if not torch.isfinite(a[torch.isfinite(b)]).all() or a.shape != b.shape:
        return float("inf")
    fin = torch.isfinite(b)
    if not torch.equal(fin, torch.isfinite(a)) or not torch.equal(a[~fin], b[~fin]):
        return float("inf")
    return ((a[fin] - b[fin]).norm() / b[fin].norm().clamp(min=1e-30)).item()


def packed(w: torch.Tensor, fmt: str, block=(32, 32)) -> PackedWeight:
    if fmt == "fp8":
        q, s = quant.quant_fp8_block(w, block)
        return PackedWeight(q, s.view(torch.uint8), "fp8", block).check()
    if fmt == "mxfp4":
        q, s = quant.quant_mxfp4(w)
        return PackedWeight(q.view(torch.uint8), s.view(torch.uint8), "mxfp4", (1, 32)).check()
    return from_dense(w)


def tol(dtype: torch.dtype) -> float:
    return 2e-2 if dtype == torch.bfloat16 else 1e-5


def check_linear(device: str, dtype: torch.dtype, g: torch.Generator):
    out = []
    cases = [("fp8", (32, 32), 1, 64, 96, 1), ("fp8", (128, 128), 17, 128, 256, 1), ("dense", (1, 1), 5, 64, 512, 1),
             ("fp8", (32, 32), 3, 128, 64, 2), ("fp8", (32, 32), 1, 32, 8192, 1), ("fp8", (128, 128), 2, 96, 200, 1),
             ("fp8", (128, 128), 300, 64, 256, 1),  # a verify step of 50 requests × 6 rows
             ("fp8", (32, 32), 64, 64, 16384, 1),  # 16 K slices of 16 KB partials: summed after the kernel
             ("fp8", (128, 128), 520, 70, 200, 1), ("fp8", (32, 32), 513, 64, 96, 2),  # prefill rows: dequantized
             ("dense", (1, 1), 530, 48, 256, 1)]  # a float32 output: the BLAS GEMM in x's dtype on CUDA
    for fmt, block, m, n, k, groups in cases:
        w = packed(torch.randn(n, k, generator=g) / k ** 0.5, fmt, block).to(device)
        if fmt == "dense":
            w = from_dense(w.data.to(dtype))
        x = torch.randn(m, k * groups, generator=g).to(device, dtype)
        for out_dtype in sorted({dtype, torch.float32}, key=str):
            poison(device)
            y = linear.linear(x, w, out_dtype, groups)
            r = linear.linear_ref(x.double(), w, torch.float64, groups)
            out.append((f"linear/{fmt}{block[0]}/m{m}/g{groups}/{str(out_dtype)[6:]}", rel(y, r), tol(dtype)))
    for block, (n, k) in (((128, 128), (70, 200)), ((32, 32), (96, 64)), ((32, 32), (33, 130))):
        w = packed(torch.randn(n, k, generator=g) * 5, "fp8", block).to(device)
        for want_dtype in sorted({dtype, torch.float32}, key=str):  # one launch = the PyTorch form, bit for bit
            poison(device)
            same = torch.equal(dequant.dequantize(w, want_dtype), w.dequantize(want_dtype))
            out.append((f"dequant/fp8{block[0]}/{n}x{k}/{str(want_dtype)[6:]}", 0.0 if same else float("inf"), 0.0))
    return out


def check_grouped(device: str, dtype: torch.dtype, g: torch.Generator):
    out = []
    e, n, k, t, top = 6, 64, 256, 9, 2
    for fmt in ("mxfp4", "fp8", "fp8-128", "dense"):
        block = (128, 128) if fmt == "fp8-128" else (32, 32)
        fmt = fmt.split("-")[0]
        w = stack_experts([packed(torch.randn(n, k, generator=g) / k ** 0.5, fmt, block)
                           for _ in range(e)]).to(device)
        if fmt == "dense":
            w = from_dense(w.data.to(dtype))
        ids = torch.randint(0, e - 1, (t, top), generator=g).to(device)  # expert e-1 stays empty
        pairs = moe_align.route_pairs(ids, e)
        order, offsets = pairs.order, pairs.offsets
        x = torch.randn(t, k, generator=g).to(device, dtype)
        for rows in (order // top, None):
            xin = x if rows is not None else torch.randn(t * top, k, generator=g).to(device, dtype)
            poison(device)
            y = moe.grouped_linear(xin, w, offsets, rows, active=pairs.active)
            r = moe.grouped_linear_ref(xin.double().cpu(), w.to("cpu"), offsets.cpu(),
                                       None if rows is None else rows.cpu())
            tag = f"{fmt}{block[0]}" if fmt == "fp8" else fmt
            out.append((f"grouped/{tag}/{'gather' if rows is not None else 'rows'}", rel(y.cpu(), r), tol(dtype)))
            if rows is not None and fmt != "dense":  # a 64-input K step (grouped_config's bk), prefill-sized tiles
                for split in (1, 2):  # K split in two: slices of 128 inputs, two 64-input steps each
                    cfg = dict(moe.grouped_config(t * top, w, dtype), bm=64, bn=64, bk=64, split=split, maxnreg=128)
                    poison(device)
                    y = moe.grouped_linear_triton(xin, w, offsets, rows, cfg, pairs.active)
                    out.append((f"grouped/{tag}/bk64/split{split}", rel(y.cpu(), r), tol(dtype)))
                if fmt == "mxfp4":  # the weight tile as the dot's left operand (yᵀ = W·xᵀ), both row grids
                    for row_grid in (False, True):
                        cfg = dict(moe.grouped_config(t * top, w, dtype), bm=16, bn=64, bk=64, split=1,
                                   decode="nibble", swap=True, row_grid=row_grid)
                        poison(device)
                        y = moe.grouped_linear_triton(xin, w, offsets, rows, cfg, pairs.active)
                        out.append((f"grouped/{tag}/swap/grid{int(row_grid)}", rel(y.cpu(), r), tol(dtype)))
                if fmt == "mxfp4" and dtype == torch.bfloat16 and device != "cpu":  # the PTX bit moves (GPU only)
                    for bk, maxnreg, swap, warps in ((64, 128, False, 4), (128, None, False, 4), (64, 128, True, 8)):
                        cfg = dict(moe.grouped_config(t * top, w, dtype), bm=64, bn=128 if swap else 64, bk=bk,
                                   split=1, decode="bits", maxnreg=maxnreg, swap=swap, warps=warps)
                        poison(device)
                        y = moe.grouped_linear_triton(xin, w, offsets, rows, cfg, pairs.active)
                        out.append((f"grouped/{tag}/bits/bk{bk}{'/swap' if swap else ''}", rel(y.cpu(), r),
                                    tol(dtype)))
    # programs per row block (config row_grid): expert 0 takes three blocks of 16 rows (16, 16, 8), experts 2 and 3
    # about two each, expert 1 (between them) none; with and without a K split
    w = stack_experts([packed(torch.randn(n, k, generator=g) / k ** 0.5, "mxfp4") for _ in range(4)]).to(device)
    ids = torch.stack([torch.zeros(40, dtype=torch.int64), torch.randint(2, 4, (40,), generator=g)], 1).to(device)
    rb = moe_align.route_pairs(ids, 4)
    xr = torch.randn(40, k, generator=g).to(device, dtype)
    for rows, split in ((rb.order // 2, 1), (None, 1), (rb.order // 2, 2)):
        xin = xr if rows is not None else torch.randn(80, k, generator=g).to(device, dtype)
        cfg = dict(moe.grouped_config(80, w, dtype), bm=16, split=split, row_grid=True)
        poison(device)
        y = moe.grouped_linear_triton(xin, w, rb.offsets, rows, cfg)
        r = moe.grouped_linear_ref(xin.double().cpu(), w.to("cpu"), rb.offsets.cpu(),
                                   None if rows is None else rows.cpu())
        tag = f"{'gather' if rows is not None else 'rows'}/split{split}"
        out.append((f"grouped/mxfp4/row_grid/{tag}", rel(y.cpu(), r), tol(dtype)))
    # K = 160 is no whole number of 64- or 128-input steps: the last step's inputs are masked (EVEN_K off), with a
    # K split of two slices too, and through the bit moves on a GPU. The activations end where NaNs begin, so a load
    # past K (a step left unmasked) poisons the result even where the weights past K read as zeros
    k_odd = 160
    w = stack_experts([packed(torch.randn(n, k_odd, generator=g) / k_odd ** 0.5, "mxfp4") for _ in range(4)]).to(device)
    buf = torch.full((40 * k_odd + 256,), float("nan"), dtype=dtype, device=device)
    xo = buf[:40 * k_odd].view(40, k_odd)
    xo.copy_(torch.randn(40, k_odd, generator=g).to(device, dtype))
    r = moe.grouped_linear_ref(xo.double().cpu(), w.to("cpu"), rb.offsets.cpu(), (rb.order // 2).cpu())
    decodes = ("nibble", "bits") if dtype == torch.bfloat16 and device != "cpu" else ("nibble",)
    for bk, split, decode in itertools.product((64, 128), (1, 2), decodes):
        cfg = dict(moe.grouped_config(80, w, dtype), bm=16, bn=64, bk=bk, split=split, decode=decode, row_grid=True)
        poison(device)
        y = moe.grouped_linear_triton(xo, w, rb.offsets, rb.order // 2, cfg)
        out.append((f"grouped/mxfp4/k{k_odd}/bk{bk}/split{split}/{decode}", rel(y.cpu(), r), tol(dtype)))
    yp = torch.randn(t * top, k, generator=g).to(device, dtype)
    extra = torch.randn(t, k, generator=g).to(device, dtype)
    inv = pairs.inv
    for ex in (extra, None):
        poison(device)
        got = moe.combine_pairs(yp, inv, top, ex)
        want = moe.combine_pairs_ref(yp.double(), inv, top, None if ex is None else ex.double())
        out.append((f"combine/{'shared' if ex is not None else 'routed'}", rel(got, want), tol(dtype)))
    return out


def check_moe_prefill(device: str, dtype: torch.dtype, g: torch.Generator):
    """MXFP4 experts dequantized in one launch equal the PyTorch form bit for bit (a run of experts from the
    middle, partial tiles, scales over ~40 binades, nothing written past the run; a program per tile and 3 programs
    looping over them); in bf16, dequantize-then-grouped-GEMM over chunks of 3 of 8 experts (a scratch buffer
    reused, the last chunk part-filled, one expert empty, gathered and pre-sorted rows) against the reference."""
    out = []
    e, n, k = 5, 40, 224  # partial tiles of 32 rows × 128 inputs
    w = stack_experts([packed(torch.randn(n, k, generator=g) * 2.0 ** torch.randint(-20, 20, (n, 1), generator=g),
                              "mxfp4") for _ in range(e)]).to(device)
    for a, b in ((0, e), (2, 4)):
        for want in sorted({dtype, torch.float32}, key=str):
            for programs in (0, 3):  # a program per tile; 3 programs looping over the tiles
                out_buf = torch.full((b - a + 1, n, k), 7.0, dtype=want, device=device)  # its last expert stays 7
                got = dequant.dequantize_experts(w, a, b, out_buf, programs)
                ref = PackedWeight(w.data[a:b], w.scale[a:b], "mxfp4", w.block).dequantize(want)
                same = torch.equal(got[:b - a], ref) and bool((got[b - a] == 7.0).all())
                out.append((f"dequantize_experts/{a}..{b}/{str(want)[6:]}/programs={programs}",
                            0.0 if same else float("inf"), 0.0))
    if dtype != torch.bfloat16:  # the grouped GEMM takes bf16
        return out
    e, n, k, t, top = 8, 64, 256, 40, 3
    w = stack_experts([packed(torch.randn(n, k, generator=g) / k ** 0.5, "mxfp4") for _ in range(e)]).to(device)
    ids = torch.randint(0, e, (t, top), generator=g)
    ids = torch.where(ids == 4, 0, ids).to(device)  # expert 4 stays empty; chunks (0..3), (3..6), (6..8): each
    # scratch buffer written twice on CUDA, the last chunk part-filled
    pairs = moe_align.route_pairs(ids, e)
    x = torch.randn(t, k, generator=g).to(device, dtype)
    for rows in (pairs.order // top, None):
        xin = x if rows is not None else torch.randn(t * top, k, generator=g).to(device, dtype)
        poison(device)
        y = moe_prefill.grouped_dequant_mm(xin, w, pairs.offsets, rows, chunk=3)
        r = moe.grouped_linear_ref(xin.double().cpu(), w.to("cpu"), pairs.offsets.cpu(),
                                   None if rows is None else rows.cpu())
        out.append((f"grouped_dequant_mm/{'gather' if rows is not None else 'rows'}", rel(y.cpu(), r), tol(dtype)))
    return out


def check_route_pairs(device: str, dtype: torch.dtype, g: torch.Generator):
    """The expert-sorted pairs equal the PyTorch reference's exactly (order, offsets, live experts, inverse, rows),
    for routings with empty experts, one expert taking every pair, more experts than pairs and the reverse."""
    out = []
    for t, k, e in ((1, 6, 256), (9, 2, 6), (8, 6, 384), (64, 6, 256), (5, 3, 1), (300, 8, 16)):
        ids = torch.randint(0, e, (t, k), generator=g)
        if t == 9:
            ids[:, 1] = 0  # one expert takes a slot of every token; the last experts stay empty
            ids.clamp_(max=e - 2)
        ids = ids.to(device)
        poison(device)
        got, want = moe_align.route_pairs(ids, e), moe_align.route_pairs_ref(ids, e)
        same = all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(got, want))
        out.append((f"route_pairs/t{t}/k{k}/e{e}", 0.0 if same else float("inf"), 0.0))
    return out


def check_window_pool(device: str, dtype: torch.dtype, g: torch.Generator):
    """Segments of several lengths (padding rows, an all-padding segment), some continuing a state triple, one
    state row read by two segments; float32 as the compressors run it."""
    t, c, width = 23, 300, 5
    value = torch.randn(t, c, generator=g).to(device)
    gate = (torch.randn(t, c, generator=g) * 4).to(device)
    rows = torch.randint(0, t, (6, width), generator=g)
    valid = torch.ones(6, width, dtype=torch.bool)
    valid[1, 2:] = False
    valid[3] = False  # a padding segment: the empty triple
    valid[4, 1:] = False  # one row: a decode step's segment
    state = torch.randn(4, 3, c, generator=g)
    state[:, 1] = state[:, 1].abs()
    state[2, 0] = float("-inf")  # a continued window whose earlier part was empty
    state[2, 1:] = 0.0
    cont = torch.tensor([True, False, True, False, True, False])  # segment 3: nothing at all (m = −inf)
    srow = torch.tensor([0, 1, 2, 3, 0, 3])
    args = [a.to(device) for a in (rows, valid, cont, srow)]
    poison(device)
    got = window_pool.pool_windows(*args, value, gate, state.to(device))
    want = window_pool.pool_windows_ref(*[a.cpu() for a in args], value.double().cpu(), gate.double().cpu(),
                                        state.double())
    fused = torch.cat([value, gate, value[:, :7]], dim=1)  # value and gate as column views of one GEMM's output
    poison(device)
    views = window_pool.pool_windows(*args, fused[:, :c], fused[:, c:2 * c], state.to(device))
    # V4's gate bias ape[p mod R] at each token's position, added where the gate is read
    ape = torch.randn(4, c, generator=g) * 3
    pos = torch.randint(0, 1000, (t,), generator=g)
    poison(device)
    biased = window_pool.pool_windows(*args, fused[:, :c], fused[:, c:2 * c], state.to(device), ape.to(device),
                                      pos.to(device))
    want_b = window_pool.pool_windows_ref(*[a.cpu() for a in args], value.double().cpu(), gate.double().cpu(),
                                          state.double(), ape.double(), pos)
    unbiased = window_pool.pool_windows_ref(*[a.cpu() for a in args], value.double().cpu(),
                                            gate.double().cpu() + ape.double()[pos % 4], state.double())
    out = [("window_pool/mixed", rel(got.cpu(), want), 1e-5),
           ("window_pool/column views", 0.0 if torch.equal(views, got) else float("inf"), 0.0),
           ("window_pool/gate bias", rel(biased.cpu(), want_b), 1e-5),
           ("window_pool/gate bias reference", 0.0 if torch.equal(want_b, unbiased) else float("inf"), 0.0)]
    # the pooled values a / s (s = 0: no token) from the triples' column views, as PyTorch divides and rounds
    for dt, through in ((torch.float32, False), (torch.float32, True), (torch.bfloat16, False)):
        poison(device)
        pv = window_pool.pooled_values(got[:, 1], got[:, 2], dt, through)
        ref = window_pool.pooled_values_ref(got[:, 1].cpu(), got[:, 2].cpu(), dt, through)
        same = torch.equal(pv.cpu(), ref) and pv.dtype == dt and bool((ref[3] == 0).all())
        out.append((f"window_pool/pooled {dt} through_bf16={through}", 0.0 if same else float("inf"), 0.0))
    # V4's CSA entries: the B half combined with the previous window's A triple from the cov cache (window 0: none;
    # a window whose block is absent: zeros), from column views of the pool's output
    rpb, n_seg = 4, 6
    cache = torch.randn(3 * rpb + rpb, 3, c, generator=g)
    cache[:, 1] = cache[:, 1].abs()
    cache[5, 0] = float("-inf")  # a previous window with no token
    cache[5, 1:] = 0.0
    table = torch.tensor([[2, 0, -1], [1, -1, 3]])
    req = torch.tensor([0, 1, 0, 1, 0, 1])
    win = torch.tensor([0, 2, 5, 9, 4, 6])  # previous entries: none, slot 5 (empty), 0, 12, 11, block absent
    trip = torch.randn(n_seg, 3, 2 * c, generator=g)
    trip[:, 1] = trip[:, 1].abs()
    trip[2, 0], trip[2, 1:] = float("-inf"), 0.0  # an empty own half
    cols = [x.to(device)[:, c:] for x in (trip[:, 0], trip[:, 1], trip[:, 2])]
    for dt in (torch.float32, torch.bfloat16):
        poison(device)
        got = window_pool.pooled_after_previous(*cols, cache.to(device), table.to(device), req.to(device),
                                                win.to(device), rpb, dt)
        want = window_pool.pooled_after_previous_ref(*(x.double()[:, c:] for x in (trip[:, 0], trip[:, 1], trip[:, 2])),
                                                     cache.double(), table, req, win, rpb, torch.float64)
        out.append((f"window_pool/after previous {dt}", rel(got.cpu(), want), 1e-5 if dt == torch.float32 else 1e-2))
    return out


def check_attention(device: str, dtype: torch.dtype, g: torch.Generator):
    out = []
    for d, h in ((64, 6), (512, 20)):
        t, s = 5, 80
        q = torch.randn(t, h, d, generator=g).to(device, dtype)
        c0, c1 = (torch.randn(s, d, generator=g).to(device, dtype) for _ in range(2))
        s0 = torch.randint(-1, s, (t, 9), generator=g).to(device)
        s1 = torch.randint(-1, s, (t, 70), generator=g).to(device)
        s0[2], s1[2] = -1, -1  # a query with no valid key returns zeros
        sink = torch.randn(h, generator=g).to(device)
        for sources in ([(c0, s0)], [(c0, s0), (c1, s1)]):
            poison(device)
            y = sparse_attention.sparse_mqa_sink(q, sources, sink, d ** -0.5)
            r = sparse_attention.sparse_mqa_sink_ref(q.double(), [(c.double(), sl) for c, sl in sources],
                                                     sink.double(), d ** -0.5)
            out.append((f"attention/d{d}/h{h}/{len(sources)}src", rel(y, r), tol(dtype)))
            if d == 512 and (device == "cpu" or (dtype == torch.bfloat16 and torch.cuda.get_device_capability()[0]
                                                  in sparse_attention.WIDE_SMEM_MAJORS)):  # the wide tiling
                poison(device)  # (64 heads a program: the 20 heads and 44 masked ones)
                y = sparse_attention._sparse_triton(q, sources, sink, d ** -0.5, [None] * len(sources), wide=True)
                out.append((f"attention/d{d}/h{h}/{len(sources)}src/wide", rel(y, r), tol(dtype)))
                if device == "cuda":  # the dispatch takes it for chunks of WIDE_MIN_TOKENS tokens
                    saved, sparse_attention.WIDE_MIN_TOKENS = sparse_attention.WIDE_MIN_TOKENS, t
                    try:
                        same = torch.equal(sparse_attention.sparse_mqa_sink(q, sources, sink, d ** -0.5), y)
                    finally:
                        sparse_attention.WIDE_MIN_TOKENS = saved
                    out.append((f"attention/d{d}/h{h}/{len(sources)}src/wide dispatch", 0.0 if same else 1.0, 0.0))
        # --kv-cache-dtype fp8: V4.1's window as FP8 records and compressed entries as FP4 records; V4's rows
        v4 = RecordFormat("swa_v4", d, rope=d // 8)
        for name, fmts in (("v41", [RecordFormat("swa_fp8", d), RecordFormat("ckv_fp4", d)]), ("v4", [v4, v4])):
            recs = [(f.encode(c * 3), sl) for f, (c, sl) in zip(fmts, ((c0, s0), (c1, s1)))]
            poison(device)
            y = sparse_attention.sparse_mqa_sink(q, recs, sink, d ** -0.5, fmts)
            r = sparse_attention.sparse_mqa_sink_ref(q.double(), recs, sink.double(), d ** -0.5, fmts)
            out.append((f"attention/d{d}/h{h}/records-{name}", rel(y, r), tol(dtype)))
    return out


def check_index_scores(device: str, dtype: torch.dtype, g: torch.Generator):
    """The scorer's tilings: one query per program, and query blocks that share a request (2 queries), straddle
    requests (4) or run past the step (8 of 6 queries); entry blocks shorter than the entries (16 of 20)."""
    out = []
    for hi, di in ((4, 32), (64, 128)):
        t, r, b, rpb = 6, 3, 5, 4
        slots = (r * b + 1) * rpb
        q = torch.randn(t, hi, di, generator=g).to(device, dtype)
        w = torch.randn(t, hi, generator=g).to(device)
        keys = torch.randn(slots, di, generator=g).to(device, dtype)
        bt = torch.randperm(slots // rpb, generator=g)[:r * b].view(r, b).to(device)
        bt[1, 3:] = -1
        req = torch.tensor([0, 0, 1, 1, 2, 2], device=device)
        nvis = torch.tensor([3, 4, 10, 12, 0, 19], device=device)
        fmt = RecordFormat("idx_mxfp4", di)  # --kv-cache-dtype fp8: MXFP4 key records
        recs = fmt.encode(keys)
        ref = indexer.index_scores_ref(q.double(), w.double(), keys.double(), bt, req, nvis, rpb, 20)
        ref_rec = indexer.index_scores_ref(q.double(), w.double(), recs, bt, req, nvis, rpb, 20, record=fmt)
        for tiles in (None, (2, 16, 4), (4, 32, 4), (8, 16, 4)):
            name = f"index_scores/h{hi}/d{di}/{tiles or 'default'}"
            poison(device)
            y = indexer.index_scores(q, w, keys, bt, req, nvis, rpb, 20, tiles=tiles)
            out.append((name, rel(y, ref), tol(dtype)))
            poison(device)
            y = indexer.index_scores(q, w, recs, bt, req, nvis, rpb, 20, record=fmt, tiles=tiles)
            out.append((name + "/records", rel(y, ref_rec), tol(dtype)))
        # the head weights' scale applied where they are loaded, from a column view of a wider float32 output:
        # the bits of scaling them first
        wide = torch.randn(t, hi + 9, generator=g).to(device)
        scale = (di * hi) ** -0.5
        poison(device)
        y = indexer.index_scores(q, wide[:, 3:3 + hi], keys, bt, req, nvis, rpb, 20, w_scale=scale)
        want = indexer.index_scores(q, wide[:, 3:3 + hi] * scale, keys, bt, req, nvis, rpb, 20)
        out.append((f"index_scores/h{hi}/d{di}/w_scale", 0.0 if torch.equal(y, want) else float("inf"), 0.0))
    return out


def check_record_store(device: str, dtype: torch.dtype, g: torch.Generator):
    """The fused record writer gives RecordFormat.encode's bytes exactly (0 = equal, inf = not), over rows of
    magnitudes 1e-7 .. 1e5 (clamped and subnormal scales), zero rows and blocks, −1 slots and an index; and the
    fused MXFP4 query rounding equals quant.mxfp4_qdq."""
    out = []
    for fmt in (RecordFormat("swa_fp8", 64), RecordFormat("ckv_fp4", 96), RecordFormat("idx_mxfp4", 32),
                RecordFormat("swa_v4", 64, rope=16), RecordFormat("swa_v4", 512, rope=64),
                RecordFormat("swa_fp8", 512), RecordFormat("ckv_fp4", 512), RecordFormat("idx_mxfp4", 128)):
        n = 12
        x = torch.randn(n, fmt.dims, generator=g) * torch.logspace(-7, 5, n).view(n, 1)
        x[0] = 0.0
        x[1, : fmt.block] = 0.0
        # ties that an approximate division would break: the block maximum sits on a scale boundary and the
        # other values on rounding midpoints of their codes (E4M3 1.0625; E2M1 0.75 with a non-power-of-two scale)
        big, mid = {"swa_fp8": (7.0, 1.0625 / 64), "swa_v4": (7.0, 1.0625 / 64), "ckv_fp4": (1.03125, 0.12890625),
                    "idx_mxfp4": (7.0, 1.5)}[fmt.kind]
        x[2, 0::2], x[2, 1::2] = big, mid
        x = x.to(device, dtype)
        slots = torch.randperm(2 * n, generator=g)[:n].to(device)
        slots[3] = -1
        index = torch.randperm(n, generator=g).to(device)
        index[6] = -1  # a row that writes nothing
        want = torch.zeros(2 * n + 1, fmt.nbytes, dtype=torch.uint8, device=device)
        got = torch.zeros_like(want)
        paged.scatter_rows_ref(want, paged.indexed_slots(slots, index), fmt.encode(x), 2 * n)
        record_store.store_records(got, slots, x, fmt, 2 * n, index=index)
        out.append((f"record_store/{fmt.kind}-{fmt.dims}", 0.0 if torch.equal(got[:-1], want[:-1]) else float("inf"),
                    0.0))
    for fmt, norm, rot in ((RecordFormat("swa_fp8", 512), True, True), (RecordFormat("idx_mxfp4", 128), True, True),
                           (RecordFormat("ckv_fp4", 512), False, True), (RecordFormat("swa_v4", 512, rope=64), True, True),
                           (RecordFormat("swa_fp8", 64), True, False)):
        n = 9  # rows: a column view of a wider projection output, written through an index, one slot −1
        wide = (torch.randn(n, fmt.dims + 40, generator=g) * 3).to(device, dtype)
        x = wide[:, 24:24 + fmt.dims]
        prep = {"norm": ((1 + 0.1 * torch.randn(fmt.dims, generator=g)).to(device), 1e-6) if norm else None,
                "rope": tuple((torch.rand(n, 32, generator=g) * 2 - 1).to(device) for _ in range(2)) if rot else None}
        slots = torch.randperm(2 * n, generator=g)[:n].to(device)
        slots[4] = -1
        index = torch.randperm(n, generator=g).to(device)
        want = torch.zeros(2 * n + 1, fmt.nbytes, dtype=torch.uint8, device=device)
        got = torch.zeros_like(want)
        record_store.store_records(want, slots, record_store.prepare_rows(x, **prep), fmt, 2 * n, index=index)
        poison(device)
        record_store.store_records(got, slots, x, fmt, 2 * n, index=index, **prep)
        name = "+".join(k for k, v in prep.items() if v is not None)
        out.append((f"record_store/{name}/{fmt.kind}-{fmt.dims}", 0.0 if torch.equal(got[:-1], want[:-1])
                    else float("inf"), 0.0))
    q = (torch.randn(5, 4, 128, generator=g) * torch.logspace(-6, 4, 5).view(5, 1, 1)).to(device, dtype)
    same = torch.equal(record_store.mxfp4_qdq_rows(q), quant.mxfp4_qdq(q, 32))
    out.append(("record_store/mxfp4_qdq_rows", 0.0 if same else float("inf"), 0.0))
    angles = tuple((torch.rand(5, 32, generator=g) * 2 - 1).to(device) for _ in range(2))  # the index queries' RoPE
    poison(device)
    same = torch.equal(record_store.mxfp4_qdq_rows(q, rope=angles), quant.mxfp4_qdq(rope.rope(q, *angles), 32))
    out.append(("record_store/mxfp4_qdq_rows after rope", 0.0 if same else float("inf"), 0.0))
    return out


def check_mhc(device: str, dtype: torch.dtype, g: torch.Generator):
    """The seam's mixes in one launch (split-K, the last program of a token block finishes it) at 37 tokens over 2
    K slices and one token over 16 (a decode step), twice (the arrival counters must be left zeroed), and in two
    launches (mhc.ONE_LAUNCH off, or no counters: a CUDA-graph capture before any eager run); collapse, collapse
    with the RMSNorm (equal to the two launches bit for bit), expand, and the whole seam (:func:`mhc.hc_seam`)."""
    out = []
    for t, d in ((37, 64), (1, 512)):
        h = torch.randn(t, 4, d, generator=g).to(device, dtype)
        fn = (torch.randn(24, 4 * d, generator=g) * 0.1).to(device)
        scale = (1 + torch.randn(3, generator=g) * 0.1).to(device)
        base = (torch.randn(24, generator=g) * 0.3).to(device)
        want = mhc.hc_mixes_ref(h.double(), fn.double(), scale.double(), base.double(), 4, 20, 1e-6, 1e-6)
        for run in ("one launch", "again", "two launches", "no counters"):
            counters, one = wstream.split_counters, mhc.ONE_LAUNCH
            mhc.ONE_LAUNCH = run != "two launches"
            if run == "no counters":
                wstream.split_counters = lambda device: None
            try:
                poison(device)
                got = mhc.hc_mixes(h, fn, scale, base, 4, 20, 1e-6, 1e-6)
            finally:
                wstream.split_counters, mhc.ONE_LAUNCH = counters, one
            out += [(f"mhc/{name} T={t} {run}", rel(a, b), 1e-5) for name, a, b in zip(("pre", "post", "comb"), got,
                                                                                         want)]
        wide_t = mhc.MIX_WIDE_T  # 64-token tiles
        try:
            mhc.MIX_WIDE_T = 1
            poison(device)
            got = mhc.hc_mixes(h, fn, scale, base, 4, 20, 1e-6, 1e-6)
            out += [(f"mhc/{name} T={t} 64-token tiles", rel(a, b), 1e-5) for name, a, b in zip(("pre", "post", "comb"),
                                                                                                got, want)]
        finally:
            mhc.MIX_WIDE_T = wide_t
        gemv_t = mhc.MIX_GEMV_T  # the split-K pass the default did not take (one token per program, or tiled)
        try:
            mhc.MIX_GEMV_T = 0 if t <= gemv_t else 64
            other = "tiled" if mhc.MIX_GEMV_T == 0 else "one token per program"
            for mhc.ONE_LAUNCH in (True, False):
                poison(device)
                got = mhc.hc_mixes(h, fn, scale, base, 4, 20, 1e-6, 1e-6)
                out += [(f"mhc/{name} T={t} {other}{'' if mhc.ONE_LAUNCH else ', two launches'}",
                         rel(a, b), 1e-5) for name, a, b in zip(("pre", "post", "comb"), got, want)]
        finally:
            mhc.MIX_GEMV_T, mhc.ONE_LAUNCH = gemv_t, one
        unroll = mhc.FINISH_UNROLL  # the finish adds the slices in order at any unroll: the same bits
        try:
            runs = []
            for mhc.FINISH_UNROLL in (1, 3):
                mhc.ONE_LAUNCH = False
                runs.append(mhc.hc_mixes(h, fn, scale, base, 4, 20, 1e-6, 1e-6))
        finally:
            mhc.FINISH_UNROLL, mhc.ONE_LAUNCH = unroll, one
        same = all(torch.equal(a, b) for a, b in zip(*runs))
        out.append((f"mhc/T={t} finish unrolled = rolled", 0.0 if same else float("inf"), 0.0))
    left = wstream.split_counters(torch.device(device))[:wstream.COUNTER_SLOTS]
    out.append(("mhc/counters left zeroed", float(left.abs().sum()), 0.0))
    pre, post, comb = (x.float() for x in want)
    y = torch.randn(t, d, generator=g).to(device, dtype)
    poison(device)
    out.append(("mhc/collapse", rel(mhc.hc_collapse(h, pre), mhc.hc_collapse_ref(h.double(), pre.double())),
                tol(dtype)))
    w = (1 + torch.randn(d, generator=g) * 0.1).to(device)
    poison(device)
    fused = mhc.hc_collapse_norm(h, pre, 1e-6, w)
    out.append(("mhc/collapse_norm", rel(fused, mhc.hc_collapse_norm_ref(h.double(), pre.double(), 1e-6, w.double())),
                tol(dtype)))
    two = norm.rms_norm(mhc.hc_collapse(h, pre), 1e-6, w)  # the two launches it replaces, bit for bit
    out.append(("mhc/collapse_norm = collapse, rms_norm", 0.0 if torch.equal(fused, two) else float("inf"), 0.0))
    sel = torch.tensor([t - 1, 0, t - 1], device=device)  # the head's logits rows, in their order, one repeated
    poison(device)
    picked = mhc.hc_collapse_norm(h, pre, 1e-6, w, sel)
    out.append(("mhc/collapse_norm of rows", 0.0 if torch.equal(picked, fused[sel]) else float("inf"), 0.0))
    ids = torch.randint(0, 50, (t,), generator=g).to(device)
    table = torch.randn(50, d, generator=g).to(device, dtype)
    poison(device)
    copies, first = hc_embed.hc_embed(ids, table, 4, torch.float32)
    want_h, want_pre = hc_embed.hc_copies(table[ids], 4, torch.float32)
    same = torch.equal(copies, want_h) and torch.equal(first, want_pre) and first.dtype == torch.float32
    out.append(("mhc/embedding copies and pre-mix", 0.0 if same else float("inf"), 0.0))
    poison(device)
    out.append(("mhc/expand", rel(mhc.hc_expand(h, y, post, comb),
                                  mhc.hc_expand_ref(h.double(), y.double(), post.double(), comb.double())), tol(dtype)))
    for given in (True, False):  # the whole seam: expansion, mixes of the copies as stored, collapse + norm
        poison(device)
        pre_c = pre if given else None
        h2, *mixes, x = mhc.hc_seam(h, fn, scale, base, 4, 20, 1e-6, 1e-6, pre_c, 1e-5, w, y, post, comb)
        out.append((f"mhc/seam copies given={given}",
                    rel(h2, mhc.hc_expand_ref(h.double(), y.double(), post.double(), comb.double())), tol(dtype)))
        want = mhc.hc_mixes_ref(h2.double(), fn.double(), scale.double(), base.double(), 4, 20, 1e-6, 1e-6)
        out += [(f"mhc/seam {name} given={given}", rel(a, b), 1e-5) for name, a, b in zip(("pre", "post", "comb"),
                                                                                            mixes, want)]
        w_c = (pre if given else mixes[0]).double()
        out.append((f"mhc/seam x given={given}",
                    rel(x, mhc.hc_collapse_norm_ref(h2.double(), w_c, 1e-5, w.double())), tol(dtype)))
    return out


def check_uniforms(device: str, dtype: torch.dtype, g: torch.Generator):
    # the last row (seed 810476, position 0) draws x >> 8 = 2^24 − 1 in a column: u must stay below 1
    seeds = torch.cat([torch.randint(-2 ** 62, 2 ** 62, (5,), generator=g), torch.tensor([810476])]).to(device)
    pos = torch.cat([torch.randint(0, 1 << 31, (5,), generator=g), torch.tensor([0])]).to(device)
    poison(device)
    got = sampling.uniforms(seeds, pos, 3000, sampling.PURPOSE_SAMPLE)
    want = sampling.uniforms_ref(seeds.cpu(), pos.cpu(), 3000, sampling.PURPOSE_SAMPLE)
    below_one = bool((got < 1.0).all())
    slots = torch.randint(0, 7, (6,), generator=g)  # draft slots (speculative decoding's keys)
    poison(device)
    got_s = sampling.uniforms(seeds, pos, 300, sampling.PURPOSE_DRAFT, slots.to(device))
    want_s = sampling.uniforms_ref(seeds.cpu(), pos.cpu(), 300, sampling.PURPOSE_DRAFT, slots)
    return [("uniforms/bitwise", 0.0 if torch.equal(got.cpu(), want) and below_one else float("inf"), 0.0),
            ("uniforms/slots bitwise", 0.0 if torch.equal(got_s.cpu(), want_s) else float("inf"), 0.0)]


def check_race(device: str, dtype: torch.dtype, g: torch.Generator):
    """The keyed race in two launches picks what the five PyTorch launches pick, bit for bit: softmax rows of
    4,099 columns (two blocks and a short one), a row of exact ties (lowest id), a row with a NaN (wins, as in
    torch.argmax), a zero row but one column, slots and purposes."""
    v = 2 * sampling.RACE_BLOCK + 3
    w = torch.softmax(torch.randn(7, v, generator=g) * 3, dim=-1)
    w[3] = 0.5  # ties everywhere: the draws decide, as in the reference
    w[4, 2 * sampling.RACE_BLOCK + 1] = float("nan")
    w[5] = 0.0
    w[5, v - 1] = 1.0
    w = w.to(device)
    seeds = torch.randint(-2 ** 62, 2 ** 62, (7,), generator=g).to(device)
    pos = torch.randint(0, 1 << 31, (7,), generator=g).to(device)
    slots = torch.randint(0, 5, (7,), generator=g).to(device)
    out = []
    for purpose, sl in ((sampling.PURPOSE_SAMPLE, None), (sampling.PURPOSE_DRAFT, slots)):
        poison(device)
        got = sampling.keyed_race(w, seeds, pos, purpose, sl)
        want = sampling.keyed_race_ref(w, seeds, pos, purpose, sl)  # PyTorch on the same device
        out.append((f"race/purpose {purpose}", 0.0 if torch.equal(got, want) else float("inf"), 0.0))
    return out


def check_angle_tables(device: str, dtype: torch.dtype, g: torch.Generator):
    """RoPE's cos / sin tables from float64 angles at positions up to 1M (and ×128, a compressed entry's first
    position), 32 frequencies of V4.1's YaRN range, against the float64 reference."""
    pos = torch.cat([torch.randint(0, 1 << 20, (9,), generator=g), torch.tensor([0, (1 << 20) - 1])]).to(device)
    freq = (10000.0 ** (-torch.arange(32, dtype=torch.float64) / 32)).to(device)
    out = []
    for scale in (1, 128):
        poison(device)
        cos, sin = rope.angle_tables(pos, freq, torch.float32, scale)
        want = rope.angle_tables_ref(pos.cpu(), freq.cpu(), torch.float64, scale)
        out += [(f"angle_tables/{name} ×{scale}", rel(a.cpu(), b), 1e-6) for name, a, b in zip(("cos", "sin"),
                                                                                            (cos, sin), want)]
    return out


def check_softmax(device: str, dtype: torch.dtype, g: torch.Generator):
    """The sampler's softmax with the temperature folded in: rows over two blocks and a short one, a whole block of
    −inf (a block with no candidate), scattered −inf (masked ids), a row of −inf only (NaN, as PyTorch's)."""
    v = 2 * softmax.BLOCK + 5
    x = torch.randn(5, v, generator=g) * 4
    x[1, :softmax.BLOCK] = float("-inf")
    x[2, ::7] = float("-inf")
    x[3] = float("-inf")
    t = torch.rand(5, generator=g) * 1.5 + 0.2
    out = []
    for temp in (t, None):
        poison(device)
        got = softmax.softmax_rows(x.to(device), None if temp is None else temp.to(device)).cpu()
        want = softmax.softmax_rows_ref(x.double(), None if temp is None else temp.double())
        live = [0, 1, 2, 4]
        out.append((f"softmax/{'temperature' if temp is not None else 'plain'}", rel(got[live], want[live]), 1e-5))
        out.append((f"softmax/{'temperature' if temp is not None else 'plain'}/-inf row is NaN",
                    0.0 if bool(got[3].isnan().all()) else float("inf"), 0.0))
    return out


def check_norm_rope_swiglu(device: str, dtype: torch.dtype, g: torch.Generator):
    out = []
    for shape, weighted in (((7, 96), True), ((3, 5, 64), False)):
        x = (torch.randn(*shape, generator=g) * 3).to(device, dtype)
        w = (1 + torch.randn(shape[-1], generator=g) * 0.1).to(device)
        poison(device)
        y = norm.rms_norm(x, 1e-6, w if weighted else None)
        r = norm.rms_norm_ref(x.double(), 1e-6, w.double() if weighted else None)
        out.append((f"rms_norm/{'x'.join(map(str, shape))}", rel(y, r), tol(dtype)))
    for shape in ((6, 64), (4, 3, 128), (2, 21, 96)):  # 21 heads: rope_'s programs of 16 rows, one part-filled
        x = torch.randn(*shape, generator=g).to(device, dtype)
        ang = torch.rand(shape[0], 16, generator=g, dtype=torch.float64) * 100
        cos, sin = ang.cos().to(device), ang.sin().to(device)
        for inverse in (False, True):
            poison(device)
            y = rope.rope(x, cos.float(), sin.float(), inverse)
            r = rope.rope_ref(x.double(), cos, sin, inverse)
            out.append((f"rope/{'x'.join(map(str, shape))}/{'inv' if inverse else 'fwd'}", rel(y, r), tol(dtype)))
            inplace = x.clone()  # in place: the rotated columns' bits, the others untouched
            same = rope.rope_(inplace, cos.float(), sin.float(), inverse) is inplace and torch.equal(inplace, y)
            out.append((f"rope_/{'x'.join(map(str, shape))}/{'inv' if inverse else 'fwd'}",
                        0.0 if same else float("inf"), 0.0))
    h13 = (torch.randn(9, 2 * 40, generator=g) * 6).to(device, dtype)
    wt = torch.rand(9, generator=g).to(device)
    for weight in (wt, None):
        poison(device)
        y = swiglu.swiglu(h13, 7.0, weight)
        r = swiglu.swiglu_ref(h13.double(), 7.0, None if weight is None else weight.double())
        out.append((f"swiglu/{'weighted' if weight is not None else 'plain'}", rel(y, r), tol(dtype)))
    for d, half in ((96, 16), (512, 32)):  # the cache-write prologue: RMSNorm then RoPE in one launch
        x = (torch.randn(5, d, generator=g) * 3).to(device, dtype)
        w = (1 + torch.randn(d, generator=g) * 0.1).to(device, dtype)
        ang = torch.rand(5, half, generator=g, dtype=torch.float64) * 100
        cos, sin = ang.cos().float().to(device), ang.sin().float().to(device)
        poison(device)
        y = rope.rms_norm_rope(x, 1e-6, w, cos, sin)
        r = rope.rms_norm_rope_ref(x.double(), 1e-6, w.double(), cos.double(), sin.double())
        out.append((f"rms_norm_rope/{d}", rel(y, r), tol(dtype)))
        two = rope.rope(norm.rms_norm(x, 1e-6, w), cos, sin)  # the two launches it replaces: the same bits
        out.append((f"rms_norm_rope/{d}/bits", 0.0 if torch.equal(y, two) else float("inf"), 0.0))
        # a column view of a wider row (a fused GEMM's output, models/fast/fused.py), read in place: the same bits
        wide = torch.cat([(torch.randn(5, 40, generator=g) * 3).to(device, dtype), x,
                          torch.randn(5, 8, generator=g).to(device, dtype)], dim=1)
        view = wide[:, 40:40 + d]
        poison(device)
        same = torch.equal(rope.rms_norm_rope(view, 1e-6, w, cos, sin), y) and \
            torch.equal(norm.rms_norm(view, 1e-6, w), norm.rms_norm(x, 1e-6, w))
        out.append((f"rms_norm_rope, rms_norm/{d}/column view", 0.0 if same else float("inf"), 0.0))
    pair_w = torch.rand(5, 3, generator=g).to(device)  # routing weights [T, k], read through the pairs' order
    order = torch.randperm(15, generator=g)[:9].to(device)
    poison(device)
    y = swiglu.swiglu(h13, 7.0, pair_w.reshape(-1), order)
    r = swiglu.swiglu_ref(h13.double(), 7.0, pair_w.reshape(-1).double()[order])
    out.append(("swiglu/ordered", rel(y, r), tol(dtype)))
    return out


def check_engram_gate(device: str, dtype: torch.dtype, g: torch.Generator):
    """The gate in one launch: D within one block and over two (1,100 > 1,024), keys and value read from a wider
    row (a strided kv), copies whose score is 0 (h = 0: sign 0, g = 1/2) and negative."""
    out = []
    for t, hc, d in ((3, 4, 96), (2, 2, 1100)):
        h = torch.randn(t, hc, d, generator=g).to(device, dtype)
        h[0, 1] = 0
        kv = torch.randn(t, (hc + 1) * d + 7, generator=g).to(device, dtype)[:, 3:3 + (hc + 1) * d]
        qw, kw = (torch.rand(hc, d, generator=g) + 0.5).to(device), (torch.randn(hc, d, generator=g)).to(device)
        poison(device)
        y = engram_gate.engram_gate(h, kv, qw, kw, 1e-6, 1e-6)
        r = engram_gate.engram_gate_ref(h.double(), kv.double(), qw.double(), kw.double(), 1e-6, 1e-6)
        out.append((f"engram_gate/{t}x{hc}x{d}", rel(y, r), tol(dtype)))
    return out


def check_engram_rows(device: str, dtype: torch.dtype, g: torch.Generator):
    """Gathered and dequantized FP8 table rows equal the PyTorch gather + dequantize exactly (0 = equal, inf = not;
    −0 codes may come back as +0, records.e4m3_value's sign): every E4M3 code but NaN, scale bytes 0 (a subnormal factor) .. 254, a column range past column 0 and a
    rank's first row past row 0, padding rows outside the rank's table (wrapped and clamped into it), row_ids with a
    row stride wider than their columns."""
    rows_local, hd, block, row0 = 40, 64, 32, 100
    codes = torch.randint(0, 256, (rows_local, hd), generator=g, dtype=torch.int32)
    codes = torch.where((codes & 0x7F) == 0x7F, codes - 1, codes).to(torch.uint8)
    codes.view(-1)[:254] = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    scale = torch.randint(0, 255, (rows_local, hd // block), generator=g, dtype=torch.int32).to(torch.uint8)
    scale[0, 0], scale[1, 0] = 0, 254
    table = PackedWeight(codes.view(torch.float8_e4m3fn).to(device), scale.to(device), "fp8", (1, block))
    ids = torch.randint(row0, row0 + rows_local, (5, 9), generator=g).to(device)[:, 1:7]  # 6 columns, stride 9
    ids[0, 1:4] = torch.tensor([row0, row0 + 1, row0 + rows_local - 1])
    ids[1, 1:3] = torch.tensor([0, row0 - 7])  # padding rows on a rank past the first: outside the table
    poison(device)
    got = engram_rows.gather_table_rows(table, ids, 1, 4, row0, dtype)
    want = engram_rows.gather_table_rows_ref(table, ids, 1, 4, row0, dtype)
    return [("engram_rows", 0.0 if torch.equal(got, want) else float("inf"), 0.0)]


def check_segments(device: str, dtype: torch.dtype, g: torch.Generator):
    """The window segments' facts equal the reference exactly (0 = equal, inf = not), at ratios 2 and 4, with and
    without a ring of state slots: segments that continue, close, both and neither, an all-padding segment (CUDA-
    graph padding), one of length L, requests whose seq_len is 0 (padding)."""
    out = []
    t, r_count = 23, 4
    positions = torch.randint(0, 200, (t,), generator=g)
    req_index = torch.randint(0, r_count, (t,), generator=g)
    state_rows = torch.randperm(9, generator=g)[:r_count]
    seq_lens = torch.tensor([0, 5, 130, 64])
    seg = torch.full((7, 5), -1, dtype=torch.int64)
    for i, n in enumerate((5, 1, 3, 0, 2, 4, 1)):  # segment 3 is all padding
        seg[i, :n] = torch.randperm(t, generator=g)[:n]
    args = [x.to(device) for x in (seg, positions, req_index, state_rows, seq_lens)]
    for ratio, ring in ((2, 0), (4, 0), (2, 3), (4, 2)):
        poison(device)
        got = segments.segment_facts(*args, ratio, 11, ring)
        want = segments.segment_facts_ref(*args, ratio, 11, ring)
        same = all(torch.equal(got[k], want[k]) for k in segments.FIELDS)
        out.append((f"segments/r{ratio}-ring{ring}", 0.0 if same else float("inf"), 0.0))
    for ratios in ([1, 2], [4, 128], [2], [1, 2, 4, 128]):
        poison(device)
        got = segments.visible_entries(args[1], ratios)
        same = all(torch.equal(got[r].cpu(), (positions + 1) // r) for r in ratios) and list(got) == ratios
        out.append((f"segments/visible {ratios}", 0.0 if same else float("inf"), 0.0))
    return out


def check_table_slots(device: str, dtype: torch.dtype, g: torch.Generator):
    bt = torch.randint(-1, 50, (3, 7), generator=g).to(device)
    req = torch.tensor([0, 2, 2, 1, 0], device=device)
    idx = torch.randint(-1, 40, (5, 9), generator=g).to(device)
    poison(device)
    got = paged.table_slots(bt, req, idx, 4)
    want = paged.block_slots(bt[req], idx, 4)
    out = [("table_slots/exact", 0.0 if torch.equal(got, want) else float("inf"), 0.0)]
    pos = torch.tensor([0, 3, 6, 27, 40], device=device)  # windows before row 0, across blocks, past the table
    for window in (1, 8, 13):
        poison(device)
        got = paged.window_slots(bt, req, pos, window, 4)
        win = pos[:, None].cpu() - torch.arange(window - 1, -1, -1)[None, :]
        want = paged.block_slots(bt[req].cpu(), torch.where(win >= 0, win, -1), 4)
        out.append((f"table_slots/window {window}", 0.0 if torch.equal(got.cpu(), want) else float("inf"), 0.0))
    n_vis = torch.tensor([0, 1, 7, 20, 33], device=device)  # none, one, within a block, past the table
    for n in (1, 9, 30):
        poison(device)
        got = paged.visible_slots(bt, req, n_vis, n, 4)
        ent = torch.arange(n)[None, :]
        want = paged.block_slots(bt[req].cpu(), torch.where(ent < n_vis[:, None].cpu(), ent, -1), 4)
        out.append((f"table_slots/visible {n}", 0.0 if torch.equal(got.cpu(), want) else float("inf"), 0.0))
    out.append(_check_table_prologue(device, g))
    return out


def _check_table_prologue(device: str, g: torch.Generator):
    """A graph's block-table prologue over three kinds (widths 7, 13 and 1; views of one allocation, as the engine
    makes them): diffs of distinct (row, column) entries on gathered and other rows, padded with −1 writes into the
    padding row; two graph rows reading the padding row. Tables and gathered rows equal the reference's exactly."""
    widths, n_rows, cap, pad = {"a": 7, "b": 13, "c": 1}, 4, 11, 5
    tables = one_allocation_tables(widths, pad + 1, device)
    for t in tables.values():
        t.copy_(torch.randint(-1, 50, t.shape, generator=g))
        t[pad] = -1
    dev = torch.zeros(n_rows + 3 * cap * len(widths), dtype=torch.int64, device=device)  # a graph's input buffer
    rows = dev[:n_rows]
    rows.copy_(torch.tensor([2, 0, pad, pad]))
    diffs = {}
    for i, (k, w) in enumerate(widths.items()):
        d = dev[n_rows + 3 * cap * i:n_rows + 3 * cap * (i + 1)].view(3, cap)
        d.copy_(torch.tensor([[pad], [0], [-1]]).expand(3, cap))
        cells = torch.randperm(pad * w, generator=g)[:cap - 3]  # distinct (row, column); rows 0..4
        d[0, :cells.numel()], d[1, :cells.numel()] = cells // w, cells % w
        d[2, :cells.numel()] = torch.randint(-1, 50, (cells.numel(),), generator=g)
        diffs[k] = d
    want_tables = {k: t.clone() for k, t in tables.items()}
    want = one_allocation_tables(widths, n_rows, device)
    table_prologue.apply_gather_ref(list(want_tables.values()), list(diffs.values()), rows, list(want.values()))
    got = one_allocation_tables(widths, n_rows, device)
    for t in got.values():
        t.fill_(99)
    prologue = table_prologue.TablePrologue(tables, diffs, rows, got)
    poison(device)
    prologue()
    same = prologue.fused and all(torch.equal(got[k], want[k]) and torch.equal(tables[k], want_tables[k])
                                  for k in widths)
    return ("table_slots/graph prologue", 0.0 if same else float("inf"), 0.0)


def check_scatter_rows(device: str, dtype: torch.dtype, g: torch.Generator):
    """Rows written at their slots (−1: nowhere but the reference's dummy row, which is not compared), through an
    index or not, [n, 3, c] rows as the compressors' triples, float32 rows into a ``dtype`` cache."""
    out = []
    for shape, indexed in (((40,), False), ((3, 24), True), ((512,), True)):
        cache = torch.randn(30, *shape, generator=g).to(device, dtype)
        slots = torch.randperm(29, generator=g)[:12].to(device)
        slots[[2, 7]] = -1
        rows = torch.randn(6 if indexed else 12, *shape, generator=g).to(device)
        index = torch.randperm(12, generator=g)[:6].to(device) if indexed else None
        if indexed:
            index[4] = -1  # a row that writes nothing (write_closed's padding segments)
        want = cache.clone()
        paged.scatter_rows_ref(want, slots if index is None else paged.indexed_slots(slots, index), rows, 29)
        paged.scatter_rows(cache, slots, rows, 29, index=index)
        same = torch.equal(cache[:29].cpu(), want[:29].cpu())
        out.append((f"scatter_rows/{'x'.join(map(str, shape))}/{'indexed' if indexed else 'direct'}",
                    0.0 if same else float("inf"), 0.0))
    return out


def check_order_keys(device: str, dtype: torch.dtype, g: torch.Generator):
    """The top-k sort keys equal the reference's bit for bit: ±0, ±inf, NaN, exact ties, negative scores, N not a
    multiple of the block."""
    scores = torch.randn(7, 1500, generator=g).round(decimals=1)  # many exact ties
    scores[0, :6] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), -1e-30])
    scores = scores.to(device)
    poison(device)
    same = torch.equal(topk.order_keys(scores).cpu(), topk.order_keys_ref(scores).cpu())
    return [("order_keys/exact", 0.0 if same else float("inf"), 0.0)]


def check_select_all(device: str, dtype: torch.dtype, g: torch.Generator):
    """Top-k at k = N (every entry picked): the reference's ids exactly, −1 at −inf scores and past n_valid (which
    may be negative, zero or past N), NaN eligible, N not a multiple of the block, rows a strided view."""
    wide = torch.randn(6, 1600, generator=g)
    wide[torch.rand(6, 1600, generator=g) < 0.3] = float("-inf")
    wide[0, ::7] = float("nan")
    n_valid = torch.tensor([1500, 1499, 700, 0, -3, 5000])
    out = []
    on_device = wide.to(device)
    cases = {"n_valid": (on_device[:, :1500].contiguous(), n_valid), "all": (on_device[:, :1500].contiguous(), None),
             "strided": (on_device[:, 50:1550], n_valid)}  # rows 1,600 apart
    for name, (scores, nv) in cases.items():
        poison(device)
        got = topk.select_topk(scores, 1500, None if nv is None else nv.to(device))
        want = topk.select_topk_ref(scores.cpu(), 1500, nv)
        out.append((f"select_all/{name}", 0.0 if torch.equal(got.cpu(), want) else float("inf"), 0.0))
    return out


def check_router(device: str, dtype: torch.dtype, g: torch.Generator):
    out = []
    t, e, k = 11, 24, 6
    logits = (torch.randn(t, e, generator=g) * 3).to(device)
    logits[0] = -1000.0  # identical logits: equal weights, no underflow
    logits[1] = 1000.0
    logits[2, :8] = logits[2, 8:16]  # exact score ties: the lower expert id wins
    bias = torch.zeros(e, device=device)
    bias[8:16] = 0.0
    hashed = torch.randint(0, e, (t, k), generator=g).to(device)
    for name, b, hids, renorm in (("topk", bias, None, True), ("topk-raw", bias, None, False),
                                  ("hash", None, hashed, True)):
        ids, w = router.route(logits, b, hids, k, 1.3, renorm, 1.5)
        rids, rw = router.route_ref(logits.double(), None if b is None else b.double(), hids, k, 1.3, renorm, 1.5)
        same = torch.equal(ids.cpu(), rids.cpu())
        out.append((f"router/{name}/ids", 0.0 if same else float("inf"), 0.0))
        out.append((f"router/{name}/weights", rel(w, rw), 1e-5))
        if renorm:
            eq = (w[:2] - w[:2, :1]).abs().max().item()
            out.append((f"router/{name}/equal-logits-equal-weights", eq, 1e-6))
    return out


def check_candidates(device: str, dtype: torch.dtype, g: torch.Generator):
    """Candidate blocks and the candidate filter: the references' masks and scores exactly. Rows with every block
    kept (the mask written by the block-score launch) and with fewer kept than blocks (block scores through the
    top-k, then marked); N not a multiple of the block; n_visible 0, 1, at a block edge and N; NaN, +inf and whole
    −inf blocks; ties between blocks; a strided candidate view in the filter."""
    out = []
    t, n, block = 7, 203, 8
    scores = torch.randn(t, n, generator=g)
    scores[torch.rand(t, n, generator=g) < 0.3] = float("-inf")
    scores[1, 40:80] = float("-inf")
    scores[2, 17] = float("nan")
    scores[3, 5] = float("inf")
    scores[4, :] = scores[4, 0]  # every block ties
    scores[:, 0] = 1.0
    n_visible = torch.tensor([203, 0, 1, 64, 65, 130, 200])
    for j in range(t):
        scores[j, int(n_visible[j]):] = float("-inf")
    s_dev, nv_dev = scores.to(device), n_visible.to(device)
    n_blocks = -(-n // block)
    for topk_blocks in (n_blocks + 5, n_blocks, 9, 1):
        poison(device)
        got = candidates.candidate_blocks(s_dev, nv_dev, block, topk_blocks)
        want = candidates.candidate_blocks_ref(scores, n_visible, block, topk_blocks)
        out.append((f"candidates/blocks/top{topk_blocks}", 0.0 if torch.equal(got.cpu(), want) else float("inf"), 0.0))
    cand = candidates.candidate_blocks_ref(scores, n_visible, block, 9)
    cand[:, 0] = torch.arange(t) % 2 == 0  # entry 0's block dropped in odd rows
    wide = torch.zeros(t, n_blocks + 3, dtype=torch.bool)
    wide[:, 1:n_blocks + 1] = cand
    for name, c in (("contiguous", cand), ("strided", wide[:, 1:n_blocks + 1])):
        poison(device)
        got = candidates.filter_candidates_(s_dev.clone(), c.to(device) if name == "contiguous"
                                            else wide.to(device)[:, 1:n_blocks + 1], block)
        want = candidates.filter_candidates_ref(scores, c, block)
        same = torch.equal(torch.isnan(got.cpu()), torch.isnan(want)) and torch.equal(got.cpu().nan_to_num(0.0),
                                                                                      want.nan_to_num(0.0))
        out.append((f"candidates/filter/{name}", 0.0 if same else float("inf"), 0.0))
    return out


CHECKS = [check_linear, check_grouped, check_moe_prefill, check_route_pairs, check_window_pool, check_attention,
          check_index_scores, check_record_store, check_mhc, check_uniforms, check_race, check_softmax,
          check_angle_tables, check_norm_rope_swiglu, check_router, check_table_slots, check_scatter_rows,
          check_order_keys, check_select_all, check_candidates, check_engram_gate, check_engram_rows, check_segments]


def run(check_name: str, device: str, dtype: torch.dtype):
    """The results of one check (a name in ``CHECKS``) on fresh random inputs."""
    g = torch.Generator().manual_seed(torch.seed() % (1 << 31))
    return {c.__name__: c for c in CHECKS}[check_name](device, dtype, g)


if __name__ == "__main__":  # the interpreter run: python tests/kernel_checks.py CHECK_NAME
    if os.environ.get("V41_RECORD_LAUNCHES"):  # each launch's types and constexprs, to compile for sm_90a after
        import triton_launches
        triton_launches.record(os.environ["V41_RECORD_LAUNCHES"])
    for name, err, limit in run(sys.argv[1], "cpu", torch.float32):
        print(json.dumps({"name": name, "err": err, "tol": limit}))
    sys.stdout.flush()
