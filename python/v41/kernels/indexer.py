"""Lightning-indexer scores of a whole step in one pass (docs/model.md §3.7 steps 2–4, §4 "CSA indexer"):
``score[t, j] = Σ_h w[t, h] · ReLU(q[t, h] · k_j)`` for the entries ``j < n_visible[t]`` of token t's request,
``−inf`` for the others, every request of the step at once, keys read through the paged block table.

The Triton kernel (one program per token and block of entries) gathers the key rows, keeps the head sum in
registers and writes only the ``[T, N]`` scores; the reference bounds its ``[c, heads, N]`` scratch by scoring
tokens in chunks of at most ``scratch_bytes``. The keys may be MXFP4 records (``--kv-cache-dtype fp8``,
:mod:`v41.cache.records`), decoded where they are read.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..cache.records import RecordFormat
from .dispatch import TRITON_DTYPES, dot_dtype, triton, use_triton
from .paged import block_slots
from .records import format_id
from .sparse_attention import gather_keys


def index_scores_ref(q: Tensor, w: Tensor, keys: Tensor, block_table: Tensor, req_index: Tensor,
                     n_visible: Tensor, rows_per_block: int, n_max: int, scratch_bytes: int = 64 << 20,
                     record: RecordFormat | None = None) -> Tensor:
    """q [T, Hi, di]; w [T, Hi] (already scaled); keys: the index-key cache [S, di] (or uint8 [S, nbytes] records
    of ``record``); block_table [R, B] (−1 = none); req_index [T]; n_visible [T] visible entries per token;
    n_max ≥ every request's cached entries. Returns float32 [T, n_max]."""
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
                 record: RecordFormat | None = None) -> Tensor:
    """:func:`index_scores_ref` as one Triton launch where :func:`.dispatch.use_triton` says so."""
    want = q.dtype if record is None else torch.uint8
    if q.dtype in TRITON_DTYPES and keys.dtype == want and use_triton(q, keys, family="attention"):
        return _scores_triton(q, w, keys, block_table, req_index, n_visible, rows_per_block, n_max, record)
    return index_scores_ref(q, w, keys, block_table, req_index, n_visible, rows_per_block, n_max, scratch_bytes,
                            record)


if triton is not None:
    import triton.language as tl

    from .records import load_rows

    @triton.jit
    def _scores_kernel(q_ptr, w_ptr, k_ptr, bt_ptr, req_ptr, nvis_ptr, out_ptr, HI, N, RPB, NB,
                       stride_qt, stride_qh, stride_wt, stride_k, stride_bt, stride_ot,
                       BH: tl.constexpr, DI: tl.constexpr, BN: tl.constexpr, DOT: tl.constexpr,
                       IEEE: tl.constexpr, FMT: tl.constexpr):
        t, jb = tl.program_id(0), tl.program_id(1)
        rj = jb * BN + tl.arange(0, BN)
        n_vis = tl.load(nvis_ptr + t)
        jmask = rj < N
        if jb * BN < n_vis:
            rh = tl.arange(0, BH)
            hmask = rh < HI
            rd = tl.arange(0, DI)
            q = tl.load(q_ptr + t * stride_qt + rh[:, None] * stride_qh + rd[None, :], mask=hmask[:, None],
                        other=0.0).to(DOT)
            wt = tl.load(w_ptr + t * stride_wt + rh, mask=hmask, other=0.0).to(tl.float32)
            req = tl.load(req_ptr + t)
            blk = rj // RPB
            phys = tl.load(bt_ptr + req * stride_bt + blk, mask=jmask & (blk < NB), other=-1)
            valid = (rj < n_vis) & (phys >= 0)
            slot = tl.maximum(phys, 0).to(tl.int64) * RPB + rj % RPB
            kt = load_rows(k_ptr, slot * stride_k, valid, DI, FMT, 0).to(DOT)
            if IEEE:
                s = tl.dot(q, tl.trans(kt), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(kt))
            score = tl.sum(tl.maximum(s, 0.0) * wt[:, None], axis=0)
            score = tl.where(rj < n_vis, score, float("-inf"))
        else:
            score = tl.full([BN], float("-inf"), dtype=tl.float32)
        tl.store(out_ptr + t * stride_ot + rj, score, mask=jmask)


def _scores_triton(q: Tensor, w: Tensor, keys: Tensor, block_table: Tensor, req_index: Tensor, n_visible: Tensor,
                   rows_per_block: int, n_max: int, record: RecordFormat | None) -> Tensor:
    t, hi, di = q.shape
    out = torch.empty(t, n_max, dtype=torch.float32, device=q.device)
    if t == 0 or n_max == 0:
        return out
    bh = max(16, triton.next_power_of_2(hi))
    bn = 64
    bt = block_table.contiguous()
    w = w.contiguous()
    _scores_kernel[(t, triton.cdiv(n_max, bn))](
        q, w, keys, bt, req_index.contiguous(), n_visible.contiguous(), out, hi, n_max, rows_per_block, bt.shape[1],
        q.stride(0), q.stride(1), w.stride(0), keys.stride(0), bt.stride(0), out.stride(0),
        BH=bh, DI=di, BN=bn, DOT=dot_dtype(q.dtype), IEEE=q.dtype == torch.float32, FMT=format_id(record))
    return out
