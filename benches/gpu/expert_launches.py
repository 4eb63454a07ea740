"""A few launches of the weight-streaming expert GEMM at one decode batch, nothing else: the program to run under
Nsight Compute (``ncu``), which reads the hardware counters of one launch (issue 17: where the expert kernel's
time goes at B = 8–64).

    ncu --clock-control none --kernel-name regex:wstream --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \\
        python3 benches/gpu/expert_launches.py --batch 64

Shapes: ``kernel_bench.EXPERTS`` (V4.1-Flash w13: 384 experts × [4608, 5120] MXFP4), uniform top-6 routing.
"""

from __future__ import annotations

import argparse

import torch

from kernel_bench import EXPERTS, TOP_K
from v41.kernels import moe_align, wstream
from v41.kernels.packed import PackedWeight


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--shape", default="v41 experts w13", choices=[e[0] for e in EXPERTS])
    ap.add_argument("--launches", type=int, default=4)
    a = ap.parse_args()
    _, e, n, k = next(s for s in EXPERTS if s[0] == a.shape)
    w = PackedWeight(torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device="cuda"),
                     torch.randint(116, 122, (e, n, k // 32), dtype=torch.uint8, device="cuda"), "mxfp4", (1, 32))
    gen = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(a.launches):
        ids = torch.rand(a.batch, e, generator=gen, device="cuda").topk(TOP_K, dim=1).indices
        pairs = moe_align.route_pairs(ids, e)
        x = torch.randn(a.batch, k, device="cuda").to(torch.bfloat16)
        assert wstream.grouped(x, w, pairs.offsets, pairs.rows, pairs.active) is not None
    torch.cuda.synchronize()
    print(f"{a.launches} launches of {a.shape} at B={a.batch}")


if __name__ == "__main__":
    main()
