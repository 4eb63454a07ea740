"""V4 attention over the paged caches: sliding window, HCA (every visible compressed entry) and CSA
(overlapping compressor + lightning indexer with its own compressor) (docs/model.md §4, §6.2).

Open windows carry across steps in the request's ``cstate`` row; the A half of every closed CSA window is
kept in ``cov{r}`` so the next window (also after a prefix-cache hit) can pool over it.
"""

from __future__ import annotations

import torch

from .select import chunked_select, pad_cat, request_keys
from ...kernels.paged import block_slots, gather_slots, write_slots
from ...kernels.sparse_attention import sparse_mqa_sink
from ..reference.attention import index_scores, select_topk
from ..reference.compress_v4 import V4Attention, WindowCompressor
from .v41 import StepState


def _run_compressor(comp: WindowCompressor, x: torch.Tensor, state_row: torch.Tensor, cov_row, pos0: int,
                    buf_cols: slice, ov_cols: slice | None):
    """One request's run through ``comp`` with its carry rebuilt from the caches; writes the new open-window
    rows back into ``state_row`` [r−1, width]. Returns (entries [n_closed, d], A halves or None)."""
    r = comp.ratio
    npend = pos0 % r
    half = (buf_cols.stop - buf_cols.start) // 2
    carry: dict = {}
    if npend:
        rows = state_row[:npend, buf_cols].to(x.dtype)
        carry["buf"] = (rows[:, :half], rows[:, half:])
    if ov_cols is not None and cov_row is not None:
        ov = cov_row[:, ov_cols].to(x.dtype)
        carry["overlap"] = (ov[:, : comp.width], ov[:, comp.width:])
    entries = comp(x, carry)
    kv, gate = carry["buf"]
    state_row[: kv.shape[0], buf_cols] = torch.cat([kv, gate], dim=-1).to(state_row.dtype)
    return entries, carry.get("closed_a") if entries.shape[0] else None


def compress_v4(mod: V4Attention, x: torch.Tensor, st: StepState):
    """Entries closed this step for a compressing layer. Returns (token rows closing them [n], pre-RoPE
    entries [n, hd], pre-RoPE index keys [n, di] or None); writes ``cstate`` and ``cov{r}``."""
    b, cache, plan = st.batch, st.cache, mod.plan
    r, hd = plan.ratio, mod.head_dim
    csa = plan.attn_type == "csa"
    di = mod.cfg.index_head_dim
    c = 2 if csa else 1
    state = cache.state[plan.layer_id]
    cov_kind = f"cov{r}"
    rows_out, ent_out, key_out = [], [], []
    for ri, (row0, n, pos0) in enumerate(b.starts):
        xr = x[row0:row0 + n]
        srow = state[int(b.state_rows[ri])]
        cov_row = None
        w0 = pos0 // r
        if csa and w0 > 0:
            slot = block_slots(b.block_tables[cov_kind][ri:ri + 1], torch.tensor([[w0 - 1]], device=x.device),
                               cache.rows_per_block(cov_kind))
            cov_row = gather_slots(cache.tensors[cov_kind][plan.layer_id], slot)[0, 0]
        main_cols = slice(0, 2 * c * hd)
        ents, a_main = _run_compressor(mod.compressor, xr, srow, cov_row, pos0, main_cols,
                                       slice(0, 2 * hd) if csa else None)
        closing = torch.nonzero((b.positions[row0:row0 + n] + 1) % r == 0).flatten() + row0
        rows_out.append(closing)
        ent_out.append(ents)
        if csa:
            idx_cols = slice(2 * c * hd, 2 * c * hd + 4 * di)
            keys, a_idx = _run_compressor(mod.indexer.compressor, xr, srow, cov_row, pos0, idx_cols,
                                          slice(2 * hd, 2 * hd + 2 * di))
            key_out.append(keys)
            if a_main is not None:
                halves = torch.cat([a_main[0], a_main[1], a_idx[0], a_idx[1]], dim=-1)  # [n_w, r, 2hd+2di]
                write_slots(cache.tensors[cov_kind][plan.layer_id], b.slot_mapping[cov_kind][closing], halves)
    rows = torch.cat(rows_out)
    return rows, torch.cat(ent_out), (torch.cat(key_out) if csa else None)


def attention_v4(mod: V4Attention, x: torch.Tensor, st: StepState) -> torch.Tensor:
    """One V4 attention sub-layer over the step: x [T, D] normalized input → [T, D]."""
    b, cache, plan = st.batch, st.cache, mod.plan
    q, qr = mod.project_q(x, b.positions)
    swa = cache.tensors["swa"][plan.layer_id]
    write_slots(swa, b.slot_mapping["swa"], mod.window_kv(x, b.positions))
    sources = [(swa, st.window_slots)]
    if plan.ratio > 0:
        r = plan.ratio
        kind = f"ckv{r}"
        rows, ents, keys = compress_v4(mod, x, st)
        ids = b.positions[rows] // r
        write_slots(cache.tensors[kind][plan.layer_id], b.slot_mapping[kind][rows], mod.encode_entries(ents, ids))
        if keys is not None:
            write_slots(cache.tensors[f"idx{r}"][plan.layer_id], b.slot_mapping[f"idx{r}"][rows],
                        mod.encode_index_keys(keys, ids))
        entry_ids = _visible_or_selected(mod, x, qr, st)
        sources.append((cache.tensors[kind][plan.layer_id],
                        block_slots(b.block_tables[kind][b.req_index], entry_ids, cache.rows_per_block(kind))))
    o = sparse_mqa_sink(q, sources, mod.attn_sink, mod.head_dim ** -0.5)
    return mod.output(o, b.positions)


def _visible_or_selected(mod: V4Attention, x: torch.Tensor, qr: torch.Tensor, st: StepState) -> torch.Tensor:
    """Entry ids per query [T, K] (−1 = none): HCA every visible entry, CSA the indexer's top-k."""
    b, cache, r = st.batch, st.cache, mod.plan.ratio
    n_t = (b.positions + 1) // r
    if mod.plan.attn_type == "hca":
        width = max(1, int(n_t.max()))
        ent = torch.arange(width, device=x.device)[None, :].expand(x.shape[0], -1)
        return torch.where(ent < n_t[:, None], ent, torch.full_like(ent, -1))
    kind = f"idx{r}"
    q, w = mod.index_query(x, qr, b.positions)
    out = []
    for ri, (row0, n, pos0) in enumerate(b.starts):
        n_cached = (pos0 + n) // r
        keys = request_keys(cache.tensors[kind][mod.plan.layer_id], b.block_tables[kind][ri:ri + 1], n_cached,
                            cache.rows_per_block(kind))
        ent = torch.arange(n_cached, device=x.device)[None, :]

        def select(scores, a, e, row0=row0, ent=ent):
            visible = ent < n_t[row0 + a:row0 + e, None]
            return select_topk(scores.masked_fill(~visible, float("-inf")), mod.cfg.index_topk)

        out.append(chunked_select(lambda a, e: index_scores(q[row0 + a:row0 + e], keys, w[row0 + a:row0 + e]),
                                  n, n_cached, mod.indexer.n_heads, q.element_size(), st.index_scratch_bytes,
                                  select))
    return pad_cat(out)
