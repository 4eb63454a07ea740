"""Async scheduling's input ids that the host does not know yet (docs/architecture.md §3 "The step").

With async scheduling the engine plans and launches step N + 1 while step N still runs on the GPU, before step
N's sampled ids reach the host. The scheduler holds a placeholder (:data:`PENDING_TOKEN`) for each of them
(``v41._native.Scheduler.set_last_token`` replaces it once the id is known), so step N + 1's plan has that
placeholder as the input id of every request that sampled in step N. :func:`pending_rows` finds those token rows
on the host and :class:`PendingResolver` fills them on the device from step N's sampled ids, after the step's
inputs are copied and before its forward: no host synchronisation between the two steps.

Engram rows (docs/model.md §3.3) hash each token with its lookback: ``R_s = XOR_{k ≤ s} v_k·m_k`` over the
compressed ids ``v_0`` (the token) ... ``v_s`` (s tokens back), row ``R_s mod prime_c + offset_c``. Only ``v_0`` is
unknown here, so the host folds the known lookback into the partial XORs ``P_s = XOR_{1 ≤ k ≤ s} v_k·m_k``
(s = 1 .. n − 1, per Engram layer) and the device finishes ``(v_0·m_0 XOR P_s) mod prime_c + offset_c``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..models.engram_hash import EngramHasher

PENDING_TOKEN = 2**32 - 1  # the scheduler's placeholder id (u32::MAX)


@dataclass
class PendingRows:
    """The token rows of a step whose ids are the previous step's sampled ids.

    rows [K] int64: token rows of the step; src [K] int64: their rows of ``sampled``; partial {layer: [K, n − 1]
    int64}: the Engram partial XORs of each row's lookback (module docstring); sampled: the previous step's
    sampled ids, int64 [N] on the model's device."""

    rows: np.ndarray
    src: np.ndarray
    partial: dict[int, np.ndarray]
    sampled: Tensor


def pending_rows(token_ids: np.ndarray, src_of: Sequence[int | None], counts: np.ndarray,
                 histories: Sequence[Sequence[int]] | None, hasher: EngramHasher | None,
                 sampled: Tensor) -> PendingRows | None:
    """Find the placeholder rows of a step and set their host ids to 0 (a valid id for the host's Engram hashing;
    the device overwrites those rows).

    token_ids int64 [T] (requests' tokens concatenated, modified in place); src_of [R]: per request, its row of the
    previous step's sampled ids, None for a request that did not sample there; counts int64 [R] tokens per request;
    histories [R]: the ≤ n − 1 committed ids before each request's first scheduled token (oldest first; only with
    Engram); sampled: the previous step's sampled ids. None when no row is pending.
    Raises RuntimeError when a placeholder belongs to a request that did not sample in the previous step (a bug)
    and ValueError for a lookback id outside the Engram token map."""
    rows = np.flatnonzero(token_ids == PENDING_TOKEN)
    if rows.size == 0:
        return None
    req = np.repeat(np.arange(len(counts)), counts)[rows]
    src = [src_of[r] for r in req.tolist()]
    if any(s is None for s in src):
        raise RuntimeError("a pending input id of a request that did not sample in the previous step")
    token_ids[rows] = 0
    partial: dict[int, np.ndarray] = {}
    if hasher is not None:
        keep = hasher.max_ngram_size - 1
        ids = np.zeros((rows.size, keep), dtype=np.int64)  # column k − 1 = the token k back
        known = np.zeros((rows.size, keep), dtype=bool)
        for i, r in enumerate(req.tolist()):
            h = histories[r][-keep:][::-1]
            ids[i, :len(h)] = h
            known[i, :len(h)] = True
        if np.any(known & ((ids < 0) | (ids >= hasher.token_map.size))):
            raise ValueError(f"token id outside the Engram token map of {hasher.token_map.size} ids")
        vals = np.where(known, hasher.token_map[np.where(known, ids, 0)], hasher.pad).astype(np.int64, copy=False)
        for lid in hasher.layer_ids:
            partial[lid] = np.bitwise_xor.accumulate(vals * hasher.multipliers[lid][1:][None, :], axis=1)
    return PendingRows(rows.astype(np.int64), np.asarray(src, dtype=np.int64), partial, sampled)


def needs_output_ids(params) -> bool:
    """Whether a request's next logits depend on the ids of its output so far (repetition, frequency or presence
    penalty, :mod:`.sampler`): its next step cannot be launched before its last sampled id reaches the host.
    ``params``: its :class:`~.params.SamplingParams`."""
    return params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0


class PendingResolver:
    """Fills a step's pending rows on ``device`` (module docstring): its token ids and, with ``hasher``, its Engram
    rows. ``vocab``: the model's vocabulary; ids the tokenizer's token map does not cover (padded vocabulary rows)
    hash as the pad token. Staging: two pinned int64 buffers used in turn (each reused once its copy finished) and
    one non-blocking copy per step; a plain decode step without Engram (rows and sources both 0 .. k − 1) needs neither:
    it is one device-to-device copy."""

    def __init__(self, device: torch.device | str, hasher: EngramHasher | None, vocab: int):
        self.device = torch.device(device)
        self.layer_ids = hasher.layer_ids if hasher is not None else ()
        self._turn, self._done = 0, [None, None]
        self._alloc(256)
        if hasher is None:
            return
        keep, heads = hasher.max_ngram_size - 1, hasher.n_heads
        token_map = np.full(max(vocab, hasher.token_map.size), hasher.pad, dtype=np.int64)
        token_map[:hasher.token_map.size] = hasher.token_map
        self.token_map = torch.from_numpy(token_map).to(self.device)
        dev = dict(dtype=torch.int64, device=self.device)
        self.m0 = torch.tensor([int(hasher.multipliers[lid][0]) for lid in self.layer_ids], **dev)
        self.primes = torch.tensor(np.stack([hasher.primes[lid] for lid in self.layer_ids]), **dev)
        self.offsets = torch.tensor(np.stack([hasher.offsets[lid] for lid in self.layer_ids]), **dev)
        self.primes = self.primes.view(len(self.layer_ids), 1, keep, heads)
        self.offsets = self.offsets.view(len(self.layer_ids), 1, keep, heads)

    def _alloc(self, n: int) -> None:
        for ev in self._done:
            if ev is not None:
                ev.synchronize()
        pin = self.device.type == "cuda"
        self.host = [torch.empty(n, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self.dev = torch.empty(n, dtype=torch.int64, device=self.device)
        self.capacity = n

    def resolve(self, p: PendingRows, token_ids: Tensor, engram_rows: dict[int, Tensor]) -> None:
        """Write the pending rows of ``token_ids`` [≥ T] int64 and of ``engram_rows`` {layer: [≥ T, cols] int64}
        (device views the step's forward reads) from ``p.sampled``; queued on the current stream."""
        k, layers = p.rows.size, len(self.layer_ids)
        if not layers and p.rows[-1] == k - 1 and np.array_equal(p.src, np.arange(k)):  # rows (sorted, distinct)
            token_ids[:k].copy_(p.sampled[:k])  # 0..k-1 take sampled ids 0..k-1 (plain decode): one copy
            return
        keep = next(iter(p.partial.values())).shape[1] if p.partial else 0
        need = 2 * k + layers * k * keep
        if need > self.capacity:
            self._alloc(max(need, 2 * self.capacity))
        turn, self._turn = self._turn, 1 - self._turn
        if self._done[turn] is not None:
            self._done[turn].synchronize()
        host = self.host[turn].numpy()
        host[:k], host[k:2 * k] = p.rows, p.src
        for i, lid in enumerate(self.layer_ids):
            host[2 * k + i * k * keep:2 * k + (i + 1) * k * keep] = p.partial[lid].reshape(-1)
        staged = self.dev[:need]
        staged.copy_(self.host[turn][:need], non_blocking=True)
        if self.device.type == "cuda":
            self._done[turn] = torch.cuda.Event()
            self._done[turn].record(torch.cuda.current_stream(self.device))
        rows, src = staged[:k], staged[k:2 * k]
        ids = p.sampled.index_select(0, src)
        token_ids.index_copy_(0, rows, ids)
        if not layers:
            return
        partial = staged[2 * k:].view(layers, k, keep, 1)
        v0 = self.token_map.index_select(0, ids)[None, :, None, None] * self.m0.view(layers, 1, 1, 1)
        hashed = (torch.bitwise_xor(v0, partial) % self.primes + self.offsets).view(layers, k, -1)
        for i, lid in enumerate(self.layer_ids):
            engram_rows[lid].index_copy_(0, rows, hashed[i])
