"""The CUDA weight-streaming GEMM of ``cuda/linear/wstream.cu`` (docs/kernels.md §2 "Dense FP8 GEMMs", "MoE"):
``y = x · Wᵀ`` for few rows per weight, with MXFP4 (W4A16) or FP8 block-scaled (W8A16) weights read in their
checkpoint layout and converted to bf16 in registers, bf16 tensor-core MMAs with float32 accumulation.

Two entry points, each returning None when the kernel does not take the shapes (the caller then runs Triton or
the reference; :func:`.dispatch.use_cuda` decides whether to try at all):

* :func:`linear`: one weight ``[N_g·G, K_g]`` (``G`` groups of :func:`.linear.linear`), x ``[M, G·K_g]`` bf16,
  M ≤ :data:`MAX_ROWS`.
* :func:`grouped`: expert weights ``[E, N, K]`` over rows sorted by expert (:func:`.moe.grouped_linear`'s
  contract), when the pairs per expert slot (``min(E, P)`` slots) average at most :data:`MAX_ROWS_PER_EXPERT`:
  decode steps; prefill chunks and long verify steps take the Triton kernel.

Both compute what :func:`.linear.linear_ref` / :func:`.moe.grouped_linear_ref` compute (bf16 products are exact;
only the float32 summation order differs). Launch shape: CTAs of 64 output rows per weight; K is split across
CTAs (float32 partials summed in a fixed order by the last CTA of each tile) until about three CTAs per SM exist.
Dense linears load a chunk's activations together with its weights (``x_prefetch``: 8–15 % faster on the big
V4.1 projections); expert GEMMs do not (13–28 % slower there: the registers cost CTAs per SM; benches/RESULTS.md).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import side_stream
from .dispatch import cuda_ext, sm_count
from .pdl import enabled as pdl_enabled
from .packed import PackedWeight

MAX_ROWS = 8              # dense linears: above this the Triton / BLAS paths win (benches/RESULTS.md)
MAX_ROWS_PER_EXPERT = 2   # grouped: pairs per expert slot on average (measured at 1: decode up to B = 64)
ROWS_PER_CTA = 64
CTAS_PER_SM = 3  # split K until this many CTAs per SM (benches/RESULTS.md: 16 and 64 measured slower)
# Weight bytes a split-K CTA streams at least (0: no floor). At one row the small projections split into slices of
# 8–16 KB (V4.1 wkv: 40 slices of 8 KB, 5.7 µs for 0.6 µs of bytes), and the Triton linear was 1.5–1.8× faster with
# 64 KB slices than with 8 KB ones (benches/RESULTS.md "2026-12-04 (afternoon)"). Here it does not pay
# (kernel_bench.py --min-slice, benches/RESULTS.md "2026-12-04 (evening)"): V4.1 wq_a at one row 6.2 µs with no
# floor, 6.7 with 32 KB, 8.1 with 64 KB; the stacked wq_a + wkv 7.1 / 7.8 / 9.1 µs. Off.
MIN_SLICE_BYTES = 0
# Expert GEMMs (no activation prefetch): cap the registers at 96 per thread so 5 CTAs fit per SM instead of 4 (the
# kernel is latency-bound there: 3-6 % faster at B = 8-64, equal at B = 1; benches/RESULTS.md "2026-12-03 (late)").
FIVE_CTAS = True
# Expert GEMMs: double-buffered batches of 2 chunks (cuda/linear/wstream.cu, DBU; 0 = off) for launches whose CTAs
# all fit at once at the variant's occupancy (121-128 registers: DOUBLE_BUFFER_CTAS_PER_SM): decode at one row,
# where the extra registers cost no CTAs. 13-15 % faster at one row (V4.1 w13 37.2 against 44.0 µs, w2 18.8 against
# 22.1; V4 w13 34.0 against 35.3). Batches of 4 (167 registers, 3 CTAs per SM) ran V4.1's 432-CTA w13 in two waves
# (58.9 µs) and were removed.
# Forced on every launch it was 4-5 % slower at 8 rows, and 5-40 % slower on the big dense linears (benches/
# RESULTS.md "2026-12-04 (router, double buffer)"), which therefore never take it: dense linears keep their
# activation prefetch, which excludes the double buffer (without the prefetch, double-buffered, they measured
# 7-26 % slower one by one and flash-slice-v41 B = 1 took 2.74 against 2.46 ms; benches/RESULTS.md "2026-12-04
# (prefill paths)").
DOUBLE_BUFFER = 2
DOUBLE_BUFFER_CTAS_PER_SM = 4
COUNTER_SLOTS = 1 << 16
FMT_CODES = {"mxfp4": 0, "fp8": 1}
CHUNK = {"mxfp4": 128, "fp8": 64}  # inputs per 64-byte chunk of a weight row

_counters: dict[tuple[str, int], Tensor] = {}  # by device and side_stream.lane()


def _takes(x: Tensor, w: PackedWeight, k: int, n_group: int) -> bool:
    """Whether the kernel takes these operands (cuda/bindings.cpp checks the same and raises)."""
    if x.dtype != torch.bfloat16 or w.fmt not in FMT_CODES or w.scale is None or x.stride(-1) != 1:
        return False
    if k % CHUNK[w.fmt] or n_group % 16 or x.stride(0) % 8 or x.data_ptr() % 16 or w.data.data_ptr() % 16:
        return False
    if w.data.stride(-2) % 16 or w.data.stride(-1) != 1:
        return False
    return w.fmt == "mxfp4" or (w.block[1] >= 16 and w.block[1] & (w.block[1] - 1) == 0)  # a power of two


def split_counters(device: torch.device) -> Tensor | None:
    """The zeroed split-K arrival counters of ``device`` (int32 [COUNTER_SLOTS + 2]; each launch of this kernel, of
    the Triton linear or of the CUDA router leaves the first COUNTER_SLOTS zeroed; the last two are the CUDA mHC
    seam's arrival counter, also zero between launches, and its generation word, any value: :mod:`.mhc_cuda`), or
    None while a CUDA graph is being captured and they do not exist yet: made inside a capture they would be zeroed
    only when that graph replays, so such a launch does without them (this kernel: no split-K; the Triton linear:
    its partials summed after the kernel). The engine's eager warm-up
    makes them first. One buffer per device and stream lane (:func:`.side_stream.lane`): two launches that may
    run at once (one on the side stream) never share counters; launches on one stream run in order."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (str(device), side_stream.lane())
    if key not in _counters:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        _counters[key] = torch.zeros(COUNTER_SLOTS + 2, dtype=torch.int32, device=device)
    return _counters[key]


def _launch_shape(slots: int, n: int, k: int, fmt: str, device: torch.device) -> tuple[int, int]:
    """(split, chunks per split): enough CTAs for ``CTAS_PER_SM`` per SM, never more slices than chunks, nor (with
    ``MIN_SLICE_BYTES``) slices of fewer weight bytes than that (a chunk is 64 bytes of each of a CTA's rows)."""
    tiles = slots * -(-n // ROWS_PER_CTA)
    chunks = k // CHUNK[fmt]
    split = max(1, min(chunks, -(-CTAS_PER_SM * sm_count(device) // tiles)))
    if MIN_SLICE_BYTES:
        split = max(1, min(split, chunks * 64 * ROWS_PER_CTA // MIN_SLICE_BYTES))
    if tiles * split > COUNTER_SLOTS:
        split = 1
    return slices(chunks, split)


def slices(chunks: int, split: int) -> tuple[int, int]:
    """(slices, chunks per slice) of ``chunks`` K chunks cut into at most ``split`` equal slices (the last may be
    shorter; 1 ≤ split ≤ chunks)."""
    per = -(-chunks // split)
    return -(-chunks // per), per


def double_buffer_chunks(ctas: int, x_prefetch: bool, sms: int) -> int:
    """The kernel's ``double_buffer`` argument for a launch of ``ctas`` CTAs on ``sms`` SMs: :data:`DOUBLE_BUFFER`
    where the launch loads no activations with its weights (expert GEMMs) and all its CTAs fit at once at the
    variant's occupancy (:data:`DOUBLE_BUFFER_CTAS_PER_SM`), else 0."""
    if not DOUBLE_BUFFER or x_prefetch:
        return 0
    return DOUBLE_BUFFER if ctas <= DOUBLE_BUFFER_CTAS_PER_SM * sms else 0


def _run(x: Tensor, rows: Tensor | None, w: PackedWeight, offsets: Tensor | None, active: Tensor | None,
         p: int, slots: int, n_group: int, x_prefetch: bool) -> Tensor:
    n, k = w.out_features, w.in_features
    y = torch.empty((p, n), dtype=torch.bfloat16, device=x.device)
    split, per = _launch_shape(slots, n, k, w.fmt, x.device)
    counters = split_counters(x.device) if split > 1 else None
    if counters is None:
        split, per = 1, k // CHUNK[w.fmt]
    partial = torch.empty((split, p, n), dtype=torch.float32, device=x.device) if split > 1 else None
    double_buffer = double_buffer_chunks(slots * -(-n // ROWS_PER_CTA) * split, x_prefetch, sm_count(x.device))
    cuda_ext().wstream(x, rows, w.data.view(torch.uint8), w.scale, offsets, active, y, partial,
                       counters, FMT_CODES[w.fmt], n_group, w.block[0],
                       32 if w.fmt == "mxfp4" else w.block[1], slots, split, per,
                       x_prefetch, FIVE_CTAS, double_buffer, pdl_enabled(x.device))
    return y


def linear(x: Tensor, w: PackedWeight, out_dtype: torch.dtype, groups: int = 1) -> Tensor | None:
    """x ``[M, G·K_g]`` bf16 → ``[M, N]`` bf16 for a 2-D fp8 or mxfp4 weight; None when not taken (M outside
    1..MAX_ROWS, another dtype, unaligned operands, K_g not a whole number of chunks). With programmatic dependent
    launch (:mod:`.pdl`) the kernel loads its first weights before it waits for the previous kernel: ``w`` must not
    be written by the kernels queued before it (weights are constants)."""
    m = x.shape[0]
    n, k = w.out_features, w.in_features
    if (not 0 < m <= MAX_ROWS or out_dtype != torch.bfloat16 or w.data.dim() != 2 or n % groups
            or x.shape[1] != groups * k or not _takes(x, w, k, n // groups)):
        return None
    return _run(x, None, w, None, None, m, 1, n // groups, x_prefetch=True)


def grouped(x: Tensor, w: PackedWeight, offsets: Tensor, rows: Tensor | None, active: Tensor) -> Tensor | None:
    """The sorted-pair expert GEMM (:func:`.moe.grouped_linear`): x ``[M, K]`` bf16, w ``[E, N, K]``, offsets
    ``[E+1]`` int64, rows ``[P]`` int64 or None, active ``[min(E, P)]`` int64 (−1 padded) → ``[P, N]``; None
    when not taken (more than MAX_ROWS_PER_EXPERT pairs per slot on average, or operands it cannot read)."""
    p = x.shape[0] if rows is None else rows.shape[0]
    if w.data.dim() != 3:
        return None
    n_exp, n, k = w.shape
    slots = active.shape[0]
    if p == 0 or p > MAX_ROWS_PER_EXPERT * slots or not _takes(x, w, k, n):
        return None
    if offsets.dtype != torch.int64 or active.dtype != torch.int64 or (rows is not None and rows.dtype != torch.int64):
        return None
    return _run(x, rows, w, offsets, active, p, slots, n, x_prefetch=False)
