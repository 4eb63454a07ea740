"""Keyed uniform draws for sampling (docs/speculative-decoding.md §3d): every draw is Philox4x32-10 with key = the
request's 64-bit seed and counter = (vocab column, position, purpose | slot << 8, 0), so a request's draws depend
only on its seed and position, never on the batch, its slot, the TP rank or a process-global generator.

``u = ((x >> 8) + 0.5) · 2^-24`` of the first 32-bit Philox output lies in (0, 1) and is exact in float32, so
``−log(u)`` is finite and positive. The Triton kernel and the PyTorch reference compute the same bits.
Philox: Salmon et al., "Parallel random numbers: as easy as 1, 2, 3" (SC 2011); constants as in Random123.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .dispatch import triton, use_triton
from .pdl import triton_kw

PURPOSE_SAMPLE, PURPOSE_DRAFT, PURPOSE_ACCEPT = 0, 1, 2  # the resample / bonus draw is PURPOSE_SAMPLE
_M0, _M1 = 0xD2511F53, 0xCD9E8D57  # round multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85  # key increments (Weyl)
_MASK = 0xFFFFFFFF
ROUNDS = 10


def _mulhilo(a: int, b: Tensor) -> tuple[Tensor, Tensor]:
    prod = b * a  # < 2**64: int64 wraps but keeps the low 64 bits, which is all we read
    return (prod >> 32) & _MASK, prod & _MASK


def philox_ref(c0: Tensor, c1: Tensor, c2: Tensor, c3: Tensor, k0: Tensor, k1: Tensor) -> Tensor:
    """First 32-bit output of Philox4x32-10 (int64 tensors holding uint32 values, broadcastable)."""
    for _ in range(ROUNDS):
        hi0, lo0 = _mulhilo(_M0, c0)
        hi1, lo1 = _mulhilo(_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + _W0) & _MASK, (k1 + _W1) & _MASK
    return c0


U_MAX = 1.0 - 2.0 ** -24  # the largest float32 below 1


def uniforms_ref(seeds: Tensor, positions: Tensor, vocab: int, purpose: int = PURPOSE_SAMPLE,
                 slots: Tensor | None = None) -> Tensor:
    """[R, vocab] float32 uniforms in (0, 1): row r keyed by ``seeds[r]`` (int64 holding the 64-bit seed's bits)
    at ``positions[r]`` (and draft slot ``slots[r]``, default 0) for ``purpose``."""
    seeds = seeds.to(torch.int64)
    k0 = (seeds & _MASK)[:, None]
    k1 = ((seeds >> 32) & _MASK)[:, None]
    pos = positions.to(torch.int64)
    c1 = (pos & _MASK)[:, None]
    slot = torch.zeros_like(pos) if slots is None else slots.to(torch.int64)
    c2 = ((slot << 8) | purpose)[:, None] & _MASK
    c0 = torch.arange(vocab, dtype=torch.int64, device=seeds.device)[None, :]
    x = philox_ref(c0, c1, c2, torch.zeros_like(c2), k0, k1)
    u = ((x >> 8).to(torch.float32) + 0.5) * 2.0 ** -24
    return torch.clamp(u, max=U_MAX)  # (2^24 − 0.5)·2^-24 rounds to 1.0 in float32: keep u < 1 (q = −log u > 0)


def uniforms(seeds: Tensor, positions: Tensor, vocab: int, purpose: int = PURPOSE_SAMPLE,
             slots: Tensor | None = None) -> Tensor:
    """:func:`uniforms_ref` as one Triton launch where :func:`.dispatch.use_triton` says so."""
    if not use_triton(seeds):
        return uniforms_ref(seeds, positions, vocab, purpose, slots)
    r = seeds.shape[0]
    out = torch.empty(r, vocab, dtype=torch.float32, device=seeds.device)
    if r:
        _uniform_kernel[(r, triton.cdiv(vocab, BLOCK))](
            out, seeds.to(torch.int64).contiguous(), positions.to(torch.int64).contiguous(), _slot_arg(slots, seeds),
            vocab, purpose, HAS_SLOT=slots is not None, BLOCK=BLOCK)
    return out


def keyed_race_ref(weights: Tensor, seeds: Tensor, positions: Tensor, purpose: int = PURPOSE_SAMPLE,
                   slots: Tensor | None = None) -> Tensor:
    """The exponential race over keyed draws: weights [R, V] float32 (>= 0, any positive scale per row) → [R]
    int64 ``argmax_t weights[r, t] / −log u[r, t]`` with ``u = uniforms(seeds, positions, V, purpose, slots)``;
    id ``t`` wins with probability ``weights[r, t] / Σ weights[r]`` (docs/speculative-decoding.md §3d). Ties go to
    the lowest id; a NaN weight wins, as in ``torch.argmax`` (scores of finite weights are finite)."""
    q = uniforms(seeds, positions, weights.shape[1], purpose, slots).log_().neg_()
    return (weights / q).argmax(dim=-1)


def keyed_race(weights: Tensor, seeds: Tensor, positions: Tensor, purpose: int = PURPOSE_SAMPLE,
               slots: Tensor | None = None) -> Tensor:
    """:func:`keyed_race_ref` in two Triton launches where :func:`.dispatch.use_triton` says so (float32
    weights): a program per row and ``RACE_BLOCK`` columns draws its uniforms in registers and keeps its best
    column, a program per row picks the best block. Bit for bit the reference's choice: the same draws, the
    same correctly rounded logarithm (libdevice's ``logf``, as PyTorch's) and division (``div.rn``), lowest id on
    ties. Five launches before, of which the single-row argmax alone took 28 µs at B = 1 (benches/RESULTS.md
    "2026-12-04 (afternoon)")."""
    r, vocab = weights.shape
    if weights.dtype != torch.float32 or r == 0 or vocab == 0 or not use_triton(weights):
        return keyed_race_ref(weights, seeds, positions, purpose, slots)
    w = weights if weights.stride(1) == 1 else weights.contiguous()
    nb = triton.cdiv(vocab, RACE_BLOCK)
    best = torch.empty(r, nb, dtype=torch.float32, device=w.device)
    at = torch.empty(r, nb, dtype=torch.int64, device=w.device)
    out = torch.empty(r, dtype=torch.int64, device=w.device)
    _race_block_kernel[(r, nb)](w, seeds.to(torch.int64).contiguous(), positions.to(torch.int64).contiguous(),
                                _slot_arg(slots, seeds), best, at, vocab, w.stride(0), purpose, nb,
                                HAS_SLOT=slots is not None, BLOCK=RACE_BLOCK, **triton_kw(w.device))
    _race_pick_kernel[(r,)](best, at, out, nb, NB=triton.next_power_of_2(nb), **triton_kw(w.device))
    return out


def _slot_arg(slots: Tensor | None, seeds: Tensor) -> Tensor:
    """The kernels' slot operand: ``slots`` as int64, or any tensor when there are none (HAS_SLOT off: slot 0, no
    zero-filled tensor launched per call)."""
    return seeds if slots is None else slots.to(torch.int64).contiguous()


BLOCK = 1024
RACE_BLOCK = 2048  # vocab columns per program of the race (129,280 columns: 64 programs per row)

if triton is not None:
    import triton.language as tl
    from .pdl import prologue

    @triton.jit
    def _umulhilo(a, b):
        return tl.umulhi(a, b), a * b

    @triton.jit
    def _philox_u(seed_ptr, pos_ptr, slot_ptr, r, cols, purpose, HAS_SLOT: tl.constexpr, BLOCK: tl.constexpr):
        """Row r's uniforms at vocab columns ``cols`` [BLOCK] (module docstring; :func:`uniforms_ref`'s bits)."""
        seed = tl.load(seed_ptr + r)
        k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
        k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
        pos = tl.load(pos_ptr + r)
        if HAS_SLOT:
            slot = tl.load(slot_ptr + r)
        else:
            slot = tl.full([], 0, tl.int64)
        c0 = cols.to(tl.uint32)
        c1 = tl.zeros([BLOCK], dtype=tl.uint32) + (pos & 0xFFFFFFFF).to(tl.uint32)
        c2 = tl.zeros([BLOCK], dtype=tl.uint32) + (((slot << 8) | purpose) & 0xFFFFFFFF).to(tl.uint32)
        c3 = tl.zeros([BLOCK], dtype=tl.uint32)
        m0 = tl.full([BLOCK], 0xD2511F53, dtype=tl.uint32)
        m1 = tl.full([BLOCK], 0xCD9E8D57, dtype=tl.uint32)
        for _ in tl.static_range(10):
            hi0, lo0 = _umulhilo(c0, m0)
            hi1, lo1 = _umulhilo(c2, m1)
            c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
            k0 = k0 + 0x9E3779B9
            k1 = k1 + 0xBB67AE85
        return tl.minimum(((c0 >> 8).to(tl.float32) + 0.5) * 5.9604644775390625e-08, 0.99999994039535522)  # U_MAX

    @triton.jit
    def _uniform_kernel(out_ptr, seed_ptr, pos_ptr, slot_ptr, V, purpose, HAS_SLOT: tl.constexpr,
                        BLOCK: tl.constexpr):
        r, vb = tl.program_id(0), tl.program_id(1)
        cols = vb * BLOCK + tl.arange(0, BLOCK)
        u = _philox_u(seed_ptr, pos_ptr, slot_ptr, r, cols, purpose, HAS_SLOT, BLOCK)
        tl.store(out_ptr + r * V + cols, u, mask=cols < V)

    @triton.jit
    def _race_block_kernel(w_ptr, seed_ptr, pos_ptr, slot_ptr, best_ptr, at_ptr, V, stride_w, purpose, NB,
                           HAS_SLOT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        """best[r, b], at[r, b]: the largest w / −log u of row r's block b and its lowest column (a NaN score counts
        as +inf: the largest, as in torch.argmax, for finite weights; columns past V never win)."""
        prologue(PDL)
        r, vb = tl.program_id(0), tl.program_id(1)
        cols = vb * BLOCK + tl.arange(0, BLOCK)
        q = -tl.log(_philox_u(seed_ptr, pos_ptr, slot_ptr, r, cols, purpose, HAS_SLOT, BLOCK))
        w = tl.load(w_ptr + r.to(tl.int64) * stride_w + cols, mask=cols < V, other=0.0)
        score = tl.math.div_rn(w, q)
        score = tl.where(score != score, float("inf"), score)
        score = tl.where(cols < V, score, float("-inf"))
        i = tl.argmax(score, 0, tie_break_left=True)
        tl.store(best_ptr + r * NB + vb, tl.max(score, 0))
        tl.store(at_ptr + r * NB + vb, (vb * BLOCK + i).to(tl.int64))

    @triton.jit
    def _race_pick_kernel(best_ptr, at_ptr, out_ptr, NB_RUN, NB: tl.constexpr, PDL: tl.constexpr):
        prologue(PDL)
        r = tl.program_id(0)
        b = tl.arange(0, NB)
        best = tl.load(best_ptr + r * NB_RUN + b, mask=b < NB_RUN, other=float("-inf"))
        i = tl.argmax(best, 0, tie_break_left=True)  # the first block holding the row's best: its lowest column
        tl.store(out_ptr + r, tl.load(at_ptr + r * NB_RUN + i))
