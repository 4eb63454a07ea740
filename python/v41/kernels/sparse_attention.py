"""Sparse MQA with a per-head sink over gathered key rows (docs/model.md §3.5 step 4–5; the FlashMLA
sparse interface: every query lists the cache slots it reads, −1 = none). Where ``v41._cuda`` is built for the GPU,
bf16 queries take the CUDA kernel of :mod:`.sparse_mqa`; the Triton kernel below serves the other CUDA cases.

The Triton kernel (one program per query token and block of 16 heads) gathers each listed key row once per
head block, keeps an online softmax in float32 and adds the sink to the final normaliser only; slot −1 is
skipped inside the kernel. Up to two sources (the window and the compressed entries) are read in one launch.
A source may be a cache of records (``--kv-cache-dtype fp8``, :mod:`v41.cache.records`): its rows are decoded
where they are read (:func:`.records.load_rows`).

Its wide tiling (:data:`WIDE`: all 64 heads in one program of 8 warps, 32-key tiles, two stages) reads each key
tile once per query token and, on sm_90, compiles its two products to WGMMA with the 64 heads as the M = 64 operand
(FlashMLA's layout; the CUDA kernel's ``mma.sync`` reads a tile from shared memory once per 16 heads): 255
registers, 16 spilled bytes and 128 KB of shared memory for d = 512 (benches/RESULTS.md "2026-12-05 (CPU)"). Steps
of at least :data:`WIDE_MIN_TOKENS` query tokens (prefill chunks) over bf16 rows take it ahead of the CUDA kernel
on GPUs with Hopper's shared memory; 0 (the default) until the H200 times it (``attention_bench.py``'s "triton
wide" column).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..cache.records import RecordFormat
from .dispatch import TRITON_DTYPES, dot_dtype, triton, use_cuda, use_triton
from .paged import gather_slots
from .records import format_id, rope_dims
from .sparse_mqa import sparse_mqa

Records = list[RecordFormat | None] | None

# (heads per program, keys per tile, warps, pipeline stages) of the Triton kernel: its default tiling (keys per tile
# by d, Triton's default stages) and the wide one (module docstring).
NARROW, WIDE = (16, None, 4, None), (64, 32, 8, 2)
# Steps of at least this many bf16 query tokens over bf16 rows take the wide Triton tiling ahead of the CUDA kernel
# (0: never; :func:`sparse_mqa_sink`).
WIDE_MIN_TOKENS = 0
WIDE_SMEM_MAJORS = (9, 10)  # compute capabilities with the ~228 KB of shared memory per SM the wide tiling needs


def gather_keys(cache: Tensor, slots: Tensor, record: RecordFormat | None, dtype: torch.dtype) -> Tensor:
    """Rows of ``cache`` at ``slots`` [...] (−1 = a zero row) in ``dtype``, decoded when ``record`` is set
    (``cache`` uint8 [S, record.nbytes])."""
    rows = gather_slots(cache, slots)
    return (record.decode(rows) if record is not None else rows).to(dtype)


def _records_of(sources: list, records: Records) -> list[RecordFormat | None]:
    """One record format (or None) per source. Raises ValueError when the counts differ."""
    if records is None:
        return [None] * len(sources)
    if len(records) != len(sources):
        raise ValueError(f"{len(sources)} sources but {len(records)} record formats")
    return list(records)


def sparse_mqa_sink_ref(q: Tensor, sources: list[tuple[Tensor, Tensor]], sink: Tensor, scale: float,
                        records: Records = None, max_rows: int = 1 << 22) -> Tensor:
    """``softmax({q·k·scale : listed keys} ∪ {sink_h})``-weighted sum of the keys (K = V).

    q: [T, H, d]; sources: (cache [S_i, d], slots [T, K_i] int64, −1 = skip) whose keys are concatenated per
    query; records: per source its :class:`~v41.cache.records.RecordFormat` when the cache holds records
    (uint8 [S_i, nbytes]), else None; sink: [H] (denominator only, unscaled). Queries are processed in chunks
    so that at most ``max_rows`` gathered key elements live at once. Returns [T, H, d] in q's dtype; a query
    with no valid key returns zeros.
    """
    t, h, d = q.shape
    records = _records_of(sources, records)
    width = sum(s.shape[1] for _, s in sources)
    out = torch.empty_like(q)
    step = max(1, max_rows // max(1, width * d))
    for a in range(0, t, step):
        b = min(t, a + step)
        keys = torch.cat([gather_keys(c, s[a:b], f, q.dtype) for (c, s), f in zip(sources, records)], dim=1)
        valid = torch.cat([s[a:b] >= 0 for _, s in sources], dim=1)  # [c, K]
        logits = torch.einsum("thd,tkd->thk", q[a:b], keys) * scale
        logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
        sinks = sink.to(logits.dtype).view(1, h, 1).expand(b - a, h, 1)
        full = torch.cat([logits, sinks], dim=-1)
        probs = torch.softmax(full - full.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
        out[a:b] = torch.einsum("thk,tkd->thd", probs, keys)
    return out


def sparse_mqa_sink(q: Tensor, sources: list[tuple[Tensor, Tensor]], sink: Tensor, scale: float,
                    records: Records = None) -> Tensor:
    """:func:`sparse_mqa_sink_ref` through the CUDA kernel of :mod:`.sparse_mqa` where :func:`.dispatch.use_cuda`
    says so and it takes the operands (bf16), else as one Triton launch where :func:`.dispatch.use_triton` says so
    (one or two sources whose caches have q's dtype or hold records, d a power of two ≥ 16). Steps of at least
    :data:`WIDE_MIN_TOKENS` bf16 query tokens over bf16 rows take the wide Triton tiling first where it fits
    (:func:`_wide_takes`; not records: the Triton decode per tile measured 8–15× slower than the CUDA kernel's,
    benches/RESULTS.md "2026-12-03")."""
    records = _records_of(sources, records)
    if WIDE_MIN_TOKENS and q.shape[0] >= WIDE_MIN_TOKENS and _wide_takes(q, sources, records):
        return _sparse_triton(q, sources, sink, scale, records, wide=True)
    if use_cuda(q, family="attention"):
        out = sparse_mqa(q, sources, sink, scale, records)
        if out is not None:
            return out
    if _triton_takes(q, sources, records) and use_triton(q, family="attention"):
        return _sparse_triton(q, sources, sink, scale, records)
    return sparse_mqa_sink_ref(q, sources, sink, scale, records)


def _wide_takes(q: Tensor, sources: list[tuple[Tensor, Tensor]], records: list[RecordFormat | None]) -> bool:
    """bf16 queries and rows on a GPU of :data:`WIDE_SMEM_MAJORS`, operands the Triton kernel takes."""
    return (q.is_cuda and q.dtype == torch.bfloat16 and all(f is None for f in records)
            and torch.cuda.get_device_capability(q.device)[0] in WIDE_SMEM_MAJORS
            and _triton_takes(q, sources, records) and use_triton(q, family="attention"))


def _triton_takes(q: Tensor, sources: list[tuple[Tensor, Tensor]], records: list[RecordFormat | None]) -> bool:
    """One or two sources whose caches have q's dtype or hold records, d a power of two ≥ 16."""
    d = q.shape[-1]
    return (q.dtype in TRITON_DTYPES and 1 <= len(sources) <= 2 and d >= 16 and d & (d - 1) == 0
            and all(c.dtype == (q.dtype if f is None else torch.uint8) for (c, _), f in zip(sources, records)))


if triton is not None:
    import triton.language as tl

    from .records import load_rows

    @triton.jit
    def _source_pass(q, m, l, acc, t, cache_ptr, slots_ptr, stride_c, stride_st, n_keys, scale,
                     D: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr, IEEE: tl.constexpr, FMT: tl.constexpr,
                     ROPE: tl.constexpr):
        for k0 in range(0, n_keys, BK):
            rk = k0 + tl.arange(0, BK)
            slot = tl.load(slots_ptr + t * stride_st + rk, mask=rk < n_keys, other=-1)
            valid = slot >= 0
            kt = load_rows(cache_ptr, tl.maximum(slot, 0).to(tl.int64) * stride_c, valid, D, FMT, ROPE)
            if IEEE:
                s = tl.dot(q, tl.trans(kt.to(DOT)), input_precision="ieee") * scale
            else:
                s = tl.dot(q, tl.trans(kt.to(DOT))) * scale
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            l = l * alpha + tl.sum(p, axis=1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(DOT), kt.to(DOT), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(DOT), kt.to(DOT))
            m = m_new
        return m, l, acc

    @triton.jit
    def _sparse_kernel(q_ptr, o_ptr, sink_ptr, c0_ptr, s0_ptr, c1_ptr, s1_ptr, H, n0, n1, scale,
                       stride_qt, stride_qh, stride_ot, stride_oh, stride_c0, stride_s0, stride_c1, stride_s1,
                       TWO: tl.constexpr, D: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr,
                       IEEE: tl.constexpr, FMT0: tl.constexpr, FMT1: tl.constexpr, ROPE0: tl.constexpr,
                       ROPE1: tl.constexpr):
        t, hb = tl.program_id(0), tl.program_id(1)
        rh = hb * BH + tl.arange(0, BH)
        hmask = rh < H
        rd = tl.arange(0, D)
        q = tl.load(q_ptr + t * stride_qt + rh[:, None] * stride_qh + rd[None, :], mask=hmask[:, None], other=0.0)
        q = q.to(DOT)
        m = tl.full([BH], -1.0e30, dtype=tl.float32)  # finite: exp(m − m_new) stays defined with no valid key
        l = tl.zeros([BH], dtype=tl.float32)
        acc = tl.zeros([BH, D], dtype=tl.float32)
        m, l, acc = _source_pass(q, m, l, acc, t, c0_ptr, s0_ptr, stride_c0, stride_s0, n0, scale, D, BK, DOT, IEEE,
                                 FMT0, ROPE0)
        if TWO:
            m, l, acc = _source_pass(q, m, l, acc, t, c1_ptr, s1_ptr, stride_c1, stride_s1, n1, scale, D, BK, DOT,
                                     IEEE, FMT1, ROPE1)
        sink = tl.load(sink_ptr + rh, mask=hmask, other=0.0).to(tl.float32)
        out = acc / (l + tl.exp(sink - m))[:, None]
        tl.store(o_ptr + t * stride_ot + rh[:, None] * stride_oh + rd[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=hmask[:, None])


def _sparse_triton(q: Tensor, sources: list[tuple[Tensor, Tensor]], sink: Tensor, scale: float,
                   records: list[RecordFormat | None], wide: bool = False) -> Tensor:
    """One launch of the Triton kernel (module docstring) in the :data:`NARROW` or (``wide``) :data:`WIDE`
    tiling; the operands as :func:`sparse_mqa_sink_ref` takes them."""
    t, h, d = q.shape
    out = torch.empty_like(q)
    if t == 0:
        return out
    (c0, s0) = sources[0]
    c1, s1 = sources[1] if len(sources) == 2 else sources[0]
    s0, s1 = s0.contiguous(), s1.contiguous()
    bh, bk, warps, stages = WIDE if wide else NARROW
    bk = bk or (32 if d >= 256 else 64)
    opts = {"num_warps": warps, **({"num_stages": stages} if stages else {})}
    _sparse_kernel[(t, triton.cdiv(h, bh))](
        q, out, sink, c0, s0, c1, s1, h, s0.shape[1], s1.shape[1] if len(sources) == 2 else 0, float(scale),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), c0.stride(0), s0.stride(0), c1.stride(0),
        s1.stride(0), TWO=len(sources) == 2, D=d, BH=bh, BK=bk, DOT=dot_dtype(q.dtype),
        IEEE=q.dtype == torch.float32, FMT0=format_id(records[0]), FMT1=format_id(records[-1]),
        ROPE0=rope_dims(records[0]), ROPE1=rope_dims(records[-1]), **opts)
    return out
