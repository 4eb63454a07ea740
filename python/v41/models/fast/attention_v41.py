"""V4.1 "CSA2" attention in the fast model (docs/model.md §3.5–§3.7): KV sources compress (ratio 2: gated
pairs carried across steps; ratio 1: one latent per token) and write the shared compressed KV and index keys;
index sources score every cached entry of every request in one pass, the candidate source publishes its block
mask, later index sources filter by it; consumers reuse their sources' cache and top-k list.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ...config import LayerPlan, ModelConfig
from ...distributed.group import TPGroup
from ...kernels.candidates import candidate_blocks, filter_candidates_
from ...kernels.indexer import index_scores
from ...kernels.record_store import mxfp4_qdq_rows
from ...kernels.topk import select_topk
from ...kernels.window_pool import pooled_values
from .attention import FastAttention, StepContext, index_row_chunks
from .compress import pool_step
from ...kernels.rope import rope_
from .layers import PackedLinear, RMSNorm


class Compressor(nn.Module):
    """KV-source compressor: ``wkv [hd, D]`` (+ ``wgate [hd, D]`` at ratio 2) BF16, ``norm [hd]`` (§3.6)."""

    def __init__(self, cfg: ModelConfig, ratio: int):
        super().__init__()
        self.ratio = ratio
        self.wkv = PackedLinear(cfg.hidden_size, cfg.head_dim)
        if ratio == 2:
            self.wgate = PackedLinear(cfg.hidden_size, cfg.head_dim)
        self.norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.deployed = False  # deployed numerics: the pooled ratio-2 latent is cast to bf16 before the norm


class Indexer(nn.Module):
    """``wq_b [Hi·di, q_lora]`` FP8, ``weights_proj [Hi, D]`` BF16; at KV sources also ``wk [di, hd]`` and
    ``k_norm [di]`` (the shared index keys, §3.7 step 1)."""

    def __init__(self, cfg: ModelConfig, owns_keys: bool):
        super().__init__()
        hi, di = cfg.index_n_heads, cfg.index_head_dim
        self.wq_b = PackedLinear(cfg.q_lora_rank, hi * di, fp8_input=True)
        self.weights_proj = PackedLinear(cfg.hidden_size, hi)
        if owns_keys:
            self.wk = PackedLinear(cfg.head_dim, di)
            self.k_norm = RMSNorm(di, cfg.rms_norm_eps)
        self.n_heads, self.head_dim = hi, di


class CSA2Attention(FastAttention):
    """A V4.1 layer with ``compress_ratio > 0``; sources run before their consumers in the forward."""

    def __init__(self, cfg: ModelConfig, plan: LayerPlan, tp: TPGroup | None = None):
        super().__init__(cfg, plan, q_head_norm=False, tp=tp)
        if plan.owns_compressor:
            self.compressor = Compressor(cfg, plan.ratio)
        if plan.is_index_source:
            self.indexer = Indexer(cfg, plan.owns_index_keys)
        # a ratio-1 compressor's wkv returns the compute dtype: it stays apart
        wide = {"comp.wkv": self.compressor.wkv, "comp.wgate": self.compressor.wgate} \
            if plan.owns_compressor and plan.ratio == 2 else {}
        if plan.is_index_source:
            wide["weights_proj"] = self.indexer.weights_proj
        self.add_wide_siblings(wide)

    def write_entries(self, x: Tensor, proj: dict[str, Tensor], ctx: StepContext) -> None:
        if self.plan.owns_compressor:
            self._write_entries(x, proj, ctx)

    def compressed_source(self, x: Tensor, qr: Tensor, proj: dict[str, Tensor], ctx: StepContext):
        plan = self.plan
        if plan.is_index_source:
            ctx.topk[plan.layer_id] = self._select(x, qr, proj, ctx)
        kind = f"ckv{plan.ratio}"
        return ctx.cache.tensors[kind][plan.kv_src], ctx.entry_slots(kind, ctx.topk[plan.idx_src])

    def _write_entries(self, x: Tensor, proj: dict[str, Tensor], ctx: StepContext) -> None:
        """Entries closed in this step → RoPE at ``j·r`` → ``ckv{r}``; index keys from the pre-RoPE latent →
        ``idx{r}`` (§3.6, §3.7 step 1)."""
        comp, r, lid = self.compressor, self.plan.ratio, self.plan.layer_id
        ix = self.indexer
        if r == 1:
            latent = comp.norm(comp.wkv(x))
            angles = ctx.rope[self.rope_key]
            ctx.write(f"idx{r}", lid, ix.wk(latent), norm=ix.k_norm.params(), rope=angles)
            ctx.write(f"ckv{r}", lid, latent, rope=angles)
            return
        seg = ctx.segments[r]
        _, s, a = pool_step(seg, proj["comp.wkv"], proj["comp.wgate"], ctx.cache.state[lid])
        latent = comp.norm(pooled_values(s, a, x.dtype, through_bf16=comp.deployed))
        angles = ctx.closed_rope(self.rope_key, r)
        ctx.write_closed(f"idx{r}", lid, seg, ix.wk(latent), norm=ix.k_norm.params(), rope=angles)
        ctx.write_closed(f"ckv{r}", lid, seg, latent, rope=angles)

    def _select(self, x: Tensor, qr: Tensor, proj: dict[str, Tensor], ctx: StepContext) -> Tensor:
        """This index source's top-k entry ids per query [T, min(index_topk, N)] (−1 = none), §3.7 steps 2–7."""
        cfg, plan, ix = self.cfg, self.plan, self.indexer
        r = plan.ratio
        q = ix.wq_b(qr).view(x.shape[0], ix.n_heads, ix.head_dim)
        w, w_scale = proj["weights_proj"], ix.head_dim ** -0.5 * ix.n_heads ** -0.5
        kind = f"idx{r}"
        record = ctx.cache.records[kind]
        if record is not None:  # MXFP4 keys are scored against MXFP4 queries, as the deployed kernel does (§2)
            q = mxfp4_qdq_rows(q, rope=ctx.rope[self.rope_key])  # rotated, then rounded, in one launch
        else:
            q = rope_(q, *ctx.rope[self.rope_key])
        b, n, block = ctx.batch, ctx.n_max[r], cfg.candidate_block_size
        picks, cand = [], []
        for rows in index_row_chunks(x.shape[0], n, ctx.index_scratch_bytes):  # bounded [rows, N] scratch
            scores = index_scores(q[rows], w[rows], ctx.cache.tensors[kind][plan.kv_src], b.block_tables[kind],
                                  b.req_index[rows], ctx.n_visible[r][rows], ctx.cache.rows_per_block(kind), n,
                                  record=record, w_scale=w_scale)
            if plan.is_candidate_source:
                cand.append(candidate_blocks(scores, ctx.n_visible[r][rows], block, cfg.candidate_topk_blocks))
            elif plan.uses_candidate_filter:
                scores = filter_candidates_(scores, ctx.cand[rows], block)
            picks.append(select_topk(scores, min(cfg.index_topk, n), ctx.n_visible[r][rows]))
        if plan.is_candidate_source:
            ctx.cand = torch.cat(cand) if len(cand) > 1 else cand[0]
        return torch.cat(picks) if len(picks) > 1 else picks[0]

