"""Async scheduling's pending input ids (engine/pending.py): the resolver writes the previous step's sampled ids into
exactly the pending token rows, from the right sampled row, whether or not the rows and their sources are the
identity (plain decode takes a one-copy path, a reordered or partial step the staged index copy)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from v41.engine.pending import PENDING_TOKEN, PendingResolver, pending_rows


@pytest.mark.parametrize("src_of, counts", [
    ([0, 1, 2, 3], [1, 1, 1, 1]),        # plain decode: rows 0..3 take sampled 0..3
    ([1, 0, 2, 3], [1, 1, 1, 1]),        # the last source is k − 1 but the order is not the identity
    ([2, 0, 1, 3], [1, 1, 1, 1]),
    ([0, None, 1], [1, 3, 1]),           # a prefill chunk between two decoding requests
    ([1, 0], [1, 1]),
])
def test_pending_rows_take_their_requests_sampled_ids(src_of, counts):
    sampled = torch.tensor([101, 202, 303, 404])
    token_ids = []
    for r, n in enumerate(counts):
        token_ids += [7 + r] * (n - 1) + [PENDING_TOKEN if src_of[r] is not None else 9]
    host = np.array(token_ids, dtype=np.int64)
    p = pending_rows(host, src_of, np.array(counts, dtype=np.int64), None, None, sampled)
    want = host.copy()
    for row, src in zip(p.rows, p.src):
        want[row] = int(sampled[src])
    device_ids = torch.full((len(token_ids) + 3,), -5, dtype=torch.int64)  # a graph's static rows: longer
    device_ids[:len(token_ids)] = torch.from_numpy(host)
    PendingResolver("cpu", None, 1024).resolve(p, device_ids, {})
    assert device_ids[:len(token_ids)].tolist() == want.tolist()
    assert device_ids[len(token_ids):].tolist() == [-5] * 3
    ends = np.cumsum(counts) - 1
    assert [int(device_ids[e]) for e, s in zip(ends, src_of) if s is not None] == [
        int(sampled[s]) for s in src_of if s is not None]


@pytest.mark.parametrize("seed", range(3))
def test_pending_engram_rows_equal_the_step_hasher_of_the_sampled_ids(seed):
    """The host's partial XORs of each pending row's lookback (histories of 0 .. 5 ids: shorter than, equal to and
    longer than the lookback), finished on the device with the sampled ids, give the rows the native step hasher
    computes once the ids are known; a request that did not sample keeps its own rows; a lookback id outside the
    token map is a ValueError."""
    from pathlib import Path

    from v41.config import load_config
    from v41.engine.engram_rows import StepRowHasher
    from v41.models.engram_loader import engram_hasher

    embedded = Path(__file__).resolve().parents[1] / "python" / "v41" / "embedded"
    hasher = engram_hasher(load_config(embedded), embedded / "tokenizer.json")
    step = StepRowHasher(hasher)
    vocab = hasher.token_map.size
    rng = np.random.default_rng(seed)
    counts = np.array([1, 1, 2, 1, 1, 1], dtype=np.int64)  # request 2 prefills two known ids
    histories = [tuple(rng.integers(0, vocab, size=n).tolist()) for n in (0, 1, 3, 2, 5, 3)]
    src_of = [3, 0, None, 5, 1, 2]
    sampled = torch.from_numpy(rng.integers(0, vocab, size=6))
    known = rng.integers(0, vocab, size=2).tolist()
    host = np.array([PENDING_TOKEN, PENDING_TOKEN, *known, PENDING_TOKEN, PENDING_TOKEN, PENDING_TOKEN],
                    dtype=np.int64)
    planned, actual = host.copy(), host.copy()
    actual[[0, 1, 4, 5, 6]] = [int(sampled[s]) for s in src_of if s is not None]
    want = step.rows(actual, counts, histories)
    p = pending_rows(host, src_of, counts, histories, hasher, sampled)  # sets the pending host ids to 0
    engram = step.rows(host, counts, histories)  # the host's rows, the pending ones overwritten by the resolver
    engram = {lid: torch.from_numpy(v.copy()) for lid, v in engram.items()}
    device_ids = torch.from_numpy(host.copy())
    PendingResolver("cpu", hasher, vocab).resolve(p, device_ids, engram)
    assert device_ids.tolist() == actual.tolist()
    for lid in hasher.layer_ids:
        np.testing.assert_array_equal(engram[lid].numpy(), want[lid])
    bad = list(histories)
    bad[4] = (1, vocab, 2)
    with pytest.raises(ValueError, match="outside the Engram token map"):
        pending_rows(planned, src_of, counts, bad, hasher, sampled)
