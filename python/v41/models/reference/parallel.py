"""Vocab-parallel embedding and LM head (docs/model.md §3.1, §3.2 "Final"; sharding in :mod:`.sharding`).

Rank r of W holds vocabulary rows ``split_range(V, W, r)`` of ``embed.weight`` and ``head.weight``. At
``world_size`` 1 both are exactly ``F.embedding`` / ``F.linear`` over the full weight (no collective).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...distributed.group import SINGLE, TPGroup, split_range


class VocabParallelEmbedding(nn.Module):
    """``weight [V_local, D]`` = rows ``[v0, v1)`` of the full ``[V, D]`` table.

    forward(ids [...] int64 in [0, V)) → [..., D]: each rank looks up the ids it owns, zeros elsewhere,
    then one ``all_reduce``; exactly one rank contributes each row, so the result equals the full lookup
    bit for bit.
    """

    def __init__(self, vocab: int, dim: int, tp: TPGroup | None = None):
        super().__init__()
        self.tp = tp or SINGLE
        self.v0, self.v1 = split_range(vocab, self.tp.world_size, self.tp.rank)
        self.weight = nn.Parameter(torch.empty(self.v1 - self.v0, dim), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.v0
        inside = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(torch.where(inside, local, torch.zeros_like(local)), self.weight)
        return self.tp.all_reduce(out.masked_fill(~inside.unsqueeze(-1), 0.0))


class VocabParallelHead(nn.Module):
    """LM head ``weight [V_local, D]`` = rows ``[v0, v1)`` of the full ``[V, D]``.

    forward(x [..., D]) → full logits [..., V] on every rank: local ``x·W_localᵀ``, padded to the largest
    rank's width when V does not divide evenly, ``all_gather`` along the last dim, padding dropped.
    """

    def __init__(self, dim: int, vocab: int, tp: TPGroup | None = None):
        super().__init__()
        self.tp = tp or SINGLE
        w, r = self.tp.world_size, self.tp.rank
        self.v0, self.v1 = split_range(vocab, w, r)
        self.weight = nn.Parameter(torch.empty(self.v1 - self.v0, dim), requires_grad=False)
        self.width = -(-vocab // w)  # the widest rank's share
        sizes = [b - a for a, b in (split_range(vocab, w, k) for k in range(w))]
        # columns of the gathered [.., W·width] tensor that hold real logits (None: no padding)
        self.keep = None if all(s == self.width for s in sizes) else \
            torch.cat([torch.arange(k * self.width, k * self.width + s) for k, s in enumerate(sizes)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.weight)
        if self.tp.world_size == 1:
            return logits
        pad = self.width - logits.shape[-1]
        if pad:
            logits = F.pad(logits, (0, pad))
        full = self.tp.all_gather(logits, dim=-1)
        return full if self.keep is None else full.index_select(-1, self.keep.to(full.device))
