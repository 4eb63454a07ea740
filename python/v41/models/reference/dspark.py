"""DSpark drafter of V4.1 (``mtp.0..S-1``): context KV from the target's aux streams, anchor + noise
block with non-causal in-block attention, Markov-corrected heads and a confidence logit
(docs/model.md §3.9)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ...config import LayerPlan, ModelConfig
from ...distributed.group import TPGroup
from .attention import Attention, ChunkContext
from .block import Block
from .moe import MoE
from .ops import Linear, RMSNorm, sink_attention, window_visible
from .state import append_rows


class DSparkAttention(Attention):
    """SWA attention of a draft stage (theta ``rope_theta``, no YaRN). Its only cache is the stage's ring
    of context KV written from ``main_x``; block queries see the last ``sliding_window`` context rows
    up to the anchor's predecessor plus every block token (non-causal). Heads shard under ``tp`` like the
    target's; the context KV ring is replicated."""

    def __init__(self, cfg: ModelConfig, plan: LayerPlan, stage: int, tp: TPGroup | None = None):
        super().__init__(cfg, plan, q_head_norm=False, tp=tp)
        self.stage = stage

    def forward(self, x: torch.Tensor, ctx: ChunkContext) -> torch.Tensor:
        q, _ = self.project_q(x, ctx.pos)
        block_kv = self.window_kv(x, ctx.pos)
        ring = ctx.cache.dspark_kv[self.stage]
        p_last = int(ctx.pos[0]) - 1
        ring_pos = torch.arange(ring.shape[0], device=x.device)
        ring_vis = window_visible(torch.full_like(ctx.pos, p_last), ring_pos, self.cfg.sliding_window)
        keys = torch.cat([ring, block_kv], dim=0)
        visible = torch.cat([ring_vis, torch.ones(x.shape[0], x.shape[0], dtype=torch.bool,
                                                  device=x.device)], dim=1)
        o = sink_attention(q, keys, visible, self.attn_sink, self.head_dim ** -0.5)
        return self.output(o, ctx.pos)


class MarkovHead(nn.Module):
    """``embed.weight [V, rank]``, ``head.weight [V, rank]``: ``logits_i += head · embed[out_i]``."""

    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.embed = Linear(rank, vocab)
        self.head = Linear(rank, vocab)


class ConfidenceHead(nn.Module):
    """``proj [1, D + rank]`` (bias-free): a raw FP32 logit, no sigmoid (§3.9)."""

    def __init__(self, dim: int):
        super().__init__()
        self.proj = Linear(dim, 1)


class DSparkStage(Block):
    """One draft stage: a full delayed-mHC block with SWA attention and a small MoE. Stage 0 also owns
    ``main_proj [D, n_targets·D]`` FP8 and ``main_norm``; the last stage owns ``norm``, ``markov_head`` and
    ``confidence_head``. Under ``tp`` attention heads and experts shard like a backbone layer's; ``main_*``,
    ``norm`` and both heads are replicated."""

    def __init__(self, cfg: ModelConfig, stage: int, tp: TPGroup | None = None):
        layer_id = cfg.num_hidden_layers + stage
        plan = LayerPlan(layer_id=layer_id, ratio=0, attn_type="swa")
        attn = DSparkAttention(cfg, plan, stage, tp)
        ffn = MoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.dspark_n_routed_experts,
                  cfg.dspark_num_experts_per_tok, cfg.n_shared_experts, cfg.swiglu_limit,
                  gate_temp=cfg.gate_temp, norm_topk_prob=cfg.norm_topk_prob,
                  scaling=cfg.routed_scaling_factor, bias_vl=True, tp=tp)
        super().__init__(cfg, attn, ffn, delayed=True)
        d = cfg.hidden_size
        if stage == 0:
            self.main_proj = Linear(len(cfg.dspark_target_layer_ids) * d, d, fp8_input=True)
            self.main_norm = RMSNorm(d, cfg.rms_norm_eps)
        if stage == cfg.num_nextn_predict_layers - 1:
            self.norm = RMSNorm(d, cfg.rms_norm_eps)
            self.markov_head = MarkovHead(cfg.vocab_size, cfg.dspark_markov_rank)
            self.confidence_head = ConfidenceHead(d + cfg.dspark_markov_rank)


@dataclass
class DraftBlock:
    """Result of one draft: ``tokens [K]`` int64 (out_1..out_K), ``logits [K, V]`` Markov-corrected,
    ``confidence [K]`` raw logits, ``positions [K]`` the positions the drafts are proposed for."""

    tokens: torch.Tensor
    logits: torch.Tensor
    confidence: torch.Tensor
    positions: torch.Tensor


def write_context(stages: nn.ModuleList, aux: torch.Tensor, pos: torch.Tensor, cache) -> None:
    """Seed every stage's ring with ``kv_norm(wkv·main_x)`` at the target positions (§3.9 "Context KV").

    aux: [T, n_targets·D] concatenated mean streams entering the target layers; pos: [T]."""
    main_x = stages[0].main_norm(stages[0].main_proj(aux))
    while len(cache.dspark_kv) < len(stages):
        cache.dspark_kv.append(None)
    for s, stage in enumerate(stages):
        cache.dspark_kv[s] = append_rows(cache.dspark_kv[s], stage.attn.window_kv(main_x, pos))


def sample_logits(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    """Argmax at temperature 0, else Gumbel-max on ``softmax(logits / temperature)`` (the reference rule)."""
    if temperature <= 0:
        return int(torch.argmax(logits))
    u = torch.rand(logits.shape, generator=generator, dtype=torch.float64, device=logits.device)
    gumbel = -torch.log(-torch.log(u.clamp(min=1e-300)))
    return int(torch.argmax(logits.double() / temperature + gumbel))
