"""The Engram rows of a whole step, hashed natively (crate ``v41-engram``, docs/model.md §3.3): token ids of every
scheduled request, each with its committed lookback, → table rows of every Engram layer, before the forward.

The Python hasher :class:`v41.models.engram_hash.EngramHasher` builds the compressed token map and the multipliers
once and stays the test oracle; this wraps ``v41._native.EngramHasher`` with the same parameters.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .. import _native
from ..models.engram_hash import EngramHasher


class StepRowHasher:
    """``rows(token_ids, counts, histories)`` → ``{layer id: int64 [T, cols]}`` for one step.

    Raises ValueError (from the crate) for a token id outside the tokenizer's token map."""

    def __init__(self, hasher: EngramHasher):
        self.hasher = hasher  # the Python hasher: token map and constants (async scheduling, :mod:`.pending`)
        self.layer_ids = hasher.layer_ids
        self.vocab = hasher.token_map.size  # token ids the map covers
        self.keep = hasher.max_ngram_size - 1
        self.native = _native.EngramHasher(
            hasher.token_map, hasher.compressed_vocab_size, hasher.pad_token_id, hasher.max_ngram_size,
            hasher.n_heads, hasher.engram_vocab_size,
            [(lid, [int(m) for m in hasher.multipliers[lid]]) for lid in hasher.layer_ids])
        for i, lid in enumerate(self.layer_ids):  # the crate derives the primes itself: they must agree
            assert self.native.primes(i) == [int(p) for p in hasher.primes[lid]], lid

    def rows(self, token_ids: np.ndarray, counts: np.ndarray, histories: Sequence[Sequence[int]]
             ) -> dict[int, np.ndarray]:
        """token_ids int64 [T] (requests concatenated), counts int64 [R], histories: per request its ≤ keep
        committed ids before the run (oldest first; shorter = the sequence starts there)."""
        hist = np.full((len(histories), self.keep), -1, dtype=np.int64)
        for r, h in enumerate(histories):
            h = list(h)[-self.keep:] if self.keep else []
            if h:
                hist[r, self.keep - len(h):] = h
        out = self.native.hash_step(np.ascontiguousarray(token_ids, dtype=np.int64),
                                    np.ascontiguousarray(counts, dtype=np.int64), hist.reshape(-1))
        return {lid: out[i] for i, lid in enumerate(self.layer_ids)}
