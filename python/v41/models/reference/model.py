"""The reference model: a dense, readable forward of DeepSeek-V4 and DeepSeek-V4.1, the test oracle
(docs/numerics.md §4; docs/model.md §3, §4).

One code path serves the whole-sequence call and the incremental path: :meth:`Transformer.forward_chunk`
processes a chunk of new tokens of one request against its :class:`RequestCache`; a whole sequence is one
chunk on an empty cache.

Tensor parallelism: built with a :class:`v41.distributed.group.TPGroup` of W ranks, every rank holds its shard
(:mod:`.sharding`) and every rank runs the same calls with the same inputs; the modules' collectives keep the
residual stream, caches and logits replicated, so each rank returns the full, bitwise identical logits.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ...config import LayerPlan, ModelConfig
from ...distributed.group import SINGLE, TPGroup, check_tp
from ..engram_hash import EngramHasher
from .attention import Attention, ChunkContext
from .block import Block
from .compress_v4 import V4Attention
from .csa2 import CSA2Attention
from .dspark import DraftBlock, DSparkStage, sample_logits, write_context
from .engram import Engram
from .moe import MoE
from .ops import NUMERICS, RMSNorm, hc_collapse, rms_norm
from .parallel import VocabParallelEmbedding, VocabParallelHead
from .state import RequestCache


def make_attention(cfg: ModelConfig, plan: LayerPlan, tp: TPGroup | None = None) -> Attention:
    """The attention module of a backbone layer: V4.1 SWA or CSA2, or V4 SWA/CSA/HCA."""
    if cfg.is_v41:
        return CSA2Attention(cfg, plan, tp) if plan.ratio > 0 else Attention(cfg, plan, q_head_norm=False, tp=tp)
    return V4Attention(cfg, plan, tp)


class Transformer(nn.Module):
    """DeepSeek-V4 / V4.1 causal LM. Parameter names equal the checkpoint's bare tensor names
    (``embed.weight``, ``layers.L.attn.wq_a.weight``, ``mtp.S.*``, ...), minus the ``.scale`` tensors that
    quantized weights carry on disk (weights are dequantized at load).

    ``hasher``: the Engram row hasher (required when the config has Engram layers). ``tp``: the tensor-parallel
    group (None = single rank); parameters then hold this rank's shard, named as the full tensors
    (:func:`.sharding.shard_plan` gives the slices). Raises ValueError when ``cfg`` cannot be split over
    ``tp.world_size`` ranks (:func:`v41.distributed.group.check_tp`) or Engram layers lack a hasher.
    """

    def __init__(self, cfg: ModelConfig, hasher: EngramHasher | None = None, tp: TPGroup | None = None):
        super().__init__()
        self.tp = tp or SINGLE
        check_tp(cfg, self.tp.world_size)
        self.cfg, self.hasher = cfg, hasher
        d = cfg.hidden_size
        self.embed = VocabParallelEmbedding(cfg.vocab_size, d, self.tp)
        self.layers = nn.ModuleList()
        for plan in cfg.plan:
            ffn = MoE(d, cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.num_experts_per_tok,
                      cfg.n_shared_experts, cfg.swiglu_limit, gate_temp=cfg.gate_temp,
                      norm_topk_prob=cfg.norm_topk_prob, scaling=cfg.routed_scaling_factor,
                      hash_vocab=cfg.vocab_size if plan.hash_moe else 0, bias_vl=cfg.is_v41,
                      always_renorm=not cfg.is_v41, tp=self.tp)
            block = Block(cfg, make_attention(cfg, plan, self.tp), ffn, delayed=cfg.is_v41)
            if plan.engram:
                if hasher is None:
                    raise ValueError("engram_layer_ids is set but no EngramHasher (tokenizer) was given")
                block.engram = Engram(cfg, hasher.primes[plan.layer_id], self.tp)
            self.layers.append(block)
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.head = VocabParallelHead(d, cfg.vocab_size, self.tp)
        if not cfg.is_v41:  # V4's learned final collapse (§4)
            self.hc_head_fn = nn.Parameter(torch.zeros(cfg.hc_mult, cfg.hc_mult * d), requires_grad=False)
            self.hc_head_base = nn.Parameter(torch.zeros(cfg.hc_mult), requires_grad=False)
            self.hc_head_scale = nn.Parameter(torch.ones(1), requires_grad=False)
        self.mtp = nn.ModuleList(DSparkStage(cfg, s, self.tp) for s in range(cfg.num_nextn_predict_layers)) \
            if cfg.has_dspark else None
        self.numerics = "exact"

    # -- configuration -----------------------------------------------------------------------------------
    def set_numerics(self, numerics: str) -> "Transformer":
        """``exact`` (activations and caches in the compute dtype) or ``deployed`` (FP8/FP4 quantize-
        dequantize points of the DeepSeek reference, §2). Raises ValueError on any other value."""
        if numerics not in NUMERICS:
            raise ValueError(f"numerics must be one of {NUMERICS}, got {numerics!r}")
        self.numerics = numerics
        for m in self.modules():
            if hasattr(m, "deployed"):
                m.deployed = numerics == "deployed"
        return self

    def new_cache(self) -> RequestCache:
        """An empty per-request cache for :meth:`forward_chunk`."""
        return RequestCache()

    # -- forward ---------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Whole-sequence logits. input_ids: [B, T] int64 → [B, T, vocab] in the compute dtype."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        return torch.stack([self.forward_chunk(row, self.new_cache()) for row in input_ids])

    @torch.no_grad()
    def forward_chunk(self, token_ids: torch.Tensor, cache: RequestCache, return_aux: bool = False):
        """Process new tokens of one request at positions ``cache.num_tokens ...`` and update ``cache``.

        token_ids: [T] int64, T ≥ 1. Returns logits [T, vocab]; with ``return_aux`` also the DSpark aux
        hidden states [T, n_targets·D] (mean of the copies entering each ``dspark_target_layer_ids`` layer,
        after that layer's Engram; V4.1 only). Raises ValueError on empty input or ids outside the vocab.
        """
        cfg = self.cfg
        token_ids = token_ids.to(self.embed.weight.device).long()
        if token_ids.dim() != 1 or token_ids.numel() == 0:
            raise ValueError("token_ids must be a non-empty 1-D tensor")
        if int(token_ids.min()) < 0 or int(token_ids.max()) >= cfg.vocab_size:
            raise ValueError(f"token ids must lie in [0, {cfg.vocab_size})")
        t = token_ids.numel()
        pos = torch.arange(cache.num_tokens, cache.num_tokens + t, device=token_ids.device)
        ctx = ChunkContext(pos=pos, token_ids=token_ids, cache=cache)
        h = self.embed(token_ids).unsqueeze(1).repeat(1, cfg.hc_mult, 1)
        pre_mix = torch.zeros(t, cfg.hc_mult, dtype=h.dtype, device=h.device)
        pre_mix[:, 0] = 1
        rows = self._engram_rows(token_ids, cache)
        aux = []
        for plan, layer in zip(cfg.plan, self.layers):
            if plan.engram:
                h = layer.engram(h, rows[plan.layer_id])
            if plan.dspark_target:
                aux.append(h.mean(dim=1))
            h, pre_mix = layer(h, pre_mix, token_ids, lambda x, a=layer.attn: a(x, ctx))
        x = hc_collapse(h, pre_mix) if cfg.is_v41 else self._hc_head(h)
        logits = self.head(self.norm(x))
        cache.num_tokens += t
        cache.token_ids.extend(token_ids.tolist())
        aux_t = torch.cat(aux, dim=-1) if aux else None
        if self.mtp is not None and aux_t is not None:
            write_context(self.mtp, aux_t, pos, cache)
        return (logits, aux_t) if return_aux else logits

    def _hc_head(self, h: torch.Tensor) -> torch.Tensor:
        """V4 final collapse ``pre = sigmoid(fn·rms(flatten H)·scale + base) + eps`` (§4)."""
        flat = rms_norm(h.flatten(1).to(torch.promote_types(h.dtype, torch.float32)), self.cfg.rms_norm_eps)
        pre = torch.sigmoid(flat @ self.hc_head_fn.to(flat.dtype).T * self.hc_head_scale + self.hc_head_base)
        return hc_collapse(h, pre + self.cfg.hc_eps)

    def _engram_rows(self, token_ids: torch.Tensor, cache: RequestCache) -> dict[int, torch.Tensor]:
        if not self.cfg.engram_layer_ids:
            return {}
        hist = cache.token_ids[-(self.cfg.engram_max_ngram_size - 1):] if cache.token_ids else []
        ids = token_ids.cpu().numpy().astype(np.int64)
        return {lid: torch.from_numpy(self.hasher.hash_ids(lid, ids, history=hist)).to(token_ids.device)
                for lid in self.cfg.engram_layer_ids}

    # -- DSpark ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def draft(self, cache: RequestCache, anchor: int, temperature: float = 0.0,
              generator: torch.Generator | None = None) -> DraftBlock:
        """Run one DSpark draft block after the last verified position ``P = cache.num_tokens − 1``.

        anchor: the token the target sampled for position P+1. Inputs are ``[anchor, noise×(K−1)]`` at
        positions P+1..P+K; drafts ``out_1..out_K`` follow the Markov-corrected logits (argmax at
        temperature 0, Gumbel-max otherwise). Does not modify ``cache``. Under TP every rank calls it with the
        same arguments (and, when sampling, a generator in the same state): the logits are bitwise identical on
        every rank, so the drafts are too. Raises RuntimeError without DSpark stages or before any verified
        position, ValueError for an anchor outside the vocabulary.
        """
        cfg = self.cfg
        if self.mtp is None:
            raise RuntimeError("this checkpoint has no DSpark stages")
        if cache.num_tokens == 0 or not cache.dspark_kv:
            raise RuntimeError("draft needs at least one verified position in the cache")
        if not 0 <= anchor < cfg.vocab_size:
            raise ValueError(f"anchor token {anchor} outside [0, {cfg.vocab_size})")
        k = cfg.dspark_block_size
        dev = self.embed.weight.device
        ids = torch.tensor([anchor] + [cfg.dspark_noise_token_id] * (k - 1), device=dev)
        pos = torch.arange(cache.num_tokens, cache.num_tokens + k, device=dev)
        ctx = ChunkContext(pos=pos, token_ids=ids, cache=cache)
        h = self.embed(ids).unsqueeze(1).repeat(1, cfg.hc_mult, 1)
        pre_mix = torch.zeros(k, cfg.hc_mult, dtype=h.dtype, device=dev)
        pre_mix[:, 0] = 1
        for stage in self.mtp:
            h, pre_mix = stage(h, pre_mix, ids, lambda x, a=stage.attn: a(x, ctx))
        last = self.mtp[-1]
        y = hc_collapse(h, pre_mix)
        base = self.head(last.norm(y))
        out, tokens, logits, conf = anchor, [], [], []
        for i in range(k):
            e = last.markov_head.embed.weight[out]
            li = base[i] + last.markov_head.head(e)
            conf.append(last.confidence_head.proj(torch.cat([y[i], e]).unsqueeze(0))[0, 0])
            out = sample_logits(li, temperature, generator)
            tokens.append(out)
            logits.append(li)
        return DraftBlock(tokens=torch.tensor(tokens), logits=torch.stack(logits),
                          confidence=torch.stack(conf), positions=pos)
