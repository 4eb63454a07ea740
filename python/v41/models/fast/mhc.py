"""mHC seams of the fast model (docs/model.md §3.4, §3.2; V4's own pre-mix and ``hc_head``, §4). The
coefficients are float32 (:func:`v41.kernels.mhc.hc_mixes`); collapse and expand compute in float32 and return
the residual stream's dtype."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ...config import ModelConfig
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


class HcHead(nn.Module):
    """V4's learned final collapse: ``pre = sigmoid(fn · rms(flatten H) · scale + base) + eps`` (§4), then the final
    RMSNorm. ``fn [hc, hc·D]``, ``base [hc]``, ``scale [1]`` (float32) as loaded; :meth:`finish_loading` (the
    loader calls it) embeds them as the pre rows of an mHC seam's ``[(2+hc)·hc, hc·D]`` / ``[(2+hc)·hc]`` / ``[3]`` mixes whose post
    and comb rows are zero, so the head is a seam of its own (:func:`v41.kernels.mhc.hc_seam`: one launch where the
    CUDA seam runs) and the unused post and comb mixes cost a few zero rows."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hc, d = cfg.hc_mult, cfg.hidden_size
        self.fn = nn.Parameter(torch.zeros(hc, hc * d), requires_grad=False)
        self.base = nn.Parameter(torch.zeros(hc), requires_grad=False)
        self.scale = nn.Parameter(torch.ones(1), requires_grad=False)
        self.cfg = cfg

    def finish_loading(self) -> None:
        """Replace the loaded ``fn``, ``base``, ``scale`` by the seam's shapes (class docstring); idempotent."""
        hc = self.cfg.hc_mult
        if self.base.shape[0] != hc:
            return
        ct = torch.promote_types(self.fn.dtype, torch.float32)
        fn = torch.zeros((2 + hc) * hc, self.fn.shape[1], dtype=ct, device=self.fn.device)
        fn[:hc] = self.fn
        base = torch.zeros((2 + hc) * hc, dtype=ct, device=self.base.device)
        base[:hc] = self.base
        scale = torch.zeros(3, dtype=ct, device=self.scale.device)
        scale[0] = self.scale[0]
        self.fn, self.base, self.scale = (nn.Parameter(t, requires_grad=False) for t in (fn, base, scale))

    def forward(self, h: Tensor, norm) -> Tensor:
        """``norm(collapse(h, pre))`` [T, D] in h's dtype of h [T, hc, D]; ``norm``: the final
        :class:`~.layers.RMSNorm`. Raises RuntimeError before :meth:`finish_loading`."""
        c = self.cfg
        if self.base.shape[0] == c.hc_mult:
            raise RuntimeError("HcHead.finish_loading() was not called after loading the head's mixes")
        # one Sinkhorn iteration: the comb mixes are unused
        return hc_seam(h, self.fn, self.scale, self.base, c.hc_mult, 1, c.hc_eps, c.rms_norm_eps, None, norm.eps,
                       norm.weight)[-1]
