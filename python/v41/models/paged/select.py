"""Request-by-request indexer helpers of the paged bridge (docs/model.md §3.7; the seed's bounded DSA
indexing): one request's index keys through its block table, and scoring in query chunks so a chunk's
[c, N, heads] scratch stays under ``scratch_bytes`` whatever the context length N."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ...kernels.paged import block_slots, gather_slots


def request_keys(keys_cache: torch.Tensor, block_table_row: torch.Tensor, n_entries: int,
                 rows_per_block: int) -> torch.Tensor:
    """Index keys 0..n_entries−1 of one request: keys_cache [slots, di], block_table_row [1, B] → [N, di]."""
    ent = torch.arange(n_entries, device=keys_cache.device)[None, :]
    return gather_slots(keys_cache, block_slots(block_table_row, ent, rows_per_block))[0]


def chunked_select(score: Callable[[int, int], torch.Tensor], n_queries: int, n_entries: int, n_heads: int,
                   itemsize: int, scratch_bytes: int,
                   select: Callable[[torch.Tensor, int, int], torch.Tensor]) -> torch.Tensor:
    """Score queries [a, e) with ``score(a, e)`` → [e−a, N] and reduce each chunk with ``select(scores, a,
    e)`` → [e−a, k]; chunks hold at most ``scratch_bytes`` of [c, N, heads] scratch. Returns [n_queries, k]."""
    per_query = max(1, n_entries * n_heads * itemsize * 2)
    chunk = max(1, scratch_bytes // per_query)
    return torch.cat([select(score(a, min(n_queries, a + chunk)), a, min(n_queries, a + chunk))
                      for a in range(0, n_queries, chunk)])


def pad_cat(rows: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate [n_i, k_i] int tensors along dim 0, right-padding each to max k_i with −1."""
    width = max(t.shape[1] for t in rows)
    return torch.cat([F.pad(t, (0, width - t.shape[1]), value=-1) for t in rows])
