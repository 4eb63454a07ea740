"""Indexer top-k cells of ``kernel_bench.py``: the CUDA radix select (``cuda/indexer/select_topk.cu``) against the
path it replaces (Triton order keys, ``torch.topk`` over int64 keys, sort, mask: ``topk.select_topk_ref`` on the
GPU) at the indexer's shapes: k = 512 of N entries per query, decode (T = batch) over a 2,048-token context, long
contexts (128k, 1M entries) and a prefill chunk. Scores are random normal float32; floor = the scores' bytes read
once over the copy bandwidth. The check column is the fraction of ids that differ (0: identical), the larger of the
two CUDA columns'.

Beside them, the index scorer that feeds the top-k (``indexer.index_scores``) at V4.1-Flash's index shape (32
heads × 128, MXFP4 key records of 68 bytes read through a block table of 64-entry blocks, queries of one request):
its floor is the key records plus the written scores, or the q·k FLOPs at the bf16 dense rate where that is larger
(prefill; an 8192³ bf16 GEMM measured in the same call). Columns: CUDA (``cuda/indexer/index_scores.cu`` called
directly, where ``v41._cuda`` runs; else the Triton kernel), Triton at the tiles ``indexer.score_tiles`` picks,
and "1×64 tiles", the Triton kernel before query blocks (one query and 64 entries per program).

    python3 benches/gpu/topk_bench.py --sweep     # the scorer at every tiling of SWEEP_TILES, one table"""

from __future__ import annotations

import argparse

import torch

from event_timing import graph_us, rel
from v41.cache.records import IDX_MXFP4
from v41.kernels import dispatch, indexer, topk

K = 512
HEADS, DIM, BLOCK = 32, 128, 64
SCORE_CELLS = ((1, 2048), (64, 2048), (1, 8192), (8, 8192), (64, 8192), (1, 32768), (8, 32768), (1, 131072),
               (8, 131072), (1, 1 << 20), (64, 1 << 20), (256, 131072), (2048, 8192))
CELLS = ((1, 2048), (8, 2048), (64, 2048), (1, 131072), (8, 131072), (1, 1 << 20), (32, 1 << 20), (2048, 8192))
CUDA_SWEEP = [(1, 128), (1, 256), (1, 512), (1, 1024), (2, 256), (4, 128), (4, 256), (4, 512), (8, 128), (8, 256),
              (8, 512), (8, 1024), (16, 256), (16, 512)]
SWEEP_TILES = [(1, 128, 4), (1, 256, 4), (1, 256, 8), (1, 512, 8), (4, 128, 4), (8, 64, 4), (8, 128, 8),
               (16, 128, 8)]


def ordered_finish(scores, n_valid):
    """The CUDA top-k with its one-CTA rows of up to 8,192 entries finished by the ordered pass
    (``topk.ORDERED_MAX_N = 8192``; the "cuda" column runs the default)."""
    kept, topk.ORDERED_MAX_N = topk.ORDERED_MAX_N, 8192
    try:
        return topk.select_topk(scores, K, n_valid)
    finally:
        topk.ORDERED_MAX_N = kept


def topk_cells(reps: int, bw: float):
    """Rows (op, cell, {path: µs}, floor µs, fraction of ids differing)."""
    rows = []
    for t, n in CELLS:
        inputs = [torch.randn(t, n, device="cuda") for _ in range(2)]
        n_valid = torch.full((t,), n, dtype=torch.int64, device="cuda")
        paths = {"cuda": lambda s: topk.select_topk(s, K, n_valid),
                 "triton": lambda s: topk.select_topk_ref(s, K, n_valid),
                 "cuda, ordered finish": lambda s: ordered_finish(s, n_valid)}
        want = paths["triton"](inputs[0])
        diff = max((paths[p](inputs[0]) != want).float().mean().item() for p in ("cuda", "cuda, ordered finish"))
        calls = max(2, min(reps, (64 << 20) // (t * n)))
        us = {p: graph_us([lambda i=i, f=f: f(inputs[i % 2]) for i in range(calls)]) for p, f in paths.items()}
        rows.append(("indexer top-k 512", f"T={t} N={n:,}", us, 4 * t * n / bw * 1e6, diff))
        del inputs
        torch.cuda.empty_cache()
    return rows


def bf16_rate() -> float:
    """bf16 matmul FLOP/s of this GPU (an 8192³ GEMM, by events): the scorer's compute ceiling."""
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    us = graph_us([lambda: x @ x] * 4)
    return 2 * 8192 ** 3 / (us * 1e-6)


def score_inputs(t: int, n: int, flops: float):
    """(call(tiles), floor µs at bandwidth bw → function) for T queries of one request over n MXFP4 key records
    in a shuffled block table over a cache of exactly the entries listed."""
    keys = IDX_MXFP4.encode(torch.randn(n, DIM, device="cuda"))
    table = torch.randperm(n // BLOCK, device="cuda")[None, :]
    q = (torch.randn(t, HEADS, DIM, device="cuda") * 0.1).to(torch.bfloat16)
    w = torch.randn(t, HEADS, device="cuda")
    req = torch.zeros(t, dtype=torch.int64, device="cuda")
    n_vis = torch.full((t,), n, dtype=torch.int64, device="cuda")
    def call(tiles=None):  # None: the CUDA scorer at cuda_tiles; ("cuda", qb, entries): at those; else Triton
        if tiles is not None and tiles[0] == "cuda":
            out = torch.empty(t, n, dtype=torch.float32, device="cuda")
            dispatch.cuda_ext().index_scores(q, w, keys, table, req, n_vis, out, BLOCK, 1, tiles[1], tiles[2])
            return out
        if tiles is None and dispatch.cuda_runs_on(q.device):
            out = indexer._scores_cuda(q, w, keys, table, req, n_vis, BLOCK, n, IDX_MXFP4)
            if out is not None:
                return out
        return indexer.index_scores(q, w, keys, table, req, n_vis, BLOCK, n, record=IDX_MXFP4,
                                    tiles=tiles or indexer.score_tiles(t, n, 1))

    floor = lambda bw: max((n * IDX_MXFP4.nbytes + 4 * t * n) / bw, 2 * t * n * HEADS * DIM / flops) * 1e6
    return call, floor


def score_cells(reps: int, bw: float, tilings: list | None = None):
    """Rows for the index scorer (module docstring): CUDA, Triton at its picked tiles, the old tiles and ``tilings``."""
    rows, flops = [], bf16_rate()
    for t, n in SCORE_CELLS:
        call, floor = score_inputs(t, n, flops)
        calls = max(2, min(reps, (256 << 20) // (t * n * 4 + n * IDX_MXFP4.nbytes)))
        ref = call()
        us, worst = {}, 0.0
        paths = [("cuda", None), ("triton", indexer.score_tiles(t, n, 1)), ("1×64 tiles", (1, 64, 4))]
        for name, tiles in paths + [(str(c), c) for c in tilings or []]:
            worst = max(worst, rel(call(tiles), ref))
            us[name] = graph_us([lambda c=tiles: call(c)] * calls)
        print(f"T={t} N={n}: " + ", ".join(f"{k} {v:.1f}" for k, v in us.items()), flush=True)
        cuda = indexer.cuda_tiles(t, n, 1, HEADS, dispatch.sm_count(torch.device("cuda")))
        rows.append(("indexer scores", f"T={t} N={n:,} {indexer.score_tiles(t, n, 1)} cuda {cuda}", us, floor(bw),
                     worst))
        del call, ref
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sweep", action="store_true", help="time the scorer at every tiling of SWEEP_TILES")
    ap.add_argument("--cuda-sweep", action="store_true", help="time the CUDA scorer at every (queries, entries) "
                    "per CTA of CUDA_SWEEP")
    ap.add_argument("--reps", type=int, default=8)
    a = ap.parse_args()
    from kernel_bench import copy_bandwidth

    bw = copy_bandwidth()
    tilings = (SWEEP_TILES if a.sweep else []) + ([("cuda", *c) for c in CUDA_SWEEP] if a.cuda_sweep else [])
    rows = score_cells(a.reps, bw, tilings)
    names = list(rows[0][2])
    print(f"\ncopy bandwidth {bw / 1e9:,.0f} GB/s; index scorer µs per launch (graph replay); tiles = "
          "(queries, entries, warps) per program")
    print("| cell | floor µs | " + " | ".join(names) + " | max rel. diff |")
    print("|---" * (len(names) + 3) + "|")
    for _, cell, us, floor, err in rows:
        print(f"| {cell} | {floor:.1f} | " + " | ".join(f"{us[k]:.1f}" for k in names) + f" | {err:.1e} |")


if __name__ == "__main__":
    main()
