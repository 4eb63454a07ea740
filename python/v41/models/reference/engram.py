"""Engram: hashed 2..n-gram lookup gated into every residual copy (v41-architecture.md §3.3).

Row ids come from :class:`v41.models.engram_hash.EngramHasher` (token ids only); this module owns the
table lookup, the ``wkv`` projection and the per-copy gate.
"""

from __future__ import annotations

import torch
from torch import nn

from ...config import ModelConfig
from .ops import Linear

GATE_FLOOR = 1e-6


class Engram(nn.Module):
    """Tensors: ``embed [rows, hd_e]`` (FP8 with per-32 E8M0 scales on disk), ``wkv [(hc+1)·D, cols·hd_e]``
    FP8, ``q_weight``/``k_weight [hc, D]`` BF16. ``cols = (max_ngram − 1)·n_heads``."""

    def __init__(self, cfg: ModelConfig, rows: int):
        super().__init__()
        cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        self.embed = nn.Embedding(rows, cfg.engram_head_dim)
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
        e = self.embed.weight[row_ids].flatten(1).to(h.dtype)
        kv = self.wkv(e)
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
