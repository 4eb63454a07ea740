"""V4.1 attention over the paged caches: window rows, shared compressed KV with carried ratio-2 state,
bounded two-level indexer over paged index keys (docs/model.md §3.5–§3.7, §6.1).

The token-wise math (projections, RoPE, norms, entry encoding, selection rules) is the reference model's
own modules, so only the data movement differs from the oracle.
"""

from __future__ import annotations

import torch

from .select import chunked_select, pad_cat, request_keys
from ...kernels.paged import block_slots, write_slots
from ...kernels.sparse_attention import sparse_mqa_sink
from ..reference.attention import Attention, index_scores
from ..reference.csa2 import Compressor, CSA2Attention
from ..protocol import StepBatch


class StepState:
    """What the layers of one step share: the batch, the cache, per-kind block rows per token, the window
    slots of every query [T, W], the top-k lists published by index sources and the candidate masks."""

    def __init__(self, batch: StepBatch, cache, window: int, index_scratch_bytes: int):
        self.batch, self.cache, self.index_scratch_bytes = batch, cache, index_scratch_bytes
        pos = batch.positions
        offs = torch.arange(window - 1, -1, -1, device=pos.device)
        win_pos = pos[:, None] - offs[None, :]  # [T, W], oldest first
        win_pos = torch.where(win_pos >= 0, win_pos, torch.full_like(win_pos, -1))
        self.window_slots = block_slots(batch.block_tables["swa"][batch.req_index], win_pos,
                                        cache.rows_per_block("swa"))
        self.topk: dict[int, torch.Tensor] = {}
        self.cand: dict[int, list[torch.Tensor | None]] = {}


def compress_ratio2(comp: Compressor, x: torch.Tensor, st: StepState, state: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Ratio-2 pooling over a flattened batch with the pending even-position token carried in ``state``
    [rows, 2, hd] (a, b). Returns (pre-RoPE latents [n, hd] of the entries closed this step, token rows [n]
    that close them); updates ``state`` for runs ending on an even position."""
    b = st.batch
    ctype = torch.promote_types(x.dtype, torch.float32)
    a_all, g_all = comp.wkv(x.to(ctype)).to(ctype), comp.wgate(x.to(ctype)).to(ctype)
    prev_a, prev_g = torch.roll(a_all, 1, 0), torch.roll(g_all, 1, 0)
    for r, (row0, n, pos0) in enumerate(b.starts):
        if pos0 % 2 == 1:  # the run starts on an odd position: its partner waits in the state row
            srow = int(b.state_rows[r])
            prev_a[row0], prev_g[row0] = state[srow, 0].to(ctype), state[srow, 1].to(ctype)
    closing = torch.nonzero(b.positions % 2 == 1).flatten()
    pa = torch.stack([prev_a[closing], a_all[closing]], dim=1)
    pg = torch.stack([prev_g[closing], g_all[closing]], dim=1)
    pooled = (torch.softmax(pg, dim=1) * pa).sum(dim=1)
    if comp.deployed:
        pooled = pooled.to(torch.bfloat16)
    for r, (row0, n, pos0) in enumerate(b.starts):
        last = row0 + n - 1
        if (pos0 + n - 1) % 2 == 0:
            srow = int(b.state_rows[r])
            state[srow, 0], state[srow, 1] = a_all[last].to(state.dtype), g_all[last].to(state.dtype)
    return comp.norm(pooled.to(x.dtype)), closing


def write_entries(mod: CSA2Attention, x: torch.Tensor, st: StepState) -> None:
    """A KV source's compressor: closed entries → RoPE/format → its ``ckv{r}`` and ``idx{r}`` rows."""
    plan, b, cache = mod.plan, st.batch, st.cache
    if plan.ratio == 1:
        latent, rows = mod.compressor.norm(mod.compressor.wkv(x)), torch.arange(x.shape[0], device=x.device)
    else:
        latent, rows = compress_ratio2(mod.compressor, x, st, cache.state[plan.layer_id])
    k, c = mod.encode_entries(latent, b.positions[rows] // plan.ratio)
    write_slots(cache.tensors[f"ckv{plan.ratio}"][plan.layer_id], b.slot_mapping[f"ckv{plan.ratio}"][rows], c)
    write_slots(cache.tensors[f"idx{plan.ratio}"][plan.layer_id], b.slot_mapping[f"idx{plan.ratio}"][rows], k)


def select_entries(mod: CSA2Attention, x: torch.Tensor, qr: torch.Tensor, st: StepState) -> torch.Tensor:
    """An index source's top-k entry ids per query [T, k] (−1 = none), request by request over its paged index
    keys, scoring queries in chunks so scratch stays under ``index_scratch_bytes``."""
    plan, b, cache = mod.plan, st.batch, st.cache
    kind = f"idx{plan.ratio}"
    q, w = mod.index_query(x, qr, b.positions)
    out: list[torch.Tensor] = []
    cands: list[torch.Tensor | None] = []
    cand_in = st.cand.get(mod.cfg.candidate_source_layer_id)
    for r, (row0, n, pos0) in enumerate(b.starts):
        n_cached = (pos0 + n) // plan.ratio
        keys = request_keys(cache.tensors[kind][plan.kv_src], b.block_tables[kind][r:r + 1], n_cached,
                            cache.rows_per_block(kind))
        n_t = (b.positions[row0:row0 + n] + 1) // plan.ratio
        masks: list[torch.Tensor] = []

        def select(scores, a, e, r=r, n_t=n_t, masks=masks):
            given = None if cand_in is None or cand_in[r] is None else cand_in[r][a:e]
            topk, mask = mod.select(scores, n_t[a:e], given)
            masks.append(mask)
            return topk

        out.append(chunked_select(lambda a, e: index_scores(q[row0 + a:row0 + e], keys, w[row0 + a:row0 + e]),
                                  n, n_cached, mod.indexer.n_heads, q.element_size(), st.index_scratch_bytes,
                                  select))
        cands.append(torch.cat(masks) if plan.is_candidate_source else None)
    if plan.is_candidate_source:
        st.cand[plan.layer_id] = cands
    return pad_cat(out)


def attention_v41(mod: Attention, x: torch.Tensor, st: StepState) -> torch.Tensor:
    """One V4.1 attention sub-layer over the step: x [T, D] normalized input → [T, D]."""
    b, cache, plan = st.batch, st.cache, mod.plan
    q, qr = mod.project_q(x, b.positions)
    swa = cache.tensors["swa"][plan.layer_id]
    write_slots(swa, b.slot_mapping["swa"], mod.window_kv(x, b.positions))
    sources = [(swa, st.window_slots)]
    if plan.ratio > 0:
        if plan.owns_compressor:
            write_entries(mod, x, st)
        if plan.is_index_source:
            st.topk[plan.layer_id] = select_entries(mod, x, qr, st)
        kind = f"ckv{plan.ratio}"
        ckv_slots = block_slots(b.block_tables[kind][b.req_index], st.topk[plan.idx_src], cache.rows_per_block(kind))
        sources.append((cache.tensors[kind][plan.kv_src], ckv_slots))
    o = sparse_mqa_sink(q, sources, mod.attn_sink, mod.head_dim ** -0.5)
    return mod.output(o, b.positions)
