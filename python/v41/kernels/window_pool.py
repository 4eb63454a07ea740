"""Compressor window pooling of one step's segments (docs/model.md §3.6 V4.1 ratio 2, §4 V4 HCA / CSA; the segment
layout is :class:`v41.models.fast.compress.Segments`'s): the online-softmax triple of each segment's own rows,
continued from the triple its request's state row holds when the segment's window began in an earlier step.

For segment s with token rows ``rows[s, :]`` (``valid`` marks real ones) and per-channel gates g and values v:
``own = (m, s, a)`` with ``m = max g``, ``s = Σ e^{g−m}``, ``a = Σ e^{g−m}·v`` over the valid rows; when
``continues[s]`` the triple ``state[state_row[s]]`` ([3, C] float32) is combined in by rescaling both to the
larger m (an empty set is m = −inf, s = a = 0). Output [S, 3, C] float32. The caller stores the open windows'
triples back (one index_copy), after every segment has read its state: a prefill chunk can read a request's state
row in its first segment and write it in its last.

The PyTorch reference is ~20 small kernels per compressor; the Triton kernel is one launch, programs
(segment, channel block), rows walked in order with a running triple.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .dispatch import triton, use_triton
from .paged import gather_slots, table_slots
from .pdl import triton_kw

NEG = float("-inf")


def combine_triples(t1: tuple[Tensor, Tensor, Tensor], t2: tuple[Tensor, Tensor, Tensor]):
    """The triple of the union of two disjoint token sets (either may be empty: m = −inf, s = a = 0)."""
    (m1, s1, a1), (m2, s2, a2) = t1, t2
    m = torch.maximum(m1, m2)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    f1 = torch.exp(m1 - m_safe)
    f2 = torch.exp(m2 - m_safe)
    return m, s1 * f1 + s2 * f2, a1 * f1 + a2 * f2


def gate_bias(ape: Tensor, positions: Tensor) -> Tensor:
    """V4's compressor gate bias of tokens at ``positions`` [n] int64: ``ape[p mod R]`` [n, C] of ``ape`` [R, C]
    (docs/model.md §4)."""
    return ape[positions % ape.shape[0]]


def pool_windows_ref(rows: Tensor, valid: Tensor, continues: Tensor, state_row: Tensor, value: Tensor,
                     gate: Tensor, state: Tensor, ape: Tensor | None = None, positions: Tensor | None = None) -> Tensor:
    """Reference of :func:`pool_windows`: rows, valid [S, L] (int64 ≥ 0, bool); continues [S] bool; state_row [S]
    int64; value, gate [T, C] float32; state [rows, 3, C] float32 (read only); ape [R, C] (gate's dtype) and
    positions [T] int64, or None → [S, 3, C] float32."""
    if ape is not None:
        gate = gate + gate_bias(ape, positions)
    g = gate[rows].masked_fill(~valid[..., None], NEG)  # [S, L, C]
    m = g.amax(dim=1)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(g - m_safe[:, None])
    own = (m, e.sum(dim=1), (e * value[rows]).sum(dim=1))
    prev = state[state_row]
    cont = continues[:, None]
    before = (torch.where(cont, prev[:, 0], torch.full_like(m, NEG)), torch.where(cont, prev[:, 1], 0.0),
              torch.where(cont, prev[:, 2], 0.0))
    return torch.stack(combine_triples(before, own), dim=1)


def pool_windows(rows: Tensor, valid: Tensor, continues: Tensor, state_row: Tensor, value: Tensor, gate: Tensor,
                 state: Tensor, ape: Tensor | None = None, positions: Tensor | None = None) -> Tensor:
    """:func:`pool_windows_ref` as one Triton launch where :func:`.dispatch.use_triton` says so. ``ape`` [R, C]:
    V4's per-position gate bias, ``ape[p mod R]`` added to the gate of the token at position ``positions[t]``
    (docs/model.md §4) where each gate is read (the three PyTorch launches of the addition go)."""
    s, width = rows.shape
    if s == 0 or value.dtype != torch.float32 or not use_triton(value, state, family="attention"):
        return pool_windows_ref(rows, valid, continues, state_row, value, gate, state, ape, positions)
    c = value.shape[1]
    out = torch.empty(s, 3, c, dtype=torch.float32, device=value.device)
    block = min(256, triton.next_power_of_2(c))
    # value and gate may be column views of one fused GEMM's output (unit column stride): read in place
    v = value if value.stride(1) == 1 else value.contiguous()
    g = gate if gate.stride(1) == 1 else gate.contiguous()
    st = state.contiguous()
    bias = ape.to(torch.float32).contiguous() if ape is not None else out
    _pool_kernel[(s, triton.cdiv(c, block))](rows.contiguous(), valid.contiguous(), continues.contiguous(),
                                             state_row.contiguous(), v, g, st, out, bias,
                                             out if positions is None else positions.contiguous(), c, width,
                                             v.stride(0), g.stride(0), bias.shape[0], APE=ape is not None,
                                             BLOCK=block)
    return out


def pooled_values_ref(s: Tensor, a: Tensor, dtype: torch.dtype, through_bf16: bool = False) -> Tensor:
    """Reference of :func:`pooled_values`."""
    y = a / torch.where(s > 0, s, torch.ones_like(s))
    return (y.to(torch.bfloat16) if through_bf16 else y).to(dtype)


def pooled_values(s: Tensor, a: Tensor, dtype: torch.dtype, through_bf16: bool = False) -> Tensor:
    """The pooled entries ``a / s`` of full triples' s, a [S, C] float32 (a window with no token gives 0), rounded
    to bf16 first where ``through_bf16`` (deployed numerics' cast of V4.1's pooled latent), returned as ``dtype``:
    one Triton launch where :func:`.dispatch.use_triton` says so (a correctly rounded division, as PyTorch's), four
    to six PyTorch launches in the reference."""
    n, c = a.shape
    if (n == 0 or a.dtype != torch.float32 or s.dtype != torch.float32 or s.stride(1) != 1 or a.stride(1) != 1
            or not use_triton(s, a, family="attention")):
        return pooled_values_ref(s, a, dtype, through_bf16)
    out = torch.empty(n, c, dtype=dtype, device=a.device)
    block = min(1024, triton.next_power_of_2(c))
    through_bf16 = through_bf16 or dtype == torch.bfloat16  # the store of a bf16 value is then exact
    _pooled_kernel[(n, triton.cdiv(c, block))](s, a, out, c, s.stride(0), a.stride(0), THROUGH_BF16=through_bf16,
                                                BLOCK=block, **triton_kw(a.device))
    return out


def pooled_after_previous_ref(m: Tensor, s: Tensor, a: Tensor, prev_cache: Tensor, block_table: Tensor, req: Tensor,
                              window: Tensor, rows_per_block: int, dtype: torch.dtype) -> Tensor:
    """Reference of :func:`pooled_after_previous`."""
    prev = window - 1
    slots = table_slots(block_table, req, prev[:, None], rows_per_block)
    t = gather_slots(prev_cache, slots)[:, 0]  # [S, 3, C]; zeros where no slot
    has = (prev >= 0)[:, None]
    before = (torch.where(has, t[:, 0], torch.full_like(t[:, 0], NEG)), torch.where(has, t[:, 1], 0.0),
              torch.where(has, t[:, 2], 0.0))
    _, s, a = combine_triples((m, s, a), before)
    return pooled_values_ref(s, a, dtype)


def pooled_after_previous(m: Tensor, s: Tensor, a: Tensor, prev_cache: Tensor, block_table: Tensor, req: Tensor,
                          window: Tensor, rows_per_block: int, dtype: torch.dtype) -> Tensor:
    """V4's overlapping CSA entries (docs/model.md §4): the pooled values (:func:`pooled_values`, as ``dtype``) of
    each segment's own triple (m, s, a) [S, C] float32 (the B half of its window) combined with the A triple of the
    window before it, read from ``prev_cache`` [slots, 3, C] float32 (the ``cov{r}`` cache) at entry ``window − 1``
    of request ``req`` through ``block_table`` [R, max_blocks] (empty for window 0; zeros where the block is
    absent). One Triton launch where :func:`.dispatch.use_triton` says so (about 25 PyTorch launches otherwise);
    exponentials by Triton's ``exp``, as the pooling kernel's."""
    n, c = a.shape
    if (n == 0 or any(t.dtype != torch.float32 or t.stride(1) != 1 for t in (m, s, a)) or not prev_cache.is_contiguous()
            or prev_cache.dtype != torch.float32 or not use_triton(a, prev_cache, family="attention")):
        return pooled_after_previous_ref(m, s, a, prev_cache, block_table, req, window, rows_per_block, dtype)
    out = torch.empty(n, c, dtype=dtype, device=a.device)
    bt = block_table if block_table.stride(1) == 1 else block_table.contiguous()
    block = min(1024, triton.next_power_of_2(c))
    _after_previous_kernel[(n, triton.cdiv(c, block))](
        m, s, a, m.stride(0), s.stride(0), a.stride(0), prev_cache, bt, req.contiguous(), window.contiguous(), out, c,
        bt.shape[1], bt.stride(0), rows_per_block, THROUGH_BF16=dtype == torch.bfloat16, BLOCK=block,
        **triton_kw(a.device))
    return out


if triton is not None:
    import triton.language as tl
    from .pdl import prologue

    @triton.jit
    def _after_previous_kernel(m_ptr, s_ptr, a_ptr, stride_m, stride_s, stride_a, cache_ptr, bt_ptr, req_ptr, win_ptr,
                               out_ptr, C, NB, stride_bt, RPB, THROUGH_BF16: tl.constexpr, BLOCK: tl.constexpr,
                               PDL: tl.constexpr):
        """Program (segment, BLOCK channels): the previous window's A triple through the block table, combined with
        the segment's own triple as combine_triples does, then a / s."""
        prologue(PDL)
        i = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < C
        prev = tl.load(win_ptr + i) - 1
        blk = tl.maximum(prev, 0) // RPB
        inside = (prev >= 0) & (blk < NB)
        phys = tl.load(bt_ptr + tl.load(req_ptr + i) * stride_bt + blk, mask=inside, other=-1)
        slot = tl.where(inside & (phys >= 0), phys.to(tl.int64) * RPB + tl.maximum(prev, 0) % RPB, -1)
        row = cache_ptr + tl.maximum(slot, 0) * 3 * C
        got = ok & (slot >= 0)
        m2 = tl.where(prev >= 0, tl.load(row + cols, mask=got, other=0.0), float("-inf"))
        s2 = tl.where(prev >= 0, tl.load(row + C + cols, mask=got, other=0.0), 0.0)
        a2 = tl.where(prev >= 0, tl.load(row + 2 * C + cols, mask=got, other=0.0), 0.0)
        m1 = tl.load(m_ptr + i * stride_m + cols, mask=ok, other=float("-inf"))
        s1 = tl.load(s_ptr + i * stride_s + cols, mask=ok, other=0.0)
        a1 = tl.load(a_ptr + i * stride_a + cols, mask=ok, other=0.0)
        mx = tl.maximum(m1, m2)
        safe = tl.where((mx == mx) & (tl.abs(mx) != float("inf")), mx, 0.0)
        f1 = tl.exp(m1 - safe)
        f2 = tl.exp(m2 - safe)
        s = s1 * f1 + s2 * f2
        y = tl.math.div_rn(a1 * f1 + a2 * f2, tl.where(s > 0, s, 1.0))
        if THROUGH_BF16:  # to nearest even by the bits (Triton's interpreter truncates in its bf16 casts)
            bits = y.to(tl.int32, bitcast=True)
            y = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
        tl.store(out_ptr + i * C + cols, y.to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _pooled_kernel(s_ptr, a_ptr, out_ptr, C, stride_s, stride_a, THROUGH_BF16: tl.constexpr, BLOCK: tl.constexpr,
                       PDL: tl.constexpr):
        prologue(PDL)
        i = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < C
        s = tl.load(s_ptr + i * stride_s + cols, mask=ok, other=1.0)
        a = tl.load(a_ptr + i * stride_a + cols, mask=ok, other=0.0)
        y = tl.math.div_rn(a, tl.where(s > 0, s, 1.0))
        if THROUGH_BF16:  # to nearest even by the bits (Triton's interpreter truncates in its bf16 casts)
            bits = y.to(tl.int32, bitcast=True)
            y = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
        tl.store(out_ptr + i * C + cols, y.to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _pool_kernel(rows_ptr, valid_ptr, cont_ptr, srow_ptr, v_ptr, g_ptr, state_ptr, out_ptr, ape_ptr, pos_ptr, C,
                     L, stride_v, stride_g, R, APE: tl.constexpr, BLOCK: tl.constexpr):
        seg, cb = tl.program_id(0), tl.program_id(1)
        cols = cb * BLOCK + tl.arange(0, BLOCK)
        cmask = cols < C
        cont = tl.load(cont_ptr + seg) != 0
        srow = tl.load(srow_ptr + seg).to(tl.int64)
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        a = tl.zeros([BLOCK], tl.float32)
        if cont:
            base = state_ptr + srow * 3 * C
            m = tl.load(base + cols, mask=cmask, other=float("-inf"))
            s = tl.load(base + C + cols, mask=cmask, other=0.0)
            a = tl.load(base + 2 * C + cols, mask=cmask, other=0.0)
        for j in range(L):
            ok = tl.load(valid_ptr + seg * L + j) != 0
            if ok:
                row = tl.load(rows_ptr + seg * L + j).to(tl.int64)
                g = tl.load(g_ptr + row * stride_g + cols, mask=cmask, other=0.0)
                if APE:  # the gate bias of the token's position within its window
                    p = tl.load(pos_ptr + row) % R
                    g = g + tl.load(ape_ptr + p * C + cols, mask=cmask, other=0.0)
                v = tl.load(v_ptr + row * stride_v + cols, mask=cmask, other=0.0)
                m_new = tl.maximum(m, g)  # g is finite, so m_new is
                f = tl.exp(m - m_new)  # exp(−inf) = 0 for an empty running set
                e = tl.exp(g - m_new)
                s = s * f + e
                a = a * f + e * v
                m = m_new
        out = out_ptr + seg.to(tl.int64) * 3 * C
        tl.store(out + cols, m, mask=cmask)
        tl.store(out + C + cols, s, mask=cmask)
        tl.store(out + 2 * C + cols, a, mask=cmask)
