"""The fast model of DeepSeek-V4.1 / V4 (docs/architecture.md §2 ``models/fast``, §3a): one flattened step in, logits out,
no host synchronisation inside :meth:`FastModel.forward` (so a decode step can be captured in a CUDA graph).

Per step, :meth:`FastModel.prepare` builds the :class:`~.attention.StepContext` once (RoPE angles, window slots,
compressor segments, visible-entry counts); the layers then only compute. The decoder layer order is the spec's
(docs/model.md §3.2 for V4.1's delayed pre-mix, §4 for V4's own pre-mix).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ...config import ModelConfig
from ...distributed.group import SINGLE, TPGroup, check_tp, split_range
from ...kernels.segments import visible_entries
from ..protocol import StepBatch
from .attention import FastAttention, StepContext, make_rope, window_slots
from .attention_v4 import V4Attention
from .attention_v41 import CSA2Attention
from .cache import FastCache, fast_layout, state_ring_size
from .compress import Segments
from .dspark import DraftBatch, FastDrafter
from .engram import FastEngram
from .heads import Embedding, LMHead
from .layers import RMSNorm
from .block import FastBlock
from .mhc import HcHead, collapse_norm, expand
from .moe import FastMoE


class FastModel(nn.Module):
    """DeepSeek-V4.1 / V4 causal LM over the paged cache (this rank's shard under ``tp``). Weights are set by
    :func:`.loader.load_fast`; :meth:`init_cache` allocates the cache before the first :meth:`forward`.

    ``primes``: per Engram layer, the bucket size of each hash column (the row hasher's). Raises ValueError when
    ``cfg`` cannot be split over ``tp`` or Engram layers lack their primes.
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                 primes: dict[int, list[int]] | None = None, tp: TPGroup | None = None, lookahead_tokens: int = 0,
                 draft_sharded: bool = True):
        super().__init__()
        self.tp = tp or SINGLE
        check_tp(cfg, self.tp.world_size)
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        d = cfg.hidden_size
        i0, i1 = split_range(cfg.moe_intermediate_size, self.tp.world_size, self.tp.rank)
        self.embed = Embedding(cfg.vocab_size, d, self.tp)
        self.layers = nn.ModuleList()
        for plan in cfg.plan:
            if cfg.is_v41:
                attn = CSA2Attention(cfg, plan, self.tp) if plan.ratio > 0 else \
                    FastAttention(cfg, plan, q_head_norm=False, tp=self.tp)
            else:
                attn = V4Attention(cfg, plan, self.tp)
            ffn = FastMoE(d, i1 - i0, cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_shared_experts,
                          cfg.swiglu_limit, gate_temp=cfg.gate_temp, norm_topk_prob=cfg.norm_topk_prob,
                          scaling=cfg.routed_scaling_factor, hash_vocab=cfg.vocab_size if plan.hash_moe else 0,
                          bias_vl=cfg.is_v41, always_renorm=not cfg.is_v41, tp=self.tp)
            block = FastBlock(cfg, attn, ffn, delayed=cfg.is_v41)
            if plan.engram:
                if not primes or plan.layer_id not in primes:
                    raise ValueError("engram_layer_ids is set but the Engram hash primes were not given")
                block.engram = FastEngram(cfg, primes[plan.layer_id], self.tp)
            self.layers.append(block)
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.head = LMHead(d, cfg.vocab_size, self.tp, self.device)
        if not cfg.is_v41:
            self.hc_head = HcHead(cfg)
        self.ropes = {key: make_rope(cfg, key, self.device, dtype) for key in ("base", "compress")}
        self.segment_ratios = sorted({p.ratio for p in cfg.plan if p.ratio > 1 and p.owns_compressor})
        self.cache: FastCache | None = None
        self.lookahead_tokens = lookahead_tokens
        self.kv_cache_dtype = "auto"  # "fp8": the caches store the deployed records (set before init_cache)
        self.index_scratch_bytes = 1 << 30  # EngineArgs.index_scratch_bytes: the indexer's row chunks (attention.py)
        draft_tp = self.tp if draft_sharded else SINGLE  # replicated stages: no collective inside them
        self.drafter = FastDrafter(cfg, draft_tp, self.ropes["base"], self.head) if lookahead_tokens else None

    def fuse_siblings(self) -> int:
        """Stack the weights of every module's sibling projections (``siblings``: :class:`.fused.SiblingLinears`)
        after loading, so each group runs as one GEMM; returns how many groups were stacked."""
        return sum(g.fuse() for m in self.modules() for g in getattr(m, "siblings", {}).values())

    def set_numerics(self, numerics: str) -> None:
        """``exact`` or ``deployed`` (docs/numerics.md §4): the activation half of deployed numerics, i.e. FP8
        quantize-dequantize of the inputs of the FP8 GEMMs and the reference's bf16 casts (the cache half is
        ``kv_cache_dtype = "fp8"``). Raises ValueError for another value."""
        if numerics not in ("exact", "deployed"):
            raise ValueError(f"numerics must be 'exact' or 'deployed', got {numerics!r}")
        for m in self.modules():
            if hasattr(m, "deployed"):
                m.deployed = numerics == "deployed"

    # -- cache ---------------------------------------------------------------------------------------------------
    def cache_layout(self, block_tokens: int | None = None):
        return fast_layout(self.cfg, block_tokens, self.lookahead_tokens, self.kv_cache_dtype)

    def init_cache(self, num_blocks: int, num_state_rows: int, block_tokens: int) -> None:
        """Allocate the paged cache on the model's device (one padding block and state row beyond the given
        counts). Raises torch's OutOfMemoryError when it does not fit."""
        self.cache = FastCache(self.cache_layout(block_tokens), num_blocks, num_state_rows, self.dtype, self.device)

    # -- forward -------------------------------------------------------------------------------------------------
    def prepare(self, batch: StepBatch) -> StepContext:
        """Everything the layers share in this step, computed once on the device."""
        cache = self.cache
        rope = {key: r.cos_sin(batch.positions) for key, r in self.ropes.items()}
        ratios = sorted({p.ratio for p in self.cfg.plan if p.ratio > 0})
        return StepContext(
            batch=batch, cache=cache, ropes=self.ropes, rope=rope,
            window_slots=window_slots(batch, cache, self.cfg.sliding_window),
            segments={r: Segments.build(batch, r, cache.dummy_state_row, self._ring(r)) for r in self.segment_ratios},
            n_max={r: batch.max_seq_len // r for r in ratios},
            n_visible=visible_entries(batch.positions, ratios), index_scratch_bytes=self.index_scratch_bytes)

    def _ring(self, ratio: int) -> int:
        """Ring slots of the state rows of ``ratio`` (0 = plain rows): V4.1 ratio 2 when speculating."""
        return state_ring_size(self.lookahead_tokens) if self.lookahead_tokens and ratio == 2 else 0

    @torch.no_grad()
    def forward(self, batch: StepBatch, return_aux: bool = False):
        """Logits [N, vocab] (float32; float64 for a float64 model) of ``batch.logits_rows``; with ``return_aux``
        also the DSpark aux states [T, n_targets·D] (mean of the copies entering each target layer) or None.
        With the drafter (``lookahead_tokens`` > 0) every token's drafter context rows are written too
        (:meth:`.dspark.FastDrafter.write_context`)."""
        cfg = self.cfg
        ctx = self.prepare(batch)
        h, pre_mix = self.embed.hc_copies(batch.token_ids, cfg.hc_mult,
                                          torch.promote_types(self.dtype, torch.float32))
        aux = []
        for lid, copies in batch.engram_copies.items():  # offload: slot fills run beside the layers before them
            self.layers[lid].engram.start_fill(copies)  # layer ids index cfg.plan
        pending = None  # a layer's last expansion, joined with the next layer's first seam (FastBlock.step)
        for plan, layer in zip(cfg.plan, self.layers):
            if pending is not None and (plan.engram or plan.dspark_target):
                h, pending = expand(h, *pending), None
            if plan.engram:
                h = layer.engram(h, batch.engram_rows[plan.layer_id])
            if plan.dspark_target:
                aux.append(h.mean(dim=1))
            h, pre_mix, pending = layer.step(h, pre_mix, batch.token_ids, ctx, pending)
        if pending is not None:
            h = expand(h, *pending)
        if self.drafter is not None:
            self.drafter.write_context(torch.cat(aux, dim=-1), *ctx.rope["base"], self.cache,
                                       batch.slot_mapping["dspark"])
        sel = batch.logits_rows
        x = collapse_norm(h, pre_mix, self.norm, sel) if cfg.is_v41 else self.hc_head(h[sel], self.norm)
        logits = self.head(x)
        if return_aux:
            return logits, (torch.cat(aux, dim=-1) if aux else None)
        return logits

    @torch.no_grad()
    def draft(self, batch: DraftBatch) -> tuple[Tensor, Tensor]:
        """One DSpark draft pass (:meth:`.dspark.FastDrafter.forward`): base logits [B·K, V] float32 and the
        confidence head's hidden input [B·K, D]. Raises
        RuntimeError when the model was built without its drafter."""
        if self.drafter is None:
            raise RuntimeError("the fast model was loaded without its DSpark drafter (lookahead_tokens = 0)")
        return self.drafter(batch, self.embed, self.cache)
