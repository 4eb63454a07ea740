"""The sampled rows' parameters on the logits' device without a host synchronisation (docs/architecture.md §3a).

A step's random (non-greedy) rows carry their row index, temperature, top-k, top-p, min-p, 64-bit seed and the
position of their last known token. :class:`SamplingInputs` packs them into one pinned host buffer per dtype and
copies each with one non-blocking copy, so the sampler's kernels queue behind the forward instead of waiting for
it: a ``torch.tensor(list, device="cuda")`` per parameter would synchronise the stream each time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .params import SamplingParams

TOP_P_OFF = 2.0  # a threshold no cumulative probability reaches (rounding can reach 1.0)


@dataclass(frozen=True)
class SamplingRows:
    """The random rows of a step, on the logits' device. ``index`` [n] int64: their rows of the step's logits;
    ``temperature``, ``top_p`` (``TOP_P_OFF`` = off), ``min_p`` [n] float32; ``top_k`` [n] int64 (vocab = off);
    ``seed`` [n] int64 (the Philox key's bits); ``position`` [n] int64. ``use_top_k`` / ``use_top_p`` /
    ``use_min_p``: whether any row filters that way (host flags: the sort runs only when needed)."""

    index: Tensor
    temperature: Tensor
    top_p: Tensor
    min_p: Tensor
    top_k: Tensor
    seed: Tensor
    position: Tensor
    use_top_k: bool
    use_top_p: bool
    use_min_p: bool

    @classmethod
    def of(cls, params: Sequence[SamplingParams], vocab: int, device) -> SamplingRows:
        """Rows 0..n−1 for ``params`` (seeds and positions 0: no draw reads them) built with plain tensor copies,
        for :func:`v41.engine.sampler.sampling_probs`."""
        n = len(params)
        f, i, flags = _pack(params, vocab, range(n), [0] * n, [0] * n)
        return _rows(torch.from_numpy(f).to(device), torch.from_numpy(i).to(device), flags)


def _pack(params: Sequence[SamplingParams], vocab: int, index, seeds, positions):
    n = len(params)
    f = np.empty((3, n), dtype=np.float32)
    i = np.empty((4, n), dtype=np.int64)
    with np.errstate(over="ignore"):  # a temperature beyond float32 becomes inf, as a float32 tensor would hold it
        f[0] = [p.temperature for p in params]
    f[1] = [p.top_p if p.top_p < 1.0 else TOP_P_OFF for p in params]
    f[2] = [p.min_p for p in params]
    i[0] = index
    i[1] = [p.top_k if 1 <= p.top_k < vocab else vocab for p in params]
    i[2] = seeds
    i[3] = positions
    # The flags follow the Python values: a top_p just below 1 or a min_p that round to 1 / 0 in float32 still
    # run their step (renormalising), as the per-row rule says.
    flags = (any(1 <= p.top_k < vocab for p in params), any(p.top_p < 1.0 for p in params),
             any(p.min_p > 0.0 for p in params))
    return f, i, flags


def _rows(f: Tensor, i: Tensor, flags) -> SamplingRows:
    return SamplingRows(i[0], f[0], f[1], f[2], i[1], i[2], i[3], *flags)


class SamplingInputs:
    """Pinned host buffers (float32 [3, capacity], int64 [4, capacity]; two pairs used in turn) and their device
    twins, grown on demand; :meth:`load` fills the first n columns and copies them without blocking the host. A
    pair is reused once its copy has finished, so the host can load step N + 1's rows while the copy of step N's
    still waits behind that step's forward (async scheduling)."""

    def __init__(self, device: torch.device | str, capacity: int = 64):
        self.device = torch.device(device)
        self._turn = 0
        self._done: list[torch.cuda.Event | None] = [None, None]
        self._alloc(capacity)

    def _alloc(self, capacity: int) -> None:
        for ev in self._done:
            if ev is not None:
                ev.synchronize()
        cuda = self.device.type == "cuda"
        self.capacity = capacity
        self.host_f = [torch.zeros(3, capacity, dtype=torch.float32, pin_memory=cuda) for _ in range(2)]
        self.host_i = [torch.zeros(4, capacity, dtype=torch.int64, pin_memory=cuda) for _ in range(2)]
        self.dev_f = self.host_f[0].to(self.device) if cuda else self.host_f[0]
        self.dev_i = self.host_i[0].to(self.device) if cuda else self.host_i[0]

    def load(self, params: Sequence[SamplingParams], index: Sequence[int], seeds: Sequence[int],
             positions: Sequence[int], vocab: int) -> SamplingRows:
        """The rows ``index`` (their ``params``, ``seeds``, ``positions``) on the device: views of the device
        buffers, valid until the next call."""
        n = len(params)
        if n > self.capacity:
            self._alloc(max(n, 2 * self.capacity))
        cuda = self.device.type == "cuda"
        turn = self._turn if cuda else 0
        self._turn = 1 - self._turn
        if self._done[turn] is not None:  # this pair's previous copy has left the pinned buffers
            self._done[turn].synchronize()
        f, i, flags = _pack(params, vocab, index, seeds, positions)
        self.host_f[turn].numpy()[:, :n] = f
        self.host_i[turn].numpy()[:, :n] = i
        if cuda:  # whole buffers (44 bytes per row): the first n columns alone are not contiguous, and PyTorch
            # stages a non-contiguous host source through pageable memory, whose copy may wait for the stream
            self.dev_f.copy_(self.host_f[turn], non_blocking=True)
            self.dev_i.copy_(self.host_i[turn], non_blocking=True)
            self._done[turn] = torch.cuda.Event()
            self._done[turn].record(torch.cuda.current_stream(self.device))
        return _rows(self.dev_f[:, :n], self.dev_i[:, :n], flags)
