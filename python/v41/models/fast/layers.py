"""Building blocks of the fast model: linear layers over packed weights, RMSNorm, RoPE (docs/model.md §2).

Activations run in the model's compute dtype (bfloat16 by default on CUDA); norms and rotations compute in float32
and cast back, as the spec's numerical conventions say. Weights are :class:`~v41.kernels.packed.PackedWeight` s
held as buffers (``weight`` = the stored data, ``scale`` = E8M0 bytes), so they stay in the checkpoint's format on
the device and the kernels dequantize them.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ... import quant
from ...config import RopeScaling, yarn_inv_freq
from ...kernels.linear import linear
from ...kernels.norm import rms_norm
from ...kernels.rope import angle_tables
from ...kernels.packed import PackedWeight, from_dense


class PackedModule(nn.Module):
    """Holds one :class:`PackedWeight` as buffers (``weight`` = stored data, ``scale`` = E8M0 bytes) of logical
    shape ``self.shape``. On the CPU, where the kernels are the PyTorch references (which dequantize), the
    dequantized weight is kept after its first use instead of being rebuilt on every call."""

    def __init__(self, shape: tuple[int, ...]):
        super().__init__()
        self.shape = shape
        self.register_buffer("weight", torch.empty(0), persistent=False)
        self.register_buffer("scale", None, persistent=False)
        self.fmt, self.block = "dense", (1, 1)
        self._dense: PackedWeight | None = None

    def set(self, w: PackedWeight) -> None:
        """Install a loaded weight. Raises ValueError when its logical shape is not ``self.shape``."""
        if w.shape != self.shape:
            raise ValueError(f"weight shape {w.shape}, expected {self.shape}")
        self.weight, self.scale, self.fmt, self.block = w.data, w.scale, w.fmt, w.block
        self._dense = None

    @property
    def packed(self) -> PackedWeight:
        pw = PackedWeight(self.weight, self.scale, self.fmt, self.block)
        if pw.fmt == "dense" or self.weight.is_cuda:
            return pw
        if self._dense is None:
            self._dense = from_dense(pw.dequantize(torch.float32))  # exact; any compute dtype converts it exactly
        return self._dense


class PackedLinear(PackedModule):
    """``y = x · Wᵀ`` with W ``[out, in]`` in its storage format (set by the loader with :meth:`set`).

    ``groups``: the block-diagonal grouped projection (:func:`v41.kernels.linear.linear`). ``fp8_input``: in
    ``deployed`` numerics (``self.deployed``, set by :meth:`FastModel.set_numerics`) the input is FP8
    quantize-dequantized per 32 elements first, as the DeepSeek reference does before its FP8 GEMMs (docs/model.md
    §2; :func:`v41.quant.fp8_act_qdq`)."""

    def __init__(self, in_features: int, out_features: int, groups: int = 1, fp8_input: bool = False):
        super().__init__((out_features, in_features))
        self.in_features, self.out_features, self.groups = in_features, out_features, groups
        self.fp8_input, self.deployed = fp8_input, False

    def forward(self, x: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
        if self.deployed and self.fp8_input:
            x = quant.fp8_act_qdq(x, 32)
        return linear(x, self.packed, out_dtype, self.groups)


class RMSNorm(nn.Module):
    """Weighted RMSNorm ``w ⊙ x / sqrt(mean(x²) + eps)`` over the last dim, in float32, cast back to x's dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.eps, self.weight)

    def params(self) -> tuple[Tensor, float]:
        """(weight, eps): the ``norm`` argument of a cache write that normalizes in its own launch
        (:meth:`~.cache.FastCache.store`)."""
        return self.weight, self.eps


class Rope:
    """Interleaved ("GPT-J") rotary embedding of the last ``rope_dim`` channels (§2): pairs ``(2i, 2i+1)``
    rotate by ``pos·f_i`` (:func:`v41.kernels.rope.rope` applies it). Angles are formed in float64 (positions up to
    1M need it); ``dtype`` is what the rotation computes in (float32, or float64 for a float64 model)."""

    def __init__(self, rope_dim: int, base: float, scaling: RopeScaling | None, device: torch.device | str,
                 dtype: torch.dtype = torch.float32):
        self.rope_dim, self.dtype = rope_dim, dtype
        self.inv_freq = torch.tensor(yarn_inv_freq(rope_dim, base, scaling), dtype=torch.float64, device=device)

    def cos_sin(self, pos: Tensor, scale: int = 1) -> tuple[Tensor, Tensor]:
        """pos [T] int64 → (cos, sin) [T, rope_dim/2] in ``dtype`` at positions ``pos·scale``
        (:func:`v41.kernels.rope.angle_tables`)."""
        return angle_tables(pos, self.inv_freq, self.dtype, scale)
