"""A decoder block of the fast model: attention and MoE sub-layers joined by the two mHC seams (docs/model.md
§3.2 for V4.1's delayed pre-mix, §4 for V4's own pre-mix). The backbone layers and the DSpark stages use it."""

from __future__ import annotations

from torch import Tensor, nn

from ...config import ModelConfig
from .attention import FastAttention
from .layers import RMSNorm
from .mhc import HcSeam, expand
from .moe import FastMoE


class FastBlock(nn.Module):
    """A decoder layer: ``attn_norm``, ``ffn_norm``, the two mHC seams, attention, MoE and (V4.1) Engram."""

    def __init__(self, cfg: ModelConfig, attn: FastAttention, ffn: FastMoE, delayed: bool):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hc_attn, self.hc_ffn = HcSeam(cfg), HcSeam(cfg)
        self.attn, self.ffn, self.delayed = attn, ffn, delayed

    def step(self, h: Tensor, pre_mix: Tensor, token_ids: Tensor, ctx,
             pending: tuple[Tensor, Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, tuple]:
        """The layer with its last expansion left to the next seam: h [T, hc, D] (with ``pending`` = (y, post,
        comb), the previous layer's FFN output and expansion weights: the copies before that expansion), pre_mix
        [T, hc] float32 (V4.1's carried pre-mix) → (the copies before this layer's FFN expansion, the FFN pre-mix,
        this layer's pending (y, post, comb)). ``ctx``: what the attention reads (a target step's
        :class:`~.attention.StepContext`, a draft pass's context). Each seam is one launch where the CUDA seam runs:
        (the pending expansion,) the mixes, the sub-layer's normed input."""
        y, post, comb = pending if pending is not None else (None, None, None)
        h, pre_a, post_a, comb_a, x = self.hc_attn.enter(h, pre_mix if self.delayed else None, self.attn_norm, y,
                                                         post, comb)
        h, pre_f, post_f, comb_f, x = self.hc_ffn.enter(h, pre_a if self.delayed else None, self.ffn_norm,
                                                        self.attn(x, ctx), post_a, comb_a)
        return h, pre_f, (self.ffn(x, token_ids), post_f, comb_f)

    def forward(self, h: Tensor, pre_mix: Tensor, token_ids: Tensor, ctx) -> tuple[Tensor, Tensor]:
        """h [T, hc, D], pre_mix [T, hc] float32 → (h', the FFN pre-mix): :meth:`step` with its expansion done."""
        h, pre_f, pending = self.step(h, pre_mix, token_ids, ctx)
        return expand(h, *pending), pre_f
