"""Bench-only prefill shortcut for flash_slice.py's decode cells at very long contexts (``--recent-index-prefill``).

The indexer scores every query of a prefill chunk against every visible compressed entry and ranks them: over a
1M-token prefill that is about 1.6·10¹² (query, entry) pairs across V4.1-Flash's index layers. With the
query-blocked scorer and the CUDA top-k the real prefill takes 225 s on an H200 (benches/RESULTS.md
"2026-12-03 (evening)"); this shortcut takes about 60 s, for runs that only need the decode step at that
context: the prefill runs with each index source selecting its ``index_topk`` most recent visible entries
instead; the KV, compressed and index caches are written exactly as in a real prefill (only the prefill's
attention reads differ), and the timed decode steps run the real indexer over every entry.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from v41.models.fast.attention_v4 import V4Attention
from v41.models.fast.attention_v41 import CSA2Attention


def _recent(self, x: Tensor, qr: Tensor, proj: dict[str, Tensor], ctx) -> Tensor:
    """The ``min(index_topk, N)`` most recent visible entry ids per query, ascending (−1 = none)."""
    r = self.plan.ratio
    k = min(self.cfg.index_topk, ctx.n_max[r])
    ids = ctx.n_visible[r][:, None] - k + torch.arange(k, device=x.device)[None, :]
    return torch.where(ids >= 0, ids, torch.full_like(ids, -1))


@contextlib.contextmanager
def recent_index_selection():
    """While active, the fast model's V4.1 and V4 index sources select by recency (module docstring)."""
    saved = CSA2Attention._select, V4Attention._select
    CSA2Attention._select = V4Attention._select = _recent
    try:
        yield
    finally:
        CSA2Attention._select, V4Attention._select = saved
