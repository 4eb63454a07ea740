"""MoE routing of a step in one kernel (docs/model.md §3.8, §4 "MoE"; docs/numerics.md §4 "Router numerics").

From the router logits ``l`` [T, E] (float32): ``log s = ½·log(softplus(l / temp))`` (``= ½·l/temp`` below −20,
so nothing underflows); selection = the top-k of ``s + bias`` with exact ties to the lower expert id (or the
given hash ids, V4's ``tid2eid``); weights = ``softmax`` of the selected ``log s`` when renormalized (equal weights
for equal logits at any value, never NaN), else ``s``; times ``scaling``.

:func:`route_fused` starts from the MoE input and the gate instead of the logits: where :data:`CUDA_ROUTER` is on
and :func:`.dispatch.use_cuda` says so, decode steps (≤ :data:`CUDA_ROUTER_MAX_TOKENS` tokens of the kernel's 16,
bf16, a bf16 gate of ≤ 512 experts) take the
CUDA router of ``cuda/moe/router.cu`` — the gate GEMV and the routing in one launch — else the gate linear
(float32 output) and :func:`route`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import wstream
from .dispatch import cuda_ext, triton, use_cuda, use_triton
from .linear import linear
from .packed import PackedWeight
from .pdl import enabled as pdl_enabled
from .pdl import triton_kw
from .topk import stable_topk

# The CUDA router for decode steps of at most CUDA_ROUTER_MAX_TOKENS tokens (tests/test_gpu_cuda_router.py passes on
# the H200). glue_bench.py --ops router, V4.1's gate [384, 5120] with top-6: 8.8 µs against 9.8 for the Triton gate
# linear + route kernel at one token, 9.4 / 10.6 / 16.3 against 9.2 / 9.5 / 9.6 at 2 / 4 / 8 tokens, where each
# warp's x pieces cost more than the Triton GEMM's tiles (benches/RESULTS.md "2026-12-04 (router, double buffer)").
CUDA_ROUTER = True
CUDA_ROUTER_MAX_TOKENS = 1
ROUTER_MAX_TOKENS, ROUTER_MAX_K, ROUTER_MAX_EXPERTS = 16, 16, 512  # cuda/moe/router.h


def log_sqrt_softplus(x: Tensor) -> Tensor:
    """``log(sqrt(softplus(x)))``, accurate over the whole float range (module docstring)."""
    safe = torch.where(x < -20, torch.zeros_like(x), x)
    return 0.5 * torch.where(x < -20, x, torch.log(F.softplus(safe)))


def route_ref(logits: Tensor, bias: Tensor | None, hash_ids: Tensor | None, top_k: int, gate_temp: float,
              renorm: bool, scaling: float) -> tuple[Tensor, Tensor]:
    """logits [T, E] float32; bias [E] (None for hash routing); hash_ids [T, k] or None. Returns (ids [T, k] int64,
    weights [T, k] float32)."""
    ls = log_sqrt_softplus(logits / gate_temp)
    ids = hash_ids if hash_ids is not None else stable_topk(torch.exp(ls) + bias, top_k)
    picked = ls.gather(1, ids)
    weights = torch.softmax(picked, dim=-1) if renorm else torch.exp(picked)
    return ids, weights * scaling


def route(logits: Tensor, bias: Tensor | None, hash_ids: Tensor | None, top_k: int, gate_temp: float,
          renorm: bool, scaling: float) -> tuple[Tensor, Tensor]:
    """:func:`route_ref` as one Triton launch (one program per token) where :func:`.dispatch.use_triton` says
    so (float32 logits, k ≤ 16)."""
    t, e = logits.shape
    if not use_triton(logits, family="moe") or logits.dtype != torch.float32 or top_k > 16 or t == 0:
        return route_ref(logits, bias, hash_ids, top_k, gate_temp, renorm, scaling)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    logits = logits.contiguous()
    _route_kernel[(t,)](logits, logits if bias is None else bias, ids if hash_ids is None else hash_ids.contiguous(),
                        ids, weights, e, float(gate_temp), float(scaling), K=top_k, KP=triton.next_power_of_2(top_k),
                        BE=triton.next_power_of_2(e), HASH=hash_ids is not None, RENORM=renorm,
                        **triton_kw(logits.device))
    return ids, weights


def route_fused(x: Tensor, gate: PackedWeight, bias: Tensor | None, hash_ids: Tensor | None, top_k: int,
                gate_temp: float, renorm: bool, scaling: float) -> tuple[Tensor, Tensor]:
    """:func:`route` of the float32 logits ``linear(x, gate)``: x [T, D], gate [E, D] (its storage format), bias
    [E] float32 or None, hash_ids [T, k] int64 or None → (ids [T, k] int64, weights [T, k] float32). One CUDA
    launch where the CUDA router takes the step (module docstring)."""
    extra = [t for t in (bias, hash_ids) if t is not None]
    if CUDA_ROUTER and x.shape[0] <= CUDA_ROUTER_MAX_TOKENS and use_cuda(x, gate.data, *extra, family="moe"):
        got = _route_cuda(x, gate, bias, hash_ids, top_k, gate_temp, renorm, scaling)
        if got is not None:
            return got
    ct = torch.promote_types(x.dtype, torch.float32)
    return route(linear(x, gate, ct), bias, hash_ids, top_k, gate_temp, renorm, scaling)


def _route_cuda(x: Tensor, gate: PackedWeight, bias: Tensor | None, hash_ids: Tensor | None, top_k: int,
                gate_temp: float, renorm: bool, scaling: float) -> tuple[Tensor, Tensor] | None:
    """The CUDA router, or None when it does not take the operands (cuda/bindings_glue.cpp checks the same)."""
    w = gate.data
    if x.dim() != 2 or (bias is None) == (hash_ids is None):
        return None
    t, d = x.shape
    if (gate.fmt != "dense" or w.dtype != torch.bfloat16 or w.dim() != 2 or not w.is_contiguous()
            or w.data_ptr() % 16 or x.dtype != torch.bfloat16 or x.stride(1) != 1 or x.stride(0) % 8
            or x.data_ptr() % 16 or d % 8 or not 0 < t <= ROUTER_MAX_TOKENS or w.shape[1] != d):
        return None
    e = w.shape[0]
    if not 0 < top_k <= min(ROUTER_MAX_K, e) or e > ROUTER_MAX_EXPERTS:
        return None
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous() or bias.numel() != e):
        return None
    if hash_ids is not None and (hash_ids.dtype != torch.int64 or hash_ids.shape != (t, top_k)):
        return None
    counters = wstream.split_counters(x.device)
    if counters is None:
        return None
    ids = torch.empty(t, top_k, dtype=torch.int64, device=x.device)
    weights = torch.empty(t, top_k, dtype=torch.float32, device=x.device)
    logits = torch.empty(t, e, dtype=torch.float32, device=x.device)
    cuda_ext().router(x, w, bias, None if hash_ids is None else hash_ids.contiguous(), logits, ids, weights,
                      counters, float(gate_temp), float(scaling), renorm, pdl_enabled(x.device))
    return ids, weights


if triton is not None:
    import triton.language as tl
    from .pdl import prologue

    @triton.jit
    def _log_sqrt_softplus(x):
        z = tl.exp(-tl.abs(x))  # softplus(x) = max(x, 0) + log1p(e^-|x|), log1p by its series for small z
        l1p = tl.where(z < 1e-4, z * (1.0 - z * (0.5 - z / 3.0)), tl.log(1.0 + z))
        sp = tl.maximum(x, 0.0) + l1p
        return 0.5 * tl.where(x < -20.0, x, tl.log(tl.where(x < -20.0, 1.0, sp)))

    @triton.jit
    def _route_kernel(l_ptr, bias_ptr, hash_ptr, ids_ptr, w_ptr, E, temp, scaling, K: tl.constexpr,
                      KP: tl.constexpr, BE: tl.constexpr, HASH: tl.constexpr, RENORM: tl.constexpr, PDL: tl.constexpr):
        prologue(PDL)
        t = tl.program_id(0)
        re = tl.arange(0, BE)
        emask = re < E
        ls = _log_sqrt_softplus(tl.load(l_ptr + t * E + re, mask=emask, other=0.0) / temp)
        rk = tl.arange(0, KP)
        picked = tl.full([KP], float("-inf"), dtype=tl.float32)
        chosen = tl.zeros([KP], dtype=tl.int64)
        if HASH:
            chosen = tl.load(hash_ptr + t * K + rk, mask=rk < K, other=0)
            for j in tl.static_range(K):
                idx = tl.sum(tl.where(rk == j, chosen, 0))
                val = tl.sum(tl.where(re == idx, ls, 0.0))
                picked = tl.where(rk == j, val, picked)
        else:
            sel = tl.where(emask, tl.exp(ls) + tl.load(bias_ptr + re, mask=emask, other=0.0), float("-inf"))
            for j in tl.static_range(K):
                best = tl.max(sel, axis=0)
                idx = tl.min(tl.where(sel == best, re, BE), axis=0)  # exact ties: the lower expert id
                chosen = tl.where(rk == j, idx.to(tl.int64), chosen)
                picked = tl.where(rk == j, tl.sum(tl.where(re == idx, ls, 0.0)), picked)
                sel = tl.where(re == idx, float("-inf"), sel)
        if RENORM:
            m = tl.max(picked, axis=0)
            p = tl.exp(picked - m)
            w = p / tl.sum(p, axis=0)
        else:
            w = tl.exp(picked)
        tl.store(ids_ptr + t * K + rk, chosen, mask=rk < K)
        tl.store(w_ptr + t * K + rk, w * scaling, mask=rk < K)
