"""Attention shared by V4 and V4.1: low-rank q, shared K=V latent in a sliding window, sink softmax, inverse
RoPE on the output, grouped output projection (docs/model.md §3.5, §4 "Attention").

Subclasses add the compressed branch: :mod:`.csa2` (V4.1) and :mod:`.compress_v4` (V4 CSA/HCA).

Tensor parallelism (docs/model.md §3.5 "TP shards heads (and o_groups caps clean TP at 8)", §8): a rank
holds its heads' rows of ``wq_b`` and ``attn_sink`` and its output groups' rows of ``wo_a`` / columns of
``wo_b``; its ``wo_b`` output is a partial sum, all-reduced in :meth:`Attention.output`. The low-rank q input,
the K=V latent (``wkv``, ``kv_norm``), compressors and indexers are replicated, so every rank writes the same
caches and selects the same entries.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ... import quant
from ...config import LayerPlan, ModelConfig
from ...distributed.group import SINGLE, TPGroup
from .ops import Linear, RMSNorm, Rope, rms_norm, sink_attention, stable_topk, window_visible
from ..sharding import group_range, head_range
from .state import LayerState, RequestCache, append_rows


@dataclass
class ChunkContext:
    """What one forward chunk of one request shares between its layers.

    pos: [T] int64 absolute positions; token_ids: [T] int64; cache: the request's state (already holding
    rows of earlier chunks); topk: per index-source layer, its published selection [T, k] int64 (−1 =
    none); cand_mask: [T, N] bool candidate positions published by the candidate source.
    """

    pos: torch.Tensor
    token_ids: torch.Tensor
    cache: RequestCache
    topk: dict[int, torch.Tensor] = field(default_factory=dict)
    cand_mask: torch.Tensor | None = None


class Attention(nn.Module):
    """Sliding-window MQA with sinks (a ratio-0 layer, §3.5); base of the compressed variants.

    Tensors: ``wq_a [q_lora, D]``, ``q_norm [q_lora]``, ``wq_b [H·hd, q_lora]``, ``wkv [hd, D]``,
    ``kv_norm [hd]``, ``wo_a [G·R, H·hd/G]``, ``wo_b [D, G·R]``, ``attn_sink [H]``. Under ``tp`` (W ranks)
    H and G are the local ``n_heads = H/W`` and ``n_groups = G/W`` (module docstring); the config must pass
    :func:`v41.distributed.group.check_tp`.
    """

    def __init__(self, cfg: ModelConfig, plan: LayerPlan, *, q_head_norm: bool, tp: TPGroup | None = None):
        super().__init__()
        self.tp = tp or SINGLE
        d, hd = cfg.hidden_size, cfg.head_dim
        h0, h1 = head_range(cfg, self.tp.world_size, self.tp.rank)
        g0, g1 = group_range(cfg, self.tp.world_size, self.tp.rank)
        h, g = h1 - h0, g1 - g0
        self.cfg, self.plan, self.q_head_norm = cfg, plan, q_head_norm
        self.n_heads, self.n_groups, self.head_dim = h, g, hd
        self.attn_sink = nn.Parameter(torch.zeros(h), requires_grad=False)
        self.wq_a = Linear(d, cfg.q_lora_rank, fp8_input=True)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = Linear(cfg.q_lora_rank, h * hd, fp8_input=True)
        self.wkv = Linear(d, hd, fp8_input=True)
        self.kv_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.wo_a = Linear(cfg.num_attention_heads * hd // cfg.o_groups, g * cfg.o_lora_rank)
        self.wo_b = Linear(g * cfg.o_lora_rank, d, fp8_input=True)
        base, scaling = cfg.layer_rope(plan.ratio)
        self.rope = Rope(cfg.qk_rope_head_dim, base, scaling)
        self.deployed = False

    # -- pieces ----------------------------------------------------------------------------------------
    def project_q(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, D] → (q [T, H_local, hd] post-RoPE, qr [T, q_lora] the normalized low-rank q, replicated)."""
        qr = self.q_norm(self.wq_a(x))
        q = self.wq_b(qr).view(x.shape[0], self.n_heads, self.head_dim)
        if self.q_head_norm:  # V4 only: unweighted per-head RMSNorm before RoPE (§4)
            q = rms_norm(q, self.cfg.rms_norm_eps)
        return self.rope(q, pos), qr

    def window_kv(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x: [T, D] → post-RoPE K=V rows [T, hd], round-tripped through the cache format when deployed."""
        kv = self.rope(self.kv_norm(self.wkv(x)), pos)
        return self.store_window(kv)

    def store_window(self, kv: torch.Tensor) -> torch.Tensor:
        """Deployed numerics of a window row: V4.1 FP8 over all dims (block 32); V4 FP8 nope, BF16 rope."""
        if not self.deployed:
            return kv
        if self.cfg.is_v41:
            return quant.fp8_act_qdq(kv, 32)
        nope = quant.fp8_act_qdq(kv[..., : self.cfg.nope_head_dim], 64)
        rope = kv[..., self.cfg.nope_head_dim:].to(torch.bfloat16).to(kv.dtype)
        return torch.cat([nope, rope], dim=-1)

    def output(self, o: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """o: [T, H_local, hd] → inverse RoPE, grouped ``wo_a`` (block-diagonal per group), ``wo_b`` → [T, D]
        (§3.5 steps 6–7); under TP the local groups' partial ``wo_b`` output is all-reduced (full on every rank)."""
        o = self.rope(o, pos, inverse=True)
        g = self.n_groups
        og = o.reshape(o.shape[0], g, -1)  # group k = heads k·H/G .. (k+1)·H/G − 1
        wa = self.wo_a.weight.view(g, self.cfg.o_lora_rank, -1)
        z = torch.einsum("tgi,gri->tgr", og, wa).flatten(1)
        return self.tp.all_reduce(self.wo_b(z))

    def compressed(self, x: torch.Tensor, qr: torch.Tensor, ctx: ChunkContext
                   ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Compressed keys [N, hd] and their visibility [T, N] for this chunk's queries; None for SWA."""
        return None

    # -- forward -----------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, ctx: ChunkContext) -> torch.Tensor:
        """x: [T, D] normalized sub-layer input → [T, D]. Appends this chunk's window rows to the cache."""
        st: LayerState = ctx.cache.layer(self.plan.layer_id)
        q, qr = self.project_q(x, ctx.pos)
        st.kv = append_rows(st.kv, self.window_kv(x, ctx.pos))
        k_pos = torch.arange(st.kv.shape[0], device=x.device)
        keys, visible = st.kv, window_visible(ctx.pos, k_pos, self.cfg.sliding_window)
        extra = self.compressed(x, qr, ctx)
        if extra is not None:
            keys = torch.cat([keys, extra[0]], dim=0)
            visible = torch.cat([visible, extra[1]], dim=1)
        o = sink_attention(q, keys, visible, self.attn_sink, self.head_dim ** -0.5)
        return self.output(o, ctx.pos)


def selection_mask(topk: torch.Tensor, n_entries: int) -> torch.Tensor:
    """[T, k] selected entry ids (−1 = none) → [T, N] bool visibility of compressed entries."""
    mask = torch.zeros(topk.shape[0], n_entries + 1, dtype=torch.bool, device=topk.device)
    safe = torch.where(topk >= 0, topk, torch.full_like(topk, n_entries))
    mask.scatter_(1, safe, True)
    return mask[:, :n_entries]


def index_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Lightning-indexer score ``Σ_h w[t,h]·ReLU(q[t,h]·k[j])`` (§3.7): q [T, Hi, di], keys [N, di],
    weights [T, Hi] (already scaled) → [T, N]."""
    return torch.einsum("thn,th->tn", torch.relu(torch.einsum("thd,nd->thn", q, keys)), weights)


def select_topk(scores: torch.Tensor, k_max: int) -> torch.Tensor:
    """Top-``min(k_max, N)`` entries of [T, N] scores, ties to the lower position, sorted ascending;
    picks whose score is −inf (not visible, or outside the candidate filter) become −1 (§3.7 step 7)."""
    k = min(k_max, scores.shape[1])
    idx = stable_topk(scores, k)
    idx = torch.sort(idx, dim=-1).values
    picked = scores.gather(1, idx)
    return torch.where(torch.isneginf(picked), torch.full_like(idx, -1), idx)
