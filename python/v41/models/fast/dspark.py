"""The DSpark drafter in the fast model (docs/model.md §3.9; docs/speculative-decoding.md §1, §2).

Three draft stages (``mtp.0..S-1``), each a delayed-mHC block with window attention and a small MoE. Two passes:

* **Context** (:meth:`FastDrafter.write_context`, inside every target step): the aux streams of every computed
  token go through ``main_proj`` / ``main_norm`` and each stage's ``wkv`` / ``kv_norm`` / RoPE into that stage's
  rows of the ``dspark`` cache kind, at the token's slot. Rows of drafts that are later rejected are simply
  unreachable: a draft block only reads positions before its anchor, which are committed.
* **Draft** (:meth:`FastDrafter.forward`): per request, the block ``[anchor, noise × (K − 1)]`` at positions
  ``n .. n + K − 1``; its queries see the stage's context rows of positions ``n − W .. n − 1`` (``W`` =
  ``sliding_window``) and every row of their own block (non-causal). Returns the base logits; the Markov head
  (:meth:`FastDrafter.markov_logits`) follows draft by draft, because it reads the previous draft, and so does
  the confidence logit ``c_i = proj · [y_i ; e_i]`` (:meth:`FastDrafter.confidence`: ``y_i`` the block row's
  collapsed hidden, ``e_i`` the Markov embedding of ``out_i``), which adaptive verification reads
  (docs/speculative-decoding.md §4).

Under tensor parallelism the stages shard like backbone layers (heads, experts), or with
``draft_tensor_parallel_size`` 1 are whole on every rank (built with a single-rank group: no all-reduce inside
them); ``main_*``, ``norm`` and the Markov and confidence heads are replicated, the embedding and LM head are the
target's (vocab-parallel, the base logits all-gathered), so every rank computes the same drafts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ...config import LayerPlan, ModelConfig
from ...distributed.group import TPGroup, split_range
from ...kernels.mhc import hc_collapse as collapse
from ...kernels.paged import table_slots
from ...kernels.rope import rope
from ...kernels.sparse_attention import sparse_mqa_sink
from .attention import FastAttention
from .block import FastBlock
from .cache import FastCache
from .heads import LMHead
from .layers import PackedLinear, RMSNorm, Rope
from .moe import FastMoE


@dataclass(frozen=True)
class DraftBatch:
    """One draft pass over B requests, K rows each, on the model's device.

    token_ids, positions, req_index [B·K] int64 (row ``b·K + i`` is slot i of request b; slot 0 holds the anchor,
    the others the noise token); block_table [B, W_blocks] int64, each request's ``dspark`` block table."""

    token_ids: Tensor
    positions: Tensor
    req_index: Tensor
    block_table: Tensor


@dataclass
class DraftContext:
    """What the stages share in a draft pass: RoPE (cos, sin) at the block positions, the ring slots [B·K, W]
    of positions n − W .. n − 1 (−1 = none), the block slots [B·K, K] into the pass's own K=V rows."""

    cache: FastCache
    cos: Tensor
    sin: Tensor
    ring_slots: Tensor
    block_slots: Tensor


class DraftAttention(FastAttention):
    """Window attention of stage s (layer id ``num_hidden_layers + s``, plain RoPE base, no YaRN): context rows
    from the ``dspark`` cache plus the block's own rows."""

    def __init__(self, cfg: ModelConfig, stage: int, tp: TPGroup | None = None):
        plan = LayerPlan(layer_id=cfg.num_hidden_layers + stage, ratio=0, attn_type="swa")
        super().__init__(cfg, plan, q_head_norm=False, tp=tp)

    def kv_rows(self, x: Tensor, cos: Tensor, sin: Tensor, kv: Tensor | None = None) -> Tensor:
        """x [T, D] → post-RoPE K=V rows [T, hd] (the context rows, and the block's own); ``kv``: ``wkv(x)`` when
        already projected."""
        return rope(self.kv_norm(self.wkv(x) if kv is None else kv), cos, sin)

    def forward(self, x: Tensor, ctx: DraftContext) -> Tensor:
        cos, sin = ctx.cos, ctx.sin
        proj = self.project(x)  # wq_a and wkv in one GEMM
        qr = self.q_norm(proj["wq_a"])
        q = rope(self.wq_b(qr).view(x.shape[0], self.n_heads, self.head_dim), cos, sin)
        ring, fmt = ctx.cache.tensors["dspark"][self.plan.layer_id], ctx.cache.records["dspark"]
        block = self.kv_rows(x, cos, sin, proj["wkv"])
        if fmt is not None:  # the block's own rows in the ring's rounding, as the reference's window rows are
            block = fmt.decode(fmt.encode(block), block.dtype)
        sources = [(ring, ctx.ring_slots), (block, ctx.block_slots)]
        records = [fmt, None]
        o = rope(sparse_mqa_sink(q, sources, self.attn_sink, self.head_dim ** -0.5, records), cos, sin, inverse=True)
        return self.tp.all_reduce(self.wo_b(self.wo_a(o.reshape(x.shape[0], -1))))


class _Weight(nn.Module):
    """A bare ``weight`` tensor (the Markov head's embedding rows [V, rank])."""

    def __init__(self, rows: int, cols: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, cols), requires_grad=False)


class MarkovHead(nn.Module):
    """``embed.weight [V, rank]``, ``head [V, rank]``: ``logits_i += head · embed[out_i]`` (§3.9)."""

    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.embed = _Weight(vocab, rank)
        self.head = PackedLinear(rank, vocab)


class ConfidenceHead(nn.Module):
    """``proj [1, D + rank]``: a raw logit per draft (no sigmoid)."""

    def __init__(self, dim: int):
        super().__init__()
        self.proj = PackedLinear(dim, 1)


class DraftStage(FastBlock):
    """One stage: a delayed-mHC :class:`~.block.FastBlock` with :class:`DraftAttention` and the stage MoE
    (:func:`draft_moe`); stage 0 adds ``main_proj [D, n_targets·D]`` and ``main_norm``, the last stage ``norm``,
    ``markov_head`` and ``confidence_head``."""

    def __init__(self, cfg: ModelConfig, stage: int, tp: TPGroup):
        super().__init__(cfg, DraftAttention(cfg, stage, tp), draft_moe(cfg, tp), delayed=True)
        d = cfg.hidden_size
        if stage == 0:
            self.main_proj = PackedLinear(len(cfg.dspark_target_layer_ids) * d, d, fp8_input=True)
            self.main_norm = RMSNorm(d, cfg.rms_norm_eps)
        if stage == cfg.num_nextn_predict_layers - 1:
            self.norm = RMSNorm(d, cfg.rms_norm_eps)
            self.markov_head = MarkovHead(cfg.vocab_size, cfg.dspark_markov_rank)
            self.confidence_head = ConfidenceHead(d + cfg.dspark_markov_rank)


def draft_moe(cfg: ModelConfig, tp: TPGroup) -> FastMoE:
    """A stage's MoE: ``dspark_n_routed_experts`` experts, ``dspark_num_experts_per_tok`` active, V4.1 routing."""
    i0, i1 = split_range(cfg.moe_intermediate_size, tp.world_size, tp.rank)
    return FastMoE(cfg.hidden_size, i1 - i0, cfg.dspark_n_routed_experts, cfg.dspark_num_experts_per_tok,
                   cfg.n_shared_experts, cfg.swiglu_limit, gate_temp=cfg.gate_temp, norm_topk_prob=cfg.norm_topk_prob,
                   scaling=cfg.routed_scaling_factor, bias_vl=True, tp=tp)


class FastDrafter(nn.Module):
    """The stages ``stages[s]`` (module docstring). ``rope_base``: the model's plain-base RoPE; ``head``: the
    model's LM head (shared, as in the checkpoint; not a submodule of the drafter)."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, rope_base: Rope, head: LMHead):
        super().__init__()
        self.cfg = cfg
        self.stages = nn.ModuleList(DraftStage(cfg, s, tp) for s in range(cfg.num_nextn_predict_layers))
        self.rope_base = rope_base
        self._head = [head]

    @property
    def last(self) -> DraftStage:
        return self.stages[-1]

    def write_context(self, aux: Tensor, cos: Tensor, sin: Tensor, cache: FastCache, slots: Tensor) -> None:
        """aux [T, n_targets·D] of a target step, (cos, sin) at its positions, slots [T] its ``dspark`` slots
        (−1 = none): every stage's context row of every token into the cache."""
        first = self.stages[0]
        main_x = first.main_norm(first.main_proj(aux.to(first.main_norm.weight.dtype)))
        for stage in self.stages:
            attn = stage.attn
            cache.store("dspark", attn.plan.layer_id, slots, attn.kv_rows(main_x, cos, sin))

    def forward(self, batch: DraftBatch, embed: nn.Module, cache: FastCache) -> tuple[Tensor, Tensor]:
        """One draft pass: the base logits [B·K, V] float32 (before the Markov term) and the collapsed hidden
        ``y`` [B·K, D] (model dtype, before ``norm``) that the confidence head reads."""
        cfg, k = self.cfg, self.cfg.dspark_block_size
        w = cfg.sliding_window
        pos, req = batch.positions, batch.req_index
        anchor = pos.view(-1, k)[:, :1].expand(-1, k).reshape(-1)  # n of each row's block
        offs = torch.arange(w, 0, -1, device=pos.device)
        ring_pos = anchor[:, None] - offs[None, :]  # n − W .. n − 1, oldest first
        ring_pos = torch.where(ring_pos >= 0, ring_pos, torch.full_like(ring_pos, -1))
        local = torch.arange(req.shape[0] // k, device=pos.device).repeat_interleave(k)
        ring_slots = table_slots(batch.block_table, local, ring_pos, cache.rows_per_block("dspark"))
        block_slots = local[:, None] * k + torch.arange(k, device=pos.device)[None, :]
        cos, sin = self.rope_base.cos_sin(pos)
        ctx = DraftContext(cache, cos, sin, ring_slots, block_slots)
        dtype = self.last.norm.weight.dtype
        h = embed(batch.token_ids).to(dtype).unsqueeze(1).repeat(1, cfg.hc_mult, 1)
        pre_mix = torch.zeros(h.shape[0], cfg.hc_mult, dtype=torch.promote_types(dtype, torch.float32),
                              device=h.device)
        pre_mix[:, 0] = 1
        for stage in self.stages:
            h, pre_mix = stage(h, pre_mix, batch.token_ids, ctx)
        y = collapse(h, pre_mix)
        return self._head[0](self.last.norm(y)), y

    def markov_logits(self, out: Tensor) -> Tensor:
        """The Markov term [B, V] float32 of the previous outputs ``out`` [B] (the anchor for slot 0)."""
        mh = self.last.markov_head
        e = mh.embed.weight[out]
        return mh.head(e, torch.promote_types(e.dtype, torch.float32))

    def confidence(self, y: Tensor, outs: Tensor) -> Tensor:
        """Raw confidence logits ``c_i = proj · [y_i ; e_i]`` [..., K] float32 (§3.9; no sigmoid) of the block rows'
        collapsed hidden ``y`` [..., K, D] and the Markov head's inputs ``outs`` [..., K] int64 (``out_0`` = the
        anchor, ``out_i`` = draft i): ``σ(c_i)`` estimates that draft ``i + 1`` is accepted once the drafts before
        it were."""
        e = self.last.markov_head.embed.weight[outs]
        x = torch.cat([y.to(e.dtype), e], dim=-1)
        c = self.last.confidence_head.proj(x.reshape(-1, x.shape[-1]), torch.promote_types(e.dtype, torch.float32))
        return c.view(outs.shape)
