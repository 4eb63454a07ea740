"""Vocab-parallel embedding and LM head of the fast model (docs/model.md §3.1, §3.2 "Final"): rank r of W
holds vocabulary rows ``split_range(V, W, r)``; the head computes float32 logits (the reference upcasts) and
all-gathers them, dropping the padding of uneven splits."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...distributed.group import SINGLE, TPGroup, split_range
from ...kernels.hc_embed import hc_copies, hc_embed
from .layers import PackedLinear


class Embedding(nn.Module):
    """``weight [V_local, D]`` (BF16 checkpoint tensor in the compute dtype); lookup + all-reduce under TP."""

    def __init__(self, vocab: int, dim: int, tp: TPGroup | None = None):
        super().__init__()
        self.tp = tp or SINGLE
        self.v0, self.v1 = split_range(vocab, self.tp.world_size, self.tp.rank)
        self.weight = nn.Parameter(torch.empty(self.v1 - self.v0, dim), requires_grad=False)

    def hc_copies(self, ids: Tensor, hc: int, mix_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The first layer's residual copies [T, hc, D] and delayed pre-mix [T, hc] (``mix_dtype``) of ``ids``
        (:func:`v41.kernels.hc_embed.hc_embed`: one launch on one rank; under TP the all-reduced lookup, copied)."""
        if self.tp.world_size == 1:
            return hc_embed(ids, self.weight, hc, mix_dtype)
        return hc_copies(self(ids), hc, mix_dtype)

    def forward(self, ids: Tensor) -> Tensor:
        if self.tp.world_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.v0
        inside = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(torch.where(inside, local, torch.zeros_like(local)), self.weight)
        return self.tp.all_reduce(out.masked_fill(~inside.unsqueeze(-1), 0.0))


class LMHead(nn.Module):
    """``proj [V_local, D]``; forward(x [N, D]) → float32 logits [N, V] on every rank (``device``: where the
    column map of uneven splits lives)."""

    def __init__(self, dim: int, vocab: int, tp: TPGroup | None = None, device: torch.device | str = "cpu"):
        super().__init__()
        self.tp = tp or SINGLE
        w, r = self.tp.world_size, self.tp.rank
        v0, v1 = split_range(vocab, w, r)
        self.proj = PackedLinear(dim, v1 - v0)
        self.width = -(-vocab // w)
        sizes = [b - a for a, b in (split_range(vocab, w, k) for k in range(w))]
        keep = None if all(s == self.width for s in sizes) else \
            torch.cat([torch.arange(k * self.width, k * self.width + s, device=device) for k, s in enumerate(sizes)])
        self.register_buffer("keep", keep, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        out_dtype = torch.promote_types(x.dtype, torch.float32)
        logits = self.proj(x, out_dtype)
        if self.tp.world_size == 1:
            return logits
        pad = self.width - logits.shape[-1]
        if pad:
            logits = F.pad(logits, (0, pad))
        full = self.tp.all_gather(logits, dim=-1)
        return full if self.keep is None else full.index_select(-1, self.keep)
