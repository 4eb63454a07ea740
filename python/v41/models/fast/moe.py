"""Mixture of experts in the fast model, routed on the device (docs/model.md §3.8, §4 "MoE"): sqrtsoftplus
router in float32 (:mod:`v41.kernels.router`: log-domain weights, deterministic top-k with exact ties to the lower
expert id, or V4 hash routing), the (token, slot)
pairs sorted by expert, one grouped GEMM for every expert's fused ``w1|w3`` and one for ``w2``
(:mod:`v41.kernels.moe`; MXFP4 experts dequantized in the kernel), the shared expert beside them (optionally on a
second CUDA stream, :mod:`v41.kernels.side_stream`), the routed outputs summed in float32.

Tensor parallelism: every expert (and the shared one) holds the rows ``split_range(I, W, r)`` of ``w1``/``w3``
and those columns of ``w2``; the router is replicated; the routed + shared partial sums take one all-reduce.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ... import quant
from ...distributed.group import SINGLE, TPGroup
from ...kernels.moe import combine_pairs, grouped_linear
from ...kernels.moe_align import route_pairs
from ...kernels.router import route_fused
from ...kernels.side_stream import beside
from ...kernels.swiglu import swiglu
from .layers import PackedLinear, PackedModule


class PackedExperts(PackedModule):
    """A ``[E, out, in]`` packed weight held as buffers (set by the loader)."""

    def __init__(self, n_experts: int, in_features: int, out_features: int):
        super().__init__((n_experts, out_features, in_features))


class FastMoE(nn.Module):
    """Router (``gate [E, D]`` BF16, ``bias [E]`` float32 or V4 ``tid2eid [V, k]``, V4.1 ``bias_vl``), routed
    experts ``w13 [E, 2·I_r, D]`` / ``w2 [E, D, I_r]`` and the shared expert ``shared_w13`` / ``shared_w2``."""

    def __init__(self, dim: int, inter_local: int, n_experts: int, top_k: int, n_shared: int, limit: float, *,
                 gate_temp: float, norm_topk_prob: bool, scaling: float, hash_vocab: int = 0, bias_vl: bool = False,
                 always_renorm: bool = False, tp: TPGroup | None = None):
        super().__init__()
        self.tp = tp or SINGLE
        self.gate = PackedLinear(dim, n_experts)
        if hash_vocab:
            self.register_buffer("tid2eid", torch.zeros(hash_vocab, top_k, dtype=torch.int64))
        else:
            self.bias = nn.Parameter(torch.zeros(n_experts), requires_grad=False)
            if bias_vl:
                self.bias_vl = nn.Parameter(torch.zeros(n_experts), requires_grad=False)
        self.w13 = PackedExperts(n_experts, dim, 2 * inter_local)
        self.w2 = PackedExperts(n_experts, inter_local, dim)
        if n_shared:
            self.shared_w13 = PackedLinear(dim, 2 * inter_local, fp8_input=True)
            self.shared_w2 = PackedLinear(inter_local, dim, fp8_input=True)
        self.deployed = False  # deployed numerics: FP8 inputs of the expert GEMMs, bf16 hidden before w2 (§3.8)
        self.n_shared, self.n_experts, self.top_k, self.limit = n_shared, n_experts, top_k, limit
        self.gate_temp, self.norm_topk_prob, self.scaling = gate_temp, norm_topk_prob, scaling
        self.always_renorm = always_renorm

    @property
    def is_hash(self) -> bool:
        return hasattr(self, "tid2eid")

    def route(self, x: Tensor, token_ids: Tensor) -> tuple[Tensor, Tensor]:
        """x [T, D], token_ids [T] → (expert ids [T, k] int64 in selection order, weights [T, k] float32)."""
        renorm = self.always_renorm or self.is_hash or (self.norm_topk_prob and self.top_k > 1)
        ct = torch.promote_types(x.dtype, torch.float32)
        return route_fused(x, self.gate.packed, None if self.is_hash else self.bias.to(ct),
                           self.tid2eid[token_ids] if self.is_hash else None, self.top_k, self.gate_temp, renorm,
                           self.scaling)

    def _bf16(self, h: Tensor) -> Tensor:
        """Deployed numerics: the reference casts the (weighted) hidden to bf16 before w2 (§3.8)."""
        return h.to(torch.bfloat16).to(h.dtype) if self.deployed else h

    def _w2_input(self, h: Tensor) -> Tensor:
        return quant.fp8_act_qdq(self._bf16(h), 32) if self.deployed else h

    def _shared(self, x: Tensor) -> Tensor:
        return self.shared_w2(self._bf16(swiglu(self.shared_w13(x), self.limit)))

    def forward(self, x: Tensor, token_ids: Tensor) -> Tensor:
        """x [T, D] (replicated), token_ids [T] → [T, D] (full on every rank). The shared expert is queued beside the
        router and the routed experts (on the side stream where :mod:`v41.kernels.side_stream` is enabled)."""
        k = self.top_k
        shared = beside(lambda: self._shared(x), x, "shared_expert") if self.n_shared else None
        ids, weights = self.route(x, token_ids)
        pairs = route_pairs(ids, self.n_experts)
        xq = quant.fp8_act_qdq(x, 32) if self.deployed else x
        h = grouped_linear(xq, self.w13.packed, pairs.offsets, rows=pairs.rows, active=pairs.active)
        h = self._w2_input(swiglu(h, self.limit, weights.reshape(-1), pairs.order))
        y = grouped_linear(h, self.w2.packed, pairs.offsets, active=pairs.active)
        return self.tp.all_reduce(combine_pairs(y, pairs.inv, k, None if shared is None else shared.wait()))
