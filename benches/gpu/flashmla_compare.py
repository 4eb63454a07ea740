"""v41's CUDA sparse MQA against FlashMLA's SM90 sparse kernels (issue 17's public-kernel comparison): the same
cache contents, queries, sink and listed rows, at V4-Flash shapes (64 heads × 512, a 128-token window plus 512
selected compressed entries per query, as ``attention_bench.py``): decode over V4's FP8 rows, and a prefill chunk
over bf16 rows.

    bash benches/gpu/flashmla/stage.sh FLASHMLA_GIT_DIR CUTLASS_GIT_DIR     # here, once (writes .flashmla/)
    python3 benches/gpu/flashmla_compare.py [--batches 1,8,64] [--prefill 2048] [--reps 24]   # on the GPU

FlashMLA's "MODEL1" format is V4's 584-byte row (448 FP8 codes, 64 bf16 RoPE dims, 7 E8M0 scales and a pad
byte), stored by page block: a block's codes and RoPE dims of every token first, then every token's 8 scale
bytes. v41's ``swa_v4`` record keeps each token's 584 bytes together, so the bench writes a re-laid copy of the
same bytes for FlashMLA (page blocks of 64 tokens; a row's index is the same in both). The window rows are its
``extra_k_cache``. Each cell checks both outputs against the float32 reference
(``sparse_attention.sparse_mqa_sink_ref`` over the decoded rows) and times each kernel as CUDA-graph replays of
``--reps`` launches over 4 sets of inputs (FlashMLA: its decode and combine kernels; its split schedule is made
once per shape, as its interface caches it). Floor = the listed rows' bytes plus q and o over the copy bandwidth
of the call. A last decode row lists some rows as −1 (none) to compare how each treats them. The prefill cell
gives FlashMLA both sources as one bf16 array and one list of 640 rows per query (its prefill kernel reads one
source). Prints the tables last.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from attention_bench import CACHE_ROWS, DIM, FORMATS, HEADS, SELECTED, WINDOW, cache_rows
from event_timing import graph_us, rel
from kernel_bench import copy_bandwidth
from v41.kernels import sparse_attention, sparse_mqa

sys.path.insert(0, str(Path(__file__).with_name("flashmla")))
from flashmla_ext import load  # noqa: E402 - the FlashMLA extension's builder beside this script

PAGE = 64  # FlashMLA page block (tokens)
RECORD = FORMATS["v4 fp8"][0]


def paged(rows: torch.Tensor) -> torch.Tensor:
    """v41 records [S, 584] (S a multiple of PAGE) → FlashMLA's MODEL1 cache [S / PAGE, PAGE, 1, 584]: per page
    block the first 576 bytes of every row, then the 8 scale bytes of every row."""
    blocks = rows.view(-1, PAGE, RECORD.nbytes)
    data = blocks[:, :, :576].reshape(blocks.shape[0], -1)
    scales = blocks[:, :, 576:].reshape(blocks.shape[0], -1)
    return torch.cat([data, scales], dim=1).view(-1, PAGE, 1, RECORD.nbytes)


class Cells:
    """The shared caches (v41 records and FlashMLA's re-laid copy of the same bytes) and sink of every cell."""

    def __init__(self, fm, reps: int, bw: float):
        self.fm, self.reps, self.bw = fm, reps, bw
        self.caches = (cache_rows(RECORD), cache_rows(RECORD))  # window rows, compressed rows
        self.fm_caches = tuple(paged(c) for c in self.caches)
        self.sink = torch.randn(HEADS, device="cuda").to(torch.bfloat16)
        self.scale = DIM ** -0.5

    def ours(self, q, win, sel):
        return sparse_mqa.sparse_mqa(q, [(self.caches[0], win), (self.caches[1], sel)], self.sink, self.scale,
                                     [RECORD, RECORD])

    def flashmla(self, q, win32, sel32, meta, splits):
        t = q.shape[0]
        return self.fm.sparse_decode(q.view(t, 1, HEADS, DIM), self.fm_caches[1], sel32, self.sink.float(),
                                     self.fm_caches[0], win32, meta, splits, self.scale).view(t, HEADS, DIM)

    def prefill_cell(self, t: int):
        """The decode cell's figures for a prefill chunk of ``t`` queries over bf16 rows (v41: its two sources;
        FlashMLA: both caches as one array, each query's 640 rows as one list)."""
        rows = (cache_rows(None), cache_rows(None))
        kv = torch.cat(rows).view(-1, 1, DIM)
        sink = self.sink.float()
        inputs = []
        for _ in range(2):
            q = (torch.randn(t, HEADS, DIM, device="cuda") * 0.1).to(torch.bfloat16)
            win = torch.randint(0, CACHE_ROWS, (t, WINDOW), device="cuda")
            sel = torch.randint(0, CACHE_ROWS, (t, SELECTED), device="cuda")
            inputs.append((q, win, sel, torch.cat([win, sel + CACHE_ROWS], dim=1).int().view(t, 1, -1)))

        def ours(q, win, sel):
            return sparse_mqa.sparse_mqa(q, [(rows[0], win), (rows[1], sel)], self.sink, self.scale, [None, None])

        q, win, sel, idx = inputs[0]
        want = sparse_attention.sparse_mqa_sink_ref(q.float(), [(rows[0].float(), win), (rows[1].float(), sel)],
                                                    sink, self.scale)
        got = {"v41": ours(q, win, sel), "FlashMLA": self.fm.sparse_prefill(q, kv, idx, sink, self.scale)}
        us = {"v41": graph_us([lambda i=i: ours(*inputs[i % 2][:3]) for i in range(4)]),
              "FlashMLA": graph_us([lambda i=i: self.fm.sparse_prefill(inputs[i % 2][0], kv, inputs[i % 2][3], sink,
                                                                       self.scale) for i in range(4)])}
        per_token = (WINDOW + SELECTED) * DIM * 2 + 2 * HEADS * DIM * 2
        row = (f"prefill T={t}, bf16 rows", us, t * per_token / self.bw * 1e6,
               {k: rel(v, want) for k, v in got.items()}, rel(got["v41"], got["FlashMLA"]))
        print(row, flush=True)
        return row

    def cell(self, t: int, none_rows: bool = False):
        """(label, {kernel: µs}, floor µs, {kernel: rel. err vs the reference}, rel. diff v41 vs FlashMLA) at
        batch ``t``; ``none_rows``: every third window row and every fourth selected row listed as −1."""
        inputs = []
        for _ in range(4):
            q = (torch.randn(t, HEADS, DIM, device="cuda") * 0.1).to(torch.bfloat16)
            win = torch.randint(0, CACHE_ROWS, (t, WINDOW), device="cuda")
            sel = torch.randint(0, CACHE_ROWS, (t, SELECTED), device="cuda")
            if none_rows:
                win[:, ::3] = -1
                sel[:, 1::4] = -1
            inputs.append((q, win, sel, win.int().view(t, 1, -1), sel.int().view(t, 1, -1)))
        meta, splits = self.fm.plan(inputs[0][4], inputs[0][3])
        q, win, sel, win32, sel32 = inputs[0]
        want = sparse_attention.sparse_mqa_sink_ref(q.float(), [(self.caches[0], win), (self.caches[1], sel)],
                                                    self.sink.float(), self.scale, [RECORD, RECORD])
        got = {"v41": self.ours(q, win, sel), "FlashMLA": self.flashmla(q, win32, sel32, meta, splits)}
        us = {"v41": graph_us([lambda i=i: self.ours(*inputs[i % 4][:3]) for i in range(self.reps)]),
              "FlashMLA": graph_us([lambda i=i: self.flashmla(inputs[i % 4][0], *inputs[i % 4][3:], meta, splits)
                                    for i in range(self.reps)])}
        per_token = (WINDOW + SELECTED) * RECORD.nbytes + 2 * HEADS * DIM * 2
        row = (f"B={t}" + (" (−1 rows)" if none_rows else ""), us, t * per_token / self.bw * 1e6,
               {k: rel(v, want) for k, v in got.items()}, rel(got["v41"], got["FlashMLA"]))
        print(row, flush=True)
        return row


def table(rows, bw: float) -> None:
    print(f"\nV4 sparse MQA, decode over fp8 rows, prefill over bf16 rows ({torch.cuda.get_device_name()}; copy "
          f"{bw / 1e9:,.0f} GB/s), µs per launch (graph replay)")
    print("| cell | v41 CUDA | FlashMLA | floor | v41 / floor | FlashMLA / floor | v41 / FlashMLA | rel. err v41 / "
          "FlashMLA (vs float32 ref.) | v41 vs FlashMLA |")
    print("|---|---|---|---|---|---|---|---|---|")
    for cell, us, floor, errs, diff in rows:
        print(f"| {cell} | {us['v41']:.1f} | {us['FlashMLA']:.1f} | {floor:.1f} | {us['v41'] / floor:.2f}× | "
              f"{us['FlashMLA'] / floor:.2f}× | {us['v41'] / us['FlashMLA']:.2f}× | {errs['v41']:.1e} / "
              f"{errs['FlashMLA']:.1e} | {diff:.1e} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--prefill", type=int, default=2048, help="queries of the prefill cell (0: none)")
    ap.add_argument("--reps", type=int, default=24)
    a = ap.parse_args()
    fm = load()
    if fm is None:
        sys.exit(1)
    bw = copy_bandwidth()
    run = Cells(fm, a.reps, bw)
    batches = [int(b) for b in a.batches.split(",")]
    table([run.cell(t) for t in batches] + ([run.prefill_cell(a.prefill)] if a.prefill else []), bw)
    table([run.cell(batches[-1], none_rows=True)], bw)  # last: a kernel that faulted here would stop the run


if __name__ == "__main__":
    main()
