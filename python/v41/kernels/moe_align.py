"""Sorting a step's (token, slot) expert pairs by expert, on the device (docs/architecture.md §3a; docs/kernels.md §2
"MoE"): what the grouped expert GEMMs (:mod:`.moe`) and the combine need, in one launch for decode-sized steps.

For ``ids`` [T, k] (the expert of each token's k routing slots; pair p = t·k + j), :func:`route_pairs` returns a
:class:`PairRouting`:

- ``order`` [P] int64: the flat pair indices sorted by expert, stably (ties keep pair order);
- ``offsets`` [E + 1] int64: expert e's sorted rows are ``[offsets[e], offsets[e+1])``;
- ``active`` [min(E, P)] int64: the experts that own at least one pair, ascending, padded with −1 (the grouped
  GEMM launches one program row per entry; −1 programs exit);
- ``inv`` [P] int64: the inverse permutation, ``inv[order[i]] = i`` (where pair p's output row landed);
- ``rows`` [P] int64: the token row of each sorted pair, ``order // k``.

The PyTorch reference is about twenty small kernels (sort, histogram, scans, scatters) per MoE layer; the Triton
kernel does it in one program for steps of at most :data:`ALIGN_MAX_PAIRS` pairs (every decode step; larger
prefill steps run the reference, where the count does not matter beside the GEMMs). Nothing is read back to the
host: the shapes depend only on T, k and E.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .dispatch import triton, use_triton
from .pdl import triton_kw

ALIGN_MAX_PAIRS = 4096  # one program sorts this many keys (a bitonic sort in registers)
ALIGN_MAX_EXPERTS = 4095


class PairRouting(NamedTuple):
    """The sorted pairs of one MoE layer's step (module docstring)."""

    order: Tensor
    offsets: Tensor
    active: Tensor
    inv: Tensor
    rows: Tensor


def align_pairs(ids: Tensor, n_experts: int) -> tuple[Tensor, Tensor]:
    """ids [T, k] int64 → (order [T·k] int64, offsets [E + 1] int64) as :class:`PairRouting` defines them."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(n_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    return order, offsets


def active_experts(offsets: Tensor, n_slots: int) -> Tensor:
    """The experts that own at least one sorted row, ascending, in ``n_slots`` entries padded with −1."""
    counts = offsets[1:] - offsets[:-1]
    live = counts > 0
    rank = torch.cumsum(live.to(torch.int64), 0) - 1
    out = torch.full((n_slots + 1,), -1, dtype=torch.int64, device=offsets.device)
    slot = torch.where(live, rank, torch.full_like(rank, n_slots))
    out.scatter_(0, slot, torch.arange(counts.shape[0], device=offsets.device))
    return out[:n_slots]


def row_blocks(offsets: Tensor, bm: int, n_blocks: int) -> tuple[Tensor, Tensor]:
    """Blocks of ``bm`` sorted rows, each within one expert, on the device (no host synchronisation): ``owner``
    [n_blocks] int64, the expert of block b (−1 past the last block), and ``first`` [E] int64, expert e's first block.
    Expert e's rows ``[offsets[e], offsets[e+1])`` make ⌈count / bm⌉ blocks, so ``n_blocks`` = ⌈P / bm⌉ + E is
    always enough."""
    blocks = torch.div(offsets[1:] - offsets[:-1] + (bm - 1), bm, rounding_mode="floor")
    ends = torch.cumsum(blocks, 0)
    b = torch.arange(n_blocks, device=offsets.device)
    owner = torch.where(b < ends[-1:], torch.bucketize(b, ends, right=True), torch.full_like(b, -1))
    return owner, ends - blocks


def inverse_order(order: Tensor) -> Tensor:
    """The inverse permutation: ``inv[order[i]] = i``."""
    inv = torch.empty_like(order)
    return inv.scatter_(0, order, torch.arange(order.shape[0], device=order.device))


def route_pairs_ref(ids: Tensor, n_experts: int) -> PairRouting:
    """Reference of :func:`route_pairs` from PyTorch ops."""
    k = ids.shape[1]
    order, offsets = align_pairs(ids, n_experts)
    return PairRouting(order, offsets, active_experts(offsets, min(n_experts, order.shape[0])),
                       inverse_order(order), order // k)


def route_pairs(ids: Tensor, n_experts: int) -> PairRouting:
    """ids [T, k] int64 expert ids in [0, E) → :class:`PairRouting`; one Triton launch where
    :func:`.dispatch.use_triton` says so and the step has at most :data:`ALIGN_MAX_PAIRS` pairs."""
    t, k = ids.shape
    p = t * k
    if p == 0 or p > ALIGN_MAX_PAIRS or n_experts > ALIGN_MAX_EXPERTS or not use_triton(ids, family="moe"):
        return route_pairs_ref(ids, n_experts)
    dev = ids.device
    slots = min(n_experts, p)
    order, inv = (torch.empty(p, dtype=torch.int64, device=dev) for _ in range(2))
    rows = torch.empty(p, dtype=torch.int64, device=dev)
    offsets = torch.empty(n_experts + 1, dtype=torch.int64, device=dev)
    active = torch.empty(slots, dtype=torch.int64, device=dev)
    _align_kernel[(1,)](ids.reshape(-1).contiguous(), order, inv, rows, offsets, active, p, n_experts, slots,
                        K=k, BP=triton.next_power_of_2(p), BE=triton.next_power_of_2(n_experts + 1),
                        **triton_kw(ids.device))
    return PairRouting(order, offsets, active, inv, rows)


if triton is not None:
    import triton.language as tl
    from .pdl import prologue

    @triton.jit
    def _align_kernel(ids_ptr, order_ptr, inv_ptr, rows_ptr, offs_ptr, act_ptr, P, E, SLOTS, K: tl.constexpr,
                      BP: tl.constexpr, BE: tl.constexpr, PDL: tl.constexpr):
        prologue(PDL)
        i = tl.arange(0, BP)
        valid = i < P
        ids = tl.load(ids_ptr + i, mask=valid, other=0)
        ids = tl.where(valid, ids, E)  # padding pairs sort last, into the spare bin E
        # stable sort by expert: unique keys expert·BP + pair
        keys = tl.sort(ids * BP + i)
        order = keys % BP
        tl.store(order_ptr + i, order, mask=valid)
        tl.store(rows_ptr + i, order // K, mask=valid)
        tl.store(inv_ptr + order, i.to(tl.int64), mask=valid)
        counts = tl.histogram(ids.to(tl.int32), BE)  # int32 input: what the interpreter's histogram accepts
        e = tl.arange(0, BE)
        ends = tl.cumsum(counts, 0)
        tl.store(offs_ptr + e, (ends - counts).to(tl.int64), mask=e <= E)  # offsets[E] = P (bin E: padding)
        live = (counts > 0) & (e < E)
        rank = tl.cumsum(live.to(tl.int32), 0) - 1
        n_live = tl.sum(live.to(tl.int32), 0)
        tl.store(act_ptr + rank, e.to(tl.int64), mask=live)
        s = tl.arange(0, BE)
        tl.store(act_ptr + s, tl.full([BE], -1, tl.int64), mask=(s >= n_live) & (s < SLOTS))
