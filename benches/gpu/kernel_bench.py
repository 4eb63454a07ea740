"""The CUDA kernels of ``cuda/`` against the Triton kernels and the bytes floor, at V4.1-Flash / V4-Flash decode
shapes (docs/benchmarking.md "How a figure is taken"; issue 17's per-kernel table).

    python3 benches/gpu/kernel_bench.py [--batches 1,8,64] [--reps 24] [--ops linears,experts,attention,topk]
        [--sweep 2,3,8] [--splits 1,2,4] [--double-buffer 2,2:5] [--min-slice 32768,65536] [--five-ctas]
        [--linear-tiles 64:128:4:4]

Each cell captures ``reps`` launches in one CUDA graph and times its replay with events (median of 5); the launches
rotate over enough copies of the weight that none is still in L2 (≥ 256 MB in all), and each MoE launch routes
afresh (uniform top-6). Floor = the bytes read (weights and scales; the experts a routing touches) over the copy
bandwidth measured in the same call (sparse-MQA cells: attention_bench.py; indexer top-k: topk_bench.py).
Since 2026-12-04 the launches are programmatic dependents (``kernels/pdl.py``, on by default): a launch's first
weight loads may overlap the launch before it, which earlier figures did not have. Each cell also checks the CUDA output against the Triton one. Prints one
table last.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from attention_bench import attention_cells
from topk_bench import score_cells, topk_cells
from event_timing import graph_us, median_ms, rel
from v41.kernels import dispatch, linear, moe, moe_align, wstream
from v41.kernels.packed import PackedWeight

# (name, N, K, block, groups): V4.1-Flash (32×32 FP8 tiles) and V4-Flash (128×128) dense linears
LINEARS = [("v41 wq_a", 1280, 5120, 32, 1), ("v41 wq_b", 32768, 1280, 32, 1), ("v41 wkv", 512, 5120, 32, 1),
           ("v41 wq_a + wkv stacked", 1792, 5120, 32, 1),
           ("v41 wo_a (8 groups)", 8192, 32768, 32, 8), ("v41 wo_b", 5120, 8192, 32, 1),
           ("v41 shared w13", 4608, 5120, 32, 1), ("v41 shared w2", 5120, 2304, 32, 1),
           ("v4 wq_a", 1024, 4096, 128, 1), ("v4 wo_b", 4096, 8192, 128, 1)]
EXPERTS = [("v41 experts w13", 384, 4608, 5120), ("v41 experts w2", 384, 5120, 2304),
           ("v4 experts w13", 256, 4096, 4096)]
TOP_K = 6
ROTATE_BYTES = 256 << 20


def copy_bandwidth() -> float:
    src = torch.randn(1 << 29, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / (median_ms(lambda: dst.copy_(src), 10) / 1e3)


def fp8_weight(n: int, k: int, block: int) -> PackedWeight:
    codes = torch.randint(0, 256, (n, k), dtype=torch.uint8, device="cuda")
    codes = torch.where((codes & 0x7F) == 0x7F, codes - 1, codes)
    scale = torch.randint(115, 122, (-(-n // block), -(-k // block)), dtype=torch.uint8, device="cuda")
    return PackedWeight(codes.view(torch.float8_e4m3fn), scale, "fp8", (block, block))


SWEEP: list[str] = []
SPLITS: list[int] = []  # --splits: also time the CUDA kernel with its K split forced to these (columns split<n>)
DOUBLE_BUFFER: list[str] = []  # --double-buffer: wstream.DOUBLE_BUFFER[:CTAS_PER_SM] settings (columns db<setting>)
MIN_SLICE: list[int] = []  # --min-slice: also time the CUDA kernel at these wstream.MIN_SLICE_BYTES (slice<n>K)
FIVE_CTAS = [False]  # --five-ctas: also time the expert GEMMs with wstream.FIVE_CTAS flipped (its own column)
LINEAR_TILES: list[tuple[int, int, int, int]] = []


def sweep(timed) -> dict[str, float]:
    """CUDA µs at each ``--sweep`` value of ``wstream.CTAS_PER_SM`` (the split-K target), each ``--splits`` K split
    (forced on every launch, at most one slice per chunk), each ``--double-buffer`` setting
    (``wstream.DOUBLE_BUFFER``, taken by every expert launch, optionally with its own CTAS_PER_SM; dense linears
    load their activations with their weights and never take it) and each ``--min-slice`` value of
    ``wstream.MIN_SLICE_BYTES``."""
    out, default, floor = {}, wstream.CTAS_PER_SM, wstream.MIN_SLICE_BYTES
    for c in SWEEP:
        wstream.CTAS_PER_SM = int(c)
        out[c] = timed()
    wstream.CTAS_PER_SM = default
    shape = wstream._launch_shape
    for s in SPLITS:
        def forced(slots, n, k, fmt, device, s=s):
            chunks = k // wstream.CHUNK[fmt]
            return wstream.slices(chunks, min(s, chunks))
        wstream._launch_shape = forced
        try:
            out[f"split{s}"] = timed()
        finally:
            wstream._launch_shape = shape
    db = wstream.DOUBLE_BUFFER, wstream.DOUBLE_BUFFER_CTAS_PER_SM
    for d in DOUBLE_BUFFER:
        u, _, c = d.partition(":")
        wstream.DOUBLE_BUFFER, wstream.DOUBLE_BUFFER_CTAS_PER_SM = int(u), 1 << 20
        wstream.CTAS_PER_SM = int(c) if c else default
        try:
            out[f"db{d}"] = timed()
        finally:
            wstream.DOUBLE_BUFFER, wstream.DOUBLE_BUFFER_CTAS_PER_SM = db
            wstream.CTAS_PER_SM = default
    for b in MIN_SLICE:
        wstream.MIN_SLICE_BYTES = b
        out[f"slice{b >> 10}K"] = timed()
    wstream.MIN_SLICE_BYTES = floor
    return out


def linear_cells(batches, reps, bw):
    rows = []
    for name, n, k, block, groups in LINEARS:
        w0 = fp8_weight(n, k // groups if groups > 1 else k, block)
        copies = [w0] + [fp8_weight(*w0.shape, block) for _ in range(max(1, ROTATE_BYTES // w0.nbytes) - 1)]
        for m in batches:
            xs = [torch.randn(m, k, device="cuda").to(torch.bfloat16) for _ in range(4)]
            paths = {"cuda": lambda x, w: wstream.linear(x, w, torch.bfloat16, groups),
                     "triton": lambda x, w: linear._linear_triton(x, w, torch.bfloat16, groups)}
            err = rel(paths["cuda"](xs[0], w0), paths["triton"](xs[0], w0))
            us = {p: graph_us([lambda i=i, f=f: f(xs[i % 4], copies[i % len(copies)]) for i in range(reps)])
                  for p, f in paths.items()}
            us.update(sweep(lambda: graph_us([lambda i=i: paths["cuda"](xs[i % 4], copies[i % len(copies)])
                                               for i in range(reps)])))
            for t in LINEAR_TILES:  # the Triton kernel at other (BM, BN, warps, stages)
                if (n // groups) % t[1] == 0:
                    try:
                        us["t" + ":".join(map(str, t))] = graph_us(
                            [lambda i=i, t=t: linear._linear_triton(xs[i % 4], copies[i % len(copies)],
                                                                    torch.bfloat16, groups, t) for i in range(reps)])
                    except Exception as e:  # noqa: BLE001 - a tiling past the shared memory: left out
                        print(f"{name} M={m} tiles {t}: {type(e).__name__}", flush=True)
            floor = w0.nbytes / bw * 1e6
            rows.append((name, f"M={m}", us, floor, err))
        del copies
        torch.cuda.empty_cache()
    return rows


def expert_cells(batches, reps, bw):
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, e, n, k in EXPERTS:
        w = PackedWeight(torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device="cuda"),
                         torch.randint(116, 122, (e, n, k // 32), dtype=torch.uint8, device="cuda"), "mxfp4", (1, 32))
        per_expert = n * k // 2 + n * k // 32
        for b in batches:
            routes = []
            for _ in range(reps):
                ids = torch.rand(b, e, generator=gen, device="cuda").topk(TOP_K, dim=1).indices
                pairs = moe_align.route_pairs(ids, e)
                live = int((pairs.offsets[1:] > pairs.offsets[:-1]).sum())
                routes.append((pairs, live, torch.randn(b, k, device="cuda").to(torch.bfloat16)))
            pairs, _, x = routes[0]
            err = rel(wstream.grouped(x, w, pairs.offsets, pairs.rows, pairs.active),
                      moe.grouped_linear_triton(x, w, pairs.offsets, pairs.rows, active=pairs.active))
            calls = {"cuda": [lambda r=r: wstream.grouped(r[2], w, r[0].offsets, r[0].rows, r[0].active)
                              for r in routes],
                     "triton": [lambda r=r: moe.grouped_linear_triton(r[2], w, r[0].offsets, r[0].rows,
                                                                      active=r[0].active) for r in routes]}
            us = {p: graph_us(c) for p, c in calls.items()}
            us.update(sweep(lambda: graph_us(calls["cuda"])))
            if FIVE_CTAS[0]:
                wstream.FIVE_CTAS = not wstream.FIVE_CTAS
                try:
                    us["FIVE_CTAS flipped"] = graph_us(calls["cuda"])
                finally:
                    wstream.FIVE_CTAS = not wstream.FIVE_CTAS
            floor = statistics.mean(r[1] for r in routes) * per_expert / bw * 1e6
            rows.append((name, f"B={b}", us, floor, err))
        del w
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--reps", type=int, default=24)
    ap.add_argument("--ops", default="linears,experts,attention,topk")
    ap.add_argument("--mqa-min-tiles", default="", help="MIN_TILES_PER_SPLIT values to also time sparse MQA at")
    ap.add_argument("--sweep", default="", help="CTAS_PER_SM values to time the CUDA kernel at, e.g. 2,3,8")
    ap.add_argument("--splits", default="", help="K splits to also time the CUDA kernel at, forced, e.g. 1,2,4")
    ap.add_argument("--double-buffer", default="", help="wstream.DOUBLE_BUFFER settings to also time the CUDA "
                    "expert GEMMs at (2, or 0 for none), each optionally with its CTAS_PER_SM, e.g. 2,2:5")
    ap.add_argument("--min-slice", default="", help="wstream.MIN_SLICE_BYTES values to also time the CUDA kernel "
                    "at, e.g. 32768,65536")
    ap.add_argument("--five-ctas", action="store_true", help="also time the expert GEMMs with wstream.FIVE_CTAS "
                    "flipped")
    ap.add_argument("--linear-tiles", default="", help="BM:BN:warps:stages tilings to also time the Triton linear "
                    "at (columns t<tiling>; cells whose output features BN does not divide are left out)")
    args = ap.parse_args()
    SWEEP.extend(c for c in args.sweep.split(",") if c)
    SPLITS.extend(int(c) for c in args.splits.split(",") if c)
    DOUBLE_BUFFER.extend(c for c in args.double_buffer.split(",") if c)
    MIN_SLICE.extend(int(b) for b in args.min_slice.split(",") if b)
    FIVE_CTAS[0] = args.five_ctas
    LINEAR_TILES.extend(tuple(int(v) for v in c.split(":")) for c in args.linear_tiles.split(",") if c)
    batches = [int(b) for b in args.batches.split(",")]
    wstream.MAX_ROWS = max(batches)  # time the kernel past the dispatch's row limit too (where Triton wins)
    print(f"{torch.cuda.get_device_name()}; CUDA kernels {dispatch.cuda_status()}", flush=True)
    bw = copy_bandwidth()
    ops = args.ops.split(",")
    rows = ((linear_cells(batches, args.reps, bw) if "linears" in ops else [])
            + (expert_cells(batches, args.reps, bw) if "experts" in ops else [])
            + (attention_cells(batches, args.reps, bw,
                                    min_tiles=[int(v) for v in args.mqa_min_tiles.split(",") if v])
               if "attention" in ops else [])
            + (topk_cells(args.reps, bw) + score_cells(args.reps, bw) if "topk" in ops else []))
    print(f"\ncopy bandwidth {bw / 1e9:,.0f} GB/s; µs per launch (graph replay, weights and key rows not in L2)")
    extra = list(dict.fromkeys(k for row in rows for k in row[2] if k not in ("cuda", "triton")))
    print("| op | rows | CUDA µs | Triton µs | floor µs | CUDA / floor | CUDA GB/s | Triton / CUDA | rel. diff | "
          + "".join(f"{h} µs | " for h in extra))
    print("|---" * (9 + len(extra)) + "|")
    for name, cell, us, floor, err in rows:
        gbs = floor * bw / 1e9 / us["cuda"] if us["cuda"] else 0.0
        print(f"| {name} | {cell} | {us['cuda']:.1f} | {us['triton']:.1f} | {floor:.1f} | "
              f"{us['cuda'] / floor:.2f}× | {gbs:,.0f} | {us['triton'] / us['cuda']:.2f}× | {err:.1e} | "
              + "".join(f"{us.get(c, float('nan')):.1f} | " for c in extra))


if __name__ == "__main__":
    main()
