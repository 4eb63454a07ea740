"""Engram offload on one H200 (issue 16, docs/engram.md): flash-slice-v41's real layers 0, 1 and 14 (SWA, SWA +
Engram, CSA-2 + Engram: roles kept) with the Engram tables folded to --vocab rows per hash column (the default
5,424,000 makes 32.0 GiB per layer: beyond the TLB reach, as the real 101 GB), random weights in checkpoint formats,
CUDA graphs.

    python3 benches/gpu/engram_offload.py [--modes resident uva copy] [--vocab 5424000] [--out DIR]

One engine per mode, same weights (dummy tables are drawn by row block, so every mode reads the same rows):
``resident`` (tables on the device), ``uva`` and ``copy`` (tables in pinned host memory, transfer as named, default
hot cache). Per engine: the engine step at batch 1 and 64 decoding at context 128 (the lower of 2 medians of 200
steps; sampled random tokens:
every n-gram is new, so nearly every lookup misses — the worst case for the cache) and one 4,096-token prefill
chunk; the resident engine also times each layer alone (graph per layer) at batch 1 and 64. Exposed Engram time
= offload step − resident step; it is set against the two Engram layers' time per step (the target: ≤ 5 %).
Prints the environment, writes JSON to --out, the table last.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

from flash_slice import V41_FLASH_SLICE, ceilings, decode_headroom, v41_decode, v41_engine, v41_prefill
from layer_times import per_layer

SLICE = dict(V41_FLASH_SLICE, num_hidden_layers=3, compress_ratios=[0, 0, 2], kv_source_layer_ids=[2],
             index_source_layer_ids=[2], candidate_source_layer_id=2, engram_layer_ids=[1, 2])
CONTEXT, CHUNK, BATCHES = 128, 4096, (1, 64)
STEPS, REPEATS = 200, 2  # each decode cell: the lower of REPEATS medians of STEPS steps (±0.3 ms at B = 64 otherwise)


def run_mode(path: Path, mode: str, copy_gbps: float) -> dict:
    engram = None if mode == "resident" else {"cpu_offload": True, "transfer": mode}
    max_len = CHUNK + 64 + max(CONTEXT + decode_headroom(b, CONTEXT, CHUNK, steps=STEPS) for b in BATCHES)
    t = time.perf_counter()
    core = v41_engine(path, max(BATCHES), CHUNK, max_len, "auto", engram_config=engram)
    out = {"mode": mode, "load_s": time.perf_counter() - t, "gpu_GiB": torch.cuda.memory_allocated() / 2**30}
    pager = core.executor.runner.engram
    if pager is not None:
        out["host"] = {lid: {"shm": p.engram.host.path is not None, "pinned": p.records.is_pinned(),
                             "GiB": p.records.numel() / 2**30, "hot_rows": p.cache.hot_rows}
                       for lid, p in pager.layers.items()}
    print(mode, "ready:", json.dumps(out), flush=True)
    for batch in BATCHES:
        layers = {}

        def after(core, batch=batch):
            if mode == "resident":
                layers.update({r["what"]: r["ms"] for r in per_layer(core, batch, CONTEXT, copy_gbps)})

        before = core.stats().get("engram")
        out[f"decode{batch}"] = min(v41_decode(core, batch, CONTEXT, steps=STEPS, after=after if k == 0 else None)
                                    for k in range(REPEATS))
        if layers:
            out[f"layers{batch}"] = layers
        if pager is not None:
            s = core.stats()["engram"]
            out[f"hit{batch}"] = (s["hits"] - before["hits"]) / max(1, s["lookups"] - before["lookups"])
        print(mode, batch, out[f"decode{batch}"], flush=True)
    out["prefill_ms"] = 1e3 * CHUNK / v41_prefill(core, CHUNK)
    if pager is not None:
        out["engram"] = core.stats()["engram"]
    print(mode, "prefill", out["prefill_ms"], flush=True)
    del core, pager
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modes", nargs="+", default=["resident", "uva", "copy"])
    ap.add_argument("--vocab", type=int, default=5_424_000, help="engram_vocab_size (rows per hash column)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    a = ap.parse_args()
    import triton

    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "python": platform.python_version(), "commit": os.environ.get("V41_COMMIT", "?")}
    env.update(ceilings("cuda"))
    print("environment:", json.dumps(env), flush=True)
    from v41.testing.tiny import make_tiny

    path = make_tiny(Path(tempfile.mkdtemp()) / "engram-slice", "deepseek_v41", weights=False,
                     **dict(SLICE, engram_vocab_size=a.vocab))
    results = [run_mode(path, m, env["copy_GBps"]) for m in a.modes]
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "engram_offload.json").write_text(json.dumps({"env": env, "vocab": a.vocab, "results": results}))
    base = next((r for r in results if r["mode"] == "resident"), None)
    gib = 24 * a.vocab * 264 / 2**30
    print(f"\nEngram offload, flash-slice-v41 layers 0/1/14, tables {gib:.1f} GiB per layer ({env['gpu']}; "
          f"decode at context {CONTEXT}, random tokens)")
    print(f"{'mode':<10}{'cell':<14}{'step ms':>9}{'+ms':>8}{'engram layers ms':>18}{'+%':>7}{'hit':>6}")
    for r in results:
        for batch in BATCHES:
            eng = sum(v for k, v in (base or {}).get(f"layers{batch}", {}).items() if "+engram" in k)
            d = r[f"decode{batch}"] - base[f"decode{batch}"] if base else float("nan")
            hit = r.get(f"hit{batch}")
            print(f"{r['mode']:<10}{'decode B=' + str(batch):<14}{r[f'decode{batch}']:>9.3f}{d:>8.3f}{eng:>18.3f}"
                  f"{100 * d / eng if eng else float('nan'):>7.1f}{'' if hit is None else f'{hit:.2f}':>6}")
        d = r["prefill_ms"] - base["prefill_ms"] if base else float("nan")
        print(f"{r['mode']:<10}{'prefill 4096':<14}{r['prefill_ms']:>9.2f}{d:>8.2f}")


if __name__ == "__main__":
    main()
