"""V4 compressed attention: HCA (non-overlapping windows, attend every visible entry) and CSA (overlapping
windows, lightning indexer with its own compressor) (docs/model.md §4; transformers
``DeepseekV4HCACompressor`` / ``DeepseekV4CSACompressor`` / ``DeepseekV4Indexer``).
"""

from __future__ import annotations

import torch
from torch import nn

from ...config import LayerPlan, ModelConfig
from ...distributed.group import TPGroup
from .attention import Attention, ChunkContext, index_scores, select_topk, selection_mask
from .ops import Linear, RMSNorm, Rope
from .state import append_rows


class WindowCompressor(nn.Module):
    """Gated pooling over windows of ``ratio`` tokens with a learned position bias ``ape``.

    ``wkv, wgate [c·width, D]``, ``ape [ratio, c·width]``, ``norm [width]`` with c = 2 when ``overlap``
    (CSA: entry w pools the A half of window w−1 and the B half of window w over 2·ratio slots) else 1.
    Returns pre-RoPE entries; open windows (``buf``) and the overlap half (``overlap``) carry across chunks
    in ``carry``; ``closed_a`` is left holding the A halves of the windows closed by this call.
    """

    def __init__(self, dim: int, width: int, ratio: int, overlap: bool, eps: float):
        super().__init__()
        c = 2 if overlap else 1
        self.wkv = Linear(dim, c * width)
        self.wgate = Linear(dim, c * width)
        self.ape = nn.Parameter(torch.zeros(ratio, c * width), requires_grad=False)
        self.norm = RMSNorm(width, eps)
        self.width, self.ratio, self.overlap = width, ratio, overlap

    def forward(self, x: torch.Tensor, carry: dict) -> torch.Tensor:
        """x: [T, D] → entries [n_closed, width] for the windows this chunk closes."""
        kv, gate = self.wkv(x), self.wgate(x)
        if "buf" in carry:
            kv, gate = torch.cat([carry["buf"][0], kv]), torch.cat([carry["buf"][1], gate])
        r, d = self.ratio, self.width
        usable = kv.shape[0] // r * r
        carry["buf"] = (kv[usable:], gate[usable:])
        n_w = usable // r
        if n_w == 0:
            return x.new_zeros(0, d)
        ckv = kv[:usable].view(n_w, r, -1)
        cg = gate[:usable].view(n_w, r, -1) + self.ape.to(x.dtype)
        if self.overlap:
            slots_kv = ckv.new_zeros(n_w, 2 * r, d)
            slots_g = cg.new_full((n_w, 2 * r, d), float("-inf"))
            slots_kv[:, r:], slots_g[:, r:] = ckv[..., d:], cg[..., d:]
            slots_kv[1:, :r], slots_g[1:, :r] = ckv[:-1, :, :d], cg[:-1, :, :d]
            if "overlap" in carry:
                slots_kv[0, :r], slots_g[0, :r] = carry["overlap"]
            carry["overlap"] = (ckv[-1, :, :d], cg[-1, :, :d])
            carry["closed_a"] = (ckv[:, :, :d], cg[:, :, :d])  # every closed window's A half [n_w, r, d]
            ckv, cg = slots_kv, slots_g
        pooled = (torch.softmax(cg, dim=1) * ckv).sum(dim=1)
        return self.norm(pooled)


class IndexerV4(nn.Module):
    """CSA indexer: own overlapping compressor at ``index_head_dim``, ``wq_b [Hi·di, q_lora]`` FP8,
    ``weights_proj [Hi, D]``."""

    def __init__(self, cfg: ModelConfig, ratio: int):
        super().__init__()
        hi, di = cfg.index_n_heads, cfg.index_head_dim
        self.compressor = WindowCompressor(cfg.hidden_size, di, ratio, True, cfg.rms_norm_eps)
        self.wq_b = Linear(cfg.q_lora_rank, hi * di, fp8_input=True)
        self.weights_proj = Linear(cfg.hidden_size, hi)
        self.n_heads, self.head_dim = hi, di


class V4Attention(Attention):
    """A V4 layer: sliding window plus, for ratio > 0, its own compressor (HCA) and indexer (CSA). Under ``tp``
    only the heads shard; compressors and indexer are replicated."""

    def __init__(self, cfg: ModelConfig, plan: LayerPlan, tp: TPGroup | None = None):
        super().__init__(cfg, plan, q_head_norm=True, tp=tp)
        if plan.ratio > 0:
            csa = plan.attn_type == "csa"
            self.compressor = WindowCompressor(cfg.hidden_size, cfg.head_dim, plan.ratio, csa, cfg.rms_norm_eps)
            if csa:
                self.indexer = IndexerV4(cfg, plan.ratio)

    def encode_entries(self, entries: torch.Tensor, entry_ids: torch.Tensor) -> torch.Tensor:
        """Pre-RoPE entries [n, hd] → RoPE at ``j·r`` and the cache format (deployed) → [n, hd]."""
        return self.store_window(self.rope(entries, entry_ids * self.plan.ratio))

    def encode_index_keys(self, keys: torch.Tensor, entry_ids: torch.Tensor) -> torch.Tensor:
        """Pre-RoPE index keys [n, di] → RoPE at ``j·r`` → [n, di]."""
        return self.rope(keys, entry_ids * self.plan.ratio)

    def index_query(self, x: torch.Tensor, qr: torch.Tensor, pos: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Index queries [T, Hi, di] RoPE'd at ``pos`` and scaled head weights [T, Hi] (§4 "CSA indexer")."""
        ix = self.indexer
        q = self.rope(ix.wq_b(qr).view(x.shape[0], ix.n_heads, ix.head_dim), pos)
        return q, ix.weights_proj(x) * (ix.head_dim ** -0.5 * ix.n_heads ** -0.5)

    def compressed(self, x: torch.Tensor, qr: torch.Tensor, ctx: ChunkContext):
        if self.plan.ratio == 0:
            return None
        st = ctx.cache.layer(self.plan.layer_id)
        r = self.plan.ratio
        entries = self.compressor(x, st.carry.setdefault("kv", {}))
        n_old = 0 if st.ckv is None else st.ckv.shape[0]
        ids = torch.arange(entries.shape[0], device=x.device) + n_old
        st.ckv = append_rows(st.ckv, self.encode_entries(entries, ids))
        n = st.ckv.shape[0]
        n_t = (ctx.pos + 1) // r
        visible = torch.arange(n, device=x.device)[None, :] < n_t[:, None]
        if self.plan.attn_type == "hca":
            return st.ckv, visible
        keys = self.indexer.compressor(x, st.carry.setdefault("index", {}))
        st.idx_k = append_rows(st.idx_k, self.encode_index_keys(keys, ids))
        q, w = self.index_query(x, qr, ctx.pos)
        scores = index_scores(q, st.idx_k, w).masked_fill(~visible, float("-inf"))
        topk = select_topk(scores, self.cfg.index_topk)
        ctx.topk[self.plan.layer_id] = topk
        return st.ckv, selection_mask(topk, n)
