"""Sibling projections: linear layers of one module that read the same input, run as one GEMM over their weights'
rows stacked (docs/kernels.md §2 "Dense FP8 GEMMs"). At decode sizes a small projection costs its launch's ramp and
split-K tail more than its bytes (V4.1's ``wkv`` [512, 5120] FP8 takes 5.7 µs at one row for 0.6 µs of bytes on the
H200, benches/RESULTS.md "2026-12-04 (afternoon)"), so attention's ``wq_a`` + ``wkv`` and a compressor's bf16
projections (+ the indexer's ``weights_proj``) each become one launch.

The stacked weight is made once after loading (:meth:`SiblingLinears.fuse`); every member then holds a view of its
rows of it (no extra memory) and still runs alone where it is called alone. The stacked weight is not a registered
buffer (the model's buffers list each member's view once, so byte counts stay right): a fast model is not moved
or cast after :func:`.loader.load_fast`, which makes it on its device.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ... import quant
from ...kernels.linear import linear
from ...kernels.packed import PackedWeight, concat_rows
from .layers import PackedLinear, PackedModule


class SiblingLinears:
    """The members' outputs ``[m(x, out_dtype) for m in members]`` from one GEMM once :meth:`fuse` has stacked them
    (each output a column view ``[T, out_i]`` of the stacked ``[T, Σ out_i]`` result); before that, or where
    :meth:`fuse` declined, one call per member. Not an ``nn.Module``: the members stay registered where they are
    (their checkpoint names)."""

    def __init__(self, members: list[PackedLinear]):
        self.members = members
        self.stacked: PackedModule | None = None

    def fuse(self) -> bool:
        """Stack the members' loaded weights and point each member at its rows. Declines (False, nothing changed)
        when they differ in input size, storage format, block or ``fp8_input``, or a member but the last does not
        fill whole scale tiles (the stacked weight would not stay packed)."""
        ms = self.members
        if len(ms) < 2:
            return False
        w = [PackedWeight(m.weight, m.scale, m.fmt, m.block) for m in ms]  # as stored (not a CPU dequantized copy)
        first = w[0]
        if first.data.is_meta or any(
                m.in_features != ms[0].in_features or m.fp8_input != ms[0].fp8_input or m.groups != 1 for m in ms):
            return False
        if any(p.fmt != first.fmt or p.block != first.block or p.data.dtype != first.data.dtype for p in w):
            return False
        if first.fmt != "dense" and any(m.out_features % first.block[0] for m in ms[:-1]):
            return False
        stacked = concat_rows(w)
        rows = sum(m.out_features for m in ms)
        self.stacked = PackedModule((rows, ms[0].in_features))
        self.stacked.set(stacked)
        r0 = 0
        for m in ms:
            r1 = r0 + m.out_features
            scale = None
            if stacked.scale is not None:
                b = first.block[0]
                scale = stacked.scale[r0 // b: -(-r1 // b)]
            m.set(PackedWeight(stacked.data[r0:r1], scale, stacked.fmt, stacked.block))
            r0 = r1
        return True

    def __call__(self, x: Tensor, out_dtype: torch.dtype | None = None) -> list[Tensor]:
        if self.stacked is None:
            return [m(x, out_dtype) for m in self.members]
        if self.members[0].deployed and self.members[0].fp8_input:
            x = quant.fp8_act_qdq(x, 32)
        y = linear(x, self.stacked.packed, out_dtype)
        outs, c0 = [], 0
        for m in self.members:
            outs.append(y[:, c0:c0 + m.out_features])
            c0 += m.out_features
        return outs
