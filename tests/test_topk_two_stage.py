"""Long rows take ``kernels/topk.py`` ``top_keys``'s two stages (the top k of each piece, then of those): the same
indices as one ``torch.topk`` over the whole row, exact ties to the lower index, −inf and NaN included."""

from __future__ import annotations

import pytest
import torch

from v41.kernels import topk


def _one_stage(scores, k):
    keys = topk.order_keys_ref(scores)
    return topk._LOW32 - (torch.topk(keys, k, dim=-1, sorted=True).values & topk._LOW32)


@pytest.mark.parametrize("n", [129, 1000, 64 * 9])
@pytest.mark.parametrize("k", [1, 20, 64])
def test_two_stages_give_the_one_stage_indices(monkeypatch, n, k):
    monkeypatch.setattr(topk, "SEGMENT", 64)
    g = torch.Generator().manual_seed(n * 31 + k)
    scores = torch.randint(-6, 6, (4, n), generator=g).float() / 2  # many exact ties
    scores[0, ::7] = float("-inf")
    scores[1, 3::11] = float("nan")
    scores[2] = float("-inf")  # a row of nothing visible still yields k indices, the lowest first
    scores[3, -5:] = 100.0  # the winners sit in the padded last piece
    got = topk.stable_topk(scores, k)
    assert torch.equal(got, _one_stage(scores, k))
    assert got[2].tolist() == list(range(k))


def test_short_rows_and_large_k_take_one_stage(monkeypatch):
    monkeypatch.setattr(topk, "SEGMENT", 64)
    calls = []
    real = torch.topk
    monkeypatch.setattr(torch, "topk", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    s = torch.randn(2, 128)
    topk.stable_topk(s, 5)             # n = 2 · SEGMENT: one stage
    topk.stable_topk(torch.randn(2, 300), 65)  # k > SEGMENT: one stage
    assert calls == [(2, 128), (2, 300)]
    topk.stable_topk(torch.randn(2, 300), 5)
    assert calls[2:] == [(2, 5, 64), (2, 25)]
