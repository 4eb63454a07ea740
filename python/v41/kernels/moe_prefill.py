"""The MoE GEMM of prefill chunks over MXFP4 experts as dequantize-then-grouped-GEMM (docs/kernels.md §2 "MoE").

The W4A16 Triton kernel (:func:`.moe.grouped_linear_triton`) upcasts each FP4 weight tile in registers between its
loads and its MMAs. At prefill sizes that upcast is what bounds it: over V4.1-Flash's experts at 8,192 tokens
(~128 rows per expert) it ran ``w13`` / ``w2`` in 13.8 / 7.1 ms, where PyTorch's grouped bf16 GEMM
(``torch._grouped_mm``, CUTLASS on SM90) over already-dequantized experts took 5.9 / 3.1 ms, at the same products
(``benches/gpu/moe_prefill_paths.py``; benches/RESULTS.md "2026-12-04 (night)"). The dequantization is a pure
stream of bytes (0.53 B read and 2 B written per weight) whose floor is 5.4 / 2.7 ms, and it needs no tensor cores.
So :func:`grouped` pipelines the two over chunks of :data:`CHUNK` experts: a side stream dequantizes chunk i + 1
(:func:`.dequant.dequantize_experts`) into one of two bf16 scratch buffers while the current stream multiplies
chunk i. Scratch: 2 · CHUNK · N · K bf16 (2 · 16 · 4608 · 5120 · 2 B = 1.5 GB for V4.1's ``w13``), freed
after the call, and not in the engine's memory budget (a reason more to keep the path off until it pays).

Measured on the H200 (same bench and section): it does **not** pay yet, and is off (:data:`MIN_ROWS_PER_EXPERT`).
At 8,192 tokens ``w13`` took 16.2–16.6 ms against the W4A16 kernel's 13.8 (2,048 tokens: 14.8–15.0 against 8.1):
about the dequantization (8.6 ms, 1.6× its bytes floor of 5.4) plus the GEMM (5.9), so the two streams barely
overlap — a dequantization grid fills every SM and the GEMM waits for free ones. What would make it pay: the
dequantization at its floor on a bounded number of SMs, leaving the rest to the GEMM (:data:`DEQUANT_PROGRAMS`,
not yet timed).

Same math as :func:`.moe.grouped_linear_ref`: the dequantized weight is exact in bf16, the products are exact in
float32, only the order of the float32 sums differs. Prefill only: the call reads the expert offsets on the host
(one device → host copy) and is never used while a CUDA graph is being captured.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import side_stream
from .dequant import dequantize_experts
from .packed import PackedWeight

# Steps with at least this many (token, expert) pairs per expert on average take this path (0 = never). Off: slower
# than the Triton kernel on the H200 at 32 and 128 pairs per expert (module docstring; moe_prefill_paths.py).
MIN_ROWS_PER_EXPERT = 0
CHUNK = 16  # experts per dequantized chunk
# Programs of each chunk's dequantization (0: one per tile, as measured). The measured pipeline barely overlapped:
# the dequantization grid filled every SM and the GEMM waited. Bounded, it leaves the other SMs to the GEMM beside
# it (the direction benches/RESULTS.md "2026-12-04 (night)" names; moe_prefill_paths.py --chunks 16:32).
DEQUANT_PROGRAMS = 0


def available(x: Tensor, w: PackedWeight) -> bool:
    """Whether :func:`grouped` can take these operands at all: bf16 rows on CUDA, a 3-D MXFP4 weight with N and K
    multiples of 8, a PyTorch with ``torch._grouped_mm``, no graph capture in progress."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and w.fmt == "mxfp4" and w.data.dim() == 3
            and w.shape[1] % 8 == 0 and w.shape[2] % 8 == 0  # rows of 16-byte multiples, as the GEMM's TMA needs
            and hasattr(torch, "_grouped_mm") and not torch.cuda.is_current_stream_capturing())


def grouped(x: Tensor, w: PackedWeight, offsets: Tensor, rows: Tensor | None = None) -> Tensor | None:
    """:func:`.moe.grouped_linear_ref` (x ``[M, K]`` bf16, w ``[E, N, K]`` MXFP4, offsets ``[E + 1]`` int64, rows
    ``[P]`` int64 or None → ``[P, N]`` bf16) dequantize-then-grouped-GEMM when :func:`available` and the pairs per
    expert average at least :data:`MIN_ROWS_PER_EXPERT`; None otherwise (the caller takes another path)."""
    p = x.shape[0] if rows is None else rows.shape[0]
    if not MIN_ROWS_PER_EXPERT or p < MIN_ROWS_PER_EXPERT * w.shape[0] or not available(x, w):
        return None
    return grouped_dequant_mm(x, w, offsets, rows)


def grouped_dequant_mm(x: Tensor, w: PackedWeight, offsets: Tensor, rows: Tensor | None = None,
                       chunk: int | None = None) -> Tensor:
    """The computation of :func:`grouped` without its conditions (CUDA: pipelined over two streams; CPU: the same
    chunks in order, for tests where ``torch._grouped_mm`` has a CPU kernel): x ``[M, K]``, w ``[E, N, K]`` MXFP4,
    offsets ``[E + 1]`` int64 (pairs sorted by expert), rows ``[P]`` int64 or None (x already holds the P rows)
    → ``[P, N]`` in x's dtype; ``chunk`` experts per chunk (None: :data:`CHUNK`). Raises ValueError when K is odd or
    the offsets do not end at P."""
    e, n, k = w.shape
    chunk = chunk or CHUNK
    xs = x if rows is None else x.index_select(0, rows)
    xs = xs.contiguous()  # the GEMM's TMA reads rows of unit stride
    bounds = offsets.tolist()
    if k % 2 or len(bounds) != e + 1 or bounds[-1] != xs.shape[0]:
        raise ValueError(f"{e} experts of K = {k}: offsets must be [E + 1] ending at the {xs.shape[0]} pairs")
    y = torch.empty(xs.shape[0], n, dtype=xs.dtype, device=xs.device)
    chunks = [(a, min(a + chunk, e)) for a in range(0, e, chunk) if bounds[min(a + chunk, e)] > bounds[a]]
    if not chunks:
        return y
    bufs = [torch.empty(min(chunk, e), n, k, dtype=xs.dtype, device=xs.device) for _ in range(min(2, len(chunks)))]
    main = torch.cuda.current_stream(xs.device) if xs.is_cuda else None
    side = side_stream.stream_for(xs.device) if xs.is_cuda else None
    if side is not None:
        side.wait_stream(main)  # the weight, x and the buffers are ready for the side stream
    freed: list[torch.cuda.Event | None] = [None, None]  # per buffer: the GEMM that last read it
    for i, (a, b) in enumerate(chunks):
        buf = bufs[i % 2]
        ready = None
        if side is not None:
            with torch.cuda.stream(side):
                if freed[i % 2] is not None:
                    side.wait_event(freed[i % 2])
                dequantize_experts(w, a, b, buf, DEQUANT_PROGRAMS)
                ready = torch.cuda.Event()
                ready.record(side)
            main.wait_event(ready)
        else:
            dequantize_experts(w, a, b, buf, DEQUANT_PROGRAMS)
        lo, hi = bounds[a], bounds[b]
        offs = offsets[a + 1:b + 1].sub(lo).to(torch.int32)
        y[lo:hi] = torch._grouped_mm(xs[lo:hi], buf[:b - a].transpose(-2, -1), offs=offs)
        if side is not None:
            freed[i % 2] = torch.cuda.Event()
            freed[i % 2].record(main)
    return y

