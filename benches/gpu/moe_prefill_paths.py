"""The MoE GEMM of a prefill chunk four ways (issue 17: "FP8 re-encode or bf16 grouped GEMM — measure both, keep
the faster"), over V4.1-Flash's 384 MXFP4 experts (``w13`` [4608, 5120], ``w2`` [5120, 2304]) at the pair counts of
2,048- and 8,192-token chunks (uniform top-6 routing), one call:

* **W4A16** — v41's path: :func:`v41.kernels.moe.grouped_linear_triton` at its default tiles (the FP4 → bf16
  upcast inside the GEMM; nothing is written but the output);
* **bf16** — the experts dequantized to bf16, then PyTorch's grouped GEMM (``torch._grouped_mm``, CUTLASS on
  SM90) over the pairs sorted by expert, each expert's rows padded to 16;
* **FP8** — the experts re-encoded to E4M3 with one scale per output row, the activations quantized per row, then
  ``torch._scaled_grouped_mm`` (FP8 tensor cores, bf16 output);
* **pipelined** — v41's prefill path :func:`v41.kernels.moe_prefill.grouped_dequant_mm`: chunks of experts
  dequantized to bf16 on a side stream (one Triton launch each) while the grouped bf16 GEMM runs the previous chunk,
  at ``--chunks`` experts per chunk; ``16:32`` also bounds each dequantization to 32 programs
  (``moe_prefill.DEQUANT_PROGRAMS``), leaving the other SMs to the GEMM.

For bf16 and FP8 the table gives the GEMM alone, the re-encode of the whole weight (bf16: the Triton
``dequant.dequantize_experts``; FP8: PyTorch, chunks of 32 experts), and the re-encode's bytes floor (MXFP4 read +
the new format written, over the copy bandwidth of the call) — a full-model deployment cannot keep a second copy
of the experts, so a chunk pays it every call. Rel. err is against float32 products of the dequantized weight (the
FP8 path also rounds the activations, which the others do not). Times: CUDA events, median of ``--reps``.

    python3 benches/gpu/moe_prefill_paths.py [--batches 2048,8192] [--reps 5] [--chunks 16,32,16:32]
"""

from __future__ import annotations

import argparse

import torch

from event_timing import median_ms
from moe_bench import SHAPES, TOP_K, bf16_rate, copy_bandwidth, expert_reference, mxfp4, rel_err, routings
from v41.kernels import moe_prefill
from v41.kernels.dequant import dequantize_experts
from v41.kernels.moe import grouped_config, grouped_linear_triton
from v41.kernels.packed import PackedWeight

E4M3_MAX = 448.0
CHUNK = 32  # experts per FP8 re-encode step


def fp8_chunks(w: PackedWeight, out: torch.Tensor | None = None,
               scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The [E, N, K] weight re-encoded to E4M3 with one float32 scale per row (PyTorch, CHUNK experts at a time)."""
    e, n, k = w.shape
    out = torch.empty(e, n, k, dtype=torch.float8_e4m3fn, device="cuda") if out is None else out
    scale = torch.empty(e, n, dtype=torch.float32, device="cuda") if scale is None else scale
    for a in range(0, e, CHUNK):
        part = PackedWeight(w.data[a:a + CHUNK], w.scale[a:a + CHUNK], "mxfp4", w.block).dequantize(torch.bfloat16)
        s = part.abs().amax(-1).float().clamp(min=1e-30) / E4M3_MAX
        scale[a:a + CHUNK] = s
        out[a:a + CHUNK] = (part.float() / s[..., None]).to(torch.float8_e4m3fn)
    return out, scale


def padded_layout(offsets: torch.Tensor, align: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """(destination row of each sorted pair, int32 end offset of each expert's padded group)."""
    counts = offsets[1:] - offsets[:-1]
    padded = (counts + align - 1) // align * align
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    expert = torch.repeat_interleave(torch.arange(counts.numel(), device=offsets.device), counts)
    within = torch.arange(int(offsets[-1]), device=offsets.device) - offsets[:-1][expert]
    return starts[expert] + within, ends.to(torch.int32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="2048,8192")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--chunks", default="16,32,16:32",
                    help="the pipelined path's cells: experts per chunk[:programs of its dequantization, 0 = a "
                         "program per tile]")
    a = ap.parse_args()
    experts, hidden, inter = SHAPES["v41"]
    torch.manual_seed(0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    bw, peak = copy_bandwidth(), bf16_rate()
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e9:.0f} GB/s, bf16 {peak / 1e12:.0f} TFLOP/s", flush=True)
    rows = []
    for name, w in (("w13", mxfp4(experts, 2 * inter, hidden)), ("w2", mxfp4(experts, hidden, inter))):
        e, n, k = w.shape
        w_bf = dequantize_experts(w, 0, e, torch.empty(e, n, k, dtype=torch.bfloat16, device="cuda"))
        w_f8, s_f8 = fp8_chunks(w)
        mx_bytes = w.data.numel() + w.scale.numel()
        for batch in [int(b) for b in a.batches.split(",")]:
            _, offsets, _ = routings(batch, experts, 1, gen)[0]
            pairs = batch * TOP_K
            x = torch.randn(pairs, k, device="cuda", dtype=torch.bfloat16)  # the pairs' rows, sorted by expert
            ref = expert_reference(x, w, offsets)
            flop = 2 * pairs * n * k
            cfg = grouped_config(pairs, w, x.dtype)
            cell = {"batch": batch, "weight": name}
            cell["w4a16"] = (median_ms(lambda: grouped_linear_triton(x, w, offsets, None, cfg), a.reps),
                             rel_err(grouped_linear_triton(x, w, offsets, None, cfg), ref))
            dest, ends = padded_layout(offsets)
            xp = torch.zeros(int(ends[-1]), k, device="cuda", dtype=torch.bfloat16)
            xp[dest] = x
            try:
                def bf16_gemm():
                    return torch._grouped_mm(xp, w_bf.transpose(-2, -1), offs=ends, out_dtype=torch.bfloat16)
                cell["bf16"] = (median_ms(bf16_gemm, a.reps), rel_err(bf16_gemm()[dest], ref))
            except (RuntimeError, AttributeError, TypeError) as exc:
                cell["bf16"] = (float("nan"), f"{type(exc).__name__}: {str(exc)[:80]}")
            try:
                sx = xp.abs().amax(-1).float().clamp(min=1e-30) / E4M3_MAX
                xq = (xp.float() / sx[:, None]).to(torch.float8_e4m3fn)

                def fp8_gemm():
                    return torch._scaled_grouped_mm(xq, w_f8.transpose(-2, -1), sx, s_f8, offs=ends,
                                                    out_dtype=torch.bfloat16)

                def quant_x():
                    s = xp.abs().amax(-1).float().clamp(min=1e-30) / E4M3_MAX
                    return (xp.float() / s[:, None]).to(torch.float8_e4m3fn)

                cell["fp8"] = (median_ms(fp8_gemm, a.reps), rel_err(fp8_gemm()[dest], ref))
                cell["fp8 act quant"] = median_ms(quant_x, a.reps)
            except (RuntimeError, AttributeError, TypeError) as exc:
                cell["fp8"] = (float("nan"), f"{type(exc).__name__}: {str(exc)[:80]}")
            for entry in [c for c in a.chunks.split(",") if c]:
                chunk, _, programs = entry.partition(":")

                def piped(chunk=int(chunk)):
                    return moe_prefill.grouped_dequant_mm(x, w, offsets, None, chunk=chunk)
                moe_prefill.DEQUANT_PROGRAMS = int(programs or 0)
                cell[f"pipelined {entry}"] = (median_ms(piped, a.reps), rel_err(piped(), ref))
                moe_prefill.DEQUANT_PROGRAMS = 0
            cell["flop"] = flop
            rows.append(cell)
            print(cell, flush=True)
        enc = {"bf16": median_ms(lambda: dequantize_experts(w, 0, e, w_bf), 3),
               "fp8": median_ms(lambda: fp8_chunks(w, w_f8, s_f8), 2)}
        floors = {"bf16": (mx_bytes + w_bf.numel() * 2) / bw * 1e3, "fp8": (mx_bytes + w_f8.numel() + s_f8.numel() * 4)
                  / bw * 1e3}
        for cell in rows:
            if cell["weight"] == name:
                cell["reencode"], cell["reencode_floor"] = enc, floors
        del w_bf, w_f8
        torch.cuda.empty_cache()
    print(f"\nMoE prefill GEMM paths ({torch.cuda.get_device_name()}; copy {bw / 1e9:.0f} GB/s, bf16 "
          f"{peak / 1e12:.0f} TFLOP/s), ms; TFLOP/s of the GEMM in brackets")
    chunks = [c for c in a.chunks.split(",") if c]
    print("| tokens | weight | W4A16 (Triton) | "
          + " | ".join(f"pipelined, {c.partition(':')[0]} experts per chunk"
                       + (f", dequant in {c.partition(':')[2]} programs" if c.partition(":")[2] else "")
                       for c in chunks)
          + " | bf16 grouped GEMM | bf16 dequant: Triton / floor | FP8 grouped GEMM | FP8 act. quant | FP8 re-encode: "
          "PyTorch / floor | rel. err W4A16 / pipelined / FP8 |")
    print("|---|---|---|" + "---|" * len(chunks) + "---|---|---|---|---|---|")

    def ms(v):
        return f"{v[0]:.2f} ({v[2] / v[0] / 1e9:.0f})" if v[0] == v[0] else "—"

    for c in rows:
        errs = " / ".join(f"{c[p][1]:.1e}" if isinstance(c[p][1], float) else c[p][1]
                          for p in ("w4a16", f"pipelined {chunks[0]}" if chunks else "bf16", "fp8"))
        piped = "".join(f"{ms((*c[f'pipelined {ch}'], c['flop']))} | " for ch in chunks)
        print(f"| {c['batch']} | {c['weight']} | {ms((*c['w4a16'], c['flop']))} | {piped}"
              f"{ms((*c['bf16'], c['flop']))} | "
              f"{c['reencode']['bf16']:.2f} / {c['reencode_floor']['bf16']:.2f} | {ms((*c['fp8'], c['flop']))} | "
              f"{c.get('fp8 act quant', float('nan')):.2f} | {c['reencode']['fp8']:.2f} / "
              f"{c['reencode_floor']['fp8']:.2f} | {errs} |")


if __name__ == "__main__":
    main()
