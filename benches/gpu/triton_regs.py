"""Registers, spills and shared memory of the MoE GEMM's Triton launches for sm_90a, without a GPU: each tiling of
:func:`v41.kernels.moe.grouped_linear_triton` is compiled by Triton for an H100/H200 target and its PTX assembled
by the ``ptxas`` Triton ships (``-v``), so occupancy can be counted before a device call times it.

    python benches/gpu/triton_regs.py [--tiles 128:128,128:128:64:3:128] [--warps 4,8] [--gather]

A tiling is ``BM:BN[:BK[:stages[:maxnreg]]]`` (moe_bench.py's ``--tiles``; defaults BK 128, 3 stages, no register
cap); each is compiled through ``tl.dot_scaled`` and through the nibble decode, for MXFP4 weights and bf16
activations, with the rows in order (``w2``) or, with ``--gather``, through the pairs' token ids (``w13``). Integer
arguments are compiled as multiples of 16, as the launches' shapes specialize them. CTAs per SM = min(65,536
registers / (threads · registers), 228 KB / shared memory).
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import tempfile

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moe_bench import parse_tiling
from v41.kernels import moe

POINTERS = {"x_ptr": "*bf16", "rows_ptr": "*i64", "w_ptr": "*u8", "s_ptr": "*u8", "offs_ptr": "*i64",
            "act_ptr": "*i64", "y_ptr": "*bf16"}
UNALIGNED = ("offs_ptr", "act_ptr")  # indexed by expert: no 16-element alignment


def compile_grouped(bm: int, bn: int, bk: int, stages: int, maxnreg: int, warps: int, scaled: bool,
                    gather: bool = False) -> dict:
    """One tiling of the grouped kernel for sm_90a → {registers, spill bytes, shared bytes}; ``gather``: rows read
    through the pairs' token ids (``w13``), else in order (``w2``)."""
    fn = moe._grouped_kernel
    consts = dict(GATHER=gather, B0=1, SK=32, FMT=2, BM=bm, BN=bn, BK=bk, DOT=tl.bfloat16, IEEE=False, SCALED=scaled,
                  LHS_FMT="bf16", PDL=False)
    sig, const, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
            const[(i,)] = consts[name]
            continue
        sig[name] = POINTERS.get(name, "i32")
        if name not in UNALIGNED:
            attrs[(i,)] = [["tt.divisibility", 16]]
    options = dict(num_warps=warps, num_stages=stages, **({"maxnreg": maxnreg} if maxnreg else {}))
    kernel = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32), options=options)
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(kernel.asm["ptx"])
        log = subprocess.run([ptxas, "-arch=sm_90a", "-v", src, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True, check=True).stderr
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    spills = int(re.search(r"(\d+) bytes spill stores", log).group(1))
    return dict(registers=regs, spills=spills, shared=kernel.metadata.shared)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiles", default="128:128,128:128:64,128:128:64:3:128,128:128:64:4:128")
    ap.add_argument("--warps", default="8")
    ap.add_argument("--gather", action="store_true", help="the w13 launch (rows through token ids), else w2's")
    a = ap.parse_args()
    print("| tiling BM:BN:BK:stages:maxnreg | warps | dot | registers | spill bytes | shared KB | CTAs per SM |")
    print("|---|---|---|---|---|---|---|")
    for tile, warps, scaled in itertools.product(a.tiles.split(","), [int(w) for w in a.warps.split(",")],
                                                 (True, False)):
        bm, bn, bk, stages, maxnreg = parse_tiling(tile)
        r = compile_grouped(bm, bn, bk, stages, maxnreg, warps, scaled, a.gather)
        ctas = min(65536 // (32 * warps * r["registers"]), 228 * 1024 // max(1, r["shared"]))
        print(f"| {bm}:{bn}:{bk}:{stages}:{maxnreg or '-'} | {warps} | {'dot_scaled' if scaled else 'nibble'} | "
              f"{r['registers']} | {r['spills']} | {r['shared'] / 1024:.1f} | {ctas} |", flush=True)


if __name__ == "__main__":
    main()
