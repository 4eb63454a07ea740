"""Indexer top-k cells of ``kernel_bench.py``: the CUDA radix select (``cuda/indexer/select_topk.cu``) against the
path it replaces (Triton order keys, ``torch.topk`` over int64 keys, sort, mask: ``topk.select_topk_ref`` on the
GPU) at the indexer's shapes: k = 512 of N entries per query, decode (T = batch) over a 2,048-token context, long
contexts (128k, 1M entries) and a prefill chunk. Scores are random normal float32; floor = the scores' bytes read
once over the copy bandwidth. The check column is the fraction of ids that differ (0: identical).

Beside them, the Triton index scorer that feeds the top-k (``indexer.index_scores``) at V4.1-Flash's index shape
(64 heads × 128, MXFP4 key records of 68 bytes read through a block table of 64-entry blocks): its floor is the
key records plus the written scores; there is no CUDA scorer yet, so its CUDA column repeats the Triton time."""

from __future__ import annotations

import torch

from event_timing import graph_us
from v41.cache.records import IDX_MXFP4
from v41.kernels import indexer, topk

K = 512
HEADS, DIM, BLOCK = 64, 128, 64
SCORE_CELLS = ((1, 2048), (64, 2048), (1, 131072), (1, 1 << 20))
CELLS = ((1, 2048), (8, 2048), (64, 2048), (1, 131072), (8, 131072), (1, 1 << 20), (32, 1 << 20), (2048, 8192))


def topk_cells(reps: int, bw: float):
    """Rows (op, cell, {path: µs}, floor µs, fraction of ids differing)."""
    rows = []
    for t, n in CELLS:
        inputs = [torch.randn(t, n, device="cuda") for _ in range(2)]
        n_valid = torch.full((t,), n, dtype=torch.int64, device="cuda")
        paths = {"cuda": lambda s: topk.select_topk(s, K, n_valid),
                 "triton": lambda s: topk.select_topk_ref(s, K, n_valid)}
        diff = (paths["cuda"](inputs[0]) != paths["triton"](inputs[0])).float().mean().item()
        calls = max(2, min(reps, (64 << 20) // (t * n)))
        us = {p: graph_us([lambda i=i, f=f: f(inputs[i % 2]) for i in range(calls)]) for p, f in paths.items()}
        rows.append(("indexer top-k 512", f"T={t} N={n:,}", us, 4 * t * n / bw * 1e6, diff))
        del inputs
        torch.cuda.empty_cache()
    return rows


def score_cells(reps: int, bw: float):
    """Rows for the Triton index scorer (module docstring), keys in a shuffled block table over a cache of
    exactly the entries listed."""
    rows = []
    for t, n in SCORE_CELLS:
        keys = IDX_MXFP4.encode(torch.randn(n, DIM, device="cuda"))
        table = torch.randperm(n // BLOCK, device="cuda")[None, :]
        q = (torch.randn(t, HEADS, DIM, device="cuda") * 0.1).to(torch.bfloat16)
        w = torch.randn(t, HEADS, device="cuda")
        req = torch.zeros(t, dtype=torch.int64, device="cuda")
        n_vis = torch.full((t,), n, dtype=torch.int64, device="cuda")
        call = lambda: indexer.index_scores(q, w, keys, table, req, n_vis, BLOCK, n, record=IDX_MXFP4)
        us = graph_us([call] * max(2, min(reps, (256 << 20) // (t * n * 4 + n * IDX_MXFP4.nbytes))))
        floor = (n * IDX_MXFP4.nbytes + 4 * t * n) / bw * 1e6
        rows.append(("indexer scores (Triton)", f"T={t} N={n:,}", {"cuda": us, "triton": us}, floor, 0.0))
        del keys
        torch.cuda.empty_cache()
    return rows
