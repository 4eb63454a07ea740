"""mHC seams of the fast model (docs/model.md §3.4, §3.2; V4's own pre-mix and ``hc_head``, §4). The
coefficients are float32 (:func:`v41.kernels.mhc.hc_mixes`); collapse and expand compute in float32 and return
the residual stream's dtype."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ...config import ModelConfig
from ...kernels.mhc import hc_collapse as collapse
from ...kernels.mhc import hc_collapse_norm
from ...kernels.mhc import hc_expand as expand
from ...kernels.mhc import hc_seam


def collapse_norm(h: Tensor, pre: Tensor, norm, rows: Tensor | None = None) -> Tensor:
    """``norm(collapse(h, pre))`` of the tokens ``rows`` (None: all) in one launch where the kernels run
    (:func:`v41.kernels.mhc.hc_collapse_norm`); ``norm``: the sub-layer's :class:`~.layers.RMSNorm`."""
    return hc_collapse_norm(h, pre, norm.eps, norm.weight, rows)


class HcSeam(nn.Module):
    """``fn [(2+hc)·hc, hc·D]``, ``base [(2+hc)·hc]``, ``scale [3]`` (float32) of one sub-layer."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hc, d = cfg.hc_mult, cfg.hidden_size
        n_mix = (2 + hc) * hc
        self.fn = nn.Parameter(torch.zeros(n_mix, hc * d), requires_grad=False)
        self.base = nn.Parameter(torch.zeros(n_mix), requires_grad=False)
        self.scale = nn.Parameter(torch.ones(3), requires_grad=False)
        self.cfg = cfg

    def enter(self, h: Tensor, pre_c: Tensor | None, norm, y: Tensor | None = None, post: Tensor | None = None,
              comb: Tensor | None = None) -> tuple[Tensor, ...]:
        """The seam into a sub-layer: ``h' = expand(h, y, post, comb)`` when ``y`` (the previous sub-layer's
        output) is given, this seam's mixes of h', and the sub-layer's input ``norm(collapse(h', w))`` with ``w`` =
        ``pre_c`` (V4.1's delayed pre-mix) or, when None, this seam's pre. Returns ``(h', pre, post', comb', x)``;
        one launch where the CUDA seam runs (:func:`v41.kernels.mhc.hc_seam`). ``norm``: the sub-layer's
        :class:`~.layers.RMSNorm`."""
        c = self.cfg
        return hc_seam(h, self.fn, self.scale, self.base, c.hc_mult, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps,
                       pre_c, norm.eps, norm.weight, y, post, comb)


def _ctype(h: Tensor) -> torch.dtype:
    return torch.promote_types(h.dtype, torch.float32)


class HcHead(nn.Module):
    """V4's learned final collapse: ``pre = sigmoid(fn · rms(flatten H) · scale + base) + eps`` (§4)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hc, d = cfg.hc_mult, cfg.hidden_size
        self.fn = nn.Parameter(torch.zeros(hc, hc * d), requires_grad=False)
        self.base = nn.Parameter(torch.zeros(hc), requires_grad=False)
        self.scale = nn.Parameter(torch.ones(1), requires_grad=False)
        self.cfg = cfg

    def forward(self, h: Tensor) -> Tensor:
        ct = _ctype(h)
        flat = h.flatten(1).to(ct)
        flat = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)
        pre = torch.sigmoid(flat @ self.fn.to(ct).T * self.scale.to(ct) + self.base.to(ct))
        return collapse(h, pre + self.cfg.hc_eps)
