"""Weights as the checkpoint stores them, kept on the device and dequantized inside the kernels
(docs/architecture.md §3a; formats: docs/model.md §2 "Weight storage dtypes", :mod:`v41.quant`).

A :class:`PackedWeight` is a ``[*lead, out, in]`` matrix (``lead`` = experts for grouped MoE weights) in one of
three formats:

* ``fp8``: ``data`` float8_e4m3fn ``[*lead, out, in]``, ``scale`` uint8 E8M0 bytes
  ``[*lead, ceil(out/b0), ceil(in/b1)]`` (V4.1 32×32 tiles, V4 128×128); ``w = e4m3 · 2^(byte − 127)``.
* ``mxfp4``: ``data`` uint8 ``[*lead, out, in/2]`` (element 2k in the low nibble), ``scale`` uint8
  ``[*lead, out, in/32]``; ``w = e2m1 · 2^(byte − 127)``.
* ``dense``: ``data`` in a floating dtype ``[*lead, out, in]``, no scale (BF16 checkpoint tensors, weights
  dequantized at load with ``--quantization none``, and shards that cut a quantization block).

Both quantized products are exact in bfloat16 and float32 (an E4M3 or E2M1 value has ≤ 3 mantissa bits and
the scale is a power of two), so ``dequantize`` followed by any GEMM is the reference every kernel must match.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .. import quant

FORMATS = ("fp8", "mxfp4", "dense")
MX_BLOCK = 32


DEQUANT_CHUNK_ELEMENTS = 1 << 28  # PackedWeight.dequantize: elements of a stack dequantized at once (1 GiB float32)


@dataclass(frozen=True)
class PackedWeight:
    """One weight in its storage format (module docstring). ``block``: the scale tile ``(b0, b1)`` (fp8),
    ``(1, 32)`` (mxfp4) or ``(1, 1)`` (dense). Raises ValueError from :meth:`check` for inconsistent parts."""

    data: Tensor
    scale: Tensor | None
    fmt: str
    block: tuple[int, int] = (1, 1)

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical ``(*lead, out, in)``."""
        lead = tuple(self.data.shape[:-1])
        return lead + (self.data.shape[-1] * (2 if self.fmt == "mxfp4" else 1),)

    @property
    def out_features(self) -> int:
        return self.shape[-2]

    @property
    def in_features(self) -> int:
        return self.shape[-1]

    @property
    def nbytes(self) -> int:
        """Bytes on the device (data + scales)."""
        n = self.data.numel() * self.data.element_size()
        return n + (0 if self.scale is None else self.scale.numel())

    def check(self) -> "PackedWeight":
        if self.fmt not in FORMATS:
            raise ValueError(f"unknown weight format {self.fmt!r}; expected one of {FORMATS}")
        if self.fmt == "dense":
            if self.scale is not None or not self.data.is_floating_point():
                raise ValueError("a dense weight is one floating tensor without a scale")
            return self
        if self.scale is None or self.scale.dtype != torch.uint8:
            raise ValueError(f"a {self.fmt} weight needs uint8 E8M0 scale bytes")
        *lead, out, inn = self.shape
        b0, b1 = self.block
        want = (*lead, -(-out // b0), -(-inn // b1))
        if tuple(self.scale.shape) != want:
            raise ValueError(f"{self.fmt} scale of weight {self.shape} with block {self.block}: expected "
                             f"{want}, got {tuple(self.scale.shape)}")
        if self.fmt == "fp8" and self.data.dtype != torch.float8_e4m3fn:
            raise ValueError(f"fp8 data must be float8_e4m3fn, got {self.data.dtype}")
        if self.fmt == "mxfp4" and (self.data.dtype != torch.uint8 or self.block != (1, MX_BLOCK)):
            raise ValueError("mxfp4 data must be uint8 with block (1, 32)")
        return self

    def to(self, device: torch.device | str) -> "PackedWeight":
        return PackedWeight(self.data.to(device), None if self.scale is None else self.scale.to(device),
                            self.fmt, self.block)

    def dequantize(self, dtype: torch.dtype) -> Tensor:
        """The dense ``[*lead, out, in]`` weight in ``dtype`` (exact for bfloat16 / float32 / float64). A stack
        (experts ``[E, out, in]``) of more than :data:`DEQUANT_CHUNK_ELEMENTS` elements is dequantized a run of
        matrices at a time into the result, so the float32 / int32 temporaries (4–8× a bf16 result) stay bounded:
        a V4.1 ``w13`` stack would otherwise take 16 GiB of them at once."""
        if self.fmt == "dense":
            return self.data.to(dtype)
        *lead, out, inn = self.shape
        if lead and math.prod(lead) * out * inn > DEQUANT_CHUNK_ELEMENTS:
            result = torch.empty((*lead, out, inn), dtype=dtype, device=self.data.device)
            flat, data = result.view(-1, out, inn), self.data.reshape(-1, *self.data.shape[-2:])
            scale = self.scale.reshape(-1, *self.scale.shape[-2:])
            step = max(1, DEQUANT_CHUNK_ELEMENTS // (out * inn))
            for i in range(0, flat.shape[0], step):
                flat[i:i + step] = PackedWeight(data[i:i + step], scale[i:i + step], self.fmt,
                                                self.block).dequantize(dtype)
            return result
        s = quant.e8m0_to_float(self.scale)
        if self.fmt == "mxfp4":
            w = quant.dequant_mxfp4(self.data, self.scale) if not lead else \
                quant.dequant_mxfp4(self.data.reshape(-1, self.data.shape[-1]),
                                    self.scale.reshape(-1, self.scale.shape[-1])).view(*lead, out, inn)
            return w.to(dtype)
        b0, b1 = self.block
        s = s.repeat_interleave(b0, dim=-2)[..., :out, :].repeat_interleave(b1, dim=-1)[..., :inn]
        return (self.data.to(torch.float32) * s).to(dtype)

    def narrow(self, dim: int, start: int, stop: int) -> "PackedWeight":
        """Logical indices ``[start, stop)`` of the output (``dim`` −2 or 0 for 2-D) or input (−1 / 1) dim; stays
        packed when the cut is aligned to the scale tiles (MXFP4 inputs: 32), else dense float32."""
        nd = len(self.shape)
        d = dim % nd
        if d not in (nd - 2, nd - 1):
            raise ValueError(f"narrow: dim {dim} of a {nd}-D weight is not its output or input dim")
        full = self.shape[d]
        b = self.block[d - (nd - 2)]
        if self.fmt == "dense":
            return PackedWeight(self.data.narrow(d, start, stop - start), None, "dense")
        if start % b or (stop % b and stop != full):
            return PackedWeight(self.dequantize(torch.float32).narrow(d, start, stop - start), None, "dense")
        per = 2 if self.fmt == "mxfp4" and d == nd - 1 else 1
        data = self.data.narrow(d, start // per, (stop - start) // per)
        scale = self.scale.narrow(d, start // b, -(-stop // b) - start // b)
        return PackedWeight(data, scale, self.fmt, self.block)


def from_dense(w: Tensor) -> PackedWeight:
    """A dense PackedWeight over ``w`` (no copy)."""
    return PackedWeight(w, None, "dense")


def concat_rows(parts: list[PackedWeight]) -> PackedWeight:
    """Stack weights along their output dim (e.g. w1 over w3 → gate_up). Stays packed when every part has the
    same format and block and every part but the last fills whole scale tiles; otherwise dense float32."""
    first = parts[0]
    aligned = all(p.fmt == first.fmt and p.block == first.block for p in parts) and \
        all(p.out_features % first.block[0] == 0 for p in parts[:-1])
    if first.fmt != "dense" and aligned:
        return PackedWeight(torch.cat([p.data for p in parts], dim=-2), torch.cat([p.scale for p in parts], dim=-2),
                            first.fmt, first.block)
    if first.fmt == "dense" and aligned:
        return PackedWeight(torch.cat([p.data for p in parts], dim=-2), None, "dense")
    return PackedWeight(torch.cat([p.dequantize(torch.float32) for p in parts], dim=-2), None, "dense")


def stack_experts(parts: list[PackedWeight]) -> PackedWeight:
    """Stack ``E`` equal-shaped weights into one ``[E, out, in]`` weight (formats must agree; mixed formats
    become dense float32)."""
    first = parts[0]
    if all(p.fmt == first.fmt and p.block == first.block and p.data.dtype == first.data.dtype for p in parts):
        scale = None if first.scale is None else torch.stack([p.scale for p in parts])
        return PackedWeight(torch.stack([p.data for p in parts]), scale, first.fmt, first.block)
    return PackedWeight(torch.stack([p.dequantize(torch.float32) for p in parts]), None, "dense")


def weight_bytes(weights) -> int:
    """Total device bytes of an iterable of PackedWeights."""
    return sum(w.nbytes for w in weights)
