"""Dense building blocks of the reference forward: parameter holders, RMSNorm, RoPE, mHC, stable top-k,
sink attention. Everything runs in the module's compute dtype (float32 or float64); math source:
docs/model.md §2 (numerics), §3.4 (mHC), §3.5 (attention).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ... import quant
from ...config import RopeScaling, yarn_inv_freq

NUMERICS = ("exact", "deployed")


class Linear(nn.Module):
    """``y = x W^T`` with ``weight [out, in]`` (already dequantized to the compute dtype).

    ``fp8_input``: in ``deployed`` numerics the input is quantize-dequantized to FP8 E4M3 per 32-element
    block first, as the DeepSeek reference does before every FP8/FP4 GEMM (§2). BF16-stored weights
    (compressor, ``weights_proj``, router) take their input unquantized.
    """

    def __init__(self, in_features: int, out_features: int, fp8_input: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.fp8_input = fp8_input
        self.deployed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.deployed and self.fp8_input:
            x = quant.fp8_act_qdq(x, 32)
        return F.linear(x, self.weight)


class RMSNorm(nn.Module):
    """Weighted RMSNorm ``w ⊙ x / sqrt(mean(x²) + eps)`` over the last dim, in at least float32 (§2)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.eps) * self.weight


def rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Unweighted RMSNorm over the last dim (V4 per-head q norm, mHC input norm)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class Rope:
    """Interleaved ("GPT-J") rotary embedding on the **last** ``rope_dim`` channels (§2).

    Channel pairs ``(2i, 2i+1)`` of that slice rotate by ``pos·f_i``; ``inverse=True`` rotates by ``−pos·f_i``.
    Frequencies come from :func:`v41.config.yarn_inv_freq` (YaRN only when ``scaling`` is given).
    """

    def __init__(self, rope_dim: int, base: float, scaling: RopeScaling | None):
        self.rope_dim = rope_dim
        self.inv_freq = torch.tensor(yarn_inv_freq(rope_dim, base, scaling), dtype=torch.float64)

    def __call__(self, x: torch.Tensor, pos: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """x: [T, ..., d] with d ≥ rope_dim; pos: [T] int64 positions. Returns the same shape and dtype."""
        angles = pos.to(torch.float64)[:, None] * self.inv_freq.to(pos.device)[None, :]  # [T, rd/2]
        ctype = torch.float32 if x.dtype != torch.float64 else torch.float64
        cos, sin = angles.cos().to(ctype), angles.sin().to(ctype)
        if inverse:
            sin = -sin
        shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (self.rope_dim // 2,)
        cos, sin = cos.view(shape), sin.view(shape)
        rope = x[..., -self.rope_dim:].to(ctype)
        even, odd = rope[..., 0::2], rope[..., 1::2]
        rot = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
        return torch.cat([x[..., : -self.rope_dim], rot.to(x.dtype)], dim=-1)


def hc_mixes(h: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
             hc: int, iters: int, hc_eps: float, norm_eps: float):
    """mHC coefficients for one sub-layer (§3.4).

    h: [T, hc, D]; fn: [(2+hc)·hc, hc·D]; scale: [3]; base: [(2+hc)·hc].
    Returns ``pre`` [T, hc], ``post`` [T, hc] and ``comb`` [T, hc, hc] (comb[i, j]: input copy i → output j),
    after the fixed Sinkhorn procedure: softmax over j + eps, one column normalization, then
    ``iters − 1`` rounds of row then column normalization.
    """
    flat = h.flatten(1)
    flat = flat.to(torch.promote_types(flat.dtype, torch.float32))
    mixes = F.linear(rms_norm(flat, norm_eps), fn.to(flat.dtype))
    pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.split([hc, hc, hc * hc])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(-1, hc, hc) * scale[2] + comb_b.view(hc, hc), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return pre, post, comb


def hc_collapse(h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """``x = Σ_h pre[h]·H[h]``: h [T, hc, D], pre [T, hc] → [T, D] in h's dtype."""
    return (pre.unsqueeze(-1) * h).sum(dim=1).to(h.dtype)


def hc_expand(h: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Residual update ``H'[j] = post[j]·y + Σ_i comb[i, j]·H[i]`` (§3.4): returns [T, hc, D]."""
    mixed = torch.einsum("tij,tid->tjd", comb.to(h.dtype), h)
    return post.to(h.dtype).unsqueeze(-1) * y.unsqueeze(1) + mixed


def stable_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries along the last dim, in descending score order; exact ties go to
    the lower index (docs/numerics.md §4), so the choice never depends on tensor length or batch shape."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


def sink_attention(q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, sink: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """MQA with a per-head sink logit in the softmax denominator only (§2, §3.5); K = V.

    q: [T, H, d]; keys: [S, d]; visible: [T, S] bool; sink: [H]. Returns [T, H, d].
    A query with no visible key returns zeros (only the sink is in the denominator).
    """
    logits = torch.einsum("thd,sd->ths", q, keys) * scale
    logits = logits.masked_fill(~visible[:, None, :], float("-inf"))
    sinks = sink.to(logits.dtype).view(1, -1, 1).expand(logits.shape[0], -1, 1)
    full = torch.cat([logits, sinks], dim=-1)
    probs = torch.softmax(full - full.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
    return torch.einsum("ths,sd->thd", probs, keys)


def window_visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """[T, S] bool: key position s is within the sliding window of query p (``p − window < s ≤ p``)."""
    diff = q_pos[:, None] - k_pos[None, :]
    return (diff >= 0) & (diff < window)
