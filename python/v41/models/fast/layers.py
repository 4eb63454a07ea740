"""Building blocks of the fast model: linear layers over packed weights, RMSNorm, RoPE (v41-architecture.md §2).

Activations run in the model's compute dtype (bfloat16 by default on CUDA); norms and rotations compute in float32
and cast back, as the spec's numerical conventions say. Weights are :class:`~v41.kernels.packed.PackedWeight` s
held as buffers (``weight`` = the stored data, ``scale`` = E8M0 bytes), so they stay in the checkpoint's format on
the device and the kernels dequantize them.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ...config import RopeScaling, yarn_inv_freq
from ...kernels.linear import linear
from ...kernels.packed import PackedWeight


class PackedLinear(nn.Module):
    """``y = x · Wᵀ`` with W ``[out, in]`` in its storage format (set by the loader with :meth:`set`).

    ``groups``: the block-diagonal grouped projection (:func:`v41.kernels.linear.linear`)."""

    def __init__(self, in_features: int, out_features: int, groups: int = 1):
        super().__init__()
        self.in_features, self.out_features, self.groups = in_features, out_features, groups
        self.register_buffer("weight", torch.empty(0), persistent=False)
        self.register_buffer("scale", None, persistent=False)
        self.fmt, self.block = "dense", (1, 1)

    def set(self, w: PackedWeight) -> None:
        """Install a loaded weight. Raises ValueError when its logical shape is not ``[out, in]``."""
        if w.shape != (self.out_features, self.in_features):
            raise ValueError(f"weight shape {w.shape}, expected {(self.out_features, self.in_features)}")
        self.weight, self.scale, self.fmt, self.block = w.data, w.scale, w.fmt, w.block

    @property
    def packed(self) -> PackedWeight:
        return PackedWeight(self.weight, self.scale, self.fmt, self.block)

    def forward(self, x: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
        return linear(x, self.packed, out_dtype, self.groups)


class RMSNorm(nn.Module):
    """Weighted RMSNorm ``w ⊙ x / sqrt(mean(x²) + eps)`` over the last dim, in float32, cast back to x's dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.eps, self.weight)


def rms_norm(x: Tensor, eps: float, weight: Tensor | None = None) -> Tensor:
    """RMSNorm over the last dim in ≥ float32 (float64 stays float64), optional weight; x's dtype out."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(y.dtype)
    return y.to(x.dtype)


class Rope:
    """Interleaved ("GPT-J") rotary embedding of the last ``rope_dim`` channels (§2): pairs ``(2i, 2i+1)``
    rotate by ``pos·f_i``. Angles are formed in float64 (positions up to 1M need it), rotations in float32."""

    def __init__(self, rope_dim: int, base: float, scaling: RopeScaling | None, device: torch.device | str):
        self.rope_dim = rope_dim
        self.inv_freq = torch.tensor(yarn_inv_freq(rope_dim, base, scaling), dtype=torch.float64, device=device)

    def cos_sin(self, pos: Tensor) -> tuple[Tensor, Tensor]:
        """pos [T] int64 → (cos, sin) [T, rope_dim/2] float64 (cast by :func:`apply_rope`)."""
        angles = pos.to(torch.float64)[:, None] * self.inv_freq[None, :]
        return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool = False) -> Tensor:
    """Rotate the last ``2·cos.shape[-1]`` channels of x [T, ..., d] by the per-token angles (cos, sin)
    [T, rd/2]; ``inverse`` rotates by the negative angles. Returns x's shape and dtype."""
    half = cos.shape[-1]
    rd = 2 * half
    ctype = torch.float64 if x.dtype == torch.float64 else torch.float32
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    c, s = cos.to(ctype).view(shape), sin.to(ctype).view(shape)
    if inverse:
        s = -s
    rope = x[..., -rd:].to(ctype)
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rot = torch.stack((even * c - odd * s, even * s + odd * c), dim=-1).flatten(-2)
    return torch.cat([x[..., :-rd], rot.to(x.dtype)], dim=-1)
