"""Registers, spills and shared memory of the MoE GEMM's Triton launches for sm_90a, without a GPU: each tiling of
:func:`v41.kernels.moe.grouped_linear_triton` is compiled by Triton for an H100/H200 target and its PTX assembled
by the ``ptxas`` Triton ships (``-v``), so occupancy can be counted before a device call times it.

    python benches/gpu/triton_regs.py [--tiles 128:128,128:128:64:3:128] [--warps 4,8] [--gather] [--swaps 0,1]
    python benches/gpu/triton_regs.py --mqa 16:32:4:3,64:32:8:2     # sparse MQA's Triton tilings instead

A tiling is ``BM:BN[:BK[:stages[:maxnreg]]]`` (moe_bench.py's ``--tiles``; defaults BK 128, 3 stages, no register
cap); each is compiled through each decode of ``moe.DECODES`` (``tl.dot_scaled``, the nibble decode, the PTX bit
moves), for MXFP4 weights and bf16 activations, with the rows in order (``w2``) or, with ``--gather``, through the
pairs' token ids (``w13``). Integer arguments are compiled as multiples of 16, as the launches' shapes specialize
them. CTAs per SM = min(65,536 registers / (threads · registers), 228 KB / shared memory). "K-loop PTX" counts the
PTX instructions of the innermost loop holding the MMAs (one K step; per thread): the decode's cost next to the
MMAs'. "K-loop SASS" counts that loop's SASS instructions (Triton's ``nvdisasm`` on the cubin), and "× warps" the CTA's
warp-instructions per K step: four warp schedulers an SM issue one a cycle each, to set against the step's MMA
cycles (~2,048 bf16 MACs a cycle an SM on Hopper). ``--mqa BH:BK:warps:stages,...``: the tilings of
:func:`v41.kernels.sparse_attention._sparse_triton` (heads per program, keys per tile) at V4.1's d = 512 over two
bf16 sources, with the count of WGMMA and ``mma.sync`` instructions in the PTX and a key loop's SASS × warps.
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
from v41.kernels import moe, sparse_attention

POINTERS = {"x_ptr": "*bf16", "rows_ptr": "*i64", "w_ptr": "*u8", "s_ptr": "*u8", "offs_ptr": "*i64",
            "act_ptr": "*i64", "blk_ptr": "*i64", "y_ptr": "*bf16"}
UNALIGNED = ("offs_ptr", "act_ptr", "blk_ptr")  # indexed by expert: no 16-element alignment


def _ptxas(kernel) -> dict:
    """Registers, spill bytes and shared memory of a compiled kernel (its PTX assembled by Triton's ptxas -v)."""
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


def _compile(fn, consts: dict, pointers: dict, unaligned=(), **options):
    """``triton.compile`` of ``fn`` for sm_90a: ``consts`` by name, ``pointers`` {name: type}, other arguments i32
    (multiples of 16 unless ``unaligned``)."""
    sig, const, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
            const[(i,)] = consts[name]
            continue
        sig[name] = pointers.get(name, "i32")
        if name not in unaligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32), options=options)


def mma_loop_instructions(ptx: str) -> int:
    """PTX instructions in the innermost loop (a backward branch) that holds an MMA (``wgmma.mma_async`` /
    ``mma.sync``); 0 if none."""
    lines = ptx.splitlines()
    labels = {ln.strip().split(":")[0]: i for i, ln in enumerate(lines) if re.match(r"^\$L__\w+:", ln.strip())}
    sizes = []
    for i, ln in enumerate(lines):
        m = re.search(r"bra(?:\.uni)?\s+(\$L__\w+);", ln)
        if m and labels.get(m.group(1), i) < i:
            body = [x for x in lines[labels[m.group(1)]:i] if ";" in x and not x.strip().startswith("//")]
            if any("wgmma.mma_async" in x or "mma.sync" in x for x in body):
                sizes.append(len(body))
    return min(sizes, default=0)


def sass_loop_instructions(kernel) -> int:
    """The static SASS instruction count of the smallest loop holding a ``HGMMA`` / ``HMMA`` (each instruction is
    issued once per warp), from the cubin that Triton's ``nvdisasm`` disassembles (no GPU needed); 0 if none. For a
    branch-free body, as the MoE K loops are, it is the warp's issue count per iteration, closer to issue cycles than
    the PTX count (four warp schedulers an SM, one instruction a cycle each); a body with branches (sparse MQA's key
    loops) gives an upper bound."""
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        lines = subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True, check=True).stdout.splitlines()
    labels = {ln.strip().rstrip(":"): i for i, ln in enumerate(lines) if re.match(r"^\.L_x_\d+:$", ln.strip())}
    sizes = []
    for i, ln in enumerate(lines):
        m = re.search(r"BRA\s+`\((\.L_x_\d+)\)", ln)
        if m and labels.get(m.group(1), i) < i:
            body = [x for x in lines[labels[m.group(1)]:i + 1] if re.search(r"/\*[0-9a-f]{4,}\*/", x)]
            if any("HGMMA" in x or "HMMA" in x for x in body):
                sizes.append(len(body))
    return min(sizes, default=0)


def compile_grouped(bm: int, bn: int, bk: int, stages: int, maxnreg: int, warps: int, decode: str,
                    gather: bool = False, swap: bool = False) -> dict:
    """One tiling of the grouped kernel for sm_90a → {registers, spill bytes, shared bytes, loop (PTX instructions
    of one K step), sass (its SASS, :func:`sass_loop_instructions`)}, compiled with ``EVEN_K`` (whole K steps, as
    every V4 / V4.1 expert launch); ``decode`` one of ``moe.DECODES``; ``gather``: rows read through the pairs' token
    ids (``w13``), else in order (``w2``); ``swap``: the weight tile as the MMA's left operand (``moe`` config
    "swap")."""
    fn = moe._grouped_kernel
    consts = dict(GATHER=gather, B0=1, SK=32, FMT=2, BM=bm, BN=bn, BK=bk, DOT=tl.bfloat16, IEEE=False,
                  DECODE=moe.DECODES[decode], LHS_FMT="bf16", ROW_GRID=moe.PREFILL_ROW_GRID, SWAP=swap, EVEN_K=True,
                  PDL=False)
    options = dict(num_warps=warps, num_stages=stages, **({"maxnreg": maxnreg} if maxnreg else {}))
    kernel = _compile(fn, consts, POINTERS, UNALIGNED, **options)
    return dict(_ptxas(kernel), loop=mma_loop_instructions(kernel.asm["ptx"]), sass=sass_loop_instructions(kernel))


def compile_sparse_mqa(bh: int, bk: int, warps: int, stages: int) -> dict:
    """One tiling of the sparse-MQA Triton kernel at d = 512, two bf16 sources → {registers, spill bytes, shared
    bytes, wgmma, mma.sync (instruction counts in the PTX), sass (a key loop's SASS: an upper bound, the loop
    branches)}."""
    consts = dict(TWO=True, D=512, BH=bh, BK=bk, DOT=tl.bfloat16, IEEE=False, FMT0=0, FMT1=0, ROPE0=0, ROPE1=0)
    pointers = {"q_ptr": "*bf16", "o_ptr": "*bf16", "sink_ptr": "*fp32", "c0_ptr": "*bf16", "s0_ptr": "*i64",
                "c1_ptr": "*bf16", "s1_ptr": "*i64", "scale": "fp32"}
    kernel = _compile(sparse_attention._sparse_kernel, consts, pointers, ("scale",), num_warps=warps,
                      num_stages=stages)
    ptx = kernel.asm["ptx"]
    return dict(_ptxas(kernel), wgmma=ptx.count("wgmma.mma_async"), mma=ptx.count("mma.sync"),
                sass=sass_loop_instructions(kernel))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiles", default="128:128,128:128:64,128:128:64:3:128,128:128:64:4:128")
    ap.add_argument("--warps", default="8")
    ap.add_argument("--gather", action="store_true", help="the w13 launch (rows through token ids), else w2's")
    ap.add_argument("--decodes", default=",".join(moe.DECODES), help="MXFP4 decodes to compile (moe.DECODES)")
    ap.add_argument("--swaps", default="0",
                    help="0 and / or 1: the weight tile as the MMA's left operand (bits, nibble)")
    ap.add_argument("--mqa", default="", help="sparse-MQA tilings BH:BK:warps:stages to compile instead")
    a = ap.parse_args()
    if a.mqa:
        print("| tiling BH:BK:warps:stages | registers | spill bytes | shared KB | wgmma | mma.sync "
              "| key-loop SASS × warps |")
        print("|---|---|---|---|---|---|---|")
        for tile in a.mqa.split(","):
            bh, bk, warps, stages = (int(v) for v in tile.split(":"))
            r = compile_sparse_mqa(bh, bk, warps, stages)
            print(f"| {tile} | {r['registers']} | {r['spills']} | {r['shared'] / 1024:.1f} | {r['wgmma']} | "
                  f"{r['mma']} | {r['sass'] * warps} |", flush=True)
        return
    print("| tiling BM:BN:BK:stages:maxnreg | warps | decode | swap | registers | spill bytes | shared KB "
          "| CTAs per SM | K-loop PTX | per 128 inputs | K-loop SASS | × warps |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    swaps = [bool(int(v)) for v in a.swaps.split(",")]
    for tile, warps, decode, swap in itertools.product(a.tiles.split(","), [int(w) for w in a.warps.split(",")],
                                                       a.decodes.split(","), swaps):
        if swap and decode == "scaled":  # not a launch (moe.grouped_linear_triton refuses it)
            continue
        bm, bn, bk, stages, maxnreg = parse_tiling(tile)
        r = compile_grouped(bm, bn, bk, stages, maxnreg, warps, decode, a.gather, swap)
        ctas = min(65536 // (32 * warps * r["registers"]), 228 * 1024 // max(1, r["shared"]))
        print(f"| {bm}:{bn}:{bk}:{stages}:{maxnreg or '-'} | {warps} | {decode} | {int(swap)} | {r['registers']} "
              f"| {r['spills']} | {r['shared'] / 1024:.1f} | {ctas} | {r['loop']} | {r['loop'] * 128 // bk} "
              f"| {r['sass']} | {r['sass'] * warps} |", flush=True)


if __name__ == "__main__":
    main()
