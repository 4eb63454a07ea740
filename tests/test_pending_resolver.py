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
