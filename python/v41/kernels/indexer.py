"""Lightning-indexer scores of a whole step in one pass (docs/model.md §3.7 steps 2–4, §4 "CSA indexer"):
``score[t, j] = Σ_h w[t, h] · ReLU(q[t, h] · k_j)`` for the entries ``j < n_visible[t]`` of token t's request,
``−inf`` for the others, every request of the step at once, keys read through the paged block table.

The CUDA kernel (``cuda/indexer/index_scores.cu``: bf16 queries of 16–64 heads × 128 on a GPU ``v41._cuda`` is
built for, over at least :data:`CUDA_MIN_ENTRIES` entries) decodes each key tile into tensor-core fragments once
for all the CTA's queries of its request: 2.4× the Triton kernel on a 1M-entry decode row, 3× in prefill
(benches/RESULTS.md "2026-12-03 (ring and CUDA scorer)"). The Triton kernel (one program per block of queries and
block of entries) gathers and decodes a key tile once for all the block's queries when they share a request
(prefill chunks), keeps the head sum in registers and writes only the ``[T, N]`` scores; the reference bounds its
``[c, heads, N]`` scratch by scoring tokens in chunks of at most ``scratch_bytes``. The keys may be MXFP4 records
(``--kv-cache-dtype fp8``, :mod:`v41.cache.records`), decoded where they are read.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..cache.records import RecordFormat
from .dispatch import TRITON_DTYPES, cuda_ext, dot_dtype, sm_count, triton, use_cuda, use_triton
from .pdl import enabled as pdl_enabled, triton_kw
from .paged import block_slots
from .records import format_id
from .sparse_attention import gather_keys


def index_scores_ref(q: Tensor, w: Tensor, keys: Tensor, block_table: Tensor, req_index: Tensor,
                     n_visible: Tensor, rows_per_block: int, n_max: int, scratch_bytes: int = 64 << 20,
                     record: RecordFormat | None = None, w_scale: float = 1.0) -> Tensor:
    """q [T, Hi, di]; w [T, Hi] float, the head weights before ``w_scale`` (w · w_scale multiplied in w's dtype);
    keys: the index-key cache [S, di] (or uint8 [S, nbytes] records of ``record``); block_table [R, B] (−1 = none);
    req_index [T]; n_visible [T] visible entries per token; n_max ≥ every request's cached entries. Returns float32
    [T, n_max]."""
    w = w * w_scale
    t_all, hi, di = q.shape
    ent = torch.arange(n_max, device=q.device)
    req_keys = gather_keys(keys, block_slots(block_table, ent[None, :].expand(block_table.shape[0], -1),
                                             rows_per_block), record, q.dtype)  # [R, N, di]
    out = torch.empty(t_all, n_max, dtype=torch.float32, device=q.device)
    per_token = max(1, n_max * (hi + di) * q.element_size() * 2)
    chunk = max(1, scratch_bytes // per_token)
    for a in range(0, t_all, chunk):
        b = min(t_all, a + chunk)
        dots = torch.einsum("thd,tnd->thn", q[a:b], req_keys[req_index[a:b]])
        s = torch.einsum("thn,th->tn", torch.relu(dots), w[a:b].to(dots.dtype)).float()
        out[a:b] = s.masked_fill(ent[None, :] >= n_visible[a:b, None], float("-inf"))
    return out


def index_scores(q: Tensor, w: Tensor, keys: Tensor, block_table: Tensor, req_index: Tensor, n_visible: Tensor,
                 rows_per_block: int, n_max: int, scratch_bytes: int = 64 << 20,
                 record: RecordFormat | None = None, tiles: tuple[int, int, int] | None = None,
                 w_scale: float = 1.0) -> Tensor:
    """:func:`index_scores_ref` as one CUDA launch where :data:`CUDA_SCORER` is on, ``n_max`` is at least
    :data:`CUDA_MIN_ENTRIES`, :func:`.dispatch.use_cuda` says so and the kernel takes the operands
    (:func:`_scores_cuda`, after the multiply by ``w_scale``), else one Triton launch where
    :func:`.dispatch.use_triton` says so (which multiplies by ``w_scale`` where it loads ``w`` as float32: the
    reference's bits for float32 ``w``; ``w`` may be a view with unit head stride, read in place); ``tiles`` (Triton tilings: tests, sweeps) skips the CUDA kernel."""
    want = q.dtype if record is None else torch.uint8
    if (CUDA_SCORER and tiles is None and n_max >= CUDA_MIN_ENTRIES
            and use_cuda(q, keys, block_table, req_index, n_visible, family="attention")):
        out = _scores_cuda(q, w * w_scale, keys, block_table, req_index, n_visible, rows_per_block, n_max, record)
        if out is not None:
            return out
    if q.dtype in TRITON_DTYPES and keys.dtype == want and use_triton(q, keys, family="attention"):
        return _scores_triton(q, w, keys, block_table, req_index, n_visible, rows_per_block, n_max, record, tiles,
                              w_scale)
    return index_scores_ref(q, w, keys, block_table, req_index, n_visible, rows_per_block, n_max, scratch_bytes,
                            record, w_scale)


CUDA_SCORER = True  # False: the Triton kernel everywhere (an A/B switch: flash_slice.py --set)
# Rows shorter than this go to the Triton kernel, which wins there (launch shape; benches/RESULTS.md
# "2026-12-03 (ring and CUDA scorer)").
CUDA_MIN_ENTRIES = 8192
N_MAX_CUDA = 2 ** 31 - 8192  # entries per row the CUDA scorer takes (its entry arithmetic is 32-bit)


def query_blocked(t: int, requests: int) -> bool:
    """Whether a step of ``t`` queries over ``requests`` requests (the block table's rows) is prefill-like: at
    least 16 queries and 4 per request, so blocks of consecutive queries mostly share a request and one decoded
    key tile serves them all (both scorers)."""
    return t >= 16 and t >= 4 * requests


def cuda_tiles(t: int, n_max: int, requests: int, heads: int, sms: int) -> tuple[int, int]:
    """(queries per CTA, entries per CTA) of the CUDA scorer: 8 queries (4 at 64 heads: 64 KB of staged
    fragments) where :func:`query_blocked`, else 1; entries in multiples of 128 so that the grid holds about 4 CTAs
    per SM (at most 4,096 entries per CTA), and at least 64 per staged query, which pays for the staging (on the
    H200, 8 queries × 8,192 entries: 128 entries per CTA 65.8 µs, 512 entries 36.7 µs; benches/RESULTS.md
    "2026-12-03 (ring and CUDA scorer)")."""
    qb = (8 if heads <= 32 else 4) if query_blocked(t, requests) else 1
    rows = -(-t // qb)
    per = -(-(-(-n_max // 128)) * rows // (4 * sms))
    return qb, 128 * max(1, qb // 2, min(32, per))


def _scores_cuda(q: Tensor, w: Tensor, keys: Tensor, block_table: Tensor, req_index: Tensor, n_visible: Tensor,
                 rows_per_block: int, n_max: int, record: RecordFormat | None) -> Tensor | None:
    """The scores by ``cuda/indexer/index_scores.cu`` (docs/kernels.md "Indexer"), or None where it does not take
    the operands: bf16 queries of 16–64 heads (a multiple of 16) × 128, bf16 key rows or ``idx_mxfp4`` records of
    128 dims, int64 block table / request rows / visible counts."""
    ext = cuda_ext()
    t, hi, di = q.shape
    fmt = 0 if record is None else 1
    if (getattr(ext, "index_scores", None) is None or q.dtype != torch.bfloat16 or di != 128 or hi % 16
            or not 16 <= hi <= 64 or q.stride(2) != 1 or n_max > N_MAX_CUDA or t >= 2 ** 27
            or (record is not None and (record.kind != "idx_mxfp4" or record.dims != 128))
            or keys.dtype != (torch.bfloat16 if record is None else torch.uint8) or keys.dim() != 2
            or keys.stride(1) != 1 or keys.data_ptr() % (16 if record is None else 4)
            or keys.stride(0) % (8 if record is None else 4) or block_table.dtype != torch.int64
            or req_index.dtype != torch.int64 or n_visible.dtype != torch.int64 or req_index.numel() != t
            or n_visible.numel() != t):
        return None
    qb, entries = cuda_tiles(t, n_max, block_table.shape[0], hi, sm_count(q.device))
    if -(-t // qb) > 65535:  # grid.y
        return None
    out = torch.empty(t, n_max, dtype=torch.float32, device=q.device)
    if t and n_max:
        ext.index_scores(q, w.float().contiguous(), keys, block_table.contiguous(), req_index.contiguous(),
                         n_visible.contiguous(), out, rows_per_block, fmt, qb, entries, pdl_enabled(q.device))
    return out


def score_tiles(t: int, n_max: int, requests: int) -> tuple[int, int, int]:
    """(queries per program, entries per program, warps) of the Triton scorer for ``t`` queries of ``requests``
    requests over ``n_max`` entries. :func:`query_blocked` steps (prefill chunks, long speculative verify steps)
    take 8 queries per program, so a decoded key tile serves them all: 1.9–2.0× faster than one query per program
    at 64–2,048 queries (benches/RESULTS.md "2026-12-03 (evening)", ``benches/gpu/topk_bench.py --sweep``). Decode
    takes one query per program, with 128-entry blocks on long rows (166 against 180 µs at 1M entries)."""
    if query_blocked(t, requests):
        return 8, 64, 4
    return 1, 128 if n_max >= 131072 else 64, 4


if triton is not None:
    import triton.language as tl
    from .pdl import prologue

    from .records import load_rows

    @triton.jit
    def _key_tile(k_ptr, bt_ptr, req, rj, n_vis, RPB, NB, stride_k, stride_bt, DI: tl.constexpr,
                  FMT: tl.constexpr, DOT: tl.constexpr):
        """Key rows ``rj`` [BN] of request ``req`` through its block table → [BN, DI] in ``DOT`` (zeros at and past
        ``n_vis`` and in unmapped blocks)."""
        blk = rj // RPB
        phys = tl.load(bt_ptr + req * stride_bt + blk, mask=(rj < n_vis) & (blk < NB), other=-1)
        valid = (rj < n_vis) & (phys >= 0)
        slot = tl.maximum(phys, 0).to(tl.int64) * RPB + rj % RPB
        return load_rows(k_ptr, slot * stride_k, valid, DI, FMT, 0).to(DOT)

    @triton.jit
    def _scores_kernel(q_ptr, w_ptr, k_ptr, bt_ptr, req_ptr, nvis_ptr, out_ptr, T, HI, N, RPB, NB,
                       stride_qt, stride_qh, stride_wt, stride_k, stride_bt, stride_ot, w_scale,
                       BH: tl.constexpr, DI: tl.constexpr, BN: tl.constexpr, QB: tl.constexpr, DOT: tl.constexpr,
                       IEEE: tl.constexpr, FMT: tl.constexpr, PDL: tl.constexpr):
        """Program (tb, jb): queries tb·QB … +QB−1 against entries jb·BN … +BN−1. When the block's queries share a
        request (a prefill chunk) the key tile is gathered and decoded once for all of them."""
        prologue(PDL)
        tb, jb = tl.program_id(0), tl.program_id(1)
        rj = jb * BN + tl.arange(0, BN)
        jmask = rj < N
        rt = tb * QB + tl.arange(0, QB)
        tmask = rt < T
        req0 = tl.load(req_ptr + tb * QB)
        rq = tl.where(tmask, tl.load(req_ptr + rt, mask=tmask, other=0), req0)
        n_hi = tl.max(tl.load(nvis_ptr + rt, mask=tmask, other=0))
        shared = tl.min(rq) == tl.max(rq)
        rh = tl.arange(0, BH)
        hmask = rh < HI
        rd = tl.arange(0, DI)
        if jb * BN < n_hi:
            kt = _key_tile(k_ptr, bt_ptr, req0, rj, n_hi, RPB, NB, stride_k, stride_bt, DI, FMT, DOT)
            for i in range(QB):
                t = tb * QB + i
                if t < T:
                    n_vis = tl.load(nvis_ptr + t)
                    if not shared:  # a block straddling requests (mixed steps): each query gathers its own keys
                        kt = _key_tile(k_ptr, bt_ptr, tl.load(req_ptr + t), rj, n_vis, RPB, NB, stride_k,
                                       stride_bt, DI, FMT, DOT)
                    q = tl.load(q_ptr + t * stride_qt + rh[:, None] * stride_qh + rd[None, :], mask=hmask[:, None],
                                other=0.0).to(DOT)
                    wt = tl.load(w_ptr + t * stride_wt + rh, mask=hmask, other=0.0).to(tl.float32) * w_scale
                    if IEEE:
                        s = tl.dot(q, tl.trans(kt), input_precision="ieee")
                    else:
                        s = tl.dot(q, tl.trans(kt))
                    score = tl.sum(tl.maximum(s, 0.0) * wt[:, None], axis=0)
                    score = tl.where(rj < n_vis, score, float("-inf"))
                    tl.store(out_ptr + t * stride_ot + rj, score, mask=jmask)
        else:
            none = tl.full([QB, BN], float("-inf"), dtype=tl.float32)
            tl.store(out_ptr + rt[:, None] * stride_ot + rj[None, :], none, mask=tmask[:, None] & jmask[None, :])


def _scores_triton(q: Tensor, w: Tensor, keys: Tensor, block_table: Tensor, req_index: Tensor, n_visible: Tensor,
                   rows_per_block: int, n_max: int, record: RecordFormat | None,
                   tiles: tuple[int, int, int] | None = None, w_scale: float = 1.0) -> Tensor:
    t, hi, di = q.shape
    out = torch.empty(t, n_max, dtype=torch.float32, device=q.device)
    if t == 0 or n_max == 0:
        return out
    qb, bn, warps = tiles or score_tiles(t, n_max, block_table.shape[0])
    bh = max(16, triton.next_power_of_2(hi))
    bt = block_table.contiguous()
    w = w if w.stride(1) == 1 else w.contiguous()
    _scores_kernel[(triton.cdiv(t, qb), triton.cdiv(n_max, bn))](
        q, w, keys, bt, req_index.contiguous(), n_visible.contiguous(), out, t, hi, n_max, rows_per_block,
        bt.shape[1], q.stride(0), q.stride(1), w.stride(0), keys.stride(0), bt.stride(0), out.stride(0), float(w_scale),
        BH=bh, DI=di, BN=bn, QB=qb, DOT=dot_dtype(q.dtype), IEEE=q.dtype == torch.float32, FMT=format_id(record),
        num_warps=warps, **triton_kw(q.device))
    return out
