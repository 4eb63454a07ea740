"""Sparse-MQA cells of ``kernel_bench.py``: the CUDA kernel (``cuda/attention/sparse_mqa.cu``) against the Triton
kernel (its default tiling, and over bf16 rows its wide one, ``sparse_attention.WIDE``, checked against CUDA) and
the bytes floor at V4.1-Flash / V4-Flash shapes (64 heads × 512, a 128-token window plus 512
selected compressed entries per query), decode (T = batch) and a prefill chunk, over bf16 rows and the deployed
records. Key rows are gathered at random from caches far larger than L2; floor = the key bytes a query lists
(each listed row once per token) plus q and o, over the copy bandwidth of the same call."""

from __future__ import annotations

import torch

from event_timing import graph_us, rel
from v41.cache.records import RecordFormat
from v41.kernels import sparse_attention, sparse_mqa

HEADS, DIM, WINDOW, SELECTED = 64, 512, 128, 512
CACHE_ROWS = 1 << 18
FORMATS = {"bf16": (None, None),
           "v41 fp8/fp4": (RecordFormat("swa_fp8", DIM), RecordFormat("ckv_fp4", DIM)),
           "v4 fp8": (RecordFormat("swa_v4", DIM, rope=64), RecordFormat("swa_v4", DIM, rope=64))}


def cache_rows(record: RecordFormat | None) -> torch.Tensor:
    """CACHE_ROWS random rows of DIM values, bf16 or encoded as ``record`` (uint8 [CACHE_ROWS, nbytes])."""
    if record is None:
        return torch.randn(CACHE_ROWS, DIM, device="cuda").to(torch.bfloat16)
    return torch.cat([record.encode(torch.randn(CACHE_ROWS // 8, DIM, device="cuda")) for _ in range(8)])


def _row_bytes(record: RecordFormat | None) -> int:
    return 2 * DIM if record is None else record.nbytes


def attention_cells(batches, reps, bw, prefill: int = 2048, min_tiles=()):
    """Rows (op, cell, {path: µs}, floor µs, rel. diff CUDA vs Triton); ``min_tiles``: values of
    ``sparse_mqa.MIN_TILES_PER_SPLIT`` the decode cells are also timed at (columns ``split≥N``)."""
    rows = []
    default = sparse_mqa.MIN_TILES_PER_SPLIT
    for name, (r0, r1) in FORMATS.items():
        caches = (cache_rows(r0), cache_rows(r1))
        sink = torch.randn(HEADS, device="cuda").to(torch.bfloat16)
        for t in [*batches, prefill]:
            n_inputs = 4 if t < prefill else 2
            inputs = []
            for _ in range(n_inputs):
                q = (torch.randn(t, HEADS, DIM, device="cuda") * 0.1).to(torch.bfloat16)
                win = torch.randint(0, CACHE_ROWS, (t, WINDOW), device="cuda")
                sel = torch.randint(0, CACHE_ROWS, (t, SELECTED), device="cuda")
                inputs.append((q, [(caches[0], win), (caches[1], sel)]))
            paths = {"cuda": lambda q, src: sparse_mqa.sparse_mqa(q, src, sink, DIM ** -0.5, [r0, r1]),
                     "triton": lambda q, src: sparse_attention._sparse_triton(q, src, sink, DIM ** -0.5, [r0, r1])}
            if r0 is None and r1 is None:  # the wide tiling takes bf16 rows only (sparse_attention.WIDE_MIN_TOKENS)
                paths["triton wide"] = lambda q, src: sparse_attention._sparse_triton(q, src, sink, DIM ** -0.5,
                                                                                      [r0, r1], wide=True)
            err = rel(paths["cuda"](*inputs[0]), paths["triton"](*inputs[0]))
            if "triton wide" in paths:
                wide_err = rel(paths["cuda"](*inputs[0]), paths["triton wide"](*inputs[0]))
                assert wide_err < 2e-2, f"triton wide against CUDA: rel. diff {wide_err:.1e} at T = {t}"
            n = reps if t < prefill else 4
            us = {p: graph_us([lambda i=i, f=f: f(*inputs[i % n_inputs]) for i in range(n)]) for p, f in paths.items()}
            for v in min_tiles if t < prefill else ():
                sparse_mqa.MIN_TILES_PER_SPLIT = v
                us[f"split≥{v}"] = graph_us([lambda i=i: paths["cuda"](*inputs[i % n_inputs]) for i in range(n)])
                sparse_mqa.MIN_TILES_PER_SPLIT = default
            per_token = WINDOW * _row_bytes(r0) + SELECTED * _row_bytes(r1) + 2 * HEADS * DIM * 2
            floor = t * per_token / bw * 1e6
            rows.append((f"sparse MQA {name}", f"T={t}", us, floor, err))
            del inputs
        del caches
        torch.cuda.empty_cache()
    return rows
