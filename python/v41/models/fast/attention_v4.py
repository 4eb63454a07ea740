"""V4 compressed attention in the fast model (docs/model.md §4): HCA (ratio 128, non-overlapping windows,
attend every visible entry) and CSA (ratio 4, overlapping windows: entry w pools the A half of window w−1 and
the B half of window w; lightning indexer with its own overlapping compressor at ``index_head_dim``).

Both compressors of a CSA layer pool in one pass over the concatenated channels ``[A_main | A_idx | B_main |
B_idx]`` (the softmax is per channel); the A triple of every closed window goes to ``cov{r}`` where the next
window reads it — also after a prefix-cache hit (:mod:`.compress`, :mod:`.cache`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ...config import LayerPlan, ModelConfig
from ...distributed.group import TPGroup
from ...kernels.indexer import index_scores
from ...kernels.paged import visible_slots
from ...kernels.rope import rope_
from ...kernels.topk import select_topk
from ...kernels.window_pool import pooled_after_previous, pooled_values
from .attention import FastAttention, StepContext, index_row_chunks
from .compress import pool_step
from .layers import PackedLinear, RMSNorm


class WindowCompressor(nn.Module):
    """``wkv``, ``wgate [c·width, D]`` BF16, ``ape [ratio, c·width]`` float32 (the gate's bias at each position of
    a window: ``wgate(x) + ape[p mod ratio]``), ``norm [width]``; c = 2 with ``overlap`` (CSA)."""

    def __init__(self, dim: int, width: int, ratio: int, overlap: bool, eps: float):
        super().__init__()
        c = 2 if overlap else 1
        self.wkv = PackedLinear(dim, c * width)
        self.wgate = PackedLinear(dim, c * width)
        self.ape = nn.Parameter(torch.zeros(ratio, c * width), requires_grad=False)
        self.norm = RMSNorm(width, eps)
        self.width, self.ratio = width, ratio


class IndexerV4(nn.Module):
    """CSA indexer: own overlapping compressor at ``index_head_dim``, ``wq_b [Hi·di, q_lora]`` FP8,
    ``weights_proj [Hi, D]`` BF16."""

    def __init__(self, cfg: ModelConfig, ratio: int):
        super().__init__()
        hi, di = cfg.index_n_heads, cfg.index_head_dim
        self.compressor = WindowCompressor(cfg.hidden_size, di, ratio, True, cfg.rms_norm_eps)
        self.wq_b = PackedLinear(cfg.q_lora_rank, hi * di, fp8_input=True)
        self.weights_proj = PackedLinear(cfg.hidden_size, hi)
        self.n_heads, self.head_dim = hi, di


class V4Attention(FastAttention):
    """A V4 layer: window MQA plus, for ratio > 0, its own compressor (HCA) and indexer (CSA)."""

    def __init__(self, cfg: ModelConfig, plan: LayerPlan, tp: TPGroup | None = None):
        super().__init__(cfg, plan, q_head_norm=True, tp=tp)
        self.csa = plan.attn_type == "csa"
        if plan.ratio > 0:
            self.compressor = WindowCompressor(cfg.hidden_size, cfg.head_dim, plan.ratio, self.csa, cfg.rms_norm_eps)
            if self.csa:
                self.indexer = IndexerV4(cfg, plan.ratio)
            wide = {"comp.wkv": self.compressor.wkv, "comp.wgate": self.compressor.wgate}
            if self.csa:
                ic = self.indexer.compressor
                wide.update({"idx.wkv": ic.wkv, "idx.wgate": ic.wgate, "weights_proj": self.indexer.weights_proj})
            self.add_wide_siblings(wide)
        # the gate bias in the pooled channels' order (finish_loading): a buffer, so .to() and casts move it too
        self.register_buffer("pool_ape", None, persistent=False)

    def finish_loading(self) -> None:
        """The gate bias of the pooled channels (:meth:`_compress`): the compressor's ``ape``, for CSA interleaved
        with the indexer compressor's as the channels are, ``[A_main | A_idx | B_main | B_idx]``."""
        if self.plan.ratio == 0:
            return
        ape = self.compressor.ape.detach()  # a tensor, not a second registration of the parameter
        if self.csa:
            hd, di, ia = self.head_dim, self.indexer.head_dim, self.indexer.compressor.ape
            ape = torch.cat([ape[:, :hd], ia[:, :di], ape[:, hd:], ia[:, di:]], dim=1)
        self.pool_ape = ape

    def write_entries(self, x: Tensor, proj: dict[str, Tensor], ctx: StepContext) -> None:
        if self.plan.ratio > 0:
            self._compress(x, proj, ctx)

    def compressed_source(self, x: Tensor, qr: Tensor, proj: dict[str, Tensor], ctx: StepContext):
        if self.plan.ratio == 0:
            return None
        r, lid = self.plan.ratio, self.plan.layer_id
        kind = f"ckv{r}"
        if not self.csa:  # HCA: every visible entry
            b = ctx.batch
            return ctx.cache.tensors[kind][lid], visible_slots(b.block_tables[kind], b.req_index, ctx.n_visible[r],
                                                               ctx.n_max[r], ctx.cache.rows_per_block(kind))
        return ctx.cache.tensors[kind][lid], ctx.entry_slots(kind, self._select(x, qr, proj, ctx))

    def _compress(self, x: Tensor, proj: dict[str, Tensor], ctx: StepContext) -> None:
        """Pool this step's windows; write the closed entries (RoPE at ``j·r``) to ``ckv{r}`` (and the index keys
        to ``idx{r}``, the A triples to ``cov{r}`` for CSA)."""
        r, lid, hd = self.plan.ratio, self.plan.layer_id, self.head_dim
        seg = ctx.segments[r]
        value, gate = proj["comp.wkv"], proj["comp.wgate"]
        if self.csa:
            di = self.indexer.head_dim
            iv, ig = proj["idx.wkv"], proj["idx.wgate"]
            value = torch.cat([value[:, :hd], iv[:, :di], value[:, hd:], iv[:, di:]], dim=1)
            gate = torch.cat([gate[:, :hd], ig[:, :di], gate[:, hd:], ig[:, di:]], dim=1)
        m, s, a = pool_step(seg, value, gate, ctx.cache.state[lid], self.pool_ape.to(gate.dtype),
                            ctx.batch.positions)
        if self.csa:  # this window's A half kept for the next; its B half pooled with the previous window's A half
            c, kind = hd + self.indexer.head_dim, f"cov{r}"
            ctx.write_closed(kind, lid, seg, torch.stack([m[:, :c], s[:, :c], a[:, :c]], dim=1))
            pooled = pooled_after_previous(m[:, c:], s[:, c:], a[:, c:], ctx.cache.tensors[kind][lid],
                                           ctx.batch.block_tables[kind], seg.req, seg.window,
                                           ctx.cache.rows_per_block(kind), x.dtype)
        else:
            pooled = pooled_values(s, a, x.dtype)
        angles = ctx.closed_rope(self.rope_key, r)
        ctx.write_closed(f"ckv{r}", lid, seg, pooled[:, :hd], norm=self.compressor.norm.params(), rope=angles)
        if self.csa:
            ctx.write_closed(f"idx{r}", lid, seg, pooled[:, hd:], norm=self.indexer.compressor.norm.params(),
                             rope=angles)

    def _select(self, x: Tensor, qr: Tensor, proj: dict[str, Tensor], ctx: StepContext) -> Tensor:
        """The indexer's top-k entry ids per query [T, min(index_topk, N)] (−1 = none)."""
        ix, r, lid = self.indexer, self.plan.ratio, self.plan.layer_id
        cos, sin = ctx.rope[self.rope_key]
        q = rope_(ix.wq_b(qr).view(x.shape[0], ix.n_heads, ix.head_dim), cos, sin)
        w, w_scale = proj["weights_proj"], ix.head_dim ** -0.5 * ix.n_heads ** -0.5
        kind, b, n = f"idx{r}", ctx.batch, ctx.n_max[r]
        picks = []
        for rows in index_row_chunks(x.shape[0], n, ctx.index_scratch_bytes):  # bounded [rows, N] scratch
            scores = index_scores(q[rows], w[rows], ctx.cache.tensors[kind][lid], b.block_tables[kind],
                                  b.req_index[rows], ctx.n_visible[r][rows], ctx.cache.rows_per_block(kind), n,
                                  record=ctx.cache.records[kind], w_scale=w_scale)
            picks.append(select_topk(scores, min(self.cfg.index_topk, n), ctx.n_visible[r][rows]))
        return torch.cat(picks) if len(picks) > 1 else picks[0]
