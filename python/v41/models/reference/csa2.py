"""V4.1 "CSA2" attention: compressed KV shared from kv-source layers, gated ratio-2 or plain ratio-1
compressor, index keys from latents, two-level (candidate-block) indexer (docs/model.md §3.6, §3.7).
"""

from __future__ import annotations

import torch
from torch import nn

from ... import quant
from ...config import LayerPlan, ModelConfig
from ...distributed.group import TPGroup
from .attention import Attention, ChunkContext, index_scores, select_topk, selection_mask
from .ops import Linear, RMSNorm, stable_topk
from .state import LayerState, append_rows


class Compressor(nn.Module):
    """KV-source compressor. ``wkv [hd, D]`` (+ ``wgate [hd, D]`` at ratio 2), ``norm [hd]``, all BF16 on disk.

    Ratio 2: ``a = wkv·x``, ``b = wgate·x`` in ≥ FP32; entry j pools positions 2j, 2j+1 with a per-channel
    softmax over the two gates; the pooled sum is cast to BF16 (``deployed`` only) and RMS-normalized.
    A chunk ending on an even position leaves that token's ``(a, b)`` pending in the request state.
    Ratio 1: ``latent_t = norm(wkv·x_t)``.
    """

    def __init__(self, cfg: ModelConfig, ratio: int):
        super().__init__()
        self.ratio = ratio
        self.wkv = Linear(cfg.hidden_size, cfg.head_dim)
        if ratio == 2:
            self.wgate = Linear(cfg.hidden_size, cfg.head_dim)
        self.norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.deployed = False

    def forward(self, x: torch.Tensor, st: LayerState) -> torch.Tensor:
        """x: [T, D] this chunk → pre-RoPE latents [n_new, hd] of the entries closed by this chunk."""
        if self.ratio == 1:
            return self.norm(self.wkv(x))
        ctype = torch.promote_types(x.dtype, torch.float32)
        a = self.wkv(x.to(ctype)).to(ctype)
        b = self.wgate(x.to(ctype)).to(ctype)
        pend = st.carry.pop("pending", None)
        if pend is not None:
            a, b = torch.cat([pend[0], a]), torch.cat([pend[1], b])
        n_full = a.shape[0] // 2
        if a.shape[0] % 2:
            st.carry["pending"] = (a[-1:], b[-1:])
        d = a.shape[-1]
        a2, b2 = a[: 2 * n_full].view(n_full, 2, d), b[: 2 * n_full].view(n_full, 2, d)
        pooled = (torch.softmax(b2, dim=1) * a2).sum(dim=1)
        if self.deployed:
            pooled = pooled.to(torch.bfloat16)
        return self.norm(pooled.to(x.dtype))


class Indexer(nn.Module):
    """Lightning indexer of an index-source layer: ``wq_b [Hi·di, q_lora]`` FP8, ``weights_proj [Hi, D]`` BF16;
    at KV sources also ``wk [di, hd]`` and ``k_norm [di]`` producing the shared index keys."""

    def __init__(self, cfg: ModelConfig, owns_keys: bool):
        super().__init__()
        hi, di = cfg.index_n_heads, cfg.index_head_dim
        self.wq_b = Linear(cfg.q_lora_rank, hi * di, fp8_input=True)
        self.weights_proj = Linear(cfg.hidden_size, hi)
        if owns_keys:
            self.wk = Linear(cfg.head_dim, di)
            self.k_norm = RMSNorm(di, cfg.rms_norm_eps)
        self.n_heads, self.head_dim = hi, di


class CSA2Attention(Attention):
    """A V4.1 layer with ``compress_ratio > 0`` (§3.5–§3.7). Sources compress and write entries before any
    scoring reads them; index sources publish their top-k list; consumers reuse their index source's list
    and their kv source's compressed cache. Under ``tp`` only the heads shard; compressor and indexer are
    replicated."""

    def __init__(self, cfg: ModelConfig, plan: LayerPlan, tp: TPGroup | None = None):
        super().__init__(cfg, plan, q_head_norm=False, tp=tp)
        if plan.owns_compressor:
            self.compressor = Compressor(cfg, plan.ratio)
        if plan.is_index_source:
            self.indexer = Indexer(cfg, plan.owns_index_keys)

    def encode_entries(self, latent: torch.Tensor, entry_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-RoPE latents [n, hd] of entries ``entry_ids`` [n] → (index keys [n, di], compressed KV [n, hd]),
        both RoPE'd at position ``j·r`` and round-tripped through their cache formats when deployed (§3.6)."""
        pos = entry_ids * self.plan.ratio
        k = self.rope(self.indexer.k_norm(self.indexer.wk(latent)), pos)  # from the pre-RoPE latent
        c = self.rope(latent, pos)
        if self.deployed:
            k = quant.mxfp4_qdq(k, 32)
            c = quant.fp4_e4m3_qdq(c, 16)
        return k, c

    def index_query(self, x: torch.Tensor, qr: torch.Tensor, pos: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Index queries [T, Hi, di] (RoPE'd at ``pos``) and head weights [T, Hi] (scaled, §3.7 steps 2–3)."""
        ix = self.indexer
        q = self.rope(ix.wq_b(qr).view(x.shape[0], ix.n_heads, ix.head_dim), pos)
        if self.deployed:
            q = quant.mxfp4_qdq(q, 32)
        return q, ix.weights_proj(x) * (ix.head_dim ** -0.5 * ix.n_heads ** -0.5)

    def select(self, scores: torch.Tensor, n_t: torch.Tensor, cand_mask: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """§3.7 steps 4–7 for one request's queries: scores [T, N] over its cached entries, n_t [T] visible
        counts, the candidate mask published earlier in this forward (filtered sources). Returns (top-k entry
        ids [T, min(index_topk, N)] ascending, −1 = none; the candidate mask this layer publishes or the one
        it was given)."""
        cfg = self.cfg
        n = scores.shape[1]
        visible = torch.arange(n, device=scores.device)[None, :] < n_t[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        if self.plan.is_candidate_source:
            cand_mask = candidate_mask(scores, n_t, cfg.candidate_block_size, cfg.candidate_topk_blocks)
        elif self.plan.uses_candidate_filter:
            scores = scores.masked_fill(~cand_mask[:, :n], float("-inf"))
        return select_topk(scores, cfg.index_topk), cand_mask

    def compressed(self, x, qr, ctx):
        if self.plan.owns_compressor:
            st = ctx.cache.layer(self.plan.layer_id)
            n_old = 0 if st.ckv is None else st.ckv.shape[0]
            latent = self.compressor(x, st)
            k, c = self.encode_entries(latent, torch.arange(latent.shape[0], device=x.device) + n_old)
            st.idx_k, st.ckv = append_rows(st.idx_k, k), append_rows(st.ckv, c)
        src = ctx.cache.layer(self.plan.kv_src)
        if src.ckv is None or src.ckv.shape[0] == 0:
            ckv = x.new_zeros(0, self.head_dim)
            return ckv, torch.zeros(x.shape[0], 0, dtype=torch.bool, device=x.device)
        if self.plan.is_index_source:
            q, w = self.index_query(x, qr, ctx.pos)
            n_t = (ctx.pos + 1) // self.plan.ratio
            ctx.topk[self.plan.layer_id], ctx.cand_mask = self.select(index_scores(q, src.idx_k, w), n_t,
                                                                      ctx.cand_mask)
        topk = ctx.topk[self.plan.idx_src]
        return src.ckv, selection_mask(topk, src.ckv.shape[0])


def candidate_mask(scores: torch.Tensor, n_t: torch.Tensor, block: int, topk_blocks: int) -> torch.Tensor:
    """Level-1 candidate positions (§3.7 step 5): scores [T, N] (−inf where not visible), n_t [T].

    Block score = max over its ``block`` positions (partial last block padded with −inf); the block holding
    the newest visible entry is forced to +inf; keep the top ``min(topk_blocks, ceil(N/block))`` blocks
    whose score is not −inf (ties to the lower block); expand to a [T, N] bool mask.
    """
    t, n = scores.shape
    n_blocks = -(-n // block)
    padded = torch.full((t, n_blocks * block), float("-inf"), dtype=scores.dtype, device=scores.device)
    padded[:, :n] = scores
    bscore = padded.view(t, n_blocks, block).amax(dim=-1)
    newest = ((n_t - 1) // block).clamp(min=0)
    has_any = n_t > 0
    bscore[has_any, newest[has_any]] = float("inf")
    k = min(topk_blocks, n_blocks)
    keep = stable_topk(bscore, k)
    keep_ok = ~torch.isneginf(bscore.gather(1, keep))
    bmask = torch.zeros(t, n_blocks, dtype=torch.bool, device=scores.device)
    bmask.scatter_(1, keep, keep_ok)
    return bmask.repeat_interleave(block, dim=1)[:, :n]
