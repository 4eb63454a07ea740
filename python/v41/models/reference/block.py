"""A decoder block: attention and MoE sub-layers joined by mHC (docs/model.md §3.2 for V4.1's delayed
pre-mix, §4 for V4's own pre-mix)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ...config import ModelConfig
from .attention import Attention
from .moe import MoE
from .ops import RMSNorm, hc_collapse, hc_expand, hc_mixes


class Block(nn.Module):
    """Tensors: ``attn_norm``/``ffn_norm [D]``, ``hc_{attn,ffn}_fn [(2+hc)·hc, hc·D]``, ``_base``, ``_scale [3]``,
    plus ``attn.*`` and ``ffn.*``. ``delayed``: V4.1 collapses each sub-layer with the previous sub-layer's
    pre-mix; V4 collapses with the pre-mix it computes itself."""

    def __init__(self, cfg: ModelConfig, attn: Attention, ffn: MoE, delayed: bool):
        super().__init__()
        d, hc = cfg.hidden_size, cfg.hc_mult
        n_mix = (2 + hc) * hc
        self.attn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(d, cfg.rms_norm_eps)
        for sub in ("attn", "ffn"):
            setattr(self, f"hc_{sub}_fn", nn.Parameter(torch.zeros(n_mix, hc * d), requires_grad=False))
            setattr(self, f"hc_{sub}_base", nn.Parameter(torch.zeros(n_mix), requires_grad=False))
            setattr(self, f"hc_{sub}_scale", nn.Parameter(torch.ones(3), requires_grad=False))
        self.attn, self.ffn = attn, ffn
        self.cfg, self.delayed = cfg, delayed

    def _mixes(self, h: torch.Tensor, sub: str):
        c = self.cfg
        return hc_mixes(h, getattr(self, f"hc_{sub}_fn"), getattr(self, f"hc_{sub}_scale"),
                        getattr(self, f"hc_{sub}_base"), c.hc_mult, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps)

    def forward(self, h: torch.Tensor, pre_mix: torch.Tensor | None, token_ids: torch.Tensor,
                attend: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """h: [T, hc, D]; pre_mix: [T, hc] carried pre-mix (V4.1) or None (V4); token_ids: [T] (hash routing);
        attend: the attention sub-layer applied to the normalized collapsed input [T, D] → [T, D] (dense
        reference cache or the engine's paged one). Returns (h', the FFN pre-mix [T, hc] to carry on)."""
        pre_a, post_a, comb_a = self._mixes(h, "attn")
        x = hc_collapse(h, pre_mix if self.delayed else pre_a)
        h = hc_expand(h, attend(self.attn_norm(x)), post_a, comb_a)
        pre_f, post_f, comb_f = self._mixes(h, "ffn")
        x = hc_collapse(h, pre_a if self.delayed else pre_f)
        h = hc_expand(h, self.ffn(self.ffn_norm(x), token_ids), post_f, comb_f)
        return h, pre_f
