"""The small kernels between a decode step's GEMMs, at V4.1-Flash shapes: the mHC seam's mixes, alone and between
the expansion and the collapse + RMSNorm (``kernels/mhc.py``: the CUDA seam up to 16 tokens; column "Triton": the
split-K pass + finish, the expansion and the collapse as their own launches), the bf16 linears with float32
outputs that the CUDA kernel does not take (router gate, compressor, indexer weights; ``kernels/linear.py``), each
at its switches' settings, the MoE router (``kernels/router.py``: the CUDA router against the Triton gate linear
and route kernel; ``--ops router``), and the sampler's softmax with its temperature and keyed race over 129,280 columns
(``kernels/softmax.py``, ``kernels/sampling.py``; column "PyTorch": their PyTorch forms).

    python3 benches/gpu/glue_bench.py [--tokens 1,8,64] [--reps 24] [--ops mhc,linear,race]

Each cell captures ``reps`` calls (or one per weight copy, at most 128) in one CUDA graph and times its replay
with events (median; event_timing.py); the mHC mixes and the linears rotate over copies of their weight (≥ 256 MB)
so that none is in L2, as in a decode step, where each layer has its own. Floor = bytes read over the copy
bandwidth of the same call. Columns other than "default" set a switch for that cell only (the module attribute
named). Prints one table last.
"""

from __future__ import annotations

import argparse

import torch

from event_timing import graph_us, median_ms, rel
from v41.kernels import linear, mhc, pdl, router, sampling, softmax
from v41.kernels.packed import from_dense

D, HC = 5120, 4
# (name, N, K): V4.1-Flash bf16 weights with float32 outputs (the CUDA weight-streaming kernel takes fp8 / mxfp4)
LINEARS = [("router gate", 384, D), ("compressor wkv", 512, D), ("indexer weights_proj", 32, D),
           ("compressor wkv + wgate + weights_proj stacked", 1056, D)]
ROTATE_BYTES = 256 << 20


def copy_bandwidth() -> float:
    src = torch.randn(1 << 29, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / (median_ms(lambda: dst.copy_(src), 10) / 1e3)


def switched(module, settings: dict, fn):
    """``fn()`` with ``module``'s attributes set to ``settings``, restored after."""
    old = {k: getattr(module, k) for k in settings}
    for k, v in settings.items():
        setattr(module, k, v)
    try:
        return fn()
    finally:
        for k, v in old.items():
            setattr(module, k, v)


MHC_VARIANTS = {"default": {}, "Triton": {"CUDA_SEAM": False}}
MHC_VARIANTS.update({name: {"CUDA_SEAM": False, **s} for name, s in {  # the Triton path's switches
    "two launches": {"ONE_LAUNCH": False}, "finish unroll 1": {"FINISH_UNROLL": 1},
    "finish unroll 8": {"FINISH_UNROLL": 8}, "gemv ≤ 8 tokens": {"MIX_GEMV_T": 8},
    "split ≤ 16": {"MIX_SPLIT_MAX": 16}, "split ≤ 64": {"MIX_SPLIT_MAX": 64}, "64-token tiles": {"MIX_WIDE_T": 1},
    "16-token tiles": {"MIX_WIDE_T": 0}}.items()})
LINEAR_VARIANTS = {"default": {}, "sum after": {"SPLIT_REDUCE_BYTES": 0}, "slices ≥ 8 KB": {"MIN_SLICE_BYTES": 8 << 10},
                   "slices ≥ 256 KB": {"MIN_SLICE_BYTES": 256 << 10}}


def mhc_cells(tokens, reps, bw):
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    n_mix = (2 + HC) * HC
    fn = torch.randn(n_mix, HC * D, device="cuda", generator=g) * 0.01
    fns = [fn] + [torch.randn_like(fn) * 0.01 for _ in range(ROTATE_BYTES // (fn.numel() * 4) - 1)]  # each seam's own
    scale = torch.ones(3, device="cuda")
    base = torch.zeros(n_mix, device="cuda")
    for t in tokens:
        hs = [torch.randn(t, HC, D, device="cuda", generator=g).to(torch.bfloat16) for _ in range(4)]
        call = lambda i: mhc.hc_mixes(hs[i % 4], fns[i % len(fns)], scale, base, HC, 20, 1e-6, 1e-6)  # noqa: E731
        want = mhc.hc_mixes_ref(hs[0].double(), fn.double(), scale.double(), base.double(), HC, 20, 1e-6, 1e-6)
        err = max(rel(a, b) for a, b in zip(call(0), want))
        n = max(reps, min(len(fns), 128))
        us = {name: switched(mhc, s, lambda: graph_us([lambda i=i: call(i) for i in range(n)]))
              for name, s in MHC_VARIANTS.items()}
        # where the default's time goes: one Sinkhorn iteration instead of 20, one mix weight (in L2), PDL off
        one = lambda i: mhc.hc_mixes(hs[i % 4], fns[i % len(fns)], scale, base, HC, 1, 1e-6, 1e-6)  # noqa: E731
        us["Sinkhorn 1 iteration"] = graph_us([lambda i=i: one(i) for i in range(n)])
        us["weight in L2"] = graph_us([lambda i=i: mhc.hc_mixes(hs[i % 4], fn, scale, base, HC, 20, 1e-6, 1e-6)
                                       for i in range(n)])
        us["PDL off"] = switched(pdl, {"ENABLED": False}, lambda: graph_us([lambda i=i: call(i) for i in range(n)]))
        floor = (fn.numel() * 4 + hs[0].numel() * 2) / bw * 1e6
        rows.append(("mhc mixes", f"T={t}", us, floor, err))
        # the whole seam after a sub-layer: its output expanded into the copies, the next mixes, the collapse with
        # the delayed pre-mix and the sub-layer's RMSNorm
        ys = [torch.randn(t, D, device="cuda", generator=g).to(torch.bfloat16) for _ in range(4)]
        post = torch.rand(t, HC, device="cuda", generator=g) * 2
        comb = torch.rand(t, HC, HC, device="cuda", generator=g) / HC
        pre_c = torch.rand(t, HC, device="cuda", generator=g) + 0.5
        norm_w = torch.ones(D, device="cuda", dtype=torch.bfloat16)
        seam = lambda i: mhc.hc_seam(hs[i % 4], fns[i % len(fns)], scale, base, HC, 20, 1e-6, 1e-6, pre_c,  # noqa
                                     1e-6, norm_w, ys[i % 4], post, comb)
        got = seam(0)
        h2 = mhc.hc_expand_ref(hs[0].double(), ys[0].double(), post.double(), comb.double())
        want = (h2, *mhc.hc_mixes_ref(got[0].double(), fn.double(), scale.double(), base.double(), HC, 20, 1e-6,
                                      1e-6), mhc.hc_collapse_norm_ref(got[0].double(), pre_c.double(), 1e-6,
                                                                      norm_w.double()))
        err = max(rel(a, b) for a, b in zip(got, want))
        us = {name: switched(mhc, s, lambda: graph_us([lambda i=i: seam(i) for i in range(n)]))
              for name, s in (("default", {}), ("Triton", {"CUDA_SEAM": False}))}
        floor = (fn.numel() * 4 + 2 * hs[0].numel() * 2 + 2 * ys[0].numel() * 2) / bw * 1e6
        rows.append(("mhc seam (expand, mixes, collapse + norm)", f"T={t}", us, floor, err))
    return rows


def linear_cells(tokens, reps, bw):
    rows = []
    for name, n, k in LINEARS:
        w0 = from_dense(torch.randn(n, k, device="cuda").to(torch.bfloat16) / k ** 0.5)
        copies = [w0] + [from_dense(torch.randn(n, k, device="cuda").to(torch.bfloat16))
                         for _ in range(max(1, ROTATE_BYTES // w0.nbytes) - 1)]
        for t in tokens:
            xs = [torch.randn(t, k, device="cuda").to(torch.bfloat16) for _ in range(4)]
            call = lambda i: linear._linear_triton(xs[i % 4], copies[i % len(copies)], torch.float32, 1)  # noqa
            err = rel(call(0), linear.linear_ref(xs[0].double(), w0, torch.float64))
            n_calls = max(reps, min(len(copies), 128))
            us = {v: switched(linear, s, lambda: graph_us([lambda i=i: call(i) for i in range(n_calls)]))
                  for v, s in LINEAR_VARIANTS.items()}
            rows.append((f"linear {name} [{n}, {k}] bf16 → fp32", f"T={t}", us, w0.nbytes / bw * 1e6, err))
        del copies
        torch.cuda.empty_cache()
    return rows


def router_cells(tokens, reps, bw):
    """The MoE router of a decode step, V4.1-Flash's gate [384, 5120] bf16, top-6 with bias: the CUDA router (one
    launch, at every token count; column "default" sets router.CUDA_ROUTER and its token limit) against the Triton
    gate linear + route kernel."""
    rows = []
    e, k = 384, 6
    gates = [from_dense(torch.randn(e, D, device="cuda").to(torch.bfloat16) / D ** 0.5)
             for _ in range(ROTATE_BYTES // (e * D * 2))]
    bias = torch.randn(e, device="cuda") * 0.01
    for t in tokens:
        xs = [torch.randn(t, D, device="cuda").to(torch.bfloat16) for _ in range(4)]
        call = lambda i: router.route_fused(xs[i % 4], gates[i % len(gates)], bias, None, k, 1.0, True, 2.5)  # noqa
        on = {"CUDA_ROUTER": True, "CUDA_ROUTER_MAX_TOKENS": router.ROUTER_MAX_TOKENS}
        ids, w = switched(router, on, lambda: call(0))
        want_ids, want_w = router.route_ref(xs[0].double() @ gates[0].data.double().T, bias.double(), None, k, 1.0,
                                            True, 2.5)
        err = rel(w, want_w) if torch.equal(ids, want_ids) else float("inf")
        n = max(reps, min(len(gates), 128))
        us = {name: switched(router, sw, lambda: graph_us([lambda i=i: call(i) for i in range(n)]))
              for name, sw in (("default", on), ("Triton", {"CUDA_ROUTER": False}))}
        rows.append((f"router gate [{e}, {D}] + top-{k}", f"T={t}", us, e * D * 2 / bw * 1e6, err))
    return rows


def race_cells(tokens, reps, bw):
    rows = []
    vocab = 129280
    for t in tokens:
        ws = [torch.softmax(torch.randn(t, vocab, device="cuda"), -1) for _ in range(4)]
        seeds = torch.arange(t, device="cuda") * 7919 + 1
        pos = torch.arange(t, device="cuda") + 4096
        same = all(torch.equal(sampling.keyed_race(w, seeds, pos), sampling.keyed_race_ref(w, seeds, pos)) for w in ws)
        us = {"default": graph_us([lambda i=i: sampling.keyed_race(ws[i % 4], seeds, pos) for i in range(reps)]),
              "PyTorch": graph_us([lambda i=i: sampling.keyed_race_ref(ws[i % 4], seeds, pos) for i in range(reps)])}
        rows.append(("sampler keyed race, 129,280 columns", f"T={t}", us, t * vocab * 4 / bw * 1e6,
                     0.0 if same else float("inf")))
        xs = [torch.randn(t, vocab, device="cuda") * 3 for _ in range(4)]
        temp = torch.full((t,), 0.7, device="cuda")
        err = rel(softmax.softmax_rows(xs[0], temp), softmax.softmax_rows_ref(xs[0].double(), temp.double()))
        us = {"default": graph_us([lambda i=i: softmax.softmax_rows(xs[i % 4], temp) for i in range(reps)]),
              "PyTorch": graph_us([lambda i=i: softmax.softmax_rows_ref(xs[i % 4], temp) for i in range(reps)])}
        rows.append(("sampler softmax(x / T), 129,280 columns", f"T={t}", us, 2 * t * vocab * 4 / bw * 1e6, err))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,8,64")
    ap.add_argument("--reps", type=int, default=24)
    ap.add_argument("--ops", default="mhc,linear,race", help="which cells: mhc, linear, race, router")
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    print(torch.cuda.get_device_name(), flush=True)
    bw = copy_bandwidth()
    cells = {"mhc": mhc_cells, "linear": linear_cells, "race": race_cells, "router": router_cells}
    rows = [row for op in args.ops.split(",") for row in cells[op](tokens, args.reps, bw)]
    print(f"\ncopy bandwidth {bw / 1e9:,.0f} GB/s; µs per call (graph replay)")
    cols = list(dict.fromkeys(c for r in rows for c in r[2]))
    print("| op | tokens | floor µs | default / floor | rel. diff | " + "".join(f"{c} µs | " for c in cols))
    print("|---" * (5 + len(cols)) + "|")
    for name, cell, us, floor, err in rows:
        print(f"| {name} | {cell} | {floor:.1f} | {us['default'] / floor:.1f}× | {err:.1e} | "
              + "".join(f"{us[c]:.1f} | " if c in us else "— | " for c in cols))


if __name__ == "__main__":
    main()
