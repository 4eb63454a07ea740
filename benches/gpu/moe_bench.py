"""The MoE GEMM alone (docs/benchmarking.md, issues 12 and 17): :func:`v41.kernels.moe.grouped_linear_triton` over
V4-Flash's MXFP4 experts (256 experts; ``w13`` 4096 × 4096, ``w2`` 4096 × 2048) or V4.1-Flash's (``--shape v41``:
384 experts; ``w13`` 4608 × 5120, ``w2`` 5120 × 2304) at the pair counts of decode batches or of a prefill chunk,
each launch configuration checked against dequantize-then-matmul and timed with CUDA events.

    python3 benches/gpu/moe_bench.py [--batches 1,8,64] [--sweep] [--reps 20]
    python3 benches/gpu/moe_bench.py --shape v41 --batches 2048,8192 --tiles 64:64,128:128,128:128:64:3:128 --reps 5

Every repetition routes afresh (top-6 per token, uniform or with ``--skew`` Zipf-popular experts, a new draw each
time) so the experts it reads are not
the previous repetition's L2 contents; the launch is timed as a CUDA graph replay, as the decode step runs it.
Floor = bytes of the experts touched (data + scales) over the copy bandwidth measured in the same call. Prints one
table last: the default configuration and, with ``--sweep`` (decode: K split, N tile, warps, stages) or ``--tiles
BM:BN[:BK[:stages[:maxnreg]]],…`` (prefill: each row block × N tile, K step (128), pipeline stages (3) and register
cap (none) at ``--tile-warps`` (4 and 8), through each of ``--decodes``: ``tl.dot_scaled``, the nibble decode, the
PTX bit moves), with ``--row-grids`` and ``--swaps`` (the weight tile as the MMA's left operand), the best of the
swept ones per cell; every cell also gives TFLOP/s, against the bf16 dense-GEMM rate measured in the same call.
"""

from __future__ import annotations

import argparse
import itertools
import statistics

import torch
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources, PTXASError

from event_timing import median_ms
from v41.kernels.moe import grouped_config, grouped_linear_triton
from v41.kernels.moe_align import align_pairs
from v41.kernels.packed import PackedWeight

SHAPES = {"v4": (256, 4096, 2048), "v41": (384, 5120, 2304)}  # experts, hidden, intermediate
TOP_K = 6


def copy_bandwidth() -> float:
    src = torch.randn(1 << 29, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / (median_ms(lambda: dst.copy_(src), 10) / 1e3)


def mxfp4(experts: int, n: int, k: int) -> PackedWeight:
    data = torch.randint(0, 256, (experts, n, k // 2), dtype=torch.uint8, device="cuda")
    scale = torch.randint(118, 127, (experts, n, k // 32), dtype=torch.uint8, device="cuda")
    return PackedWeight(data, scale, "mxfp4", (1, 32))


def bf16_rate() -> float:
    """FLOP/s of one 8192³ bf16 matmul (the roofline the prefill cells are read against)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192 ** 3 / (median_ms(lambda: a @ a, 10) / 1e3)


def routings(batch: int, experts: int, reps: int, gen: torch.Generator, skew: float = 0.0):
    """``reps`` routings of ``batch`` tokens to TOP_K distinct experts each: uniform, or with ``skew`` > 0 drawn
    without replacement with expert weights ∝ rank^-skew (Zipf, ranks shuffled; Gumbel top-k)."""
    out = []
    if skew:
        logw = -skew * torch.log(torch.arange(1, experts + 1, device="cuda", dtype=torch.float32))
        logw = logw[torch.randperm(experts, generator=gen, device="cuda")]
    for _ in range(reps):
        u = torch.rand(batch, experts, generator=gen, device="cuda")
        score = u if skew == 0 else logw - torch.log(-torch.log(u.clamp_min(1e-20)))
        ids = score.topk(TOP_K, dim=1).indices
        order, offsets = align_pairs(ids, experts)
        out.append((order // TOP_K, offsets, int((offsets[1:] > offsets[:-1]).sum())))
    return out


def expert_reference(xs: torch.Tensor, w: PackedWeight, offsets: torch.Tensor) -> torch.Tensor:
    """float32 ``[P, N]``: each expert's sorted rows ``xs`` times its dequantized weight, one expert at a time (the
    whole weight in float32 would not fit)."""
    ref = torch.zeros(xs.shape[0], w.shape[1], device=xs.device)
    bounds = offsets.tolist()
    for e in range(w.shape[0]):
        a, b = bounds[e], bounds[e + 1]
        if b > a:
            we = PackedWeight(w.data[e], w.scale[e], "mxfp4", w.block).dequantize(torch.float32)
            ref[a:b] = xs[a:b].float() @ we.T
    return ref


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error of ``got`` against ``ref``; inf when ``got`` holds a non-finite value."""
    got = got.float()
    return float((got - ref).norm() / ref.norm()) if torch.isfinite(got).all() else float("inf")


def check(x, w, route, cfg, gather: bool) -> float:
    """Relative error of one launch (its output's memory poisoned with NaN first: rows a launch skips show)."""
    rows, offsets, _ = route
    rows = rows if gather else None
    p = x.shape[0] if rows is None else rows.shape[0]
    poison = torch.full((p, w.shape[1]), float("nan"), dtype=x.dtype, device=x.device)
    del poison  # the caching allocator hands its block to the launch's output
    got = grouped_linear_triton(x, w, offsets, rows, cfg)
    return rel_err(got, expert_reference(x if rows is None else x[rows], w, offsets))


def timed(x, w, routes, cfg, gather: bool) -> float:
    """Median ms of the launch replayed as a CUDA graph (as the decode step runs it: no host launch cost), the
    routing copied into the graph's static inputs before each replay."""
    rows = routes[0][0].clone()
    offsets = routes[0][1].clone()
    grouped_linear_triton(x, w, offsets, rows if gather else None, cfg)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grouped_linear_triton(x, w, offsets, rows if gather else None, cfg)

    def load(i: int) -> None:
        rows.copy_(routes[i][0])
        offsets.copy_(routes[i][1])
        torch.cuda.synchronize()

    return median_ms(graph.replay, len(routes), before=load, warmup=0)


def parse_tiling(tile: str) -> tuple[int, int, int, int, int]:
    """``BM:BN[:BK[:stages[:maxnreg]]]`` → (BM, BN, BK, stages, maxnreg), defaults BK 128, 3 stages, maxnreg 0 (no
    register cap)."""
    given = [int(v) for v in tile.split(":")]
    if not 2 <= len(given) <= 5:
        raise SystemExit(f"tiling {tile!r}: expected BM:BN[:BK[:stages[:maxnreg]]]")
    return tuple(given + [128, 3, 0][len(given) - 2:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--shape", choices=tuple(SHAPES), default="v4")
    ap.add_argument("--tiles", default="",
                    help="BM:BN[:BK[:stages[:maxnreg]]] tilings to sweep at --tile-warps, through --decodes "
                    "(defaults BK 128, 3 stages, no register cap)")
    ap.add_argument("--tile-warps", default="4,8", help="the warps each --tiles tiling is timed at")
    ap.add_argument("--decodes", default="scaled,nibble,bits", help="the MXFP4 decodes each --tiles tiling is timed "
                    "with (v41.kernels.moe.DECODES)")
    ap.add_argument("--row-grids", default="0", help="each --tiles tiling with programs per expert (0) and / or per "
                    "row block (1)")
    ap.add_argument("--swaps", default="0", help="each --tiles tiling with the weight tile on the MMA's N side (0) "
                    "and / or as its left operand from registers (1: yᵀ = W·xᵀ; decodes bits and nibble)")
    ap.add_argument("--skew", type=float, default=0.0, help="Zipf exponent of the experts' popularity (0: uniform)")
    a = ap.parse_args()
    experts, hidden, inter = SHAPES[a.shape]
    torch.manual_seed(0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    bw = copy_bandwidth()
    peak = bf16_rate()
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e9:.0f} GB/s, bf16 {peak / 1e12:.0f} TFLOP/s")
    weights = {"w13": mxfp4(experts, 2 * inter, hidden), "w2": mxfp4(experts, hidden, inter)}
    per_expert = {name: (w.data[0].numel() + w.scale[0].numel()) for name, w in weights.items()}
    rows = []
    for batch in [int(b) for b in a.batches.split(",")]:
        routes = routings(batch, experts, a.reps, gen, a.skew)
        touched = statistics.mean(r[2] for r in routes)
        for name, w in weights.items():
            gather = name == "w13"  # w13 reads token rows through the sorted pairs, w2 the sorted rows in order
            x = torch.randn(batch if gather else batch * TOP_K, w.shape[2], device="cuda", dtype=torch.bfloat16)
            floor_ms = touched * per_expert[name] / bw * 1e3
            default = grouped_config(batch * TOP_K, w, x.dtype)
            configs = [default]
            if a.sweep:
                splits = sorted({default["split"], 2 * default["split"], max(1, default["split"] // 2)})
                for decode, bn, split, warps, stages in itertools.product(
                        ("nibble", "scaled"), (64, 128), splits, (4, 8), (3, 4)):
                    configs.append(dict(default, decode=decode, bn=bn, split=split, warps=warps, stages=stages))
            for tile, warps, decode, row_grid, swap in itertools.product(
                    a.tiles.split(",") if a.tiles else (), [int(v) for v in a.tile_warps.split(",")],
                    a.decodes.split(","), [bool(int(v)) for v in a.row_grids.split(",")],
                    [bool(int(v)) for v in a.swaps.split(",")]):
                bm, bn, bk, stages, maxnreg = parse_tiling(tile)
                configs.append(dict(default, bm=bm, bn=bn, bk=bk, split=1, warps=warps, stages=stages, decode=decode,
                                    maxnreg=maxnreg or None, row_grid=row_grid, swap=swap))
            flop = 2 * batch * TOP_K * w.shape[1] * w.shape[2]
            results = []
            for cfg in configs:
                try:
                    err = check(x, w, routes[0], cfg, gather)
                    ms = timed(x, w, routes, cfg, gather) if err < 1e-2 else float("nan")
                except (OutOfResources, CompilationError, PTXASError, ValueError) as exc:  # does not fit / exist
                    err, ms = float("inf"), float("nan")
                    print(f"B={batch} {name} {cfg}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                print(f"B={batch:3d} {name:3s} {cfg} err {err:.1e} {ms:.3f} ms", flush=True)
                results.append((ms if ms == ms else float("inf"), cfg, err))
            best = min(results, key=lambda r: r[0])
            rows.append((batch, name, touched, floor_ms, results[0][0], results[0][2], best[0], best[1], flop))
    print("\n| B | weight | experts touched | floor ms | default ms | default/floor | default TFLOP/s | rel err "
          "| best ms | best TFLOP/s | best config |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for batch, name, touched, floor_ms, d_ms, err, b_ms, b_cfg, flop in rows:
        print(f"| {batch} | {name} | {touched:.0f} | {floor_ms:.3f} | {d_ms:.3f} | {d_ms / floor_ms:.1f}x "
              f"| {flop / d_ms / 1e9:.0f} | {err:.1e} | {b_ms:.3f} | {flop / b_ms / 1e9:.0f} | {b_cfg} |")
    print(f"(bf16 dense rate in this call: {peak / 1e12:.0f} TFLOP/s)")


if __name__ == "__main__":
    main()
