"""Mixture of experts: sqrtsoftplus router with the noaux selection bias, V4 hash routing, SwiGLU experts
with clamps (docs/model.md §3.8, §4 "MoE").

Tensor parallelism (``tp``, :mod:`.sharding`): every routed expert and the shared expert hold the rows
``split_range(moe_intermediate_size, W, r)`` of ``w1``/``w3`` and the same columns of ``w2``; SwiGLU and its
clamps are element-wise over the intermediate dim, so each rank's ``w2`` output is a partial sum. The router is
replicated (every rank routes identically) and the routed + shared partial sums take one all-reduce per MoE.
Expert parallelism (split by expert id) is not implemented: see ``v41.distributed.group.MOE_PARALLEL_MODES``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...distributed.group import SINGLE, TPGroup, split_range
from .ops import Linear, stable_topk



class Expert(nn.Module):
    """SwiGLU expert ``w2(silu(min(w1 x, L)) · clamp(w3 x, ±L) · weight)`` (§3.8).

    w1/w3: [inter, D], w2: [D, inter]. The routing weight multiplies ``h`` before ``w2``, as in the V4.1
    reference (transformers V4 multiplies after ``down_proj``: equal in exact arithmetic).
    """

    def __init__(self, dim: int, inter: int, limit: float):
        super().__init__()
        self.w1 = Linear(dim, inter, fp8_input=True)
        self.w2 = Linear(inter, dim, fp8_input=True)
        self.w3 = Linear(dim, inter, fp8_input=True)
        self.limit = limit
        self.deployed = False

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        g = self.w1(x).clamp(max=self.limit)
        u = self.w3(x).clamp(min=-self.limit, max=self.limit)
        h = F.silu(g) * u
        if weight is not None:
            h = h * weight.unsqueeze(-1).to(h.dtype)
        if self.deployed:  # the reference casts the weighted hidden to BF16 before W2's FP8 input (§3.8)
            h = h.to(torch.bfloat16).to(x.dtype)
        return self.w2(h)


class Gate(nn.Module):
    """Router. ``weight [E, D]``; ``bias [E]`` (selection only, noaux_tc); V4.1 also ``bias_vl [E]`` for image
    tokens; V4 hash layers carry ``tid2eid [vocab, k]`` int64 instead of a bias."""

    def __init__(self, dim: int, n_experts: int, top_k: int, *, hash_vocab: int = 0, bias_vl: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, dim), requires_grad=False)
        self.top_k = top_k
        if hash_vocab:
            self.register_buffer("tid2eid", torch.zeros(hash_vocab, top_k, dtype=torch.int64))
        else:
            self.bias = nn.Parameter(torch.zeros(n_experts), requires_grad=False)
            if bias_vl:
                self.bias_vl = nn.Parameter(torch.zeros(n_experts), requires_grad=False)

    @property
    def is_hash(self) -> bool:
        return hasattr(self, "tid2eid")


def log_sqrt_softplus(logits: torch.Tensor) -> torch.Tensor:
    """``log(sqrt(softplus(x)))`` accurate over the whole float range: below x = −20, ``log(softplus(x)) = x``
    to within e^x/2 (< 1e-9), so the scores' logarithm never underflows (docs/numerics.md §4 "Router numerics")."""
    safe = torch.where(logits < -20, torch.zeros_like(logits), logits)
    return 0.5 * torch.where(logits < -20, logits, torch.log(F.softplus(safe)))


def route(gate: Gate, x: torch.Tensor, token_ids: torch.Tensor, *, gate_temp: float, norm_topk_prob: bool,
          scaling: float, always_renorm: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing (§3.8): scores ``s = sqrt(softplus(x·Wgᵀ / gate_temp))`` in ≥ float32, kept as ``log s``.

    x: [T, D]; token_ids: [T] int64 (hash layers). Returns (ids [T, k] int64 in descending selection-score
    order, ties to the lower id; weights [T, k]). Renormalized weights are a softmax of the selected ``log s``:
    ``s_i / Σ s_j`` without underflow, so a row of identical logits gets equal weights at any value (−1000 or
    1000) and never NaN. V4.1 renormalizes only when ``norm_topk_prob`` and k > 1 (the reference); V4
    (``always_renorm``, as transformers does) and hash layers always.
    """
    ctype = torch.promote_types(x.dtype, torch.float32)
    logits = F.linear(x.to(ctype), gate.weight.to(ctype)) / gate_temp
    log_scores = log_sqrt_softplus(logits)
    if gate.is_hash:
        ids = gate.tid2eid[token_ids]
    else:
        ids = stable_topk(torch.exp(log_scores) + gate.bias.to(ctype), gate.top_k)
    picked = log_scores.gather(1, ids)
    if always_renorm or gate.is_hash or (norm_topk_prob and ids.shape[1] > 1):
        weights = torch.softmax(picked, dim=-1)
    else:
        weights = torch.exp(picked)
    return ids, weights * scaling


class MoE(nn.Module):
    """Routed experts + one shared expert; ``out = Σ_k expert_k(x, w_k) + shared(x)`` (§3.8).

    ``inter`` is the full intermediate size; under ``tp`` each expert holds ``split_range(inter, W, r)`` of it
    (module docstring) and :meth:`forward` all-reduces the partial output.
    """

    def __init__(self, dim: int, inter: int, n_experts: int, top_k: int, n_shared: int, limit: float, *,
                 gate_temp: float, norm_topk_prob: bool, scaling: float, hash_vocab: int = 0,
                 bias_vl: bool = False, always_renorm: bool = False, tp: TPGroup | None = None):
        super().__init__()
        self.tp = tp or SINGLE
        i0, i1 = split_range(inter, self.tp.world_size, self.tp.rank)
        self.gate = Gate(dim, n_experts, top_k, hash_vocab=hash_vocab, bias_vl=bias_vl)
        self.experts = nn.ModuleList(Expert(dim, i1 - i0, limit) for _ in range(n_experts))
        self.shared_experts = Expert(dim, i1 - i0, limit) if n_shared else None
        self.gate_temp, self.norm_topk_prob, self.scaling = gate_temp, norm_topk_prob, scaling
        self.always_renorm = always_renorm

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """x: [T, D] (replicated), token_ids: [T] → [T, D] (full on every rank)."""
        ids, weights = route(self.gate, x, token_ids, gate_temp=self.gate_temp,
                             norm_topk_prob=self.norm_topk_prob, scaling=self.scaling,
                             always_renorm=self.always_renorm)
        out = torch.zeros_like(x)
        for e in torch.unique(ids).tolist():
            rows, slot = torch.nonzero(ids == e, as_tuple=True)
            out.index_add_(0, rows, self.experts[e](x[rows], weights[rows, slot]).to(x.dtype))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return self.tp.all_reduce(out)

