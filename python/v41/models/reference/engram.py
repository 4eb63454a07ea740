"""Engram: hashed 2..n-gram lookup gated into every residual copy (docs/model.md §3.3).

Row ids come from :class:`v41.models.engram_hash.EngramHasher` (token ids only); this module owns the
table lookup, the ``wkv`` projection and the per-copy gate.

Tensor parallelism (``tp``, :mod:`.sharding`): rank r holds the hash columns ``[c0, c1) = split_range(cols, W, r)``
(uneven splits allowed), i.e. the contiguous table rows ``[offsets[c0], offsets[c1])`` and the ``wkv`` input
columns ``[c0·hd_e, c1·hd_e)``; its ``wkv`` output is a partial sum, all-reduced before the (replicated) gate.
"""

from __future__ import annotations

import torch
from torch import nn

from ...config import ModelConfig
from ...distributed.group import SINGLE, TPGroup, split_range
from .ops import Linear
from ..sharding import engram_rows

GATE_FLOOR = 1e-6


class Engram(nn.Module):
    """Tensors: ``embed [rows, hd_e]`` (FP8 with per-32 E8M0 scales on disk), ``wkv [(hc+1)·D, cols·hd_e]``
    FP8, ``q_weight``/``k_weight [hc, D]`` BF16. ``cols = (max_ngram − 1)·n_heads``.

    primes: the layer's bucket size per hash column (``EngramHasher.primes[layer]``, [cols]); the table has
    ``sum(primes)`` rows. Under ``tp`` ``embed`` and ``wkv`` hold the local columns' rows / input columns.
    """

    def __init__(self, cfg: ModelConfig, primes, tp: TPGroup | None = None):
        super().__init__()
        self.tp = tp or SINGLE
        self.col0, self.col1 = split_range(len(primes), self.tp.world_size, self.tp.rank)
        self.row0, row1 = engram_rows(primes, self.col0, self.col1)
        cols = self.col1 - self.col0
        self.embed = nn.Embedding(row1 - self.row0, cfg.engram_head_dim)
        self.embed.weight.requires_grad_(False)
        self.wkv = Linear(cols * cfg.engram_head_dim, (cfg.hc_mult + 1) * cfg.hidden_size, fp8_input=True)
        self.q_weight = nn.Parameter(torch.zeros(cfg.hc_mult, cfg.hidden_size), requires_grad=False)
        self.k_weight = nn.Parameter(torch.zeros(cfg.hc_mult, cfg.hidden_size), requires_grad=False)
        self.hc, self.dim, self.eps = cfg.hc_mult, cfg.hidden_size, cfg.rms_norm_eps

    def forward(self, h: torch.Tensor, row_ids: torch.Tensor, dead: torch.Tensor | None = None) -> torch.Tensor:
        """h: [T, hc, D] residual copies; row_ids: [T, cols] int64 table rows; dead: [T] bool image tokens
        (gate 0). Returns ``H + g ⊙ value`` with ``g = sigmoid(sign(s)·sqrt(max(|s|, 1e-6)))`` and
        ``s = Σ_d H·w·key / (rms(H)·rms(key)·sqrt(D))`` per copy."""
        t = h.shape[0]
        if self.tp.world_size > 1:  # this rank's columns, as rows of its table slice
            row_ids = row_ids[:, self.col0:self.col1] - self.row0
        e = self.embed.weight[row_ids].flatten(1).to(h.dtype)
        kv = self.tp.all_reduce(self.wkv(e))
        key = kv[:, : self.hc * self.dim].view(t, self.hc, self.dim)
        value = kv[:, self.hc * self.dim:]
        w = (self.q_weight * self.k_weight).to(h.dtype)
        ctype = torch.promote_types(h.dtype, torch.float32)
        hf, kf = h.to(ctype), key.to(ctype)
        rms_h = torch.sqrt(hf.pow(2).mean(-1) + self.eps)
        rms_k = torch.sqrt(kf.pow(2).mean(-1) + self.eps)
        s = (hf * w * kf).sum(-1) / (rms_h * rms_k * self.dim ** 0.5)
        g = torch.sigmoid(torch.sign(s) * torch.sqrt(s.abs().clamp(min=GATE_FLOOR)))
        if dead is not None:
            g = g.masked_fill(dead[:, None], 0.0)
        return (hf + g.unsqueeze(-1) * value.to(ctype).unsqueeze(1)).to(h.dtype)
